"""AGREE (dgemma/data/tasks.py): one hidden choice per word that every digit of the word must agree on, so that
independent per-position choices (parallel commits) make invalid mixtures."""

import itertools

import numpy as np
import pytest

from dgemma.data.config import DataConfig, TaskConfig
from dgemma.data.rewards import TaskExample, agree_word_validity, bump_word, reward
from dgemma.data.tasks import SyntheticTask
from dgemma.data.tokenizer import DEFAULT_SYMBOLS, EOS_ID, ToyTokenizer

TOK = ToyTokenizer(DEFAULT_SYMBOLS + ("G",))


def test_every_alternative_is_valid_and_every_mixture_invalid():
    ex = TaskExample(task="agree", prompt="G391 29|", response="391 29", answer="391 29")
    words = ["391", "29"]
    for bumps in itertools.product((0, 1), repeat=2):  # all 2^#words alternatives
        out = " ".join(bump_word(w, b) for w, b in zip(words, bumps))
        assert reward(ex, out + "<eos>") == 1.0
        assert reward(ex, TOK.encode(out) + [EOS_ID], TOK) == 1.0
    assert bump_word("391", 1) == "402"  # 9 + 1 wraps to 0
    # a word mixing the two alternatives (some digits bumped, others not) is invalid, at every split
    for mask in itertools.product((0, 1), repeat=3):
        if 0 < sum(mask) < 3:
            mixed = "".join(str((int(d) + m) % 10) for d, m in zip("391", mask))
            assert reward(ex, f"{mixed} 29<eos>") == 0.0, mixed
    assert reward(ex, "391 39<eos>") == 0.0  # second word mixed
    assert reward(ex, "280 29<eos>") == 0.0  # one less is not a choice
    assert agree_word_validity(ex, "402 29<eos>") == 1.0 and agree_word_validity(ex, "401 29<eos>") == 0.5
    assert agree_word_validity(ex, "401 28<eos>") == 0.0 and agree_word_validity(ex, "40129<eos>") == 0.0
    assert agree_word_validity(ex, TOK.encode("391 39") + [EOS_ID], TOK) == 0.5
    assert reward(ex, "39129<eos>") == reward(ex, "391 29 1<eos>") == reward(ex, "391 2<eos>") == 0.0  # layout


def test_examples_are_alternatives_and_independent_digits_rarely_are():
    task = SyntheticTask(TaskConfig(name="agree", min_len=36, max_len=36, word_len=3))
    exs = [task.example(0, i) for i in range(64)]
    for e in exs:
        assert e.prompt == f"G{e.answer}|" and [len(w) for w in e.answer.split(" ")] == [3] * 12
        assert reward(e, e.response) == 1.0
    bumped = [sum(o != a for o, a in zip(e.response, e.answer)) for e in exs]
    assert 0 < np.mean(bumped) < 36 and all(b % 3 == 0 for b in bumped)  # whole words bump, about half of them
    # sampling each digit independently from the data's marginal (prompt digit or one more, 1/2 each) is valid only
    # when every word happens to agree: (2 * 2^-3)^12 per answer
    rng = np.random.default_rng(0)
    hits = 0
    for e in exs:
        out = "".join(c if c == " " else str((int(c) + int(rng.integers(0, 2))) % 10) for c in e.answer)
        hits += reward(e, out)
    assert hits == 0
    with pytest.raises(ValueError, match="TaskConfig.word_len"):
        TaskConfig(name="agree", word_len=0)
    with pytest.raises(ValueError, match=r"task 'agree' needs the symbols \['G'\]"):
        DataConfig(tasks=[{"name": "agree"}])
    one_word = SyntheticTask(TaskConfig(name="agree", min_len=5, max_len=5, word_len=99)).example(0, 0)
    assert " " not in one_word.answer  # word_len >= the length: one hidden choice for the whole answer


def test_two_digit_words_as_configs_toy_agree2_trains_them():
    """experiments/sdrl_study/configs/agree2.yaml: 24 digits in 12 two-digit words, each with one partner digit; the answer fits the
    canvas, and a factorised sampler (each digit its marginal) gets about half the words and almost never all 12."""
    from pathlib import Path

    from dgemma.config import load_config

    cfg = load_config(str(Path(__file__).resolve().parents[2] / "experiments/sdrl_study/configs/agree2.yaml"), [])
    (tc,) = [t for t in cfg.data.tasks if t.name == "agree"]
    assert (tc.word_len, tc.min_len, tc.max_len) == (2, 24, 24)
    task, tok = SyntheticTask(tc), ToyTokenizer(tuple(cfg.data.tokenizer.symbols))
    exs = [task.example(cfg.data.seed, i) for i in range(64)]
    rng = np.random.default_rng(1)
    word_valid, hits = [], 0
    for e in exs:
        assert [len(w) for w in e.answer.split(" ")] == [2] * 12 and reward(e, e.response) == 1.0
        assert len(tok.encode(e.response)) + 1 <= cfg.data.layout.n_blocks * cfg.model.canvas_length  # + EOS
        assert len(tok.encode(e.prompt)) + 1 <= cfg.data.layout.prompt_len  # + BOS
        for w_resp, w_ans in zip(e.response.split(" "), e.answer.split(" ")):  # whole words bump together
            assert w_resp in (w_ans, bump_word(w_ans, 1))
        out = "".join(c if c == " " else str((int(c) + int(rng.integers(0, 2))) % 10) for c in e.answer)
        word_valid.append(agree_word_validity(e, out + "<eos>"))
        hits += reward(e, out + "<eos>")
    assert 0.4 < np.mean(word_valid) < 0.6 and hits == 0  # 2 * 2^-2 per word; 0.5^12 per answer
    odd = SyntheticTask(TaskConfig(name="agree", min_len=5, max_len=5, word_len=2)).example(0, 0)
    assert [len(w) for w in odd.answer.split(" ")] == [2, 2, 1]  # the last word is shorter

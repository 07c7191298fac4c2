"""Synthetic verifiable tasks: determinism by (seed, index), correctness of the answers, binary rewards."""

import collections

import numpy as np
import pytest

from dgemma.data.config import TaskConfig
from dgemma.data.rewards import TaskExample, cut_at_eos, reward
from dgemma.data.tasks import MixtureSource, SyntheticTask, TaskSource
from dgemma.data.tokenizer import (BOS_ID, CHOICE_SYMBOLS, DEFAULT_SYMBOLS, EOS_ID, PAD_ID, TASK_TAGS, WILDCARD,
                                   ToyTokenizer)

TASKS = ("copy", "sort", "add", "mul", "perm")
TOK = ToyTokenizer()


def _corrupt(answer: str) -> str:
    """Changes the first digit (a different string for every task, including PERM's multiset)."""
    return str((int(answer[0]) + 1) % 10) + answer[1:]


@pytest.mark.parametrize("name", TASKS)
def test_generation_is_deterministic_by_seed_and_index(name):
    task = SyntheticTask(TaskConfig(name=name))
    a = [task.example(7, i) for i in range(50)]
    b = [SyntheticTask(TaskConfig(name=name)).example(7, i) for i in range(50)]
    assert a == b
    assert task.example(7, 3) == a[3]  # random access, order independent
    assert len({e.prompt for e in a}) > 40  # indices give different examples
    other_seed = [task.example(8, i) for i in range(50)]
    assert sum(x.prompt != y.prompt for x, y in zip(a, other_seed)) > 40
    assert all(e.index == i and e.task == name for i, e in enumerate(a))


@pytest.mark.parametrize("name", TASKS)
def test_reward_true_answer_is_one_and_corrupted_is_zero(name):
    task = SyntheticTask(TaskConfig(name=name))
    for i in range(20):
        ex = task.example(0, i)
        ids = TOK.encode(ex.response)
        # tokens: the answer, EOS, then a supervised tail / junk that must be ignored
        assert reward(ex, ids + [EOS_ID, EOS_ID, 7, 8, PAD_ID], TOK) == 1.0
        assert reward(ex, np.array(ids + [EOS_ID, 9, 9]), TOK) == 1.0
        assert task.reward(ex, ex.response + "<eos>123|<pad>") == 1.0  # text input
        bad = _corrupt(ex.response)
        assert reward(ex, TOK.encode(bad) + [EOS_ID], TOK) == 0.0
        assert reward(ex, bad + "<eos>", TOK) == 0.0
        assert reward(ex, ids[:-1] + [EOS_ID] + ids[-1:], TOK) == 0.0  # EOS too early: the rest is ignored
        assert reward(ex, ids + [PAD_ID, EOS_ID], TOK) == 0.0  # a pad before EOS is part of the answer
        assert reward(ex, ids + [3, EOS_ID], TOK) == 0.0  # extra token before EOS


def test_require_eos():
    ex = SyntheticTask(TaskConfig(name="copy")).example(0, 0)
    ids = TOK.encode(ex.response)
    assert reward(ex, ids) == 1.0
    assert reward(ex, ids, require_eos=True) == 0.0
    assert reward(ex, ids + [EOS_ID], require_eos=True) == 1.0
    assert cut_at_eos([5, 6, EOS_ID, 7]) == ([5, 6], True)
    assert cut_at_eos("12<eos>3") == ("12", True)


def test_copy_sort_perm_answers():
    for i in range(30):
        c = SyntheticTask(TaskConfig(name="copy", min_len=3, max_len=5)).example(1, i)
        s = SyntheticTask(TaskConfig(name="sort")).example(1, i)
        p = SyntheticTask(TaskConfig(name="perm")).example(1, i)
        assert c.prompt == f"C{c.response}|" and 3 <= len(c.response) <= 5 and c.response.isdigit()
        digits = s.prompt[1:-1]
        assert s.prompt[0] == "S" and s.response == "".join(sorted(digits)) and 4 <= len(digits) <= 12
        assert p.prompt[0] == "P" and p.answer == p.prompt[1:-1] and sorted(p.response) == sorted(p.answer)
    # PERM rewards any permutation, SORT only the sorted one
    p = TaskExample(task="perm", prompt="P3141|", response="1134", answer="3141")
    assert reward(p, "4311<eos>") == 1.0 and reward(p, "4331<eos>") == 0.0 and reward(p, "431<eos>") == 0.0
    s = TaskExample(task="sort", prompt="S3141|", response="1134", answer="1134")
    assert reward(s, "4311<eos>") == 0.0


@pytest.mark.parametrize("lsb_first", [True, False])
@pytest.mark.parametrize("name,op,fn", [("add", "+", lambda a, b: a + b), ("mul", "*", lambda a, b: a * b)])
def test_arithmetic_answers(name, op, fn, lsb_first):
    task = SyntheticTask(TaskConfig(name=name, lsb_first=lsb_first, min_digits=1, max_digits=4))
    rev = (lambda s: s[::-1]) if lsb_first else (lambda s: s)
    lengths = collections.Counter()
    for i in range(200):
        ex = task.example(3, i)
        assert ex.prompt[0] == name[0].upper() and ex.prompt.endswith("|")
        a_txt, b_txt = ex.prompt[1:-1].split(op)
        a, b = int(rev(a_txt)), int(rev(b_txt))
        assert ex.response == ex.answer == rev(str(fn(a, b)))
        assert task.parse_number(ex.answer) == fn(a, b)
        assert not rev(a_txt).startswith("0") or a == 0  # no leading zeros in the number
        lengths[len(a_txt)] += 1
    assert set(lengths) == {1, 2, 3, 4}  # operand lengths are spread over [min_digits, max_digits]


def test_digit_order_example():
    ex = TaskExample(task="add", prompt="A52+89|", response="321", answer="321")  # 25 + 98 = 123, LSB first
    assert reward(ex, "321<eos>") == 1.0 and reward(ex, "123<eos>") == 0.0


def test_task_source_random_access():
    src = TaskSource(TaskConfig(name="sort"), seed=5, num_examples=100)
    assert len(src) == 100 and src[42] == SyntheticTask(TaskConfig(name="sort")).example(5, 42)
    with pytest.raises(IndexError):
        src[100]
    with pytest.raises(IndexError):
        src[-1]


def test_mixture_weights_and_determinism():
    tasks = [TaskConfig(name="copy", weight=3.0), TaskConfig(name="add", weight=1.0)]
    mix = MixtureSource(tasks, seed=11, num_examples=10_000)
    draws = [mix[i] for i in range(2000)]
    frac_copy = np.mean([e.task == "copy" for e in draws])
    assert abs(frac_copy - 0.75) < 0.04
    assert draws == [MixtureSource(tasks, seed=11, num_examples=10_000)[i] for i in range(2000)]
    other = [MixtureSource(tasks, seed=12, num_examples=10_000)[i].task for i in range(200)]
    assert other != [e.task for e in draws[:200]]
    # example i of the mixture is example i of its task
    assert all(e == SyntheticTask(TaskConfig(name=e.task)).example(11, e.index) for e in draws[:50])
    with pytest.raises(IndexError):
        mix[10_000]


def test_task_tokens_fit_the_toy_vocab():
    mix = MixtureSource([TaskConfig(name=n) for n in TASKS], seed=0, num_examples=1000)
    reserved = set(TOK.reserved_ids) | {PAD_ID, EOS_ID, BOS_ID}
    for i in range(200):
        ex = mix[i]
        ids = TOK.encode(ex.prompt) + TOK.encode(ex.response)
        assert reserved.isdisjoint(ids)


def test_task_config_validation():
    with pytest.raises(ValueError, match="TaskConfig.name"):
        TaskConfig(name="div")
    with pytest.raises(ValueError, match="TaskConfig.max_len"):
        TaskConfig(name="copy", min_len=5, max_len=4)
    with pytest.raises(ValueError, match="TaskConfig.weight"):
        TaskConfig(name="copy", weight=0)
    with pytest.raises(ValueError, match="TaskConfig.max_digits"):
        TaskConfig(name="mul", max_digits=100)


# MARK: the many-answer tasks (pick, fill)

CHOICE_TOK = ToyTokenizer(symbols=DEFAULT_SYMBOLS + CHOICE_SYMBOLS, num_reserved=8)


@pytest.mark.parametrize("name", ["pick", "fill"])
def test_choice_tasks_are_deterministic_and_their_training_answers_are_rewarded(name):
    task = SyntheticTask(TaskConfig(name=name, min_len=20, max_len=20))
    a = [task.example(7, i) for i in range(40)]
    assert a == [SyntheticTask(TaskConfig(name=name, min_len=20, max_len=20)).example(7, i) for i in range(40)]
    for ex in a:
        assert ex.prompt[0] == TASK_TAGS[name] and ex.prompt.endswith("|") and ex.answer == ex.prompt[1:-1]
        ids = CHOICE_TOK.encode(ex.response)
        assert reward(ex, ids + [EOS_ID, 7, PAD_ID], CHOICE_TOK) == 1.0 and reward(ex, ex.response + "<eos>") == 1.0
        assert reward(ex, ids[:-1] + [EOS_ID], CHOICE_TOK) == 0.0  # one digit short
        assert reward(ex, ids + [ids[-1], EOS_ID], CHOICE_TOK) == 0.0  # one digit long
        assert reward(ex, ids + [PAD_ID, EOS_ID], CHOICE_TOK) == 0.0
    # the training answers really choose: both options of PICK and many digits per FILL wildcard occur
    if name == "pick":
        bumps = [(int(r) - int(p)) % 10 for ex in a for r, p in zip(ex.response, ex.answer)]
        assert set(bumps) == {0, 1} and 0.4 < np.mean(bumps) < 0.6
    else:
        free = [r for ex in a for r, p in zip(ex.response, ex.answer) if p == WILDCARD]
        assert 0.4 < len(free) / (40 * 20) < 0.6 and len(set(free)) == 10


def test_pick_and_fill_rewards_accept_every_valid_choice_and_nothing_else():
    pick = TaskExample(task="pick", prompt="K3919|", response="3910", answer="3919")
    assert reward(pick, "3919<eos>") == reward(pick, "4020<eos>") == reward(pick, "3010<eos>") == 1.0
    assert reward(pick, "2919<eos>") == 0.0  # one less is not a choice
    assert reward(pick, "3939<eos>") == 0.0 and reward(pick, "391<eos>") == 0.0 and reward(pick, "39190<eos>") == 0.0
    fill = TaskExample(task="fill", prompt="F3?1?|", response="3014", answer="3?1?")
    assert reward(fill, "3014<eos>") == reward(fill, "3919<eos>") == 1.0
    assert reward(fill, "3?1?<eos>") == 0.0  # the wildcard itself is not a digit
    assert reward(fill, "4014<eos>") == 0.0 and reward(fill, "301<eos>") == 0.0
    assert reward(fill, CHOICE_TOK.encode("3|14") + [EOS_ID], CHOICE_TOK) == 0.0


def test_choice_tasks_need_their_symbols_and_a_valid_wildcard_rate():
    ex = SyntheticTask(TaskConfig(name="fill", min_len=8, max_len=8, wildcard_rate=1.0)).example(0, 0)
    assert ex.answer == WILDCARD * 8
    assert SyntheticTask(TaskConfig(name="fill", wildcard_rate=0.0)).example(0, 0).answer.isdigit()
    with pytest.raises(ValueError, match="cannot encode 'F'"):
        TOK.encode(ex.prompt)  # the default vocabulary lacks the choice symbols: a config must append them
    from dgemma.data.config import DataConfig

    with pytest.raises(ValueError, match=r"tokenizer.symbols: task 'fill' needs the symbols \['F', '\?'\]"):
        DataConfig(tasks=[{"name": "copy"}, {"name": "fill"}])  # caught at config time, before any pipeline
    DataConfig(tasks=[{"name": "fill"}], tokenizer={"symbols": DEFAULT_SYMBOLS + CHOICE_SYMBOLS})
    for bad in (-0.1, 1.5, True, "half"):
        with pytest.raises(ValueError, match="wildcard_rate"):
            TaskConfig(name="fill", wildcard_rate=bad)

"""Diversity beside accuracy (dgemma/eval/diversity.py): the estimators on hand-built answer sets, the data's own
values (exact, and against the generator's samples), the collapse flag, and the evaluator path on a tiny model."""

import math

import jax
import numpy as np
import pytest
from flax import nnx

from dgemma.data.config import TaskConfig
from dgemma.data.rewards import TaskExample
from dgemma.data.tasks import SyntheticTask, answer_count, free_choices
from dgemma.data.tokenizer import CHOICE_SYMBOLS, DEFAULT_SYMBOLS, WILDCARD, ToyTokenizer
from dgemma.eval.diversity import (evaluate_diversity, expected_distinct, expected_plugin_entropy, measure,
                                   plugin_entropy, pool_models)

TOK = ToyTokenizer(symbols=DEFAULT_SYMBOLS + CHOICE_SYMBOLS)


def _fill(pattern):
    return TaskExample(task="fill", prompt=f"F{pattern}|", response="", answer=pattern)


def _pick(digits):
    return TaskExample(task="pick", prompt=f"K{digits}|", response="", answer=digits)


def test_plugin_entropy_and_its_exact_expectation():
    assert plugin_entropy(list("aaaa")) == 0.0
    assert plugin_entropy(list("0123456789")) == pytest.approx(math.log(10))
    assert plugin_entropy(list("aabb")) == pytest.approx(math.log(2))
    # two fair choices, 3 draws: counts (3,0) w.p. 1/4 -> 0, (2,1) w.p. 3/4 -> H(2/3, 1/3)
    h21 = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))
    assert expected_plugin_entropy({"a": 0.5, "b": 0.5}, 3) == pytest.approx(0.75 * h21)
    uniform10 = {str(d): 0.1 for d in range(10)}
    assert expected_plugin_entropy(uniform10, 1) == 0.0
    assert expected_plugin_entropy(uniform10, 2) == pytest.approx(0.9 * math.log(2))  # distinct w.p. 0.9
    assert expected_plugin_entropy(uniform10, 20000) == pytest.approx(math.log(10), abs=1e-3)  # bias vanishes
    rng = np.random.default_rng(0)  # the exact expectation against simulation at K = 4
    sims = [plugin_entropy(rng.integers(0, 10, 4).tolist()) for _ in range(20000)]
    assert expected_plugin_entropy(uniform10, 4) == pytest.approx(np.mean(sims), abs=0.01)
    assert expected_distinct(1, 5) == 1.0 and expected_distinct(2, 3) == pytest.approx(2 * (1 - 0.125))
    assert expected_distinct(10**30, 4) == pytest.approx(4.0)


def test_free_choices_and_answer_counts_follow_the_task_definitions():
    assert free_choices(_fill(f"3{WILDCARD}4{WILDCARD}")) == [(1, {str(d): 0.1 for d in range(10)}),
                                                              (3, {str(d): 0.1 for d in range(10)})]
    assert answer_count(_fill(f"3{WILDCARD}4{WILDCARD}")) == 100 and answer_count(_fill("34")) == 1
    assert free_choices(_pick("39")) == [(0, {"3": 0.5, "4": 0.5}), (1, {"9": 0.5, "0": 0.5})]
    agree = TaskExample(task="agree", prompt="", response="", answer="12 3")
    assert [j for j, _ in free_choices(agree)] == [0, 1, 3] and answer_count(agree) == 4
    perm = TaskExample(task="perm", prompt="", response="", answer="112")
    assert free_choices(perm)[0] == (0, {"1": 2 / 3, "2": 1 / 3}) and answer_count(perm) == 3
    for task in ("copy", "sort", "add", "mul"):
        assert free_choices(TaskExample(task=task, prompt="", response="", answer="12")) == []


def test_the_data_values_match_the_generators_own_samples():
    """The task generators' training responses, pooled: FILL's wildcard digits have entropy ln 10 and PICK's
    bumps rate 0.5, as `free_choices` says; each response is a valid answer of its prompt."""
    from dgemma.data.rewards import reward

    for name, want in (("fill", math.log(10)), ("pick", math.log(2))):
        task = SyntheticTask(TaskConfig(name=name, min_len=8, max_len=12))
        examples = [task.example(3, i) for i in range(400)]
        measured = measure(examples, [[e.response for e in examples]] * 2, TOK)[name]
        assert measured["entropy_pooled_data"] == pytest.approx(want)
        assert measured["entropy_pooled"] == pytest.approx(want, abs=0.01)  # ~3,000 samples of the generator
        assert measured["invalid_free"] == 0.0 and all(reward(e, e.response, TOK) == 1.0 for e in examples)
        if name == "pick":
            assert measured["plus_one_rate"] == pytest.approx(0.5, abs=0.03)


def test_identical_answers_have_no_diversity_and_collapse_while_data_like_answers_do_not():
    rng = np.random.default_rng(1)
    K = 6
    examples = [_fill(f"1{WILDCARD}{WILDCARD}2{WILDCARD}") for _ in range(40)]
    same = [["12222" for _ in examples]] * K  # every key: the wildcards all '2'
    m = measure(examples, same, TOK)["fill"]
    assert m["entropy_free"] == 0.0 and m["distinct"] == pytest.approx(1 / K) and m["collapse"]
    assert m["entropy_free_data"] == pytest.approx(expected_plugin_entropy({str(d): 0.1 for d in range(10)}, K))
    assert m["entropy_pooled"] == 0.0 and m["entropy_pooled_data"] == pytest.approx(math.log(10))
    assert m["distinct_data"] == pytest.approx(expected_distinct(1000, K) / K) and m["free_positions"] == 120
    uniform = [[f"1{a}{b}2{c}" for a, b, c in rng.integers(0, 10, (len(examples), 3))] for _ in range(K)]
    u = measure(examples, uniform, TOK)["fill"]
    lo, hi = u["entropy_free_ci"][1:]
    assert u["entropy_free_ci"][0] == pytest.approx(u["entropy_free"]) and lo < u["entropy_free"] < hi
    assert m["entropy_free_ci"] == (0.0, 0.0, 0.0)
    assert u["entropy_free"] == pytest.approx(u["entropy_free_data"], abs=0.1) and not u["collapse"]
    assert u["entropy_pooled"] == pytest.approx(math.log(10), abs=0.05) and u["distinct"] > 0.95
    # all ten digits once per position: the plug-in entropy is ln 10 exactly
    ten = [[f"1{d}{d}2{d}" for _ in examples] for d in range(10)]
    assert measure(examples, ten, TOK)["fill"]["entropy_free"] == pytest.approx(math.log(10))
    # the threshold is a named argument: a half-collapsed decoding (one of two bumps 90 %)
    picks = [_pick("1234") for _ in range(50)]
    skew = [["1234" if rng.random() < 0.9 else "2345" for _ in picks] for _ in range(K)]
    s = measure(picks, skew, TOK)
    assert not measure(picks, skew, TOK, collapse_ratio=0.2)["pick"]["collapse"]
    assert s["pick"]["collapse"] and s["pick"]["plus_one_rate"] == pytest.approx(0.1, abs=0.05)
    assert measure(picks, skew, TOK, collapse_ratio=0.2)["pick"]["collapse_ratio"] == 0.2
    # an invalid character at a free position counts as its own symbol and as invalid
    bad = measure(picks, [["1234"] * len(picks), ["9999"] * len(picks)], TOK)["pick"]
    assert bad["invalid_free"] == 0.5 and bad["entropy_free"] == pytest.approx(math.log(2))
    with pytest.raises(ValueError, match="need >= 2"):
        measure(picks, [["1234"] * len(picks)], TOK)
    ids = [TOK.encode("1234")] * len(picks)
    with pytest.raises(ValueError, match="pass the tokenizer"):
        measure(picks, [ids, ids])
    assert measure(picks, [ids, ids], TOK)["pick"]["entropy_free"] == 0.0  # ids decode through the tokenizer
    assert measure([TaskExample(task="copy", prompt="", response="", answer="1")], [["1"], ["2"]], TOK) == {}


def test_pooled_models_keep_each_models_spread_and_the_collapse_of_one():
    """An arm with one model per training seed: entropy over every model's positions (Σ / Σ), CI over models then
    prompts; a model that collapses alone is counted; two models that each collapse onto a different answer collapse
    (their answers differ between models, not across keys)."""
    rng = np.random.default_rng(3)
    K = 4
    examples = [_fill(f"1{WILDCARD}{WILDCARD}2{WILDCARD}") for _ in range(30)]
    uniform = measure(examples, [[f"1{a}{b}2{c}" for a, b, c in rng.integers(0, 10, (30, 3))] for _ in range(K)], TOK)
    same = measure(examples, [["12222"] * 30] * K, TOK)
    other = measure(examples, [["17772"] * 30] * K, TOK)
    both = pool_models([uniform, same])["fill"]
    assert both["entropy_free"] == pytest.approx(uniform["fill"]["entropy_free"] / 2)  # same positions, one at 0
    assert both["entropy_free_ci"][0] == both["entropy_free"] and both["models"] == 2 and both["keys"] == K
    assert both["entropy_free_ci"][1] < both["entropy_free"] < both["entropy_free_ci"][2]
    assert both["collapsed_models"] == 1  # half the data's entropy: the pooled flag follows the ratio
    assert both["collapse"] == (both["entropy_free"] < 0.5 * both["entropy_free_data"])
    assert not pool_models([uniform, same], collapse_ratio=0.4)["fill"]["collapse"]
    assert both["entropy_free_models"] == [uniform["fill"]["entropy_free"], 0.0]
    assert both["entropy_free_data"] == uniform["fill"]["entropy_free_data"]
    assert both["distinct"] == pytest.approx((uniform["fill"]["distinct"] + 1 / K) / 2)
    apart = pool_models([same, other])["fill"]
    assert apart["entropy_free"] == 0.0 and apart["collapse"] and apart["collapsed_models"] == 2
    alone = pool_models([uniform])["fill"]
    assert alone["entropy_free"] == pytest.approx(uniform["fill"]["entropy_free"])
    assert alone["entropy_free_ci"] == pytest.approx(uniform["fill"]["entropy_free_ci"])  # one model: measure's CI
    with pytest.raises(ValueError, match="different prompts or keys"):
        pool_models([uniform, measure(examples[:10], [["12222"] * 10] * K, TOK)])
    with pytest.raises(ValueError, match="different tasks"):
        pool_models([uniform, measure([_pick("1234")], [["1234"]] * K, TOK)])


def test_evaluate_diversity_decodes_through_the_evaluator_with_different_keys():
    from dgemma.data.config import LayoutConfig, DataConfig
    from dgemma.eval.evaluator import evaluate
    from dgemma.eval.frontier import sweep, table_md
    from dgemma.eval.heldout import build_held_out
    from dgemma.inference.sampler_types import SamplerConfig
    from dgemma.model.config import tiny
    from dgemma.model.transformer import Transformer

    data = DataConfig(tasks=(TaskConfig(name="fill", min_len=4, max_len=6),
                             TaskConfig(name="pick", min_len=4, max_len=6)),
                      layout=LayoutConfig(prompt_len=10, canvas_length=8, n_blocks=1), batch_size=8, num_threads=0,
                      tokenizer={"symbols": DEFAULT_SYMBOLS + CHOICE_SYMBOLS})
    held = build_held_out(data, n_per_task=4, batch_size=8, train_streams=[(data, 2)])
    model = Transformer(tiny(num_hidden_layers=2, layer_types=("sliding_attention", "full_attention")),
                        rngs=nnx.Rngs(0))
    base = SamplerConfig(max_steps=3, t_max=2.0, t_min=2.0)  # a random model at a high temperature: diverse
    out = evaluate_diversity(model, held, base, keys=3, key=jax.random.key(7))
    assert set(out["per_task"]) == {"fill", "pick"} and out["keys"] == 3 and len(out["evaluations"]) == 3
    outputs = [e["rows"]["output"] for e in out["evaluations"]]
    assert outputs[0] != outputs[1]  # the keys sample differently
    again = evaluate(model, held, base, ("diffusion",), key=jax.random.fold_in(jax.random.key(7), 1))
    assert again["diffusion"]["rows"]["output"] == outputs[1]  # key k is fold_in(key, k) through the evaluator
    for t, m in out["per_task"].items():
        assert m["prompts"] == 4 and 1 / 3 <= m["distinct"] <= 1.0 and 1 / 3 <= m["distinct_data"] <= 1.0
        assert 0.0 <= m["entropy_free"] <= math.log(3) + 1e-9 and 0.0 < m["entropy_free_data"] <= math.log(3)
        assert m["distinct"] > 1 / 3  # at temperature 2 a random model does not repeat itself
        assert isinstance(m["collapse"], bool)
    rows = sweep(model, held, base, [], seeds=(0, 1), diversity=True)
    assert set(rows[0]["diversity"]) == {"fill", "pick"} and rows[0]["diversity"]["fill"]["keys"] == 2
    md = table_md(rows).splitlines()
    assert "fill H/pos (data)" in md[0] and "pick distinct (data)" in md[0] and "collapse" in md[0]
    assert md[0].count("|") == md[1].count("|") == md[2].count("|")
    with pytest.raises(ValueError, match="keys = 1"):
        evaluate_diversity(model, held, base, keys=1)


def test_a_collapsed_row_says_so_in_the_frontier_table():
    from dgemma.eval.frontier import table_md

    def row(label, h, pooled):
        d = {"entropy_free": h, "entropy_free_data": 0.96, "entropy_pooled": pooled, "entropy_pooled_data": 2.30,
             "distinct": 1.0, "distinct_data": 1.0, "collapse": h < 0.5 * 0.96}
        return {"label": label, "exact_match": (1.0, 1.0, 1.0), "steps_per_block": (20.0, 20.0, 20.0),
                "tpf": (1.0, 1.0, 1.0), "pct_max_steps": 0.0, "diversity": {"fill": d}}

    md = table_md([row("default", 0.95, 2.28), row("fast", 0.10, 0.33)]).splitlines()
    assert "fill H pooled (data)" in md[0] and md[0].count("|") == md[1].count("|") == md[3].count("|")
    assert "| 0.95 (0.96) | 2.28 (2.30) | 1.00 (1.00) | no |" in md[2]
    assert "| 0.10 (0.96) | 0.33 (2.30) | 1.00 (1.00) | COLLAPSE: fill |" in md[3]

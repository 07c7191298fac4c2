"""The sampler frontier (dgemma/eval/frontier.py): Pareto-correct on given rows, the fair baseline row, the grid, and
a sweep on a tiny model through the one evaluator."""

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from dgemma.eval.frontier import (DIVERSITY_KEPT, best_keeping_diversity, best_sampler_only, grid, keeps_diversity,
                                  pareto_front, row_label, sweep, table_md, versus)


def _rows(points):
    return [{"steps_per_block": (x, x, x), "exact_match": (y, y, y), "label": str(i), "tpf": (1.0, 1.0, 1.0),
             "pct_max_steps": 0.0} for i, (x, y) in enumerate(points)]


def _dominated(p, q):  # q dominates p: no more steps, no less exact match, one strictly
    return q[0] <= p[0] and q[1] >= p[1] and (q[0] < p[0] or q[1] > p[1])


def test_pareto_front_is_exactly_the_non_dominated_rows_in_step_order():
    fixed = [(10.0, 1.0), (4.0, 0.9), (4.0, 0.95), (2.0, 0.5), (6.0, 0.95), (3.0, 0.95), (2.0, float("nan"))]
    assert pareto_front(_rows(fixed)) == [3, 5, 0]  # (4, 0.9) and (4, 0.95), (6, 0.95) lose to (3, 0.95)
    rng = np.random.default_rng(0)
    for _ in range(200):
        pts = [tuple(p) for p in np.round(rng.random((int(rng.integers(1, 12)), 2)) * [8, 1], 1)]
        front = pareto_front(_rows(pts))
        assert set(front) == {i for i, p in enumerate(pts) if not any(_dominated(p, q) for q in pts)}
        xs, ys = [pts[i][0] for i in front], [pts[i][1] for i in front]
        assert xs == sorted(xs) and ys == sorted(ys)  # monotone: more steps only for more exact match


def test_best_sampler_only_is_the_fewest_steps_within_one_point_of_the_default():
    rows = _rows([(20.0, 0.90), (5.0, 0.80), (8.0, 0.895), (9.0, 0.95), (8.0, 0.889), (3.0, 0.889999)])
    assert best_sampler_only(rows) == 2  # 0.895 >= 0.89; 0.889 and 0.889999 are more than 1 point below
    assert best_sampler_only(rows, tolerance=0.2) == 5
    assert best_sampler_only(_rows([(20.0, 0.5), (30.0, 0.9)])) == 0  # the default itself when nothing is faster
    md = table_md(rows)
    assert md.count("\n") == len(rows) + 1 and "best within 1 pt, frontier" in md.splitlines()[4]


def test_best_sampler_only_against_a_reference_from_another_model():
    arm = _rows([(10.0, 0.97), (6.0, 0.995), (4.0, 0.98)])
    assert best_sampler_only(arm) == 2  # within 1 point of its own default (0.97)
    assert best_sampler_only(arm, reference=1.0) == 1  # within 1 point of stage 1's 1.00: 0.98 is not
    assert best_sampler_only(arm, reference=1.0, tolerance=0.0) is None  # nothing reaches it


def _div_rows(points):
    """Rows (steps, EM, pick entropy ratio, fill entropy ratio) with the diversity `sweep(diversity=True)` writes."""
    rows = _rows([(x, y) for x, y, _, _ in points])
    for r, (_, _, pick, fill) in zip(rows, points):
        r["diversity"] = {"pick": {"entropy_free": 0.5 * pick, "entropy_free_data": 0.5},
                          "fill": {"entropy_free": 0.9 * fill, "entropy_free_data": 0.9}}
    return rows


def test_best_keeping_diversity_skips_collapsed_and_inaccurate_rows_and_breaks_ties():
    assert DIVERSITY_KEPT == 0.8
    rows = _div_rows([(23.0, 0.99, 0.93, 0.99),   # the default: keeps
                      (2.0, 1.00, 0.66, 0.50),    # fewest steps at full EM, but fill at half the data's
                      (4.0, 1.00, 0.79, 0.95),    # pick just under the bar
                      (8.0, 0.979, 0.90, 0.99),   # keeps, but more than 1 point under the default's EM
                      (9.0, 0.98, 0.82, 0.97),    # keeps, within 1 point: the answer
                      (12.0, 1.00, 0.90, 0.99)])  # keeps, slower
    assert best_sampler_only(rows) == 1  # exact match alone picks the collapsed row
    assert best_keeping_diversity(rows) == 4
    assert [keeps_diversity(r) for r in rows] == [True, False, False, True, True, True]
    assert best_keeping_diversity(rows, kept=0.78) == 2  # the bar is what excludes row 2
    assert best_keeping_diversity(rows, tolerance=0.02) == 3  # the EM bar is what excludes row 3
    assert best_keeping_diversity(rows, reference=1.0) == 5  # held to another model's exact match
    # ties on steps: the higher exact match, then the higher lowest entropy ratio, then the earlier row
    assert best_keeping_diversity(_div_rows([(20.0, 1.0, 1.0, 1.0), (5.0, 0.995, 0.9, 0.9),
                                             (5.0, 1.0, 0.85, 0.9)])) == 2
    assert best_keeping_diversity(_div_rows([(20.0, 1.0, 1.0, 1.0), (5.0, 1.0, 0.85, 0.95),
                                             (5.0, 1.0, 0.95, 0.9)])) == 2
    assert best_keeping_diversity(_div_rows([(20.0, 1.0, 1.0, 1.0), (5.0, 1.0, 0.9, 0.9),
                                             (5.0, 1.0, 0.9, 0.9)])) == 1
    # nothing keeps it (the default included): None, not a collapsed row
    assert best_keeping_diversity(_div_rows([(20.0, 1.0, 0.7, 1.0), (5.0, 1.0, 0.5, 0.5)])) is None
    nan = _div_rows([(20.0, 1.0, 1.0, 1.0), (5.0, 1.0, 1.0, 1.0)])
    nan[1]["diversity"]["fill"]["entropy_free"] = float("nan")  # an unmeasured entropy never passes
    assert best_keeping_diversity(nan) == 0


def test_best_keeping_diversity_refuses_rows_without_diversity_and_a_bad_fraction():
    rows = _div_rows([(20.0, 1.0, 1.0, 1.0), (5.0, 1.0, 1.0, 1.0)])
    del rows[1]["diversity"]
    with pytest.raises(ValueError, match=r"rows\[1\]\.diversity: missing"):
        best_keeping_diversity(rows)
    with pytest.raises(ValueError, match="kept = 1.5"):
        best_keeping_diversity(_div_rows([(20.0, 1.0, 1.0, 1.0)]), kept=1.5)


def test_versus_the_baseline_needs_disjoint_step_intervals_at_equal_exact_match():
    base = {"exact_match": (1.0, 1.0, 1.0), "steps_per_block": (8.0, 7.5, 8.5)}

    def row(em, spb):
        return {"exact_match": (em, em, em), "steps_per_block": spb}

    assert versus(row(0.995, (6.0, 5.0, 7.4)), base) == "fewer steps"
    assert versus(row(1.0, (6.0, 5.0, 7.5)), base) == "same steps (CIs overlap)"  # touching intervals are no claim
    assert versus(row(1.0, (9.0, 8.6, 9.4)), base) == "more steps"
    assert versus(row(0.985, (2.0, 1.5, 2.5)), base) == "EM below"  # faster, but more than 1 point less accurate
    assert versus(row(0.985, (2.0, 1.5, 2.5)), base, reference=0.99) == "fewer steps"


def test_plot_frontier_writes_a_png_on_either_axis(tmp_path):
    from dgemma.eval.frontier import plot_frontier

    rows = [dict(r, word_valid=list(r["exact_match"])) for r in _rows([(20.0, 0.9), (5.0, 0.8), (8.0, 0.9)])]
    for y in ("exact_match", "word_valid"):
        path = plot_frontier(rows, tmp_path / f"{y}.png", y=y)
        assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    # a NaN default row leaves no best row to mark: a TypeError that says so, and nothing is written
    with pytest.raises(TypeError, match="no best sampler-only row"):
        plot_frontier(_rows([(20.0, float("nan")), (5.0, 0.8)]), tmp_path / "nan.png")
    assert not (tmp_path / "nan.png").exists()


def test_grid_varies_each_rule_only_in_what_it_reads():
    g = grid(accept=("entropy_bound", "confidence", "fixed_count"), entropy_bound=(0.1, 1.0),
             accept_confidence=(0.5, 0.9), temperatures=((0.8, 0.4), (0.2, 0.1)), max_steps=(8, 16))
    assert len(g) == 2 * 2 * 2 + 2 * 2 * 2 + 2 * 2
    assert all(("entropy_bound" in s) == (s["accept"] == "entropy_bound") for s in g)
    assert all(("accept_confidence" in s) == (s["accept"] == "confidence") for s in g)
    assert len({row_label(s) for s in g}) == len(g) and row_label({}) == "default"
    assert row_label(g[0]) == "eb g=0.1 t=0.8>0.4 K=8 S=1 c=0.005"


def test_around_is_the_gamma_tau_product_then_one_axis_at_a_time_at_the_base():
    from dgemma.inference.sampler_types import SamplerConfig

    from dgemma.eval.frontier import around

    base = SamplerConfig()  # γ 0.1, τ 0.8 -> 0.4, K_max 48, S 1, c 0.005
    got = around(base, entropy_bound=(0.1, 1.5), temperatures=((0.8, 0.4), (0.2, 0.1)), max_steps=(8, 48),
                 stability_threshold=(0, 1), accept_confidence=(0.9,), fixed_count_steps=(4, 48))
    assert [row_label(s) for s in got] == [
        "eb g=0.1 t=0.2>0.1 K=48 S=1 c=0.005", "eb g=1.5 t=0.8>0.4 K=48 S=1 c=0.005",
        "eb g=1.5 t=0.2>0.1 K=48 S=1 c=0.005", "eb g=0.1 t=0.8>0.4 K=8 S=1 c=0.005",
        "eb g=0.1 t=0.8>0.4 K=48 S=0 c=0.005", "conf p=0.9 t=0.8>0.4 K=48 S=1 c=0.005",
        "fixed t=0.8>0.4 K=4 S=1 c=0.005", "fixed t=0.8>0.4 K=48 S=1 c=0.005"]  # the base (K 48, S 1) once: the default
    for s in got:  # each setting differs from the base in its own axis only
        changed = {k for k, v in s.items() if getattr(base, k) != v}
        assert changed in ({"entropy_bound"}, {"t_max", "t_min"}, {"entropy_bound", "t_max", "t_min"},
                           {"max_steps"}, {"stability_threshold"}, {"accept"}, {"accept", "max_steps"}), (s, changed)
    assert around(base) == [] and [row_label(s) for s in around(base.replace(greedy=True), max_steps=(8,))] == [
        "eb g=0.1 t=0.8>0.4 K=8 S=1 c=0.005 greedy"]  # the base's greedy carries into every row
    with pytest.raises(ValueError, match="around: base.accept = 'confidence'"):
        around(base.replace(accept="confidence"), max_steps=(8,))


def test_sweep_on_a_tiny_model_matches_the_evaluator_row_by_row():
    from dgemma.data.config import LayoutConfig, DataConfig, TaskConfig
    from dgemma.eval.evaluator import evaluate
    from dgemma.eval.heldout import build_held_out
    from dgemma.inference.sampler_types import SamplerConfig
    from dgemma.model.config import tiny
    from dgemma.model.transformer import Transformer

    data = DataConfig(tasks=(TaskConfig(name="copy", min_len=3, max_len=6),),
                      layout=LayoutConfig(prompt_len=10, canvas_length=8, n_blocks=1), batch_size=4,
                      num_threads=0)
    held = build_held_out(data, n_per_task=4, batch_size=4, train_streams=[(data, 2)])
    model = Transformer(tiny(num_hidden_layers=2, layer_types=("sliding_attention", "full_attention")),
                        rngs=nnx.Rngs(0))
    base = SamplerConfig(max_steps=3)
    settings = grid(entropy_bound=(5.0,), max_steps=(3,)) + grid(accept=("fixed_count",), max_steps=(1,))
    seen = []
    from dgemma.data.rewards import reward

    rows = sweep(model, held, base, settings, seeds=(0, 1), progress=seen.append,
                 row_metrics={"rescored": lambda ex, out, tok: reward(ex, out, tok)})
    assert all(r["rescored"] == r["exact_match"] for r in rows)  # each output scored against its own example
    assert [r["label"] for r in rows] == ["default", *map(row_label, settings)] and seen == rows
    for r, change in zip(rows, [{}, *settings]):
        assert r["settings"] == change and r["seeds"] == [0, 1] and r["n"] == 4 and list(r["per_task"]) == ["copy"]
        assert r["exact_match"][1] <= r["exact_match"][0] <= r["exact_match"][2]
        assert r["text"].startswith("diffusion: EB sampler")
    # the row of gamma 5 is the evaluator's decoding of that setting with the sampler keys 1000 + seed
    per_seed = [evaluate(model, held, base.replace(**settings[0]), ("diffusion",), key=jax.random.key(1000 + s))
                ["diffusion"]["metrics"] for s in (0, 1)]
    assert rows[1]["exact_match"][0] == pytest.approx(np.mean([m["exact_match"] for m in per_seed]))
    assert rows[1]["tpf"][0] == pytest.approx(sum(m["tokens"] for m in per_seed) / sum(m["forwards"] for m in per_seed))
    assert rows[1]["steps_per_block"][0] == pytest.approx(np.mean([m["steps_per_block"] for m in per_seed]))
    assert "gamma = 5.0" in rows[1]["text"] and "gamma = 0.1" in rows[0]["text"]
    assert rows[-1]["steps_per_block"][0] == 1.0  # K_max 1: one decoder step per block
    assert 1.0 <= rows[0]["steps_per_block"][0] <= 3.0
    with pytest.raises(ValueError, match=r"sweep: settings \['gamma'\] are not SamplerConfig fields"):
        sweep(model, held, base, [{"gamma": 1.0}], seeds=(0,), include_default=False)
    assert dataclasses.asdict(base) == dataclasses.asdict(SamplerConfig(max_steps=3))  # the base is not changed


def test_frontier_script_refuses_a_missing_checkpoint_and_a_used_out_in_one_line(tmp_path):
    """Bad input is refused before any work, and an --out that already holds files is never overwritten."""
    import subprocess
    import sys

    script = [sys.executable, "experiments/sdrl_study/frontier.py", "--config", "experiments/sdrl_study/configs/agree.yaml"]
    repo = Path(__file__).resolve().parents[2]
    used = tmp_path / "used"
    used.mkdir()
    (used / "frontier.json").write_text("keep")
    for args, says in ((["--checkpoint", str(tmp_path / "missing"), "--out", str(tmp_path / "new")], "--checkpoint"),
                       (["--checkpoint", "experiments/sdrl_study/checkpoint/stage1_agree", "--out", str(used)],
                        "--out"),
                       (["--checkpoint", *["experiments/sdrl_study/checkpoint/stage1_agree"] * 2, "--seeds", "0", "1",
                         "2", "--out", str(tmp_path / "new")], "2 --checkpoint directories for 3 --seeds")):
        proc = subprocess.run([*script, *args], cwd=repo, capture_output=True, text=True, timeout=300)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], proc.stderr[-2000:]
    assert (used / "frontier.json").read_text() == "keep" and not (tmp_path / "new").exists()


def test_sweep_with_one_model_per_seed_decodes_each_seed_with_its_model_and_measures_diversity_per_model():
    """A trained arm: seed s's row entries come from model s at key 1000 + s, and its diversity is each model's
    spread over its own keys (fold_in(key 1000 + s, k)), pooled over the models."""
    from dgemma.data.config import LayoutConfig, DataConfig, TaskConfig
    from dgemma.data.tokenizer import CHOICE_SYMBOLS, DEFAULT_SYMBOLS
    from dgemma.eval.diversity import measure_rows, pool_models
    from dgemma.eval.evaluator import evaluate
    from dgemma.eval.heldout import build_held_out
    from dgemma.inference.sampler_types import SamplerConfig
    from dgemma.model.config import tiny
    from dgemma.model.transformer import Transformer

    data = DataConfig(tasks=(TaskConfig(name="pick", min_len=4, max_len=6),),
                      layout=LayoutConfig(prompt_len=10, canvas_length=8, n_blocks=1), batch_size=4, num_threads=0,
                      tokenizer={"symbols": DEFAULT_SYMBOLS + CHOICE_SYMBOLS})
    held = build_held_out(data, n_per_task=4, batch_size=4, train_streams=[(data, 2)])
    cfg = tiny(num_hidden_layers=2, layer_types=("sliding_attention", "full_attention"))
    models = [Transformer(cfg, rngs=nnx.Rngs(i)) for i in (0, 1)]
    base = SamplerConfig(max_steps=3, t_max=2.0, t_min=2.0)
    row = sweep(models, held, base, [], seeds=(3, 4), diversity=True, diversity_keys=3)[0]

    def decode(model, key):
        return evaluate(model, held, base, ("diffusion",), key=key)["diffusion"]

    own = [decode(m, jax.random.key(1000 + s)) for m, s in zip(models, (3, 4))]
    assert row["exact_match"][0] == pytest.approx(np.mean([e["metrics"]["exact_match"] for e in own]))
    assert row["steps_per_block"][0] == pytest.approx(np.mean([e["metrics"]["steps_per_block"] for e in own]))
    per_model = [measure_rows(held, [e["rows"], *(decode(m, jax.random.fold_in(jax.random.key(1000 + s), k))["rows"]
                                                  for k in (1, 2))]) for m, s, e in zip(models, (3, 4), own)]
    want = pool_models(per_model)["pick"]
    got = row["diversity"]["pick"]
    assert got["keys"] == 3 and got["models"] == 2 and got["entropy_free"] == pytest.approx(want["entropy_free"])
    assert got["entropy_free_models"] == pytest.approx([m["pick"]["entropy_free"] for m in per_model])
    # not the spread between the models: their answers under one key each are another measure
    assert got["entropy_free_models"] != pytest.approx([measure_rows(held, [e["rows"] for e in own])["pick"]
                                                        ["entropy_free"]] * 2)
    with pytest.raises(ValueError, match="2 models for 3 seeds"):
        sweep(models, held, base, [], seeds=(0, 1, 2))
    with pytest.raises(ValueError, match="diversity_keys = 1"):
        sweep(models, held, base, [], seeds=(0, 1), diversity=True, diversity_keys=1)

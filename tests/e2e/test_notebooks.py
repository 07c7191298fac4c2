"""Notebooks are jupytext percent scripts, executed here as real notebooks (jupytext -> nbformat -> nbclient, one
Jupyter kernel per notebook), so what is checked is what a reader sees: every code cell runs in order in a kernel,
no cell raises, and the notebook shows results (stream / display outputs). Tiny preset, CPU.

Needs the `notebooks` extra (jupytext, nbclient, ipykernel); `.ci/run` installs it.
"""

from pathlib import Path

import signal

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.py"))


# Every notebook runs here at its own defaults, as a reader opens it, except where CI_ENV names a reduced budget. The
# sampler-frontier notebook's default is the recorded full sweep (~3 min); here it runs at DGEMMA_FRONTIER_BUDGET=ci
# (~1 min: 4 prompts per task, 2 seeds, 2 settings, K_max 8) and its written table is checked (CHECKS).
# The SD·RL study notebook's default is the reduced study (1 seed, copy + sort, 4 iterations from the shipped copy/sort
# stage-1 checkpoint, 12 held-out prompts per task) and asserts the direction of change on copy: fewer steps per
# block, EM within 5 points (~3 min on the 2-core CI runner). `DGEMMA_SDRL_REGIME=choice` runs the many-answer regime
# (pick + fill) instead. `DGEMMA_SDRL_BUDGET=smoke` runs the same cells at a smoke budget (plumbing only).
# The stage-2 arms notebook's default trains 2 arms x 3 seeds from the shipped stage1_choice checkpoint and sweeps
# every model's frontier over the whole sampler grid (811-1265 s on the shared 2 cores); here it runs at
# DGEMMA_ARMS_BUDGET=ci (~1-1.5 min, mostly the SD·RL update's compile: a one-layer untrained stand-in, 2 seeds, 1
# iteration, 4 prompts per task, 3 settings) and its written table is checked (CHECKS).
# The stage-1 ablations notebook's default trains 6 recipe variants x 3 seeds from the shipped stage-0 AR checkpoint;
# here it runs at DGEMMA_STAGE1_ABLATIONS_BUDGET=ci (a one-layer untrained stand-in, 3 variants, 2 seeds, 2 steps, 4
# prompts per task, K_max 4; mostly compiling) and its written table is checked (CHECKS).
CI_ENV = {"sampler_frontier": {"DGEMMA_FRONTIER_BUDGET": "ci"}, "sdrl_arms": {"DGEMMA_ARMS_BUDGET": "ci"},
          "stage1_ablations": {"DGEMMA_STAGE1_ABLATIONS_BUDGET": "ci"}}
# The default suite (kept under 15 min on 2 cores) runs the quickstart, the sampler frontier at its CI budget and the
# SD·RL study notebook at its smoke budget (every cell, plumbing only); the notebooks whose CI runs take 25-110 s
# (the study's reduced default, the arms, the stage-1 ablations, the LoRA study) are `slow`: their study code is
# tested in tests/studies.
SLOW_NOTEBOOKS = {"sdrl_study", "sdrl_arms", "stage1_ablations", "lora_study"}
PARAMS = [pytest.param(p, CI_ENV.get(p.stem, {}), id=p.stem,
                       marks=[pytest.mark.slow] if p.stem in SLOW_NOTEBOOKS else []) for p in NOTEBOOKS] + [
    pytest.param(REPO / "notebooks" / "sdrl_study.py", {"DGEMMA_SDRL_BUDGET": "smoke"}, id="sdrl_study-smoke")]


@pytest.mark.parametrize("path, env", PARAMS)
def test_notebook_executes(path, env, tmp_path, monkeypatch):
    jupytext = pytest.importorskip("jupytext", reason="notebooks extra (jupytext, nbclient, ipykernel)")
    nbclient = pytest.importorskip("nbclient", reason="notebooks extra (jupytext, nbclient, ipykernel)")
    import nbformat

    nb = jupytext.read(path)
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    assert code_cells, f"{path.name}: no code cells (is it a jupytext percent script?)"
    # The kernel inherits this process's environment (XLA_FLAGS, JAX_PLATFORMS, the session's compilation cache, the
    # budget above) and runs from the repository root, as the script version did (notebooks name configs by path).
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # what the notebook writes to a temp dir goes with the test's tmp_path
    client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                     resources={"metadata": {"path": str(REPO)}})
    # The kernel manager installs Python's default SIGINT handler in this process; a run started in the background
    # (SIGINT ignored, as `cmd &` does) would otherwise see its handler changed by this test.
    sigint = signal.getsignal(signal.SIGINT)
    try:
        client.execute()  # raises CellExecutionError naming the cell on any error
    finally:
        signal.signal(signal.SIGINT, sigint)
    nbformat.write(nb, tmp_path / f"{path.stem}.ipynb")  # the executed notebook, outputs included
    outputs = [o for c in code_cells for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert [o for o in outputs if o.output_type in ("stream", "display_data", "execute_result")], (
        f"{path.name}: a notebook should show its results")
    if path.stem in CHECKS:
        CHECKS[path.stem](tmp_path, outputs)


def check_sampler_frontier(tmp_path, outputs):
    """At the ci budget: one row per setting (the default and γ 1.5 at τ 0.2 -> 0.1), each with finite means inside
    their CIs, steps per block within [1, K_max], exact match within [0, 1] and the diversity of both many-answer
    tasks; the frontier plots written as PNGs and shown."""
    import json
    import math

    written = sorted(tmp_path.glob("sampler_frontier_*/frontier.json"))
    assert len(written) == 1, f"the notebook writes one frontier.json under its temp dir, found {written}"
    res = json.loads(written[0].read_text())
    rows, kmax = res["rows"], res["kmax"]
    assert res["budget"] == "ci" and kmax == 8 and res["seeds"] == [0, 1]
    assert [r["label"] for r in rows] == ["default", "eb g=1.5 t=0.2>0.1 K=8 S=1 c=0.005"]
    for r in rows:
        em, spb = r["exact_match"], r["steps_per_block"]
        assert all(map(math.isfinite, (*em, *spb))), r["label"]
        assert 0.0 <= em[1] <= em[0] <= em[2] <= 1.0, (r["label"], em)
        assert 1.0 <= spb[1] <= spb[0] <= spb[2] <= kmax, (r["label"], spb)
        assert r["n"] == 8 and r["seeds"] == [0, 1] and set(r["per_task"]) == {"pick", "fill"}
        assert {t: d["keys"] for t, d in r["diversity"].items()} == {"pick": 2, "fill": 2}
    assert 0 <= res["best_sampler_only"] < len(rows) and res["frontier"]
    for png in (written[0].parent / "frontier.png", written[0].parent / "frontier_tasks.png"):
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{png}: no PNG written"
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 2, "both plots are shown in the notebook"


def check_sdrl_arms(tmp_path, outputs):
    """At the ci budget: arms.json holds stage 1's and both arms' frontiers (one row per setting, 2 seeds, 8 prompts),
    the summary rows (stage 1's default, its best sampler-only row by exact match and the one that keeps the data's
    diversity, each arm's default and its own best point by each rule) with finite means inside their CIs, each row's
    diversity of pick and fill against the data's (an arm: 2 models x 2 keys each), both baselines, each comparison
    and each diversity verdict as the library computes them from the written rows, and both plots written and
    shown."""
    import json
    import math

    from dgemma.eval.frontier import DIVERSITY_KEPT, best_keeping_diversity, best_sampler_only, keeps_diversity, versus

    written = sorted(tmp_path.glob("sdrl_arms_*/arms.json"))
    assert len(written) == 1, f"the notebook writes one arms.json under its temp dir, found {written}"
    res = json.loads(written[0].read_text())
    assert res["budget"] == "ci" and res["seeds"] == [0, 1] and res["kmax"] == 4 and res["diversity_keys"] == 2
    assert set(res["arms"]) == {"state_argmax_agree", "verified"}
    groups = ["stage 1", *res["arms"].values()]
    assert list(res["rows"]) == groups, list(res["rows"])
    for g in groups:
        assert [r["label"] for r in res["rows"][g]] == ["default", "eb g=1.5 t=0.2>0.1 K=4 S=1 c=0.005",
                                                         "fixed t=0.8>0.4 K=2 S=1 c=0.005"], g
        assert all(r["seeds"] == [0, 1] and r["n"] == 8 for r in res["rows"][g]), g
    s1 = res["rows"]["stage 1"]
    assert res["best"]["stage 1"] == best_sampler_only(s1) and res["diversity_kept_fraction"] == DIVERSITY_KEPT
    assert res["best_keeping_diversity"]["stage 1"] == best_keeping_diversity(s1)
    ref = s1[0]["exact_match"][0]
    want = ["stage 1: default sampler", "stage 1: best sampler-only"] + (
        ["stage 1: best sampler-only keeping diversity"] if res["best_keeping_diversity"]["stage 1"] is not None else [])
    for name in res["arms"].values():
        assert res["best"][name] == best_sampler_only(res["rows"][name], reference=ref), name
        assert res["best_keeping_diversity"][name] == best_keeping_diversity(res["rows"][name], reference=ref), name
        want += [f"{name}: default sampler"] + [f"{name}: {what}" for rule, what in (
            ("best", "own best frontier point"), ("best_keeping_diversity", "own best point keeping diversity"))
            if res[rule][name] is not None]
    assert [t["row"] for t in res["table"]] == want
    baseline = s1[res["best"]["stage 1"]]
    i_div = res["best_keeping_diversity"]["stage 1"]
    baseline_div = None if i_div is None else s1[i_div]
    for t in res["table"]:
        em, spb = t["exact_match"], t["steps_per_block"]
        assert all(map(math.isfinite, (*em, *spb))), t["row"]
        assert 0.0 <= em[1] <= em[0] <= em[2] <= 1.0 and 1.0 <= spb[1] <= spb[0] <= spb[2] <= 4, (t["row"], em, spb)
        assert em == res["rows"][t["group"]][t["index"]]["exact_match"], t["row"]
        row = res["rows"][t["group"]][t["index"]]
        assert t["keeps_diversity"] == keeps_diversity(row), t["row"]
        if t["group"] != "stage 1":
            assert t["vs_baseline"] == versus(row, baseline, reference=ref), t["row"]
            assert t["vs_diversity_baseline"] == ("- (no baseline)" if baseline_div is None else
                                                  versus(row, baseline_div, reference=ref)), t["row"]
        assert set(t["diversity"]) == {"pick", "fill"}, t["row"]
        for task, d in t["diversity"].items():
            lo, mid, hi = d["entropy_free_ci"][1], d["entropy_free"], d["entropy_free_ci"][2]
            assert d["keys"] == 2 and 0.0 <= lo <= mid <= hi <= math.log(2) + 1e-9, (t["row"], task, d)
            assert d.get("models", 1) == (1 if t["group"] == "stage 1" else 2), (t["row"], task)
            assert d["collapse"] == (mid < 0.5 * d["entropy_free_data"]), (t["row"], task)
            assert (task in t["collapsed"]) == d["collapse"], (t["row"], task)
    lines = res["verdict"].splitlines()
    assert lines[0].startswith("EM-only baseline: " + baseline["label"]) and lines[1].startswith(
        "diversity-keeping baseline") and [ln.split(":")[0] for ln in lines[2:]] == list(res["arms"].values())
    assert res["table_md"].count("\n") == len(want) + 1
    for png in (written[0].parent / "frontiers.png", written[0].parent / "diversity.png"):
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{png}: no PNG written"
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 2, "both plots are shown in the notebook"


def check_stage1_ablations(tmp_path, outputs):
    """At the ci budget: ablations.json holds one row per variant run (default, self-cond off, canvas 16; in that
    order, with their overrides), each with finite diffusion / AR exact match, steps per block, tokens per forward
    and final losses inside their CIs over 2 seeds x 12 held-out prompts, per-task rows of add / copy / sort, the
    comparison with the default as its CIs say, both seeds' mean training curves, a held-out set disjoint from
    training, and the plot written and shown."""
    import json
    import math

    written = sorted(tmp_path.glob("stage1_ablations_*/ablations.json"))
    assert len(written) == 1, f"the notebook writes one ablations.json under its temp dir, found {written}"
    res = json.loads(written[0].read_text())
    assert res["budget"] == "ci" and res["seeds"] == [0, 1] and res["steps"] == 2 and res["kmax"] == 4
    assert res["variants"] == {"default": [], "self-cond off": ["diffusion.p_self_cond=0"],
                               "canvas 16": ["model.canvas_length=16", "data.layout.n_blocks=1"]}
    assert res["held_out"].endswith("overlap with the training stream: 0") and "K_max = 4" in res["decoding"]["diffusion"]
    rows = res["rows"]
    assert [r["variant"] for r in rows] == list(res["variants"])
    base = rows[0]
    for r in rows:
        for key in ("exact_match", "ar_exact_match", "steps_per_block", "tpf", "loss", "loss_diffusion", "loss_ar"):
            m, lo, hi = r[key]
            assert all(map(math.isfinite, (m, lo, hi))) and lo <= m <= hi, (r["variant"], key, r[key])
        for key in ("exact_match", "ar_exact_match"):
            assert 0.0 <= r[key][1] and r[key][2] <= 1.0, (r["variant"], key)
            (_, lo, hi), (_, b_lo, b_hi) = r[key], base[key]
            assert r["vs_default"][key] == ("higher" if lo > b_hi else "lower" if hi < b_lo else "CIs overlap")
        assert 1.0 <= r["steps_per_block"][1] and r["steps_per_block"][2] <= 4, (r["variant"], r["steps_per_block"])
        assert r["n"] == 2 * 12 and set(r["per_task"]) == {"add", "copy", "sort"}, r["variant"]
        curves = res["curves"][r["variant"]]
        assert all(len(c) == 2 and all(map(math.isfinite, c)) for c in curves.values()), r["variant"]
    assert res["table_md"].count("\n") == len(rows) + 1 and res["wall_s"] > 0
    png = written[0].parent / "ablations.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{png}: no PNG written"
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 1, "the plot is shown in the notebook"


CHECKS = {"sampler_frontier": check_sampler_frontier, "sdrl_arms": check_sdrl_arms,
          "stage1_ablations": check_stage1_ablations}  # per-notebook checks of what the executed notebook wrote

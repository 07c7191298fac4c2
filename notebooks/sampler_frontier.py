# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # The sampler frontier: how far does the sampler alone go, with no training?
#
# A step-distillation (SD·RL) claim is a claim against the best *sampler-only* setting of the same checkpoint: other
# entropy bounds γ, other temperatures, no training. This notebook decodes held-out prompts with the many-answer
# stage-1 checkpoint that ships with the repository (`experiments/sdrl_study/checkpoint/stage1_choice`, config
# `experiments/sdrl_study/configs/choice.yaml`, tasks PICK and FILL) under each sampler setting, 3 seeds (sampler key 1000 + seed),
# through the library (`dgemma.eval.frontier`: `grid`, `sweep`, `pareto_front`, `best_sampler_only`, `table_md`,
# `plot_frontier`; the diversity of the answers over the seeds' keys through `dgemma.eval.diversity`).
# `experiments/sdrl_study/frontier.py` is the command line over the same functions.
#
# `DGEMMA_FRONTIER_BUDGET` chooses the budget:
#
# * `full` (default, ~3 min on 2 shared CPU cores): the recorded "Fair baseline" run of
#   `experiments/sdrl_study/results.md` (24 held-out prompts per task, seeds 0 1 2, γ ∈ {0.1, 1.5} × τ ∈ {0.8 → 0.4,
#   0.2 → 0.1}, K_max 48), set beside the recorded table.
# * `ci` (~1 min, run by `tests/e2e/test_notebooks.py`): the same cells at 4 prompts per task, 2 seeds, the default and
#   one other setting, K_max 8 (plumbing only: the numbers mean nothing at that budget).

# %%
import dataclasses
import json
import math
import os
import re
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # figures are written to files and displayed from them
import matplotlib.pyplot as plt

from dgemma.config import load_config
from dgemma.eval import plots
from dgemma.eval.frontier import best_sampler_only, grid, pareto_front, plot_frontier, row_label, sweep, table_md
from dgemma.eval.heldout import build_held_out
from dgemma.inference.sampler_types import SamplerConfig
from dgemma.train.study import restore

ROOT = Path.cwd()
while not (ROOT / "experiments" / "sdrl_study").is_dir() and ROOT != ROOT.parent:
    ROOT = ROOT.parent
CHECKPOINT = ROOT / "experiments" / "sdrl_study" / "checkpoint" / "stage1_choice"
CONFIG = ROOT / "experiments" / "sdrl_study" / "configs" / "choice.yaml"
RECORDED = ROOT / "experiments" / "sdrl_study" / "results.md"
TASKS = ("pick", "fill")

BUDGET = os.environ.get("DGEMMA_FRONTIER_BUDGET", "full")
if BUDGET not in ("full", "ci"):
    raise ValueError(f"DGEMMA_FRONTIER_BUDGET={BUDGET}: expected full or ci")
if not CHECKPOINT.is_dir():
    raise FileNotFoundError(f"{CHECKPOINT}: the shipped stage-1 checkpoint is missing")
if BUDGET == "full":  # the recorded run (results.md, "Fair baseline")
    SEEDS, PER_TASK, BATCH, KMAX = (0, 1, 2), 24, 48, None  # KMAX None: the config's (48)
    GAMMAS, TEMPERATURES = (0.1, 1.5), ((0.8, 0.4), (0.2, 0.1))
else:  # the CI budget: the default and the recorded best setting, 2 seeds (the fewest the diversity measures take)
    SEEDS, PER_TASK, BATCH, KMAX = (0, 1), 4, 8, 8
    GAMMAS, TEMPERATURES = (1.5,), ((0.2, 0.1),)
OUT = Path(tempfile.mkdtemp(prefix="sampler_frontier_"))
print("budget:", BUDGET, "| checkpoint:", CHECKPOINT.relative_to(ROOT), "| out:", OUT)

# %% [markdown]
# ## The checkpoint, its base sampler and the held-out prompts
# PICK and FILL of `choice.yaml` at equal weights (as `frontier.py --tasks pick fill`). The held-out prompts are
# deduplicated and disjoint from the stream that trained the checkpoint (`choice.yaml` at its `trainer.steps`); the
# overlap is recounted and must be 0.

# %%
cfg = load_config(CONFIG)
picked = tuple(dataclasses.replace(t, weight=1.0) for t in cfg.data.tasks if t.name in TASKS)
cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tasks=picked))
held = build_held_out(cfg.data, n_per_task=PER_TASK, batch_size=BATCH,
                      train_streams=[(load_config(CONFIG).data, cfg.trainer.steps)])
print(held.summary())
assert held.overlap == 0 and held.per_task() == {t: PER_TASK for t in sorted(TASKS)}, held.summary()
model = restore(cfg, str(CHECKPOINT))
base = SamplerConfig.from_section(cfg.sampler, **({"max_steps": KMAX} if KMAX else {}))
K = base.max_steps
print(f"base sampler: accept {base.accept}, γ {base.entropy_bound}, τ {base.t_max} -> {base.t_min}, K_max {K}, "
      f"stability {base.stability_threshold}, stop entropy {base.confidence_threshold}")

# %% [markdown]
# ## The sweep
# γ × temperature at the base sampler's K_max and stop rule (`grid`); the base sampler itself is the first row
# ("default"), so a setting equal to it is not decoded twice. Each row: exact match and steps per block with 95 %
# bootstrap CIs over seeds, then prompts; corpus tokens per forward; per task the diversity of the answers over the
# seeds' keys against the data's (`dgemma.eval.diversity`).

# %%
common = dict(max_steps=[K], stability_threshold=[base.stability_threshold],
              confidence_threshold=[base.confidence_threshold])
default = row_label(grid(entropy_bound=[base.entropy_bound], temperatures=[(base.t_max, base.t_min)], **common)[0])
settings = [s for s in grid(entropy_bound=GAMMAS, temperatures=TEMPERATURES, **common) if row_label(s) != default]
print(f"{len(settings) + 1} settings x {len(SEEDS)} seeds x {len(held.examples)} prompts")


def progress(r):
    em, spb = r["exact_match"], r["steps_per_block"]
    print(f"{r['label']:<38} EM {em[0]:.3f} [{em[1]:.3f}, {em[2]:.3f}]  steps/block {spb[0]:.2f} "
          f"[{spb[1]:.2f}, {spb[2]:.2f}]", flush=True)


rows = sweep(model, held, base, settings, SEEDS, progress=progress, diversity=True)
best, front = best_sampler_only(rows), pareto_front(rows)
(OUT / "frontier.json").write_text(json.dumps(
    {"checkpoint": str(CHECKPOINT), "config": str(CONFIG), "budget": BUDGET, "kmax": K, "seeds": list(SEEDS),
     "held_out": held.summary(), "rows": rows, "frontier": front, "best_sampler_only": best}, indent=1) + "\n")
print(table_md(rows))
print(f"\nbest sampler-only setting within 1 point of the default's exact match: {rows[best]['label']}")
for r in rows:  # every mean inside its CI, steps within the budget, EM a rate
    em, spb = r["exact_match"], r["steps_per_block"]
    assert all(map(math.isfinite, (*em, *spb))) and em[1] <= em[0] <= em[2] and spb[1] <= spb[0] <= spb[2], r["label"]
    assert 0.0 <= em[1] and em[2] <= 1.0 and 1.0 <= spb[1] and spb[2] <= K, (r["label"], em, spb)

# %% [markdown]
# ## Steps per block against exact match
# One point per setting with its CIs (both axes), the frontier as a line, the default (red) and the best sampler-only
# setting within 1 point (green) marked; then the same per task.

# %%
title = f"stage1_choice: pick, fill ({len(SEEDS)} seeds, {PER_TASK} prompts/task, K_max {K})"
plot_frontier(rows, OUT / "frontier.png", title=title)
fig, axes = plt.subplots(1, len(TASKS), figsize=(5 * len(TASKS), 3.8), squeeze=False)
for ax, task in zip(axes[0], TASKS):
    for i, r in enumerate(rows):
        (xm, xl, xh), (ym, yl, yh) = r["per_task"][task]["steps_per_block"], r["per_task"][task]["exact_match"]
        ax.errorbar(xm, ym, xerr=[[xm - xl], [xh - xm]], yerr=[[ym - yl], [yh - ym]], fmt="o", capsize=3,
                    color="tab:red" if i == 0 else None, label=r["label"])
    ax.set_xlabel("decoder steps per block (mean)")
    ax.set_ylabel("exact match (95 % CI)")
    ax.set_title(task)
    ax.grid(alpha=0.3)
axes[0][-1].legend(fontsize=6)
fig.tight_layout()
fig.savefig(OUT / "frontier_tasks.png", dpi=100)
plt.close(fig)
plots.show([OUT / "frontier.png", OUT / "frontier_tasks.png"])

# %% [markdown]
# ## The recorded result (`experiments/sdrl_study/results.md`, "Fair baseline", 2026-12-04)
# 24 held-out prompts per task, 3 seeds, diffusion mode, sampled proposals, K_max 48, stop: argmax stable 1 step and
# mean entropy < 0.005. Mean [95 % bootstrap CI over seeds, then prompts].
#
# | setting | pick EM | pick steps / block | fill EM | fill steps / block | all EM | all steps / block | corpus TPF |
# |---|---|---|---|---|---|---|---|
# | default | 1.000 [1.000, 1.000] | 28.88 [27.65, 30.08] | 1.000 [1.000, 1.000] | 19.03 [17.70, 20.38] | 1.000 [1.000, 1.000] | 23.96 [22.82, 25.05] | 0.86 [0.82, 0.90] |
# | eb g=0.1 t=0.2>0.1 K=48 S=1 c=0.005 | 0.986 [0.944, 1.000] | 15.47 [15.16, 15.74] | 0.986 [0.944, 1.000] | 8.56 [8.26, 8.85] | 0.986 [0.951, 1.000] | 12.01 [11.43, 12.58] | 1.71 [1.63, 1.79] |
# | eb g=1.5 t=0.8>0.4 K=48 S=1 c=0.005 | 1.000 [1.000, 1.000] | 12.52 [11.41, 13.73] | 1.000 [1.000, 1.000] | 10.90 [10.22, 11.62] | 1.000 [1.000, 1.000] | 11.71 [10.99, 12.43] | 1.75 [1.65, 1.86] |
# | eb g=1.5 t=0.2>0.1 K=48 S=1 c=0.005 | 1.000 [1.000, 1.000] | 7.22 [7.08, 7.35] | 0.986 [0.944, 1.000] | 8.53 [8.24, 8.80] | 0.993 [0.972, 1.000] | 7.88 [7.68, 8.06] | 2.60 [2.54, 2.67] |
#
# "The best sampler-only setting within 1 point of the default's pooled exact match is γ 1.5 at τ 0.2 → 0.1: pick
# 28.9 → 7.2 steps per block (−75 %) at EM 1.00, fill 19.0 → 8.5 (−55 %) at EM 0.986 [0.944, 1.000]." Against it,
# SD·RL's headline (pick 27.65 → 8.82, fill 17.74 → 8.91 at EM 1.00 / 1.00) is not faster on pick and on fill matches
# the sampler retune. The diversity section that follows it: the retune keeps the data's choices (no collapse; PICK's
# per-position entropy across keys falls from 96 % to 88 % of the data's at K = 8).
#
# The next cell reads that table from `results.md` and sets this run's rows beside it; at the full budget it checks
# whether every recorded mean is reproduced to its printed digits (on the machine that recorded it, it is).

# %%
section = RECORDED.read_text().split("## Fair baseline", 1)[1].split("\n## ", 1)[0]
table = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| setting")]
recorded = {}
for line in table:
    cells = [c.strip() for c in line.strip("|").split("|")]
    pick_em, pick_s, fill_em, fill_s, all_em, all_s, _ = (float(re.match(r"[-\d.]+", c).group()) for c in cells[1:])
    recorded[cells[0]] = {"pick": (pick_em, pick_s), "fill": (fill_em, fill_s), "all": (all_em, all_s)}
assert len(recorded) == 4 and "default" in recorded, f"{RECORDED}: 'Fair baseline' table not found"
mismatch = []
comparable = KMAX is None  # the recorded rows decode at the config's K_max (48); the ci budget's at 8
print(f"{'setting':<38} {'task':<5} {'EM (recorded)':<16} steps/block (recorded)")
for r in rows:
    rec = recorded.get(r["label"]) if comparable else None
    for task in ("pick", "fill", "all"):
        m = r["per_task"][task] if task != "all" else r
        em, spb = m["exact_match"][0], m["steps_per_block"][0]
        if rec is None:
            print(f"{r['label']:<38} {task:<5} {em:.3f} (-)        {spb:.2f} (-)")
            continue
        print(f"{r['label']:<38} {task:<5} {em:.3f} ({rec[task][0]:.3f})  {spb:.2f} ({rec[task][1]:.2f})")
        if abs(em - rec[task][0]) > 5e-4 + 1e-9 or abs(spb - rec[task][1]) > 5e-3 + 1e-9:
            mismatch.append((r["label"], task))
if BUDGET == "full":
    assert [r["label"] for r in rows] == list(recorded), "the full budget decodes the recorded settings"
    # Reported, not asserted: the recorded run was one machine's (AMD EPYC, jax 0.10.2); another CPU's fp32 rounding
    # can flip a sampled token and move a mean in its last digits.
    print("the recorded table is reproduced to its printed digits" if not mismatch else
          f"differs from the recorded digits in {mismatch} (another machine's fp32 rounding can do that; compare the CIs)")
else:
    print("ci budget (other prompts, seeds and K_max): not comparable with the recorded rows")

# %% [markdown]
# ## Diversity beside accuracy
# Exact match cannot see mode collapse on PICK and FILL (any valid answer scores 1). Per task: the plug-in entropy of
# the answer characters at each free position over the seeds' keys (K = number of seeds), against the data's exact
# expected value at the same K; the pooled choice entropy against the data's (ln 2 for PICK, ln 10 for FILL);
# collapse = per-position entropy below half the data's.

# %%
for r in rows:
    for task, d in r["diversity"].items():
        print(f"{r['label']:<38} {task}: H/pos {d['entropy_free']:.3f} (data {d['entropy_free_data']:.3f}), "
              f"H pooled {d['entropy_pooled']:.3f} (data {d['entropy_pooled_data']:.3f}), K = {d['keys']}"
              + (", COLLAPSE" if d["collapse"] else ""))

# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # E2 at a reduced budget: does SD·RL shorten the stage-1 model's trajectories without losing accuracy?
#
# Stage 2 (SD·RL, `docs/sdrl.md`) starts from the stage-1 checkpoint and trains on the model's own sampler
# trajectories: a verifier-gated distillation term plus a policy-gradient term on the task reward. This notebook runs
# the study (`experiments/sdrl_study/run.py`, loaded here by path, over the library's `dgemma.train.study`) at a reduced
# budget: 1 seed, two tasks, a few iterations, the `sdrl` arm, and compares it with the stage-1 model on held-out
# prompts that are disjoint from every training stream. It checks only the direction of change: fewer mean steps per
# block, exact match within 5 points.
#
# Two regimes of the study (`experiments/sdrl_study/results.md`), both from stage-1 checkpoints that ship with the
# repository (~1 MB each), chosen with `DGEMMA_SDRL_REGIME`:
#
# * `copy_sort` (default; the CI version): COPY and SORT of 40 digits from the copy/sort regime's stage 1
#   (`checkpoint/stage1_toy`: copy EM 0.69 at 8.7 steps per 32-token block, sort EM 0.01 at 12.5). The SD target is
#   the student's argmax at its visited states where it equals the verified output (`sdrl.sd_target=
#   state_argmax_agree`, the shipped 26B setting), 4 iterations at lr 5e-4 (the study: 8). Checked: COPY needs fewer
#   steps per block at EM within 5 points. SORT has no verified output to distil (EM ~0), so it is shown, not checked.
# * `choice`: PICK and FILL, whose answers are independent choices per position, so the converged stage-1 model
#   (`checkpoint/stage1_choice`) stays uncertain while decoding and needs ~23 steps per block, as the released stage-1
#   model does on language. `sd_target=state_argmax`, 6 iterations at lr 1e-4 (the study: 3e-5 for 72). Checked: both
#   tasks together need fewer steps per block at EM within 5 points.
#
# `DGEMMA_SDRL_STAGE1` points at another checkpoint; with `DGEMMA_SDRL_STAGE1=none` it builds a tiny untrained model
# instead, so every cell runs in seconds; the direction is then not checked.
#
# `DGEMMA_SDRL_BUDGET=smoke` runs the same cells from the same checkpoint at a smoke budget (1 iteration, Q x G =
# 2 x 2, 4 held-out prompts per task) and checks the reporting contract only.

# %%
import importlib.util
import math
import os
import sys
import tempfile
from pathlib import Path

from dgemma.eval import plots

ROOT = Path.cwd() if (Path.cwd() / "experiments").is_dir() else Path(__file__).resolve().parents[1]
# the study's run script (experiments/ is not a package): loaded by path under a name of its own, with its folder on
# sys.path as when it runs as a script (it imports its own modules by name)
sys.path.insert(0, str(ROOT / "experiments" / "sdrl_study"))
study_spec = importlib.util.spec_from_file_location("sdrl_study_run", ROOT / "experiments" / "sdrl_study" / "run.py")
sdrl_study_run = importlib.util.module_from_spec(study_spec)
study_spec.loader.exec_module(sdrl_study_run)

REGIME = os.environ.get("DGEMMA_SDRL_REGIME", "copy_sort")
if REGIME not in ("copy_sort", "choice"):
    raise ValueError(f"DGEMMA_SDRL_REGIME={REGIME}: expected copy_sort or choice")
CHECKPOINT = {"copy_sort": "stage1_toy", "choice": "stage1_choice"}[REGIME]
STAGE1 = os.environ.get("DGEMMA_SDRL_STAGE1", str(ROOT / "experiments" / "sdrl_study" / "checkpoint" / CHECKPOINT))
TRAINED = STAGE1 != "none"
BUDGET = os.environ.get("DGEMMA_SDRL_BUDGET", "study")
if BUDGET not in ("study", "smoke"):
    raise ValueError(f"DGEMMA_SDRL_BUDGET={BUDGET}: expected study or smoke")
if TRAINED and not Path(STAGE1).is_dir():
    raise FileNotFoundError(f"DGEMMA_SDRL_STAGE1={STAGE1}: no such checkpoint directory")
work = Path(tempfile.mkdtemp(prefix="sdrl_study_"))
print("stage-1 checkpoint:", STAGE1 if TRAINED else "none found: tiny untrained model (plumbing only)")
print("regime:", REGIME, "| budget:", BUDGET)

# %% [markdown]
# ## The run configuration
# The regime's stage-2 config (`experiments/sdrl_study/stage2.yaml` for copy/sort, `stage2_choice.yaml` for pick/fill:
# canvas 32, V = 128, K_max 48, 40-digit tasks); the held-out prompts avoid every stream that trained the checkpoint.
# Without a trained checkpoint: the toy config shrunk to canvas 8, K_max 4 and 3-5 digit copy/sort prompts
# (`dgemma.train.study_toy`).

# %%
if TRAINED and REGIME == "copy_sort":  # the study's settings at a reduced budget: 12 prompts per task, Q x G = 8 x 4
    config = str(ROOT / "experiments" / "sdrl_study" / "stage2.yaml")
    toy_streams = ("stage0_ar.yaml:4500", "stage1.yaml:", "ar_control.yaml:")
    select, iterations = ["--tasks", "copy", "sort", "--override", "sdrl.sd_target=state_argmax_agree"], "4"
elif TRAINED:
    config = str(ROOT / "experiments" / "sdrl_study" / "stage2_choice.yaml")
    toy_streams = ("stage0_ar.yaml:4500", "stage1.yaml:", "ar_control.yaml:", "stage1_more.yaml:", "choice.yaml:")
    select, iterations = ["--override", "sdrl.sd_target=state_argmax", "optim.lr=1e-4"], "6"
if TRAINED:
    streams = [a for c in toy_streams for a in ("--train-stream", str(ROOT / "experiments" / "sdrl_study" / "configs" / c))]
    budget = (["--prompts", "2", "--group-size", "2", "--eval-per-task", "4", "--eval-batch", "8", "--iterations", "1"]
              if BUDGET == "smoke" else ["--eval-per-task", "12", "--eval-batch", "24", "--iterations", iterations])
    extra = [*budget, *select]  # select last: --override takes every argument after it
else:
    from dgemma.train.study_toy import write_toy_study

    config, STAGE1 = map(str, write_toy_study(work, base=ROOT / "experiments" / "sdrl_study" / "stage2.yaml"))
    streams = ["--train-stream", f"{config}:5"]
    extra = ["--prompts", "2", "--group-size", "2", "--eval-per-task", "4", "--eval-batch", "8", "--iterations", "2"]

# %% [markdown]
# ## Run: stage-1 evaluation, SD·RL (`sdrl` arm), evaluation of the result

# %%
out = work / "out"
res = sdrl_study_run.run_study(sdrl_study_run.build_parser().parse_args(
    ["--reduced", "--stage1", STAGE1, "--config", config, "--out", str(out), *streams, *extra]))

# %% [markdown]
# ## Direction of change (held-out, argmax-committed diffusion at the full K_max)

# %%
md = (out / "results.md").read_text()
assert "overlap with the training stream: 0" in md, "held-out prompts must be disjoint from training"
assert "greedy" in md and "K_max = " in md, "every table states its decoding settings"
assert {"stage1", "stage1:ar", "sdrl", "sdrl:ar"} <= set(res["table"])
before, after = res["table"]["stage1"]["all"], res["table"]["sdrl"]["all"]
em = after["exact_match"]
assert em[1] <= em[0] <= em[2], "EM carries a bootstrap CI around its mean"
print(f"steps per block: stage 1 {before['steps_per_block'][0]:.2f} -> SD·RL {after['steps_per_block'][0]:.2f}")
print(f"exact match:     stage 1 {before['exact_match'][0]:.3f} -> SD·RL {after['exact_match'][0]:.3f}")
print(f"corpus TPF:      stage 1 {before['tpf'][0]:.2f} -> SD·RL {after['tpf'][0]:.2f}")
for row in (before, after):  # finite means inside their CIs
    for metric in ("exact_match", "steps_per_block", "tpf"):
        lo, mean, hi = row[metric][1], row[metric][0], row[metric][2]
        assert all(map(math.isfinite, (lo, mean, hi))) and lo <= mean <= hi, (metric, row[metric])
for task in [t for t, v in res["table"]["stage1"].items() if t != "all" and isinstance(v, dict)]:
    b, a = res["table"]["stage1"][task], res["table"]["sdrl"][task]
    print(f"{task}: steps per block {b['steps_per_block'][0]:.2f} -> {a['steps_per_block'][0]:.2f}, "
          f"EM {b['exact_match'][0]:.3f} -> {a['exact_match'][0]:.3f}")
if TRAINED and BUDGET == "study":
    # copy_sort checks COPY, the task with verified outputs to distil; choice checks both tasks together
    checked = "copy" if REGIME == "copy_sort" else "all"
    before, after = res["table"]["stage1"][checked], res["table"]["sdrl"][checked]
    assert after["steps_per_block"][0] <= before["steps_per_block"][0], \
        f"SD·RL did not reduce mean steps per block ({checked})"
    assert after["exact_match"][0] >= before["exact_match"][0] - 0.05, \
        f"SD·RL lost more than 5 points of exact match ({checked})"
    print(f"direction of change on {checked}: as hypothesised")
else:
    print("untrained stage-1 stand-in or smoke budget: direction not checked")

# %% [markdown]
# ## Figures

# %%
plots.show([out / name for name in ("em_vs_steps.png", "tpf_vs_em.png", "iterations.png", "per_step_train.png",
                                    "commitment_stage1.png", "commitment_sdrl.png")])

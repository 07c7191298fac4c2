# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Stage-1 ablations: which parts of the conversion recipe matter
#
# Stage 1 converts an AR model into a block-diffusion model. This notebook starts from the **stage-0 AR checkpoint
# that ships with the repository** (`experiments/tiny_pipeline/checkpoint/stage0_ar`: the main job's stage 0, the
# 26B-A4B architecture twin `tiny_toy` at ~0.5M parameters after 2,400 AR steps on copy / sort / add, AR EM 1.00 /
# 0.99 / 0.99) and runs the main job's stage-1 recipe (`experiments/tiny_pipeline/stage1.yaml`) against one change at a
# time, each with several training seeds:
#
# | variant | change | what it asks |
# |---|---|---|
# | default | none: w(t) = 1, self-conditioning p = 0.5, canvas 8 (2 blocks), λ_AR = 1 | the recipe |
# | loss: reweighted | `diffusion.loss_weighting=reweighted` (w(t) = 1/(1-t), clipped at 10) | does the ELBO-style weight help? |
# | self-cond off | `diffusion.p_self_cond=0` (and decoded without the module) | is the two-pass training worth it? |
# | canvas 16 | `model.canvas_length=16`, `data.layout.n_blocks=1` (same 16-token answers) | larger blocks |
# | λ_AR 0 | `diffusion.lambda_ar=0` | does the AR fallback survive without its loss? |
# | λ_AR 4 | `diffusion.lambda_ar=4` | does more AR weight cost diffusion? |
#
# Each variant x training seed s trains through the library trainer (`dgemma.train.ablation.train_variant`, which calls
# `dgemma.train.trainer.train`, what `dgemma train` runs) and is decoded with sampler key 1000 + s on the same
# held-out prompts (`dgemma.eval.heldout`: deduplicated, disjoint from the stage-0 and stage-1 streams; the overlap is
# recounted and must be 0) by the held-out evaluator (`dgemma.eval.evaluator`): greedy AR and the recipe's EB sampler.
# Reported per variant (`dgemma.eval.study_report.summarize`, `dgemma.eval.stats`): exact match (diffusion and AR),
# steps per block and corpus tokens per forward with 95 % bootstrap CIs over seeds, then prompts; the final training
# losses with 95 % CIs over seeds. Steps per block compare like with like only at one canvas length (a 16-token block
# needs more steps than an 8-token one); tokens per forward compare across canvases.
#
# `DGEMMA_STAGE1_ABLATIONS_BUDGET` chooses the budget:
#
# * `full` (default): seeds 0 1 2, **120 stage-1 steps per run** (the recipe runs 1,000; this is a short schedule so
#   that 18 runs fit in minutes: it ranks the recipe's parts early in conversion, not at convergence), batch 32,
#   warmup 12, 32 held-out prompts per task, K_max 16 (the main job's decoding). 2,399 s measured on the 2 CPU cores
#   shared with other jobs at load 9-18 (this job at nice 10); its numbers are in
#   `experiments/stage1_ablations/results.md`.
# * `ci` (run by `tests/e2e/test_notebooks.py`): the same cells on a one-layer *untrained* stand-in of the checkpoint
#   (same vocabulary, canvas and tasks), 3 variants (default, self-cond off, canvas 16: the ones whose programs
#   differ), 2 seeds, 2 steps, 4 prompts per task, K_max 4 (69 s measured at load ~12 on the 2 cores, mostly
#   compiling): plumbing only, the numbers mean nothing.

# %%
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import matplotlib
import numpy as np

matplotlib.use("Agg")  # figures are written to files and displayed from them
import matplotlib.pyplot as plt

from dgemma.config import load_config
from dgemma.eval.evaluator import decoding_settings, evaluate
from dgemma.eval.heldout import build_held_out
from dgemma.eval.stats import bootstrap_ci, fmt_ci
from dgemma.eval.study_report import machine_description, summarize
from dgemma.inference.sampler_types import SamplerConfig
from dgemma.train.ablation import train_variant, variant_cfg

ROOT = Path.cwd()
while not (ROOT / "experiments" / "tiny_pipeline").is_dir() and ROOT != ROOT.parent:
    ROOT = ROOT.parent
PIPE = ROOT / "experiments" / "tiny_pipeline"
RECIPE, STAGE0_CONFIG = PIPE / "stage1.yaml", PIPE / "stage0_ar.yaml"
TASKS = ["add", "copy", "sort"]
VARIANTS = {
    "default": [],
    "loss: reweighted": ["diffusion.loss_weighting=reweighted"],
    "self-cond off": ["diffusion.p_self_cond=0"],
    "canvas 16": ["model.canvas_length=16", "data.layout.n_blocks=1"],
    "λ_AR 0": ["diffusion.lambda_ar=0"],
    "λ_AR 4": ["diffusion.lambda_ar=4"],
}

BUDGET = os.environ.get("DGEMMA_STAGE1_ABLATIONS_BUDGET", "full")
if BUDGET not in ("full", "ci"):
    raise ValueError(f"DGEMMA_STAGE1_ABLATIONS_BUDGET={BUDGET}: expected full or ci")
OUT = Path(tempfile.mkdtemp(prefix="stage1_ablations_"))
if BUDGET == "full":
    STAGE0 = PIPE / "checkpoint" / "stage0_ar"
    if not STAGE0.is_dir():
        raise FileNotFoundError(f"{STAGE0}: the shipped stage-0 checkpoint is missing")
    SEEDS, STEPS, WARMUP, PER_TASK, K = (0, 1, 2), 120, 12, 32, 16
    MODEL = []
else:
    from flax import nnx

    from dgemma.checkpoint import save_params
    from dgemma.model.transformer import Transformer

    SEEDS, STEPS, WARMUP, PER_TASK, K = (0, 1), 2, 0, 4, 4
    # the variants whose code paths differ (the default; no self-conditioning module; another canvas and held-out
    # encoding): the weighting and λ_AR variants change one number of the default's program
    VARIANTS = {k: VARIANTS[k] for k in ("default", "self-cond off", "canvas 16")}
    MODEL = ["model.num_hidden_layers=1", "model.layer_types=[full_attention]"]  # compiles in a fraction
    STAGE0 = OUT / "stand_in"
    stand_in = variant_cfg(RECIPE, MODEL, seed=0, init_from=None, out=OUT / "runs", name="stand_in")
    save_params(STAGE0, 0, nnx.state(Transformer(stand_in.model_config, rngs=nnx.Rngs(0)), nnx.Param))
COMMON = [*MODEL, f"optim.warmup_steps={WARMUP}"]
if not jax.config.jax_compilation_cache_dir:  # a variant's seeds build the same programs: compile them once
    jax.config.update("jax_compilation_cache_dir", str(OUT / "xla_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
T0 = time.time()
print("budget:", BUDGET, "| stage 0:", STAGE0, "| recipe:", RECIPE.relative_to(ROOT), "| out:", OUT)
print(f"seeds {list(SEEDS)}, {STEPS} stage-1 steps per run, {PER_TASK} held-out prompts per task, K_max {K}")

# %% [markdown]
# ## Held-out prompts and the decoding
# One set of prompts, disjoint from stage 0's stream (2,400 steps of `stage0_ar.yaml`) and from every variant's
# stage-1 stream; the canvas-16 variant reads the same prompts in its own encoding (checked).

# %%
cfgs = {name: variant_cfg(RECIPE, [*COMMON, *ov], seed=SEEDS[0], init_from=STAGE0, out=OUT / "runs", name="probe",
                          steps=STEPS) for name, ov in VARIANTS.items()}
stage0_data = load_config(STAGE0_CONFIG, [])
streams = [(stage0_data.data, stage0_data.trainer.steps)] + [(c.data, STEPS) for c in cfgs.values()]
held_by_canvas = {}
for c in cfgs.values():
    L = c.model_config.canvas_length
    if L not in held_by_canvas:
        held_by_canvas[L] = build_held_out(c.data, n_per_task=PER_TASK, batch_size=min(64, PER_TASK * len(TASKS)),
                                           train_streams=streams)
held = held_by_canvas[cfgs["default"].model_config.canvas_length]
print(held.summary())
assert held.overlap == 0 and held.per_task() == {t: PER_TASK for t in TASKS}, held.summary()
for L, h in held_by_canvas.items():
    assert [e.prompt for e in h.source] == [e.prompt for e in held.source], f"canvas {L}: other held-out prompts"
sampler = SamplerConfig.from_section(cfgs["default"].sampler, max_steps=K)
DECODING = {"diffusion": decoding_settings(sampler, "diffusion"), "ar": decoding_settings(sampler, "ar")}
for mode, text in DECODING.items():
    print(f"{mode}: {text}")

# %% [markdown]
# ## Train every variant x seed from the stage-0 checkpoint, then decode it
# Training seed s (`run.seed`: noise levels, self-conditioning draws; the data order is the recipe's) is decoded with
# sampler key 1000 + s.

# %%
evals, losses, seconds = {}, {}, {}
for name, ov in VARIANTS.items():
    for seed in SEEDS:
        run = train_variant(RECIPE, [*COMMON, *ov], seed=seed, init_from=STAGE0, out=OUT / "runs",
                            name=f"v{list(VARIANTS).index(name)}", steps=STEPS)
        h = held_by_canvas[run.cfg.model_config.canvas_length]
        e = evaluate(run.model, h, sampler, ("ar", "diffusion"), key=jax.random.key(1000 + seed))
        evals.setdefault(name, []).append(e)
        evals.setdefault(f"{name}:ar", []).append(e)
        losses.setdefault(name, []).append(run.losses)
        seconds.setdefault(name, []).append(run.seconds)
        m, a = e["diffusion"]["metrics"], e["ar"]["metrics"]
        print(f"{name:<17} seed {seed}: {run.seconds:5.0f} s, loss {run.losses['loss'][0]:.3f} -> "
              f"{run.losses['loss'][-1]:.3f}; diffusion EM {m['exact_match']:.3f} at {m['steps_per_block']:.2f} "
              f"steps/block, AR EM {a['exact_match']:.3f}", flush=True)
print(f"trained and decoded {len(VARIANTS)} x {len(SEEDS)} runs in {time.time() - T0:.0f} s")

# %% [markdown]
# ## The table: every variant against the recipe's default
# Mean [95 % CI]; EM, steps per block and tokens per forward over seeds then prompts; losses over seeds, each seed's
# mean over its last tenth of steps (`loss` = the weighted diffusion CE + λ_AR x AR CE, so its level moves with the
# weighting and λ_AR: compare `loss_ar`, and `loss_diffusion` between runs of one weighting). *vs default*: "higher" /
# "lower" when the variant's CI lies wholly above / below the default's, else "CIs overlap".

# %%
table = summarize(evals, TASKS)
tail = max(1, STEPS // 10)
final = {name: {k: bootstrap_ci([float(np.mean(r[k][-tail:])) for r in runs]) for k in ("loss", "loss_diffusion",
                                                                                         "loss_ar")}
         for name, runs in losses.items()}


def versus(ci, base):
    return "higher" if ci[1] > base[2] else "lower" if ci[2] < base[1] else "CIs overlap"


rows = []
for name, ov in VARIANTS.items():
    d, a = table[name]["all"], table[f"{name}:ar"]["all"]
    base_d, base_a = table["default"]["all"], table["default:ar"]["all"]
    rows.append({"variant": name, "overrides": ov, "exact_match": d["exact_match"],
                 "steps_per_block": d["steps_per_block"], "tpf": d["tpf"], "ar_exact_match": a["exact_match"],
                 "per_task": {t: {"exact_match": table[name][t]["exact_match"],
                                  "ar_exact_match": table[f"{name}:ar"][t]["exact_match"],
                                  "steps_per_block": table[name][t]["steps_per_block"]} for t in TASKS},
                 **final[name], "n": d["n"], "seconds": float(np.mean(seconds[name])),
                 "vs_default": {"exact_match": versus(d["exact_match"], base_d["exact_match"]),
                                "ar_exact_match": versus(a["exact_match"], base_a["exact_match"]),
                                "loss_ar": versus(final[name]["loss_ar"], final["default"]["loss_ar"])}})
head = ("| variant | diffusion EM | steps / block | corpus TPF | AR EM | loss | loss_diffusion | loss_ar | "
        "vs default: diffusion EM / AR EM |")
lines = [head, "|" + "---|" * (head.count("|") - 1)]
for r in rows:
    v = r["vs_default"]
    lines.append("| " + " | ".join([r["variant"], fmt_ci(r["exact_match"]), fmt_ci(r["steps_per_block"], 2),
                                    fmt_ci(r["tpf"], 2), fmt_ci(r["ar_exact_match"]), fmt_ci(r["loss"]),
                                    fmt_ci(r["loss_diffusion"]), fmt_ci(r["loss_ar"]),
                                    "(the default)" if r["variant"] == "default" else
                                    f"{v['exact_match']} / {v['ar_exact_match']}"]) + " |")
md = "\n".join(lines)
print(md)
print("\nper task, diffusion EM / AR EM / steps per block:")
for r in rows:
    print(f"  {r['variant']:<17} " + "  ".join(
        f"{t} {p['exact_match'][0]:.3f} / {p['ar_exact_match'][0]:.3f} / {p['steps_per_block'][0]:.2f}"
        for t, p in r["per_task"].items()))
for r in rows:  # every mean inside its CI, EM a rate, steps within the budget
    for key in ("exact_match", "ar_exact_match", "steps_per_block", "tpf", "loss", "loss_diffusion", "loss_ar"):
        m, lo, hi = r[key]
        assert all(map(math.isfinite, (m, lo, hi))) and lo <= m <= hi, (r["variant"], key, r[key])
    assert 0.0 <= r["exact_match"][1] and r["exact_match"][2] <= 1.0, r["variant"]
    assert 1.0 <= r["steps_per_block"][1] and r["steps_per_block"][2] <= K, r["variant"]
wall = round(time.time() - T0)
(OUT / "ablations.json").write_text(json.dumps(
    {"budget": BUDGET, "stage0": str(STAGE0), "recipe": str(RECIPE), "seeds": list(SEEDS), "steps": STEPS,
     "warmup": WARMUP, "kmax": K, "per_task": PER_TASK, "held_out": held.summary(), "decoding": DECODING,
     "variants": VARIANTS, "rows": rows, "table_md": md,
     "curves": {name: {k: np.mean([r[k] for r in runs], axis=0).tolist() for k in ("loss_diffusion", "loss_ar")}
                for name, runs in losses.items()},
     "machine": machine_description(), "load_avg": os.getloadavg(), "wall_s": wall}, indent=1, default=float) + "\n")
print(f"wrote {OUT / 'ablations.json'} ({wall} s; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")

# %% [markdown]
# ## Plot: exact match against steps per block, AR exact match, and the training curves
# Left: diffusion exact match against steps per block per variant (95 % CIs on both axes; canvas 16's steps are per
# 16-token block). Middle: AR exact match per variant. Right: the diffusion loss and the AR loss of training, mean
# over seeds.

# %%
fig, axes = plt.subplots(1, 3, figsize=(14, 4.4))
for i, r in enumerate(rows):
    (xm, xl, xh), (ym, yl, yh) = r["steps_per_block"], r["exact_match"]
    axes[0].errorbar(xm, ym, xerr=[[xm - xl], [xh - xm]], yerr=[[ym - yl], [yh - ym]], fmt="s" if i == 0 else "o",
                     color=f"C{i}", capsize=3, label=r["variant"])
    am, al, ah = r["ar_exact_match"]
    axes[1].bar(i, am, yerr=[[am - al], [ah - am]], color=f"C{i}", capsize=3)
    for key, style in (("loss_diffusion", "-"), ("loss_ar", ":")):
        curve = np.mean([run[key] for run in losses[r["variant"]]], axis=0)
        axes[2].plot(np.arange(1, len(curve) + 1), curve, style, color=f"C{i}", lw=1)
axes[0].set_xlabel("decoder steps per block (mean)")
axes[0].set_ylabel("diffusion exact match (95 % CI)")
axes[0].legend(fontsize=7)
axes[1].set_xticks(range(len(rows)), [r["variant"] for r in rows], rotation=30, ha="right", fontsize=7)
axes[1].set_ylabel("AR exact match (95 % CI)")
axes[2].set_yscale("log")
axes[2].set_xlabel("stage-1 step")
axes[2].set_ylabel("training loss (solid: diffusion, dotted: AR)")
for ax in axes:
    ax.grid(alpha=0.3)
fig.suptitle(f"stage-1 ablations from the stage-0 AR checkpoint: {len(SEEDS)} seeds x {STEPS} steps, "
             f"{PER_TASK} held-out prompts/task, K_max {K} ({BUDGET} budget)", fontsize=9)
fig.tight_layout()
fig.savefig(OUT / "ablations.png", dpi=110)
plt.close(fig)
print(OUT / "ablations.png", (OUT / "ablations.png").stat().st_size, "bytes")
if "ipykernel" in sys.modules:
    from IPython.display import Image, display

    display(Image(filename=str(OUT / "ablations.png")))

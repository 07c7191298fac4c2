# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Stage-2 arms against the sampler-only baseline, with diversity beside accuracy
#
# A stage-2 (SD·RL) claim is a claim against the best *sampler-only* setting of the stage-1 checkpoint: the same
# model with another entropy bound γ or other temperatures, no training. This notebook trains SD·RL arms from the
# many-answer stage-1 checkpoint that ships with the repository (`experiments/sdrl_study/checkpoint/stage1_choice`,
# tasks PICK and FILL: every answer position a free choice), then sweeps the sampler frontier of stage 1 *and of
# every trained arm* on the same held-out prompts, and reports
#
# * stage 1 at the default sampler, and two sampler-only baselines: the stage-1 setting with the fewest steps per
#   block within 1 point of the default's exact match (`best_sampler_only`: by exact match alone), and the same choice
#   among the settings that keep the data's diversity (`best_keeping_diversity`: per-position answer entropy >=
#   `DIVERSITY_KEPT` = 0.8 of the data's on every task), since the first can be a setting that buys its steps with
#   collapse;
# * each arm at the default sampler, and the arm's own best frontier point by each rule, held to stage 1's exact
#   match; for each arm, which baseline it beats, and whether its rows keep the data's diversity;
# * steps per block and exact match with 95 % bootstrap CIs over seeds, then prompts;
# * diversity beside accuracy: per task the plug-in entropy of the answer characters at free positions across sampler
#   keys, and the distinct-answer rate across keys, each against the data's own (exact, bias-matched) value; rows
#   that buy steps with collapse (entropy below half the data's) are flagged.
#
# Arms (`sdrl` objective, `experiments/sdrl_study/stage2_choice.yaml`): `sd_target=state_argmax_agree` (the shipped
# 26B setting) and `sd_target=verified` (docs/sdrl.md §3's teacher target y*(q), the design's default). Everything
# goes through the library: `dgemma.train.study` (configs, held-out prompts, restore), `dgemma.train.sdrl.run_sdrl`,
# `dgemma.eval.frontier` (`around`, `sweep` with one trained model per seed, `pareto_front`, `best_sampler_only`,
# `best_keeping_diversity`, `keeps_diversity`, `versus`) and `dgemma.eval.diversity`. Addition is not swept: this
# checkpoint never learned it (the shared mix's stage 0 left add at AR EM 0 and its stage 1 dropped it), add has no
# free positions (no diversity to keep), and the addition model (`checkpoint/stage1_add`) is another regime.
#
# `DGEMMA_ARMS_BUDGET` chooses the budget:
#
# * `full` (default; 811-1265 s measured on 2 CPU cores shared with other jobs at load 4-7, less on an idle machine;
#   3-5 min of it the 6 SD·RL runs, the rest the 3 x 18 frontier rows): seeds 0 1 2 (training seed s is decoded with
#   sampler key 1000 + s), **6 SD·RL iterations per run at lr 1e-4, Q 4 prompts x G 4 rollouts** (the study's
#   recorded arms ran 12-72 iterations at Q 8 x G 4: this is a short schedule, chosen so the notebook runs in
#   minutes), 16 held-out prompts per task, diversity over 3 keys per model, and the whole sampler grid for every model
#   (`dgemma.eval.frontier.around`): γ ∈ {0.1, 1.5} x τ ∈ {0.8 → 0.4, 0.2 → 0.1} at K_max 48, then one axis at a
#   time around the default: K_max ∈ {8, 16, 24}, stability S ∈ {0, 2}, the confidence accept rule at p ∈ {0.5, 0.7,
#   0.9}, the fixed-count rule at K ∈ {1, 2, 3, 4, 8, 16} (ceil(32 / K) = 32, 16, 11, 8, 4, 2 positions per step on
#   the 32-token block): 18 rows per model. Its numbers are in
#   `experiments/sdrl_study/results.md`, "Stage-2 arms against the sampler-only baseline over the whole grid".
# * `ci` (20-50 s in tests/e2e/test_notebooks.py at load 2-11 on the 2 cores, most of it compiling the SD·RL update; run by
#   `tests/e2e/test_notebooks.py`): the same cells on a tiny *untrained* stand-in
#   (`dgemma.train.study_toy`: one layer, canvas 8, K_max 4, 3-5 digit pick / fill), 2 seeds, 1 iteration, Q 2 x G 2,
#   4 prompts per task, the default, γ 1.5 at τ 0.2 → 0.1 and the fixed-count rule at K 2: plumbing only, the
#   numbers mean nothing.

# %%
import json
import math
import os
import tempfile
import time
from pathlib import Path

import jax
import matplotlib

matplotlib.use("Agg")  # figures are written to files and displayed from them
import matplotlib.pyplot as plt

from dgemma.eval import plots
from dgemma.eval.frontier import (DIVERSITY_KEPT, around, best_keeping_diversity, best_sampler_only, diversity_kept,
                                  keeps_diversity, pareto_front, row_label, sweep, versus)
from dgemma.eval.stats import fmt_ci
from dgemma.inference.sampler_types import SamplerConfig
from dgemma.model.transformer import model_from_params
from dgemma.train.sdrl import run_sdrl
from dgemma.train.study import build_parser, held_out, restore, study_cfg, study_mesh

ROOT = Path.cwd()
while not (ROOT / "experiments" / "sdrl_study").is_dir() and ROOT != ROOT.parent:
    ROOT = ROOT.parent
STUDY = ROOT / "experiments" / "sdrl_study"
TASKS = ("pick", "fill")
ARMS = {"state_argmax_agree": "sdrl, sd_target=state_argmax_agree", "verified": "sdrl, sd_target=verified (design)"}

BUDGET = os.environ.get("DGEMMA_ARMS_BUDGET", "full")
if BUDGET not in ("full", "ci"):
    raise ValueError(f"DGEMMA_ARMS_BUDGET={BUDGET}: expected full or ci")
OUT = Path(tempfile.mkdtemp(prefix="sdrl_arms_"))
if BUDGET == "full":
    STAGE1, CONFIG = STUDY / "checkpoint" / "stage1_choice", STUDY / "stage2_choice.yaml"
    if not STAGE1.is_dir():
        raise FileNotFoundError(f"{STAGE1}: the shipped stage-1 checkpoint is missing")
    SEEDS, ITERATIONS, Q, G, LR, PER_TASK, BATCH = (0, 1, 2), 6, 4, 4, 1e-4, 16, 32
    AXES = dict(entropy_bound=(0.1, 1.5), temperatures=((0.8, 0.4), (0.2, 0.1)), max_steps=(8, 16, 24),
                stability_threshold=(0, 2), accept_confidence=(0.5, 0.7, 0.9),
                fixed_count_steps=(1, 2, 3, 4, 8, 16))  # K 3: ceil(32 / 3) = 11 positions per step (11 + 11 + 10)
    STREAMS = [str(ROOT / "experiments" / "sdrl_study" / "configs" / c) for c in
               ("stage0_ar.yaml:4500", "stage1.yaml:", "ar_control.yaml:", "stage1_more.yaml:", "choice.yaml:")]
else:
    from dgemma.train.study_toy import write_toy_study

    CONFIG, STAGE1 = write_toy_study(OUT / "toy", base=STUDY / "stage2_choice.yaml", tasks=[
        {"name": "pick", "min_len": 3, "max_len": 5},
        {"name": "fill", "min_len": 3, "max_len": 5, "wildcard_rate": 0.5}],
        model={"num_hidden_layers": 1, "layer_types": ["full_attention"]})  # one layer: compiles in a fraction
    SEEDS, ITERATIONS, Q, G, LR, PER_TASK, BATCH = (0, 1), 1, 2, 2, 1e-4, 4, 8
    AXES = dict(entropy_bound=(1.5,), temperatures=((0.2, 0.1),), fixed_count_steps=(2,))  # one row per kind of axis
    STREAMS = [f"{CONFIG}:5"]
KEYS = len(SEEDS)  # diversity: K sampler keys per model (stage 1: the seeds' keys; an arm: K keys per seed's model)
if not jax.config.jax_compilation_cache_dir:  # the 2 x len(SEEDS) runs build the same programs: compile them once
    jax.config.update("jax_compilation_cache_dir", str(OUT / "xla_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
T0 = time.time()
print("budget:", BUDGET, "| stage 1:", STAGE1, "| config:", Path(CONFIG).name, "| out:", OUT)


def study_args(sd_target: str):
    """The study's command line (`dgemma.train.study.build_parser`) for one arm: its config, tasks and budget."""
    streams = [a for s in STREAMS for a in ("--train-stream", s)]
    return build_parser(CONFIG).parse_args([
        "--stage1", str(STAGE1), "--out", str(OUT / "runs"), "--name", sd_target, "--tasks", *TASKS,
        "--iterations", str(ITERATIONS), "--prompts", str(Q), "--group-size", str(G),
        "--eval-per-task", str(PER_TASK), "--eval-batch", str(BATCH), *streams,
        "--override", f"sdrl.sd_target={sd_target}", f"optim.lr={LR}"])


# %% [markdown]
# ## Held-out prompts and the base sampler
# Deduplicated and disjoint from every stream that trained the checkpoint (stages 0/1, the AR control, `choice.yaml`)
# and from the SD·RL prompt stream at this iteration count; the overlap is recounted and must be 0.

# %%
cfg0 = study_cfg(study_args("verified"), "sdrl", SEEDS[0])
held = held_out(study_args("verified"), cfg0)
print(held.summary())
assert held.overlap == 0 and held.per_task() == {t: PER_TASK for t in sorted(TASKS)}, held.summary()
base = SamplerConfig.from_section(cfg0.sampler)
K = base.max_steps
print(f"base sampler: accept {base.accept}, γ {base.entropy_bound}, τ {base.t_max} -> {base.t_min}, K_max {K}, "
      f"stability {base.stability_threshold}, stop entropy {base.confidence_threshold}; sampled proposals, argmax "
      f"output, blocks committed in order")
settings = around(base, **AXES)  # γ x τ at the base's K_max and stop rule, then one axis at a time around the base
print(f"frontier grid: default + {len(settings)} settings: {[row_label(s) for s in settings]}")


def progress(r):
    em, spb = r["exact_match"], r["steps_per_block"]
    print(f"  {r['label']:<38} EM {fmt_ci(em)}  steps/block {fmt_ci(spb, 2)}", flush=True)


# %% [markdown]
# ## Stage 1: its sampler frontier and the two sampler-only baselines
# The shipped checkpoint, no training; sampler key 1000 + seed, so every row has the arms' sampling noise. The
# baseline by exact match alone, and the baseline that also keeps the data's diversity (entropy per free position
# >= DIVERSITY_KEPT x the data's on every task).

# %%
stage1 = restore(cfg0, str(STAGE1))
print("stage 1 frontier:")
rows = {"stage 1": sweep(stage1, held, base, settings, SEEDS, progress=progress, diversity=True)}
best = {"stage 1": best_sampler_only(rows["stage 1"])}
best_div = {"stage 1": best_keeping_diversity(rows["stage 1"])}
baseline = rows["stage 1"][best["stage 1"]]
baseline_div = None if best_div["stage 1"] is None else rows["stage 1"][best_div["stage 1"]]
reference_em = rows["stage 1"][0]["exact_match"][0]
print(f"best sampler-only row (fewest steps within 1 point of the default's EM {reference_em:.3f}): "
      f"{baseline['label']}; the same keeping >= {DIVERSITY_KEPT:g} x the data's entropy on every task: "
      f"{'none' if baseline_div is None else baseline_div['label']}")

# %% [markdown]
# ## The arms: SD·RL from stage 1, one run per seed, then each arm's frontier
# Each seed's trained model is decoded with that seed's sampler key (`sweep` with one model per seed), so an arm's CI
# covers training seeds and prompts. Its diversity is each model's spread over its own K keys, pooled over the seeds.

# %%
histories = {}
for target, name in ARMS.items():
    args, models = study_args(target), []
    for seed in SEEDS:
        cfg = study_cfg(args, "sdrl", seed)
        ts = time.time()
        summary = run_sdrl(cfg, progress=False, mesh=study_mesh(cfg))
        histories.setdefault(name, []).append([float(m.get("steps_per_block", math.nan)) for m in summary.history])
        models.append(model_from_params(cfg.model_config, summary.state.params))
        print(f"{name} seed {seed}: {len(summary.history)} iterations in {time.time() - ts:.0f} s; training-rollout "
              f"steps/block {histories[name][-1][0]:.2f} -> {histories[name][-1][-1]:.2f}", flush=True)
    print(f"{name} frontier:")
    rows[name] = sweep(models, held, base, settings, SEEDS, progress=progress, diversity=True, diversity_keys=KEYS)
    best[name] = best_sampler_only(rows[name], reference=reference_em)
    best_div[name] = best_keeping_diversity(rows[name], reference=reference_em)
    del models
print(f"trained and swept in {time.time() - T0:.0f} s")

# %% [markdown]
# ## The table: every arm against both sampler-only baselines
# *vs EM-only* / *vs diversity-keeping baseline*: `versus` — "fewer steps" only when the row's steps-per-block CI lies
# wholly below that baseline's at a mean exact match within 1 point of stage 1's default. Diversity per task: H/pos =
# plug-in entropy (nats) of the K answer characters at each free position, mean over (prompt, position) [95 % CI],
# the data's expected value at the same K in parentheses; distinct = distinct answers / K, the data's in parentheses.
# *collapse*: H/pos < 0.5 x data. *keeps diversity*: H/pos >= DIVERSITY_KEPT (0.8) x data on every task (the lowest
# ratio in parentheses). An arm *beats* a baseline with a row that has fewer steps by that rule and is not collapsed
# (EM-only baseline) or keeps the data's diversity (diversity-keeping baseline).


# %%
def against(r, group, index, rule_best, base_row):
    """The row against one baseline: itself, no baseline (none qualified), or `versus` at stage 1's EM."""
    if group == "stage 1" and index == rule_best:
        return "(the baseline)"
    return "- (no baseline)" if base_row is None else versus(r, base_row, reference=reference_em)


def summary_row(group, index, what):
    r = rows[group][index]
    div = r["diversity"]
    faster = r["steps_per_block"][0] < rows["stage 1"][0]["steps_per_block"][0]
    collapsed = sorted(t for t, d in div.items() if d["collapse"])
    return {"row": f"{group}: {what}", "group": group, "index": index, "setting": r["label"], "text": r["text"],
            "exact_match": r["exact_match"], "steps_per_block": r["steps_per_block"], "tpf": r["tpf"],
            "per_task": r["per_task"], "diversity": div, "collapsed": collapsed,
            "buys_steps_with_collapse": bool(faster and collapsed), "keeps_diversity": keeps_diversity(r),
            "diversity_kept": diversity_kept(r),
            "vs_baseline": against(r, group, index, best["stage 1"], baseline),
            "vs_diversity_baseline": against(r, group, index, best_div["stage 1"], baseline_div)}


table = [summary_row("stage 1", 0, "default sampler"), summary_row("stage 1", best["stage 1"], "best sampler-only")]
if best_div["stage 1"] is not None:
    table.append(summary_row("stage 1", best_div["stage 1"], "best sampler-only keeping diversity"))
else:
    print(f"stage 1: no setting within 1 point of its default's EM keeps >= {DIVERSITY_KEPT:g} x the data's entropy")
for name in ARMS.values():
    table.append(summary_row(name, 0, "default sampler"))
    for rule_best, what in ((best[name], "own best frontier point"),
                            (best_div[name], "own best point keeping diversity")):
        if rule_best is not None:
            table.append(summary_row(name, rule_best, what))
        else:
            print(f"{name}: no {what} within 1 point of stage 1's EM {reference_em:.3f}")
head = ("| row | setting | EM [95 % CI] | steps / block [95 % CI] | corpus TPF | "
        + "".join(f"{t} EM | {t} steps | {t} H/pos (data) | {t} distinct (data) | " for t in TASKS)
        + "collapse | keeps diversity | vs EM-only baseline | vs diversity-keeping baseline |")
lines = [head, "|" + "---|" * (head.count("|") - 1)]
for s in table:
    cells = [s["row"], s["setting"], fmt_ci(s["exact_match"]), fmt_ci(s["steps_per_block"], 2), f"{s['tpf'][0]:.2f}"]
    for t in TASKS:
        d, p = s["diversity"][t], s["per_task"][t]
        cells += [f"{p['exact_match'][0]:.3f}", f"{p['steps_per_block'][0]:.2f}",
                  f"{fmt_ci(d['entropy_free_ci'])} ({d['entropy_free_data']:.3f})",
                  f"{d['distinct']:.2f} ({d['distinct_data']:.2f})"]
    kept = s["diversity_kept"]
    cells += [("COLLAPSE: " + ", ".join(s["collapsed"]) + (" (buys steps with it)" if s["buys_steps_with_collapse"]
                                                          else "")) if s["collapsed"] else "no",
              ("yes" if s["keeps_diversity"] else "no") + (f" ({min(kept.values()):.2f})" if kept else ""),
              s["vs_baseline"], s["vs_diversity_baseline"]]
    lines.append("| " + " | ".join(cells) + " |")
md = "\n".join(lines)
print(md)


def describe(b):
    return "none qualifies" if b is None else (f"{b['label']}, {b['steps_per_block'][0]:.2f} steps/block at EM "
                                               f"{b['exact_match'][0]:.3f}")


verdicts = [f"EM-only baseline: {describe(baseline)}", f"diversity-keeping baseline (>= {DIVERSITY_KEPT:g} x the "
            f"data's entropy on every task): {describe(baseline_div)}"]
for name in ARMS.values():
    mine = [s for s in table if s["group"] == name]
    beats_em = [s["setting"] for s in mine if s["vs_baseline"] == "fewer steps" and not s["collapsed"]]
    beats_div = [s["setting"] for s in mine if s["vs_diversity_baseline"] == "fewer steps" and s["keeps_diversity"]]
    own = rows[name][best[name]] if best[name] is not None else None
    own_state = "none within 1 point" if own is None else (
        f"{own['label']}: " + ("collapsed on " + ", ".join(sorted(t for t, d in own["diversity"].items()
                                                                    if d["collapse"]))
                               if any(d["collapse"] for d in own["diversity"].values()) else "not collapsed")
        + (", keeps the data's diversity" if keeps_diversity(own) else ", below the diversity bar"))
    verdicts.append(f"{name}: beats the EM-only baseline: {', '.join(beats_em) or 'no'}; beats the "
                    f"diversity-keeping baseline: {', '.join(beats_div) or 'no'}; own best point by EM: {own_state}")
verdict = "\n".join(verdicts)
print("\n" + verdict)
for s in table:  # every mean inside its CI, steps within the budget, EM a rate
    em, spb = s["exact_match"], s["steps_per_block"]
    assert all(map(math.isfinite, (*em, *spb))) and em[1] <= em[0] <= em[2] and spb[1] <= spb[0] <= spb[2], s["row"]
    assert 0.0 <= em[1] and em[2] <= 1.0 and 1.0 <= spb[1] and spb[2] <= K, (s["row"], em, spb)
    assert set(s["diversity"]) == set(TASKS), (s["row"], sorted(s["diversity"]))
(OUT / "arms.json").write_text(json.dumps(
    {"budget": BUDGET, "stage1": str(STAGE1), "config": str(CONFIG), "seeds": list(SEEDS), "iterations": ITERATIONS,
     "prompts_x_group": [Q, G], "lr": LR, "kmax": K, "diversity_keys": KEYS, "held_out": held.summary(),
     "decoding": baseline["text"], "arms": ARMS, "rows": rows, "best": best, "best_keeping_diversity": best_div,
     "diversity_kept_fraction": DIVERSITY_KEPT, "frontier": {g: pareto_front(r) for g, r in rows.items()},
     "table": table, "table_md": md, "verdict": verdict, "histories": histories,
     "machine": f"{os.cpu_count()} CPU cores, jax {jax.__version__}", "wall_s": round(time.time() - T0)},
    indent=1, default=float) + "\n")
print(f"wrote {OUT / 'arms.json'} ({time.time() - T0:.0f} s)")

# %% [markdown]
# ## Frontier curves: steps per block against exact match, per model
# Every setting of the grid for stage 1 and each arm, with 95 % CIs on both axes; the line joins each model's frontier
# (`pareto_front`); the best sampler-only row by exact match is the star, the one that keeps the data's diversity the
# plus, each arm's own best point by exact match a diamond and its best diversity-keeping point a plus.

# %%
fig, ax = plt.subplots(figsize=(7.2, 4.8))
for (group, rs), color in zip(rows.items(), ("tab:red", "tab:blue", "tab:green", "tab:purple")):
    for i, r in enumerate(rs):
        (xm, xl, xh), (ym, yl, yh) = r["steps_per_block"], r["exact_match"]
        marker = (("*" if group == "stage 1" else "D") if i == best[group] else "P" if i == best_div[group] else
                  "s" if i == 0 else "o")
        ax.errorbar(xm, ym, xerr=[[xm - xl], [xh - xm]], yerr=[[ym - yl], [yh - ym]], fmt=marker, color=color,
                    ms=10 if marker == "*" else 5, elinewidth=0.8, capsize=2)
    front = pareto_front(rs)
    ax.plot([rs[i]["steps_per_block"][0] for i in front], [rs[i]["exact_match"][0] for i in front], "-", color=color,
            lw=1, label=f"{group} (square: default sampler)")
ax.axhline(reference_em - 0.01, color="0.5", ls=":", lw=0.8, label="stage-1 default EM - 1 point")
ax.set_xlabel("decoder steps per block (mean)")
ax.set_ylabel("exact match (95 % CI, seeds x prompts)")
ax.set_title(f"sampler frontiers: pick + fill ({len(SEEDS)} seeds, {PER_TASK} prompts/task, K_max {K}, "
             f"{ITERATIONS} SD·RL it.)", fontsize=9)
ax.grid(alpha=0.3)
ax.legend(fontsize=7, loc="lower right")
fig.tight_layout()
fig.savefig(OUT / "frontiers.png", dpi=110)
plt.close(fig)

# %% [markdown]
# ## Diversity beside accuracy
# Per task, each summary row's per-position answer entropy across keys (bars, 95 % CI) against the data's value at
# the same K (black tick; the dashed tick is the diversity-keeping bar, 0.8 of it; the dotted tick the collapse
# threshold, half of it), and its distinct-answer rate against the data's.

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
width = 0.8 / len(table)
for j, s in enumerate(table):
    for t_i, t in enumerate(TASKS):
        d = s["diversity"][t]
        m, lo, hi = d["entropy_free_ci"]
        x = t_i + (j - (len(table) - 1) / 2) * width
        axes[0].bar(x, m, width, yerr=[[m - lo], [hi - m]], capsize=2, color=f"C{j}", label=s["row"] if t_i == 0
                    else None)
        axes[1].bar(x, d["distinct"], width, color=f"C{j}")
        for ax, v in ((axes[0], d["entropy_free_data"]), (axes[1], d["distinct_data"])):
            ax.plot([x - width / 2, x + width / 2], [v, v], "k-", lw=1.5)
        axes[0].plot([x - width / 2, x + width / 2], [d["entropy_free_data"] / 2] * 2, "k:", lw=1)
        axes[0].plot([x - width / 2, x + width / 2], [d["entropy_free_data"] * DIVERSITY_KEPT] * 2, "k--", lw=0.8)
for ax, label in zip(axes, (f"answer entropy per free position (nats, K = {KEYS})",
                            f"distinct answers / K (K = {KEYS})")):
    ax.set_xticks(range(len(TASKS)), TASKS)
    ax.set_ylabel(label)
    ax.grid(alpha=0.3, axis="y")
axes[0].set_title(f"black: the data's value; dashed: the diversity bar ({DIVERSITY_KEPT:g} of it); dotted: "
                  "collapse (half of it)", fontsize=8)
fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=7)
fig.tight_layout(rect=(0, 0.14, 1, 1))  # the legend below the panels, not over the bars
fig.savefig(OUT / "diversity.png", dpi=110)
plt.close(fig)
plots.show([OUT / "frontiers.png", OUT / "diversity.png"])

"""The SD·RL study's figures, written report (results.md) and verdict on its hypothesis (run.py here). Input: the
table of `dgemma.eval.study_report.summarize` and `evals` = {label: [evaluator result per seed]} as there.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["perm_diagnostics", "plots", "report", "verdict"]


def perm_diagnostics(held, res) -> dict:
    """PERM outputs of the diffusion decoding: mean validity, duplicate and missing digits (`dgemma.data.rewards`)."""
    from dgemma.data.rewards import perm_diagnostics as diag

    rows = res["diffusion"]["rows"]
    out = [diag(held.source[i], toks, held.tokenizer) for i, toks in zip(rows["index"], rows["output"])
           if held.source[i].task == "perm"]
    if not out:
        return {}
    return {k: float(np.mean([d[k] for d in out])) for k in out[0]}


def plots(out: Path, table: dict, histories: dict, evals: dict, max_steps: int) -> list[str]:
    """The study's figures in `out`; returns their file names. `histories` = {arm: [per-seed iteration metrics]}."""
    from dgemma.eval.plots import by_step, commitment_heatmap, tradeoff, training_curves

    files = []
    diff = {k: v["all"] for k, v in table.items() if not k.endswith(":ar")}
    tradeoff({k: {"x": v["steps_per_block"], "y": v["exact_match"]} for k, v in diff.items()}, "x", "y",
             out / "em_vs_steps.png", "exact match vs mean steps per block (all tasks)", "mean decoder steps per block",
             "exact match")
    tradeoff({k: {"x": v["all"]["tpf"], "y": v["all"]["exact_match"]} for k, v in table.items() if "all" in v}, "x",
             "y", out / "tpf_vs_em.png", "corpus tokens per forward vs exact match", "corpus tokens per forward",
             "exact match")
    files += ["em_vs_steps.png", "tpf_vs_em.png"]
    histories = {arm: [h for h in hs if h] for arm, hs in histories.items()}  # no record: nothing to plot
    histories = {arm: hs for arm, hs in histories.items() if hs}
    if histories:
        runs = {}
        for arm, hs in histories.items():  # mean over seeds per iteration
            n = min(len(h) for h in hs)
            runs[arm] = [{"step": i + 1, **{k: float(np.mean([h[i].get(k, np.nan) for h in hs]))
                                             for k in ("reward", "k_max", "steps_per_block", "tpf")}}
                         for i in range(n)]
        training_curves(runs, ["reward", "k_max", "steps_per_block", "tpf"], out / "iterations.png",
                        "SD·RL training rollouts (mean over seeds)")
        series = {}
        for arm, hs in histories.items():
            for tag, idx in (("first", 0), ("last", -1)):
                series[f"{arm} ({tag} iteration)"] = {
                    k: [float(np.mean([h[idx].get(f"{k}_step{j}", np.nan) for h in hs])) for j in range(1, 7)]
                    for k in ("entropy", "accept_frac")}
        by_step(series, ["entropy", "accept_frac"], out / "per_step_train.png",
                "training rollouts: mean entropy and accept fraction at steps 1-6")
        files += ["iterations.png", "per_step_train.png"]
    eval_series = {k: {"entropy": list(np.nanmean([e["diffusion"]["entropy_per_step"] for e in v], 0))}
                   for k, v in evals.items() if not k.endswith(":ar")}
    by_step(eval_series, ["entropy"], out / "per_step_eval.png", "held-out decoding: mean entropy by step (K_max)")
    files.append("per_step_eval.png")
    for label, per_seed in evals.items():
        if label.endswith(":ar"):
            continue
        commit = np.concatenate([np.asarray(e["diffusion"]["commit_step"]) for e in per_seed])
        commitment_heatmap(commit, max_steps, out / f"commitment_{label}.png", f"{label}: commit step per position")
        files.append(f"commitment_{label}.png")
    return files


def report(meta: dict, table: dict, tasks: list[str], held_summary: str, perm: dict,
           retention: dict | None = None) -> str:
    """results.md: what ran, the decoding settings, one table per task, PERM diagnostics, the verdict."""
    from dgemma.eval.stats import fmt_ci

    lines = ["# E2: SD·RL study results", "", f"machine: {meta['machine']}", "",
             "## What ran", "", *[f"- {k}: {v}" for k, v in meta["ran"].items()], "",
             "## Decoding settings", "", f"- {meta['settings']['diffusion']}", f"- {meta['settings']['ar']}", "",
             f"Held-out: {held_summary}", ""]
    base = table.get("stage1", {})
    for task in [*tasks, "all"]:
        lines += [f"## {task}", "", "| model | mode | EM [95% CI] | steps/block [95% CI] | Δ steps vs stage 1 | "
                  "corpus TPF [CI] | TPF incl. commits | n |", "|---|---|---|---|---|---|---|---|"]
        for label, entry in table.items():
            if task not in entry:
                continue
            d = entry[task]
            mode = "AR (greedy)" if label.endswith(":ar") else f"diffusion (argmax, K_max {meta['kmax']})"
            steps = fmt_ci(d["steps_per_block"], 2) if "steps_per_block" in d else "–"
            delta = "–"
            if "steps_per_block" in d and task in base and label != "stage1":
                delta = f"{100 * (d['steps_per_block'][0] / base[task]['steps_per_block'][0] - 1):+.0f} %"
            lines.append(f"| {label.removesuffix(':ar')} | {mode} | {fmt_ci(d['exact_match'])} | {steps} | {delta} | "
                         f"{fmt_ci(d['tpf'], 2)} | {d['tpf_total'][0]:.2f} | {d['n']} |")
        lines.append("")
    lines += ["Per-row mean TPF (secondary; over-weights short answers): " +
              ", ".join(f"{k} {v['tpf_row_mean']:.2f}" for k, v in table.items()), ""]
    if perm:
        lines += ["## E2c: PERM diagnostics (diffusion outputs)", "",
                  *[f"- {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in d.items()) for label, d in perm.items()],
                  ""]
    if retention:
        lines += ["## Retention: tasks stage 2 does not train (EM change vs stage 1, paired 95 % CI)", "",
                  "| model | task | diffusion Δ EM | AR Δ EM |", "|---|---|---|---|"]
        for label, per_task in retention.items():
            for task, d in per_task.items():
                cells = [f"{100 * d[m]['delta_em'][0]:+.1f} pts [{100 * d[m]['delta_em'][1]:+.1f}, "
                         f"{100 * d[m]['delta_em'][2]:+.1f}] ({d[m]['verdict']})" for m in ("diffusion", "ar")]
                lines.append(f"| {label} | {task} | {cells[0]} | {cells[1]} |")
        lines.append("")
    lines += ["## Hypothesis (>= 30 % fewer steps per block at EM >= stage 1 - 1 point)", "", meta["verdict"], ""]
    return "\n".join(lines)


def verdict(table: dict, tasks: list[str]) -> str:
    """SD·RL (or + curriculum) cuts mean steps per block by >= 30 % vs stage 1 on every task, at EM >= stage 1 - 1
    point on every task (point estimates; the tables give the CIs)."""
    base = table.get("stage1")
    out = []
    for arm in ("sdrl", "sdrl_curriculum", "sd_only", "rl_only"):
        if arm not in table or base is None:
            continue
        present = [t for t in tasks if t in table[arm] and t in base]
        cuts = {t: 1 - table[arm][t]["steps_per_block"][0] / base[t]["steps_per_block"][0] for t in present}
        drops = {t: table[arm][t]["exact_match"][0] - base[t]["exact_match"][0] for t in present}
        ok = bool(present) and all(cuts[t] >= 0.30 and drops[t] >= -0.01 for t in present)
        cut_all = 1 - table[arm]["all"]["steps_per_block"][0] / base["all"]["steps_per_block"][0]
        per_task = ", ".join(f"{t} {100 * -cuts[t]:+.0f} %" for t in present)
        out.append(f"- {arm}: steps per block vs stage 1 {per_task} (all {100 * -cut_all:+.0f} %; target <= -30 % on "
                   "every task); EM change " + ", ".join(f"{t} {100 * v:+.1f} pts" for t, v in drops.items())
                   + f" -> {'meets' if ok else 'does NOT meet'} the target (point estimates; see CIs above)")
    return "\n".join(out) or "no arm ran"

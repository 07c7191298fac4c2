"""The LoRA study's figure and results.md (`dgemma.train.lora_study`; table from `dgemma.eval.study_report.summarize`
plus per-arm `trainable`, `seconds_per_iteration` and per-task `entropy_free` / `entropy_free_data`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["plots", "report", "overlap"]


def overlap(a: tuple, b: tuple) -> bool:
    """Whether two (mean, lo, hi) intervals overlap."""
    return not (a[2] < b[1] or b[2] < a[1])


def plots(out: Path, table: dict, tasks: list[str], arms: list[str]) -> list[str]:
    """One figure: per task, exact match and steps per block per arm, mean with its 95 % CI; returns file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in arms if a in table]
    fig, axes = plt.subplots(2, len(tasks), figsize=(4.5 * len(tasks), 6.5), squeeze=False)
    for j, task in enumerate(tasks):
        for i, (metric, name) in enumerate((("exact_match", "exact match"), ("steps_per_block", "steps per block"))):
            ax = axes[i][j]
            shown = [a for a in arms if task in table[a] and metric in table[a][task]]
            ci = np.array([table[a][task][metric] for a in shown], float).reshape(-1, 3)
            x = np.arange(len(shown))
            colors = ["0.5" if a == "stage1" else "C3" if a == "full" else "C0" if a.endswith("_attn") else "C2"
                      for a in shown]
            ax.bar(x, ci[:, 0], color=colors, yerr=[ci[:, 0] - ci[:, 1], ci[:, 2] - ci[:, 0]], capsize=3)
            ax.set_xticks(x, shown, rotation=45, ha="right", fontsize=8)
            ax.set_title(f"{task}: {name}", fontsize=10)
            if ci.size:
                ax.axhline(ci[0, 0] if shown[0] == "stage1" else np.nan, color="0.3", lw=0.8, ls="--")
    fig.suptitle("SD·RL: full parameters (red) vs LoRA attention-only (blue) / + MLP & experts (green); 95 % CI",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "lora_arms.png", dpi=110)
    plt.close(fig)
    return ["lora_arms.png"]


def _fmt(ci, digits=3) -> str:
    from dgemma.eval.stats import fmt_ci

    return fmt_ci(tuple(ci), digits)


def report(meta: dict, table: dict, tasks: list[str], held_summary: str) -> str:
    """results.md: what ran, decoding settings, one table per task, and the experts' adapters' effect by rank."""
    lines = ["# LoRA study: SD·RL with adapters vs full parameters", "", f"machine: {meta['machine']}", "",
             "## What ran", "", *[f"- {k}: {v}" for k, v in meta["ran"].items()], "",
             "## Decoding settings (every row)", "", f"- {meta['settings']}", "", f"Held-out: {held_summary}", ""]
    arms = [a for a in meta["arms"] if a in table]
    for task in tasks:
        lines += [f"## {task}", "", "| arm | trainable params | s / iteration | EM [95% CI] | steps/block [95% CI] | "
                  "answer entropy (data) | n |", "|---|---|---|---|---|---|---|"]
        for arm in arms:
            d = table[arm].get(task)
            if d is None:
                continue
            ent = f"{d['entropy_free']:.3f} ({d['entropy_free_data']:.3f})" if "entropy_free" in d else "–"
            spi = table[arm]["seconds_per_iteration"]
            lines.append(f"| {arm} | {table[arm]['trainable']:,} | {spi:.1f} | {_fmt(d['exact_match'])} | "
                         f"{_fmt(d['steps_per_block'], 2)} | {ent} | {d['n']} |")
        lines.append("")
    lines += ["## Frozen base", "",
              "Stage-1 parameter leaves that differ after training, per seed (a LoRA arm must show 0):",
              "", *[f"- {a}: {table[a].get('base_leaves_changed')}" for a in arms if a != "stage1"], ""]
    lines += ["## What the experts' adapters add (r<R>_all vs r<R>_attn; CIs overlap = no measurable difference)", "",
              *experts_effect(table, tasks, arms), ""]
    return "\n".join(lines)


def experts_effect(table: dict, tasks: list[str], arms: list[str]) -> list[str]:
    """One line per rank that has both target sets, per task: the differences of the means and whether CIs overlap."""
    out = []
    ranks = sorted({a[1:].partition("_")[0] for a in arms if a.startswith("r")}, key=int)
    for r in ranks:
        a, b = f"r{r}_attn", f"r{r}_all"
        if a not in table or b not in table:
            continue
        for task in tasks:
            if task not in table[a] or task not in table[b]:
                continue
            parts = []
            for metric, name, dg in (("exact_match", "EM", 3), ("steps_per_block", "steps/block", 2)):
                x, y = table[a][task][metric], table[b][task][metric]
                parts.append(f"{name} {y[0] - x[0]:+.{dg}f} ({'CIs overlap' if overlap(x, y) else 'CIs disjoint'})")
            out.append(f"- rank {r}, {task}: " + ", ".join(parts))
    return out or ["- no rank ran with both target sets"]

"""The LoRA study's figure and results.md (run.py here; table from `dgemma.eval.study_report.summarize`
plus per-arm `trainable`, `seconds_per_iteration` and per-task `entropy_free` / `entropy_free_data`; `meta["arm_lr"]`
holds each arm's optim.lr, which the lr control's comparison reads)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["FIGURE", "experts_effect", "lr_control", "overlap", "plots", "report"]

FIGURE = "lora_arms.png"


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
            colors = ["0.5" if a == "stage1" else "C3" if a == "full" else "C1" if a.startswith("full_lr")
                      else "C0" if a.endswith("_attn") else "C2" for a in shown]
            ax.bar(x, ci[:, 0], color=colors, yerr=[ci[:, 0] - ci[:, 1], ci[:, 2] - ci[:, 0]], capsize=3)
            ax.set_xticks(x, shown, rotation=45, ha="right", fontsize=8)
            ax.set_title(f"{task}: {name}", fontsize=10)
            if ci.size:
                ax.axhline(ci[0, 0] if shown[0] == "stage1" else np.nan, color="0.3", lw=0.8, ls="--")
    fig.suptitle("SD·RL: full parameters (red; at the adapters' lr: orange) vs LoRA attention-only (blue) / "
                 "+ MLP & experts (green); 95 % CI", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / FIGURE, dpi=110)
    plt.close(fig)
    return [FIGURE]


def _fmt(ci, digits=3) -> str:
    from dgemma.eval.stats import fmt_ci

    return fmt_ci(tuple(ci), digits)


def report(meta: dict, table: dict, tasks: list[str], held_summary: str, *, figure_dir: str = ".") -> str:
    """results.md: what ran, the figure (linked at `figure_dir`/FIGURE, relative to the results.md written), decoding
    settings, one table per task, the experts' adapters' effect by rank and the lr control's comparisons."""
    link = FIGURE if figure_dir in ("", ".") else f"{Path(figure_dir).as_posix()}/{FIGURE}"
    lines = ["# LoRA study: SD·RL with adapters vs full parameters", "", f"machine: {meta['machine']}", "",
             "## What ran", "", *[f"- {k}: {v}" for k, v in meta["ran"].items()], "",
             f"![steps per block and exact match per arm]({link})", "",
             "## Decoding settings (every row)", "", f"- {meta['settings']}", "", f"Held-out: {held_summary}", ""]
    arms = [a for a in meta["arms"] if a in table]
    lrs = meta.get("arm_lr", {})
    for task in tasks:
        lines += [f"## {task}", "", "| arm | optim.lr | trainable params | s / iteration | EM [95% CI] | "
                  "steps/block [95% CI] | answer entropy (data) | n |", "|---|---|---|---|---|---|---|---|"]
        for arm in arms:
            d = table[arm].get(task)
            if d is None:
                continue
            ent = f"{d['entropy_free']:.3f} ({d['entropy_free_data']:.3f})" if "entropy_free" in d else "–"
            spi = table[arm]["seconds_per_iteration"]
            lr = f"{lrs[arm]:g}" if arm in lrs else "–"
            lines.append(f"| {arm} | {lr} | {table[arm]['trainable']:,} | {spi:.1f} | {_fmt(d['exact_match'])} | "
                         f"{_fmt(d['steps_per_block'], 2)} | {ent} | {d['n']} |")
        lines.append("")
    lines += ["## Frozen base", "",
              "Stage-1 parameter leaves that differ after training, per seed (a LoRA arm must show 0):",
              "", *[f"- {a}: {table[a].get('base_leaves_changed')}" for a in arms if a != "stage1"], ""]
    lines += ["## What the experts' adapters add (r<R>_all vs r<R>_attn; CIs overlap = no measurable difference)", "",
              *experts_effect(table, tasks, arms), ""]
    lines += ["## The lr control (full_lr<lr> vs full: the step size alone; vs each adapter arm at the same lr: "
              "adapters vs full parameters at matched lr; CIs overlap = no measurable difference)", "",
              *lr_control(table, tasks, arms, lrs), ""]
    return "\n".join(lines)


def _differences(x_row: dict, y_row: dict) -> str:
    """'EM ..., steps/block ...': y minus x, and whether the two 95 % CIs overlap."""
    parts = []
    for metric, name, dg in (("exact_match", "EM", 3), ("steps_per_block", "steps/block", 2)):
        x, y = x_row[metric], y_row[metric]
        parts.append(f"{name} {y[0] - x[0]:+.{dg}f} ({'CIs overlap' if overlap(x, y) else 'CIs disjoint'})")
    return ", ".join(parts)


def lr_control(table: dict, tasks: list[str], arms: list[str], lrs: dict) -> list[str]:
    """Per lr-control arm (full_lr<lr>) and task: its difference from `full`, then each adapter arm's difference from
    it where the two lrs agree in float32 (the precision the optimizer runs at)."""
    out = []
    for ctl in (a for a in arms if a.startswith("full_lr") and a in lrs):
        same_lr = [a for a in arms if a.startswith("r") and a in lrs and np.float32(lrs[a]) == np.float32(lrs[ctl])]
        for task in tasks:
            if task not in table[ctl]:
                continue
            if "full" in table and task in table["full"]:
                out.append(f"- {ctl} - full, {task}: " + _differences(table["full"][task], table[ctl][task]))
            out += [f"- {a} - {ctl}, {task}: " + _differences(table[ctl][task], table[a][task])
                    for a in same_lr if task in table[a]]
    return out or ["- no lr-control arm ran"]


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
            out.append(f"- rank {r}, {task}: " + _differences(table[a][task], table[b][task]))
    return out or ["- no rank ran with both target sets"]

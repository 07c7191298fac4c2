"""Plots for reports (matplotlib, Agg backend, PNG): training curves and metrics by noise level."""

from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def show(paths) -> None:
    """Print each PNG's path and size, and display it when running under a Jupyter kernel (the last cell of every
    notebook; in a plain `python notebook.py` run only the lines are printed)."""
    import sys

    paths = [Path(p) for p in paths]
    for p in paths:
        print(p, p.stat().st_size, "bytes")
    if "ipykernel" in sys.modules:
        from IPython.display import Image, display

        for p in paths:
            display(Image(filename=str(p)))


def _save(fig, path: str | Path) -> Path:
    """Lay out, write the PNG and free the figure (every plot here ends this way)."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)
    return Path(path)


def _panels(keys: list[str], xlabel: str, draw, path: str | Path, title: str) -> Path:
    """One panel per key; `draw(ax, key)` plots the lines. Shared layout, legend and PNG output."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        draw(ax, key)
        ax.set_title(key)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def training_curves(runs: dict[str, list[dict]], keys: list[str], path: str | Path, title: str = "") -> Path:
    """One panel per metric key; one line per run. `runs` maps a label to its metrics.jsonl rows."""

    def draw(ax, key):
        for label, rows in runs.items():
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if pts:
                ax.plot(*zip(*pts), label=label)

    return _panels(keys, "step", draw, path, title)


def by_noise_level(series: dict[str, dict[float, dict[str, float]]], keys: list[str], path: str | Path,
                   title: str = "") -> Path:
    """Metrics (e.g. nll, acc) against the noise level t; one line per model."""

    def draw(ax, key):
        for label, by_t in series.items():
            ts = sorted(by_t)
            ax.plot(ts, [by_t[t][key] for t in ts], marker="o", label=label)

    return _panels(keys, "noise level t (alpha = 1 - t)", draw, path, title)


def commitment_heatmap(commit_step, max_steps: int, path: str | Path, title: str = "") -> Path:
    """Position x step heatmap: share of (row, block) samples whose canvas position took its final value at a step.

    commit_step: [N, blocks, L] 1-based step of the final argmax value per position (0 = no diffusion: skipped).
    """
    import numpy as np

    plt = _plt()
    cs = np.asarray(commit_step).reshape(-1, np.asarray(commit_step).shape[-1])
    L = cs.shape[1]
    grid = np.zeros((max_steps, L))
    for p in range(L):
        steps = cs[:, p][cs[:, p] > 0]
        if steps.size:
            grid[:, p] = np.bincount(steps - 1, minlength=max_steps)[:max_steps] / steps.size
    # capped size and thinned ticks: at canvas 32 x K_max 48 the uncapped figure was 17 x 15 inches (seconds to save)
    fig, ax = plt.subplots(figsize=(min(0.45 * L + 2.5, 11.0), min(0.28 * max_steps + 1.5, 8.0)))
    im = ax.imshow(grid, aspect="auto", origin="lower", cmap="viridis")
    ax.set_xlabel("canvas position")
    ax.set_ylabel("denoising step at which the position committed")
    every = max(1, -(-max_steps // 24))
    ax.set_yticks(range(0, max_steps, every))
    ax.set_yticklabels(range(1, max_steps + 1, every), fontsize=7)
    fig.colorbar(im, ax=ax, label="share of samples")
    ax.set_title(title)
    return _save(fig, path)


def tradeoff(points: dict[str, dict[str, tuple[float, float, float]]], x: str, y: str, path: str | Path,
             title: str = "", xlabel: str | None = None, ylabel: str | None = None) -> Path:
    """One point per label with 95 % CI bars on both axes. points[label][x] = (mean, lo, hi), same for y.

    Used for the SD·RL study's trade-off curves: exact match vs mean steps per block, corpus TPF vs exact match."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.2, 4.0))
    for label, p in points.items():
        (xm, xl, xh), (ym, yl, yh) = p[x], p[y]
        ax.errorbar([xm], [ym], xerr=[[xm - xl], [xh - xm]], yerr=[[ym - yl], [yh - ym]], fmt="o", capsize=3,
                    label=label)
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel or y)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    return _save(fig, path)


def by_step(series: dict[str, dict[str, list[float]]], keys: list[str], path: str | Path, title: str = "") -> Path:
    """Per-denoising-step diagnostics (e.g. mean entropy and accept fraction at steps 1..k); one line per label.
    series[label][key] = values at steps 1, 2, ... (None / NaN where no block ran that step)."""

    def draw(ax, key):
        for label, d in series.items():
            vals = [float("nan") if v is None else v for v in d.get(key, [])]
            if vals:
                ax.plot(range(1, len(vals) + 1), vals, marker="o", label=label)

    return _panels(keys, "denoising step", draw, path, title)

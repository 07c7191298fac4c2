"""The tables of a model-comparison study: metrics with bootstrap CIs per model and task, forgetting on the tasks
stage 2 did not train, and what machine a result ran on (the SD·RL and LoRA studies under experiments/, the stage-1
ablations notebook; each study writes its own figures and results.md).

Input: `evals` = {label: [evaluator result per seed]}, where an evaluator result is what
`dgemma.eval.evaluator.evaluate` returns (one entry per decoding, keyed by mode) and a label ending in ":ar" reads its
"ar" decoding, every other label its "diffusion" decoding. The table holds, per label and task (and "all"), the
evaluator's metric names with 95 % bootstrap CIs over seeds, then prompts: `exact_match`, `steps_per_block`
(diffusion), `tpf`, `tpf_total`, and `n`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["machine_description", "retention", "summarize"]


def machine_description() -> str:
    """CPU model, cores, jax backend and version (what a recorded result ran on)."""
    import os
    import platform

    import jax

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, {jax.default_backend()} (jax {jax.__version__}), shared with other jobs"


def _mode(label: str) -> str:
    return "ar" if label.endswith(":ar") else "diffusion"


def summarize(evals: dict[str, list[dict]], tasks: list[str], retention: Sequence[str] = ()) -> dict:
    """Per label, per task: the metrics with 95 % bootstrap CIs (seeds, then prompts); `n` scored rows. "all" pools
    the rows of `tasks` only (retention tasks decoded beside them are summarized per task, not in "all")."""
    from dgemma.eval.stats import hierarchical_ci, ratio_ci

    table = {}
    tasks, stage2_tasks = list(tasks) + list(retention), list(tasks)
    for label, per_seed in evals.items():
        mode = _mode(label)
        rows = [e[mode]["rows"] for e in per_seed]
        entry: dict[str, Any] = {}  # task -> its metrics, and "tpf_row_mean"
        for task in [*tasks, "all"]:
            sel = [np.isin(np.asarray(r["task"]), [task] if task != "all" else stage2_tasks) for r in rows]
            if not all(s.any() for s in sel):
                continue

            def col(name, rows=rows, sel=sel):  # the selected rows' column, per seed
                return [np.asarray(r[name], float)[s] for r, s in zip(rows, sel)]

            d = {"exact_match": hierarchical_ci(col("reward")),
                 "tpf": ratio_ci(col("tokens"), col("forwards")),
                 "tpf_total": ratio_ci(col("tokens"), [f + c for f, c in zip(col("forwards"), col("commit_passes"))]),
                 "n": int(sum(s.sum() for s in sel))}
            if mode == "diffusion":
                d["steps_per_block"] = hierarchical_ci(col("steps_per_block"))
            entry[task] = d
        entry["tpf_row_mean"] = float(np.mean([e[mode]["metrics"]["tpf_row_mean"] for e in per_seed]))
        table[label] = entry
    return table


def retention(evals: dict[str, list[dict]], tasks: list[str], base: str = "stage1") -> dict:
    """Forgetting on the tasks stage 2 does not train: per model label (every label but `base`), per task, per mode
    ("diffusion", "ar"): EM change vs `base` as (mean, lo, hi), a paired 95 % bootstrap over seeds, then prompts
    (seed s's model and `base` decoded with the same key on the same prompts), and a verdict: "kept" (mean change
    >= -1 point), "forgotten" (below -1 point with the whole CI below 0) or "unclear"."""
    from dgemma.eval.stats import hierarchical_ci

    out: dict = {}
    for label, per_seed in evals.items():
        if label.endswith(":ar") or label == base or base not in evals:
            continue
        for task in tasks:
            for mode, key in (("diffusion", label), ("ar", f"{label}:ar")):
                ref, rows = evals[f"{base}:ar" if mode == "ar" else base], evals[key]
                diffs = []
                for a, b in zip(rows, ref):
                    ra, rb = _by_index(a[mode]["rows"], task), _by_index(b[mode]["rows"], task)
                    if ra.keys() != rb.keys() or not ra:
                        raise ValueError(f"retention: {label} and {base} decoded other {task} prompts")
                    diffs.append([ra[i] - rb[i] for i in sorted(ra)])
                m, lo, hi = hierarchical_ci(diffs)
                verdict = "kept" if m >= -0.01 else ("forgotten" if hi < 0 else "unclear")
                out.setdefault(label, {}).setdefault(task, {})[mode] = {"delta_em": (m, lo, hi), "verdict": verdict}
    return out


def _by_index(rows: dict, task: str) -> dict[int, float]:
    return {int(i): float(r) for i, t, r in zip(rows["index"], rows["task"], rows["reward"]) if t == task}

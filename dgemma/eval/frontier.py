"""The sampler frontier of one checkpoint: steps per block against exact match over the sampler's settings.

A step-distillation claim is a claim against the best *sampler-only* setting: the same checkpoint, decoded with
another entropy bound, other temperatures, another step limit K_max, accept rule or stop rule, with no training. This
module sweeps those settings (`grid`), decodes the held-out prompts with each through the one evaluator
(`dgemma.eval.evaluator.evaluate`, diffusion mode) once per seed (sampler key 1000 + seed, as the SD·RL study),
and returns one row per setting:

    settings          the SamplerConfig fields the row changes from the base sampler ({} = the base itself)
    label, text       a short name and `decoding_settings` (how it decoded, in words)
    exact_match       (mean, lo, hi): 95 % bootstrap CI over seeds, then prompts (`dgemma.eval.stats`)
    steps_per_block   (mean, lo, hi) of the mean decoder steps per (row, block)
    tpf               (Σ tokens / Σ forwards, lo, hi): corpus tokens per forward
    per_task          {task: {"exact_match": ci, "steps_per_block": ci}}
    seeds, n          the seeds and the scored rows per seed

`pareto_front(rows)` is the set of rows no other row beats on both axes (fewer steps per block and at least the exact
match, or the same steps and more exact match), sorted by steps; `best_sampler_only(rows)` is the row with the
fewest steps whose mean exact match is within `tolerance` (1 point) of the base sampler's: the fair baseline row by
exact match alone. `best_keeping_diversity(rows)` is the same choice among the rows that keep the data's diversity
(`keeps_diversity`: per-position answer entropy >= `DIVERSITY_KEPT` of the data's on every many-answer task): the
baseline that does not buy its steps with collapse.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["DIVERSITY_KEPT", "around", "best_keeping_diversity", "best_sampler_only", "diversity_kept", "grid",
           "keeps_diversity", "pareto_front", "plot_frontier", "row_label", "sweep", "table_md", "versus"]

# A row "keeps the data's diversity" when its mean per-position answer entropy at free positions is at least this
# fraction of the data's on every many-answer task. Why 0.8: the data's value is the exact expected plug-in entropy at
# the same K keys (bias-matched), so a sampler that draws from the data's distribution reads ~1.0, and the stage-1
# default sampler reads 0.93 (pick) / 0.99 (fill) on the shipped many-answer checkpoint; the 95 % CI of that mean over
# 16 prompts is about +-3-5 % of the data's, so 0.8 leaves room for this noise and for the mild sharpening of a lower
# temperature, while it rejects the halving the collapse flag reports (`dgemma.eval.diversity.COLLAPSE_RATIO`, 0.5)
# and the partial loss (0.5-0.8) in between: a baseline below it is faster partly because it answers fewer different
# ways, and beating it would credit stage 2 with a speed that the sampler bought with diversity.
DIVERSITY_KEPT = 0.8

# the sweep axes, each a SamplerConfig field (temperatures are one axis: the (t_max, t_min) pair)
AXES = ("accept", "entropy_bound", "accept_confidence", "temperatures", "max_steps", "stability_threshold",
        "confidence_threshold", "greedy")


def grid(*, accept: Sequence[str] = ("entropy_bound",), entropy_bound: Sequence[float] = (0.1,),
         accept_confidence: Sequence[float] = (0.9,), temperatures: Sequence[tuple[float, float]] = ((0.8, 0.4),),
         max_steps: Sequence[int] = (48,), stability_threshold: Sequence[int] = (1,),
         confidence_threshold: Sequence[float] = (0.005,), greedy: Sequence[bool] = (False,)) -> list[dict]:
    """The full product of the axes as a list of SamplerConfig changes. `entropy_bound` varies only under the
    entropy-bound accept rule and `accept_confidence` only under the confidence rule (the other rules ignore it), so
    a rule contributes only the settings that decode differently."""
    out = []
    for rule in accept:
        gammas = entropy_bound if rule == "entropy_bound" else (None,)
        confs = accept_confidence if rule == "confidence" else (None,)
        for g, p, (t_hi, t_lo), k, s, c, gr in itertools.product(gammas, confs, temperatures, max_steps,
                                                                  stability_threshold, confidence_threshold, greedy):
            d = {"accept": rule, "t_max": float(t_hi), "t_min": float(t_lo), "max_steps": int(k),
                 "stability_threshold": int(s), "confidence_threshold": float(c), "greedy": bool(gr)}
            if g is not None:
                d["entropy_bound"] = float(g)
            if p is not None:
                d["accept_confidence"] = float(p)
            out.append(d)
    return out


def around(base, *, entropy_bound: Sequence[float] = (), temperatures: Sequence[tuple[float, float]] = (),
           max_steps: Sequence[int] = (), stability_threshold: Sequence[int] = (),
           accept_confidence: Sequence[float] = (), fixed_count_steps: Sequence[int] = ()) -> list[dict]:
    """The frontier sweep around the sampler `base` (a SamplerConfig, entropy-bound rule): the `entropy_bound` x
    `temperatures` product at the base's K_max and stop rule, then one axis at a time with everything else at the
    base: K_max (`max_steps`; note that it also rescales the temperature schedule, whose denominator it is),
    stability S, the confidence accept rule at each `accept_confidence`, the fixed-count rule at each K_max of
    `fixed_count_steps` (ceil(L / K_max) positions per step). An empty axis adds nothing (an empty γ or τ list
    falls back to the base's value). Deduplicated by label, in that order, without the base setting itself (a
    sweep's default row)."""
    if base.accept != "entropy_bound":
        raise ValueError(f"around: base.accept = {base.accept!r}; the sweep is centred on the entropy_bound rule")
    temps = [(base.t_max, base.t_min)]
    common = dict(max_steps=[base.max_steps], stability_threshold=[base.stability_threshold],
                  confidence_threshold=[base.confidence_threshold], greedy=[base.greedy])
    gamma = [base.entropy_bound]
    out = grid(entropy_bound=list(entropy_bound) or gamma, temperatures=list(temperatures) or temps, **common)
    out += grid(entropy_bound=gamma, temperatures=temps, **{**common, "max_steps": list(max_steps)})
    out += grid(entropy_bound=gamma, temperatures=temps, **{**common, "stability_threshold": list(stability_threshold)})
    out += grid(accept=["confidence"], accept_confidence=list(accept_confidence), temperatures=temps, **common)
    out += grid(accept=["fixed_count"], temperatures=temps, **{**common, "max_steps": list(fixed_count_steps)})
    seen, kept = {row_label(grid(entropy_bound=gamma, temperatures=temps, **common)[0])}, []
    for s in out:
        label = row_label(s)
        if label not in seen:
            seen.add(label)
            kept.append(s)
    return kept


def row_label(settings: dict) -> str:
    """A short name of a setting, e.g. 'eb g=0.3 t=0.8>0.4 K=48 S=1 c=0.005'."""
    if not settings:
        return "default"
    rule = {"entropy_bound": "eb", "confidence": "conf", "fixed_count": "fixed"}.get(settings.get("accept", ""), "?")
    parts = [rule]
    if "entropy_bound" in settings:
        parts.append(f"g={settings['entropy_bound']:g}")
    if "accept_confidence" in settings:
        parts.append(f"p={settings['accept_confidence']:g}")
    if "t_max" in settings:
        parts.append(f"t={settings['t_max']:g}>{settings['t_min']:g}")
    for key, short in (("max_steps", "K"), ("stability_threshold", "S"), ("confidence_threshold", "c")):
        if key in settings:
            parts.append(f"{short}={settings[key]:g}")
    if settings.get("greedy"):
        parts.append("greedy")
    return " ".join(parts)


def sweep(model, held_out, sampler, settings: Sequence[dict], seeds: Sequence[int] = (0, 1, 2), *,
          include_default: bool = True, progress=None, row_metrics: dict | None = None, diversity: bool = False,
          collapse_ratio: float = 0.5, diversity_keys: int = 3, **evaluate_kw) -> list[dict]:
    """One row per setting (module docstring); the base sampler `sampler` (a run config's section or a
    SamplerConfig) is the first row when `include_default`. `progress(row)` is called after each row.
    `model` is one model, or a list of one model per seed (a trained arm: seed s's model, e.g. the params of its
    SD·RL run, decoded with key 1000 + s), so a trained arm's row has a CI over training seeds.
    `row_metrics` {name: fn(example, output token ids, tokenizer) -> float} adds each as a CI over seeds and
    prompts (e.g. a partial-credit score such as `dgemma.data.rewards.agree_word_validity`). `diversity` adds
    "diversity": {task: measures} of the many-answer tasks (`dgemma.eval.diversity`; `collapse` below
    `collapse_ratio` of the data's entropy): for one model the seeds' keys are the K keys (`measure_rows`); for one
    model per seed each model is decoded under `diversity_keys` keys (its seed's key, then fold_in(that key, k) for
    k = 1, 2, ...), measured over its own keys and pooled over the models (`pool_models`)."""
    import jax

    from dgemma.eval.evaluator import Decoding, decoding_settings, evaluate
    from dgemma.eval.stats import hierarchical_ci, ratio_ci
    from dgemma.inference.sampler_types import SamplerConfig

    if not seeds:
        raise ValueError("sweep: seeds must name at least one seed")
    models = list(model) if isinstance(model, (list, tuple)) else None
    if models is not None and len(models) != len(seeds):
        raise ValueError(f"sweep: {len(models)} models for {len(seeds)} seeds; pass one model, or one per seed")
    if models is not None and diversity and diversity_keys < 2:
        raise ValueError(f"sweep: diversity_keys = {diversity_keys}; need >= 2 decodings per model")
    model_of = (lambda i: models[i]) if models is not None else (lambda i: model)
    diff = (Decoding("diffusion", "diffusion"),)
    base = SamplerConfig.from_section(sampler)
    todo: list[dict[str, Any]] = [{}] if include_default else []
    todo += [dict(s) for s in settings]
    rows = []
    for change in todo:
        unknown = sorted(set(change) - {f.name for f in dataclasses.fields(SamplerConfig)})
        if unknown:
            raise ValueError(f"sweep: settings {unknown} are not SamplerConfig fields")
        cfg = base.replace(**change)
        per_seed = [evaluate(model_of(i), held_out, cfg, diff, key=jax.random.key(1000 + int(s)),
                             **evaluate_kw)["diffusion"] for i, s in enumerate(seeds)]
        rs = [e["rows"] for e in per_seed]

        def col(name, task=None, rs=rs):
            return [np.asarray(r[name], np.float64)[np.asarray(r["task"]) == task] if task else
                    np.asarray(r[name], np.float64) for r in rs]

        tasks = sorted(set(rs[0]["task"]))
        row = {"settings": change, "label": row_label(change), "text": decoding_settings(cfg, "diffusion"),
               "exact_match": hierarchical_ci(col("reward")), "steps_per_block": hierarchical_ci(col("steps_per_block")),
               "tpf": ratio_ci(col("tokens"), col("forwards")),
               "pct_max_steps": float(np.mean([e["metrics"]["pct_max_steps"] for e in per_seed])),
               "per_task": {t: {"exact_match": hierarchical_ci(col("reward", t)),
                                "steps_per_block": hierarchical_ci(col("steps_per_block", t))} for t in tasks},
               "seeds": [int(s) for s in seeds], "n": int(len(rs[0]["reward"]))}
        for name, fn in (row_metrics or {}).items():
            row[name] = hierarchical_ci([[fn(held_out.source[int(i)], out, held_out.tokenizer)
                                          for i, out in zip(r["index"], r["output"])] for r in rs])
        if diversity:
            from dgemma.eval.diversity import measure_rows, pool_models

            if models is None:
                row["diversity"] = measure_rows(held_out, rs, collapse_ratio=collapse_ratio)
            else:  # each model over its own keys: the spread between training seeds is not diversity
                row["diversity"] = pool_models([measure_rows(held_out, [r, *(
                    evaluate(models[i], held_out, cfg, diff, key=jax.random.fold_in(jax.random.key(1000 + int(s)), k),
                             **evaluate_kw)["diffusion"]["rows"] for k in range(1, diversity_keys))],
                    collapse_ratio=collapse_ratio) for i, (s, r) in enumerate(zip(seeds, rs))],
                    collapse_ratio=collapse_ratio)
        rows.append(row)
        if progress is not None:
            progress(row)
    return rows


def _point(v) -> float:
    return float(v[0]) if isinstance(v, (tuple, list)) else float(v)


def pareto_front(rows: Sequence[dict], x: str = "steps_per_block", y: str = "exact_match") -> list[int]:
    """Indices of the rows on the frontier (fewer `x` is better, more `y` is better; mean values), sorted by `x`.
    A row is on it iff no other row has x <= its x and y >= its y with one of them strict. Along the returned
    order x and y rise (y strictly, except between identical points). Rows with a NaN are never on it."""
    pts = [(_point(r[x]), _point(r[y])) for r in rows]
    order = sorted((i for i, (a, b) in enumerate(pts) if np.isfinite(a) and np.isfinite(b)),
                   key=lambda i: (pts[i][0], -pts[i][1]))
    front, best_y = [], -np.inf
    for i in order:
        if pts[i][1] > best_y:  # strictly better than every row at fewer (or equal) steps
            front.append(i)
            best_y = pts[i][1]
        elif front and pts[i] == pts[front[-1]]:  # a tie with a frontier row: neither dominates the other
            front.append(i)
    return front


def best_sampler_only(rows: Sequence[dict], *, default: int = 0, tolerance: float = 0.01,
                      reference: float | None = None) -> int | None:
    """Index of the row with the fewest mean steps per block whose mean exact match is >= the `default` row's minus
    `tolerance` (ties: the higher exact match). The default row itself qualifies, so there is always an answer.
    With `reference` (an exact match from elsewhere, e.g. stage 1's default row when `rows` are a trained arm's
    frontier) the rows are held to it instead, and None says that no row comes within `tolerance` of it."""
    ok = _within_em(rows, default, tolerance, reference)
    if not ok:
        return None
    return min(ok, key=lambda i: (_point(rows[i]["steps_per_block"]), -_point(rows[i]["exact_match"])))


def _within_em(rows: Sequence[dict], default: int, tolerance: float, reference: float | None) -> list[int]:
    """Indices of the rows with finite steps whose mean exact match is >= the reference (the `default` row's, or
    `reference`) minus `tolerance`: the candidates of both baseline rules."""
    ref = (_point(rows[default]["exact_match"]) if reference is None else float(reference)) - tolerance
    return [i for i, r in enumerate(rows) if _point(r["exact_match"]) >= ref - 1e-12
            and np.isfinite(_point(r["steps_per_block"]))]


def _all_kept(ratios: dict[str, float], kept: float) -> bool:
    return all(r >= kept - 1e-12 for r in ratios.values())  # NaN fails


def diversity_kept(row: dict, *, where: str = "row") -> dict[str, float]:
    """{task: the row's per-position entropy at free positions / the data's} for every many-answer task the row
    measured (`sweep(diversity=True)`); a task whose data entropy is 0 or NaN (no free choice) is left out."""
    div = row.get("diversity")
    if not isinstance(div, dict):
        raise ValueError(f"{where}.diversity: missing; sweep with diversity=True to choose by diversity")
    out = {}
    for task, d in div.items():
        h, h_data = float(d["entropy_free"]), float(d["entropy_free_data"])
        if np.isfinite(h_data) and h_data > 0:
            out[task] = h / h_data if np.isfinite(h) else float("nan")
    return out


def keeps_diversity(row: dict, *, kept: float = DIVERSITY_KEPT, where: str = "row") -> bool:
    """True when the row's entropy is >= `kept` x the data's on every many-answer task it measured (NaN fails)."""
    return _all_kept(diversity_kept(row, where=where), kept)


def best_keeping_diversity(rows: Sequence[dict], *, default: int = 0, tolerance: float = 0.01,
                           reference: float | None = None, kept: float = DIVERSITY_KEPT) -> int | None:
    """`best_sampler_only` among the rows that keep the data's diversity (`keeps_diversity` at `kept`): the row with
    the fewest mean steps per block whose mean exact match is >= the `default` row's (or `reference`) minus
    `tolerance` and whose entropy per free position is >= `kept` x the data's on every task. Ties on steps: the
    higher exact match, then the higher lowest entropy ratio over the tasks, then the earlier row. None when no row
    qualifies (the default row too is held to the diversity bar). Every row must carry `diversity`."""
    if not 0.0 < kept <= 1.0:
        raise ValueError(f"best_keeping_diversity: kept = {kept}; expected a fraction in (0, 1]")
    ratios = [diversity_kept(r, where=f"rows[{i}]") for i, r in enumerate(rows)]
    ok = [i for i in _within_em(rows, default, tolerance, reference) if _all_kept(ratios[i], kept)]
    if not ok:
        return None
    return min(ok, key=lambda i: (_point(rows[i]["steps_per_block"]), -_point(rows[i]["exact_match"]),
                                  -min(ratios[i].values(), default=np.inf), i))


def versus(row: dict, baseline: dict, *, reference: float | None = None, tolerance: float = 0.01) -> str:
    """How `row` (e.g. a trained arm) stands against `baseline` (the best sampler-only row), the stage-2 claim:
    "EM below" when its mean exact match is more than `tolerance` under `reference` (default: the baseline's);
    otherwise "fewer steps" / "more steps" when its 95 % CI of steps per block lies wholly below / above the
    baseline's, and "same steps (CIs overlap)" when the intervals overlap."""
    ref = _point(baseline["exact_match"]) if reference is None else float(reference)
    if _point(row["exact_match"]) < ref - tolerance - 1e-12:
        return "EM below"
    (_, lo, hi), (_, base_lo, base_hi) = row["steps_per_block"], baseline["steps_per_block"]
    return "fewer steps" if hi < base_lo else "more steps" if lo > base_hi else "same steps (CIs overlap)"


def plot_frontier(rows: Sequence[dict], path, *, title: str = "", default: int = 0, y: str = "exact_match") -> str:
    """`y` (exact match, or a `row_metrics` name) against steps per block with the CIs, the frontier on those two
    axes as a line, the default and the best sampler-only row (by exact match) marked; written to `path` (PNG).
    Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    front = pareto_front(rows, y=y)
    best = best_sampler_only(rows, default=default)
    if best is None:  # the default row's exact match or steps are NaN (a TypeError, as indexing the rows with None was)
        raise TypeError(f"plot_frontier: no best sampler-only row to mark (no row with finite steps per block comes "
                        f"within 0.01 of the exact match of the default row {default})")
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for i, r in enumerate(rows):
        (xm, xl, xh), (ym, yl, yh) = r["steps_per_block"], r[y]
        color = "tab:red" if i == default else "tab:green" if i == best else "tab:blue" if i in front else "0.6"
        ax.errorbar(xm, ym, xerr=[[xm - xl], [xh - xm]], yerr=[[ym - yl], [yh - ym]], fmt="o", ms=4, color=color,
                    elinewidth=0.8, capsize=2)
    ax.plot([_point(rows[i]["steps_per_block"]) for i in front], [_point(rows[i][y]) for i in front],
            "-", color="tab:blue", lw=1, label="frontier")
    for i, name in ((default, "default"), (best, "best within 1 pt")):
        ax.annotate(f"{name}: {rows[i]['label']}", (_point(rows[i]["steps_per_block"]), _point(rows[i][y])),
                    fontsize=7, xytext=(4, -10 if i == best else 4), textcoords="offset points")
    ax.set_xlabel("decoder steps per block (mean)")
    ax.set_ylabel(f"{y.replace('_', ' ')} (95 % CI, seeds x prompts)")
    ax.set_title(title or "sampler frontier", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


_ROW_KEYS = {"settings", "label", "text", "exact_match", "steps_per_block", "tpf", "pct_max_steps", "per_task", "seeds",
             "n", "diversity"}


def table_md(rows: Sequence[dict], *, default: int = 0) -> str:
    """A markdown table of the rows: label, EM [CI], steps per block [CI], corpus TPF, % at K_max, the row metrics,
    with `sweep(diversity=True)` per many-answer task the entropy per free position, the pooled choice entropy and
    the distinct-answer rate (the data's value in parentheses) and the tasks that collapse, then the frontier mark."""
    from dgemma.eval.stats import fmt_ci

    front, best = set(pareto_front(rows)), best_sampler_only(rows, default=default)
    extra = [k for k in rows[0] if k not in _ROW_KEYS]  # row_metrics of the sweep
    div = sorted(rows[0].get("diversity", {}))
    div_head = "".join(f"{t} H/pos (data) | {t} H pooled (data) | {t} distinct (data) | " for t in div) + (
        "collapse | " if div else "")
    lines = ["| setting | exact match | steps / block | corpus TPF | % at K_max | " + "".join(f"{k} | " for k in extra)
             + div_head + "|", "|---|---|---|---|---|" + "---|" * (len(extra) + 3 * len(div) + bool(div)) + "---|"]
    for i, r in enumerate(rows):
        mark = ", ".join(m for m, on in (("default", i == default), ("best within 1 pt", i == best),
                                          ("frontier", i in front)) if on)
        lines.append(f"| {r['label']} | {fmt_ci(r['exact_match'])} | {fmt_ci(r['steps_per_block'], 2)} | "
                     f"{fmt_ci(r['tpf'], 2)} | {r['pct_max_steps']:.0f} | " + "".join(f"{fmt_ci(r[k])} | " for k in extra)
                     + _diversity_cells(r.get("diversity", {}), div) + f"{mark} |")
    return "\n".join(lines)


def _diversity_cells(div: dict, tasks: Sequence[str]) -> str:
    if not tasks:
        return ""
    cells = "".join(f"{d['entropy_free']:.2f} ({d['entropy_free_data']:.2f}) | {d['entropy_pooled']:.2f} "
                    f"({d['entropy_pooled_data']:.2f}) | {d['distinct']:.2f} ({d['distinct_data']:.2f}) | "
                    if (d := div.get(t)) else "- | - | - | " for t in tasks)
    collapsed = [t for t in tasks if div.get(t, {}).get("collapse")]
    return cells + (("COLLAPSE: " + ", ".join(collapsed)) if collapsed else "no") + " | "

"""The held-out evaluator: exact match per task, tokens per forward and steps per block, per decoding.

Every evaluation in dgemma runs through `evaluate` (`dgemma eval`, the periodic evaluation of training, the SD·RL
periodic evaluation, the SD·RL study and the notebooks), so one quantity has one name everywhere:

    exact_match, exact_match/<task>    mean reward of the decoded outputs (the task rewards of `dgemma.data.rewards`,
                                       or a user reward); EOS cuts a generation
    n, n/<task>                        scored rows
    tpf                                corpus tokens per forward: Σ generated non-pad tokens / Σ (decoder passes + AR
                                       forwards) over the scored rows
    tpf_total                          the same with the commit (encoder) passes added to the forwards
    tpf_row_mean                       mean of the per-row ratios (secondary: over-weights short answers)
    tokens, forwards, commit_passes    the totals behind the ratios
    steps_per_block                    diffusion modes: mean decoder steps over the (row, block) pairs that denoised,
    steps_p50, steps_p90, pct_max_steps  with its median, 90th percentile and % of them stopped at K_max
    max_steps                          the step limit K_max the decoding ran at

A decoding is a `Decoding(label, mode, max_steps)`; its label names it in results and logs (`scalars` flattens to
`<prefix><label>/<metric>`, e.g. `eval/diffusion/exact_match/copy`), and `settings` states how it decoded in words
(`decoding_settings`). Prompts come straight from pipeline batches (left-padded prompt region and its valid mask), so
evaluation sees exactly the training encoding; `held_out` is a `DataPipeline` or a deduplicated
`dgemma.eval.heldout.HeldOutSet` (prompts disjoint from training). Diversity beside accuracy (entropy at the free
answer positions and distinct answers over K sampler keys, against the data's values) decodes through `evaluate`
once per key: `dgemma.eval.diversity.evaluate_diversity`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable

import numpy as np

from dgemma.eval.heldout import held_out_pipeline  # noqa: F401  (re-exported: its users import it from here)

__all__ = ["Decoding", "corpus_tpf", "decoding_settings", "evaluate", "held_out_pipeline", "scalars"]


@dataclasses.dataclass(frozen=True)
class Decoding:
    """One decoding to evaluate: `label` names its results, `mode` is the sampler mode ("ar" | "diffusion" |
    "auto"), `max_steps` the step limit K_max (None: the sampler section's)."""

    label: str
    mode: str
    max_steps: int | None = None

    def __post_init__(self):
        if self.mode not in ("ar", "diffusion", "auto"):
            raise ValueError(f"Decoding.mode: {self.mode!r} is not 'ar', 'diffusion' or 'auto'")


def decoding_settings(sampler_cfg, mode: str) -> str:
    """One line stating how a mode decodes, for every results table (like must be compared with like)."""
    c = sampler_cfg
    if mode == "ar":
        return "AR: greedy (argmax) next-token decoding, one token per forward" + (
            "" if c.ar_temperature == 0 else f" (temperature {c.ar_temperature})")
    if c.algorithm == "ancestral":
        head = f"ancestral sampler, K_max = {c.max_steps} steps, x0 temperature {c.ancestral_temperature}"
    else:
        accept = {"entropy_bound": f"entropy-bounded accept (gamma = {c.entropy_bound})",
                  "confidence": f"confidence accept (p >= {c.accept_confidence})",
                  "fixed_count": "fixed-count accept"}[c.accept]
        head = (f"EB sampler: {accept}, {'greedy' if c.greedy else 'sampled'} proposals, tau {c.t_max} -> "
                f"{c.t_min} linear over K_max = {c.max_steps}, stop: argmax stable {c.stability_threshold} step(s) and "
                f"mean entropy < {c.confidence_threshold}")
    tail = "; output = argmax canvas of the last step, committed block by block"
    if mode == "auto":
        tail += "; blocks that hit K_max re-decoded greedily by AR"
    return f"{mode}: {head}{tail}"


def corpus_tpf(tokens, forwards, commit_passes=None) -> dict[str, float]:
    """`tpf` = Σ tokens / Σ forwards over a set of rows and (with `commit_passes`) `tpf_total` =
    Σ tokens / Σ (forwards + commits)."""
    tokens, forwards = np.asarray(tokens, np.float64), np.asarray(forwards, np.float64)
    out = {"tpf": float(tokens.sum() / max(forwards.sum(), 1.0))}
    if commit_passes is not None:
        out["tpf_total"] = float(tokens.sum() / max(forwards.sum() + np.sum(commit_passes), 1.0))
    return out


def evaluate(model, held_out, sampler, decodings: Iterable[Decoding | str] = ("diffusion",), *,
             batches: Iterable[int] | None = None, key=None, eos_ids=None, pad_id: int | None = None, reward_fn=None,
             require_eos: bool = False, mesh=None, rules="fsdp") -> dict[str, dict]:
    """Decode the held-out prompts once per decoding and score them (module docstring).

    Args:
      model: the model to decode with.
      held_out: `HeldOutSet` or pipeline: `batch(s)`, `source[i]`, `tokenizer`, `num_batches`.
      sampler: the run config's `sampler` section (or a `SamplerConfig`); each decoding's sampler is
        `SamplerConfig.from_section(sampler, mode=..., max_steps=..., max_new_tokens=<response region>, eos_ids=...,
        pad_id=...)`.
      decodings: `Decoding`s, or mode names (label = mode, the section's K_max).
      batches: batch positions of `held_out` (default: all `held_out.num_batches`).
      key: sampler key; batch position s decodes with fold_in(key, s) in every decoding (default key(0)).
      eos_ids, pad_id: default: the sampler's, else the held-out tokenizer's stop ids and pad id.
      reward_fn, require_eos: the reward (`dgemma.data.rewards.score_rows`).
      mesh, rules: passed to the sampler.

    Returns {label: {"mode", "max_steps", "settings" (one line), "metrics" (the names above), "rows" (per scored row:
    task, reward, index, tokens, forwards, commit_passes, output; diffusion modes: steps_per_block), and for diffusion
    modes "entropy_per_step" [K_max] (mean over the (row, block) pairs that ran that step) and "commit_step"
    [rows, blocks, L]}}.
    """
    import jax

    from dgemma.inference.sampler_types import SamplerConfig

    key = jax.random.key(0) if key is None else key
    tok = held_out.tokenizer
    eos_ids = eos_ids if eos_ids is not None else (getattr(sampler, "eos_ids", None) or tuple(tok.stop_ids))
    pad_id = pad_id if pad_id is not None else getattr(sampler, "pad_id", None)
    pad_id = int(tok.pad_id if pad_id is None else pad_id)
    positions = list(range(held_out.num_batches) if batches is None else batches)
    if not positions:
        raise ValueError("evaluate: no held-out batches to evaluate")
    out: dict[str, dict] = {}
    for d in (Decoding(x, x) if isinstance(x, str) else x for x in decodings):
        if d.label in out:
            raise ValueError(f"evaluate: two decodings are labelled {d.label!r}")
        over = {"mode": d.mode, "eos_ids": tuple(eos_ids), "pad_id": pad_id}
        if d.max_steps is not None:
            over["max_steps"] = int(d.max_steps)
        base = SamplerConfig.from_section(sampler, **over)
        out[d.label] = _evaluate_one(model, held_out, positions, base, key, reward_fn, require_eos, mesh, rules)
    return out


def _evaluate_one(model, held_out, positions, base, key, reward_fn, require_eos, mesh, rules) -> dict:
    import jax

    from dgemma.data.rewards import score_rows
    from dgemma.inference import sampler as sampler_mod
    from dgemma.inference.batches import concat_results
    from dgemma.inference.sampler_types import MAX_STEPS, SamplerConfig

    results, scored = [], []  # scored: (flat row in the joined result, task, reward, source index, output)
    offset = 0
    for s in positions:
        batch = held_out.batch(s)
        R = batch["diffusion_weight"].shape[1]
        P = batch["tokens"].shape[1] - R
        cfg = SamplerConfig.from_section(base, max_new_tokens=R)
        res = sampler_mod.sample(model, np.asarray(batch["tokens"])[:, :P],
                                 np.asarray(batch["valid"])[:, :P].astype(bool), cfg, jax.random.fold_in(key, s),
                                 base.mode, mesh=mesh, rules=rules)
        results.append(res)
        kept = np.flatnonzero(np.asarray(batch.get("example_mask", np.ones(len(batch["index"]), bool)), bool))
        examples = [held_out.source[int(batch["index"][r])] for r in kept]
        outputs = [[int(t) for t in np.asarray(res.tokens)[r]] for r in kept]
        rewards = score_rows(examples, outputs, held_out.tokenizer, fn=reward_fn, require_eos=require_eos)
        scored += [(offset + int(r), e.task, float(w), int(batch["index"][r]), o)
                   for r, e, w, o in zip(kept, examples, rewards, outputs)]
        offset += res.tokens.shape[0]
    joined = concat_results(results, base.pad_id)  # batches may have run different numbers of blocks
    sel = np.asarray([r[0] for r in scored], np.int64)
    tokens = (np.asarray(joined.tokens) != base.pad_id).sum(axis=1).astype(np.int64)[sel]
    forwards = (np.asarray(joined.decoder_passes) + np.asarray(joined.ar_forwards)).astype(np.int64)[sel]
    commits = np.asarray(joined.commit_passes).astype(np.int64)[sel]
    task = np.asarray([r[1] for r in scored])
    reward = np.asarray([r[2] for r in scored], np.float64)
    metrics: dict[str, float] = {"exact_match": float(reward.mean()) if reward.size else float("nan"),
                                 "n": float(reward.size)}
    for t in sorted(set(task.tolist())):
        metrics[f"exact_match/{t}"] = float(reward[task == t].mean())
        metrics[f"n/{t}"] = float((task == t).sum())
    metrics.update(corpus_tpf(tokens, forwards, commits))
    metrics.update(tpf_row_mean=float(np.nanmean(np.asarray(joined.tpf, np.float64)[sel])),
                   tokens=float(tokens.sum()), forwards=float(forwards.sum()), commit_passes=float(commits.sum()),
                   max_steps=float(base.max_steps))
    rows = {"task": task.tolist(), "reward": reward.tolist(), "index": [r[3] for r in scored],
            "tokens": tokens.tolist(), "forwards": forwards.tolist(), "commit_passes": commits.tolist(),
            "output": [r[4] for r in scored]}
    entry = {"mode": base.mode, "max_steps": base.max_steps, "settings": decoding_settings(base, base.mode),
             "metrics": metrics, "rows": rows}
    if base.mode != "ar":
        spb = np.asarray(joined.steps_per_block)[sel]
        active = spb > 0
        ran = spb[active]
        stopped_at_max_steps = np.asarray(joined.stop_reason)[sel][active] == MAX_STEPS
        nan = float("nan")
        metrics.update(steps_per_block=float(ran.mean()) if ran.size else nan,
                       steps_p50=float(np.percentile(ran, 50)) if ran.size else nan,
                       steps_p90=float(np.percentile(ran, 90)) if ran.size else nan,
                       pct_max_steps=float(100.0 * stopped_at_max_steps.mean()) if ran.size else nan)
        rows["steps_per_block"] = np.where(active.any(1), spb.sum(1) / np.maximum(active.sum(1), 1), nan).tolist()
        entry.update(entropy_per_step=_entropy_per_step(np.asarray(joined.entropy_trace)[sel]),
                     commit_step=np.asarray(joined.commit_step)[sel])
    return entry


def scalars(results: dict[str, dict], prefix: str = "eval/") -> dict[str, float]:
    """`{f"{prefix}{label}/{metric}": value}` of every decoding's metrics (what the training loops log)."""
    return {f"{prefix}{label}/{name}": float(v) for label, r in results.items() for name, v in r["metrics"].items()}


def _entropy_per_step(trace) -> list[float]:
    """Mean tempered entropy at each step over the (row, block) pairs still running at that step."""
    t = np.asarray(trace, np.float64)
    t = t.reshape(-1, t.shape[-1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # steps no block reached
        return [float(v) for v in np.nanmean(t, axis=0)]


"""Exact-match evaluation on verifiable tasks: decode held-out prompts and score them with the task rewards.

Prompts come straight from pipeline batches (left-padded prompt region + valid mask), so evaluation sees exactly the
training encoding; the reward target is `pipeline.source[index]`. Rewards cut generations at the first EOS.
`pipeline` is a `DataPipeline` or a deduplicated `dgemma.eval.heldout.HeldOutSet` (prompts disjoint from training).

Efficiency is reported over the whole set (issue 12): corpus tokens per forward = Σ generated non-pad tokens /
Σ forwards (decoder passes + AR forwards), and the same with the commit (encoder) passes added. The mean of per-row
ratios is kept only as a secondary number: it over-weights short answers.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Callable

import numpy as np

from dgemma.data.rewards import reward
from dgemma.eval.heldout import HELD_OUT_SEED_OFFSET, HeldOutSet, build_held_out  # noqa: F401 (re-exported)


def held_out_pipeline(data_cfg, batch_size: int):
    """The data config's stream with another seed, unshuffled, single process, synchronous. Not deduplicated against
    training: prefer `build_held_out` for reported numbers."""
    from dgemma.data.pipeline import DataPipeline

    data = dataclasses.replace(data_cfg, seed=data_cfg.seed + HELD_OUT_SEED_OFFSET, batch_size=batch_size,
                               shuffle=False, num_threads=0)
    return DataPipeline(data, process_index=0, process_count=1)


def decode_ar(model, prompt, prompt_valid, max_new_tokens: int):
    from dgemma.inference.ar import generate

    return np.asarray(generate(model, prompt, prompt_valid, max_new_tokens=max_new_tokens))


def decoding_settings(sampler_cfg, mode: str) -> str:
    """One line stating how a mode decodes, for every results table (like must be compared with like)."""
    c = sampler_cfg
    if mode == "ar":
        return "AR: greedy (argmax) next-token decoding, one token per forward" + (
            "" if c.ar_temperature == 0 else f" (temperature {c.ar_temperature})")
    if c.algorithm == "ancestral":
        head = f"ancestral sampler, N = {c.max_steps} steps, x0 temperature {c.ancestral_temperature}"
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


def evaluate_exact_match(model, pipeline, steps: range | list[int], *, decode: Callable | None = None,
                         records: list | None = None) -> dict[str, dict[str, float]]:
    """Per-task exact match over the batches `pipeline.batch(s)` for s in `steps`.

    decode(model, prompt [B,P], prompt_valid [B,P], max_new_tokens) -> [B, >=1] tokens; default: AR greedy.
    Returns {task: {"exact_match": mean reward, "n": count}} plus an "all" entry. With `records`, appends one
    (batch position, row, task, reward, source index, output tokens) tuple per scored row (for per-row statistics,
    bootstrap CIs and output diagnostics).
    """
    decode = decode or decode_ar
    scores: dict[str, list[float]] = defaultdict(list)
    for k, s in enumerate(steps):
        batch = pipeline.batch(s)
        R = batch["diffusion_weight"].shape[1]
        P = batch["tokens"].shape[1] - R
        out = decode(model, batch["tokens"][:, :P], batch["valid"][:, :P], R)
        for row, idx in enumerate(batch["index"]):
            if not bool(batch["example_mask"][row]):
                continue
            example = pipeline.source[int(idx)]
            r = reward(example, [int(t) for t in out[row]], pipeline.tokenizer)
            scores[example.task].append(r)
            scores["all"].append(r)
            if records is not None:
                records.append((k, row, example.task, r, int(idx), [int(t) for t in out[row]]))
    return {task: {"exact_match": float(np.mean(v)), "n": len(v)} for task, v in sorted(scores.items())}


def row_efficiency(res, pad_id: int) -> dict[str, np.ndarray]:
    """Per-row generated non-pad tokens, forwards (decoder passes + AR forwards) and commit passes of a result."""
    return {"tokens": (np.asarray(res.tokens) != pad_id).sum(axis=1).astype(np.int64),
            "forwards": (np.asarray(res.decoder_passes) + np.asarray(res.ar_forwards)).astype(np.int64),
            "commit_passes": np.asarray(res.commit_passes).astype(np.int64)}


def corpus_tpf(tokens, forwards, commit_passes=None) -> dict[str, float]:
    """Σ tokens / Σ forwards over a set of rows, and (with `commit_passes`) Σ tokens / Σ (forwards + commits)."""
    tokens, forwards = np.asarray(tokens, np.float64), np.asarray(forwards, np.float64)
    out = {"tpf_corpus": float(tokens.sum() / max(forwards.sum(), 1.0))}
    if commit_passes is not None:
        out["tpf_total_corpus"] = float(tokens.sum() / max(forwards.sum() + np.sum(commit_passes), 1.0))
    return out


def evaluate_modes(model, pipeline, steps, sampler_cfg, modes=("ar", "diffusion", "auto"), key=None) -> dict:
    """Exact match per task for each decoding mode on the same prompts, with the sampler's efficiency metrics.

    Returns {mode: {"exact_match": {task: {...}}, "settings": decoding_settings(...),
    "tpf_corpus": Σ non-pad tokens / Σ (decoder passes + AR forwards), "tpf_total_corpus": the same with commit
    passes, "tpf_row_mean": mean of per-row TPF (secondary), "tpf": alias of tpf_corpus, "tokens"/"forwards"/
    "commit_passes": totals, "rows": per-row arrays (task, reward, tokens, forwards, commit_passes, and in diffusion
    modes mean steps per block), and for diffusion modes "steps_per_block" (mean over (row, block) pairs that ran),
    "steps_p50", "steps_p90", "pct_max_steps", "entropy_per_step" [K_max] and "commit_step" [N, blocks, L]}}.
    """
    import jax

    from dgemma.inference.batches import concat_results
    from dgemma.inference.sampler import MAX_STEPS, sample

    key = jax.random.key(0) if key is None else key
    pad_id = int(model.cfg.pad_token_id if sampler_cfg.pad_id is None else sampler_cfg.pad_id)
    out = {}
    for mode in modes:
        results = []

        def decode(m, prompt, valid, max_new_tokens, _mode=mode):
            cfg = dataclasses.replace(sampler_cfg, max_new_tokens=max_new_tokens)
            res = sample(m, prompt, valid, cfg, jax.random.fold_in(key, len(results)), _mode)
            results.append(res)
            return res.tokens

        records: list = []
        em = evaluate_exact_match(model, pipeline, steps, decode=decode, records=records)
        # batches may have run different numbers of blocks (a batch stops when all its rows finished): pad, then join
        joined = concat_results(results, pad_id)
        B = results[0].tokens.shape[0]
        sel = np.asarray([rec[0] * B + rec[1] for rec in records], np.int64)  # scored rows only
        eff = {k: v[sel] for k, v in row_efficiency(joined, pad_id).items()}
        rows = {"task": np.asarray([rec[2] for rec in records]), "reward": np.asarray([rec[3] for rec in records]),
                "index": np.asarray([rec[4] for rec in records]), **eff}
        row = {"exact_match": em, "settings": decoding_settings(sampler_cfg, mode),
               **corpus_tpf(eff["tokens"], eff["forwards"], eff["commit_passes"]),
               "tpf_row_mean": float(np.nanmean(np.asarray(joined.tokens_per_forward, np.float64)[sel])),
               "tokens": int(eff["tokens"].sum()), "forwards": int(eff["forwards"].sum()),
               "commit_passes": int(eff["commit_passes"].sum())}
        row["tpf"] = row["tpf_corpus"]
        if mode != "ar":
            spb = joined.steps_per_block[sel]
            active = spb > 0
            reasons = joined.stop_reason[sel]
            steps_act = spb[active]
            rows["steps_per_block"] = np.where(active.any(1), spb.sum(1) / np.maximum(active.sum(1), 1), np.nan)
            row.update(steps_per_block=float(steps_act.mean()) if steps_act.size else float("nan"),
                       steps_p50=float(np.percentile(steps_act, 50)) if steps_act.size else float("nan"),
                       steps_p90=float(np.percentile(steps_act, 90)) if steps_act.size else float("nan"),
                       pct_max_steps=float((reasons[active] == MAX_STEPS).mean()) if steps_act.size else float("nan"),
                       entropy_per_step=_entropy_per_step(joined.entropy_trace[sel]),
                       commit_step=joined.commit_step[sel])
        row["rows"] = {k: v.tolist() for k, v in rows.items()}  # JSON-safe
        row["rows"]["output"] = [rec[5] for rec in records]
        out[mode] = row
    return out


def _entropy_per_step(trace) -> list[float]:
    """Mean tempered entropy at each step over the (row, block) pairs still running at that step."""
    import warnings

    t = np.asarray(trace, np.float64).reshape(-1, np.asarray(trace).shape[-1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # steps no block reached
        return [float(v) for v in np.nanmean(t, axis=0)]

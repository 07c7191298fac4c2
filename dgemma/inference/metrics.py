"""Sampler metrics (docs/sampler.md §7): summaries of a `SampleResult` for logs, eval and benchmarks.

| metric | definition |
|---|---|
| TPF (per row) | non-pad generated tokens (EOS included) / forwards while active (decoder passes + AR forwards) |
| TPF_total | non-pad tokens / (forwards + commit encoder passes): the honest end-to-end number |
| steps per block | decoder forwards per (row, block) with the row in diffusion; mean, p50, p90, % at max |
| stop reasons | fractions of (row, block) pairs that converged / hit max_steps / ran AR fallback |
| entropy per step | mean tempered entropy at each step index, averaged over the (row, block) pairs still active |
| commitment | mean fraction of the block's steps after which a position's argmax no longer changed |
"""

from __future__ import annotations

import warnings

import numpy as np

from dgemma.inference.sampler import AR_FALLBACK, CONVERGED, EOS_FINISHED, MAX_STEPS, SampleResult

__all__ = ["summarize", "format_summary"]


def summarize(res: SampleResult, max_steps: int | None = None) -> dict:
    """Scalar summary of a sampling run (JSON-friendly floats)."""
    out: dict = {
        "rows": int(res.tokens.shape[0]),
        "blocks_run": int(res.n_blocks),
        "tokens_generated": int(res.tokens.shape[1]),
        "tpf_mean": float(np.nanmean(_finite(res.tpf))),
        "tpf_total_mean": float(np.nanmean(_finite(res.tpf_total))),
        "decoder_passes": int(res.decoder_passes.sum()),
        "ar_forwards": int(res.ar_forwards.sum()),
        "commit_passes": int(res.commit_passes.sum()),
    }
    reasons = res.stop_reason
    took_part = (reasons != EOS_FINISHED) & (reasons != AR_FALLBACK)
    steps = res.steps_per_block[took_part & (res.steps_per_block > 0)]
    if steps.size:
        out.update(steps_mean=float(steps.mean()), steps_p50=float(np.percentile(steps, 50)),
                   steps_p90=float(np.percentile(steps, 90)))
        if max_steps is not None:
            out["pct_max_steps"] = float(100.0 * (steps >= max_steps).mean())
    live = reasons != EOS_FINISHED
    if live.any():
        n = live.sum()
        out.update(pct_converged=float(100.0 * ((reasons == CONVERGED) & live).sum() / n),
                   pct_hit_max_steps=float(100.0 * ((reasons == MAX_STEPS) & live).sum() / n),
                   pct_ar_fallback=float(100.0 * ((reasons == AR_FALLBACK) & live).sum() / n))
    if res.entropy_trace.size:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns (steps no row reached)
            per_step = np.nanmean(res.entropy_trace.reshape(-1, res.entropy_trace.shape[-1]), axis=0)
        out["entropy_per_step"] = [None if np.isnan(x) else float(x) for x in per_step]
    if res.commit_step.size and steps.size:
        frac = res.commit_step / np.maximum(res.steps_per_block[..., None], 1)
        sel = np.broadcast_to(took_part[..., None] & (res.steps_per_block[..., None] > 0), frac.shape)
        out["commit_fraction_mean"] = float(frac[sel].mean()) if sel.any() else None
    return out


def format_summary(summary: dict) -> str:
    keys = ["tpf_mean", "tpf_total_mean", "steps_mean", "steps_p50", "steps_p90", "pct_max_steps", "pct_converged",
            "pct_hit_max_steps", "pct_ar_fallback", "decoder_passes", "ar_forwards"]
    parts = []
    for k in keys:
        if k in summary and summary[k] is not None:
            v = summary[k]
            parts.append(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}")
    return " ".join(parts)


def _finite(x):
    x = np.asarray(x, np.float64)
    return np.where(np.isfinite(x), x, np.nan)

"""Per-iteration SD·RL rollout metrics (docs/sdrl.md §5).

Rollout metrics are corpus-level where the design asks for it: `tpf` = Σ non-pad generated tokens / Σ decoder
forwards over all rollouts, `tpf_total` adds the commit (encoder) passes; steps per block over the (row, block) pairs
that denoised (mean, p50, p90, % at the current K_max); stop-reason shares; mean tempered entropy and accept fraction
|A_k| / L at steps k = 1..6 over the states that ran; the argmax flip rate between consecutive steps; output length
(tokens before EOS), EOS rate and tokens after the first EOS (non-EOS, non-pad; mean per row).
"""

from __future__ import annotations

import numpy as np

from dgemma.inference.sampler_types import CONVERGED, EOS_FINISHED, MAX_STEPS

__all__ = ["rollout_metrics"]

PER_STEP = 6  # steps k = 1..6 reported individually


def _outputs(tokens: np.ndarray, eos_ids, pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(non-pad counts, length before EOS, has EOS) per row of generated tokens [B, T]."""
    is_eos = np.isin(tokens, np.asarray(tuple(eos_ids)))
    has = np.any(is_eos, axis=1)  # (the method's stub types it as a scalar or an array)
    length = np.where(has, is_eos.argmax(1), tokens.shape[1])
    return (tokens != pad_id).sum(1), length, has


def _tokens_after_eos(tokens: np.ndarray, eos_ids, pad_id: int) -> np.ndarray:
    """Per row: tokens after the first EOS that are neither EOS nor padding (content the stop rule let through)."""
    is_eos = np.isin(tokens, np.asarray(tuple(eos_ids)))
    after = np.cumsum(is_eos, axis=1) > 0
    return (after & ~is_eos & (tokens != pad_id)).sum(1)


def rollout_metrics(ro, max_steps: int, eos_ids, pad_id: int, prefix: str = "") -> dict[str, float]:
    """Scalar metrics of a `dgemma.inference.rollout.Rollout` (or its `SampleResult` + record) at step limit K_max."""
    res = ro.result
    non_pad, length, has_eos = _outputs(np.asarray(ro.tokens), eos_ids, pad_id)
    fwd = res.decoder_passes.astype(np.float64) + res.ar_forwards
    out = {"tpf": float(non_pad.sum() / max(fwd.sum(), 1)),
           "tpf_total": float(non_pad.sum() / max((fwd + res.commit_passes).sum(), 1)),
           "output_length": float(length.mean()), "eos_rate": float(has_eos.mean()),
           "tokens_after_eos": float(_tokens_after_eos(np.asarray(ro.tokens), eos_ids, pad_id).mean())}
    reasons, steps = res.stop_reason, res.steps_per_block
    ran = (reasons != EOS_FINISHED) & (steps > 0)
    if ran.any():
        s = steps[ran]
        out.update(steps_per_block=float(s.mean()), steps_p50=float(np.percentile(s, 50)),
                   steps_p90=float(np.percentile(s, 90)), pct_at_kmax=float(100.0 * (s >= max_steps).mean()),
                   pct_converged=float(100.0 * (reasons[ran] == CONVERGED).mean()),
                   pct_max_steps=float(100.0 * (reasons[ran] == MAX_STEPS).mean()))
    rec = ro.record
    if rec is not None:
        valid = np.asarray(rec.step_ran, bool)  # [nb, K, B]
        ent = np.asarray(rec.mean_entropy, np.float64)
        acc = np.asarray(rec.accept, bool).mean(-1)  # [nb, K, B]
        for k in range(min(PER_STEP, valid.shape[1])):
            v = valid[:, k]
            if v.any():
                out[f"entropy_step{k + 1}"] = float(ent[:, k][v].mean())
                out[f"accept_frac_step{k + 1}"] = float(acc[:, k][v].mean())
        if valid.any():
            out["accept_frac"] = float(acc[valid].mean())
        # argmax flip rate: share of positions whose argmax changed from step k-1 to step k (states with k >= 1)
        am = np.asarray(rec.draft)
        both = valid[:, 1:] & valid[:, :-1]
        if both.any():
            out["argmax_flip_rate"] = float((am[:, 1:] != am[:, :-1]).mean(-1)[both].mean())
    return {prefix + k: v for k, v in out.items()}

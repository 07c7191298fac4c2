"""The periodic held-out evaluation of an SD·RL run (`SDRLSession.evaluate`, every `trainer.eval_every` iterations)."""

from __future__ import annotations

__all__ = ["evaluate"]


def evaluate(model, data, cfg, max_steps: int, key, *, eos_ids, pad_id: int, reward_fn=None, mesh=None) -> dict:
    """Held-out evaluation through the one evaluator (`dgemma.eval.evaluator`), over `trainer.eval_batches`
    batches of `data` (held-out prompts; fewer where a held-out file has fewer), with the student's sampler settings
    and a fixed key: diffusion at the current K_max `max_steps` (label `diffusion_current`), diffusion at the full
    K_max `sampler.max_steps` (label `diffusion`, as the periodic evaluation of the other objectives) and greedy AR on
    the same weights (label `ar`).
    Returns `eval/<label>/<metric>` (exact_match, exact_match/<task>, tpf, tpf_total, steps_per_block, max_steps, ...)
    and, for a `HeldOutSet`, `eval/heldout_overlap`."""
    from dgemma.eval.evaluator import Decoding, evaluate as evaluate_held_out, scalars

    decodings = (Decoding("diffusion_current", "diffusion", int(max_steps)),
                 Decoding("diffusion", "diffusion", cfg.sampler.max_steps), Decoding("ar", "ar", cfg.sampler.max_steps))
    n = min(cfg.trainer.eval_batches, getattr(data, "num_batches", cfg.trainer.eval_batches))
    res = evaluate_held_out(model, data, cfg.sampler, decodings, batches=range(n), key=key,
                            eos_ids=tuple(eos_ids), pad_id=pad_id, reward_fn=reward_fn,
                            require_eos=cfg.sdrl.reward_require_eos, mesh=mesh, rules=cfg.mesh.rules)
    out = scalars(res, "eval/")
    if getattr(data, "overlap", None) is not None:
        out["eval/heldout_overlap"] = float(data.overlap)
    return out

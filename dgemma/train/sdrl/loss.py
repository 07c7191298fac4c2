"""The SD·RL loss over recorded states, as a `LossFn` for `dgemma.train.step.make_train_step` (§12.4-§12.5).

    loss_fn = make_sdrl_loss_fn(cfg)                   # (model, batch, rng) -> (loss, metrics)
    logp = state_logprobs(model, batch, batch["output"])   # no-grad passes: π_old before the updates, π_ref

The batch is one minibatch of `states.build_state_rows` (+ `logp_old`, `logp_ref` or `ref_logits`, and the anchor
rows under `anchor/...`). One replay forward with gradient per state gives the tempered logits z = f_θ(s)/τ_k
(`dgemma.inference.replay`); L_PG, L_SD and L_KL all read them (`dgemma.diffusion.sdrl_objective`). The anchor is the
stage-1 loss on canvasized (q, y*) with fresh noise and λ_AR' as its AR weight (rows without y* carry zero weight).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dgemma.diffusion import sdrl_objective as so
from dgemma.diffusion.stage1 import Stage1Config, stage1_loss
from dgemma.inference.record import RolloutRecord

__all__ = ["ANCHOR_PREFIX", "make_sdrl_loss_fn", "record_from_rows", "state_logits", "state_logprobs"]

ANCHOR_PREFIX = "anchor/"
PER_STATE = ("output", "target", "pg_mask", "sd_mask", "logp_old", "logp_ref", "advantage", "weight", "omega")


def record_from_rows(batch: dict) -> RolloutRecord:
    """A one-step `RolloutRecord` ([nb, 1, N, ...]) holding each row's state, so `replay_logits(..., steps=0)`
    evaluates exactly the recorded states of the rows (fields replay does not read are zeros)."""
    canvas = jnp.swapaxes(batch["canvas"], 0, 1)[:, None]  # [nb, 1, N, L]
    sc = batch.get("sc")
    sc = None if sc is None else jnp.swapaxes(sc, 0, 1)[:, None]
    valid = jnp.swapaxes(batch["state_valid"], 0, 1)  # [nb, N]
    zeros = jnp.zeros_like(canvas)
    return RolloutRecord(canvas=canvas, sc=sc, tau=jnp.swapaxes(batch["tau"], 0, 1)[:, None], accept=zeros != 0,
                         argmax=zeros, proposal=zeros, mean_entropy=jnp.zeros(valid.shape, jnp.float32)[:, None],
                         step_valid=valid[:, None], tokens=jnp.swapaxes(batch["committed"], 0, 1),
                         steps=valid.astype(jnp.int32), stop_reason=jnp.zeros(valid.shape, jnp.int32),
                         block_valid=valid)


def _one_pass_replay(model, rec: RolloutRecord, prompts, prompt_valid) -> jax.Array:
    """Adapter until `dgemma.inference.replay` lands: step 0 of a one-step record through the stage-1 one-pass
    forward [clean = prompt + committed blocks ; noisy = each block's recorded canvas] with the recorded SC input.
    Returns tempered logits [N, nb, L, V]."""
    from dgemma.diffusion import masks as bd_masks
    from dgemma.diffusion.stage1 import one_pass_hidden, one_pass_masks

    nb, _, N, L = rec.canvas.shape
    P, R = prompts.shape[1], nb * L
    T = P + R
    committed = jnp.swapaxes(rec.tokens, 0, 1).reshape(N, R)
    tokens = jnp.concatenate([prompts.astype(jnp.int32), committed], axis=1)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (N, T))
    valid = jnp.concatenate([prompt_valid, jnp.ones((N, R), bool)], axis=1)
    block_id = jnp.concatenate([jnp.where(prompt_valid, -1, -2),
                                jnp.broadcast_to(jnp.repeat(jnp.arange(nb, dtype=jnp.int32), L)[None], (N, R))], 1)
    x_t = jnp.swapaxes(rec.canvas[:, 0], 0, 1).reshape(N, R)
    streams = bd_masks.concat_streams(tokens, x_t, positions, valid, block_id)
    masks = one_pass_masks(model.cfg, streams)
    soft = None if rec.sc is None else jnp.swapaxes(rec.sc[:, 0], 0, 1).reshape(N, R, -1)
    hidden = one_pass_hidden(model, streams, masks, T, soft)
    logits = model.logits(hidden[:, T:]).reshape(N, nb, L, -1)
    return logits / jnp.swapaxes(rec.tau[:, 0], 0, 1)[:, :, None, None]


def state_logits(model, batch: dict) -> jax.Array:
    """Tempered logits [N, nb, L, V] (fp32) at the rows' recorded states, through the training forward."""
    rec = record_from_rows(batch)
    try:
        from dgemma.inference.replay import replay_logits
    except ImportError:
        return _one_pass_replay(model, rec, batch["prompts"], batch["prompt_valid"])
    z, _ = replay_logits(model, rec, batch["prompts"], batch["prompt_valid"], 0)
    return z


def state_logprobs(model, batch: dict, tokens: jax.Array) -> jax.Array:
    """log softmax(z)[tokens] [N, nb, L] at the rows' recorded states."""
    return so.token_logprobs(state_logits(model, batch), tokens)


def _flat(x: jax.Array) -> jax.Array:
    """[N, nb, ...] -> [N·nb, ...]: each (row, block) is one state."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def make_sdrl_loss_fn(sdrl, stage1: Stage1Config | None = None):
    """`loss_fn(model, batch, rng) -> (loss, metrics)`; `sdrl` is the `SDRLConfig`, `stage1` the diffusion settings
    of the anchor (its `lambda_ar` is replaced by `sdrl.anchor_ar_weight`)."""
    weights = sdrl.weights()
    anchor_cfg = dataclasses.replace(stage1 or Stage1Config(), lambda_ar=weights.anchor_ar)

    def loss_fn(model, batch, rng):
        z = _flat(state_logits(model, batch))
        flat = {k: _flat(batch[k]) for k in PER_STATE if k in batch}
        ref = _flat(batch["ref_logits"]) if sdrl.kl_estimator == "exact" and weights.kl else None
        kl_est = sdrl.kl_estimator if weights.kl else "k3"
        if "logp_ref" not in flat:
            flat["logp_ref"] = jax.lax.stop_gradient(so.token_logprobs(z, flat["output"]))  # KL off: unused
        terms = so.sdrl_terms(z, flat, clip_eps=sdrl.clip_eps, kl_estimator=kl_est, ref_logits=ref)
        anchor = jnp.zeros((), jnp.float32)
        if weights.anchor:
            rows = {k[len(ANCHOR_PREFIX):]: v for k, v in batch.items() if k.startswith(ANCHOR_PREFIX)}
            anchor, m = stage1_loss(model, rows, rng, anchor_cfg)
            terms["loss_anchor_diffusion"], terms["loss_anchor_ar"] = m["loss_diffusion"], m["loss_ar"]
        terms["loss_anchor"] = anchor
        loss = so.total_loss(terms, weights, anchor)
        return loss, terms

    return loss_fn

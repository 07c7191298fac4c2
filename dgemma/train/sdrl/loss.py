"""The SD·RL loss over recorded states, as a `LossFn` for `dgemma.train.step.make_train_step` (docs/sdrl.md §2).

    loss_fn = make_sdrl_loss_fn(cfg)                   # (model, batch, rng) -> (loss, metrics)
    logp = state_logprobs(model, batch, batch["output"])   # no-grad passes: π_old before the updates, π_ref

The batch is one minibatch of state rows (`states.StateRows.batch()`: the fields of `states.ROW_FIELDS`, with
`logp_old` and `logp_ref` or `ref_logits`) plus the anchor rows under `anchor/...`. One replay forward with gradient
per state (`dgemma.inference.replay`, the stage-1 one-pass layout) gives the tempered log-probabilities of both o and
y* from the same logits (chunked head, no V-wide array; with the exact KL the V-wide logits instead); L_PG, L_SD and
L_KL all read them (`dgemma.diffusion.sdrl_objective`). The anchor is the
stage-1 loss on laid-out (q, y*) with fresh noise and λ_AR' as its AR weight (rows without y* carry zero weight).
A batch in the `states.shared_prefix_batch` layout (`prefix_index` present; the iteration's default) replays each
distinct clean stream once and every row's noisy stream over it (`dgemma.inference.replay_shared`): the same values
up to fp32 summation order.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dgemma.diffusion import sdrl_objective as so
from dgemma.diffusion.stage1 import Stage1Config, stage1_loss
from dgemma.inference.record import RolloutRecord
from dgemma.train.sdrl.retention import term_weights
from dgemma.train.sdrl.states import LOSS_FIELDS

__all__ = ["ANCHOR_PREFIX", "RETENTION_PREFIX", "make_sdrl_loss_fn", "record_from_rows", "state_logits",
           "state_logprobs",
           "state_logprobs_and_twin"]

ANCHOR_PREFIX = "anchor/"
RETENTION_PREFIX = "retention/"  # rows of the retention stream (`dgemma.train.sdrl.retention`)
PREFIX_INDEX = "prefix_index"  # present: rows carry their rollouts' shared prefix (`states.shared_prefix_batch`)
PER_STATE = LOSS_FIELDS  # the per-state fields (4.2) reads (`states.ROW_FIELDS`)


def record_from_rows(batch: dict) -> RolloutRecord:
    """A one-step `RolloutRecord` ([nb, 1, N, ...]) holding each row's state, so `replay_logits(..., steps=0)`
    evaluates exactly the recorded states of the rows (fields replay does not read are zeros)."""
    canvas = jnp.swapaxes(batch["canvas"], 0, 1)[:, None]  # [nb, 1, N, L]
    soft_embeds = batch.get("soft_embeds")
    soft_embeds = None if soft_embeds is None else jnp.swapaxes(soft_embeds, 0, 1)[:, None]
    valid = jnp.swapaxes(batch["state_ran"], 0, 1)  # [nb, N]
    zeros = jnp.zeros_like(canvas)
    return RolloutRecord(canvas=canvas, soft_embeds=soft_embeds, tau=jnp.swapaxes(batch["tau"], 0, 1)[:, None],
                         accept=zeros != 0, draft=zeros, proposal=zeros,
                         mean_entropy=jnp.zeros(valid.shape, jnp.float32)[:, None],
                         step_ran=valid[:, None], tokens=jnp.swapaxes(batch["committed"], 0, 1),
                         steps=valid.astype(jnp.int32), stop_reason=jnp.zeros(valid.shape, jnp.int32),
                         block_ran=valid)


def state_logits(model, batch: dict) -> jax.Array:
    """Tempered logits [N, nb, L, V] (fp32) at the rows' recorded states (V-wide: toy sizes / the exact KL only)."""
    from dgemma.inference.replay import replay_logits

    if PREFIX_INDEX in batch:  # the clean stream once per rollout (`dgemma.inference.replay_shared`)
        hidden, tau, _ = _replay_hidden_shared(model, batch, share_scan_grads=False)
        return model.logits(hidden) / tau[:, :, None, None]
    z, _ = replay_logits(model, record_from_rows(batch), batch["prompts"], batch["prompt_valid"], 0)
    return z


def state_logprobs(model, batch: dict, tokens: jax.Array):
    """log π_θ(tokens) [N, nb, L(, M)] at the rows' recorded states; chunked head, no [N, nb, L, V] array. `tokens`
    [N, nb, L] or [N, nb, L, M] (M token sets read from the same forward)."""
    return _state_logprobs(model, batch, tokens, share_scan_grads=False)[0]


def state_logprobs_and_twin(model, batch: dict, tokens: jax.Array):
    """`state_logprobs` and the replay's twin model: a pass run on the twin (the anchor) adds its scanned-layer
    gradient into the replay's stack (`dgemma.model.shared_scan_grads`; one stack instead of two at the update's
    peak). The twin is the model itself when its layers are not scanned."""
    return _state_logprobs(model, batch, tokens, share_scan_grads=True)


def _state_logprobs(model, batch: dict, tokens: jax.Array, *, share_scan_grads: bool):
    from dgemma.inference.replay import replay_hidden, tempered_logprobs

    if PREFIX_INDEX in batch:  # the clean stream once per rollout (`dgemma.inference.replay_shared`)
        hidden, _, twin = _replay_hidden_shared(model, batch, share_scan_grads=share_scan_grads)
        return tempered_logprobs(model, hidden, batch["tau"], tokens), twin
    hidden, _, twin = replay_hidden(model, record_from_rows(batch), batch["prompts"], batch["prompt_valid"], 0,
                                    share_scan_grads=share_scan_grads)
    return tempered_logprobs(model, hidden, batch["tau"], tokens), twin


def _replay_hidden_shared(model, batch: dict, *, share_scan_grads: bool):
    from dgemma.inference.replay_shared import replay_hidden_shared

    return replay_hidden_shared(model, batch, share_scan_grads=share_scan_grads)


def _flat(x: jax.Array) -> jax.Array:
    """[N, nb, ...] -> [N·nb, ...]: each (row, block) is one state."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def make_sdrl_loss_fn(sdrl, stage1: Stage1Config | None = None, *, share_scan_grads: bool = True):
    """`loss_fn(model, batch, rng) -> (loss, metrics)`; `sdrl` is the `SDRLConfig`, `stage1` the diffusion settings
    of the anchor (its `lambda_ar` is replaced by `sdrl.anchor_ar_weight`). With scanned layers (and
    `share_scan_grads`, default) the anchor's passes run on the replay's twin model, so the update keeps one
    stacked gradient of the scanned layers instead of two (`dgemma.model.shared_scan_grads`)."""
    weights = term_weights(sdrl)  # (4.2)'s weights and lambda_ret of the retention rows
    anchor_cfg = dataclasses.replace(stage1 or Stage1Config(), lambda_ar=weights.anchor_ar)
    exact_kl = sdrl.kl_estimator == "exact" and bool(weights.kl)

    def loss_fn(model, batch, rng):
        flat = {k: _flat(batch[k]) for k in PER_STATE if k in batch}
        kl = None
        anchor_model = model
        if exact_kl:  # V-wide logits per state: the toy setting (`sdrl.kl_estimator: exact`)
            z = _flat(state_logits(model, batch))
            logp_o, logp_y = so.token_logprobs(z, flat["output"]), so.token_logprobs(z, flat["target"])
            kl = so.exact_kl(z, jax.lax.stop_gradient(_flat(batch["ref_logits"])))
        else:  # one chunked forward, both token sets from the same logits
            both = jnp.stack([batch["output"], batch["target"]], axis=-1)
            if share_scan_grads and weights.anchor:  # the anchor below runs on the replay's twin: one gradient stack
                lp, anchor_model = state_logprobs_and_twin(model, batch, both)
            else:
                lp = state_logprobs(model, batch, both)
            lp = _flat(lp)
            logp_o, logp_y = lp[..., 0], lp[..., 1]
            if not weights.kl:
                flat["logp_ref"] = jax.lax.stop_gradient(logp_o)  # KL switched off: k3 = 0, and never added
        terms = so.sdrl_terms(logp_o, logp_y, flat, clip_eps=sdrl.clip_eps, kl=kl)
        anchor = jnp.zeros((), jnp.float32)
        if weights.anchor:
            rows = {k[len(ANCHOR_PREFIX):]: v for k, v in batch.items() if k.startswith(ANCHOR_PREFIX)}
            anchor, m = stage1_loss(anchor_model, rows, rng, anchor_cfg)
            terms["loss_anchor_diffusion"], terms["loss_anchor_ar"] = m["loss_diffusion"], m["loss_ar"]
        terms["loss_anchor"] = anchor
        retention = jnp.zeros((), jnp.float32)
        if weights.retention:  # the stage-1 loss as stage 1 trained it (its own lambda_ar), other noise than the anchor
            rows = {k[len(RETENTION_PREFIX):]: v for k, v in batch.items() if k.startswith(RETENTION_PREFIX)}
            # on `model`, not the twin: the twin carries one pass (the anchor's); a second stack here is the price
            retention, m = stage1_loss(model, rows, jax.random.fold_in(rng, 1), stage1 or Stage1Config())
            terms["loss_retention_diffusion"], terms["loss_retention_ar"] = m["loss_diffusion"], m["loss_ar"]
        terms["loss_retention"] = retention
        loss = so.total_loss(terms, weights, anchor, retention)
        return loss, terms

    return loss_fn

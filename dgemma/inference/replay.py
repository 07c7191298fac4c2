"""Replay recorded sampler states through the TRAINING forward, with gradient (SD·RL, docs/sdrl.md §1).

    h, valid, _ = replay_hidden(model, record, prompts, prompt_valid, steps)        # [B, nb, L, H], [B, nb], model
    z, valid = replay_logits(model, record, prompts, prompt_valid, steps)           # tempered, [B, nb, L, V] fp32
    lp, valid = replay_logprobs(model, record, prompts, prompt_valid, steps, targets)   # [B, nb, L(, M)] fp32

`steps` picks, for every (row, block), which recorded step k to evaluate: an int, or int [B, nb]. ONE forward of the
stage-1 one-pass layout (`dgemma.diffusion.stage1`, docs/stage1.md §4) evaluates that state for every block at once:

    clean stream : prompt (left-padded; pads invalid) + the committed tokens of every block  (causal, = the AR model)
    noisy stream : block b's recorded canvas at step steps[r, b], self-conditioned on the recorded SC embedding

By the train/inference invariant (tests/diffusion/test_stage1.py) noisy block b then sees exactly the context the sampler's cache held when it
denoised block b (prompt + committed blocks < b, the last W − 1 of them on sliding layers), so the tempered logits
z = logits / τ_k equal the sampler's at that state (tests/inference/test_rollout_replay.py: ≤ 1e-5 in fp32). Everything is a
pure function of the model parameters: differentiate through it with `nnx.split` / `jax.grad` as for the stage-1
loss. The recorded states, SC embeddings and τ are inputs (stop-gradient by construction, as docs/sdrl.md §2 asks).

`valid[r, b]` is `step_ran` at the chosen state: the row really visited it. Rows / blocks where it is False give
finite but meaningless numbers; mask them. `replay_logprobs` uses a chunked head (no [B, R, V] array; the backward
pass recomputes each chunk), `replay_logits` materialises V-wide logits (toy sizes and tests only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dgemma.diffusion import masks as bd_masks
from dgemma.diffusion.stage1 import one_pass_hidden, one_pass_hidden_and_twin, one_pass_masks
from dgemma.inference.record import RolloutRecord

__all__ = ["gather_states", "layout_streams", "replay_hidden", "replay_logits", "replay_logprobs", "tempered_logprobs"]


def gather_states(record: RolloutRecord, steps):
    """(canvas [B, nb, L], soft_embeds [B, nb, L, H] or None, tau [B, nb], valid [B, nb]) at step steps[r, b]."""
    nb, K, B, _ = record.canvas.shape
    steps = jnp.broadcast_to(jnp.asarray(steps, jnp.int32), (B, nb))
    bi, ri = jnp.arange(nb)[None, :], jnp.arange(B)[:, None]
    take = lambda x: x[bi, steps, ri]  # noqa: E731  [nb, K, B, ...] -> [B, nb, ...]
    in_range = (steps >= 0) & (steps < K)
    valid = take(record.step_ran) & in_range
    # a step the block never ran holds the record's initial tau of 0: dividing by it gives inf logits whose NaN
    # gradient survives the loss masks (0 * NaN), so unvisited states are replayed at tau 1 (their loss weight is 0)
    tau = jnp.where(valid, take(record.tau), 1.0)
    soft_embeds = None if record.soft_embeds is None else take(record.soft_embeds)
    return take(record.canvas), soft_embeds, tau, valid


def _layout(record: RolloutRecord, prompts, prompt_valid, canvas):
    """The one-pass [clean ; noisy] streams (docs/stage1.md §4): clean = prompt + committed blocks, noisy = the chosen canvases."""
    nb, _, B, L = record.canvas.shape
    return layout_streams(jnp.moveaxis(record.tokens, 0, 1), prompts, prompt_valid, canvas.reshape(B, nb, L))


def layout_streams(committed, prompts, prompt_valid, canvas):
    """`_layout` from the rows' committed blocks [B, nb, L] and canvases [B, nb, L] (the replay of state rows)."""
    B, nb, L = committed.shape
    prompts = jnp.asarray(prompts, jnp.int32)
    P = prompts.shape[1]
    if prompts.shape[0] != B:
        raise ValueError(f"replay: prompts have {prompts.shape[0]} rows, the record has {B}")
    prompt_valid = jnp.ones((B, P), bool) if prompt_valid is None else jnp.asarray(prompt_valid, bool)
    tokens = jnp.concatenate([prompts, committed.reshape(B, nb * L)], axis=1)
    positions = jnp.broadcast_to(jnp.arange(P + nb * L, dtype=jnp.int32)[None], tokens.shape)
    valid = jnp.concatenate([prompt_valid, jnp.ones((B, nb * L), bool)], axis=1)
    block_id = jnp.concatenate([jnp.where(prompt_valid, bd_masks.BLK_PROMPT, bd_masks.BLK_PAD),
                                jnp.broadcast_to(jnp.repeat(jnp.arange(nb), L)[None], (B, nb * L))], axis=1)
    return bd_masks.concat_streams(tokens, canvas.reshape(B, nb * L), positions, valid, block_id)


def replay_hidden(model, record: RolloutRecord, prompts, prompt_valid, steps, *, share_scan_grads: bool = False):
    """Final hidden states of the noisy stream at the chosen states: ([B, nb, L, H], valid [B, nb], twin). `twin` is
    the model itself, or with `share_scan_grads` the twin of `one_pass_hidden_and_twin`: a later pass run with it
    adds its scanned-layer gradient into this replay's stack."""
    nb, _, B, L = record.canvas.shape
    canvas, soft_embeds, _, valid = gather_states(record, steps)
    streams = _layout(record, prompts, prompt_valid, canvas)
    num_clean = streams.tokens.shape[1] - nb * L
    # causal clean stream, strict block rule, the model's sliding rule
    masks = one_pass_masks(model.cfg, streams, num_clean=num_clean)
    soft = None if soft_embeds is None else soft_embeds.reshape(B, nb * L, -1)
    if share_scan_grads:
        hidden, twin = one_pass_hidden_and_twin(model, streams, masks, num_clean, soft)
    else:
        hidden, twin = one_pass_hidden(model, streams, masks, num_clean, soft), model
    return hidden[:, num_clean:].reshape(B, nb, L, -1), valid, twin


def replay_logits(model, record: RolloutRecord, prompts, prompt_valid, steps):
    """The sampler's tempered logits z = logits / τ_k at the chosen states: ([B, nb, L, V] fp32, valid [B, nb])."""
    hidden, valid, _ = replay_hidden(model, record, prompts, prompt_valid, steps)
    _, _, tau, _ = gather_states(record, steps)
    return model.logits(hidden) / tau[:, :, None, None], valid


def tempered_logprobs(model, hidden, tau, targets, *, chunk: int = 256):
    """log softmax(logits(h) / τ)[targets], chunked over positions (never the whole [.., V] at once).

    hidden [B, nb, L, H]; tau [B, nb]; targets [B, nb, L] or [B, nb, L, M] (M token sets read from the same
    logits, e.g. the rollout's output and a distillation target). Returns fp32 of the targets' shape.
    """
    B, nb, L, H = hidden.shape
    squeeze = targets.ndim == 3
    tg = targets[..., None] if squeeze else targets
    M = tg.shape[-1]
    n = nb * L
    c = max(1, min(chunk, n))
    k = -(-n // c)
    pad = k * c - n
    hs = jnp.pad(hidden.reshape(B, n, H), ((0, 0), (0, pad), (0, 0))).reshape(B, k, c, H).swapaxes(0, 1)
    ts = jnp.broadcast_to(tau[:, :, None], (B, nb, L)).reshape(B, n)
    ts = jnp.pad(ts, ((0, 0), (0, pad)), constant_values=1.0).reshape(B, k, c).swapaxes(0, 1)
    ys = jnp.clip(tg.reshape(B, n, M).astype(jnp.int32), 0, model.cfg.vocab_size - 1)
    ys = jnp.pad(ys, ((0, 0), (0, pad), (0, 0))).reshape(B, k, c, M).swapaxes(0, 1)

    @jax.checkpoint
    def body(args):
        hc, tc, yc = args  # [B, c, H], [B, c], [B, c, M]
        z = model.logits(hc) / tc[..., None]
        return jnp.take_along_axis(z, yc, axis=-1) - jax.nn.logsumexp(z, axis=-1, keepdims=True)

    out = jax.lax.map(body, (hs, ts, ys))  # [k, B, c, M]
    out = out.swapaxes(0, 1).reshape(B, k * c, M)[:, :n].reshape(B, nb, L, M)
    return out[..., 0] if squeeze else out


def replay_logprobs(model, record: RolloutRecord, prompts, prompt_valid, steps, targets, *, chunk: int = 256):
    """log π_θ^k(targets | s_k) at the chosen states (tempered, as the sampler drew): ([B, nb, L(, M)], valid)."""
    hidden, valid, _ = replay_hidden(model, record, prompts, prompt_valid, steps)
    _, _, tau, _ = gather_states(record, steps)
    return tempered_logprobs(model, hidden, tau, jnp.asarray(targets), chunk=chunk), valid

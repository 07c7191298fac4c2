"""Stage-1 objective: uniform-noise block diffusion + clean-stream AR loss, every canvas in ONE forward pass.

    loss, metrics = stage1_loss(model, batch, key, Stage1Config())

Per training row (docs/stage1.md §2-§5):
  1. t ~ per (example, block), stratified over the batch, clipped to [t_min, t_max]; alpha_t = 1 - t.
  2. x_t: each supervised canvas token replaced with prob. 1 - alpha_t by a uniform id over all V (prompt, clean
     context and unused canvases are never noised).
  3. One forward over [clean stream (causal, = the AR model) ; noisy stream (bidirectional inside its block)] with the
     strict block mask (`dgemma.diffusion.masks`): canvas b sees the prompt and clean blocks < b only, and on sliding
     layers exactly the W - 1 clean tokens before it -- the same context the inference decoder sees through the cache.
  4. Self-conditioning: with prob. p_sc per example, a stop-gradient first pass provides the previous prediction's
     soft embedding; other rows get exactly zero (a mask, never "zero logits"). The first pass re-runs the whole
     layout (`self_cond_pass: full`) or only the noisy stream over the clean stream's K/V (`noisy_stream`,
     `dgemma.diffusion.split_streams`): the same loss, fewer FLOPs.
  5. L = CE(noisy-stream predictions, x0) over supervised canvas positions  +  lambda_AR * next-token CE (clean stream).

Head alignment: `noshift` (DiffusionGemma, the only exportable one): canvas query p predicts x0[p].
`shift` (Dream-style ablation): query p-1 predicts x0[p]; block b's first token is predicted by the clean stream at
position s_b - 1 (the AR prediction), and the block's last query is unused.
"""

from __future__ import annotations

import functools
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np

from dgemma.diffusion import masks as bd_masks
from dgemma.diffusion.corruption import corrupt
from dgemma.diffusion.losses import per_example_mean, token_nll_from_hidden
from dgemma.diffusion.schedule import expand_per_block, sample_t
from dgemma.diffusion.split_streams import split_hidden
from dgemma.diffusion.stage1_config import Stage1Config
from dgemma.model.attention_chunked import check_chunking
from dgemma.model.config import FULL, SLIDING
from dgemma.model.kernels import SplashMask, StaticPattern, check_splash_layout


def noise_batch(key, batch: dict, cfg: Stage1Config, vocab_size: int, n_blocks: int):
    """Sample per-(example, block) t and the noisy response x_t. Returns (t [B, N], x_t [B, R], weights [B, R]):
    `weights` marks the supervised positions (the loss weighting w(t) is applied by `loss_weights`)."""
    tokens, block_id = batch["tokens"], batch["block_id"]
    R = batch["diffusion_weight"].shape[1]
    B = tokens.shape[0]
    k_t, k_noise, k_sel = jax.random.split(key, 3)
    t = sample_t(k_t, B, n_blocks, cfg.t_min, cfg.t_max, cfg.antithetic)
    resp_blk = block_id[:, -R:]
    weights = batch["diffusion_weight"].astype(jnp.float32)
    if cfg.block_selection == "one_random":  # Google's recipe: one supervised block per example
        used = batch["block_used"].astype(jnp.float32)
        logits = jnp.where(used > 0, 0.0, -jnp.inf)
        chosen = jax.random.categorical(k_sel, logits, axis=-1)
        weights = weights * (resp_blk == chosen[:, None])
    alpha = expand_per_block(1.0 - t, resp_blk, fill=1.0)
    x_t = corrupt(k_noise, tokens[:, -R:], alpha, weights > 0, vocab_size=vocab_size)
    return t, x_t, weights


def loss_weights(t, resp_blk, cfg: Stage1Config):
    """w(t) per response position [B, R] (docs/stage1.md §3): 1 (`base`) or min(1/(1-t), reweight_max).

    It multiplies the NLL, never the averaging weights: the per-example loss is w(t) x mean NLL (a weight inside
    Σw·nll/Σw would cancel)."""
    if cfg.loss_weighting == "base":
        return jnp.ones(resp_blk.shape, jnp.float32)
    return jnp.minimum(1.0 / (1.0 - expand_per_block(t, resp_blk, fill=0.0)), cfg.reweight_max)


def one_pass_masks(model_cfg, streams: bd_masks.Streams, *, clean_attention="causal", strict=True,
                   num_clean: int | None = None):
    """{layer_type: mask} for the concatenated streams (the docs/stage1.md §4 rule; `strict=False` only for tests): dense
    [B, T, T] arrays, `IntervalMask` structures for `model.execution.attention_impl` "chunked" / "tokamax", or Splash
    masks (the rule of a canonical row as a static pattern + per-example key validity) for "splash", which needs
    `num_clean` (P + R)."""
    info = streams.info
    common = dict(decoder_sliding=model_cfg.decoder_sliding, clean_attention=clean_attention, strict=strict)
    T = streams.tokens.shape[1]
    if model_cfg.execution.attention_impl == "splash":
        if num_clean is None:
            raise ValueError("model.execution.attention_impl=splash: one_pass_masks needs num_clean (the clean "
                             "stream's length)")
        if info.segment is not None or not strict:
            raise ValueError("model.execution.attention_impl=splash: packed segments and strict=False are dense-only")
        ex = model_cfg.execution
        check_splash_layout(T, T, ex.attention_q_chunk, ex.attention_kv_chunk)
        key_valid = cast(jax.Array, info.valid)  # the streams' TokenInfo holds jax arrays (`concat_streams`)
        return {kind: SplashMask(StaticPattern(canonical_one_pass_pattern(
                    num_clean, T - num_clean, model_cfg.canvas_length, window, kind, **common)), key_valid)
                for kind, window in ((SLIDING, model_cfg.sliding_window), (FULL, None))}
    if model_cfg.execution.attention_impl != "dense":
        if model_cfg.execution.attention_impl == "chunked":  # Tokamax does not tile by these settings
            check_chunking(T, T, model_cfg.execution.attention_q_chunk, model_cfg.execution.attention_kv_chunk,
                           "one-pass [clean ; noisy]")
        return {SLIDING: bd_masks.block_diffusion_intervals(info, window=model_cfg.sliding_window,
                                                            layer_type=SLIDING, **common),
                FULL: bd_masks.block_diffusion_intervals(info, window=None, layer_type=FULL, **common)}
    return {
        SLIDING: bd_masks.block_diffusion_mask(info, info, window=model_cfg.sliding_window, layer_type=SLIDING,
                                               **common),
        FULL: bd_masks.block_diffusion_mask(info, info, window=None, layer_type=FULL, **common),
    }


@functools.lru_cache(maxsize=16)
def canonical_one_pass_pattern(num_clean: int, num_noisy: int, canvas_length: int, window,
                               layer_type: bd_masks.LayerTypeArg,
                               **rule) -> np.ndarray:
    """The one-pass rule (docs/stage1.md §4) [P + 2R, P + 2R] of a row with every token valid, positions = arange and blocks of
    `canvas_length` after the prompt: the training layout's index structure (`dgemma.data.layout`), on which only key
    validity varies between examples (left padding, unused canvases)."""
    P, L = num_clean - num_noisy, canvas_length
    if num_noisy % L or P < 0:
        raise ValueError(f"one-pass layout: response length {num_noisy} is not a multiple of model.canvas_length={L}")
    # [clean: prompt P, response blocks ; noisy: the response blocks again], in numpy: no device is touched while a
    # program for another platform is traced
    response = np.repeat(np.arange(num_noisy // L), L)
    blk = np.concatenate([np.full(P, bd_masks.BLK_PROMPT), response, response])[None]
    pos = np.concatenate([np.arange(num_clean), P + np.arange(num_noisy)])[None]
    noisy = (np.arange(num_clean + num_noisy) >= num_clean)[None]
    start = np.where(blk < 0, 0, P + L * np.maximum(blk, 0))
    info = bd_masks.TokenInfo(pos, blk, noisy, np.ones_like(noisy), None, start)
    allowed = bd_masks.block_diffusion_mask(info, info, window=window, layer_type=layer_type, xp=np, **rule)
    return np.asarray(allowed[0])


def _one_pass_input(model, streams, num_clean: int, soft_embeds, sc_mask):
    """The concatenated layout's input embeddings; the noisy stream goes through self-conditioning."""
    clean = model.embedder.encode(streams.tokens[:, :num_clean], model.dtype)
    noisy = model.decoder_input(streams.tokens[:, num_clean:], soft_embeds, sc_mask)
    return jnp.concatenate([clean, noisy], axis=1)


def one_pass_hidden(model, streams, masks, num_clean: int, soft_embeds=None, sc_mask=None):
    """Final hidden states of the concatenated forward; the noisy stream goes through self-conditioning."""
    x = _one_pass_input(model, streams, num_clean, soft_embeds, sc_mask)
    hidden, _ = model.forward(None, streams.positions, masks, embeds=x, decoder_tokens=streams.is_noisy,
                              per_layer_tokens=streams.tokens)
    return hidden


def one_pass_hidden_and_twin(model, streams, masks, num_clean: int, soft_embeds=None, sc_mask=None):
    """`one_pass_hidden` and a twin model: a later pass run with the twin adds its scanned-parameter gradient into
    this pass's stack (`Transformer.forward_sharing_scan_grads`; the twin is the model itself when unscanned)."""
    x = _one_pass_input(model, streams, num_clean, soft_embeds, sc_mask)
    hidden, _, twin = model.forward_sharing_scan_grads(streams.positions, masks, embeds=x,
                                                       decoder_tokens=streams.is_noisy,
                                                       per_layer_tokens=streams.tokens)
    return hidden, twin


def _shift_targets_hidden(hidden_clean, hidden_noisy, P: int, L: int):
    """`shift` alignment: per block, [anchor = clean hidden at s_b - 1 ; noisy queries 0..L-2]."""
    B, R, H = hidden_noisy.shape
    n = R // L
    anchors = hidden_clean[:, P - 1 + L * jnp.arange(n)]  # [B, n, H]: clean index of position s_b - 1
    blocks = hidden_noisy.reshape(B, n, L, H)
    return jnp.concatenate([anchors[:, :, None], blocks[:, :, :-1]], axis=2).reshape(B, R, H)


def self_conditioning_hidden(first, T: int, P: int, L: int, alignment: str):
    """Hidden states whose predictions feed self-conditioning: row p must be the prediction OF x0[p] (the sampler's
    previous-step logits at p). Under `shift` that is the shifted row (the anchor / query p-1), not query p."""
    if alignment == "shift":
        return _shift_targets_hidden(first[:, :T], first[:, T:], P, L)
    return first[:, T:]


def stage1_loss(model, batch: dict, key, cfg: Stage1Config, *, strict_mask: bool = True):
    """The stage-1 loss and metrics for one batch (see module docstring). `batch` follows `dgemma.data.layout`."""
    mc = model.cfg
    tokens = batch["tokens"]
    R = batch["diffusion_weight"].shape[1]
    T = tokens.shape[1]
    P = T - R
    L = mc.canvas_length
    if R % L:
        raise ValueError(f"response length {R} is not a multiple of model.canvas_length={L}")
    n_blocks = R // L
    k_noise, k_sc = jax.random.split(key)
    t, x_t, weights = noise_batch(k_noise, batch, cfg, mc.vocab_size, n_blocks)
    streams = bd_masks.concat_streams(tokens, x_t, batch["positions"], batch["valid"], batch["block_id"])
    masks = one_pass_masks(mc, streams, clean_attention=cfg.clean_attention, strict=strict_mask, num_clean=T)

    def self_conditioning(first):  # first pass's hidden [B, P + 2R, H] -> the main pass's (soft embeds, row mask)
        tau = None
        if cfg.sc_train_temperature == "sampled_tau":  # feed tempered logits, as the sampler does
            tau = jax.random.uniform(jax.random.fold_in(k_sc, 1), (tokens.shape[0], 1, 1), minval=0.4, maxval=0.8)
        # softmax(logits / tau) . E * sqrt(H), chunked over tokens (no [B, R, V] logits)
        soft = jax.lax.stop_gradient(model.embedder.soft_encode_hidden(
            self_conditioning_hidden(first, T, P, L, cfg.head_alignment), mc.final_logit_softcapping or None,
            model.dtype, temperature=tau, chunk=cfg.ce_chunk))
        return soft, jax.random.bernoulli(k_sc, cfg.p_self_cond, (tokens.shape[0],))

    if cfg.p_self_cond > 0 and cfg.self_cond_pass == "noisy_stream":
        hidden = split_hidden(model, streams, masks, T, self_conditioning)
    else:
        soft, sc_mask = None, None
        if cfg.p_self_cond > 0:
            soft, sc_mask = self_conditioning(jax.lax.stop_gradient(one_pass_hidden(model, streams, masks, T)))
        hidden = one_pass_hidden(model, streams, masks, T, soft, sc_mask)
    h_clean, h_noisy = hidden[:, :T], hidden[:, T:]
    if cfg.head_alignment == "shift":
        h_noisy = _shift_targets_hidden(h_clean, h_noisy, P, L)
    table = model.embedder.embedding[...]
    softcap = mc.final_logit_softcapping or None
    x0 = tokens[:, P:]
    nll = token_nll_from_hidden(h_noisy, table, x0, softcap=softcap, chunk=cfg.ce_chunk)
    diff_ex, diff_has = per_example_mean(nll * loss_weights(t, batch["block_id"][:, P:], cfg), weights)
    diff_loss = jnp.sum(diff_ex) / jnp.maximum(jnp.sum(diff_has), 1.0)
    ar_nll = token_nll_from_hidden(h_clean, table, batch["ar_targets"], softcap=softcap, chunk=cfg.ce_chunk)
    ar_ex, ar_has = per_example_mean(ar_nll, batch["ar_weight"])
    ar_loss = jnp.sum(ar_ex) / jnp.maximum(jnp.sum(ar_has), 1.0)
    loss = diff_loss + cfg.lambda_ar * ar_loss
    # per-(example, block) mean NLL and t, for "loss by noise level" reports
    sup = (weights > 0).astype(jnp.float32).reshape(-1, n_blocks, L)
    block_nll = jnp.sum(nll.reshape(-1, n_blocks, L) * sup, -1) / jnp.maximum(jnp.sum(sup, -1), 1.0)
    corrupted = ((x_t != x0) & (weights > 0)).astype(jnp.float32)
    metrics = {
        "loss": loss, "loss_diffusion": diff_loss, "loss_ar": ar_loss,
        "corrupted_fraction": jnp.sum(corrupted) / jnp.maximum(jnp.sum(weights > 0), 1.0),
        "block_nll": block_nll, "block_t": t, "block_has": jnp.sum(sup, -1) > 0,
    }
    return loss, metrics


SCALAR_METRICS = ("loss", "loss_diffusion", "loss_ar", "corrupted_fraction")


def make_stage1_loss_fn(cfg: Stage1Config):
    """`loss_fn(model, batch, rng) -> (loss, scalar metrics)` for `dgemma.train` (drops the per-block arrays)."""

    def loss_fn(model, batch, rng):
        loss, metrics = stage1_loss(model, batch, rng, cfg)
        return loss, {k: metrics[k] for k in SCALAR_METRICS if k != "loss"}

    return loss_fn

"""The Gemma 4 MoE transformer with its DiffusionGemma modes, on one set of weights.

    model = Transformer(cfg, rngs=nnx.Rngs(0))
    logits = model(tokens)                                    # AR / Gemma4ForCausalLM: causal full forward
    hidden, cache = model.encode(tokens, cache, valid)        # encoder: prefill or commit; writes the cache
    hidden = model.decode(canvas, cache, sc_logits=...)       # decoder: bidirectional canvas; reads the cache
    logits = model.logits(hidden)                             # tied head, fp32 soft-cap 30
    hidden, kv = model.forward(tokens, positions, masks, decoder_tokens=...)   # general (one-pass training)

Layer (as transformers' `Gemma4TextDecoderLayer`; HF names in brackets, see `dgemma.convert.keymap`):
    r  = x + post_attn_norm(Attn(pre_attn_norm(x)))                      [input_/post_attention_layernorm]
    d  = post_mlp_norm(MLP(pre_mlp_norm(r)))                             [pre_/post_feedforward_layernorm(_1)]
    m  = MoE(r): router on the RAW residual r, experts on pre_moe_norm(r) [router, pre/post_feedforward_layernorm_2]
    x' = (r + post_ffw_norm(d + m)) * layer_scalar                       [post_feedforward_layernorm, layer_scalar]

The decoder uses its own `layer_scalar` copy when `cfg.tie_layer_scalar` is False (HF stores two buffers; the
released checkpoint has them equal).

Layers: `layers/i` per layer (default), or with `cfg.scan_layers` a `jax.lax.scan` over periods of stacked blocks
(`scan_blocks/j`, `tail_blocks/k`; `dgemma.model.scan`). `cfg.remat` picks the per-block rematerialisation policy.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from dgemma.model import masks as mask_lib
from dgemma.model.activation_sharding import batch_sharded
from dgemma.model.attention import Attention
from dgemma.model.cache import KVCache
from dgemma.model.config import ModelConfig
from dgemma.model.layers import Embedder, GatedMLP, RMSNorm, param, rms_normalize
from dgemma.model.kv_sharing import shared_keys_values
from dgemma.model.moe import MoEBlock
from dgemma.model.per_layer_embeddings import PerLayerEmbedder, PerLayerInputGate
from dgemma.model.scan import remat_block_fn, run_scanned, scan_geometry, stack_blocks
from dgemma.model.shared_scan_grads import run_scanned_shared


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.execution.param_dtype)
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_type = cfg.layer_types[layer]
        self.pre_attn_norm = RMSNorm(H, eps=eps, dtype=pd)
        self.attn = Attention(cfg, layer, param_dtype=pd, rngs=rngs)
        self.post_attn_norm = RMSNorm(H, eps=eps, dtype=pd)
        self.pre_mlp_norm = RMSNorm(H, eps=eps, dtype=pd)
        self.mlp = GatedMLP(H, cfg.layer_mlp_width(layer), param_dtype=pd, rngs=rngs)
        # dense-only members (enable_moe_block=false) have neither the experts nor the dense branch's own post-norm
        self.post_mlp_norm = RMSNorm(H, eps=eps, dtype=pd) if cfg.enable_moe_block else None
        self.moe: MoEBlock | None = MoEBlock(cfg, param_dtype=pd, rngs=rngs) if cfg.enable_moe_block else None
        self.post_ffw_norm = RMSNorm(H, eps=eps, dtype=pd)
        self.per_layer_gate = (PerLayerInputGate(cfg, param_dtype=pd, rngs=rngs)
                               if cfg.hidden_size_per_layer_input else None)
        self.layer_scalar = param(rngs, (1,), (None,), pd, init="ones")
        self.decoder_layer_scalar = None if cfg.tie_layer_scalar else param(rngs, (1,), (None,), pd, init="ones")

    def scalar(self, decoder_tokens, dtype) -> jax.Array:
        """layer_scalar per token: the decoder copy for noisy/canvas tokens when untied."""
        enc = self.layer_scalar[...].astype(dtype)
        if self.decoder_layer_scalar is None or decoder_tokens is False:
            return enc
        dec = self.decoder_layer_scalar[...].astype(dtype)
        if decoder_tokens is True:
            return dec
        return jnp.where(decoder_tokens[..., None], dec, enc)  # [B, T, 1]

    def __call__(self, x, positions, mask, prefix=None, decoder_tokens=False, per_layer_input=None, shared_kv=None):
        attn_out, kv = self.attn(self.pre_attn_norm(x), positions, mask, prefix, shared_kv)
        r = x + self.post_attn_norm(attn_out)
        ffw = self.mlp(self.pre_mlp_norm(r))
        if self.moe is not None:
            assert self.post_mlp_norm is not None  # built with self.moe (cfg.enable_moe_block)
            ffw = self.post_mlp_norm(ffw) + self.moe(r)  # router reads the un-normed residual r
        out = r + self.post_ffw_norm(ffw)
        if self.per_layer_gate is not None:
            out = self.per_layer_gate(out, per_layer_input)
        return out * self.scalar(decoder_tokens, x.dtype), kv


class SelfConditioning(nnx.Module):
    """Decoder input = RMSNorm_noscale(e + MLP(RMSNorm(s; pre_norm))); s = soft embedding of the previous step.

    s = 0 exactly on the first step (and for rows masked out in training) -- NOT softmax of zero logits.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.execution.param_dtype)
        self.pre_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=pd)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, param_dtype=pd, rngs=rngs)
        self.eps = cfg.rms_norm_eps

    def __call__(self, token_embeds: jax.Array, soft_embeds: jax.Array) -> jax.Array:
        combined = token_embeds + self.mlp(self.pre_norm(soft_embeds))
        return rms_normalize(combined, self.eps).astype(token_embeds.dtype)


def _run_block(block, x, positions, mask, prefix, decoder_tokens, per_layer_input=None, shared_kv=None):
    return block(x, positions, mask, prefix, decoder_tokens, per_layer_input, shared_kv)


def _layer_mask(masks, block):
    """The mask (pytree) a block reads: one per layer type."""
    return masks[block.layer_type]


class Transformer(nnx.Module):
    """Gemma 4 26B-A4B-family decoder stack with the DiffusionGemma encoder/decoder/self-conditioning modes."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = jnp.dtype(cfg.execution.param_dtype)
        self.embedder = Embedder(cfg.vocab_size, cfg.hidden_size, param_dtype=pd, rngs=rngs)
        self.per_layer_embedder = (PerLayerEmbedder(cfg, param_dtype=pd, rngs=rngs)
                                   if cfg.hidden_size_per_layer_input else None)
        blocks = [Block(cfg, i, rngs=rngs) for i in range(cfg.num_hidden_layers)]
        if cfg.execution.scan_layers:  # same random draws as the per-layer model, then stacked (dgemma.model.scan)
            P, n, _ = scan_geometry(cfg)
            self.scan_blocks = nnx.List([stack_blocks(blocks[j:n * P:P]) for j in range(P)])
            self.tail_blocks = nnx.List(blocks[n * P:])
        else:
            self.layers = nnx.List(blocks)
        self.final_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=pd)
        self.self_conditioning = SelfConditioning(cfg, rngs=rngs) if cfg.self_conditioning else None

    @property
    def dtype(self):
        return jnp.dtype(self.cfg.execution.dtype)

    # MARK: core ---------------------------------------------------------------------------------------------
    def forward(self, tokens=None, positions=None, masks=None, *, embeds=None, cache: KVCache | None = None,
                prefix_kvs=None, decoder_tokens=False, per_layer_tokens=None):
        """Run the stack. masks: {layer_type: [B, T, S]}; with `cache`, keys are [cache slots ; new tokens]; with
        `prefix_kvs` (per layer (k, v) [B, C, KV, D], e.g. a clean stream's keys, as `forward` returns them), keys are
        [prefix ; new tokens]. `per_layer_tokens` [B, T]: the ids the per-layer embeddings look up (default `tokens`;
        needed with `embeds` on a PLE model).

        Returns (final-normed hidden [B, T, H], per-layer (k, v) of the new tokens; None for KV-shared layers).
        """
        # FSDP: the batch layout, not the embedding table's (dgemma.model.activation_sharding)
        x = batch_sharded(self.embedder.encode(tokens, self.dtype) if embeds is None else embeds)
        per_layer_inputs = self.per_layer_inputs(tokens if per_layer_tokens is None else per_layer_tokens, x)
        if cache is not None:
            prefix_kvs = list(zip(cache.keys, cache.values))

        def scanned_part(x, run, n, P):
            prefixes = None
            if prefix_kvs is not None:  # per layer: gather each period position's layers (a copy)
                prefixes = tuple((jnp.stack([kv[0] for kv in prefix_kvs[j:n * P:P]]),
                                  jnp.stack([kv[1] for kv in prefix_kvs[j:n * P:P]])) for j in range(P))
            x, kvs = run_scanned(
                self.scan_blocks, x, lambda b, prefix: (positions, _layer_mask(masks, b), prefix, decoder_tokens),
                run, n, prefixes)
            return x, kvs, None

        hidden, kvs, _ = self._walk_stack(x, positions, masks, decoder_tokens, prefix_kvs, scanned_part,
                                          per_layer_inputs)
        return hidden, kvs

    def per_layer_inputs(self, tokens, embeds):
        """[B, T, L, P] per-layer inputs (dgemma.model.per_layer_embeddings), or None for a model without PLE."""
        if self.per_layer_embedder is None:
            return None
        if tokens is None:
            raise ValueError("Transformer.forward: this model has per-layer embeddings "
                             "(hidden_size_per_layer_input > 0), which need token ids: pass per_layer_tokens")
        return self.per_layer_embedder.inputs(tokens, embeds)

    def forward_sharing_scan_grads(self, positions, masks, *, embeds, decoder_tokens=False, per_layer_tokens=None):
        """`forward(None, positions, masks, embeds=embeds, decoder_tokens=...)` (no cache, no prefix), plus a twin of
        this model whose scanned layers run on this pass's pass-through parameters: a later pass run with the twin
        accumulates its scanned-parameter gradient into this pass's backward, one gradient stack instead of two
        (`dgemma.model.shared_scan_grads`). Unscanned layers have no stack to share: the twin is the model itself.
        Returns (final-normed hidden, per-layer (k, v), twin)."""
        if not self.cfg.execution.scan_layers:
            hidden, kvs = self.forward(None, positions, masks, embeds=embeds, decoder_tokens=decoder_tokens,
                                       per_layer_tokens=per_layer_tokens)
            return hidden, kvs, self
        static = isinstance(decoder_tokens, bool)

        def scanned_part(x, run, n, P):  # -> (x, kvs, the scanned blocks around the passed-through parameters)
            return run_scanned_shared(
                self.scan_blocks, x, (positions, masks, None if static else decoder_tokens),
                lambda b, inp: (inp[0], _layer_mask(inp[1], b), None, decoder_tokens if static else inp[2]), run, n)

        hidden, kvs, blocks = self._walk_stack(embeds, positions, masks, decoder_tokens, None, scanned_part)
        twin = nnx.merge(*nnx.split(self))  # the same arrays; only its scan_blocks change
        twin.scan_blocks = blocks
        return hidden, kvs, twin

    def _walk_stack(self, x, positions, masks, decoder_tokens, prefix_kvs, scanned_part, per_layer_inputs=None):
        """The layer walk both forwards share: the scanned periods through `scanned_part(x, run, n, P)` ->
        (x, kvs, extra), then the unscanned (tail) blocks one by one, each under the model's remat policy; then the
        final norm. Returns (hidden, kvs, extra); extra is None without scanned layers."""
        run = remat_block_fn(_run_block, self.cfg.execution.remat, static_mode=isinstance(decoder_tokens, bool))
        kvs, extra = [], None
        x = batch_sharded(x)
        first = 0  # index of the first unscanned layer
        if self.cfg.execution.scan_layers:
            P, n, _ = scan_geometry(self.cfg)
            x, kvs, extra = scanned_part(x, run, n, P)
            first = n * P
        for i, block in enumerate(self.tail_blocks if self.cfg.execution.scan_layers else self.layers, start=first):
            prefix = None if prefix_kvs is None else prefix_kvs[i]
            producer, shared = self.cfg.kv_producer(i), None
            if producer is not None:  # KV sharing (unscanned layers only: the config refuses it with scan_layers)
                shared = shared_keys_values(kvs[producer], None if prefix_kvs is None else prefix_kvs[producer])
                prefix = None
            pli = None if per_layer_inputs is None else per_layer_inputs[:, :, i]
            x, kv = run(block, x, positions, _layer_mask(masks, block), prefix, decoder_tokens, pli, shared)
            x = batch_sharded(x)
            kvs.append(kv)
        return self.final_norm(x), kvs, extra

    def logits(self, hidden: jax.Array) -> jax.Array:
        return self.embedder.decode(hidden, self.cfg.final_logit_softcapping)

    # MARK: AR / encoder ---------------------------------------------------------------------------------------
    def __call__(self, tokens, positions=None, valid=None):
        """Causal LM logits [B, T, V] (Gemma4ForCausalLM semantics; positions default to arange(T))."""
        B, T = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(T)[None], (B, T)) if positions is None else positions
        valid = jnp.ones((B, T), bool) if valid is None else valid
        hidden, _ = self.forward(tokens, positions, mask_lib.full_forward_masks(self.cfg, positions, valid))
        return self.logits(hidden)

    def encode(self, tokens, cache: KVCache, valid=None):
        """Causal encoder pass over new tokens at positions N.., writing their K/V. Returns (hidden, cache)."""
        B, T = tokens.shape
        valid = jnp.ones((B, T), bool) if valid is None else valid
        positions = jnp.broadcast_to(cache.length + jnp.arange(T, dtype=jnp.int32)[None], (B, T))
        masks = mask_lib.encoder_masks(self.cfg, cache, positions, valid)
        hidden, kvs = self.forward(tokens, positions, masks, cache=cache)
        return hidden, cache.write(kvs, valid)

    # MARK: decoder (denoiser) ---------------------------------------------------------------------------------
    def soft_embed(self, sc_logits: jax.Array) -> jax.Array:
        """Soft embedding of the previous step's (tempered) logits: softmax(l) . E * sqrt(H)."""
        return self.embedder.soft_encode(sc_logits, self.dtype)

    def decoder_input(self, canvas, soft_embeds=None, sc_mask=None):
        """Self-conditioned decoder input. soft_embeds [B, L, H] or None (= exactly zero); sc_mask [B] bool."""
        e = batch_sharded(self.embedder.encode(canvas, self.dtype))  # before the self-conditioning MLP
        if self.self_conditioning is None:
            return e
        s = jnp.zeros_like(e) if soft_embeds is None else soft_embeds.astype(e.dtype)
        if sc_mask is not None:
            s = s * sc_mask.astype(e.dtype)[:, None, None]
        return self.self_conditioning(e, s)

    def decode(self, canvas, cache: KVCache, *, sc_logits=None, soft_embeds=None, sc_mask=None, canvas_valid=None):
        """Bidirectional denoiser over canvas [B, L] at positions N..N+L-1, reading (never writing) the cache."""
        B, L = canvas.shape
        if sc_logits is not None:
            soft_embeds = self.soft_embed(sc_logits)
        x = self.decoder_input(canvas, soft_embeds, sc_mask)
        positions = jnp.broadcast_to(cache.length + jnp.arange(L, dtype=jnp.int32)[None], (B, L))
        canvas_valid = jnp.ones((B, L), bool) if canvas_valid is None else canvas_valid
        masks = mask_lib.decoder_masks(self.cfg, cache, positions, canvas_valid)
        hidden, _ = self.forward(None, positions, masks, embeds=x, cache=cache, decoder_tokens=True,
                                 per_layer_tokens=canvas)  # PLE: the canvas ids and the self-conditioned input
        return hidden


def abstract_model(cfg: ModelConfig) -> Transformer:
    """Shape-only model (no allocation): for parameter counts, shardings and restore targets."""
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))


def model_from_params(cfg: ModelConfig, params) -> Transformer:
    """Rebuild a `Transformer` around an existing params state (e.g. a restored or just-trained one); no copy."""
    graphdef, _ = nnx.split(abstract_model(cfg))
    return nnx.merge(graphdef, params)


def count_params(cfg: ModelConfig, *, include_self_conditioning: bool = False) -> int:
    """Number of text parameters (tied head counted once). Excludes self-conditioning unless asked."""
    state = nnx.state(abstract_model(cfg.replace(self_conditioning=include_self_conditioning)), nnx.Param)
    return sum(math.prod(x.shape) for x in jax.tree.leaves(state))  # Python ints: exact, no device ops


__all__ = ["Block", "SelfConditioning", "Transformer", "abstract_model", "count_params", "model_from_params"]

"""Per-layer embeddings (PLE) of the small Gemma 4 models (E2B, E4B), exactly as transformers' `Gemma4TextModel`.

Every layer i gets a small residual input u_i [P] (P = `hidden_size_per_layer_input`) made of a token-identity part
and a context part of the input embedding e (the scaled token embedding the stack starts from):

    ple    = table[token] * sqrt(P)                   table [V_ple, L * P], viewed as [L, P] per token
    ctx    = RMSNorm_P((e . W_model) / sqrt(H))        W_model [H, L * P]          [per_layer_model_projection(_norm)]
    u      = (ctx + ple) / sqrt(2)                     [B, T, L, P]

and, inside layer i, after the feed-forward residual and before `layer_scalar`:

    x' = x + RMSNorm_H( (gelu_tanh(x . W_gate_i) * u_i) . W_proj_i )   [per_layer_input_gate, per_layer_projection,
                                                                         post_per_layer_input_norm]

`PerLayerEmbedder.inputs` computes u for given token ids and input embeddings; the decoder of the DiffusionGemma
modes passes the canvas ids and its (self-conditioned) input. The table is the model's largest single tensor
(262,144 x 35 * 256 for E2B): it is sharded over `vocab` rows x `embed` columns like the token embedding's columns.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from dgemma.model.activation_sharding import batch_sharded
from dgemma.model.layers import RMSNorm, param

if TYPE_CHECKING:
    from dgemma.model.config import ModelConfig


class PerLayerEmbedder(nnx.Module):
    """The PLE table, the context projection and its norm (model-level parameters)."""

    def __init__(self, cfg: ModelConfig, *, param_dtype, rngs: nnx.Rngs):
        L, P, H = cfg.num_hidden_layers, cfg.hidden_size_per_layer_input, cfg.hidden_size
        self.num_layers, self.width, self.hidden_size = L, P, H
        self.table = param(rngs, (cfg.vocab_size_per_layer_input, L * P), ("vocab", "embed"), param_dtype)
        self.model_projection = param(rngs, (H, L * P), ("embed", None), param_dtype)
        self.projection_norm = RMSNorm(P, eps=cfg.rms_norm_eps, dtype=param_dtype, axis_name=None)

    def inputs(self, tokens: jax.Array, embeds: jax.Array) -> jax.Array:
        """tokens [B, T] int, embeds [B, T, H] -> per-layer inputs u [B, T, L, P] in the embeds' dtype."""
        dt = embeds.dtype
        table = self.table[...]
        # HF's scaled embedding: sqrt(P) cast to the table's dtype, product in the table's dtype
        # the rows on the batch, not on the table's columns (dgemma.model.activation_sharding)
        ple = batch_sharded(jnp.take(table, tokens, axis=0)) * jnp.asarray(math.sqrt(self.width), table.dtype)
        ple = ple.astype(dt).reshape(*tokens.shape, self.num_layers, self.width)
        ctx = (embeds @ self.model_projection[...].astype(dt)) * (self.hidden_size ** -0.5)
        ctx = self.projection_norm(ctx.reshape(*embeds.shape[:-1], self.num_layers, self.width))
        return batch_sharded((ctx + ple) * (2.0 ** -0.5))


class PerLayerInputGate(nnx.Module):
    """The per-layer part inside layer i: x + post_norm(proj(gelu_tanh(gate(x)) * u_i))."""

    def __init__(self, cfg: ModelConfig, *, param_dtype, rngs: nnx.Rngs):
        H, P = cfg.hidden_size, cfg.hidden_size_per_layer_input
        self.gate = param(rngs, (H, P), ("embed", None), param_dtype)
        self.projection = param(rngs, (P, H), (None, "embed"), param_dtype)
        self.post_norm = RMSNorm(H, eps=cfg.rms_norm_eps, dtype=param_dtype)

    def __call__(self, x: jax.Array, per_layer_input: jax.Array) -> jax.Array:
        dt = x.dtype
        h = jax.nn.gelu(x @ self.gate[...].astype(dt), approximate=True) * per_layer_input.astype(dt)
        return x + self.post_norm(h @ self.projection[...].astype(dt))


__all__ = ["PerLayerEmbedder", "PerLayerInputGate"]

"""Building blocks of the Gemma 4 backbone: RMSNorm, embedder, gated MLP, RoPE.

Every parameter carries its logical axis names as NNX metadata (`axes=(...)`); `dgemma.parallel.rules` maps those
names to mesh axes, so sharding is configuration and never a model edit. Variables are created with
`eager_sharding=False` so a model can be constructed (or `nnx.eval_shape`d) without a mesh context.

Precision rules copied from transformers' Gemma 4 (`modeling_gemma4.py`): RMSNorm, RoPE tables and softmaxes run in fp32
and cast back to the activation dtype.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import jax.numpy as jnp
from flax import nnx

from dgemma.model.lora_experts import adapt


def param(rngs: nnx.Rngs | None, shape, axes: tuple[str | None, ...], dtype, init: str = "normal", std: float = 0.02):
    """Create an `nnx.Param` with logical-axis metadata. `init` is 'normal' (N(0, std)) or 'ones'."""
    assert len(shape) == len(axes), (shape, axes)
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        # rngs is None only from RMSNorm (init "ones"): every module with a random init takes an nnx.Rngs
        assert rngs is not None
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, axes=tuple(axes), eager_sharding=False)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(mean(x^2) + eps), computed in fp32 (the weightless "noscale" RMSNorm). Returns fp32."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """Gemma 4 RMSNorm. The weight multiplies directly (init 1); this is NOT Gemma 2/3's (1 + w)."""

    def __init__(self, dim: int, *, eps: float, dtype, rngs: nnx.Rngs | None = None, axis_name: str | None = "embed"):
        self.eps = eps
        self.scale = param(rngs, (dim,), (axis_name,), dtype, init="ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        return (rms_normalize(x, self.eps) * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class Embedder(nnx.Module):
    """Token embedding, tied LM head and the self-conditioning soft embedding.

    `encode` multiplies by sqrt(H) cast to the weight dtype (in bf16 sqrt(2816)=53.07 becomes 53.0, as in HF).
    `decode` is the tied head: logits = softcap * tanh((h . E^T) / softcap), computed in fp32 (DiffusionGemma casts
    to fp32 before the soft-cap; for fp32 activations this equals Gemma4ForCausalLM bit for bit).
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, param_dtype, rngs: nnx.Rngs):
        self.embedding = param(rngs, (vocab_size, hidden_size), ("vocab", "embed"), param_dtype)
        self.hidden_size = hidden_size

    def scale(self, dtype) -> jax.Array:
        return jnp.asarray(math.sqrt(self.hidden_size), self.embedding[...].dtype).astype(dtype)

    def encode(self, tokens: jax.Array, dtype) -> jax.Array:
        table = self.embedding[...]
        return jnp.take(table, tokens, axis=0).astype(dtype) * self.scale(dtype)

    def soft_encode(self, logits: jax.Array, dtype) -> jax.Array:
        """softmax_fp32(logits) cast to E's dtype, times E, times sqrt(H): HF's self-conditioning soft embedding."""
        table = self.embedding[...]
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(table.dtype)
        return (probs @ table).astype(dtype) * self.scale(dtype)

    def soft_encode_hidden(self, hidden: jax.Array, softcap: float | None, dtype, *, temperature=None,
                           chunk: int = 256) -> jax.Array:
        """`soft_encode(decode(hidden) / temperature)` chunked over tokens: [B, T, V] logits never materialise.

        Used by training's self-conditioning first pass, where R canvas tokens x V = 262k logits would otherwise be
        ~1 GB per row in fp32. temperature: None or broadcastable to [B, 1, 1].
        """
        B, T, H = hidden.shape
        c = max(1, min(chunk, T))
        n = -(-T // c)
        hs = jnp.pad(hidden, ((0, 0), (0, n * c - T), (0, 0))).reshape(B, n, c, H).swapaxes(0, 1)

        def body(hc):
            z = self.decode(hc, softcap)
            if temperature is not None:
                z = z / temperature
            return self.soft_encode(z, dtype)

        out = jax.lax.map(body, hs)  # [n, B, c, H]
        return out.swapaxes(0, 1).reshape(B, n * c, H)[:, :T]

    def decode(self, hidden: jax.Array, softcap: float | None) -> jax.Array:
        logits = jnp.einsum("...h,vh->...v", hidden, self.embedding[...].astype(hidden.dtype))
        logits = logits.astype(jnp.float32)
        if softcap:
            logits = softcap * jnp.tanh(logits / softcap)
        return logits


class GatedMLP(nnx.Module):
    """down( gelu_tanh(gate(x)) * up(x) ): the dense MLP beside the experts, and the self-conditioning MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, param_dtype, rngs: nnx.Rngs):
        self.gate = param(rngs, (hidden_size, intermediate_size), ("embed", "mlp"), param_dtype)
        self.up = param(rngs, (hidden_size, intermediate_size), ("embed", "mlp"), param_dtype)
        self.down = param(rngs, (intermediate_size, hidden_size), ("mlp", "embed"), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = x.dtype
        g = adapt(self, "gate", x, x @ self.gate[...].astype(dt))
        u = adapt(self, "up", x, x @ self.up[...].astype(dt))
        h = jax.nn.gelu(g, approximate=True) * u
        return adapt(self, "down", h, h @ self.down[...].astype(dt))


# MARK: RoPE -----------------------------------------------------------------------------------------------------


def rope_inv_freq(head_dim: int, theta: float, rotated_pairs: int) -> np.ndarray:
    """Inverse frequencies over head_dim/2 pairs; pairs >= `rotated_pairs` get frequency 0 (pass through).

    Proportional RoPE (full layers): the exponent divides by the FULL head_dim, not by the rotated width.
    """
    # numpy on purpose: the table is static config, computed identically under tracing / eval_shape.
    i = np.arange(head_dim // 2, dtype=np.float32)
    inv = (1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))).astype(np.float32)
    return np.where(i < rotated_pairs, inv, np.float32(0.0)).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x: [B, T, heads, D]; positions: [B, T] int. cos/sin in fp32, cast to x.dtype."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos = jnp.cos(emb).astype(x.dtype)[:, :, None, :]
    sin = jnp.sin(emb).astype(x.dtype)[:, :, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin

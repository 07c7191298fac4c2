"""Shared builders of the stage-1 tests: a prompt + N canvases layout with left padding and unused blocks, and a
model whose every weight is moved off its initial value."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def block_layout(tokens, P: int, L: int, N: int, left_pad, unused_last_block):
    """Lay [B, P + N*L] `tokens` out as a prompt of P then N canvases of L: row b is left-padded by left_pad[b] and its
    last block is unused where unused_last_block[b] (padding: token 0, invalid, block id -2; prompt: block id -1).
    Returns numpy (tokens, valid [B, P + N*L] bool, block_id [B, P + N*L])."""
    tokens = np.array(tokens)
    B = tokens.shape[0]
    valid = np.ones(tokens.shape, bool)
    block_id = np.concatenate([np.full((B, P), -1), np.repeat(np.arange(N), L)[None].repeat(B, 0)], axis=1)
    for b in range(B):
        valid[b, : left_pad[b]] = False
        block_id[b, : left_pad[b]] = -2
        tokens[b, : left_pad[b]] = 0
        if unused_last_block[b]:
            valid[b, P + (N - 1) * L:] = False
            block_id[b, P + (N - 1) * L:] = -2
            tokens[b, P + (N - 1) * L:] = 0
    return tokens, valid, block_id


def perturb_params(model, seed: int = 9, scale: float = 0.1):
    """Add scale x N(0, 1) to every parameter of `model` (in place; returns it): no weight keeps its initial value
    (zero-initialised or unit scales would hide bugs). The noise is drawn and added on the host: eager JAX draws would
    compile one threefry program per parameter shape (~1 s each on CPU)."""
    state = nnx.state(model, nnx.Param)
    rng = np.random.default_rng(seed)

    def perturbed(x):
        x32 = np.asarray(x, np.float32)
        return jnp.asarray((x32 + scale * rng.standard_normal(x.shape, np.float32)).astype(x.dtype))

    nnx.update(model, jax.tree.map(perturbed, state))
    return model


def stage1_batch(P: int, L: int, N: int, left_pad, unused_last_block, seed: int = 0) -> dict:
    """A stage-1 batch (`dgemma.data.layout` keys) of len(left_pad) rows laid out by `block_layout`: random tokens,
    positions = arange, every valid canvas position supervised, AR targets on the valid tokens after the prompt."""
    B, R = len(left_pad), N * L
    rng = np.random.default_rng(seed)
    tokens, valid, block_id = block_layout(rng.integers(3, 120, (B, P + R)), P, L, N, left_pad, unused_last_block)
    ar_w = valid.astype(np.float32)
    ar_w[:, :P - 1] = 0
    batch = dict(tokens=tokens.astype(np.int32), valid=valid, block_id=block_id.astype(np.int32),
                 positions=np.broadcast_to(np.arange(P + R), (B, P + R)).astype(np.int32),
                 diffusion_weight=valid[:, P:].astype(np.float32),
                 ar_targets=np.concatenate([tokens[:, 1:], np.zeros((B, 1), int)], 1).astype(np.int32),
                 ar_weight=ar_w, block_used=np.array([[True] * N] * B))
    return {k: jnp.asarray(v) for k, v in batch.items()}


def max_rel(a, b) -> float:
    """max |a - b| / max(1, max |b|), in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(1.0, np.abs(b).max()))


def assert_rel_close(a, b, tol: float = 1e-5, msg: str = "") -> None:
    """`max_rel(a, b) <= tol`: fp32 agreement scaled by the reference's magnitude. Two different programs (another
    fusion, cache layout or summation order) agree to a few ulps of their largest value, so an absolute 1e-5 on
    values of 5-20 passes or fails with the machine's XLA; a real bug is off by O(1)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, f"{msg} shapes {a.shape} != {b.shape}"
    err = max_rel(a, b)
    if err > tol:
        at = np.unravel_index(np.abs(a - b).argmax(), a.shape)
        raise AssertionError(f"{msg} max_rel {err:.3g} > {tol:g}: at {at} got {a[at]!r}, want {b[at]!r} "
                             f"(max |want| {np.abs(b).max():.3g})")

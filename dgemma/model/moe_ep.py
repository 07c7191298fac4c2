"""Expert parallelism for the MoE experts: a `shard_map` dispatch over one mesh axis, dropless, routed per shard.

    out = expert_parallel_experts(x, weights, idx, gate, up, down, expert_axis="expert", ffn=expert_ffn)

Called by `dgemma.model.moe.Experts` under an active mesh (`jax.set_mesh`) when `model.execution.moe_impl` selects it.
The model layer only needs the mesh axis NAME; nothing here imports `dgemma.parallel`.

Layout inside the shard_map (manual over every mesh axis):
  * tokens [N, H] are split over ALL mesh axes of size > 1 (mesh order), `n = N / devices` per device. Tokens that
    arrive sharded over (data, fsdp) and replicated over `expert` are only sliced further: no communication, and no
    device computes another device's expert work twice;
  * expert weights [E, ...] are split over `expert_axis` (ep = its size): device `e` holds experts
    [e * E/ep, (e+1) * E/ep). Whatever else the rules shard (e.g. `embed` on fsdp) is gathered at the boundary,
    exactly as FSDP gathers any weight before use.

Per device, within its group of `ep` devices along `expert_axis` (the "all-gather + local ragged_dot + reduce-scatter"
collective; `ragged_all_to_all` is not implemented by XLA:CPU in jax 0.10.2, so it cannot be tested here, see
docs/expert_parallelism.md):
  1. all-gather the group's tokens and their (already computed, per-token) routing: [ep * n, H], [ep * n, k];
  2. keep only the slots routed to the local experts, sorted by local expert (a per-shard sort over ep * n * k
     keys, never a global one); the buffer holds ep * n * min(k, E/ep) rows, the most a device can receive since a
     token's top-k experts are distinct: no capacity limit, nothing is dropped, and a token's output never depends
     on the other tokens of the batch;
  3. the gated expert FFN as `jax.lax.ragged_dot`s with the local group sizes (rows past the routed ones are zero);
  4. weight by the fp32 routing weights, scatter-add per token (fp32), reduce-scatter over `expert_axis`: each
     device gets back the sum over all experts for its own n tokens.
Autodiff: all-gather and reduce-scatter are each other's transposes, so gradients need no custom rule.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

__all__ = ["active_expert_axis_size", "ep_collective_bytes", "ep_expert_weight_bytes", "ep_rows_per_token",
           "expert_parallel_experts", "per_shard_experts"]

def ep_rows_per_token(top_k: int, num_experts: int, ep: int) -> int:
    """Rows of the dropless dispatch buffer per own token: ep x min(k, E/ep), the most a device can receive since a
    token's top-k are distinct experts (the planner's MoE and adapter terms count the same buffer)."""
    return ep * min(top_k, num_experts // ep)


ExpertFFN = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def active_expert_axis_size(expert_axis: str) -> int | None:
    """Size of `expert_axis` in the active mesh; None when no mesh is active or it has no such axis."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or expert_axis not in mesh.axis_names:
        return None
    return int(mesh.shape[expert_axis])


def _token_axes(mesh) -> tuple[str, ...]:
    return tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)


def _pad_tokens(x, weights, idx, devices: int, pad_id: int):
    """Pad the token dimension to a multiple of `devices`; padded slots carry expert id `pad_id` and weight 0."""
    pad = (-idx.shape[0]) % devices
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
        weights = jnp.pad(weights, ((0, pad), (0, 0)))
        idx = jnp.pad(idx, ((0, pad), (0, 0)), constant_values=pad_id)
    return x, weights, idx


def per_shard_experts(x: jax.Array, weights: jax.Array, idx: jax.Array, gate: jax.Array, up: jax.Array,
                      down: jax.Array, *, experts: Callable, check_vma: bool = True) -> jax.Array:
    """`experts(x, weights, idx, gate, up, down)` (the single-sort dispatch) on each device's own tokens inside a
    `shard_map` over every mesh axis of size > 1, with the expert weights whole on every device: the partitioner
    all-gathers them at the boundary (FSDP-style; cast to the activation dtype first, so the gather moves those
    bytes, as the FFN would cast them anyway) and sums their gradients back (XLA:CPU chose an all-reduce there, twice
    the bytes of a reduce-scatter: docs/expert_parallelism.md). No token leaves its device, and the sort, its
    buffers and the expert FLOPs are per device instead of over the global batch."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        raise ValueError("model.execution.moe_impl='sharded' needs an active mesh (jax.set_mesh)")
    tok_axes = _token_axes(mesh)
    N = idx.shape[0]
    devices = math.prod(int(mesh.shape[a]) for a in tok_axes)
    x, weights, idx = _pad_tokens(x, weights, idx.astype(jnp.int32), devices, 0)  # weight 0: contributes nothing
    dt = x.dtype
    tok = P(tok_axes if tok_axes else None)
    # Whole at the boundary on purpose: splitting them here and all-gathering inside (so the backward reduce-scatters)
    # was tried and reverted: XLA:GPU already turns the all-reduce + slice into a reduce-scatter, the TPU compiler keeps
    # an all-reduce either way, and the 26B H100 step's peak rose by 5.6 GiB (docs/expert_parallelism.md).
    whole = P()
    out = jax.shard_map(experts, in_specs=(tok, tok, tok, whole, whole, whole), out_specs=tok, check_vma=check_vma)(
        x, weights, idx, gate.astype(dt), up.astype(dt), down.astype(dt))
    return out[:N]


def expert_parallel_experts(x: jax.Array, weights: jax.Array, idx: jax.Array, gate: jax.Array, up: jax.Array,
                            down: jax.Array, *, expert_axis: str, ffn: ExpertFFN, check_vma: bool = True) -> jax.Array:
    """x [N, H] (activation dtype); weights [N, k] fp32; idx [N, k] int; gate/up [E, H, I]; down [E, I, H]
    -> [N, H] = sum_j weights[:, j] * expert_{idx[:, j]}(x), computed with the experts split over `expert_axis`.

    `ffn(xs, gate, up, down, group_sizes)` is the expert FFN on expert-sorted rows (`dgemma.model.moe.expert_ffn`).
    `check_vma=False` is for an `ffn` that runs a Pallas kernel (shard_map cannot type its outputs' variance).
    Each row of `idx` must hold distinct experts (as `top_k` gives): the dropless buffer bound relies on it.
    """
    mesh = jax.sharding.get_abstract_mesh()
    num_experts = gate.shape[0]
    if mesh is None or mesh.empty or expert_axis not in mesh.axis_names:
        names = () if mesh is None or mesh.empty else tuple(mesh.axis_names)
        raise ValueError(f"model.execution.moe_impl='ep' needs an active mesh (jax.set_mesh) with axis "
                         f"model.execution.expert_axis={expert_axis!r}; active mesh axes: {names or 'none'}")
    ep = int(mesh.shape[expert_axis])
    if num_experts % ep:
        raise ValueError(f"model.num_experts={num_experts} is not divisible by mesh axis model.execution.expert_axis="
                         f"{expert_axis!r} of size {ep} (expert parallelism splits the experts evenly)")
    tok_axes = _token_axes(mesh)
    devices = math.prod(int(mesh.shape[a]) for a in tok_axes)
    N, k = idx.shape
    pad = (-N) % devices
    # padded tokens get the out-of-range expert id E: never local anywhere, never computed
    x, weights, idx = _pad_tokens(x, weights, idx, devices, num_experts)
    tok = P(tok_axes if tok_axes else None)
    experts = P(expert_axis)
    body = _make_body(expert_axis, ep, num_experts // ep, k, ffn, x.dtype)
    out = jax.shard_map(body, in_specs=(tok, tok, tok, experts, experts, experts), out_specs=tok,
                        check_vma=check_vma)(
        x, weights, idx.astype(jnp.int32), gate, up, down)
    return out[:N] if pad else out


def _make_body(expert_axis: str, ep: int, local_experts: int, k: int, ffn: ExpertFFN, dtype):
    def body(x, weights, idx, gate, up, down):
        n = x.shape[0]
        me = jax.lax.axis_index(expert_axis)
        # 1. the group's tokens and routing (ep = 1: the gather is the identity)
        xg = jax.lax.all_gather(x, expert_axis, axis=0, tiled=True)  # [ep*n, H]
        wg = jax.lax.all_gather(weights, expert_axis, axis=0, tiled=True).reshape(-1)  # [ep*n*k]
        eg = jax.lax.all_gather(idx, expert_axis, axis=0, tiled=True).reshape(-1)
        # 2. local slots first, grouped by local expert; everything else gets the sentinel key `local_experts`
        local = eg // local_experts == me
        key = jnp.where(local, eg - me * local_experts, local_experts)
        rows = n * ep_rows_per_token(k, ep * local_experts, ep)  # every token's top-k all local (dropless)
        order = jnp.argsort(key, stable=True)[:rows]
        group_sizes = jnp.bincount(key, length=local_experts + 1)[:local_experts].astype(jnp.int32)
        token = order // k
        # 3. expert FFN on the routed rows only (ragged_dot leaves rows past sum(group_sizes) at zero)
        out_rows = ffn(jnp.take(xg, token, axis=0), gate, up, down, group_sizes)
        # 4. fp32 combine per token, then each device keeps the sums for its own tokens
        routed = (key[order] < local_experts)[:, None]
        contrib = jnp.where(routed, out_rows.astype(jnp.float32) * wg[order][:, None], 0.0)
        summed = jnp.zeros((ep * n, x.shape[1]), jnp.float32).at[token].add(contrib)
        return jax.lax.psum_scatter(summed, expert_axis, scatter_dimension=0, tiled=True).astype(dtype)

    return body


# MARK: cost model (for the planner; checked against the compiled HLO by experiments/bench_moe_ep.py) ---------------


def ep_collective_bytes(*, tokens_per_device: int, hidden_size: int, top_k: int, ep: int, act_bytes: int,
                        backward: bool = True) -> dict[str, int]:
    """Bytes ONE device sends per MoE layer over `expert_axis` (ring collectives: a group of ep moves (ep-1)/ep of
    the gathered / reduced array per device). `tokens_per_device` = n = global tokens / all devices (the dispatch
    splits tokens over every mesh axis). Forward: all-gather of the tokens (activation dtype) and of the routing
    (fp32 weights + int32 ids), reduce-scatter of the fp32 per-token sums. Backward (the transposes): reduce-scatter
    of the token gradients, of the routing-weight gradients, all-gather of the fp32 output gradients. With
    rematerialisation the forward terms are paid twice. Excludes the FSDP gather of the local experts' weights."""
    r, n, H, k = ep - 1, tokens_per_device, hidden_size, top_k
    out = {"fwd_tokens_all_gather": r * n * H * act_bytes, "fwd_routing_all_gather": r * n * k * 8,
           "fwd_combine_reduce_scatter": r * n * H * 4}
    if backward:
        out.update(bwd_tokens_reduce_scatter=r * n * H * act_bytes, bwd_routing_reduce_scatter=r * n * k * 4,
                   bwd_combine_all_gather=r * n * H * 4)
    return out


def ep_expert_weight_bytes(*, num_experts: int, hidden_size: int, moe_intermediate_size: int, ep: int,
                           other_shards: int, param_bytes: int) -> dict[str, int]:
    """Per-device bytes of one layer's expert weights (gate, up, down): `stored` = 3 E H I b / (ep * other_shards)
    (other_shards = the product of the mesh axes the rules put on `embed` / `exp_mlp`, e.g. fsdp under `ep`);
    `gathered` = 3 (E / ep) H I b, the local experts at full width while the layer computes (transient). Gradients
    and optimizer moments follow `stored`."""
    full = 3 * num_experts * hidden_size * moe_intermediate_size * param_bytes
    return {"stored": full // (ep * other_shards), "gathered": full // ep}

"""Gemma 4 mixture of experts: the router and dropless sorted `ragged_dot` experts.

Router (matches transformers `Gemma4TextRouter`, NOT the gemma JAX library, whose router differs):
    z = RMSNorm_noscale(r) * router.scale * H^-1/2        r = the post-attention residual (un-normed!)
    P = softmax_fp32(z @ proj)                            [T, E]
    w, idx = top_k(P, k)   (exact top-k)                  w <- w / sum(w);  w <- w * per_expert_scale[idx]

Experts read RMSNorm(r; pre_moe_norm) and are computed only for the selected (token, expert) slots:
sort the T*k slots by expert, run two `jax.lax.ragged_dot`s with per-expert group sizes, unsort, and combine
with the fp32 routing weights. No capacity factor, no token dropping, no dense all-experts compute (except
`model.execution.moe_kernel="dense"`, `dense_experts`: the same function as plain GEMMs, for tiny CPU models).

Dispatch (`model.execution.moe_impl`): "local" runs the above on whatever tokens the array holds (under a mesh the SPMD
partitioner chooses the collectives: for a sort over a batch-sharded array it gathers the global batch's tokens on
every device, so every device sorts and computes the whole batch's MoE); "sharded" runs it per device inside a
`shard_map` on that device's own tokens with the layer's expert weights gathered (FSDP-style, in the activation
dtype); "ep" runs it per device with the experts split over mesh axis `model.execution.expert_axis`
(`dgemma.model.moe_ep`); "auto" (default) = "ep" when the active mesh has that axis with size > 1, else "local". All
give the same numbers (fp32: equal up to summation order). "sharded" is opt-in: it moves weights to tokens, which suits
training's many tokens per device (the shipped 26B training configs select it) but would gather every layer's experts
per decoding step, where "local" may move the few tokens instead (not measured on an accelerator).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from dgemma.model.kernels import grouped_matmul, resolve_moe_kernel, target_platform
from dgemma.model.layers import param, rms_normalize
from dgemma.model.lora_experts import adapt, expert_weights, with_adapters
from dgemma.model.moe_ep import active_expert_axis_size, expert_parallel_experts, per_shard_experts

if TYPE_CHECKING:
    from dgemma.model.config import ModelConfig


def choose_dispatch(impl: str, expert_axis_size: int, devices: int) -> str:
    """The dispatch `model.execution.moe_impl` selects on a mesh of `devices` whose expert axis has `expert_axis_size`
    (1 when absent). "sharded" on one device is "local" (nothing to shard; the same numbers); "ep" stays "ep" and fails
    without a mesh axis to split the experts over. The planner applies the same rule to the mesh it plans for."""
    if impl == "auto":
        return "ep" if expert_axis_size > 1 else "local"
    if impl == "sharded" and devices <= 1:
        return "local"
    return impl


def _mesh_devices() -> int:
    """Devices of the active mesh (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh is None or mesh.empty else math.prod(int(n) for n in mesh.shape.values())


class Router(nnx.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, eps: float, param_dtype, rngs):
        self.proj = param(rngs, (hidden_size, num_experts), ("embed", "exp"), param_dtype)
        self.scale = param(rngs, (hidden_size,), ("embed",), param_dtype, init="ones")
        self.per_expert_scale = param(rngs, (num_experts,), ("exp",), param_dtype, init="ones")
        self.top_k = top_k
        self.eps = eps
        self.hidden_size = hidden_size

    def __call__(self, residual: jax.Array) -> tuple[jax.Array, jax.Array]:
        """residual [T, H] -> (weights [T, k] fp32, expert ids [T, k] int32)."""
        dt = residual.dtype
        z = rms_normalize(residual, self.eps).astype(dt)
        z = z * self.scale[...].astype(dt) * jnp.asarray(self.hidden_size**-0.5, dt)
        scores = adapt(self, "proj", z, z @ self.proj[...].astype(dt))
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1)
        weights, idx = jax.lax.top_k(probs, self.top_k)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        weights = weights * self.per_expert_scale[...].astype(jnp.float32)[idx]
        return weights, idx


def expert_ffn(xs: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, group_sizes: jax.Array, *,
               matmul: Callable = jax.lax.ragged_dot) -> jax.Array:
    """Gated expert FFN on rows sorted by expert: rows [M, H], group_sizes [G] (rows past their sum give 0).
    `matmul(rows, weights [G, K, N], group_sizes)` is the grouped matmul (`model.execution.moe_kernel`)."""
    dt = xs.dtype
    g = matmul(xs, gate.astype(dt), group_sizes)
    u = matmul(xs, up.astype(dt), group_sizes)
    h = jax.nn.gelu(g, approximate=True) * u
    return matmul(h, down.astype(dt), group_sizes)


class Experts(nnx.Module):
    """E gated experts stored as stacked weights: gate/up [E, H, I], down [E, I, H] (logical 'exp' first)."""

    def __init__(self, num_experts: int, hidden_size: int, moe_intermediate_size: int, *, param_dtype, rngs,
                 impl: str = "auto", expert_axis: str = "expert", kernel: str = "xla", interpret: bool = False,
                 tokamax_backend: str = "xla"):
        shape_in = (num_experts, hidden_size, moe_intermediate_size)
        self.gate = param(rngs, shape_in, ("exp", "embed", "exp_mlp"), param_dtype)
        self.up = param(rngs, shape_in, ("exp", "embed", "exp_mlp"), param_dtype)
        self.down = param(rngs, (num_experts, moe_intermediate_size, hidden_size), ("exp", "exp_mlp", "embed"),
                          param_dtype)
        self.num_experts = num_experts
        self.impl = impl
        self.expert_axis = expert_axis
        self.kernel = kernel
        self.interpret = interpret
        self.tokamax_backend = tokamax_backend

    def dispatch(self) -> str:
        """"ep", "sharded" or "local" for this call (decided at trace time from the active mesh; module docstring)."""
        return choose_dispatch(self.impl, active_expert_axis_size(self.expert_axis) or 1, _mesh_devices())

    def expert_parallel(self) -> bool:
        """Whether this call dispatches with expert parallelism (decided at trace time from the active mesh)."""
        return self.dispatch() == "ep"

    def __call__(self, x: jax.Array, weights: jax.Array, idx: jax.Array) -> jax.Array:
        """x [T, H]; weights/idx [T, k] -> [T, H] = sum_j w_j * expert_{idx_j}(x)."""
        mode = self.dispatch()
        kernel = resolve_moe_kernel(self.kernel, target_platform())  # "auto": per the platform being traced for
        matmul = functools.partial(grouped_matmul, kernel=kernel, interpret=self.interpret,
                                   tokamax_backend=self.tokamax_backend)
        ffn = functools.partial(expert_ffn, matmul=with_adapters(matmul))  # adapters in the same ragged path
        gate, up, down = expert_weights(self)
        typed = kernel in ("xla", "gathered")  # shard_map cannot check the variance of a Pallas kernel's outputs (Tokamax's too)
        if kernel == "dense":
            if mode != "local" or any(not isinstance(w, jax.Array) for w in (gate, up, down)):
                why = f"moe_impl resolves to {mode!r}" if mode != "local" else "expert LoRA adapters are attached"
                raise ValueError(f"model.execution.moe_kernel='dense' runs the 'local' dispatch on plain "
                                 f"expert weights ({why}): use moe_kernel 'xla' or 'gathered'")
            return dense_experts(x, weights, idx, gate, up, down)
        if mode == "ep":
            return expert_parallel_experts(x, weights, idx, gate, up, down,
                                           expert_axis=self.expert_axis, ffn=ffn, check_vma=typed)
        if mode == "sharded":
            return per_shard_experts(x, weights, idx, gate, up, down,
                                     experts=functools.partial(sorted_experts, ffn=ffn), check_vma=typed)
        devices = _mesh_devices()
        if kernel not in ("xla", "gathered") and devices > 1:
            resolved = f" ({kernel} here)" if self.kernel == "auto" else ""
            raise ValueError(f"model.execution.moe_kernel={self.kernel!r}{resolved} needs model.execution.moe_impl "
                             f"'sharded' or 'ep' on a {devices}-device mesh: XLA does not partition a Pallas kernel "
                             f"('local' would run it on the gathered global batch)")
        return sorted_experts(x, weights, idx, gate, up, down, ffn=ffn)


def sorted_experts(x: jax.Array, weights: jax.Array, idx: jax.Array, gate: jax.Array, up: jax.Array,
                   down: jax.Array, *, ffn: Callable = expert_ffn) -> jax.Array:
    """The single-sort dispatch over the tokens it is given: x [T, H]; weights/idx [T, k] -> [T, H]."""
    T, k = idx.shape
    dt = x.dtype
    flat_expert = idx.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)  # slots grouped by expert
    token_of_slot = order // k
    group_sizes = jnp.bincount(flat_expert, length=gate.shape[0]).astype(jnp.int32)
    xs = jnp.take(x, token_of_slot, axis=0)
    out_sorted = ffn(xs, gate, up, down, group_sizes)  # [T*k, H]
    # Undo the sort: slot s = t*k + j sits at the position p where order[p] == s.
    out_slots = jnp.zeros_like(out_sorted).at[order].set(out_sorted).reshape(T, k, -1)
    # HF multiplies in the activation dtype with fp32 weights promoted; keep fp32 for the combine.
    combined = jnp.sum(out_slots.astype(jnp.float32) * weights[..., None], axis=1)
    return combined.astype(dt)


def dense_experts(x: jax.Array, weights: jax.Array, idx: jax.Array, gate: jax.Array, up: jax.Array,
                  down: jax.Array) -> jax.Array:
    """Every expert on every token, combined with the routing weights (zero off each token's top k): x [T, H];
    weights/idx [T, k] -> [T, H]. The function of `sorted_experts` (fp32: equal up to summation order; unselected
    experts get weight 0, so zero output and zero gradient), as plain GEMMs over [T, E x I] with no sort: E/k x the
    routed FLOPs, which XLA:CPU spends anyway on ragged_dot (it expands it densely over every expert, on T*k rows: 2x
    this, in a slower loop). `model.execution.moe_kernel="dense"`: the tiny CPU models' setting."""
    T, E = x.shape[0], gate.shape[0]
    dt = x.dtype
    dense_w = jnp.zeros((T, E), jnp.float32).at[jnp.arange(T)[:, None], idx].set(weights)  # top_k ids are distinct
    g = jnp.einsum("th,ehi->tei", x, gate.astype(dt))
    u = jnp.einsum("th,ehi->tei", x, up.astype(dt))
    h = jax.nn.gelu(g, approximate=True) * u
    # the fp32 combine of sorted_experts folded into the down projection: one [T, E*I] x [E*I, H] contraction
    hw = (h.astype(jnp.float32) * dense_w[..., None]).astype(dt)
    out = jnp.einsum("tei,eih->th", hw, down.astype(dt), preferred_element_type=jnp.float32)
    return out.astype(dt)


class MoEBlock(nnx.Module):
    """Router on the raw residual + experts on RMSNorm(residual; pre_moe_norm), post-normed."""

    def __init__(self, cfg: ModelConfig, *, param_dtype, rngs):
        from dgemma.model.layers import RMSNorm

        H = cfg.hidden_size
        self.router = Router(H, cfg.num_experts, cfg.top_k_experts, eps=cfg.rms_norm_eps, param_dtype=param_dtype,
                             rngs=rngs)
        self.pre_norm = RMSNorm(H, eps=cfg.rms_norm_eps, dtype=param_dtype)
        self.experts = Experts(cfg.num_experts, H, cfg.moe_intermediate_size, param_dtype=param_dtype, rngs=rngs,
                               impl=cfg.execution.moe_impl, expert_axis=cfg.execution.expert_axis,
                               kernel=cfg.execution.moe_kernel, interpret=cfg.execution.kernel_interpret,
                               tokamax_backend=cfg.execution.tokamax_backend)
        self.post_norm = RMSNorm(H, eps=cfg.rms_norm_eps, dtype=param_dtype)

    def __call__(self, residual: jax.Array) -> jax.Array:
        shape = residual.shape
        flat = residual.reshape(-1, shape[-1])
        weights, idx = self.router(flat)
        out = self.experts(self.pre_norm(flat), weights, idx)
        return self.post_norm(out.reshape(shape))

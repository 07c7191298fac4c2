"""Accelerator kernels from maintained libraries (JAX's Pallas TPU ops, Tokamax), chosen by config; never written here.

    (settings of `model.execution`)
    attention_impl: splash   -> Splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`) for the
                                one-pass [clean ; noisy] training layout, with the block-diffusion mask
    moe_kernel: megablox     -> Megablox grouped matmul (`jax.experimental.pallas.ops.tpu.megablox.gmm`) for
                                the experts, instead of `jax.lax.ragged_dot`
    kernel_interpret: true   -> run either kernel in Pallas interpret mode (CPU tests, debugging; slow)
    attention_impl: tokamax  -> Tokamax's `dot_product_attention` on every attention call (training layouts,
                                encoder and decoder over the cache), implementation `tokamax_backend`
    moe_kernel: tokamax      -> Tokamax's `ragged_dot` for the experts (same backend setting)

Tokamax (openxla/tokamax, the optional `gpu` extra) is the GPU path: "mosaic" is its Mosaic GPU flash attention /
grouped matmul (Hopper, Blackwell; Mosaic TPU on TPU), "triton" its Pallas Triton kernels, "xla" / "xla_chunked" plain
XLA (any platform; what the CPU tests run through the same API). Its attention takes the mask as a boolean
[B, 1, T, S] kernel input, built here from the structured `IntervalMask`: one byte per query-key pair instead of the
dense path's fp32 scores per head, and every rule (one-pass layout, cache ring, W - 1 decoder rule, padding) exact.
It does not skip tiles from that mask (the kernels bound their key loops only by causal / window / length hints),
so its attention FLOPs are those of dense attention; `chunked` and `splash` skip masked tiles.

Both are TPU (Mosaic) kernels. A program that targets another platform without `kernel_interpret` gets a one-line
error naming the setting and the platform, never a silent fallback. Neither kernel is partitioned by XLA's SPMD
partitioner: attention runs inside a `shard_map` over the batch here, and the Megablox experts only inside the
per-device MoE dispatches (`moe_impl` "sharded" / "ep"), which are already `shard_map`s.

Splash takes its mask as a static [T, S] pattern (it precomputes which [block_q, block_kv] tiles are empty, full
or partial, and skips the empty ones in forward and backward). The one-pass layout is static in index space
(positions = arange, blocks of `canvas_length` after a fixed prompt length), so the pattern is the docs/stage1.md §4 rule of a
canonical row, built by the diffusion layer (`dgemma.diffusion.stage1.one_pass_masks`); what varies per example
(left padding, unused canvases) is key validity, passed as Splash segment ids (query 1, key 1 iff valid). Rows of
invalid queries are never read by a valid token, as on the other paths.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

if TYPE_CHECKING:
    from dgemma.model.config import ModelConfig

LANES = 128  # Splash tiles the key axis (and the query axis inside its mask logic) in multiples of the TPU lane width


class StaticPattern:
    """A numpy bool [T, S] mask pattern usable as static pytree metadata (hashable, compared by content)."""

    def __init__(self, array):
        self.array = np.asarray(array, bool)
        self.array.setflags(write=False)
        self._digest = hashlib.sha1(np.packbits(self.array).tobytes() + str(self.array.shape).encode()).hexdigest()

    def __hash__(self):
        return hash(self._digest)

    def __eq__(self, other):
        return isinstance(other, StaticPattern) and self._digest == other._digest

    def __repr__(self):
        return f"StaticPattern(shape={self.array.shape}, allowed={int(self.array.sum())})"


@functools.partial(jax.tree_util.register_dataclass, data_fields=["key_valid"], meta_fields=["pattern"])
@dataclasses.dataclass(frozen=True)
class SplashMask:
    """allowed(b, q, k) = pattern[q, k] and key_valid[b, k]."""

    pattern: StaticPattern
    key_valid: jax.Array  # [B, S] bool

    @property
    def shape(self) -> tuple[int, int]:
        return self.pattern.array.shape

    def restrict(self, rows: slice, cols: slice) -> "SplashMask":
        """The rule for a sub-range of the queries and keys (e.g. one stream of the one-pass layout)."""
        return SplashMask(StaticPattern(self.pattern.array[rows, cols]), self.key_valid[:, cols])

    def to_dense(self) -> jax.Array:
        """[B, T, S] bool (tests only)."""
        return jnp.asarray(self.pattern.array)[None] & self.key_valid[:, None, :]


def target_platform() -> str:
    """The platform the program being traced is for: the active mesh's devices (a deviceless TPU compile traces on a
    CPU host), else the default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh is None or mesh.empty else getattr(mesh, "abstract_device", None)
    return device.platform if device is not None else jax.default_backend()


def require_tpu(setting: str, interpret: bool, platform: str | None = None) -> None:
    """One-line error when a Pallas TPU kernel is asked for on another platform (default: the traced program's)
    without interpret mode."""
    platform = platform or target_platform()
    if not interpret and platform != "tpu":
        raise ValueError(f"{setting} is a TPU (Pallas Mosaic) kernel and this program targets {platform!r}; use it on "
                         f"TPU, or set model.execution.kernel_interpret=true to run it interpreted (tests; slow)")


def resolve_moe_kernel(kernel: str, platform: str) -> str:
    """`model.execution.moe_kernel` for a program on `platform`: "auto" is a grouped matmul that stays sparse where
    the compiler expands `jax.lax.ragged_dot` densely over every expert (E x the work): Tokamax's on GPU (deviceless
    H100 compiles, docs/planner_gpu.md), Megablox on TPU (libtpu 0.0.42 does the same, docs/planner_compile.md; the
    recorded v5p cost analysis is tests/golden/tpu_moe_flops.json), XLA's `ragged_dot` on CPU (tests, where the
    dense fallback is what the reference computes); any other value is itself."""
    if kernel != "auto":
        return kernel
    return {"gpu": "tokamax", "tpu": "megablox"}.get(platform, "xla")


# The one device check so far (a lent H200, 2026-12-04, tokamax 0.0.17, jax 0.11.2): Tokamax's Mosaic grouped matmul
# matched ragged_dot forward and in the input gradient, not in the experts' weight gradient; which side was wrong is
# what the next device check's dense reference says. Until then a GPU plan on that kernel says so.
UNVERIFIED_GPU_MOE = ("GPU grouped matmul (Tokamax) not yet verified for training: on an H200 its weight gradient "
                      "differed from ragged_dot's by 0.61 (docs/device_check.md, 'Measured')")


def check_kernel_platform(cfg: ModelConfig, platform: str) -> None:
    """Before a run compiles or writes anything: the model config's Pallas kernels can run on `platform` (the mesh's
    devices), with `model.execution.moe_kernel=auto` resolved for it."""
    moe_kernel = resolve_moe_kernel(cfg.execution.moe_kernel, platform)
    if cfg.execution.attention_impl == "splash":
        require_tpu("model.execution.attention_impl='splash'", cfg.execution.kernel_interpret, platform)
    if moe_kernel == "megablox":
        require_tpu("model.execution.moe_kernel='megablox'", cfg.execution.kernel_interpret, platform)
    if cfg.execution.attention_impl == "tokamax":
        require_tokamax_backend("model.execution.attention_impl='tokamax'", cfg.execution.tokamax_backend, platform)
        require_tokamax_head_dim(cfg.execution.tokamax_backend, max(cfg.head_dim, cfg.global_head_dim), platform)
    if moe_kernel == "tokamax":
        ex = cfg.execution
        setting = f"model.execution.moe_kernel={ex.moe_kernel!r}" + (" (tokamax on gpu)" if ex.moe_kernel == "auto"
                                                                      else "")
        if ex.tokamax_backend == "xla_chunked":
            raise ValueError(f"{setting}: model.execution.tokamax_backend='xla_chunked' is an attention "
                             f"implementation; the grouped matmul needs 'mosaic', 'triton' or 'xla'")
        require_tokamax_backend(setting, cfg.execution.tokamax_backend, platform)
        _tokamax(setting)  # installed (the `gpu` extra), or a one-line error before anything runs


def check_splash_layout(T: int, S: int, block_q: int, block_kv: int) -> None:
    """One-line error when a layout or block size cannot run under Splash."""
    for name, block, n in (("model.execution.attention_q_chunk", block_q, T),
                           ("model.execution.attention_kv_chunk", block_kv, S)):
        if block % LANES or n % block:
            raise ValueError(f"attention_impl=splash needs {name} a multiple of {LANES} that divides the one-pass "
                             f"layout length {n}; got {block}")


def _splash_kernel(pattern: StaticPattern, heads: int, block_q: int, block_kv: int, interpret: bool):
    # Built inside each trace, never cached across traces: the kernel holds its mask's block tables as arrays of the
    # trace that made it. Deferred import: the Pallas TPU ops are only needed when this implementation is selected.
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    mask = sm.MultiHeadMask([sm.NumpyMask(pattern.array)] * heads)
    blocks = sk.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv, block_q_dkv=block_q,
                           block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv, block_q_dq=block_q,
                           block_kv_dq=block_kv)
    return sk.make_splash_mqa_single_device(mask, block_sizes=blocks, interpret=interpret), sk.SegmentIds


def _batch_axes(batch: int, setting: str = "attention_impl=splash") -> tuple[str, ...]:
    """The active mesh's axes of size > 1 (none without a mesh), which must divide the batch."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return ()
    axes = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)
    n = math.prod(int(mesh.shape[a]) for a in axes)
    if batch % n:
        raise ValueError(f"{setting} runs per device over the batch: batch {batch} is not a multiple of "
                         f"the {n} devices of mesh axes {axes}")
    return axes


def splash_attention(q, k, v, mask: SplashMask, *, block_q: int, block_kv: int, interpret: bool) -> jax.Array:
    """q [B, T, KV, G, D] (query head n = kv head n // G), k / v [B, S, KV, D] -> [B, T, KV, G, D].

    Scores are q . k (scale 1: Gemma 4 normalises q and k); per kv head one MQA kernel over its G query heads."""
    require_tpu("model.execution.attention_impl='splash'", interpret)
    B, T, KV, G, D = q.shape
    S = k.shape[1]
    if mask.shape != (T, S):
        raise ValueError(f"splash mask covers (queries, keys) = {mask.shape} but attention has {(T, S)}")
    check_splash_layout(T, S, block_q, block_kv)
    kernel, segment_ids = _splash_kernel(mask.pattern, G, block_q, block_kv, interpret)

    def per_device(q, k, v, key_valid):
        # Batch and kv-head axes leading, so that the kernel's blocks tile the trailing [sequence, head_dim] dims.
        qh, kh, vh = q.transpose(0, 2, 3, 1, 4), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

        def one(qb, kb, vb, valid_b):  # qb [KV, G, T, D]; kb, vb [KV, S, D]; valid_b [S]
            seg = segment_ids(q=jnp.ones((T,), jnp.int32), kv=valid_b.astype(jnp.int32))
            return jax.vmap(lambda qg, kg, vg: kernel(qg, kg, vg, segment_ids=seg))(qb, kb, vb)  # [KV, G, T, D]

        return jax.vmap(one)(qh, kh, vh, key_valid).transpose(0, 3, 1, 2, 4)

    return _per_device_over_batch(per_device, "attention_impl=splash", q, k, v, mask.key_valid)


def _per_device_over_batch(fn, setting: str, *args):
    """fn(*args) with every arg split on its leading (batch) axis over the active mesh's axes of size > 1; XLA does
    not partition a Pallas call, so kernels run inside a shard_map. check_vma=False: shard_map cannot type a Pallas
    kernel's outputs."""
    axes = _batch_axes(args[0].shape[0], setting)
    if not axes:
        return fn(*args)
    spec = P(axes)
    return jax.shard_map(fn, in_specs=(spec,) * len(args), out_specs=spec, check_vma=False)(*args)


# MARK: Tokamax -----------------------------------------------------------------------------------------------------

_TOKAMAX_PLATFORMS = {"mosaic": ("gpu", "tpu"), "triton": ("gpu",)}  # "xla" / "xla_chunked" run anywhere


def require_tokamax_backend(setting: str, backend: str, platform: str | None = None) -> None:
    """One-line error when `model.execution.tokamax_backend` names a kernel the traced program's platform cannot run."""
    platform = platform or target_platform()
    allowed = _TOKAMAX_PLATFORMS.get(backend)
    if allowed is not None and platform not in allowed:
        raise ValueError(f"{setting} with model.execution.tokamax_backend={backend!r} is a "
                         f"{'/'.join(allowed).upper()} kernel and this program targets {platform!r}; set "
                         f"model.execution.tokamax_backend='xla' to run Tokamax's XLA implementation here (tests), or "
                         f"use a {'/'.join(allowed).upper()}")


def _tokamax(setting: str):
    try:
        import tokamax  # deferred: an optional dependency, needed only when a Tokamax kernel is selected
    except ImportError as e:
        raise ValueError(f"{setting} needs the tokamax package: pip install 'dgemma[gpu]'") from e
    from absl import flags  # Tokamax reads absl flags, which would otherwise parse this process's own argv and fail

    if not flags.FLAGS.is_parsed():
        flags.FLAGS(["dgemma"], known_only=True)
    return tokamax


def _tokamax_call(setting: str, backend: str, fn, *args, implementation=None, **kwargs):
    """A Tokamax op (`implementation`: default the backend's name), its NotImplementedError (a shape, dtype or GPU
    generation the kernel does not take) as one line naming the setting: never a silent fallback to another
    implementation."""
    try:
        return fn(*args, implementation=backend if implementation is None else implementation, **kwargs)
    except NotImplementedError as e:
        shapes = ", ".join(str(tuple(getattr(a, "shape", ()))) for a in args)
        raise ValueError(f"{setting} with model.execution.tokamax_backend={backend!r} cannot run operands of shapes "
                         f"{shapes}: {e}") from e


# Tokamax's heuristics keep a whole head in one shared-memory tile. At the full layers' head_dim 512 that does not fit
# a Hopper SM (227 KiB), measured by deviceless H100 compiles (docs/planner_gpu.md, "Deviceless GPU compile"): Triton asks
# 324 KiB with its default tiles (258 KiB in its default backward) and compiles with the head split into 128-wide
# slices and 32-row backward tiles;
# Mosaic GPU has no head split and its smallest tiles ask 402 KiB, so it is refused for such heads on GPU.
WIDE_HEAD = 256
_TRITON_WIDE_HEAD_TILES = dict(block_q=64, block_k=32, block_d=128, block_d_out=128, num_warps=4, num_stages=2)
_TRITON_WIDE_HEAD_VJP_TILES = dict(block_m1=32, block_n1=32, block_m2=32, block_n2=32, num_warps=4, num_stages=1)


def require_tokamax_head_dim(backend: str, head_dim: int, platform: str) -> None:
    """One-line error when Tokamax's `backend` attention cannot tile heads of `head_dim` on `platform`."""
    if backend == "mosaic" and platform == "gpu" and head_dim > WIDE_HEAD:
        raise ValueError(f"model.execution.attention_impl='tokamax' with model.execution.tokamax_backend='mosaic' "
                         f"cannot run head_dim {head_dim} on GPU: Mosaic GPU flash attention keeps a whole head per "
                         f"tile and its smallest tiles need more shared memory than a Hopper SM has (max {WIDE_HEAD}); use "
                         f"model.execution.tokamax_backend='triton' (splits the head) or "
                         f"model.execution.attention_impl='chunked'")


def _tokamax_attention_implementation(backend: str, head_dim: int):
    """The `implementation` argument of `tokamax.dot_product_attention`: the backend's name, or for Triton with wide
    heads the op with head-split tiles (the public API takes no tile config, hence the private module)."""
    if backend != "triton" or head_dim <= WIDE_HEAD:
        return backend
    from tokamax._src.ops.attention import pallas_triton, pallas_triton_vjp

    vjp = pallas_triton_vjp.PallasTritonFlashAttentionVjp(config=pallas_triton_vjp.Config(**_TRITON_WIDE_HEAD_VJP_TILES))
    return pallas_triton.PallasTritonFlashAttention(config=pallas_triton.Config(**_TRITON_WIDE_HEAD_TILES), vjp=vjp)


def tokamax_attention(q, k, v, mask, *, backend: str) -> jax.Array:
    """q [B, T, KV, G, D] (query head n = kv head n // G, Tokamax's grouping too), k / v [B, S, KV, D], mask an
    `IntervalMask` over (T, S) -> [B, T, KV, G, D]. Scale 1 (Gemma 4 normalises q and k); rows with no allowed key
    average all keys, as the dense path does (they are never read)."""
    setting = "model.execution.attention_impl='tokamax'"
    require_tokamax_backend(setting, backend)
    tokamax = _tokamax(setting)
    B, T, KV, G, D = q.shape
    if mask.shape != (T, k.shape[1]):
        raise ValueError(f"attention mask covers (queries, keys) = {mask.shape} but attention has {(T, k.shape[1])}")
    require_tokamax_head_dim(backend, D, target_platform())
    implementation = _tokamax_attention_implementation(backend, D)

    def per_device(q, k, v, allowed):
        b = q.shape[0]
        out = _tokamax_call(setting, backend, tokamax.dot_product_attention, q.reshape(b, T, KV * G, D), k, v,
                            mask=allowed[:, None], scale=1.0, implementation=implementation)
        return out.reshape(b, T, KV, G, v.shape[-1])

    return _per_device_over_batch(per_device, "attention_impl=tokamax", q, k, v, mask.allowed())


def grouped_matmul(lhs, rhs, group_sizes, *, kernel: str, interpret: bool, tokamax_backend: str = "xla") -> jax.Array:
    """rows [M, K] sorted by group x rhs [G, K, N] -> [M, N]; rows past sum(group_sizes) give 0 (as ragged_dot)."""
    if kernel == "xla":
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)
    if kernel == "gathered":
        return gathered_matmul(lhs, rhs, group_sizes)
    if kernel == "tokamax":
        setting = "model.execution.moe_kernel='tokamax'"
        require_tokamax_backend(setting, tokamax_backend)
        tokamax = _tokamax(setting)
        routed = _routed_rows(lhs, group_sizes)
        out = _tokamax_call(setting, tokamax_backend, tokamax.ragged_dot, _routed_rows_gradient(lhs, routed), rhs,
                            group_sizes.astype(jnp.int32))
        return jnp.where(routed, out, jnp.zeros((), out.dtype))
    require_tpu("model.execution.moe_kernel='megablox'", interpret)
    from jax.experimental.pallas.ops.tpu.megablox import gmm  # deferred: TPU-only op

    M = lhs.shape[0]
    tm = min(512, M)
    pad = (-M) % tm  # Megablox needs M to be a multiple of its row tile; padded rows belong to no group
    routed = _routed_rows(lhs, group_sizes)
    x = _routed_rows_gradient(lhs, routed)
    x = jnp.pad(x, ((0, pad), (0, 0))) if pad else x
    # K and N tiles of one lane width: Megablox masks a partial last tile (I_moe = 704 = 5.5 x 128), and the backward
    # reuses the tiling with K and N swapped, so a tile equal to one whole dimension would not fit the other.
    tiling = (tm, LANES, LANES)
    out = gmm(x, rhs, group_sizes.astype(jnp.int32), preferred_element_type=lhs.dtype, tiling=tiling,
              interpret=interpret)[:M]
    return jnp.where(routed, out, jnp.zeros((), out.dtype))


def gathered_matmul(lhs, rhs, group_sizes) -> jax.Array:
    """`jax.lax.ragged_dot` in plain JAX with each row's group matrix gathered: M x K x N work and memory, where
    XLA:CPU expands ragged_dot densely over every group (M x G x K per call; the CPU rehearsal of a 128-expert
    model runs out of memory on it). Equal to ragged_dot up to summation order; rows past sum(group_sizes) give 0."""
    G, M = rhs.shape[0], lhs.shape[0]
    group = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(M, dtype=group_sizes.dtype), side="right")
    weights = jnp.take(rhs, jnp.minimum(group, G - 1), axis=0)  # [M, K, N]
    out = jnp.einsum("mk,mkn->mn", lhs, weights.astype(lhs.dtype))
    return jnp.where((group < G)[:, None], out, jnp.zeros((), out.dtype))


def _routed_rows(lhs, group_sizes) -> jax.Array:
    """[M, 1] bool: rows that belong to a group. The others get zero output and zero gradient whatever a kernel
    writes there (Megablox writes neither)."""
    return jnp.arange(lhs.shape[0])[:, None] < jnp.sum(group_sizes)


@jax.custom_vjp
def _routed_rows_gradient(x, routed):
    """Identity whose gradient is zero on unrouted rows (Megablox leaves those rows of d lhs unwritten)."""
    return x


def _routed_fwd(x, routed):
    return x, routed


def _routed_bwd(routed, g):
    return jnp.where(routed, g, jnp.zeros((), g.dtype)), None


_routed_rows_gradient.defvjp(_routed_fwd, _routed_bwd)


__all__ = ["UNVERIFIED_GPU_MOE", "SplashMask", "StaticPattern", "check_kernel_platform", "check_splash_layout",
           "gathered_matmul", "grouped_matmul", "require_tokamax_backend", "require_tokamax_head_dim", "require_tpu",
           "resolve_moe_kernel", "splash_attention", "target_platform", "tokamax_attention"]

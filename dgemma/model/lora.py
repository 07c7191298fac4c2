"""Low-rank adapters (LoRA) on the model's matmul weights: attach, compute, merge.

    spec = LoraSpec(rank=8, alpha=16.0, targets=(r"attn/[qkvo]_proj$", r"experts/(gate|up|down)$"))
    attached = attach_adapters(model, spec, nnx.Rngs(1))   # paths of the adapted base weights
    merged = merged_params(model)                           # base-layout params with W + scale * A.B folded in

A target is a base weight `W` that a module multiplies activations with (`ADAPTABLE` lists them by module type),
selected by `re.search` of a `LoraSpec.targets` regex over its '/'-joined parameter path (`layers/3/attn/q_proj`,
`scan_blocks/0/moe/experts/gate`, `self_conditioning/mlp/up`). Its adapter is a `LowRank` module in the owning
module's `lora` dict (`layers/3/attn/lora/q_proj/a`, `.../b`):

    W   [*lead, *in, *out]          lead = the scanned-layers stack axis and/or the experts axis (batch dims)
    A   [*lead, *in, r]             normal(0, 1/sqrt(prod(in)))
    B   [*lead, r, *out]            zeros, so a fresh adapter changes nothing (y + 0 = y: bit-identical logits)
    y = x.W  +  (alpha / r) * (x.A).B

A and B are `nnx.LoRAParam`s (Flax's LoRA variable type, a `nnx.Param`) whose logical axes are W's with the rank
axis named `lora_rank` (in no rule preset: replicated), so `dgemma.parallel.rules` shards them exactly as W: an
expert adapter follows the expert axis. Flax's `nnx.LoRA` module is not used for the adapters themselves: it holds a
2-D [in, r] x [r, out] pair, and the attention weights here are 3-D einsum operands ([H, N, D], [N, D, H]) whose
head axes carry sharding names that a flattened [r, N*D] factor could not. The experts' adapters run inside their
ragged-dot path (`dgemma.model.lora_experts`). Modules call `adapt(self, name, x, y)` after each adaptable matmul:
without an adapter it returns `y` itself, so a model without adapters traces exactly as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import zlib
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dgemma.model.attention import Attention
from dgemma.model.layers import GatedMLP
from dgemma.model.lora_experts import LORA_ATTR, adapt, dropped
from dgemma.model.moe import Experts, Router

__all__ = ["ADAPTABLE", "LORA_ATTR", "DropoutKey", "LoraSpec", "LowRank", "adapt", "adaptable_paths",
           "adapter_dropout", "adapters_disabled",
           "attach_adapters", "has_adapters", "merged_params", "split_layout"]

RANK_AXIS = "lora_rank"
STACK_AXIS = "layers"  # `dgemma.model.scan`'s stacked-layers axis

# module type -> {weight name: (leading batch dims of the kind, contracted input dims)}
ADAPTABLE: dict[type, dict[str, tuple[int, int]]] = {
    Attention: {"q_proj": (0, 1), "k_proj": (0, 1), "v_proj": (0, 1), "o_proj": (0, 2)},
    GatedMLP: {"gate": (0, 1), "up": (0, 1), "down": (0, 1)},
    Router: {"proj": (0, 1)},
    Experts: {"gate": (1, 1), "up": (1, 1), "down": (1, 1)},
}


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """What to adapt: rank r >= 1, scale alpha / r, `targets` regexes over base weight paths, adapter dtype."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    param_dtype: str = "float32"
    dropout: float = 0.0  # adapter-input dropout while training (`adapter_dropout`); none at evaluation / sampling

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"lora.rank={self.rank}: adapters need rank >= 1 (0 means no adapters)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout={self.dropout}: must be in [0, 1)")

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank


def split_layout(base: nnx.Variable, kind_lead: int, n_in: int) -> tuple[int, int]:
    """(lead, n_in) of a base weight: the kind's batch dims plus the scanned stack axis when the weight is stacked."""
    axes = base.get_metadata().get("axes") or ()
    stacked = 1 if axes and axes[0] == STACK_AXIS else 0
    return kind_lead + stacked, n_in


class LowRank(nnx.Module):
    """The adapter of one base weight (module docstring): `a` [*lead, *in, r], `b` [*lead, r, *out]."""

    def __init__(self, base: nnx.Variable, lead: int, n_in: int, spec: LoraSpec, rngs: nnx.Rngs):
        shape = tuple(base.shape)
        axes = tuple(base.get_metadata().get("axes") or (None,) * len(shape))
        r, dt = spec.rank, jnp.dtype(spec.param_dtype)
        fan_in = math.prod(shape[lead:lead + n_in])
        a = jax.random.normal(rngs.params(), shape[:lead + n_in] + (r,), jnp.float32) / math.sqrt(fan_in)
        self.a = nnx.LoRAParam(a.astype(dt), axes=axes[:lead + n_in] + (RANK_AXIS,), eager_sharding=False)
        self.b = nnx.LoRAParam(jnp.zeros(shape[:lead] + (r,) + shape[lead + n_in:], dt),
                               axes=axes[:lead] + (RANK_AXIS,) + axes[lead + n_in:], eager_sharding=False)
        self.n_in = n_in
        self.scale = spec.scale
        self.dropout = float(spec.dropout)

    def delta(self, x: jax.Array) -> jax.Array:
        """scale * (x.A).B for an unbatched (dense) weight, in x's dtype: x [..., *in] -> [..., *out]; x goes through
        the adapter's dropout while `adapter_dropout` has set a key."""
        dt = x.dtype
        key = getattr(self, "dropout_key", None)
        x = dropped(x, self.dropout, None if key is None else key[...])
        low = jnp.tensordot(x, self.a[...].astype(dt), axes=self.n_in)
        return (self.scale * jnp.tensordot(low, self.b[...].astype(dt), axes=1)).astype(dt)

    def product(self, lead: int) -> jax.Array:
        """scale * A.B in W's layout (fp32): the batch dims `lead` are kept, rank contracted."""
        a = self.a[...].astype(jnp.float32)
        b = self.b[...].astype(jnp.float32)
        lead_shape, r = a.shape[:lead], a.shape[-1]
        in_shape, out_shape = a.shape[lead:-1], b.shape[lead + 1:]
        flat = jnp.matmul(a.reshape(*lead_shape, -1, r), b.reshape(*lead_shape, r, -1))
        return self.scale * flat.reshape(*lead_shape, *in_shape, *out_shape)


def _join(path) -> str:
    return "/".join(str(p) for p in path)


def _adaptable(model: nnx.Module):
    """(module path, module, weight name, base variable, kind lead, n_in) for every adaptable weight present."""
    for path, module in nnx.iter_modules(model):
        kinds = ADAPTABLE.get(type(module))
        if kinds is None:
            continue
        for name, (kind_lead, n_in) in kinds.items():
            base = getattr(module, name, None)
            if isinstance(base, nnx.Variable):
                yield _join(path), module, name, base, kind_lead, n_in


def adaptable_paths(model: nnx.Module) -> list[str]:
    """Parameter paths of every weight an adapter can target (module docstring)."""
    return [f"{p}/{name}" if p else name for p, _, name, *_ in _adaptable(model)]


def attach_adapters(model: nnx.Module, spec: LoraSpec, rngs: nnx.Rngs) -> list[str]:
    """Give every adaptable weight matched by a `spec.targets` regex a zero-product `LowRank` adapter (in place).
    Returns the adapted weights' paths. Raises ValueError naming `lora.targets` for a regex that matches no
    adaptable weight (a typo would otherwise silently train nothing) and for a model that already has adapters."""
    if has_adapters(model):
        raise ValueError("lora: the model already has adapters")
    compiled = []
    for pattern in spec.targets:
        try:
            compiled.append(re.compile(pattern))
        except re.error as e:
            raise ValueError(f"lora.targets: invalid regex {pattern!r}: {e}") from None
    candidates = list(_adaptable(model))
    paths = [f"{p}/{name}" if p else name for p, _, name, *_ in candidates]
    unused = [c.pattern for c in compiled if not any(c.search(p) for p in paths)]
    if unused:
        raise ValueError(f"lora.targets: {unused} match no adaptable weight (adaptable paths look like "
                         f"{sorted(set(re.sub(r'/[0-9]+/', '/<i>/', p) for p in paths))[:8]})")
    attached = []
    for (mpath, module, name, base, kind_lead, n_in), path in zip(candidates, paths):
        if not any(c.search(path) for c in compiled):
            continue
        lead, n_in = split_layout(base, kind_lead, n_in)
        adapters = getattr(module, LORA_ATTR, None)
        if adapters is None:
            adapters = nnx.Dict()
            setattr(module, LORA_ATTR, adapters)
        adapters[name] = LowRank(base, lead, n_in, spec, rngs)
        attached.append(path)
    return attached


def has_adapters(model: nnx.Module) -> bool:
    return any(getattr(m, LORA_ATTR, None) for _, m in nnx.iter_modules(model))


class DropoutKey(nnx.Variable):
    """Raw PRNG key data of an adapter's dropout, set only inside `adapter_dropout` (never saved, never trained)."""


@contextlib.contextmanager
def adapter_dropout(model: nnx.Module, key: jax.Array):
    """`with adapter_dropout(model, key): loss = ...` trains with each adapter's `LoraSpec.dropout` on its input.
    Every adapter with dropout > 0 gets its own key, `fold_in(key, crc32(its path))`, split over its batch dims (the
    scanned-layers axis: one key per layer; the experts axis: one per expert shard) and set for the block only: a
    model outside the block (evaluation, sampling) has no key and no dropout. `key` is the training step's key, so
    a run is reproducible and resumes exactly. Adapters with dropout 0 are left alone (bit-identical)."""
    keyed = []
    for path, module in nnx.iter_modules(model):
        if isinstance(module, LowRank) and module.dropout > 0:
            lead = len(module.a.shape) - module.n_in - 1
            batch = tuple(module.a.shape[:lead])
            own = jax.random.fold_in(key, zlib.crc32(_join(path).encode()) & 0x7FFFFFFF)
            data = jax.random.key_data(jax.random.split(own, math.prod(batch))).reshape(*batch, -1)
            keyed.append(module)
            # an nnx attribute that exists for this step only (LowRank reads it with getattr)
            module.dropout_key = DropoutKey(data)  # type: ignore[attr-defined]
    try:
        yield model
    finally:
        for module in keyed:
            delattr(module, "dropout_key")


@contextlib.contextmanager
def adapters_disabled(model: nnx.Module):
    """`with adapters_disabled(model): model(...)` runs the base model: every module's adapters are detached for the
    block and re-attached after it, in place (no weight is copied). Works eagerly and inside a traced function (the
    SD·RL reference policy = the student's own weights with adapters off); a model without adapters is unchanged."""
    detached = []
    for _, module in nnx.iter_modules(model):
        adapters = getattr(module, LORA_ATTR, None)
        if adapters is not None:
            detached.append((module, adapters))
    for module, _ in detached:
        delattr(module, LORA_ATTR)
    try:
        yield model
    finally:
        for module, adapters in detached:
            setattr(module, LORA_ATTR, adapters)


def merged_params(model: nnx.Module) -> Any:
    """The model's base parameters (no adapters) with every adapter folded in: W + scale * A.B, computed in fp32 and
    cast to W's dtype. A model without adapters gives its params unchanged. Does not modify `model`."""
    folded = {}
    for mpath, module, name, base, kind_lead, n_in in _adaptable(model):
        adapters = getattr(module, LORA_ATTR, None)
        if adapters is None or name not in adapters:
            continue
        lead, _ = split_layout(base, kind_lead, n_in)
        w = base[...]
        folded[f"{mpath}/{name}" if mpath else name] = (
            w.astype(jnp.float32) + adapters[name].product(lead)).astype(w.dtype)
    state = nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    flat = [(p, v.replace(folded[_join(p)]) if _join(p) in folded else v) for p, v in nnx.to_flat_state(state)]
    return nnx.from_flat_state(flat)

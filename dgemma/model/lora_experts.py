"""The adapters' call-site hooks: dense matmuls (`adapt`) and the experts' grouped matmuls (`ExpertWeight`).

Dense weights: a module calls `y = adapt(self, "q_proj", x, x.W)`; with an adapter (`dgemma.model.lora.LowRank` in
the module's `lora` dict) that is `y + scale * (x.A).B`, without one it returns `y` itself.

Experts: the per-expert adapters run inside the same sorted / ragged path as the base experts, so the dropless
routing, the sort and the group sizes are those of the base model. `expert_weights(experts)` gives each of gate / up /
down either the plain stacked array or an `ExpertWeight(base [E, K, N], a [E, K, r], b [E, r, N], scale)` pytree;
`with_adapters(matmul)` turns the grouped matmul `matmul(rows, w [G, K, N], group_sizes)` into

    matmul(rows, base) + scale * matmul(matmul(rows, a), b)        (the same group sizes for all three)

Each row multiplies its own expert's A_e and B_e, which is x.(W_e + scale * A_e.B_e) up to summation order; rows
past sum(group_sizes) stay zero. `ExpertWeight` is a pytree whose leaves all lead with the experts axis, so the
per-device dispatches (`dgemma.model.moe_ep`: the `shard_map` in-specs P(expert_axis) / P(), the activation-dtype
cast) handle it as they handle the plain array: expert adapters are split over the expert axis with their experts.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

__all__ = ["LORA_ATTR", "ExpertWeight", "adapt", "dropped", "expert_weights", "with_adapters"]

LORA_ATTR = "lora"  # the attribute of a module holding its adapters: paths read `<module>/lora/<weight>/{a,b}`


def dropped(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout of an adapter's input: each element zeroed with probability `rate`, the rest scaled by
    1 / (1 - rate). `key` holds raw key data whose leading dims are those of the adapter's batch dims (the experts
    axis: its first entry keys the rows this call sees); None (evaluation, sampling) or rate 0 returns `x` itself."""
    if key is None or not rate:
        return x
    while key.ndim > 1:
        key = key[0]
    keep = jax.random.bernoulli(jax.random.wrap_key_data(key), 1.0 - rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype)).astype(x.dtype)


def adapt(module, name: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """`y` (= x.W for the module's weight `name`) plus its adapter's contribution; `y` itself without one."""
    adapters = getattr(module, LORA_ATTR, None)
    if adapters is None or name not in adapters:
        return y
    return y + adapters[name].delta(x).astype(y.dtype)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["base", "a", "b", "dropout_key"],
                   meta_fields=["scale", "dropout"])
@dataclasses.dataclass(frozen=True)
class ExpertWeight:
    """A stacked expert weight with its per-expert adapter (module docstring)."""

    base: jax.Array  # [E, K, N]
    a: jax.Array  # [E, K, r]
    b: jax.Array  # [E, r, N]
    scale: float
    dropout_key: jax.Array | None = None  # [E, 2] raw keys while training with adapter dropout, else None
    dropout: float = 0.0

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.base.shape)

    @property
    def dtype(self):
        return self.base.dtype

    def astype(self, dtype) -> "ExpertWeight":
        return dataclasses.replace(self, base=self.base.astype(dtype), a=self.a.astype(dtype), b=self.b.astype(dtype))


def expert_weights(experts) -> tuple:
    """(gate, up, down) of an `Experts` module: plain arrays, or `ExpertWeight`s where an adapter is attached."""
    adapters = getattr(experts, LORA_ATTR, None) or {}
    out = []
    for name in ("gate", "up", "down"):
        w = getattr(experts, name)[...]
        if name in adapters:
            ad = adapters[name]
            key = getattr(ad, "dropout_key", None)
            w = ExpertWeight(w, ad.a[...], ad.b[...], ad.scale, None if key is None else key[...], ad.dropout)
        out.append(w)
    return tuple(out)


def with_adapters(matmul: Callable) -> Callable:
    """The grouped matmul that also applies an `ExpertWeight`'s adapter (module docstring); plain weights pass
    straight to `matmul`."""

    def grouped(rows, w, group_sizes):
        if not isinstance(w, ExpertWeight):
            return matmul(rows, w, group_sizes)
        dt = rows.dtype
        base = matmul(rows, w.base.astype(dt), group_sizes)
        low = matmul(dropped(rows, w.dropout, w.dropout_key), w.a.astype(dt), group_sizes)
        return base + (w.scale * matmul(low, w.b.astype(dt), group_sizes)).astype(base.dtype)

    return grouped

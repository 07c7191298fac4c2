"""Logical-axis rules: how the model's logical names map onto mesh axes, per preset.

Model code names axes (`vocab, embed, heads, kv_heads, head_dim, mlp, exp, exp_mlp, ...`); a preset maps each name to
one mesh axis, a tuple of mesh axes, or None (replicated). Changing the parallelism strategy is choosing a preset.

| preset            | experts (`exp`)  | other weights                    | use                                      |
|-------------------|------------------|----------------------------------|------------------------------------------|
| `fsdp`            | replicated       | `embed` on fsdp                  | small models, CPU tests                  |
| `fsdp_tp`         | replicated       | + tensor on heads / mlp / vocab  | larger dense compute                     |
| `experts_on_fsdp` | `exp` on fsdp    | `embed` on fsdp                  | default for 26B-A4B (128 experts / fsdp) |
| `ep`              | `exp` on expert  | `embed` on fsdp                  | opt-in expert parallelism                |

`ep`: on a mesh whose `expert` axis is > 1 the MoE dispatches tokens to the expert shards inside a `shard_map`
(`dgemma.model.moe_ep`, chosen by `model.execution.moe_impl=auto`): dropless, each device sorts only its own tokens.
Without an expert axis, `model.execution.moe_impl=sharded` dispatches per device too, with the experts gathered
FSDP-style. The batch stays on data x fsdp, so the other layers run replicated over `expert`; to make the expert group
the FSDP devices instead, use `experts_on_fsdp` with `model.execution.expert_axis=fsdp` (docs/expert_parallelism.md).

A mesh axis is used at most once per array: if two dimensions of one parameter resolve to the same mesh axis, the
later one is left replicated (e.g. expert weights under `experts_on_fsdp` shard `exp` on fsdp, not `embed`).

Sampling variants (`<preset>_sampling`, e.g. `experts_on_fsdp_sampling`): the same expert placement, but the dense
weights are not FSDP-sharded (`embed` -> replicated), so a decoding step does no weight all-gathers for them; tensor
sharding is kept. The sampler's KV cache follows the batch it is built from (the partitioner places it; no rule
names it). Training and sampling presets share the logical names, so a model needs no change to switch.
"""

from __future__ import annotations

from typing import Mapping

import jax
from jax.sharding import NamedSharding, PartitionSpec

Rules = Mapping[str, str | tuple[str, ...] | None]

_BATCH = ("data", "fsdp")

PRESETS: dict[str, dict[str, str | tuple[str, ...] | None]] = {
    "fsdp": {"batch": _BATCH, "embed": "fsdp", "vocab": None, "heads": None, "kv_heads": None, "mlp": None,
             "exp": None, "exp_mlp": None},
    "fsdp_tp": {"batch": _BATCH, "embed": "fsdp", "vocab": "tensor", "heads": "tensor", "kv_heads": None,
                "mlp": "tensor", "exp": None, "exp_mlp": "tensor"},
    "experts_on_fsdp": {"batch": _BATCH, "exp": "fsdp", "embed": "fsdp", "vocab": None, "heads": None,
                        "kv_heads": None, "mlp": None, "exp_mlp": None},
    "ep": {"batch": _BATCH, "exp": "expert", "embed": "fsdp", "vocab": None, "heads": None, "kv_heads": None,
           "mlp": None, "exp_mlp": None},
}


TRAINING_PRESETS: tuple[str, ...] = tuple(PRESETS)


def _sampling_variant(rules: Rules) -> dict[str, str | tuple[str, ...] | None]:
    out = dict(rules)
    out["embed"] = None  # dense weights replicated over data/fsdp: no per-step all-gathers while decoding
    return out


for _name in TRAINING_PRESETS:
    PRESETS[f"{_name}_sampling"] = _sampling_variant(PRESETS[_name])
del _name
SAMPLING_PRESETS: tuple[str, ...] = tuple(f"{n}_sampling" for n in TRAINING_PRESETS)


def get_rules(name_or_rules: str | Rules) -> Rules:
    if not isinstance(name_or_rules, str):
        return name_or_rules
    if name_or_rules not in PRESETS:
        raise KeyError(f"unknown sharding rules preset {name_or_rules!r}; available: {sorted(PRESETS)}")
    return PRESETS[name_or_rules]


def logical_to_spec(axes: tuple[str | None, ...], rules: Rules, mesh_axis_names=None) -> PartitionSpec:
    """Resolve logical names to a PartitionSpec; mesh axes absent from the mesh or already used are dropped."""
    used: set[str] = set()
    spec = []
    for name in axes:
        target = rules.get(name) if name is not None else None
        targets = (target,) if isinstance(target, str) else tuple(target or ())
        keep = tuple(t for t in targets if t not in used and (mesh_axis_names is None or t in mesh_axis_names))
        used.update(keep)
        spec.append(None if not keep else keep[0] if len(keep) == 1 else keep)
    return PartitionSpec(*spec)


def sampling_rules(name: str) -> Rules:
    """The sampling variant of a training preset (`fsdp` -> `fsdp_sampling`); sampling presets map to themselves."""
    return get_rules(name if name.endswith("_sampling") else f"{name}_sampling")


def constrain(x, logical_axes: tuple[str | None, ...], rules: str | Rules = "fsdp"):
    """`with_sharding_constraint` of an activation through the rules, against the active mesh (`jax.set_mesh`);
    a no-op when no mesh is active, so model code can call it unconditionally.

    Model code should constrain the residual stream of each block, e.g. `constrain(x, ("batch", None, None))`,
    so that FSDP all-gathers weights instead of activations (the SPMD partitioner otherwise may gather the batch).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return x
    spec = logical_to_spec(tuple(logical_axes), get_rules(rules), mesh.axis_names)
    return jax.lax.with_sharding_constraint(x, spec)


def _axes_of(var) -> tuple:
    meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
    axes = meta.get("axes")
    if axes is None:
        return (None,) * len(getattr(var, "shape", ()))
    return tuple(axes)


def state_specs(state, rules: Rules, mesh=None):
    """PartitionSpec for every Variable of an NNX state (tree of the same structure, leaves = specs)."""
    from flax import nnx

    names = None if mesh is None else mesh.axis_names

    def spec(var):
        return logical_to_spec(_axes_of(var), rules, names)

    return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def state_shardings(state, mesh, rules: Rules):
    """NamedSharding for every Variable of an NNX state; divisibility is checked with a clear error."""
    from flax import nnx

    def sharding(path, var):
        spec = logical_to_spec(_axes_of(var), rules, mesh.axis_names)
        for dim, (size, axis) in enumerate(zip(var.shape, tuple(spec) + (None,) * (len(var.shape) - len(spec)))):
            if axis is None:
                continue
            n = 1
            for a in (axis,) if isinstance(axis, str) else axis:
                n *= mesh.shape[a]
            if size % n:
                p = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
                raise ValueError(f"parameter {p} dim {dim} (size {size}, logical {_axes_of(var)[dim]!r}) is not "
                                 f"divisible by mesh axis {axis!r} of size {n}")
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(sharding, state, is_leaf=lambda x: isinstance(x, nnx.Variable))

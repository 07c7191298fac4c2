"""Sharding sanity checks with clear errors: divisibility of the model and the batch by the mesh, and replication.

    check_model_divisibility(model_cfg, mesh, "experts_on_fsdp")   # experts, heads, kv heads, vocab, widths
    check_batch_divisibility(global_batch, mesh, rules, grad_accum_steps=1)
    assert_sufficiently_sharded(params, mesh, rules, tolerance=0.02)
    replication_report(params, mesh, rules)                          # numbers behind the assertion

`mesh` is anything with axis sizes: a `jax.sharding.Mesh`, an `AbstractMesh`, or a plain `{axis: size}` dict.

Replication (MaxText `assert_params_sufficiently_sharded`): a parameter is *fully replicated* when none of its
dimensions maps to a mesh axis of size > 1. The check fails if more than `tolerance` of the parameter bytes are fully
replicated while the mesh has more than one device on the axes that may shard parameters (every axis but `data`,
whose replicas are data parallelism by design). Sampling presets
(`*_sampling`) replicate dense weights on purpose and are expected to fail it; it is a training check.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

from dgemma.parallel.rules import Rules, get_rules, logical_to_spec

__all__ = [
    "BatchLayout", "InsufficientShardingError", "ReplicationReport", "assert_sufficiently_sharded", "axis_sizes",
    "batch_layout", "check_batch_divisibility", "check_global_batch", "check_model_divisibility", "param_axes_and_shapes",
    "replication_report",
    "spec_shard_count",
]

_PURE_DATA_AXES = ("data",)  # replication over pure data parallelism is by design


class InsufficientShardingError(AssertionError):
    """More than the tolerated fraction of parameter bytes is replicated on a multi-device mesh."""


def axis_sizes(mesh: Any) -> dict[str, int]:
    """{axis: size} of a Mesh / AbstractMesh / mapping."""
    if isinstance(mesh, Mapping):
        return {str(k): int(v) for k, v in mesh.items()}
    return {str(k): int(v) for k, v in dict(mesh.shape).items()}


def _targets(rule) -> tuple[str, ...]:
    return (rule,) if isinstance(rule, str) else tuple(rule or ())


def spec_shard_count(spec, sizes: Mapping[str, int]) -> int:
    """Number of distinct shards of an array with PartitionSpec `spec` on a mesh of `sizes`."""
    n = 1
    for entry in spec:
        for axis in _targets(entry):
            n *= int(sizes.get(axis, 1))
    return n


def check_model_divisibility(model_cfg: Any, mesh: Any, rules: str | Rules) -> None:
    """Raise one ValueError listing every model dimension not divisible by the mesh axes its logical name maps to."""
    rules = get_rules(rules)
    sizes = axis_sizes(mesh)
    kinds = set(model_cfg.layer_types)
    dims = {
        "exp": [("num_experts", model_cfg.num_experts)],
        "heads": [("num_attention_heads", model_cfg.num_attention_heads)],
        "kv_heads": ([("num_key_value_heads", model_cfg.num_key_value_heads)] if "sliding_attention" in kinds else [])
        + ([("num_global_key_value_heads", model_cfg.num_global_key_value_heads)] if "full_attention" in kinds else []),
        "vocab": [("vocab_size", model_cfg.vocab_size)],
        "embed": [("hidden_size", model_cfg.hidden_size)],
        "mlp": [("intermediate_size", model_cfg.intermediate_size)],
        "exp_mlp": [("moe_intermediate_size", model_cfg.moe_intermediate_size)],
        "head_dim": [("head_dim", model_cfg.head_dim), ("global_head_dim", model_cfg.global_head_dim)],
    }
    errors = []
    for logical, fields in dims.items():
        axes = [a for a in _targets(rules.get(logical)) if a in sizes]
        n = math.prod(sizes[a] for a in axes)
        for field, value in fields:
            if n > 1 and value % n:
                errors.append(f"model.{field}={value} is not divisible by mesh axis {' x '.join(axes)} of size {n}, "
                              f"which the rules map '{logical}' to")
    if errors:
        raise ValueError("; ".join(errors) + f" (mesh {sizes})")


def check_batch_divisibility(global_batch: int, mesh: Any, rules: str | Rules = "fsdp", *,
                             grad_accum_steps: int = 1) -> int:
    """Check the global batch (and each micro-batch) splits over the batch axes; returns examples per batch shard."""
    rules = get_rules(rules)
    sizes = axis_sizes(mesh)
    axes = [a for a in _targets(rules.get("batch", ("data", "fsdp"))) if a in sizes]
    n = math.prod(sizes[a] for a in axes)
    if global_batch % grad_accum_steps:
        raise ValueError(f"global batch {global_batch} is not divisible by trainer.grad_accum_steps="
                         f"{grad_accum_steps}")
    micro = global_batch // grad_accum_steps
    if micro % n:
        what = f"micro-batch {micro} (global {global_batch} / {grad_accum_steps})" if grad_accum_steps > 1 \
            else f"global batch {global_batch}"
        raise ValueError(f"{what} is not divisible by the data axes {' x '.join(axes)} = {n} (mesh {sizes}); "
                         f"use a global batch that is a multiple of {n * grad_accum_steps}")
    return micro // n


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """How one global batch (`data.batch_size`) splits: rows per process, batch-sharding devices, micro-batches."""

    global_batch: int
    processes: int
    batch_shards: int  # product of the mesh axes the batch is sharded over (data x fsdp)
    grad_accum_steps: int  # resolved (never 0)

    @property
    def rows_per_process(self) -> int:
        return self.global_batch // self.processes

    @property
    def micro_batch_per_device(self) -> int:
        """Examples each batch shard computes per micro-batch."""
        return self.global_batch // self.grad_accum_steps // self.batch_shards

    def describe(self) -> str:
        return (f"global batch {self.global_batch} (data.batch_size) = {self.processes} processes x "
                f"{self.rows_per_process} rows; {self.micro_batch_per_device} examples per device per micro-batch x "
                f"grad_accum {self.grad_accum_steps} over {self.batch_shards} batch shards")


def check_global_batch(global_batch: int, processes: int, mesh: Any, rules: str | Rules = "fsdp", *,
                       what: str = "the global batch") -> int:
    """The number of batch shards (the product of the mesh's batch axes); a one-line ValueError naming
    data.batch_size when `global_batch` does not split over the processes and those shards. SD·RL calls it with its
    prompts per iteration: the anchor rows and the prompts are sharded over the batch axes like any batch."""
    rules = get_rules(rules)
    sizes = axis_sizes(mesh)
    axes = [a for a in _targets(rules.get("batch", ("data", "fsdp"))) if a in sizes]
    n = math.prod(sizes[a] for a in axes)
    need = math.lcm(processes, n)
    if global_batch % need:
        raise ValueError(f"data.batch_size={global_batch} ({what}) is not divisible by the {processes} "
                         f"processes and the batch axes {' x '.join(axes) or '-'} = {n} (mesh {sizes}); use a "
                         f"multiple of {need}")
    return n


def batch_layout(global_batch: int, processes: int, mesh: Any, rules: str | Rules = "fsdp",
                 grad_accum_steps: int = 1) -> BatchLayout:
    """The layout of `data.batch_size` = the global batch over `processes` and the mesh's batch axes; a one-line
    ValueError naming data.batch_size when it does not split. `grad_accum_steps` 0 derives the accumulation: one
    example per batch shard per micro-batch (global / (data x fsdp) micro-batches)."""
    n = check_global_batch(global_batch, processes, mesh, rules)
    accum = grad_accum_steps or global_batch // n
    check_batch_divisibility(global_batch, axis_sizes(mesh), rules, grad_accum_steps=accum)
    return BatchLayout(global_batch, processes, n, accum)


def param_axes_and_shapes(state: Any) -> list[tuple[str, tuple[int, ...], Any, tuple]]:
    """[(path, shape, dtype, logical axes)] for every parameter Variable of an NNX state / module / TrainState."""
    import jax
    from flax import nnx

    if isinstance(state, nnx.Module):
        state = nnx.state(state, nnx.Param)
    state = getattr(state, "params", state)
    out = []
    leaves = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    for path, var in leaves:
        if not isinstance(var, nnx.Variable):
            continue
        name = "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
        name = name.removesuffix("/value")
        shape = tuple(var.shape) if hasattr(var, "shape") else tuple(np.shape(var[...]))
        axes = var.get_metadata().get("axes") or (None,) * len(shape)
        out.append((name, shape, var.dtype, tuple(axes)))
    return out


@dataclasses.dataclass(frozen=True)
class ReplicationReport:
    total_bytes: int
    replicated_bytes: int
    relevant_devices: int  # devices on the axes that may shard parameters (all but `data`)
    replicated: tuple[tuple[str, int], ...]  # (path, bytes), largest first

    @property
    def fraction(self) -> float:
        return self.replicated_bytes / max(self.total_bytes, 1)


def replication_report(state: Any, mesh: Any, rules: str | Rules) -> ReplicationReport:
    rules = get_rules(rules)
    sizes = axis_sizes(mesh)
    relevant = math.prod(size for axis, size in sizes.items() if axis not in _PURE_DATA_AXES)
    total = replicated = 0
    rows = []
    for path, shape, dtype, axes in param_axes_and_shapes(state):
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        total += nbytes
        spec = logical_to_spec(axes, rules, tuple(sizes))
        if spec_shard_count(spec, sizes) == 1:
            replicated += nbytes
            rows.append((path, nbytes))
    rows.sort(key=lambda r: -r[1])
    return ReplicationReport(total, replicated, relevant, tuple(rows))


def assert_sufficiently_sharded(state: Any, mesh: Any, rules: str | Rules,
                                tolerance: float = 0.02) -> ReplicationReport:
    """Raise `InsufficientShardingError` if > `tolerance` of parameter bytes are fully replicated (module docstring)."""
    report = replication_report(state, mesh, rules)
    if report.relevant_devices > 1 and report.fraction > tolerance:
        top = ", ".join(f"{p} ({b / 2**20:.1f} MiB)" for p, b in report.replicated[:5])
        name = rules if isinstance(rules, str) else "custom rules"
        raise InsufficientShardingError(
            f"{report.fraction:.1%} of parameter bytes ({report.replicated_bytes / 2**30:.2f} of "
            f"{report.total_bytes / 2**30:.2f} GiB) are fully replicated under {name} on mesh {axis_sizes(mesh)} "
            f"(tolerance {tolerance:.1%}); largest: {top}")
    return report

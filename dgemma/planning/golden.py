"""Golden partition specs: the full parameter -> PartitionSpec table of a model under a rule preset on a fake mesh.

Computed from abstract shapes only (`nnx.eval_shape` + `jax.sharding.AbstractMesh`; no device memory), checked into
the test suite (`tests/golden/partition_specs/*.json`, owned by `tests/parallel/test_parallel_golden.py`, which compares them with
what this module computes), so a rule or model change that silently replicates (or reshards) a weight fails a test.
The library never reads those files itself. After an intended change, regenerate and review the diff:

    python -m dgemma.planning.golden --write --dir tests/golden/partition_specs   # rewrites every table in GOLDEN_CASES
    python -m dgemma.planning.golden --check --dir tests/golden/partition_specs   # exit 1 if any table is stale

File format (one JSON object per case; specs are lists with one entry per dimension: null, "axis" or ["a", "b"]):

    {"model": "gemma4_26b_a4b", "rules": "experts_on_fsdp", "mesh": {"data": 1, "fsdp": 8, ...},
     "summary": {"params": ..., "param_bytes": ..., "max_param_bytes_per_device": ..., "replicated_fraction": ...},
     "specs": {"embedder/embedding": [[262144, 2816], "float32", [null, "fsdp"]], ...}}
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any, Mapping

__all__ = ["GOLDEN_CASES", "case_path", "compare", "partition_table"]

# name -> (model preset, rules preset, mesh sizes). 8xH100 node, v5p-64 slice (32 chips), two v5p-64 slices over DCN,
# tensor and expert parallel variants, and the sampling layout.
GOLDEN_CASES: dict[str, tuple[str, str, dict[str, int]]] = {
    "26b_experts_on_fsdp_fsdp8": ("gemma4_26b_a4b", "experts_on_fsdp", {"fsdp": 8}),
    "26b_experts_on_fsdp_fsdp32": ("gemma4_26b_a4b", "experts_on_fsdp", {"fsdp": 32}),
    "26b_experts_on_fsdp_data2_fsdp32": ("gemma4_26b_a4b", "experts_on_fsdp", {"data": 2, "fsdp": 32}),
    "26b_fsdp_tp_fsdp8_tensor4": ("gemma4_26b_a4b", "fsdp_tp", {"fsdp": 8, "tensor": 4}),
    "26b_ep_fsdp4_expert8": ("gemma4_26b_a4b", "ep", {"fsdp": 4, "expert": 8}),
    "26b_experts_on_fsdp_sampling_data4_fsdp8": ("gemma4_26b_a4b", "experts_on_fsdp_sampling", {"data": 4, "fsdp": 8}),
}


@functools.lru_cache(maxsize=4)
def _abstract_params(model_cfg: Any):
    from flax import nnx

    from dgemma.model.transformer import abstract_model

    return nnx.state(abstract_model(model_cfg), nnx.Param)


def _spec_json(spec, ndim: int) -> list:
    entries = list(spec) + [None] * (ndim - len(spec))
    return [e if e is None or isinstance(e, str) else list(e) for e in entries]


def partition_table(model: str | Any, rules: str, mesh_sizes: Mapping[str, int]) -> dict[str, Any]:
    """The golden table (module docstring) for a model preset name (or ModelConfig), rules preset and mesh sizes."""
    import numpy as np
    from flax import nnx

    from dgemma.model.config import preset
    from dgemma.parallel.checks import check_model_divisibility, replication_report, spec_shard_count
    from dgemma.parallel.mesh import abstract_mesh
    from dgemma.parallel.rules import get_rules, state_shardings

    model_cfg = preset(model) if isinstance(model, str) else model
    mesh = abstract_mesh(mesh_sizes)
    sizes = {k: int(v) for k, v in mesh.shape.items()}
    check_model_divisibility(model_cfg, sizes, rules)
    state = _abstract_params(model_cfg)
    shardings = state_shardings(state, mesh, get_rules(rules))  # also checks per-parameter divisibility
    specs: dict[str, list] = {}
    total = per_device = 0
    for (path, var), (_, sh) in zip(nnx.to_flat_state(state), nnx.to_flat_state(shardings)):
        name = "/".join(str(p) for p in path)
        nbytes = int(np.prod(var.shape, dtype=np.int64)) * np.dtype(var.dtype).itemsize
        total += nbytes
        per_device += -(-nbytes // spec_shard_count(sh.spec, sizes))
        specs[name] = [list(var.shape), str(np.dtype(var.dtype)), _spec_json(sh.spec, len(var.shape))]
    report = replication_report(state, sizes, rules)
    return {
        "model": model if isinstance(model, str) else "custom",
        "rules": rules,
        "mesh": sizes,
        "summary": {"params": len(specs), "param_bytes": total, "max_param_bytes_per_device": per_device,
                    "replicated_fraction": round(report.fraction, 6)},
        "specs": dict(sorted(specs.items())),
    }


def case_path(name: str, directory: str | Path) -> Path:
    return Path(directory) / f"{name}.json"


def dumps(table: Mapping[str, Any]) -> str:
    """Stable text: one parameter per line so diffs are readable."""
    head = {k: v for k, v in table.items() if k != "specs"}
    lines = [json.dumps(head, sort_keys=True)[:-1] + ', "specs": {']
    items = list(table["specs"].items())
    for i, (k, v) in enumerate(items):
        lines.append(f"  {json.dumps(k)}: {json.dumps(v)}{',' if i < len(items) - 1 else ''}")
    lines.append("}}")
    return "\n".join(lines) + "\n"


def compare(expected: Mapping[str, Any], actual: Mapping[str, Any], limit: int = 20) -> list[str]:
    """Human-readable differences between two tables (empty list: equal)."""
    diffs = [f"{k}: golden {expected.get(k)!r} != now {actual.get(k)!r}"
             for k in ("model", "rules", "mesh", "summary") if expected.get(k) != actual.get(k)]
    want, got = expected.get("specs", {}), actual.get("specs", {})
    for name in sorted(set(want) | set(got)):
        if want.get(name) != got.get(name):
            diffs.append(f"{name}: golden {want.get(name)} != now {got.get(name)}")
    if len(diffs) > limit:
        diffs = diffs[:limit] + [f"... and {len(diffs) - limit} more"]
    return diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dgemma.planning.golden", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="(re)write the golden tables")
    mode.add_argument("--check", action="store_true", help="compare the golden tables with the current code")
    parser.add_argument("--dir", type=Path, required=True, help="golden directory (tests/golden/partition_specs)")
    parser.add_argument("cases", nargs="*", help=f"subset of {sorted(GOLDEN_CASES)}")
    args = parser.parse_args(argv)
    stale = 0
    for name in args.cases or sorted(GOLDEN_CASES):
        model, rules, sizes = GOLDEN_CASES[name]
        table = partition_table(model, rules, sizes)
        path = case_path(name, args.dir)
        if args.write:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(dumps(table))
            print(f"wrote {path}")
            continue
        diffs = compare(json.loads(path.read_text()), table) if path.exists() else [f"{path} is missing"]
        stale += bool(diffs)
        print(f"{name}: {'OK' if not diffs else 'STALE'}")
        for d in diffs:
            print(f"  {d}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())

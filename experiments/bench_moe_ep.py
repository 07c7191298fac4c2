"""Expert-parallel MoE dispatch vs the single-sort MoE: time, per-device memory and collective bytes, forward + backward.

    python experiments/bench_moe_ep.py                 # ~2-4 min on 2 cores
    python experiments/bench_moe_ep.py --reps 3 --tokens 2048

On 8 simulated CPU devices (one process; all devices share the machine's cores, so times measure TOTAL work plus
collective overhead, not a parallel speed-up). One MoE block (router + experts) of a mid-sized twin, fp32:
  * `single`      one device, no mesh (the reference path);
  * `local@mesh`  `--layout ep`: the `ep` preset's shardings on a {data: 2, expert: 4} mesh (`--layout fsdp`:
                  `experts_on_fsdp` on {fsdp: 8}), `model.execution.moe_impl=local`: the SPMD partitioner lays out the
                  single global sort and the ragged_dots by itself;
  * `ep@mesh`     same mesh and shardings, `model.execution.moe_impl=ep` (over `expert`, or `fsdp` with
                  `--layout fsdp`): the shard_map dispatch (dgemma.model.moe_ep);
  * `sharded@mesh` same mesh and shardings, `model.execution.moe_impl=sharded` (what `auto` picks without an
                  expert axis): each device sorts its own tokens, the layer's experts gathered whole (FSDP-style).
Per variant: median wall time of value_and_grad (after a warm-up), XLA's per-device temporary bytes, and the bytes
one device sends in the compiled program's collectives (ring model). Then, for the experts alone on {expert: 8}, the
collective bytes of the compiled program against `ep_collective_bytes` (the planner's formula).
Printed: one JSON line per measurement, and the ratios against `single` measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import re
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from dgemma.model.config import tiny  # noqa: E402
from dgemma.model.moe import MoEBlock, expert_ffn  # noqa: E402
from dgemma.model.moe_ep import ep_collective_bytes, expert_parallel_experts  # noqa: E402
from dgemma.parallel.mesh import make_mesh  # noqa: E402
from dgemma.parallel.rules import get_rules, state_shardings  # noqa: E402
from bench_common import median_seconds  # noqa: E402

_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1}
_OP = re.compile(r"=\s*(\(.*?\)|\w+\[[\d,]*\]\S*)\s+(all-gather|reduce-scatter|all-reduce|all-to-all|"
                 r"collective-permute)\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def _group_size(line: str) -> int:
    """Devices per replica group, from any of XLA's printed forms: [G,S]<=[N], {{0,1,..},..}, or mesh[...] {axes}."""
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\].*?\{('[^}]*)\}", line)
    if m:
        sizes = {k.strip("'"): int(v) for k, v in (kv.split("=") for kv in m.group(1).split(","))}
        return int(np.prod([sizes[a.strip().strip("'")] for a in m.group(2).split(",")]))
    return 1  # no groups printed: a collective over nothing here (or an unknown form, counted as no traffic)


def collective_bytes(hlo: str) -> dict[str, int]:
    """Bytes one device sends per collective kind in a compiled HLO module (ring model: all-gather (g-1)/g of its
    output, reduce-scatter (g-1) x its output, all-reduce 2 (g-1)/g, all-to-all (g-1)/g, permute all)."""
    out: dict[str, int] = {}
    for line in hlo.splitlines():
        m = _OP.search(line)
        if not m:
            continue
        shape, kind = m.groups()
        size = sum(int(np.prod([int(d) for d in dims.split(",") if d])) * _DTYPE_BYTES.get(dt, 4)
                   for dt, dims in _ARRAY.findall(shape))
        g = _group_size(line)
        if g <= 1:
            continue
        sent = {"all-gather": size * (g - 1) / g, "reduce-scatter": size * (g - 1), "all-reduce": 2 * size * (g - 1) / g,
                "all-to-all": size * (g - 1) / g, "collective-permute": size}[kind]
        out[kind] = out.get(kind, 0) + int(sent)
    return out


def random_block(cfg):
    graphdef, state = nnx.split(MoEBlock(cfg, param_dtype=jnp.float32, rngs=nnx.Rngs(0)))
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    leaves = [1.0 + 0.3 * jax.random.normal(k, x.shape) if x.ndim == 1 else 0.05 * jax.random.normal(k, x.shape)
              for k, x in zip(keys, leaves)]
    return graphdef, jax.tree.unflatten(treedef, leaves)


def measure(name, graphdef, state, residual, mesh, reps):
    def loss(s, r):
        return jnp.sum(jnp.sin(nnx.merge(graphdef, s)(r)))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    ctx = jax.set_mesh(mesh) if mesh is not None else _null()
    with ctx:
        t0 = time.perf_counter()
        compiled = step.lower(state, residual).compile()
        compile_s = time.perf_counter() - t0
        step_s = median_seconds(lambda: compiled(state, residual), reps)
        value, grads = compiled(state, residual)
    mem = compiled.memory_analysis()
    row = {"variant": name, "step_s": step_s, "compile_s": round(compile_s, 2),
           "temp_mib_per_device": round(mem.temp_size_in_bytes / 2**20, 3),
           "collective_bytes_per_device": collective_bytes(compiled.as_text())}
    print(json.dumps(row), flush=True)
    return row, (value, grads)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def formula_check(cfg, tokens):
    """Experts alone on {expert: 8}: the compiled program's collectives vs ep_collective_bytes."""
    mesh = make_mesh({"expert": 8})
    graphdef, state = random_block(cfg)
    experts = nnx.merge(graphdef, state).experts
    H, k = cfg.hidden_size, cfg.top_k_experts
    x = jax.random.normal(jax.random.key(2), (tokens, H))
    w = jax.random.uniform(jax.random.key(3), (tokens, k))
    idx = jax.random.randint(jax.random.key(4), (tokens, k), 0, cfg.num_experts)  # duplicates allowed: fine here
    tok, ex = NamedSharding(mesh, P("expert")), NamedSharding(mesh, P("expert"))
    args = [jax.device_put(a, tok) for a in (x, w)] + [jax.device_put(idx, tok)]
    weights = [jax.device_put(p[...], ex) for p in (experts.gate, experts.up, experts.down)]

    def loss(x, w, gate, up, down, idx):
        out = expert_parallel_experts(x, w, idx, gate, up, down, expert_axis="expert", ffn=expert_ffn)
        return jnp.sum(jnp.sin(out))

    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))).lower(
            args[0], args[1], *weights, args[2]).compile()
    measured = collective_bytes(compiled.as_text())
    predicted = ep_collective_bytes(tokens_per_device=tokens // 8, hidden_size=H, top_k=k, ep=8, act_bytes=4)
    row = {"check": "experts on {expert: 8}", "measured_bytes_per_device": measured,
           "measured_total": sum(measured.values()), "formula": predicted, "formula_total": sum(predicted.values()),
           "ratio_measured_to_formula": round(sum(measured.values()) / sum(predicted.values()), 4)}
    print(json.dumps(row), flush=True)
    return row


LAYOUTS = {"ep": ({"data": 2, "expert": 4}, "ep", "expert"), "fsdp": ({"fsdp": 8}, "experts_on_fsdp", "fsdp")}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per step (batch 8 x tokens/8)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="ep",
                    help="ep: `ep` preset on {data 2, expert 4}; fsdp: `experts_on_fsdp` on {fsdp 8} with "
                         "model.execution.expert_axis=fsdp (the expert group is the FSDP group)")
    args = ap.parse_args()
    base = dict(hidden_size=256, moe_intermediate_size=256, num_experts=32, top_k_experts=4)
    residual = jax.random.normal(jax.random.key(7), (8, args.tokens // 8, base["hidden_size"]))
    sizes, rules, axis = LAYOUTS[args.layout]
    mesh = make_mesh(sizes)
    print(json.dumps({"layout": args.layout, "mesh": sizes, "rules": rules, "expert_axis": axis}))
    rows, results = [], {}
    variants = (("single", "local", None), ("local@mesh", "local", mesh), ("ep@mesh", "ep", mesh),
                ("sharded@mesh", "sharded", mesh))
    for name, impl, m in variants:
        cfg = tiny(**base).with_execution(moe_impl=impl, expert_axis=axis)
        graphdef, state = random_block(cfg)
        if m is not None:
            state = jax.device_put(state, state_shardings(state, m, get_rules(rules)))
        row, results[name] = measure(name, graphdef, state, residual, m, args.reps)
        rows.append(row)
    ref = results["single"]
    for name in ("local@mesh", "ep@mesh", "sharded@mesh"):
        diff = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
                   for a, b in zip(jax.tree.leaves(results[name]), jax.tree.leaves(ref)))
        print(json.dumps({"variant": name, "max_rel_diff_vs_single (value and each gradient, / its max)": diff}))
    check = formula_check(tiny(**base), args.tokens)

    print(f"\nMoE block fwd+bwd, {args.tokens} tokens, H={base['hidden_size']} I={base['moe_intermediate_size']} "
          f"E={base['num_experts']} k={base['top_k_experts']}, fp32, 8 simulated CPU devices, mesh {sizes}, "
          f"rules {rules}, expert_axis {axis}")
    print(f"{'variant':<13} {'step ms':>9} {'x single':>9} {'temp MiB/dev':>13} {'collective KiB/dev':>19}")
    for r in rows:
        kib = sum(r["collective_bytes_per_device"].values()) / 1024
        print(f"{r['variant']:<13} {1e3 * r['step_s']:9.1f} {r['step_s'] / rows[0]['step_s']:9.2f} "
              f"{r['temp_mib_per_device']:13.2f} {kib:19.1f}")
    print(f"collective bytes of the EP experts on {{expert: 8}}: measured {check['measured_total']} vs formula "
          f"{check['formula_total']} (ratio {check['ratio_measured_to_formula']})")


if __name__ == "__main__":
    main()

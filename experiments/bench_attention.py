"""Peak memory and time of `model.execution.attention_impl` dense vs chunked: stage-1 one-pass loss, forward + backward.

    python experiments/bench_attention.py                     # T = 1024, 2048, 4096 streams, ~3 min on 2 cores
    python experiments/bench_attention.py --lengths 1024 --reps 1

T is the length of the one-pass [clean ; noisy] row (P + 2R). The model is a small Gemma-4-architecture twin (3 layers:
sliding, sliding, full; window 256, canvas 64), fp32, batch 1, no self-conditioning pass. For each (impl, T):
  * peak temporary memory of the compiled value_and_grad step, from XLA's compiled memory analysis (`temp_size`:
    every buffer XLA allocates beyond arguments and outputs, i.e. activations, scores and their gradients);
  * wall time per step (median of --reps runs after one warm-up; dense is skipped where it would not fit RAM).
Printed: one JSON line per measurement and a table with the chunked / dense ratios measured in this run. O(T^2)
memory doubles twice per doubling of T; O(T) doubles once.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dgemma.diffusion.stage1 import Stage1Config, stage1_loss
from dgemma.model.config import tiny
from dgemma.model.transformer import Transformer
from bench_common import median_seconds

P, L = 128, 64


def batch_for(T: int) -> dict:
    R = (T - P) // 2
    assert P + 2 * R == T and R % L == 0, T
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 128, (1, P + R)).astype(np.int32)
    block_id = np.concatenate([np.full(P, -1), np.repeat(np.arange(R // L), L)])[None].astype(np.int32)
    valid = np.ones((1, P + R), bool)
    return {k: jnp.asarray(v) for k, v in dict(
        tokens=tokens, valid=valid, block_id=block_id, positions=np.arange(P + R, dtype=np.int32)[None],
        diffusion_weight=np.ones((1, R), np.float32), ar_targets=np.roll(tokens, -1, 1),
        ar_weight=np.ones((1, P + R), np.float32), block_used=np.ones((1, R // L), bool)).items()}


def step_fn(impl: str, chunk: int):
    cfg = tiny(sliding_window=256, canvas_length=L, max_position_embeddings=8192).with_execution(
        attention_impl=impl, attention_q_chunk=chunk, attention_kv_chunk=chunk)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    scfg = Stage1Config(p_self_cond=0.0)

    @jax.jit
    def step(p, batch):
        return jax.value_and_grad(lambda q: stage1_loss(nnx.merge(graphdef, q, rest), batch, jax.random.key(0),
                                                        scfg)[0])(p)

    return step, params


def measure(impl: str, T: int, chunk: int, reps: int, run_dense_up_to: int) -> dict:
    step, params = step_fn(impl, chunk)
    batch = batch_for(T)
    t0 = time.perf_counter()
    compiled = step.lower(params, batch).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    row = {"impl": impl, "T": T, "chunk": chunk, "temp_MiB": mem.temp_size_in_bytes / 2**20,
           "args_MiB": mem.argument_size_in_bytes / 2**20, "compile_s": round(compile_s, 2)}
    if impl == "chunked" or T <= run_dense_up_to:
        row["step_s"] = median_seconds(lambda: compiled(params, batch), reps)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--run-dense-up-to", type=int, default=4096, help="only compile (memory) dense above this T")
    args = ap.parse_args(argv)
    rows = []
    for T in args.lengths:
        for impl in ("dense", "chunked"):
            row = measure(impl, T, args.chunk, args.reps, args.run_dense_up_to)
            print(json.dumps(row), flush=True)
            rows.append(row)
    by = {(r["impl"], r["T"]): r for r in rows}
    print(f"\n{'T':>6} {'dense MiB':>10} {'chunked MiB':>12} {'mem ratio':>10} {'dense s':>8} {'chunked s':>10} "
          f"{'time ratio':>10}")
    for T in args.lengths:
        d, c = by[("dense", T)], by[("chunked", T)]
        tr = (f"{c['step_s'] / d['step_s']:10.2f}" if "step_s" in d else f"{'-':>10}")
        print(f"{T:6d} {d['temp_MiB']:10.1f} {c['temp_MiB']:12.1f} {c['temp_MiB'] / d['temp_MiB']:10.3f} "
              f"{d.get('step_s', float('nan')):8.2f} {c['step_s']:10.2f} {tr}")
    for impl in ("dense", "chunked"):
        ts = [by[(impl, T)]["temp_MiB"] for T in args.lengths]
        growth = [f"{b / a:.2f}" for a, b in zip(ts, ts[1:])]
        print(f"{impl}: temp memory growth per doubling of T: {', '.join(growth)}")


if __name__ == "__main__":
    main()

"""Compile time of the training gradient vs depth: per-layer (Python loop) vs scanned layers
(`model.execution.scan_layers`).

    python experiments/bench_compile.py                 # 6 and 30 layers, both layouts, remat=full
    python experiments/bench_compile.py --layers 6 12 30 --remat none

Compiles `jax.jit(jax.value_and_grad(AR loss))` of a narrow Gemma 4 twin (tiny_toy widths, the 26B layer pattern of
5 sliding + 1 full) for each depth, lowering and compiling against abstract inputs, and prints the seconds and the
ratio to the shallowest depth of the same layout (measured in the same run). Target: scanned 30 vs 6 <= 1.5x.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
from flax import nnx

from dgemma.model.config import tiny_toy
from dgemma.model.transformer import Transformer


def compile_seconds(layers: int, scan: bool, remat: str, seq: int = 64) -> float:
    cfg = tiny_toy(num_hidden_layers=layers).with_execution(scan_layers=scan, remat=remat)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))

    def loss(state, tokens):
        logits = nnx.merge(graphdef, state)(tokens)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

    tokens = jax.ShapeDtypeStruct((2, seq), jnp.int32)
    t0 = time.perf_counter()
    jax.jit(jax.value_and_grad(loss)).lower(state, tokens).compile()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[6, 30])
    parser.add_argument("--remat", default="full")
    args = parser.parse_args()
    rows = []
    for scan in (False, True):
        base = None
        for n in args.layers:
            s = compile_seconds(n, scan, args.remat)
            base = base or s
            rows.append({"layout": "scanned" if scan else "per_layer", "layers": n, "remat": args.remat,
                         "compile_s": round(s, 2), "ratio_vs_first": round(s / base, 2)})
            print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()

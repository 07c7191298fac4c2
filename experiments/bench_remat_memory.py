"""Rematerialisation's memory effect, by XLA's compiled memory analysis (nothing is run or allocated).

    python experiments/bench_remat_memory.py                     # medium config, 12 layers, T = 512, batch 4
    python experiments/bench_remat_memory.py --layers 12 --seq 1024 --policies none full save_dots

For each layout (per-layer, scanned) and remat policy, compiles `jax.value_and_grad` of the AR loss (fused chunked
head + CE) of a medium Gemma 4 twin (hidden 256, 8 heads, 16 experts top-2, the 5 sliding + 1 full pattern) against
abstract inputs and prints XLA's temporaries (gradients + activations + transients) and the ratio to `none` of the
same layout, measured in the same run, next to the planner's activation estimate for the same policy.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
from flax import nnx

from dgemma.model.config import ModelConfig
from dgemma.model.transformer import Transformer
from dgemma.diffusion.ar import ar_loss_fn

MiB = 2**20


def medium(layers: int, **kw) -> ModelConfig:
    return ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=32, global_head_dim=64,
                       num_global_key_value_heads=2, sliding_window=128, num_experts=16, top_k_experts=2,
                       moe_intermediate_size=128, max_position_embeddings=8192, eos_token_id=(1,), canvas_length=16,
                       **kw)


def compiled_temp(cfg: ModelConfig, batch: int, seq: int) -> tuple[int, int, float]:
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))

    def loss(state, b):
        return ar_loss_fn(nnx.merge(graphdef, state), b, jax.random.key(0))[0]

    b = {"tokens": jax.ShapeDtypeStruct((batch, seq), jnp.int32),
         "ar_targets": jax.ShapeDtypeStruct((batch, seq), jnp.int32),
         "ar_weight": jax.ShapeDtypeStruct((batch, seq), jnp.float32)}
    t0 = time.perf_counter()
    mem = jax.jit(jax.value_and_grad(loss)).lower(state, b).compile().memory_analysis()
    return int(mem.temp_size_in_bytes), int(mem.argument_size_in_bytes), time.perf_counter() - t0


def planner_activations(cfg: ModelConfig, batch: int, seq: int, policy: str) -> int:
    from dgemma.planning.planner import PlanSpec, activation_bytes

    spec = PlanSpec(model=cfg, rules="fsdp", mesh={"fsdp": 1}, global_batch=batch, prompt_len=0, response_len=seq,
                    objective="ar", remat=policy, moe_lowering="dense")
    return activation_bytes(spec)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--policies", nargs="+", default=["none", "full", "save_dots"])
    parser.add_argument("--layouts", nargs="+", default=["per_layer", "scanned"])
    args = parser.parse_args()
    for layout in args.layouts:
        base = None
        for policy in args.policies:
            cfg = medium(args.layers).with_execution(scan_layers=layout == "scanned", remat=policy)
            temp, arg, secs = compiled_temp(cfg, args.batch, args.seq)
            base = base or temp
            row = {"layout": layout, "remat": policy, "layers": args.layers, "seq": args.seq, "batch": args.batch,
                   "xla_temp_MiB": round(temp / MiB, 1), "ratio_vs_none": round(temp / base, 3),
                   "planner_activations_MiB": round(planner_activations(cfg, args.batch, args.seq, policy) / MiB, 1),
                   "arguments_MiB": round(arg / MiB, 1), "compile_s": round(secs, 1)}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

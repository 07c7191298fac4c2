"""Training throughput, FLOP utilisation and the cost of a stage-1 step relative to an AR step (same batch).

    python experiments/bench_train.py            # tiny_toy and a d=256 CPU config
    python experiments/bench_train.py --steps 20

For each model config, two jitted train steps (AdamW, same optimizer) run on the SAME batch:
  * AR:      next-token CE on the clean stream (P + R tokens per row),
  * stage 1: one-pass [clean ; noisy] forward (P + 2R tokens) with the self-conditioning first pass, CE on the
             canvases + lambda_AR x AR CE; and the same loss with `diffusion.self_cond_pass=noisy_stream` (the SC
             pass over the R noisy tokens only, reading the clean stream's K/V), printed as a ratio to it.
Printed: step time, tokens/s (tokens = P + R per row, the data actually trained on), model FLOP utilisation
(MFU = analytic model FLOPs with top-k-of-E active experts / step time / peak), where peak is this machine's measured
fp32 matmul throughput in the same run (a 2048^3 jitted matmul), and the ratio stage-1 / AR step time (target <= 2.5).
Also printed: XLA's own FLOP count of the compiled step. On the CPU backend it is far above the model FLOPs because
XLA:CPU lowers `jax.lax.ragged_dot` to a dense dot over all experts with masking; the model code dispatches sparsely
(sorted slots, per-expert group sizes), which GPU/TPU grouped-GEMM lowerings exploit.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np


def matmul_peak(n: int = 2048, reps: int = 10) -> float:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
        out = f(a)
    out.block_until_ready()
    return 2 * n**3 * reps / (time.perf_counter() - t)


def active_matmul_params(model_cfg) -> int:
    """Parameters a token multiplies through: all non-embedding weights with only top-k of E experts active, plus the
    tied head (V x H). Embedding lookups are not FLOPs."""
    from dgemma.model.transformer import count_params

    c = model_cfg
    total = count_params(c, include_self_conditioning=False) - c.vocab_size * c.hidden_size
    experts = c.num_hidden_layers * c.num_experts * 3 * c.hidden_size * c.moe_intermediate_size
    active_experts = experts * c.top_k_experts // c.num_experts
    return total - experts + active_experts + c.vocab_size * c.hidden_size


def model_flops(model_cfg, batch, objective: str) -> float:
    """Analytic matmul FLOPs of one train step (6 N T for forward + backward; +2 N T for the no-grad SC pass);
    attention score FLOPs are included as 12 * layers * heads * head_dim * T^2 per row (fwd + bwd)."""
    B, T = batch["tokens"].shape
    R = batch["diffusion_weight"].shape[1]
    n = active_matmul_params(model_cfg)
    c = model_cfg
    attn_dim = c.num_attention_heads * max(c.head_dim, c.global_head_dim)
    if objective == "ar":
        tokens = B * T
        return 6 * n * tokens + 12 * c.num_hidden_layers * attn_dim * T * T * B
    T1 = T + R  # one-pass [clean ; noisy]
    return 8 * n * B * T1 + 16 * c.num_hidden_layers * attn_dim * T1 * T1 * B


def make_batch(model_cfg, batch_size: int, prompt_len: int, n_blocks: int):
    from dgemma.data.layout import to_layout
    from dgemma.data.config import LayoutConfig

    cc = LayoutConfig(prompt_len=prompt_len, canvas_length=model_cfg.canvas_length, n_blocks=n_blocks)
    rng = np.random.default_rng(0)
    R = n_blocks * model_cfg.canvas_length
    rows = [to_layout(list(rng.integers(3, model_cfg.vocab_size, prompt_len - 2)),
                      list(rng.integers(3, model_cfg.vocab_size, R - 1 - (i % 3))), cc) for i in range(batch_size)]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def bench_step(model_cfg, loss_fn, batch, steps: int) -> dict:
    from flax import nnx

    from dgemma.config.sections import OptimSection
    from dgemma.model.transformer import Transformer
    from dgemma.train.optim import build_optimizer
    from dgemma.train.state import TrainState
    from dgemma.train.step import make_train_step

    optimizer = build_optimizer(OptimSection(lr=1e-3, warmup_steps=0), 1000)
    model = Transformer(model_cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    state = TrainState(params=params, opt_state=optimizer.tx.init(params), step=jnp.int32(0),
                       rng=jax.random.key_data(jax.random.key(0)))
    step = make_train_step(graphdef, optimizer, loss_fn, donate=True)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    compiled = step.lower(state, batch).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    flops = float(cost.get("flops", 0.0))
    for _ in range(2):  # warm-up
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    t = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    dt = (time.perf_counter() - t) / steps
    return {"step_s": dt, "flops_per_step": flops, "loss": float(metrics["loss"])}


CONFIGS = {
    "tiny_toy (d=64)": dict(preset="tiny_toy"),
    "cpu_d256": dict(preset="tiny_toy", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                     head_dim=64, global_head_dim=128, moe_intermediate_size=128, num_experts=8, vocab_size=512,
                     canvas_length=16),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from dgemma.config import RunConfig
    from dgemma.model.config import preset
    from dgemma.train.objectives import loss_fn_for

    peak = matmul_peak()
    print(f"machine fp32 matmul peak (measured, 2048^3 jit): {peak / 1e9:.1f} GFLOP/s on {jax.device_count()} "
          f"{jax.default_backend()} device(s)")
    results = {"peak_flops": peak, "configs": {}}
    for name, spec in CONFIGS.items():
        spec = dict(spec)
        cfg = preset(spec.pop("preset"), **spec)
        batch = make_batch(cfg, args.batch, prompt_len=16, n_blocks=2)
        tokens = batch["tokens"].size
        row = {}
        # the registry's losses at the default settings, and stage 1 with the noisy-stream-only SC pass
        for label, overrides in (("ar", ["trainer.objective=ar"]), ("stage1", ["trainer.objective=stage1"]),
                                 ("stage1_noisy_sc", ["trainer.objective=stage1",
                                                      "diffusion.self_cond_pass=noisy_stream"])):
            fn = loss_fn_for(RunConfig().with_overrides(*overrides))
            r = bench_step(cfg, fn, batch, args.steps)
            r["tokens_per_s"] = tokens / r["step_s"]
            r["utilisation"] = r["flops_per_step"] / r["step_s"] / peak
            r["model_flops_per_step"] = model_flops(cfg, batch, "ar" if label == "ar" else "stage1")
            r["mfu"] = r["model_flops_per_step"] / r["step_s"] / peak
            row[label] = r
            print(f"{name:16s} {label:15s} step {r['step_s'] * 1e3:8.1f} ms  {r['tokens_per_s']:9.0f} tok/s  "
                  f"model {r['model_flops_per_step'] / 1e9:6.2f} GFLOP/step  MFU {100 * r['mfu']:5.1f}%  "
                  f"(XLA-counted {r['flops_per_step'] / 1e9:6.2f} GFLOP/step, {100 * r['utilisation']:5.1f}% of peak)")
        row["stage1_over_ar"] = row["stage1"]["step_s"] / row["ar"]["step_s"]
        print(f"{name:16s} stage-1 / AR step time = {row['stage1_over_ar']:.2f}x (target <= 2.5)")
        row["noisy_sc_over_full"] = row["stage1_noisy_sc"]["step_s"] / row["stage1"]["step_s"]
        print(f"{name:16s} stage-1 noisy-stream SC pass / full SC pass: step time "
              f"{row['noisy_sc_over_full']:.2f}x, XLA FLOPs "
              f"{row['stage1_noisy_sc']['flops_per_step'] / row['stage1']['flops_per_step']:.2f}x")
        results["configs"][name] = row
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

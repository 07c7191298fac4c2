"""Time one DiffusionGemma canvas forward at the 26B-A4B geometry on one accelerator (never in CI).

    python experiments/gpu_canvas_forward.py                      # GPU: 26B geometry, bf16, as many layers as fit
    python experiments/gpu_canvas_forward.py --layers 6 --rows 4  # one 5 sliding + 1 full period, 4 rows
    python experiments/gpu_canvas_forward.py --layers 1 --small   # CPU smoke size (tests/experiments/test_gpu_canvas_forward.py)

A canvas forward is what the sampler runs per denoising step (`dgemma.inference.sampler`): the self-conditioned
decoder over one canvas of L = 256 tokens attending to a KV cache of `--context` positions, plus the V-wide head,
`model.logits(model.decode(canvas, cache, soft_embeds=sc))`. Weights are random (bf16 params and activations): the
time does not depend on their values. The AR decode step (one token per row: `model.encode` + head) is timed on
the same weights and cache as the baseline of the same run.

Attention: `--attention chunked` (default; pure-JAX flash-style, masked tiles skipped), `dense`, or `tokamax`
(Tokamax's flash attention, `--tokamax-backend mosaic|triton|xla|xla_chunked`; the full-attention layers' head_dim 512
is beyond cuDNN's 256 on Hopper, so cuDNN is not offered). MoE: `jax.lax.ragged_dot` (`--moe-kernel xla`, the
default off GPU) or Tokamax's grouped matmul (`--moe-kernel tokamax`, the default on GPU):
XLA:CPU and XLA:GPU both expand ragged_dot densely over all 128 experts (shown by a deviceless H100 compile,
docs/planner_gpu.md), so only the kernel gives a meaningful GPU time. Tokamax's Mosaic GPU attention cannot tile the full
layers' head_dim 512 on Hopper (refused); `--attention tokamax --tokamax-backend triton` splits the head. A kernel
that cannot take a shape is a one-line error naming the setting.

Layers: with fewer than 30 the time is also scaled linearly to 30 (labelled an extrapolation). The default picks
the largest multiple of the 6-layer period whose bf16 weights + cache + step transients fit 80% of the device's
memory (`memory_stats()['bytes_limit']`; 30 layers = ~50 GB of bf16 weights).

Published: 13.56 ms per canvas forward on one H100 with FP8 weights (the figure published for
DiffusionGemma-26B-A4B); this script runs bf16, so expect it slower by up to the FP8/bf16 matmul-rate ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

PUBLISHED_MS = 13.56  # H100, FP8 (DiffusionGemma's published figure)
FULL_LAYERS = 30


def default_moe_kernel() -> str:
    """`model.execution.moe_kernel=auto` for this backend, named: Tokamax's grouped matmul on GPU (XLA:GPU's ragged_dot
    is dense over the experts), XLA's ragged_dot elsewhere."""
    import jax

    from dgemma.model.kernels import resolve_moe_kernel

    return resolve_moe_kernel("auto", jax.default_backend())


def with_layers(cfg, n: int):
    """`cfg` with n layers in the 26B pattern (5 sliding + 1 full), the last one full as Gemma 4 requires."""
    from dgemma.model.config import FULL, SLIDING

    types = tuple(FULL if (i + 1) % 6 == 0 or i == n - 1 else SLIDING for i in range(n))
    return cfg.replace(num_hidden_layers=n, layer_types=types)


def _config(args):
    from dgemma.model.config import gemma4_26b_a4b, tiny

    execution = dict(dtype="bfloat16", param_dtype="bfloat16", attention_impl=args.attention,
                     moe_kernel=args.moe_kernel or default_moe_kernel(), tokamax_backend=args.tokamax_backend)
    if args.small:
        cfg = tiny(canvas_length=8, sliding_window=16).with_execution(**execution, attention_q_chunk=8,
                                                                       attention_kv_chunk=8)
        return with_layers(cfg, args.layers or 3)
    cfg = gemma4_26b_a4b().with_execution(**execution)
    return with_layers(cfg, args.layers) if args.layers else cfg


def _weight_bytes(cfg) -> int:
    """bf16 bytes of the weights (attention, dense MLP, router, all experts, tied embedding; norms and the small
    self-conditioning MLP are left out: < 0.1%)."""
    H, E = cfg.hidden_size, cfg.num_experts
    n = cfg.vocab_size * H
    for i in range(cfg.num_hidden_layers):
        N, D, KV = cfg.num_attention_heads, cfg.layer_head_dim(i), cfg.layer_kv_heads(i)
        kv = (2 if cfg.is_sliding(i) else 1) * H * KV * D  # full layers: K = V
        n += 2 * H * N * D + kv + 3 * H * cfg.intermediate_size + H * E + 3 * E * H * cfg.moe_intermediate_size
    return 2 * n


def layers_that_fit(cfg, bytes_limit: int, rows: int, capacity: int) -> int:
    """Largest multiple of 6 (at most 30) layers whose weights + cache + transients fit 80% of `bytes_limit`."""
    best = 6
    for n in range(6, FULL_LAYERS + 1, 6):
        c = with_layers(cfg, n)
        cache = sum(2 * rows * capacity * c.layer_kv_heads(i) * c.layer_head_dim(i) * 2 for i in range(n))
        transient = 4 * rows * c.canvas_length * c.vocab_size * 4 + 2 * c.vocab_size * c.hidden_size * 2
        if _weight_bytes(c) + cache + transient <= 0.8 * bytes_limit:
            best = n
    return best


def _median_ms(fn, reps: int) -> tuple[float, float]:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times), min(times)


def run(args) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dgemma.model.cache import KVCache
    from dgemma.model.transformer import Transformer

    dev = jax.devices()[0]
    cfg = _config(args)
    L = cfg.canvas_length
    capacity = args.context + L + args.reps + 3
    if not args.layers and not args.small:
        limit = (dev.memory_stats() or {}).get("bytes_limit")
        if limit is None:
            raise SystemExit("gpu_canvas_forward: the device reports no memory limit; pass --layers N")
        cfg = with_layers(cfg, layers_that_fit(cfg, int(limit), args.rows, capacity))
    t0 = time.perf_counter()
    model = Transformer(cfg, rngs=nnx.Rngs(args.seed))
    graphdef, state = nnx.split(model)
    jax.block_until_ready(state)
    init_s = time.perf_counter() - t0
    key = jax.random.key(args.seed)
    prompt = jax.random.randint(key, (args.rows, args.context), 0, cfg.vocab_size, jnp.int32)

    @jax.jit
    def prefill(state, prompt):
        m = nnx.merge(graphdef, state)
        return m.encode(prompt, KVCache.init(cfg, prompt.shape[0], capacity))[1]

    @jax.jit
    def canvas_forward(state, canvas, sc, cache):
        m = nnx.merge(graphdef, state)
        return m.logits(m.decode(canvas, cache, soft_embeds=sc))  # [rows, L, V] fp32, as the sampler computes

    @jax.jit
    def ar_step(state, token, cache):
        m = nnx.merge(graphdef, state)
        hidden, cache = m.encode(token, cache)
        return m.logits(hidden[:, -1]), cache

    cache = jax.block_until_ready(prefill(state, prompt))
    canvas = jax.random.randint(jax.random.fold_in(key, 1), (args.rows, L), 0, cfg.vocab_size, jnp.int32)
    sc = jax.random.normal(jax.random.fold_in(key, 2), (args.rows, L, cfg.hidden_size), jnp.bfloat16)
    t0 = time.perf_counter()
    jax.block_until_ready(canvas_forward(state, canvas, sc, cache))  # compile + first run
    compile_s = time.perf_counter() - t0
    canvas_ms, canvas_min = _median_ms(lambda: jax.block_until_ready(canvas_forward(state, canvas, sc, cache)),
                                       args.reps)
    token = canvas[:, :1]
    jax.block_until_ready(ar_step(state, token, cache))
    ar_cache = [cache]

    def one_ar():
        logits, ar_cache[0] = ar_step(state, token, ar_cache[0])
        jax.block_until_ready(logits)

    ar_ms, ar_min = _median_ms(one_ar, args.reps)
    scale = FULL_LAYERS / cfg.num_hidden_layers if not args.small else 1.0
    uses_tokamax = "tokamax" in (cfg.execution.attention_impl, cfg.execution.moe_kernel)
    tokamax_note = (f"tokamax backend {cfg.execution.tokamax_backend!r}" if uses_tokamax
                    else "no tokamax kernel selected")
    return {"device": f"{dev.device_kind} ({dev.platform})", "jax": jax.__version__, "small": args.small,
            "layers": cfg.num_hidden_layers, "rows": args.rows, "canvas": L, "context": args.context,
            "attention": cfg.execution.attention_impl, "moe_kernel": cfg.execution.moe_kernel, "dtype": "bf16 params + "
            "activations", "init_s": init_s,
            "compile_s": compile_s, "reps": args.reps, "canvas_ms": canvas_ms, "canvas_min_ms": canvas_min,
            "canvas_ms_30_layers": canvas_ms * scale, "ar_step_ms": ar_ms, "ar_step_min_ms": ar_min,
            "ar_step_ms_30_layers": ar_ms * scale, "published_ms": PUBLISHED_MS, "kernels": tokamax_note,
            "weight_bytes_30_layers": _weight_bytes(cfg if args.small else with_layers(cfg, FULL_LAYERS))}


def report(r: dict) -> str:
    scaled = r["layers"] != FULL_LAYERS and not r["small"]
    ext = f" -> {r['canvas_ms_30_layers']:.2f} ms at 30 layers (linear extrapolation)" if scaled else ""
    ar_ext = f" -> {r['ar_step_ms_30_layers']:.2f} ms at 30 layers" if scaled else ""
    lines = [
        f"device     {r['device']}, jax {r['jax']}; {r['kernels']}",
        f"geometry   {'tiny smoke model' if r['small'] else '26B-A4B'}, {r['layers']} layers, {r['dtype']}, random "
        f"weights; {r['rows']} row(s) x canvas {r['canvas']} over a {r['context']}-position cache; "
        f"attention={r['attention']}, MoE kernel {r['moe_kernel']} (init {r['init_s']:.1f} s, compile {r['compile_s']:.1f} s)",
        f"canvas     {r['canvas_ms']:.3f} ms per canvas forward (median of {r['reps']}, min "
        f"{r['canvas_min_ms']:.3f}){ext}",
        f"ar step    {r['ar_step_ms']:.3f} ms per AR decode step (1 token per row; median of {r['reps']}){ar_ext}; "
        f"canvas / AR step = {r['canvas_ms'] / r['ar_step_ms']:.2f}",
    ]
    if not r["small"]:
        lines.append(f"published  {r['published_ms']:.2f} ms per canvas forward (H100, FP8): this run / published = "
                     f"{r['canvas_ms_30_layers'] / r['published_ms']:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=0, help="layers to build (default: as many as fit, <= 30)")
    p.add_argument("--small", action="store_true", help="tiny geometry (CPU smoke run), not the 26B one")
    p.add_argument("--rows", type=int, default=1, help="canvases per forward (batch rows)")
    p.add_argument("--context", type=int, default=1024, help="cached positions the canvas attends to")
    p.add_argument("--attention", choices=("chunked", "dense", "tokamax"), default="chunked")
    p.add_argument("--moe-kernel", choices=("xla", "tokamax"), default=None,
                   help="default: tokamax on GPU (XLA:GPU expands ragged_dot over all experts), xla elsewhere")
    p.add_argument("--tokamax-backend", choices=("mosaic", "triton", "xla", "xla_chunked"), default="mosaic",
                   help="Tokamax implementation for --attention / --moe-kernel tokamax")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    for name in ("layers", "rows", "context", "reps"):
        if getattr(args, name) < (0 if name == "layers" else 1):
            p.error(f"--{name} {getattr(args, name)}: must be positive")
    try:
        r = run(args)
    except ValueError as e:  # a kernel the platform or shape cannot run: the one-line reason, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Sampler benchmark: overhead of the compiled denoising loop, and diffusion vs AR fallback throughput (CPU).

    python experiments/bench_sampler.py                       # d=256 config, V=4096, canvas 64, batch 2
    python experiments/bench_sampler.py --canvas 128 --batch 4 --json /tmp/bench_sampler.json

What it measures (target: loop overhead ≤ 1.10):

1. **Loop overhead.** One block of the compiled sampler (`dgemma.inference.sampler._run_block`: a while_loop of
   exactly K steps, stopping disabled with c = 0, then EOS processing and the commit encoder pass) is timed for
   K = K1 and K = K2 on the same cache; (t(K2) − t(K1)) / (K2 − K1) is the time of one denoising step with every
   fixed cost (dispatch, canvas init, EOS, commit) removed. The same run times the baselines, each its own jitted
   function of the same shapes (same cache capacity):
     forward_sc   the per-step model forward as transformers computes it: soft embedding of the previous step's
                  logits (softmax·E·sqrt(H), inside HF's forward) + decoder + tied head      <- the target ratio
     forward      decoder + head only (no self-conditioning input)
   ratio = step / baseline. The loop additionally does temperature, entropy, categorical sampling over V,
   argsort-based EB accept, renoise draws, the stop test and metric bookkeeping.
2. **Diffusion vs AR on the same weights and prompts.** `sample(mode="diffusion")` vs `sample(mode="ar")` (which is
   `dgemma.inference.ar.generate`) for the same number of new tokens; generated tokens/s of each (after a warm-up
   call that compiles), their ratio, and TPF. Two diffusion settings: random weights never converge, so every
   block runs max_steps (TPF = L/K: the worst case); "converging" weights (post-sublayer norms ×0.1, the trick the
   tests use) stop early under the adaptive rule.

Timing: --reps interleaved rounds after a warm-up (`block_until_ready` on outputs); min and median reported. The
machine is a shared 2-core VM; the script prints the 1-minute load average before and after so noisy runs are
visible.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from dgemma.inference import sampler as S  # noqa: E402
from dgemma.model.config import ModelConfig  # noqa: E402
from bench_common import random_model, timeit  # noqa: E402

TARGET = 1.10


def bench_config(canvas: int, vocab: int) -> ModelConfig:
    """d=256: 6 layers (5 sliding + 1 full), 4 heads, 8 experts top-2; the 26B-A4B architecture, CPU-sized."""
    return ModelConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128,
                       num_global_key_value_heads=1, sliding_window=256, num_experts=8, top_k_experts=2,
                       moe_intermediate_size=128, max_position_embeddings=4096, eos_token_id=(1,),
                       canvas_length=canvas)


def loop_overhead(model, prompts, k1: int, k2: int, reps: int) -> dict:
    cfg = model.cfg
    B, P = prompts.shape
    L = cfg.canvas_length
    graphdef, state = nnx.split(model)
    cap = P + L
    cache, last_hidden = S._prefill(graphdef, state, prompts, jnp.ones(prompts.shape, bool), capacity=cap)
    jax.block_until_ready(cache)
    keys = S._row_keys(jax.random.key(0), None, B)
    zeros = jnp.zeros((B,), bool)

    def block_fn(K):
        scfg = S.SamplerConfig(max_steps=K, confidence_threshold=0.0)  # never stops: exactly K steps

        def run():
            # _run_block donates its cache argument: hand it a fresh copy each call
            c = jax.tree.map(jnp.copy, cache)
            out = S._run_block(graphdef, state, c, last_hidden, zeros, keys, zeros, zeros, jnp.int32(0),
                               jnp.asarray(False), scfg.dynamic_part(), jnp.asarray([10 ** 6], jnp.int32),
                               jnp.int32(0), None, scfg=scfg.static_part(), use_ar=False)
            return out[0], out[4]["steps_run"]
        return run

    canvas = jax.random.randint(jax.random.key(1), (B, L), 0, cfg.vocab_size, jnp.int32)
    prev_logits = jax.random.normal(jax.random.key(2), (B, L, cfg.vocab_size), jnp.float32)

    @jax.jit
    def forward_sc(state, canvas, cache, prev_logits):
        m = nnx.merge(graphdef, state)
        return m.logits(m.decode(canvas, cache, soft_embeds=m.soft_embed(prev_logits)))

    @jax.jit
    def forward(state, canvas, cache):
        m = nnx.merge(graphdef, state)
        return m.logits(m.decode(canvas, cache))

    copy_only = jax.jit(lambda c: jax.tree.map(jnp.copy, c))
    t = timeit({"block_k1": block_fn(k1), "block_k2": block_fn(k2), "forward_sc": lambda: forward_sc(
        state, canvas, cache, prev_logits), "forward": lambda: forward(state, canvas, cache),
        "cache_copy": lambda: copy_only(cache)}, reps)
    steps = int(block_fn(k2)()[1])
    assert steps == k2, steps
    out = dict(k1=k1, k2=k2, reps=reps)
    for stat, i in (("min", 0), ("median", 1)):
        step = (t["block_k2"][i] - t["block_k1"][i]) / (k2 - k1)
        out[stat] = dict({f"{k}_s": v[i] for k, v in t.items()}, step_s=step,
                         ratio_vs_forward_sc=step / t["forward_sc"][i], ratio_vs_forward=step / t["forward"][i],
                         block_per_step_vs_forward_sc=(t["block_k2"][i] - t["cache_copy"][i]) / k2
                         / t["forward_sc"][i])
    return out


def throughput(model, prompts, new_tokens: int, max_steps: int, reps: int) -> dict:
    """Diffusion and AR timed in the same interleaved rounds (min wall time over rounds)."""
    cfg = S.SamplerConfig(max_steps=max_steps, max_new_tokens=new_tokens, eos_ids=(10 ** 6,), pad_id=-1)
    results = {}

    def runner(mode):
        def run():
            results[mode] = S.sample(model, prompts, None, cfg, jax.random.key(0), mode=mode)
            return results[mode].tokens
        return run

    t = timeit({m: runner(m) for m in ("diffusion", "ar")}, reps)
    out = {}
    for mode in ("diffusion", "ar"):
        r = results[mode]
        n = int((r.tokens != -1).sum())
        out[mode] = dict(seconds=t[mode][0], seconds_median=t[mode][1], tokens=n, tokens_per_s=n / t[mode][0],
                         tpf=float(np.mean(r.tpf)),
                         steps_per_block=float(r.steps_per_block.mean()) if r.steps_per_block.size else None)
    out["diffusion_over_ar_tokens_per_s"] = out["diffusion"]["tokens_per_s"] / out["ar"]["tokens_per_s"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--canvas", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--k1", type=int, default=4)
    ap.add_argument("--k2", type=int, default=12)
    ap.add_argument("--max-steps", type=int, default=16, help="K of the throughput comparison")
    ap.add_argument("--blocks", type=int, default=2, help="canvases generated in the throughput comparison")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", help="write all numbers here")
    args = ap.parse_args(argv)

    cfg = bench_config(args.canvas, args.vocab)
    load0 = os.getloadavg()[0]
    prompts = jax.random.randint(jax.random.key(3), (args.batch, args.prompt), 2, cfg.vocab_size, jnp.int32)
    print(f"config: d={cfg.hidden_size} layers={cfg.num_hidden_layers} V={cfg.vocab_size} L={cfg.canvas_length} "
          f"B={args.batch} P={args.prompt}; devices={jax.devices()}; load(1m)={load0:.2f}")
    model = random_model(cfg, 0, converging=False)
    ov = loop_overhead(model, prompts, args.k1, args.k2, args.reps)
    for stat in ("min", "median"):
        o = ov[stat]
        print(f"[{stat} of {args.reps}] block K={args.k1}: {o['block_k1_s'] * 1e3:.1f} ms, K={args.k2}: "
              f"{o['block_k2_s'] * 1e3:.1f} ms -> one denoising step {o['step_s'] * 1e3:.2f} ms; forward+SC "
              f"{o['forward_sc_s'] * 1e3:.2f} ms, forward {o['forward_s'] * 1e3:.2f} ms")
        print(f"    RATIO step / forward+SC = {o['ratio_vs_forward_sc']:.3f} (target <= {TARGET}); step / forward = "
              f"{o['ratio_vs_forward']:.3f}; whole block / K / forward+SC = {o['block_per_step_vs_forward_sc']:.3f}")

    results = dict(config=cfg.to_dict(), args=vars(args), overhead=ov)
    for name, converging in (("random", False), ("converging", True)):
        m = model if not converging else random_model(cfg, 0, converging=True)
        tp = throughput(m, prompts, args.blocks * args.canvas, args.max_steps, args.reps)
        results[f"throughput_{name}"] = tp
        d, a = tp["diffusion"], tp["ar"]
        print(f"[{name} weights] diffusion: {d['tokens_per_s']:.1f} tok/s (TPF {d['tpf']:.2f}, steps/block "
              f"{d['steps_per_block']:.1f}); AR: {a['tokens_per_s']:.1f} tok/s (TPF {a['tpf']:.2f}); "
              f"diffusion/AR = {tp['diffusion_over_ar_tokens_per_s']:.3f}")
    results["load_avg_1m"] = [load0, os.getloadavg()[0]]
    print(f"load(1m) after: {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())

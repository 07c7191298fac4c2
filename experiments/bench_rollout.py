#!/usr/bin/env python
"""Rollout benchmark: sampling with state recording vs the plain sampler, and bytes per recorded state (CPU).

    python experiments/bench_rollout.py                    # toy-study shape: V=128, L=32, H=64, 2 layers, K=48
    python experiments/bench_rollout.py --batch 16 --reps 5 --json /tmp/bench_rollout.json

What it measures (target: recording ≤ 1.15× the plain sampler):

1. **Recording overhead.** `sample(..., SamplerConfig(record_states=False))` vs the same call with
   `record_states=True` (what `rollout` runs) on the same prompts, keys and weights, after a warm-up call that
   compiles each. Stopping is disabled (c = 0) so both do exactly n_blocks · K decoder steps; a second pair uses the
   default stop rule on "converging" weights (post-sublayer norms ×0.1, as in the tests), where rows stop early.
   ratio = t(record) / t(plain), min and median of interleaved rounds.
2. **Bytes per recorded state** (one row, one block, one step), counted from the record's own arrays
   (`jax.eval_shape` of `record.StepRecord.init`, so nothing is allocated at the 26B shape) against the V-wide fp32
   logits [L, V] it replaces, at the toy shape (measured also on a real record) and at the 26B shape
   (L = 256, H = 2816, V = 262,144, SC embedding in bf16).
3. **Storing vs replaying the SC embedding.** The SC input of step k is softmax(z_{k−1})·E·sqrt(H) where z_{k−1}
   depends on the SC input of step k−1: regenerating it from the per-row keys means re-running the block's whole
   chain of decoder forwards, i.e. a second rollout. The script times the state-replay forward
   (`replay.replay_logprobs` at one state per (row, block), the training forward) next to the rollout, so the cost of
   "replay from keys" (≈ one more rollout per inner epoch) can be compared with the bytes of storing.

The machine is a shared 2-core VM; the 1-minute load average is printed before and after.
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

from dgemma.inference.record import StepRecord  # noqa: E402
from dgemma.inference.replay import replay_logprobs  # noqa: E402
from dgemma.inference.sampler import SamplerConfig, sample  # noqa: E402
from dgemma.model.config import FULL, SLIDING, tiny_toy  # noqa: E402
from bench_common import random_model, timeit  # noqa: E402

TARGET = 1.15
SHAPE_26B = dict(L=256, H=2816, V=262144, sc_dtype=jnp.bfloat16)


def toy_config():
    """The SD·RL toy study's model (experiments/sdrl_study/configs/common.yaml): V=128, L=32, H=64, 1 sliding (W=32) + 1 full layer."""
    return tiny_toy(vocab_size=128, canvas_length=32, sliding_window=32, num_hidden_layers=2,
                    layer_types=(SLIDING, FULL), num_experts=4, top_k_experts=2)


def state_bytes(L: int, H: int, sc_dtype, K: int = 4, B: int = 2) -> dict:
    """Bytes per (row, block, step) of a StepRecord, from its abstract arrays."""
    rec = jax.eval_shape(lambda: StepRecord.init(K, B, L, H, sc_dtype))
    per = {f: int(np.prod(getattr(rec, f).shape)) * jnp.dtype(getattr(rec, f).dtype).itemsize // (K * B)
           for f in rec.__dataclass_fields__}
    return per


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=24)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--max-steps", type=int, default=48)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args(argv)
    load0 = os.getloadavg()[0]
    cfg = toy_config()
    L, H, V = cfg.canvas_length, cfg.hidden_size, cfg.vocab_size
    rng = np.random.default_rng(0)
    prompts = jnp.asarray(rng.integers(3, V, (args.batch, args.prompt)), jnp.int32)
    out: dict = {"batch": args.batch, "prompt": args.prompt, "blocks": args.blocks, "max_steps": args.max_steps,
                 "toy_shape": dict(L=L, H=H, V=V, layers=cfg.num_hidden_layers)}

    timings = {}
    for name, converging, c in (("fixed_K", False, 0.0), ("adaptive", True, 0.005)):
        model = random_model(cfg, 0, converging, scale_std=0.5, weight_std=0.2, sc_down_factor=0.1)
        scfg = SamplerConfig(max_steps=args.max_steps, max_new_tokens=args.blocks * L, eos_ids=(10 ** 6,),
                             confidence_threshold=c)
        key = jax.random.key(1)

        def run(record, model=model, scfg=scfg, key=key):
            res = sample(model, prompts, None, scfg.replace(record_states=record), key)
            return res.record.canvas if record else jnp.asarray(res.tokens)

        t = timeit({"plain": lambda: run(False), "record": lambda: run(True)}, args.reps)
        res = sample(model, prompts, None, scfg.replace(record_states=True), key)
        steps = float(res.steps_per_block.mean())
        timings[name] = dict(plain_min=t["plain"][0], plain_median=t["plain"][1], record_min=t["record"][0],
                             record_median=t["record"][1], ratio_min=t["record"][0] / t["plain"][0],
                             ratio_median=t["record"][1] / t["plain"][1], steps_per_block=steps)
        if name == "fixed_K":
            rec = res.record
            n_states = rec.n_blocks * rec.max_steps * rec.batch_size
            per_rec = sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(rec)
                          if x.shape[:3] == (rec.n_blocks, rec.max_steps, rec.batch_size)) / n_states
            out["toy_measured_bytes_per_state"] = per_rec
            out["toy_record_total_bytes"] = rec.nbytes()
            # the training forward at one state per (row, block): what replay costs per selected step
            replay = jax.jit(lambda steps: replay_logprobs(model, rec, prompts, jnp.ones(prompts.shape, bool), steps,
                                                           jnp.asarray(res.tokens).reshape(rec.batch_size,
                                                                                           rec.n_blocks, L))[0])
            tr = timeit({"replay_one_state": lambda: replay(jnp.int32(3))}, args.reps)
            timings["replay_one_state_per_block"] = dict(min=tr["replay_one_state"][0],
                                                         median=tr["replay_one_state"][1])
    out["timings"] = timings

    shapes = {}
    for name, (Ls, Hs, Vs, dt) in {"toy": (L, H, V, jnp.dtype(cfg.execution.dtype)),
                                   "26B": (SHAPE_26B["L"], SHAPE_26B["H"], SHAPE_26B["V"],
                                           SHAPE_26B["sc_dtype"])}.items():
        per = state_bytes(Ls, Hs, dt)
        total = sum(per.values())
        logits = Ls * Vs * 4
        shapes[name] = dict(L=Ls, H=Hs, V=Vs, sc_dtype=str(jnp.dtype(dt)), fields=per, bytes_per_state=total,
                            logits_fp32_bytes=logits, ratio_logits_over_state=logits / total,
                            without_sc_bytes=total - per["sc"])
    out["bytes"] = shapes
    out["load_avg_1min"] = [load0, os.getloadavg()[0]]
    out["machine"] = "2-core AMD EPYC VM, CPU only, jax " + jax.__version__ + ", shared with other work"

    print(f"machine: {out['machine']}; load {load0:.2f} -> {out['load_avg_1min'][1]:.2f}")
    print(f"toy model V={V} L={L} H={H}, batch {args.batch}, prompt {args.prompt}, {args.blocks} blocks, "
          f"K={args.max_steps}")
    for name in ("fixed_K", "adaptive"):
        t = timings[name]
        print(f"{name:9s} steps/block {t['steps_per_block']:.1f}: plain {t['plain_min'] * 1e3:.1f} ms "
              f"(median {t['plain_median'] * 1e3:.1f}), record {t['record_min'] * 1e3:.1f} ms "
              f"(median {t['record_median'] * 1e3:.1f}); ratio {t['ratio_min']:.3f} (median {t['ratio_median']:.3f})"
              f" target <= {TARGET}")
    tr = timings["replay_one_state_per_block"]
    print(f"replay (training forward, one state per row x block): {tr['min'] * 1e3:.1f} ms "
          f"(median {tr['median'] * 1e3:.1f}) vs one rollout {timings['fixed_K']['record_min'] * 1e3:.1f} ms")
    print(f"toy record measured: {out['toy_measured_bytes_per_state']:.0f} B per state "
          f"({out['toy_record_total_bytes']} B in all)")
    for name, s in shapes.items():
        print(f"{name:4s} L={s['L']} H={s['H']} V={s['V']} SC {s['sc_dtype']}: {s['bytes_per_state']:,} B per state "
              f"(SC {s['fields']['sc']:,} B, rest {s['without_sc_bytes']:,} B) vs fp32 logits "
              f"{s['logits_fp32_bytes']:,} B: {s['ratio_logits_over_state']:.1f}x smaller")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()

"""Where the tiny pipeline's training step time goes: steps/s of execution / XLA:CPU variants against the shipped
settings, measured back-to-back in the same run (interleaved rounds), with each variant's loss curve compared to the
baseline's.

    python experiments/bench_tiny_step.py                         # stage 0 (AR) config, default variants
    python experiments/bench_tiny_step.py --config stage1.yaml --steps 120 --rounds 2

Each (variant, round) trains the main job's config (experiments/tiny_pipeline/) for --steps steps in a fresh
subprocess (so XLA_FLAGS can differ), from the same seed and data. Printed per variant: median steps/s over the rounds
(the first --skip steps, compile and warm-up, excluded), the ratio to the baseline's median, and |loss - baseline
loss| at step 1 and over the first 20 steps: a variant that changes only how the step runs must match to float32
rounding at step 1 (Adam's normalised updates then amplify rounding differences step by step). Only the ratios of one run mean anything on a shared machine; absolute steps/s depend on its load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent / "tiny_pipeline"
# name -> (dotted overrides, XLA_FLAGS additions). The baseline is the shipped configuration.
VARIANTS = {
    "baseline": ([], ""),
    "moe_dense": (["model.execution.moe_kernel=dense"], ""),
    "moe_gathered": (["model.execution.moe_kernel=gathered"], ""),
    "chunked_attn": (["model.execution.attention_impl=chunked", "model.execution.attention_q_chunk=16",
                      "model.execution.attention_kv_chunk=16"], ""),
    "eigen_1thread": ([], "--xla_cpu_multi_thread_eigen=false"),
}


def worker(config: str, steps: int, overrides: list[str], out: str) -> None:
    """Train `steps` steps, print one JSON line: per-step wall clock and losses."""
    from dgemma.config import load_config
    from dgemma.train.trainer import train

    cfg = load_config(HERE / config, [f"run.output_dir={out}", f"trainer.steps={steps}", "trainer.log_every=1",
                                      f"checkpoint.every={10 * steps}", f"optim.warmup_steps={min(100, steps // 2)}",
                                      *overrides])
    times, losses = [], []

    def on_step(step: int, m: dict) -> None:
        times.append(time.perf_counter())
        losses.append(m["loss"])

    train(cfg, progress=False, save_params_at_end=False, on_step=on_step)
    print("RESULT " + json.dumps({"times": times, "losses": losses}), flush=True)


def run_variant(name: str, config: str, steps: int) -> dict:
    overrides, flags = VARIANTS[name]
    env = dict(os.environ)
    if flags:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, __file__, "--worker", "--config", config, "--steps", str(steps), "--out", out,
               "--overrides", json.dumps(overrides)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"variant {name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="stage0_ar.yaml", help="a config of experiments/tiny_pipeline/")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--skip", type=int, default=20, help="steps excluded from the rate (warm-up)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, baseline first")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--overrides", default="[]", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.config, args.steps, json.loads(args.overrides), args.out)
        return 0
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or names[0] != "baseline":
        raise SystemExit(f"--variants: unknown {unknown} or baseline not first (known: {', '.join(VARIANTS)})")
    rates: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for n in names:  # interleaved: each round runs every variant once, in order
            res = run_variant(n, args.config, args.steps)
            t = res["times"]
            rate = (len(t) - 1 - args.skip) / (t[-1] - t[args.skip])
            rates[n].append(rate)
            losses.setdefault(n, res["losses"])
            print(f"round {r} {n}: {rate:.2f} steps/s", flush=True)

    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2

    base = median(rates["baseline"])
    print(f"\n{args.config}, {args.steps} steps x {args.rounds} rounds, load avg {os.getloadavg()[0]:.1f}")
    print("| variant | steps/s (median) | rounds | ratio to baseline | |loss diff| at step 1 | max over steps 1-20 |")
    print("|---|---|---|---|---|---|")
    for n in names:
        diffs = [abs(a - b) for a, b in zip(losses[n][:20], losses["baseline"][:20])]
        print(f"| {n} | {median(rates[n]):.2f} | {', '.join(f'{x:.2f}' for x in rates[n])} | "
              f"{median(rates[n]) / base:.3f} | {diffs[0]:.2e} | {max(diffs):.2e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

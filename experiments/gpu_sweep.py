"""In one device call: time the canvas forward and the AR decode step under each attention / MoE
kernel choice, then the best choice at as many layers as fit (never in CI).

A lent GPU comes with a short budget (minutes, all tries together) and no network, so everything a run needs is
prepared here and the device does one call:

    bash experiments/gpu_wheels.sh          # here: Tokamax and its pure-Python dependencies -> .gpu_wheels/
    # on the device, carrying .gpu_wheels (the `run` tool's carry), one command:
    python3 -m pip install -q --no-index --find-links .gpu_wheels tokamax pyyaml
    python3 experiments/gpu_sweep.py --out "$OUT"

Each variant is `experiments/gpu_canvas_forward.py` in its own process (a kernel that crashes or hangs costs only its
own timeout, and its device memory is returned before the next one), most portable first, so a kernel the device's
jax / Tokamax cannot run still leaves the XLA figures. A variant that fails is recorded with its one-line reason,
never dropped. Results: `results.json` (every variant's figures or error) and `summary.md` (the table for
docs/planner_gpu.md) under --out, and the table on stdout.

    python experiments/gpu_sweep.py --small --out /tmp/sweep   # CPU smoke (tests/experiments/test_gpu_sweep.py)
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

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "gpu_canvas_forward.py"

# (name, gpu_canvas_forward arguments), most portable first: XLA only, then Tokamax's grouped matmul, then Tokamax
# attention too. Mosaic GPU attention refuses head_dim 512 on Hopper (docs/planner_gpu.md), so attention uses Triton.
VARIANTS = (
    ("chunked+xla", ["--attention", "chunked", "--moe-kernel", "xla"]),
    ("chunked+tokamax-mosaic", ["--attention", "chunked", "--moe-kernel", "tokamax", "--tokamax-backend", "mosaic"]),
    ("chunked+tokamax-triton", ["--attention", "chunked", "--moe-kernel", "tokamax", "--tokamax-backend", "triton"]),
    ("tokamax-triton (both)", ["--attention", "tokamax", "--moe-kernel", "tokamax", "--tokamax-backend", "triton"]),
)

# HBM bandwidth in TB/s by `device_kind` prefix: one canvas forward of 256 tokens touches nearly every expert, so
# reading the weights once is a floor on its time (FP8 halves it; the published 13.56 ms is H100 with FP8).
HBM_TBPS = {"NVIDIA H200": 4.8, "NVIDIA H100": 3.35, "NVIDIA A100": 2.0}


def weight_read_floor_ms(device: str, weight_bytes: int) -> float | None:
    tbps = next((v for k, v in HBM_TBPS.items() if device.startswith(k)), None)
    return None if tbps is None else weight_bytes / (tbps * 1e12) * 1e3


def run_variant(name: str, extra: list[str], common: list[str], out: Path, timeout_s: float) -> dict:
    """One gpu_canvas_forward process; its figures, or its failure as one line (rc, last stderr line). Its output is
    appended to log.txt; its JSON is merged into results.json (the device returns at most 8 files)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "variant.json"
        try:
            p = subprocess.run([sys.executable, str(SCRIPT), *extra, *common, "--json", str(path)], env=env,
                               capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:  # keep what it printed (its output may come back as bytes)
            printed = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x for x in (e.stdout, e.stderr)
                              if x)
            p, error = None, f"timed out after {timeout_s:.0f} s"
        else:
            printed = p.stdout + p.stderr
            lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
            error = f"rc {p.returncode}: {lines[-1] if lines else '(no stderr)'}"[:400]
        with open(out / "log.txt", "a") as log:
            log.write(f"\n===== {name}\n{printed}" + (f"\n[{error}]\n" if p is None else ""))
        figures = json.loads(path.read_text()) if p is not None and p.returncode == 0 and path.exists() else None
    result = {"variant": name, "args": extra, "wall_s": time.perf_counter() - t0}
    if figures is not None:
        return {**result, "ok": True, **figures}
    return {**result, "ok": False, "error": error}


def table(results: list[dict]) -> str:
    rows = ["| variant | layers | canvas ms (30-layer) | AR step ms (30-layer) | vs published 13.56 | "
            "bf16 weight-read floor ms (30-layer) | compile s |", "|---|---|---|---|---|---|---|"]
    for r in results:
        if not r["ok"]:
            rows.append(f"| {r['variant']} | | failed: {r['error']} | | | | |")
            continue
        floor = r.get("weight_read_floor_ms_30_layers")
        rows.append(f"| {r['variant']} | {r['layers']} | {r['canvas_ms']:.2f} ({r['canvas_ms_30_layers']:.2f}) | "
                    f"{r['ar_step_ms']:.2f} ({r['ar_step_ms_30_layers']:.2f}) | "
                    f"{r['canvas_ms_30_layers'] / r['published_ms']:.2f} x | "
                    f"{'?' if floor is None else f'{floor:.2f}'} | {r['compile_s']:.0f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_sweep", help="results folder (default $OUT)")
    p.add_argument("--budget-s", type=float, default=480, help="stop starting variants past this many seconds")
    p.add_argument("--variant-timeout-s", type=float, default=150)
    p.add_argument("--layers", type=int, default=6, help="layers per variant (one 5+1 period; timed, scaled to 30)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--only", nargs="+", metavar="VARIANT", help="run only these variants (names as in the table)")
    p.add_argument("--no-full", action="store_true", help="skip the best variant's as-many-layers-as-fit run")
    p.add_argument("--small", action="store_true", help="tiny geometry (CPU smoke run)")
    args = p.parse_args(argv)
    if args.budget_s <= 0 or args.variant_timeout_s <= 0 or args.layers < 1 or args.reps < 1:
        p.error("--budget-s, --variant-timeout-s, --layers and --reps must be positive")
    names = [n for n, _ in VARIANTS]
    unknown = sorted(set(args.only or ()) - set(names))
    if unknown:
        p.error(f"--only {', '.join(unknown)}: not a variant; choose from {', '.join(names)}")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        p.error(f"--out {out}: exists and is not an empty folder; pick a new one (earlier results are kept)")
    out.mkdir(parents=True, exist_ok=True)
    common = ["--reps", str(args.reps)] + (["--small", "--context", "16"] if args.small else [])
    start = time.perf_counter()
    results = []
    chosen = [(n, a) for n, a in VARIANTS if not args.only or n in args.only]
    for i, (name, extra) in enumerate(chosen):
        left = args.budget_s - (time.perf_counter() - start)
        if left < 30:
            results.append({"variant": name, "args": extra, "ok": False, "error": "not run: sweep budget spent"})
            continue
        print(f"[{i + 1}/{len(chosen)}] {name} ({left:.0f} s of budget left)", flush=True)
        results.append(run_variant(name, extra, common + ["--layers", str(args.layers)], out,
                                   min(args.variant_timeout_s, left)))
        print(f"    {'ok' if results[-1]['ok'] else results[-1]['error']}", flush=True)
    ok = [r for r in results if r["ok"]]
    left = args.budget_s - (time.perf_counter() - start)
    if ok and not args.no_full and not args.small and left >= 60:
        best = min(ok, key=lambda r: r["canvas_ms_30_layers"])
        print(f"[full] {best['variant']} at as many layers as fit ({left:.0f} s of budget left)", flush=True)
        results.append(run_variant(best["variant"] + " (fit)", best["args"], common, out, left))
    for r in results:
        if r["ok"]:
            r["weight_read_floor_ms_30_layers"] = weight_read_floor_ms(r["device"], r["weight_bytes_30_layers"])
    (out / "results.json").write_text(json.dumps(results, indent=1))
    first = next((r for r in results if r["ok"]), None)
    setting = ("no variant ran" if first is None else
               f"{first['device']}, jax {first['jax']}; bf16 weights and activations, random; {first['rows']} row x "
               f"{first['canvas']}-token canvas over a {first['context']}-position cache; median of {args.reps}")
    summary = f"{setting}; times at fewer than 30 layers scaled linearly to 30 (in brackets)\n\n{table(results)}\n"
    (out / "summary.md").write_text(summary)
    print(summary)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The device check: everything a lent GPU should prove, in one call of at most 5 minutes (never in CI).

Here (a machine with the package registry), once:

    bash experiments/gpu_wheels.sh            # Tokamax + its pure-Python deps -> .gpu_wheels/ (+ manifest.json)

On the device, the one call (the `run` tool: carry [".gpu_wheels"], timeout_s 330; a 15-minute budget leaves room
for one retry):

    python3 experiments/device_check.py --wheelhouse .gpu_wheels --out "$OUT"

In order, under one global deadline (`--deadline-s`, default 290 s) with each phase in its own process and its own
timeout (a kernel that crashes or hangs costs only that phase; its device memory is returned before the next):
  1. versions: python, jax, jaxlib, the CUDA plugin, flax, transformers, tokamax; refused in one line (exit 2) when
     they do not match what the wheelhouse was built for (manifest.json: python, tokamax, qwix) and what dgemma and
     Tokamax require (jax == jaxlib == the CUDA plugin; jax / flax / transformers minimums). The wheelhouse is
     installed (`pip install --no-index`) before tokamax is checked.
  2. step: one real stage-1 training step of the shipped 26B config at 6 layers of full width (128 experts top-8,
     canvas 256) with the shipped kernels, each kernel checked against the XLA path
     (experiments/device_train_step.py; tolerances there).
  3. canvas: the canvas forward and AR decode step at 6 layers with the shipped kernels
     (experiments/gpu_canvas_forward.py), then with XLA's ragged_dot as the baseline, while the deadline allows.
Writes 4 files under --out: versions.json, results.json, summary.md, log.txt (every phase's output).
Exit 0 only if every phase passed.

    python experiments/device_check.py --small --out /tmp/check   # CPU smoke (tests/experiments/test_device_check.py)
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
CANVAS = ROOT / "experiments" / "gpu_canvas_forward.py"
STEP = ROOT / "experiments" / "device_train_step.py"
DISTS = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "jax-cuda12-pjrt", "jax-cuda13-pjrt", "flax",
         "transformers", "tokamax", "qwix")
OUTPUTS = ("versions.json", "results.json", "summary.md", "log.txt")


def _installed(dist: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _requirement(text: str):
    try:
        from packaging.requirements import Requirement
    except ImportError:  # the device's python may lack packaging; pip vendors it
        from pip._vendor.packaging.requirements import Requirement
    return Requirement(text)


def dgemma_requirements() -> dict[str, str]:
    """dgemma's own minimums for the packages the device brings (pyproject.toml's dependencies)."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    reqs = [_requirement(d) for d in deps]
    return {r.name: str(r) for r in reqs if r.name in ("jax", "flax", "transformers")}


# transformers is dgemma's parity and export reference; the device phases (train step, canvas forward) never import
# it, and a lent GPU brought 5.17 (2026-12-04) while dgemma needs 5.24 for DiffusionGemma: a note, not a refusal.
UNUSED_ON_DEVICE = ("transformers",)
NOISE = "Autotuning cache miss"  # Tokamax's warning per kernel shape without a tuned config; never the failure


def version_report(manifest: dict | None, want_gpu: bool) -> tuple[dict, list[str]]:
    """(what is installed, the mismatches as one-line reasons)."""
    found = {"python": f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"}
    found.update({d: _installed(d) for d in DISTS})
    problems = []
    if manifest is not None:
        py = ".".join(found["python"].split(".")[:2])
        if py != manifest["python"]:
            problems.append(f"python {py} but the wheelhouse was built for python {manifest['python']} "
                            f"(bash experiments/gpu_wheels.sh {py})")
        for dist in ("tokamax", "qwix"):
            if found[dist] != manifest.get(dist):
                problems.append(f"{dist} {found[dist] or 'not installed'} but the wheelhouse has {manifest.get(dist)}")
    reqs = list(dgemma_requirements().values()) + [r for r in (manifest or {}).get("requires", [])]
    for text in reqs:
        req = _requirement(text)
        have = found.get(req.name) or _installed(req.name)
        if have is None or not req.specifier.contains(have, prereleases=True):
            if req.name in UNUSED_ON_DEVICE:  # recorded, not refused: no device phase imports it
                found.setdefault("notes", []).append(
                    f"{req.name} {have or 'not installed'} does not satisfy {text}; not used by the device phases")
                continue
            problems.append(f"{req.name} {have or 'not installed'} does not satisfy {text}")
    if found["jaxlib"] != found["jax"]:
        problems.append(f"jaxlib {found['jaxlib']} differs from jax {found['jax']}")
    plugins = {d: found[d] for d in DISTS if "cuda" in d and found[d]}
    found["cuda_plugin"] = ", ".join(f"{d} {v}" for d, v in plugins.items()) or None
    if want_gpu:
        if not plugins:
            problems.append("no JAX CUDA plugin installed (jax-cuda12-plugin / jax-cuda13-plugin)")
        problems += [f"{d} {v} differs from jaxlib {found['jaxlib']}" for d, v in plugins.items()
                     if v != found["jaxlib"]]
    return found, problems


def install_wheelhouse(wheelhouse: Path) -> str | None:
    """pip install --no-index the wheelhouse's packages; the failure as one line, or None."""
    # --no-deps over exactly the wheelhouse's wheels: gpu_wheels.sh chose them (xprof without its server's
    # requirements), so pip must not resolve further.
    wheels = sorted(str(w) for w in wheelhouse.glob("*.whl"))
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *wheels],
                       capture_output=True, text=True)
    if p.returncode:
        lines = [ln for ln in (p.stderr or p.stdout).splitlines() if ln.strip()]
        return f"pip install from {wheelhouse} failed (rc {p.returncode}): {lines[-1] if lines else ''}"
    return None


def run_phase(name: str, cmd: list[str], timeout_s: float, log) -> tuple[dict | None, str | None, float]:
    """One phase in its own process: (its JSON, its failure as one line or None, seconds)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # the 6-layer step's state + Adam is ~100 GB
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:  # the phase's JSON is merged into results.json, not kept as a file
        path = Path(tmp) / "phase.json"
        log.write(f"\n===== {name}: {' '.join(cmd)} (timeout {timeout_s:.0f} s)\n")
        log.flush()
        try:
            p = subprocess.run([*cmd, "--json", str(path)], env=env, capture_output=True, text=True, timeout=timeout_s)
            printed, error = p.stdout + p.stderr, None
            if p.returncode:
                lines = ([ln for ln in p.stderr.strip().splitlines() if ln.strip() and NOISE not in ln]
                         or p.stdout.strip().splitlines())
                error = f"rc {p.returncode}: {lines[-1] if lines else '(no output)'}"[:400]
        except subprocess.TimeoutExpired as e:
            printed = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x for x in (e.stdout, e.stderr)
                              if x)
            error = f"timed out after {timeout_s:.0f} s"
        log.write(printed + (f"\n[{error}]\n" if error else ""))
        log.flush()
        data = json.loads(path.read_text()) if path.exists() else None
    return data, error, time.perf_counter() - t0


def phases(args) -> list[tuple[str, list[str], float]]:
    """(name, command, own timeout) in order of importance."""
    py = sys.executable
    if args.small:
        step = [py, str(STEP), "--small"]
        canvas = [py, str(CANVAS), "--small", "--context", "16", "--layers", "1", "--reps", "1"]
        shipped = ["--moe-kernel", "tokamax", "--tokamax-backend", "xla"]  # the CPU stand-in, same API
    else:
        step = [py, str(STEP), "--layers", "6"]
        canvas = [py, str(CANVAS), "--layers", "6", "--reps", "10"]
        shipped = ["--moe-kernel", "tokamax", "--tokamax-backend", "mosaic"]  # as configs/stage1/gemma4_26b_a4b.yaml
    return [("step", step, args.step_timeout_s), ("canvas (shipped kernels)", canvas + shipped, args.canvas_timeout_s),
            ("canvas (xla baseline)", canvas + ["--moe-kernel", "xla"], args.canvas_timeout_s)]


def summary(versions: dict, results: list[dict]) -> str:
    lines = ["versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v), ""]
    for r in results:
        lines.append(f"{r['phase']}: {'ok' if r['ok'] else 'FAILED'} ({r['s']:.0f} s)"
                     + (f" - {r['error']}" if r.get("error") else ""))
        data = r.get("data") or {}
        for c in data.get("checks", []):
            detail = c.get("error") or ", ".join(f"{k} {v:.2e}" for k, v in c["rel_err"].items())
            lines.append(f"  {c['name']:<22} {'ok' if c['ok'] else 'FAILED'}  {detail}"
                         + (f" (tol {c['tol']})" if "tol" in c else ""))
        if "canvas_ms" in data:
            lines.append(f"  {data['device']}, {data['layers']} layers, moe {data['moe_kernel']}: canvas "
                         f"{data['canvas_ms']:.2f} ms, AR step {data['ar_step_ms']:.2f} ms (compile "
                         f"{data['compile_s']:.0f} s)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT"), help="results folder (default $OUT)")
    p.add_argument("--wheelhouse", help="the folder experiments/gpu_wheels.sh made (installed, then checked)")
    p.add_argument("--deadline-s", type=float, default=290, help="the whole check, phases included")
    p.add_argument("--step-timeout-s", type=float, default=220)  # the Mosaic step compiled >160 s on an H200
    p.add_argument("--canvas-timeout-s", type=float, default=60)
    p.add_argument("--small", action="store_true", help="CPU smoke: tiny models, Tokamax's XLA implementation")
    p.add_argument("--no-install", action="store_true", help="check against --wheelhouse without installing from it "
                   "(its packages are installed already)")
    args = p.parse_args(argv)
    start = time.perf_counter()
    if not args.out:
        p.error("--out: no results folder (and $OUT is not set)")
    if min(args.deadline_s, args.step_timeout_s, args.canvas_timeout_s) <= 0:
        p.error("--deadline-s, --step-timeout-s and --canvas-timeout-s must be positive")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        p.error(f"--out {out}: exists and is not an empty folder; pick a new one (earlier results are kept)")
    manifest = None
    if args.wheelhouse:
        path = Path(args.wheelhouse) / "manifest.json"
        if not path.is_file():
            p.error(f"--wheelhouse {args.wheelhouse}: no manifest.json (make it with bash experiments/gpu_wheels.sh)")
        manifest = json.loads(path.read_text())
        py = f"{sys.version_info.major}.{sys.version_info.minor}"
        if py != manifest["python"]:  # before installing: wheels for another python would not install
            print(f"device_check: python {py} but the wheelhouse was built for python {manifest['python']} "
                  f"(bash experiments/gpu_wheels.sh {py})", file=sys.stderr)
            return 2
        failed = None if args.no_install else install_wheelhouse(Path(args.wheelhouse))
        if failed:
            print(f"device_check: {failed}", file=sys.stderr)
            return 2
    out.mkdir(parents=True, exist_ok=True)
    versions, problems = version_report(manifest, want_gpu=not args.small)
    (out / "versions.json").write_text(json.dumps({**versions, "problems": problems}, indent=1))
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v), flush=True)
    if problems:
        print(f"device_check: version mismatch: {'; '.join(problems)}", file=sys.stderr)
        return 2
    results = []
    with open(out / "log.txt", "w") as log:
        for name, cmd, own in phases(args):
            left = args.deadline_s - (time.perf_counter() - start)
            if left < 20:
                results.append({"phase": name, "ok": False, "s": 0.0, "error": "not run: deadline reached"})
                continue
            print(f"[{name}] ({left:.0f} s left)", flush=True)
            data, error, seconds = run_phase(name, cmd, min(own, left - 5), log)
            results.append({"phase": name, "ok": error is None, "s": seconds, "error": error, "data": data})
            print(f"    {'ok' if error is None else error}", flush=True)
    (out / "results.json").write_text(json.dumps({"versions": versions, "phases": results}, indent=1))
    text = summary(versions, results)
    (out / "summary.md").write_text(text)
    print(text)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

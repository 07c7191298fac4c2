#!/usr/bin/env bash
# Prepare, on a machine with the package registry, what a lent GPU (no network; jax, flax and transformers
# preinstalled) needs for experiments/gpu_sweep.py: Tokamax and its dependencies as wheels for the device's Python
# (default 3.12), in .gpu_wheels/ (git-ignored; ~5 MB, within the device tool's carry limit). jax, jaxlib, flax and
# numpy are left out on purpose: the device's own jax is the one to time.
# DEST/manifest.json records what the wheelhouse was built for (python, tokamax, qwix and their requirements on the
# device's own packages); experiments/device_check.py checks the device against it before anything runs.
# Usage: bash experiments/gpu_wheels.sh [PYTHON_VERSION [DEST]]   (DEST: replaced only if this script made it)
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-3.12}"
dest="${2:-.gpu_wheels}"
if [[ ! "$py" =~ ^3\.[0-9]+$ ]]; then
    echo "gpu_wheels: PYTHON_VERSION $py: expected the device's python as 3.N (e.g. 3.12)" >&2
    exit 2
fi
marker=.made-by-dgemma-gpu-wheels  # only a wheelhouse this script made is ever replaced
if [ -e "$dest" ] && [ ! -e "$dest/$marker" ]; then
    echo "gpu_wheels: $dest exists and is not a wheelhouse this script made; remove it or pass another DEST" >&2
    exit 2
fi
tmp="$(mktemp -d "${dest}.tmp.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
opts=(-q --python-version "$py" --only-binary=:all: -d "$tmp"
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_28_x86_64)  # 2_27: xprof, which Tokamax >= 0.0.13 requires
# Tokamax: the newest release for the device's Python unless TOKAMAX_VERSION pins one. 0.0.12 (the newest for
# Python 3.11) fails on jax 0.11 (Mosaic: Mesh(out_shape=...); Triton: pl.dot removed), seen on a lent H200 on
# 2026-12-04; 0.0.17 needs jax >= 0.11.1. The device check refuses a jax below what the chosen release requires.
tokamax_spec="tokamax${TOKAMAX_VERSION:+==$TOKAMAX_VERSION}"
python3 -m pip download "${opts[@]}" --no-deps "$tokamax_spec" qwix  # their jax / flax pins: the device's own
# The rest of their requirements as their metadata pins them (tokamax pins typeguard==2.13.3), with their own light
# dependencies, minus what the device brings (jax, jaxlib, flax, numpy) and extras.
mapfile -t reqs < <(python3 - "$tmp" <<'PY'
import re, sys, zipfile
from pathlib import Path
device_has = {"jax", "jaxlib", "flax", "numpy", "qwix", "xprof"}  # qwix: fetched above without its flax pin
for whl in Path(sys.argv[1]).glob("*.whl"):
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:") and "extra ==" not in line:
                req = line.split(":", 1)[1].split(";")[0].strip()
                if re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower() not in device_has:
                    print(req)
PY
)
python3 -m pip download "${opts[@]}" "${reqs[@]}" pyyaml
# xprof (Tokamax >= 0.0.13 imports it at import time, for its benchmarking helpers) with only what that import
# needs: its own requirements (duckdb, gcsfs, google-cloud-storage, grpcio: ~50 MB) serve its profile server, which
# nothing here runs, and would exceed the device tool's 64 MiB carry. Installed --no-deps on the device.
if unzip -p "$tmp"/tokamax-*.whl '*/METADATA' | grep -q '^Requires-Dist: xprof'; then
    python3 -m pip download "${opts[@]}" --no-deps xprof fire termcolor etils googleapis-common-protos protobuf six
fi
rm -f "$tmp"/numpy-*.whl  # pulled in by tensorboardx; the device's numpy is the one jax was built against
python3 - "$tmp" "$py" <<'PY'
import json, sys, zipfile
from pathlib import Path
tmp, py = Path(sys.argv[1]), sys.argv[2]
device_has = {"jax", "jaxlib", "flax", "numpy"}
manifest = {"python": py, "requires": []}
for name in ("tokamax", "qwix"):
    whl = next(tmp.glob(f"{name}-*.whl"))
    manifest[name] = whl.name.split("-")[1]
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:") and "extra ==" not in line:
                req = line.split(":", 1)[1].split(";")[0].strip()
                if req.split("<")[0].split(">")[0].split("=")[0].split("!")[0].strip().lower() in device_has:
                    manifest["requires"].append(req)
(tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
PY
touch "$tmp/$marker"
rm -rf "$dest" && mv "$tmp" "$dest"  # all or nothing: a failed download leaves the previous wheelhouse
trap - EXIT
echo "$(ls "$dest" | wc -l) wheels in $dest ($(du -sh "$dest" | cut -f1)); on the device:"
echo "  python3 experiments/device_check.py --wheelhouse $dest --out \"\$OUT\"   (docs/device_check.md)"

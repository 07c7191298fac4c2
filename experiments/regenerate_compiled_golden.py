"""Regenerate the recorded compiled figures in tests/golden/{tpu,gpu}_compiled_memory.json with the targets' own
compilers (deviceless: no TPU or GPU needed, but their compilers are).

    python experiments/regenerate_compiled_golden.py            # every file whose compiler is installed
    python experiments/regenerate_compiled_golden.py --only gpu # one file

Each case (its config, overrides and device count are kept) is compiled again: the train step (`cases`,
`stage2_update_cases`) with `dgemma.planning.plan_config.compiled_memory`, the sampler's block program
(`sampler_block_cases`) with `dgemma.planning.sampler_aot.compiled_sampler_block`, over the devices of the target's
topology (TPU v5p-64 = v5p:2x4x4 through libtpu, the `tpu-aot` extra; H100s = h100:N through the CUDA plugin, the
`gpu-aot` extra). The figures are rewritten in place (GiB to two decimals; bytes where the case records bytes); the
tests that read them say `recorded` in their names. Without either compiler it says what to install and exits 2.
A 26B compile takes minutes to tens of minutes per case on a CPU host.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOLDEN = {"tpu": REPO / "tests/golden/tpu_compiled_memory.json", "gpu": REPO / "tests/golden/gpu_compiled_memory.json"}
EXTRA = {"tpu": "dgemma[tpu-aot]", "gpu": "dgemma[gpu-aot]"}
ACCELERATOR = {"tpu": "v5p", "gpu": "h100"}


def compiler_available(target: str) -> bool:
    """Whether the target's deviceless compiler is importable (libtpu, or the JAX CUDA plugin)."""
    import importlib.util

    if target == "tpu":
        return importlib.util.find_spec("libtpu") is not None
    from dgemma.planning.gpu_aot import cuda_plugin

    return cuda_plugin() is not None


def topology_name(target: str, devices: int) -> str:
    if target == "gpu":
        return f"h100:{devices}" if devices <= 8 else f"h100:{devices // 8}x8"
    if devices != 32:
        raise ValueError(f"no recorded TPU topology for {devices} chips (v5p:2x4x4 = 32)")
    return "v5p:2x4x4"


def _figures(case: dict, report) -> None:
    gib = 2**30
    case["argument_gib"] = round(report.argument_bytes / gib, 2)
    case["temp_gib"] = round(report.temp_bytes / gib, 2)
    case["peak_gib"] = round(report.peak_bytes / gib, 2)
    for key, value in (("argument_bytes", report.argument_bytes), ("temp_bytes", report.temp_bytes),
                       ("peak_bytes", report.peak_bytes)):
        if key in case:
            case[key] = int(value)


def regenerate(target: str) -> None:
    from dgemma.config import load_config
    from dgemma.planning.gpu_aot import gpu_topology_devices
    from dgemma.planning.plan_config import compiled_memory, spec_from_config
    from dgemma.planning.sampler_aot import compiled_sampler_block
    from dgemma.planning.tpu_aot import tpu_topology_devices

    path = GOLDEN[target]
    golden = json.loads(path.read_text())
    for key in ("cases", "stage2_update_cases", "sampler_block_cases"):
        for case in golden.get(key, []):
            cfg = load_config(REPO / case["config"], case["overrides"], env={})
            name = topology_name(target, case["devices"])
            devices = (gpu_topology_devices if target == "gpu" else tpu_topology_devices)(name)
            spec = spec_from_config(cfg, devices=len(devices), accelerator=ACCELERATOR[target])
            if key == "sampler_block_cases":
                report = compiled_sampler_block(cfg, spec, devices, rows_per_device=case["rows_per_device"])[0]
            else:
                report = compiled_memory(cfg, spec, devices)
            _figures(case, report)
            print(f"{target} {key} {case['overrides']}: peak {case['peak_gib']} GiB", flush=True)
    path.write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path.relative_to(REPO)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(GOLDEN), help="regenerate one file")
    args = parser.parse_args(argv)
    targets = [args.only] if args.only else sorted(GOLDEN)
    missing = [t for t in targets if not compiler_available(t)]
    if missing == targets:
        print("regenerate_compiled_golden: needs the targets' compilers: pip install "
              + " / ".join(f"'{EXTRA[t]}'" for t in missing), file=sys.stderr)
        return 2
    for t in missing:
        print(f"regenerate_compiled_golden: skipping {GOLDEN[t].name}: pip install '{EXTRA[t]}'", file=sys.stderr)
    os.environ["JAX_PLATFORMS"] = "cpu"  # the compile-only clients stay beside a CPU backend
    import jax

    jax.config.update("jax_platforms", "cpu")
    for t in targets:
        if t not in missing:
            regenerate(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())

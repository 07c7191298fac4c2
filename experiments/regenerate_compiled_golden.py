"""Regenerate the recorded compiled figures in tests/golden/{tpu,gpu}_compiled_memory.json with the targets' own
compilers (deviceless: no TPU or GPU needed, but their compilers are).

    python experiments/regenerate_compiled_golden.py            # every file whose compiler is installed
    python experiments/regenerate_compiled_golden.py --only gpu # one file

Each case (its config, overrides and device count are kept) is compiled again: the train step (`cases`,
`stage2_update_cases`, and `reduced_depth_cases`: the dense family members' stage 1 at 2 and 4 layers; their
`bf16_vh_tables_at_peak`, read in the live ranges of an `XLA_FLAGS=--xla_dump_to` compile, is kept, not re-derived)
with `dgemma.planning.plan_config.compiled_memory`, the sampler's block program (`sampler_block_cases`) with
`dgemma.planning.sampler_aot.compiled_sampler_block`, over the devices of the target's topology (TPU v5p-64 =
v5p:2x4x4 through libtpu, the `tpu-aot` extra; H100s = h100:N through the CUDA plugin, the `gpu-aot` extra). The
figures are rewritten in place (GiB to two decimals; bytes where the case records bytes); the tests that read them
say `recorded` in their names. Without either compiler it says what to install and exits 2.
A 26B compile takes minutes to tens of minutes per case on a CPU host.

With libtpu it also rewrites tests/golden/tpu_moe_flops.json: XLA's cost analysis of the 26B stage-1 step compiled
deviceless for TPU with `moe_kernel: auto` (what `resolve_moe_kernel` picks on TPU), per layer, against
6 x active params x tokens of that layer. Cost analysis counts a loop body once (the layer scan, chunked attention's
tiles, the chunked head + cross-entropy), so the step is compiled without the layer scan at two reduced depths,
[full] and [sliding, full]; their difference is one sliding layer (25 of the 30; its MoE is every layer's), where
a dense expansion of the experts would show as E / k = 16 x their matmuls. A Pallas call counts what its
CostEstimate says (Megablox: 2 m k n over the routed rows).

    python experiments/regenerate_compiled_golden.py --only tpu-flops   # this file alone (2 parallel compiles per case)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOLDEN = {"tpu": REPO / "tests/golden/tpu_compiled_memory.json", "gpu": REPO / "tests/golden/gpu_compiled_memory.json",
          "tpu-flops": REPO / "tests/golden/tpu_moe_flops.json"}
EXTRA = {"tpu": "dgemma[tpu-aot]", "gpu": "dgemma[gpu-aot]", "tpu-flops": "dgemma[tpu-aot]"}
ACCELERATOR = {"tpu": "v5p", "gpu": "h100"}
DEPTHS = {"F": ("full_attention",), "SF": ("sliding_attention", "full_attention")}


def compiler_available(target: str) -> bool:
    """Whether the target's deviceless compiler is importable (libtpu, or the JAX CUDA plugin)."""
    import importlib.util

    if target in ("tpu", "tpu-flops"):
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
    for key in ("cases", "stage2_update_cases", "reduced_depth_cases", "sampler_block_cases"):
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


def layer_model_flops(cfg, spec, layer: int) -> float:
    """6 x the active params of one layer x tokens of one optimizer step (`dgemma.planning.flops`)."""
    from dgemma.planning.flops import layer_matmul_params

    return 6.0 * layer_matmul_params(cfg.model_config, layer) * spec.tokens_per_example * spec.global_batch


def _default_tpu_flops_golden() -> dict:
    return {"_about": "XLA's cost analysis of the 26B stage-1 step, deviceless v5p, per sliding layer against 6 x its "
                      "active params x tokens (experiments/regenerate_compiled_golden.py --only tpu-flops; "
                      "docs/planner_compile.md, \"MoE FLOPs on TPU\")",
            "cases": [{"config": "configs/stage1/gemma4_26b_a4b.yaml", "topology": "v5p:2x2x1", "moe_kernel": "auto",
                       "overrides": ["trainer.grad_accum_steps=1", "data.batch_size=8"]}]}


def tpu_flops_overrides(case: dict, name: str) -> list[str]:
    """`case`'s overrides for its step without the layer scan at depth DEPTHS[name]."""
    types = DEPTHS[name]
    return [*case["overrides"], f"model.execution.moe_kernel={case['moe_kernel']}",
            f"model.num_hidden_layers={len(types)}", f"model.layer_types=[{','.join(types)}]",
            "model.execution.scan_layers=false", f"model.execution.scan_period={len(types)}"]


def tpu_flops_depth(case: dict, name: str) -> dict:
    """One compile: `case`'s step without the layer scan at depth DEPTHS[name]; its cost analysis per chip."""
    from dgemma.config import load_config
    from dgemma.planning.plan_config import compiled_memory, spec_from_config
    from dgemma.planning.tpu_aot import tpu_topology_devices

    devices = tpu_topology_devices(case["topology"])
    cfg = load_config(REPO / case["config"], tpu_flops_overrides(case, name), env={})
    spec = spec_from_config(cfg, devices=len(devices), accelerator=ACCELERATOR["tpu"])
    report = compiled_memory(cfg, spec, devices)
    # layer 0 of every depth is its first type: the sliding one in [sliding, full]
    return {"flops": report.flops, "compile_seconds": round(report.compile_seconds), "chips": len(devices),
            "global_batch": spec.global_batch, "tokens_per_example": spec.tokens_per_example,
            "layer0_model_flops": layer_model_flops(cfg, spec, 0)}


def _tpu_flops_child(index: int, name: str) -> int:
    """Child process of `regenerate_tpu_flops`: one depth's compile, its figures as JSON on the last stdout line."""
    path = GOLDEN["tpu-flops"]
    golden = json.loads(path.read_text()) if path.exists() else _default_tpu_flops_golden()
    print(json.dumps(tpu_flops_depth(golden["cases"][index], name)), flush=True)
    return 0


def regenerate_tpu_flops() -> None:
    """Each case's two depths compile at once, one child process each (a 26B compile is single-threaded for most of
    its tens of minutes); the file is written when both are done."""
    import importlib.metadata as md
    import subprocess

    import jax

    from dgemma.model.kernels import resolve_moe_kernel

    path = GOLDEN["tpu-flops"]
    golden = json.loads(path.read_text()) if path.exists() else _default_tpu_flops_golden()
    # libtpu takes /tmp/libtpu_lockfile for its process unless told not to; deviceless compiles share no chip
    env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    for index, case in enumerate(golden["cases"]):
        children = {name: subprocess.Popen([sys.executable, __file__, "--only", "tpu-flops", "--tpu-flops-depth",
                                            name, "--tpu-flops-case", str(index)], stdout=subprocess.PIPE, text=True,
                                           env=env) for name in DEPTHS}
        figures = {}
        for name, child in children.items():
            out, _ = child.communicate()
            if child.returncode != 0:
                raise SystemExit(f"regenerate_compiled_golden: the tpu-flops {name} compile failed "
                                 f"(exit {child.returncode}); {path.name} not written")
            figures[name] = json.loads(out.strip().splitlines()[-1])
            print(f"tpu-flops {case['moe_kernel']} {name}: {figures[name]['flops']:.4e} per chip "
                  f"({figures[name]['compile_seconds']} s)", flush=True)
        per_depth = {name: f["flops"] for name, f in figures.items()}
        sf = figures["SF"]
        layer = (per_depth["SF"] - per_depth["F"]) * sf["chips"]
        model = sf["layer0_model_flops"]
        case.update(resolved=resolve_moe_kernel(case["moe_kernel"], "tpu"), flops_per_chip=per_depth,
                    compile_seconds={name: f["compile_seconds"] for name, f in figures.items()},
                    chips=sf["chips"], global_batch=sf["global_batch"], tokens_per_example=sf["tokens_per_example"],
                    sliding_layer_flops=layer, sliding_layer_model_flops=model, ratio=round(layer / model, 3),
                    jax=jax.__version__, libtpu=md.version("libtpu"))
        print(f"tpu-flops {case['moe_kernel']} ({case['resolved']}): one sliding layer {case['ratio']} x 6 x active "
              f"x tokens", flush=True)
    path.write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path.relative_to(REPO)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(GOLDEN), help="regenerate one file")
    # internal: one tpu-flops compile, run by regenerate_tpu_flops as a child process
    parser.add_argument("--tpu-flops-depth", choices=sorted(DEPTHS), help=argparse.SUPPRESS)
    parser.add_argument("--tpu-flops-case", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    targets = [args.only] if args.only else sorted(GOLDEN)
    missing = [t for t in targets if not compiler_available(t)]
    if missing == targets:
        print("regenerate_compiled_golden: needs the targets' compilers: pip install "
              + " / ".join(sorted({f"'{EXTRA[t]}'" for t in missing})), file=sys.stderr)
        return 2
    for t in missing:
        print(f"regenerate_compiled_golden: skipping {GOLDEN[t].name}: pip install '{EXTRA[t]}'", file=sys.stderr)
    os.environ["JAX_PLATFORMS"] = "cpu"  # the compile-only clients stay beside a CPU backend
    import jax

    jax.config.update("jax_platforms", "cpu")
    if args.tpu_flops_depth:
        return _tpu_flops_child(args.tpu_flops_case, args.tpu_flops_depth)
    for t in targets:
        if t not in missing:
            regenerate_tpu_flops() if t == "tpu-flops" else regenerate(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Deviceless GPU ahead-of-time compilation: XLA:GPU's memory analysis of a step for H100s, on a machine with none.

    devices = gpu_topology_devices("h100:8")          # 8 abstract H100s on one host; nothing is allocated
    report = compiled_memory(cfg, spec, devices)      # dgemma.planning.plan_config: the real train step

`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)` builds a compile-only CUDA client
from a target description (`gpu_targets/*.txtpb`: compute capability, SMs, shared memory, HBM size), so the real
XLA:GPU pipeline (SPMD partitioning, fusion, scheduling, buffer assignment, Triton / Mosaic GPU kernel lowering) runs
here and `memory_analysis()` is what each GPU would hold. Autotuning needs a device and is skipped, so kernel
choices fall back to heuristics: memory, not speed, is what this proves.

Needs the CUDA plugin matching jax (`pip install 'dgemma[gpu-aot]'`, or `pip install --target DIR
jax-cuda12-plugin[with-cuda]==<jax's version>` on PYTHONPATH for this one command; ptxas comes from its nvcc wheel).
JAX itself stays on CPU (`dgemma plan --topology` sets jax_platforms=cpu before the backend starts).
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
from pathlib import Path

__all__ = ["GPU_TOPOLOGY_PATTERN", "cuda_plugin", "gpu_topology_devices", "is_gpu_topology", "kernel_device", "parse_gpu_topology"]

GPU_TOPOLOGY_PATTERN = re.compile(r"^(h100):(?:(\d+)x)?(\d+)$")
_TARGETS = {"h100": "h100_sxm.txtpb"}  # generation -> target description; the planner's accelerator has its name


def is_gpu_topology(name: str) -> bool:
    """Whether `--topology name` names GPUs (GEN:[HOSTSx]GPUS) rather than a TPU slice."""
    return str(name).split(":", 1)[0].lower() in _TARGETS


def parse_gpu_topology(name: str) -> tuple[str, int, int]:
    """(generation, hosts, GPUs per host) of a GPU topology such as "h100:8" (one host of 8) or "h100:2x8"."""
    m = GPU_TOPOLOGY_PATTERN.match(str(name).lower())
    if not m:
        raise ValueError(f"--topology {name!r}: expected GEN:[HOSTSx]GPUS with GEN one of {', '.join(_TARGETS)} "
                         f"(e.g. h100:8 for one host of 8 H100s)")
    hosts, per_host = int(m.group(2) or 1), int(m.group(3))
    if hosts < 1 or per_host < 1:
        raise ValueError(f"--topology {name!r}: hosts and GPUs per host must be >= 1")
    return m.group(1), hosts, per_host


def target_config(generation: str) -> str:
    """The XLA GPU target description (text proto) of `generation`."""
    return (Path(__file__).with_name("gpu_targets") / _TARGETS[generation]).read_text()


def cuda_plugin() -> str | None:
    """The installed JAX CUDA plugin's module name, or None."""
    for name in ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"):
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except ModuleNotFoundError:  # no jax_plugins package at all
            return None
    return None


def gpu_topology_devices(name: str) -> list:
    """The compile-only devices of GPU topology `name` (see `parse_gpu_topology`); needs the CUDA plugin."""
    gen, hosts, per_host = parse_gpu_topology(name)
    if cuda_plugin() is None:  # only to give a clear error; JAX loads the plugin itself
        raise ValueError(f"--topology {name}: deviceless GPU compilation needs the CUDA plugin matching jax (pip "
                         f"install 'dgemma[gpu-aot]'); neither jax_plugins.xla_cuda12 nor xla_cuda13 is installed")
    from jax.experimental import topologies

    try:  # "slices x hosts x devices per host"
        topo = topologies.get_topology_desc(platform="cuda", target_config=target_config(gen),
                                            topology=f"1x{hosts}x{per_host}")
    except Exception as e:  # noqa: BLE001 - the plugin's errors are long; keep the first line
        raise ValueError(f"--topology {name}: the CUDA plugin could not describe it: {str(e).splitlines()[0]}") from None
    return list(topo.devices)


def kernel_device(mesh):
    """Context for lowering a program over `mesh`: when its devices are compile-only GPUs, JAX's default device is the
    first of them, because Tokamax picks and checks its kernels against the default device (a CPU on this host).
    Lowering only: eager operations cannot run on a compile-only device."""
    device = mesh.devices.flat[0]
    if device.platform == "gpu" and getattr(device.client, "runtime_type", "") == "compile_only_runtime":
        import jax

        return jax.default_device(device)
    return contextlib.nullcontext()

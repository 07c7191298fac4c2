"""The accelerators the planner knows: HBM per device, dense bf16 peak, devices per host and the RAM of one host
(node) (`--accelerator`). Node RAM is the cloud machine type's: H100 = A3 a3-highgpu-8g (1,872 GB), H200 = A3 Ultra
a3-ultragpu-8g (2,952 GB), v5p = ct5p-hightpu-4t (448 GB), v6e = ct6e-standard-4t (720 GB); a launch profile states its
own cluster's (`launch.node_ram_gib`)."""

from __future__ import annotations

import dataclasses

__all__ = ["ACCELERATORS", "GiB", "Accelerator", "get_accelerator"]

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str
    label: str
    hbm_gib: float  # per device
    bf16_tflops: float  # dense peak per device
    devices_per_host: int
    platform: str  # gpu | tpu | cpu (simulated devices share the host's memory: hbm_gib is the host RAM)
    node_ram_gib: float = 0.0  # RAM of one host (pinned host memory, offloaded activations are planned against it)


ACCELERATORS: dict[str, Accelerator] = {
    "h100": Accelerator("h100", "NVIDIA H100 80GB", 80, 989, 8, "gpu", 1872e9 / GiB),
    "h200": Accelerator("h200", "NVIDIA H200 141GB", 141, 989, 8, "gpu", 2952e9 / GiB),
    "v5p": Accelerator("v5p", "TPU v5p (95 GB/chip)", 95, 459, 4, "tpu", 448e9 / GiB),
    "v6e": Accelerator("v6e", "TPU v6e / Trillium (32 GB/chip)", 32, 918, 4, "tpu", 720e9 / GiB),
}


def _host_gib() -> float:
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16.0


def get_accelerator(name: str) -> Accelerator:
    key = name.lower().replace("-80gb", "").replace("nvidia-", "")
    if key == "cpu":
        ram = round(_host_gib(), 1)
        return Accelerator("cpu", "host CPU (simulated devices share host RAM)", ram, 0.5, 8, "cpu", ram)
    if key not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {name!r}; known: {sorted(ACCELERATORS) + ['cpu']}")
    return ACCELERATORS[key]

"""`dgemma train`'s own accelerator memory setup and its fit check before the first step.

    configure_allocator()            # before the JAX backend starts: XLA_PYTHON_CLIENT_* from the packaged gpu.env
    refusal = run_fit_refusal(cfg)   # after it started: the planner's peak vs what the allocator allows, or None

`dgemma launch` exports the packaged hardware env (`dgemma/planning/hardware/gpu.env`) on every host; a plain
`dgemma train` would otherwise keep JAX's default GPU preallocation (75 % of HBM), below the peak the planner and the
compiler expect of the 26B configs. So train applies the same allocator variables itself, keeping any the user set.
They are read by the GPU client only (TPU and CPU ignore them).

The check compares the planner's per-device peak (`dgemma.planning.plan_config.plan_for` for this config, device
count and process count) with the allocator's limit (`memory_stats()["bytes_limit"]`: device memory x the fraction).
Backends that report no limit (CPU) are skipped with a debug line. `dgemma train --force` overrides the refusal, as
`dgemma launch --force` does.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

from dgemma.planning.accelerators import GiB

if TYPE_CHECKING:
    from dgemma.config import RunConfig

__all__ = ["allocator_variables", "configure_allocator", "fit_refusal", "host_fit_refusal", "run_fit_refusal"]

log = logging.getLogger(__name__)
ALLOCATOR_PREFIX = "XLA_PYTHON_CLIENT_"


def allocator_variables() -> dict[str, str]:
    """The allocator variables of the packaged GPU env file (what `dgemma launch` exports on GPU hosts)."""
    from dgemma.planning.launcher import HARDWARE_DIR, read_env_file

    return {k: v for k, v in read_env_file(HARDWARE_DIR / "gpu.env").items() if k.startswith(ALLOCATOR_PREFIX)}


def configure_allocator(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the allocator variables the user has not set (before the JAX backend starts); returns those set."""
    environ = os.environ if environ is None else environ
    added = {k: v for k, v in allocator_variables().items() if k not in environ}
    environ.update(added)
    return added


def fit_refusal(planned_bytes: int, allowed_bytes: int, where: str) -> str | None:
    """The one-line refusal when the planned per-device peak exceeds what the allocator allows, else None."""
    if planned_bytes <= allowed_bytes:
        return None
    fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "JAX's default")
    return (f"refused: the planned peak {planned_bytes / GiB:.1f} GiB per device exceeds the {allowed_bytes / GiB:.1f} "
            f"GiB the allocator allows on {where} (XLA_PYTHON_CLIENT_MEM_FRACTION={fraction}); change the mesh / "
            f"batch / remat, raise the fraction, or pass --force")


def host_fit_refusal(needed_bytes: int, usable_bytes: int | None, node_devices: int) -> str | None:
    """The one-line refusal when what is kept on the host (pinned reference params, offloaded activations) for
    `node_devices` devices exceeds the usable node RAM, else None."""
    if usable_bytes is None or needed_bytes <= usable_bytes:
        return None
    return (f"refused: the host memory planned for {node_devices} devices, {needed_bytes / GiB:.1f} GiB, exceeds the "
            f"{usable_bytes / GiB:.1f} GiB usable of this node's RAM (sdrl.reference_memory=device or fewer devices "
            f"per node keep less on the host), or pass --force")


def _planner_accelerator(device: Any) -> str:
    """The planner's accelerator name for a device: what picks its MoE lowering (memory comes from the allocator)."""
    kind = str(getattr(device, "device_kind", "")).lower()
    if device.platform == "gpu":
        return "h200" if "h200" in kind else "h100"
    return "v6e" if "v6" in kind else "v5p"


def run_fit_refusal(cfg: RunConfig) -> str | None:
    """The planner's per-device peak for `cfg` on this run's devices vs the allocator's limit (module docstring)."""
    import jax

    from dgemma.planning.plan_config import plan_for, spec_from_config

    device = jax.local_devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    limit = (stats or {}).get("bytes_limit")
    if not limit:
        log.debug("memory fit check skipped: %s reports no allocator limit", device.platform)
        return None
    from dgemma.planning.accelerators import _host_gib

    spec = spec_from_config(cfg, devices=jax.device_count(), accelerator=_planner_accelerator(device),
                            processes=jax.process_count(), devices_per_node=jax.local_device_count(),
                            node_ram_gib=_host_gib())  # this process's devices and this machine's RAM
    plan = plan_for(spec)
    log.info("memory: planned peak %.1f GiB per device, allocator limit %.1f GiB", plan.total / GiB, limit / GiB)
    return (fit_refusal(plan.total, int(limit), f"{jax.device_count()} x {device.device_kind}")
            or host_fit_refusal(plan.host_bytes_per_node, plan.host_usable_bytes, plan.node_devices))

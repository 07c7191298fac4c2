"""Deviceless TPU ahead-of-time compilation: the TPU compiler's memory analysis of a step, on a machine with no TPU.

    devices = tpu_topology_devices("v5p:2x4x4")        # 32 abstract v5p chips (v5p-64); nothing is allocated
    report = compiled_memory(cfg, spec, devices)       # dgemma.planning.plan_config: the real train step

`jax.experimental.topologies.get_topology_desc` describes a TPU slice from libtpu alone (the way MaxText's
train_compile.py proves fit before a job is queued); jitted functions lowered with shardings over those devices are
compiled by the real TPU compiler, so `memory_analysis()` is what the chips would hold: native ragged_dot for the
MoE and the TPU fusion decisions (unlike XLA:CPU, whose dense ragged_dot fallback inflates the temporaries).

libtpu is optional (`pip install 'dgemma[tpu-aot]'`, or a `pip install --target DIR libtpu==<jax's pin>` put on
PYTHONPATH for this one command: importing it changes how every later JAX process in that environment initialises
its backends). Run with JAX_PLATFORMS=cpu so JAX does not try to attach to TPU chips; `dgemma plan --topology`
sets that before the backend starts.
"""

from __future__ import annotations

import re

__all__ = ["TOPOLOGY_PATTERN", "parse_topology", "tpu_topology_devices"]

TOPOLOGY_PATTERN = re.compile(r"^(v4|v5p|v5e|v6e):(\d+)x(\d+)(?:x(\d+))?$")
_ACCELERATOR = {"v4": None, "v5p": "v5p", "v5e": None, "v6e": "v6e"}  # planner accelerator names with an HBM size


def parse_topology(name: str) -> tuple[str, int, str | None]:
    """(generation, chips, planner accelerator name or None) of a topology such as "v5p:2x4x4" (v5p-64)."""
    m = TOPOLOGY_PATTERN.match(str(name))
    if not m:
        raise ValueError(f"--topology {name!r}: expected GEN:AxB[xC] with GEN one of v4, v5p, v5e, v6e "
                         f"(e.g. v5p:2x4x4 for v5p-64 = 32 chips)")
    dims = [int(d) for d in m.groups()[1:] if d is not None]
    if any(d < 1 for d in dims):
        raise ValueError(f"--topology {name!r}: every dimension must be >= 1")
    chips = 1
    for d in dims:
        chips *= d
    return m.group(1), chips, _ACCELERATOR[m.group(1)]


def tpu_topology_devices(name: str, num_slices: int = 1) -> list:
    """The abstract devices of TPU topology `name` (see `parse_topology`); needs libtpu importable."""
    gen, _, _ = parse_topology(name)
    try:
        import libtpu  # noqa: F401 - only to give a clear error; JAX loads it itself
    except ImportError as e:
        raise ValueError(f"--topology {name}: deviceless TPU compilation needs libtpu (pip install "
                         f"'dgemma[tpu-aot]', or libtpu matching jax on PYTHONPATH): {e}") from None
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=name, chip_config_name="default",
                                            chips_per_host_bounds=(2, 2, 1), num_slices=num_slices)
    except Exception as e:  # noqa: BLE001 - libtpu's errors are long; keep the first line
        raise ValueError(f"--topology {name}: libtpu could not describe it: {str(e).splitlines()[0]}") from None
    return list(topo.devices)

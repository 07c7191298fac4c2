"""Device mesh from named axis sizes, and the one context manager that activates mesh + rules.

Axes are (data, fsdp, expert, tensor). Sizes come as a mapping; at most one axis may be -1 (filled with the remaining
devices). Multi-slice / multi-node hybrid meshes are built in `make_hybrid_mesh` (ICI x DCN sizes).
"""

from __future__ import annotations

import contextlib
import math
from typing import Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "fsdp", "expert", "tensor")


def resolve_axis_sizes(sizes: Mapping[str, int], num_devices: int, *, level: str = "ici") -> dict[str, int]:
    unknown = [a for a in sizes if a not in AXES]
    if unknown:
        raise ValueError(f"mesh.{level}: unknown axis {unknown}; valid axes are {list(AXES)}")
    full = {a: int(sizes.get(a, 1)) for a in AXES}
    auto = [a for a, s in full.items() if s == -1]
    if len(auto) > 1:
        raise ValueError(f"mesh.{level}: at most one axis may be -1, got {auto}")
    bad = [a for a, s in full.items() if s == 0 or s < -1]
    if bad:
        raise ValueError(f"mesh.{level}: axis sizes must be >= 1 or -1, got { {a: full[a] for a in bad} }")
    known = math.prod(s for s in full.values() if s != -1)
    if auto:
        if num_devices % known:
            raise ValueError(f"mesh.{level}: {num_devices} devices do not factor into fixed axes of product {known}")
        full[auto[0]] = num_devices // known
    if math.prod(full.values()) != num_devices:
        raise ValueError(f"mesh.{level}: axis sizes {full} (product {math.prod(full.values())}) do not match "
                         f"{num_devices} devices")
    return full


def make_mesh(sizes: Mapping[str, int] | None = None, devices=None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_axis_sizes(sizes or {"fsdp": -1}, len(devices))
    shape = tuple(sizes[a] for a in AXES)
    return Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=(AxisType.Auto,) * len(AXES))


@contextlib.contextmanager
def use_mesh(mesh: Mesh):
    """Activate `mesh` for jit/sharding constraints (jax.set_mesh), usable as a context manager."""
    with jax.set_mesh(mesh):
        yield mesh

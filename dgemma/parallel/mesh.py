"""Device mesh from named axis sizes (ICI x DCN), and the one context manager that activates it.

Axes are (data, fsdp, expert, tensor), outermost first. Sizes come per level:

    ici   within a slice / node (fast interconnect: TPU ICI, NVLink)
    dcn   across slices / nodes (data-center network)

At most one axis per level may be -1 (filled with what is left). Mesh axis `a` has size `ici[a] * dcn[a]`; the DCN
factor is the outer (major) one, so consecutive indices along an axis stay inside one slice.

    make_mesh({"fsdp": -1})                        single slice, plain reshape of the devices (kept for tests)
    make_mesh_from_config(cfg.mesh)                ICI x DCN from the config section; hybrid when dcn != all 1
    hybrid_device_array(ici, dcn, devices)         the device ndarray only (works with fake device objects)
    abstract_mesh({"fsdp": 64})                    `jax.sharding.AbstractMesh`: shapes/specs without devices

Granules (the units DCN connects) are found in this order: distinct `slice_index` values (TPU multi-slice), then
processes (one process per node), then equal contiguous blocks of processes (one process per GPU: SLURM numbers
tasks node by node), and on CPU with a single process, equal contiguous blocks of devices (a simulation, for tests).
"""

from __future__ import annotations

import collections
import contextlib
import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "fsdp", "expert", "tensor")

__all__ = [
    "AXES", "MeshShape", "abstract_mesh", "group_granules", "hybrid_device_array", "make_mesh",
    "make_mesh_from_config", "resolve_axis_sizes", "resolve_mesh_shape", "use_mesh",
]


def resolve_axis_sizes(sizes: Mapping[str, int], num_devices: int, *, level: str = "ici") -> dict[str, int]:
    """Fill the (at most one) -1 axis so the sizes multiply to `num_devices`; clear errors otherwise."""
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


class MeshShape(collections.namedtuple("MeshShape", ["ici", "dcn"])):
    """Resolved per-level sizes: `ici`, `dcn` (dicts over AXES). `sizes` = their product per axis."""

    @property
    def sizes(self) -> dict[str, int]:
        return {a: self.ici[a] * self.dcn[a] for a in AXES}

    @property
    def num_devices(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def num_granules(self) -> int:
        return math.prod(self.dcn.values())


def resolve_mesh_shape(ici: Mapping[str, int], dcn: Mapping[str, int] | None, num_devices: int,
                       num_granules: int | None = None) -> MeshShape:
    """Resolve ICI and DCN sizes for `num_devices` devices in `num_granules` slices / nodes.

    With `dcn` all 1 the mesh is one flat granule (ICI sizes cover every device, e.g. FSDP across GPU nodes).
    Otherwise `dcn` (its -1 filled from `num_granules`) must multiply to the granule count and `ici` to the devices
    of one granule.
    """
    dcn = dict(dcn or {})
    if all(int(v) == 1 for v in dcn.values()):
        return MeshShape(resolve_axis_sizes(ici, num_devices, level="ici"), {a: 1 for a in AXES})
    has_auto = any(int(v) == -1 for v in dcn.values())
    if num_granules is None:
        if has_auto:
            raise ValueError(f"mesh.dcn={dcn} has a -1 axis but the number of slices / nodes is unknown; pass it "
                             "(e.g. `--slices`) or give the DCN sizes explicitly")
        num_granules = math.prod(int(dcn.get(a, 1)) for a in AXES)
    dcn_sizes = resolve_axis_sizes(dcn, num_granules, level="dcn")
    if num_devices % num_granules:
        raise ValueError(f"mesh: {num_devices} devices cannot be split evenly into {num_granules} slices / nodes "
                         f"(mesh.dcn={dcn_sizes})")
    ici_sizes = resolve_axis_sizes(ici, num_devices // num_granules, level="ici")
    return MeshShape(ici_sizes, dcn_sizes)


def make_mesh(sizes: Mapping[str, int] | None = None, devices=None) -> Mesh:
    """Single-granule mesh: the devices reshaped in order into AXES with `sizes` (one -1 allowed)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_axis_sizes(sizes or {"fsdp": -1}, len(devices))
    shape = tuple(sizes[a] for a in AXES)
    return Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def group_granules(devices: Sequence[Any], num_granules: int) -> list[list[Any]]:
    """Split `devices` into `num_granules` equal groups (slices / nodes), ordered by granule (module docstring)."""
    devices = list(devices)
    if num_granules < 1 or len(devices) % num_granules:
        raise ValueError(f"{len(devices)} devices cannot form {num_granules} equal slices / nodes")

    def by(key) -> list[list[Any]]:
        groups: dict[Any, list[Any]] = collections.defaultdict(list)
        for d in devices:
            groups[key(d)].append(d)
        return [groups[k] for k in sorted(groups)]

    slices = {getattr(d, "slice_index", None) for d in devices}
    if None not in slices and len(slices) == num_granules:
        out = by(lambda d: d.slice_index)
    else:
        procs = sorted({d.process_index for d in devices})
        rank = {p: i for i, p in enumerate(procs)}
        if len(procs) == num_granules:
            out = by(lambda d: d.process_index)
        elif len(procs) > num_granules and len(procs) % num_granules == 0:
            per = len(procs) // num_granules  # one process per GPU: contiguous process ranks share a node
            out = by(lambda d: rank[d.process_index] // per)
        elif len(procs) == 1 and devices[0].platform == "cpu":
            per = len(devices) // num_granules  # simulated DCN on one CPU process (tests)
            ordered = sorted(devices, key=lambda d: d.id)
            out = [ordered[i * per:(i + 1) * per] for i in range(num_granules)]
        else:
            raise ValueError(f"cannot group {len(devices)} devices into {num_granules} slices / nodes: they have "
                             f"slice_index values {sorted(slices, key=str)} and {len(procs)} processes; mesh.dcn must "
                             "multiply to the number of slices (TPU) or nodes / processes (GPU)")
    sizes = {len(g) for g in out}
    if len(sizes) != 1:
        raise ValueError(f"slices / nodes have unequal device counts {sorted(len(g) for g in out)}")
    return out


def _granule_array(shape: tuple[int, ...], devices: list[Any]) -> np.ndarray:
    platform = devices[0].platform
    if platform in ("tpu", "gpu", "cuda", "rocm"):
        from jax.experimental import mesh_utils

        try:
            return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        except (ValueError, NotImplementedError, AssertionError):  # no topology-aware layout: fall back to order
            pass
    return np.asarray(sorted(devices, key=lambda d: d.id), dtype=object).reshape(shape)


def hybrid_device_array(ici: Mapping[str, int], dcn: Mapping[str, int], devices: Sequence[Any]) -> np.ndarray:
    """ndarray of devices with shape ici*dcn per axis (DCN major), like `mesh_utils.create_hybrid_device_mesh`,
    but grouping granules as in `group_granules` (so it also works with one process per GPU and fake devices)."""
    ici_shape = tuple(int(ici[a]) for a in AXES)
    dcn_shape = tuple(int(dcn[a]) for a in AXES)
    granules = group_granules(devices, math.prod(dcn_shape))
    per = [_granule_array(ici_shape, g) for g in granules]
    index = np.arange(len(granules)).reshape(dcn_shape)
    blocks = np.empty(dcn_shape, dtype=object)
    for pos in np.ndindex(*dcn_shape):
        blocks[pos] = per[int(index[pos])]
    return np.block(blocks.tolist())


def fixed_device_count(mesh_section: Any) -> int | None:
    """How many devices a `MeshSection` names (the product of its `ici` and `dcn` sizes), or None where a size is -1
    (it takes whatever devices there are)."""
    sizes = [int(v) for v in (*mesh_section.ici.values(), *mesh_section.dcn.values())]
    return None if -1 in sizes else math.prod(sizes)


def make_mesh_from_config(mesh_section: Any, devices: Sequence[Any] | None = None, *,
                          num_granules: int | None = None) -> Mesh:
    """The mesh of a `MeshSection` (`ici`, `dcn`; axes must be AXES) on `devices` (default: all global devices).

    `num_granules` (slices / nodes) is only needed when `dcn` has a -1 and cannot be inferred: it defaults to the
    number of distinct `slice_index` values, else the number of processes.
    """
    axes = tuple(getattr(mesh_section, "axes", AXES))
    if axes != AXES:
        raise ValueError(f"mesh.axes={list(axes)}: dgemma meshes use exactly {list(AXES)} (sizes of 1 are free)")
    devices = list(jax.devices() if devices is None else devices)
    ici, dcn = dict(mesh_section.ici), dict(mesh_section.dcn)
    if num_granules is None and any(int(v) == -1 for v in dcn.values()):
        slices = {getattr(d, "slice_index", None) for d in devices}
        procs = len({d.process_index for d in devices})
        num_granules = len(slices) if None not in slices and len(slices) > 1 else procs
    shape = resolve_mesh_shape(ici, dcn, len(devices), num_granules)
    if shape.num_granules == 1:
        array = _granule_array(tuple(shape.ici[a] for a in AXES), devices)
    else:
        array = hybrid_device_array(shape.ici, shape.dcn, devices)
    return Mesh(array, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def abstract_mesh(sizes: Mapping[str, int]) -> jax.sharding.AbstractMesh:
    """Device-free mesh with the given axis sizes (missing axes 1): for shapes, specs and planning only."""
    full = {a: int(sizes.get(a, 1)) for a in AXES}
    unknown = [a for a in sizes if a not in AXES]
    if unknown or any(s < 1 for s in full.values()):
        raise ValueError(f"abstract mesh sizes must be >= 1 over axes {list(AXES)}, got {dict(sizes)}")
    return jax.sharding.AbstractMesh(tuple(full[a] for a in AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES))


@contextlib.contextmanager
def use_mesh(mesh: Mesh):
    """Activate `mesh` for jit/sharding constraints (jax.set_mesh), usable as a context manager."""
    with jax.set_mesh(mesh):
        yield mesh

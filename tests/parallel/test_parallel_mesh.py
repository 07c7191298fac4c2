"""Meshes from config: ICI x DCN resolution, hybrid (multi-slice / multi-node) device grouping, clear errors.

Device grouping is tested with fake device objects (slice_index / process_index / platform), real meshes on the 8
simulated CPU devices of conftest, and a 16-device subprocess runs the tiny model on a simulated 2-slice mesh.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import jax
import numpy as np
import pytest

from support import fast_xla

from dgemma.config import load_config
from dgemma.parallel.mesh import (
    AXES,
    abstract_mesh,
    group_granules,
    hybrid_device_array,
    make_mesh,
    make_mesh_from_config,
    resolve_axis_sizes,
    resolve_mesh_shape,
)

REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int
    slice_index: int | None = None
    platform: str = "cpu"
    device_kind: str = "fake"


def _devices(n_proc: int, per_proc: int, slices: int | None = None, platform="cpu"):
    out = []
    for p in range(n_proc):
        for j in range(per_proc):
            i = p * per_proc + j
            s = None if slices is None else p * slices // n_proc
            out.append(FakeDevice(i, p, s, platform))
    return out


def _granule_of(array: np.ndarray, key) -> np.ndarray:
    return np.vectorize(key, otypes=[object])(array)


# MARK: sizes
def test_resolve_mesh_shape_flat_and_hybrid():
    flat = resolve_mesh_shape({"fsdp": -1, "tensor": 2}, {"data": 1}, 16)
    assert flat.sizes == {"data": 1, "fsdp": 8, "expert": 1, "tensor": 2} and flat.num_granules == 1
    hyb = resolve_mesh_shape({"fsdp": -1}, {"data": -1}, 64, num_granules=4)
    assert hyb.ici["fsdp"] == 16 and hyb.dcn["data"] == 4 and hyb.sizes == {"data": 4, "fsdp": 16, "expert": 1,
                                                                             "tensor": 1}
    assert hyb.num_devices == 64
    fixed = resolve_mesh_shape({"fsdp": 4}, {"data": 2}, 8)  # DCN fixed: granules inferred from it
    assert fixed.sizes["data"] == 2 and fixed.sizes["fsdp"] == 4


@pytest.mark.parametrize("ici,dcn,n,granules,match", [
    ({"fsdp": 3}, {}, 8, None, "do not match 8 devices"),
    ({"data": 3, "fsdp": -1}, {}, 8, None, "do not factor"),
    ({"fsdp": -1}, {"data": -1}, 8, None, "number of slices / nodes is unknown"),
    ({"fsdp": -1}, {"data": 3}, 8, None, "cannot be split evenly into 3"),
    ({"fsdp": -1}, {"data": 2, "fsdp": -1}, 8, 3, "do not factor"),
    ({"fsdp": 2}, {"data": 2}, 16, None, "do not match 8 devices"),
])
def test_resolve_mesh_shape_errors(ici, dcn, n, granules, match):
    with pytest.raises(ValueError, match=match):
        resolve_mesh_shape(ici, dcn, n, granules)


def test_resolve_axis_sizes_is_backwards_compatible():
    assert resolve_axis_sizes({"data": 2, "fsdp": -1}, 8) == {"data": 2, "fsdp": 4, "expert": 1, "tensor": 1}
    with pytest.raises(ValueError, match="unknown axis"):
        resolve_axis_sizes({"fsdpp": 8}, 8)


# MARK: granules (fake devices)
def test_hybrid_groups_by_slice_index_with_dcn_major():
    devs = _devices(8, 4, slices=2, platform="cpu")  # 2 slices x 4 hosts x 4 chips
    arr = hybrid_device_array({"data": 1, "fsdp": 16, "expert": 1, "tensor": 1},
                              {"data": 2, "fsdp": 1, "expert": 1, "tensor": 1}, devs)
    assert arr.shape == (2, 16, 1, 1)
    slices = _granule_of(arr, lambda d: d.slice_index)
    assert (slices[0] == 0).all() and (slices[1] == 1).all()  # the DCN axis crosses slices, ICI stays inside


def test_hybrid_dcn_on_fsdp_keeps_each_slice_contiguous():
    devs = _devices(2, 4)  # 2 processes (nodes), 4 devices each, no slice_index
    arr = hybrid_device_array({"data": 1, "fsdp": 4, "expert": 1, "tensor": 1},
                              {"data": 1, "fsdp": 2, "expert": 1, "tensor": 1}, devs)
    procs = _granule_of(arr, lambda d: d.process_index)[0, :, 0, 0]
    assert list(procs) == [0, 0, 0, 0, 1, 1, 1, 1]


def test_one_process_per_gpu_groups_consecutive_ranks_into_nodes():
    devs = _devices(16, 1, platform="gpu")  # 2 nodes x 8 GPUs, one process per GPU (SLURM block order)
    groups = group_granules(devs, 2)
    assert [sorted(d.process_index for d in g) for g in groups] == [list(range(8)), list(range(8, 16))]
    arr = hybrid_device_array(dict(zip(AXES, (1, 8, 1, 1))), dict(zip(AXES, (2, 1, 1, 1))), devs)
    assert {d.process_index for d in arr[1].ravel()} == set(range(8, 16))


def test_single_cpu_process_simulates_dcn_by_device_blocks():
    devs = _devices(1, 8)
    groups = group_granules(devs, 2)
    assert [[d.id for d in g] for g in groups] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_group_granules_errors():
    with pytest.raises(ValueError, match="cannot group 8 devices into 2"):
        group_granules(_devices(1, 8, platform="gpu"), 2)  # one GPU process: no simulation off CPU
    with pytest.raises(ValueError, match="cannot form 3 equal"):
        group_granules(_devices(2, 4), 3)
    with pytest.raises(ValueError, match="cannot group"):
        group_granules(_devices(3, 2), 2)  # 3 processes cannot make 2 nodes


# MARK: real meshes on the 8 conftest devices
def test_make_mesh_from_config_flat_and_simulated_dcn():
    cfg = load_config(None, {"mesh.ici": {"fsdp": -1, "tensor": 2}}, env={})
    mesh = make_mesh_from_config(cfg.mesh)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "expert": 1, "tensor": 2}
    assert mesh.devices.ravel().tolist() == sorted(jax.devices(), key=lambda d: d.id)
    cfg = load_config(None, {"mesh.ici": {"fsdp": -1}, "mesh.dcn": {"data": 2}}, env={})
    mesh = make_mesh_from_config(cfg.mesh)
    assert dict(mesh.shape)["data"] == 2 and dict(mesh.shape)["fsdp"] == 4
    assert [d.id for d in mesh.devices[1].ravel()] == [4, 5, 6, 7]
    cfg = load_config(None, {"mesh.ici": {"fsdp": -1}, "mesh.dcn": {"data": -1}}, env={})
    assert dict(make_mesh_from_config(cfg.mesh, num_granules=4).shape)["data"] == 4


def test_make_mesh_from_config_errors_name_the_problem():
    cfg = load_config(None, {"mesh.ici": {"fsdp": 3}}, env={})
    with pytest.raises(ValueError, match=r"mesh.ici: axis sizes .* do not match 8 devices"):
        make_mesh_from_config(cfg.mesh)
    section = types.SimpleNamespace(axes=("data", "fsdp"), ici={"fsdp": -1}, dcn={})
    with pytest.raises(ValueError, match="dgemma meshes use exactly"):
        make_mesh_from_config(section)


def test_abstract_mesh_and_legacy_make_mesh():
    m = abstract_mesh({"fsdp": 64})
    assert m.axis_names == AXES and dict(m.shape)["fsdp"] == 64
    with pytest.raises(ValueError, match=">= 1"):
        abstract_mesh({"fsdp": 0})
    assert dict(make_mesh({"data": 2, "fsdp": -1}).shape) == {"data": 2, "fsdp": 4, "expert": 1, "tensor": 1}


# MARK: 16 simulated devices, 2 simulated slices (subprocess)
_SCRIPT = textwrap.dedent("""
    import jax, numpy as np
    from flax import nnx
    from dgemma.config import load_config
    from dgemma.model.config import tiny
    from dgemma.model.transformer import Transformer
    from dgemma.parallel.mesh import make_mesh_from_config
    from dgemma.parallel.rules import get_rules, state_shardings
    from jax.sharding import NamedSharding, PartitionSpec as P
    assert jax.device_count() == 16, jax.device_count()
    cfg = load_config(None, {"mesh.ici": {"fsdp": 4, "tensor": 2}, "mesh.dcn": {"data": 2}}, env={})
    mesh = make_mesh_from_config(cfg.mesh)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "expert": 1, "tensor": 2}, mesh.shape
    assert sorted(d.id for d in mesh.devices[0].ravel()) == list(range(8))
    model = Transformer(tiny(num_experts=8), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (8, 12), 0, 128)
    graphdef, state = nnx.split(model)
    f = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    want = f(state, tokens)
    sharded = jax.device_put(state, state_shardings(state, mesh, get_rules("experts_on_fsdp")))
    with jax.set_mesh(mesh):
        got = f(sharded, jax.device_put(tokens, NamedSharding(mesh, P(("data", "fsdp")))))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
    print("OK", len({s.device for s in sharded["layers"][0]["moe"]["experts"]["gate"][...].addressable_shards}))
""")


def test_16_devices_two_simulated_slices_subprocess():
    env = {**os.environ, "XLA_FLAGS": fast_xla.xla_flags("--xla_force_host_platform_device_count=16"),
           "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, cwd=REPO, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().startswith("OK 16")

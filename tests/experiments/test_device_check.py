"""The one-call device check (`experiments/device_check.py`) at its CPU size, its version refusals, and the
wheelhouse script's argument refusals (no download: they come before any)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def _check():
    return load_script("experiments/device_check.py", "device_check")


def _manifest(tmp_path: Path, **changes) -> Path:
    """A wheelhouse (empty: pip finds everything installed) whose manifest matches this environment, but `changes`."""
    import importlib.metadata as md

    house = tmp_path / "wheels"
    house.mkdir()
    manifest = {"python": f"{sys.version_info.major}.{sys.version_info.minor}", "tokamax": md.version("tokamax"),
                "qwix": md.version("qwix"), "requires": ["jax>=0.9.2", "jaxlib>=0.9.2", "flax>=0.12.0"], **changes}
    (house / "manifest.json").write_text(json.dumps(manifest))
    return house


@pytest.mark.slow  # 26 s: every phase of the device check on CPU; its refusals and reference stay default
def test_small_device_check_runs_every_phase_and_writes_four_files(tmp_path, capsys):
    out = tmp_path / "out"
    # the phases' own timeouts are sized for the GPU; a busy CI machine gets more
    rc = _check().main(["--small", "--wheelhouse", str(_manifest(tmp_path)), "--no-install", "--out", str(out),
                        "--deadline-s", "900", "--step-timeout-s", "600", "--canvas-timeout-s", "300"])
    results = json.loads((out / "results.json").read_text())
    assert rc == 0, results
    assert sorted(p.name for p in out.iterdir()) == ["log.txt", "results.json", "summary.md", "versions.json"]
    versions = json.loads((out / "versions.json").read_text())
    for dist in ("python", "jax", "jaxlib", "flax", "transformers", "tokamax"):
        assert versions[dist], dist
    assert versions["problems"] == [] and versions["cuda_plugin"] is None  # CPU smoke: no plugin asked for
    step, shipped, baseline = results["phases"]
    assert [c["name"] for c in step["data"]["checks"]] == ["kernel:tokamax/xla", "step"]
    assert all(c["ok"] for c in step["data"]["checks"]) and step["data"]["checks"][1]["params_finite"]
    assert shipped["data"]["moe_kernel"] == "tokamax" and baseline["data"]["moe_kernel"] == "xla"
    summary = (out / "summary.md").read_text()
    assert summary.startswith("versions: python") and "step: ok" in summary and "kernel:tokamax/xla" in summary
    assert "versions: python" in capsys.readouterr().out


def test_a_wheelhouse_for_another_python_is_refused_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "out"
    assert _check().main(["--small", "--wheelhouse", str(_manifest(tmp_path, python="3.99")), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "built for python 3.99" in err and "gpu_wheels.sh" in err
    assert not out.exists()


def test_a_version_mismatch_is_one_line_and_only_the_versions_are_written(tmp_path, capsys):
    out = tmp_path / "out"
    house = _manifest(tmp_path, tokamax="0.0.1", requires=["jax>=99"])
    assert _check().main(["--small", "--wheelhouse", str(house), "--no-install", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("device_check: version mismatch")
    assert "the wheelhouse has 0.0.1" in err and "does not satisfy jax>=99" in err
    assert [p.name for p in out.iterdir()] == ["versions.json"]


def test_on_a_gpu_the_cuda_plugin_must_match_jaxlib():
    _, problems = _check().version_report(None, want_gpu=True)
    assert any("no JAX CUDA plugin" in p for p in problems)  # this environment has none


@pytest.mark.parametrize("argv,match", [(["--out", "{used}"], "not an empty folder"),
                                        (["--deadline-s", "0", "--out", "{new}"], "must be positive"),
                                        (["--wheelhouse", "{empty}", "--out", "{new}"], "no manifest.json")])
def test_bad_arguments_name_the_setting(argv, match, tmp_path, capsys):
    used, empty = tmp_path / "used", tmp_path / "empty"
    used.mkdir()
    empty.mkdir()
    (used / "results.json").write_text("earlier")
    argv = [a.format(used=used, empty=empty, new=tmp_path / "new") for a in argv]
    with pytest.raises(SystemExit):
        _check().main(argv)
    assert match in capsys.readouterr().err
    assert (used / "results.json").read_text() == "earlier" and not (tmp_path / "new").exists()


@pytest.mark.parametrize("args,match", [(["3.x"], "expected the device's python as 3.N"),
                                        (["3.12", "{dest}"], "is not a wheelhouse this script made")])
def test_gpu_wheels_refuses_bad_arguments_before_downloading(args, match, tmp_path):
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    p = subprocess.run(["bash", str(ROOT / "experiments/gpu_wheels.sh"), *[a.format(dest=dest) for a in args]],
                       capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and match in p.stderr, p.stderr
    assert sorted(x.name for x in dest.iterdir()) == ["keep.txt"] and not list(tmp_path.glob("mine.tmp.*"))


def test_transformers_below_the_minimum_is_a_note_not_a_refusal(monkeypatch):
    """No device phase imports transformers (a lent H200 had 5.17 < dgemma's minimum): recorded, never refused;
    the packages the phases use stay refusals."""
    check = _check()
    real = check._installed
    monkeypatch.setattr(check, "_installed", lambda d: "5.17.0" if d == "transformers" else
                        ("0.0.1" if d == "flax" else real(d)))
    found, problems = check.version_report(None, want_gpu=False)
    assert any(n.startswith("transformers 5.17.0 does not satisfy") for n in found["notes"])
    assert not any("transformers" in p for p in problems) and any(p.startswith("flax 0.0.1") for p in problems)


def test_the_dense_reference_is_ragged_dot_with_empty_and_uneven_groups():
    """The device check's independent reference for the grouped matmul (a masked full matmul per group) computes
    ragged_dot's meaning: forward and both gradients, groups of 0, 1 and many rows, rows past the last group."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    step = load_script("experiments/device_train_step.py", "device_train_step")
    sizes = jnp.array([0, 5, 1, 0, 9], jnp.int32)  # 15 of 17 rows routed
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    lhs, rhs = jax.random.normal(k1, (17, 6)), jax.random.normal(k2, (5, 6, 3))
    cot = jax.random.normal(k3, (17, 3))

    def grads(f):
        return jax.value_and_grad(lambda a, b: jnp.sum(f(a, b, sizes) * cot), (0, 1))(lhs, rhs)

    (v_ref, g_ref), (v, g) = grads(jax.lax.ragged_dot), grads(step.dense_grouped_matmul)
    np.testing.assert_allclose(v, v_ref, rtol=1e-5)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(g[1][0]).max()) == 0.0 and float(jnp.abs(g[1][4]).max()) > 0  # an empty group gets none

"""The one-call GPU sweep (`experiments/gpu_sweep.py`) at its CPU size: every variant runs in its own process, a kernel the
platform refuses is recorded with its one-line reason (never dropped), and the summary table is written."""

from __future__ import annotations

import json

import pytest
from support.scripts import load_script


def _sweep():
    return load_script("experiments/gpu_sweep.py", "gpu_sweep")


def test_a_refused_kernel_is_recorded_with_its_reason_and_the_sweep_fails_when_nothing_ran(tmp_path, capsys):
    mod = _sweep()
    assert mod.main(["--small", "--only", "chunked+tokamax-triton", "--reps", "1", "--layers", "1",
                     "--out", str(tmp_path)]) == 1
    (r,) = json.loads((tmp_path / "results.json").read_text())
    assert not r["ok"] and "rc 2" in r["error"] and "tokamax_backend='triton' is a GPU kernel" in r["error"], r
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("no variant ran") and "| chunked+tokamax-triton | | failed: rc 2" in summary
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.txt", "results.json", "summary.md"]
    assert "chunked+tokamax-triton" in capsys.readouterr().out


def test_a_variant_past_its_timeout_is_recorded_and_keeps_its_log(tmp_path):
    mod = _sweep()
    assert mod.main(["--small", "--only", "chunked+xla", "--variant-timeout-s", "0.5", "--out", str(tmp_path)]) == 1
    (r,) = json.loads((tmp_path / "results.json").read_text())
    assert not r["ok"] and r["error"].startswith("timed out after"), r
    assert "[timed out after" in (tmp_path / "log.txt").read_text()


def test_table_and_weight_read_floor():
    mod = _sweep()
    ok = {"variant": "v", "ok": True, "layers": 6, "canvas_ms": 3.0, "canvas_ms_30_layers": 15.0, "ar_step_ms": 1.0,
          "ar_step_ms_30_layers": 5.0, "published_ms": 13.56, "compile_s": 12.0,
          "weight_read_floor_ms_30_layers": mod.weight_read_floor_ms("NVIDIA H200", 48 * 10**9)}
    assert ok["weight_read_floor_ms_30_layers"] == pytest.approx(10.0)  # 48 GB at 4.8 TB/s
    assert mod.weight_read_floor_ms("TPU v5p", 1) is None
    rows = mod.table([ok, {"variant": "w", "ok": False, "error": "timed out after 150 s"}]).splitlines()
    assert rows[2] == "| v | 6 | 3.00 (15.00) | 1.00 (5.00) | 1.11 x | 10.00 | 12 |"
    assert rows[3].startswith("| w | | failed: timed out after 150 s")


@pytest.mark.parametrize("argv,match", [(["--only", "nope"], "not a variant"), (["--layers", "0"], "positive"),
                                        (["--out", "{used}"], "not an empty folder")])
def test_bad_arguments_name_the_setting(argv, match, capsys, tmp_path):
    (tmp_path / "results.json").write_text("earlier")
    with pytest.raises(SystemExit):
        _sweep().main([a.replace("{used}", str(tmp_path)) for a in argv])
    assert match in capsys.readouterr().err
    assert (tmp_path / "results.json").read_text() == "earlier"


@pytest.mark.slow
def test_small_sweep_times_the_xla_variant(tmp_path):
    mod = _sweep()
    assert mod.main(["--small", "--only", "chunked+xla", "chunked+tokamax-mosaic", "--reps", "2", "--layers", "2",
                     "--out", str(tmp_path)]) == 0
    ok, refused = json.loads((tmp_path / "results.json").read_text())
    assert ok["ok"] and ok["layers"] == 2 and ok["canvas_ms"] > 0 and ok["ar_step_ms"] > 0 and ok["canvas"] == 8
    assert not refused["ok"] and "mosaic" in refused["error"]
    assert len(list(tmp_path.iterdir())) == 3 and "| chunked+xla | 2 |" in (tmp_path / "summary.md").read_text()

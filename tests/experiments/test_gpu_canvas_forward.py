"""Smoke run of the GPU canvas-forward timing script at its CPU size (the GPU run itself is never in CI)."""

from __future__ import annotations

import json

import pytest
from support.scripts import load_script


def _script():
    return load_script("experiments/gpu_canvas_forward.py", "gpu_canvas_forward")


def test_small_run_prints_canvas_and_ar_step_times(tmp_path, capsys):
    mod = _script()
    out_json = tmp_path / "r.json"
    assert mod.main(["--small", "--layers", "1", "--reps", "2", "--context", "16", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "ms per canvas forward" in out and "ms per AR decode step" in out, out
    r = json.loads(out_json.read_text())
    assert r["layers"] == 1 and r["canvas_ms"] > 0 and r["ar_step_ms"] > 0 and r["attention"] == "chunked"


def test_layer_pattern_and_fit():
    from dgemma.model.config import FULL, SLIDING, gemma4_26b_a4b

    mod = _script()
    cfg = mod.with_layers(gemma4_26b_a4b(), 8)
    assert cfg.layer_types == (SLIDING,) * 5 + (FULL, SLIDING, FULL)  # the 26B period, the last layer full
    big = gemma4_26b_a4b().with_execution(dtype="bfloat16", param_dtype="bfloat16")
    assert mod._weight_bytes(big) == pytest.approx(2 * 25_250_986_782, rel=2e-3)  # the released parameter count
    assert mod.layers_that_fit(big, 80 * 2**30, rows=1, capacity=1300) == 30  # H100: ~50 GB of bf16 weights
    n = mod.layers_that_fit(big, 40 * 2**30, rows=1, capacity=1300)
    assert n % 6 == 0 and 6 <= n < 30 and mod._weight_bytes(mod.with_layers(big, n)) < 0.8 * 40 * 2**30

"""The README's main job, reduced: AR pre-training -> stage-1 conversion -> evaluation report (CI-sized)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_quick_pipeline_end_to_end(tmp_path):
    out = tmp_path / "tp"
    proc = subprocess.run([sys.executable, str(REPO / "experiments/tiny_pipeline/run.py"), "--quick", "--out",
                           str(out)], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    for stage in ("stage0", "stage1"):
        em = results[stage]["ar_exact_match"]
        assert {"copy", "sort", "add", "mul", "all"} <= set(em)
        assert all(0.0 <= v["exact_match"] <= 1.0 and v["n"] > 0 for v in em.values())
    d0, d1 = results["stage0"]["denoise"], results["stage1"]["denoise"]
    # even 40 stage-1 steps must beat the AR init at one-step denoising, at every noise level
    assert all(d1[t]["nll"] < d0[t]["nll"] for t in d1)
    for name in ("report.md", "curves.png", "noise_levels.png"):
        assert (out / name).stat().st_size > 0
    # each stage wrote its resolved config, metrics and a params checkpoint
    for stage in ("stage0_ar", "stage1"):
        assert (out / stage / "resolved_config.yaml").exists() and (out / stage / "metrics.jsonl").exists()
    assert "Tiny pipeline results" in proc.stdout

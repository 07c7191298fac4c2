"""The second main job, `python experiments/tiny_chat/run.py --quick`, as a user runs it (its own process): AR
fine-tuning on GSM8K conversations, stage 1, and the report: every section present, every reported number finite."""

import json
import math
import os
import subprocess
import sys

import pytest

from support.scripts import REPO, load_script

GSM8K = load_script("experiments/tiny_chat/build_data.py", "build_chat_data").GSM8K
SECTIONS = ("# Tiny chat results", "## Decodings (held-out conversations)", "## Wall-clock text tokens per second",
            "## Sample conversations", "## Training")
DECODINGS = ("stage 0, AR", "stage 1, AR", "stage 1, diffusion")


@pytest.mark.skipif(not GSM8K.exists(), reason=f"GSM8K not found at {GSM8K} (shared/ next to the repo)")
def test_tiny_chat_quick_writes_the_report(tmp_path):
    out = tmp_path / "tiny_chat"
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}  # one CPU device, as the job runs
    proc = subprocess.run([sys.executable, str(REPO / "experiments/tiny_chat/run.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=1800, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = (out / "report.md").read_text()
    for section in SECTIONS:
        assert section in report, section
    for name in ("curves.png", "commitment.png", "entropy_per_step.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    m = json.loads((out / "metrics.json").read_text())
    assert set(m["decodings"]) == set(DECODINGS) and m["eval_rows"] == 4
    assert "skipped" in m["data"]  # rows that do not fit the layout are counted, never silently dropped
    for name in DECODINGS:
        d = m["decodings"][name]
        assert d["metrics"]["n"] == 4 and 0 <= d["format_share"] <= 1 and 0 <= d["metrics"]["exact_match"] <= 1
        assert d["gen_ppl"]["tokens"] > 0 and math.isfinite(d["gen_ppl"]["gen_ppl"]) and d["gen_ppl"]["gen_ppl"] >= 1
        assert math.isfinite(d["unigram_entropy"]) and math.isfinite(d["metrics"]["tpf"])
    diff = m["decodings"]["stage 1, diffusion"]
    assert diff["keys"] == 2 and 0 <= diff["per_prompt_entropy"][0] <= math.log(2) + 1e-9
    assert 1 <= diff["metrics"]["steps_per_block"] <= 32
    # the reference answers end with GSM8K's `#### N` line: the format check must accept them all
    assert m["reference"]["format_share"] == 1.0 and math.isfinite(m["reference"]["gen_ppl"]["gen_ppl"])
    for mode in ("ar", "diffusion"):
        t = m["throughput"][mode]
        assert t["tokens"] > 0 and t["seconds"] > 0 and math.isfinite(t["tokens_per_second"])
    assert len(m["samples"]) == 2 and all(s["question"] and s["reference"] for s in m["samples"])
    assert "Tiny chat results" in proc.stdout

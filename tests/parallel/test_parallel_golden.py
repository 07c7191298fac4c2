"""Golden partition specs of Gemma 4 26B-A4B (abstract shapes on fake meshes), checked into tests/golden/ (the test
suite owns them; the library only computes tables).

A rule or model change that reshards or silently replicates a weight changes a table and fails here. After an
intended change, regenerate and review the diff:

    python -m dgemma.planning.golden --write --dir tests/golden/partition_specs
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dgemma.parallel.rules import PRESETS, TRAINING_PRESETS
from dgemma.planning import golden

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden" / "partition_specs"
REGENERATE = "python -m dgemma.planning.golden --write --dir tests/golden/partition_specs"


@pytest.mark.parametrize("name", sorted(golden.GOLDEN_CASES))
def test_partition_specs_match_golden(name):
    model, rules, sizes = golden.GOLDEN_CASES[name]
    path = golden.case_path(name, GOLDEN_DIR)
    assert path.exists(), f"{path} missing: run `{REGENERATE}`"
    expected = json.loads(path.read_text())
    actual = golden.partition_table(model, rules, sizes)
    diffs = golden.compare(expected, actual)
    assert not diffs, (f"partition specs changed; if intended, run `{REGENERATE}` and review the diff:\n  "
                       + "\n  ".join(diffs))
    assert len(expected["specs"]) == 691  # every parameter of the model (self-conditioning included)
    if rules in TRAINING_PRESETS:
        assert expected["summary"]["replicated_fraction"] <= 0.02, "a golden training table replicates weights"


def test_golden_catches_a_silently_replicated_weight(monkeypatch):
    model, rules, sizes = golden.GOLDEN_CASES["26b_experts_on_fsdp_fsdp8"]
    expected = json.loads(golden.case_path("26b_experts_on_fsdp_fsdp8", GOLDEN_DIR).read_text())
    monkeypatch.setitem(PRESETS, "experts_on_fsdp", {**PRESETS["experts_on_fsdp"], "exp": None})
    actual = golden.partition_table(model, rules, sizes)
    diffs = golden.compare(expected, actual, limit=1000)
    assert any(d.startswith("layers/0/moe/experts/gate:") for d in diffs)
    assert any(d.startswith("summary:") for d in diffs)
    # experts fall back to embed-on-fsdp here; the per-device bytes stay equal, only the layout changes
    assert actual["specs"]["layers/0/moe/experts/gate"][2] == [None, "fsdp", None]


def test_regeneration_command_round_trips(tmp_path, capsys):
    assert golden.main(["--write", "--dir", str(tmp_path), "26b_ep_fsdp4_expert8"]) == 0
    assert golden.main(["--check", "--dir", str(tmp_path), "26b_ep_fsdp4_expert8"]) == 0
    path = tmp_path / "26b_ep_fsdp4_expert8.json"
    path.write_text(path.read_text().replace('"expert", "fsdp", null', 'null, "fsdp", null', 1))
    assert golden.main(["--check", "--dir", str(tmp_path), "26b_ep_fsdp4_expert8"]) == 1
    out = capsys.readouterr().out
    assert "STALE" in out and "layers/0/moe/experts/gate" in out

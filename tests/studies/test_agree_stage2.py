"""experiments/sdrl_study/agree_stage2.py: the counters it reads from an SD·RL run's metrics.jsonl (how often L_PG had
a signal, how often y* was the teacher's), its sampler grid, and its one-line refusal of a missing arm."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "sdrl_study" / "agree_stage2.py"


def _module():
    spec = importlib.util.spec_from_file_location("agree_stage2", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run_dir(path: Path, rows: list[dict]) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_counters_pool_iterations_over_seeds(tmp_path):
    m = _module()
    a = _run_dir(tmp_path / "x_s0", [
        {"step": 1, "reward": 1.0, "zero_std_fraction": 1.0, "loss_pg": 0.0, "target_from_teacher": 1.0},
        {"step": 2, "reward": 0.75, "zero_std_fraction": 0.5, "loss_pg": -0.01, "target_from_teacher": 0.5}])
    b = _run_dir(tmp_path / "x_s1", [
        {"step": 1, "reward": 0.5, "zero_std_fraction": 0.25, "loss_pg": 0.02, "target_from_teacher": 0.0},
        {"step": 2, "reward": 1.0, "zero_std_fraction": 1.0, "loss_pg": 0.0, "target_from_teacher": 1.0},
        {"step": 2, "eval/diffusion/exact_match": 1.0}])  # an evaluation row, not an iteration
    c = m.counters([a, b])
    assert c["iterations"] == 4
    assert c["pg_signal"] == 0.5 and c["pg_nonzero"] == 0.5  # two of four iterations had a group with variance
    assert c["target_from_teacher"] == 0.625
    assert c["reward"] == 0.8125 and c["reward_min"] == 0.5
    assert c["zero_std_fraction"] == 0.6875


def test_grid_is_the_agree_frontier_without_the_default():
    from dgemma.eval.frontier import row_label

    labels = [row_label(s) for s in _module().settings()]
    assert len(labels) == len(set(labels)) == 11
    assert "eb g=0.1 t=0.8>0.4 K=48 S=1 c=0.005" not in labels  # the default row comes from the sweep itself
    assert "eb g=3 t=0.2>0.1 K=48 S=1 c=0.005" in labels and "fixed t=0.8>0.4 K=8 S=1 c=0.005" in labels


def test_missing_arm_is_refused_in_one_line_before_anything_is_written(tmp_path):
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, str(SCRIPT), "--arm", f"x={tmp_path / 'nope'}", "--out", str(out)],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [f"agree_stage2: --arm x: no params under {tmp_path / 'nope'}_s0"]
    assert not out.exists()

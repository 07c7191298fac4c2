"""Trackers: JSONL lines and resume truncation, process-0 only, wandb offline, clean fallback without wandb."""

import json
import sys
import warnings

import numpy as np
import pytest

from dgemma.config import load_config
from dgemma.tracking import JsonlTracker, MultiTracker, NoopTracker, WandbTracker, make_tracker, read_jsonl


def _logging(**kw):
    return load_config(None, {f"logging.{k}": v for k, v in kw.items()}, env={}).logging


def test_jsonl_lines_types_and_resume_truncation(tmp_path):
    path = tmp_path / "metrics.jsonl"
    t = JsonlTracker(path)
    t.log(1, {"loss": np.float32(2.5), "n": np.int32(3), "ok": np.bool_(True), "bad": float("nan")})
    t.log(2, {"loss": 2.0})
    t.log(3, {"loss": 1.5})
    t.close()
    rows = read_jsonl(path)
    assert rows[0] == {"step": 1, "loss": 2.5, "n": 3, "ok": True, "bad": "nan"}
    assert [r["step"] for r in rows] == [1, 2, 3]
    with open(path, "a") as f:
        f.write('{"step": 4, "lo')  # torn line of a killed writer
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]
    t = JsonlTracker(path, resume_step=2)  # resumed from checkpoint 2: later lines will be rewritten
    t.log(3, {"loss": 9.0})
    t.close()
    assert [(r["step"], r["loss"]) for r in read_jsonl(path)] == [(1, 2.5), (2, 2.0), (3, 9.0)]
    assert all(json.loads(line) for line in path.read_text().splitlines())  # every line is complete again


def test_make_tracker_process_zero_only_and_disabled(tmp_path):
    assert isinstance(make_tracker(_logging(), tmp_path, process_index=1), NoopTracker)
    assert isinstance(make_tracker(_logging(jsonl=False), tmp_path), NoopTracker)
    assert not (tmp_path / "metrics.jsonl").exists()
    t = make_tracker(_logging(), tmp_path)
    assert isinstance(t, JsonlTracker)
    t.close()


def test_wandb_unavailable_falls_back_cleanly(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.warns(RuntimeWarning, match="wandb disabled"):
        t = make_tracker(_logging(wandb=True, wandb_mode="offline"), tmp_path)
    assert isinstance(t, JsonlTracker)
    t.log(1, {"loss": 1.0})
    t.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isinstance(make_tracker(_logging(wandb=True, wandb_mode="disabled", jsonl=False), tmp_path),
                          NoopTracker)


@pytest.fixture
def wandb_torn_down():
    """wandb, shut down after the test: a finished run still leaves wandb's service process running, WANDB_SERVICE
    set and a socket directory in the temp dir; `wandb.teardown()` ends them (the next test starts from none)."""
    wandb = pytest.importorskip("wandb")
    yield wandb
    wandb.teardown()


def test_wandb_offline_run_in_tmp_dir(tmp_path, monkeypatch, wandb_torn_down):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback warning would mean wandb did not start
        t = make_tracker(_logging(wandb=True, wandb_mode="offline", wandb_project="dgemma-test"), tmp_path,
                         config={"a": 1}, config_sha="abc", name="t")
    assert isinstance(t, MultiTracker)
    wb = [x for x in t.trackers if isinstance(x, WandbTracker)][0]
    run_id = wb.run.id
    t.log(1, {"loss": 1.25})
    t.log(2, {"loss": 1.0})
    t.close()
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert runs and any(f.suffix == ".wandb" for f in runs[0].iterdir())
    assert (tmp_path / "wandb_run_id").read_text().strip() == run_id  # a resumed run reuses the id
    assert [r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1.25, 1.0]

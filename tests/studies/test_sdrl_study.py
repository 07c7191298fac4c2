"""The E2 study script (experiments/sdrl_study/run.py, loaded by path) end to end at a toy budget: stage-1
checkpoint -> SD·RL arm -> held-out evaluation -> tables with bootstrap CIs, figures. Checks the plumbing and the
reporting contract (overlap 0, CIs, settings), not the research hypothesis (that is the script's full run and the
notebook); and the library parts it runs on (`dgemma.train.study`, `dgemma.eval.study_report`)."""

import json
from pathlib import Path

import pytest
from support.scripts import load_script
from support.study_stage1 import tiny_study_dir

from dgemma.train import study


@pytest.fixture(scope="module")
def stage1(tmp_path_factory):
    return tiny_study_dir(tmp_path_factory.mktemp("study"))


@pytest.mark.slow  # the default suite runs the same script from notebooks/sdrl_study.py (trained checkpoint)
def test_reduced_study_writes_tables_with_cis(stage1):
    out = stage1 / "out"
    script = load_script("experiments/sdrl_study/run.py", "sdrl_study_run")
    rc = script.main(["--reduced", "--stage1", str(stage1 / "stage1" / "params"), "--config", str(stage1 / "tiny.yaml"),
                     "--out", str(out), "--iterations", "1", "--prompts", "2", "--group-size", "2",
                     "--eval-per-task", "3", "--eval-batch", "4", "--train-stream", f"{stage1 / 'tiny.yaml'}:5"])
    assert rc == 0
    md = (out / "results.md").read_text()
    assert "overlap with the training stream: 0" in md
    assert "K_max = 4" in md and "greedy" in md  # decoding settings stated
    assert "| stage1 | diffusion" in md and "| sdrl | diffusion" in md and "[" in md
    res = json.loads((out / "results.json").read_text())
    assert {"stage1", "stage1:ar", "sdrl", "sdrl:ar"} <= set(res["table"])
    em = res["table"]["sdrl"]["all"]["exact_match"]
    assert em[1] <= em[0] <= em[2] and res["table"]["sdrl"]["all"]["n"] == 6
    assert len(res["histories"]["sdrl"][0]) == 1
    for name in ("em_vs_steps.png", "tpf_vs_em.png", "iterations.png", "per_step_train.png",
                 "commitment_stage1.png", "commitment_sdrl.png"):
        assert (out / name).stat().st_size > 0


def test_study_refuses_a_run_dir_left_by_other_settings(stage1):
    """A killed study resumes its own runs, but a run dir written under other overrides is refused (naming it), not
    resumed: resuming would mix two configs' iterations in one reported row."""
    from dgemma.config import load_config
    from dgemma.train.run_dir import prepare_run_dir

    cfg = load_config(stage1 / "tiny.yaml", [f"run.output_dir={stage1 / 'reuse'}", "run.name=e2_sdrl_s0"])
    study.refuse_foreign_run_dir(cfg)  # nothing there yet
    prepare_run_dir(cfg)
    study.refuse_foreign_run_dir(cfg)  # same config: a resume, allowed
    other = load_config(stage1 / "tiny.yaml", [f"run.output_dir={stage1 / 'reuse'}", "run.name=e2_sdrl_s0",
                                                "optim.lr=3e-5"])
    with pytest.raises(SystemExit, match="e2_sdrl_s0: holds a run with another config"):
        study.refuse_foreign_run_dir(other)


def test_resumed_run_reports_every_iteration_from_its_metrics_file(stage1):
    """A resumed run's in-memory history holds only the iterations of this start; the study reads the whole run from
    metrics.jsonl (truncated to the restored step by the tracker on resume), so its curves do not lose iterations."""
    from types import SimpleNamespace

    from dgemma.config import load_config
    from dgemma.tracking import JsonlTracker

    cfg = load_config(stage1 / "tiny.yaml", [f"run.output_dir={stage1 / 'hist'}", "run.name=e2_sdrl_s0",
                                              "trainer.log_every=1"])
    run_dir = cfg.run.run_dir
    Path(run_dir).mkdir(parents=True)
    tracker = JsonlTracker(Path(run_dir) / "metrics.jsonl")
    for step in (1, 2, 3):
        tracker.log(step, {"reward": float(step)})
    tracker.close()
    resumed = SimpleNamespace(history=[{"step": 3, "reward": 3.0}])  # killed after 2, resumed for the third
    assert [r["step"] for r in study.run_history(cfg, resumed)] == [1, 2, 3]
    fresh = SimpleNamespace(history=[{"step": s, "reward": 0.0} for s in (1, 2, 3, 4)])  # no file written past 3
    assert study.run_history(cfg, fresh) is fresh.history


def test_retention_is_reported_per_task_and_mode_and_stays_out_of_all():
    """`--retention-tasks` (tasks stage 2 does not train): their EM change vs stage 1 per decoding mode, paired over
    the same prompts and keys, with a verdict; the "all" row pools only the SD·RL tasks."""
    from dgemma.eval import study_report as rep

    sdrl_report = load_script("experiments/sdrl_study/sdrl_report.py", "sdrl_report")

    def ev(rewards):  # one seed's evaluator result: rows of pick (SD·RL) and sort (retention), index = prompt
        tasks = ["pick", "pick", "sort", "sort"]
        rows = {"task": tasks, "reward": rewards, "index": [0, 1, 2, 3], "tokens": [4] * 4, "forwards": [2] * 4,
                "commit_passes": [0] * 4, "steps_per_block": [2.0] * 4}
        return {m: {"rows": rows, "metrics": {"tpf_row_mean": 2.0}} for m in ("diffusion", "ar")}

    evals = {"stage1": [ev([1, 1, 1, 1])] * 3, "stage1:ar": [ev([1, 1, 1, 1])] * 3,
             "sdrl": [ev([1, 1, 0, 1])] * 3, "sdrl:ar": [ev([1, 1, 1, 1])] * 3}
    table = rep.summarize(evals, ["pick"], ["sort"])
    assert table["sdrl"]["all"]["n"] == 6 and table["sdrl"]["sort"]["exact_match"][0] == 0.5
    kept = rep.retention(evals, ["sort"])
    assert kept["sdrl"]["sort"]["diffusion"]["delta_em"][0] == -0.5
    assert kept["sdrl"]["sort"]["diffusion"]["verdict"] == "forgotten"
    assert kept["sdrl"]["sort"]["ar"] == {"delta_em": (0.0, 0.0, 0.0), "verdict": "kept"}
    md = sdrl_report.report({"machine": "m", "kmax": 4, "settings": {"diffusion": "d", "ar": "a"}, "ran": {},
                     "verdict": "v"}, table, ["pick", "sort"], "held", {}, kept)
    assert "| sdrl | sort | -50.0 pts [-83.3, -16.7] (forgotten) | +0.0 pts [+0.0, +0.0] (kept) |" in md


def test_a_task_the_stage2_config_lacks_comes_from_the_task_config():
    """`--tasks perm` (E2c) over stage2.yaml, which trains copy / sort / add: perm's lengths come from the run script's
    --task-config (the toy stage-0/1 mix, configs/common.yaml) at weight 1; without one it is refused, naming it."""
    script = load_script("experiments/sdrl_study/run.py", "sdrl_study_run")
    cfg = study.load_cfg(script.DEFAULT_CONFIG, [])
    picked = study.select_tasks(cfg, ["sort", "perm"], script.TASK_CONFIG).data.tasks
    assert [(t.name, t.min_len, t.max_len, t.weight) for t in picked] == [("sort", 40, 40, 1.0), ("perm", 40, 40, 1.0)]
    with pytest.raises(SystemExit, match=r"^--tasks: unknown task 'perm'; known: \['add', 'copy', 'sort'\]$"):
        study.select_tasks(cfg, ["perm"])
    args = script.build_parser().parse_args(["--stage1", "unused", "--tasks", "perm"])
    assert args.task_config == str(script.TASK_CONFIG)
    assert args.default_train_streams == [str(p) for p in script.TRAIN_STREAMS]

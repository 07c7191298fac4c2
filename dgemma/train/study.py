"""The parts of a model-comparison study of SD·RL runs that any study reuses: the run config of one arm x seed, the
held-out prompts every model is decoded on, restoring a checkpoint, the evaluation, a run's iteration history and
the study command line.

    from dgemma.train.study import build_parser, held_out, study_cfg
    args = build_parser(stage2_config, train_streams=[stage0_config, stage1_config]).parse_args([...])
    cfg = study_cfg(args, "sdrl", seed)     # the stage-2 config + the study's overrides, --tasks selected
    held = held_out(args, cfg)              # deduplicated, disjoint from every training stream (overlap must be 0)

Each arm (rl_only, sd_only, sdrl, sdrl_curriculum) x seed runs `--iterations` SD·RL iterations through the library
entry point (`dgemma.train.sdrl.run_sdrl`) from the `--stage1` checkpoint; every model is decoded on the same
held-out prompts by the held-out evaluator (`dgemma.eval.evaluator`), diffusion at the full K_max and greedy AR,
with sampler key 1000 + seed. The studies that use this (each under experiments/, with its own run script, configs,
report and results): the SD·RL study (`experiments/sdrl_study/run.py`) and the LoRA study
(`experiments/lora_study/run.py`); `notebooks/sdrl_arms.py` builds its arms from it. A study's run script passes its
own defaults (stage-2 config, training streams, task source): nothing here knows where a checkout keeps them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["ARMS", "build_parser", "evaluate_model", "held_out", "load_cfg", "refuse_foreign_run_dir", "restore",
           "run_history", "select_tasks", "study_cfg", "study_mesh"]

ARMS = ("rl_only", "sd_only", "sdrl", "sdrl_curriculum")


def load_cfg(path, overrides):
    from dgemma.config import load_config

    return load_config(path, list(overrides))


def study_cfg(args, arm: str, seed: int):
    """The run config of one arm x seed: the study config with the study's overrides and tasks."""
    out = [f"run.output_dir={args.out}", f"run.name={args.name}_{arm}_s{seed}", f"run.seed={seed}",
           f"sdrl.arm={arm}", f"trainer.steps={args.iterations}", f"checkpoint.init_from={args.stage1}",
           f"sdrl.group_size={args.group_size}", f"data.batch_size={args.prompts}", *args.override]
    return select_tasks(load_cfg(args.config, out), list(args.tasks), args.task_config)


def select_tasks(cfg, names, task_config=None):
    """`cfg` training only the tasks `names` (each at weight 1): a task `cfg.data.tasks` lacks is taken from
    `task_config`'s data.tasks (e.g. the stage-0/1 mix, for a task the stage-2 config does not train); an unknown
    name is refused in one line."""
    import dataclasses

    from dgemma.data.config import TaskConfig

    have = {t.name: t for t in cfg.data.tasks}
    ref = {t.name: t for t in load_cfg(task_config, []).data.tasks} if task_config else {}
    picked = []
    for n in names:
        if n not in have and n not in ref:
            raise SystemExit(f"--tasks: unknown task {n!r}; known: {sorted(set(have) | set(ref))}")
        picked.append(have.get(n) or ref[n])
    picked = [TaskConfig(**{**dataclasses.asdict(t), "weight": 1.0}) for t in picked]
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tasks=tuple(picked)))


def refuse_foreign_run_dir(cfg) -> None:
    """A run directory left by a study with other settings must not be resumed: the library allows a config change on
    resume (it warns and keeps the old config), which here would silently mix two arms' iterations in one row."""
    from dgemma.config import config_hash
    from dgemma.train.run_dir import recorded_config_sha

    run_dir = Path(cfg.run.run_dir)
    if recorded_config_sha(run_dir) not in (None, config_hash(cfg)):
        raise SystemExit(f"{run_dir}: holds a run with another config (e.g. other --override or --iterations); "
                         "choose another --out or --name, or delete that directory")


def run_history(cfg, summary) -> list[dict]:
    """Every iteration of the run: `summary.history` holds only this process's iterations, so a resumed run (a killed
    study restarted) reads its metrics.jsonl, which the tracker truncates to the restored step on resume."""
    from dgemma.tracking import read_jsonl

    path = Path(cfg.run.run_dir) / "metrics.jsonl"
    rows = read_jsonl(path) if cfg.logging.jsonl and cfg.trainer.log_every == 1 else []
    return rows if len(rows) >= len(summary.history) else summary.history


def study_mesh(cfg):
    """The config's mesh on the first devices it needs (a fixed-size mesh such as mesh/single.yaml runs on one device
    also where more are visible, e.g. the test suite's 8 simulated CPU devices)."""
    import math

    import jax

    from dgemma.parallel.mesh import make_mesh_from_config

    n = math.prod(int(v) for v in dict(cfg.mesh.ici).values()) * math.prod(int(v) for v in dict(cfg.mesh.dcn).values())
    return make_mesh_from_config(cfg.mesh, jax.devices()[:n] if n > 0 else None)


def held_out(args, cfg):
    """Deduplicated held-out prompts for the study's tasks and its `--retention-tasks` (decoded, never trained by
    stage 2), disjoint from stages 0/1, the AR control and the SD·RL stream."""
    from dgemma.eval.heldout import build_held_out
    from dgemma.train.sdrl.retention import retention_data_config

    streams = [(cfg.data, args.iterations)]
    if retention_data_config(cfg) is not None:  # sdrl.retention_mix: stage 2 trains on those rows too
        streams.append((retention_data_config(cfg), args.iterations))
    retention = list(getattr(args, "retention_tasks", None) or [])
    if set(retention) & set(args.tasks):
        raise SystemExit(f"--retention-tasks: {sorted(set(retention) & set(args.tasks))} are SD·RL tasks (--tasks)")
    held_data = cfg.data
    if retention:  # their lengths: the study config's data.tasks (cfg holds the SD·RL tasks only), else common.yaml's
        import dataclasses

        names = {t.name for t in cfg.data.tasks}
        full = (*cfg.data.tasks, *(t for t in load_cfg(args.config, args.override).data.tasks if t.name not in names))
        held_data = select_tasks(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tasks=full)),
                                 [*args.tasks, *retention], args.task_config).data
    for spec in args.train_stream or [f"{path}:" for path in args.default_train_streams]:
        path, _, steps = spec.rpartition(":")
        c = load_cfg(path, [])
        streams.append((c.data, int(steps) if steps else c.trainer.steps))
    return build_held_out(held_data, n_per_task=args.eval_per_task, batch_size=args.eval_batch, train_streams=streams)


def restore(cfg, path):
    """The model of a params checkpoint (e.g. the shipped stage-1 checkpoints of experiments/sdrl_study)."""
    from dgemma.checkpoint.model import restore_model
    from dgemma.parallel.mesh import make_mesh

    # (an adapted run's params come back merged: dgemma.checkpoint.lora_params)
    return restore_model(cfg.model_config, path, mesh=make_mesh({"fsdp": -1}), rules=cfg.mesh.rules)[0]


def evaluate_model(model, held, cfg, seed: int) -> dict:
    """The evaluator's results for greedy AR and diffusion at the config's full K_max, key 1000 + seed."""
    import jax

    from dgemma.eval.evaluator import evaluate

    return evaluate(model, held, cfg.sampler, ("ar", "diffusion"), key=jax.random.key(1000 + seed))


def build_parser(default_config: str | Path, *, train_streams=(), task_config: str | Path | None = None
                 ) -> argparse.ArgumentParser:
    """The study's command line; `default_config` is the stage-2 run config used without `--config`,
    `train_streams` the configs whose training streams (at their trainer.steps) the held-out prompts avoid without
    `--train-stream`, and `task_config` the default of `--task-config`. The study's run script passes its own."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.set_defaults(default_train_streams=[str(p) for p in train_streams])
    ap.add_argument("--stage1", required=True, help="stage-1 params checkpoint (runs/toy/stage1/params)")
    ap.add_argument("--out", default="runs/sdrl_study")
    ap.add_argument("--name", default="e2")
    ap.add_argument("--config", default=str(default_config), help=f"stage-2 run config (default {default_config})")
    ap.add_argument("--train-stream", action="append", default=None, metavar="CONFIG:STEPS",
                    help="a training stream the held-out prompts must avoid (repeatable; default: "
                         f"{', '.join(map(str, train_streams)) or 'none'} at their trainer.steps; empty STEPS = "
                         "trainer.steps)")
    ap.add_argument("--arms", nargs="*", default=list(ARMS), choices=ARMS,
                    help="in this order (none: evaluate the checkpoints only); table.json is rewritten after each run")
    ap.add_argument("--extra", action="append", default=[], metavar="LABEL=PARAMS",
                    help="another checkpoint to evaluate beside stage 1 (e.g. stage0=runs/toy/stage0_ar/params)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--tasks", nargs="+", default=None, help="default: the config's data.tasks")
    ap.add_argument("--task-config", default=None if task_config is None else str(task_config),
                    help=f"run config whose data.tasks supply a --tasks / --retention-tasks name the stage-2 config "
                         f"lacks (default {task_config})")
    ap.add_argument("--retention-tasks", nargs="*", default=[], metavar="TASK",
                    help="tasks the checkpoint knows that stage 2 does not train (e.g. copy sort): decoded on held-out "
                         "prompts in both modes; results.md adds their EM change vs stage 1 (forgetting)")
    ap.add_argument("--iterations", type=int, default=None, help="SD·RL iterations per run (default 20; reduced 3)")
    ap.add_argument("--prompts", type=int, default=8, help="Q prompts per iteration")
    ap.add_argument("--group-size", type=int, default=4, help="G rollouts per prompt")
    ap.add_argument("--eval-per-task", type=int, default=64)
    ap.add_argument("--eval-batch", type=int, default=32)
    ap.add_argument("--reduced", action="store_true",
                    help="CI: 1 seed, the config's first two tasks, 3 iterations, sdrl vs stage 1")
    ap.add_argument("--results-md", default=None, help="also write results.md here (e.g. experiments/sdrl_study)")
    ap.add_argument("--compile-cache", default=None, help="persistent XLA compilation cache directory (optional)")
    ap.add_argument("--override", nargs="*", default=[], help="extra dotted overrides for the stage-2 config")
    return ap

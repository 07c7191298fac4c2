"""`dgemma train`: config-driven training (`trainer.objective`: stage1 block-diffusion adaptation, ar, or sdrl stage 2).

    dgemma train --config configs/stage1/tiny.yaml trainer.steps=200 run.name=my_run

Builds the mesh and sharding rules from `mesh`, creates or resumes the train state (exact resume from the run's latest
checkpoint; `checkpoint.init_from` seeds params from a params-only checkpoint), writes the resolved config and its
sha into the run directory and runs the loop with metrics (JSONL, optional wandb) and a progress bar.
Before the backend starts it sets the GPU allocator's memory fraction that `dgemma launch` exports
(`dgemma.planning.device_memory`; a value already in the environment wins), and before anything is written it refuses
a run whose planned per-device peak exceeds what the allocator allows (`--force` overrides; CPU is not checked).
Exit codes: 0 done (or preempted after a clean checkpoint); 1 non-finite loss (last good checkpoint kept), the run
does not fit the devices, its run directory is in use, or a disk / file error; 2 bad config: a config error, a model
that does not fit the run's checkpoints on resume, or a reward function (`sdrl.reward`) that cannot be imported, fails
or returns something other than one finite float per row.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from dgemma.cli import common

if TYPE_CHECKING:
    from dgemma.config import RunConfig

NAME = "train"
HELP = "train a model (stage 1 block diffusion, AR, or stage 2 SD·RL)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `dgemma train` besides the shared config ones."""
    parser.add_argument("--no-progress", action="store_true", help="disable the progress bar")
    parser.add_argument("--force", action="store_true",
                        help="start even if the planner's peak exceeds what the accelerator's allocator allows")


def run(args: argparse.Namespace) -> int:
    from dgemma.planning.device_memory import configure_allocator, run_fit_refusal

    configure_allocator()  # what `dgemma launch` exports (GPU memory fraction), before the JAX backend starts
    cfg, done = common.load_or_print(args)
    if done:
        return common.EXIT_OK
    from dgemma.parallel.distributed import maybe_initialize

    maybe_initialize()  # multi-host: before any other jax use (SLURM / TPU / DGEMMA_COORDINATOR...; no-op otherwise)
    import jax

    from dgemma.train.run_lock import RunDirInUse, RunLocks

    if jax.process_index() == 0:  # a run or checkpoint dir in use: refused before the planner's fit check (the
        try:  # trainer then holds both locks from its own start)
            RunLocks.for_config(cfg).check_free()
        except RunDirInUse as e:
            print(f"dgemma train: {e}", file=sys.stderr)
            return common.EXIT_ERROR
    refusal = None if args.force else run_fit_refusal(cfg)  # before anything is written
    if refusal:
        print(f"dgemma train: {refusal}", file=sys.stderr)
        return common.EXIT_ERROR
    layout = batch_line(cfg)
    if layout:  # on stdout: stderr carries only a refusal's one line
        print(f"batch: {layout}", flush=True)
    from dgemma.checkpoint import CheckpointMismatchError
    from dgemma.data.rewards import RewardError
    from dgemma.train import trainer
    from dgemma.train.nonfinite import NonFiniteLossError

    try:
        summary = trainer.train(cfg, progress=not args.no_progress)  # the trainer of `trainer.objective`
    except (NonFiniteLossError, RunDirInUse) as e:
        print(f"dgemma train: {e}", file=sys.stderr)
        return common.EXIT_ERROR
    except (CheckpointMismatchError, RewardError) as e:  # the config (its model, its reward function) is at fault
        print(f"dgemma train: {common.one_line(e)}", file=sys.stderr)
        return common.EXIT_USAGE
    state = "preempted" if summary.preempted else "done"
    if summary.steps_run == 0:  # resumed at the final step: nothing trained, no loss to report
        print(f"{state}: already at step {summary.final_step} (params written); run dir {summary.run_dir}")
        return common.EXIT_OK
    print(f"{state}: steps {summary.start_step}->{summary.final_step} in {summary.wall_seconds:.1f}s "
          f"(compile {summary.compile_seconds:.1f}s); last loss {summary.last_metrics.get('loss', float('nan')):.4f}; "
          f"run dir {summary.run_dir}")
    return common.EXIT_OK


def batch_line(cfg: RunConfig) -> str | None:  # noqa: ANN001 - RunConfig
    """One line: how `data.batch_size` (the global batch) splits on this run's processes and devices; None when the
    mesh cannot be resolved here (the run then fails with its own error)."""
    import jax

    from dgemma.parallel.checks import batch_layout
    from dgemma.parallel.mesh import resolve_mesh_shape
    from dgemma.train.objectives import get_objective

    processes = jax.process_count()
    if get_objective(cfg.trainer.objective).rollouts:
        return (f"{cfg.data.batch_size} prompts per iteration (data.batch_size, global) = {processes} processes x "
                f"{cfg.data.batch_size // processes}")
    try:
        devices = cfg.mesh.axis_size(*cfg.mesh.axes) or jax.device_count()  # a fixed mesh uses its own size
        shape = resolve_mesh_shape(dict(cfg.mesh.ici), dict(cfg.mesh.dcn), devices, processes)
        return batch_layout(cfg.data.batch_size, processes, shape.sizes, cfg.mesh.rules,
                            cfg.trainer.grad_accum_steps).describe()
    except ValueError:
        return None


if __name__ == "__main__":
    sys.exit(common.standalone(sys.modules[__name__]))

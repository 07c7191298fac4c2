"""`dgemma launch`: render a run for local | slurm | xpk | tpu-vm, check it fits, and submit it (or print it).

    dgemma launch --target local configs/stage1/tiny.yaml trainer.steps=2 optim.warmup_steps=0
    dgemma launch --target slurm --profile slurm_h100 configs/stage1/gemma4_26b_a4b.yaml launch.nodes=2 --dry-run
    dgemma launch --target xpk --profile xpk_v5p64 configs/stage1/gemma4_26b_a4b.yaml launch.num_slices=2
    dgemma launch --target tpu-vm --profile tpu_vm_v5p64 -c configs/stage1/gemma4_26b_a4b.yaml

Launch settings (`dgemma.planning.launch_spec.LaunchSection`: accelerator, nodes, partition, cluster, tpu_type, ...)
come from `--profile` (a YAML path or the name of a packaged profile, dgemma/planning/profiles/) and `launch.*`
overrides; every other `KEY=VALUE` overrides the run config. `data.batch_size` is the global batch whatever the
process count (each process reads batch_size / processes rows). Before anything is written or submitted the planner
checks that the run fits the accelerator and, for what is kept on the host, the nodes' RAM (`launch.node_ram_gib`;
`dgemma plan`); a run that does not fit is refused with the planner's numbers (`--force` overrides).
The rendered files go to `<run.output_dir>/<run.name>/launch/`; `--dry-run` prints them and the submit command
instead (sbatch | bash xpk script | bash gcloud script | bash local script). Exit codes: 0 ok (local: the run's exit
code), 1 does not fit or submission failed, 2 bad config. A local run works from any directory (no checkout, no
activated environment needed): it runs the packaged host wrapper with the interpreter dgemma runs in unless
`launch.python` names another; a launch that cannot start removes what it wrote.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from dgemma.cli import common

if TYPE_CHECKING:
    from dgemma.config import RunConfig

NAME = "launch"
HELP = "render (and submit) a run for local | slurm | xpk | tpu-vm, refusing runs that do not fit"
TARGETS = ("local", "slurm", "xpk", "tpu-vm", "xpk-tpu", "xpk-gpu")
CANNOT_START = (126, 127)  # bash: a command not executable / not found (dgemma train itself never exits with these)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `dgemma launch` besides the shared config ones."""
    parser.add_argument("--target", choices=TARGETS, default=None,
                        help="where to run (default: the profile's target, else local); xpk-tpu / xpk-gpu = xpk")
    parser.add_argument("--profile", metavar="PATH|NAME", help="launch profile YAML, or a packaged profile name (slurm_h100, xpk_v5p64, ...)")
    parser.add_argument("--dry-run", action="store_true", help="print the rendered files and submit command only")
    parser.add_argument("--force", action="store_true", help="submit even if the planner says it does not fit")


def split_overrides(tokens: list[str]) -> tuple[list[str], list[str]]:
    """(run-config overrides, launch.* overrides)."""
    run: list[str] = []
    launch: list[str] = []
    for t in tokens:
        (launch if t.startswith("launch.") else run).append(t)
    return run, launch


def _plan(cfg: RunConfig, launch, topo):
    import argparse as _argparse

    from dgemma.cli.plan import planner_report

    ns = _argparse.Namespace(devices=topo.devices, accelerator=launch.accelerator, processes=topo.processes,
                             global_batch=None, slices=topo.granules, remat=None,
                             devices_per_node=topo.devices_per_host, node_ram_gib=launch.node_ram_gib or None)
    return planner_report(cfg, ns)


def run(args: argparse.Namespace) -> int:
    from dgemma.cli.plan import config_and_overrides

    config_and_overrides(args)
    run_overrides, launch_overrides = split_overrides(list(args.overrides or []))
    args.overrides = run_overrides
    cfg, done = common.load_or_print(args)
    if done:
        return common.EXIT_OK
    common.check_run_length(cfg)  # what `dgemma train` would refuse at its start, before a job is queued
    from dgemma.planning.launch_spec import load_launch
    from dgemma.planning.launcher import render

    try:
        launch = load_launch(args.profile, launch_overrides, args.target)
        job = render(cfg, launch, config_path=args.config, overrides=run_overrides)
    except (ValueError, KeyError, FileNotFoundError) as e:
        if type(e).__name__ == "ConfigError":
            raise
        print(f"dgemma launch: {e}", file=sys.stderr)
        return common.EXIT_USAGE
    if launch.plan_check:
        try:
            report, fits = _plan(cfg, launch, job.topology)
        except ValueError as e:
            print(f"dgemma launch: refused, the planner rejects this run: {e}", file=sys.stderr)
            return common.EXIT_ERROR
        sys.stderr.write(report)
        if fits is False and not args.force:
            print(f"dgemma launch: refused: the run does not fit {job.topology.devices} x {launch.accelerator} "
                  "or its nodes' RAM (numbers above); change the mesh / batch / freezing, or pass --force",
                  file=sys.stderr)
            return common.EXIT_ERROR
    if args.dry_run:
        sys.stdout.write(job.text())
        return common.EXIT_OK
    try:
        paths = job.write()
    except BaseException:
        job.unwrite()
        raise
    print(f"dgemma launch: wrote {', '.join(str(p) for p in paths)}; running: {' '.join(job.submit_command)}",
          file=sys.stderr)
    try:
        rc = job.submit()
    except FileNotFoundError as e:
        job.unwrite()
        print(f"dgemma launch: cannot submit ({e}); the rendered files were removed", file=sys.stderr)
        return common.EXIT_ERROR
    if job.target == "local" and rc in CANNOT_START:
        job.unwrite()
        print(f"dgemma launch: the local run could not start (exit {rc}: a command was not found or not executable, "
              f"output above); the rendered files and logs were removed", file=sys.stderr)
        return common.EXIT_ERROR
    if job.target != "local" and rc != 0:
        return common.EXIT_ERROR
    return rc


if __name__ == "__main__":
    sys.exit(common.standalone(sys.modules[__name__]))

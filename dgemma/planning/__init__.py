"""Planning and launching (above `dgemma.train`, below the CLI): will a run fit, and how is it started.

    planner.py       per-device memory and FLOPs of a training step from abstract shapes (docs/planner.md)
    plan_config.py   the planner on a RunConfig: PlanSpec, text report, XLA's compiled memory analysis
    golden.py        golden PartitionSpec tables (`python -m dgemma.planning.golden --check --dir DIR`)
    launch_spec.py   launch settings (profiles); launcher.py: render / submit local | slurm | xpk | tpu-vm jobs

Package data: `templates/` (job templates), `profiles/` (example launch profiles), `hardware/` (env per accelerator).
Importing this package imports nothing heavy; import the submodules you need.
"""

"""Parallelism: meshes, sharding rules and checks, multi-host initialisation, the memory planner, launchers.

    mesh.py          device meshes from config (ICI x DCN, hybrid multi-slice / multi-node), AbstractMesh
    rules.py         logical-axis rule presets (training and `*_sampling`), specs / shardings of NNX states
    checks.py        divisibility errors (experts, heads, batch) and the sufficiently-sharded assertion
    golden.py        golden PartitionSpec tables (tests/golden/partition_specs/, `python -m dgemma.parallel.golden`)
    distributed.py   `maybe_initialize()`: jax.distributed for SLURM / TPU / GKE / explicit env (CLI only)
    planner.py       per-device memory and FLOPs of a training step; plan_config.py: from a RunConfig + XLA check
    launch_spec.py   launch settings (profiles); launcher.py: render / submit local | slurm | xpk | tpu-vm jobs

Importing this package imports nothing heavy; import the submodules you need.
"""

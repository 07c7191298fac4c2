"""Sharding (below `dgemma.train`): meshes, sharding rules and checks, multi-host initialisation.

    mesh.py          device meshes from config (ICI x DCN, hybrid multi-slice / multi-node), AbstractMesh
    rules.py         logical-axis rule presets (training and `*_sampling`), specs / shardings of NNX states
    checks.py        divisibility errors (experts, heads, batch) and the sufficiently-sharded assertion
    distributed.py   `maybe_initialize()`: jax.distributed for SLURM / TPU / GKE / explicit env (CLI only)

The memory planner, launchers and golden partition tables are in `dgemma.planning` (above `dgemma.train`).
Importing this package imports nothing heavy; import the submodules you need.
"""

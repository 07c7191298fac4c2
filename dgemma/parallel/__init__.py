"""Sharding (below `dgemma.train`): meshes, sharding rules and checks, multi-host initialisation.

The memory planner, launchers and golden partition tables are in `dgemma.planning` (above `dgemma.train`).
Importing this package imports nothing heavy; import the submodules you need.

Modules:
  mesh         device meshes from named axis sizes (ICI x DCN, multi-slice / multi-node), the activating context
  rules        logical-axis rule presets (training and `*_sampling`), specs / shardings of NNX states
  checks       divisibility errors (experts, heads, batch) and the sufficiently-sharded assertion
  memory       moving a sharded pytree between accelerator memory and pinned host memory
  distributed  `maybe_initialize()`: jax.distributed for SLURM / TPU / GKE / explicit env (CLI only)
"""

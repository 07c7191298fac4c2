"""Keep the model's activations sharded on the batch under FSDP.

The token embedding and the per-layer embedding tables are FSDP-sharded on their columns (`embed` -> fsdp), and the
batch is sharded on the same mesh axes. A lookup into such a table can be partitioned either way, and XLA's SPMD
partitioner keeps the table's layout: the looked-up rows come out sharded on the hidden dimension with the batch
replicated, and that layout then follows every layer, so each device computes the whole global batch (a
reduced-depth deviceless v5p-64 compile of E2B stage 1 held the loss's logits chunk of all 32 examples,
f32 [32, 256, 262,144], on every chip; docs/planner_compile.md). Scanned layers happened to recover the batch
layout inside the scan; unscanned ones (E2B, E4B, 31B) do not. `batch_sharded` pins the batch layout where
activations are made and after every block, so FSDP gathers the weights instead of the activations.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec

__all__ = ["BATCH_AXES", "batch_sharded"]

# the mesh axes every rule preset puts the batch on (dgemma.parallel.rules; the model layer cannot import it)
BATCH_AXES = ("data", "fsdp")


def batch_sharded(x: jax.Array) -> jax.Array:
    """`x` [B, ...] constrained to its leading (batch) axis over the active mesh's batch axes; the identity without
    an active mesh, inside a `shard_map` over those axes, or when B does not split over them."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return x
    manual = set(getattr(mesh, "manual_axes", ()) or ())
    axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1 and a not in manual)
    if not axes or x.ndim == 0 or x.shape[0] % math.prod(mesh.shape[a] for a in axes):
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(axes if len(axes) > 1 else axes[0]))

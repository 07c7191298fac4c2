"""dgemma.checkpoint: orbax checkpoints of the training state and params-only checkpoints.

`manager.py` is the only module in dgemma that imports orbax; importing this package imports neither orbax nor jax.
"""

from __future__ import annotations

from dgemma._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "manager": ("CheckpointManager", "Restored", "dgemma_metadata", "restore_params", "save_params")})

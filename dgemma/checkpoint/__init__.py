"""dgemma.checkpoint: orbax checkpoints of the training state and params-only checkpoints.

`manager.py` (training state) and `params.py` (params only) are the only modules in dgemma that call orbax; faults
are classified in `errors.py`, stored trees checked against restore targets in `structure.py`, and `model.py` builds a
model from a params checkpoint. Importing this package imports neither orbax nor jax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dgemma._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "manager": ("CheckpointManager", "Restored", "dgemma_metadata"),
    "params": ("restore_params", "save_params"),
    "errors": ("CheckpointCorruptError", "CheckpointMismatchError", "CheckpointWriteError")})

if TYPE_CHECKING:  # the type checker sees the lazily exported names' own types
    from dgemma.checkpoint.manager import CheckpointManager, Restored, dgemma_metadata
    from dgemma.checkpoint.params import restore_params, save_params
    from dgemma.checkpoint.errors import CheckpointCorruptError, CheckpointMismatchError, CheckpointWriteError

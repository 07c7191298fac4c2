"""dgemma.checkpoint: orbax checkpoints of the training state and params-only checkpoints.

`manager.py` is the only module in dgemma that imports orbax; importing this package imports neither orbax nor jax.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["CheckpointManager", "Restored", "dgemma_metadata", "restore_params", "save_params"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        value = getattr(importlib.import_module("dgemma.checkpoint.manager"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dgemma.checkpoint' has no attribute {name!r}")

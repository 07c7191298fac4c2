"""dgemma.checkpoint: orbax checkpoints of the training state and params-only checkpoints.

`manager.py` and `params.py` are the only modules in dgemma that call orbax. Importing this package imports neither
orbax nor jax.

Modules:
  manager      training-state checkpoints (`CheckpointManager`, `Restored`): save, restore, exact resume
  params       params-only checkpoints (`save_params`, `restore_params`): written at the end of training, read by
               `checkpoint.init_from`, export, eval and sample
  errors       checkpoint faults: dgemma's exceptions and how orbax's own errors are classified
  structure    does a stored tree fit a restore target? Checked before orbax reads any array
  model        a model from a params checkpoint, placed on a mesh by a rule preset (the decoding commands)
  lora_params  params checkpoints of adapted runs: base weights, adapters and the adapters' settings
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

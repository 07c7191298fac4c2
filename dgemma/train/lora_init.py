"""`checkpoint.init_from` into a run with adapters (`lora.rank > 0`): a params checkpoint without adapters (a converted
Hugging Face model, a full-parameter stage-1 run) gives the base weights and the run keeps its freshly initialised
adapters (B = 0: the run starts exactly at the checkpoint's model); a checkpoint of an adapted run with the same
adapters is restored whole. Without adapters this is `dgemma.checkpoint.params.restore_params` itself.
"""

from __future__ import annotations

from typing import Any

__all__ = ["restore_init_params"]


def restore_init_params(cfg: Any, target: Any, fresh: Any) -> Any:
    """`cfg.checkpoint.init_from`'s params on `target`'s shardings; `fresh` (the initialised params) gives the
    adapters when the checkpoint holds none. A checkpoint whose base does not fit raises `restore_params`' one-line
    error about the base weights."""
    from flax import nnx

    from dgemma.checkpoint.errors import CheckpointMismatchError
    from dgemma.checkpoint.params import restore_params

    path = cfg.checkpoint.init_from
    lora = getattr(cfg, "lora", None)
    if lora is None or not lora.enabled:
        return restore_params(path, target)
    try:
        return restore_params(path, target)  # an adapted run's params: base and adapters
    except CheckpointMismatchError:
        base = restore_params(path, target.filter(nnx.Not(nnx.LoRAParam)))  # raises when the base differs too
    return nnx.merge_state(base, fresh.filter(nnx.LoRAParam))

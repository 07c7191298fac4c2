"""`checkpoint.init_from` into a run with adapters (`lora.rank > 0`). The run's base weights are the model the
checkpoint holds, and its adapters start fresh (B = 0: the run starts exactly at that model):
- a params checkpoint without adapters (a converted Hugging Face model, a full-parameter stage-1 run) gives the base;
- the params of an adapted run (its adapters recorded in the step's metadata, `dgemma.checkpoint.lora_params`) are
  folded first (W + scale·A·B, fp32, cast to W's dtype): the stage-1 model with its adapters is the new base, so an
  SD·RL run's KL reference and frozen teacher ("the base with the adapters off") are the stage-1 model, whatever rank
  or targets either run's adapters have;
- params with adapter leaves but no recorded settings (saved by hand) are restored whole when their adapters fit.
Without adapters this is `dgemma.checkpoint.params.restore_params` itself.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dgemma.config import RunConfig

__all__ = ["restore_init_params"]

log = logging.getLogger(__name__)


def restore_init_params(cfg: RunConfig, target: Any, fresh: Any) -> Any:
    """`cfg.checkpoint.init_from`'s params on `target`'s shardings; `fresh` (the initialised params) gives the
    adapters unless the checkpoint's own (unrecorded) adapters fit. A checkpoint whose base does not fit raises
    `restore_params`' one-line error about the base weights."""
    from flax import nnx

    from dgemma.checkpoint.errors import CheckpointMismatchError
    from dgemma.checkpoint.lora_params import adapter_settings
    from dgemma.checkpoint.params import restore_params

    path = cfg.checkpoint.init_from
    if path is None:
        raise ValueError("restore_init_params: checkpoint.init_from is not set (nothing to initialise from)")
    lora = getattr(cfg, "lora", None)
    if lora is None or not lora.enabled:
        return restore_params(path, target)
    base_target = target.filter(nnx.Not(nnx.LoRAParam))
    settings = adapter_settings(path)
    if settings is not None:
        base = _folded_base(cfg, path, settings, base_target)
        log.info("checkpoint.init_from=%s holds rank-%s adapters: folded into the base; this run's adapters start at "
                 "zero", path, settings.get("rank"))
        return nnx.merge_state(base, fresh.filter(nnx.LoRAParam))
    try:
        return restore_params(path, target)  # adapter leaves saved without settings: restored whole if they fit
    except CheckpointMismatchError:
        base = restore_params(path, base_target)  # raises when the base differs too
    return nnx.merge_state(base, fresh.filter(nnx.LoRAParam))


def _folded_base(cfg: RunConfig, path: Any, settings: dict, base_target: Any) -> Any:
    """The adapted checkpoint's merged params, in `base_target`'s dtypes and shardings."""
    import jax

    from dgemma.checkpoint.lora_params import restore_adapted
    from dgemma.parallel.rules import get_rules, state_shardings

    mesh = jax.tree.leaves(base_target)[0].sharding.mesh
    _, merged = restore_adapted(cfg.model_config, path, settings,
                                lambda a: state_shardings(a, mesh, get_rules(cfg.mesh.rules)))
    return jax.tree.map(lambda x, t: jax.device_put(x.astype(t.dtype), t.sharding), merged, base_target)

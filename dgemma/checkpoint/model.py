"""A model from a params-only checkpoint: the config's `Transformer` with the stored params, placed on a mesh by a
rule preset. Used by the commands that decode, evaluate or export a trained model (`dgemma.cli.common` adds the
`--checkpoint` argument checks), and by anything else below the CLI that needs the same.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from dgemma.checkpoint.lora_params import adapter_settings, restore_adapted
from dgemma.checkpoint.params import restore_params

__all__ = ["restore_model"]


def restore_model(model_cfg: Any, checkpoint: str | os.PathLike, *, mesh: jax.sharding.Mesh, rules: str,
                  sampling: bool = False, merge_adapters: bool = True) -> tuple[Any, Any]:
    """The `model_cfg` Transformer with params from `checkpoint` (a params root or one step directory in it), placed
    on `mesh` by the rule preset `rules` (with `sampling=True` its `*_sampling` variant: dense weights replicated over
    the batch axes for decoding). Returns (model, params state). The params of a run with adapters (`lora` in the
    step's metadata) are restored with their adapters and merged: the model is the config's plain model (with
    `merge_adapters=False`: the adapted model, base and adapters apart, and its params).

    Raises:
      FileNotFoundError: no params checkpoint at `checkpoint`.
      CheckpointMismatchError: the stored params do not fit `model_cfg` (names the first differing parameter).
      CheckpointCorruptError: the checkpoint's files are truncated or missing.
    """
    from flax import nnx

    from dgemma.model.transformer import abstract_model, model_from_params
    from dgemma.parallel.rules import get_rules, sampling_rules, state_shardings

    preset = sampling_rules(rules) if sampling else get_rules(rules)
    adapters = adapter_settings(checkpoint)
    if adapters is not None:  # an adapted run's params: restored with its adapters, returned merged
        return restore_adapted(model_cfg, checkpoint, adapters, lambda a: state_shardings(a, mesh, preset),
                               merge=merge_adapters)
    abstract = nnx.state(abstract_model(model_cfg), nnx.Param)
    shardings = state_shardings(abstract, mesh, preset)
    # the restore target: the abstract params carrying the shardings they are to land on (one sharding per Variable)
    target = jax.tree.map(
        lambda sharding, var: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), var),
        shardings, abstract)
    params = restore_params(checkpoint, target)
    return model_from_params(model_cfg, params), params

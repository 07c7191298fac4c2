"""Params checkpoints of adapted runs (`lora.rank > 0`): the base weights with their adapters, and the adapters'
settings in the step's metadata, so a command that only has the model config can rebuild and merge them.

    spec = adapter_settings(path)                          # {"rank", "alpha", "targets", "param_dtype"} or None
    model, params = restore_model(model_cfg, path, ...)    # dgemma.checkpoint.model: merged when adapters are stored

The trainer records `lora` (`lora_metadata`) in the metadata of every checkpoint of an adapted run, its params
checkpoint included. `restore_adapted` restores base and adapters into the adapted model and folds the adapters in
(`dgemma.model.lora.merged_params`: W + scale * A.B in fp32, cast to W's dtype), so sampling, evaluation and export
get a plain model of the config's layout.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax

__all__ = ["LORA_KEY", "adapter_settings", "lora_metadata", "params_metadata", "restore_adapted"]

LORA_KEY = "lora"
METADATA_FILE = "_CHECKPOINT_METADATA"  # orbax's per-step metadata file; `custom_metadata` holds what dgemma recorded


def lora_metadata(lora: Any) -> dict:
    """{"lora": settings} for a run's checkpoint metadata (a `LoraSection`); {} when adapters are off."""
    if lora is None or not lora.enabled:
        return {}
    spec = lora.spec()
    return {LORA_KEY: {"rank": spec.rank, "alpha": spec.alpha, "targets": list(spec.targets),
                       "param_dtype": spec.param_dtype,
                       # weights trained in full beside the adapters: an unmerged adapter export cannot carry them
                       "train_router": bool(lora.train_router), "train_embeddings": bool(lora.train_embeddings)}}


def _step_dir(path: Path) -> Path | None:
    """The step directory a params path names: itself (a step) or the newest committed step under a root."""
    if (path / "params").is_dir():
        return path
    steps = sorted((int(p.name) for p in path.iterdir() if p.name.isdigit() and p.is_dir()), reverse=True) \
        if path.is_dir() else []
    return path / str(steps[0]) if steps else None


def params_metadata(path: str | os.PathLike) -> dict:
    """The recorded metadata of the params step `path` names (a root: its newest step); {} when unreadable."""
    step = _step_dir(Path(path).absolute())
    if step is None:
        return {}
    try:
        return dict(json.loads((step / METADATA_FILE).read_text()).get("custom_metadata") or {})
    except (OSError, ValueError, AttributeError):
        return {}


def adapter_settings(path: str | os.PathLike) -> dict | None:
    """The adapters' settings recorded with the params at `path`; None for a checkpoint without adapters."""
    return params_metadata(path).get(LORA_KEY) or None


def _spec(settings: dict):
    from dgemma.model.lora import LoraSpec

    return LoraSpec(rank=int(settings["rank"]), alpha=float(settings["alpha"]), targets=tuple(settings["targets"]),
                    param_dtype=str(settings.get("param_dtype", "float32")))


def abstract_adapted_model(model_cfg: Any, settings: dict):
    """Shape-only config model with the recorded adapters attached (no allocation)."""
    from flax import nnx

    from dgemma.model.lora import attach_adapters
    from dgemma.model.transformer import Transformer

    def build():
        model = Transformer(model_cfg, rngs=nnx.Rngs(0))
        attach_adapters(model, _spec(settings), nnx.Rngs(1))
        return model

    return nnx.eval_shape(build)


def restore_adapted(model_cfg: Any, checkpoint: str | os.PathLike, settings: dict, shardings_of, *,
                    merge: bool = True) -> tuple[Any, Any]:
    """(model, params) of an adapted params checkpoint: with `merge` the config's plain model around the merged
    params, else the adapted model around base + adapters. `shardings_of(abstract_params)` gives the restore
    shardings (one per Variable)."""
    from flax import nnx

    from dgemma.checkpoint.params import restore_params
    from dgemma.model.lora import merged_params
    from dgemma.model.transformer import model_from_params

    graphdef, abstract = nnx.split(abstract_adapted_model(model_cfg, settings), nnx.Param)
    shardings = shardings_of(abstract)
    target = jax.tree.map(
        lambda sharding, var: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), var),
        shardings, abstract)
    params = restore_params(checkpoint, target)
    adapted = nnx.merge(graphdef, params)
    if not merge:
        return adapted, params
    merged = merged_params(adapted)
    return model_from_params(model_cfg, merged), merged

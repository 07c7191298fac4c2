"""SD·RL with adapters (`lora.rank > 0`): the KL reference and the frozen teacher are the base model with its
adapters off, read from the student's own frozen weights; no second copy of the model is held.

    ref = AdapterReference(cfg, graphdef, abstract_params)
    kept = ref.start(params)                        # the session's: trainable non-adapter leaves (usually none)
    reference = ref.reference_params(params, kept)  # merges with ref.graphdef (the adapters-off model)
    ema = ref.trainable(params)                     # teacher=ema: only what trains is averaged
    teacher = ref.with_trainable(params, ema)       # merges with the trainer's graphdef

With adapters every base weight is frozen (`dgemma.train.lora_setup`), so the student's base leaves are the stage-1
weights for the whole run, bit for bit, and the reference is a view of them (`base_params`: the same arrays, no
copy) merged with the graph of the model under `dgemma.model.lora.adapters_disabled`: the model without its adapter
modules (the base model's computation exactly, not `x.W + 0`). What `lora.train_router` /
`lora.train_embeddings` (or a narrower `optim.freeze`) leaves trainable beside the adapters does move; its stage-1
values are the only thing this reference keeps (`start`; nothing with the default settings), checkpointed under
"reference". The EMA teacher (`sdrl.teacher=ema`) averages the trainable leaves only and is the student's frozen base
with them. `sdrl.reference_memory=host` is refused with adapters (`check_config`): there is no copy to move.

The reference is the base without any adapters. When `checkpoint.init_from` is an adapted stage-1 run's params,
`dgemma.train.lora_init` folds that run's adapters into the base first, so the reference is the stage-1 model; only
params holding non-zero adapter leaves without recorded settings (saved by hand) start with trained adapters, and the
session warns (`trained_adapters`): the KL then pulls toward the model without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from dgemma.model.lora import adapters_disabled

if TYPE_CHECKING:
    from dgemma.config import RunConfig

__all__ = ["AdapterReference", "adapters_off_graphdef", "base_params", "check_config"]


def check_config(cfg: RunConfig) -> None:
    """One-line refusal of settings that have no meaning with adapters (before anything is written; whether the run
    trains adapters is the adaptation's answer, `dgemma.train.adaptation`)."""
    from dgemma.train.adaptation import adaptation_for

    if adaptation_for(cfg).trains_adapters and cfg.sdrl.reference_memory != "device":
        raise ValueError(f"sdrl.reference_memory={cfg.sdrl.reference_memory}: with lora.rank={cfg.lora.rank} the KL "
                         f"reference is the student's own frozen base with the adapters off (no copy to move); set "
                         f"sdrl.reference_memory=device")


def base_params(params: Any) -> Any:
    """`params` (an `nnx.State`) without its adapter leaves (`nnx.LoRAParam`): the same arrays, no copy."""
    return params.filter(nnx.Not(nnx.LoRAParam))


def adapters_off_graphdef(graphdef: nnx.GraphDef, params: Any) -> nnx.GraphDef:
    """The graph of `nnx.merge(graphdef, params)` with its adapters disabled; it merges with `base_params(params)`.
    `params` may be abstract (ShapeDtypeStructs): nothing is computed or allocated."""
    from dgemma.train.state import split_params

    model = nnx.merge(graphdef, params)
    with adapters_disabled(model):
        return split_params(model)[0]


def _join(path) -> str:
    return "/".join(str(p) for p in path)


class AdapterReference:
    """The reference / teacher views of a student with adapters (module docstring)."""

    def __init__(self, cfg: RunConfig, graphdef: nnx.GraphDef, abstract_params: Any):
        from dgemma.train.lora_setup import optim_section
        from dgemma.train.optim import frozen_flags, param_paths

        self.graphdef = adapters_off_graphdef(graphdef, abstract_params)  # the reference's (and frozen teacher's)
        flags = frozen_flags(abstract_params, tuple(optim_section(cfg).freeze))
        self.trainable_paths = frozenset(p for p, f in zip(param_paths(abstract_params), flags) if not f)

    def _is_trainable(self, path, _value=None) -> bool:
        return _join(path) in self.trainable_paths

    def _is_kept(self, path, value) -> bool:
        return self._is_trainable(path) and not isinstance(value, nnx.LoRAParam)

    def trainable(self, params: Any) -> Any:
        """The trainable leaves of `params` (adapters + what `lora.train_*` names): a view, no copy."""
        return params.filter(self._is_trainable)

    def kept(self, params: Any) -> Any:
        """The trainable non-adapter leaves of `params` (a view; abstract params give the checkpoint target)."""
        return params.filter(self._is_kept)

    def start(self, params: Any) -> Any:
        """A copy of the trainable non-adapter leaves at the start: the reference's own values of them."""
        return jax.tree.map(jnp.copy, self.kept(params))

    def reference_params(self, params: Any, kept: Any) -> Any:
        """The adapters-off base (`self.graphdef`'s state): `params`' frozen leaves, `kept`'s start values."""
        base = base_params(params)
        return nnx.merge_state(base, kept) if jax.tree.leaves(kept) else base

    @staticmethod
    def with_trainable(params: Any, trainable: Any) -> Any:
        """`params` with `trainable`'s leaves in place of its own (the EMA teacher over the shared frozen base)."""
        return nnx.merge_state(params, trainable)

    @staticmethod
    def trained_adapters(params: Any) -> bool:
        """Whether any adapter of `params` changes the model (a non-zero B: the run starts from trained adapters)."""
        return any(bool(jnp.any(v[...] != 0)) for p, v in nnx.to_flat_state(params.filter(nnx.LoRAParam))
                   if str(p[-1]) == "b")

    @staticmethod
    def held_bytes(tree: Any) -> int:
        """Bytes of the arrays a session holds for the reference (`start`'s copy): 0 with the default settings."""
        return sum(int(x.nbytes) for x in jax.tree.leaves(tree)) if tree is not None else 0

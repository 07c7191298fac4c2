"""Adapters (`lora.rank > 0`) in the planner: what changes in a plan when only low-rank adapters train.

    spec = spec_from_config(cfg)          # spec.lora = cfg.lora.spec(), spec.optim = the optim section + lora freeze
    plan = plan_for(spec)                 # planner.state_bytes counts the adapted model (`adapted_abstract_model`)
    terms = lora_terms(spec)              # adapter params, their bytes per device, the SD·RL reference / EMA bytes

Memory per device with adapters (`dgemma.train.lora_setup`, `dgemma.model.lora`):

    params       the frozen base in model.execution.param_dtype (bfloat16 in the shipped LoRA configs) + the adapters
                 in lora.param_dtype (float32), each sharded like its base weight
    grads        the trainable parameters only: the adapters (+ the routers / the embedding when lora.train_router /
                 lora.train_embeddings); the base has none (`optim.freeze` gains the lora freeze regex)
    optimizer    AdamW's two moments of the trainable parameters only (`optax.set_to_zero` holds no state for the base)
    activations  as without adapters (the base's backward still runs for the input gradients; the rank-r
                 intermediates are r / H of one layer's hidden states and are not counted)

SD·RL (`dgemma.planning.sdrl_plan`): the KL reference and the frozen teacher are the student's own base with the
adapters off (`dgemma.train.sdrl.lora_reference`), so the resident reference is only the start values of what trains
beside the adapters (0 with the defaults), and the EMA teacher (`sdrl.teacher=ema`) holds the trainable leaves only.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["adapted_abstract_model", "adapter_param_count", "lora_terms", "sdrl_reference_bytes"]


def adapted_abstract_model(model: Any, lora: Any) -> Any:
    """The shape-only model with `lora`'s adapters attached (nothing allocated); `lora` is a `LoraSpec`."""
    from flax import nnx

    from dgemma.model.lora import attach_adapters
    from dgemma.model.transformer import Transformer

    def build():
        m = Transformer(model, rngs=nnx.Rngs(0))
        attach_adapters(m, lora, nnx.Rngs(1))
        return m

    return nnx.eval_shape(build)


def adapter_param_count(model: Any, lora: Any) -> int:
    """Parameters of the adapters alone (every A and B)."""
    return lora_terms_for(model, lora, "fsdp", (), ())["adapter_params"]


def lora_terms(spec: Any) -> dict[str, int]:
    """For a `PlanSpec` with `spec.lora`: adapter_params (count), adapter_bytes / trainable_bytes / kept_bytes per
    device (kept: trainable parameters that are not adapters, whose start values the SD·RL reference keeps)."""
    freeze = tuple(spec.optim.freeze) if spec.optim is not None else ()
    return lora_terms_for(spec.model, spec.lora, spec.rules, tuple(sorted((str(k), int(v)) for k, v in
                                                                           spec.mesh.items())), freeze)


@functools.lru_cache(maxsize=16)
def lora_terms_for(model: Any, lora: Any, rules: str, mesh_items: tuple, freeze: tuple) -> dict[str, int]:
    import jax
    import numpy as np
    from flax import nnx

    from dgemma.parallel.checks import spec_shard_count
    from dgemma.parallel.rules import get_rules, logical_to_spec
    from dgemma.train.optim import frozen_flags

    mesh = dict(mesh_items)
    params = nnx.state(adapted_abstract_model(model, lora), nnx.Param)
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    flags = frozen_flags(params, freeze) if freeze else (False,) * len(leaves)  # both in jax.tree.leaves order
    rules_map = get_rules(rules)
    out = {"adapter_params": 0, "adapter_bytes": 0, "trainable_bytes": 0, "kept_bytes": 0}
    for v, frozen in zip(leaves, flags):
        axes = tuple(v.get_metadata().get("axes") or (None,) * len(v.shape))
        shards = spec_shard_count(logical_to_spec(axes, rules_map, tuple(mesh)), mesh) if mesh else 1
        n = int(np.prod(v.shape, dtype=np.int64))
        per_dev = -(-n * np.dtype(v.dtype).itemsize // shards)
        adapter = isinstance(v, nnx.LoRAParam)
        if adapter:
            out["adapter_params"] += n
            out["adapter_bytes"] += per_dev
        if not frozen:
            out["trainable_bytes"] += per_dev
            out["kept_bytes"] += 0 if adapter else per_dev
    return out


def sdrl_reference_bytes(spec: Any) -> tuple[int, int]:
    """(resident reference bytes, EMA teacher bytes) per device of SD·RL with adapters (module docstring)."""
    t = lora_terms(spec)
    return t["kept_bytes"], t["trainable_bytes"]

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
    activations  the base's as without adapters (its backward still runs for the input gradients), plus the
                 adapters' own (`lora_activation_bytes`, the plan's `lora_activations` term)

SD·RL (`dgemma.planning.sdrl_plan`): the KL reference and the frozen teacher are the student's own base with the
adapters off (`dgemma.train.sdrl.lora_reference`), so the resident reference is only the start values of what trains
beside the adapters (0 with the defaults), and the EMA teacher (`sdrl.teacher=ema`) holds the trainable leaves only.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any, NamedTuple

__all__ = ["AdapterShape", "adapted_abstract_model", "adapter_param_count", "adapter_shapes", "lora_activation_bytes",
           "lora_activation_parts", "lora_activation_split", "lora_saved_dot_bytes", "lora_terms",
           "sdrl_reference_bytes"]


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


# MARK: the adapters' activations ----------------------------------------------------------------------------------
# What autodiff keeps of an adapted matmul y = x.W + scale * (x.A).B (`dgemma.model.lora.LowRank.delta`; the experts'
# grouped form `dgemma.model.lora_experts.with_adapters`), read in `jax.ad_checkpoint` saved residuals of the stage-1
# loss (tests/planning/test_plan_lora_activations.py):
#   low = x.A         [rows, r] in the activation dtype: dB's operand. rows = tokens (dense), tokens x k (experts).
#   the sum y + delta replaces y as the residual downstream: no extra bytes; x is the base matmul's own input.
#   A, B cast to the activation dtype (lora.param_dtype float32, activations bfloat16): the casts are residuals too,
#                     once per layer and per differentiated pass over the stack (two with self_cond_pass=noisy_stream:
#                     the clean and the noisy stream), sharded like the adapter.
#   with lora.dropout > 0 the dropped input [rows, in], its keep mask (1 byte per element) and a second
#                     [rows, in] value of the mask's select (jnp.where's linearisation), per adapter (each has its
#                     own key: q, k and v drop their shared input independently).
# remat=save_dots keeps the outputs of dots without batch dims: low and (low).B [rows, out] of every dense adapter;
# the experts' grouped matmuls are ragged dots (or kernels), not saved. The self-conditioning MLP runs before the
# stack, outside any remat, over the noisy stream (R tokens per example). Under moe_lowering=dense (XLA:CPU's and
# XLA:GPU's ragged_dot) each expert adapter's rank-r rows are also expanded to one slab per expert, for the B matmul
# and its transpose: E x rows x 2r per token, in the form of the base's `moe` term (an estimate, not measured).


class AdapterShape(NamedTuple):
    """One adapter as the planner counts it: `group` is "layers/<i>" or "self_conditioning"."""

    group: str
    expert: bool  # on the experts' grouped matmuls (rows = tokens x k)
    width_in: int
    width_out: int
    rank: int
    device_elements: int  # A + B elements per device (sharded like the base weight)


def adapter_shapes(model: Any, lora: Any, rules: str, mesh_items: tuple) -> tuple[AdapterShape, ...]:
    """Every adapter of the per-layer (unscanned) model, in model order."""
    model = model.with_execution(dtype="float32", attention_impl="dense", remat="none", moe_impl="auto",
                                 expert_axis="expert", attention_q_chunk=512, attention_kv_chunk=512,
                                 scan_layers=False)
    return _adapter_shapes(model, lora, rules, mesh_items)


@functools.lru_cache(maxsize=16)
def _adapter_shapes(model: Any, lora: Any, rules: str, mesh_items: tuple) -> tuple[AdapterShape, ...]:
    from flax import nnx

    from dgemma.model.lora import LowRank
    from dgemma.parallel.checks import spec_shard_count
    from dgemma.parallel.rules import get_rules, logical_to_spec

    mesh, rules_map = dict(mesh_items), get_rules(rules)

    def per_device(v) -> int:
        axes = tuple(v.get_metadata().get("axes") or (None,) * len(v.shape))
        shards = spec_shard_count(logical_to_spec(axes, rules_map, tuple(mesh)), mesh) if mesh else 1
        return -(-math.prod(v.shape) // shards)

    out = []
    for path, module in nnx.iter_modules(adapted_abstract_model(model, lora)):
        if not isinstance(module, LowRank):
            continue
        name = "/".join(str(p) for p in path)
        group = re.match(r"(layers/\d+|self_conditioning)/", name)
        if group is None:
            raise ValueError(f"lora: adapter {name} is in no layer and not the self-conditioning MLP: not planned")
        a, b = module.a, module.b
        lead = len(a.shape) - module.n_in - 1  # the experts axis (the model is unscanned)
        out.append(AdapterShape(group.group(1), lead == 1, math.prod(a.shape[lead:-1]), math.prod(b.shape[lead + 1:]),
                                int(a.shape[-1]), per_device(a) + per_device(b)))
    return tuple(out)


def _rows_per_token(spec: Any, shape: AdapterShape) -> tuple[int, int]:
    """(rows per token, expert slabs under the dense ragged_dot lowering) of an adapter."""
    if not shape.expert:
        return 1, 0
    from dgemma.model.moe_ep import ep_rows_per_token
    from dgemma.planning.expert_parallel import ep_axis_size

    m = spec.model
    ep = ep_axis_size(m, dict(spec.mesh))
    k, E = m.top_k_experts, m.num_experts
    rows = k if ep is None else ep_rows_per_token(k, E, ep)
    return rows, (E if ep is None else E // ep) if spec.moe_lowering == "dense" else 0


def _mesh_items(spec: Any) -> tuple:
    return tuple(sorted((str(k), int(v)) for k, v in spec.mesh.items()))


def lora_activation_parts(spec: Any, a: int) -> dict[str, Any]:
    """Per-example and per-device pieces of the adapters' activations (module notes above), for one micro-batch:
    kept_token {group: bytes per token kept without remat}, saved_token {group: bytes per token remat=save_dots
    keeps}, casts {group: per-device bytes of one pass's adapter casts}, tokens {group: tokens per example},
    passes (differentiated passes over the stack)."""
    import numpy as np

    from dgemma.train.objectives import get_objective

    lora, m = spec.lora, spec.model
    objective = get_objective(spec.objective)
    cast = a if np.dtype(lora.param_dtype) != np.dtype(m.execution.dtype) else 0  # a no-op cast keeps nothing
    drop = lora.dropout > 0
    parts: dict[str, Any] = {"kept_token": {}, "saved_token": {}, "casts": {}, "tokens": {},
             "passes": 2 if (objective.self_conditioning_pass and spec.self_conditioning_pass
                             and spec.self_cond_pass == "noisy_stream") else 1}
    for s in adapter_shapes(m, lora, spec.rules, _mesh_items(spec)):
        rows, slabs = _rows_per_token(spec, s)
        kept = rows * (s.rank * a + (s.width_in * (2 * a + 1) if drop else 0)) + slabs * rows * 2 * s.rank * a
        saved = 0 if s.expert else rows * (s.rank + s.width_out) * a  # ragged dots are not dots: recomputed
        g = s.group
        parts["kept_token"][g] = parts["kept_token"].get(g, 0) + kept
        parts["saved_token"][g] = parts["saved_token"].get(g, 0) + saved
        parts["casts"][g] = parts["casts"].get(g, 0) + s.device_elements * cast
        parts["tokens"][g] = (spec.tokens_per_example if g != "self_conditioning"
                              else spec.response_len if objective.layout == "one_pass" else 0)
    return parts


def lora_activation_split(spec: Any, a: int, examples: float) -> tuple[int, int]:
    """(kept, recomputed): bytes per device of the adapters' own activations at the start of the backward, for
    `examples` per device in the micro-batch, under the model's remat (`spec.remat`), with the neighbouring terms'
    conventions (`dgemma.planning.planner.activation_bytes`). kept: what autodiff holds across the whole backward
    (remat=none: every layer's; save_dots: every layer's saved dots; the self-conditioning MLP's under every policy,
    it runs outside the remat); recomputed: the largest layer's while it is rematerialised (full / block / offload /
    save_dots, as `recomputed_block`)."""
    p = lora_activation_parts(spec, a)
    layer_groups = [g for g in p["kept_token"] if g != "self_conditioning"]

    def kept(g: str) -> float:  # one group's intermediates and one pass's casts, remat=none
        return examples * p["tokens"][g] * p["kept_token"][g] + p["casts"][g]

    held = kept("self_conditioning") if "self_conditioning" in p["kept_token"] else 0.0
    recomputed = 0.0
    if spec.remat == "none":
        held += sum(kept(g) for g in layer_groups) + (p["passes"] - 1) * sum(p["casts"][g] for g in layer_groups)
    elif layer_groups:
        recomputed = max(kept(g) for g in layer_groups)
        if spec.remat == "save_dots":
            held += examples * sum(p["tokens"][g] * p["saved_token"][g] for g in layer_groups)
    return int(held), int(recomputed)


def lora_activation_bytes(spec: Any, a: int, examples: float) -> int:
    """The plan's `lora_activations` term: kept + recomputed of `lora_activation_split`."""
    return sum(lora_activation_split(spec, a, examples))


def lora_saved_dot_bytes(spec: Any, a: int) -> int:
    """Bytes per token and example of every layer's adapter dots that save_dots keeps (and offload moves to host)."""
    p = lora_activation_parts(spec, a)
    return sum(v for g, v in p["saved_token"].items() if g != "self_conditioning")

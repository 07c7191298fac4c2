"""Expert-parallel MoE terms of a plan: collective bytes per step and transient expert weights, per device.

    terms = ep_plan_terms(spec)      # None when the plan's MoE does not dispatch with expert parallelism

The formulas live beside the dispatch they describe (`dgemma.model.moe_ep`, checked against the compiled HLO by
experiments/bench_moe_ep.py); this module applies them to a `PlanSpec`. Passes per optimizer step and micro-batch:
one forward + backward; the forward again under any remat policy (the dispatch's gathers are not dots, so even
save_dots recomputes them); one more gradient-free forward for stage 1's self-conditioning pass. Stored expert
weights, their gradients and optimizer state are already in the planner's state bytes (they follow the rules);
`gathered_expert_bytes` is the extra transient of one layer's local experts at full width.
"""

from __future__ import annotations

import math
from typing import Any

from dgemma.model.moe import choose_dispatch
from dgemma.model.moe_ep import ep_collective_bytes, ep_expert_weight_bytes
from dgemma.train.objectives import get_objective

__all__ = ["ep_axis_size", "ep_plan_terms", "moe_dispatch"]


def moe_dispatch(model: Any, mesh: dict) -> str:
    """"ep", "sharded" or "local": what `dgemma.model.moe.Experts.dispatch` picks on this mesh (the same rule)."""
    return choose_dispatch(model.execution.moe_impl, int(mesh.get(model.execution.expert_axis, 1)),
                           math.prod(int(v) for v in mesh.values()))


def ep_axis_size(model: Any, mesh: dict) -> int | None:
    """Size of the axis the MoE dispatches over under `model.execution.moe_impl`, or None when it runs a single-sort
    path (per device or over the array's tokens)."""
    if moe_dispatch(model, mesh) != "ep":
        return None
    return int(mesh.get(model.execution.expert_axis, 1))


def ep_plan_terms(spec: Any) -> dict[str, Any] | None:
    """{axis, ep, tokens_per_device, per_layer (bytes by collective, one micro-batch forward + backward),
    collective_bytes_per_step, gathered_expert_bytes} for one device, or None without expert parallelism."""
    m = spec.model
    ep = ep_axis_size(m, dict(spec.mesh))
    if ep is None:
        return None
    devices = math.prod(int(v) for v in spec.mesh.values())
    micro_batch = spec.global_batch / spec.grad_accum_steps
    n = math.ceil(micro_batch * spec.tokens_per_example / devices)  # the dispatch pads tokens to the device count
    a = 4 if m.execution.dtype == "float32" else 2
    per_layer = ep_collective_bytes(tokens_per_device=n, hidden_size=m.hidden_size, top_k=m.top_k_experts, ep=ep,
                                    act_bytes=a)
    forward = sum(v for k, v in per_layer.items() if k.startswith("fwd_"))
    backward = sum(v for k, v in per_layer.items() if k.startswith("bwd_"))
    sc_pass = 0.0
    if get_objective(spec.objective).self_conditioning_pass and spec.self_conditioning_pass:  # moves R of T tokens
        sc_pass = spec.response_len / spec.tokens_per_example if spec.self_cond_pass == "noisy_stream" else 1.0
    forwards = 1 + (spec.remat != "none") + sc_pass
    per_step = m.num_hidden_layers * spec.grad_accum_steps * (forwards * forward + backward)
    b = 4 if m.execution.param_dtype == "float32" else 2
    weights = ep_expert_weight_bytes(num_experts=m.num_experts, hidden_size=m.hidden_size,
                                     moe_intermediate_size=m.moe_intermediate_size, ep=ep, other_shards=1,
                                     param_bytes=b)
    return {"axis": m.execution.expert_axis, "ep": ep, "tokens_per_device": n, "per_layer": per_layer,
            "forward_passes": forwards, "collective_bytes_per_step": per_step,
            "gathered_expert_bytes": weights["gathered"]}

"""Memory and FLOPs planner: will a training run fit its accelerators? (`dgemma plan`, and `dgemma launch` before
submitting.) Everything here is arithmetic on abstract shapes; nothing is allocated. See docs/planner.md.

Per-device bytes, for a model + mesh + rules + batch:

    params       sum over parameters of bytes / (product of the mesh axes its PartitionSpec uses)
    grads        the same over *trainable* parameters (frozen ones, `optim.freeze`, get no gradient buffer); x2 with
                 gradient accumulation (the accumulator plus the current micro-batch's gradients); plus one more
                 buffer for a trainable tied embedding (its lookup and LM-head gradients are materialised separately
                 before they are summed)
    optimizer    `jax.eval_shape` of the real optimizer (`build_optimizer(cfg.optim)`): AdamW keeps 2 moments per
                 trainable parameter in the parameter dtype (fp32); Adafactor keeps factored row/column statistics
                 (plus momentum when b1 > 0); moments are sharded like their parameter, other leaves replicated
    activations  see `activation_bytes` (what the backward pass keeps alive, per micro-batch)

The verdict compares the total with `usable_fraction` (0.9) of the accelerator's HBM: the rest is left to the XLA
runtime, collectives buffers and fragmentation.

FLOPs per optimizer step: `dgemma.planning.flops`."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping

from dgemma.model.config import SLIDING, ModelConfig
from dgemma.planning.accelerators import GiB, Accelerator
from dgemma.planning.expert_parallel import ep_axis_size, ep_plan_terms, moe_dispatch
from dgemma.planning.flops import active_params, skips_masked_tiles, step_flops
from dgemma.planning.layer_bytes import HEAD_PHASE_FREED, MOE_BACKWARD_SLOT_ROWS, head_backward_bytes
from dgemma.planning.layer_bytes import per_layer_input_bytes
from dgemma.planning.layer_bytes import flash_memory as _flash_memory
from dgemma.planning.layer_bytes import layer_token_bytes as _layer_token_bytes
from dgemma.planning.layer_bytes import saved_dot_bytes as _saved_dot_bytes
from dgemma.planning.lora_plan import lora_activation_bytes, lora_saved_dot_bytes
from dgemma.train.objectives import get_objective

__all__ = ["Plan", "PlanSpec", "activation_bytes", "estimate", "state_bytes"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanSpec:
    """What the planner needs (built from a RunConfig by `dgemma.planning.plan_config.spec_from_config`)."""

    model: ModelConfig
    rules: str
    mesh: Mapping[str, int]  # resolved axis sizes (ici x dcn)
    global_batch: int  # examples per optimizer step
    prompt_len: int
    response_len: int  # n_blocks x canvas_length
    objective: str = "stage1"  # a name of dgemma.train.objectives.REGISTRY (rollouts: dgemma.planning.sdrl_plan)
    self_conditioning_pass: bool = True  # stage 1 with p_self_cond > 0
    self_cond_pass: str = "full"  # diffusion.self_cond_pass: full (whole layout again) | noisy_stream (R tokens)
    grad_accum_steps: int = 1
    optim: Any = None  # an OptimSection (None: AdamW defaults, nothing frozen)
    remat: str = "none"  # the model's policy (model.execution.remat): none | full (= block) | save_dots | offload
    # ragged: a grouped-matmul kernel | dense: XLA:CPU / XLA:GPU expand ragged_dot over every expert (E x the expert
    # work) | dense_compute: libtpu's ragged_dot, masked dense dots inside fusions (dense FLOPs, ragged memory);
    # spec_from_config picks it (accelerator, model.execution.moe_kernel)
    moe_lowering: str = "ragged"
    accelerator: Accelerator | None = None
    usable_fraction: float = 0.9
    ce_chunk: int = 256
    sdrl: Any = None  # stage 2 only: a `dgemma.planning.sdrl_plan.SDRLShape` (group size, step limits, minibatches)
    devices_per_node: int = 0  # devices one host (node) drives (0: the accelerator's devices per host)
    node_ram_gib: float | None = None  # RAM of one node (None: the accelerator table's)
    lora: Any = None  # a LoraSpec (lora.rank > 0): adapters on a frozen base, dgemma.planning.lora_plan

    @property
    def num_devices(self) -> int:
        return math.prod(int(v) for v in self.mesh.values())

    @property
    def tokens_per_example(self) -> int:
        """Sequence length of one forward: the one-pass layout P + 2R for stage 1 (and the SD·RL replay), P + R for
        AR."""
        r = self.response_len
        return get_objective(self.objective).tokens_per_example(self.prompt_len, r)


@dataclasses.dataclass(frozen=True)
class Plan:
    spec: PlanSpec
    params: int  # per-device bytes
    grads: int
    optimizer: int
    activations: int
    activation_terms: dict[str, int]
    examples_per_device: float  # per micro-batch
    total_params: int  # parameter count
    trainable_params: int
    active_params: int  # per token (top-k experts)
    flops_per_step: float  # global
    model_flops_per_step: float  # 6 * active * tokens (global)
    notes: tuple[str, ...] = ()
    resident: dict[str, int] = dataclasses.field(default_factory=dict)  # other bytes held for the whole step
    phases: dict[str, int] = dataclasses.field(default_factory=dict)  # transients of phases that are not the update
    collective_bytes_per_step: int = 0  # expert-parallel dispatch, sent per device (dgemma.planning.expert_parallel)
    phase_flops: dict[str, float] = dataclasses.field(default_factory=dict)  # SD·RL: FLOPs by phase (global)
    host: dict[str, int] = dataclasses.field(default_factory=dict)  # host (pinned / offloaded) bytes per device

    @property
    def update_bytes(self) -> int:
        """The update's transient: gradients + activations (+ the EP dispatch's gathered expert weights)."""
        return self.grads + self.activations

    @property
    def total(self) -> int:
        """Peak per device: what is always held + the largest phase (the update, or an SD·RL rollout / no-grad
        pass when that is larger)."""
        return (self.params + self.optimizer + sum(self.resident.values())
                + max(self.update_bytes, max(self.phases.values(), default=0)))

    @property
    def usable_bytes(self) -> int | None:
        acc = self.spec.accelerator
        return None if acc is None else int(acc.hbm_gib * GiB * self.spec.usable_fraction)

    @property
    def needed_bytes(self) -> int:
        """Bytes compared with `usable_bytes`: per device, or all devices together when they share host RAM."""
        shared = self.spec.accelerator is not None and self.spec.accelerator.platform == "cpu"
        return self.total * (self.spec.num_devices if shared else 1)

    @property
    def device_fits(self) -> bool | None:
        return None if self.usable_bytes is None else self.needed_bytes <= self.usable_bytes

    @property
    def node_devices(self) -> int:
        """Devices one node drives (all its processes): the launch's, else the accelerator's devices per host."""
        acc = self.spec.accelerator
        per_node = self.spec.devices_per_node or (acc.devices_per_host if acc is not None else 1)
        return min(per_node, self.spec.num_devices)

    @property
    def host_bytes_per_node(self) -> int:
        """Host memory of one node: the per-device host bytes x the devices the node drives."""
        return sum(self.host.values()) * self.node_devices

    @property
    def host_usable_bytes(self) -> int | None:
        """`usable_fraction` of the node's RAM; None without an accelerator, or on CPU (host and devices share it)."""
        acc = self.spec.accelerator
        if acc is None or acc.platform == "cpu" or not self.host:
            return None
        ram = self.spec.node_ram_gib if self.spec.node_ram_gib is not None else acc.node_ram_gib
        return int(ram * GiB * self.spec.usable_fraction)

    @property
    def host_fits(self) -> bool | None:
        usable = self.host_usable_bytes
        return None if usable is None else self.host_bytes_per_node <= usable

    @property
    def fits(self) -> bool | None:
        """The devices fit and, where something is kept on the host, the nodes' RAM does too."""
        return None if self.device_fits is None else self.device_fits and self.host_fits is not False

    def step_seconds_at_peak(self) -> float | None:
        acc = self.spec.accelerator
        return None if acc is None else self.flops_per_step / (acc.bf16_tflops * 1e12 * self.spec.num_devices)


# MARK: static state -------------------------------------------------------------------------------------------------
def state_bytes(model: ModelConfig, rules: str, mesh: Mapping[str, int], optim: Any = None,
                lora: Any = None) -> dict[str, int]:
    """Per-device params / grads / optimizer bytes and parameter counts (abstract shapes only; cached)."""
    if optim is None:
        from dgemma.config.sections import OptimSection

        optim = OptimSection()
    # settings that change no parameter shape or dtype share one cache entry (building the 26B state is slow)
    model = model.with_execution(dtype="float32", attention_impl="dense", remat="none", moe_impl="auto",
                                 expert_axis="expert", attention_q_chunk=512, attention_kv_chunk=512)
    return dict(_state_bytes(model, rules, tuple(sorted((str(k), int(v)) for k, v in mesh.items())), optim, lora))


@functools.lru_cache(maxsize=32)
def _state_bytes(model: ModelConfig, rules: str, mesh_items: tuple, optim: Any, lora: Any = None) -> tuple:
    mesh = dict(mesh_items)
    import jax
    import numpy as np
    from flax import nnx

    from dgemma.parallel.checks import check_model_divisibility, spec_shard_count
    from dgemma.parallel.rules import get_rules, logical_to_spec
    from dgemma.train.optim import build_optimizer, frozen_flags, param_path

    check_model_divisibility(model, mesh, rules)
    rules_map = get_rules(rules)
    params = _abstract_params(model, lora)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    counts = jax.tree.map(lambda v: spec_shard_count(logical_to_spec(tuple(v.get_metadata().get("axes") or
                                                                            (None,) * len(v.shape)), rules_map,
                                                                      tuple(mesh)), mesh), params, is_leaf=is_var)
    leaves = jax.tree.leaves(params, is_leaf=is_var)
    flags = frozen_flags(params, tuple(optim.freeze))
    nbytes = [int(np.prod(v.shape, dtype=np.int64)) * np.dtype(v.dtype).itemsize for v in leaves]
    shards = jax.tree.leaves(counts)
    per_dev = [-(-b // c) for b, c in zip(nbytes, shards)]
    paths = [param_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_var)[0]]
    tied = sum(p for p, f, name in zip(per_dev, flags, paths) if not f and name.startswith("embedder/"))
    out = {"params": sum(per_dev), "grads": sum(p for p, f in zip(per_dev, flags) if not f) + tied, "tied_grads": tied,
           "scanned_grads": sum(p for p, f, name in zip(per_dev, flags, paths)
                                if not f and name.startswith("scan_blocks/")),
           "total_params": sum(int(np.prod(v.shape, dtype=np.int64)) for v in leaves),
           "trainable_params": sum(int(np.prod(v.shape, dtype=np.int64)) for v, f in zip(leaves, flags) if not f)}
    tx = build_optimizer(optim, max(1, optim.warmup_steps)).tx  # only the state's structure is used here
    opt_abstract = jax.eval_shape(tx.init, params)
    acc = [0]

    def param_like(leaf, param, count):
        if getattr(leaf, "shape", None) is None:  # frozen parameter: optax.MaskedNode, no state
            return leaf
        size = int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
        acc[0] += -(-size // count) if tuple(leaf.shape) == tuple(param.shape) else size
        return leaf

    def other(leaf):
        if getattr(leaf, "shape", None) is not None:
            acc[0] += int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
        return leaf

    import optax

    optax.tree_map_params(tx, param_like, opt_abstract, params, counts, transform_non_params=other, is_leaf=is_var)
    out["optimizer"] = acc[0]
    return tuple(out.items())


@functools.lru_cache(maxsize=4)
def _abstract_params(model: ModelConfig, lora: Any = None):
    from flax import nnx

    from dgemma.model.transformer import abstract_model
    from dgemma.planning.lora_plan import adapted_abstract_model

    return nnx.state(abstract_model(model) if lora is None else adapted_abstract_model(model, lora), nnx.Param)


# MARK: activations --------------------------------------------------------------------------------------------------
REMAT = ("none", "block", "full", "save_dots", "offload")


def activation_bytes(spec: PlanSpec) -> tuple[int, dict[str, int], float]:
    """(bytes, breakdown, examples per device) of activations alive at the start of the backward pass.

    Formula (per device, per micro-batch of b = global_batch / grad_accum / (data x fsdp) examples, each a forward
    over T tokens: T = P + 2R in stage 1's one-pass layout [clean stream ; noisy stream], P + R for AR):

      remat=none (no rematerialisation):
        b * T * sum_layers [ (32 + 11a) H  +  q/k/v/ctx terms  +  attention  +  4 a I
                             + k (H (2a + 4) + 4 a I_moe)  +  E (a + 4) ]
        attention = N * T * (4 + 2a) for attention_impl=dense (scores over all keys), N * 4 for chunked (one
        log-sum-exp per query and head; the output is in the q/k/v/ctx terms)
        + masks: b * T * T * 2 bytes (dense: one boolean mask per layer kind) or O(T) (chunked: interval masks)
        + b * T * H * a (embeddings)
        + AR only: b * T * V * 4 * 3 (full fp32 logits, log-softmax and its gradient; stage 1 chunks the CE
          under jax.checkpoint so only b * chunk * V * 4 * 3 is live)
      moe_lowering=dense (how XLA:CPU and XLA:GPU lower ragged_dot; on GPU the default of moe_kernel=xla) adds
        E k (2H + 2 I_moe) a per token and layer: the ragged operands expanded to one dense slab per expert.
      remat=full (= block): each block's input b * T * H * a per layer, plus the largest layer once (recomputed
        during its backward) and the same extras. save_dots: + the weight-matmul outputs of every layer
        (`saved_dot_bytes`). offload: as full on the device (the matmul outputs live in host memory).
      chunked attention adds a transient tile b * N * q_chunk * kv_chunk * 12 bytes (scores, probabilities).
      The sort-based MoE dispatch (ragged lowering, not EP) adds its backward's slot rows for one layer:
        b * T * k * H * a * (MOE_BACKWARD_SLOT_ROWS - 2 - 4/a)   (`moe_dispatch_backward`)
      and moe_impl=sharded with sharded experts one layer's gathered experts: 4 * E * H * I_moe * a.
      Scanned layers (model.execution.scan_layers) keep the same residuals (the scan carries one block input per layer).

    a = bytes of the activation dtype (2 for bf16); H hidden, N heads, I dense MLP width, k top-k experts,
    I_moe expert width, E experts. With dense attention the term N * T^2 dominates at long sequences. The per-layer
    terms follow each member's layers (`dgemma.planning.layer_bytes`: no K/V on KV-shared layers, the double-wide
    MLP, no MoE terms on dense-only members, the per-layer input gate); with per-layer embeddings
    b * T * L * P_ple * (4 + 3a) of per-layer inputs (`per_layer_inputs`) are kept too.
    """
    m = spec.model
    if spec.remat not in REMAT:
        raise ValueError(f"remat={spec.remat!r}: expected one of {REMAT}")
    a = 2 if m.execution.dtype in ("bfloat16", "float16") else 4
    batch_axes = math.prod(int(spec.mesh.get(x, 1)) for x in ("data", "fsdp"))
    b = spec.global_batch / spec.grad_accum_steps / batch_axes
    T = spec.tokens_per_example
    dense = spec.moe_lowering == "dense"
    moe = m.enable_moe_block  # dense-only members (E2B, E4B, 31B) have no experts, router or dispatch
    ep = ep_axis_size(m, dict(spec.mesh)) if moe else None
    per_layer = [_layer_token_bytes(m, i, T, a, dense, ep) for i in range(m.num_hidden_layers)]
    layer_totals = [sum(d.values()) * T for d in per_layer]  # per example
    terms: dict[str, float] = {}
    if spec.remat == "none":
        for d in per_layer:
            for k, v in d.items():
                terms[k] = terms.get(k, 0.0) + v * T * b
    else:
        terms["block_inputs"] = m.num_hidden_layers * T * m.hidden_size * a * b
        if spec.remat == "save_dots":
            terms["saved_dots"] = sum(_saved_dot_bytes(m, i, a) for i in range(m.num_hidden_layers)) * T * b
        terms["recomputed_block"] = max(layer_totals) * b
    if skips_masked_tiles(m):
        terms["masks"] = 64 * T * b
        terms["attention_tile"] = (m.num_attention_heads * m.execution.attention_q_chunk
                                   * m.execution.attention_kv_chunk * 12 * b)
    else:  # dense: one boolean [T, T] mask per layer kind; Tokamax takes the same booleans as its kernel input
        terms["masks"] = 2 * T * T * b
    terms["embeddings"] = T * m.hidden_size * a * b
    if m.hidden_size_per_layer_input:  # the per-layer inputs [T, L, P], made before the stack (outside any remat)
        terms["per_layer_inputs"] = T * per_layer_input_bytes(m, a) * b
    if ep is not None:  # one layer's local experts gathered to full width while it runs (0 when already whole)
        terms["ep_gathered_experts"] = _ep_gathered_extra(m, spec.rules, dict(spec.mesh), ep)
    elif moe and moe_dispatch(m, dict(spec.mesh)) == "sharded" and _expert_shards(spec.rules, dict(spec.mesh)) > 1:
        # the per-device dispatch gathers one layer's experts whole in the activation dtype; the backward holds the
        # three gathered tensors and one cotangent at a time, each summed back to the shards as it is made (four
        # [E, H, I] bf16 buffers at the TPU compile's peak, docs/planner_compile.md)
        terms["sharded_gathered_experts"] = (3 + 1) * m.num_experts * m.hidden_size * m.moe_intermediate_size * a
    if moe and ep is None and not dense and m.num_experts > 1:
        # the sort dispatch's backward (ragged lowering): the sorted / unsorted slot rows [b T k, H], their
        # cotangents, the take/select masks and the fp32 combine are alive together while one layer's MoE is
        # differentiated. The TPU compile's live ranges hold ~24 slot rows of H activation-dtype bytes per slot at
        # its peak; `moe` in the layer terms counts 2 + 4/a of them, the rest is this term.
        rows = MOE_BACKWARD_SLOT_ROWS - (2 + 4 / a)
        terms["moe_dispatch_backward"] = b * T * m.top_k_experts * m.hidden_size * a * rows
    objective = get_objective(spec.objective)
    if objective.self_conditioning_pass and spec.self_conditioning_pass and spec.self_cond_pass == "noisy_stream":
        # the clean stream's keys and values, read by both noisy passes, live until the backward (split_streams)
        kv = sum(2 * m.layer_kv_heads(i) * m.layer_head_dim(i) for i in range(m.num_hidden_layers)
                 if m.kv_producer(i) is None)  # KV-shared layers read their producer's
        terms["clean_stream_kv"] = b * (spec.prompt_len + spec.response_len) * kv * a
    positions = T if objective.layout == "ar" else min(spec.ce_chunk, T)
    terms["logits"] = positions * m.vocab_size * 4 * 3 * b
    if spec.lora is not None:  # the adapters' rank-r intermediates, saved dots and weight casts
        terms["lora_activations"] = lora_activation_bytes(spec, a, b)
    out = {k: int(v) for k, v in terms.items()}
    return sum(out.values()), out, b


def _expert_shards(rules: str, mesh: dict) -> int:
    """Devices one expert weight tensor [E, H, I] is split over under `rules`."""
    from dgemma.parallel.checks import spec_shard_count
    from dgemma.parallel.rules import get_rules, logical_to_spec

    return spec_shard_count(logical_to_spec(("exp", "embed", "exp_mlp"), get_rules(rules), tuple(mesh)), mesh)


def _ep_gathered_extra(m: ModelConfig, rules: str, mesh: dict, ep: int) -> int:
    """Bytes of one layer's local experts at full width beyond the stored shard (FSDP on `embed` under the `ep`
    preset; nothing under `experts_on_fsdp` with `execution.expert_axis=fsdp`, where each shard is whole experts)."""
    from dgemma.model.moe_ep import ep_expert_weight_bytes

    other = max(1, _expert_shards(rules, mesh) // ep)
    w = ep_expert_weight_bytes(num_experts=m.num_experts, hidden_size=m.hidden_size,
                               moe_intermediate_size=m.moe_intermediate_size, ep=ep, other_shards=other,
                               param_bytes=4 if m.execution.param_dtype == "float32" else 2)
    return w["gathered"] - w["stored"] if other > 1 else 0


def estimate(spec: PlanSpec) -> Plan:
    """The plan for `spec` (module docstring)."""
    from dgemma.parallel.checks import check_batch_divisibility, check_model_divisibility

    if get_objective(spec.objective).rollouts:
        raise ValueError(f"objective={spec.objective}: plan stage 2 with dgemma.planning.sdrl_plan.estimate_sdrl")
    check_model_divisibility(spec.model, spec.mesh, spec.rules)
    check_batch_divisibility(spec.global_batch, spec.mesh, spec.rules, grad_accum_steps=spec.grad_accum_steps)
    static = state_bytes(spec.model, spec.rules, spec.mesh, spec.optim, spec.lora)
    act, terms, b = activation_bytes(spec)
    grads = static["grads"] * (2 if spec.grad_accum_steps > 1 else 1)
    flops, model_flops = step_flops(spec)
    notes, ep = _moe_notes(spec) if spec.model.enable_moe_block else ([], None)
    if spec.remat != spec.model.execution.remat:
        notes.append(f"remat={spec.remat} is a what-if (config: model.execution.remat={spec.model.execution.remat})")
    if not _flash_memory(spec.model) and spec.tokens_per_example > 2048:
        notes.append("model.execution.attention_impl=dense materialises [T, T] scores per layer; chunked does not")
    if spec.optim is not None and spec.optim.freeze:
        notes.append(f"frozen (no grads / optimizer state): {list(spec.optim.freeze)}")
    return Plan(spec=spec, params=static["params"], grads=grads, optimizer=static["optimizer"], activations=act,
                activation_terms=terms, examples_per_device=b, total_params=static["total_params"],
                trainable_params=static["trainable_params"], active_params=active_params(spec.model),
                flops_per_step=flops, model_flops_per_step=model_flops, notes=tuple(notes),
                collective_bytes_per_step=0 if ep is None else int(ep["collective_bytes_per_step"]),
                host=_offloaded_bytes(spec, b), phases=_head_phase(spec, static, grads, terms, b))


def _head_phase(spec: PlanSpec, static: dict, grads: int, terms: dict, b: float) -> dict[str, int]:
    """{"loss_head_backward": bytes} when the chunked loss head trains an FSDP-sharded tied table: the gradients,
    the activations the layers keep for their backward and `head_backward_bytes` (the table gathered, its gradient
    whole); {} otherwise (one device, a frozen table or adapters, the unchunked AR loss, GPUs: not measured)."""
    m = spec.model
    table = m.vocab_size * m.hidden_size * (4 if m.execution.param_dtype == "float32" else 2)
    measured = spec.accelerator is not None and spec.accelerator.platform == "tpu"  # the TPU compiler's partitioning
    if (not measured or get_objective(spec.objective).layout == "ar" or spec.lora is not None
            or not static["tied_grads"] or static["tied_grads"] * 2 > table):  # table whole on a device: no gather
        return {}
    a = 2 if m.execution.dtype in ("bfloat16", "float16") else 4
    kept = sum(v for k, v in terms.items() if k not in HEAD_PHASE_FREED)
    return {"loss_head_backward": int(grads + kept + head_backward_bytes(m, a, b, min(spec.ce_chunk,
                                                                                       spec.tokens_per_example)))}


def _moe_notes(spec: PlanSpec) -> tuple[list[str], dict | None]:
    """The notes on how the MoE lowers and dispatches, and the expert-parallel terms (None without EP)."""
    notes = []
    if spec.moe_lowering == "dense" and spec.accelerator is not None and spec.accelerator.platform == "gpu":
        notes.append("model.execution.moe_kernel=xla on GPU: XLA:GPU expands ragged_dot densely over all experts "
                     "(moe_lowering=dense, deviceless H100 compiles); model.execution.moe_kernel=tokamax|auto does not")
    elif spec.model.execution.moe_kernel == "auto" and spec.accelerator is not None:
        from dgemma.model.kernels import resolve_moe_kernel

        platform = spec.accelerator.platform
        notes.append(f"model.execution.moe_kernel=auto: {resolve_moe_kernel('auto', platform)} on {platform}")
    elif spec.moe_lowering == "dense":
        notes.append("moe_lowering=dense models JAX's CPU ragged_dot fallback (for comparing with CPU compiles)")
    if (spec.accelerator is not None and spec.accelerator.platform == "gpu"
            and spec.model.execution.moe_kernel in ("auto", "tokamax")):
        from dgemma.model.kernels import UNVERIFIED_GPU_MOE

        notes.append(UNVERIFIED_GPU_MOE)
    ep = ep_plan_terms(spec)
    if ep is not None:
        notes.append(f"expert parallel over {ep['axis']} (ep={ep['ep']}): dropless dispatch buffers of "
                     f"ep x min(k, E/ep) rows per token in the MoE term; {ep['forward_passes']:.3g} forward passes")
    elif moe_dispatch(spec.model, dict(spec.mesh)) == "sharded":
        notes.append("per-device MoE dispatch (model.execution.moe_impl=sharded): each device sorts its own tokens; "
                     "one layer's experts gathered whole (sharded_gathered_experts)")
    elif _experts_sharded_over_batch(spec):
        notes.append("single-sort MoE (model.execution.moe_impl=local) with experts sharded over a batch axis: XLA "
                     "gathers the global batch's tokens (not modelled here); moe_impl=sharded dispatches per device")
    return notes, ep


def _offloaded_bytes(spec: PlanSpec, examples: float) -> dict[str, int]:
    """Host bytes per device of remat=offload: every layer's weight-matmul outputs (`_saved_dot_bytes`) of a
    micro-batch live in host memory."""
    if spec.remat != "offload":
        return {}
    m = spec.model
    a = 2 if m.execution.dtype in ("bfloat16", "float16") else 4
    per_token = sum(_saved_dot_bytes(m, i, a) for i in range(m.num_hidden_layers))
    per_token += lora_saved_dot_bytes(spec, a) if spec.lora is not None else 0
    return {"offloaded_activations": int(examples * spec.tokens_per_example * per_token)}


def _experts_sharded_over_batch(spec: PlanSpec) -> bool:
    from dgemma.parallel.rules import get_rules

    target = get_rules(spec.rules).get("exp")
    targets = target if isinstance(target, tuple) else (target,)
    return any(t in ("data", "fsdp") and int(spec.mesh.get(t, 1)) > 1 for t in targets)

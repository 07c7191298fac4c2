"""The planner on a RunConfig: build the `PlanSpec`, print the report, and validate it against XLA.

    spec = spec_from_config(cfg, devices=8, accelerator="h100")
    plan = estimate(spec)                        # dgemma.planning.planner
    print(format_plan(plan))
    report = compiled_memory(cfg, spec)          # the real train step, compiled on simulated CPU devices

`compiled_memory` lowers and compiles the exact train step `dgemma.train.trainer.train` runs (same optimizer, shardings,
loss and batch layout) against abstract inputs, so nothing is allocated; it needs as many local devices as the
mesh has (`jax_num_cpu_devices` / `--xla_force_host_platform_device_count`). Its `memory_analysis()` is per device:
arguments (params + optimizer state + batch), outputs (aliased with the donated state) and temporaries (gradients +
activations + transients). CPU XLA fuses differently from GPU/TPU XLA, so it validates the estimate's order of
magnitude and its terms, not the last percent.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from dgemma.planning.accelerators import Accelerator, GiB, get_accelerator
from dgemma.planning.planner import Plan, PlanSpec, estimate
from dgemma.train.objectives import get_objective

if TYPE_CHECKING:
    from dgemma.config import MeshSection, RunConfig
    from dgemma.data.config import DataConfig

__all__ = ["CompiledReport", "abstract_batch_shapes", "compiled_memory", "format_plan", "plan_for",
           "spec_from_config"]


def spec_from_config(cfg: RunConfig, *, devices: int | None = None, accelerator: str | None = None,
                     processes: int | None = None, global_batch: int | None = None, slices: int | None = None,
                     remat: str | None = None, rules: str | None = None, devices_per_node: int | None = None,
                     node_ram_gib: float | None = None) -> PlanSpec:
    """A `PlanSpec` for a RunConfig on `devices` accelerators (default: the mesh's fixed size).

    Global batch: `global_batch`, else `data.batch_size` (the global batch, whatever the process count; processes
    default to one per host: devices / the accelerator's devices per host). It must split over the processes and the
    batch axes; `trainer.grad_accum_steps=0` derives the accumulation (`dgemma.parallel.checks.batch_layout`).
    """
    from dgemma.parallel.checks import batch_layout, check_global_batch, check_model_divisibility
    from dgemma.parallel.mesh import resolve_mesh_shape
    from dgemma.train.lora_setup import optim_section  # lora: the optim section + the adapters' freeze regex

    for name, value in (("devices", devices), ("processes", processes), ("global_batch", global_batch),
                        ("slices", slices)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"planner {name}={value!r}: must be a positive integer")
    acc = get_accelerator(accelerator) if accelerator else None
    if devices is None:
        devices = cfg.mesh.axis_size(*cfg.mesh.axes)
        if devices is None:
            raise ValueError("the mesh has an auto (-1) axis: pass the device count (--devices N)")
    if processes is None:
        processes = max(1, devices // acc.devices_per_host) if acc is not None else 1
    shape = resolve_mesh_shape(dict(cfg.mesh.ici), dict(cfg.mesh.dcn), devices, slices)
    data_layout = cfg.data.layout
    model = cfg.model_config
    sdrl = None
    batch = cfg.data.batch_size if global_batch is None else global_batch
    rollouts = get_objective(cfg.trainer.objective).rollouts
    check_model_divisibility(model, shape.sizes, rules or cfg.mesh.rules)  # before the batch: the mesh's own error
    if rollouts:  # prompts per iteration: the global batch, split over the processes and the batch axes
        check_global_batch(batch, processes, shape.sizes, rules or cfg.mesh.rules,
                           what="the global batch of prompts")
    layout = None if rollouts else batch_layout(batch, processes, shape.sizes, rules or cfg.mesh.rules,
                                                cfg.trainer.grad_accum_steps)
    if rollouts:
        from dgemma.planning.sdrl_plan import SDRLShape

        s = cfg.sdrl
        weights = s.weights()
        q = batch // processes
        sdrl = SDRLShape(prompts_per_process=q, processes=processes, group_size=s.group_size,
                         num_minibatches=s.num_minibatches, inner_epochs=s.inner_epochs,
                         student_steps=cfg.sampler.max_steps, teacher_steps=s.teacher_max_steps(cfg.sampler.max_steps),
                         n_blocks=data_layout.n_blocks, states_per_rollout=s.states_per_rollout,
                         kl=s.kl_estimator if weights.kl else "off",
                         anchor=bool(weights.anchor), ema_teacher=s.teacher == "ema",
                         reference_on_host=s.reference_memory == "host",
                         retention_rows=s.retention_rows if s.retention_mix else 0)
    return PlanSpec(
        model=model, rules=rules or cfg.mesh.rules, mesh=shape.sizes,
        global_batch=batch,
        prompt_len=data_layout.prompt_len, response_len=data_layout.n_blocks * model.canvas_length,
        objective=cfg.trainer.objective, self_conditioning_pass=cfg.diffusion.p_self_cond > 0,
        self_cond_pass=cfg.diffusion.self_cond_pass,
        grad_accum_steps=layout.grad_accum_steps if layout else 1, optim=optim_section(cfg), lora=lora_spec(cfg),
        remat=remat or model.execution.remat,
        accelerator=acc, sdrl=sdrl, moe_lowering=moe_lowering(model, acc), devices_per_node=devices_per_node or 0,
        node_ram_gib=node_ram_gib)


def lora_spec(cfg: RunConfig) -> Any:
    """The run's `LoraSpec` (None without adapters)."""
    lora = getattr(cfg, "lora", None)
    return None if lora is None else lora.spec()


def moe_lowering(model: Any, acc: Accelerator | None) -> str:
    """How the experts' grouped matmul is lowered on `acc` when `model.execution.moe_kernel` resolves to XLA's
    `jax.lax.ragged_dot`:
      "dense" on GPU: XLA:GPU expands ragged_dot densely over every expert, in FLOPs and memory (deviceless H100
        compiles, docs/planner_gpu.md);
      "dense_compute" on TPU: this libtpu expands it into masked dense dots over every expert inside fusions, so the
        FLOPs are E x the routed work but the expanded operands are not materialised and the memory is the ragged
        one (the deviceless v5p-64 compiles of `ragged_dot` in tests/golden/tpu_compiled_memory.json,
        docs/planner_compile.md);
      "ragged" for a Pallas grouped matmul (Tokamax, Megablox; `auto` on GPU and TPU), which is ragged wherever it
        runs, and without an accelerator: simulated CPU devices keep "ragged" here, `dgemma plan --compile` compares
        their compile with a dense plan itself.
    `moe_kernel: dense` (every expert on every token) is "dense" on an accelerator (counted as ragged_dot's expansion
    over the T*k routed rows: k x its T rows, an over-count)."""
    from dgemma.model.kernels import resolve_moe_kernel

    kernel = resolve_moe_kernel(model.execution.moe_kernel, acc.platform) if acc is not None else None
    if kernel == "dense":
        return "dense"
    if kernel != "xla":
        return "ragged"
    assert acc is not None  # kernel is None without an accelerator
    return {"gpu": "dense", "tpu": "dense_compute"}.get(acc.platform, "ragged")


def plan_for(spec: PlanSpec) -> Plan:
    """`estimate(spec)`, or the stage-2 plan (`dgemma.planning.sdrl_plan.estimate_sdrl`) for objective=sdrl."""
    if get_objective(spec.objective).rollouts:
        from dgemma.planning.sdrl_plan import estimate_sdrl

        plan = estimate_sdrl(spec)
    else:
        plan = estimate(spec)
    if spec.moe_lowering == "dense_compute":
        plan = dataclasses.replace(plan, notes=(*plan.notes, (
            "model.execution.moe_kernel=xla on TPU: libtpu expands ragged_dot into masked dense dots over all experts "
            "(FLOPs E x the routed work; memory as ragged, moe_lowering=dense_compute); "
            "model.execution.moe_kernel=megablox|auto does not")))
    return plan


def _gib(n: float) -> str:
    return f"{n / GiB:8.2f} GiB" if n >= GiB else f"{n / 2**20:8.2f} MiB"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.3f}M"


def format_plan(plan: Plan, compiled: CompiledReport | None = None, compiled_plan: Plan | None = None) -> str:
    """The text report; `compiled_plan` is the estimate for what was compiled (CPU: dense MoE lowering)."""
    s = plan.spec
    m = s.model
    mesh = {k: v for k, v in s.mesh.items() if v != 1} or {"single": 1}
    lines = [
        f"plan       {s.num_devices} devices mesh={mesh} rules={s.rules} "
        f"accelerator={s.accelerator.label if s.accelerator else 'none'}",
        f"model      {_count(plan.total_params)} params ({_count(plan.trainable_params)} trainable), "
        f"{_count(plan.active_params)} active/token, dtype={m.execution.dtype} params={m.execution.param_dtype}",
        f"batch      global {s.global_batch} x {s.tokens_per_example} tokens ({s.objective}: prompt {s.prompt_len} + "
        f"{'' if get_objective(s.objective).layout == 'ar' else '2 x '}response {s.response_len}), "
        f"{plan.examples_per_device:g} "
        f"examples/device/micro-batch, grad_accum {s.grad_accum_steps}, remat={s.remat}, "
        f"attention={m.execution.attention_impl}, scan_layers={m.execution.scan_layers}",
        "per device",
        f"  params       {_gib(plan.params)}",
        f"  grads        {_gib(plan.grads)}",
        f"  optimizer    {_gib(plan.optimizer)}   ({getattr(s.optim, 'name', 'adamw')})",
        f"  activations  {_gib(plan.activations)}   "
        + ", ".join(f"{k} {_gib(v).strip()}" for k, v in sorted(plan.activation_terms.items(), key=lambda kv: -kv[1])
                    if v >= plan.activations / 50),
    ]
    if s.lora is not None:
        from dgemma.planning.lora_plan import lora_terms

        terms = lora_terms(s)
        lines.insert(2, f"lora       rank {s.lora.rank}: {_count(terms['adapter_params'])} adapter params "
                        f"({_gib(terms['adapter_bytes']).strip()} per device), frozen base in "
                        f"{m.execution.param_dtype}")
    lines += [f"  {k:<12} {_gib(v)}   (resident)" for k, v in plan.resident.items()]
    lines += [f"  {k:<12} {_gib(v)}   (phase peak; the update's is grads + activations "
              f"{_gib(plan.update_bytes).strip()})" for k, v in plan.phases.items()]
    lines.append(f"  total        {_gib(plan.total)}")
    if plan.usable_bytes is not None and s.accelerator is not None:  # (usable_bytes is set only with an accelerator)
        verdict = "FITS" if plan.device_fits else "DOES NOT FIT"
        what = "per device" if plan.needed_bytes == plan.total else f"for {s.num_devices} devices sharing host RAM"
        lines.append(f"verdict    {verdict}: {plan.needed_bytes / GiB:.1f} GiB {what} vs "
                     f"{plan.usable_bytes / GiB:.1f} GiB usable ({s.usable_fraction:.0%} of {s.accelerator.hbm_gib:g} GiB, {s.accelerator.label})")
    if plan.host:
        per_node = plan.host_bytes_per_node
        line = (f"host       {', '.join(f'{k} {_gib(v).strip()}' for k, v in plan.host.items())} per device x "
                f"{plan.node_devices} devices per node = {per_node / GiB:.1f} GiB per node")
        if plan.host_usable_bytes is not None and s.accelerator is not None:  # (set only with an accelerator)
            ram = s.node_ram_gib if s.node_ram_gib is not None else s.accelerator.node_ram_gib
            line += (f": {'FITS' if plan.host_fits else 'DOES NOT FIT'} vs {plan.host_usable_bytes / GiB:.1f} GiB "
                     f"usable ({s.usable_fraction:.0%} of {ram:.0f} GiB node RAM)")
        lines.append(line)
    t = plan.step_seconds_at_peak()
    lines.append(f"flops      {plan.flops_per_step:.3e} per step as implemented = "
                 f"{plan.flops_per_step / plan.model_flops_per_step:.2f} x {plan.model_flops_per_step:.3e} "
                 f"(6 x active x tokens)" + (f"; >= {t:.2f} s/step at 100% of peak bf16" if t else ""))
    if plan.phase_flops:
        lines.append("           by phase: " + ", ".join(f"{k} {v:.3e}" for k, v in plan.phase_flops.items()))
    if plan.collective_bytes_per_step:
        lines.append(f"comms      expert-parallel dispatch {plan.collective_bytes_per_step / GiB:.2f} GiB sent per "
                     f"device per step (all-gather + reduce-scatter over model.execution.expert_axis, "
                     f"docs/expert_parallelism.md)")
    lines += [f"note       {n}" for n in plan.notes]
    if compiled is not None:
        lines.append(compiled.format(compiled_plan or plan))
    return "\n".join(lines) + "\n"


# MARK: compiled validation ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CompiledReport:
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    flops: float | None  # XLA cost analysis, per device
    compile_seconds: float
    xla_peak_bytes: int = 0  # memory_analysis().peak_memory_in_bytes
    platform: str = "cpu"  # of the devices compiled for

    @property
    def allocated_bytes(self) -> int:
        """Arguments + outputs not aliased to them + the temporaries' buffer: what the program reserves. The temporary
        buffer is sized by XLA's buffer assignment (values packed by live range, with fragmentation), so this is at
        least the peak of live bytes, on TPU several GiB more (docs/planner_compile.md)."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def reports_peak(self) -> bool:
        """Whether the backend's peak counts temporaries: TPU's does; XLA:CPU's is arguments + outputs only."""
        return self.platform != "cpu" and self.xla_peak_bytes > 0

    @property
    def peak_bytes(self) -> int:
        """XLA's own peak (live bytes at the worst point of the schedule) where reported, else `allocated_bytes`."""
        return self.xla_peak_bytes if self.reports_peak else self.allocated_bytes

    @property
    def peak_source(self) -> str:
        return "peak_memory_in_bytes" if self.reports_peak else "arguments + temporaries"

    def format(self, plan: Plan) -> str:
        est_args = plan.params + plan.optimizer
        est_temp = plan.grads + plan.activations
        ratio = self.peak_bytes / max(plan.total, 1)
        out = (f"compiled   XLA:{self.platform.upper()} memory_analysis per device (compiled on {self.platform}, "
               f"{self.compile_seconds:.0f}s; estimate for "
               f"moe_lowering={plan.spec.moe_lowering}):\n"
               f"  arguments    {_gib(self.argument_bytes)}   (estimate params + optimizer {_gib(est_args).strip()})\n"
               f"  temporaries  {_gib(self.temp_bytes)}   (estimate grads + activations {_gib(est_temp).strip()}; "
               f"XLA's buffer, packed by live range)\n"
               f"  allocated    {_gib(self.allocated_bytes)}   (arguments + temporaries)\n"
               f"  peak         {_gib(self.peak_bytes)}   = {ratio:.2f} x the estimate ({_gib(plan.total).strip()}); "
               f"XLA's {self.peak_source}")
        if self.flops:
            out += (f"\n  flops        {self.flops:.3e} per device by XLA's cost analysis (estimate "
                    f"{plan.flops_per_step / plan.spec.num_devices:.3e}; XLA counts a loop body once)")
        return out


def abstract_batch_shapes(data: DataConfig, global_batch: int) -> dict[str, tuple[tuple[int, ...], Any]]:
    """{key: (global shape, dtype)} of one training batch of the `data` section's layout (no data is read)."""
    import numpy as np

    from dgemma.data.layout import to_layout

    one = to_layout([5, 6, 7], [8, 9], data.layout, pad_id=0, eos_id=1, bos_id=2, index=0)
    one["index"] = np.array(0, np.int32)
    return {k: ((global_batch, *np.shape(v)), np.asarray(v).dtype) for k, v in one.items()}


def abstract_sdrl_batch_shapes(cfg: RunConfig, spec: PlanSpec) -> dict[str, tuple[tuple[int, ...], Any]]:
    """{key: (global shape, dtype)} of one SD·RL optimizer step's batch, as `dgemma.train.sdrl.iteration` feeds it: a
    minibatch of state rows (`states.row_shapes` of `states.ROW_FIELDS`, padded as the planner's worst case
    `sdrl_plan.state_rows`) with π_old and π_ref, plus the anchor rows (stage-1 layout of the Q prompts under
    `anchor/`) and the retention rows (`sdrl.retention_rows`, under `retention/`)."""
    from dgemma.planning.sdrl_plan import state_rows
    from dgemma.train.sdrl.loss import ANCHOR_PREFIX, RETENTION_PREFIX
    from dgemma.train.sdrl.states import prefix_rows, ran_states_apply, row_shapes, shared_prefix_shapes

    s, m = spec.sdrl, spec.model
    n = state_rows(spec)[1] // s.num_minibatches
    out = row_shapes(n, P=spec.prompt_len, nb=s.n_blocks, L=m.canvas_length, H=m.hidden_size, V=m.vocab_size,
                     act_dtype=m.execution.dtype, self_conditioning=m.self_conditioning, kl=s.kl)
    if s.processes == 1:  # the loop's default layout: each distinct clean stream once (at most one per rollout)
        batch_devices = math.prod(int(spec.mesh.get(x, 1)) for x in ("data", "fsdp"))
        out = shared_prefix_shapes(out, prefix_rows(min(n, s.prompts_per_process * s.group_size), batch_devices),
                                   ran_only=ran_states_apply(m.execution.attention_impl))
    if s.anchor:
        anchor = abstract_batch_shapes(cfg.data, s.prompts_per_process * s.processes)
        out.update({f"{ANCHOR_PREFIX}{k}": v for k, v in anchor.items() if k != "index"})
    if s.retention_rows:  # sdrl.retention_mix: its stage-1 rows under `retention/` (dgemma.train.sdrl.retention)
        retention = abstract_batch_shapes(cfg.data, s.retention_rows)
        out.update({f"{RETENTION_PREFIX}{k}": v for k, v in retention.items() if k != "index"})
    return out


def compile_mesh(mesh: MeshSection, spec: PlanSpec, devices: list | None = None):
    """The mesh `spec` plans for (the run's `mesh` section), over the first `spec.num_devices` of `devices` (default:
    the local ones)."""
    import jax

    from dgemma.parallel.mesh import make_mesh_from_config

    n = spec.num_devices
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < n:
        raise ValueError(f"compiling for {n} devices needs {n} local devices, have {len(devices)} (set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before starting)")
    granules = math.prod(v for k, v in mesh.dcn.items() if v > 0) or 1
    return make_mesh_from_config(mesh, devices[:n], num_granules=granules)


def compiled_report(compiled: Any, mesh: Any, seconds: float, flops: float | None = None) -> CompiledReport:
    """`CompiledReport` of a program compiled for `mesh`, from its memory analysis."""
    mem = compiled.memory_analysis()
    return CompiledReport(int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes),
                          int(mem.alias_size_in_bytes), int(mem.temp_size_in_bytes), flops, seconds,
                          int(getattr(mem, "peak_memory_in_bytes", 0) or 0), mesh.devices.flat[0].platform)


def compiled_memory(cfg: RunConfig, spec: PlanSpec, devices: list | None = None) -> CompiledReport:
    """Compile the real train step for `spec`'s mesh and batch on local devices; returns XLA's memory analysis."""
    import time

    import jax

    from dgemma.model.transformer import Transformer
    from dgemma.parallel.mesh import use_mesh
    from dgemma.parallel.rules import get_rules
    from dgemma.planning.gpu_aot import kernel_device
    from dgemma.train.objectives import loss_fn_for
    from dgemma.train.optim import build_optimizer
    from dgemma.train.state import abstract_train_state, train_state_shardings, with_shardings
    from dgemma.train.step import batch_sharding, make_train_step

    mesh = compile_mesh(cfg.mesh, spec, devices)
    # the run's optimizer updates, as the trainer counts them (the schedule refuses a longer warmup)
    updates = cfg.trainer.steps * get_objective(cfg.trainer.objective).updates_per_step(cfg)
    optimizer = build_optimizer(cfg.optim, updates)
    graphdef, abstract = abstract_train_state(lambda rngs: Transformer(spec.model, rngs=rngs), optimizer.tx, cfg.run.seed)
    shardings = train_state_shardings(abstract, optimizer.tx, mesh, get_rules(spec.rules))
    step = make_train_step(graphdef, optimizer, loss_fn_for(cfg), mesh=mesh, shardings=shardings,
                           grad_accum_steps=spec.grad_accum_steps)
    bsh = batch_sharding(mesh)
    shapes = abstract_sdrl_batch_shapes(cfg, spec) if get_objective(spec.objective).rollouts else \
        abstract_batch_shapes(cfg.data, spec.global_batch)
    batch = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=bsh) for k, (shape, dtype) in shapes.items()}
    t0 = time.time()
    # activation sharding constraints in the model resolve against this mesh; kernels pick against its devices
    with use_mesh(mesh), kernel_device(mesh):
        compiled = step.lower(with_shardings(abstract, shardings), batch).compile()
    seconds = time.time() - t0
    flops = None
    try:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        flops = float(cost.get("flops")) if cost and cost.get("flops") else None
    except Exception:  # noqa: BLE001 - cost analysis is optional per backend
        flops = None
    return compiled_report(compiled, mesh, seconds, flops)

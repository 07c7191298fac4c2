"""`dgemma plan`: resolve and validate a config, summarise the run, and plan its memory and FLOPs per device.

    dgemma plan configs/stage1/gemma4_26b_a4b.yaml --devices 8 --accelerator h100
    dgemma plan -c configs/stage1/gemma4_26b_a4b.yaml --devices 32 --accelerator v5p optim.freeze='[router, embedder]'
    dgemma plan configs/stage1/tiny.yaml --compile      # also compile the real train step on simulated CPU devices
    dgemma plan --schema                                # every config key with its type, default and description
    dgemma plan -c x.yaml --out runs/x                  # also write resolved_config.yaml + config.sha256 there

The planner (`dgemma.planning.planner`, docs/planner.md) gives per-device bytes for params, gradients, optimizer state
and activations, FLOPs per step, and whether the run fits the named accelerator (h100, h200, v5p, v6e, cpu). The
device count comes from `--devices` or from a mesh without -1 axes; the global batch is `data.batch_size` (whatever
the process count: one per host unless `--processes`), or `--global-batch`; the per-device micro-batch and the gradient
accumulation (`trainer.grad_accum_steps`, 0 = derived) follow and are printed. `--compile` lowers and compiles the
exact train step
on simulated CPU devices and prints XLA's memory analysis next to the estimate (for configs that fit this machine).
Exit codes: 0 ok, 1 the run does not fit the accelerator, 2 bad config.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from dgemma.cli import common

if TYPE_CHECKING:
    from dgemma.config import RunConfig

NAME = "plan"
HELP = "validate a config, summarise the run, plan memory / FLOPs per device (fits H100, H200, v5p, v6e?)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `dgemma plan` besides the shared config ones."""
    parser.add_argument("--schema", action="store_true", help="print every config key (type, default, help); exit")
    parser.add_argument("--out", metavar="DIR", help="write resolved_config.yaml and config.sha256 into DIR")
    add_planner_args(parser)
    parser.add_argument("--compile", action="store_true",
                        help="also compile the real train step and print XLA's memory analysis, naming the backend: "
                             "simulated CPU devices without an accelerator (or --accelerator cpu); a GPU or TPU "
                             "accelerator only with its own compiler (--topology; the gpu-aot / tpu-aot extra), whose "
                             "compiled peak then decides the verdict; refused (exit 2) otherwise")
    parser.add_argument("--topology", metavar="GEN:AxBxC",
                        help="with --compile: compile deviceless with the real accelerator compiler, for a TPU slice "
                             "(e.g. v5p:2x4x4 = v5p-64; needs libtpu: the tpu-aot extra) or for GPUs (h100:8 = one "
                             "host of 8 H100s, h100:2x8 two hosts; needs the CUDA plugin: the gpu-aot extra)")
    parser.add_argument("--sampler", action="store_true",
                        help="with --compile: compile the sampler's per-block program (diffusion rows, the config's "
                             "sampler settings) instead of the train step")
    parser.add_argument("--sampler-rows", type=int, metavar="N",
                        help="with --sampler: rows per batch shard (default: the SD·RL student rollout's rows for "
                             "objective=sdrl, else data.batch_size)")


def add_planner_args(parser: argparse.ArgumentParser) -> None:
    """Planner options shared with `dgemma launch`."""
    g = parser.add_argument_group("planner")
    g.add_argument("--devices", type=int, metavar="N", help="accelerator count (default: the mesh's fixed size)")
    g.add_argument("--accelerator", metavar="NAME", help="h100 | h200 | v5p | v6e | cpu (memory per device)")
    g.add_argument("--processes", type=int, metavar="N",
                   help="processes (default: one per host); each reads data.batch_size / processes rows of the "
                        "global batch")
    g.add_argument("--global-batch", type=int, metavar="N", help="examples per optimizer step (overrides the above)")
    g.add_argument("--slices", type=int, metavar="N", help="slices / nodes for a mesh.dcn with a -1 axis")
    g.add_argument("--node-ram-gib", type=float, metavar="GIB",
                   help="RAM of one node (default: the accelerator table's); host-kept bytes are planned against it")
    g.add_argument("--remat", choices=("none", "full", "block", "save_dots", "offload"), default=None,
                   help="what-if rematerialisation policy (default: the config's model.execution.remat)")


PLANNER_COUNTS = (("--devices", "devices"), ("--processes", "processes"), ("--global-batch", "global_batch"),
                  ("--slices", "slices"))


def planner_args_error(args: argparse.Namespace) -> str | None:
    """A one-line error naming the first planner flag with a value that is not a positive count, else None."""
    for flag, name in PLANNER_COUNTS:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            return f"{flag} {value}: must be a positive integer"
    return None


def processes_error(devices: int | None, processes: int | None, devices_from: str = "--devices") -> str | None:
    """A one-line error when `--processes` cannot drive `devices` (each process drives the same number >= 1 of
    devices), else None. `devices_from` names where the device count came from (a flag or the mesh)."""
    if devices is None or processes is None:
        return None
    if processes > devices:
        return (f"--processes {processes} is more than the {devices} devices ({devices_from} {devices}); each process "
                f"drives at least one device")
    if devices % processes:
        return (f"--processes {processes} does not divide the {devices} devices ({devices_from} {devices}); every "
                f"process drives the same number of devices")
    return None


def config_and_overrides(args: argparse.Namespace) -> None:
    """Accept the config as the first positional (`dgemma plan CONFIG k=v`) as well as `--config CONFIG`."""
    overrides = list(args.overrides or [])
    if args.config is None and overrides and "=" not in overrides[0] and overrides[0].endswith((".yaml", ".yml")):
        args.config = overrides.pop(0)
    args.overrides = overrides


def schema_text() -> str:
    """One line per config key: `dotted.key  type  = default  # help`."""
    from dgemma.config import RunConfig, field_help

    rows = field_help(RunConfig)
    width = max(len(r[0]) for r in rows)
    return "".join(f"{path:<{width}}  {tp}  = {default!r}  # {doc}\n" for path, tp, default, doc in rows)


def summary_text(cfg: RunConfig) -> str:  # noqa: ANN001 - RunConfig, imported lazily
    """Human-readable summary of a resolved `RunConfig`."""
    from dgemma.config import config_hash

    m = cfg.model.build()
    mesh = cfg.mesh
    devices = mesh.axis_size(*mesh.axes)
    layout = cfg.data.layout
    seq = layout.prompt_len + layout.n_blocks * m.canvas_length
    lines = [
        f"run        {cfg.run.name}  ->  {cfg.run.run_dir}",
        f"sha256     {config_hash(cfg)}",
        f"model      preset={cfg.model.preset} overrides={cfg.model.overrides() or '{}'}",
        f"           layers={m.num_hidden_layers} hidden={m.hidden_size} vocab={m.vocab_size} "
        f"{f'experts={m.num_experts} top_k={m.top_k_experts}' if m.enable_moe_block else 'dense MLP'} "
        f"canvas={m.canvas_length} window={m.sliding_window} "
        f"dtype={m.execution.dtype}/{m.execution.param_dtype}",
        f"mesh       ici={dict(mesh.ici)} dcn={dict(mesh.dcn)} rules={mesh.rules} "
        f"devices={devices if devices is not None else 'auto (-1)'}",
        f"data       source={cfg.data.source} global batch={cfg.data.batch_size} prompt={layout.prompt_len} "
        f"n_blocks={layout.n_blocks} -> {seq} tokens/example (one-pass layout: "
        f"{layout.prompt_len + 2 * (seq - layout.prompt_len)})",
        f"trainer    steps={cfg.trainer.steps} lr={cfg.optim.lr} ({cfg.optim.name}, {cfg.optim.schedule}, "
        f"warmup {cfg.optim.warmup_steps}) ckpt every {cfg.checkpoint.every} -> "
        f"{cfg.checkpoint.directory(cfg.run)}",
        f"diffusion  L={m.canvas_length} t=[{cfg.diffusion.t_min}, {cfg.diffusion.t_max}] "
        f"align={cfg.diffusion.head_alignment} lambda_ar={cfg.diffusion.lambda_ar} "
        f"p_sc={cfg.diffusion.p_self_cond}",
    ]
    if cfg.diffusion.head_alignment != "noshift":
        lines.append("note       head_alignment=shift is not exportable to diffusion_gemma")
    return "\n".join(lines) + "\n"


def planner_report(cfg: RunConfig, args: argparse.Namespace, *, compile_step: bool = False) -> tuple[str, bool | None]:
    """(text, fits) of the planner for `cfg` and the planner options in `args`; fits is None without accelerator."""
    import dataclasses

    from dgemma.planning.plan_config import compiled_memory, format_plan, plan_for, spec_from_config

    topology = getattr(args, "topology", None)
    devices = accelerator = None
    if compile_step and not topology:  # a verdict for an accelerator only from that accelerator's compiler
        topology = target_topology(args.accelerator, args.devices or cfg.mesh.axis_size(*cfg.mesh.axes))
    if topology:
        _check_same_platform(topology, args.accelerator)
        devices, accelerator = _topology_devices(topology, args.devices)
        bad = processes_error(len(devices), args.processes, f"--topology {topology}:")
        if bad:
            raise ValueError(bad)
    spec = spec_from_config(cfg, devices=len(devices) if devices else args.devices,
                            accelerator=args.accelerator or accelerator, processes=args.processes,
                            global_batch=args.global_batch, slices=args.slices, remat=args.remat,
                            devices_per_node=getattr(args, "devices_per_node", None),
                            node_ram_gib=getattr(args, "node_ram_gib", None))
    if compile_step and not topology:
        _ensure_cpu_devices(spec.num_devices)  # before anything starts the JAX backend
    plan = plan_for(spec)
    compiled = compiled_plan = None
    if compile_step and getattr(args, "sampler", False):
        return format_plan(plan) + _sampler_report(cfg, spec, devices, args.sampler_rows), plan.fits
    if compile_step:  # abstract inputs: compiling allocates no parameter, state or activation buffer
        compiled = compiled_memory(cfg, spec, devices)
        # XLA:CPU lowers ragged_dot densely; on a topology the plan already has that compiler's lowering
        compiled_plan = plan if topology else plan_for(dataclasses.replace(spec, moe_lowering="dense"))
    text = format_plan(plan, compiled, compiled_plan)
    # (usable_bytes is set only with an accelerator)
    if (compiled is not None and plan.usable_bytes is not None and spec.accelerator is not None
            and compiled.platform == spec.accelerator.platform):
        shared = spec.num_devices if compiled.platform == "cpu" else 1  # simulated CPU devices share host RAM
        fits = compiled.peak_bytes * shared <= plan.usable_bytes  # the target's own compiler: its peak decides
        text += (f"verdict    by XLA:{compiled.platform.upper()}: {'FITS' if fits else 'DOES NOT FIT'}: compiled peak "
                 f"{compiled.peak_bytes * shared / 2**30:.2f} GiB {'per device' if shared == 1 else 'in all'} vs "
                 f"{plan.usable_bytes / 2**30:.1f} GiB usable\n")
        return text, fits
    return text, plan.fits


def target_topology(accelerator: str | None, devices: int | None) -> str | None:
    """The `--topology` that `--compile` uses for `accelerator` when none is given: None for a CPU (or no)
    accelerator, which compiles on simulated CPU devices; `GEN:[HOSTSx]GPUS` for a GPU with a deviceless target.
    Otherwise a ValueError: a fit verdict for an accelerator comes only from its own compiler."""
    from dgemma.planning.accelerators import get_accelerator
    from dgemma.planning.gpu_aot import cuda_plugin, is_gpu_topology

    acc = get_accelerator(accelerator) if accelerator else None
    if acc is None or acc.platform == "cpu":
        return None
    if acc.platform == "gpu" and cuda_plugin() is None:
        raise ValueError(f"--compile for --accelerator {accelerator} needs XLA:GPU's compiler (the CUDA plugin), not "
                         f"installed here: pip install 'dgemma[gpu-aot]'; a compile on this CPU gives no verdict for "
                         f"{acc.label}")
    if acc.platform == "gpu" and is_gpu_topology(f"{acc.name}:1") and devices:
        per_host = min(devices, acc.devices_per_host)
        return f"{acc.name}:{devices // per_host}x{per_host}" if devices > per_host else f"{acc.name}:{devices}"
    extra = "gpu-aot" if acc.platform == "gpu" else "tpu-aot"
    example = "v5p:2x4x4 for 32 chips" if acc.platform == "tpu" else "h100:8"
    raise ValueError(f"--compile for --accelerator {accelerator} compiles with the {acc.platform.upper()} compiler: "
                     f"pass --topology (e.g. {example}; needs pip install 'dgemma[{extra}]'), or plan without "
                     f"--compile; a compile on this CPU gives no verdict for {acc.label}")


def _check_same_platform(topology: str, accelerator: str | None) -> None:
    """A ValueError when `--accelerator` is not the platform `--topology` compiles for (no cross-backend verdict)."""
    from dgemma.planning.accelerators import get_accelerator
    from dgemma.planning.gpu_aot import is_gpu_topology

    platform = "gpu" if is_gpu_topology(topology) else "tpu"
    if accelerator and get_accelerator(accelerator).platform != platform:
        raise ValueError(f"--accelerator {accelerator} is not what --topology {topology} compiles for ({platform})")


def _topology_devices(topology: str, devices: int | None) -> tuple[list, str | None]:
    """(compile-only devices, planner accelerator name) of `--topology`: GPUs through the CUDA plugin, else a TPU
    slice through libtpu. JAX itself stays on CPU."""
    from dgemma.planning.gpu_aot import gpu_topology_devices, is_gpu_topology, parse_gpu_topology
    from dgemma.planning.tpu_aot import parse_topology, tpu_topology_devices

    accelerator: str | None
    if is_gpu_topology(topology):
        accelerator, hosts, per_host = parse_gpu_topology(topology)
        chips, describe = hosts * per_host, gpu_topology_devices
    else:
        _, chips, accelerator = parse_topology(topology)
        describe = tpu_topology_devices
    if devices not in (None, chips):
        raise ValueError(f"--devices {devices} disagrees with --topology {topology} ({chips} chips)")
    _ensure_cpu_devices(1)
    return describe(topology), accelerator


def _sampler_report(cfg: RunConfig, spec, devices, rows: int | None) -> str:
    """Compile the sampler's block program (`dgemma.planning.sampler_aot`) and print it beside the planner."""
    from dgemma.planning.sampler_aot import compiled_sampler_block, default_rows_per_device, format_sampler_report

    rows = default_rows_per_device(cfg, spec) if rows is None else rows
    report, terms, shape = compiled_sampler_block(cfg, spec, devices, rows_per_device=rows)
    return format_sampler_report(report, terms, shape, rows)


def _ensure_cpu_devices(n: int) -> None:
    """Ask for `n` simulated CPU devices if the JAX backend has not started yet."""
    import jax

    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", max(n, 1))


def run(args: argparse.Namespace) -> int:
    """Print the schema, or resolve the config, print its summary and plan, optionally write provenance files."""
    if args.schema:
        sys.stdout.write(schema_text())
        return common.EXIT_OK
    config_and_overrides(args)
    bad = planner_args_error(args)  # before anything is loaded, printed or written
    if getattr(args, "topology", None) and not args.compile:
        bad = "--topology needs --compile"
    if (args.sampler or args.sampler_rows is not None) and not args.compile:
        bad = "--sampler needs --compile"
    if args.sampler_rows is not None and args.sampler_rows < 1:
        bad = f"--sampler-rows {args.sampler_rows}: must be a positive integer"
    if bad:
        print(f"dgemma plan: {bad}", file=sys.stderr)
        return common.EXIT_USAGE
    cfg, done = common.load_or_print(args)
    if done:
        return common.EXIT_OK
    common.check_run_length(cfg)  # what `dgemma train` would refuse at its start
    if args.compile:
        try:  # no verdict for an accelerator from another backend's compile: refused before anything is printed
            if getattr(args, "topology", None):
                _check_same_platform(args.topology, args.accelerator)
            else:
                target_topology(args.accelerator, args.devices or cfg.mesh.axis_size(*cfg.mesh.axes))
        except ValueError as e:
            print(f"dgemma plan: {e}", file=sys.stderr)
            return common.EXIT_USAGE
    if not getattr(args, "topology", None):  # a topology's chip count is checked by planner_report
        mesh_devices = cfg.mesh.axis_size(*cfg.mesh.axes)
        bad = processes_error(args.devices or mesh_devices, args.processes,
                              "--devices" if args.devices else "fixed by the mesh:")
        if bad:  # before the summary and before --out is written
            print(f"dgemma plan: {bad}", file=sys.stderr)
            return common.EXIT_USAGE
    sys.stdout.write(summary_text(cfg))

    def write_out() -> None:  # only once the planner accepted the config: a refused plan writes nothing
        if args.out:
            from dgemma.config import dump_resolved

            digest = dump_resolved(cfg, args.out)
            print(f"wrote      {args.out}/resolved_config.yaml (sha256 {digest[:12]})")

    if args.devices is None and not getattr(args, "topology", None) and cfg.mesh.axis_size(*cfg.mesh.axes) is None:
        write_out()
        print("planner    the mesh has an auto (-1) axis: pass --devices N (and --accelerator NAME) to plan memory")
        return common.EXIT_OK
    try:
        text, fits = planner_report(cfg, args, compile_step=args.compile)
    except ValueError as e:
        print(f"dgemma plan: {e}", file=sys.stderr)
        return common.EXIT_USAGE
    except NotImplementedError as e:  # a Pallas kernel (Tokamax, Megablox) that cannot lower a shape at compile time
        m = cfg.model_config
        print(f"dgemma plan: a kernel cannot compile this program: {str(e).splitlines()[0]} "
              f"(model.execution.attention_impl={m.execution.attention_impl}, "
              f"model.execution.moe_kernel={m.execution.moe_kernel}, "
              f"model.execution.tokamax_backend={m.execution.tokamax_backend})",
              file=sys.stderr)
        return common.EXIT_USAGE
    except Exception as e:  # noqa: BLE001 - the TPU compiler refuses a step that needs more HBM than a chip has
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        print(f"dgemma plan: DOES NOT FIT by the compiler: {str(e).splitlines()[0]}", file=sys.stderr)
        return common.EXIT_ERROR
    write_out()  # also for "does not fit": the config itself is valid, only this machine count is too small
    sys.stdout.write(text)
    return common.EXIT_ERROR if fits is False else common.EXIT_OK


if __name__ == "__main__":
    sys.exit(common.standalone(sys.modules[__name__]))

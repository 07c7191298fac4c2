"""`dgemma plan`: resolve and validate a config and summarise what a run would do, without touching devices.

    dgemma plan --config configs/stage1/gemma4_26b_a4b.yaml checkpoint.init_from=/ckpt/gemma4
    dgemma plan --schema            # every config key with its type, default and description
    dgemma plan -c x.yaml --out runs/x   # also write resolved_config.yaml + config.sha256 there

Implemented: config resolution, validation, summary, provenance files. Not implemented yet: the AOT compile preflight
(`jit(...).lower(abstract...).compile()` against a target topology) — it will live here and import jax inside `run`.
"""

from __future__ import annotations

import argparse
import sys

from dgemma.cli import common

NAME = "plan"
HELP = "resolve + validate a config and summarise the run (no devices touched)"
ISSUE = "AOT compile preflight (dgemma.parallel)"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `dgemma plan` and its arguments."""
    parser = subparsers.add_parser(NAME, help=HELP, description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_config_args(parser)
    parser.add_argument("--schema", action="store_true", help="print every config key (type, default, help); exit")
    parser.add_argument("--out", metavar="DIR", help="write resolved_config.yaml and config.sha256 into DIR")
    return parser


def schema_text() -> str:
    """One line per config key: `dotted.key  type  = default  # help`."""
    from dgemma.config import RunConfig, field_help

    rows = field_help(RunConfig)
    width = max(len(r[0]) for r in rows)
    return "".join(f"{path:<{width}}  {tp}  = {default!r}  # {doc}\n" for path, tp, default, doc in rows)


def summary_text(cfg) -> str:  # noqa: ANN001 - RunConfig, imported lazily
    """Human-readable summary of a resolved `RunConfig`."""
    from dgemma.config import config_hash

    m = cfg.model.build()
    mesh = cfg.mesh
    devices = mesh.axis_size(*mesh.axes)
    canvas = cfg.data.canvas
    seq = canvas.prompt_len + canvas.num_canvases * m.canvas_length
    lines = [
        f"run        {cfg.run.name}  ->  {cfg.run.run_dir}",
        f"sha256     {config_hash(cfg)}",
        f"model      preset={cfg.model.preset} overrides={cfg.model.overrides() or '{}'}",
        f"           layers={m.num_hidden_layers} hidden={m.hidden_size} vocab={m.vocab_size} "
        f"experts={m.num_experts} top_k={m.top_k_experts} canvas={m.canvas_length} window={m.sliding_window} "
        f"dtype={m.dtype}/{m.param_dtype}",
        f"mesh       ici={dict(mesh.ici)} dcn={dict(mesh.dcn)} rules={mesh.rules} "
        f"devices={devices if devices is not None else 'auto (-1)'}",
        f"data       source={cfg.data.source} batch/process={cfg.data.batch_size} prompt={canvas.prompt_len} "
        f"canvases={canvas.num_canvases} -> {seq} tokens/example (one-pass layout: "
        f"{canvas.prompt_len + 2 * (seq - canvas.prompt_len)})",
        f"trainer    steps={cfg.trainer.steps} lr={cfg.optim.lr} ({cfg.optim.name}, {cfg.optim.schedule}, "
        f"warmup {cfg.optim.warmup_steps}) ckpt every {cfg.checkpoint.every} -> "
        f"{cfg.checkpoint.directory(cfg.run)}",
        f"diffusion  L={cfg.diffusion.canvas_length} t=[{cfg.diffusion.t_min}, {cfg.diffusion.t_max}] "
        f"align={cfg.diffusion.head_alignment} lambda_ar={cfg.diffusion.lambda_ar} "
        f"p_sc={cfg.diffusion.p_self_cond}",
    ]
    if cfg.diffusion.head_alignment != "noshift":
        lines.append("note       head_alignment=shift is not exportable to diffusion_gemma")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    """Print the schema, or resolve the config, print its summary and optionally write provenance files."""
    if args.schema:
        sys.stdout.write(schema_text())
        return common.EXIT_OK
    cfg, done = common.load_or_print(args)
    if done:
        return common.EXIT_OK
    sys.stdout.write(summary_text(cfg))
    if args.out:
        from dgemma.config import dump_resolved

        digest = dump_resolved(cfg, args.out)
        print(f"wrote      {args.out}/resolved_config.yaml (sha256 {digest[:12]})")
    print(f"preflight  AOT compile check not implemented yet (see issue: {ISSUE})")
    return common.EXIT_OK


if __name__ == "__main__":
    sys.exit(common.standalone(sys.modules[__name__]))

"""`dgemma convert`: a Hugging Face Gemma 4 / DiffusionGemma checkpoint -> a dgemma params-only checkpoint.

    dgemma convert --hf checkpoints/gemma-4-26B-A4B --out runs/init/params -c configs/stage1/gemma4_26b_a4b.yaml
    dgemma train -c configs/stage1/gemma4_26b_a4b.yaml checkpoint.init_from=runs/init/params

Streams every tensor onto its shard of the mesh from the config (`mesh`, `mesh.rules`), converting AR Gemma 4 to
DiffusionGemma (self-conditioning initialised by the documented rule, see `dgemma.convert.hf_import`), and writes an
orbax params checkpoint (step 0) that `checkpoint.init_from` and `dgemma export` read. The model geometry comes from
the checkpoint's config.json and is checked against the run config's `model` section.
"""

from __future__ import annotations

import argparse
import sys

from dgemma.cli import common

NAME = "convert"
HELP = "convert a HF Gemma 4 / DiffusionGemma checkpoint into a dgemma params checkpoint"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `dgemma convert` besides the shared config ones."""
    parser.add_argument("--hf", metavar="DIR", required=True, help="HF checkpoint directory (safetensors)")
    parser.add_argument("--out", metavar="DIR", required=True, help="params checkpoint root to write")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out (only a params checkpoint; replaced atomically)")


_GEOMETRY = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "global_head_dim", "num_global_key_value_heads", "layer_types",
             "sliding_window", "num_experts", "top_k_experts", "moe_intermediate_size")


def run(args: argparse.Namespace) -> int:
    cfg, done = common.load_or_print(args)
    if done:
        return common.EXIT_OK
    import os
    import shutil
    import uuid
    from pathlib import Path

    from dgemma.convert.destination import check_destination, sigterm_raises, swap_into_place

    if not Path(args.hf).is_dir():
        print(f"dgemma convert: --hf {args.hf}: no such directory", file=sys.stderr)
        return common.EXIT_USAGE
    try:  # an existing --out would keep its old steps (readers take the latest): refuse, or replace it whole
        check_destination(args.out, overwrite=args.overwrite, kind="params", sources=[args.hf])
    except FileExistsError as e:
        print(f"dgemma convert: {e}", file=sys.stderr)
        return common.EXIT_USAGE
    from flax import nnx

    from dgemma.checkpoint import save_params
    from dgemma.convert.hf_config import CheckpointError
    from dgemma.convert.hf_import import load_hf_checkpoint

    want = cfg.model_config
    try:
        model, report = load_hf_checkpoint(args.hf, mesh=common.run_mesh(cfg.mesh), rules=cfg.mesh.rules,
                                           dtype=want.execution.dtype, param_dtype=want.execution.param_dtype,
                                           canvas_length=want.canvas_length, tie_layer_scalar=want.tie_layer_scalar,
                                           # the run's parameter layout (scanned or per layer), so init_from restores
                                           scan_layers=want.execution.scan_layers,
                                           scan_period=want.execution.scan_period)
    except CheckpointError as e:
        print(f"dgemma convert: {e}", file=sys.stderr)
        return common.EXIT_ERROR
    diff = [f"model.{k}: config {getattr(want, k)!r} vs checkpoint {getattr(model.cfg, k)!r}" for k in _GEOMETRY
            if getattr(want, k) != getattr(model.cfg, k)]
    if diff:
        print("dgemma convert: the checkpoint does not match the run config's model section:\n  " + "\n  ".join(diff),
              file=sys.stderr)
        return common.EXIT_USAGE
    out = Path(args.out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with sigterm_raises():
            save_params(tmp, 0, nnx.state(model, nnx.Param),
                        metadata={"source": str(args.hf), "model_type": report.model_type})
            swap_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    path = out / "0"
    print(f"converted {report.loaded} tensors ({len(report.initialised)} initialised, {len(report.skipped)} vision "
          f"tensors skipped) -> {path}")
    return common.EXIT_OK


if __name__ == "__main__":
    sys.exit(common.standalone(sys.modules[__name__]))

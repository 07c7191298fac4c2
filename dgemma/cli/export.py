"""`dgemma export`: a dgemma params checkpoint -> Hugging Face safetensors for serving (transformers, vLLM).

    dgemma export -c configs/stage1/tiny.yaml --checkpoint runs/stage1_tiny/params --out exports/dg
    dgemma export -c ... --checkpoint ... --out exports/ar --layout gemma4            # AR fallback in any Gemma 4 runtime
    dgemma export -c ... --checkpoint ... --out exports/dg_fp8 --fp8                  # float8 e4m3 + block scales
    dgemma export -c ... --checkpoint runs/lora_run/params --out exports/m --merge-lora  # adapters folded in

The model geometry comes from the config's `model` section (the one the checkpoint was trained with), the sampler
settings written to generation_config.json from its `sampler` section. The export is written to a temporary
directory next to `--out` and renamed into place only when complete; an existing `--out` needs `--overwrite`.
Only `diffusion.head_alignment=noshift` models are exportable to the diffusion_gemma layout. The params of a run with
adapters (`lora.rank > 0`) are exported merged (`--merge-lora`, required for them and refused for other checkpoints):
`dgemma.checkpoint.lora_params` restores base and adapters and folds W + scale * A.B in fp32 for every adapted weight,
the experts' included; there is no unmerged (PEFT) adapter export.
"""

from __future__ import annotations

import argparse
import sys

from dgemma.cli import common

NAME = "export"
HELP = "export a params checkpoint to Hugging Face safetensors (diffusion_gemma / gemma4, bf16 or FP8)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `dgemma export` besides the shared config ones."""
    parser.add_argument("--checkpoint", metavar="PATH", required=True,
                        help="params-only checkpoint (<run dir>/params, or one step directory in it)")
    parser.add_argument("--out", metavar="DIR", required=True, help="destination directory")
    parser.add_argument("--layout", choices=("diffusion_gemma", "gemma4", "gemma4_text"), default="diffusion_gemma")
    parser.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16")
    parser.add_argument("--fp8", action="store_true", help="float8 e4m3 weights with block scales")
    parser.add_argument("--fp8-block", metavar="N|NxK", default=None,
                        help="fp8 scale block (default: the largest of 128/64/32/16 dividing every quantised "
                             "dimension, e.g. 64 for 26B-A4B, which vLLM's block-FP8 loader needs)")
    parser.add_argument("--fp8-allow-partial-blocks", action="store_true",
                        help="accept a --fp8-block that leaves partial edge blocks (transformers GPU kernels only)")
    parser.add_argument("--max-shard-size", type=int, default=5 * 1024**3, metavar="BYTES")
    parser.add_argument("--vision-source", metavar="DIR", help="HF checkpoint whose vision tower is carried through")
    parser.add_argument("--tokenizer-dir", metavar="DIR", help="copy tokenizer files from this directory")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out (only a previous export; never one containing the source)")
    parser.add_argument("--merge-lora", action="store_true",
                        help="the checkpoint of a run with adapters (lora.rank > 0): fold W + scale * A.B into the "
                             "base weights and export the merged model (adapters are not exported unmerged)")


def run(args: argparse.Namespace) -> int:
    cfg, done = common.load_or_print(args)
    if done:
        return common.EXIT_OK
    if args.layout == "diffusion_gemma" and cfg.diffusion.head_alignment != "noshift":
        print("dgemma export: diffusion.head_alignment=shift cannot be served by diffusion_gemma runtimes; "
              "export --layout gemma4 for the AR path instead", file=sys.stderr)
        return common.EXIT_USAGE
    from pathlib import Path

    from dgemma.convert.destination import check_destination

    if not args.fp8:  # the fp8 flags would be silently ignored on a bf16 / fp32 export
        given = [f for f, v in (("--fp8-block", args.fp8_block is not None),
                                ("--fp8-allow-partial-blocks", args.fp8_allow_partial_blocks)) if v]
        if given:
            print(f"dgemma export: {' and '.join(given)} {'needs' if len(given) == 1 else 'need'} --fp8 (an FP8 "
                  f"export); add --fp8 or drop {' and '.join(given)}", file=sys.stderr)
            return common.EXIT_USAGE
    block = None
    if args.fp8_block is not None:
        try:
            edges = [int(x) for x in args.fp8_block.lower().split("x")]
            block = (edges[0], edges[-1]) if len(edges) in (1, 2) and min(edges) > 0 else None
        except ValueError:
            block = None
        if block is None:
            print(f"dgemma export: --fp8-block {args.fp8_block!r}: expected N or NxK with positive ints",
                  file=sys.stderr)
            return common.EXIT_USAGE
    if args.max_shard_size <= 0:
        print(f"dgemma export: --max-shard-size {args.max_shard_size}: must be > 0 bytes", file=sys.stderr)
        return common.EXIT_USAGE
    for flag, d in (("--tokenizer-dir", args.tokenizer_dir), ("--vision-source", args.vision_source)):
        if d is not None and not Path(d).is_dir():
            print(f"dgemma export: {flag} {d}: no such directory", file=sys.stderr)
            return common.EXIT_USAGE
    refusal = _lora_refusal(args)
    if refusal:
        print(f"dgemma export: {refusal}", file=sys.stderr)
        return common.EXIT_USAGE
    sources = [args.checkpoint, args.vision_source, args.tokenizer_dir]
    try:  # before restoring anything: --overwrite never deletes the source or something that is not an export
        check_destination(args.out, overwrite=args.overwrite, kind="export", sources=sources)
    except FileExistsError as e:
        print(f"dgemma export: {e}", file=sys.stderr)
        return common.EXIT_USAGE
    from dgemma.convert.hf_export import export_from_params

    try:
        _, params = common.restore_model(cfg, args.checkpoint)
    except FileNotFoundError as e:
        print(f"dgemma export: {e}", file=sys.stderr)
        return common.EXIT_USAGE
    model_cfg = cfg.model_config
    kwargs = dict(layout=args.layout, dtype=args.dtype, max_shard_size=args.max_shard_size, overwrite=args.overwrite,
                  generation_config=cfg.sampler, vision_source=args.vision_source, tokenizer_dir=args.tokenizer_dir,
                  sources=sources)
    if args.fp8:
        kwargs.update(quantization="fp8", fp8_block_size=block, allow_partial_fp8_blocks=args.fp8_allow_partial_blocks)
    try:
        out = export_from_params(params, model_cfg, args.out, **kwargs)
    except (FileExistsError, ValueError) as e:
        print(f"dgemma export: {e}", file=sys.stderr)
        return common.EXIT_USAGE
    print(f"exported {args.layout} ({'fp8' if args.fp8 else args.dtype}) to {out}")
    return common.EXIT_OK


def _lora_refusal(args: argparse.Namespace) -> str | None:
    """Why `--merge-lora` (or its absence) does not fit the checkpoint; None when it does. Checked before anything is
    restored or written. There is no unmerged adapter export: transformers loads adapters through `peft`, which maps
    module names of its own; the merged model loads in every runtime."""
    from pathlib import Path

    from dgemma.checkpoint.lora_params import adapter_settings

    settings = adapter_settings(args.checkpoint)
    if settings is not None and not args.merge_lora:
        return (f"--checkpoint {args.checkpoint} holds LoRA adapters (lora.rank={settings['rank']}); add --merge-lora "
                f"to export the merged weights W + scale * A.B (adapters are not exported unmerged)")
    if settings is None and args.merge_lora and Path(args.checkpoint).is_dir():
        return (f"--merge-lora: --checkpoint {args.checkpoint} holds no LoRA adapters (not the params of a run with "
                f"lora.rank > 0); drop --merge-lora")
    return None


if __name__ == "__main__":
    sys.exit(common.standalone(sys.modules[__name__]))

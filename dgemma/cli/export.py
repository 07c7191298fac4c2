"""`dgemma export`: a dgemma params checkpoint -> Hugging Face safetensors for serving (transformers, vLLM).

    dgemma export -c configs/stage1/tiny.yaml --checkpoint runs/stage1_tiny/params --out exports/dg
    dgemma export -c ... --checkpoint ... --out exports/ar --layout gemma4            # AR fallback in any Gemma 4 runtime
    dgemma export -c ... --checkpoint ... --out exports/dg_fp8 --fp8                  # float8 e4m3 + block scales
    dgemma export -c ... --checkpoint runs/lora_run/params --out exports/m --merge-lora  # adapters folded in
    dgemma export -c ... --checkpoint ... --out exports/pipe --layout diffusers       # diffusers DiffusionGemmaPipeline

The model geometry comes from the config's `model` section (the one the checkpoint was trained with), the sampler
settings written to generation_config.json from its `sampler` section (and, for `--layout diffusers`, to the
pipeline's scheduler/scheduler_config.json). The tokenizer and its chat template are copied from the config's
`data.tokenizer` when it is a HF tokenizer directory (kind hf), or from `--tokenizer-dir` (which takes precedence:
the 26B's Gemma tokenizer); its EOS and `<turn|>` ids join generation_config.json's eos_token_id (docs/export.md).
The export is written to a temporary directory next to `--out` and renamed into place only when complete; an
existing `--out` needs `--overwrite`.
Only `diffusion.head_alignment=noshift` models are exportable to the diffusion_gemma layout. The params of a run with
adapters (`lora.rank > 0`) are exported merged (`--merge-lora`, required for them and refused for other checkpoints):
`dgemma.checkpoint.lora_params` restores base and adapters and folds W + scale * A.B in fp32 for every adapted weight,
the experts' included. `--peft-adapters` instead writes the adapters alone, unmerged, in PEFT's LoRA format
(`dgemma.convert.peft_export`), which transformers loads with `peft` on an export of the run's base:

    dgemma export -c ... --checkpoint runs/base/params --out exports/base             # the run's base, once
    dgemma export -c ... --checkpoint runs/lora_run/params --out exports/adapters --peft-adapters
    # python: base = DiffusionGemmaForBlockDiffusion.from_pretrained("exports/base")
    #         model = PeftModel.from_pretrained(base, "exports/adapters")
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from dgemma.cli import common

if TYPE_CHECKING:
    from dgemma.config import RunConfig

NAME = "export"
HELP = "export a params checkpoint to Hugging Face safetensors (diffusion_gemma / gemma4, bf16 or FP8)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `dgemma export` besides the shared config ones."""
    parser.add_argument("--checkpoint", metavar="PATH", required=True,
                        help="params-only checkpoint (<run dir>/params, or one step directory in it)")
    parser.add_argument("--out", metavar="DIR", required=True, help="destination directory")
    parser.add_argument("--layout", choices=("diffusion_gemma", "gemma4", "gemma4_text", "diffusers"),
                        default="diffusion_gemma",
                        help="diffusers: a DiffusionGemmaPipeline repository (model/ scheduler/ processor/), "
                             "see docs/export.md")
    parser.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16")
    parser.add_argument("--fp8", action="store_true", help="float8 e4m3 weights with block scales")
    parser.add_argument("--fp8-block", metavar="N|NxK", default=None,
                        help="fp8 scale block (default: the largest of 128/64/32/16 dividing every quantised "
                             "dimension, e.g. 64 for 26B-A4B, which vLLM's block-FP8 loader needs)")
    parser.add_argument("--fp8-allow-partial-blocks", action="store_true",
                        help="accept a --fp8-block that leaves partial edge blocks (transformers GPU kernels only)")
    parser.add_argument("--max-shard-size", type=int, default=5 * 1024**3, metavar="BYTES")
    parser.add_argument("--vision-source", metavar="DIR", help="HF checkpoint whose vision tower is carried through")
    parser.add_argument("--tokenizer-dir", metavar="DIR",
                        help="copy the tokenizer (and chat template) from this HF tokenizer directory (default: the "
                             "config's data.tokenizer.path when data.tokenizer.kind is hf)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out (only a previous export; never one containing the source)")
    parser.add_argument("--merge-lora", action="store_true",
                        help="the checkpoint of a run with adapters (lora.rank > 0): fold W + scale * A.B into the "
                             "base weights and export the merged model")
    parser.add_argument("--peft-adapters", action="store_true",
                        help="the checkpoint of a run with adapters: write the adapters alone, unmerged, in PEFT's "
                             "LoRA format (adapter_config.json + adapter_model.safetensors), for transformers + peft "
                             "on an export of the run's base in the same --layout")
    parser.add_argument("--base-model", metavar="NAME_OR_DIR", default=None,
                        help="with --peft-adapters: recorded as the adapters' base_model_name_or_path")


def run(args: argparse.Namespace) -> int:
    cfg, done = common.load_or_print(args)
    if done:
        return common.EXIT_OK
    if args.layout in ("diffusion_gemma", "diffusers") and cfg.diffusion.head_alignment != "noshift":
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
    if args.tokenizer_dir is None and not args.peft_adapters and cfg.data.tokenizer.kind == "hf":
        args.tokenizer_dir = cfg.data.tokenizer.path  # the tokenizer the run was trained with
    sources = [args.checkpoint, args.vision_source, args.tokenizer_dir]
    try:  # the tokenizer is checked before the (possibly 26B) checkpoint is restored
        from dgemma.convert import diffusers_layout, tokenizer_files

        if args.tokenizer_dir is not None:
            tokenizer_files.tokenizer_files(args.tokenizer_dir)
        if args.layout == "diffusers" and not args.peft_adapters:
            diffusers_layout.check_tokenizer(args.tokenizer_dir)
    except ValueError as e:
        print(f"dgemma export: {e}", file=sys.stderr)
        return common.EXIT_USAGE
    try:  # before restoring anything: --overwrite never deletes the source or something that is not an export
        check_destination(args.out, overwrite=args.overwrite, kind="export", sources=sources)
    except FileExistsError as e:
        print(f"dgemma export: {e}", file=sys.stderr)
        return common.EXIT_USAGE
    if args.peft_adapters:
        return _export_peft(cfg, args, sources)
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


def _export_peft(cfg: RunConfig, args: argparse.Namespace, sources: list) -> int:
    """`--peft-adapters`: restore base and adapters apart and write the adapters in PEFT's format."""
    from dgemma.checkpoint.lora_params import adapter_settings
    from dgemma.convert.peft_export import export_peft

    settings = adapter_settings(args.checkpoint)
    try:
        model, _ = common.restore_model(cfg, args.checkpoint, merge_adapters=False)
    except FileNotFoundError as e:
        print(f"dgemma export: {e}", file=sys.stderr)
        return common.EXIT_USAGE
    # restored: the checkpoint is a directory, and `_lora_refusal` refused --peft-adapters for one without adapters
    assert settings is not None
    try:
        out = export_peft(model, args.out, layout=args.layout, rank=int(settings["rank"]),
                          alpha=float(settings["alpha"]), dtype=args.dtype, base_model=args.base_model,
                          overwrite=args.overwrite, sources=sources)
    except (FileExistsError, ValueError) as e:
        print(f"dgemma export: {e}", file=sys.stderr)
        return common.EXIT_USAGE
    print(f"exported the LoRA adapters (rank {settings['rank']}, PEFT format, {args.layout} module names, "
          f"{args.dtype}) to {out}")
    return common.EXIT_OK


def _lora_refusal(args: argparse.Namespace) -> str | None:
    """Why `--merge-lora` / `--peft-adapters` (or their absence) do not fit the checkpoint; None when they do.
    Checked before anything is restored or written."""
    from pathlib import Path

    from dgemma.checkpoint.lora_params import adapter_settings

    settings = adapter_settings(args.checkpoint)
    if args.base_model is not None and not args.peft_adapters:
        return "--base-model is recorded only with --peft-adapters; add --peft-adapters or drop --base-model"
    if args.peft_adapters:
        clash = [f for f, v in (("--merge-lora", args.merge_lora), ("--fp8", args.fp8),
                                ("--vision-source", args.vision_source), ("--tokenizer-dir", args.tokenizer_dir)) if v]
        if clash:
            return (f"--peft-adapters writes the adapters alone; {' and '.join(clash)} belong to a model export "
                    f"(export the base, or --merge-lora, with them)")
        if settings is None and Path(args.checkpoint).is_dir():
            return (f"--peft-adapters: --checkpoint {args.checkpoint} holds no LoRA adapters (not the params of a run "
                    f"with lora.rank > 0)")
        full = [f"lora.{k}" for k in ("train_router", "train_embeddings") if (settings or {}).get(k)]
        if full:
            return (f"--peft-adapters: the run also trained {' and '.join(full)} in full, which an adapter file cannot "
                    f"carry; export --merge-lora instead")
        return None
    if settings is not None and not args.merge_lora:
        return (f"--checkpoint {args.checkpoint} holds LoRA adapters (lora.rank={settings['rank']}); add --merge-lora "
                f"to export the merged weights W + scale * A.B, or --peft-adapters for the adapters alone")
    if settings is None and args.merge_lora and Path(args.checkpoint).is_dir():
        return (f"--merge-lora: --checkpoint {args.checkpoint} holds no LoRA adapters (not the params of a run with "
                f"lora.rank > 0); drop --merge-lora")
    return None


if __name__ == "__main__":
    sys.exit(common.standalone(sys.modules[__name__]))

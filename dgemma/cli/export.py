"""`dgemma export`: export params to Hugging Face safetensors (diffusion_gemma or gemma4).

Status: not implemented yet; the command loads and validates the config, then exits with code 2.
Will: read a params-only checkpoint and write a `diffusion_gemma` (or AR `gemma4`) HF directory without orbax in
the path.
Heavy imports (jax, flax, transformers) belong inside `run`, never at module level.
"""

from __future__ import annotations

import argparse
import sys

from dgemma.cli import common

NAME = "export"
HELP = "export params to Hugging Face safetensors (diffusion_gemma or gemma4)"
ISSUE = "dgemma.convert.hf_diffusion_gemma (export; only head_alignment=noshift is exportable)"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `dgemma export` and its arguments."""
    parser = subparsers.add_parser(NAME, help=HELP, description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_config_args(parser)
    parser.add_argument("--checkpoint", metavar="PATH", help="params checkpoint to export")
    parser.add_argument("--out", metavar="DIR", help="output directory")
    parser.add_argument("--format", choices=("diffusion_gemma", "gemma4"), default="diffusion_gemma",
                        help="HF model type to write (default: diffusion_gemma)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Validate the config; the command itself is not implemented yet (exit code 2)."""
    _cfg, done = common.load_or_print(args)
    if done:
        return common.EXIT_OK
    return common.not_implemented(NAME, ISSUE)


if __name__ == "__main__":
    sys.exit(common.standalone(sys.modules[__name__]))

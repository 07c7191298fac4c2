"""`dgemma convert`: import a Hugging Face Gemma 4 / DiffusionGemma checkpoint into dgemma params.

Status: not implemented yet; the command loads and validates the config, then exits with code 2.
Will: stream HF safetensors (`model.language_model.*` / `model.decoder.*`) onto the configured shardings and
save a dgemma checkpoint.
Heavy imports (jax, flax, transformers) belong inside `run`, never at module level.
"""

from __future__ import annotations

import argparse
import sys

from dgemma.cli import common

NAME = "convert"
HELP = "import a Hugging Face Gemma 4 / DiffusionGemma checkpoint into dgemma params"
ISSUE = "dgemma.convert.hf_gemma4 (HF safetensors import with the regex key map)"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `dgemma convert` and its arguments."""
    parser = subparsers.add_parser(NAME, help=HELP, description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_config_args(parser)
    parser.add_argument("--hf-dir", metavar="DIR", help="HF checkpoint directory (safetensors + config.json)")
    parser.add_argument("--out", metavar="DIR", help="output checkpoint directory")
    return parser


def run(args: argparse.Namespace) -> int:
    """Validate the config; the command itself is not implemented yet (exit code 2)."""
    _cfg, done = common.load_or_print(args)
    if done:
        return common.EXIT_OK
    return common.not_implemented(NAME, ISSUE)


if __name__ == "__main__":
    sys.exit(common.standalone(sys.modules[__name__]))

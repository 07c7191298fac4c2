"""`dgemma eval`: evaluate a checkpoint (ELBO / CE, sampler accuracy, tokens per forward).

Status: not implemented yet; the command loads and validates the config, then exits with code 2.
Will: restore `--checkpoint` and run the evaluation metrics of diffusion_math.md on the configured data.
Heavy imports (jax, flax, transformers) belong inside `run`, never at module level.
"""

from __future__ import annotations

import argparse
import sys

from dgemma.cli import common

NAME = "eval"
HELP = "evaluate a checkpoint (ELBO / CE, sampler accuracy, tokens per forward)"
ISSUE = "dgemma evaluation (ELBO, sampler metrics)"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `dgemma eval` and its arguments."""
    parser = subparsers.add_parser(NAME, help=HELP, description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_config_args(parser)
    parser.add_argument("--checkpoint", metavar="PATH", help="checkpoint to evaluate")
    return parser


def run(args: argparse.Namespace) -> int:
    """Validate the config; the command itself is not implemented yet (exit code 2)."""
    _cfg, done = common.load_or_print(args)
    if done:
        return common.EXIT_OK
    return common.not_implemented(NAME, ISSUE)


if __name__ == "__main__":
    sys.exit(common.standalone(sys.modules[__name__]))

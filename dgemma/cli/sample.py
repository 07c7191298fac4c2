"""`dgemma sample`: generate with the entropy-bounded diffusion sampler (or AR fallback).

Status: not implemented yet; the command loads and validates the config, then exits with code 2.
Will: restore params (`--checkpoint`, else `checkpoint.init_from`), tokenize `--prompt`s and run the sampler
configured by the `sampler` section.
Heavy imports (jax, flax, transformers) belong inside `run`, never at module level.
"""

from __future__ import annotations

import argparse
import sys

from dgemma.cli import common

NAME = "sample"
HELP = "generate with the entropy-bounded diffusion sampler (or AR fallback)"
ISSUE = "dgemma.diffusion.sampler (compiled sharded EB-renoise sampler + AR fallback)"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `dgemma sample` and its arguments."""
    parser = subparsers.add_parser(NAME, help=HELP, description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_config_args(parser)
    parser.add_argument("--checkpoint", metavar="PATH", help="checkpoint to sample from")
    parser.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="prompt (repeatable)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Validate the config; the command itself is not implemented yet (exit code 2)."""
    _cfg, done = common.load_or_print(args)
    if done:
        return common.EXIT_OK
    return common.not_implemented(NAME, ISSUE)


if __name__ == "__main__":
    sys.exit(common.standalone(sys.modules[__name__]))

"""`dgemma train`: train a model (stage 1 denoising adaptation; stage 2 SD-RL).

Status: not implemented yet; the command loads and validates the config, then exits with code 2.
Will: initialise jax.distributed when multi-process (dgemma.parallel.distributed, inside run only), build the
mesh and rules from `mesh`, create or restore the train state, dump the resolved config into the run dir and run
the loop.
Heavy imports (jax, flax, transformers) belong inside `run`, never at module level.
"""

from __future__ import annotations

import argparse
import sys

from dgemma.cli import common

NAME = "train"
HELP = "train a model (stage 1 denoising adaptation; stage 2 SD-RL)"
ISSUE = "dgemma.train.loop (stage-1 training loop: resume, checkpoints, preemption)"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `dgemma train` and its arguments."""
    parser = subparsers.add_parser(NAME, help=HELP, description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_config_args(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """Validate the config; the command itself is not implemented yet (exit code 2)."""
    _cfg, done = common.load_or_print(args)
    if done:
        return common.EXIT_OK
    return common.not_implemented(NAME, ISSUE)


if __name__ == "__main__":
    sys.exit(common.standalone(sys.modules[__name__]))

"""`dgemma launch`: render (and submit) a run for local | slurm | xpk-tpu | xpk-gpu | tpu-vm.

Status: not implemented yet; the command loads and validates the config, then exits with code 2.
Will: render one resolved config plus a command for the target; `--dry-run` prints the rendered script.
Heavy imports (jax, flax, transformers) belong inside `run`, never at module level.
"""

from __future__ import annotations

import argparse
import sys

from dgemma.cli import common

NAME = "launch"
HELP = "render (and submit) a run for local | slurm | xpk-tpu | xpk-gpu | tpu-vm"
ISSUE = "launch/submit.py renderer (SLURM, XPK/GKE, TPU VM)"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `dgemma launch` and its arguments."""
    parser = subparsers.add_parser(NAME, help=HELP, description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_config_args(parser)
    parser.add_argument("--target", choices=("local", "slurm", "xpk-tpu", "xpk-gpu", "tpu-vm"), default="local",
                        help="where to run (default: local)")
    parser.add_argument("--dry-run", action="store_true", help="print the rendered launch script, submit nothing")
    return parser


def run(args: argparse.Namespace) -> int:
    """Validate the config; the command itself is not implemented yet (exit code 2)."""
    _cfg, done = common.load_or_print(args)
    if done:
        return common.EXIT_OK
    return common.not_implemented(NAME, ISSUE)


if __name__ == "__main__":
    sys.exit(common.standalone(sys.modules[__name__]))

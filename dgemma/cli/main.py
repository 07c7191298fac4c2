"""`dgemma` console entry point: builds the argparse tree from the command modules and dispatches.

    dgemma --help
    dgemma train --config configs/stage1/tiny.yaml trainer.steps=20
    dgemma plan --config configs/stage1/gemma4_26b_a4b.yaml --print-config

Importing this module is cheap: it imports only argparse and the small command modules (no jax, no transformers).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from dgemma.cli import COMMANDS
from dgemma.cli.common import EXIT_USAGE, add_command, dispatch, parse_args

__all__ = ["build_parser", "dispatch", "main", "parse_args"]

DESCRIPTION = (
    "dgemma: convert an autoregressive Gemma 4 LM into a block discrete-diffusion LM (JAX/Flax).\n"
    "Every command takes --config PATH and dotted KEY=VALUE overrides; env DGEMMA_SECTION__FIELD=value also "
    "overrides (setting one key both ways is an error)."
)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("dgemma")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The full `dgemma` parser with one subparser per module in `dgemma.cli.COMMANDS`."""
    parser = argparse.ArgumentParser(prog="dgemma", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"dgemma {_version()}")
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    for name in COMMANDS:
        add_command(sub, importlib.import_module(f"dgemma.cli.{name}"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point; returns the process exit code."""
    parser = build_parser()
    args = parse_args(parser, None if argv is None else list(argv))
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return dispatch(args)


if __name__ == "__main__":
    raise SystemExit(main())

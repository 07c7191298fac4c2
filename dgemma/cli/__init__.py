"""The `dgemma` command line: one entry point with a subcommand per module (`dgemma/cli/<name>.py`).

Each command module exposes `NAME`, `HELP`, `add_arguments(parser)` (its own arguments; `common.add_command` adds
the shared `--config` / overrides and registers it) and `run(args) -> int`, and can also be
run directly (`python -m dgemma.cli.train --config x.yaml trainer.steps=10`). Command modules import nothing heavy at
module level: jax, flax, transformers, torch are imported inside `run`, and `jax.distributed` is initialised only by
the commands that need it, inside `run`, never at import or config load.
"""

COMMANDS: tuple[str, ...] = ("train", "sample", "eval", "export", "convert", "plan", "launch", "rehearse", "demo")
"""Subcommand module names, in `dgemma --help` order."""

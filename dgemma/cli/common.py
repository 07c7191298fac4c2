"""Shared CLI plumbing: the common `--config PATH` / `overrides` arguments, config loading, argument parsing and
dispatch (used by `main` and by `standalone`), model restore.

Kept import-light on purpose: `dgemma.config` is imported inside functions, jax never.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dgemma.config import DiffusionSection, MeshSection, RunConfig

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
"""Exit code for bad configs and usage errors."""
DEBUG_ENV = "DGEMMA_DEBUG"
"""Set (to anything) to get the full traceback of an error the CLI would report in one line."""


class CommandError(Exception):
    """A user error a command reports as one line (exit 2): bad argument, missing or unusable input file."""

def check_decodable(diffusion: DiffusionSection, modes: Iterable[str]) -> None:
    """Refuse decoding modes the run's training layout (its `diffusion` section) cannot be decoded in: the block
    sampler reads the `noshift` head (query p predicts x0[p]); a `shift`-trained model decodes only in AR mode
    (docs/stage1.md §3)."""
    block_modes = sorted(set(modes) - {"ar"})
    if diffusion.head_alignment != "noshift" and block_modes:
        raise CommandError(f"diffusion.head_alignment={diffusion.head_alignment!r}: the block sampler decodes the "
                           f"noshift layout only, so mode(s) {block_modes} cannot run; use mode ar")


OVERRIDES_HELP = "dotted config overrides, e.g. trainer.steps=200 model.canvas_length=64 mesh.ici='{fsdp: 8}'"


def add_config_args(parser: argparse.ArgumentParser, *, config_required: bool = False) -> None:
    """Add `--config PATH`, positional `overrides` and `--print-config` to a subcommand parser."""
    parser.add_argument("--config", "-c", metavar="PATH", required=config_required,
                        help="YAML config (with optional `base:` chain); default: built-in defaults")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config and its sha256, then exit 0")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)


def add_command(subparsers: argparse._SubParsersAction, module: ModuleType) -> argparse.ArgumentParser:
    """Register a command module: its subparser (`NAME`, `HELP`, the module docstring as description), the shared
    config arguments, the module's own (`add_arguments`) and its `run`."""
    parser = subparsers.add_parser(module.NAME, help=module.HELP, description=module.__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser)
    module.add_arguments(parser)
    parser.set_defaults(_run=module.run)
    return parser


def load_from_args(args: argparse.Namespace) -> RunConfig:
    """Load the `RunConfig` named by `args.config` + `args.overrides` (+ `DGEMMA_A__B` env overrides).

    Raises:
      dgemma.config.ConfigError: on any config problem (main() turns it into exit code 2).
    """
    from dgemma.config import load_config

    return load_config(args.config, list(args.overrides or []))


def resolved_text(cfg: RunConfig) -> str:
    """The resolved config as YAML, headed by its sha256."""
    from dgemma.config import config_hash, dump_yaml, to_dict

    return f"# sha256 {config_hash(cfg)}\n{dump_yaml(to_dict(cfg))}"


def load_or_print(args: argparse.Namespace) -> tuple[RunConfig, bool]:
    """Load the config; with `--print-config`, print it and return `(cfg, True)` meaning "done, exit 0"."""
    cfg = load_from_args(args)
    if getattr(args, "print_config", False):
        sys.stdout.write(resolved_text(cfg))
        return cfg, True
    return cfg, False


def check_run_length(cfg: RunConfig) -> None:
    """Refuse (ConfigError) what `dgemma train` would refuse at its start about the run's length, before `dgemma plan`
    / `dgemma launch` write or queue anything: an `optim.warmup_steps` longer than the run's optimizer updates
    (`trainer.steps` x the objective's updates per step, `dgemma.train.objectives`)."""
    from dgemma.config import ConfigError
    from dgemma.config.sections import warmup_refusal
    from dgemma.train.objectives import get_objective

    updates = cfg.trainer.steps * get_objective(cfg.trainer.objective).updates_per_step(cfg)
    refusal = warmup_refusal(cfg.optim.warmup_steps, updates)
    if refusal:
        raise ConfigError(refusal)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`parse_args` that also accepts `KEY=VALUE` overrides after options (`--prompt hi a.b=1 --ckpt x c.d=2`).

    argparse cannot intermix a `nargs="*"` positional with options in a subparser, so leftover `KEY=VALUE` tokens are
    appended to `args.overrides` in order; any other leftover is the usual "unrecognized arguments" error.
    """
    args, extra = parser.parse_known_args(argv)
    bad = [t for t in extra if t.startswith("-") or "=" not in t or not hasattr(args, "overrides")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if extra:
        args.overrides = [*(args.overrides or []), *extra]
    return args


def dispatch(args: argparse.Namespace) -> int:
    """Run the command selected in `args`, mapping config errors to exit code 2 with a one-screen message."""
    from dgemma.config.types import ConfigError

    import os

    try:
        return int(args._run(args) or 0)
    except (ConfigError, CommandError) as e:
        print(f"dgemma {args.command}: {one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"dgemma {args.command}: interrupted", file=sys.stderr)
        return EXIT_ERROR
    except (OSError, ValueError, KeyError, UnicodeError) as e:
        # bad inputs found deep inside (a data file, a mesh larger than the devices, an unwritable path): their
        # messages name the file / field / value; a traceback only on request
        if os.environ.get(DEBUG_ENV):
            raise
        print(f"dgemma {args.command}: {type(e).__name__}: {one_line(e)}  (set {DEBUG_ENV}=1 for the traceback)",
              file=sys.stderr)
        return EXIT_ERROR


def one_line(e: BaseException) -> str:
    return "; ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__


def standalone(module: ModuleType, argv: list[str] | None = None) -> int:
    """Run one command module on its own (`python -m dgemma.cli.<name> ...`)."""
    name = module.NAME  # not __name__: that is "__main__" under `python -m`
    parser = argparse.ArgumentParser(prog="dgemma")
    sub = parser.add_subparsers(dest="command")
    add_command(sub, module)
    args = parse_args(parser, [name, *(sys.argv[1:] if argv is None else argv)])
    return dispatch(args)


def _mesh_devices(mesh_section):
    """All devices, or the first N when `cfg.mesh` names fixed sizes (no -1) that use N < all of them: decoding with
    a run's single-device mesh on a bigger host is fine; a mesh larger than the host is still an error."""
    import jax

    from dgemma.parallel.mesh import fixed_device_count

    devices = jax.devices()
    wanted = fixed_device_count(mesh_section)
    return devices[:wanted] if wanted is not None and wanted < len(devices) else devices


def run_mesh(mesh: MeshSection):
    """The run's mesh (its `mesh` section) on this host's devices (see `_mesh_devices`)."""
    from dgemma.parallel.mesh import make_mesh_from_config

    return make_mesh_from_config(mesh, _mesh_devices(mesh))


def build_tokenizer(cfg: RunConfig):
    """The config's tokenizer (`data.tokenizer`); one that cannot be built (a missing directory, a chat tokenizer
    without a chat template or without `<turn|>`) is a one-line CommandError naming it."""
    from dgemma.data.tokenizer import build_tokenizer as build

    try:
        return build(cfg.data.tokenizer)
    except (OSError, ValueError) as e:
        raise CommandError(f"data.tokenizer (kind={cfg.data.tokenizer.kind!r}, path={cfg.data.tokenizer.path!r}): "
                           f"{one_line(e)}") from None


def restore_model(cfg: RunConfig, checkpoint: str, *, sampling: bool = False, merge_adapters: bool = True):
    """`dgemma.checkpoint.model.restore_model` for a command's `--checkpoint`: the path is checked first, the run's
    mesh (`cfg.mesh`) and rule preset are used, and a checkpoint that does not fit the config's model (or is damaged)
    is a one-line CommandError. Returns (model, params state)."""
    from dgemma.checkpoint import CheckpointCorruptError, CheckpointMismatchError
    from dgemma.checkpoint.model import restore_model as restore

    check_params_checkpoint(checkpoint)
    try:
        return restore(cfg.model_config, checkpoint, mesh=run_mesh(cfg.mesh), rules=cfg.mesh.rules, sampling=sampling,
                       merge_adapters=merge_adapters)
    except (CheckpointMismatchError, CheckpointCorruptError) as e:
        raise CommandError(f"--checkpoint {checkpoint}: cannot restore the config's model from it "
                           f"({type(e).__name__}: {one_line(e)[:700]})") from e


def check_params_checkpoint(path) -> None:
    """Raise CommandError unless `path` is a params checkpoint root (step directories) or one step directory."""
    from pathlib import Path

    p = Path(path)
    if not p.exists():
        raise CommandError(f"--checkpoint {p}: does not exist")
    if not p.is_dir():
        raise CommandError(f"--checkpoint {p}: not a directory (expected <run dir>/params or a step in it)")
    if (p / "config.json").exists() or any(p.glob("*.safetensors")):
        raise CommandError(f"--checkpoint {p}: a Hugging Face checkpoint, not a dgemma params checkpoint; import it "
                           f"first with `dgemma convert --hf {p} --out PARAMS`")
    is_step = (p / "params").is_dir()
    steps = [c for c in p.iterdir() if c.is_dir() and c.name.isdigit()]
    if not is_step and not steps:
        raise CommandError(f"--checkpoint {p}: no params checkpoint in it (expected step directories such as "
                           f"{p}/<step>/params)")

"""dgemma configuration: strict, frozen, YAML + `base:` inheritance + env + dotted CLI overrides.

    from dgemma.config import load_config, dump_resolved
    cfg = load_config("configs/stage1/tiny.yaml", ["trainer.steps=200"])
    cfg.model.build()        # -> dgemma.model.config.ModelConfig
    dump_resolved(cfg, cfg.run.run_dir)

Config files: `configs/base.yaml`, stage configs such as `configs/stage1/*.yaml` and everything under `experiments/`
are *full* configs and load on their own. Files in a folder named after a `RunConfig` section
(`configs/model/`, `configs/mesh/`, ... see `is_fragment`) are *fragments*: partial configs meant to be listed in
`base:`; they are validated by loading `configs/base.yaml` with the fragment merged on top (`validate_config_file`).

Importing this package never imports jax and never initialises `jax.distributed`.

Modules:
  schema        `RunConfig`: the top-level frozen config, one dataclass per section (`SECTIONS`)
  sections      the sections other than `model` (run, trainer, optim, mesh, checkpoint, logging, ...)
  derived       sections derived from the dataclasses the code uses (`diffusion`, `sampler`)
  sdrl_section  the `sdrl` section, with the teacher's sampler as `sdrl.teacher_sampler`
  lora_section  the `lora` section: low-rank adapters for any objective (`rank: 0` turns them off)
  loader        the generic strict loader: YAML bases + env + dotted overrides -> frozen dataclass; config hash
  types         strict, typed construction of frozen dataclasses from plain data
  yaml_io       YAML reading / writing: the scalar schema, `base:` inheritance, deep merge
  errors        `ConfigError`, the one exception of the config system
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from dgemma.config.loader import (
    HASH_NAME,
    RESOLVED_NAME,
    config_hash,
    dump_resolved,
    env_overrides,
    load,
    parse_override,
    parse_overrides,
    with_overrides,
)
from dgemma.config.schema import SECTION_NAMES, ModelSection, RunConfig
from dgemma.config.sections import (
    CheckpointSection,
    DiffusionSection,
    LoggingSection,
    MeshSection,
    OptimSection,
    RunSection,
    SamplerSection,
    TrainerSection,
)
from dgemma.config.types import ConfigError, FrozenDict, field_help, from_dict, to_dict
from dgemma.config.yaml_io import deep_merge, dump_yaml, parse_yaml, read_tree

__all__ = [
    "CONFIGS_DIR", "HASH_NAME", "RESOLVED_NAME", "SECTION_NAMES",
    "CheckpointSection", "ConfigError", "DiffusionSection", "FrozenDict", "LoggingSection",
    "MeshSection", "ModelSection", "OptimSection", "RunConfig", "RunSection", "SamplerSection", "TrainerSection",
    "config_hash", "deep_merge", "dump_resolved", "dump_yaml", "env_overrides", "field_help", "from_dict",
    "is_fragment", "load", "load_config", "parse_override", "parse_overrides", "parse_yaml", "read_tree",
    "resolve_config_path", "to_dict",
    "validate_config_file", "with_overrides",
]

CONFIGS_DIR = (Path(__file__).resolve().parents[1] / "configs").resolve()
"""The shipped configs: package data `dgemma/configs` (in a checkout a link to the repository's `configs/`)."""


def resolve_config_path(path: str | Path) -> Path:
    """`path` itself when it exists; otherwise a relative `configs/...` path names a shipped config, so the README's
    `configs/stage1/tiny.yaml` also works outside the repository after a non-editable install."""
    path = Path(path)
    if path.exists() or path.is_absolute() or not path.parts or path.parts[0] != "configs":
        return path
    shipped = CONFIGS_DIR.joinpath(*path.parts[1:])
    return shipped if shipped.is_file() else path


def load_config(
    path: str | Path | None = None,
    overrides: Iterable[str] | Mapping[str, object] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    extra_files: Iterable[str | Path] = (),
) -> RunConfig:
    """Load a `RunConfig` from a YAML file plus env (`DGEMMA_A__B=v`) and CLI (`a.b=v`) overrides.

    Args:
      path: YAML config (None: all defaults).
      overrides: `["trainer.steps=200", ...]` or `{"trainer.steps": 200}`.
      env: environment mapping (default `os.environ`; pass `{}` to ignore env overrides).
      extra_files: YAML files merged on top of `path`, before overrides.
    """
    path = None if path is None else resolve_config_path(path)
    return load(RunConfig, path, list(overrides) if overrides is not None and not isinstance(overrides, Mapping)
                else overrides, env=env, extra_files=extra_files)


def _configs_root(path: Path) -> Path | None:
    for parent in path.resolve().parents:
        if parent.name == "configs":
            return parent
    return None


def is_fragment(path: str | Path) -> bool:
    """True for `configs/<section>/...yaml` where `<section>` is a `RunConfig` section name (e.g. configs/model/)."""
    path = Path(path).resolve()
    root = _configs_root(path)
    if root is None:
        return False
    parts = path.relative_to(root).parts
    return len(parts) > 1 and parts[0] in SECTION_NAMES


def validate_config_file(path: str | Path, *, env: Mapping[str, str] | None = None) -> RunConfig:
    """Load a config file under the repository conventions: fragments on top of `configs/base.yaml`, others alone."""
    path = Path(path)
    if is_fragment(path):
        root = _configs_root(path)
        assert root is not None
        return load_config(root / "base.yaml", extra_files=[path], env={} if env is None else env)
    return load_config(path, env={} if env is None else env)

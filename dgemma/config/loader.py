"""Generic strict config loader: YAML bases + env overrides + dotted CLI overrides -> frozen dataclass.

    cfg = load(RunConfig, "configs/stage1/tiny.yaml", ["trainer.steps=200", "model.canvas_length=16"])

Resolution order (later wins; but a key set by BOTH env and CLI is an error, never silently resolved):

    dataclass defaults  <  YAML file and its `base:` chain  <  env `DGEMMA_A__B=value`  <  CLI `a.b=value`

* Every layer is deep-merged onto the previous one, starting from the dataclass defaults, so a mapping-valued field
  (`mesh.ici`) set partially anywhere keeps its other default entries.
* CLI overrides are `dotted.key=value` tokens; the value is typed by the target field (see `types.RawValue`): text for
  `str` / string-`Literal` fields, a YAML parse otherwise (`a.b=[1,2]`, `x=true`, `lr=1e-4`, `d={data: 2}`).
  A mapping value is deep-merged; any other value replaces. Setting the same key twice on the CLI is an error.
* Env overrides: variables `DGEMMA_<SECTION>__<FIELD>[__<SUBFIELD>...]`, lower-cased, `__` -> `.`. Only variables
  that contain `__` after the prefix are overrides (every config key lives in a section), so unrelated variables such
  as `DGEMMA_CACHE_DIR` are ignored. A key is "set by both" if the env key and a CLI key are equal or one is a prefix
  of the other (`mesh.ici` vs `mesh.ici.fsdp`).
* Loading has no side effects: it never imports jax nor initialises `jax.distributed`.

Provenance: `config_hash(cfg)` is the sha256 of the canonical JSON of the resolved config (sorted keys, so key order in
YAML does not matter); `dump_resolved(cfg, run_dir)` writes `resolved_config.yaml` and `config.sha256` atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from dgemma.config.types import ConfigError, RawValue, defaults_dict, from_dict, to_dict
from dgemma.config.yaml_io import deep_merge, dump_yaml, parse_scalar, read_tree

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")  # a config dataclass

ENV_PREFIX = "DGEMMA_"
RESOLVED_NAME = "resolved_config.yaml"
HASH_NAME = "config.sha256"
_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*(?:\.[A-Za-z0-9_\-]+)*$")

Overrides = Sequence[str] | Mapping[str, Any]


def parse_override(token: str) -> tuple[str, Any]:
    """Split `a.b=value` into `("a.b", value)`; value is a `RawValue`, or a parsed list/mapping.

    Raises:
      ConfigError: if the token has no `=` or the key is not a dotted identifier.
    """
    key, sep, text = token.partition("=")
    key = key.strip()
    if not sep or not _KEY_RE.match(key):
        raise ConfigError(f"override {token!r}: expected `dotted.key=value` (e.g. trainer.steps=200)")
    text = text.strip()
    if text[:1] in ("[", "{"):
        parsed = parse_scalar(text)
        if isinstance(parsed, (list, dict)):
            return key, parsed
    return key, RawValue(text)


def parse_overrides(overrides: Overrides | None) -> dict[str, Any]:
    """Dotted key -> value for CLI-style tokens (or a ready mapping of dotted keys, e.g. from a notebook)."""
    if not overrides:
        return {}
    if isinstance(overrides, Mapping):
        out = {}
        for key, value in overrides.items():
            if not isinstance(key, str) or not _KEY_RE.match(key):
                raise ConfigError(f"override key {key!r}: expected a dotted key such as 'trainer.steps'")
            out[key] = value
        return out
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of `key=value` strings, got the single string {overrides!r}")
    out = {}
    for token in overrides:
        key, value = parse_override(token)
        if key in out:
            raise ConfigError(f"{key}: set twice on the command line ({key}=... appears more than once)")
        out[key] = value
    return out


def env_overrides(environ: Mapping[str, str] | None = None, prefix: str = ENV_PREFIX) -> dict[str, Any]:
    """Dotted key -> `RawValue` for every `DGEMMA_A__B=value` variable (see module docstring)."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for name, text in sorted(environ.items()):
        if not name.startswith(prefix) or "__" not in name[len(prefix):]:
            continue
        parts = name[len(prefix):].lower().split("__")
        if not all(parts):
            raise ConfigError(f"env {name}: empty key segment; expected {prefix}SECTION__FIELD=value")
        out[".".join(parts)] = RawValue(text)
    return out


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """`{"a.b": 1, "a.c": 2}` -> `{"a": {"b": 1, "c": 2}}`, applied in order with deep merge."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        for part in reversed(key.split(".")):
            value = {part: value}
        tree = deep_merge(tree, value)
    return tree


def _check_conflicts(cli: Mapping[str, Any], env: Mapping[str, Any], prefix: str) -> None:
    errors = []
    for ck in cli:
        for ek in env:
            if ck == ek or ck.startswith(ek + ".") or ek.startswith(ck + "."):
                env_name = prefix + "__".join(ek.split(".")).upper()
                errors.append(f"{ck}: set both on the command line and by env {env_name}; unset one of them")
    if errors:
        raise ConfigError(errors)


def load(
    cls: type[T],
    path: str | Path | None = None,
    overrides: Overrides | None = None,
    *,
    env: Mapping[str, str] | None = None,
    env_prefix: str = ENV_PREFIX,
    extra_files: Iterable[str | Path] = (),
) -> T:
    """Load a frozen config dataclass of type `cls`.

    Args:
      cls: the (top-level) config dataclass, e.g. `RunConfig`.
      path: YAML file (with optional `base:` chain); None means dataclass defaults only.
      overrides: CLI tokens `["a.b=1", ...]` or a mapping `{"a.b": 1}`.
      env: environment to read `DGEMMA_*__*` overrides from; defaults to `os.environ`. Pass `{}` to ignore env.
      env_prefix: prefix of env override variables.
      extra_files: more YAML files merged after `path` (e.g. a fragment validated on top of a base).

    Raises:
      ConfigError: unknown key (with suggestion), wrong type, missing field, CLI+env conflict, failed validator.
    """
    data: dict[str, Any] = defaults_dict(cls)  # so mapping-valued fields merge onto their defaults too
    for file in [p for p in (path, *extra_files) if p is not None]:
        data = deep_merge(data, read_tree(file))
    cli = parse_overrides(overrides)
    envs = env_overrides(env, env_prefix)
    _check_conflicts(cli, envs, env_prefix)
    data = deep_merge(deep_merge(data, _nest(envs)), _nest(cli))
    return from_dict(cls, data)


def with_overrides(cfg: T, overrides: Overrides) -> T:
    """A new, re-validated config equal to `cfg` with dotted overrides applied (the notebook way to make variants)."""
    data = deep_merge(to_dict(cfg), _nest(parse_overrides(overrides)))
    return from_dict(type(cfg), data)


def canonical_json(cfg: DataclassInstance) -> str:
    """Canonical JSON of a config: sorted keys, no whitespace, ASCII."""
    return json.dumps(to_dict(cfg), sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def config_hash(cfg: DataclassInstance) -> str:
    """sha256 hex digest of `canonical_json(cfg)`; stable across key order and Python sessions."""
    return hashlib.sha256(canonical_json(cfg).encode("utf-8")).hexdigest()


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; resolved configs are meant to be read by others
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def dump_resolved(cfg: DataclassInstance, run_dir: str | Path) -> str:
    """Write `<run_dir>/resolved_config.yaml` and `<run_dir>/config.sha256` atomically; return the hash.

    The YAML file reloads (`load(type(cfg), run_dir/resolved_config.yaml)`) to an equal config with the same hash.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    digest = config_hash(cfg)
    header = f"# dgemma resolved config; sha256 {digest}\n"
    _atomic_write(run_dir / RESOLVED_NAME, header + dump_yaml(to_dict(cfg)))
    _atomic_write(run_dir / HASH_NAME, digest + "\n")
    return digest

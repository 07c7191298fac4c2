"""YAML reading/writing for configs: a YAML-1.2-style scalar schema, `base:` inheritance and deep merge.

Scalars follow the YAML 1.2 core schema rather than PyYAML's YAML 1.1 defaults, which surprise in configs:

* only `true`/`false` (any case style) are booleans; `yes`, `no`, `on`, `off` stay strings;
* `1e-4` is a float (PyYAML 1.1 reads it as a string), `010` is the int 10 (not octal 8);
* no sexagesimal ints (`1:30`) and no implicit timestamps.

Composition: a file may list `base: [a.yaml, b.yaml]` (or a single string). Paths are relative to the directory of the
file that names them. Bases are merged left to right, then the file itself: mappings merge recursively, everything
else (scalars, lists) is replaced. Cycles, duplicate keys inside one mapping and an empty (or comment-only) file
are errors.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from dgemma.config.errors import ConfigError

BASE_KEY = "base"

_BOOL_RE = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_INT_RE = re.compile(r"^(?:[-+]?[0-9][0-9_]*|[-+]?0x[0-9a-fA-F_]+|[-+]?0o[0-7_]+|[-+]?0b[01_]+)$")
_FLOAT_RE = re.compile(
    r"^(?:[-+]?(?:\.[0-9][0-9_]*|[0-9][0-9_]*\.[0-9_]*)(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
_STD_TAGS = ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float",
             "tag:yaml.org,2002:timestamp")


def _filtered(resolvers: dict) -> dict:
    return {ch: [(tag, rx) for tag, rx in lst if tag not in _STD_TAGS] for ch, lst in resolvers.items()}


class _Loader(yaml.SafeLoader):
    """SafeLoader with the YAML 1.2 core scalar schema and duplicate-key detection."""

    yaml_implicit_resolvers = _filtered(yaml.SafeLoader.yaml_implicit_resolvers)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                mark = key_node.start_mark
                raise ConfigError(f"{mark.name}:{mark.line + 1}: duplicate key {key!r} in one mapping")
            seen[key] = True
        return super().construct_mapping(node, deep=deep)


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node).replace("_", "")
    body = text.lstrip("+-")
    return int(text, 0) if body[:2].lower() in ("0x", "0o", "0b") else int(text, 10)


def _construct_float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
    text = loader.construct_scalar(node).replace("_", "").lower()
    if text.endswith("inf"):
        return -math.inf if text.startswith("-") else math.inf
    if text.endswith("nan"):
        return math.nan
    return float(text)


def _construct_bool(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> bool:
    return loader.construct_scalar(node).lower() == "true"


_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", _BOOL_RE, list("tTfF"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:int", _INT_RE, list("-+0123456789"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))
_Loader.add_constructor("tag:yaml.org,2002:bool", _construct_bool)
_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)


class _Dumper(yaml.SafeDumper):
    """SafeDumper that also quotes strings our loader would read as non-strings (e.g. '1e-4')."""


_Dumper.add_implicit_resolver("tag:yaml.org,2002:int", _INT_RE, list("-+0123456789"))
_Dumper.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))


def parse_yaml(text: str, name: str = "<string>") -> Any:
    """Parse YAML text with dgemma's scalar schema."""
    try:
        loader = _Loader(text)
        loader.name = name
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        raise ConfigError(f"{name}: cannot parse YAML: {e}") from None


def parse_scalar(text: str) -> Any:
    """Type an override value the way YAML would: `2` -> 2, `1e-4` -> 1e-4, `[1,2]` -> [1, 2], `true` -> True."""
    return parse_yaml(text, name=f"value {text!r}")


def dump_yaml(data: Any) -> str:
    """Block-style YAML with keys in insertion order; round-trips through `parse_yaml`."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True, width=120)


def deep_merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Return `base` updated by `update`: mappings merge recursively, anything else (incl. lists) is replaced."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(out.get(key), Mapping) and isinstance(value, Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def read_tree(path: str | Path, _chain: Sequence[Path] = ()) -> dict[str, Any]:
    """Read a YAML config file and resolve its `base:` chain into one merged mapping (not yet validated)."""
    path = Path(path).resolve()
    if path in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, path))
        raise ConfigError(f"{path}: `base:` cycle: {cycle}")
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    data = parse_yaml(text, name=str(path))
    if data is None:  # an empty file would silently run every default (e.g. a 1,000-step run): never what was meant
        raise ConfigError(f"{path}: the config file is empty (no settings, only comments or blank lines); write at "
                          f"least one setting or a `{BASE_KEY}:` line")
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: the top level of a config file must be a mapping, got {type(data).__name__}")
    data = dict(data)
    bases = data.pop(BASE_KEY, None) or []
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"{path}: `{BASE_KEY}:` must be a path or a list of paths, got {bases!r}")
    merged: dict[str, Any] = {}
    for base in bases:
        base_path = (path.parent / base).resolve()
        if not base_path.is_file():
            raise ConfigError(f"{path}: base file {base!r} not found (looked for {base_path})")
        merged = deep_merge(merged, read_tree(base_path, (*_chain, path)))
    return deep_merge(merged, data)

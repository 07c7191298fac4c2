"""Strict, typed construction of frozen dataclasses from plain data (the core of dgemma's config system).

Everything here is generic: it works for any (nested) frozen dataclass, not only `RunConfig`. The rules:

* **Unknown keys are errors.** The message names the full dotted path and suggests the nearest valid key
  (`difflib`), or the same key in another section (`trainer.lr` -> "did you mean 'optim.lr'?").
* **Types are checked, not coerced.** `int` rejects bools and floats; `float` accepts ints (stored as float, so
  `1` and `1.0` hash the same); `bool` accepts only real booleans (no 1/0, no "yes"); `str` accepts only strings;
  `Literal[...]` checks membership; `tuple[X, ...]` / `tuple[A, B]` accept YAML lists; `X | None`; nested
  dataclasses from mappings; `dict[str, X]` becomes an immutable, hashable `FrozenDict`.
* **Missing required fields are errors.** Every error found in one pass is reported together.
* **Override text is typed by its target.** A CLI/env value arrives as `RawValue(text)`; for a `str` / string
  `Literal` target the text is taken verbatim (so `run.name=no` is the string "no", not False); for any other target
  it is parsed as a YAML scalar.

`Section` is a mixin for config dataclasses: its `__post_init__` runs the same type checks and normalisation on
direct Python construction (`TrainerSection(steps=3)`) and then calls `validate()`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union

from dgemma.config.errors import ConfigError
from dgemma.config.yaml_io import parse_scalar

__all__ = ["ConfigError", "FrozenDict", "RawValue", "Section", "coerce", "defaults_dict", "field_help", "from_dict",
           "schema_paths", "to_dict", "type_name"]

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")
_NULL_WORDS = ("", "~", "null", "Null", "NULL", "None")


class FrozenDict(Mapping):
    """An immutable, hashable `dict[str, X]` used for mapping-valued config fields."""

    __slots__ = ("_data", "_hash")
    _data: dict[Any, Any]
    _hash: int | None

    def __init__(self, mapping: Mapping | None = None, /, **kwargs: Any):
        object.__setattr__(self, "_data", dict(mapping or {}, **kwargs))
        object.__setattr__(self, "_hash", None)

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        digest = self._hash
        if digest is None:
            digest = hash(frozenset(self._data.items()))
            object.__setattr__(self, "_hash", digest)
        return digest

    def __repr__(self) -> str:
        return f"FrozenDict({self._data!r})"

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to attribute {name!r} of a FrozenDict")

    def __reduce__(self) -> tuple:
        return (FrozenDict, (self._data,))


@dataclasses.dataclass(frozen=True)
class RawValue:
    """Unparsed text of a CLI / env override; resolved against the target field's type (see module docstring)."""

    text: str

    def resolve(self, tp: Any) -> Any:
        if _wants_text(tp):
            if _allows_none(tp) and self.text.strip() in _NULL_WORDS:
                return None
            return self.text
        return parse_scalar(self.text)


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _allows_none(tp: Any) -> bool:
    return tp is Any or tp is type(None) or (_is_union(tp) and type(None) in typing.get_args(tp))


def _wants_text(tp: Any) -> bool:
    if tp is str:
        return True
    if typing.get_origin(tp) is Literal:
        return all(isinstance(a, str) for a in typing.get_args(tp))
    if _is_union(tp):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        return bool(rest) and all(_wants_text(a) for a in rest)
    return False


def type_name(tp: Any) -> str:
    """Readable name of a type annotation, e.g. `tuple[int, ...] | None`."""
    if isinstance(tp, type) and not typing.get_args(tp):
        return "None" if tp is type(None) else tp.__name__
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if _is_union(tp):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return str(tp).replace("typing.", "")


def _got(value: Any) -> str:
    return f"got {value!r} ({type(value).__name__})"


_FIELD_TYPES: dict[type, dict[str, Any]] = {}


def field_types(cls: Any) -> dict[str, Any]:
    """Resolved annotations of a dataclass's init fields (handles `from __future__ import annotations`); cached per
    class."""
    found = _FIELD_TYPES.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls)
        found = _FIELD_TYPES[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}
    return found


def _expect(ok: bool, path: str, tp: Any, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{path}: expected {type_name(tp)}, {_got(value)}")


def coerce(value: Any, tp: Any, path: str, root: type | None = None) -> Any:
    """Check `value` against annotation `tp` and return its normalised form (tuple, FrozenDict, float, dataclass).

    Raises:
      ConfigError: naming `path`, the expected type and the value received.
    """
    if isinstance(value, RawValue):
        try:
            value = value.resolve(tp)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e.errors[0]}") from None
    if tp is Any:
        return value
    if _is_union(tp):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors: list[str] = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, path, root)
            except ConfigError as e:
                errors.extend(e.errors)
        if len([a for a in args if a is not type(None)]) == 1:
            raise ConfigError(errors)
        raise ConfigError(f"{path}: expected {type_name(tp)}, {_got(value)}")
    if tp is type(None):
        _expect(value is None, path, tp, value)
        return None
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if not any(value == c and type(value) is type(c) for c in choices):
            hint = ""
            if isinstance(value, str):
                close = difflib.get_close_matches(value, [c for c in choices if isinstance(c, str)], n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{path}: expected {type_name(tp)}, {_got(value)}{hint}")
        return value
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return value
        _expect(isinstance(value, Mapping), path, tp, value)
        return from_dict(tp, value, path=path, root=root)
    if tp is bool:
        _expect(isinstance(value, bool), path, tp, value)
        return value
    if tp is int:
        _expect(isinstance(value, int) and not isinstance(value, bool), path, tp, value)
        return value
    if tp is float:
        _expect(isinstance(value, (int, float)) and not isinstance(value, bool), path, tp, value)
        return float(value)
    if tp is str:
        _expect(isinstance(value, str), path, tp, value)
        return value
    if origin is tuple or tp is tuple:
        _expect(isinstance(value, (list, tuple)), path, tp, value)
        args = typing.get_args(tp)
        if not args:
            return tuple(value)
        if len(args) == 2 and args[1] is Ellipsis:
            args = (args[0],) * len(value)
        elif len(args) != len(value):
            raise ConfigError(f"{path}: expected {type_name(tp)} with {len(args)} items, {_got(value)}")
        return tuple(coerce(v, a, f"{path}[{i}]", root) for i, (v, a) in enumerate(zip(value, args)))
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        _expect(isinstance(value, Mapping), path, tp, value)
        kt, vt = typing.get_args(tp) or (Any, Any)
        return FrozenDict({coerce(k, kt, f"{path}.<key>", root): coerce(v, vt, f"{path}.{k}", root)
                           for k, v in value.items()})
    raise TypeError(f"{path}: unsupported annotation {tp!r} in a config dataclass")


def schema_paths(cls: type, prefix: str = "") -> list[str]:
    """All dotted field paths of a (nested) config dataclass, e.g. ['run.name', 'run.seed', ...]."""
    out: list[str] = []
    for name, tp in field_types(cls).items():
        path = f"{prefix}{name}"
        out.append(path)
        inner = [a for a in (typing.get_args(tp) if _is_union(tp) else (tp,))
                 if isinstance(a, type) and dataclasses.is_dataclass(a)]
        for sub in inner:
            out.extend(schema_paths(sub, path + "."))
    return out


def _unknown_key_message(key: str, path: str, names: list[str], root: type | None) -> str:
    full = f"{path}.{key}" if path else key
    # The same key in another section (a setting that moved to its owner, e.g. `diffusion.canvas_length` ->
    # `model.canvas_length`) is a better hint than a similar-looking key here.
    elsewhere = [p for p in schema_paths(root) if p.rsplit(".", 1)[-1] == key] if root else []
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    if elsewhere:
        hint = f"did you mean {elsewhere[0]!r}?"
    elif close:
        hint = f"did you mean {(f'{path}.' if path else '') + close[0]!r}?"
    else:
        hint = f"valid keys here: {', '.join(names)}"
    return f"{full}: unknown key ({hint})"


def from_dict(cls: type[T], data: Mapping[str, Any], *, path: str = "", root: type | None = None) -> T:
    """Build dataclass `cls` from `data` strictly (unknown / missing / mistyped keys are errors).

    Args:
      cls: a dataclass type; nested dataclass fields are built recursively.
      data: a mapping, e.g. parsed YAML merged with overrides.
      path: dotted prefix of `data` in the full config, used in error messages.
      root: the top-level class, used to suggest keys from other sections.

    Raises:
      ConfigError: listing every problem found, or wrapping the `ValueError` of a `__post_init__` validator.
    """
    root = root or cls
    where = path or cls.__name__
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping for {cls.__name__}, {_got(data)}")
    hints = field_types(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    moved: dict[str, str] = getattr(cls, "__moved_keys__", {})
    errors: list[str] = []
    kwargs: dict[str, Any] = {}
    for key in data:
        if not isinstance(key, str):
            errors.append(f"{where}: keys must be strings, {_got(key)}")
        elif key in moved:  # a key a section replaced: name the new one
            prefix = f"{path}." if path else ""
            errors.append(f"{prefix}{key}: replaced by {prefix}{moved[key]}")
        elif key not in fields:
            errors.append(_unknown_key_message(key, path, list(fields), root))
    for name, f in fields.items():
        sub = f"{path}.{name}" if path else name
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                errors.append(f"{sub}: missing required key (expected {type_name(hints[name])})")
            continue
        try:
            kwargs[name] = coerce(data[name], hints[name], sub, root)
        except ConfigError as e:
            errors.extend(e.errors)
    if errors:
        raise ConfigError(errors)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError([m if m.startswith(f"{where}") else f"{where}: {m}" for m in e.errors]) from None
    except (ValueError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        own = f"{cls.__name__}."
        # "MeshSection.ici.x: ..." raised by the section at path "mesh" reads better as "mesh.ici.x: ...".
        raise ConfigError(f"{path}.{msg[len(own):]}" if path and msg.startswith(own) else f"{where}: {msg}") from None


def to_dict(obj: Any) -> Any:
    """Plain-data view of a config: dataclasses -> dict, tuples -> lists, FrozenDict -> dict (JSON/YAML-ready)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


def defaults_dict(cls: type) -> dict[str, Any]:
    """Plain-data defaults of a config dataclass (fields without a default are absent), the bottom merge layer."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            out[f.name] = to_dict(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = to_dict(f.default_factory())
    return out


class Section:
    """Mixin for frozen config dataclasses: type-check + normalise fields on construction, then `validate()`.

    Subclasses are `@dataclasses.dataclass(frozen=True, kw_only=True)`; `validate()` raises
    `ValueError("<Class>.<field>: ...")` and may normalise fields with `object.__setattr__`.
    """

    # every subclass is a dataclass: this tells the type checker so (`dataclasses.fields(self)` in the mixins)
    __dataclass_fields__: typing.ClassVar[dict[str, dataclasses.Field[Any]]]

    def __post_init__(self) -> None:
        cls = type(self)
        for name, tp in field_types(cls).items():
            object.__setattr__(self, name, coerce(getattr(self, name), tp, f"{cls.__name__}.{name}"))
            value = getattr(self, name)
            if isinstance(value, float) and not math.isfinite(value):
                # NaN slips through every `x <= 0` check and inf is never a meaningful setting
                self._fail(name, f"{value} is not a finite number")
        self.validate()

    def validate(self) -> None:
        """Field and cross-field checks; override in subclasses."""

    def _fail(self, field: str, msg: str) -> typing.NoReturn:
        raise ValueError(f"{type(self).__name__}.{field}: {msg}")


def field_help(cls: type) -> list[tuple[str, str, Any, str]]:
    """`(dotted path, type, default, help)` for every leaf field of a config dataclass (for `dgemma plan --schema`)."""
    rows: list[tuple[str, str, Any, str]] = []

    def walk(c: type, prefix: str) -> None:
        hints = field_types(c)
        for f in dataclasses.fields(c):
            if not f.init:
                continue
            tp = hints[f.name]
            if isinstance(tp, type) and dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
                continue
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else "<required>")
            rows.append((prefix + f.name, type_name(tp), to_dict(default), f.metadata.get("help", "")))

    walk(cls, "")
    return rows

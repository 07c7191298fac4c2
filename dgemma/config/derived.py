"""Config sections derived from the dataclasses the code uses (one source of truth for names, types and defaults).

    SamplerSection = section_of(SamplerConfig, exclude=("eos_ids", "pad_id"))
    cfg.sampler.build(eos_ids=...)      # -> SamplerConfig, validated by SamplerConfig's own validator (the code
                                        #    builds sampler configs with SamplerConfig.from_section(cfg.sampler, ...))

A derived section has exactly the fields of its target dataclass (minus `exclude`: values supplied at run time, not by
a config file), with the same types and defaults; each field's help is the target field's `metadata["help"]` or its
entry in the target's Google-style `Attributes:` docstring. Validation is the target's: constructing the section
constructs the target, and a `ValueError("<Target>.<field>: ...")` is reported as `<section path>.<field>: ...`.
The target must be importable without jax (config loading never imports it).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import typing
from typing import Any

from dgemma.config.types import Section

_ENTRY_RE = re.compile(r"^(\s*)([A-Za-z_][\w]*(?:\s*,\s*[A-Za-z_][\w]*)*)\s*:\s*(.*)$")


def docstring_attributes(cls: type) -> dict[str, str]:
    """`{field: text}` from the `Attributes:` section of `cls`'s docstring (`a, b: text` documents both)."""
    doc = inspect.getdoc(cls) or ""
    lines = doc.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return {}
    out: dict[str, str] = {}
    names: list[str] = []
    indent = None
    for line in lines[start + 1:]:
        if not line.strip():
            break
        m = _ENTRY_RE.match(line)
        if m and (indent is None or len(m.group(1)) == indent):
            indent = len(m.group(1))
            names = [n.strip() for n in m.group(2).split(",")]
            for n in names:
                out[n] = m.group(3).strip()
        elif names and (indent is None or len(line) - len(line.lstrip()) > indent):
            for n in names:
                out[n] = f"{out[n]} {line.strip()}"
        else:
            break
    return out


class DerivedSection(Section):
    """Base of generated sections: `validate()` builds the target; `build(**runtime)` returns it."""

    __target__: type
    __excluded__: tuple[str, ...] = ()

    def values(self) -> dict[str, Any]:
        """The section's fields as keyword arguments of the target."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    def build(self, **runtime: Any) -> Any:
        """The target dataclass built from this section plus run-time values (e.g. `eos_ids=` from the tokenizer)."""
        return self.__target__(**self.values(), **runtime)

    def validate(self) -> None:
        try:
            self.build()
        except ValueError as e:
            msg, own = str(e), f"{self.__target__.__name__}."
            raise ValueError(f"{type(self).__name__}.{msg[len(own):]}" if msg.startswith(own) else msg) from None


@functools.cache
def section_of(target: type, exclude: tuple[str, ...] = (), name: str | None = None) -> type:
    """A frozen, kw-only config section with the fields of dataclass `target` (see module docstring).

    Args:
      target: a dataclass whose `__init__` validates (raising `ValueError("<Target>.<field>: ...")`).
      exclude: target fields that the config does not set (they must have defaults; `build(**runtime)` passes them).
      name: class name of the section (default: `<Target minus 'Config'>Section`).
    """
    hints = typing.get_type_hints(target)
    helps = docstring_attributes(target)
    fields_by_name = {f.name: f for f in dataclasses.fields(target) if f.init}
    unknown = sorted(set(exclude) - set(fields_by_name))
    if unknown:
        raise TypeError(f"section_of({target.__name__}): exclude names unknown fields {unknown}")
    spec = []
    for f in fields_by_name.values():
        if f.name in exclude:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise TypeError(f"section_of({target.__name__}): excluded field {f.name!r} has no default")
            continue
        meta = {"help": f.metadata.get("help") or helps.get(f.name, "")}
        if f.default_factory is not dataclasses.MISSING:
            field = dataclasses.field(default_factory=f.default_factory, metadata=meta)
        elif f.default is not dataclasses.MISSING:
            field = dataclasses.field(default=f.default, metadata=meta)
        else:
            field = dataclasses.field(metadata=meta)
        spec.append((f.name, hints[f.name], field))
    base_name = target.__name__.removesuffix("Config")
    return dataclasses.make_dataclass(
        name or f"{base_name}Section", spec, bases=(DerivedSection,), frozen=True, kw_only=True,
        namespace={"__module__": __name__, "__target__": target, "__excluded__": tuple(exclude),
                   "__moved_keys__": getattr(target, "__moved_keys__", {}),
                   "__doc__": f"Config section derived from `{target.__module__}.{target.__qualname__}`: same fields, "
                              f"defaults and validator; `build()` returns the `{target.__name__}`."},
    )

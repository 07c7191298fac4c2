"""Every config field is read by the code: a field that nothing reads is a setting that silently does nothing.

Static check: for every leaf field of `RunConfig` (derived sections included), its name must be read somewhere in
`dgemma/` outside the config machinery (`dgemma/config/`) and outside validators (`validate` / `__post_init__`
bodies, which read every field by construction): as an attribute (`cfg.eval_every`), a keyword (`Stage1Config(
t_min=...)`) or a string (`getattr(cfg, "t_min")`, field-name tables). Name-based, so it cannot prove a particular
section's field is read, but a field whose name appears nowhere else (`trainer.eval_every` before the loop evaluated,
`diffusion.decoder_sliding`) fails it. The scan runs in a fresh python (tests/support/fresh_python.py says why).

One module of `dgemma/config/` counts, for its attribute reads only: `sdrl_section.py`, the one definition of the `sdrl`
section, whose derived methods (`weights()`: the arm and the term weights, `max_steps_ladder()`,
`teacher_max_steps()`) are the code that reads those fields; its string constants (help texts, moved-key tables) do not
count.
"""

import ast
from pathlib import Path

from support import fresh_python  # tests/ is on sys.path (rootdir conftest)

PACKAGE = Path(__file__).resolve().parents[2] / "dgemma"
VALIDATORS = {"validate", "__post_init__"}

ALLOWED_UNREAD: dict[str, str] = {
    # "section.field": "why it is legitimately not read by dgemma/ code",
}


CONFIG_CODE = ("sdrl_section.py",)
"""Modules of `dgemma/config/` whose attribute reads outside validators count (module docstring)."""


class _ReadNames(ast.NodeVisitor):
    def __init__(self, attributes_only: bool = False) -> None:
        self.names: set[str] = set()
        self.attributes_only = attributes_only

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        if node.name not in VALIDATORS:
            self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.names.add(node.attr)
        self.generic_visit(node)

    def visit_keyword(self, node: ast.keyword) -> None:
        if node.arg and not self.attributes_only:
            self.names.add(node.arg)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and not self.attributes_only:
            self.names.add(node.value)


def read_names(sources: dict[str, str], attributes_only: bool = False) -> set[str]:
    """Names read by the given modules (path -> source), skipping validator bodies."""
    visitor = _ReadNames(attributes_only)
    for source in sources.values():
        visitor.visit(ast.parse(source))
    return visitor.names


def unread_fields(config_cls: type, sources: dict[str, str], attribute_sources: dict[str, str] | None = None
                  ) -> list[str]:
    from dgemma.config.types import field_help

    names = read_names(sources) | read_names(attribute_sources or {}, attributes_only=True)
    return [path for path, *_ in field_help(config_cls) if path.rsplit(".", 1)[-1] not in names]


def _library_sources() -> dict[str, str]:
    return {str(p): p.read_text() for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "config"}


def _config_code_sources() -> dict[str, str]:
    return {str(PACKAGE / "config" / name): (PACKAGE / "config" / name).read_text() for name in CONFIG_CODE}


# MARK: run in a fresh python (tests/support/fresh_python.py: nothing the pytest worker holds can break ast.parse there) -----
def library_unread_fields() -> list[str]:
    from dgemma.config import RunConfig

    return unread_fields(RunConfig, _library_sources(), _config_code_sources())


def toy_unread_fields() -> list[str]:
    """The check on a toy config whose one field only a validator reads."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Section:
        read_me: int = 1
        never_read: int = 2

        def validate(self) -> None:  # validators read every field: they do not count
            assert self.never_read > 0

    @dataclasses.dataclass(frozen=True)
    class Config:
        sec: Section = dataclasses.field(default_factory=Section)

    code = {"user.py": "def f(cfg):\n    return cfg.sec.read_me\n\n"
                       "class C:\n    def validate(self):\n        return self.never_read\n"}
    return unread_fields(Config, code)


def test_every_config_field_is_read_by_the_code():
    found = fresh_python.call(Path(__file__).stem, "library_unread_fields")
    unread = [p for p in found if p not in ALLOWED_UNREAD]
    assert not unread, f"config fields nothing in dgemma/ reads (wire them or delete them): {unread}"
    stale = [p for p in ALLOWED_UNREAD if p not in found]
    assert not stale, f"allow-listed fields that are read now (remove them from ALLOWED_UNREAD): {stale}"


def test_the_check_fails_on_an_unread_field():
    assert fresh_python.call(Path(__file__).stem, "toy_unread_fields") == ["sec.never_read"]


def test_config_code_counts_attribute_reads_only():
    code = "MOVED = {'old': 'pg_weight'}\n\ndef weights(self):\n    return self.arm\n"
    names = read_names({"sdrl_section.py": code}, attributes_only=True)
    assert "arm" in names and "pg_weight" not in names

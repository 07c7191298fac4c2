"""Every package docstring maps the package as it is: each `dgemma/**/__init__.py` docstring has a `Modules:` block
naming every module and subpackage that exists in that folder, one line each, and no name that does not exist.

The module list comes from the filesystem, so moving, splitting or deleting a module fails this test until the
docstring says so. Block format (read without importing anything, so it runs in the pytest worker):

    Modules:
      name        one line on what it is (continuation lines indented further)
      sub/        a subpackage

An entry line is indented by exactly two spaces; `name`, `name.py` and `sub/` are accepted; the block ends at the
first blank line.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENTRY = re.compile(r"^  ([A-Za-z_]\w*)(\.py|/)?(?:\s{2,}\S.*)?$")


def existing(package: Path) -> set[str]:
    """The modules (`name`) and subpackages (`name/`) of a package folder, `__init__` itself left out."""
    modules = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
    subpackages = {f"{p.name}/" for p in package.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    return modules | subpackages


def listed(docstring: str) -> tuple[set[str] | None, list[str]]:
    """(the names the `Modules:` block lists, or None without a block; the block's lines that are neither an entry
    nor a continuation)."""
    lines = docstring.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Modules:")
    except StopIteration:
        return None, ["no 'Modules:' block"]
    names, bad = set(), []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        if m := ENTRY.match(line):
            names.add(m.group(1) + ("/" if m.group(2) == "/" else ""))
        elif not line.startswith("    "):
            bad.append(f"not an entry: {line.strip()!r}")
    return names, bad


def problems(package: Path) -> list[str]:
    """What the package docstring of `package` gets wrong (empty: nothing)."""
    init = package / "__init__.py"
    docstring = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
    where = init.relative_to(REPO) if REPO in init.parents else init
    if not docstring:
        return [f"{where}: no docstring"]
    names, out = listed(docstring)
    out = [f"{where}: {p}" for p in out]
    if names is None:
        return out
    have = existing(package)
    out += [f"{where}: does not list {name}" for name in sorted(have - names)]
    out += [f"{where}: lists {name}, which does not exist" for name in sorted(names - have)]
    return out


PACKAGES = sorted(p.parent for p in (REPO / "dgemma").rglob("__init__.py") if "__pycache__" not in p.parts)


def test_the_packages_are_found():
    names = {p.relative_to(REPO).as_posix() for p in PACKAGES}
    assert {"dgemma", "dgemma/model", "dgemma/planning", "dgemma/train/sdrl"} <= names


@pytest.mark.parametrize("package", PACKAGES, ids=[p.relative_to(REPO).as_posix() for p in PACKAGES])
def test_package_docstring_lists_the_modules_that_exist(package):
    assert problems(package) == []


def test_the_top_level_docstring_lists_every_subpackage():
    subpackages = {name for name in existing(REPO / "dgemma") if name.endswith("/")}
    assert len(subpackages) >= 12
    assert subpackages <= (listed(ast.get_docstring(ast.parse((REPO / "dgemma/__init__.py").read_text())))[0] or set())


def test_the_check_finds_a_missing_module_and_a_name_that_does_not_exist(tmp_path):
    """The check is able to fail: a module left out, a listed module that is gone, a malformed line, no block."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "data").mkdir()  # package data, not a subpackage: need not be listed
    for name in ("alpha", "beta"):
        (pkg / f"{name}.py").write_text("")
    (pkg / "__init__.py").write_text('"""Pkg.\n\nModules:\n  alpha.py    the first\n      continued here\n'
                                     '  gone        removed long ago\n   odd indentation\n'
                                     '  sub/        a subpackage\n"""\n')
    assert sorted(problems(pkg)) == sorted([
        f"{pkg / '__init__.py'}: not an entry: 'odd indentation'",
        f"{pkg / '__init__.py'}: does not list beta",
        f"{pkg / '__init__.py'}: lists gone, which does not exist"])
    (pkg / "__init__.py").write_text('"""Pkg without a map."""\n')
    assert problems(pkg) == [f"{pkg / '__init__.py'}: no 'Modules:' block"]

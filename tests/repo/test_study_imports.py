"""Studies (experiments/) and notebooks use only the library's public API, and the library does not know the
repository's layout.

- A file under experiments/ or notebooks/ (but a benchmark of the library's internal stages, INTERNALS_BENCHMARKS)
  imports no private name of `dgemma` (`from dgemma.x import _y`,
  `import dgemma._x`) and reads no private attribute of a `dgemma` module it imported (`study._y`): what a study needs
  from the library is public, so a library change that breaks it is seen as an API change.
- No code under dgemma/ holds a path into experiments/ (a string `experiments` or `experiments/...` outside
  docstrings): the installed package has no checkout beside it, so a study's configs and checkpoints are passed in by
  the study's run script.
- A study imports its own modules by bare name (its folder is first on sys.path, tests/support/scripts.py); those names
  are unique across experiments/, so two studies loaded in one process cannot shadow each other's modules.
AST scan of the files, no imports of them.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PATH_INTO_EXPERIMENTS = re.compile(r"(?:\.\./)*experiments(?:/.*)?")
# benchmarks that time the library's internal stages one by one (not studies): allowed their private names
INTERNALS_BENCHMARKS = {"experiments/bench_sampler.py": "times the compiled sampler's prefill and block loop apart"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(source: str) -> list[str]:
    """`line: what` for each private name of dgemma the source imports or reads off an imported dgemma module."""
    tree = ast.parse(source)
    modules: set[str] = set()  # local names bound to something imported from dgemma (modules or not)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dgemma":
            for part in node.module.split("."):
                if _private(part):
                    found.append(f"{node.lineno}: from {node.module} import ...")
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "dgemma":
                    continue
                if any(_private(part) for part in alias.name.split(".")):
                    found.append(f"{node.lineno}: import {alias.name}")
                modules.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):  # dgemma.train.study._x: the chain's root
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(set(found))


def paths_into_experiments(source: str) -> list[str]:
    """`line: string` for each string constant outside docstrings that names experiments/ as a path."""
    tree = ast.parse(source)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return sorted((f"{n.lineno}: {n.value!r}" for n in ast.walk(tree)
                   if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
                   and PATH_INTO_EXPERIMENTS.fullmatch(n.value)), key=lambda s: int(s.partition(":")[0]))


def _files(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (REPO / f).rglob("*.py"))


def test_studies_and_notebooks_import_only_public_library_names():
    found = {str(p.relative_to(REPO)): uses for p in _files("experiments", "notebooks")
             if (uses := private_uses(p.read_text()))}
    bad = {k: v for k, v in found.items() if k not in INTERNALS_BENCHMARKS}
    assert not bad, f"private dgemma names used outside the library (make them public or keep them out): {bad}"
    stale = sorted(set(INTERNALS_BENCHMARKS) - set(found))
    assert not stale, f"INTERNALS_BENCHMARKS: {stale} use no private names any more; take them off the list"


def test_the_library_holds_no_path_into_experiments():
    bad = {str(p.relative_to(REPO)): found for p in _files("dgemma") if (found := paths_into_experiments(p.read_text()))}
    assert not bad, f"dgemma/ builds paths into experiments/ (pass them in from the study's run script): {bad}"


def test_study_module_names_are_unique_across_experiments():
    """run.py is loaded by path under a name of its own; every other module of a study folder imports by bare name."""
    stems = Counter(p.stem for p in (REPO / "experiments").glob("*/*.py") if p.name != "run.py")
    assert not [s for s, n in stems.items() if n > 1], stems


def test_the_scans_find_what_they_look_for():
    """Each scan flags a planted violation (so a green run means none were found, not that nothing was looked at)."""
    src = ("from dgemma.train.study import _select_tasks, restore\nfrom dgemma.eval import stats as s\n"
           "import dgemma._lazy\nfrom pathlib import Path\nx = s._ci(1) + Path._flavour + restore.__doc__\n")
    assert private_uses(src) == ["1: from dgemma.train.study import _select_tasks", "3: import dgemma._lazy",
                                 "5: s._ci"]
    lib = ('"""Docstring naming experiments/sdrl_study."""\nfrom pathlib import Path\n'
           'A = Path(__file__).parents[2] / "experiments" / "x"\nB = "../experiments/sdrl_study/stage2.yaml"\n'
           'C = "see experiments/x"\n')
    assert paths_into_experiments(lib) == ["3: 'experiments'", "4: '../experiments/sdrl_study/stage2.yaml'"]

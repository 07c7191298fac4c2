"""The layering is a contract: `.importlinter` (layers, nothing imports dgemma.cli) and no module-level import cycles.

Function-level (lazy) imports count as imports: a lazy import still makes the importer depend on the imported module.
Both scans parse the whole package, so they run in a fresh python (tests/support/fresh_python.py says why) with the repository
root as working directory (import-linter reads its config relative to it).
"""

import configparser
import contextlib
import io
import pkgutil
from pathlib import Path

import pytest

from support import fresh_python  # tests/ is on sys.path (rootdir conftest)

REPO = Path(__file__).resolve().parents[2]
CONTRACTS = REPO / ".importlinter"

# Module cycles still present, each with its reason; a new cycle fails the test, and so does a listed one that is gone.
KNOWN_CYCLES: dict[frozenset, str] = {}


def lint_contracts() -> dict:
    """import-linter's exit code and report (run by tests/support/fresh_python.py, in the repository root)."""
    from importlinter.cli import lint_imports

    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        rc = lint_imports(config_filename=str(CONTRACTS), no_cache=True, no_logo=True)
    return {"rc": rc, "report": report.getvalue()}


def test_import_contracts_hold():
    pytest.importorskip("importlinter")
    lint = fresh_python.call(Path(__file__).stem, "lint_contracts")
    assert lint["rc"] == 0, lint["report"]


def test_every_subpackage_is_in_a_layer():
    import dgemma

    parser = configparser.ConfigParser()
    parser.read(CONTRACTS)
    layers = parser["importlinter:contract:layers"]["layers"]
    named = {p.strip() for line in layers.splitlines() for p in line.replace(":", "|").split("|") if p.strip()}
    packages = {m.name for m in pkgutil.iter_modules(dgemma.__path__) if m.ispkg}
    assert packages == named, f"packages missing from the layers contract: {sorted(packages - named)}"


def module_cycles() -> list[list[str]]:
    """[importer, imported, the chain back] for every direct import that has a chain back (run by
    tests/support/fresh_python.py)."""
    import grimp

    graph = grimp.build_graph("dgemma", cache_dir=None)
    found = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back:
                found.append([importer, imported, " -> ".join((importer, *back))])
    return found


def test_no_import_cycles():
    pytest.importorskip("grimp")
    cycles = {frozenset({importer, imported}): chain
              for importer, imported, chain in fresh_python.call(Path(__file__).stem, "module_cycles")}
    new = {k: v for k, v in cycles.items() if k not in KNOWN_CYCLES}
    assert not new, "import cycles: " + "; ".join(sorted(new.values()))
    gone = [sorted(k) for k in KNOWN_CYCLES if k not in cycles]
    assert not gone, f"listed cycles that no longer exist (remove them from KNOWN_CYCLES): {gone}"

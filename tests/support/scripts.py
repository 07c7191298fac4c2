"""Import a script under experiments/ (not a package) as a module, so tests can call its functions. Its folder is first
on sys.path while it loads, as when it runs as a script, so a study's run.py imports its own modules by name (names
unique across experiments/, tests/repo/test_study_imports.py); the folder is taken off again afterwards."""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_script(relpath: str, name: str):
    path = REPO / relpath
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module

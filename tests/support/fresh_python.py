"""Call a function of a test module in a fresh Python process and get its JSON result back.

Tests that scan the repository's source (`ast.parse`, import-linter, grimp) do the scan there, not in the pytest
worker: the worker holds whatever earlier tests left for the garbage collector (orbax's asyncio coroutines, ...), and a
finaliser that runs in the middle of `ast.parse` and parses again itself (on Python 3.11 formatting a traceback parses
its source line, e.g. in pytest's unraisable-exception hook) corrupts the parser's recursion-depth bookkeeping:
`SystemError: AST constructor recursion depth mismatch`, in a test that passes alone. A fresh process holds nothing of
the kind, so the scan's result depends only on the source it scans.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]

# argv: module, function, JSON list of arguments. Whatever the function prints goes to stderr (fd 1 is pointed there,
# C-level writes included); the original stdout carries only the JSON result.
_CHILD = """\
import importlib, json, os, sys
result_fd = os.dup(1)
os.dup2(2, 1)
sys.path[:0] = [{tests!r}, {module_dir!r}]
module, function, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
result = getattr(importlib.import_module(module), function)(*args)
sys.stdout.flush()
os.write(result_fd, json.dumps(result).encode())
"""


def call(module: str, function: str, *args: Any, timeout: float = 300) -> Any:
    """`module.function(*args)` (a test module anywhere under tests/, named by its file's stem; JSON-serialisable
    arguments and result) in a new `python` whose working directory is the repository root. A failure in the child
    fails the calling test with its stderr."""
    found = sorted(TESTS.rglob(f"{module}.py"))
    if len(found) != 1:
        raise AssertionError(f"{module}.py: expected exactly one such file under {TESTS}, found {found}")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD.format(tests=str(TESTS), module_dir=str(found[0].parent)), module, function,
         json.dumps(list(args))],
        capture_output=True, text=True, cwd=REPO, env=dict(os.environ), timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{module}.{function} failed in a fresh python (exit {proc.returncode}):\n"
                             f"{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)

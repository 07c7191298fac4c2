"""The type checker: `python -m mypy` over dgemma/ ([tool.mypy] in pyproject.toml) reports no error (docs/typing.md).

Run from pytest so that the README's test command, which CI runs, includes it. mypy runs in a subprocess (its own
interpreter state, nothing of the pytest worker's). Its incremental cache makes a rerun fast: the repository's
`.mypy_cache/` on a developer's machine, a fresh temporary directory under CI (`CI` set), where nothing may be
left behind in the checkout, one per pytest session so that both tests share it.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_mypy(cache_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=1800)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # one directory for the session under CI: the second test reuses the first one's cache (cold twice cost 79 s more)
    return tmp_path_factory.mktemp("mypy_cache") if os.environ.get("CI") else REPO / ".mypy_cache"


def test_mypy_reports_no_errors_in_dgemma(cache_dir):
    done = run_mypy(cache_dir)
    report = (done.stdout + done.stderr).strip()
    assert done.returncode == 0 and "Success: no issues found" in done.stdout, \
        f"mypy over dgemma/ (pyproject.toml [tool.mypy]) reports errors (exit {done.returncode}):\n{report}"


def test_the_check_fails_on_a_type_error(tmp_path, cache_dir):
    """The same configuration reports a wrong call into dgemma's typed config (so the test above can fail)."""
    bad = tmp_path / "bad.py"
    bad.write_text("from dgemma.config import RunConfig\n\n\ndef steps(cfg: RunConfig) -> str:\n"
                   "    return cfg.trainer.steps\n")
    # the same options as above (so the same cache serves both); the assertion is about bad.py's own line
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"),
                           "--cache-dir", str(cache_dir), str(bad)],
                          cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 1, done.stdout + done.stderr
    # (the directory may be an earlier run's: mypy replays an unchanged module's errors from its cache)
    assert 'bad.py:5: error: Incompatible return value type (got "int", expected "str")' in done.stdout, done.stdout

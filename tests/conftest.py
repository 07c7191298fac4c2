"""Test-wide setup: 8 simulated CPU devices (set before any JAX backend starts) and hermetic env."""

import os
import shutil
import tempfile

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import fast_xla  # noqa: E402  (tests/ is on sys.path: pytest's rootdir conftest import)

# Before the first JAX backend starts (XLA reads XLA_FLAGS then); subprocesses inherit them.
if fast_xla.enabled():
    os.environ["XLA_FLAGS"] = fast_xla.xla_flags(os.environ.get("XLA_FLAGS", ""))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", False)

# One persistent XLA compilation cache per test session, shared by the xdist workers (they inherit the environment of
# the process that created it): many tests compile the same programs in fresh jit closures (the toy training step of
# every train() call, the tiny samplers), and a repeated compile becomes a cache read (toy train step: 4 -> 1 CPU-s).
# A fresh directory per session keeps runs hermetic; it is removed at the end by the process that made it.
_XLA_CACHE_ENV = "PYTEST_DGEMMA_XLA_CACHE"  # not DGEMMA_*: test_cli clears those
_OWN_XLA_CACHE = _XLA_CACHE_ENV not in os.environ
if _OWN_XLA_CACHE:
    os.environ[_XLA_CACHE_ENV] = tempfile.mkdtemp(prefix="dgemma-test-xla-cache-")
jax.config.update("jax_compilation_cache_dir", os.environ[_XLA_CACHE_ENV])
# Every compile is cached, op-by-op (eager) ones too: a tiny model's eager init alone is ~35 programs (11.8 s cold,
# 1.6 s from the cache in a fresh process), and the xdist workers and CLI subprocesses repeat them.
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
# Subprocesses (CLI runs, notebook kernels, the tiny pipeline) inherit it through JAX's own environment variables: they
# compile the same programs again (a tiny model's init is ~30 eager `random.normal` compiles: 21 -> 4 s when cached).
# Tests that pass their own JAX_COMPILATION_CACHE_DIR keep theirs.
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[_XLA_CACHE_ENV]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def pytest_configure(config):
    """Under CI the parity tests (which compare against the transformers reference) must run, not skip: a missing
    torch fails the session instead of silently dropping them."""
    if not _ci():
        return
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise pytest.UsageError(f"CI is set but torch cannot be imported ({e}): the parity tests would be skipped; "
                                "install the test extra: pip install -e '.[test]'") from None


def pytest_unconfigure(config):
    if _OWN_XLA_CACHE:
        shutil.rmtree(os.environ.pop(_XLA_CACHE_ENV), ignore_errors=True)


# The few minute-long files run first: under `-n 2` one of them started last leaves the other worker idle for its
# whole length (a 1-2 min tail). With `--dist=worksteal` (pyproject addopts) an idle worker takes unstarted tests from
# the busy one, so front-loading them balances the end of the run. Whole files move, so module fixtures keep their
# grouping; the order within a file is unchanged.
_LONG_FIRST = ("test_notebooks.py", "test_tiny_pipeline.py", "test_parallel_multiprocess.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in _LONG_FIRST)  # stable: False (long) before True

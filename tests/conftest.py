"""Test-wide setup: 8 simulated CPU devices (set before any JAX backend starts) and hermetic env."""

import gc
import os
import shutil
import tempfile

# The environment the code under test reads must not come from the machine: a developer's shell or a CI runner
# inside a SLURM job would otherwise change what the tests see (DGEMMA_* config overrides, DGEMMA_DEBUG's tracebacks
# instead of exit codes, the SLURM / TPU / DGEMMA_COORDINATOR variables that make `dgemma train` initialise
# jax.distributed, an online wandb or Hub). The suite's own switches stay: DGEMMA_TEST_*, DGEMMA_UPDATE_GOLDEN and the
# SD·RL study notebook's DGEMMA_SDRL_* (tests/e2e/test_notebooks.py). Subprocesses of the tests inherit this environment.
os.environ.update(WANDB_MODE="disabled", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
# what `dgemma train` sets in its own process (the GPU allocator's fraction, `dgemma.planning.device_memory`), set once
# for the session so that an in-process `main(["train", ...])` leaves the environment as it found it
from dgemma.planning.device_memory import configure_allocator  # noqa: E402 - no jax import

configure_allocator()
for _key in [k for k in os.environ if k.startswith(("DGEMMA_", "SLURM_", "MEGASCALE_")) or k == "TPU_WORKER_HOSTNAMES"]:
    if not _key.startswith(("DGEMMA_TEST_", "DGEMMA_UPDATE_GOLDEN", "DGEMMA_SDRL_")):
        del os.environ[_key]
# Per-user tool state that notebook kernels (IPython, Jupyter), matplotlib and wandb read and write lives in a directory
# of this session, not in the home directory: a user's IPython startup scripts, Jupyter kernelspecs, matplotlibrc or
# wandb settings must not change the tests, and the tests leave nothing there (wandb writes its service logs to its
# cache dir even offline). Removed at the end by the process that made it.
_USER_DIRS_ENV = "PYTEST_DGEMMA_USER_DIRS"
_OWN_USER_DIRS = _USER_DIRS_ENV not in os.environ
if _OWN_USER_DIRS:
    os.environ[_USER_DIRS_ENV] = tempfile.mkdtemp(prefix="dgemma-test-user-dirs-")
for _var, _sub in (("IPYTHONDIR", "ipython"), ("JUPYTER_CONFIG_DIR", "jupyter-config"),
                   ("JUPYTER_DATA_DIR", "jupyter-data"), ("JUPYTER_RUNTIME_DIR", "jupyter-runtime"),
                   ("MPLCONFIGDIR", "matplotlib"), ("WANDB_CONFIG_DIR", "wandb-config"),
                   ("WANDB_CACHE_DIR", "wandb-cache"), ("WANDB_DATA_DIR", "wandb-data")):
    os.environ[_var] = os.path.join(os.environ[_USER_DIRS_ENV], _sub)

from support import fast_xla  # noqa: E402  (tests/ is on sys.path: pytest's rootdir conftest import)

# Before the first JAX backend starts (XLA reads XLA_FLAGS then); subprocesses inherit them.
if fast_xla.enabled():
    os.environ["XLA_FLAGS"] = fast_xla.xla_flags(os.environ.get("XLA_FLAGS", ""))

import jax  # noqa: E402
import pytest  # noqa: E402

from support import process_guard  # noqa: E402

# The CPU backend on every machine (with a GPU jaxlib the in-process tests would otherwise run on one GPU).
jax.config.update("jax_platforms", "cpu")
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


@pytest.fixture(scope="session", autouse=True)
def _jax_backend_started():
    """The backend starts before the first test: code that configures JAX only while no backend runs (`dgemma plan
    --compile` sets the simulated device count; tests call it in-process) then cannot change the device count of
    the tests after it in the same worker."""
    devices = jax.devices()
    assert len(devices) == 8 and devices[0].platform == "cpu", devices


@pytest.fixture(autouse=True)
def _test_leaves_its_process_unchanged():
    """tests/support/process_guard.py: cwd, environment, sys.path, JAX config, logging level, signal handlers, threads."""
    before = process_guard.Snapshot.take()
    yield
    changed = process_guard.changes_since(before)
    if changed:
        pytest.fail("the test left its process changed (restored now; use monkeypatch / tmp_path / try-finally):\n  "
                    + "\n  ".join(changed), pytrace=False)


# XLA:CPU maps every compiled program's code into memory (several mappings per program) and keeps them while JAX's
# caches hold the program. A pytest worker that runs hundreds of tests without freeing them reaches the kernel's limit on
# mappings per process (vm.max_map_count, 65,530 by default); XLA's JIT then fails to map the next program ("Failed to
# materialize symbols", "out of memory") and the worker dies in the C++ exception that follows (a segfault or abort
# inside XLA's compile or its cache write, in whatever test was running). The compiled programs are freed when a test
# file ends: the next file's programs come from the session's persistent cache above.
MAX_MAP_COUNT_SHARE = 0.5  # after freeing, a worker above this share of the limit fails the file's last test


@pytest.fixture(scope="module", autouse=True)
def _compiled_programs_freed_after_each_file():
    yield
    jax.clear_caches()
    gc.collect()
    limit, held = process_guard.max_map_count(), process_guard.memory_mappings()
    if limit and held > MAX_MAP_COUNT_SHARE * limit:
        pytest.fail(f"this test file left {held:,} memory mappings in its process after JAX's caches were cleared "
                    f"(vm.max_map_count {limit:,}): something keeps compiled programs alive, and the worker would "
                    "crash inside XLA once it reaches the limit", pytrace=False)


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
    if _OWN_USER_DIRS:
        shutil.rmtree(os.environ.pop(_USER_DIRS_ENV), ignore_errors=True)


# The few minute-long files run first: under `-n 2` one of them started last leaves the other worker idle for its
# whole length (a 1-2 min tail). With `--dist=worksteal` (pyproject addopts) an idle worker takes unstarted tests from
# the busy one, so front-loading them balances the end of the run. Whole files move, so module fixtures keep their
# grouping; the order within a file is unchanged.
_LONG_FIRST = ("test_notebooks.py", "test_tiny_pipeline.py", "test_parallel_multiprocess.py", "test_rehearse.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in _LONG_FIRST)  # stable: False (long) before True

"""Guards of the CI run itself: parity tests may not be skipped silently there, and a test may not leave its process
changed for the tests after it (tests/support/process_guard.py)."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# a pytest session in which torch cannot be imported (sys.modules[name] = None makes `import` raise ImportError)
NO_TORCH = ("import sys; sys.modules['torch'] = None; import pytest; "
            "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-n', '0', '--collect-only', 'tests/convert/test_import.py']))")


def _run(ci: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=300)


def test_missing_torch_fails_under_ci_and_skips_otherwise():
    ci = _run("true")
    assert ci.returncode != 0 and "CI is set but torch cannot be imported" in ci.stdout + ci.stderr
    local = _run(None)
    assert "CI is set" not in local.stdout + local.stderr
    assert "SKIPPED" in local.stdout  # the parity module is skipped, not an error, outside CI


# MARK: tests/support/process_guard.py fails a test that leaves its process changed, and restores it for the next test
LEAKY_TESTS = '''
import os, signal, sys, threading
import jax

START = os.getcwd()
RELEASE = threading.Event()

def test_runs_on_a_started_cpu_backend_without_the_machines_settings():
    from jax._src import xla_bridge

    assert xla_bridge.backends_are_initialized() and jax.device_count() == 8  # before the first test's own code
    assert jax.devices()[0].platform == "cpu"
    left = [k for k in os.environ if k.startswith(("DGEMMA_TRAINER", "DGEMMA_DEBUG", "SLURM_"))]
    assert not left and os.environ["WANDB_MODE"] == "disabled" and os.environ["DGEMMA_SDRL_BUDGET"] == "smoke"
    assert os.environ["IPYTHONDIR"].startswith(os.environ["PYTEST_DGEMMA_USER_DIRS"])  # not the home directory

def test_leaves_cwd(tmp_path):
    os.chdir(tmp_path)

def test_leaves_env():
    os.environ["DGEMMA_LEFT_BEHIND"] = "1"

def test_leaves_sys_path():
    sys.path.insert(0, "/left/behind")

def test_leaves_signal_handler():
    signal.signal(signal.SIGUSR1, lambda *a: None)

def test_leaves_jax_config():
    jax.config.update("jax_debug_nans", True)

def test_leaves_a_thread():
    threading.Thread(target=RELEASE.wait, name="left-running").start()

def test_sees_everything_restored():
    RELEASE.set()
    assert os.getcwd() == START and "DGEMMA_LEFT_BEHIND" not in os.environ and "/left/behind" not in sys.path
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL and not jax.config.jax_debug_nans

def test_monkeypatch_is_fine(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DGEMMA_SET_BY_MONKEYPATCH", "1")
    monkeypatch.syspath_prepend(str(tmp_path))
'''


def test_a_test_that_leaves_its_process_changed_fails_and_is_undone(tmp_path):
    (tmp_path / "test_leaky.py").write_text(LEAKY_TESTS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
           # a developer's shell / a SLURM job: removed by the conftest (the study notebook's switch is kept)
           "DGEMMA_TRAINER__STEPS": "5", "DGEMMA_DEBUG": "1", "SLURM_JOB_ID": "7", "SLURM_PROCID": "0",
           "SLURM_NTASKS": "2", "WANDB_MODE": "online", "DGEMMA_SDRL_BUDGET": "smoke"}
    env.pop("PYTEST_DGEMMA_USER_DIRS", None)  # the child session makes (and removes) its own
    # -p conftest: the suite's conftest (its guard fixture) as a plugin for a test file outside tests/
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q", "-rA",
                        "test_leaky.py"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "9 passed, 6 errors" in out, out[-3000:]  # the 6 errors: at teardown
    for test, change in (("test_leaves_cwd", "working directory"),
                         ("test_leaves_env", "environment variable DGEMMA_LEFT_BEHIND: None -> '1'"),
                         ("test_leaves_sys_path", "sys.path: added ['/left/behind']"),
                         ("test_leaves_signal_handler", "signal handler SIGUSR1"),
                         ("test_leaves_jax_config", "jax config jax_debug_nans: False -> True"),
                         ("test_leaves_a_thread", "non-daemon thread left running: left-running")):
        assert f"ERROR at teardown of {test}" in out and change in out, (test, out[-3000:])
    for test in ("test_runs_on_a_started_cpu_backend_without_the_machines_settings", "test_sees_everything_restored",
                 "test_monkeypatch_is_fine"):  # restored, and monkeypatch undoes
        assert f"PASSED test_leaky.py::{test}" in out and f"ERROR at teardown of {test}" not in out, out[-3000:]


def test_clearing_jax_caches_unmaps_compiled_programs():
    """What tests/conftest.py frees after every test file: XLA:CPU maps each compiled program's code, and the mappings
    go only with the program. Without that, a worker's mappings grew to the kernel's limit (vm.max_map_count) in CI and
    it crashed inside XLA."""
    import gc

    import jax
    import jax.numpy as jnp

    from support.process_guard import memory_mappings

    before = memory_mappings()
    assert before > 0  # Linux: /proc/self/maps
    for k in range(40):  # 40 programs (distinct shapes): XLA:CPU maps each one's kernels (code, rodata, data)
        jax.jit(lambda v: jnp.exp(jnp.sin(v)) + jnp.cos(v) / 3)(jnp.ones((k + 3, 129))).block_until_ready()
    grown = memory_mappings() - before
    jax.clear_caches()
    gc.collect()
    freed = before + grown - memory_mappings()
    assert grown >= 80 and freed >= 0.8 * grown, (before, grown, freed)

"""What a test may not leave changed in its process: the tests after it in the same pytest worker would run in it.

Checked around every test (tests/conftest.py): the working directory, `os.environ`, `sys.path`, JAX's configuration,
the root logger's level, the process's signal handlers and its non-daemon threads. A test that changes one of them and
does not put it back (use pytest's `monkeypatch`, `tmp_path`, a `try/finally`, or a subprocess) fails in its teardown
with what it changed, and the state is restored, so the tests after it are not affected. The checks compare small
snapshots (tens of microseconds a test).

Only what a test does counts, not what a library does once, on its first import in the process (which test imports
it first depends on the order): environment variables that a library sets then (jax's TF_CPP_MIN_LOG_LEVEL, tokamax's
MOSAIC_GPU_CUDA_ROOT) are not flagged, only variables changed or removed, or added under a prefix the project or its
tests read (WATCHED_ENV_PREFIXES); orbax adds a root logging handler on import, so handlers are not compared.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time

import jax

# Added variables under these prefixes are flagged (added elsewhere they may be a library's import-time setting).
WATCHED_ENV_PREFIXES = ("DGEMMA_", "JAX_", "XLA_", "WANDB_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "SLURM_", "TPU_",
                        "MEGASCALE_", "CUDA_", "PYTEST_", "PYTHON")
PYTEST_OWN_ENV = {"PYTEST_CURRENT_TEST"}  # pytest sets it for every phase of every test
SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2",
                                                   "SIGALRM", "SIGCHLD", "SIGPIPE") if hasattr(signal, name))
THREAD_GRACE_S = 2.0  # a thread a test stopped but did not join gets this long to end before it counts as left running


@dataclasses.dataclass
class Snapshot:
    cwd: str
    environ: dict[str, str]
    path: list[str]
    jax_config: dict[str, object]
    log_level: tuple[int, int]
    handlers: dict[int, object]
    threads: set[threading.Thread]

    @classmethod
    def take(cls) -> Snapshot:
        return cls(cwd=os.getcwd(), environ=dict(os.environ), path=list(sys.path), jax_config=dict(jax.config.values),
                   log_level=(logging.root.level, logging.root.manager.disable),
                   handlers={s: signal.getsignal(s) for s in SIGNALS},
                   threads={t for t in threading.enumerate() if not t.daemon})


def _new_threads(before: Snapshot) -> list[threading.Thread]:
    left = [t for t in threading.enumerate() if not t.daemon and t not in before.threads and t.is_alive()]
    deadline = time.monotonic() + THREAD_GRACE_S
    for t in left:
        t.join(max(0.0, deadline - time.monotonic()))
    return [t for t in left if t.is_alive()]


def changes_since(before: Snapshot) -> list[str]:
    """What differs from `before` (one line each); everything that can be put back is put back."""
    found = []
    if os.getcwd() != before.cwd:
        found.append(f"working directory {before.cwd} -> {os.getcwd()}")
        os.chdir(before.cwd)

    env = os.environ
    for key in sorted(set(before.environ) | set(env)):
        old, new = before.environ.get(key), env.get(key)
        if old == new or key in PYTEST_OWN_ENV or (old is None and not key.startswith(WATCHED_ENV_PREFIXES)):
            continue
        found.append(f"environment variable {key}: {old!r} -> {new!r}")
        if old is None:
            del env[key]
        else:
            env[key] = old

    if sys.path != before.path:
        found.append(f"sys.path: added {[p for p in sys.path if p not in before.path]}, "
                     f"removed {[p for p in before.path if p not in sys.path]}")
        sys.path[:] = before.path

    now = dict(jax.config.values)
    for key in sorted(k for k in set(now) | set(before.jax_config) if now.get(k) != before.jax_config.get(k)):
        found.append(f"jax config {key}: {before.jax_config.get(key)!r} -> {now.get(key)!r}")
        try:
            jax.config.update(key, before.jax_config[key])
        except Exception:  # noqa: BLE001 - some options cannot change once the backend runs; reported above
            pass

    if (logging.root.level, logging.root.manager.disable) != before.log_level:
        found.append(f"root logger level / logging.disable {before.log_level} -> "
                     f"{(logging.root.level, logging.root.manager.disable)}")
        logging.root.setLevel(before.log_level[0])
        logging.disable(before.log_level[1])

    for sig, old in before.handlers.items():
        new = signal.getsignal(sig)
        if new != old:
            found.append(f"signal handler {signal.Signals(sig).name}: {old!r} -> {new!r}")
            if old is not None and threading.current_thread() is threading.main_thread():
                signal.signal(sig, old)

    for t in _new_threads(before):
        found.append(f"non-daemon thread left running: {t.name} ({type(t).__name__}, target "
                     f"{getattr(getattr(t, '_target', None), '__qualname__', None)})")
    return found


def memory_mappings() -> int:
    """How many memory mappings this process holds (0 where /proc is not available). XLA:CPU maps each compiled
    kernel; tests/conftest.py frees compiled programs after every test file so that a worker stays far below
    `max_map_count`."""
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def max_map_count() -> int:
    """Linux's limit on memory mappings per process (`vm.max_map_count`; 0 where it cannot be read)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0

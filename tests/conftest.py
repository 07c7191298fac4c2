"""Test-wide setup: 8 simulated CPU devices (set before any JAX backend starts) and hermetic env."""

import os

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", False)


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

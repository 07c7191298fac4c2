"""Helpers shared by the sampler and rollout benchmarks: a randomly initialised model and interleaved timing."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dgemma.model.transformer import abstract_model


def random_model(cfg, seed: int, converging: bool, *, scale_std: float = 0.1, weight_std: float = 0.05,
                 sc_down_factor: float = 1.0):
    """`cfg`'s model with random weights: norm scales and layer scalars 1 + scale_std N(0, 1) (x 0.1 on the post-norms
    when `converging`, which makes the sampler's blocks converge early), every other weight weight_std N(0, 1)
    (x sc_down_factor on the self-conditioning down projection)."""
    m = abstract_model(cfg)
    flat = nnx.to_flat_state(nnx.state(m, nnx.Param))
    rng = np.random.default_rng(seed)
    for path, var in flat:
        name, shape = "/".join(map(str, path)), var.shape
        if name.endswith("scale") or "layer_scalar" in name:
            v = (1.0 + scale_std * rng.standard_normal(shape)) * (0.1 if converging and "post_" in name else 1.0)
        else:
            v = weight_std * rng.standard_normal(shape) * (
                sc_down_factor if "self_conditioning" in name and "down" in name else 1.0)
        var.set_value(jnp.asarray(v, var.dtype))
    nnx.update(m, nnx.from_flat_state(flat))
    return m


def timeit(fns: dict, reps: int) -> dict:
    """Interleaved timing: every round runs each function once (so load drift hits all of them alike).

    Returns {name: (min, median)} in seconds; the minimum is the least-disturbed run on a shared machine.
    """
    for fn in fns.values():
        jax.block_until_ready(fn())  # warm-up / compile
    ts = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            ts[k].append(time.perf_counter() - t0)
    return {k: (min(v), statistics.median(v)) for k, v in ts.items()}


def median_seconds(fn, reps: int) -> float:
    """Median wall time of `fn()` (blocked until ready) over `reps` runs, after one warm-up run."""
    return timeit({"fn": fn}, reps)["fn"][1]

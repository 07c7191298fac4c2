"""Compile the sampler's per-block program for a config's model and mesh, with abstract inputs (nothing allocated).

    report, terms, shape = compiled_sampler_block(cfg, spec, devices, rows_per_device=8)

What is compiled is `dgemma.inference.sampler.block_function`: exactly the code `sample` (and SD·RL's student
rollouts) runs per block for diffusion rows: the denoising while_loop (up to `sampler.max_steps` decoder passes over a
canvas, reading the KV cache) and the commit encoder pass, with the cache donated as `sample` donates it. Parameters
are sharded by the config's rule preset (`mesh.rules`), as SD·RL's student rollouts shard them (a serving config
names a `*_sampling` preset there); the cache, hidden states and row keys over the batch axes. `devices` may be
simulated CPU devices or a deviceless TPU topology (`dgemma.planning.tpu_aot`), as for the train step. The estimate
beside it is the planner's model of the same phase (`dgemma.planning.sdrl_plan`): the parameters, the rows' KV cache,
and one decoder step's transient (V-wide fp32 arrays, the head's activation-dtype table, one layer's forward).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from dgemma.planning.planner import PlanSpec

if TYPE_CHECKING:
    from dgemma.config import RunConfig

__all__ = ["compiled_sampler_block", "default_rows_per_device", "format_sampler_report", "sampler_block_estimate"]


def default_rows_per_device(cfg: RunConfig, spec: PlanSpec) -> int:
    """Rows per batch shard of the SD·RL student rollout (Q x G over the batch devices); data.batch_size's share
    for other objectives."""
    from dgemma.planning.sdrl_plan import _batch_devices

    from dgemma.train.objectives import get_objective

    group = get_objective(spec.objective).rollouts_per_prompt(cfg)
    return max(1, spec.global_batch * group // _batch_devices(spec))


def sampler_block_estimate(spec: PlanSpec, rows_per_device: float, capacity: int, param_bytes: int) -> dict[str, int]:
    """The planner's bytes per device for one block of the sampler over `rows_per_device` rows."""
    from dgemma.planning.sdrl_plan import _decode_step_bytes, _kv_cache_row_bytes

    m = spec.model
    return {"params": int(param_bytes), "kv_cache": int(rows_per_device * _kv_cache_row_bytes(m, capacity)),
            "decoder_step": int(_decode_step_bytes(m, rows_per_device, capacity))}


def compiled_sampler_block(cfg: RunConfig, spec: PlanSpec, devices: list, *, rows_per_device: int):
    """(CompiledReport, the planner's terms for the same phase, {rows, capacity, canvas, max_steps}) of the
    sampler's block program on `spec`'s mesh, `rows_per_device` rows on each batch shard."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from dgemma.inference.sampler import block_function
    from dgemma.model.cache import KVCache
    from dgemma.model.transformer import Transformer
    from dgemma.parallel.checks import spec_shard_count
    from dgemma.parallel.mesh import use_mesh
    from dgemma.parallel.rules import get_rules, state_shardings
    from dgemma.planning.plan_config import compile_mesh, compiled_report
    from dgemma.planning.gpu_aot import kernel_device
    from dgemma.train.sdrl.teacher import student_sampler

    if rows_per_device < 1:
        raise ValueError(f"rows per device must be >= 1, got {rows_per_device}")
    mesh = compile_mesh(cfg.mesh, spec, devices)
    batch_axes = tuple(a for a in ("data", "fsdp") if int(mesh.shape.get(a, 1)) > 1)
    rows = rows_per_device * math.prod(int(mesh.shape[a]) for a in batch_axes)
    m = spec.model
    L = m.canvas_length
    capacity = spec.prompt_len + spec.response_len
    scfg = student_sampler(cfg, cfg.sampler.max_steps, spec.response_len)

    model = nnx.eval_shape(lambda: Transformer(m, rngs=nnx.Rngs(0)))
    fn, _, params = block_function(model, scfg)
    # the flat names block_function uses, with the config's rule preset (as the rollouts place the parameters)
    shard_state = state_shardings(nnx.split(model)[1], mesh, get_rules(spec.rules))
    param_sh = {".".join(map(str, p)): s for p, s in nnx.to_flat_state(shard_state)}
    cache = jax.eval_shape(lambda: KVCache.init(m, rows, capacity))
    cache = (cache.keys, cache.values, cache.valid, cache.length)
    by_batch = NamedSharding(mesh, PartitionSpec(batch_axes or None))
    replicated = NamedSharding(mesh, PartitionSpec())
    cache_sh = (tuple(by_batch for _ in cache[0]), tuple(by_batch for _ in cache[1]), by_batch, replicated)
    dt = jnp.dtype(m.execution.dtype)
    args = (params, cache, jax.ShapeDtypeStruct((rows, m.hidden_size), dt), jax.ShapeDtypeStruct((rows,), bool),
            jax.ShapeDtypeStruct((rows, 2), jnp.uint32), jax.ShapeDtypeStruct((), jnp.int32),
            jax.ShapeDtypeStruct((), bool))
    shardings = (param_sh, cache_sh, by_batch, by_batch, by_batch, replicated, replicated)
    t0 = time.time()
    with use_mesh(mesh), kernel_device(mesh):  # kernels pick against the mesh's devices (GPU compiles)
        # the cache is donated, as `sample` donates it to each block (`_run_block`): updated in place, not copied
        compiled = jax.jit(fn, in_shardings=shardings, donate_argnums=(1,)).lower(*args).compile()
    report = compiled_report(compiled, mesh, time.time() - t0)
    param_bytes = sum(math.prod(v.shape) * jnp.dtype(v.dtype).itemsize
                      // spec_shard_count(param_sh[k].spec, dict(mesh.shape)) for k, v in params.items())
    shape = {"rows": rows, "capacity": capacity, "canvas": L, "max_steps": scfg.max_steps}
    return report, sampler_block_estimate(spec, rows_per_device, capacity, param_bytes), shape


def format_sampler_report(report, terms: dict[str, int], shape: dict[str, int], rows_per_device: int) -> str:
    """The `dgemma plan --compile --sampler` lines: XLA's memory analysis beside the planner's terms."""
    from dgemma.planning.plan_config import _gib

    est = sum(terms.values())
    return (f"compiled   sampler block (diffusion rows; K_max {shape['max_steps']}, canvas {shape['canvas']}, "
            f"{shape['rows']} rows = {rows_per_device} per batch shard, cache capacity {shape['capacity']}), per "
            f"device ({report.compile_seconds:.0f}s compile):\n"
            f"  arguments    {_gib(report.argument_bytes)}   (estimate params + KV cache "
            f"{_gib(terms['params'] + terms['kv_cache']).strip()})\n"
            f"  temporaries  {_gib(report.temp_bytes)}   (estimate one decoder step {_gib(terms['decoder_step']).strip()})\n"
            f"  peak         {_gib(report.peak_bytes)}   = {report.peak_bytes / max(est, 1):.2f} x the estimate "
            f"({_gib(est).strip()}); XLA's {report.peak_source}\n")

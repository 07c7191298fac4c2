"""The training loop: `train(cfg, loss_fn=..., model_factory=..., data=...) -> TrainSummary`.

Startup (everything that can fail on a bad config runs before anything is written):
  1. mesh from `cfg.mesh` (or the `mesh=` argument), rules preset, optimizer, abstract TrainState, shardings
     (divisibility errors surface here), and the train step compiled ahead of time against abstract inputs (shape,
     sharding and memory errors surface here; compile time is reported separately from step time);
  2. the run directory: created by writing `resolved_config.yaml` + `config.sha256` into a hidden temporary sibling
     and renaming it into place, so a failed start leaves either no run dir or a complete one;
  3. resume: the latest committed checkpoint in `checkpoint.dir` (default `<run_dir>/checkpoints`) is restored into an
     abstract target that carries the current shardings (params, opt state, step, rng) and the data iterator is
     positioned with `iterator_from_step(step)`; the saved iterator state is then checked against it (same stream
     fingerprint, same step). Without a checkpoint: `checkpoint.init_from` (a params-only checkpoint) or a fresh
     sharded init (`jit(init, out_shardings=...)`, nothing is materialized on one device).

Per step s (0-based; the state after it has `step = s + 1`, which is the number used in logs and checkpoints):
  batch s -> global arrays sharded over ('data', 'fsdp') -> `train_step` (async dispatch). The metrics of a step are
  read one step later (so the host never stalls the device pipeline) and always before any checkpoint that includes
  the step: a checkpoint is written only after every step it contains had a finite loss and grad norm.
  * logging every `trainer.log_every` steps (and the last): `metrics.jsonl` in the run dir (step, loss, lr,
    grad_norm, tokens_per_sec, step_time, time, aux metrics), wandb if `logging.wandb`, a tqdm bar (loss, tok/s, ETA);
    process 0 only;
  * checkpoints every `checkpoint.every` steps and/or `checkpoint.every_seconds`, at the end, and at preemption
    (SIGTERM/SIGINT: save at the next step boundary, wait for the write, return with `preempted=True`);
  * held-out evaluation every `trainer.eval_every` steps (`dgemma.train.periodic_eval`: denoising
    metrics by noise level, sampler exact match and steps per block), logged like the training metrics (`eval/...`);
  * a non-finite loss or grad norm raises `NonFiniteLossError` naming the step; the bad state is never saved and the
    last good checkpoint stays the latest.
  * `finally`: pending async saves are awaited, trackers closed, signal handlers restored.
At the end a params-only checkpoint is written to `<run_dir>/params/<steps>/` for evaluation/export.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from dgemma.model.kernels import check_kernel_platform
from dgemma.train.preemption import PreemptionGuard, any_process
from dgemma.train.run_dir import (  # noqa: F401  (re-exported)
    NonFiniteLossError, TrainSummary, build_mesh, prepare_run_dir, record_config)
from dgemma.train.state import ModelFactory, TrainState
from dgemma.train.step import LossFn

__all__ = ["NonFiniteLossError", "TrainSummary", "build_mesh", "prepare_run_dir", "run_objective", "train"]

log = logging.getLogger(__name__)


def _check_init_from(init_from) -> None:
    """`checkpoint.init_from` must be a params checkpoint; checked before compiling and before the run dir exists."""
    from dgemma.config.types import ConfigError

    if not init_from:
        return
    p = Path(init_from)
    if not p.is_dir():
        raise ConfigError(f"checkpoint.init_from: {init_from} does not exist (or is not a directory)")
    if (p / "config.json").exists():
        raise ConfigError(f"checkpoint.init_from: {init_from} is a Hugging Face checkpoint; convert it first "
                          f"(dgemma convert --hf {init_from} --out PARAMS) and set checkpoint.init_from=PARAMS")
    if not (p / "params").is_dir() and not any(c.is_dir() and c.name.isdigit() for c in p.iterdir()):
        raise ConfigError(f"checkpoint.init_from: {init_from} holds no params checkpoint (no step directories)")


def _default_model_factory(model_cfg) -> ModelFactory:
    from dgemma.model.transformer import Transformer

    return lambda rngs: Transformer(model_cfg, rngs=rngs)


def _data_iterator(data: Any, step: int):
    if hasattr(data, "iterator_from_step"):
        return data.iterator_from_step(step)
    if hasattr(data, "iterator"):
        return data.iterator(step)
    raise TypeError(f"data {type(data).__name__} needs iterator_from_step(step) (e.g. dgemma.data.DataPipeline)")


def _check_data_state(it: Any, saved: dict | None, step: int) -> None:
    """The saved iterator state must describe the same stream at the same step as `iterator_from_step(step)`."""
    if not saved or not hasattr(it, "set_state"):
        log.warning("checkpoint step %d has no data-iterator state; positioning the data by the step alone", step)
        return
    if "step" in saved and int(saved["step"]) != step:
        raise ValueError(f"checkpoint step {step} holds a data-iterator state for step {saved['step']}: the "
                         "checkpoint is inconsistent")
    try:
        it.set_state(saved)
    except ValueError as e:
        raise ValueError(f"cannot resume the data stream at step {step}: {e}") from e
    if hasattr(it, "step") and int(it.step) != step:
        raise ValueError(f"data iterator is at {it.step} after restoring step {step}")


def _global_batch(batch: dict, sharding) -> dict:
    from dgemma.data.pipeline import to_global_batch

    return to_global_batch(batch, sharding)


def _example_batch(data: Any) -> dict:
    if hasattr(data, "batch"):
        return data.batch(0)
    it = _data_iterator(data, 0)
    try:
        return next(it)
    finally:
        if hasattr(it, "close"):
            it.close()


def _abstract_batch(data: Any, sharding, mesh: Mesh) -> dict:
    """Global ShapeDtypeStructs (with the batch sharding) of one batch; checks batch divisibility by the mesh."""
    n = math.prod(mesh.shape[a] for a in ("data", "fsdp"))
    out = {}
    for k, v in _example_batch(data).items():
        v = np.asarray(v)
        b = v.shape[0] * jax.process_count()
        if b % n:
            raise ValueError(f"global batch size {b} (batch[{k!r}]) is not divisible by the batch-sharding mesh axes "
                             f"data x fsdp = {n}")
        out[k] = jax.ShapeDtypeStruct((b, *v.shape[1:]), jax.dtypes.canonicalize_dtype(v.dtype), sharding=sharding)
    return out


def _tokens_in(batch: dict) -> int:
    x = batch.get("tokens", next(iter(batch.values())))
    return int(np.size(x)) * jax.process_count()


def train(
    cfg: Any,
    *,
    data: Any | None = None,
    loss_fn: LossFn | None = None,
    model_factory: ModelFactory | None = None,
    mesh: Mesh | None = None,
    progress: bool = True,
    save_params_at_end: bool = True,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> TrainSummary:
    """Train `cfg.trainer.steps` optimizer steps, resuming from the run's latest checkpoint (module docstring).

    Args:
      cfg: the `RunConfig`.
      data: the batch source: `iterator_from_step(step)` returning an iterator of process-local numpy batch dicts with
        `get_state()/set_state()`; default: `dgemma.data.DataPipeline(cfg.data)` for this process.
      loss_fn: `loss_fn(model, batch, rng) -> (loss, aux)`; default: the loss of `cfg.trainer.objective`
        (`dgemma.train.objectives`); `trainer.objective=sdrl` without a loss runs `dgemma.train.sdrl.run_sdrl`.
      model_factory: `model_factory(rngs) -> nnx.Module`; default: `Transformer(cfg.model_config, rngs=rngs)`.
      mesh: overrides the mesh built from `cfg.mesh`.
      progress: show a tqdm bar (process 0).
      save_params_at_end: write a params-only checkpoint when the last step completes.
      on_step: called on process 0 with (step, metrics) each time a step's metrics are read.

    Raises:
      NonFiniteLossError: a step produced a NaN/inf loss or grad norm (that state is not saved).
    """
    from dgemma.checkpoint import CheckpointManager, restore_params, save_params
    from dgemma.config import to_dict
    from dgemma.config.types import ConfigError
    from dgemma.train.run_lock import check_free, run_dir_lock
    from dgemma.parallel.mesh import use_mesh
    from dgemma.parallel.rules import get_rules
    from dgemma.tracking import make_tracker
    from dgemma.train.optim import build_optimizer
    from dgemma.train.periodic_eval import eval_due
    from dgemma.train.state import abstract_train_state, init_train_state, train_state_shardings, with_shardings
    from dgemma.train.step import batch_sharding, make_train_step

    if loss_fn is None:
        from dgemma.train.objectives import loss_fn_for

        if cfg.trainer.objective == "sdrl":  # an iteration is not one batch: its own runner
            return run_objective(cfg, data=data, model_factory=model_factory, mesh=mesh, progress=progress,
                                 on_step=on_step)
        loss_fn = loss_fn_for(cfg)
    t_start = time.time()
    pi = jax.process_index()
    if data is None:
        from dgemma.data.pipeline import DataPipeline

        data = DataPipeline(cfg.data)
    total = int(cfg.trainer.steps)
    model_cfg = cfg.model_config
    if model_factory is None:
        model_factory = _default_model_factory(model_cfg)
        tok = getattr(data, "tokenizer", None)
        if tok is not None and getattr(tok, "vocab_size", 0) > model_cfg.vocab_size:
            raise ValueError(f"tokenizer vocab_size {tok.vocab_size} > model.vocab_size {model_cfg.vocab_size}")

    # 1. everything in memory first (and fail at once if another process trains in this run dir)
    if pi == 0:
        check_free(Path(cfg.run.run_dir).absolute())
    _check_init_from(cfg.checkpoint.init_from)
    mesh = build_mesh(cfg) if mesh is None else mesh
    check_kernel_platform(model_cfg, mesh.devices.flat[0].platform)
    rules = get_rules(cfg.mesh.rules)
    optimizer = build_optimizer(cfg.optim, total)
    graphdef, abstract = abstract_train_state(model_factory, optimizer.tx, cfg.run.seed)
    evaluator = None
    if cfg.trainer.eval_every:  # held-out set and sampler settings are checked before anything is written
        from dgemma.train.periodic_eval import PeriodicEval

        evaluator = PeriodicEval(cfg, graphdef)
    shardings = train_state_shardings(abstract, optimizer.tx, mesh, rules)
    step_fn = make_train_step(graphdef, optimizer, loss_fn, mesh=mesh, shardings=shardings,
                              grad_accum_steps=cfg.trainer.grad_accum_steps)
    bsh = batch_sharding(mesh)
    # AOT compile against abstract inputs: compile errors (shapes, shardings, OOM) surface before the run dir exists,
    # and compile time is not counted as step time.
    t0 = time.time()
    with use_mesh(mesh):  # so sharding constraints inside the model resolve against this mesh
        compiled_step = step_fn.lower(with_shardings(abstract, shardings),
                                      _abstract_batch(data, bsh, mesh)).compile()
    compile_seconds = time.time() - t0
    log.info("train step compiled in %.1fs", compile_seconds)

    # 2. run dir
    run_dir, sha = prepare_run_dir(cfg, write=pi == 0, defer_existing=True)
    metadata = {"config_sha": sha, "run_name": cfg.run.name, "param_layout": "per_layer",
                "vocab_size": model_cfg.vocab_size, "canvas_length": model_cfg.canvas_length,
                "head_alignment": cfg.diffusion.head_alignment, "mesh_rules": cfg.mesh.rules,
                "mesh_shape": {k: int(v) for k, v in mesh.shape.items()}}

    with contextlib.ExitStack() as stack:
        if pi == 0:
            stack.enter_context(run_dir_lock(run_dir))
        ckpt = stack.enter_context(CheckpointManager.from_config(cfg, metadata=metadata))

        # 3. resume / init (restore runs outside jax.set_mesh)
        if not cfg.checkpoint.resume and ckpt.latest_step() is not None:
            raise ValueError(f"checkpoint.resume=false but {ckpt.directory} already holds checkpoints "
                             f"{ckpt.all_steps()}; use another run name / checkpoint.dir, or remove them")
        restored = ckpt.restore(with_shardings(abstract, shardings)) if cfg.checkpoint.resume else None
        if restored is not None:
            state: TrainState = restored.state
            start = restored.step
            if int(state.step) != start:
                raise ValueError(f"checkpoint {restored.step} holds a state at step {int(state.step)}")
            if start > total:
                raise ConfigError(f"trainer.steps={total} is below the step {start} of the checkpoint in "
                                  f"{ckpt.directory}; raise trainer.steps to continue, or use another run.name")
            old_sha = restored.metadata.get("config_sha")
            if old_sha and old_sha != sha:
                log.warning("resuming step %d written by config %s with config %s", start, old_sha[:12], sha[:12])
            log.info("resumed from %s step %d", ckpt.directory, start)
        else:
            _, state = init_train_state(model_factory, optimizer.tx, cfg.run.seed, shardings)
            start = 0
            if cfg.checkpoint.init_from:
                params = restore_params(cfg.checkpoint.init_from, with_shardings(abstract.params, shardings.params))
                state = state.replace(params=params)
                log.info("initialized params from %s", cfg.checkpoint.init_from)

        it = _data_iterator(data, start)
        if hasattr(it, "close"):
            stack.callback(it.close)
        if restored is not None:
            _check_data_state(it, restored.data_state, start)
        if pi == 0:  # the resume succeeded: now the run dir may record this config
            record_config(cfg, run_dir, sha)

        tracker = make_tracker(cfg.logging, run_dir, config=to_dict(cfg), config_sha=sha, resume_step=start,
                               process_index=pi, name=cfg.run.name)
        stack.callback(tracker.close)
        guard = stack.enter_context(PreemptionGuard())
        bar = None
        if progress and pi == 0:
            from tqdm.auto import tqdm

            bar = stack.enter_context(tqdm(total=total, initial=start, desc=cfg.run.name, unit="step",
                                           dynamic_ncols=True,
                                           mininterval=1.0 if sys.stderr.isatty() else 30.0))

        last_metrics: dict[str, float] = {}
        clock = {"t": time.time(), "step": start}

        def drain(step: int, metrics: dict, tokens: int) -> None:
            """Read a step's metrics (blocks until that step ran), check them, log them."""
            nonlocal last_metrics
            host = {k: float(v) for k, v in jax.device_get(metrics).items()}
            now = time.time()
            dt = max(now - clock["t"], 1e-9)
            n = step - clock["step"]
            clock.update(t=now, step=step)
            host["step_time"] = dt / max(n, 1)
            host["tokens_per_sec"] = tokens * n / dt
            last_metrics = host
            finite = math.isfinite(host["loss"]) and math.isfinite(host["grad_norm"])
            if pi == 0 and (not finite or step % cfg.trainer.log_every == 0 or step == total):
                tracker.log(step, {**host, "time": now, "elapsed": now - t_start})
            if bar is not None:
                bar.update(step - bar.n)
                bar.set_postfix(loss=f"{host['loss']:.4f}", tok_s=f"{host['tokens_per_sec']:.0f}", refresh=False)
            if on_step is not None and pi == 0:
                on_step(step, host)
            if not finite:
                ckpt.wait_until_finished()
                raise NonFiniteLossError(step, host["loss"], host["grad_norm"], ckpt.latest_step(), ckpt.directory)

        pending: tuple | None = None
        preempted = False
        step = start
        for s in range(start, total):
            batch = next(it)
            tokens = _tokens_in(batch)
            global_batch = _global_batch(batch, bsh)
            with use_mesh(mesh):
                state, metrics = compiled_step(state, global_batch)
            step = s + 1
            if pending is not None:
                drain(*pending)
            pending = (step, metrics, tokens)
            preempted = any_process(guard.triggered) or ckpt.reached_preemption(step)
            if step == total or preempted or ckpt.should_save(step):
                drain(*pending)
                pending = None
                t_save = time.time()
                ckpt.save(step, state, data_state=it.get_state() if hasattr(it, "get_state") else None)
                clock["t"] += time.time() - t_save  # checkpoint time is not step time
            if evaluator is not None and not preempted and eval_due(step, cfg.trainer.eval_every):
                if pending is not None:
                    drain(*pending)
                    pending = None
                t_eval = time.time()
                with use_mesh(mesh):
                    scores = evaluator(state.params, step)
                clock["t"] += time.time() - t_eval  # evaluation time is not step time
                last_metrics.update(scores)
                if pi == 0:
                    tracker.log(step, scores)
            if preempted:
                log.warning("preempted: checkpoint step %d written to %s; stopping", step, ckpt.directory)
                break
        if pending is not None:
            drain(*pending)
        ckpt.wait_until_finished()
        # also when resuming at the final step: the run may have died between its last checkpoint and params/
        if step == total and not preempted and save_params_at_end:
            save_params(run_dir / "params", step, state.params, metadata={**metadata, "step": step})
        checkpoint_steps = ckpt.all_steps()

    return TrainSummary(run_dir=str(run_dir), config_sha=sha, start_step=start, final_step=step,
                        steps_run=step - start, preempted=preempted, last_metrics=last_metrics,
                        checkpoint_steps=checkpoint_steps, wall_seconds=time.time() - t_start,
                        compile_seconds=compile_seconds,
                        resumed=restored is not None, state=state)


def run_objective(cfg: Any, **kwargs: Any):
    """Train `cfg` with its `trainer.objective`; returns the `TrainSummary` (an `SDRLSummary` with `history` for sdrl).

    kwargs go to `train` (data, model_factory, mesh, progress, on_step, ...) or, for sdrl, to
    `dgemma.train.sdrl.run_sdrl` (data, model_factory, mesh, progress, and on_step as its per-iteration callback).
    The losses themselves are chosen by the registry `dgemma.train.objectives.loss_fn_for`.
    """
    if cfg.trainer.objective == "sdrl":
        from dgemma.train.sdrl.loop import run_sdrl

        if "on_step" in kwargs:
            kwargs["on_iteration"] = kwargs.pop("on_step")
        kwargs.pop("save_params_at_end", None)
        return run_sdrl(cfg, **kwargs)
    from dgemma.train.objectives import loss_fn_for

    return train(cfg, loss_fn=loss_fn_for(cfg), **kwargs)

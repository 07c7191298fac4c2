"""The one trainer: `run_training(cfg) -> TrainSummary` runs every objective of `dgemma.train.objectives`.

Startup (everything that can fail on a bad config runs before anything is written):
  1. the objective's refusals (`Objective.check_config`: settings it cannot honour, one line each), the locks and the
     checkpoint directory's owner / objective / resume settings (`dgemma.train.resume`), `checkpoint.init_from`;
  2. mesh from `cfg.mesh` (or `mesh=`), kernel/platform check, optimizer (its schedule spans `trainer.steps` x the
     objective's updates per step), abstract `TrainState` and its shardings (divisibility errors surface here);
  3. the objective's session (`Session` below): its own inputs (budgets, reward function, held-out set; checked
     by `Session.prepare` before the mesh) and, for a one-batch objective, the update compiled ahead of time
     (shape, sharding and memory errors surface here);
  4. the run directory, created atomically (`run_dir.prepare_run_dir`); the run directory and the checkpoint
     directory are locked for the whole run (`run_lock`);
  5. resume: the latest checkpoint is restored into an abstract target carrying the current shardings; the restored
     step is checked (state step = checkpoint step x updates per step, `trainer.steps` >= it) and the data iterator
     is positioned with `iterator_from_step(step)` and checked against the saved iterator state. Only then is the
     resolved config recorded in the run dir (a failed resume leaves the previous one in place). Without a
     checkpoint: a sharded init, then `checkpoint.init_from`'s params.

Per trainer step s (the state after it is step s + 1, the number in logs and checkpoints): the session's `step`
(async dispatch for one-batch objectives; their metrics are read one step later so the host never stalls the device,
and always before a checkpoint that includes the step). A non-finite loss or grad norm is logged, then raises
`NonFiniteLossError` naming the step; that state is never saved. Every `trainer.eval_every` steps and at the last
one the session evaluates, and the scores join that step's logged metrics. Metrics (`objectives.TRAIN_METRICS`
+ the objective's own) go to metrics.jsonl / wandb every `trainer.log_every` steps and to the tqdm bar (ETA and the
objective's `progress_metrics`). Checkpoints every `checkpoint.every` steps / `checkpoint.every_seconds`, at the end,
and at preemption (SIGTERM/SIGINT: save at the step boundary, return with `preempted=True`). At the end a params-only
checkpoint goes to `<run_dir>/params/<steps>/` (also when resuming at the final step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import jax
from jax.sharding import Mesh

from dgemma.model.kernels import check_kernel_platform
from dgemma.parallel.mesh import make_mesh_from_config
from dgemma.train.preemption import PreemptionGuard, any_process
from dgemma.train.nonfinite import NonFiniteLossError
from dgemma.train.run_dir import prepare_run_dir, record_config
from dgemma.train.summary import TrainSummary

__all__ = ["RunContext", "Session", "StepOutput", "run_training"]

log = logging.getLogger(__name__)
OBJECTIVE_STATE = "objective"  # key of the session's JSON state beside the data-iterator state in a checkpoint


@dataclasses.dataclass
class RunContext:
    """What the trainer built that a session uses."""

    cfg: Any
    objective: Any  # the `Objective`
    data: Any
    mesh: Mesh
    graphdef: Any
    abstract: Any  # TrainState of ShapeDtypeStruct
    shardings: Any  # TrainState of shardings (prefix)
    optimizer: Any
    model_factory: Callable


@dataclasses.dataclass
class StepOutput:
    """One trainer step's result. `metrics` of device scalars are read one step later; `on_host` ones at once."""

    state: Any
    metrics: dict
    tokens: int = 0  # trained tokens (for tokens_per_sec)
    on_host: bool = False
    finite: bool | None = None  # None: loss and grad_norm decide


class Session(Protocol):
    """An objective's per-run implementation (`Objective.session`): `Session(ctx, **Session.prepare(cfg, data,
    **session_kwargs))`."""

    @classmethod
    def prepare(cls, cfg: Any, data: Any, **kwargs: Any) -> dict: ...  # inputs checked before the mesh -> __init__
    def compile(self, target: Any) -> float: ...  # ahead-of-time compile against the abstract state; seconds
    def restore_target(self, target: Any) -> Any: ...  # the checkpoint item to restore, given the TrainState's
    def from_restored(self, item: Any, state: dict | None) -> Any: ...  # -> TrainState; keeps the rest itself
    def fresh(self, state: Any) -> Any: ...  # the initial TrainState (after init_from) -> TrainState
    def step(self, state: Any, batch: dict, index: int) -> StepOutput: ...
    def checkpoint_item(self, state: Any) -> Any: ...
    def objective_state(self) -> dict | None: ...  # JSON saved beside the data-iterator state
    def evaluate(self, state: Any, step: int) -> dict[str, float] | None: ...  # None: no evaluation configured


def _data_iterator(data: Any, step: int):
    if hasattr(data, "iterator_from_step"):
        return data.iterator_from_step(step)
    raise TypeError(f"data {type(data).__name__} needs iterator_from_step(step) (e.g. dgemma.data.DataPipeline)")


def _default_model_factory(model_cfg):
    from dgemma.model.transformer import Transformer

    return lambda rngs: Transformer(model_cfg, rngs=rngs)


def run_training(cfg: Any, *, objective: Any = None, data: Any = None, model_factory: Callable | None = None,
                 mesh: Mesh | None = None, progress: bool = True, save_params_at_end: bool = True,
                 on_step: Callable[[int, dict[str, float]], None] | None = None,
                 session_kwargs: dict | None = None) -> tuple[TrainSummary, Any]:
    """Train `cfg.trainer.steps` steps of `objective` (default: `cfg.trainer.objective`), resuming from the run's
    latest checkpoint (module docstring). Returns (summary, the session).

    Args:
      data: `iterator_from_step(step)` -> iterator of process-local numpy batches with `get_state()/set_state()`;
        default `dgemma.data.DataPipeline(cfg.data)`.
      model_factory: `model_factory(rngs) -> nnx.Module`; default `Transformer(cfg.model_config, rngs=rngs)`.
      mesh: overrides the mesh of `cfg.mesh`.
      on_step: called on process 0 with (step, metrics) once a step's metrics are read (evaluation included).
      session_kwargs: passed to the objective's session (e.g. `loss_fn` for a one-batch objective, `eval_data`).
    """
    from dgemma.checkpoint import CheckpointManager, save_params
    from dgemma.config import to_dict
    from dgemma.parallel.rules import get_rules
    from dgemma.tracking import make_tracker
    from dgemma.train import resume
    from dgemma.train.objectives import get_objective
    from dgemma.train.lora_init import restore_init_params
    from dgemma.train.lora_checkpoint import AdapterCheckpoints
    from dgemma.train.lora_setup import adapted_factory, optim_section
    from dgemma.train.optim import build_optimizer
    from dgemma.train.run_lock import check_free, run_dir_lock
    from dgemma.train.state import abstract_train_state, init_train_state, train_state_shardings, with_shardings

    t_start = time.time()
    pi = jax.process_index()
    obj = get_objective(cfg.trainer.objective) if objective is None else objective
    # 1. refusals, locks, the checkpoint directory: nothing is compiled or written yet
    obj.check_config(cfg)
    run_dir = Path(cfg.run.run_dir).absolute()
    ckpt_dir = Path(cfg.checkpoint.directory(cfg.run)).absolute()
    own_ckpt_lock = ckpt_dir != run_dir  # (a second flock on the same directory would refuse this very run)
    if pi == 0:
        check_free(run_dir, "run dir")
        if own_ckpt_lock:
            check_free(ckpt_dir, "checkpoint.dir")
    resume.check_checkpoint_dir(cfg, obj, ckpt_dir)
    resume.check_init_from(cfg.checkpoint.init_from)
    if data is None:
        from dgemma.data.pipeline import DataPipeline

        data = DataPipeline(cfg.data)
    total = int(cfg.trainer.steps)
    updates = obj.updates_per_step(cfg)
    model_cfg = cfg.model_config
    if model_factory is None:
        model_factory = _default_model_factory(model_cfg)
        tok = getattr(data, "tokenizer", None)
        if tok is not None and getattr(tok, "vocab_size", 0) > model_cfg.vocab_size:
            raise ValueError(f"tokenizer vocab_size {tok.vocab_size} > model.vocab_size {model_cfg.vocab_size}")
    model_factory = adapted_factory(cfg, model_factory)  # + lora adapters (lora.rank > 0)
    session_class = obj.session_class()
    session_args = session_class.prepare(cfg, data, **(session_kwargs or {}))  # its own inputs, checked
    # 2. mesh, optimizer, abstract state
    mesh = make_mesh_from_config(cfg.mesh) if mesh is None else mesh
    check_kernel_platform(model_cfg, mesh.devices.flat[0].platform)
    optimizer = build_optimizer(optim_section(cfg), total * updates)  # lora: all but the adapters frozen
    graphdef, abstract = abstract_train_state(model_factory, optimizer.tx, cfg.run.seed)
    shardings = train_state_shardings(abstract, optimizer.tx, mesh, get_rules(cfg.mesh.rules))
    train_target = with_shardings(abstract, shardings)

    def fresh_params():  # the run's start params: the seed's initialisation, then checkpoint.init_from
        _, fresh = init_train_state(model_factory, optimizer.tx, cfg.run.seed, shardings)
        if not cfg.checkpoint.init_from:
            return fresh.params
        return restore_init_params(cfg, train_target.params, fresh.params)

    adapter_ckpt = AdapterCheckpoints.for_run(cfg, optimizer, abstract.params, fresh_params)  # lora: adapters only
    # 3. the objective's session (its inputs checked, its update compiled)
    ctx = RunContext(cfg=cfg, objective=obj, data=data, mesh=mesh, graphdef=graphdef, abstract=abstract,
                     shardings=shardings, optimizer=optimizer, model_factory=model_factory)
    session = session_class(ctx, **session_args)
    compile_seconds = session.compile(train_target)

    # 4. run dir (the resolved config is recorded only after a successful resume)
    run_dir, sha = prepare_run_dir(cfg, write=pi == 0, defer_existing=True)
    metadata = {"config_sha": sha, "run_name": cfg.run.name, "objective": obj.name,
                "settings": obj.recorded_settings(cfg), "param_layout": "per_layer",
                "vocab_size": model_cfg.vocab_size, "canvas_length": model_cfg.canvas_length,
                "head_alignment": cfg.diffusion.head_alignment, "mesh_rules": cfg.mesh.rules,
                "mesh_shape": {k: int(v) for k, v in mesh.shape.items()}, **adapter_ckpt.run_metadata()}
    with contextlib.ExitStack() as stack:
        if pi == 0:
            stack.enter_context(run_dir_lock(run_dir, "run dir"))
            if own_ckpt_lock:
                ckpt_dir.mkdir(parents=True, exist_ok=True)
                stack.enter_context(run_dir_lock(ckpt_dir, "checkpoint.dir"))
            resume.check_checkpoint_dir(cfg, obj, ckpt_dir)  # again under the lock: another run may have written
        ckpt = stack.enter_context(CheckpointManager.from_config(cfg, metadata=metadata))

        # 5. resume / init (restore runs outside the mesh context)
        restored = adapter_ckpt.restored(ckpt.restore(adapter_ckpt.target(session.restore_target(train_target))),
                                         ckpt.directory) if cfg.checkpoint.resume else None
        if restored is not None:
            start = restored.step
            saved = dict(restored.data_state or {})
            # (checkpoints of the former SD·RL runner kept it under the objective's name)
            extra = saved.pop(OBJECTIVE_STATE, None) or saved.pop(obj.name, None)
            state = session.from_restored(restored.state, extra)
            resume.check_restored(int(state.step), start, updates, total, ckpt.directory)
            old_sha = restored.metadata.get("config_sha")
            if old_sha and old_sha != sha:
                log.warning("resuming step %d written by config %s with config %s", start, old_sha[:12], sha[:12])
            log.info("resumed from %s step %d", ckpt.directory, start)
        else:
            _, state = init_train_state(model_factory, optimizer.tx, cfg.run.seed, shardings)
            start, saved = 0, None
            if cfg.checkpoint.init_from:
                state = state.replace(params=restore_init_params(cfg, train_target.params, state.params))
                log.info("initialized params from %s", cfg.checkpoint.init_from)
            state = session.fresh(state)
        it = _data_iterator(data, start)
        if hasattr(it, "close"):
            stack.callback(it.close)
        if restored is not None:
            resume.check_data_state(it, saved, start)
        if pi == 0:  # the resume succeeded: now the run dir may record this config
            record_config(cfg, run_dir, sha)

        tracker = make_tracker(cfg.logging, run_dir, config=to_dict(cfg), config_sha=sha, resume_step=start,
                               process_index=pi, name=cfg.run.name)
        stack.callback(tracker.close)
        guard = stack.enter_context(PreemptionGuard())
        bar = None
        if progress and pi == 0:
            from tqdm.auto import tqdm

            bar = stack.enter_context(tqdm(total=total, initial=start, desc=f"{cfg.run.name} [{obj.name}]",
                                           unit="it" if obj.step_unit == "iteration" else "step",
                                           dynamic_ncols=True, mininterval=1.0 if sys.stderr.isatty() else 30.0))

        last_metrics: dict[str, float] = {}
        clock = {"t": time.time(), "step": start}

        def read(step: int, out: StepOutput) -> dict[str, float]:
            """A step's metrics on the host (blocks until it ran); a non-finite step is logged, then raises."""
            host = {k: float(v) for k, v in jax.device_get(out.metrics).items()}
            now = time.time()
            dt = max(now - clock["t"], 1e-9)
            n = max(step - clock["step"], 1)
            clock.update(t=now, step=step)
            host.update(step_time=dt / n, tokens_per_sec=out.tokens * n / dt, time=now, elapsed=now - t_start)
            finite = out.finite if out.finite is not None else (
                math.isfinite(host.get("loss", 0.0)) and math.isfinite(host.get("grad_norm", 0.0)))
            if not finite:
                if pi == 0:
                    tracker.log(step, {**host, "nonfinite": 1.0})
                ckpt.wait_until_finished()
                raise NonFiniteLossError(step, host.get("loss", math.nan), host.get("grad_norm", math.nan),
                                         ckpt.latest_step(), ckpt.directory)
            return host

        def report(step: int, host: dict[str, float], evaluated: bool) -> None:
            nonlocal last_metrics
            last_metrics = host
            if pi == 0 and (evaluated or step % cfg.trainer.log_every == 0 or step == total):
                tracker.log(step, host)
            if bar is not None:
                bar.update(step - bar.n)
                bar.set_postfix({k: f"{host[k]:.4g}" for k in obj.progress_metrics if k in host}, refresh=False)
            if on_step is not None and pi == 0:
                on_step(step, host)

        pending: tuple[int, StepOutput] | None = None
        preempted = False
        step = start
        for s in range(start, total):
            batch = next(it)
            out = session.step(state, batch, s)
            state = out.state
            step = s + 1
            if pending is not None:
                report(pending[0], read(*pending), False)
            pending = (step, out)
            preempted = any_process(guard.triggered) or ckpt.reached_preemption(step)
            evaluate = (not preempted and cfg.trainer.eval_every > 0
                        and (step % cfg.trainer.eval_every == 0 or step == total))
            save = step == total or preempted or ckpt.should_save(step)
            if out.on_host or evaluate or save:
                host = read(*pending)
                pending = None
                if evaluate:
                    t_eval = time.time()
                    host.update(session.evaluate(state, step) or {})
                    clock["t"] += time.time() - t_eval  # evaluation time is not step time
                report(step, host, evaluate)
            if save:
                t_save = time.time()
                data_state = dict(it.get_state()) if hasattr(it, "get_state") else {"step": step}
                extra = session.objective_state()
                if extra is not None:
                    data_state[OBJECTIVE_STATE] = extra
                ckpt.save(step, adapter_ckpt.item(session.checkpoint_item(state)), data_state=data_state,
                          metadata=adapter_ckpt.metadata(state.params))
                clock["t"] += time.time() - t_save  # checkpoint time is not step time
            if preempted:
                log.warning("preempted: checkpoint step %d written to %s; stopping", step, ckpt.directory)
                break
        if pending is not None:
            report(pending[0], read(*pending), False)
        ckpt.wait_until_finished()
        # also when resuming at the final step: the run may have died between its last checkpoint and params/
        if step == total and not preempted and save_params_at_end:
            save_params(run_dir / "params", step, state.params, metadata={**metadata, "step": step})
        checkpoint_steps = ckpt.all_steps()

    summary = TrainSummary(run_dir=str(run_dir), config_sha=sha, start_step=start, final_step=step,
                           steps_run=step - start, preempted=preempted, last_metrics=last_metrics,
                           checkpoint_steps=checkpoint_steps, wall_seconds=time.time() - t_start,
                           compile_seconds=compile_seconds, resumed=restored is not None, state=state)
    return summary, session

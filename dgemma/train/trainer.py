"""The one trainer: `train(cfg) -> TrainSummary` runs every objective of `dgemma.train.objectives`.

    summary = train(cfg)                                          # the objective of cfg.trainer.objective
    summary = train(cfg, loss_fn=my_loss, data=..., model_factory=...)   # a one-batch objective with a custom loss

`train` composes three parts (the shape of MaxText's `setup_train_loop` / `train_loop`): `setup_training` (steps 1-4
below), `restore_or_init` (5) and `train_loop` (the steps); `train(cfg, return_session=True)` also returns the
objective's session (`dgemma.train.sdrl.run_sdrl` reads its curriculum). Full-parameter vs adapter training is one
object chosen in `setup_training` (`dgemma.train.adaptation`).

Startup (everything that can fail on a bad config runs before anything is written):
  1. the objective's refusals (`Objective.check_config`: settings it cannot honour, one line each); the locks of the
     run and checkpoint directories (`run_lock.RunLocks`), taken before the data, the model and the compile: a second
     run on a directory in use is refused at once, in one line, and writes nothing; the checkpoint directory's owner /
     objective / resume settings (`dgemma.train.resume`), `checkpoint.init_from`;
  2. mesh from `cfg.mesh` (or `mesh=`), kernel/platform check, optimizer (its schedule spans `trainer.steps` x the
     objective's updates per step), abstract `TrainState` and its shardings (divisibility errors surface here);
  3. the objective's session (`Session` below): its own inputs (step limits, reward function, held-out set; checked
     by `Session.prepare` before the mesh) and, for a one-batch objective, the update compiled ahead of time
     (shape, sharding and memory errors surface here);
  4. the run directory, created atomically (`run_dir.prepare_run_dir`) and locked at once if it is new; both locks
     are held for the whole run;
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
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import jax
from jax.sharding import Mesh

from dgemma.model.kernels import check_kernel_platform
from dgemma.parallel.mesh import make_mesh_from_config
from dgemma.train.adaptation import adaptation_for
from dgemma.train.preemption import PreemptionGuard, any_process
from dgemma.train.run_dir import prepare_run_dir, record_config
from dgemma.train.run_lock import RunLocks
from dgemma.train.session import OBJECTIVE_STATE, RunContext, Session, StepOutput  # noqa: F401 (re-exported)
from dgemma.train.step_report import StepReport
from dgemma.train.summary import TrainSummary

if TYPE_CHECKING:
    from dgemma.config.schema import RunConfig

__all__ = ["RunContext", "Session", "StepOutput", "TrainSetup", "restore_or_init", "setup_training", "train",
           "train_loop"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainSetup:
    """What `setup_training` built: the run's parts, its session (compiled) and its run directory (the locks are
    held by the caller's ExitStack)."""

    ctx: RunContext
    session: Any  # the objective's `Session`
    train_target: Any  # TrainState of ShapeDtypeStruct carrying the shardings (restore / compile target)
    checkpoints: Any  # `AdapterCheckpoints` of the adaptation: what a run checkpoint holds
    run_dir: Path
    config_sha: str
    metadata: dict  # recorded in every checkpoint
    updates: int  # optimizer updates per trainer step
    compile_seconds: float
    t_start: float

    @property
    def total(self) -> int:
        return int(self.ctx.cfg.trainer.steps)


@dataclasses.dataclass
class Start:
    """Where the step loop starts (`restore_or_init`)."""

    state: Any  # TrainState
    step: int
    iterator: Any  # the data iterator positioned at `step`
    resumed: bool


@dataclasses.dataclass
class LoopEnd:
    """Where the step loop stopped (`train_loop`)."""

    state: Any
    step: int
    preempted: bool
    last_metrics: dict[str, float]


def _data_iterator(data: Any, step: int) -> Any:
    if hasattr(data, "iterator_from_step"):
        return data.iterator_from_step(step)
    raise TypeError(f"data {type(data).__name__} needs iterator_from_step(step) (e.g. dgemma.data.DataPipeline)")


def _default_model_factory(model_cfg: Any) -> Callable:
    from dgemma.model.transformer import Transformer

    return lambda rngs: Transformer(model_cfg, rngs=rngs)


def setup_training(cfg: RunConfig, stack: contextlib.ExitStack, *, objective: Any = None, data: Any = None,
                   model_factory: Callable | None = None, mesh: Mesh | None = None,
                   session_kwargs: dict | None = None) -> TrainSetup:
    """Startup steps 1-4 (module docstring): refusals, locks (held until `stack` closes), the mesh, optimizer and
    abstract state, the session (compiled), the run directory. Nothing is written before the locks are held."""
    from dgemma.parallel.rules import get_rules
    from dgemma.train import resume
    from dgemma.train.objectives import get_objective
    from dgemma.train.optim import build_optimizer
    from dgemma.train.state import abstract_train_state, init_train_state, train_state_shardings, with_shardings

    t_start = time.time()
    pi = jax.process_index()
    obj = get_objective(cfg.trainer.objective) if objective is None else objective
    # 1. refusals and the locks: nothing is built, compiled or written yet
    obj.check_config(cfg)
    locks = RunLocks.for_config(cfg)
    if pi == 0:
        locks.take_existing()  # a directory in use is refused here, in one line
        stack.callback(locks.release)
    try:
        resume.check_checkpoint_dir(cfg, obj, locks.ckpt_dir)
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
        adaptation = adaptation_for(cfg)  # full-parameter or adapter training, chosen once
        model_factory = adaptation.model_factory(model_factory)
        session_class = obj.session_class()
        session_args = session_class.prepare(cfg, data, **(session_kwargs or {}))  # its own inputs, checked
        # 2. mesh, optimizer, abstract state
        mesh = make_mesh_from_config(cfg.mesh) if mesh is None else mesh
        check_kernel_platform(model_cfg, mesh.devices.flat[0].platform)
        optimizer = build_optimizer(adaptation.optim_section(), total * updates)
        graphdef, abstract = abstract_train_state(model_factory, optimizer.tx, cfg.run.seed)
        shardings = train_state_shardings(abstract, optimizer.tx, mesh, get_rules(cfg.mesh.rules))
        train_target = with_shardings(abstract, shardings)

        def fresh_params() -> Any:  # the run's start params: the seed's initialisation, then checkpoint.init_from
            _, fresh = init_train_state(model_factory, optimizer.tx, cfg.run.seed, shardings)
            if not cfg.checkpoint.init_from:
                return fresh.params
            return adaptation.init_params(train_target.params, fresh.params)

        checkpoints = adaptation.checkpoints(optimizer, abstract.params, fresh_params)
        # 3. the objective's session (its inputs checked, its update compiled)
        ctx = RunContext(cfg=cfg, objective=obj, data=data, mesh=mesh, graphdef=graphdef, abstract=abstract,
                         shardings=shardings, optimizer=optimizer, model_factory=model_factory, adaptation=adaptation)
        session = session_class(ctx, **session_args)
        compile_seconds = session.compile(train_target)
    except BaseException:
        locks.release(started=False)  # and the checkpoint directory it created, if any
        raise
    # 4. run dir (the resolved config is recorded only after a successful resume)
    run_dir, sha = prepare_run_dir(cfg, write=pi == 0, defer_existing=True)
    metadata = {"config_sha": sha, "run_name": cfg.run.name, "objective": obj.name,
                "settings": obj.recorded_settings(cfg), "param_layout": "per_layer",
                "vocab_size": model_cfg.vocab_size, "canvas_length": model_cfg.canvas_length,
                "head_alignment": cfg.diffusion.head_alignment, "mesh_rules": cfg.mesh.rules,
                "mesh_shape": {k: int(v) for k, v in mesh.shape.items()}, **checkpoints.run_metadata()}
    if pi == 0:
        locks.take_rest()  # a new run dir exists now
        resume.check_checkpoint_dir(cfg, obj, locks.ckpt_dir)  # again under the lock: another run may have written
    return TrainSetup(ctx=ctx, session=session, train_target=train_target, checkpoints=checkpoints, run_dir=run_dir,
                      config_sha=sha, metadata=metadata, updates=updates, compile_seconds=compile_seconds,
                      t_start=t_start)


def restore_or_init(setup: TrainSetup, ckpt: Any, stack: contextlib.ExitStack) -> Start:
    """Startup step 5: the latest checkpoint restored and checked (`checkpoint.resume`), else a sharded init then
    `checkpoint.init_from`'s params; the data iterator positioned (closed with `stack`). Then the run dir records
    this config."""
    from dgemma.train import resume
    from dgemma.train.state import init_train_state

    ctx, session, cfg = setup.ctx, setup.session, setup.ctx.cfg
    target = setup.checkpoints.target(session.restore_target(setup.train_target))
    restored = (setup.checkpoints.restored(ckpt.restore(target), ckpt.directory) if cfg.checkpoint.resume
                else None)  # (restore runs outside the mesh context)
    if restored is not None:
        start = restored.step
        saved = dict(restored.data_state or {})
        # (checkpoints of the former SD·RL runner kept it under the objective's name)
        extra = saved.pop(OBJECTIVE_STATE, None) or saved.pop(ctx.objective.name, None)
        state = session.from_restored(restored.state, extra)
        resume.check_restored(int(state.step), start, setup.updates, setup.total, ckpt.directory)
        old_sha = restored.metadata.get("config_sha")
        if old_sha and old_sha != setup.config_sha:
            log.warning("resuming step %d written by config %s with config %s", start, old_sha[:12],
                        setup.config_sha[:12])
        log.info("resumed from %s step %d", ckpt.directory, start)
    else:
        _, state = init_train_state(ctx.model_factory, ctx.optimizer.tx, cfg.run.seed, ctx.shardings)
        start, saved = 0, None
        if cfg.checkpoint.init_from:
            params = ctx.adaptation.init_params(setup.train_target.params, state.params)
            state = dataclasses.replace(state, params=params)
            log.info("initialized params from %s", cfg.checkpoint.init_from)
        state = session.fresh(state)
    it = _data_iterator(ctx.data, start)
    if hasattr(it, "close"):
        stack.callback(it.close)
    if restored is not None:
        resume.check_data_state(it, saved, start)
    if jax.process_index() == 0:  # the resume succeeded: now the run dir may record this config
        record_config(cfg, setup.run_dir, setup.config_sha)
    return Start(state=state, step=start, iterator=it, resumed=restored is not None)


def train_loop(setup: TrainSetup, ckpt: Any, start: Start, stack: contextlib.ExitStack, *, progress: bool = True,
               on_step: Callable[[int, dict[str, float]], None] | None = None) -> LoopEnd:
    """The steps `start.step` .. `trainer.steps` (module docstring): metrics, evaluation, checkpoints, preemption."""
    from dgemma.config import to_dict
    from dgemma.tracking import make_tracker

    ctx, session, cfg = setup.ctx, setup.session, setup.ctx.cfg
    obj, total, pi, it = ctx.objective, setup.total, jax.process_index(), start.iterator
    tracker = make_tracker(cfg.logging, setup.run_dir, config=to_dict(cfg), config_sha=setup.config_sha,
                           resume_step=start.step, process_index=pi, name=cfg.run.name)
    stack.callback(tracker.close)
    guard = stack.enter_context(PreemptionGuard())
    bar = None
    if progress and pi == 0:
        from tqdm.auto import tqdm

        bar = stack.enter_context(tqdm(total=total, initial=start.step, desc=f"{cfg.run.name} [{obj.name}]",
                                       unit="it" if obj.step_unit == "iteration" else "step",
                                       dynamic_ncols=True, mininterval=1.0 if sys.stderr.isatty() else 30.0))
    report = StepReport(start=start.step, total=total, t_start=setup.t_start, log_every=cfg.trainer.log_every,
                        progress_metrics=obj.progress_metrics, tracker=tracker, ckpt=ckpt, bar=bar, on_step=on_step,
                        process_index=pi)
    pending: tuple[int, StepOutput] | None = None
    preempted = False
    state, step = start.state, start.step
    for s in range(start.step, total):
        batch = next(it)
        out = session.step(state, batch, s)
        state = out.state
        step = s + 1
        if pending is not None:
            report.report(pending[0], report.read(*pending), False)
        pending = (step, out)
        preempted = any_process(guard.triggered) or ckpt.reached_preemption(step)
        evaluate = (not preempted and cfg.trainer.eval_every > 0
                    and (step % cfg.trainer.eval_every == 0 or step == total))
        save = step == total or preempted or ckpt.should_save(step)
        if out.on_host or evaluate or save:
            host = report.read(*pending)
            pending = None
            if evaluate:
                t_eval = time.time()
                host.update(session.evaluate(state, step) or {})
                report.exclude(time.time() - t_eval)  # evaluation time is not step time
            report.report(step, host, evaluate)
        if save:
            t_save = time.time()
            data_state = dict(it.get_state()) if hasattr(it, "get_state") else {"step": step}
            extra = session.objective_state()
            if extra is not None:
                data_state[OBJECTIVE_STATE] = extra
            ckpt.save(step, setup.checkpoints.item(session.checkpoint_item(state)), data_state=data_state,
                      metadata=setup.checkpoints.metadata(state.params))
            report.exclude(time.time() - t_save)  # checkpoint time is not step time
        if preempted:
            log.warning("preempted: checkpoint step %d written to %s; stopping", step, ckpt.directory)
            break
    if pending is not None:
        report.report(pending[0], report.read(*pending), False)
    return LoopEnd(state=state, step=step, preempted=preempted, last_metrics=report.last_metrics)


OnStep = Callable[[int, dict[str, float]], None]


@overload
def train(cfg: RunConfig, *, data: Any | None = ..., loss_fn: Callable | None = ...,
          model_factory: Callable | None = ..., mesh: Mesh | None = ..., progress: bool = ...,
          save_params_at_end: bool = ..., on_step: OnStep | None = ..., return_session: Literal[False] = ...,
          **session_kwargs: Any) -> TrainSummary: ...
@overload
def train(cfg: RunConfig, *, data: Any | None = ..., loss_fn: Callable | None = ...,
          model_factory: Callable | None = ..., mesh: Mesh | None = ..., progress: bool = ...,
          save_params_at_end: bool = ..., on_step: OnStep | None = ..., return_session: Literal[True],
          **session_kwargs: Any) -> tuple[TrainSummary, Any]: ...
def train(cfg: RunConfig, *, data: Any | None = None, loss_fn: Callable | None = None,
          model_factory: Callable | None = None, mesh: Mesh | None = None, progress: bool = True,
          save_params_at_end: bool = True, on_step: OnStep | None = None, return_session: bool = False,
          **session_kwargs: Any) -> TrainSummary | tuple[TrainSummary, Any]:
    """Train `cfg.trainer.steps` steps of `cfg.trainer.objective`, resuming from the run's latest checkpoint (module
    docstring): the one entry point, of `dgemma train` and of the library.

    Args:
      data: `iterator_from_step(step)` -> iterator of process-local numpy batches with `get_state()/set_state()`;
        default `dgemma.data.DataPipeline(cfg.data)`.
      loss_fn: `loss_fn(model, batch, rng) -> (loss, aux)` replacing the objective's loss (ar / stage1 only).
      model_factory: `model_factory(rngs) -> nnx.Module`; default `Transformer(cfg.model_config, rngs=rngs)`.
      mesh: overrides the mesh of `cfg.mesh`.
      on_step: called on process 0 with (step, metrics) once a step's metrics are read (evaluation included).
      return_session: also return the objective's session as it ended, `(summary, session)` (SD·RL: its curriculum,
        reference and EMA); by default it is dropped with the run, so nothing it holds outlives `train`.
      session_kwargs: the objective session's own arguments (sdrl: `eval_data`).

    Raises:
      NonFiniteLossError: a step produced a NaN/inf loss or grad norm (that state is not saved).
      RunDirInUse: another process trains in the run directory or writes to the checkpoint directory.
    """
    from dgemma.checkpoint import CheckpointManager, save_params

    if loss_fn is not None:  # the objective's session refuses it where its update is not a loss over batches
        session_kwargs["loss_fn"] = loss_fn
    with contextlib.ExitStack() as stack:
        setup = setup_training(cfg, stack, data=data, model_factory=model_factory, mesh=mesh,
                               session_kwargs=session_kwargs)
        ckpt = stack.enter_context(CheckpointManager.from_config(cfg, metadata=setup.metadata))
        start = restore_or_init(setup, ckpt, stack)
        end = train_loop(setup, ckpt, start, stack, progress=progress, on_step=on_step)
        ckpt.wait_until_finished()
        # also when resuming at the final step: the run may have died between its last checkpoint and params/
        if end.step == setup.total and not end.preempted and save_params_at_end:
            save_params(setup.run_dir / "params", end.step, end.state.params,
                        metadata={**setup.metadata, "step": end.step})
        checkpoint_steps = ckpt.all_steps()

    summary = TrainSummary(run_dir=str(setup.run_dir), config_sha=setup.config_sha, start_step=start.step,
                           final_step=end.step, steps_run=end.step - start.step, preempted=end.preempted,
                           last_metrics=end.last_metrics, checkpoint_steps=checkpoint_steps,
                           wall_seconds=time.time() - setup.t_start, compile_seconds=setup.compile_seconds,
                           resumed=start.resumed, state=end.state)
    return (summary, setup.session) if return_session else summary

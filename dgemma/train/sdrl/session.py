"""Stage 2 (SD·RL) as an objective of the one trainer: `SDRLSession` (one trainer step = one SD·RL iteration,
`dgemma.train.sdrl.iteration`); `dgemma.train.sdrl.run.run_sdrl` runs the trainer with it.

The session holds what lives across iterations besides the student's `TrainState`: the frozen reference params
(the stage-1 weights; `sdrl.reference_memory` says device or pinned host memory), the teacher EMA (`sdrl.teacher=ema`)
and the K_max curriculum. Checkpoints (step = iterations done) hold {"train": TrainState (student params,
optimizer state, optimizer step = iterations x updates per iteration, base RNG key), "reference", "ema"} and, as
JSON next to the data-iterator state, the curriculum; resume after SIGKILL continues bit-identically. After each
iteration with a finite loss: the EMA update, then the curriculum update (`curriculum_event` -1 raise, 1 lower).
Stage 2 starts from `checkpoint.init_from` (a stage-1 params checkpoint; `sdrl.allow_random_init=true` for smoke
tests), whose weights become the student, the reference and the EMA's start. With adapters (`lora.rank > 0`) the
reference and the frozen teacher are the student's frozen base with the adapters off and the EMA covers the trainable
leaves only: no copy of the model (`dgemma.train.sdrl.lora_reference`).
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dgemma.parallel.memory import DEVICE, HOST, require_memory_kind, to_memory
from dgemma.train.sdrl import evaluation
from dgemma.train.sdrl.curriculum import MaxStepsCurriculum
from dgemma.train.sdrl import lora_reference
from dgemma.train.sdrl.iteration import Iteration, load_reward_fn
from dgemma.train.session import RunContext, StepOutput

__all__ = ["EVAL_SEED_OFFSET", "SDRLSession"]

log = logging.getLogger(__name__)
EVAL_SEED_OFFSET = 10_007  # key of the periodic evaluation's sampler


def _eval_data(cfg, data, eval_data):
    """Held-out prompts for the periodic evaluation: the caller's, or `trainer.eval_batches` batches of prompts
    disjoint from every prompt this run trains on (`dgemma.eval.heldout.periodic_held_out`: drawn from a synthetic
    task mix, or the rows of `data.eval_paths`; overlap 0).
    Returns (prompts, overlap with training or None when the caller's set does not say)."""
    if eval_data is None:
        from dgemma.eval.heldout import periodic_held_out

        data_cfg = getattr(data, "config", cfg.data)
        eval_data = periodic_held_out(data_cfg, rows=cfg.trainer.eval_batches * cfg.data.batch_size,
                                      batch_size=cfg.data.batch_size, train_steps=cfg.trainer.steps,
                                      train=data if hasattr(data, "encoded_rows") else None)
    overlap = getattr(eval_data, "overlap", None)
    if overlap:
        raise ValueError(f"sdrl eval_data: {overlap} held-out prompts occur in the training stream")
    if overlap is None:
        log.warning("sdrl: the periodic evaluation's prompts are not checked against the training stream "
                    "(pass a dgemma.eval.heldout.HeldOutSet)")
    else:
        log.info("sdrl periodic evaluation: %s", eval_data.summary())
    return eval_data, overlap




class SDRLSession:
    """`dgemma.train.trainer.Session` of `trainer.objective=sdrl` (module docstring)."""

    @classmethod
    def prepare(cls, cfg: Any, data: Any, *, eval_data: Any | None = None, loss_fn=None) -> dict:
        """The session's own inputs, checked before the mesh is built and before anything is written: the
        curriculum's and the teacher's K_max, the user reward function (probed on the first batch), the held-out set."""
        if loss_fn is not None:
            raise ValueError("loss_fn: trainer.objective=sdrl trains its own loss over recorded rollout states; a "
                             "custom loss_fn applies to the one-batch objectives (ar, stage1)")
        lora_reference.check_config(cfg)
        curriculum = MaxStepsCurriculum.from_config(cfg.sdrl, cfg.sampler.max_steps)
        cfg.sdrl.teacher_max_steps(cfg.sampler.max_steps)
        reward_fn = load_reward_fn(cfg, data)
        eval_data, overlap = _eval_data(cfg, data, eval_data) if cfg.trainer.eval_every else (None, None)
        return {"curriculum": curriculum, "reward_fn": reward_fn, "eval_data": eval_data, "eval_overlap": overlap}

    def __init__(self, ctx: RunContext, *, curriculum: MaxStepsCurriculum, reward_fn, eval_data, eval_overlap):
        from dgemma.train import step as step_lib

        cfg, s = ctx.cfg, ctx.cfg.sdrl
        from dgemma.parallel.checks import check_global_batch

        # the prompts (and the anchor rows) are sharded over the batch axes: a one-line error naming data.batch_size
        # here, not an IndivisibleError from the first sharded array
        check_global_batch(getattr(ctx.data, "global_batch_size", cfg.data.batch_size), jax.process_count(),
                           ctx.mesh, cfg.mesh.rules, what="the global batch of prompts")
        if s.retention_rows:  # appended to the anchor rows, sharded the same way (`retention`)
            try:
                check_global_batch(s.retention_rows, jax.process_count(), ctx.mesh, cfg.mesh.rules,
                                   what="the retention rows")
            except ValueError as e:
                raise ValueError(str(e).replace("data.batch_size=", "sdrl.retention_rows=", 1)) from None
        self.ctx, self.cfg, self.s = ctx, cfg, s
        self.curriculum, self.reward_fn = curriculum, reward_fn
        self.eval_data, self.eval_overlap = eval_data, eval_overlap
        self.reference_kind = HOST if s.reference_memory == "host" else DEVICE  # where it lives between iterations
        if self.reference_kind == HOST:
            require_memory_kind(ctx.mesh.devices.flat[0], HOST, "sdrl.reference_memory=host")
        step_fn = step_lib.make_train_step(ctx.graphdef, ctx.optimizer, ctx.objective.loss_fn(cfg), mesh=ctx.mesh,
                                           shardings=ctx.shardings)
        # adapters (the run's adaptation, `dgemma.train.adaptation`): the reference is the student's frozen base with
        # the adapters off (`lora_reference`)
        self.adapters = (lora_reference.AdapterReference(cfg, ctx.graphdef, ctx.abstract.params)
                         if ctx.adaptation.trains_adapters else None)
        self.iteration = Iteration(cfg, ctx.data, ctx.graphdef, step_fn, ctx.mesh, self.reward_fn,
                                   self.reference_kind, None if self.adapters is None else self.adapters.graphdef)
        self.reference = self.ema = None
        self.max_steps = self.curriculum.max_steps  # K_max of the last iteration (its evaluation samples at it)
        mc = cfg.model_config
        self.tokens_per_row = cfg.data.layout.prompt_len + 2 * cfg.data.layout.n_blocks * mc.canvas_length

    def compile(self, target: Any) -> float:
        return 0.0  # the state rows' count varies per iteration: the update compiles at its first use

    def restore_target(self, target: Any) -> Any:
        from dgemma.train.state import with_shardings

        params = target.params
        if self.adapters is not None:  # only what trains: the kept start values, the EMA of the trainable leaves
            kept = self.adapters.kept(params)
            return {"train": target, **({"reference": kept} if jax.tree.leaves(kept) else {}),
                    **({"ema": self.adapters.trainable(params)} if self.s.teacher == "ema" else {})}
        reference = params if self.reference_kind == DEVICE else with_shardings(
            self.ctx.abstract.params, jax.tree.map(lambda sh: sh.with_memory_kind(HOST), self.ctx.shardings.params))
        return {"train": target, "reference": reference, **({"ema": params} if self.s.teacher == "ema" else {})}

    def from_restored(self, item: Any, state: dict | None) -> Any:
        if not state or "curriculum" not in state:
            raise ValueError("sdrl checkpoint: no curriculum state next to its data-iterator state")
        self.curriculum.load_state(state["curriculum"])
        self.reference, self.ema = item.get("reference"), item.get("ema")
        if self.adapters is not None and self.reference is None:
            self.reference = self.adapters.start(item["train"].params)  # (empty: nothing trainable beside adapters)
        return item["train"]

    def fresh(self, state: Any) -> Any:
        if not self.cfg.checkpoint.init_from:
            log.warning("sdrl: sdrl.allow_random_init=true and no checkpoint.init_from: stage 2 starts from random "
                        "weights")
        if self.adapters is not None:  # no copy of the base: the start values of what trains beside the adapters
            if self.adapters.trained_adapters(state.params):
                log.warning("sdrl with lora: the start params hold trained adapters; the KL reference and the frozen "
                            "teacher are the base without them (dgemma.train.sdrl.lora_reference)")
            self.reference = self.adapters.start(state.params)
            self.ema = (jax.tree.map(jnp.copy, self.adapters.trainable(state.params)) if self.s.teacher == "ema"
                        else None)
            return state
        # frozen: the stage-1 weights (a copy in pinned host memory for sdrl.reference_memory=host)
        self.reference = (to_memory(state.params, HOST) if self.reference_kind == HOST
                          else jax.tree.map(jnp.copy, state.params))
        self.ema = jax.tree.map(jnp.copy, state.params) if self.s.teacher == "ema" else None
        return state

    def step(self, state: Any, batch: dict, index: int) -> StepOutput:
        from dgemma.train.sdrl.teacher import ema_update

        self.max_steps = self.curriculum.max_steps
        reference, ema, a = self.reference, self.ema, self.adapters
        if a is not None:  # views of the student's arrays (the base is frozen: the same bits every iteration)
            reference = a.reference_params(state.params, self.reference)
            ema = None if ema is None else a.with_trainable(state.params, ema)
        state, m, finite = self.iteration.run(state, reference, ema, batch, index, self.max_steps)
        del reference, ema
        if finite:
            if self.ema is not None:
                current = state.params if a is None else a.trainable(state.params)
                self.ema = ema_update(self.ema, current, self.s.teacher_ema_decay)
            event = self.curriculum.update(m["reward"], m["teacher_reward"])
            m["curriculum_event"] = 0.0 if event is None else {"lower": -1.0, "raise": 1.0}.get(event, 0.0)
        tokens = int(m["states"]) * self.tokens_per_row * self.s.inner_epochs
        return StepOutput(state=state, metrics=m, tokens=tokens, on_host=True, finite=finite)

    def checkpoint_item(self, state: Any) -> Any:
        held = self.adapters is None or jax.tree.leaves(self.reference)  # (adapters: kept values, often none)
        return {"train": state, **({"reference": self.reference} if held else {}),
                **({"ema": self.ema} if self.ema is not None else {})}

    def objective_state(self) -> dict | None:
        return {"curriculum": self.curriculum.state_dict()}

    def evaluate(self, state: Any, step: int) -> dict[str, float] | None:
        if self.eval_data is None:
            return None
        it = self.iteration
        out = evaluation.evaluate(nnx.merge(self.ctx.graphdef, state.params), self.eval_data, self.cfg, self.max_steps,
                                   jax.random.key(self.cfg.run.seed + EVAL_SEED_OFFSET), eos_ids=it.eos,
                                   pad_id=it.pad, reward_fn=self.reward_fn, mesh=self.ctx.mesh)
        if self.eval_overlap is not None and "eval/heldout_overlap" not in out:
            out["eval/heldout_overlap"] = float(self.eval_overlap)  # held-out prompts seen in training (0)
        return out

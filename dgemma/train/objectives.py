"""The objective registry: every `trainer.objective`, what one trainer step of it is, and what it reads and writes.

    objective = get_objective(cfg.trainer.objective)     # an `Objective` of REGISTRY
    objective.check_config(cfg)                          # one-line ConfigError for settings it cannot honour
    summary = dgemma.train.trainer.train(cfg)            # the one trainer runs any of them

| objective | one trainer step | optimizer updates per step | checkpoint items |
|---|---|---|---|
| `ar` | one batch: next-token CE (`dgemma.diffusion.ar.ar_loss_fn`) | 1 | `state` |
| `stage1` | one batch: block-diffusion CE + λ_AR · AR CE (`dgemma.diffusion.stage1`) | 1 | `state` |
| `sdrl` | one SD·RL iteration: rollouts, teacher, state rows, μ passes over the minibatches (`dgemma.train.sdrl`) | `sdrl.inner_epochs` x `sdrl.num_minibatches` | `train`, `reference`, `ema` (teacher=ema), curriculum (JSON) |

`trainer.grad_accum_steps` splits one batch into micro-batches inside its single optimizer update (ar, stage1); an
SD·RL iteration's minibatches are its updates, so sdrl refuses it. Every objective's checkpoints record `objective`
and the settings of `resume_settings` in their metadata; the trainer refuses to resume across a change of either.

The registry is the one owner of the objective names: the trainer and the planner (`dgemma.planning`: `layout`,
`self_conditioning_pass`, `rollouts`, `rollouts_per_prompt`) read its attributes instead of comparing names, and the
config's `trainer.objective` literal (a lower layer) is checked against it by tests/train/test_trainer_refusals.py. `import dgemma.train.objectives` imports neither jax nor numpy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

__all__ = ["OBJECTIVES", "REGISTRY", "TRAIN_METRICS", "Objective", "get_objective", "loss_fn_for"]

TRAIN_METRICS = ("loss", "grad_norm", "lr", "step_time", "tokens_per_sec", "time", "elapsed")
"""Training metrics every objective logs under these names (metrics.jsonl, wandb): the loss and the learning rate
(means over a step's optimizer updates), the gradient norm (of its last update), seconds per trainer step (compile,
checkpoint and evaluation time excluded), trained tokens per second, wall time and seconds since the start."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Objective:
    """One training objective (module docstring). Fields are data; the behaviour is in the methods and `session`."""

    name: str
    step_unit: str  # what `trainer.steps` counts: "optimizer step" | "iteration"
    reads: tuple[str, ...]  # config sections its step reads besides run/model/mesh/optim/trainer/data/checkpoint/logging
    checkpoint_items: tuple[str, ...]  # what its checkpoints hold
    metrics: tuple[str, ...]  # training metrics it logs besides TRAIN_METRICS (evaluation metrics: dgemma.eval)
    progress_metrics: tuple[str, ...]  # shown in the progress bar (with the ETA)
    resume_settings: tuple[str, ...] = ()  # dotted settings that give the saved state its meaning: fixed on resume
    layout: Literal["ar", "one_pass"]  # planner: P + R tokens (ar) | the one-pass P + 2R layout (stage-1 / replay)
    self_conditioning_pass: bool = False  # planner: diffusion.p_self_cond > 0 adds a gradient-free SC pass
    rollouts: bool = False  # planner: a step is an iteration of rollouts + updates (dgemma.planning.sdrl_plan)
    # () -> the class of its per-run implementation (the trainer's `Session` protocol); type[Any]: its `prepare` and
    # constructor take the objective's own keyword arguments, which a protocol cannot state for every class
    session: Callable[[], type[Any]]
    updates: Callable[[Any], int] = lambda cfg: 1  # optimizer updates one trainer step makes
    refusals: Callable[[Any], str | None] = lambda cfg: None  # the first setting it cannot honour, as a message
    loss: Callable[[Any], Any]  # cfg -> LossFn of its optimizer update

    def updates_per_step(self, cfg: Any) -> int:
        """Optimizer updates one trainer step makes (the LR schedule spans `trainer.steps` x this)."""
        return int(self.updates(cfg))

    def check_config(self, cfg: Any) -> None:
        """Raise a one-line `ConfigError` naming the first setting this objective cannot honour (module docstring)."""
        from dgemma.config.types import ConfigError

        msg = _foreign_sections(cfg, self) or self.refusals(cfg)
        if msg:
            raise ConfigError(msg)

    def loss_fn(self, cfg: Any):
        """The `LossFn` of one optimizer update (`dgemma.train.step.make_train_step`) as this run trains it
        (`dgemma.train.adaptation`: with `lora.dropout` the adapters' dropout runs inside it)."""
        from dgemma.train.adaptation import adaptation_for

        return adaptation_for(cfg).loss_fn(self.loss(cfg))

    def session_class(self) -> type[Any]:
        """The class of its session (imported on first use: this module imports no jax)."""
        return self.session()

    def recorded_settings(self, cfg: Any) -> dict[str, Any]:
        """{dotted setting: value} of `resume_settings` (JSON-able), recorded in the checkpoint metadata."""
        out = {}
        for dotted in self.resume_settings:
            value: Any = cfg
            for part in dotted.split("."):
                value = getattr(value, part)
            out[dotted] = list(value) if isinstance(value, tuple) else value
        return out

    def tokens_per_example(self, prompt_len: int, response_len: int) -> int:
        """Tokens of one training forward: P + R (ar) or the one-pass layout's P + 2R."""
        return prompt_len + (response_len if self.layout == "ar" else 2 * response_len)

    def rollouts_per_prompt(self, cfg: Any) -> int:
        """Sampled rows per prompt of a step's rollouts (planner's sampler compile): G for sdrl, else 1."""
        return int(cfg.sdrl.group_size) if self.rollouts else 1


# MARK: refusals ------------------------------------------------------------------------------------------------------
def _foreign_sections(cfg: Any, objective: Objective) -> str | None:
    """Non-default settings of a section only another objective reads (e.g. `sdrl.*` under stage1)."""
    for section in ("sdrl",):
        if section in objective.reads:
            continue
        current = getattr(cfg, section)
        default = type(current)()
        changed = [f.name for f in dataclasses.fields(current) if getattr(current, f.name) != getattr(default, f.name)]
        if changed:
            readers = [o.name for o in REGISTRY.values() if section in o.reads]
            return (f"{section}.{changed[0]}={getattr(current, changed[0])!r} is read only by trainer.objective="
                    f"{'|'.join(readers)}, but trainer.objective={objective.name}; remove it")
    return None


def _sdrl_refusals(cfg: Any) -> str | None:
    if cfg.trainer.grad_accum_steps != 1:
        return (f"trainer.grad_accum_steps={cfg.trainer.grad_accum_steps} does not apply to trainer.objective=sdrl "
                "(each of an iteration's sdrl.num_minibatches minibatches is one optimizer update); set it to 1 and "
                "raise sdrl.num_minibatches to shrink the update")
    if not cfg.checkpoint.init_from and not cfg.sdrl.allow_random_init:
        return ("checkpoint.init_from is not set: stage 2 (trainer.objective=sdrl) starts from a stage-1 params "
                "checkpoint (checkpoint.init_from=<stage-1 run>/params); sdrl.allow_random_init=true starts from "
                "random weights (smoke tests only)")
    return None


# MARK: losses --------------------------------------------------------------------------------------------------------
def _ar_loss(cfg: Any):
    from dgemma.diffusion.ar import ar_loss_fn

    return ar_loss_fn


def _stage1_loss(cfg: Any):
    from dgemma.diffusion.stage1 import Stage1Config, make_stage1_loss_fn

    return make_stage1_loss_fn(Stage1Config.from_section(cfg.diffusion))


def _sdrl_loss(cfg: Any):
    """The loss of one SD·RL minibatch update over state rows; only the SD·RL iteration can feed it."""
    from dgemma.diffusion.stage1 import Stage1Config
    from dgemma.train.sdrl.loss import make_sdrl_loss_fn

    return make_sdrl_loss_fn(cfg.sdrl, Stage1Config.from_section(cfg.diffusion))


# MARK: sessions (classes imported when a run starts: `import dgemma.train.objectives` imports no jax) ----------------
def _batch_session() -> type:
    from dgemma.train.batch_session import BatchSession

    return BatchSession


def _sdrl_session() -> type:
    from dgemma.train.sdrl.session import SDRLSession

    return SDRLSession


REGISTRY: dict[str, Objective] = {o.name: o for o in (
    Objective(name="stage1", step_unit="optimizer step", reads=("diffusion",), checkpoint_items=("state",),
              metrics=("loss_diffusion", "loss_ar"), progress_metrics=("loss", "tokens_per_sec"), layout="one_pass",
              self_conditioning_pass=True, session=_batch_session, loss=_stage1_loss),
    Objective(name="ar", step_unit="optimizer step", reads=(), checkpoint_items=("state",),
              metrics=("ar_accuracy", "ar_tokens"), progress_metrics=("loss", "tokens_per_sec"), layout="ar",
              session=_batch_session, loss=_ar_loss),
    Objective(name="sdrl", step_unit="iteration", reads=("sdrl", "sampler", "diffusion"),
              checkpoint_items=("train", "reference", "ema", "curriculum"),
              metrics=("reward", "teacher_reward", "loss_pg", "loss_sd", "loss_kl", "loss_anchor", "k_max",
                       "steps_per_block", "states", "curriculum_event"),
              progress_metrics=("reward", "steps_per_block", "k_max"),
              resume_settings=("sdrl.arm", "sdrl.group_size", "sdrl.inner_epochs", "sdrl.num_minibatches",
                               "sdrl.teacher", "sampler.max_steps",
                               "sdrl.curriculum_max_steps"),
              layout="one_pass", rollouts=True, session=_sdrl_session,
              updates=lambda cfg: cfg.sdrl.inner_epochs * cfg.sdrl.num_minibatches, refusals=_sdrl_refusals,
              loss=_sdrl_loss),
)}
OBJECTIVES = tuple(REGISTRY)


def get_objective(name: str) -> Objective:
    """The registered objective `name` (ValueError naming `trainer.objective` otherwise)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"trainer.objective={name!r} is not one of {OBJECTIVES}") from None


def loss_fn_for(cfg: Any):
    """The per-update loss of `cfg.trainer.objective` (`Objective.loss_fn`)."""
    return get_objective(cfg.trainer.objective).loss_fn(cfg)

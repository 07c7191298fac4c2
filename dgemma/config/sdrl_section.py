"""`SDRLConfig`: the `sdrl` section of a run config (stage 2, SD·RL, docs/sdrl.md), its one definition. Imports
neither jax nor numpy.

One frozen dataclass holds every stage-2 switch; the named arm decides which terms are on:

    arm               L_PG   L_SD   curriculum
    rl_only            on     off     off
    sd_only            off    on      off
    sdrl               on     on      off
    sdrl_curriculum    on     on      on

Within an arm each term keeps its own weight (`pg_weight`, `sd_weight` = λ_SD, `kl_weight` = β, `anchor_weight` =
λ_anc); a weight of 0 switches that term off. Prompts per iteration Q = `data.batch_size`; the student sampler is the
run's `sampler` section with K_max = the curriculum's current K_max (`sampler.max_steps` at the start).

The teacher's sampler is the nested `sdrl.teacher_sampler` section: the fields of the top-level `sampler` section
(`SamplerConfig` minus the run-time ids), each optional: a field that is set replaces the `sampler` section's value for
the teacher, a null field inherits it. The teacher's documented defaults (`TEACHER_SAMPLER_DEFAULTS`: gentler
annealing, γ_T = 0.02, greedy proposals, stability 2) are the section's defaults; its step limit `max_steps` (K_T) left
null is 2 x `sampler.max_steps`. The teacher's `SamplerConfig` is
`SamplerConfig.from_section(cfg.sampler, cfg.sdrl.teacher_sampler, max_steps=cfg.sdrl.teacher_max_steps(...), ...)`
(`dgemma.train.sdrl.teacher.teacher_sampler`). The flat config keys the nested section replaced
(`sdrl.teacher_max_steps: 16` in a config, ...) are refused with the new key's name.

The retention rows (`retention_mix`, `retention_rows`, `retention_weight`) train the stage-1 loss as a term of their
own (`dgemma.train.sdrl.retention`).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import TYPE_CHECKING, Any, Literal, Optional

from dgemma.config.sections import SamplerSection, help_field
from dgemma.config.types import Section
from dgemma.data.config import TaskConfig
from dgemma.inference.sampler_types import SamplerConfig

__all__ = ["ANCHOR_TARGETS", "ARMS", "SDRLConfig", "SD_TARGETS", "TEACHER_DECODINGS", "TEACHER_SAMPLER_DEFAULTS",
           "TeacherSamplerSection", "TermWeights"]

ARMS = ("rl_only", "sd_only", "sdrl", "sdrl_curriculum")
ANCHOR_TARGETS = ("verified", "reference_ar", "verified_else_reference_ar")
TEACHER_DECODINGS = ("diffusion", "ar", "diffusion_else_ar")
SD_TARGETS = ("verified", "verified_agree", "state_argmax", "state_argmax_agree", "coupled_teacher")
Arm = Literal["rl_only", "sd_only", "sdrl", "sdrl_curriculum"]
TEACHER_SAMPLER_DEFAULTS = {"entropy_bound": 0.02, "t_max": 0.6, "t_min": 0.4, "greedy": True, "stability_threshold": 2}
"""The teacher's sampler where the run config's `sdrl.teacher_sampler` section does not say otherwise (docs/sdrl.md §4): a
smaller accept bound γ_T, gentler annealing (τ 0.6 -> 0.4), greedy proposals (deterministic given its key) and
stability 2; its step limit K_T defaults to 2 x `sampler.max_steps`. Every other field is the `sampler` section's."""


@dataclasses.dataclass(frozen=True)
class TermWeights:
    """The effective weights of (4.2) after the arm is applied."""

    pg: float
    sd: float
    kl: float
    anchor: float
    anchor_ar: float
    retention: float = 0.0  # lambda_ret of the retention rows (the run config's sdrl.retention_weight)


class _SamplerOverrides(Section):
    """Base of the partial sampler section: `given()` is what it sets; validation builds a `SamplerConfig` from it."""

    def given(self) -> dict[str, Any]:
        """The fields set (non-null): they replace the `sampler` section's values."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def validate(self) -> None:  # each given value on its own (the merge with `sampler` is checked when built)
        try:
            SamplerConfig(**self.given())
        except ValueError as e:
            msg = str(e)
            own = "SamplerConfig."
            raise ValueError(f"{type(self).__name__}.{msg[len(own):]}" if msg.startswith(own) else msg) from None


def _teacher_sampler_section() -> type:
    hints = typing.get_type_hints(SamplerSection)
    spec = []
    for f in dataclasses.fields(SamplerSection):
        if not f.init:
            continue
        default = TEACHER_SAMPLER_DEFAULTS.get(f.name)
        if f.name == "max_steps":
            text = "K_T: the teacher's step limit (null: 2 x sampler.max_steps; never below sampler.max_steps)"
        elif default is None:
            text = f"null: the sampler section's {f.name} ({f.metadata.get('help', '')})"
        else:
            text = f"the teacher's {f.name} (default {default!r}; null: the sampler section's) -- {f.metadata['help']}"
        spec.append((f.name, Optional[hints[f.name]], help_field(default, text)))  # noqa: UP045 - runtime type
    return dataclasses.make_dataclass(
        "TeacherSamplerSection", spec, bases=(_SamplerOverrides,), frozen=True, kw_only=True,
        namespace={"__module__": __name__, "__doc__": (
            "`sdrl.teacher_sampler`: the `sampler` section's fields, each optional (null: the `sampler` section's "
            "value); defaults: the teacher's (module docstring).")})


if TYPE_CHECKING:
    class TeacherSamplerSection(_SamplerOverrides):
        """The checker's view of the generated class: every field of `SamplerSection`, optional."""

        def __getattr__(self, name: str) -> Any: ...
else:
    TeacherSamplerSection = _teacher_sampler_section()

_MOVED = {"teacher_max_steps": "max_steps", "teacher_entropy_bound": "entropy_bound", "teacher_t_max": "t_max",
          "teacher_t_min": "t_min", "teacher_greedy": "greedy", "teacher_stability": "stability_threshold"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SDRLConfig(Section):
    """Stage 2 (SD·RL): RL on verifiable rewards + verifier-gated sampler distillation (module docstring).

    A `Section`: the fields are type-checked on construction and `validate()` raises
    `ValueError("SDRLConfig.<field>: ...")` (reported by the loader as `sdrl.<field>: ...`).
    """

    __moved_keys__ = {**{old: f"teacher_sampler.{new}" for old, new in _MOVED.items()},
                      "curriculum_budgets": "curriculum_max_steps"}  # renamed (docs/glossary.md)

    arm: Arm = help_field("sdrl", "rl_only | sd_only | sdrl | sdrl_curriculum (which terms and the K_max curriculum)")
    group_size: int = help_field(8, "G: student rollouts per prompt (>= 2; advantages are normalised within the group)")
    inner_epochs: int = help_field(2, "mu: optimisation passes over one iteration's states")
    num_minibatches: int = help_field(1, "minibatches of rollouts per inner epoch (one optimizer step each)")
    states_per_rollout: int = help_field(0, "M: recorded steps per rollout trained on, drawn uniformly without replacement "
                                    "among the steps it ran (0: all; 4 at full scale, where replaying every step does not fit)")
    clip_eps: float = help_field(0.2, "epsilon of the PPO clip")
    pg_weight: float = help_field(1.0, "weight of L_PG (0: off)")
    sd_weight: float = help_field(1.0, "lambda_SD: weight of L_SD (0: off)")
    kl_weight: float = help_field(0.01, "beta: weight of the KL to the frozen reference (0: off)")
    kl_estimator: Literal["k3", "exact"] = help_field("k3", "k3 on output tokens | exact full-vocabulary KL per position")
    anchor_weight: float = help_field(0.1, "lambda_anc: weight of the stage-1 anchor on (q, y*) (0: off)")
    anchor_ar_weight: float = help_field(0.1, "lambda_AR': weight of the AR loss inside the anchor")
    anchor_target: Literal["verified", "reference_ar", "verified_else_reference_ar"] = help_field(
        "verified", "the anchor's response: verified = y* (a prompt without y* gets no anchor) | reference_ar ="
                    " the frozen reference's greedy AR output (task-independent: needs no verifier, keeps the AR "
                    "mode where nothing is verified) | verified_else_reference_ar = y* where it exists, else that")
    sd_target: Literal["verified", "verified_agree", "state_argmax", "state_argmax_agree", "coupled_teacher"] = help_field(
        "verified", "L_SD's target and states: verified = y*(q) at the states of blocks whose committed prefix equals "
                    "y*'s | verified_agree = y*(q) only at the states before the first step whose accepted "
                    "tokens differ from it | state_argmax = the student's own argmax at each visited state of its "
                    "verified rollouts (mode seeking: a deterministic function of the state also where "
                    "the task has many correct answers) | state_argmax_agree = the same at the positions where that "
                    "argmax equals the rollout's final (verified) output | coupled_teacher = per rollout, the "
                    "teacher's answer decoded from that rollout's own initial canvases and random stream (its key) "
                    "with the teacher sampler, where verified, at the states before the first step whose accepted "
                    "tokens differ from it (docs/sdrl.md §3)")
    sd_step_weighting: Literal["uniform", "early"] = help_field(
        "uniform", "omega_k of L_SD: uniform (1) | early (1 + (K_i - k)/K_i, up-weights early states)")
    efficiency_reward: float = help_field(0.0, "eta of R' = R (1 + eta (1 - steps/K_max)) on full-credit outputs, R >= reward_max (0: off)")
    reward: str | None = help_field(None, "user reward 'package.module:function' (or dotted); null: the task rewards of "
                            "dgemma.data.rewards. Called as fn(examples, generations, tokenizer) -> one float per row")
    reward_max: float = help_field(1.0, "reward of a verified output (R_max): the SD target gate and the teacher check")
    reward_require_eos: bool = help_field(False, "task rewards: a generation without EOS scores 0")
    teacher: Literal["frozen", "ema"] = help_field("frozen", "frozen stage-1 weights | EMA of the student")
    teacher_decoding: Literal["diffusion", "ar", "diffusion_else_ar"] = help_field(
        "diffusion", "how the teacher decodes: diffusion = its own EB sampler | ar = greedy AR on the same "
                     "weights (the converted model's AR mode) | diffusion_else_ar = both, per prompt the better reward"
                     " (ties: diffusion); AR gives verified targets on tasks the diffusion sampler never solves")
    teacher_ema_decay: float = help_field(0.99, "EMA decay per iteration (teacher=ema)")
    reference_memory: Literal["device", "host"] = help_field(
        "device", "where the frozen reference params live between uses: device | host = pinned host memory, copied "
                  "to the devices at their first use after the student rollouts (teacher rollout, pi_ref passes, anchor "
                  "decode; never when an iteration reads none of them) and freed before the update: one model copy "
                  "less on the devices at the update's peak (docs/planner_gpu.md)")
    curriculum_max_steps: tuple[int, ...] = help_field(
        (12, 8, 6), "the max_steps values below sampler.max_steps the curriculum may lower K_max to, strictly "
                    "decreasing")
    curriculum_ratio: float = help_field(0.97, "lower K_max when rolling reward >= ratio x teacher reward")
    curriculum_drop: float = help_field(0.05, "raise K_max when the rolling reward drops by more than this")
    curriculum_window: int = help_field(4, "iterations in the rolling reward")
    allow_random_init: bool = help_field(False, "start stage 2 from random weights when checkpoint.init_from is not set "
                                        "(smoke tests only; stage 2 starts from a stage-1 params checkpoint)")

    teacher_sampler: TeacherSamplerSection = help_field(
        TeacherSamplerSection, "the teacher's sampler: the sampler section's fields that differ for the teacher (the "
                               "rest inherit from `sampler`)")
    retention_mix: tuple[TaskConfig, ...] = help_field(
        (), "tasks (data.tasks entries: name, weight, lengths) of a retention stream, e.g. the stage-1 mix: its rows, "
            "with the data's answers, train the stage-1 loss each iteration (weight retention_weight) so tasks the "
            "SD·RL stream does not train are not forgotten (empty: off)")
    retention_rows: int = help_field(0, "rows of the retention stream per iteration (global; 0 when retention_mix is "
                                        "empty)")
    retention_weight: float = help_field(
        0.3, "lambda_ret: weight of the retention rows' stage-1 loss (diffusion + the diffusion section's lambda_ar x "
             "AR, as stage 1); separate from lambda_anc, whose (q, y*) rows pull the SD·RL tasks toward the teacher's "
             "answers. Larger keeps more and costs the stream's speed-up (toy: 0.1 / 0.3 / 1.0 -> sort AR -2.1 / +1.0 "
             "/ +1.0 points, pick -56 / -44 / -30 % steps; sdrl_study results.md, 'Nothing forgotten')")

    def __post_init__(self) -> None:
        # the membership checks first: their messages name the valid choices
        if self.arm not in ARMS:
            self._fail("arm", f"unknown arm {self.arm!r}; expected one of {ARMS}")
        if self.anchor_target not in ANCHOR_TARGETS:
            self._fail("anchor_target", f"{self.anchor_target!r} is not one of {ANCHOR_TARGETS}")
        if self.teacher_decoding not in TEACHER_DECODINGS:
            self._fail("teacher_decoding", f"{self.teacher_decoding!r} is not one of {TEACHER_DECODINGS}")
        if self.sd_target not in SD_TARGETS:
            self._fail("sd_target", f"{self.sd_target!r} is not one of {SD_TARGETS}")
        if self.sd_target == "coupled_teacher" and self.teacher_decoding != "diffusion":
            self._fail("sd_target", f"coupled_teacher needs teacher_decoding='diffusion' (the teacher decodes the "
                                    f"student's noise with its sampler), got {self.teacher_decoding!r}")
        if self.reference_memory not in ("device", "host"):
            self._fail("reference_memory", f"{self.reference_memory!r} is not 'device' or 'host'")
        if self.kl_estimator not in ("k3", "exact"):
            self._fail("kl_estimator", f"{self.kl_estimator!r} is not 'k3' or 'exact'")
        super().__post_init__()  # type checks, then validate()

    def validate(self) -> None:
        if self.group_size < 2:
            self._fail("group_size", f"{self.group_size} must be >= 2 (advantages need a group)")
        if self.states_per_rollout < 0:
            self._fail("states_per_rollout", f"{self.states_per_rollout} must be >= 0 (0: every recorded step)")
        for name in ("inner_epochs", "num_minibatches", "curriculum_window"):
            if getattr(self, name) < 1:
                self._fail(name, f"{getattr(self, name)} must be >= 1")
        for name in ("pg_weight", "sd_weight", "kl_weight", "anchor_weight", "anchor_ar_weight",
                     "efficiency_reward", "curriculum_drop"):
            if getattr(self, name) < 0:
                self._fail(name, f"{getattr(self, name)} must be >= 0 (0 switches it off)")
        if not 0.0 < self.clip_eps < 1.0:
            self._fail("clip_eps", f"{self.clip_eps} must be in (0, 1)")
        if not 0.0 <= self.teacher_ema_decay < 1.0:
            self._fail("teacher_ema_decay", f"{self.teacher_ema_decay} must be in [0, 1)")
        b = self.curriculum_max_steps
        if any(x < 1 for x in b) or any(x <= y for x, y in zip(b, b[1:])):
            self._fail("curriculum_max_steps", f"{list(b)} must be positive and strictly decreasing")
        if not 0.0 < self.curriculum_ratio <= 1.0:
            self._fail("curriculum_ratio", f"{self.curriculum_ratio} must be in (0, 1]")
        if self.reward is not None and not _looks_dotted(self.reward):
            self._fail("reward", f"{self.reward!r} is not 'package.module:function' or 'package.module.function'")
        # the retention rows train the stage-1 loss as a term of their own (dgemma.train.sdrl.retention)
        mix, rows = self.retention_mix, self.retention_rows
        if rows < 0:
            raise ValueError(f"sdrl.retention_rows: {rows} must be >= 0")
        if bool(mix) != bool(rows):
            raise ValueError(f"sdrl.retention_rows={rows} and sdrl.retention_mix ({len(mix)} tasks): set both "
                             "(rows >= 1 of a non-empty task mix) or neither")
        weight = self.retention_weight
        if not weight >= 0:
            raise ValueError(f"sdrl.retention_weight: {weight} must be >= 0")
        if mix and not weight:
            raise ValueError("sdrl.retention_mix: its rows train with weight sdrl.retention_weight, which is 0")
        names = [t.name for t in mix]
        if len(set(names)) != len(names):
            raise ValueError(f"sdrl.retention_mix: task names must be unique, got {names}")

    # MARK: derived ---------------------------------------------------------------------------------------------
    def weights(self) -> TermWeights:
        """Effective term weights: the arm switches L_PG / L_SD; each weight can switch its term off."""
        return TermWeights(pg=0.0 if self.arm == "sd_only" else self.pg_weight,
                           sd=0.0 if self.arm == "rl_only" else self.sd_weight,
                           kl=self.kl_weight, anchor=self.anchor_weight, anchor_ar=self.anchor_ar_weight)

    @property
    def uses_curriculum(self) -> bool:
        return self.arm == "sdrl_curriculum"

    def max_steps_ladder(self, student_max_steps: int) -> tuple[int, ...]:
        """(sampler.max_steps, *curriculum_max_steps); raises naming both fields when they do not descend."""
        if self.curriculum_max_steps and self.curriculum_max_steps[0] >= student_max_steps:
            raise ValueError(f"sdrl.curriculum_max_steps={list(self.curriculum_max_steps)} must all be below "
                             f"sampler.max_steps={student_max_steps}")
        return (student_max_steps, *self.curriculum_max_steps)


    def teacher_max_steps(self, student_max_steps: int) -> int:
        """K_T; raises ValueError naming both fields when it is below the student's K_max (before any work)."""
        k = self.teacher_sampler.max_steps
        k = 2 * student_max_steps if k is None else k
        if k < student_max_steps:
            raise ValueError(f"sdrl.teacher_sampler.max_steps={k} is below the student's K_max sampler.max_steps="
                             f"{student_max_steps}; the teacher must get at least the student's steps")
        return k


def _looks_dotted(path: str) -> bool:
    mod, sep, name = path.partition(":")
    if not sep:
        mod, _, name = path.rpartition(".")
    parts = [*mod.split("."), name]
    return bool(mod) and all(p.isidentifier() for p in parts)


"""The `sdrl` section: `SDRLConfig` plus the teacher's sampler as a nested `sdrl.teacher_sampler` section.

`sdrl.teacher_sampler` has the fields of the top-level `sampler` section (`SamplerConfig` minus the run-time ids),
each optional: a field that is set replaces the `sampler` section's value for the teacher, a null field inherits it.
The teacher's documented defaults (`dgemma.diffusion.sdrl_config.TEACHER_SAMPLER_DEFAULTS`: gentler annealing,
γ_T = 0.02, greedy proposals, stability 2) are the section's defaults; its step budget `max_steps` left null is
2 x `sampler.max_steps`. The teacher's `SamplerConfig` is
`SamplerConfig.from_section(cfg.sampler, cfg.sdrl.teacher_sampler, max_steps=cfg.sdrl.teacher_budget(...), ...)`
(`dgemma.train.sdrl.teacher.teacher_sampler`).

The flat keys this section replaced (`sdrl.teacher_max_steps`, ...) are refused with the new key's name.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Optional

from dgemma.config.sections import SamplerSection, help_field
from dgemma.config.types import Section
from dgemma.data.config import TaskConfig
from dgemma.diffusion.sdrl_config import TEACHER_SAMPLER_DEFAULTS, SDRLConfig
from dgemma.inference.sampler_types import SamplerConfig

__all__ = ["SDRLSection", "TeacherSamplerSection"]


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
            text = "K_T: the teacher's step budget (null: 2 x sampler.max_steps; never below sampler.max_steps)"
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


TeacherSamplerSection = _teacher_sampler_section()

_MOVED = {"teacher_max_steps": "max_steps", "teacher_entropy_bound": "entropy_bound", "teacher_t_max": "t_max",
          "teacher_t_min": "t_min", "teacher_greedy": "greedy", "teacher_stability": "stability_threshold"}


class _SDRLSectionMethods(SDRLConfig):
    """What the nested teacher section adds to `SDRLConfig`."""

    __moved_keys__ = {**{old: f"teacher_sampler.{new}" for old, new in _MOVED.items()},
                      "curriculum_budgets": "curriculum_max_steps"}  # renamed (docs/glossary.md)

    def teacher_budget(self, student_max_steps: int) -> int:
        """K_T; raises ValueError naming both fields when it is below the student's budget (before any work)."""
        k = self.teacher_sampler.max_steps
        k = 2 * student_max_steps if k is None else k
        if k < student_max_steps:
            raise ValueError(f"sdrl.teacher_sampler.max_steps={k} is below the student's budget sampler.max_steps="
                             f"{student_max_steps}; the teacher must get at least the student's steps")
        return k

    def validate(self) -> None:
        super().validate()
        # the retention fields are SDRLSection's own (below), which is the only class built on this one; the rows train
        # the stage-1 loss as a term of their own (dgemma.train.sdrl.retention)
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


SDRLSection = dataclasses.make_dataclass(
    "SDRLSection", [("teacher_sampler", TeacherSamplerSection,
                     help_field(TeacherSamplerSection, "the teacher's sampler: the sampler section's fields that "
                                                       "differ for the teacher (the rest inherit from `sampler`)")),
                    ("retention_mix", tuple[TaskConfig, ...], help_field(
                        (), "tasks (data.tasks entries: name, weight, lengths) of a retention stream, e.g. the "
                            "stage-1 mix: its rows, with the data's answers, train the stage-1 loss each iteration "
                            "(weight retention_weight) so tasks the SD·RL stream does not train are not forgotten "
                            "(empty: off)")),
                    ("retention_rows", int, help_field(
                        0, "rows of the retention stream per iteration (global; 0 when retention_mix is empty)")),
                    ("retention_weight", float, help_field(
                        0.3, "lambda_ret: weight of the retention rows' stage-1 loss (diffusion + the diffusion "
                             "section's lambda_ar x AR, as stage 1); separate from lambda_anc, whose (q, y*) rows "
                             "pull the SD·RL tasks toward the teacher's answers. Larger keeps more and costs the "
                             "stream's speed-up (toy: 0.1 / 0.3 / 1.0 -> sort AR -2.1 / +1.0 / +1.0 points, pick "
                             "-56 / -44 / -30 % steps; sdrl_study results.md, 'Nothing forgotten')"))],
    bases=(_SDRLSectionMethods,), frozen=True, kw_only=True,
    namespace={"__module__": __name__, "__doc__": (
        "`sdrl`: `dgemma.diffusion.sdrl_config.SDRLConfig` plus `teacher_sampler` (module docstring).")})

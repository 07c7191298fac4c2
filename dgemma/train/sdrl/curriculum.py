"""K_max curriculum (docs/sdrl.md §5): the student's K_max walks down a ladder of step limits.

    ladder = (sampler.max_steps, *sdrl.curriculum_max_steps), e.g. (16, 12, 8, 6) for the toys, (48, 32, 24, 16, 12)

After each iteration `update(student_reward, teacher_reward)`:
  * lower K_max one rung when, over the last `window` iterations at the current K_max, the mean train reward is
    >= `ratio` x the teacher's mean reward (the student matches its high-step teacher at this K_max);
  * raise it one rung when the rolling reward has dropped more than `drop` below the reward it had when K_max was
    last lowered (K_max was cut too far).
Both rules need a full window at the current K_max, so a change is always followed by `window` iterations of
evidence. Disabled (arms other than `sdrl_curriculum`): K_max stays at the first rung. The state is a small JSON dict
checkpointed with the run (`state_dict` / `from_state`), so a resumed run continues the same walk.
"""

from __future__ import annotations

import dataclasses

__all__ = ["MaxStepsCurriculum"]


@dataclasses.dataclass
class MaxStepsCurriculum:
    ladder: tuple[int, ...]
    enabled: bool = True
    ratio: float = 0.97
    drop: float = 0.05
    window: int = 4
    level: int = 0
    rewards: list[float] = dataclasses.field(default_factory=list)
    teacher_rewards: list[float] = dataclasses.field(default_factory=list)
    reference: float | None = None  # rolling reward when K_max was last lowered

    @classmethod
    def from_config(cls, sdrl, student_max_steps: int) -> MaxStepsCurriculum:
        return cls(ladder=tuple(sdrl.max_steps_ladder(student_max_steps)), enabled=sdrl.uses_curriculum,
                   ratio=sdrl.curriculum_ratio, drop=sdrl.curriculum_drop, window=sdrl.curriculum_window)

    @property
    def max_steps(self) -> int:
        """The student's current K_max."""
        return self.ladder[self.level]

    def _move(self, delta: int, rolling: float) -> None:
        self.level += delta
        self.reference = rolling if delta > 0 else None
        self.rewards, self.teacher_rewards = [], []

    def update(self, reward: float, teacher_reward: float) -> str | None:
        """Record one iteration's mean train reward and teacher reward; returns "lower", "raise" or None."""
        if not self.enabled:
            return None
        self.rewards = [*self.rewards, float(reward)][-self.window:]
        self.teacher_rewards = [*self.teacher_rewards, float(teacher_reward)][-self.window:]
        if len(self.rewards) < self.window:
            return None
        rolling = sum(self.rewards) / len(self.rewards)
        teacher = sum(self.teacher_rewards) / len(self.teacher_rewards)
        if self.reference is not None and self.level > 0 and rolling < self.reference - self.drop:
            self._move(-1, rolling)
            return "raise"
        if self.level + 1 < len(self.ladder) and rolling >= self.ratio * teacher:
            self._move(+1, rolling)
            return "lower"
        return None

    def state_dict(self) -> dict:
        return {"ladder": list(self.ladder), "level": self.level, "rewards": list(self.rewards),
                "teacher_rewards": list(self.teacher_rewards), "reference": self.reference}

    def load_state(self, state: dict) -> None:
        """Restore `state_dict()`; the ladder must be the same (a changed ladder would move to another K_max)."""
        if list(state["ladder"]) != list(self.ladder):
            raise ValueError(f"checkpointed curriculum ladder {state['ladder']} != the config's {list(self.ladder)} "
                             "(sampler.max_steps / sdrl.curriculum_max_steps changed since the checkpoint)")
        self.level = int(state["level"])
        self.rewards = [float(x) for x in state["rewards"]]
        self.teacher_rewards = [float(x) for x in state["teacher_rewards"]]
        self.reference = None if state["reference"] is None else float(state["reference"])

"""The contract between the trainer and an objective's session: what the trainer built (`RunContext`), what a
session implements (`Session`) and what one step returns (`StepOutput`). Its own module so that the sessions
(`dgemma.train.batch_session`, `dgemma.train.sdrl.session`), which the objective registry names as classes, do not
import the trainer, which imports the registry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from jax.sharding import Mesh

from dgemma.train.adaptation import Adaptation

if TYPE_CHECKING:
    from dgemma.config.schema import RunConfig

__all__ = ["OBJECTIVE_STATE", "RunContext", "Session", "StepOutput"]

OBJECTIVE_STATE = "objective"  # key of the session's JSON state beside the data-iterator state in a checkpoint


@dataclasses.dataclass
class RunContext:
    """What the trainer built that a session uses."""

    cfg: RunConfig
    objective: Any  # the `Objective`
    data: Any
    mesh: Mesh
    graphdef: Any
    abstract: Any  # TrainState of ShapeDtypeStruct
    shardings: Any  # TrainState of shardings (prefix)
    optimizer: Any
    model_factory: Callable
    adaptation: Adaptation  # full-parameter or adapter training


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

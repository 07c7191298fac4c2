"""Full-parameter vs adapter (LoRA) training: the one seam, chosen once per run from `lora.rank`.

    adaptation = adaptation_for(cfg)                       # FullParams (lora.rank 0) or Adapters (lora.rank > 0)
    model_factory = adaptation.model_factory(model_factory)  # + the adapters
    optimizer = build_optimizer(adaptation.optim_section(), updates)  # + every base weight frozen
    loss_fn = adaptation.loss_fn(objective_loss)             # + adapter dropout (lora.dropout > 0)
    params = adaptation.init_params(target, fresh)           # checkpoint.init_from (adapted checkpoints folded)
    checkpoints = adaptation.checkpoints(optimizer, abstract_params, fresh_params)  # run checkpoints: what trains
    adaptation.trains_adapters                               # False / True (SD·RL: the reference is the base)

The trainer (`dgemma.train.trainer`), the objectives (`Objective.loss_fn`) and the SD·RL session
(`RunContext.adaptation`, `lora_reference.check_config`) ask this object instead of testing `lora.rank` themselves; the
lora implementations are `dgemma.train.lora_setup`, `lora_init` and `lora_checkpoint`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from dgemma.config.schema import RunConfig
    from dgemma.config.sections import OptimSection
    from dgemma.train.lora_checkpoint import AdapterCheckpoints

__all__ = ["Adaptation", "Adapters", "FullParams", "adaptation_for"]


class Adaptation(Protocol):
    """What a run trains: every parameter (`FullParams`) or adapters over a frozen base (`Adapters`)."""

    trains_adapters: bool  # adapters over a frozen base (the SD·RL reference is then that base, no copy)

    def model_factory(self, factory: Callable) -> Callable: ...  # rngs -> the model this run trains
    def optim_section(self) -> OptimSection: ...  # the optimizer settings, with what stays frozen
    def loss_fn(self, loss_fn: Callable) -> Callable: ...  # the objective's LossFn as this run trains it
    def init_params(self, target: Any, fresh: Any) -> Any: ...  # `checkpoint.init_from`'s params on `target`
    def checkpoints(self, optimizer: Any, abstract_params: Any,
                    fresh_params: Callable[[], Any]) -> AdapterCheckpoints: ...  # what a run checkpoint holds


class FullParams:
    """Every parameter trains (`lora.rank: 0`): each method passes its input through."""

    trains_adapters = False

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg

    def model_factory(self, factory: Callable) -> Callable:
        return factory

    def optim_section(self) -> OptimSection:
        return self.cfg.optim

    def loss_fn(self, loss_fn: Callable) -> Callable:
        return loss_fn

    def init_params(self, target: Any, fresh: Any) -> Any:
        from dgemma.checkpoint.params import restore_params

        init_from = self.cfg.checkpoint.init_from
        assert init_from is not None  # the trainer calls init_params only when checkpoint.init_from is set
        return restore_params(init_from, target)

    def checkpoints(self, optimizer: Any, abstract_params: Any, fresh_params: Callable[[], Any]) -> AdapterCheckpoints:
        from dgemma.train.lora_checkpoint import AdapterCheckpoints

        return AdapterCheckpoints(self.cfg, None, None)  # pass-through: the whole TrainState is checkpointed


class Adapters:
    """Adapters train over a frozen base (`lora.rank > 0`, `dgemma.config.lora_section`)."""

    trains_adapters = True

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg

    def model_factory(self, factory: Callable) -> Callable:
        from dgemma.train.lora_setup import adapted_factory

        return adapted_factory(self.cfg, factory)

    def optim_section(self) -> OptimSection:
        from dgemma.train.lora_setup import optim_section

        return optim_section(self.cfg)

    def loss_fn(self, loss_fn: Callable) -> Callable:
        from dgemma.train.lora_setup import with_adapter_dropout

        return with_adapter_dropout(self.cfg, loss_fn)

    def init_params(self, target: Any, fresh: Any) -> Any:
        from dgemma.train.lora_init import restore_init_params

        return restore_init_params(self.cfg, target, fresh)

    def checkpoints(self, optimizer: Any, abstract_params: Any, fresh_params: Callable[[], Any]) -> AdapterCheckpoints:
        from dgemma.train.lora_checkpoint import AdapterCheckpoints

        return AdapterCheckpoints.for_run(self.cfg, optimizer, abstract_params, fresh_params)


def adaptation_for(cfg: RunConfig) -> Adaptation:
    """`Adapters` when `lora.rank > 0`, else `FullParams`."""
    lora = getattr(cfg, "lora", None)
    return Adapters(cfg) if lora is not None and lora.enabled else FullParams(cfg)

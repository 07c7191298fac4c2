"""What the trainer does differently with `lora.rank > 0` (`dgemma.config.lora_section`), in one place.

    model_factory = adapted_factory(cfg, model_factory)     # the model, then its adapters (same rngs stream)
    optimizer = build_optimizer(optim_section(cfg), ...)    # `optim.freeze` + everything but the adapters
    loss_fn = with_adapter_dropout(cfg, loss_fn)            # lora.dropout > 0: adapter dropout inside the loss

Every objective builds its models from the trainer's graphdef, so the adapters reach the AR, stage-1 and SD·RL
updates, their samplers and evaluations alike. The frozen base goes through `dgemma.train.step`'s frozen path:
`stop_gradient`, `optax.set_to_zero` (no optimizer state), passed through unchanged (bit-identical). With
`lora.rank: 0` (and `lora.dropout: 0` for the loss) each function returns its input unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from dgemma.config import RunConfig

__all__ = ["DROPOUT_STREAM", "adapted_factory", "freeze_pattern", "optim_section", "with_adapter_dropout"]

DROPOUT_STREAM = 0x4C6F5241  # fold_in constant: the adapters' dropout key, apart from the loss's own use of its key


def adapted_factory(cfg: RunConfig, model_factory: Callable) -> Callable:
    """`model_factory` followed by `attach_adapters(model, cfg.lora.spec(), rngs)` (itself when lora is off)."""
    lora = getattr(cfg, "lora", None)
    if lora is None or not lora.enabled:
        return model_factory
    from dgemma.model.lora import attach_adapters

    spec = lora.spec()

    def factory(rngs):
        model = model_factory(rngs)
        attach_adapters(model, spec, rngs)
        return model

    return factory


def optim_section(cfg: RunConfig) -> Any:
    """`cfg.optim` with the adapters' freeze regex appended to `optim.freeze` (itself when lora is off)."""
    lora = getattr(cfg, "lora", None)
    if lora is None or not lora.enabled:
        return cfg.optim
    return dataclasses.replace(cfg.optim, freeze=tuple(cfg.optim.freeze) + (freeze_pattern(lora),))


def freeze_pattern(lora: Any) -> str:
    """One regex matching every parameter path that stays frozen: all but the adapters (`.../lora/...`) and what
    `lora.train_router` / `lora.train_embeddings` name."""
    keep = [r"(.*/)?lora/"] + ([r"(.*/)?router/"] if lora.train_router else []) + (
        [r"embedder/"] if lora.train_embeddings else [])
    return "^" + "".join(f"(?!{k})" for k in keep)


def with_adapter_dropout(cfg: RunConfig, loss_fn: Callable) -> Callable:
    """`loss_fn(model, batch, rng)` run under `adapter_dropout(model, fold_in(rng, DROPOUT_STREAM))`: the step's key
    (seed and step only) keys the masks, so runs repeat and resume exactly. Itself when lora or its dropout is off."""
    lora = getattr(cfg, "lora", None)
    if lora is None or not lora.enabled or not lora.dropout:
        return loss_fn
    import jax

    from dgemma.model.lora import adapter_dropout

    def loss(model, batch, rng):
        with adapter_dropout(model, jax.random.fold_in(rng, DROPOUT_STREAM)):
            return loss_fn(model, batch, rng)

    return loss

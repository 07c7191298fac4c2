"""What the trainer does differently with `lora.rank > 0` (`dgemma.config.lora_section`), in one place.

    model_factory = adapted_factory(cfg, model_factory)     # the model, then its adapters (same rngs stream)
    optimizer = build_optimizer(optim_section(cfg), ...)    # `optim.freeze` + everything but the adapters

Every objective builds its models from the trainer's graphdef, so the adapters reach the AR, stage-1 and SD·RL
updates, their samplers and evaluations alike. The frozen base goes through `dgemma.train.step`'s frozen path:
`stop_gradient`, `optax.set_to_zero` (no optimizer state), passed through unchanged (bit-identical). With
`lora.rank: 0` both functions return their input unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

__all__ = ["adapted_factory", "freeze_pattern", "optim_section"]


def adapted_factory(cfg: Any, model_factory: Callable) -> Callable:
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


def optim_section(cfg: Any) -> Any:
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

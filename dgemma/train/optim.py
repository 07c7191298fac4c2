"""The optimizer from the config's `optim` section: schedule, clipping, AdamW/Adafactor, weight-decay mask, freezing.

    opt = build_optimizer(cfg.optim, total_steps=updates)   # updates: optimizer updates of the run (see below)
    opt_state = opt.tx.init(params)                  # params: nnx.State of nnx.Param (or any pytree)
    lr = opt.schedule(step)                          # the lr used by the update that takes the state to step+1

Transformation (per parameter, by label)::

    trainable:  clip_by_global_norm(clip_norm)  ->  adamw(schedule, b1, b2, eps, weight_decay, mask=decay_mask)
    frozen:     set_to_zero()                          (no optimizer state is allocated for frozen parameters)

* **Parameter paths** are the '/'-joined keys of a parameter in the state tree, e.g. `embedder/embedding`,
  `layers/3/moe/router/proj` (`param_path`). NNX's internal `value` attribute is not part of the path.
* **Freezing**: a parameter whose path matches any `optim.freeze` regex (`re.search`) is labelled `frozen`.
  `optax.multi_transform` sends it through `set_to_zero`, so its update is exactly 0 and the global-norm clip is
  computed over trainable parameters only. `dgemma.train.step` additionally passes frozen leaves through unchanged
  (no `p + 0.0`, which would turn -0.0 into +0.0), so frozen parameters stay bit-identical.
* **Weight decay** is decoupled (AdamW: `p -= lr * wd * p`, scaled by the schedule as in optax/PyTorch) and applies to
  parameters with ndim >= 2 only: norm scales, router scales and `layer_scalar` (1-D) are never decayed. The tied
  embedding is decayed unless `decay_embeddings=False` (or an extra `no_decay` regex matches it).
* **Schedule** (`make_schedule`): linear warmup over `w = warmup_steps` updates, reaching the peak at update w-1
  (update 0 already trains, at lr/w), then cosine from the peak at update w to `lr * min_lr_ratio` at update
  `total_steps` (or constant). `total_steps` counts optimizer updates: `trainer.steps` for stage1 / ar, and
  `trainer.steps x sdrl.inner_epochs x sdrl.num_minibatches` for sdrl. A warmup longer than the run is refused
  (`optim.warmup_steps` names both numbers): the run would never reach the configured peak lr, and clamping it
  would silently train a different schedule from the one the config states.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax

if TYPE_CHECKING:
    from dgemma.config import OptimSection

__all__ = [
    "FROZEN", "TRAINABLE", "Optimizer", "build_optimizer", "decay_mask", "frozen_flags", "make_schedule",
    "param_labels", "param_path", "param_paths",
]

TRAINABLE = "trainable"
FROZEN = "frozen"
EMBEDDING_PATTERN = r"(^|/)embedder/"


def param_path(path: Sequence[Any]) -> str:
    """'/'-joined name of a pytree key path, without NNX's internal `.value` attribute (`layers/0/attn/q_proj`)."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            if k.name not in ("value", "raw_value"):
                parts.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return "/".join(parts)


def param_paths(params: Any) -> list[str]:
    """Paths of all leaves of `params`, in `jax.tree.leaves` order."""
    return [param_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def _compile(patterns: Sequence[str]) -> list[re.Pattern]:
    return [re.compile(p) for p in patterns]


def _matches(path: str, compiled: Sequence[re.Pattern]) -> bool:
    return any(c.search(path) for c in compiled)


def param_labels(params: Any, freeze: Sequence[str]) -> Any:
    """Tree like `params` with `"frozen"` / `"trainable"` leaves (path regex search against `freeze`)."""
    compiled = _compile(freeze)
    return jax.tree_util.tree_map_with_path(
        lambda p, _: FROZEN if _matches(param_path(p), compiled) else TRAINABLE, params)


def frozen_flags(params: Any, freeze: Sequence[str]) -> tuple[bool, ...]:
    """One bool per leaf of `params` (leaves order): True for frozen parameters. Static (Python) data.

    Raises ValueError naming `optim.freeze` for an invalid regex or one that matches no parameter (a typo would
    otherwise silently train everything)."""
    try:
        compiled = _compile(freeze)
    except re.error as e:
        raise ValueError(f"optim.freeze: invalid regex {e.pattern!r}: {e}") from None
    paths = param_paths(params)
    unused = [c.pattern for c in compiled if not any(c.search(p) for p in paths)]
    if unused:
        raise ValueError(f"optim.freeze: {unused} match no parameter path (paths look like {paths[:3]})")
    return tuple(_matches(p, compiled) for p in paths)


def decay_mask(params: Any, *, decay_embeddings: bool = True, no_decay: Sequence[str] = ()) -> Any:
    """Tree like `params` with True where weight decay applies: ndim >= 2 and not excluded by a regex."""
    compiled = _compile(tuple(no_decay) + (() if decay_embeddings else (EMBEDDING_PATTERN,)))
    return jax.tree_util.tree_map_with_path(
        lambda p, x: len(getattr(x, "shape", ())) >= 2 and not _matches(param_path(p), compiled), params)


def make_schedule(lr: float, total_steps: int, *, warmup_steps: int = 0, kind: str = "cosine",
                  min_lr_ratio: float = 0.1) -> Callable[[Any], jax.Array]:
    """Learning rate as a function of the number of updates already applied (module docstring for the shape)."""
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be >= 1")
    if kind not in ("cosine", "constant"):
        raise ValueError(f"unknown schedule {kind!r}; expected 'cosine' or 'constant'")
    if warmup_steps > total_steps:
        raise ValueError(f"warmup_steps={warmup_steps} exceeds total_steps={total_steps}")
    warmup = int(warmup_steps)
    decay_steps = max(total_steps - warmup, 1)
    peak, floor = float(lr), float(lr) * float(min_lr_ratio)

    def schedule(count):
        s = jnp.asarray(count, jnp.float32)
        warm = peak * (s + 1.0) / max(warmup, 1)
        if kind == "constant":
            after = jnp.full_like(s, peak)
        else:
            frac = jnp.clip((s - warmup) / decay_steps, 0.0, 1.0)
            after = floor + (peak - floor) * 0.5 * (1.0 + jnp.cos(math.pi * frac))
        return jnp.where(s < warmup, warm, after)

    return schedule


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """The optax transformation plus what the train step needs to know about it.

    Attributes:
      tx: the full transformation (multi_transform over trainable / frozen labels).
      schedule: count -> lr (for logging; `tx` uses the same function).
      freeze: the freeze regexes (see `frozen_flags`).
    """

    tx: optax.GradientTransformation
    schedule: Callable[[Any], jax.Array]
    freeze: tuple[str, ...] = ()

    def frozen_flags(self, params: Any) -> tuple[bool, ...]:
        return frozen_flags(params, self.freeze)


def build_optimizer(optim: OptimSection, total_steps: int, *, decay_embeddings: bool = True,
                    no_decay: Sequence[str] = ()) -> Optimizer:
    """Build the optimizer from an `OptimSection` (name, lr, b1, b2, eps, weight_decay, clip_norm, warmup_steps,
    schedule, min_lr_ratio, freeze).

    Args:
      optim: the run's `optim` section.
      total_steps: optimizer updates the run makes (module docstring), for the schedule.
      decay_embeddings: apply weight decay to the (tied) embedding.
      no_decay: extra path regexes excluded from weight decay.

    Raises:
      ConfigError: `optim.warmup_steps` exceeds `total_steps`.
    """
    from dgemma.config import ConfigError
    from dgemma.config.sections import warmup_refusal

    refusal = warmup_refusal(optim.warmup_steps, total_steps)
    if refusal:
        raise ConfigError(refusal)
    schedule = make_schedule(optim.lr, total_steps, warmup_steps=optim.warmup_steps, kind=optim.schedule,
                             min_lr_ratio=optim.min_lr_ratio)
    freeze = tuple(optim.freeze)

    def mask(tree):
        return decay_mask(tree, decay_embeddings=decay_embeddings, no_decay=no_decay)

    parts = []
    if optim.clip_norm is not None:
        parts.append(optax.clip_by_global_norm(optim.clip_norm))
    if optim.name == "adamw":
        parts.append(optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay,
                                 mask=mask))
    elif optim.name == "adafactor":
        parts.append(optax.adafactor(learning_rate=schedule, decay_rate=optim.b2, eps=optim.eps,
                                     weight_decay_rate=optim.weight_decay or None, weight_decay_mask=mask,
                                     momentum=optim.b1 or None))
    else:
        raise ValueError(f"optim.name={optim.name!r} is not supported (adamw | adafactor)")
    trainable = optax.chain(*parts)
    tx = optax.multi_transform({TRAINABLE: trainable, FROZEN: optax.set_to_zero()},
                               lambda tree: param_labels(tree, freeze))
    return Optimizer(tx=tx, schedule=schedule, freeze=freeze)

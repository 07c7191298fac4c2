"""Run checkpoints of an adapted run (`lora.rank > 0`): the trainable leaves only, plus a fingerprint of the base.

    adapter_ckpt = AdapterCheckpoints.for_run(cfg, optimizer, fresh_params)   # pass-through when lora is off
    ckpt.save(step, adapter_ckpt.item(item), ..., metadata=adapter_ckpt.metadata())
    restored = ckpt.restore(adapter_ckpt.target(target))
    item = adapter_ckpt.restored(restored, ckpt.directory)                  # base filled in, fingerprint checked

With adapters every base weight is frozen, bit-identical to where the run started: the base of a resumed run is
rebuilt as the run built it (the seed's initialisation, then `checkpoint.init_from`), so a checkpoint holds what
trains (the adapters and what `lora.train_*` names), the optimizer state (which has no entries for the frozen base),
the step and the data state — not a second copy of the base. Each step's metadata records `lora_base`: the
`init_from` path, the seed, a hash of the frozen leaves' paths / shapes / dtypes and fp32 sums of three of them; a
resume whose rebuilt base gives another fingerprint (another `init_from`, a changed file there) is refused in one
line naming the checkpoint directory and the base, before anything is written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from dgemma.config import RunConfig

__all__ = ["BASE_KEY", "AdapterCheckpoints", "base_fingerprint"]

BASE_KEY = "lora_base"  # the checkpoint metadata entry holding the base fingerprint
SUM_RTOL = 1e-5  # a sum computed on another mesh may differ by reduction order


def _flat(params) -> list[tuple[str, Any]]:
    from flax import nnx

    return [("/".join(map(str, p)), v) for p, v in nnx.to_flat_state(params)]


def _subset(params, keep: set[str]):
    from flax import nnx

    return nnx.from_flat_state([(p, v) for p, v in nnx.to_flat_state(params) if "/".join(map(str, p)) in keep])


def base_fingerprint(params, frozen: set[str], *, init_from: str | None, seed: int) -> dict:
    """{init_from, seed, shapes (hash of the frozen leaves' paths, shapes, dtypes), sums (fp32 sums of the first,
    middle and last frozen leaf)} (module docstring)."""
    leaves = sorted((p, v) for p, v in _flat(params) if p in frozen)
    described = ";".join(f"{p}:{tuple(v.shape)}:{jnp.dtype(v.dtype).name}" for p, v in leaves)
    picks = sorted({0, len(leaves) // 2, len(leaves) - 1}) if leaves else []
    sums = {leaves[i][0]: float(jax.device_get(jnp.sum(jnp.asarray(leaves[i][1][...], jnp.float32))))
            for i in picks}
    return {"init_from": None if not init_from else str(init_from), "seed": int(seed),
            "shapes": hashlib.sha256(described.encode()).hexdigest()[:16], "sums": sums}


def _same_base(saved: dict, now: dict) -> bool:
    if saved.get("shapes") != now["shapes"] or set(saved.get("sums") or {}) != set(now["sums"]):
        return False
    return all(math.isclose(float(saved["sums"][k]), v, rel_tol=SUM_RTOL, abs_tol=1e-6)
               for k, v in now["sums"].items())


class AdapterCheckpoints:
    """The trainer's checkpoint item / restore target / restored state of an adapted run (module docstring); every
    method passes its input through unchanged when lora is off (`active` False)."""

    def __init__(self, cfg: RunConfig, frozen: set[str] | None, fresh_params: Callable[[], Any] | None):
        self.cfg = cfg
        self.frozen = frozen  # paths of the frozen leaves; None: lora off
        self.fresh_params = fresh_params  # () -> the base as the run builds it (seed init, then init_from)
        self._fingerprint: dict | None = None

    @classmethod
    def for_run(cls, cfg: RunConfig, optimizer: Any, abstract_params: Any, fresh_params: Callable[[], Any]):
        lora = getattr(cfg, "lora", None)
        if lora is None or not lora.enabled:
            return cls(cfg, None, None)
        from dgemma.train.optim import param_paths

        flags = optimizer.frozen_flags(abstract_params)
        return cls(cfg, {p for p, f in zip(param_paths(abstract_params), flags) if f}, fresh_params)

    @property
    def active(self) -> bool:
        return self.frozen is not None

    def _map_train_state(self, item: Any, fn: Callable) -> Any:
        from dgemma.train.state import TrainState

        if isinstance(item, TrainState):
            return dataclasses.replace(item, params=fn(item.params))
        if isinstance(item, dict) and isinstance(item.get("train"), TrainState):
            return {**item, "train": dataclasses.replace(item["train"], params=fn(item["train"].params))}
        raise TypeError(f"lora checkpoints: no TrainState in the checkpoint item ({type(item).__name__})")

    def _frozen_paths(self) -> set[str]:
        assert self.frozen is not None  # read only when `active` (frozen set)
        return self.frozen

    def _trainable(self, params):
        return _subset(params, {p for p, _ in _flat(params) if p not in self._frozen_paths()})

    def item(self, item: Any) -> Any:
        """The checkpoint item with the TrainState's params cut to the trainable leaves."""
        return item if not self.active else self._map_train_state(item, self._trainable)

    def target(self, target: Any) -> Any:
        """The restore target cut the same way (ShapeDtypeStructs of the trainable leaves)."""
        return target if not self.active else self._map_train_state(target, self._trainable)

    def fingerprint(self, params: Any) -> dict:
        """The base fingerprint of `params` (computed once per run: the base never changes)."""
        if self._fingerprint is None:
            c = self.cfg.checkpoint
            self._fingerprint = base_fingerprint(params, self._frozen_paths(), init_from=c.init_from,
                                                 seed=self.cfg.run.seed)
        return self._fingerprint

    def metadata(self, params: Any) -> dict:
        """The entries each checkpoint step records (the base fingerprint), {} when lora is off."""
        return {BASE_KEY: self.fingerprint(params)} if self.active else {}

    def run_metadata(self) -> dict:
        """{"lora": the adapters' settings} for every checkpoint's metadata, the params checkpoint's included
        (`dgemma.checkpoint.lora_params`: what sampling, evaluation and export rebuild the adapters from)."""
        from dgemma.checkpoint.lora_params import lora_metadata

        return lora_metadata(getattr(self.cfg, "lora", None))

    def restored(self, restored: Any, directory: Any) -> Any:
        """`restored` (a `Restored` of `target(...)`) with the rebuilt base merged into the TrainState's params.
        Raises a one-line ConfigError when the step was written over another base (or without a fingerprint)."""
        if not self.active or restored is None:
            return restored
        from flax import nnx

        from dgemma.config.types import ConfigError

        saved = (restored.metadata or {}).get(BASE_KEY)
        assert self.fresh_params is not None  # `for_run` sets it with `frozen` (active)
        base = self.fresh_params()
        now = self.fingerprint(base)
        where = f"checkpoint step {restored.step} in {directory}"
        if not saved:
            raise ConfigError(f"{where} holds no {BASE_KEY} fingerprint: it was not written by a run with adapters "
                              f"(lora.rank={self.cfg.lora.rank}); use another run.name")
        if not _same_base(saved, now):
            raise ConfigError(
                f"{where} was written over another base (checkpoint.init_from={saved.get('init_from')}, seed "
                f"{saved.get('seed')}) than this run's (checkpoint.init_from={now['init_from']}, seed {now['seed']}): "
                f"the frozen weights differ; resume with that base or use another run.name")
        frozen_base = _subset(base, self._frozen_paths())
        state = self._map_train_state(restored.state, lambda trained: nnx.merge_state(frozen_base, trained))
        return restored._replace(state=state)

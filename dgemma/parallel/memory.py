"""Moving a sharded pytree between accelerator memory and pinned host memory: same devices, same partitioning.

    ref = to_memory(params, HOST)        # a copy in pinned host memory; `params` is untouched
    dev = to_memory(ref, DEVICE)         # back on the accelerators, for the programs that read it
    ...
    free(dev)                            # its device buffers go now, not whenever Python drops the last reference

    ref = DeviceCopy(stored, kind)       # stored in `kind`; ref.params() on the devices, copied on first use only
    ...
    ref.release()                        # frees that copy (nothing when `stored` was on the devices already)

Why: SD·RL keeps a frozen copy of the model (the KL reference / frozen teacher) that only the phases before the
update read. In pinned host memory between those reads it costs no accelerator memory during the update, which is
where a step peaks (26B on 8 x H100: docs/planner_26b.md, stage 2). `jax.device_put` to a `Sharding.with_memory_kind`
moves each process's addressable shards, so this works unchanged on multi-host meshes; CPU, GPU and TPU devices all
expose a `pinned_host` memory.
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["DEVICE", "HOST", "DeviceCopy", "free", "memory_kinds", "require_memory_kind", "to_memory"]

HOST = "pinned_host"
DEVICE = "device"


def require_memory_kind(device: Any, kind: str, setting: str) -> None:
    """One-line error naming `setting` when `device` has no memory of `kind` (checked before a run writes anything)."""
    kinds = sorted(m.kind for m in device.addressable_memories())
    if kind not in kinds:
        raise ValueError(f"{setting}: the {device.platform} devices have no {kind!r} memory (they have {kinds})")


def _target(sharding: jax.sharding.Sharding, kind: str) -> jax.sharding.Sharding:
    # "device" names the accelerator's own memory whatever the backend calls its default memory space
    if kind == DEVICE:
        device: Any = next(iter(sharding.device_set))  # (jaxlib's Device type is opaque to the type checker)
        kind = device.default_memory().kind
    return sharding.with_memory_kind(kind)


def to_memory(tree: Any, kind: str) -> Any:
    """`tree` (jax.Arrays) in memory `kind` (DEVICE or HOST) of the same devices and partitioning. An array already
    there comes back as the same object (no copy), so `free` a result only when it was moved."""
    return jax.device_put(tree, jax.tree.map(lambda a: _target(a.sharding, kind), tree))


def memory_kinds(tree: Any) -> set[str]:
    """The memory kinds `tree`'s arrays live in ('device' for each backend's default memory)."""
    out = set()
    for a in jax.tree.leaves(tree):
        kind = a.sharding.memory_kind
        default = next(iter(a.sharding.device_set)).default_memory().kind
        out.add(DEVICE if kind in (None, default) else kind)
    return out


def free(tree: Any) -> None:
    """Delete `tree`'s buffers now. Only for a tree this code made (a `to_memory` copy nobody else holds)."""
    for a in jax.tree.leaves(tree):
        a.delete()


class DeviceCopy:
    """`stored` (a pytree kept in memory `kind`) for the phases that read it on the devices: `params()` copies it
    there on first use only, so a phase sequence that reads none of it copies nothing; `release()` frees that copy.
    With `kind` DEVICE both are no-ops around `stored` itself."""

    def __init__(self, stored: Any, kind: str):
        self.stored, self.kind, self._on_devices = stored, kind, None

    def params(self) -> Any:
        if self._on_devices is None:
            self._on_devices = to_memory(self.stored, DEVICE) if self.kind != DEVICE else self.stored
        return self._on_devices

    def release(self) -> None:
        if self.kind != DEVICE and self._on_devices is not None:  # the copy is this object's own
            free(self._on_devices)
        self._on_devices = None

"""Multi-host initialisation (`jax.distributed`), called ONLY from CLI entry points, never at import or config load.

    from dgemma.parallel.distributed import maybe_initialize
    plan = maybe_initialize()        # at the top of `dgemma train`'s run; None for a single-process run

`detect(environ)` decides what to do from the environment alone (pure; unit-tested with fake environments):

| order | environment                                        | action                                                  |
|-------|----------------------------------------------------|---------------------------------------------------------|
| 1     | `DGEMMA_DISTRIBUTED=off`                           | skip                                                    |
| 2     | `DGEMMA_DISTRIBUTED=jax`                           | `jax.distributed.initialize()` (JAX's own detection)    |
| 3     | `DGEMMA_COORDINATOR`, `DGEMMA_NUM_PROCESSES`,      | explicit: those values (+ `DGEMMA_LOCAL_DEVICE_IDS`     |
|       | `DGEMMA_PROCESS_ID` (all three)                    | "0,1"); skipped when the count is 1                     |
| 4     | SLURM with `SLURM_NTASKS` > 1                      | explicit: coordinator = first host of the expanded      |
|       |                                                    | `SLURM_STEP_NODELIST` (else `SLURM_JOB_NODELIST`), id = |
|       |                                                    | `SLURM_PROCID`, count = `SLURM_NTASKS`, local devices = |
|       |                                                    | [`SLURM_LOCALID`] when several tasks share a node       |
| 5     | multi-host TPU (`TPU_WORKER_HOSTNAMES` with > 1    | `jax.distributed.initialize()`: JAX's TPU / GKE JobSet  |
|       | host, or `MEGASCALE_NUM_SLICES` > 1)               | detection                                               |
| 6     | anything else                                      | skip (single process)                                   |

Why SLURM is explicit rather than delegated: JAX's SLURM detection always restricts a process to the GPU numbered
`SLURM_LOCALID`, which hides 7 of 8 GPUs in the one-process-per-node layout, and it needs `SLURM_STEP_NODELIST`
(srun only). With one process per GPU and SLURM binding GPUs itself (`CUDA_VISIBLE_DEVICES` a single id), no local
ids are passed. The coordinator port is `DGEMMA_COORDINATOR_PORT`, else `JAX_COORDINATOR_PORT`, else derived from
the job id as JAX does. On CPU (`JAX_PLATFORMS=cpu`) the gloo collectives are enabled before initialising, so
multi-process CPU runs (tests) work. The initialisation timeout is generous (`DGEMMA_INIT_TIMEOUT`, default 1800 s:
large jobs start their hosts minutes apart).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["DistributedPlan", "detect", "expand_nodelist", "maybe_initialize"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 1800


@dataclasses.dataclass(frozen=True)
class DistributedPlan:
    """What `maybe_initialize` passes to `jax.distributed.initialize` (None fields: JAX detects them)."""

    method: str  # "explicit" | "slurm" | "jax"
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    cpu_collectives: bool = False
    timeout_s: int = DEFAULT_TIMEOUT_S

    def kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"initialization_timeout": self.timeout_s}
        for name in ("coordinator_address", "num_processes", "process_id"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.local_device_ids is not None:
            out["local_device_ids"] = list(self.local_device_ids)
        return out


def _expand_one(name: str) -> list[str]:
    """'a[01-02]b[1,3]' -> ['a01b1', 'a01b3', 'a02b1', 'a02b3'] (zero padding kept)."""
    m = re.search(r"\[([^\]]*)\]", name)
    if not m:
        return [name]
    head, tail = name[:m.start()], name[m.end():]
    values = []
    for part in m.group(1).split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = part.split("-", 1)
            width = len(lo)
            values += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
        elif part:
            values.append(part)
    return [head + v + rest for v in values for rest in _expand_one(tail)]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM hostlist: 'gpu-[01-03,07],cpu1' -> ['gpu-01', 'gpu-02', 'gpu-03', 'gpu-07', 'cpu1']."""
    items, depth, cur = [], 0, ""
    for ch in nodelist.strip():
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items.append(cur)
    out = []
    for item in items:
        if item.strip():
            out += _expand_one(item.strip())
    return out


def _tasks_per_node(env: Mapping[str, str], ntasks: int) -> int:
    for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        text = env.get(key)
        if text:
            m = re.match(r"(\d+)", text)  # '8(x2)' or '8,8' or '8'
            if m:
                return int(m.group(1))
    nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    return max(ntasks // max(nodes, 1), 1)


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except (KeyError, ValueError):
        raise ValueError(f"distributed init: environment variable {key}={env.get(key)!r} must be an integer") from None


def detect(environ: Mapping[str, str] | None = None) -> DistributedPlan | None:
    """The initialisation plan for this environment, or None for a single-process run (module docstring)."""
    env = os.environ if environ is None else environ
    mode = env.get("DGEMMA_DISTRIBUTED", "auto").strip().lower()
    if mode not in ("auto", "off", "jax"):
        raise ValueError(f"DGEMMA_DISTRIBUTED={mode!r}: expected auto | off | jax")
    if mode == "off":
        return None
    cpu = env.get("JAX_PLATFORMS", "").split(",")[0].strip().lower() == "cpu"
    timeout = _int(env, "DGEMMA_INIT_TIMEOUT") if env.get("DGEMMA_INIT_TIMEOUT") else DEFAULT_TIMEOUT_S
    common: dict[str, Any] = dict(cpu_collectives=cpu, timeout_s=timeout)
    if mode == "jax":
        return DistributedPlan("jax", **common)

    explicit = [k for k in ("DGEMMA_COORDINATOR", "DGEMMA_NUM_PROCESSES", "DGEMMA_PROCESS_ID") if env.get(k)]
    if explicit:
        if len(explicit) != 3:
            missing = sorted({"DGEMMA_COORDINATOR", "DGEMMA_NUM_PROCESSES", "DGEMMA_PROCESS_ID"} - set(explicit))
            raise ValueError(f"distributed init: {explicit} set but {missing} missing; set all three or none")
        n, i = _int(env, "DGEMMA_NUM_PROCESSES"), _int(env, "DGEMMA_PROCESS_ID")
        if not 0 <= i < n:
            raise ValueError(f"distributed init: DGEMMA_PROCESS_ID={i} must be in [0, DGEMMA_NUM_PROCESSES={n})")
        if n == 1:
            return None
        local = env.get("DGEMMA_LOCAL_DEVICE_IDS")
        ids = tuple(int(x) for x in local.split(",") if x.strip()) if local else None
        return DistributedPlan("explicit", env["DGEMMA_COORDINATOR"], n, i, ids, **common)

    if "SLURM_JOB_ID" in env and "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        n = _int(env, "SLURM_NTASKS")
        if n > 1:
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            if not nodelist:
                raise ValueError("distributed init: SLURM job with several tasks but no SLURM_*_NODELIST")
            host = expand_nodelist(nodelist)[0]
            port = env.get("DGEMMA_COORDINATOR_PORT") or env.get("JAX_COORDINATOR_PORT") or \
                str(_int(env, "SLURM_JOB_ID") % 2**12 + (65535 - 2**12 + 1))
            ids = None
            visible = [v for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
            if _tasks_per_node(env, n) > 1 and len(visible) != 1 and "SLURM_LOCALID" in env:
                ids = (_int(env, "SLURM_LOCALID"),)  # one process per GPU, all GPUs visible: pick ours
            return DistributedPlan("slurm", f"{host}:{port}", n, _int(env, "SLURM_PROCID"), ids, **common)
        return None

    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    slices = int(env.get("MEGASCALE_NUM_SLICES") or 1)
    if len(hosts) > 1 or slices > 1:
        return DistributedPlan("jax", **common)
    return None


def maybe_initialize(environ: Mapping[str, str] | None = None, *,
                     initialize: Callable[..., Any] | None = None) -> DistributedPlan | None:
    """Initialise `jax.distributed` if this is a multi-process run (see `detect`); returns the plan or None.

    Idempotent: does nothing if `jax.distributed` is already initialised. `initialize` replaces
    `jax.distributed.initialize` (tests).
    """
    plan = detect(environ)
    if plan is None:
        return None
    import jax

    if initialize is None:
        if jax.distributed.is_initialized():
            log.info("jax.distributed is already initialised; skipping")
            return plan
        initialize = jax.distributed.initialize
    if plan.cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    log.info("initialising jax.distributed (%s): %s", plan.method, plan.kwargs())
    initialize(**plan.kwargs())
    return plan

"""Launch settings: where and how a run is started (`dgemma launch`). Independent of the run config on purpose: one
run config can be launched on several clusters.

Settings come from a launch profile YAML (packaged examples in `dgemma/planning/profiles/*.yaml`, top-level key `launch:`) plus `launch.*`
overrides on the `dgemma launch` command line, loaded strictly with `dgemma.config.loader.load` (unknown keys are
errors with a did-you-mean hint). Importing this module never imports jax.

Topology: `devices = nodes x devices_per_node x num_slices`.
* SLURM / GPU: `nodes` hosts with `devices_per_node` GPUs (default 8); `process_per: device` runs one process per GPU
  (`--ntasks-per-node=8`, what NVIDIA recommends), `node` one per host.
* XPK / TPU: `tpu_type` (e.g. `v5p-64`) fixes the chips and hosts of one slice (v5p/v4 names count TensorCores, two
  per chip: v5p-64 = 32 chips = 8 hosts of 4); `num_slices` slices are joined over DCN.
* XPK / GPU: `device_type` (e.g. `h100-80gb-8`) and `nodes`.
* TPU VM: `tpu_type` and `tpu_name` (the VM slice); commands go to every worker (`--worker=all`).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Literal

from dgemma.config.sections import help_field
from dgemma.config.types import FrozenDict, Section

__all__ = ["LaunchFile", "LaunchSection", "Topology", "load_launch", "tpu_slice", "topology"]

Target = Literal["local", "slurm", "xpk", "tpu-vm"]
TARGET_ALIASES = {"xpk-tpu": "xpk", "xpk-gpu": "xpk"}
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"  # package data


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchSection(Section):
    """Where and how to start a run (module docstring)."""

    target: Target = help_field("local", "local | slurm | xpk | tpu-vm")
    accelerator: Literal["cpu", "h100", "h200", "v5p", "v6e"] = help_field(
        "cpu", "accelerator kind: planner memory per device and the packaged hardware env file")
    nodes: int = help_field(1, "hosts per slice (SLURM nodes, XPK GPU nodes); TPU: derived from tpu_type")
    devices_per_node: int = help_field(0, "accelerators per host (0: 8 GPUs, 4 TPU chips, 1 CPU device)")
    num_slices: int = help_field(1, "TPU slices over DCN (xpk --num-slices)")
    process_per: Literal["node", "device"] = help_field("node", "SLURM: one process per node or per GPU")
    hardware_env: str | None = help_field(None, "packaged env gpu | tpu | cpu, or a path to an .env file (null: by accelerator)")
    env: dict[str, str] = help_field(FrozenDict(), "extra environment variables exported on every host")
    workdir: str = help_field(".", "repository checkout on the hosts (the command runs there); local: relative to "
                                   "the directory dgemma launch runs in")
    python: str | None = help_field(None, "python executable on the hosts (null: local runs the interpreter dgemma "
                                          "runs in, other targets `python`)")
    setup: tuple[str, ...] = help_field((), "shell lines run on every host before training (venv, modules)")
    log_dir: str | None = help_field(None, "per-host logs (null: <run.output_dir>/<run.name>/logs)")
    plan_check: bool = help_field(True, "refuse to submit a run the planner says does not fit")
    node_ram_gib: float = help_field(0.0, "RAM of one node in GiB (0: the accelerator table's); what is kept on the "
                                          "host (sdrl.reference_memory=host, remat=offload) is planned against it")
    # SLURM
    partition: str | None = help_field(None, "SLURM partition")
    account: str | None = help_field(None, "SLURM account")
    qos: str | None = help_field(None, "SLURM QoS")
    time_limit: str = help_field("24:00:00", "SLURM --time")
    sbatch_extra: tuple[str, ...] = help_field((), "extra '#SBATCH' options, e.g. ['--exclusive']")
    # XPK (GKE)
    cluster: str | None = help_field(None, "GKE cluster (xpk --cluster)")
    project: str | None = help_field(None, "GCP project")
    zone: str | None = help_field(None, "GCP zone")
    docker_image: str | None = help_field(None, "container image with dgemma installed (xpk --base-docker-image)")
    tpu_type: str | None = help_field(None, "TPU slice type, e.g. v5p-64 (xpk --tpu-type, TPU VM)")
    device_type: str | None = help_field(None, "GPU node type, e.g. h100-80gb-8 (xpk --device-type)")
    workload: str | None = help_field(None, "xpk workload name (null: the run name)")
    priority: str | None = help_field(None, "xpk --priority (e.g. medium)")
    # TPU VM
    tpu_name: str | None = help_field(None, "TPU VM name (gcloud compute tpus tpu-vm ssh NAME)")

    def validate(self) -> None:
        for name, low in (("nodes", 1), ("devices_per_node", 0), ("num_slices", 1), ("node_ram_gib", 0)):
            if getattr(self, name) < low:
                self._fail(name, f"{getattr(self, name)} must be >= {low}")
        if self.tpu_type is not None:
            try:
                tpu_slice(self.tpu_type)
            except ValueError as e:
                self._fail("tpu_type", str(e).removeprefix(f"tpu_type {self.tpu_type!r}: ").join(
                    (f"{self.tpu_type!r}: ", "")))
        if self.target == "xpk" and self.accelerator in ("h100", "h200") and self.tpu_type:
            self._fail("tpu_type", "a GPU accelerator takes device_type, not tpu_type")
        if self.target in ("xpk", "tpu-vm") and self.accelerator in ("v5p", "v6e") and not self.tpu_type:
            self._fail("tpu_type", f"target {self.target} on {self.accelerator} needs a tpu_type, e.g. v5p-64")
        if self.target == "xpk" and self.accelerator == "cpu":
            self._fail("accelerator", "target xpk runs on GKE TPU or GPU nodes, not cpu; set launch.accelerator "
                                      "(h100, h200, v5p, v6e) or use target local / slurm for a CPU run")
        if self.target == "tpu-vm" and self.accelerator not in ("v5p", "v6e"):
            self._fail("accelerator", f"target tpu-vm runs on TPU VMs, not {self.accelerator}; set "
                                      f"launch.accelerator to v5p or v6e")
        if self.target == "tpu-vm" and not self.tpu_name:
            self._fail("tpu_name", "target tpu-vm needs the TPU VM name")
        if self.target == "xpk" and not self.cluster:
            self._fail("cluster", "target xpk needs the GKE cluster name")
        if self.process_per == "device" and self.target != "slurm":
            self._fail("process_per", "one process per device is only rendered for SLURM")
        for k in self.env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                self._fail(f"env.{k}", "not a valid environment variable name")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchFile(Section):
    """A launch profile file: `launch: {...}`."""

    launch: LaunchSection = help_field(LaunchSection, "launch settings")


def load_launch(profile: str | Path | None = None, overrides: list[str] | None = None,
                target: str | None = None) -> LaunchSection:
    """LaunchSection from a profile (a path, or a packaged profile name in PROFILES_DIR) + `launch.*` overrides."""
    from dgemma.config.loader import load

    path = None
    if profile is not None:
        path = Path(profile)
        if not path.exists() and (PROFILES_DIR / f"{profile}.yaml").exists():
            path = PROFILES_DIR / f"{profile}.yaml"
    tokens = list(overrides or [])
    if target is not None:
        tokens.append(f"launch.target={TARGET_ALIASES.get(target, target)}")
    return load(LaunchFile, path, tokens, env={}).launch


def tpu_slice(tpu_type: str) -> tuple[str, int, int]:
    """(generation, chips, hosts) of a TPU slice name: v5p-64 -> ('v5p', 32, 8); v6e-256 -> ('v6e', 256, 64)."""
    m = re.fullmatch(r"(v4|v5p|v5litepod|v5e|v6e)-(\d+)", tpu_type)
    if not m:
        raise ValueError(f"tpu_type {tpu_type!r}: expected e.g. v5p-64, v6e-256, v5litepod-16, v4-32")
    gen, n = m.group(1), int(m.group(2))
    if n < 1 or (gen in ("v4", "v5p") and n % 2):
        raise ValueError(f"tpu_type {tpu_type!r}: the size must be a positive number of "
                         f"{'TensorCores (even: two per chip)' if gen in ('v4', 'v5p') else 'chips'}")
    chips = n // 2 if gen in ("v4", "v5p") else n  # v4 / v5p names count TensorCores (2 per chip)
    per_host = 8 if gen in ("v5e", "v5litepod", "v6e") and chips <= 8 else 4
    return gen, chips, max(1, chips // per_host)


@dataclasses.dataclass(frozen=True)
class Topology:
    hosts_per_slice: int
    devices_per_host: int
    slices: int
    processes: int

    @property
    def devices(self) -> int:
        return self.hosts_per_slice * self.devices_per_host * self.slices

    @property
    def granules(self) -> int:
        """Units DCN connects: TPU slices, else hosts."""
        return self.slices if self.slices > 1 else self.hosts_per_slice


def topology(launch: LaunchSection, mesh_devices: int | None = None) -> Topology:
    """Hosts, devices and processes of a launch (module docstring). `mesh_devices` (the run's fixed mesh size) is
    the default device count of a CPU launch with `devices_per_node: 0`."""
    if launch.tpu_type:
        _, chips, hosts = tpu_slice(launch.tpu_type)
        return Topology(hosts, chips // hosts, launch.num_slices, hosts * launch.num_slices)
    if launch.device_type:
        m = re.search(r"-(\d+)$", launch.device_type)
        per = int(m.group(1)) if m else 8
    else:
        cpu = max(1, (mesh_devices or 1) // launch.nodes)
        per = launch.devices_per_node or {"cpu": cpu, "v5p": 4, "v6e": 4}.get(launch.accelerator, 8)
    processes = launch.nodes * (per if launch.process_per == "device" else 1) * launch.num_slices
    return Topology(launch.nodes, per, launch.num_slices, processes)

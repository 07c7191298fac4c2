"""Render (and submit) a training run for local | slurm | xpk | tpu-vm from a run config + launch settings.

    job = render(cfg, launch, config_path="configs/stage1/gemma4_26b_a4b.yaml", overrides=["trainer.steps=10"])
    print(job.text())          # the rendered script(s) and the submit command (what --dry-run prints)
    job.write(); job.submit()  # write under <run_dir>/launch/ and run sbatch / xpk / gcloud / bash

Templates are package data (`dgemma/planning/templates/<target>.*.tmpl`) with `{{name}}` placeholders (a missing value is an error, so a template
and the renderer cannot drift silently). Every target runs `host_wrapper.sh LOG_DIR -- PYTHON -m dgemma.cli
train --config CONFIG [overrides]` on each host, which tees per-host logs. A local run needs no checkout and no
activated environment: it runs the packaged wrapper and the interpreter dgemma runs in (`sys.executable`, unless
`launch.python` names another) in `launch.workdir` made absolute; cluster targets run `launch/host_wrapper.sh` of the
checkout at `launch.workdir` and `launch.python` (default `python`). The environment exported on the hosts is
the packaged `dgemma/planning/hardware/<gpu|tpu|cpu>.env` (by accelerator; `launch.hardware_env` names another
packaged file or a path to an `.env` file) plus `launch.env`.

Multi-host initialisation is never rendered as code: `dgemma train` calls
`dgemma.parallel.distributed.maybe_initialize()`, which reads SLURM_* (slurm), JAX's TPU/GKE detection (tpu-vm, xpk
on TPU), or the DGEMMA_COORDINATOR / DGEMMA_NUM_PROCESSES / DGEMMA_PROCESS_ID variables that the XPK GPU command sets
from the JobSet environment.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dgemma.planning.launch_spec import LaunchSection, Topology, topology

if TYPE_CHECKING:
    from dgemma.config import RunConfig

__all__ = ["Job", "hardware_env", "read_env_file", "render", "render_template"]

PACKAGE_DIR = Path(__file__).resolve().parent  # package data: templates/, hardware/, profiles/
TEMPLATES_DIR = PACKAGE_DIR / "templates"
HARDWARE_DIR = PACKAGE_DIR / "hardware"
HOST_WRAPPER = PACKAGE_DIR / "host_wrapper.sh"  # package data; launch/host_wrapper.sh in a checkout links to it
CHECKOUT_WRAPPER = "launch/host_wrapper.sh"  # what cluster hosts run, relative to launch.workdir
TEMPLATES = {"local": "local.sh.tmpl", "slurm": "slurm.sbatch.tmpl", "xpk": "xpk.sh.tmpl", "tpu-vm": "tpu_vm.sh.tmpl"}
SCRIPT_NAMES = {"local": "run.sh", "slurm": "job.sbatch", "xpk": "xpk_workload.sh", "tpu-vm": "tpu_vm_run.sh"}
# XPK GPU JobSets: the first pod of the job is the coordinator (MaxText's GPU recipe; NNODES / NODE_RANK are set by
# xpk, JOB_COMPLETION_INDEX by the Job controller).
XPK_GPU_DISTRIBUTED = (
    'export DGEMMA_COORDINATOR="${JAX_COORDINATOR_ADDRESS:-${JOBSET_NAME}-${REPLICATED_JOB_NAME}-0-0.${JOBSET_NAME}}'
    ':${JAX_COORDINATOR_PORT:-6002}" DGEMMA_NUM_PROCESSES="${NNODES}" '
    'DGEMMA_PROCESS_ID="${NODE_RANK:-${JOB_COMPLETION_INDEX}}"')


def read_env_file(path: str | Path) -> dict[str, str]:
    """KEY=VALUE lines (blank lines and # comments ignored; optional matching quotes stripped)."""
    out: dict[str, str] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)", line)
        if not m:
            raise ValueError(f"{path}:{n}: expected KEY=VALUE, got {line!r}")
        value = m.group(2)
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[m.group(1)] = value
    return out


def hardware_env(launch: LaunchSection) -> tuple[str, dict[str, str]]:
    """(label, variables) of the hardware env file for this launch: a packaged name (gpu | tpu | cpu) or a path to
    an `.env` file (relative to the current directory)."""
    name = launch.hardware_env or {"h100": "gpu", "h200": "gpu", "v5p": "tpu", "v6e": "tpu"}.get(
        launch.accelerator, "cpu")
    if name.endswith(".env"):
        label, path = name, Path(name)
    else:
        label, path = f"hardware/{name}.env (packaged)", HARDWARE_DIR / f"{name}.env"
    if not path.exists():
        known = sorted(p.stem for p in HARDWARE_DIR.glob("*.env"))
        raise ValueError(f"launch.hardware_env: {name!r} is neither a packaged env {known} nor an existing .env file")
    return label, read_env_file(path)


def render_template(text: str, values: Mapping[str, Any]) -> str:
    """Replace `{{name}}` placeholders; every placeholder needs a value."""
    missing = sorted({m for m in re.findall(r"{{\s*(\w+)\s*}}", text) if m not in values})
    if missing:
        raise KeyError(f"template placeholders without a value: {missing}")
    return re.sub(r"{{\s*(\w+)\s*}}", lambda m: str(values[m.group(1)]), text)


@dataclasses.dataclass(frozen=True)
class Job:
    """A rendered launch: files to write under `directory` and the command that submits / runs them."""

    target: str
    directory: Path  # <run_dir>/launch (relative to workdir when the run dir is)
    files: dict[str, str]
    submit_command: tuple[str, ...]
    topology: Topology
    make_dirs: tuple[str, ...] = ()  # created by `write` (SLURM does not create the --output directory)
    created: list[Path] = dataclasses.field(default_factory=list, compare=False)  # what `write` made, for `unwrite`

    def text(self) -> str:
        parts = [f"# ---- {self.directory / name} ----\n{body}" for name, body in self.files.items()]
        parts.append(f"# ---- submit ----\n{shlex.join(self.submit_command)}\n")
        return "\n".join(parts)

    def write(self) -> list[Path]:
        """Write the files (and `make_dirs`); what did not exist before is recorded for `unwrite`."""
        for d in (self.directory, *(Path(d).expanduser() for d in self.make_dirs)):
            top = next((p for p in reversed((d, *d.parents)) if not p.exists()), None)
            d.mkdir(parents=True, exist_ok=True)
            if top is not None:
                self.created.append(top)
        paths = []
        for name, body in self.files.items():
            path = self.directory / name
            if not path.exists():
                self.created.append(path)
            path.write_text(body)
            path.chmod(0o755)
            paths.append(path)
        return paths

    def unwrite(self) -> None:
        """Remove what `write` created (a launch that could not start leaves nothing half-made behind)."""
        for p in reversed(self.created):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        self.created.clear()

    def submit(self, *, cwd: str | Path | None = None) -> int:
        """Run the submit command (foreground); returns its exit code."""
        return subprocess.run(list(self.submit_command), cwd=cwd, check=False).returncode


def _exports(env: Mapping[str, str]) -> str:
    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())


def _export_line(env: Mapping[str, str]) -> str:
    return ("export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())) if env else ""


def _quote_path(path: str) -> str:
    """Shell-quote a path but keep a leading ~/ expandable."""
    return "~/" + shlex.quote(path[2:]) if path.startswith("~/") else shlex.quote(path)


def _cpu_devices_per_process(launch: LaunchSection, topo: Topology) -> int:
    """Simulated CPU devices each process needs (1 unless a CPU launch runs one process for several devices)."""
    if launch.accelerator != "cpu":
        return 1
    if launch.target == "local":
        return topo.devices
    return topo.devices_per_host if launch.process_per == "node" else 1


def render(cfg: RunConfig, launch: LaunchSection, *, config_path: str | None, overrides: Sequence[str] = (),
           env_extra: Mapping[str, str] | None = None) -> Job:
    """Render the job for `launch.target` (module docstring). `cfg` is the resolved RunConfig."""
    topo = topology(launch, cfg.mesh.axis_size(*cfg.mesh.axes))
    target = launch.target
    if target == "tpu-vm" and launch.num_slices != 1:
        raise ValueError("launch.num_slices: target tpu-vm runs one slice; use target xpk for multi-slice")
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    log_dir = launch.log_dir or str(run_dir / "logs")
    env_file, env = hardware_env(launch)
    env = {**env, **dict(launch.env), **dict(env_extra or {})}
    cpu_devices_per_process = _cpu_devices_per_process(launch, topo)
    if cpu_devices_per_process > 1:
        flag = f"--xla_force_host_platform_device_count={cpu_devices_per_process}"
        env["XLA_FLAGS"] = f"{env['XLA_FLAGS']} {flag}" if env.get("XLA_FLAGS") else flag
    local = target == "local"
    python = launch.python or (sys.executable if local else "python")
    if local and shutil.which(python) is None:
        raise ValueError(f"launch.python: {python!r} is not an executable on this machine")
    workdir = str(Path(launch.workdir).expanduser().absolute()) if local else launch.workdir
    argv = [python, "-m", "dgemma.cli", "train"]
    if config_path:
        argv += ["--config", str(config_path)]
    argv += list(overrides)
    if target != "local":
        argv.append("--no-progress")
    command = shlex.join(argv)
    wrapper = shlex.quote(str(HOST_WRAPPER)) if local else CHECKOUT_WRAPPER
    host_cmd = f"bash {wrapper} {shlex.quote(log_dir)} -- {command}"
    setup = "\n".join(launch.setup)
    values: dict[str, Any] = {
        "run_name": cfg.run.name, "job_name": f"dgemma-{cfg.run.name}", "devices": topo.devices,
        "accelerator": launch.accelerator, "nodes": topo.hosts_per_slice, "devices_per_node": topo.devices_per_host,
        "processes": topo.processes, "workdir": _quote_path(workdir), "setup": setup,
        "env_exports": f"# environment: {env_file} + launch.env\n{_exports(env)}", "log_dir": shlex.quote(log_dir),
        "command": command, "time_limit": launch.time_limit, "host_command": host_cmd,
    }
    gcp = "".join(f"  --{k}={shlex.quote(v)} \\\n" for k, v in (("project", launch.project), ("zone", launch.zone))
                  if v)
    if target == "slurm":
        values["tasks_per_node"] = topo.devices_per_host if launch.process_per == "device" else 1
        # a CPU job asks SLURM for no GPUs: its devices are simulated in each process (XLA_FLAGS above)
        values["gpu_request"] = ("" if launch.accelerator == "cpu"
                                 else f"\n#SBATCH --gpus-per-node={topo.devices_per_host}")
        opts = [f"--{k}={v}" for k, v in (("partition", launch.partition), ("account", launch.account),
                                           ("qos", launch.qos)) if v] + list(launch.sbatch_extra)
        values["sbatch_options"] = "\n".join(f"#SBATCH {o}" for o in opts)
        submit = ("sbatch",)
    elif target == "xpk":
        inner = [f"cd {_quote_path(launch.workdir)}", *launch.setup, _export_line(env)]
        if launch.tpu_type:
            device_flags = f"  --tpu-type={launch.tpu_type} \\\n  --num-slices={launch.num_slices} \\\n"
            values["topology"] = f"{launch.num_slices} x {launch.tpu_type}"
        else:
            device_type = launch.device_type or f"{launch.accelerator}-80gb-8"
            device_flags = f"  --device-type={device_type} \\\n  --num-nodes={launch.nodes} \\\n"
            values["topology"] = f"{launch.nodes} x {device_type}"
            inner.append(XPK_GPU_DISTRIBUTED)
        if launch.priority:
            device_flags += f"  --priority={launch.priority} \\\n"
        inner.append(host_cmd)
        values.update(cluster=launch.cluster, gcp_flags=gcp, workload=launch.workload or f"dgemma-{cfg.run.name}",
                      docker_image=shlex.quote(launch.docker_image or "<set launch.docker_image>"),
                      device_flags=device_flags, container_command=shlex.quote(" && ".join(x for x in inner if x)))
        submit = ("bash",)
    elif target == "tpu-vm":
        inner = [f"cd {_quote_path(launch.workdir)}", *launch.setup, _export_line(env), host_cmd]
        values.update(tpu_name=launch.tpu_name, tpu_type=launch.tpu_type, gcp_flags=gcp,
                      remote_command=shlex.quote(" && ".join(x for x in inner if x)))
        submit = ("bash",)
    else:
        submit = ("bash",)
    template = (TEMPLATES_DIR / TEMPLATES[target]).read_text()
    body = render_template(template, values)
    body = re.sub(r"\n{3,}", "\n\n", body)
    directory = run_dir / "launch"
    name = SCRIPT_NAMES[target]
    local_dirs = (log_dir,) if target in ("slurm", "local") else ()
    return Job(target, directory, {name: body}, (*submit, str(directory / name)), topo, local_dirs)

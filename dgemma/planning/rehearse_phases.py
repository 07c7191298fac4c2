"""The phases of `dgemma rehearse`, each through the CLI a user runs, as child processes with their own CPU backend:

    stage1        `dgemma launch --target local --profile local_cpu` (the rendered run.sh): 2 stage-1 steps
    kill_resume   the same launch again, SIGKILLed once its step-1 checkpoint is committed, then launched once more:
                  its final params must equal the straight run's bit for bit
    sdrl          `dgemma launch --target local` of the stage-2 config from the resumed run's params: 1 SD·RL iteration
    sample        `dgemma sample` on the SD·RL params (block diffusion)
    eval          `dgemma eval` on them (exact match per task, diffusion mode)
    export_bf16   `dgemma export` (bfloat16), reloaded in transformers: logits equal dgemma's (float32, 1e-4)
    export_fp8    `dgemma export --fp8` (automatic block), reloaded the same way after dequantisation

A phase that fails prints its one-line reason; the phases that do not need its output still run. Every file goes
under the rehearsal's output directory. Phases run as soon as the phases they need have passed, up to `jobs` at a
time (sample, eval and the two exports all read the SD·RL params only): a compile is one thread, so two phases keep
two cores busy where one leaves one idle. Each phase's CPU seconds are its own child processes' (wait4), its compile
seconds its own logs', whatever runs beside it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

__all__ = ["PHASES", "PhaseResult", "exit_on_sigterm", "run_phases"]

PHASES = ("stage1", "kill_resume", "sdrl", "sample", "eval", "export_bf16", "export_fp8")
PHASE_TIMEOUT_S = 3600
COMPILE_LOG = re.compile(r"Finished XLA compilation of .* in ([0-9.]+) sec")  # jax_log_compiles' lines
CACHE_HIT_LOG = "Persistent compilation cache hit for"


@dataclasses.dataclass(frozen=True)
class PhaseResult:
    name: str
    passed: bool | None  # None: skipped (a phase it needs failed)
    seconds: float
    figure: str  # the key figure, or the one-line reason it failed / was skipped
    cpu_seconds: float = 0.0  # user + sys of the phase's child processes: the figure a shared machine's load leaves
    compile_seconds: float = 0.0  # wall seconds in XLA compilation or persistent-cache loads (JAX's compile log)
    cache_hits: int = 0  # programs loaded from the rehearsal's persistent compilation cache instead of compiled

    def line(self) -> str:
        status = {True: "PASS", False: "FAIL", None: "SKIP"}[self.passed]
        return (f"{self.name:<12} {status}  {self.seconds:7.1f} s  cpu {self.cpu_seconds:7.1f} s  "
                f"compile {self.compile_seconds:6.1f} s ({self.cache_hits} cached)  {self.figure}")


class PhaseError(Exception):
    """A phase's one-line reason for failing."""


class Runner:
    """Runs the phases of one rehearsal under `out` (configs already written by `rehearse.write_configs`)."""

    def __init__(self, out: Path, configs: dict[str, Path], devices: int, repo: Path):
        self.out, self.configs, self.devices, self.repo = out, configs, devices, repo
        self.runs = out / "runs"
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
                    "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
                    # the straight, killed and resumed runs compile the same programs: compile them once
                    "JAX_COMPILATION_CACHE_DIR": str(out / "jax_cache"),
                    # every compile logs its seconds: the phase lines split compile from run time
                    "JAX_LOG_COMPILES": "1"}
        self.env.pop("DGEMMA_RUN__OUTPUT_DIR", None)
        self.local = threading.local()  # the phase this thread runs: .phase (log prefix) and .cpu (its CPU seconds)
        self.live: set[int] = set()  # process groups of the children running now (killed if the rehearsal stops)
        self.lock = threading.Lock()
        self.stopping = False

    def _phase_cpu(self, seconds: float) -> None:
        self.local.cpu = getattr(self.local, "cpu", 0.0) + seconds

    # --- child processes ---------------------------------------------------------------------------------------
    def _cmd(self, name: str, argv: list[str], *, cwd: Path | None = None) -> str:
        """Run `argv` (logged to logs/<name>.log); returns its output; a non-zero exit raises its last line."""
        log = self.logs / f"{name}.log"
        with log.open("a") as f:
            f.write(f"$ {' '.join(argv)}\n")
            f.flush()
            start = f.tell()
            p = self._popen(argv, f, cwd)
            timed_out = threading.Event()  # streamed to the log as it runs; wait4 has no timeout of its own

            def time_out() -> None:
                timed_out.set()
                p.kill()

            timer = threading.Timer(PHASE_TIMEOUT_S, time_out)
            timer.start()
            try:  # wait4: this child's own rusage (and its waited-for children's), not every thread's children
                _, status, usage = os.wait4(p.pid, 0)
            finally:
                timer.cancel()
            self._reaped(p)
            p.returncode = os.waitstatus_to_exitcode(status)
            self._phase_cpu(usage.ru_utime + usage.ru_stime)
        if timed_out.is_set():
            raise PhaseError(f"timed out after {PHASE_TIMEOUT_S} s (log {log})")
        with log.open() as f:
            f.seek(start)
            output = f.read()
        if p.returncode != 0:
            if p.returncode in (137, -signal.SIGKILL):  # the wrapper's last lines say only that its child died
                raise PhaseError(f"exit {p.returncode}: killed by SIGKILL (out of memory?) (log {log})")
            tail = [ln for ln in output.splitlines() if ln.strip()]
            raise PhaseError(f"exit {p.returncode}: {tail[-1][:300] if tail else 'no output'} (log {log})")
        return output

    def _popen(self, argv: list[str], log, cwd: Path | None = None) -> subprocess.Popen:
        """Start `argv` in a process group of its own (a `dgemma launch` is three processes deep), output to `log`."""
        with self.lock:
            if self.stopping:
                raise PhaseError("the rehearsal is stopping")
            p = subprocess.Popen(argv, cwd=cwd or self.repo, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            self.live.add(p.pid)
        return p

    def _reaped(self, p: subprocess.Popen) -> None:
        with self.lock:
            self.live.discard(p.pid)

    def kill_live(self) -> None:
        """SIGKILL every child process group still running (the rehearsal is stopping)."""
        with self.lock:
            self.stopping = True
            for pgid in self.live:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def log_sizes(self) -> dict[Path, int]:
        return {f: f.stat().st_size for f in self.logs.glob("*.log")}

    def compiles_since(self, sizes: dict[Path, int], prefix: str = "") -> tuple[float, int]:
        """(seconds of XLA compilation, a persistent-cache load included; persistent-cache hits) logged since
        `sizes` (`log_sizes`), in the logs whose names start with `prefix` (a phase's own)."""
        total, hits = 0.0, 0
        for f in self.logs.glob(f"{prefix}*.log"):
            with f.open(errors="replace") as fh:
                fh.seek(sizes.get(f, 0))
                text = fh.read()
            total += sum(float(m) for m in COMPILE_LOG.findall(text))
            hits += text.count(CACHE_HIT_LOG)
        return total, hits

    def _launch_argv(self, stage: str, run_name: str, extra: list[str]) -> list[str]:
        return [sys.executable, "-m", "dgemma", "launch", "--target", "local", "--profile", "local_cpu",
                str(self.configs[stage]), f"launch.devices_per_node={self.devices}", f"run.name={run_name}",
                f"run.output_dir={self.runs}", *extra]

    def _check(self, *args: str) -> str:
        out = self._cmd(f"{getattr(self.local, 'phase', '')}_checks",
                        [sys.executable, "-m", "dgemma.planning.rehearse_check", *args])
        line = [ln for ln in out.splitlines() if ln.startswith(("OK ", "FAIL "))][-1]
        return line[3:]

    def _last_metric(self, run: str, key: str) -> float:
        rows = [json.loads(ln) for ln in (self.runs / run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        rows = [r for r in rows if key in r]
        if not rows:
            raise PhaseError(f"{self.runs / run / 'metrics.jsonl'} has no {key!r}")
        return rows[-1][key]

    # --- phases ------------------------------------------------------------------------------------------------
    def stage1(self) -> str:
        self._cmd("stage1", self._launch_argv("stage1", "straight", ["trainer.steps=2"]))
        loss = self._last_metric("straight", "loss")
        return f"2 steps, loss {loss:.4f} at step 2, params {self.runs / 'straight' / 'params'}"

    def kill_resume(self) -> str:
        argv = self._launch_argv("stage1", "resumed", ["trainer.steps=2"])
        log = self.logs / "kill_resume.log"
        committed = self.runs / "resumed" / "checkpoints" / "1"
        with log.open("a") as f:
            f.write(f"$ {' '.join(argv)}  (SIGKILLed once {committed} exists)\n")
            f.flush()
            p = self._popen(argv, f)  # its own process group: the kill reaches the trainer
            t0 = time.time()
            while p.poll() is None and not committed.is_dir() and time.time() - t0 < PHASE_TIMEOUT_S:
                time.sleep(0.05)
            if p.poll() is not None:
                raise PhaseError(f"the run ended (exit {p.returncode}) before it could be killed after step 1 "
                                 f"(log {log})")
            self._phase_cpu(_group_cpu_seconds(p.pid))  # the killed processes' rusage never reaches wait4
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            self._reaped(p)
        if (self.runs / "resumed" / "params").exists():
            raise PhaseError("the killed run had already written its final params")
        kept = sorted(int(c.name) for c in committed.parent.iterdir() if c.name.isdigit())
        self._cmd("kill_resume", argv)
        if not (self.runs / "straight" / "params").is_dir():
            raise PhaseError("no straight run to compare with (the stage1 phase did not run)")
        same = self._check("params-equal", str(self.devices), str(self.runs / "straight" / "params"),
                           str(self.runs / "resumed" / "params"))
        return f"SIGKILL with checkpoints {kept} committed, resumed to step 2: {same}"

    def sdrl(self) -> str:
        if "stage2" not in self.configs:
            raise PhaseError("no stage-2 config next to the stage-1 one (configs/stage2/<same name>)")
        init = self.runs / "resumed" / "params"
        self._cmd("sdrl", self._launch_argv("stage2", "sdrl", ["trainer.steps=1", f"checkpoint.init_from={init}"]))
        reward = self._last_metric("sdrl", "loss")
        return f"1 iteration from {init.relative_to(self.out)}, loss {reward:.4f}"

    def _sdrl_params(self) -> tuple[Path, Path]:
        params = self.runs / "sdrl" / "params"
        if not params.is_dir():
            raise PhaseError("no SD·RL params (the sdrl phase failed)")
        return self.configs["stage2"], params

    def sample(self) -> str:
        config, params = self._sdrl_params()
        out = self._cmd("sample", [sys.executable, "-m", "dgemma", "sample", "-c", str(config), "--checkpoint",
                                   str(params), "--prompt", "C1234|", "--prompt", "S93|", "--mode", "diffusion",
                                   f"run.output_dir={self.runs}"])
        lines = [ln for ln in out.splitlines() if ln.strip()]
        return f"2 prompts decoded; {lines[-1][:120] if lines else ''}"

    def eval(self) -> str:
        config, params = self._sdrl_params()
        out = self._cmd("eval", [sys.executable, "-m", "dgemma", "eval", "-c", str(config), "--checkpoint",
                                 str(params), "--modes", "diffusion", "--batches", "1", "--batch-size",
                                 str(self.devices), "--plot-dir", str(self.out / "eval"), f"run.output_dir={self.runs}"])
        lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
        em = [ln.split()[-1] for ln in lines if ln.startswith("all ")]  # the exact-match table's total row
        speed = [ln for ln in lines if ln.startswith("diffusion: tokens/forward")]
        if not em:
            raise PhaseError(f"no exact-match table in the output (log {self.logs / 'eval.log'})")
        return f"exact match {em[-1]} (untrained widths); {speed[-1] if speed else ''}"

    def _export(self, name: str, extra: list[str]) -> str:
        config, params = self._sdrl_params()
        dest = self.out / "export" / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        self._cmd(f"export_{name}", [sys.executable, "-m", "dgemma", "export", "-c", str(config), "--checkpoint",
                                     str(params), "--out", str(dest), *extra])
        line = self._check("export-logits", str(dest), str(self.out / "export"), str(config), str(params))
        return line

    def export_bf16(self) -> str:
        return self._export("bf16", [])

    def export_fp8(self) -> str:
        dest = self.out / "export" / "fp8"
        line = self._export("fp8", ["--fp8"])
        block = json.loads((dest / "config.json").read_text())["quantization_config"]["weight_block_size"]
        return f"block {block[0]}x{block[1]} (automatic); {line}"


NEEDS = {"kill_resume": ("stage1",), "sdrl": ("kill_resume",), "sample": ("sdrl",), "eval": ("sdrl",),
         "export_bf16": ("sdrl",), "export_fp8": ("sdrl",)}
"""What each phase needs to have passed before it starts. kill_resume could run beside stage1 (only its last check
reads stage1's params), but on 2 cores that took as long (318 s against 323 s in turn, idle VM) for 128 more CPU
seconds: both compiled the same programs, where in turn the second reads them from the compilation cache."""


def _group_cpu_seconds(pgid: int) -> float:
    """user + sys so far of the live processes of process group `pgid` and of their waited-for children (Linux
    /proc; 0 elsewhere)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the name: state ppid pgrp ...; utime stime cutime cstime at 11-14
            total += sum(int(f) for f in fields[11:15])
    return total / os.sysconf("SC_CLK_TCK")


def _run_one(runner: Runner, name: str, skipped_for: list[str]) -> PhaseResult:
    """Run phase `name` in this thread (or skip it: `skipped_for` lists the failed phases it needs)."""
    runner.local.phase, runner.local.cpu = name, 0.0
    t0, sizes = time.time(), runner.log_sizes()
    if skipped_for:
        return PhaseResult(name, None, 0.0, f"skipped: needs {', '.join(skipped_for)}")
    try:
        r = PhaseResult(name, True, 0.0, getattr(runner, name)())
    except (PhaseError, OSError, ValueError, KeyError) as e:
        r = PhaseResult(name, False, 0.0, str(e).splitlines()[0] if str(e) else type(e).__name__)
    compile_s, hits = runner.compiles_since(sizes, prefix=name)
    return dataclasses.replace(r, seconds=time.time() - t0, cpu_seconds=runner.local.cpu, compile_seconds=compile_s,
                               cache_hits=hits)


def run_phases(out: Path, configs: dict[str, Path], devices: int, repo: Path,
               emit: Callable[[str], None] = print, phases: tuple[str, ...] = PHASES,
               jobs: int = 2) -> list[PhaseResult]:
    """Run `phases`, each once the phases it needs (`NEEDS`, among `phases`) have ended, at most `jobs` at a time,
    emitting one line per phase as it ends; a phase whose prerequisite failed is skipped. Returns the results in
    `phases` order."""
    if jobs < 1:
        raise ValueError(f"jobs {jobs}: must be >= 1")
    runner = Runner(out, configs, devices, repo)
    results: dict[str, PhaseResult] = {}
    pending: list[str] = list(phases)
    running: dict[Future, str] = {}
    with ThreadPoolExecutor(jobs) as pool:
        try:
            _schedule(runner, phases, jobs, pool, pending, running, results, emit)
        except BaseException:  # SIGTERM (the CLI raises SystemExit) or Ctrl-C: leave no trainer running on its own
            runner.kill_live()
            raise
    return [results[n] for n in phases]


def _schedule(runner, phases, jobs, pool, pending, running, results, emit) -> None:
    while pending or running:
        for name in list(pending):
            needs = [n for n in NEEDS.get(name, ()) if n in phases]
            if len(running) < jobs and all(n in results for n in needs):
                pending.remove(name)
                failed = [n for n in needs if not results[n].passed]
                running[pool.submit(_run_one, runner, name, failed)] = name
        if not running:  # nothing can start: a phase needs one that is not in `phases` order before it
            raise ValueError(f"phases {pending}: what they need never runs")
        done, _ = wait(running, return_when=FIRST_COMPLETED)
        for f in sorted(done, key=lambda f: phases.index(running[f])):
            r = f.result()
            results[running.pop(f)] = r
            emit(r.line())


def exit_on_sigterm() -> None:
    """SIGTERM (`kill`, `timeout`) raises SystemExit(143) in the main thread, so `run_phases` SIGKILLs the children it
    is running before it exits: each phase's children are a process group of their own and would run on unowned."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

"""Config sections of `RunConfig` (except `model`, see schema.py). Each is a frozen, kw-only, self-validating dataclass;
`diffusion` and `sampler` are derived from the dataclasses the code uses (`dgemma.config.derived.section_of`).

Conventions: every field has a `help` (shown by `dgemma plan --schema`); validators raise
`ValueError("<Section>.<field>: ...")`; `0` means "off" for cadence fields (`eval_every`, `checkpoint.every`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from dgemma.config.derived import DerivedSection, section_of
from dgemma.config.types import FrozenDict, Section
from dgemma.diffusion.stage1_config import Stage1Config
from dgemma.inference.sampler_types import SamplerConfig

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "expert", "tensor")
RulesPreset = Literal["fsdp", "fsdp_tp", "experts_on_fsdp", "ep"]


def help_field(default: Any, help: str) -> Any:  # noqa: A002 - "help" mirrors argparse
    """A dataclass field with a description; a dataclass type as default becomes its default factory."""
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=default, metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSection(Section):
    """Identity of a run. Outputs go to `run_dir = output_dir / name`."""

    name: str = help_field("dgemma", "run name; also the run directory name under output_dir")
    output_dir: str = help_field("runs", "parent directory of run directories")
    seed: int = help_field(0, "global seed (params init, noise, sampling)")

    def validate(self) -> None:
        if not self.name or "/" in self.name or self.name in (".", ".."):
            self._fail("name", f"{self.name!r} must be a non-empty single path component")

    @property
    def run_dir(self) -> Path:
        """`output_dir / name`."""
        return Path(self.output_dir) / self.name


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshSection(Section):
    """Named device mesh: per-axis ICI (within a slice/node) and DCN (across slices/nodes) sizes.

    A size of -1 means "all remaining devices" (at most one -1 in `ici` and one in `dcn`); axes missing from `ici` /
    `dcn` get size 1. The rule preset maps logical names to mesh axes (implemented in `dgemma.parallel`).
    """

    axes: tuple[str, ...] = help_field(MESH_AXES, "mesh axis names, outermost first")
    ici: dict[str, int] = help_field(FrozenDict(data=1, fsdp=-1, expert=1, tensor=1),
                                     "axis -> size within a slice/node (-1: auto)")
    dcn: dict[str, int] = help_field(FrozenDict(data=1, fsdp=1, expert=1, tensor=1),
                                     "axis -> size across slices/nodes (-1: auto)")
    rules: RulesPreset = help_field("fsdp", "logical-axis rule preset: fsdp | fsdp_tp | experts_on_fsdp | ep")

    def validate(self) -> None:
        if not self.axes or len(set(self.axes)) != len(self.axes):
            self._fail("axes", f"{self.axes!r} must be non-empty and unique")
        for name in ("ici", "dcn"):
            sizes = getattr(self, name)
            for axis, size in sizes.items():
                if axis not in self.axes:
                    close = difflib.get_close_matches(axis, self.axes, n=1)
                    hint = f"did you mean {close[0]!r}?" if close else f"mesh axes are {list(self.axes)}"
                    self._fail(f"{name}.{axis}", f"unknown mesh axis ({hint})")
                if size != -1 and size < 1:
                    self._fail(f"{name}.{axis}", f"size {size} must be >= 1, or -1 for auto")
            if sum(1 for s in sizes.values() if s == -1) > 1:
                self._fail(name, f"at most one axis may be -1 (auto), got {dict(sizes)}")
            object.__setattr__(self, name, FrozenDict({a: sizes.get(a, 1) for a in self.axes}))

    def axis_size(self, *names: str) -> int | None:
        """Total size (ici x dcn) of the given axes, or None if any of them is auto (-1)."""
        sizes = [self.ici[n] for n in names] + [self.dcn[n] for n in names]
        return None if -1 in sizes else math.prod(sizes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerSection(Section):
    """Training-loop cadence. Checkpoint cadence lives in `checkpoint` (one source of truth)."""

    objective: Literal["stage1", "ar", "sdrl"] = help_field(
        "stage1", "stage1: block-diffusion CE + lambda_ar x AR CE (dgemma.diffusion.stage1) | ar: next-token CE only "
        "| sdrl: stage 2 (dgemma.train.sdrl, settings in `sdrl`); registry: dgemma.train.objectives")
    steps: int = help_field(1000, "trainer steps: optimizer steps (ar, stage1) or iterations (sdrl)")
    log_every: int = help_field(10, "log train metrics every N steps")
    eval_every: int = help_field(0, "evaluate every N steps (0: never) on held-out rows: drawn for a synthetic task "
                                    "mix, data.eval_paths for a file source")
    eval_batches: int = help_field(1, "batches per evaluation")
    grad_accum_steps: int = help_field(1, "micro-batches accumulated per optimizer step (0: derived, one example per "
                                          "batch-sharding device per micro-batch: global batch / (data x fsdp))")

    def validate(self) -> None:
        for name, low in (("steps", 1), ("log_every", 1), ("eval_every", 0), ("eval_batches", 1),
                          ("grad_accum_steps", 0)):
            if getattr(self, name) < low:
                self._fail(name, f"{getattr(self, name)} must be >= {low}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimSection(Section):
    """Optimizer, learning-rate schedule (linear warmup, then cosine to lr*min_lr_ratio or constant), freezing."""

    name: Literal["adamw", "adafactor"] = help_field("adamw", "optimizer")
    lr: float = help_field(1e-4, "peak learning rate")
    b1: float = help_field(0.9, "Adam beta1")
    b2: float = help_field(0.999, "Adam beta2")
    eps: float = help_field(1e-8, "Adam epsilon")
    weight_decay: float = help_field(0.0, "decoupled weight decay")
    clip_norm: float | None = help_field(1.0, "global-norm gradient clipping (null: off)")
    warmup_steps: int = help_field(0, "linear warmup, in optimizer updates; at most the run's updates (trainer.steps; "
                                   "x sdrl.inner_epochs x sdrl.num_minibatches for sdrl), else the run is refused")
    schedule: Literal["cosine", "constant"] = help_field("cosine", "schedule after warmup")
    min_lr_ratio: float = help_field(0.1, "final lr / peak lr for the cosine schedule")
    freeze: tuple[str, ...] = help_field((), "regexes (re.search) over '/'-joined param paths to keep frozen")

    def validate(self) -> None:
        if self.lr <= 0:
            self._fail("lr", f"{self.lr} must be > 0")
        for name in ("b1", "b2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                self._fail(name, f"{getattr(self, name)} must be in [0, 1)")
        if self.eps <= 0:
            self._fail("eps", f"{self.eps} must be > 0")
        if self.weight_decay < 0:
            self._fail("weight_decay", f"{self.weight_decay} must be >= 0")
        if self.clip_norm is not None and self.clip_norm <= 0:
            self._fail("clip_norm", f"{self.clip_norm} must be > 0, or null to disable clipping")
        if self.warmup_steps < 0:
            self._fail("warmup_steps", f"{self.warmup_steps} must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            self._fail("min_lr_ratio", f"{self.min_lr_ratio} must be in [0, 1]")
        for i, pattern in enumerate(self.freeze):
            try:
                re.compile(pattern)
            except re.error as e:
                self._fail(f"freeze[{i}]", f"invalid regex {pattern!r}: {e}")


def warmup_refusal(warmup_steps: int, updates: int) -> str | None:
    """The one-line refusal of an `optim.warmup_steps` longer than the run's `updates` optimizer updates (the run
    would never reach optim.lr), else None. Used by `dgemma.train.optim.build_optimizer` at the start of a run and by
    `dgemma plan` / `dgemma launch` before a job is queued."""
    if warmup_steps <= updates:
        return None
    return (f"optim.warmup_steps={warmup_steps} exceeds the {updates} optimizer updates of this run; the learning rate "
            f"would never reach optim.lr: lower optim.warmup_steps to at most {updates} (e.g. optim.warmup_steps=0 "
            f"for a smoke run)")


# Sections derived from the dataclasses the code uses: their names, types, defaults and validator are the code's.
SAMPLER_RUNTIME_FIELDS = ("eos_ids", "pad_id")
"""`SamplerConfig` fields that come from the tokenizer at run time, not from a config file."""

if TYPE_CHECKING:  # the type checker's view of the generated classes: the target's fields, `build()` its type
    class DiffusionSection(Stage1Config, DerivedSection):
        def build(self, **runtime: Any) -> Stage1Config: ...

    class SamplerSection(SamplerConfig, DerivedSection):  # (it has no eos_ids / pad_id: SAMPLER_RUNTIME_FIELDS)
        def build(self, **runtime: Any) -> SamplerConfig: ...
else:
    DiffusionSection = section_of(Stage1Config, name="DiffusionSection")
    SamplerSection = section_of(SamplerConfig, exclude=SAMPLER_RUNTIME_FIELDS, name="SamplerSection")
"""`diffusion`: the stage-1 objective, `dgemma.diffusion.stage1_config.Stage1Config` (`cfg.diffusion.build()`)."""

"""`sampler`: `dgemma.inference.sampler_types.SamplerConfig` minus the run-time fields; the code builds its sampler
configs with `SamplerConfig.from_section(cfg.sampler, ..., eos_ids=..., pad_id=...)`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoggingSection(Section):
    """Metric sinks (process 0 only)."""

    jsonl: bool = help_field(True, "write metrics.jsonl in the run dir")
    wandb: bool = help_field(False, "log to Weights & Biases")
    wandb_project: str = help_field("dgemma", "wandb project")
    wandb_entity: str | None = help_field(None, "wandb entity (null: default)")
    wandb_mode: Literal["online", "offline", "disabled"] = help_field("online", "wandb mode")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointSection(Section):
    """Checkpoint directory, cadence (step and/or time based), retention, initialisation and resume."""

    dir: str | None = help_field(None, "checkpoint directory (null: <run_dir>/checkpoints); it belongs to the "
                                     "run.name that wrote it: another run.name is refused there")
    every: int = help_field(1000, "save every N steps (0: only at the end)")
    every_seconds: int = help_field(0, "also save every N seconds of wall time (0: off)")
    keep: int = help_field(3, "checkpoints to keep")
    async_save: bool = help_field(True, "save asynchronously")
    init_from: str | None = help_field(None, "params checkpoint to initialise from (`dgemma convert` makes one from a "
                                             "HF dir; null: random)")
    resume: bool = help_field(True, "resume from the latest checkpoint in `dir` if one exists")

    def validate(self) -> None:
        for name, low in (("every", 0), ("every_seconds", 0), ("keep", 1)):
            if getattr(self, name) < low:
                self._fail(name, f"{getattr(self, name)} must be >= {low}")

    def directory(self, run: RunSection) -> Path:
        """The checkpoint directory: `dir`, or `<run_dir>/checkpoints`."""
        return Path(self.dir) if self.dir is not None else run.run_dir / "checkpoints"

"""`RunConfig`: the top-level, frozen config of a dgemma run, one dataclass per section.

    run        name, output_dir, seed                       -> run_dir = output_dir/name
    model      preset + optional ModelConfig overrides       -> .build() -> dgemma.model.config.ModelConfig
               + model.execution (ExecutionConfig: kernels, scan, remat, dtypes)
    mesh       axes, ici/dcn sizes (-1 = auto), rule preset
    trainer    steps, logging / eval cadence, grad accumulation
    optim      adamw | adafactor, lr schedule, clipping, frozen-parameter regexes
    diffusion  stage-1 objective (t range, alignment, weighting, ...): derived from `Stage1Config`
    sampler    sampler settings: derived from `SamplerConfig` (defaults: HF generation_config values)
    data       `dgemma.data.config.DataConfig` (sources, tokenizer, training layout, batching)
    logging    jsonl / wandb
    checkpoint directory, cadence, retention, init/resume
    sdrl       stage-2 SD·RL settings (`dgemma.config.sdrl_section.SDRLConfig`)

Section classes live in `sections.py`; this module adds the model section and the cross-field validators, which raise
errors naming every field involved (e.g. `data.layout.canvas_length=256 disagrees with model.canvas_length=8`).
The model owns the canvas length; the data layout's is derived from it.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import TYPE_CHECKING, Any, Optional

from dgemma.config import sections
from dgemma.config.derived import DerivedSection, section_of
from dgemma.config.sections import help_field
from dgemma.config.types import Section
from dgemma.data.config import DataConfig
from dgemma.model import config as model_config
from dgemma.model.config import EXECUTION_FIELDS, ExecutionConfig, ModelConfig
from dgemma.config.sdrl_section import SDRLConfig
from dgemma.config.lora_section import LoraSection

__all__ = ["ModelSection", "RunConfig", "SECTION_NAMES"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _ModelSectionBase(Section):
    """Model preset; the generated `ModelSection` subclass adds every architecture field of `ModelConfig` as an
    optional override and `execution` (the `ExecutionConfig` section)."""

    preset: str = help_field("tiny", "name of a preset in dgemma.model.config.PRESETS")
    if TYPE_CHECKING:
        execution: ExecutionSection  # added by the generated subclass

    def overrides(self) -> dict[str, Any]:
        """The architecture fields of `ModelConfig` set explicitly in this section (non-None)."""
        return {name: getattr(self, name) for name in _MODEL_FIELDS if getattr(self, name) is not None}

    def build(self) -> ModelConfig:
        """`dgemma.model.config.preset(self.preset, **self.overrides(), execution=self.execution.build())`, built once
        and cached."""
        built = self.__dict__.get("_built")
        if built is None:
            built = model_config.preset(self.preset, **self.overrides(), execution=self.execution.build())
            object.__setattr__(self, "_built", built)
        return built

    def validate(self) -> None:
        if self.preset not in model_config.PRESETS:
            self._fail("preset", f"unknown preset {self.preset!r}; available: {sorted(model_config.PRESETS)}")
        try:
            self.build()  # runs ModelConfig's own validation ("ModelConfig.<field>: ...")
        except ValueError as e:
            msg = str(e)
            msg = msg[len("ModelConfig."):] if msg.startswith("ModelConfig.") else msg
            raise ValueError(f"{type(self).__name__}.{msg} (preset {self.preset!r} + overrides {self.overrides()})")


_MODEL_FIELDS = [f.name for f in dataclasses.fields(ModelConfig) if f.init and f.name != "execution"]
if TYPE_CHECKING:  # the type checker's view of the generated class
    class ExecutionSection(ExecutionConfig, DerivedSection):
        def build(self, **runtime: Any) -> ExecutionConfig: ...
else:
    ExecutionSection = section_of(ExecutionConfig)


def _make_model_section() -> type:
    hints = typing.get_type_hints(ModelConfig)
    fields = [
        (name, Optional[hints[name]],  # noqa: UP007 - a runtime type expression
         help_field(None, f"override ModelConfig.{name} (None: keep the preset's value)"))
        for name in _MODEL_FIELDS
    ] + [("execution", ExecutionSection, help_field(
        ExecutionSection, "how the model runs: attention / MoE kernels, layer scan, remat, dtypes "
                          "(dgemma.model.config.ExecutionConfig)"))]
    cls = dataclasses.make_dataclass(
        "ModelSection", fields, bases=(_ModelSectionBase,), frozen=True, kw_only=True,
        namespace={"__module__": __name__, "__moved_keys__": {f: f"execution.{f}" for f in EXECUTION_FIELDS},
                   "__doc__": (
            "Model section: `preset` plus every architecture field of `ModelConfig` as an optional override and "
            "`execution` (generated from `ModelConfig` / `ExecutionConfig`, so it never drifts). `build()` returns "
            "the `ModelConfig`.")},
    )
    return cls


if TYPE_CHECKING:  # the type checker's view of the generated class
    class ModelSection(_ModelSectionBase):
        def __getattr__(self, name: str) -> Any: ...  # the architecture overrides: `ModelConfig`'s fields, optional
else:
    ModelSection = _make_model_section()


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig(Section):
    """Everything one dgemma run needs, frozen; one field per section. Build it with
    `dgemma.config.load_config(path, overrides)`."""

    run: sections.RunSection = help_field(sections.RunSection, "run identity: name, output_dir, seed")
    model: ModelSection = help_field(ModelSection, "model preset and overrides")
    mesh: sections.MeshSection = help_field(sections.MeshSection, "device mesh and sharding-rule preset")
    trainer: sections.TrainerSection = help_field(sections.TrainerSection, "training loop")
    optim: sections.OptimSection = help_field(sections.OptimSection, "optimizer and schedule")
    diffusion: sections.DiffusionSection = help_field(
        sections.DiffusionSection, "stage-1 objective (dgemma.diffusion.stage1_config.Stage1Config)")
    sampler: sections.SamplerSection = help_field(
        sections.SamplerSection, "sampler (dgemma.inference.sampler_types.SamplerConfig)")
    data: DataConfig = help_field(DataConfig, "data source, tokenizer, training layout, batching (dgemma.data)")
    logging: sections.LoggingSection = help_field(sections.LoggingSection, "metrics logging")
    checkpoint: sections.CheckpointSection = help_field(sections.CheckpointSection, "checkpoints")
    sdrl: SDRLConfig = help_field(SDRLConfig, "stage 2 (SD·RL) objective, teacher and its sampler, K_max "
                                              "curriculum (dgemma.train.sdrl; read when trainer.objective=sdrl)")
    lora: LoraSection = help_field(LoraSection, "low-rank adapters (rank 0: off); the base weights stay frozen "
                                                "(dgemma.model.lora)")

    def validate(self) -> None:
        model = self.model.build()
        self._inherit_from_model(model)
        errors = self._cross_field_errors(model)
        if errors:
            raise ValueError("; ".join(errors))

    def _inherit_from_model(self, model: ModelConfig) -> None:
        """The model owns the canvas length: `data.layout.canvas_length` unset (null) takes it, any other value must
        agree (an explicit disagreement is an error naming both fields, never silently overwritten)."""
        layout = self.data.layout
        if layout.canvas_length is None:
            object.__setattr__(self, "data", dataclasses.replace(
                self.data, layout=dataclasses.replace(layout, canvas_length=model.canvas_length)))
        elif layout.canvas_length != model.canvas_length:
            raise ValueError(
                f"data.layout.canvas_length={layout.canvas_length} disagrees with model.canvas_length="
                f"{model.canvas_length} (preset {self.model.preset!r}"
                f"{' + overrides' if self.model.canvas_length is not None else ''}); the model owns the canvas length: "
                f"leave data.layout.canvas_length unset (null) or set it to the same value")

    def _cross_field_errors(self, model: ModelConfig) -> list[str]:
        errors: list[str] = []
        mesh = self.mesh
        expert = mesh.axis_size("expert")
        if expert is not None and model.num_experts % expert:
            errors.append(f"model.num_experts={model.num_experts} is not divisible by the mesh expert axis size "
                          f"{expert} (mesh.ici.expert x mesh.dcn.expert)")
        fsdp = mesh.axis_size("fsdp")
        if mesh.rules == "experts_on_fsdp" and fsdp is not None and model.num_experts % fsdp:
            errors.append(f"model.num_experts={model.num_experts} is not divisible by the fsdp axis size {fsdp}, "
                          f"which mesh.rules='experts_on_fsdp' shards experts over")
        # Batch divisibility by the processes and the mesh is checked at run time, when they are known
        # (data.batch_size is the global batch; trainer.grad_accum_steps=0 derives the accumulation from the mesh).
        if self.trainer.grad_accum_steps and self.data.batch_size % self.trainer.grad_accum_steps:
            errors.append(f"data.batch_size={self.data.batch_size} is not divisible by "
                          f"trainer.grad_accum_steps={self.trainer.grad_accum_steps}")
        layout = self.data.layout
        seq = layout.prompt_len + layout.n_blocks * model.canvas_length
        if seq > model.max_position_embeddings:
            errors.append(f"data.layout.prompt_len + data.layout.n_blocks x model.canvas_length = {seq} exceeds "
                          f"model.max_position_embeddings={model.max_position_embeddings}")
        tiling = self._chunk_tiling_error(model)
        if tiling:
            errors.append(tiling)
        if self.data.tokenizer.kind == "toy" and model.vocab_size < 32:
            errors.append(f"model.vocab_size={model.vocab_size} is smaller than the toy tokenizer's 32 ids")
        return errors

    def _chunk_tiling_error(self, model: ModelConfig) -> str | None:
        """`model.execution.attention_impl=chunked` tiles the training sequence by `attention_q_chunk` /
        `attention_kv_chunk` without padding, so a sequence longer than a chunk must be a multiple of it
        (`dgemma.model.attention_chunked.check_chunking`, which the first train step would raise). Checked here for the
        objectives whose training sequence the config fixes: stage1 (the one-pass [clean ; noisy] stream, P + 2R) and ar
        (P + R)."""
        objective = self.trainer.objective
        if model.execution.attention_impl != "chunked" or objective not in ("stage1", "ar"):
            return None
        layout, L = self.data.layout, model.canvas_length
        copies = 2 if objective == "stage1" else 1
        length = lambda l: layout.prompt_len + copies * layout.n_blocks * l  # noqa: E731
        T = length(L)
        for name in ("attention_q_chunk", "attention_kv_chunk"):
            c = getattr(model.execution, name)
            if T > c and T % c:
                valid = [l for l in range(1, 4097) if length(l) <= c or length(l) % c == 0][:6]
                stream = "one-pass [clean ; noisy] stream" if objective == "stage1" else "training sequence"
                return (f"model.canvas_length={L}: the {stream} of data.layout.prompt_len + {copies} x "
                        f"data.layout.n_blocks x model.canvas_length = {layout.prompt_len} + {copies} x "
                        f"{layout.n_blocks} x {L} = {T} tokens is longer than model.execution.{name}={c} and not "
                        f"a multiple of it, and model.execution.attention_impl=chunked tiles it without padding; with "
                        f"this layout canvas_length may be {', '.join(map(str, valid)) or 'none up to 4096'}"
                        f"{', ...' if len(valid) == 6 else ''} (or change prompt_len, n_blocks or the chunk)")
        return None

    def with_overrides(self, *tokens: str, **dotted: Any) -> RunConfig:
        """Re-validated copy with overrides: `cfg.with_overrides("trainer.steps=3")` or
        `cfg.with_overrides(**{"optim.lr": 1e-3})` (the notebook way to make a variant)."""
        from dgemma.config.loader import parse_overrides, with_overrides

        return with_overrides(self, {**parse_overrides(list(tokens)), **dotted})

    @property
    def model_config(self) -> ModelConfig:
        """Shorthand for `self.model.build()`."""
        return self.model.build()


SECTION_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RunConfig))
"""The sections of `RunConfig`, in order. Registering a section is one field of `RunConfig`: a `Section` subclass,
or `section_of(SomeConfig)` for a frozen dataclass the code uses (`dgemma.config.derived`; docs/architecture.md §4)."""

"""Sampler configuration and result types (the public data of `dgemma.inference.sampler`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:  # not at run time: the config system imports this module and must not import jax
    from dgemma.model.cache import KVCache

Mode = Literal["diffusion", "ar", "auto"]
MODES = ("diffusion", "ar", "auto")
STOP_REASONS = ("converged", "max_steps", "eos_finished", "ar_fallback")
CONVERGED, MAX_STEPS, EOS_FINISHED, AR_FALLBACK = range(4)

# Fields that are runtime scalars of the compiled block (changing them does not recompile).
_DYNAMIC_FIELDS = ("entropy_bound", "t_max", "t_min", "confidence_threshold", "accept_confidence",
                   "ancestral_temperature", "ar_temperature", "auto_entropy_threshold")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplerConfig:
    """Sampler hyperparameters. Defaults are DiffusionGemma's generation_config (docs/sampler.md).

    Attributes:
      mode: default mode of `sample` ("diffusion" | "ar" | "auto").
      algorithm: "eb" (entropy-bounded accept + renoise, HF) or "ancestral" (exact, fixed max_steps steps).
      max_new_tokens: token budget, rounded UP to whole canvases (as HF does).
      max_steps: K_max, max decoder forwards per block (and the temperature schedule's denominator).
      t_max, t_min: temperature schedule endpoints (τ = t_max at the first step, t_min + (t_max−t_min)/K_max at the
        last).
      accept: EB variant: "entropy_bound" (HF), "confidence" (p(chosen) ≥ accept_confidence), "fixed_count"
        (ceil(L/K_max) lowest-entropy tokens per step).
      entropy_bound: γ of the EB accept rule.
      accept_confidence: the p(chosen) threshold of accept="confidence".
      stability_threshold: S, argmax must equal each of the last S argmaxes (0 disables the stability part).
      confidence_threshold: c, stop needs mean tempered entropy < c (strict); 0 disables stopping.
      greedy: use the argmax instead of a sample for the proposal (EB: "greedy accept"; ancestral: x̂0 = argmax).
      sampling: how the EB proposal x̂ ~ softmax(z) is drawn: "inverse_cdf" (one uniform per position; fastest on
        CPU) or "gumbel" (`jax.random.categorical`). Both exact; different random bits.
      ancestral_temperature: τ of the ancestral sampler's x̂0 draw (1.0 = exact).
      ar_temperature: temperature of AR decoding (0 = greedy).
      auto_entropy_threshold: in "auto", fall back only if the block's last mean entropy exceeds this (0: always
        when the stop rule was not met).
      eos_ids, pad_id: default to the model config's.
      wait_for_finished_rows: HF's loop-exit semantics (see module docstring); output-neutral.
      record_drafts: also return the argmax canvas after every step ([n_blocks, K, B, L], K = max_steps).
      record_states: also return a `RolloutRecord` of every visited state (decoder inputs, τ, accept set,
        argmax, ...; `dgemma.inference.rollout`), for SD·RL replay. EB diffusion only.
    """

    # what runs, how long, and the temperature schedule
    mode: Mode = "diffusion"
    algorithm: Literal["eb", "ancestral"] = "eb"
    max_new_tokens: int = 256
    max_steps: int = 48
    t_max: float = 0.8
    t_min: float = 0.4
    # the EB per-step rule: accept, then stop
    accept: Literal["entropy_bound", "confidence", "fixed_count"] = "entropy_bound"
    entropy_bound: float = 0.1
    accept_confidence: float = 0.9
    stability_threshold: int = 1
    confidence_threshold: float = 0.005
    # draws, other temperatures, the auto fallback
    sampling: Literal["inverse_cdf", "gumbel"] = "inverse_cdf"
    greedy: bool = False
    ancestral_temperature: float = 1.0
    ar_temperature: float = 0.0
    auto_entropy_threshold: float = 0.0
    # ids and recording
    eos_ids: tuple[int, ...] | None = None
    pad_id: int | None = None
    wait_for_finished_rows: bool = False
    record_drafts: bool = False
    record_states: bool = False

    def __post_init__(self):
        if self.eos_ids is not None:
            ids = (self.eos_ids,) if isinstance(self.eos_ids, int) else tuple(int(i) for i in self.eos_ids)
            object.__setattr__(self, "eos_ids", ids)
        self.validate()

    def validate(self) -> None:
        def fail(field, msg):
            raise ValueError(f"SamplerConfig.{field}: {msg}")

        if self.max_steps < 1:
            fail("max_steps", f"{self.max_steps} must be >= 1")
        if self.entropy_bound < 0:
            fail("entropy_bound", f"{self.entropy_bound} must be >= 0")
        if not 0.0 <= self.t_min <= self.t_max or self.t_max <= 0:
            fail("t_min", f"need 0 <= t_min <= t_max and t_max > 0, got t_min={self.t_min}, t_max={self.t_max}")
        if self.stability_threshold < 0:
            fail("stability_threshold", f"{self.stability_threshold} must be >= 0")
        if self.confidence_threshold < 0:
            fail("confidence_threshold", f"{self.confidence_threshold} must be >= 0")
        if self.max_new_tokens < 1:
            fail("max_new_tokens", f"{self.max_new_tokens} must be >= 1")
        if self.mode not in MODES:
            fail("mode", f"{self.mode!r} is not one of {MODES}")
        if self.algorithm not in ("eb", "ancestral"):
            fail("algorithm", f"{self.algorithm!r} is not 'eb' or 'ancestral'")
        if self.accept not in ("entropy_bound", "confidence", "fixed_count"):
            fail("accept", f"{self.accept!r} is not 'entropy_bound', 'confidence' or 'fixed_count'")
        if self.sampling not in ("inverse_cdf", "gumbel"):
            fail("sampling", f"{self.sampling!r} is not 'inverse_cdf' or 'gumbel'")
        if self.ancestral_temperature <= 0:
            fail("ancestral_temperature", f"{self.ancestral_temperature} must be > 0")
        if self.ar_temperature < 0:
            fail("ar_temperature", f"{self.ar_temperature} must be >= 0")

    @classmethod
    def from_section(cls, section, *layers, **overrides) -> "SamplerConfig":
        """THE way to build a sampler config from settings: the run config's `sampler` section (derived from this
        class by `dgemma.config`; a `SamplerConfig` also works), then each partial section in `layers` (its set
        fields, `given()`, replace the values before it: e.g. `sdrl.teacher_sampler`), then `overrides` (run-time
        values: eos_ids, pad_id, max_new_tokens, a step limit max_steps, a mode). A field that is not a `SamplerConfig`
        field is an error (never dropped silently)."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {f.name: getattr(section, f.name) for f in dataclasses.fields(section) if f.init}
        for layer in layers:
            values.update(layer.given())
        unknown = sorted((set(values) | set(overrides)) - names)
        if unknown:
            raise ValueError(f"sampler section fields {unknown} are not SamplerConfig fields")
        return cls(**{**values, **overrides})

    def replace(self, **changes) -> "SamplerConfig":
        """This config with `changes` (through `from_section`, the one construction path)."""
        return SamplerConfig.from_section(self, **changes)

    # --- compile-time / runtime split ------------------------------------------------------------------------
    def static_part(self) -> "SamplerConfig":
        """This config with the runtime scalars zeroed: the hashable key of the compiled block function."""
        return dataclasses.replace(self, entropy_bound=0.0, t_max=1.0, t_min=0.0, confidence_threshold=0.0,
                                   accept_confidence=0.0, ancestral_temperature=1.0, ar_temperature=0.0,
                                   auto_entropy_threshold=0.0, max_new_tokens=1, mode="diffusion", eos_ids=None,
                                   pad_id=None)

    def dynamic_part(self) -> dict:
        d = {k: np.float32(getattr(self, k)) for k in _DYNAMIC_FIELDS}
        d["t_delta"] = np.float32(self.t_max - self.t_min)  # difference in double, as HF computes it
        return d


@dataclasses.dataclass
class SampleResult:
    """Output of `sample`. Per-row arrays are numpy; `cache` stays on device.

    tokens: [B, T] int32 generated tokens (T = L·blocks run, or max_new_tokens in pure AR mode); PAD after EOS.
    tpf: [B] non-pad generated tokens / (decoder passes + AR forwards) while the row was active
      (transformers' `tokens_per_forward` when no AR fallback ran).
    tpf_total: [B] non-pad tokens / (decoder passes + AR forwards + commit encoder passes).
    decoder_passes, ar_forwards, commit_passes: [B] forward counts while active (commit passes exclude the last
      block's, which only feeds the returned cache).
    steps_per_block: [B, n_blocks] decoder forwards of the row in each block (0 when it did not take part).
    stop_reason: [B, n_blocks] int codes into STOP_REASONS.
    entropy_trace: [B, n_blocks, K] mean tempered entropy per step (NaN where the row was inactive).
    commit_step: [B, n_blocks, L] 1-based step at which each position took its final argmax value (0: no diffusion).
    steps_run: [n_blocks] loop iterations of each block (lockstep over the batch).
    drafts: [n_blocks, K, B, L] argmax after each step (only with `record_drafts`).
    record: `RolloutRecord` of the visited states, device arrays (only with `record_states`).
    """

    tokens: np.ndarray
    tpf: np.ndarray
    tpf_total: np.ndarray
    decoder_passes: np.ndarray
    ar_forwards: np.ndarray
    commit_passes: np.ndarray
    steps_per_block: np.ndarray
    stop_reason: np.ndarray
    entropy_trace: np.ndarray
    commit_step: np.ndarray
    steps_run: np.ndarray
    mode: tuple[str, ...]
    drafts: np.ndarray | None = None
    cache: KVCache | None = None
    record: Any = None

    @property
    def n_blocks(self) -> int:
        return self.stop_reason.shape[1]

    def stop_reason_names(self) -> list[list[str]]:
        return [[STOP_REASONS[int(c)] for c in row] for row in self.stop_reason]

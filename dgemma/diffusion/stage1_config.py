"""`Stage1Config`: the stage-1 objective's settings (the run config's `diffusion` section is derived from it).

Kept free of jax so that loading a config never imports it (`dgemma.config` builds its sections from this class).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage1Config:
    """Stage-1 block-diffusion objective (docs/stage1.md). Defaults are the design's defaults.

    Attributes:
      t_min: lower end of the training noise level range.
      t_max: upper end of the training noise level range.
      antithetic: antithetic t over batch x blocks.
      lambda_ar: weight of the clean-stream AR loss (keeps the AR fallback).
      p_self_cond: probability of the self-conditioning pass per example.
      head_alignment: noshift (DiffusionGemma, exportable) | shift (Dream-style ablation).
      loss_weighting: base: w(t) = 1 | reweighted: w(t) = 1/(1-t) clipped at reweight_max, multiplying each
        example's mean NLL (docs/stage1.md §3). The design's `loo` / `elbo` training ablations are not
        offered (the exact NELBO is an evaluation metric: dgemma.eval.denoise.nelbo_estimate).
      reweight_max: clip of the 1/(1-t) weight.
      clean_attention: clean-stream attention: causal (= the AR model) | block_causal.
      block_selection: train every block (all) | one random block per example (one_random).
      sc_train_temperature: logits fed to self-conditioning in training: raw | sampled_tau (tempered as the
        sampler does).
      self_cond_pass: the gradient-free self-conditioning pass re-runs the whole [clean ; noisy] layout (full) or
        only the noisy stream over the clean stream's keys and values (noisy_stream: the same loss and gradients,
        a third of the pass's FLOPs at the 26B layout; dgemma.diffusion.split_streams).
      ce_chunk: tokens per chunk of the fused head + cross-entropy (memory, not numerics).
    """

    t_min: float = 1e-3
    t_max: float = 1.0 - 1e-3
    antithetic: bool = True
    lambda_ar: float = 1.0
    p_self_cond: float = 0.5
    head_alignment: Literal["noshift", "shift"] = "noshift"
    loss_weighting: Literal["base", "reweighted"] = "base"
    reweight_max: float = 10.0
    clean_attention: Literal["causal", "block_causal"] = "causal"
    block_selection: Literal["all", "one_random"] = "all"
    sc_train_temperature: Literal["raw", "sampled_tau"] = "raw"
    self_cond_pass: Literal["full", "noisy_stream"] = "full"
    ce_chunk: int = 256

    __moved_keys__ = {"canvas_selection": "block_selection"}  # renamed keys: the config loader names the new one

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def fail(field: str, msg: str) -> None:
            raise ValueError(f"Stage1Config.{field}: {msg}")

        if not 0.0 <= self.t_min < self.t_max <= 1.0:
            fail("t_min", f"need 0 <= t_min < t_max <= 1, got t_min={self.t_min}, t_max={self.t_max}")
        if not self.lambda_ar >= 0 or math.isinf(self.lambda_ar):
            fail("lambda_ar", f"{self.lambda_ar} must be a finite number >= 0")
        if not 0.0 <= self.p_self_cond <= 1.0:
            fail("p_self_cond", f"{self.p_self_cond} must be in [0, 1]")
        if not self.reweight_max > 0 or math.isinf(self.reweight_max):
            fail("reweight_max", f"{self.reweight_max} must be a finite number > 0")
        for name, choices in (("head_alignment", ("noshift", "shift")), ("loss_weighting", ("base", "reweighted")),
                              ("clean_attention", ("causal", "block_causal")),
                              ("block_selection", ("all", "one_random")),
                              ("sc_train_temperature", ("raw", "sampled_tau")),
                              ("self_cond_pass", ("full", "noisy_stream"))):
            if getattr(self, name) not in choices:
                fail(name, f"{getattr(self, name)!r} is not one of {choices}")
        if isinstance(self.ce_chunk, bool) or not isinstance(self.ce_chunk, int) or self.ce_chunk < 1:
            fail("ce_chunk", f"{self.ce_chunk!r} must be an int >= 1")

    @classmethod
    def from_section(cls, section) -> Stage1Config:
        """Build from the run config's `diffusion` section; a section field that is not a `Stage1Config` field is an
        error (never dropped silently)."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {f.name: getattr(section, f.name) for f in dataclasses.fields(section) if f.init}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"diffusion section fields {unknown} are not Stage1Config fields")
        return cls(**values)

"""The `lora` section: low-rank adapters for any objective (ar, stage1, sdrl); `rank: 0` (default) turns them off.

    lora:
      rank: 16                      # r; 0 = no adapters (full-parameter training as configured by `optim`)
      alpha: 32.0                   # scale = alpha / r (null: alpha = r, scale 1)
      targets: [attn/[qkvo]_proj$, mlp/(gate|up|down)$, experts/(gate|up|down)$]
      train_router: false           # also train the routers (proj, scale, per_expert_scale) in full
      train_embeddings: false       # also train the tied embedding in full
      dropout: 0.0                  # dropout on the adapters' inputs while training (none at eval / sampling)

`targets` are regexes (`re.search`) over base weight paths (`dgemma.model.lora`): `attn/[qkvo]_proj$` the attention
projections, `mlp/(gate|up|down)$` the dense MLPs and the self-conditioning MLP (`self_conditioning/mlp/...`),
`experts/(gate|up|down)$` the experts' grouped matmuls, `router/proj$` the router logits. Every other parameter is
frozen (`optim.freeze` gains a regex that matches everything but the adapters and what `train_*` names): no optimizer
state, no update, bit-identical after training (`dgemma.train.lora_setup`). `dropout` drops elements of each adapter's
input (the base matmul sees them all) in the training losses only, keyed from the step's training key
(`dgemma.model.lora.adapter_dropout`): reproducible, exact on resume, absent from evaluation and sampling.
"""

from __future__ import annotations

import dataclasses
import re

from dgemma.config.sections import help_field
from dgemma.config.types import Section

__all__ = ["DEFAULT_TARGETS", "LoraSection"]

DEFAULT_TARGETS = (r"attn/[qkvo]_proj$", r"mlp/(gate|up|down)$", r"experts/(gate|up|down)$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraSection(Section):
    """Low-rank adapters (module docstring)."""

    rank: int = help_field(0, "adapter rank r; 0 = no adapters")
    alpha: float | None = help_field(None, "adapter scale alpha / r (null: alpha = r)")
    targets: tuple[str, ...] = help_field(DEFAULT_TARGETS, "regexes (re.search) over the adapted base weights' paths")
    train_router: bool = help_field(False, "train the routers (proj, scale, per_expert_scale) in full")
    train_embeddings: bool = help_field(False, "train the tied embedding in full")
    param_dtype: str = help_field("float32", "dtype of the adapters (the base keeps model.param_dtype)")
    dropout: float = help_field(0.0, "dropout on the adapters' inputs while training, in [0, 1)")

    def validate(self) -> None:
        if self.rank < 0:
            self._fail("rank", f"{self.rank} must be >= 0 (0: no adapters)")
        if self.alpha is not None and self.alpha <= 0:
            self._fail("alpha", f"{self.alpha} must be > 0 (or null: alpha = rank)")
        if self.rank and not self.targets:
            self._fail("targets", "is empty; adapters need at least one target regex (or set lora.rank=0)")
        for i, pattern in enumerate(self.targets):
            try:
                re.compile(pattern)
            except re.error as e:
                self._fail(f"targets[{i}]", f"invalid regex {pattern!r}: {e}")
        if not 0.0 <= self.dropout < 1.0:
            self._fail("dropout", f"{self.dropout} must be in [0, 1) (0: no dropout)")
        if self.param_dtype not in ("float32", "bfloat16"):
            self._fail("param_dtype", f"{self.param_dtype!r} must be float32 or bfloat16")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def spec(self):
        """The model layer's `LoraSpec` (None when off)."""
        from dgemma.model.lora import LoraSpec

        if not self.enabled:
            return None
        return LoraSpec(rank=self.rank, alpha=float(self.rank if self.alpha is None else self.alpha),
                        targets=tuple(self.targets), param_dtype=self.param_dtype, dropout=float(self.dropout))

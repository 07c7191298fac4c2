"""Periodic evaluation inside the training loop: `trainer.eval_every` steps, `trainer.eval_batches` held-out batches.

Every `eval_every` steps the loop calls `PeriodicEval(params, step)` and logs what it returns
next to the training metrics (same tracker, keys prefixed `eval/`):

  eval/nll_t{t}, eval/acc_t{t}, eval/acc_noised_t{t}   denoising CE / one-step accuracy at fixed noise levels t, in the
                                                        run's layout (`dgemma.eval.denoise`, `cfg.diffusion`)
  eval/<mode>/exact_match[/<task>], eval/<mode>/tpf, eval/<mode>/steps_per_block, ...
                                                        the run's sampler (`cfg.sampler`, decoding in its `mode`), scored
                                                        by the held-out evaluator (`dgemma.eval.evaluator`: the metric
                                                        names every evaluation in dgemma uses)
  eval/heldout_overlap                                  held-out prompts that occur in the training data (0)

The held-out rows (`dgemma.eval.heldout.periodic_held_out`, built by `held_out_for` before the run dir is written):
for a synthetic task mix, prompts drawn disjoint from the prompts the training stream reads; for a file source
(json, parquet, arrow, gsm8k, messages), the first `eval_batches x data.batch_size` examples of `data.eval_paths`,
read as the training files are (chat template, canvas layout), refused when any of their prompts is a prompt of a
training file. Other sources, or a file source without `data.eval_paths`, are refused at start-up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from dgemma.eval.denoise import DEFAULT_T_GRID, denoise_metrics
from dgemma.eval.heldout import periodic_held_out
from dgemma.eval.evaluator import evaluate, scalars

if TYPE_CHECKING:
    from dgemma.config import RunConfig
    from dgemma.eval.heldout import HeldOutSet

__all__ = ["PeriodicEval", "eval_due", "held_out_for"]


def eval_due(step: int, every: int) -> bool:
    """Whether the loop evaluates after `step`: every `every` steps (`every=0`: never)."""
    return every > 0 and step % every == 0


def held_out_for(cfg: RunConfig, data: Any = None) -> HeldOutSet:
    """The run's held-out set (module docstring); `data`: the training pipeline, whose kept prompt ids the file check
    reuses. Raises ValueError in one line naming the setting or the file."""
    if cfg.diffusion.head_alignment == "shift" and cfg.sampler.mode != "ar":
        raise ValueError("trainer.eval_every: the block sampler decodes the noshift layout only, but "
                         "diffusion.head_alignment='shift'; set sampler.mode=ar for periodic evaluation")
    data_cfg = cfg.data
    return periodic_held_out(data_cfg, rows=cfg.trainer.eval_batches * data_cfg.batch_size,
                             batch_size=data_cfg.batch_size, train_steps=cfg.trainer.steps,
                             train=data if hasattr(data, "encoded_rows") else None,
                             field=f"trainer.eval_every={cfg.trainer.eval_every}")


def _without_padding_rows(batch: dict) -> dict:
    """The batch with no supervised positions on the padding rows of a short last batch (`example_mask` False), so
    that the denoising metrics average over held-out rows only."""
    keep = np.asarray(batch.get("example_mask", True), bool)
    if keep.all():
        return batch
    return {**batch, "diffusion_weight": np.asarray(batch["diffusion_weight"]) * keep[:, None]}


class PeriodicEval:
    """Held-out evaluation of the training state (module docstring). Built once at start-up, before the run dir;
    `held_out`: the set `held_out_for` built (default: built here)."""

    def __init__(self, cfg: RunConfig, graphdef: Any, *, held_out: HeldOutSet | None = None, t_grid=DEFAULT_T_GRID,
                 mesh=None):
        self.held_out = held_out_for(cfg) if held_out is None else held_out
        self.sampler = cfg.sampler
        self.stage1 = cfg.diffusion.build()
        self.batches = range(min(cfg.trainer.eval_batches, self.held_out.num_batches))
        self.graphdef = graphdef
        self.t_grid = tuple(t_grid)
        self.key = jax.random.key(cfg.run.seed)
        # decode on the training mesh (the batch split over it, not replicated), across processes too
        self.mesh, self.rules = mesh, cfg.mesh.rules

    def __call__(self, params: Any, step: int) -> dict[str, float]:
        from flax import nnx

        model = nnx.merge(self.graphdef, params)
        key = jax.random.fold_in(self.key, step)
        batches = [self.held_out.batch(s) for s in self.batches]
        out: dict[str, float] = {}
        for t, row in denoise_metrics(model, [_without_padding_rows(b) for b in batches], key, self.t_grid,
                                      cfg=self.stage1).items():
            out.update({f"eval/{name}_t{t:g}": value for name, value in row.items()})
        res = evaluate(model, self.held_out, self.sampler, (self.sampler.mode,), batches=self.batches, key=key,
                       mesh=self.mesh, rules=self.rules)
        out.update(scalars(res, "eval/"))
        out["eval/heldout_overlap"] = float(self.held_out.overlap)
        return out

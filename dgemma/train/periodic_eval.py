"""Periodic evaluation inside the training loop: `trainer.eval_every` steps, `trainer.eval_batches` held-out batches.

Every `eval_every` steps the loop calls `PeriodicEval(params, step)` and logs what it returns
next to the training metrics (same tracker, keys prefixed `eval/`):

  eval/nll_t{t}, eval/acc_t{t}, eval/acc_noised_t{t}   denoising CE / one-step accuracy at fixed noise levels t, in the
                                                        run's layout (`dgemma.eval.denoise`, `cfg.diffusion`)
  eval/<mode>/exact_match[/<task>], eval/<mode>/tpf, eval/<mode>/steps_per_block, ...
                                                        the run's sampler (`cfg.sampler`, decoding in its `mode`), scored
                                                        by the held-out evaluator (`dgemma.eval.evaluator`: the metric
                                                        names every evaluation in dgemma uses)
  eval/heldout_overlap                                  held-out prompts that occur in the training stream (0)

Held-out prompts are disjoint from the prompts the training stream reads (`dgemma.eval.heldout.build_held_out`), which
needs a synthetic task mix; other sources are refused at start-up rather than evaluated on training data.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import jax

from dgemma.eval.denoise import DEFAULT_T_GRID, denoise_metrics
from dgemma.eval.heldout import build_held_out
from dgemma.eval.evaluator import evaluate, scalars

if TYPE_CHECKING:
    from dgemma.config import RunConfig

__all__ = ["PeriodicEval", "eval_due"]


def eval_due(step: int, every: int) -> bool:
    """Whether the loop evaluates after `step`: every `every` steps (`every=0`: never)."""
    return every > 0 and step % every == 0


class PeriodicEval:
    """Held-out evaluation of the training state (module docstring). Built once at start-up, before the run dir."""

    def __init__(self, cfg: RunConfig, graphdef: Any, *, t_grid=DEFAULT_T_GRID, mesh=None):
        data_cfg = cfg.data
        if data_cfg.source != "synthetic":
            raise ValueError(f"trainer.eval_every={cfg.trainer.eval_every} needs held-out prompts disjoint from "
                             f"training, which dgemma draws from a synthetic task mix; data.source="
                             f"{data_cfg.source!r}: set trainer.eval_every=0 and evaluate with `dgemma eval`")
        if cfg.diffusion.head_alignment == "shift" and cfg.sampler.mode != "ar":
            raise ValueError("trainer.eval_every: the block sampler decodes the noshift layout only, but "
                             "diffusion.head_alignment='shift'; set sampler.mode=ar for periodic evaluation")
        n_tasks = len({t.name for t in data_cfg.tasks})
        rows = cfg.trainer.eval_batches * data_cfg.batch_size
        self.held_out = build_held_out(data_cfg, n_per_task=math.ceil(rows / n_tasks),
                                       batch_size=data_cfg.batch_size,
                                       train_streams=[(data_cfg, cfg.trainer.steps)])
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
        for t, row in denoise_metrics(model, batches, key, self.t_grid, cfg=self.stage1).items():
            out.update({f"eval/{name}_t{t:g}": value for name, value in row.items()})
        res = evaluate(model, self.held_out, self.sampler, (self.sampler.mode,), batches=self.batches, key=key,
                       mesh=self.mesh, rules=self.rules)
        out.update(scalars(res, "eval/"))
        out["eval/heldout_overlap"] = float(self.held_out.overlap)
        return out

"""Recipe ablations: one training run of a config variant from a checkpoint, through the one trainer.

    from dgemma.train.ablation import train_variant
    run = train_variant("experiments/tiny_pipeline/stage1.yaml", ["diffusion.lambda_ar=0"], seed=1,
                        init_from="experiments/tiny_pipeline/checkpoint/stage0_ar", out="runs/abl", name="ar0")
    run.model, run.losses["loss_diffusion"], run.seconds

A variant is the recipe's config plus dotted overrides (`dgemma.config.load_config`, the same syntax as `dgemma
train`); `seed` is the run's training seed (`run.seed`: initialisation of anything `init_from` does not hold, noise
levels, self-conditioning draws, data order is the config's), so a variant's spread over seeds is training noise.
The run goes through `dgemma.train.trainer.train` (what `dgemma train` runs) with a fresh run directory: a
directory left by another run is refused, never resumed (a resumed run would mix two variants' steps). It returns the
trained model (`decoding_model`: without the self-conditioning module when the run never trained it) and every
step's training losses (the objective's logged scalars), so a notebook compares variants
without reading a script's files. `notebooks/stage1_ablations.py` uses it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["VariantRun", "decoding_model", "train_variant", "variant_cfg"]


@dataclasses.dataclass
class VariantRun:
    """One trained variant: its config, model, per-step losses {metric: [value per step]} and wall seconds."""

    cfg: Any
    model: Any
    losses: dict[str, list[float]]
    seconds: float


def variant_cfg(config: str | Path, overrides: Sequence[str], *, seed: int, init_from: str | Path | None, out,
                name: str, steps: int | None = None):
    """The run config of one variant x seed: `config` + `overrides`, then the run's name, seed, directory, start
    checkpoint and (if given) step count, which the overrides cannot change."""
    from dgemma.config import load_config

    run = [f"run.output_dir={out}", f"run.name={name}_s{seed}", f"run.seed={seed}",
           f"checkpoint.init_from={init_from or ''}"]
    if steps is not None:
        run.append(f"trainer.steps={steps}")
    mine = {o.partition("=")[0] for o in run}
    clash = sorted({o.partition("=")[0] for o in overrides} & mine)
    if clash:
        raise ValueError(f"train_variant: override {clash[0]} is set by the ablation itself (seed, out, name, "
                         "init_from, steps)")
    return load_config(config, [*overrides, *run])


def train_variant(config: str | Path, overrides: Sequence[str] = (), *, seed: int, init_from: str | Path | None,
                  out: str | Path, name: str, steps: int | None = None, mesh=None) -> VariantRun:
    """Train one variant x seed (module docstring) and return its model and losses."""
    from dgemma.train.study import study_mesh
    from dgemma.train.trainer import train

    cfg = variant_cfg(config, overrides, seed=seed, init_from=init_from, out=out, name=name, steps=steps)
    run_dir = Path(cfg.run.run_dir)
    if run_dir.exists():
        raise FileExistsError(f"train_variant: {run_dir} exists (another run's directory); choose another out or name")
    losses: dict[str, list[float]] = {}

    def on_step(step: int, metrics: dict) -> None:
        for k, v in metrics.items():
            if k.startswith("loss"):
                losses.setdefault(k, []).append(float(v))

    t0 = time.time()
    summary = train(cfg, progress=False, on_step=on_step, save_params_at_end=False,
                    mesh=study_mesh(cfg) if mesh is None else mesh)
    return VariantRun(cfg=cfg, model=decoding_model(cfg, summary.state.params), losses=losses,
                      seconds=time.time() - t0)


def decoding_model(cfg, params):
    """The model a variant decodes with. A stage-1 run at `diffusion.p_self_cond=0` never trains its
    self-conditioning module (the stage-0 checkpoint it starts from holds that module at its initialisation), and the
    sampler feeds a model's module whenever it has one: that variant decodes without it, as it trained."""
    from flax import nnx

    from dgemma.model.transformer import model_from_params

    from dgemma.train.objectives import get_objective

    mc = cfg.model_config
    trains_sc = get_objective(cfg.trainer.objective).self_conditioning_pass  # its SC pass runs at p_self_cond > 0
    if trains_sc and cfg.diffusion.p_self_cond == 0 and mc.self_conditioning:
        mc = mc.replace(self_conditioning=False)
        params = nnx.State({k: v for k, v in params.items() if k != "self_conditioning"})
    return model_from_params(mc, params)

"""`dgemma.train.ablation`: one recipe variant trained from a checkpoint through the trainer (the stage-1 ablations
notebook's training call). A one-layer stand-in of the main job's stage-1 recipe (experiments/tiny_pipeline), 2 steps.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "experiments" / "tiny_pipeline" / "stage1.yaml"
SMALL = ["model.num_hidden_layers=1", "model.layer_types=[full_attention]", "optim.warmup_steps=0",
         "data.batch_size=8"]


@pytest.fixture(scope="module")
def stage0(tmp_path_factory):
    """An untrained stand-in of the stage-0 checkpoint (the params of the one-layer model, seed 0)."""
    from flax import nnx

    from dgemma.checkpoint import save_params
    from dgemma.model.transformer import Transformer
    from dgemma.train.ablation import variant_cfg

    out = tmp_path_factory.mktemp("stage0")
    cfg = variant_cfg(RECIPE, SMALL, seed=0, init_from=None, out=out, name="stand_in")
    save_params(out / "params", 0, nnx.state(Transformer(cfg.model_config, rngs=nnx.Rngs(0)), nnx.Param))
    return out / "params"


def test_variant_cfg_applies_overrides_and_refuses_the_ablations_own_fields(tmp_path):
    from dgemma.train.ablation import variant_cfg

    cfg = variant_cfg(RECIPE, [*SMALL, "diffusion.lambda_ar=0"], seed=2, init_from="ckpt", out=tmp_path, name="x",
                      steps=3)
    assert (cfg.diffusion.lambda_ar, cfg.run.seed, cfg.trainer.steps, cfg.checkpoint.init_from) == (0.0, 2, 3, "ckpt")
    assert cfg.run.name == "x_s2" and cfg.diffusion.p_self_cond == 0.5  # the recipe's default kept
    for field in ("run.seed", "trainer.steps", "checkpoint.init_from"):
        with pytest.raises(ValueError, match=f"override {field} is set by the ablation itself"):
            variant_cfg(RECIPE, [f"{field}=1"], seed=0, init_from=None, out=tmp_path, name="x", steps=3)


def test_decoding_model_drops_self_conditioning_only_when_the_run_never_trained_it(tmp_path):
    from flax import nnx

    from dgemma.model.transformer import Transformer
    from dgemma.train.ablation import decoding_model, variant_cfg

    on = variant_cfg(RECIPE, SMALL, seed=0, init_from=None, out=tmp_path, name="on")
    params = nnx.state(Transformer(on.model_config, rngs=nnx.Rngs(0)), nnx.Param)
    assert decoding_model(on, params).self_conditioning is not None
    off = variant_cfg(RECIPE, [*SMALL, "diffusion.p_self_cond=0"], seed=0, init_from=None, out=tmp_path, name="off")
    model = decoding_model(off, params)
    assert model.self_conditioning is None and "self_conditioning" not in nnx.state(model, nnx.Param)


def test_train_variant_trains_from_the_checkpoint_and_returns_losses(stage0, tmp_path):
    import jax
    import numpy as np
    from flax import nnx

    from dgemma.checkpoint.params import restore_params
    from dgemma.model.transformer import Transformer
    from dgemma.train.ablation import train_variant

    run = train_variant(RECIPE, [*SMALL, "diffusion.p_self_cond=0", "diffusion.lambda_ar=2"], seed=1,
                        init_from=stage0, out=tmp_path, name="v", steps=2)
    assert run.cfg.run.seed == 1 and run.cfg.diffusion.lambda_ar == 2.0
    assert sorted(run.losses) == ["loss", "loss_ar", "loss_diffusion"]
    assert all(len(v) == 2 and all(map(math.isfinite, v)) for v in run.losses.values()), run.losses
    for total, diff, ar in zip(run.losses["loss"], run.losses["loss_diffusion"], run.losses["loss_ar"]):
        assert total == pytest.approx(diff + 2.0 * ar, rel=1e-5)  # the variant's λ_AR is the one trained
    assert run.model.self_conditioning is None and run.seconds > 0
    # started from the checkpoint (an untrained model at seed 0; the run's own initialisation is seed 1) and trained
    def pure(state):
        return dict(state.to_pure_dict() if hasattr(state, "to_pure_dict") else state)

    trained = pure(nnx.state(run.model, nnx.Param))
    start = pure(restore_params(stage0, nnx.state(Transformer(run.cfg.model_config, rngs=nnx.Rngs(5)), nnx.Param)))
    start.pop("self_conditioning")
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
                                         trained, start))
    assert 0 < max(moved) < 0.01, max(moved)  # two Adam steps at lr <= 2e-3 from the checkpoint, not elsewhere
    with pytest.raises(FileExistsError, match="v_s1 exists"):  # never resumed into: another variant's steps
        train_variant(RECIPE, SMALL, seed=1, init_from=stage0, out=tmp_path, name="v", steps=2)

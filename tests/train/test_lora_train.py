"""LoRA through the real trainer (`lora` section, `dgemma.train.lora_setup`): only the adapters (and what
`lora.train_*` names) train; the base stays bit-identical, has no optimizer state; bad settings are one-line errors."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs/stage1/tiny.yaml")


def _cfg(tmp_path, *overrides, rank=2):
    from dgemma.config import load_config

    return load_config(TINY, [f"run.output_dir={tmp_path}", "trainer.steps=2", "trainer.eval_every=0",
                              "trainer.log_every=1", "checkpoint.every=0", "data.batch_size=4",
                              "optim.warmup_steps=0", "model.num_hidden_layers=2",
                              "model.layer_types=[sliding_attention, full_attention]", f"lora.rank={rank}", "lora.alpha=4.0", *overrides], env={})


def _one_device():
    from dgemma.parallel.mesh import make_mesh

    return make_mesh({"fsdp": 1}, jax.devices()[:1])


def _flat(params) -> dict[str, np.ndarray]:
    return {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(params)}


@pytest.mark.parametrize("objective", [pytest.param("ar", marks=pytest.mark.slow), "stage1"])
def test_only_adapters_train(tmp_path, objective):
    import optax

    from dgemma.train.lora_setup import adapted_factory
    from dgemma.train.state import init_train_state
    from dgemma.train.trainer import _default_model_factory, train

    cfg = _cfg(tmp_path, f"trainer.objective={objective}", "lora.train_router=true",
               "lora.targets=['attn/[qkvo]_proj$', 'experts/(gate|up|down)$', 'self_conditioning/mlp/gate$']")
    factory = adapted_factory(cfg, _default_model_factory(cfg.model_config))
    initial = _flat(init_train_state(factory, optax.identity(), cfg.run.seed)[1].params)  # as the trainer draws it
    summary = train(cfg, progress=False, save_params_at_end=False, mesh=_one_device())
    trained = _flat(summary.state.params)
    assert set(trained) == set(initial)
    changed = {k for k in trained if not np.array_equal(trained[k], initial[k])}
    adapters = {k for k in trained if "/lora/" in k}
    assert any("experts/lora/gate/b" in k for k in changed) and any("attn/lora/o_proj/b" in k for k in changed)
    assert any(k.endswith("self_conditioning/mlp/lora/gate/b") for k in changed) == (objective == "stage1")
    routers = {k for k in trained if "/router/" in k}
    assert changed <= adapters | routers and changed & routers  # train_router: the routers train in full
    # no optimizer state for the frozen base: AdamW's moments exist for the adapters and routers only
    opt_leaves = jax.tree.leaves(summary.state.opt_state)
    moments = sum(x.size for x in opt_leaves if getattr(x, "ndim", 0) >= 1)
    trainable = sum(trained[k].size for k in adapters | routers)
    assert moments == 2 * trainable


def test_bad_lora_settings_are_one_line_errors(tmp_path):
    from dgemma.config import ConfigError
    from dgemma.train.trainer import train

    with pytest.raises(ConfigError, match=r"lora.rank: -1 must be >= 0 \(0: no adapters\)$"):
        _cfg(tmp_path, rank=-1)
    cfg = _cfg(tmp_path, "trainer.objective=ar", "lora.targets=[attn/qq_proj]")
    with pytest.raises(ValueError, match=r"^lora.targets: \['attn/qq_proj'\] match no adaptable weight") as e:
        train(cfg, progress=False, mesh=_one_device())
    assert "\n" not in str(e.value)
    assert not list(tmp_path.iterdir())  # refused before the run dir exists


def test_rank_zero_is_the_base_model(tmp_path):
    from dgemma.train.lora_setup import adapted_factory, optim_section
    from dgemma.train.trainer import _default_model_factory

    cfg = _cfg(tmp_path, rank=0)
    factory = _default_model_factory(cfg.model_config)
    assert adapted_factory(cfg, factory) is factory and optim_section(cfg) is cfg.optim


def test_adapter_dropout_setting(tmp_path):
    """lora.dropout is checked in one line, and reaches the objectives' losses only when > 0."""
    from dgemma.config import ConfigError
    from dgemma.train.objectives import get_objective
    from dgemma.diffusion.ar import ar_loss_fn

    for bad in ("1.0", "-0.1"):
        with pytest.raises(ConfigError, match=rf"lora.dropout: {bad} must be in \[0, 1\)"):
            _cfg(tmp_path, f"lora.dropout={bad}")
    assert get_objective("ar").loss_fn(_cfg(tmp_path, "lora.dropout=0.0")) is ar_loss_fn
    assert get_objective("ar").loss_fn(_cfg(tmp_path, "lora.dropout=0.1")) is not ar_loss_fn


@pytest.mark.slow
def test_adapter_dropout_through_the_trainer(tmp_path):
    """lora.dropout acts on the adapters' inputs in the training loss only: at step 1 (B = 0, the adapters add
    nothing) the loss equals the no-dropout run's bit for bit while the gradients differ; from step 2 the losses
    differ. Same seed, same run: tests/checkpoint/test_lora_checkpoint.py resumes a dropout run bit-identically."""
    from dgemma.train.trainer import train

    curves = {}
    for rate in (0.0, 0.3):
        rows = []
        cfg = _cfg(tmp_path / str(rate), "trainer.objective=ar", f"lora.dropout={rate}")
        train(cfg, progress=False, save_params_at_end=False, mesh=_one_device(),
              on_step=lambda step, m: rows.append((m["loss"], m["grad_norm"])))
        curves[rate] = rows
    (l0, g0), (l1, g1) = curves[0.0][0], curves[0.3][0]
    assert l0 == l1 and g0 != g1
    assert curves[0.0][1][0] != curves[0.3][1][0]


def test_the_adaptation_is_the_one_answer_to_whether_adapters_train(tmp_path):
    """`adaptation_for` decides once from `lora.rank`; the SD·RL session and its refusals read `trains_adapters`."""
    from dgemma.train.adaptation import Adapters, FullParams, adaptation_for

    adapters, full = adaptation_for(_cfg(tmp_path)), adaptation_for(_cfg(tmp_path, rank=0))
    assert isinstance(adapters, Adapters) and adapters.trains_adapters
    assert isinstance(full, FullParams) and not full.trains_adapters

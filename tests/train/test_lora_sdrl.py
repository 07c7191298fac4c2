"""SD·RL with adapters (`lora.rank > 0`, dgemma/train/sdrl/lora_reference.py): the KL reference and the frozen
teacher are the student's frozen base with the adapters off, no copy of the model; only the adapters train.

- the reference model equals a model that never had adapters, bit for bit, whatever the adapters hold (trained ones);
  what trains beside them (`lora.train_router`) keeps its start values in the reference, and only that is copied;
- one real SD·RL iteration through the trainer, from a params checkpoint whose adapters are non-zero (so the student
  and the reference differ from the first state on): the log π_ref its optimizer steps read are the base model's,
  log π_old the student's; the base is bit-identical afterwards, the adapters moved, the loss is finite, and the
  session holds no reference arrays (its checkpoint item has no "reference");
- `sdrl.reference_memory=host` with adapters is a one-line refusal before anything is written.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

REPO = Path(__file__).resolve().parents[2]
TARGETS = "lora.targets=['attn/[qkvo]_proj$', 'mlp/(gate|up|down)$', 'experts/(gate|up|down)$']"
ONE_LAYER = ["model.num_hidden_layers=1", "model.layer_types=[full_attention]"]
REWARD_MODULE = "lora_sdrl_reward"
REWARD = """
def reward(examples, generations, tokenizer):  # parity of the even tokens: varies within a group (advantages != 0)
    return [float(sum(1 for t in g if t % 2 == 0) % 2) for g in generations]
"""


def _cfg(tmp_path, *overrides):
    from dgemma.config import load_config

    return load_config(REPO / "configs/stage2/tiny.yaml", [*ONE_LAYER, "lora.rank=2", "lora.alpha=4.0", TARGETS,
                                                           f"run.output_dir={tmp_path}", *overrides], env={})


def _flat(params) -> dict[str, np.ndarray]:
    return {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(params)}


def _randomized(params, seed, scale=0.1):
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(params))))
    return jax.tree.map(lambda x: x + scale * jax.random.normal(next(keys), x.shape, x.dtype), params)


def _adapted(cfg):
    """(graphdef, params with every leaf randomized: non-zero adapters B, as after training)."""
    from dgemma.train.lora_setup import adapted_factory
    from dgemma.train.state import split_params
    from dgemma.train.trainer import _default_model_factory

    graphdef, params = split_params(adapted_factory(cfg, _default_model_factory(cfg.model_config))(nnx.Rngs(0)))
    return graphdef, _randomized(params, 1)


def _plain_model(cfg, params):
    """A model built without adapters, holding `params`' base weights."""
    from dgemma.train.trainer import _default_model_factory

    model = _default_model_factory(cfg.model_config)(nnx.Rngs(5))
    nnx.update(model, params.filter(nnx.Not(nnx.LoRAParam)))
    return model


TOKENS = np.random.default_rng(0).integers(2, 30, (2, 12)).astype(np.int32)  # tiny_toy: 32 tokens


@pytest.mark.parametrize("train_router", [False, True])
def test_reference_is_the_base_model(tmp_path, train_router):
    from dgemma.train.sdrl.lora_reference import AdapterReference

    cfg = _cfg(tmp_path, f"lora.train_router={str(train_router).lower()}")
    graphdef, params = _adapted(cfg)
    ref = AdapterReference(cfg, graphdef, jax.eval_shape(lambda: params))
    kept = ref.start(params)
    kept_paths = set(_flat(kept))
    assert kept_paths == ({p for p in _flat(params) if "/router/" in p} if train_router else set())
    assert AdapterReference.held_bytes(kept) == sum(_flat(params)[p].nbytes for p in kept_paths)
    base_logits = np.asarray(_plain_model(cfg, params)(TOKENS))
    student = nnx.merge(graphdef, params)
    assert not np.allclose(np.asarray(student(TOKENS)), base_logits, atol=1e-3)  # the adapters do change the model
    if train_router:  # the router trains: the reference keeps its start values, not the moved ones
        moved = nnx.merge_state(params, _randomized(params.filter(lambda p, v: "router" in map(str, p)), 2))
        reference = nnx.merge(ref.graphdef, ref.reference_params(moved, kept))
    else:
        reference = nnx.merge(ref.graphdef, ref.reference_params(params, kept))
    assert np.array_equal(np.asarray(reference(TOKENS)), base_logits)  # bit for bit: no adapter term at all
    assert not any(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(nnx.state(reference)))


def test_reference_memory_host_is_refused(tmp_path):
    from dgemma.parallel.mesh import make_mesh
    from dgemma.train.sdrl import run_sdrl

    cfg = _cfg(tmp_path, "sdrl.reference_memory=host", "sdrl.allow_random_init=true", "trainer.steps=1")
    with pytest.raises(ValueError, match=r"^sdrl.reference_memory=host: with lora.rank=2 the KL reference is the "
                                         r"student's own frozen base") as e:
        run_sdrl(cfg, progress=False, mesh=make_mesh({"fsdp": 1}, devices=jax.devices()[:1]))
    assert "\n" not in str(e.value)
    assert not list(tmp_path.iterdir())  # refused before the run dir exists


def test_one_iteration_trains_only_adapters_against_the_base(tmp_path, caplog):
    import dgemma.train.step as step_mod
    from dgemma.checkpoint.params import save_params
    from dgemma.parallel.mesh import make_mesh
    from dgemma.train.sdrl.loss import state_logprobs
    from dgemma.train.trainer import train

    (tmp_path / f"{REWARD_MODULE}.py").write_text(REWARD)
    cfg = _cfg(tmp_path, "trainer.steps=1", "data.batch_size=2", "sdrl.group_size=2", "sampler.max_steps=3",
               "sdrl.teacher_sampler.max_steps=4", "sdrl.curriculum_max_steps=[2]", "sdrl.kl_estimator=k3",
               "sdrl.kl_weight=0.1", "sdrl.anchor_weight=0", "sdrl.inner_epochs=1", "sdrl.num_minibatches=1",
               f"sdrl.reward={REWARD_MODULE}:reward", "optim.lr=0.01", "checkpoint.every=0",
               "checkpoint.async_save=false", "trainer.eval_every=0", "logging.jsonl=false", "run.name=lora_sdrl",
               f"checkpoint.init_from={tmp_path}/stage1/params")
    graphdef, start = _adapted(cfg)  # a stage-1 run's params with its adapters (non-zero B)
    save_params(tmp_path / "stage1/params", 0, start)
    batches, real = [], step_mod.make_train_step

    def make(*args, **kwargs):  # the real step; the wrapper keeps what each optimizer step is given
        fn = real(*args, **kwargs)

        def observed(state, batch):
            batches.append(jax.device_get(batch))
            return fn(state, batch)

        return observed

    with pytest.MonkeyPatch.context() as mp, caplog.at_level("WARNING", logger="dgemma.train.sdrl.session"):
        mp.syspath_prepend(str(tmp_path))
        mp.delitem(sys.modules, REWARD_MODULE, raising=False)
        mp.setattr(step_mod, "make_train_step", make)
        summary, session = train(cfg, progress=False, save_params_at_end=False, return_session=True,
                                 mesh=make_mesh({"fsdp": 1}, devices=jax.devices()[:1]))
    before, after = _flat(start), _flat(summary.state.params)
    assert set(after) == set(before)
    changed = {k for k in after if not np.array_equal(after[k], before[k])}
    assert changed and all("/lora/" in k for k in changed)  # the base is bit-identical
    assert any("experts/lora/" in k for k in changed) and any("attn/lora/" in k for k in changed)
    m = summary.last_metrics
    assert np.isfinite(m["loss"]) and m["loss"] != 0 and m["loss_kl"] >= 0
    # no copy of the model: the session holds no reference arrays and checkpoints none
    assert not jax.tree.leaves(session.reference) and session.ema is None
    assert "reference" not in session.checkpoint_item(summary.state)
    assert "the start params hold trained adapters" in caplog.text  # the reference is the base without them
    # log π_ref fed to the update = the base model (adapters off); log π_old = the student (adapters on)
    (batch,) = batches
    rows = {k: np.asarray(v) for k, v in batch.items()}
    mask = rows["state_ran"][..., None] & np.ones(rows["logp_ref"].shape, bool)
    base = np.asarray(jax.jit(state_logprobs)(_plain_model(cfg, start), rows, rows["output"]))
    student = np.asarray(jax.jit(state_logprobs)(nnx.merge(graphdef, start), rows, rows["output"]))
    np.testing.assert_allclose(rows["logp_ref"][mask], base[mask], atol=1e-5, rtol=0)
    np.testing.assert_allclose(rows["logp_old"][mask], student[mask], atol=1e-5, rtol=0)
    assert np.abs(rows["logp_ref"] - rows["logp_old"])[mask].max() > 1e-3  # the two policies differ here


@pytest.mark.slow  # three SD·RL runs (~25 s on an idle CPU, minutes on a shared one)
def test_resume_with_ema_teacher_and_trained_router_is_exact(tmp_path):
    """Straight 2 iterations vs the same run resumed from its iteration-1 checkpoint: the checkpoints hold the kept
    router start values ("reference") and the EMA of the trainable leaves only, and the resumed run ends bit-equal."""
    import shutil

    from dgemma.checkpoint.params import save_params
    from dgemma.parallel.mesh import make_mesh
    from dgemma.train.state import split_params
    from dgemma.train.trainer import _default_model_factory, train

    (tmp_path / f"{REWARD_MODULE}.py").write_text(REWARD)
    base = split_params(_default_model_factory(_cfg(tmp_path).model_config)(nnx.Rngs(3)))[1]
    save_params(tmp_path / "stage1/params", 0, base)  # a full-parameter stage-1 checkpoint: no adapters

    def run(name):
        cfg = _cfg(tmp_path, "trainer.steps=2", "data.batch_size=2", "sdrl.group_size=2", "sampler.max_steps=3",
                   "sdrl.teacher_sampler.max_steps=4", "sdrl.curriculum_max_steps=[2]", "sdrl.kl_estimator=k3",
                   "sdrl.kl_weight=0.1", "sdrl.anchor_weight=0", "sdrl.inner_epochs=1", "sdrl.num_minibatches=1",
                   f"sdrl.reward={REWARD_MODULE}:reward", "optim.lr=0.01", "checkpoint.every=1", "checkpoint.keep=3",
                   "checkpoint.async_save=false", "trainer.eval_every=0", "logging.jsonl=false", f"run.name={name}",
                   "sdrl.teacher=ema", "lora.train_router=true", f"checkpoint.init_from={tmp_path}/stage1/params")
        with pytest.MonkeyPatch.context() as mp:
            mp.syspath_prepend(str(tmp_path))
            mp.delitem(sys.modules, REWARD_MODULE, raising=False)
            return train(cfg, progress=False, save_params_at_end=False, return_session=True,
                         mesh=make_mesh({"fsdp": 1}, devices=jax.devices()[:1]))

    straight, session = run("straight")
    assert set(_flat(session.reference)) == {p for p in _flat(straight.state.params) if "/router/" in p}
    assert set(_flat(session.ema)) == {p for p in _flat(straight.state.params) if "/router/" in p or "/lora/" in p}
    run("resumed")
    ckpt = tmp_path / "resumed" / "checkpoints"
    shutil.rmtree(ckpt / "2")  # as if killed after iteration 1's checkpoint
    resumed, again = run("resumed")
    assert resumed.start_step == 1 and resumed.final_step == 2
    a, b = _flat(straight.state.params), _flat(resumed.state.params)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(session.ema), jax.tree.leaves(again.ema)))
    assert straight.last_metrics["loss"] == resumed.last_metrics["loss"]


def test_init_from_an_adapted_run_folds_its_adapters_into_the_base(tmp_path):
    """An adapted stage-1 run's params (adapters recorded in the metadata; other rank and targets than this run's)
    become this run's base, merged: the base model gives the stage-1 model's logits, so the KL reference ("the base
    with the adapters off") is the stage-1 model, and this run's adapters start at their initial values (B = 0)."""
    from dgemma.checkpoint.lora_params import lora_metadata
    from dgemma.checkpoint.params import save_params
    from dgemma.parallel.mesh import make_mesh
    from dgemma.parallel.rules import get_rules, state_shardings
    from dgemma.train.lora_init import restore_init_params
    from dgemma.train.lora_setup import adapted_factory
    from dgemma.train.state import split_params
    from dgemma.train.trainer import _default_model_factory

    from dgemma.config import load_config

    stage1 = load_config(REPO / "configs/stage2/tiny.yaml", [*ONE_LAYER, "lora.rank=4", "lora.alpha=8.0",
                                                             "lora.targets=['attn/[qkvo]_proj$', 'experts/(gate|up|down)$']",
                                                             f"run.output_dir={tmp_path}"], env={})
    s1_graphdef, s1_params = _adapted(stage1)  # trained-looking stage-1 adapters (non-zero B), rank 4
    save_params(tmp_path / "stage1/params", 5, s1_params, metadata=lora_metadata(stage1.lora))
    cfg = _cfg(tmp_path, f"checkpoint.init_from={tmp_path}/stage1/params")  # rank 2, attention + MLP + experts
    _, fresh = split_params(adapted_factory(cfg, _default_model_factory(cfg.model_config))(nnx.Rngs(0)))
    mesh = make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    target = jax.tree.map(  # the trainer's restore target: the abstract params on their mesh shardings
        lambda sh, var: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), var),
        state_shardings(fresh, mesh, get_rules(cfg.mesh.rules)), fresh)

    params = restore_init_params(cfg, target, fresh)

    adapters, got_adapters = _flat(fresh.filter(nnx.LoRAParam)), _flat(params.filter(nnx.LoRAParam))
    assert set(got_adapters) == set(adapters) and all(np.array_equal(got_adapters[k], adapters[k]) for k in adapters)
    stage1_logits = np.asarray(nnx.merge(s1_graphdef, s1_params)(TOKENS))
    base_logits = np.asarray(_plain_model(cfg, params)(TOKENS))
    unfolded = np.asarray(_plain_model(cfg, s1_params)(TOKENS))  # stage 1's base alone: what restoring whole gave
    assert np.abs(stage1_logits - unfolded).max() > 1e-3  # the stage-1 adapters matter here
    np.testing.assert_allclose(base_logits, stage1_logits, atol=1e-5, rtol=0)

"""The inference and training stages on the Gemma 4 family twins (E2B-like: per-layer embeddings, KV sharing of both
layer types, double-wide MLP; E4B-like; 31B-like: dense, own-V full layers): the entropy-bounded sampler, its AR
fallback, `dgemma eval` and an SD·RL run through `dgemma train`.

Each check compares against an independent computation: the sampler's recorded states against a block-by-block
reference built from fresh caches (and against the one-pass training layout), its AR rows against `ar.generate`
(itself equal to transformers' `generate`, tests/model/test_family_parity.py), the evaluator's outputs against direct
decoding of the in-memory model the checkpoint was written from. The E2B-like twin runs in the default suite (every
new path), the other two under -m slow.
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from support.block_layout import assert_rel_close, perturb_params
from dgemma.cli.main import main as cli_main
from dgemma.inference.ar import generate as ar_generate
from dgemma.inference.replay import replay_logits
from dgemma.inference.rollout import rollout
from dgemma.inference.sampler import AR_FALLBACK, SamplerConfig, sample
from dgemma.model.cache import KVCache
from dgemma.model.config import preset
from dgemma.model.transformer import Transformer

REPO = Path(__file__).resolve().parents[2]
TWINS = [pytest.param(n, marks=() if n == "tiny_e2b" else pytest.mark.slow) for n in ("tiny_e2b", "tiny_e4b",
                                                                                        "tiny_31b")]
P, K = 6, 4
# the stop rule off (confidence 0): every block runs all K steps, so each step's state is a distinct input; no EOS
CFG = SamplerConfig(max_steps=K, max_new_tokens=16, eos_ids=(999,), entropy_bound=0.5, confidence_threshold=0.0)


@pytest.fixture(scope="module")
def twins():
    """name -> a twin with self-conditioning, every weight moved off its initial value (built once per module)."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = perturb_params(Transformer(preset(name, tie_layer_scalar=False), rngs=nnx.Rngs(0)))
        return cache[name]
    return get


@pytest.fixture(scope="module")
def rolled(twins):
    """name -> (twin, its recorded rollout of `_prompts()` with CFG and key 1), run once per module."""
    cache = {}

    def get(name):
        if name not in cache:
            prompts, valid = _prompts()
            cache[name] = twins(name), rollout(twins(name), prompts, valid, CFG, jax.random.key(1), group_size=1)
        return cache[name]
    return get


def _prompts(B=2):
    prompts = np.random.default_rng(0).integers(3, 120, (B, P)).astype(np.int32)
    valid = np.ones((B, P), bool)
    valid[1, :2] = False  # row 1 left-padded
    prompts[~valid] = 0
    return prompts, valid


@nnx.jit
def _encode(model, tokens, cache, valid):
    return model.encode(tokens, cache, valid)


@nnx.jit
def _tempered(model, canvas, cache, soft, tau):
    z = model.logits(model.decode(canvas, cache, soft_embeds=soft)) / tau[:, None, None]
    return z, model.soft_embed(z)


@pytest.mark.parametrize("name", TWINS)
def test_sampler_states_equal_block_by_block_reference(rolled, name):
    """Every recorded sampler state (canvas, SC input, tau) run through a reference that encodes the prompt and the
    committed blocks into a fresh cache and calls the decoder: the sampler's own log-probabilities and argmaxes, its
    next SC input (= soft embedding of this step's tempered logits), its committed tokens (the argmax of the last
    step) and its final cache all come back; the one-pass training layout (replay) gives the same logits."""
    model, ro = rolled(name)
    prompts, valid = _prompts()
    r = ro.record
    B, L, nb = 2, model.cfg.canvas_length, r.n_blocks
    assert nb == 2 and r.soft_embeds is not None and bool(np.asarray(r.step_ran).all())
    h, cache = _encode(model, jnp.asarray(prompts), KVCache.init(model.cfg, B, P + nb * L), jnp.asarray(valid))
    ref_z = []
    for b in range(nb):
        zs = []
        for k in range(K):
            z, soft = _tempered(model, r.canvas[b, k], cache, r.soft_embeds[b, k], r.tau[b, k])
            zs.append(np.asarray(z))
            logp = jnp.take_along_axis(jax.nn.log_softmax(z, -1), r.proposal[b, k][..., None], -1)[..., 0]
            assert_rel_close(logp, r.logp[b, k], tol=1e-4, msg=f"{name} logp block {b} step {k}")
            np.testing.assert_array_equal(np.argmax(zs[-1], -1), np.asarray(r.draft[b, k]), err_msg=f"{b} {k}")
            if k + 1 < K:
                assert_rel_close(np.asarray(r.soft_embeds[b, k + 1], np.float32), np.asarray(soft, np.float32),
                                 tol=1e-4, msg=f"{name} SC input block {b} step {k + 1}")
        np.testing.assert_array_equal(np.asarray(r.tokens[b]), np.argmax(zs[-1], -1))  # no EOS: argmax committed
        ref_z.append(zs)
        h, cache = _encode(model, r.tokens[b], cache, jnp.ones((B, L), bool))
    # the sampler's cache holds exactly prompt + committed blocks; KV-shared layers have no slots of their own
    got = ro.result.cache
    for i in range(model.cfg.num_hidden_layers):
        if model.cfg.kv_producer(i) is not None:
            assert got.keys[i].shape[1] == 0 and got.values[i].shape[1] == 0
            continue
        assert_rel_close(got.keys[i], cache.keys[i], tol=1e-4, msg=f"{name} cache keys layer {i}")
        assert_rel_close(got.values[i], cache.values[i], tol=1e-4, msg=f"{name} cache values layer {i}")
    np.testing.assert_array_equal(np.asarray(got.length), np.asarray(cache.length))
    np.testing.assert_array_equal(np.asarray(got.valid), np.asarray(cache.valid))
    # the training layout: one forward evaluates block 0 at step 0 and block 1 at its last step
    steps = jnp.asarray([[0, K - 1]] * B)
    z, ok = jax.jit(lambda s: replay_logits(model, r, ro.prompts, ro.prompt_valid, s))(steps)
    assert bool(np.asarray(ok).all())
    for b, k in enumerate((0, K - 1)):
        assert_rel_close(np.asarray(z[:, b]), ref_z[b][k], tol=5e-5, msg=f"{name} replay block {b} step {k}")


@pytest.mark.parametrize("name", TWINS)
def test_ar_rows_and_fallback_equal_ar_generate(rolled, name):
    """Row 1 decodes AR inside a diffusion batch (one token at a time into the KV-shared cache, teacher-forcing row
    0's committed tokens): row 1 equals `ar.generate` greedy, row 0 equals the pure-diffusion run (the recorded
    rollout: recording changes nothing). "auto" with a stop rule that never fires drops every draft and equals AR
    greedy."""
    model, ro = rolled(name)
    prompts, valid = _prompts()
    ar = np.asarray(ar_generate(model, prompts, valid, max_new_tokens=16, eos_ids=(999,), pad_id=0))
    mixed = sample(model, prompts, valid, CFG, jax.random.key(1), mode=("diffusion", "ar"))
    np.testing.assert_array_equal(mixed.tokens[0], ro.tokens[0])
    np.testing.assert_array_equal(mixed.tokens[1], ar[1])
    assert not np.array_equal(ro.tokens[1], ar[1])  # the diffusion row differs from AR: the comparison means something
    never = sample(model, prompts, valid, CFG, jax.random.key(1), mode="auto")
    np.testing.assert_array_equal(never.tokens, ar)
    assert (never.stop_reason == AR_FALLBACK).all() and (never.ar_forwards == 16).all()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny_e2b", "tiny_e4b", "tiny_31b"])
def test_sharded_sampler_states_equal_single_device(rolled, name):
    """The sampler on a (data 1, fsdp 2) mesh (the PLE table's columns and every weight's embed axis split, the batch
    split): the states both runs reach agree, to fp32 rounding, in the sampler's own log-probabilities (a random twin
    amplifies rounding through self-conditioning: later steps are compared only where the canvases agree)."""
    from dgemma.parallel.mesh import make_mesh

    model, ro = rolled(name)
    prompts, valid = _prompts()
    mesh = make_mesh({"data": 1, "fsdp": 2}, devices=jax.devices()[:2])
    res = sample(model, prompts, valid, CFG.replace(record_states=True), jax.random.key(1), mesh=mesh)
    assert len(res.cache.keys[0].sharding.device_set) == 2
    got, want = res.record, ro.record
    np.testing.assert_array_equal(np.asarray(got.canvas[:, 0]), np.asarray(want.canvas[:, 0]))  # same draws
    assert_rel_close(got.logp[:, 0], want.logp[:, 0], tol=1e-4, msg=f"{name} first step")
    same = (np.asarray(got.canvas[:, 1]) == np.asarray(want.canvas[:, 1])).all(-1)  # [nb, B]
    assert same.any()
    assert_rel_close(np.asarray(got.logp[:, 1])[same], np.asarray(want.logp[:, 1])[same], tol=1e-3,
                     msg=f"{name} second step")


# MARK: `dgemma eval` and SD·RL on a saved twin ------------------------------------------------------------------
STAGE1 = str(REPO / "configs/stage1/tiny.yaml")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (run config, in-memory twin, its params checkpoint root), the twin of `configs/stage1/tiny.yaml` with
    `model.preset=<name>`: the params a stage-1 run of that config writes (`save_params`, the trainer's format)."""
    from dgemma.checkpoint import save_params
    from dgemma.config import load_config

    cache = {}

    def get(name, model_overrides=()):
        if (name, model_overrides) not in cache:
            cfg = load_config(STAGE1, [f"model.preset={name}", *model_overrides])
            model = perturb_params(Transformer(cfg.model_config, rngs=nnx.Rngs(1)), seed=4)
            root = tmp_path_factory.mktemp(f"params_{name}")
            save_params(root, 0, nnx.state(model, nnx.Param))
            cache[name, model_overrides] = (cfg, model, root)
        return cache[name, model_overrides]
    return get


@pytest.mark.slow  # 19 s per twin: `dgemma eval` on a saved twin; the twins' stage tests above stay default
@pytest.mark.parametrize("name", TWINS)
def test_dgemma_eval_on_a_saved_twin(checkpoints, name, tmp_path):
    """`dgemma eval` on the twin's checkpoint: the model it restores is the twin, bit for bit, and it reports per mode
    the outputs of decoding the held-out prompts directly (AR: `ar.generate`; diffusion: the sampler with the
    evaluator's key) with exact match and tokens per forward computed from those outputs."""
    from dgemma.cli.common import restore_model
    from dgemma.data.rewards import score_rows
    from dgemma.eval.heldout import held_out_rows

    cfg, model, root = checkpoints(name)
    code = cli_main(["eval", "-c", STAGE1, f"model.preset={name}", "--checkpoint", str(root), "--modes",
                     "ar,diffusion", "--batches", "1", "--batch-size", "4", "--plot-dir", str(tmp_path),
                     "sampler.max_steps=4"])
    assert code == 0
    res = json.loads((tmp_path / "eval.json").read_text())
    restored, _ = restore_model(cfg, str(root), sampling=True)  # as the command does: its compiled programs serve
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                                 nnx.to_flat_state(nnx.state(restored, nnx.Param)), strict=True):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))
    held = held_out_rows(cfg.data, rows=4, batch_size=4, train_streams=[(cfg.data, cfg.trainer.steps)])
    batch = held.batch(0)
    R = batch["diffusion_weight"].shape[1]
    prompts = np.asarray(batch["tokens"])[:, :-R]
    valid = np.asarray(batch["valid"])[:, :-R].astype(bool)
    eos, pad = tuple(held.tokenizer.stop_ids), int(held.tokenizer.pad_id)
    scfg = SamplerConfig.from_section(cfg.sampler, max_steps=4, max_new_tokens=R, eos_ids=eos, pad_id=pad,
                                      mode="diffusion")
    want = {"ar": np.asarray(ar_generate(restored, prompts, valid, max_new_tokens=R, eos_ids=eos, pad_id=pad)),
            "diffusion": sample(restored, prompts, valid, scfg, jax.random.fold_in(jax.random.key(0), 0)).tokens}
    examples = [held.source[int(i)] for i in batch["index"]]
    for mode, tokens in want.items():
        rows, metrics = res[mode]["rows"], res[mode]["metrics"]
        assert rows["index"] == [int(i) for i in batch["index"]]
        np.testing.assert_array_equal(np.asarray(rows["output"]), tokens, err_msg=mode)
        reward = score_rows(examples, [list(map(int, t)) for t in tokens], held.tokenizer)
        assert metrics["exact_match"] == pytest.approx(float(np.mean(reward))) and metrics["n"] == 4
        assert metrics["tpf"] == pytest.approx(sum(rows["tokens"]) / sum(rows["forwards"]))
        assert sum(rows["tokens"]) == int((tokens != pad).sum())


# a reward that differs between the rollouts of a group (a random twin never solves a task): a real PG gradient
REWARD = """
def mean_id(examples, generations, tokenizer):
    return [sum(g) / (128.0 * max(len(g), 1)) for g in generations]
"""


# the default suite's run: the E2B-like twin cut to 3 layers [sliding, full, full] with the last one KV-shared
# (per-layer embeddings, a shared double-wide layer reading its producer): the train step's compile scales with depth
SHORT_E2B = ("model.num_hidden_layers=3", "model.layer_types=[sliding_attention, full_attention, full_attention]",
             "model.num_kv_shared_layers=1")
SDRL_CASES = [pytest.param("tiny_e2b", SHORT_E2B, id="tiny_e2b_3_layers")] + [
    pytest.param(n, (), marks=pytest.mark.slow, id=n) for n in ("tiny_e2b", "tiny_e4b", "tiny_31b")]


@pytest.mark.parametrize(("name", "model_overrides"), SDRL_CASES)
def test_sdrl_iteration_on_a_twin(checkpoints, name, model_overrides, tmp_path, monkeypatch):
    """One SD·RL iteration (student and teacher rollouts, replay, PPO / SD / KL / anchor terms, two inner epochs)
    through the trainer (`run_sdrl`, what `dgemma train` runs for a stage-2 config) from `configs/stage2/tiny.yaml`
    with `checkpoint.init_from` the twin's params, on one device: finite losses, the params moved, and the saved
    params reload into the twin and run."""
    from dgemma.checkpoint.model import restore_model
    from dgemma.config import load_config
    from dgemma.parallel.mesh import make_mesh
    from dgemma.train.sdrl.run import run_sdrl

    _, model, root = checkpoints(name, model_overrides)
    (tmp_path / "family_stage_reward.py").write_text(REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(str(REPO / "configs/stage2/tiny.yaml"), [
        f"model.preset={name}", *model_overrides, f"run.output_dir={tmp_path}", "run.name=s2", "trainer.steps=1",
        "data.batch_size=2", "sdrl.group_size=2", "sampler.max_steps=4", "sdrl.curriculum_max_steps=[3]",
        "sdrl.kl_estimator=k3", "sdrl.teacher_sampler.max_steps=4", "sdrl.teacher_sampler.stability_threshold=1",
        "sdrl.reward=family_stage_reward:mean_id", "checkpoint.every=1", "checkpoint.async_save=false",
        "logging.jsonl=true", f"checkpoint.init_from={root}"])
    one = make_mesh({"data": 1}, devices=jax.devices()[:1])
    summary = run_sdrl(cfg, mesh=one, progress=False)
    assert summary.final_step == 1
    rows = [json.loads(x) for x in (tmp_path / "s2" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    for k in ("loss", "loss_pg", "loss_sd", "loss_kl", "loss_anchor", "grad_norm", "reward", "steps_per_block"):
        assert math.isfinite(rows[0][k]), (k, rows[0][k])
    assert rows[0]["states"] > 0 and rows[0]["grad_norm"] > 0
    trained, _ = restore_model(cfg.model_config, tmp_path / "s2" / "params", mesh=one, rules=cfg.mesh.rules)
    before = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    after = dict(nnx.to_flat_state(nnx.state(trained, nnx.Param)))
    assert before.keys() == after.keys()
    moved = [p for p in before if not np.array_equal(np.asarray(before[p][...]), np.asarray(after[p][...]))]
    assert len(moved) > len(before) // 2, f"{len(moved)} of {len(before)} parameters moved"
    tokens = jnp.asarray(_prompts()[0])
    forward = nnx.jit(lambda m, t: m(t))
    out = np.asarray(forward(trained, tokens))
    assert np.isfinite(out).all() and not np.array_equal(out, np.asarray(forward(model, tokens)))

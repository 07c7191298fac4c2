"""Replay of recorded states through the training forward (dgemma.inference.replay) and its determinism.

The sampler's tempered logits at a recorded state are recomputed by the one-pass [clean ; noisy] forward with every
block evaluated at once: sliding layers (window 4) with a context far beyond it, left-padded prompts,
self-conditioning on, three blocks, rows that stop at different steps.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from dgemma.inference import eb_accept
from dgemma.inference.replay import gather_states, replay_logits, replay_logprobs
from dgemma.inference.rollout import rollout
from dgemma.inference.sampler import SamplerConfig
from dgemma.model.cache import KVCache
from support.block_layout import assert_rel_close
from support.sampler_helpers import batch_prompts as _batch_prompts, converging_model

K = 6
CFG = SamplerConfig(max_steps=K, max_new_tokens=24, eos_ids=(999,), entropy_bound=1.0, confidence_threshold=0.02)


@pytest.fixture(scope="module")
def setup():
    model = converging_model()
    prompts, valid, _ = _batch_prompts(B=2, P=6, seed=4)
    valid[1, :2] = False  # row 1 left-padded
    prompts[1, :2] = 0
    ro = rollout(model, prompts, valid, CFG, jax.random.key(21), group_size=2)
    return model, ro


def _sampler_logits(model, ro):
    """The sampler's computation at every recorded state: the cached decoder on the recorded inputs."""
    r = ro.record
    B, L = r.batch_size, r.canvas_length
    encode = jax.jit(lambda toks, cache, v: model.encode(toks, cache, v)[1])
    tempered = jax.jit(lambda canvas, cache, soft, tau: model.logits(model.decode(canvas, cache, soft_embeds=soft))
                       / tau[:, None, None])
    cache = encode(ro.prompts, KVCache.init(model.cfg, B, ro.prompts.shape[1] + r.n_blocks * L), ro.prompt_valid)
    out = np.zeros((r.n_blocks, K, B, L, model.cfg.vocab_size), np.float32)
    for b in range(r.n_blocks):
        for k in range(K):
            out[b, k] = tempered(r.canvas[b, k], cache, r.soft_embeds[b, k], r.tau[b, k])
        cache = encode(r.tokens[b], cache, jnp.ones((B, L), bool))
    return out


def test_replay_reproduces_the_sampler_logits_at_every_state(setup):
    model, ro = setup
    r = ro.record
    assert r.n_blocks == 3 and r.soft_embeds is not None
    assert len(set(np.asarray(r.steps).ravel().tolist())) > 1  # rows / blocks stop at different steps
    ref = _sampler_logits(model, ro)
    replay = jax.jit(lambda steps: replay_logits(model, r, ro.prompts, ro.prompt_valid, steps))
    L = r.canvas_length
    rng = np.random.default_rng(0)
    checked = 0
    for k in range(K):
        z, valid = replay(jnp.full((r.batch_size, r.n_blocks), k))
        z, valid = np.asarray(z), np.asarray(valid)
        np.testing.assert_array_equal(valid, np.asarray(r.step_ran[:, k]).T)
        for row in range(r.batch_size):
            for b in range(r.n_blocks):
                if not valid[row, b]:
                    continue
                assert_rel_close(z[row, b], ref[b, k, row], msg=f"{k} {row} {b}")
                # the recorded decisions come back from the replayed logits (replay reproduces the states)
                np.testing.assert_array_equal(eb_accept.argmax(z[row, b]), r.draft[b, k, row])
                if k + 1 < K and r.step_ran[b, k + 1, row]:
                    acc = np.asarray(r.accept[b, k, row])
                    np.testing.assert_array_equal(np.asarray(r.canvas[b, k + 1, row])[acc],
                                                  np.asarray(r.proposal[b, k, row])[acc])
                checked += 1
    # mixed steps per (row, block) in one forward give the same numbers
    steps = rng.integers(0, 2, (r.batch_size, r.n_blocks))
    z, valid = replay(jnp.asarray(steps))
    for row in range(r.batch_size):
        for b in range(r.n_blocks):
            if valid[row, b]:
                assert_rel_close(np.asarray(z[row, b]), ref[b, steps[row, b], row])
    assert checked >= 12


def test_replay_logprobs_and_gradient(setup):
    model, ro = setup
    r = ro.record
    B, nb, L = r.batch_size, r.n_blocks, r.canvas_length
    out = jnp.asarray(ro.tokens).reshape(B, nb, L)
    targets = jnp.stack([out, jnp.asarray(r.draft[:, 0]).transpose(1, 0, 2)], axis=-1)  # two token sets
    graphdef, state = nnx.split(model)

    def f(state):
        m = nnx.merge(graphdef, state)
        lp, valid = replay_logprobs(m, r, ro.prompts, ro.prompt_valid, 1, targets, chunk=5)
        return jnp.sum(jnp.where(valid[..., None, None], lp, 0.0)), lp

    (loss, lp), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(state)
    z, _ = jax.jit(lambda: replay_logits(model, r, ro.prompts, ro.prompt_valid, 1))()  # one program, not eager ops
    want = jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), targets, axis=-1)
    assert_rel_close(np.asarray(lp), np.asarray(want))
    assert np.isfinite(float(loss))
    flat = {tuple(p): v[...] for p, v in nnx.to_flat_state(grads)}
    assert float(jnp.abs(flat[("self_conditioning", "mlp", "down")]).sum()) > 0  # step 1: the SC input is used
    assert float(jnp.abs(flat[("embedder", "embedding")]).sum()) > 0
    assert all(np.isfinite(np.asarray(g)).all() for g in flat.values())
    _, soft_embeds, tau, _ = gather_states(r, 0)
    assert (np.asarray(soft_embeds) == 0).all() and np.allclose(np.asarray(tau), CFG.t_max)


def test_same_key_same_rollouts_and_greedy_teacher_is_deterministic(setup):
    model, ro = setup
    prompts, valid = np.asarray(ro.prompts[::2]), np.asarray(ro.prompt_valid[::2])
    again = rollout(model, prompts, valid, CFG, jax.random.key(21), group_size=2)
    for x, y in zip(jax.tree.leaves(ro.record), jax.tree.leaves(again.record)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    teacher = CFG.replace(greedy=True, stability_threshold=2, entropy_bound=0.02, max_steps=2 * K)
    t1 = rollout(model, prompts, valid, teacher, jax.random.key(4), group_size=1)
    t2 = rollout(model, prompts, valid, teacher, jax.random.key(4), group_size=1)
    np.testing.assert_array_equal(t1.tokens, t2.tokens)
    for x, y in zip(jax.tree.leaves(t1.record), jax.tree.leaves(t2.record)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # greedy: the accepted proposals are the argmax
    acc, prop, amax = (np.asarray(x) for x in (t1.record.accept, t1.record.proposal, t1.record.draft))
    np.testing.assert_array_equal(prop[acc], amax[acc])


# MARK: the sampler's own log-probabilities, on a model that keeps denoising -----------------------------------------
# every weight random at full scale (no damped residual): the argmax never settles, so with the stop rule off and a low
# entropy bound each block runs all K steps, accepting a few tokens per step and renoising the rest; consecutive
# canvases differ, so replaying the wrong step's canvas gives other numbers. Same shapes as CFG: the sampler compiled
# for `setup` is reused (entropy_bound / confidence_threshold are runtime values).
NOISY_CFG = CFG.replace(entropy_bound=0.05, confidence_threshold=0.0)


@pytest.fixture(scope="module")
def noisy():
    model = converging_model(seed=7, post=1.0, sc=1.0)
    prompts, valid, _ = _batch_prompts(B=2, P=6, seed=5)
    ro = rollout(model, prompts, valid, NOISY_CFG, jax.random.key(3), group_size=2)
    return model, ro


def _replayed_proposal_logprobs(model, ro, record):
    """log π_θ(y_k | s_k) [K, B, nb, L] of the recorded proposals, replayed from `record`'s states."""
    fn = jax.jit(lambda k, y: replay_logprobs(model, record, ro.prompts, ro.prompt_valid, k, y)[0])
    return np.stack([np.asarray(fn(k, jnp.moveaxis(record.proposal[:, k], 0, 1))) for k in range(K)])


def test_replay_gives_back_the_logprobs_the_sampler_itself_computed(noisy):
    model, ro = noisy
    r = ro.record
    assert r.logp.shape == r.proposal.shape and r.logp.dtype == jnp.float32
    assert np.asarray(r.step_ran).all() and r.n_blocks == 3  # every block ran all K steps
    canvas = np.asarray(r.canvas)
    assert (canvas[:, 1:] != canvas[:, :-1]).any(-1).all()  # every step's canvas differs from the one before
    accepted = np.asarray(r.accept).sum(-1)
    assert (accepted < r.canvas_length).all()  # no step accepts the whole canvas: a real multi-step denoise
    want = np.moveaxis(np.asarray(r.logp), 2, 1)  # [nb, K, B, L] -> [nb, B, K, L]
    got = _replayed_proposal_logprobs(model, ro, r)  # [K, B, nb, L]
    got = got.transpose(2, 1, 0, 3)  # -> [nb, B, K, L]
    assert np.abs(want).max() > 1.0  # log-probabilities of a spread distribution, not ~0
    assert_rel_close(got, want, msg="replayed vs sampler log pi(y_k | s_k)")
    # the same check on a record that holds the canvas (and SC input) of the previous or the next step fails by far
    for shift in (1, -1):
        wrong = r.replace(canvas=jnp.roll(r.canvas, shift, axis=1), soft_embeds=jnp.roll(r.soft_embeds, shift, axis=1))
        bad = _replayed_proposal_logprobs(model, ro, wrong).transpose(2, 1, 0, 3)
        keep = slice(1, K) if shift == 1 else slice(0, K - 1)  # the steps that really got another step's state
        err = np.abs(bad[:, :, keep] - want[:, :, keep]).max() / max(1.0, np.abs(want).max())
        assert err > 1e-2, (shift, err)

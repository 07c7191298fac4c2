"""Rollouts that record their states (dgemma.inference.rollout): the record is faithful to what the sampler did.

(That the recorded inputs give back the sampler's logits and decisions is tested in test_rollout_replay.py.)"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dgemma.diffusion.sdrl_objective import rollout_advantages
from dgemma.inference import eb_accept
from dgemma.inference.rollout import rollout
from dgemma.inference.sampler import EOS_FINISHED, SamplerConfig, sample
from support.sampler_helpers import batch_prompts as _batch_prompts, converging_model

# the shapes and settings of test_rollout_replay.py (2 prompts x 2 copies, 3 blocks): the compiled sampler is shared
CFG = SamplerConfig(max_steps=6, max_new_tokens=24, eos_ids=(999,), entropy_bound=1.0, confidence_threshold=0.02)


@pytest.fixture(scope="module")
def model():
    return converging_model()


@pytest.fixture(scope="module")
def runs(model):
    prompts, valid, _ = _batch_prompts(B=4, P=6, seed=4)
    plain = sample(model, prompts, valid, CFG, jax.random.key(11))
    rec = sample(model, prompts, valid, CFG.replace(record_states=True), jax.random.key(11))
    return prompts, valid, plain, rec


def test_recording_changes_nothing_and_has_the_contract_shapes(model, runs):
    _, _, plain, res = runs
    np.testing.assert_array_equal(res.tokens, plain.tokens)
    np.testing.assert_array_equal(res.steps_per_block, plain.steps_per_block)
    # same decisions; XLA may fuse the entropy reduction differently once it is also written out (last-bit rounding)
    np.testing.assert_allclose(res.entropy_trace, plain.entropy_trace, rtol=1e-5, atol=1e-6)
    r = res.record
    nb, K, B, L, H = res.n_blocks, CFG.max_steps, 4, model.cfg.canvas_length, model.cfg.hidden_size
    assert (r.n_blocks, r.max_steps, r.batch_size, r.canvas_length) == (nb, K, B, L)
    assert r.canvas.shape == r.accept.shape == r.draft.shape == r.proposal.shape == (nb, K, B, L)
    assert r.soft_embeds.shape == (nb, K, B, L, H) and r.soft_embeds.dtype == jnp.dtype(model.cfg.execution.dtype)
    assert r.tau.shape == r.mean_entropy.shape == r.step_ran.shape == (nb, K, B)
    assert r.tokens.shape == (nb, B, L) and r.steps.shape == r.stop_reason.shape == r.block_ran.shape == (nb, B)
    # the SC embedding dominates; no V-wide arrays
    assert r.nbytes() < 2 * int(r.soft_embeds.size) * r.soft_embeds.dtype.itemsize
    np.testing.assert_array_equal(np.asarray(r.steps).T, res.steps_per_block)
    sub = r.rows(np.asarray([2, 0]))
    np.testing.assert_array_equal(sub.canvas, np.asarray(r.canvas)[:, :, [2, 0]])
    np.testing.assert_array_equal(sub.soft_embeds, np.asarray(r.soft_embeds)[:, :, [2, 0]])
    np.testing.assert_array_equal(sub.tokens, np.asarray(r.tokens)[:, [2, 0]])
    np.testing.assert_array_equal(np.asarray(r.step_ran).sum(1).T, res.steps_per_block)
    np.testing.assert_array_equal(np.asarray(r.stop_reason).T, res.stop_reason)
    np.testing.assert_array_equal(np.moveaxis(np.asarray(r.tokens), 0, 1).reshape(B, -1), res.tokens)
    tau = eb_accept.temperature_schedule(K, CFG.t_min, CFG.t_max)
    valid = np.asarray(r.step_ran)
    np.testing.assert_array_equal(np.asarray(r.tau)[valid], np.broadcast_to(tau[None, :, None], valid.shape)[valid])
    np.testing.assert_allclose(np.asarray(r.mean_entropy).transpose(2, 0, 1)[valid.transpose(2, 0, 1)],
                               res.entropy_trace[valid.transpose(2, 0, 1)], rtol=0, atol=0)


def test_record_is_a_consistent_trajectory(runs):
    _, _, res, _ = runs
    r = runs[3].record
    canvas, acc, prop, amax = (np.asarray(x) for x in (r.canvas, r.accept, r.proposal, r.draft))
    valid = np.asarray(r.step_ran)
    soft_embeds = np.asarray(r.soft_embeds)
    assert (soft_embeds[:, 0] == 0).all()  # no self-conditioning at the first step
    for b in range(r.n_blocks):
        for row in range(r.batch_size):
            n = int(valid[b, :, row].sum())
            assert valid[b, :n, row].all() and not valid[b, n:, row].any()  # a row stops once and for all
            for k in range(n - 1):  # accepted proposals become the next canvas
                np.testing.assert_array_equal(canvas[b, k + 1, row][acc[b, k, row]], prop[b, k, row][acc[b, k, row]])
                assert acc[b, k, row].any() and np.abs(soft_embeds[b, k + 1, row]).sum() > 0
            if n and r.stop_reason[b, row] != EOS_FINISHED:  # the committed block is the last step's argmax
                np.testing.assert_array_equal(np.asarray(r.tokens)[b, row], amax[b, n - 1, row])


def test_rollout_groups_have_distinct_keys_and_are_reproducible(model):
    prompts, valid, _ = _batch_prompts(B=2, P=6, seed=4)  # 2 prompts x 2 copies: the fixture's compiled shapes
    a = rollout(model, prompts, valid, CFG, jax.random.key(3), group_size=2)
    assert a.tokens.shape[0] == 4 and list(a.prompt_index) == [0, 0, 1, 1]
    # the iteration's advantages group each prompt's own rows (rows with the same prompt), never across prompts
    adv, _ = rollout_advantages(np.array([1.0, 0.0, 5.0, 3.0]), a.prompt_index, 2)
    rows_of = [np.flatnonzero((np.asarray(a.prompts) == np.asarray(a.prompts)[r]).all(1)) for r in (0, 2)]
    assert [x.tolist() for x in rows_of] == [[0, 1], [2, 3]]
    for rows in rows_of:
        assert abs(float(np.asarray(adv)[rows].sum())) < 1e-6 and np.abs(np.asarray(adv)[rows]).min() > 0.9
    np.testing.assert_array_equal(np.asarray(a.prompts[1]), prompts[0])
    np.testing.assert_array_equal(np.asarray(a.prompt_valid[2]), valid[1])
    init = np.asarray(a.record.canvas[0, 0])
    assert len({tuple(x) for x in init}) == 4  # every copy starts from its own canvas
    assert len({tuple(x) for x in a.tokens}) > 1
    b = rollout(model, prompts, valid, CFG, jax.random.key(3), group_size=2)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    for x, y in zip(jax.tree.leaves(a.record), jax.tree.leaves(b.record)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="record_states"):
        sample(model, prompts, valid, CFG.replace(record_states=True), jax.random.key(0), mode="auto")

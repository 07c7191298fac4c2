"""States per rollout (§12.6 M): subsampling keeps at most M recorded steps of each rollout, every rollout stays
represented, and the per-rollout weights keep each rollout's total weight (so the loss estimates the mean over all
of its states)."""

import numpy as np

from dgemma.diffusion.sdrl_objective import pair_weights
from dgemma.diffusion.sdrl_config import SDRLConfig
from dgemma.train.sdrl.states import subsample_states


def _states():
    # rollout r ran steps 0..(3 + 4 r): 3, 7, 11, 15 states; np.nonzero order (k major, then r)
    valid = np.zeros((20, 4), bool)
    for r in range(4):
        valid[: 3 + 4 * r, r] = True
    return np.nonzero(valid)


def test_at_most_m_per_rollout_and_every_rollout_kept():
    ks, rs = _states()
    k2, r2 = subsample_states(ks, rs, 4, np.random.default_rng(0))
    counts = np.bincount(r2, minlength=4)
    assert counts.tolist() == [3, 4, 4, 4]
    order = np.lexsort((r2, k2))
    assert (order == np.arange(len(k2))).all()  # still sorted by step, then rollout
    kept = set(zip(k2.tolist(), r2.tolist()))
    assert kept <= set(zip(ks.tolist(), rs.tolist()))


def test_draws_depend_on_the_rng_and_cover_late_steps():
    ks, rs = _states()
    seen = set()
    for seed in range(30):
        k2, r2 = subsample_states(ks, rs, 2, np.random.default_rng(seed))
        seen |= set(k2[r2 == 3].tolist())
    assert len(seen) > 10  # uniform over rollout 3's 15 steps, not the first M


def test_each_rollout_keeps_its_total_weight():
    ks, rs = _states()
    L = 5
    for m in (0, 2):
        k2, r2 = (ks, rs) if m == 0 else subsample_states(ks, rs, m, np.random.default_rng(1))
        w = np.asarray(pair_weights(np.ones((len(r2), L), bool), r2, 4))
        per_rollout = np.bincount(r2, weights=w * L, minlength=4)
        np.testing.assert_allclose(per_rollout, 0.25, rtol=1e-6)


def test_negative_m_is_refused():
    import pytest

    with pytest.raises(ValueError, match="states_per_rollout"):
        SDRLConfig(states_per_rollout=-1)


def test_unvisited_states_replay_at_tau_one():
    """A block that stopped earlier than another holds the record's initial tau 0 at the later steps; replaying those
    (weight-0) states must not divide by 0 (the inf logits gave NaN gradients through the masked loss)."""
    from types import SimpleNamespace

    import jax.numpy as jnp

    from dgemma.inference.replay import gather_states

    nb, K, B, L = 2, 3, 2, 4
    step_valid = jnp.zeros((nb, K, B), bool).at[0].set(True).at[1, 0].set(True)  # block 1 ran only step 0
    tau = jnp.where(step_valid, 0.7, 0.0)
    rec = SimpleNamespace(canvas=jnp.zeros((nb, K, B, L), jnp.int32), sc=None, tau=tau, step_valid=step_valid)
    _, _, t, valid = gather_states(rec, 2)
    assert valid.tolist() == [[True, False], [True, False]]
    np.testing.assert_allclose(np.asarray(t), [[0.7, 1.0], [0.7, 1.0]])

"""States per rollout (M = `sdrl.states_per_rollout`): subsampling keeps at most M recorded steps of each rollout, every rollout stays
represented, and the per-rollout weights keep each rollout's total weight (so the loss estimates the mean over all
of its states)."""

import numpy as np

from dgemma.diffusion.sdrl_objective import pair_weights
from dgemma.config.sdrl_section import SDRLConfig
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
    step_ran = jnp.zeros((nb, K, B), bool).at[0].set(True).at[1, 0].set(True)  # block 1 ran only step 0
    tau = jnp.where(step_ran, 0.7, 0.0)
    rec = SimpleNamespace(canvas=jnp.zeros((nb, K, B, L), jnp.int32), soft_embeds=None, tau=tau, step_ran=step_ran)
    _, _, t, valid = gather_states(rec, 2)
    assert valid.tolist() == [[True, False], [True, False]]
    np.testing.assert_allclose(np.asarray(t), [[0.7, 1.0], [0.7, 1.0]])


def test_state_rows_are_one_typed_container_with_the_shapes_of_row_fields():
    """`build_state_rows` returns `StateRows` whose fields, shapes and dtypes are exactly `ROW_FIELDS` through
    `row_shapes` (what the planner compiles the update for); padding and minibatches keep the type and the fields,
    and the update's batch is the fed fields only."""
    import jax.numpy as jnp
    import pytest

    from dgemma.inference.record import RolloutRecord
    from dgemma.train.sdrl.states import ROW_FIELDS, StateRows, build_state_rows, minibatches, pad_rows, row_shapes
    from dgemma.train.sdrl.targets import build_targets

    nb, K, B, L, H, P, EOS, PAD = 2, 3, 4, 2, 3, 3, 1, 0
    rng = np.random.default_rng(0)
    steps = np.array([[3, 1, 2, 3], [2, 0, 1, 0]])
    step_ran = np.arange(K)[None, :, None] < steps[:, None, :]
    tokens = np.array([[[5, 6], [5, 9], [7, 7], [7, EOS]], [[EOS, PAD], [PAD, PAD], [EOS, PAD], [PAD, PAD]]])
    ints = lambda *s: jnp.asarray(rng.integers(2, 9, s), jnp.int32)  # noqa: E731
    rec = RolloutRecord(canvas=ints(nb, K, B, L),
                        soft_embeds=jnp.asarray(rng.normal(size=(nb, K, B, L, H)), jnp.float32),
                        tau=jnp.full((nb, K, B), 0.5), accept=jnp.zeros((nb, K, B, L), bool), draft=ints(nb, K, B, L),
                        proposal=ints(nb, K, B, L), mean_entropy=jnp.zeros((nb, K, B)),
                        step_ran=jnp.asarray(step_ran), tokens=jnp.asarray(tokens), steps=jnp.asarray(steps),
                        stop_reason=jnp.zeros((nb, B), jnp.int32), block_ran=jnp.asarray(steps > 0))
    committed = tokens.transpose(1, 0, 2)
    t = build_targets(committed[[0, 2]], np.array([1.0, 0.0]), committed, np.array([1.0, 0, 0, 0]),
                      np.array([5, 1, 3, 3]), 2, reward_max=1.0, eos_ids=(EOS,), pad_id=PAD, tail_id=EOS)
    rows = build_state_rows(rec, np.ones((B, P), np.int32), np.ones((B, P), bool), np.array([0, 0, 1, 1]), t,
                            np.zeros(B), n_blocks=nb, eos_ids=(EOS,), pad_id=PAD, tail_id=EOS)
    assert isinstance(rows, StateRows) and len(rows) == 9
    rows = rows.replace(logp_old=np.zeros((len(rows), nb, L), np.float32),
                        logp_ref=np.zeros((len(rows), nb, L), np.float32))
    want = row_shapes(len(rows), P=P, nb=nb, L=L, H=H, V=32, act_dtype="float32", self_conditioning=True, kl="k3")
    fed = rows.batch()
    assert {k: (v.shape, v.dtype) for k, v in fed.items()} == want
    assert set(rows.keys()) == set(want) | {"rollout", "step"} and "ref_logits" not in rows
    assert {f.name for f in ROW_FIELDS if not f.fed} == {"rollout", "step"}
    with pytest.raises(KeyError):
        rows["ref_logits"]
    padded = pad_rows(rows, 8)
    assert isinstance(padded, StateRows) and len(padded) == 16 and padded.keys() == rows.keys()
    assert not padded.pg_mask[9:].any() and not padded.weight[9:].any() and padded.logp_old.shape[0] == 16
    mbs = minibatches(padded, 2, np.random.default_rng(0))
    assert all(isinstance(m, StateRows) and len(m) == 8 and m.keys() == rows.keys() for m in mbs)
    assert sum(m.weight.sum() for m in mbs) == pytest.approx(2 * padded.weight.sum())


def test_each_state_row_holds_the_recorded_inputs_of_its_own_step():
    """Row (k, r) replays the state the sampler denoised at step k of rollout r: its canvas, SC embedding and τ are the
    record's INPUTS of that step (not those of step k + 1, the canvas the step produced), for every block that ran it.
    Each recorded value here encodes its (block, step, row), so a row taking another step's state fails."""
    import jax.numpy as jnp

    from dgemma.inference.record import RolloutRecord
    from dgemma.train.sdrl.states import build_state_rows
    from dgemma.train.sdrl.targets import build_targets

    nb, K, B, L, H = 2, 4, 3, 2, 2
    # [nb, K, B]: each recorded value names its (block, step, row)
    code = 100 * np.arange(nb)[:, None, None] + 10 * np.arange(K)[None, :, None] + np.arange(B)[None, None]
    steps = np.array([[4, 2, 3], [3, 0, 1]])  # [nb, B]: row 1 finished after block 0
    step_ran = np.arange(K)[None, :, None] < steps[:, None, :]
    tokens = np.full((nb, B, L), 5, np.int32)
    rec = RolloutRecord(
        canvas=jnp.asarray(np.repeat(code[..., None], L, -1), jnp.int32),
        soft_embeds=jnp.asarray(np.repeat(code[..., None, None], L, -2).repeat(H, -1), jnp.float32),
        tau=jnp.asarray(code / 1000.0 + 0.5, jnp.float32), accept=jnp.zeros((nb, K, B, L), bool),
        draft=jnp.zeros((nb, K, B, L), jnp.int32), proposal=jnp.zeros((nb, K, B, L), jnp.int32),
        mean_entropy=jnp.zeros((nb, K, B)), step_ran=jnp.asarray(step_ran), tokens=jnp.asarray(tokens),
        steps=jnp.asarray(steps), stop_reason=jnp.zeros((nb, B), jnp.int32), block_ran=jnp.asarray(steps > 0))
    committed = tokens.transpose(1, 0, 2)
    t = build_targets(committed, np.ones(B), committed, np.zeros(B), np.ones(B), 1, reward_max=1.0, eos_ids=(1,),
                      pad_id=0, tail_id=1)
    rows = build_state_rows(rec, np.ones((B, 3), np.int32), np.ones((B, 3), bool), np.arange(B), t, np.zeros(B),
                            n_blocks=nb, eos_ids=(1,), pad_id=0, tail_id=1)
    assert len(rows) == 4 + 2 + 3  # every (k, r) where some block ran step k
    checked = 0
    for i, (k, r) in enumerate(zip(rows["step"], rows["rollout"])):
        for b in range(nb):
            assert rows["state_ran"][i, b] == step_ran[b, k, r]
            if not step_ran[b, k, r]:
                continue
            want = code[b, k, r]
            assert (rows["canvas"][i, b] == want).all(), (k, r, b, rows["canvas"][i, b])
            assert (rows["soft_embeds"][i, b] == want).all(), (k, r, b)
            assert rows["tau"][i, b] == np.float32(want / 1000.0 + 0.5), (k, r, b)
            checked += 1
    assert checked == step_ran.sum()

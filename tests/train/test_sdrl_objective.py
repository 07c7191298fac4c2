"""SD·RL objective math (docs/sdrl.md §2): advantages, PPO surrogate, gated SD, KL, switches."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma.diffusion import sdrl_objective as so
from dgemma.config.sdrl_section import SDRLConfig, TermWeights
from dgemma.train.sdrl.targets import agreement_gate, build_targets, prefix_gate, supervised_tokens

EOS, PAD = 1, 0


def test_advantages_zero_mean_per_group_and_zero_std_groups_are_zero():
    r = jnp.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.3, 0.7, 0.1, 0.9], [0.0, 0.0, 0.0, 0.0]])
    adv, zero = so.group_advantages(r)
    np.testing.assert_allclose(np.asarray(adv).mean(1), 0.0, atol=1e-6)
    assert np.asarray(zero).tolist() == [False, True, False, True]
    assert np.all(np.asarray(adv)[[1, 3]] == 0.0)
    np.testing.assert_allclose(np.asarray(adv)[0], [1, -1, -1, 1], atol=1e-5)  # (R - mean) / std


def _policy_batch(seed=0, N=6, L=3, V=5, R=3):
    rng = np.random.default_rng(seed)
    return dict(
        x=jnp.asarray(rng.normal(size=(N, L, 4))),
        output=jnp.asarray(rng.integers(0, V, (N, L)), jnp.int32),
        target=jnp.asarray(rng.integers(0, V, (N, L)), jnp.int32),
        pg_mask=jnp.asarray(rng.random((N, L)) < 0.8),
        sd_mask=jnp.asarray(rng.random((N, L)) < 0.5),
        rollout=jnp.asarray(np.arange(N) % R, jnp.int32),
        advantage=jnp.asarray(rng.normal(size=N)),
    )


def _linear_logits(w, x):
    return jnp.einsum("nld,dv->nlv", x, w)


def test_ppo_gradient_at_ratio_one_equals_reinforce_by_finite_differences():
    """At inner step 1 (π_old = π_θ, ρ = 1) the clipped surrogate's gradient is the REINFORCE gradient
    −Σ w Â ∇log π(o); checked against central finite differences of the REINFORCE objective in float64."""
    with jax.enable_x64(True):
        b = _policy_batch()
        b = {k: (v.astype(jnp.float64) if v.dtype == jnp.float32 else v) for k, v in b.items()}
        w0 = jnp.asarray(np.random.default_rng(1).normal(size=(4, 5)), jnp.float64)
        weight = so.pair_weights(b["pg_mask"], b["rollout"], 3).astype(jnp.float64)
        logp_old = jax.lax.stop_gradient(so.token_logprobs(_linear_logits(w0, b["x"]), b["output"]))

        def ppo(w):
            logp = so.token_logprobs(_linear_logits(w, b["x"]), b["output"]).astype(jnp.float64)
            return so.pg_loss(logp, logp_old.astype(jnp.float64), b["advantage"], b["pg_mask"], weight, 0.2)[0]

        def reinforce(w):
            logp = so.token_logprobs(_linear_logits(w, b["x"]), b["output"]).astype(jnp.float64)
            return -jnp.sum(weight * b["advantage"] * jnp.sum(jnp.where(b["pg_mask"], logp, 0.0), -1))

        g = np.asarray(jax.grad(ppo)(w0))
        reinforce = jax.jit(reinforce)
        h = 1e-6
        fd = np.zeros_like(g)
        for idx in np.ndindex(g.shape):
            e = np.zeros(g.shape)
            e[idx] = h
            fd[idx] = (float(reinforce(w0 + e)) - float(reinforce(w0 - e))) / (2 * h)
        assert np.abs(g).max() > 1e-3  # a real gradient
        np.testing.assert_allclose(g, fd, atol=1e-5, rtol=0)


def test_zero_std_group_gives_zero_pg_gradient():
    b = _policy_batch(N=4, R=4)  # 4 rollouts = 2 prompts x G = 2, one state row each
    rewards = jnp.array([[1.0, 1.0], [0.0, 1.0]])  # group 0 all equal
    adv, zero = so.group_advantages(rewards)
    adv_row = adv.reshape(-1)[b["rollout"]]
    w0 = jnp.asarray(np.random.default_rng(2).normal(size=(4, 5)), jnp.float32)
    weight = so.pair_weights(b["pg_mask"], b["rollout"], 4)
    only_group0 = b["pg_mask"] & (b["rollout"] < 2)[:, None]  # rows of rollouts 0, 1 = prompt 0

    def loss(w, mask):
        logp = so.token_logprobs(_linear_logits(w, b["x"]), b["output"])
        return so.pg_loss(logp, jax.lax.stop_gradient(logp) + 0.3, adv_row, mask, weight, 0.2)[0]

    assert bool(zero[0]) and not bool(zero[1])
    assert np.all(np.asarray(jax.grad(loss)(w0, only_group0)) == 0.0)
    assert np.abs(np.asarray(jax.grad(loss)(w0, b["pg_mask"]))).max() > 0  # the other group does move


def test_clip_fraction_and_clipped_side_has_no_gradient():
    logp_old = jnp.zeros((1, 2))
    mask = jnp.ones((1, 2), bool)

    def loss(lp, adv):
        return so.pg_loss(lp, logp_old, jnp.array([adv]), mask, jnp.ones(1), 0.2)

    lp = jnp.array([[0.5, 0.0]])  # ratio e^0.5 = 1.65 > 1.2 on position 0
    (l, frac), g = jax.value_and_grad(loss, has_aux=True)(lp, 1.0)
    assert float(frac) == 0.5 and float(g[0, 0]) == 0.0 and float(g[0, 1]) != 0.0
    _, frac_neg = loss(lp, -1.0)  # negative advantage: the upper clip does not bind
    assert float(frac_neg) == 0.0


def test_no_sd_gradient_without_verified_target_or_with_a_different_prefix():
    """The SD mask comes from build_targets + prefix_gate; a row without y* or with a different committed prefix
    contributes exactly zero gradient, the others do not."""
    L, n, G = 2, 2, 2
    teacher = np.array([[[5, 6], [EOS, PAD]], [[7, 7], [7, EOS]]])  # prompt 0 teacher right, prompt 1 wrong
    students = np.array([[[5, 6], [EOS, PAD]], [[5, 9], [EOS, PAD]],   # prompt 0: same prefix | different block 0
                         [[7, 8], [EOS, PAD]], [[7, 7], [EOS, PAD]]])  # prompt 1: no row correct
    t = build_targets(teacher, np.array([1.0, 0.0]), students, np.array([1.0, 0.0, 0.0, 0.0]), np.array([3, 3, 3, 3]),
                      G, reward_max=1.0, eos_ids=(EOS,), pad_id=PAD, tail_id=EOS)
    assert t.has_target.tolist() == [True, False] and t.source.tolist() == [1, 0]
    gate = prefix_gate(students, t, np.array([0, 0, 1, 1]))
    # row 0: both blocks; row 1: block 0 (empty prefix) but not block 1 (its block 0 differs); prompt 1: none
    assert gate.tolist() == [[True, True], [True, False], [False, False], [False, False]]
    assert t.supervised[0].tolist() == [[5, 6], [EOS, EOS]]  # tail filled like the stage-1 layout

    x = jnp.asarray(np.random.default_rng(0).normal(size=(4 * n, L, 4)), jnp.float32)  # state = (row, block)
    target = jnp.asarray(t.supervised[[0, 0, 1, 1]].reshape(4 * n, L))
    sd_mask = jnp.asarray(np.repeat(gate.reshape(-1)[:, None], L, 1))
    weight = jnp.ones(4 * n) / 8
    w0 = jnp.asarray(np.random.default_rng(3).normal(size=(4, 8)), jnp.float32)

    def sd_of_rows(w, rows):
        logp = so.token_logprobs(_linear_logits(w, x), target)
        keep = jnp.zeros(4 * n, bool).at[jnp.asarray(rows)].set(True)[:, None]
        return so.sd_loss(logp, sd_mask & keep, weight)

    for rows in ([3], [4, 5, 6, 7]):  # row 1 block 1 (prefix differs); all states of prompt 1 (no target)
        assert np.all(np.asarray(jax.grad(sd_of_rows)(w0, rows)) == 0.0)
    assert np.abs(np.asarray(jax.grad(sd_of_rows)(w0, [0, 1, 2]))).max() > 0


def test_agreement_gate_drops_states_after_an_accepted_token_differs_from_the_target():
    """sd_target=verified_agree: a state is trained toward y* only while every token its block accepted before it
    equals y*; step 0 always agrees, positions where y* is PAD (after its EOS) are not compared, prompts without y*
    never."""
    y = np.array([[[5, 6], [EOS, PAD]], [[7, 7], [7, EOS]]])  # two prompts, 2 blocks of L = 2
    t = build_targets(y, np.array([1.0, 0.0]), y[[0, 0, 1, 1]], np.zeros(4), np.ones(4), 2, reward_max=1.0,
                      eos_ids=(EOS,), pad_id=PAD, tail_id=EOS)
    nb, K, B, L = 2, 3, 4, 2
    accept = np.zeros((nb, K, B, L), bool)
    proposal = np.full((nb, K, B, L), 9, np.int32)
    # row 0: block 0 accepts 5 at step 0, 6 at step 1 (agree); block 1 accepts EOS then junk after EOS (ignored)
    accept[0, 0, 0, 0], proposal[0, 0, 0, 0] = True, 5
    accept[0, 1, 0, 1], proposal[0, 1, 0, 1] = True, 6
    accept[1, 0, 0, :], proposal[1, 0, 0] = True, [EOS, 4]
    # row 1: block 0 accepts 4 (not y*'s 5) at step 1: states 2 onward disagree; unaccepted proposals never count
    accept[0, 1, 1, 0], proposal[0, 1, 1, 0] = True, 4
    proposal[0, 0, 1, 1] = 3
    gate = agreement_gate(accept, proposal, t, np.array([0, 0, 1, 1]), PAD)
    assert gate.shape == (nb, K, B)
    assert gate[:, :, 0].all()
    assert gate[0, :, 1].tolist() == [True, True, False] and gate[1, :, 1].all()  # block 1 starts afresh
    assert not gate[:, :, 2:].any()  # prompt 1 has no verified target


def test_best_correct_student_is_the_target_when_the_teacher_fails():
    teacher = np.array([[[3, EOS]]])
    students = np.array([[[4, EOS]], [[5, EOS]], [[5, EOS]]])
    t = build_targets(teacher, np.array([0.0]), students, np.array([0.0, 1.0, 1.0]), np.array([9, 7, 4]), 3,
                      reward_max=1.0, eos_ids=(EOS,), pad_id=PAD, tail_id=EOS)
    assert t.source.tolist() == [2] and t.student_row.tolist() == [2]  # the shorter of the two correct rows


def test_supervised_tokens_tail_fill_only_inside_the_eos_block():
    x = np.array([[[4, EOS, PAD], [PAD, PAD, PAD]]])
    assert supervised_tokens(x, (EOS,), PAD, EOS).tolist() == [[[4, EOS, EOS], [PAD, PAD, PAD]]]
    assert supervised_tokens(x, (EOS,), PAD, PAD).tolist() == x.tolist()


def test_kl_is_zero_at_the_reference_and_positive_elsewhere():
    z = jnp.asarray(np.random.default_rng(0).normal(size=(3, 4, 7)), jnp.float32)
    o = jnp.asarray(np.random.default_rng(1).integers(0, 7, (3, 4)), jnp.int32)
    lp = so.token_logprobs(z, o)
    assert float(jnp.max(jnp.abs(so.k3(lp, lp)))) == 0.0
    assert float(jnp.max(jnp.abs(so.exact_kl(z, z)))) < 1e-6
    assert float(jnp.min(so.exact_kl(z, z + jnp.arange(7.0) * 0.3))) > 0
    assert float(jnp.min(so.k3(lp, lp + 0.1))) > 0


def _terms_batch():
    rng = np.random.default_rng(0)
    N, L, V = 4, 3, 6
    z = jnp.asarray(rng.normal(size=(N, L, V)), jnp.float32)
    out = jnp.asarray(rng.integers(0, V, (N, L)), jnp.int32)
    b = dict(output=out, target=jnp.asarray(rng.integers(0, V, (N, L)), jnp.int32),
             pg_mask=jnp.ones((N, L), bool), sd_mask=jnp.asarray(rng.random((N, L)) < 0.6),
             logp_old=so.token_logprobs(z, out) - 0.05, logp_ref=so.token_logprobs(z, out) + 0.2,
             advantage=jnp.asarray(rng.normal(size=N), jnp.float32), weight=jnp.full((N,), 0.25 / L))
    return z, b


@pytest.mark.parametrize("term", ["pg", "sd", "kl", "anchor"])
def test_switching_each_term_off_changes_the_loss(term):
    z, b = _terms_batch()
    terms = so.sdrl_terms(so.token_logprobs(z, b["output"]), so.token_logprobs(z, b["target"]), b, clip_eps=0.2)
    on = TermWeights(pg=1.0, sd=1.0, kl=0.5, anchor=0.1, anchor_ar=0.1)
    off = dataclasses.replace(on, **{term: 0.0})
    full, part = so.total_loss(terms, on, 0.7), so.total_loss(terms, off, 0.7)
    assert float(full) != float(part)
    expected = {"pg": terms["loss_pg"], "sd": terms["loss_sd"], "kl": 0.5 * terms["loss_kl"], "anchor": 0.07}[term]
    np.testing.assert_allclose(float(full - part), float(expected), rtol=1e-5)


def test_a_switched_off_term_cannot_leak_nan():
    z, b = _terms_batch()
    terms = so.sdrl_terms(so.token_logprobs(z, b["output"]), so.token_logprobs(z, b["target"]), b, clip_eps=0.2)
    terms = dict(terms, loss_sd=jnp.float32(jnp.nan))
    assert np.isfinite(float(so.total_loss(terms, TermWeights(1.0, 0.0, 0.1, 0.0, 0.0))))


def test_arms_switch_terms():
    assert SDRLConfig(arm="rl_only").weights().sd == 0 and SDRLConfig(arm="rl_only").weights().pg == 1
    assert SDRLConfig(arm="sd_only").weights().pg == 0 and SDRLConfig(arm="sd_only").weights().sd == 1
    assert SDRLConfig(arm="sdrl_curriculum").uses_curriculum and not SDRLConfig(arm="sdrl").uses_curriculum


def test_pair_weights_average_each_rollout_then_rollouts():
    mask = jnp.array([[1, 1], [1, 0], [0, 0], [1, 1]], bool)
    w = so.pair_weights(mask, jnp.array([0, 0, 1, 2]), 3)
    # rollout 0: 3 pairs -> 1/9 each; rollout 1: none -> 0; rollout 2: 2 pairs -> 1/6
    np.testing.assert_allclose(np.asarray(w), [1 / 9, 1 / 9, 0.0, 1 / 6], rtol=1e-6)


def test_efficiency_reward_only_on_correct_outputs():
    r = so.efficiency_reward(jnp.array([1.0, 0.0]), jnp.array([4, 4]), 16, 0.1)
    np.testing.assert_allclose(np.asarray(r), [1.075, 0.0], rtol=1e-6)

"""Every term of the SD·RL objective (4.2), pinned so a wrong sign, direction, token set or grouping fails.

    L = w_pg L_PG + λ_SD L_SD + β KL(π_θ ‖ π_ref) + λ_anc L_anchor          (dgemma/diffusion/sdrl_objective.py)

Plain arrays: the SD gradient raises log π(y*) where gated and ignores the rest; the exact KL and k3 against
hand-computed values of an asymmetric pair (KL(p‖q) ≠ KL(q‖p)) and their gradients; per-prompt advantage groups;
the efficiency bonus only at full credit. Tiny random model through the trainer's own loss
(`dgemma.train.sdrl.loss.make_sdrl_loss_fn`): each term against an independent numpy evaluation of the replayed
logits (so o and y* cannot be swapped and the exact KL cannot be reversed), the anchor's weight, and one SGD step
on L_SD alone. On a recorded rollout: the PPO ratio's action is each state's final output, not the drawn proposal.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dgemma.diffusion import sdrl_objective as so
from dgemma.config.sdrl_section import SDRLConfig, TermWeights
from dgemma.diffusion.stage1 import Stage1Config, stage1_loss
from support.block_layout import stage1_batch
from support.sampler_helpers import converging_model

# MARK: asymmetric pair ----------------------------------------------------------------------------------------------
# p = π_θ, q = π_ref on a 3-token vocabulary. By hand (natural logs):
#   KL(p‖q) = .7 ln(.7/.2) + .2 ln(.2/.3) + .1 ln(.1/.5) = 0.6348972650817144
#   KL(q‖p) = .2 ln(.2/.7) + .3 ln(.3/.2) + .5 ln(.5/.1) = 0.6758058949504259   (the reversed direction)
#   k3 on token o with ratio r = q(o)/p(o): r − ln r − 1 = [0.5384772542, 0.0945348919, 2.3905620876]
#                               reversed (r = p/q):        [1.2472370315, 0.0721317748, 0.8094379124]
#   ∂k3/∂ln p(o) = 1 − q(o)/p(o) = [0.7142857143, −0.5, −4.0]
#   ∂KL(p‖q)/∂θ_i (p = softmax θ) = p_i (ln(p_i/q_i) − KL(p‖q)) = [0.4325059924, −0.2080724746, −0.2244335178]
P_ = np.array([0.7, 0.2, 0.1])
Q_ = np.array([0.2, 0.3, 0.5])
KL_PQ, KL_QP = 0.6348972650817144, 0.6758058949504259
K3_PQ = np.array([0.5384772542096536, 0.09453489189183562, 2.3905620875658995])
K3_QP = np.array([1.247237031504632, 0.07213177477483113, 0.8094379124341002])
DK3 = np.array([0.7142857142857142, -0.5, -4.0])
DKL = np.array([0.4325059923895574, -0.20807247463797574, -0.2244335177515815])


def test_exact_kl_is_kl_of_policy_to_reference_with_its_gradient():
    theta, ref = jnp.log(jnp.asarray(P_, jnp.float32)) + 0.3, jnp.log(jnp.asarray(Q_, jnp.float32)) - 1.1  # any shift
    assert KL_PQ != pytest.approx(KL_QP, abs=1e-3)  # the pair tells the directions apart
    np.testing.assert_allclose(float(so.exact_kl(theta, ref)), KL_PQ, rtol=1e-5)
    np.testing.assert_allclose(float(so.exact_kl(ref, theta)), KL_QP, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.grad(so.exact_kl)(theta, ref)), DKL, rtol=1e-4, atol=1e-6)
    # one SGD step on the KL moves π_θ toward π_ref
    step = theta - 0.1 * jax.grad(so.exact_kl)(theta, ref)
    assert float(so.exact_kl(step, ref)) < KL_PQ
    # zero case: no divergence and no gradient at the reference
    assert abs(float(so.exact_kl(ref, ref))) < 1e-6
    assert np.abs(np.asarray(jax.grad(so.exact_kl)(ref, ref))).max() < 1e-6


def test_k3_is_the_unbiased_estimator_of_kl_policy_to_reference_with_its_gradient():
    lp, lr = jnp.log(jnp.asarray(P_, jnp.float32)), jnp.log(jnp.asarray(Q_, jnp.float32))
    np.testing.assert_allclose(np.asarray(so.k3(lp, lr)), K3_PQ, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(so.k3(lr, lp)), K3_QP, rtol=1e-5)
    # E_{o ~ π_θ}[k3] = KL(π_θ ‖ π_ref) (not the reverse): tokens are drawn from the policy
    np.testing.assert_allclose(float(np.sum(P_ * np.asarray(so.k3(lp, lr)))), KL_PQ, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.grad(lambda x: jnp.sum(so.k3(x, lr)))(lp)), DK3, rtol=1e-5)
    assert float(jnp.max(jnp.abs(so.k3(lr, lr)))) == 0.0
    assert float(jnp.max(jnp.abs(jax.grad(lambda x: jnp.sum(so.k3(x, lr)))(lr)))) == 0.0


def test_sdrl_terms_kl_is_k3_of_the_output_against_the_reference():
    """`sdrl_terms`' default KL term: Σ w Σ m k3(log π_θ(o), log π_ref(o)), in that direction."""
    lp = jnp.log(jnp.asarray(P_, jnp.float32))[None]  # one row, three positions
    batch = dict(pg_mask=jnp.ones((1, 3), bool), sd_mask=jnp.zeros((1, 3), bool), logp_old=lp,
                 logp_ref=jnp.log(jnp.asarray(Q_, jnp.float32))[None], advantage=jnp.zeros(1),
                 weight=jnp.full((1,), 0.5))
    terms = so.sdrl_terms(lp, lp, batch, clip_eps=0.2)
    np.testing.assert_allclose(float(terms["loss_kl"]), 0.5 * K3_PQ.sum(), rtol=1e-5)


# MARK: SD gradient on plain arrays ---------------------------------------------------------------------------------
def test_one_sgd_step_on_sd_raises_log_pi_of_the_target_where_gated_only():
    """Logits are the parameters (one free row per (state, position)): one SGD step on (4.2) with only λ_SD on raises
    log π(y*) at every gated position and leaves every other position's logits exactly as they were."""
    rng = np.random.default_rng(0)
    N, L, V = 4, 5, 7
    theta = jnp.asarray(rng.normal(size=(N, L, V)), jnp.float32)
    target = jnp.asarray(rng.integers(0, V, (N, L)), jnp.int32)
    output = jnp.asarray(rng.integers(0, V, (N, L)), jnp.int32)
    gate = rng.random((N, L)) < 0.5
    gate[0, 0], gate[0, 1] = True, False
    batch = dict(pg_mask=jnp.ones((N, L), bool), sd_mask=jnp.asarray(gate), logp_old=jnp.zeros((N, L)),
                 logp_ref=jnp.zeros((N, L)), advantage=jnp.asarray(rng.normal(size=N), jnp.float32),
                 weight=jnp.full((N,), 1.0 / (N * L)), omega=jnp.asarray([1.0, 2.0, 0.5, 1.0]))
    sd_only = TermWeights(pg=0.0, sd=1.0, kl=0.0, anchor=0.0, anchor_ar=0.0)

    def loss(th):
        terms = so.sdrl_terms(so.token_logprobs(th, output), so.token_logprobs(th, target), batch, clip_eps=0.2)
        return so.total_loss(terms, sd_only)

    logp_y = np.asarray(so.token_logprobs(theta, target))
    want = -np.sum(np.asarray(batch["weight"] * batch["omega"])[:, None] * np.where(gate, logp_y, 0.0))
    np.testing.assert_allclose(float(loss(theta)), want, rtol=1e-6)  # −Σ w ω m log π(y*)
    g = jax.grad(loss)(theta)
    after = theta - 5.0 * g
    gained = np.asarray(so.token_logprobs(after, target)) - logp_y
    assert (gained[gate] > 1e-4).all(), gained[gate]
    np.testing.assert_array_equal(np.asarray(after)[~gate], np.asarray(theta)[~gate])  # ungated: untouched
    # an ungated position's target does not enter the loss at all
    other = target.at[0, 1].set((target[0, 1] + 1) % V)

    def loss_other(th):
        terms = so.sdrl_terms(so.token_logprobs(th, output), so.token_logprobs(th, other), batch, clip_eps=0.2)
        return so.total_loss(terms, sd_only)

    assert float(loss_other(theta)) == float(loss(theta))


# MARK: advantages ---------------------------------------------------------------------------------------------------
def test_group_advantages_by_hand():
    adv, zero = so.group_advantages(jnp.asarray([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    # prompt 0: mean 2/3, std sqrt(2)/3 -> (1/3, 1/3, −2/3) / (sqrt(2)/3) = (1/√2, 1/√2, −√2)
    np.testing.assert_allclose(np.asarray(adv)[0], [2 ** -0.5, 2 ** -0.5, -(2 ** 0.5)], rtol=1e-5)
    assert np.asarray(zero).tolist() == [False, True] and (np.asarray(adv)[1] == 0).all()


@pytest.mark.parametrize("layout", ["prompt_major", "rollout_major", "shuffled"])
def test_rollout_advantages_group_the_rows_of_each_prompt(layout):
    """Â of the rollout rows has zero mean (and unit-ish scale) over each prompt's G rows, whatever the row order: a
    grouping by reshape across prompts would mix prompt 0's rewards (all high) with prompt 1's (all low)."""
    Q, G = 3, 4
    rewards = np.array([[1.0, 0.9, 0.8, 1.0], [0.0, 0.1, 0.0, 0.3], [0.5, 0.5, 0.5, 0.5]], np.float32)  # [Q, G]
    if layout == "prompt_major":  # the rollout's own order: row r = prompt r // G (`dgemma.inference.rollout`)
        index = np.repeat(np.arange(Q), G)
    elif layout == "rollout_major":
        index = np.tile(np.arange(Q), G)
    else:
        index = np.random.default_rng(0).permutation(np.repeat(np.arange(Q), G))
    flat = np.empty(Q * G, np.float32)
    seen = np.zeros(Q, int)
    for r, q in enumerate(index):  # row r holds the next reward of its prompt
        flat[r] = rewards[q, seen[q]]
        seen[q] += 1
    adv, zero = so.rollout_advantages(flat, index, Q)
    adv = np.asarray(adv)
    want, _ = so.group_advantages(jnp.asarray(rewards))
    for q in range(Q):
        np.testing.assert_allclose(adv[index == q].mean(), 0.0, atol=1e-6)
        np.testing.assert_allclose(np.sort(adv[index == q]), np.sort(np.asarray(want)[q]), rtol=1e-6)
    assert np.asarray(zero).tolist() == [False, False, True]
    assert (adv[index == 0] > -2).all() and adv[index == 0].max() > 0.5  # prompt 0 is not judged against prompt 1


def test_rollout_advantages_reject_unequal_groups():
    with pytest.raises(ValueError, match=r"same number of rollouts, got \[2, 1\]"):
        so.rollout_advantages(np.zeros(3), np.array([0, 0, 1]), 2)
    with pytest.raises(ValueError, match="3 rewards but 2 prompt indices"):
        so.rollout_advantages(np.zeros(3), np.array([0, 1]), 2)


# MARK: efficiency bonus ---------------------------------------------------------------------------------------------
def test_efficiency_bonus_only_for_full_credit():
    r = jnp.array([1.0, 0.5, 0.99, 0.0, 1.0])
    steps = jnp.array([4, 4, 4, 4, 16])
    out = np.asarray(so.efficiency_reward(r, steps, 16, 0.1, reward_max=1.0))
    np.testing.assert_allclose(out, [1.075, 0.5, 0.99, 0.0, 1.0], rtol=1e-6)  # partial credit: no bonus
    # R_max is the setting's: at R_max = 2 a reward of 1 is partial, 2 gets the bonus
    np.testing.assert_allclose(np.asarray(so.efficiency_reward(jnp.array([1.0, 2.0]), jnp.array([8, 8]), 16, 0.1,
                                                               reward_max=2.0)), [1.0, 2.1], rtol=1e-6)


# MARK: the trainer's loss on a tiny random model --------------------------------------------------------------------
N, NB, P = 2, 2, 4


@pytest.fixture(scope="module")
def tiny():
    """A random tiny model (every weight at full scale) and one minibatch of state rows with anchor rows."""
    model = converging_model(seed=11, post=1.0, sc=1.0)
    mc = model.cfg
    L, V, H = mc.canvas_length, mc.vocab_size, mc.hidden_size
    rng = np.random.default_rng(5)
    ints = lambda *s: rng.integers(2, V, s).astype(np.int32)  # noqa: E731
    sd_mask = rng.random((N, NB, L)) < 0.5
    sd_mask[0, 0, :2] = [True, False]
    batch = dict(prompts=ints(N, P), prompt_valid=np.ones((N, P), bool), committed=ints(N, NB, L),
                 canvas=ints(N, NB, L), soft_embeds=(0.3 * rng.normal(size=(N, NB, L, H))).astype(np.float32),
                 tau=np.array([[0.7, 0.5], [0.8, 0.6]], np.float32), state_ran=np.ones((N, NB), bool),
                 output=ints(N, NB, L), target=ints(N, NB, L), pg_mask=np.ones((N, NB, L), bool), sd_mask=sd_mask,
                 advantage=np.array([[1.3, 1.3], [-0.7, -0.7]], np.float32),
                 weight=np.full((N, NB), 1.0 / (N * NB * L), np.float32),
                 omega=np.array([[1.0, 1.5], [0.5, 1.0]], np.float32))
    assert (batch["output"] != batch["target"]).mean() > 0.9
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    from dgemma.train.sdrl.loss import state_logits

    z = np.asarray(jax.jit(lambda b: state_logits(model, b))(batch), np.float64)  # [N, nb, L, V] tempered
    logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
    lo = np.take_along_axis(logp, np.asarray(batch["output"])[..., None], -1)[..., 0]
    ref_z = z + rng.normal(size=z.shape)  # π_ref ≠ π_θ
    ref_lp = ref_z - np.log(np.exp(ref_z - ref_z.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - ref_z.max(-1, keepdims=True)
    batch["logp_old"] = jnp.asarray(lo + rng.normal(scale=0.15, size=lo.shape), jnp.float32)  # some ratios clip
    batch["logp_ref"] = jnp.asarray(np.take_along_axis(ref_lp, np.asarray(batch["output"])[..., None], -1)[..., 0],
                                    jnp.float32)
    batch["ref_logits"] = jnp.asarray(ref_z, jnp.float32)
    anchor = stage1_batch(P, L, NB, left_pad=[0, 1], unused_last_block=[False, True], seed=3)
    return model, batch, logp, ref_lp, anchor


def _numpy_terms(batch, logp, ref_lp, clip_eps=0.2):
    """L_PG, L_SD, exact KL and k3 in float64 from the replayed log-probabilities, following (4.2) literally."""
    b = {k: np.asarray(v, np.float64) if np.asarray(v).dtype.kind == "f" else np.asarray(v) for k, v in batch.items()}
    take = lambda lp, t: np.take_along_axis(lp, t[..., None], -1)[..., 0]  # noqa: E731
    lo, ly, lr = take(logp, b["output"]), take(logp, b["target"]), take(ref_lp, b["output"])
    w, a = b["weight"][..., None], b["advantage"][..., None]
    ratio = np.exp(lo - b["logp_old"])
    surrogate = np.minimum(ratio * a, np.clip(ratio, 1 - clip_eps, 1 + clip_eps) * a)
    pg = -np.sum(w * np.where(b["pg_mask"], surrogate, 0.0))
    sd = np.sum(w * b["omega"][..., None] * np.where(b["sd_mask"], -ly, 0.0))
    exact = np.sum(np.exp(logp) * (logp - ref_lp), -1)
    r = np.exp(lr - lo)
    return dict(loss_pg=pg, loss_sd=sd, exact=np.sum(w * np.where(b["pg_mask"], exact, 0.0)),
                k3=np.sum(w * np.where(b["pg_mask"], r - np.log(r) - 1.0, 0.0)))


def _loss(model, sdrl, batch, key=0):
    from dgemma.train.sdrl.loss import make_sdrl_loss_fn

    fn = make_sdrl_loss_fn(sdrl, Stage1Config())
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s, b: fn(nnx.merge(graphdef, s), b, jax.random.key(key)))(state, batch)


@pytest.mark.parametrize("estimator", ["k3", "exact"])
def test_trainer_loss_terms_read_o_for_pg_and_kl_and_y_star_for_sd(tiny, estimator):
    """Every term of the trainer's loss against numpy on the same replayed logits: PG and KL read the rollout's output
    o, SD reads y*; the exact KL is KL(π_θ ‖ π_ref) over the vocabulary. Swapping o and y* or the KL's direction
    moves a term by far more than the tolerance (asserted below on the numpy side)."""
    model, batch, logp, ref_lp, _ = tiny
    sdrl = SDRLConfig(kl_estimator=estimator, kl_weight=0.3, sd_weight=0.7, anchor_weight=0.0)
    loss, m = _loss(model, sdrl, batch)
    want = _numpy_terms(batch, logp, ref_lp)
    kl = want["exact" if estimator == "exact" else "k3"]
    for name, value in (("loss_pg", want["loss_pg"]), ("loss_sd", want["loss_sd"]), ("loss_kl", kl)):
        np.testing.assert_allclose(float(m[name]), value, rtol=1e-4, err_msg=name)
    np.testing.assert_allclose(float(loss), want["loss_pg"] + 0.7 * want["loss_sd"] + 0.3 * kl, rtol=1e-4)
    # the checks can fail: o <-> y* and the reversed exact KL give other values
    swapped = _numpy_terms({**batch, "output": batch["target"], "target": batch["output"]}, logp, ref_lp)
    assert abs(swapped["loss_pg"] - want["loss_pg"]) > 1e-2 * abs(want["loss_pg"])
    assert abs(swapped["loss_sd"] - want["loss_sd"]) > 1e-2 * abs(want["loss_sd"])
    reverse = _numpy_terms(batch, ref_lp, logp)["exact"]
    assert abs(reverse - want["exact"]) > 1e-2 * want["exact"]


def test_trainer_loss_anchor_weight(tiny):
    """λ_anc L_anchor: the loss moves by exactly λ_anc × the stage-1 loss of the anchor rows (fresh noise of the
    step's key, λ_AR' as its AR weight), and at weight 0 the anchor is absent: the same loss with no anchor rows."""
    model, batch, _, _, anchor = tiny
    rows = {**batch, **{f"anchor/{k}": v for k, v in anchor.items()}}
    base = dict(kl_estimator="k3", kl_weight=0.1, anchor_ar_weight=0.2)
    l0, m0 = _loss(model, SDRLConfig(**base, anchor_weight=0.0), rows)
    l_plain, _ = _loss(model, SDRLConfig(**base, anchor_weight=0.0), batch)
    l5, m5 = _loss(model, SDRLConfig(**base, anchor_weight=0.5), rows)
    assert float(m0["loss_anchor"]) == 0.0 and float(l0) == float(l_plain)
    want, _ = jax.jit(lambda a: stage1_loss(model, a, jax.random.key(0), Stage1Config(lambda_ar=0.2)))(anchor)
    assert float(want) > 0.1
    np.testing.assert_allclose(float(m5["loss_anchor"]), float(want), rtol=1e-5)
    np.testing.assert_allclose(float(l5) - float(l0), 0.5 * float(want), rtol=1e-4)
    for k in ("loss_pg", "loss_sd", "loss_kl"):  # the other terms do not change
        np.testing.assert_allclose(float(m5[k]), float(m0[k]), rtol=1e-6)


def test_one_sgd_step_of_the_trainer_sd_term_raises_log_pi_of_y_star(tiny):
    """SD alone through the trainer's loss: one small SGD step on the model raises Σ_gated w ω log π(y*); the loss
    does not read y* at ungated positions (changing them leaves it bit-identical)."""
    from dgemma.train.sdrl.loss import make_sdrl_loss_fn

    model, batch, logp, _, _ = tiny
    fn = make_sdrl_loss_fn(SDRLConfig(arm="sd_only", kl_weight=0.0, anchor_weight=0.0), Stage1Config())
    graphdef, state = nnx.split(model)
    value_grad = jax.jit(jax.value_and_grad(lambda s, b: fn(nnx.merge(graphdef, s), b, jax.random.key(0))[0]))
    loss, g = value_grad(state, batch)
    sd_mask = np.asarray(batch["sd_mask"])
    ungated = np.asarray(batch["target"]).copy()
    ungated[~sd_mask] = (ungated[~sd_mask] + 1) % model.cfg.vocab_size
    assert float(value_grad(state, {**batch, "target": jnp.asarray(ungated)})[0]) == float(loss)
    gated = np.asarray(batch["target"]).copy()
    gated[0, 0, 0] = (gated[0, 0, 0] + 1) % model.cfg.vocab_size
    assert float(value_grad(state, {**batch, "target": jnp.asarray(gated)})[0]) != float(loss)
    stepped = jax.tree.map(lambda p, d: p - 0.05 * d, state, g)
    loss_after, _ = value_grad(stepped, batch)
    assert float(loss) > 0 and float(loss_after) < float(loss) - 1e-4, (float(loss), float(loss_after))



# MARK: π_old through the trainer ------------------------------------------------------------------------------------
PARITY = """
def parity(examples, generations, tokenizer):
    return [float(sum(1 for t in g if t % 2 == 0) % 2) for g in generations]
"""


def test_pi_old_is_the_student_before_the_update_not_the_reference(tmp_path, monkeypatch):
    """Two SD·RL iterations, one optimizer step each (its metrics are those of the first inner step), a reward that
    varies within groups (a real PG gradient) and a large learning rate: in iteration 2 the student has moved away
    from the frozen reference (k3 KL > 0), yet the PPO ratio π_θ/π_old is 1 on every pair (mean 1, nothing clipped),
    because π_old is the student itself before the update."""
    from pathlib import Path

    from dgemma.config import load_config
    from dgemma.parallel.mesh import make_mesh
    from dgemma.train.sdrl import run_sdrl

    (tmp_path / "parity_reward_terms.py").write_text(PARITY)
    monkeypatch.syspath_prepend(str(tmp_path))
    repo = Path(__file__).resolve().parents[2]
    cfg = load_config(repo / "configs/stage2/tiny.yaml", [
        "model.num_hidden_layers=1", "model.layer_types=[full_attention]", "trainer.steps=2",
        "data.batch_size=2", "sdrl.group_size=2", "sampler.max_steps=4", "sdrl.teacher_sampler.max_steps=8",
        "sdrl.curriculum_max_steps=[3]", "sdrl.kl_estimator=k3", "sdrl.kl_weight=0.01", "sdrl.anchor_weight=0",
        "sdrl.inner_epochs=1", "sdrl.num_minibatches=1", "sdrl.reward=parity_reward_terms:parity",
        "optim.lr=0.01", "sdrl.allow_random_init=true", "checkpoint.every=0", "checkpoint.async_save=false", f"run.output_dir={tmp_path}",
        "run.name=pi_old"])
    history = run_sdrl(cfg, progress=False, mesh=make_mesh({"fsdp": 1}, devices=jax.devices()[:1])).history
    first, second = history
    assert first["zero_std_fraction"] < 1.0  # iteration 1 had a PG gradient: the student moved
    assert second["loss_kl"] > 1e-3, second["loss_kl"]  # student ≠ reference at iteration 2
    for m in history:
        assert abs(m["ratio_mean"] - 1.0) < 1e-5, m["ratio_mean"]
        assert m["clip_fraction"] == 0.0


# MARK: the PPO ratio's action ---------------------------------------------------------------------------------------
def test_the_ppo_ratio_reads_log_pi_of_the_final_output_not_the_proposals():
    """docs/sdrl.md "The PPO ratio's action": on the states of a recorded rollout, every row's PG tokens are its
    rollout's final (tail-filled) output o, the same at every step, and the trainer's L_PG at moved parameters equals
    a float64 hand computation with ρ = π_θ(o | s) / π_old(o | s); the same computation with the proposals the sampler
    drew at each state (and the sampler's own log π_old of them, `record.logp`) gives another value."""
    from dgemma.inference.rollout import rollout
    from dgemma.train.sdrl.loss import make_sdrl_loss_fn, state_logits, state_logprobs
    from dgemma.train.sdrl.states import build_state_rows, committed_blocks
    from dgemma.train.sdrl.targets import build_targets, supervised_tokens
    from test_sdrl_coupled import EOS as NO_EOS, NB, PAD, STUDENT
    from support.sampler_helpers import batch_prompts as _batch_prompts

    model = converging_model(seed=7, post=0.3, sc=0.1)
    prompts, valid, _ = _batch_prompts(B=2, P=5, seed=9)
    ro = rollout(model, prompts, valid, STUDENT, jax.random.key(3), group_size=2)
    committed = committed_blocks(ro.record.tokens, NB, PAD)
    y = build_targets(committed[::2], np.ones(2), committed, np.zeros(4), np.ones(4), 2, reward_max=1.0,
                      eos_ids=(NO_EOS,), pad_id=PAD, tail_id=NO_EOS)
    adv = np.array([1.0, -1.0, 0.8, -0.8])
    rows = build_state_rows(ro.record, ro.prompts, ro.prompt_valid, ro.prompt_index, y, adv, n_blocks=NB,
                            eos_ids=(NO_EOS,), pad_id=PAD, tail_id=NO_EOS)
    np.testing.assert_array_equal(rows["output"], supervised_tokens(committed, (NO_EOS,), PAD, NO_EOS)[rows["rollout"]])
    rec = jax.device_get(ro.record)
    k, r = rows["step"], rows["rollout"]
    proposal = np.asarray(rec.proposal)[:, k, r].transpose(1, 0, 2)  # [N, nb, L]: y_k drawn at each state
    proposal_logp_old = np.asarray(rec.logp)[:, k, r].transpose(1, 0, 2)
    used = rows["pg_mask"]
    assert (proposal != rows["output"])[used].mean() > 0.3  # the two actions differ at many pairs
    graphdef, old = nnx.split(model)
    batch = {f: jnp.asarray(v) for f, v in rows.batch().items()}
    batch["logp_old"] = jax.jit(lambda s, b: state_logprobs(nnx.merge(graphdef, s), b, b["output"]))(old, batch)
    leaves, tree = jax.tree.flatten(old)
    keys = jax.random.split(jax.random.key(4), len(leaves))
    moved = jax.tree.unflatten(tree, [p + 0.05 * jax.random.normal(kk, p.shape, p.dtype)
                                      for p, kk in zip(leaves, keys)])
    fn = make_sdrl_loss_fn(SDRLConfig(arm="rl_only", kl_weight=0.0, anchor_weight=0.0), Stage1Config())
    _, m = jax.jit(lambda s: fn(nnx.merge(graphdef, s), batch, jax.random.key(0)))(moved)
    z = np.asarray(jax.jit(lambda s: state_logits(nnx.merge(graphdef, s), batch))(moved), np.float64)
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    w, a = np.asarray(rows["weight"], np.float64)[..., None], np.asarray(rows["advantage"], np.float64)[..., None]

    def pg(tokens, logp_old):
        ratio = np.exp(np.take_along_axis(logp, tokens[..., None], -1)[..., 0] - logp_old)
        return -np.sum(w * np.where(used, np.minimum(ratio * a, np.clip(ratio, 0.8, 1.2) * a), 0.0))

    want = pg(rows["output"], np.asarray(batch["logp_old"], np.float64))
    np.testing.assert_allclose(float(m["loss_pg"]), want, rtol=1e-4)
    other = pg(proposal, proposal_logp_old)
    assert abs(other - want) > 1e-2 * abs(want), (other, want)

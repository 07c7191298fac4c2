"""The noise-coupled SD target (`sdrl.sd_target=coupled_teacher`, docs/sdrl.md §3).

The teacher decodes every student rollout's own noise: the same initial canvas of every block and the same renoise
draws at every step both run, with its own (larger) step limit K_T and gentler sampler. On a tiny random model that
settles slowly (`support.sampler_helpers.converging_model`):
- the teacher starts each block from the student's canvas, draws the student's renoise tokens, and its answer is a
  deterministic function of (prompt, initial canvas, key);
- the student's SD target is its own rollout's coupled answer, so it changes when the key changes (unlike y*(q));
- one optimizer step on L_SD alone raises the student's log π of the coupled target at its early (step-0) states.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dgemma.config.sdrl_section import SDRLConfig
from dgemma.inference.rollout import rollout
from dgemma.inference.sampler import SamplerConfig
from dgemma.train.sdrl.states import build_state_rows, committed_blocks
from dgemma.train.sdrl.targets import build_targets, coupled_targets
from dgemma.train.sdrl.teacher import coupled_teacher_tokens
from support.sampler_helpers import batch_prompts as _batch_prompts, converging_model

K, NB, Q, G = 4, 2, 2, 2
PAD, EOS = 0, 999  # EOS outside the vocabulary: every rollout runs both blocks
# a low entropy bound: each step accepts a few positions, the rest is renoised
STUDENT = SamplerConfig(max_steps=K, max_new_tokens=16, eos_ids=(EOS,), entropy_bound=0.05, t_max=0.8, t_min=0.4,
                        confidence_threshold=0.02)
TEACHER = STUDENT.replace(max_steps=2 * K, entropy_bound=0.02, t_max=0.6, t_min=0.4, greedy=True,
                          stability_threshold=2)


@pytest.fixture(scope="module")
def model():
    # post-sublayer norms x0.3: the argmax settles slowly; at full scale the model is chaotic, so the recorded and the
    # plain sampler (other XLA fusion, last-bit rounding) would part after a few steps
    return converging_model(seed=7, post=0.3, sc=0.1)


def _student_and_teacher(model, key):
    prompts, valid, _ = _batch_prompts(B=Q, P=5, seed=9)
    ro = rollout(model, prompts, valid, STUDENT, key, group_size=G)
    tok = coupled_teacher_tokens(model, ro.prompts, ro.prompt_valid, TEACHER, key, NB, PAD)
    return ro, tok


@pytest.fixture(scope="module")
def runs(model):
    return {seed: _student_and_teacher(model, jax.random.key(seed)) for seed in (0, 1)}


def test_the_coupled_teacher_decodes_the_students_noise_deterministically(model, runs):
    """Recorded, the coupled teacher's rollout starts every block from the student's initial canvas, and where neither
    accepted a token at step 0 its step-1 canvas holds the student's renoise draws; its answer is the one
    `coupled_teacher_tokens` returns, again on a second call, and another key gives other answers."""
    ro, tok = runs[0]
    assert tok.shape == (Q * G, NB, ro.record.canvas_length)
    t = rollout(model, ro.prompts, ro.prompt_valid, TEACHER, jax.random.key(0), group_size=1)  # row r: key r, as ro
    s_rec, t_rec = jax.device_get(ro.record), jax.device_get(t.record)
    np.testing.assert_array_equal(t_rec.canvas[:, 0], s_rec.canvas[:, 0])  # every block's initial canvas
    renoised = ~s_rec.accept[:, 0] & ~t_rec.accept[:, 0] & s_rec.step_ran[:, 1, :, None] & t_rec.step_ran[:, 1, :, None]
    assert renoised.sum() > 10  # positions both renoised at step 0 (the student accepts some, the teacher fewer)
    np.testing.assert_array_equal(t_rec.canvas[:, 1][renoised], s_rec.canvas[:, 1][renoised])
    assert (t_rec.steps > s_rec.steps).any()  # the teacher runs more steps than the student's K_max allows
    np.testing.assert_array_equal(committed_blocks(t_rec.tokens, NB, PAD), tok)
    np.testing.assert_array_equal(coupled_teacher_tokens(model, ro.prompts, ro.prompt_valid, TEACHER,
                                                         jax.random.key(0), NB, PAD), tok)
    other_ro, other = runs[1]
    np.testing.assert_array_equal(np.asarray(other_ro.prompts), np.asarray(ro.prompts))  # same prompts
    assert (other != tok).any(axis=(1, 2)).all()  # each rollout's answer follows its noise
    # the answer is not the student's own output: the teacher decodes the noise with its own sampler
    assert (committed_blocks(s_rec.tokens, NB, PAD) != tok).any()


def _rows(ro, tok, sd_target="coupled_teacher"):
    committed = committed_blocks(ro.record.tokens, NB, PAD)
    coupled = coupled_targets(tok, np.ones(len(tok)), reward_max=1.0, eos_ids=(EOS,), pad_id=PAD, tail_id=EOS)
    # y*(q) for the other targets: the first coupled answer of each prompt, "verified" as well
    y = build_targets(tok[::G], np.ones(Q), committed, np.zeros(Q * G), np.ones(Q * G), G, reward_max=1.0,
                      eos_ids=(EOS,), pad_id=PAD, tail_id=EOS)
    rows = build_state_rows(ro.record, ro.prompts, ro.prompt_valid, ro.prompt_index, y, np.zeros(Q * G),
                            n_blocks=NB, eos_ids=(EOS,), pad_id=PAD, tail_id=EOS, sd_target=sd_target,
                            coupled=coupled)
    return rows, coupled


def test_the_students_target_is_its_rollouts_coupled_answer_and_changes_with_the_key(runs):
    """Every row trains toward its own rollout's coupled answer (not its prompt's y*: a prompt's G rollouts get
    different targets), at every step-0 state of block 0 (nothing accepted yet: the state agrees), and the targets
    of the same prompts under another key differ."""
    ro, tok = runs[0]
    rows, coupled = _rows(ro, tok)
    np.testing.assert_array_equal(rows["target"], coupled.supervised[rows["rollout"]])
    first = rows["step"] == 0
    assert rows["sd_mask"][first, 0].all()
    assert not (rows["sd_mask"] & ~rows["pg_mask"]).any()
    assert rows["sd_mask"].sum() < rows["pg_mask"].sum()  # later states that accepted other tokens are dropped
    per_prompt, _ = _rows(ro, tok, sd_target="verified_agree")
    assert len({rows["target"][rows["rollout"] == r][0].tobytes() for r in range(Q * G)}) == Q * G
    assert len({per_prompt["target"][per_prompt["rollout"] == r][0].tobytes() for r in range(Q * G)}) == Q
    ro1, tok1 = runs[1]
    rows1, _ = _rows(ro1, tok1)
    for r in range(Q * G):
        a = rows["target"][(rows["rollout"] == r) & first][0]
        b = rows1["target"][(rows1["rollout"] == r) & first][0]
        assert (a != b).any(), r
    with pytest.raises(ValueError, match="coupled_teacher needs one coupled target per rollout"):
        build_state_rows(ro.record, ro.prompts, ro.prompt_valid, ro.prompt_index, coupled, np.zeros(Q * G),
                         n_blocks=NB, eos_ids=(EOS,), pad_id=PAD, tail_id=EOS, sd_target="coupled_teacher")


def test_one_optimizer_step_on_sd_raises_log_pi_of_the_coupled_target_at_early_states(model, runs):
    """L_SD alone (sd_only, no KL, no anchor) through the trainer's loss on the coupled rows: one SGD step raises the
    mean log π_θ(coupled target) over the SD pairs of the step-0 states (pure noise, shared with the teacher)."""
    from dgemma.diffusion.stage1 import Stage1Config
    from dgemma.train.sdrl.loss import make_sdrl_loss_fn, state_logprobs

    ro, tok = runs[0]
    rows, _ = _rows(ro, tok)
    graphdef, state = nnx.split(model)
    logp = jax.jit(lambda s, b, t: state_logprobs(nnx.merge(graphdef, s), b, t))
    batch = {k: jnp.asarray(v) for k, v in rows.batch().items()}
    batch["logp_old"] = logp(state, batch, batch["output"])
    fn = make_sdrl_loss_fn(SDRLConfig(arm="sd_only", kl_weight=0.0, anchor_weight=0.0), Stage1Config())
    value_grad = jax.jit(jax.value_and_grad(lambda s: fn(nnx.merge(graphdef, s), batch, jax.random.key(0))[0]))
    loss, g = value_grad(state)
    early = np.asarray(rows["sd_mask"]) & (np.asarray(rows["step"]) == 0)[:, None, None]
    assert early.sum() >= Q * G * 8  # block 0 of every rollout at least
    before = np.asarray(logp(state, batch, batch["target"]))[early].mean()
    stepped = jax.tree.map(lambda p, d: p - 0.05 * d, state, g)
    after = np.asarray(logp(stepped, batch, batch["target"]))[early].mean()
    assert float(loss) > 0 and after > before + 1e-3, (float(loss), before, after)


def test_coupled_teacher_is_refused_without_the_diffusion_teacher():
    with pytest.raises(ValueError, match=r"SDRLConfig.sd_target: coupled_teacher needs teacher_decoding='diffusion'"):
        SDRLConfig(sd_target="coupled_teacher", teacher_decoding="ar")
    with pytest.raises(ValueError, match=r"coupled_targets: \(3,\) rewards for 2 teacher answers"):
        coupled_targets(np.zeros((2, 1, 4), np.int32), np.ones(3), reward_max=1.0, eos_ids=(1,), pad_id=0, tail_id=1)

"""SD·RL terms pinned where the trainer's own iteration computes them (dgemma/train/sdrl/iteration.py).

tests/train/test_sdrl_terms.py pins every term of (4.2) on plain arrays and through the trainer's loss; this file watches
one real two-iteration `run_sdrl` (two inner epochs each, so a later optimizer step sees parameters that already
moved) through the batches its optimizer steps are fed, and checks what the iteration put in them:

- the advantages of each prompt's G rollouts have zero mean (weighted by the pair weights, which give each rollout
  1/R) and the group-normalised scale of that prompt's own rewards, on a reward whose mean differs between prompts,
  so a grouping across prompts (by row order or over the whole batch) fails; the rewards grouped are the students'
  rewards shaped by the efficiency bonus with the run's `sdrl.reward_max` (partial credit unchanged);
- the advantages are those of the shaped reward, not the raw one: a second one-iteration run gives every output full
  credit (raw advantages all zero) and lets rollouts stop at different steps, so only the bonus separates them;
- log π_old at every used pair is the student's before the iteration's first update: not the reference (which
  differs from the student from iteration 2 on), and not the parameters of the step that reads it (the second inner
  epoch sees moved parameters but the same π_old); log π_ref is the frozen start weights.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from dgemma.diffusion import sdrl_objective as so

REPO = Path(__file__).resolve().parents[2]
Q, G, EPOCHS, ITERATIONS = 2, 4, 2, 2
R_MAX, ETA = 3.0, 0.1  # full credit: only the higher-ranked prompt's parity-1 outputs (reward 3); bonus η on
REWARD_MODULE = "sdrl_pins_reward"
# parity of the even tokens (varies within a prompt's group) plus 2 × the prompt's rank among the call's prompts
# (every prompt has its own mean): advantages grouped across prompts cannot have zero mean per prompt
REWARD = """
CALLS = []


def reward(examples, generations, tokenizer):
    ranks = sorted({e.prompt for e in examples})
    out = [float(sum(1 for t in g if t % 2 == 0) % 2) + 2.0 * ranks.index(e.prompt)
           for e, g in zip(examples, generations)]
    CALLS.append(out)
    return out
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Two iterations of the tiny stage-2 config; every optimizer step's input (parameters copied before the step,
    its batch) and the rewards of every student scoring call."""
    import dgemma.train.step as step_mod
    from dgemma.config import load_config
    from dgemma.parallel.mesh import make_mesh
    from dgemma.train.sdrl import run_sdrl
    from dgemma.train.sdrl.states import per_row_batch

    tmp = tmp_path_factory.mktemp("sdrl_pins")
    (tmp / f"{REWARD_MODULE}.py").write_text(REWARD)
    steps, graphdefs, shaping = [], [], []
    real = step_mod.make_train_step
    real_shaping = so.efficiency_reward

    def observed_shaping(*args, **kwargs):  # the real efficiency bonus; the wrapper keeps its inputs and output
        out = real_shaping(*args, **kwargs)
        bound = inspect.signature(real_shaping).bind(*args, **kwargs)
        bound.apply_defaults()  # the R_max it used, passed or defaulted
        shaping.append((np.asarray(bound.arguments["reward"]), bound.arguments["reward_max"], np.asarray(out)))
        return out

    def make(*args, **kwargs):  # the real step; the wrapper only keeps a copy of what it is given
        graphdefs.append(args[0])
        fn = real(*args, **kwargs)

        def observed(state, batch):
            # before the step donates them; each row with its own prompt and committed blocks (`per_row_batch`)
            steps.append((jax.device_get(state.params), per_row_batch(jax.device_get(batch))))
            return fn(state, batch)

        return observed

    cfg = load_config(REPO / "configs/stage2/tiny.yaml", [
        "model.num_hidden_layers=1", "model.layer_types=[full_attention]", f"trainer.steps={ITERATIONS}",
        f"data.batch_size={Q}", f"sdrl.group_size={G}", "sampler.max_steps=4", "sdrl.teacher_sampler.max_steps=8",
        "sdrl.curriculum_max_steps=[3]", "sdrl.kl_estimator=k3", "sdrl.kl_weight=0.01", "sdrl.anchor_weight=0",
        f"sdrl.inner_epochs={EPOCHS}", "sdrl.num_minibatches=1", f"sdrl.reward={REWARD_MODULE}:reward",
        f"sdrl.reward_max={R_MAX}", f"sdrl.efficiency_reward={ETA}",
        "optim.lr=0.01", "sdrl.allow_random_init=true", "checkpoint.every=0", "checkpoint.async_save=false",
        "trainer.eval_every=0", "logging.jsonl=false", f"run.output_dir={tmp}", "run.name=pins"])
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(tmp))
        mp.delitem(sys.modules, REWARD_MODULE, raising=False)  # a fresh CALLS list whatever ran before
        mp.setattr(step_mod, "make_train_step", make)
        mp.setattr(so, "efficiency_reward", observed_shaping)
        summary = run_sdrl(cfg, progress=False, mesh=make_mesh({"fsdp": 1}, devices=jax.devices()[:1]))
        calls = sys.modules[REWARD_MODULE].CALLS
    student_rewards = [np.asarray(c) for c in calls if len(c) == Q * G]  # the teacher's calls score Q outputs
    assert len(steps) == ITERATIONS * EPOCHS and len(student_rewards) == ITERATIONS and graphdefs
    return graphdefs[0], steps, student_rewards, shaping, summary.history


def _prompt_groups(batch) -> list[np.ndarray]:
    """Row indices of each distinct prompt among the rows that carry weight (padding rows have weight 0)."""
    live = np.asarray(batch["weight"]).max(-1) > 0
    keys = [tuple(p) for p in np.asarray(batch["prompts"]).tolist()]
    distinct = dict.fromkeys(k for k, keep in zip(keys, live) if keep)
    return [np.flatnonzero(live & np.array([k == u for k in keys])) for u in distinct]


def test_advantages_have_zero_mean_per_prompt_in_the_iteration(run):
    """Σ over a prompt's rows of w Σ_j m^PG Â = (1/R) Σ_{rollouts i of q} Â_i (each rollout's pair weights sum to
    1/R), so it is 0 for every prompt, and the same sum of Â² is (1/R) Σ_i Â_i² of that prompt's own rewards,
    group-normalised as docs/sdrl.md §2 says (Â = 0 for a zero-std group); the rewards are the students' own,
    through the efficiency bonus at the run's R_max."""
    _, steps, student_rewards, shaping, history = run
    R = Q * G
    varied = 0
    assert len(shaping) == ITERATIONS
    for it, (rewards, (raw, reward_max, shaped)) in enumerate(zip(student_rewards, shaping)):
        # the iteration shapes its students' rewards with the run's R_max (partial credit: no bonus) and groups
        # the shaped rewards
        np.testing.assert_array_equal(raw, rewards)
        assert reward_max == R_MAX
        np.testing.assert_array_equal(shaped[rewards < R_MAX], rewards[rewards < R_MAX])
        r = shaped.reshape(Q, G)  # scoring order = rollout order: row r belongs to prompt r // G
        assert np.ptp(r.mean(1)) >= 1.0  # the prompts' means differ: a grouping across prompts shows
        varied += bool((np.ptp(r, axis=1) > 0).any())  # some group has reward variance: non-zero Â
        std = r.std(1, keepdims=True)
        adv = np.where(std > 0, (r - r.mean(1, keepdims=True)) / (std + 1e-6), 0.0)
        want_sq = sorted((adv ** 2).sum(1) / R)
        np.testing.assert_allclose(history[it]["zero_std_fraction"], np.mean(std[:, 0] == 0))
        for _, batch in steps[it * EPOCHS:(it + 1) * EPOCHS]:
            a, w = np.asarray(batch["advantage"], np.float64), np.asarray(batch["weight"], np.float64)
            per_state = w * np.asarray(batch["pg_mask"]).sum(-1)  # [N, nb]: this state's share of its rollout
            groups = _prompt_groups(batch)
            assert len(groups) == Q
            sums = [float((per_state[g] * a[g]).sum()) for g in groups]
            np.testing.assert_allclose(sums, 0.0, atol=1e-6, err_msg="advantages do not have zero mean per prompt")
            got_sq = sorted(float((per_state[g] * a[g] ** 2).sum()) for g in groups)
            np.testing.assert_allclose(got_sq, want_sq, rtol=1e-5, atol=1e-7)
    assert varied, student_rewards  # the scale check saw non-zero advantages


def _logp_fn(graphdef):
    """(params, batch) -> log π(o) [N, nb, L] at the batch's recorded states, by the trainer's replay forward."""
    from dgemma.train.sdrl.loss import state_logprobs
    from dgemma.train.sdrl.states import REPLAY_FIELDS

    fn = jax.jit(lambda p, b: state_logprobs(nnx.merge(graphdef, p), b, b["output"]))
    return lambda params, batch: np.asarray(fn(params, {k: batch[k] for k in (*REPLAY_FIELDS, "output")}))


def test_pi_old_is_the_student_before_the_first_update_and_pi_ref_the_start_weights(run):
    """Every step's log π_old equals log π of the parameters the iteration started from (recomputed here), on every
    used pair; at the second inner epoch those parameters have moved, and from iteration 2 the reference differs from
    the student, each by far more than the tolerance, so π_old taken from the step's own parameters or from the
    reference fails. log π_ref is log π of the start weights in every iteration."""
    graphdef, steps, _, _, _ = run
    logp = _logp_fn(graphdef)
    start = steps[0][0]  # the reference: the weights the run started from
    checked = set()
    for t, (params, batch) in enumerate(steps):
        it, epoch = divmod(t, EPOCHS)
        before_iteration = steps[it * EPOCHS][0]
        used = np.asarray(batch["pg_mask"]) & np.asarray(batch["state_ran"])[..., None]
        assert used.sum() > 20
        old = np.asarray(batch["logp_old"])[used]
        np.testing.assert_allclose(old, logp(before_iteration, batch)[used], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(batch["logp_ref"])[used], logp(start, batch)[used],
                                   rtol=1e-5, atol=1e-5)
        if epoch > 0:  # the step's own parameters already moved: π_old is not them
            assert np.abs(logp(params, batch)[used] - old).max() > 1e-2
            checked.add("moved")
        if it > 0:  # the student left the reference: π_old is not π_ref
            assert np.abs(np.asarray(batch["logp_ref"])[used] - old).max() > 1e-2
            checked.add("reference")
    assert checked == {"moved", "reference"}


SHAPED_ETA = 0.5
# the stop rule fires once two consecutive argmax drafts agree (stability 1; every state meets the entropy threshold);
# every position is accepted at every step (γ above any entropy sum) from near-greedy draws, so a rollout stops when
# its own draws repeat the draft, at a step that differs between rollouts of one prompt
STOP_RULE = ("sampler.stability_threshold=1", "sampler.confidence_threshold=1000.0", "sampler.entropy_bound=100.0",
             "sampler.t_max=0.05", "sampler.t_min=0.01")
CONSTANT_MODULE = "sdrl_pins_full_credit"
# every output gets full credit (R = R_max = 1): the raw rewards of a group have zero spread, so only the efficiency
# bonus (different decoder steps per rollout, from the sampler's stop rule) can give non-zero advantages
CONSTANT_REWARD = """
def reward(examples, generations, tokenizer):
    return [1.0] * len(generations)
"""


@pytest.fixture(scope="module")
def full_credit_run(tmp_path_factory):
    """One iteration of the tiny stage-2 config with a full-credit reward and a stop rule that fires at different
    steps in different rollouts (stability 1, an entropy threshold every state meets); the real efficiency bonus's
    inputs and output, and every optimizer step's batch."""
    import dgemma.train.step as step_mod
    from dgemma.config import load_config
    from dgemma.parallel.mesh import make_mesh
    from dgemma.train.sdrl import run_sdrl
    from dgemma.train.sdrl.states import per_row_batch

    tmp = tmp_path_factory.mktemp("sdrl_pins_full_credit")
    (tmp / f"{CONSTANT_MODULE}.py").write_text(CONSTANT_REWARD)
    batches, shaping = [], []
    real = step_mod.make_train_step
    real_shaping = so.efficiency_reward

    def observed_shaping(*args, **kwargs):  # the real efficiency bonus; the wrapper keeps its inputs and output
        out = real_shaping(*args, **kwargs)
        bound = inspect.signature(real_shaping).bind(*args, **kwargs)
        bound.apply_defaults()
        shaping.append({k: np.asarray(v) for k, v in bound.arguments.items()} | {"out": np.asarray(out)})
        return out

    def make(*args, **kwargs):
        fn = real(*args, **kwargs)

        def observed(state, batch):
            batches.append(per_row_batch(jax.device_get(batch)))  # each row with its own prompt (`per_row_batch`)
            return fn(state, batch)

        return observed

    cfg = load_config(REPO / "configs/stage2/tiny.yaml", [
        "model.num_hidden_layers=1", "model.layer_types=[full_attention]", "trainer.steps=1",
        f"data.batch_size={Q}", f"sdrl.group_size={G}", "sampler.max_steps=4", *STOP_RULE, "sdrl.teacher_sampler.max_steps=8", "sdrl.curriculum_max_steps=[]",
        "sdrl.kl_estimator=k3", "sdrl.kl_weight=0.01", "sdrl.anchor_weight=0", "sdrl.inner_epochs=1",
        "sdrl.num_minibatches=1", f"sdrl.reward={CONSTANT_MODULE}:reward", "sdrl.reward_max=1.0",
        f"sdrl.efficiency_reward={SHAPED_ETA}", "optim.lr=0.01", "sdrl.allow_random_init=true", "checkpoint.every=0",
        "checkpoint.async_save=false", "trainer.eval_every=0", "logging.jsonl=false", f"run.output_dir={tmp}",
        "run.name=full_credit"])
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(tmp))
        mp.delitem(sys.modules, CONSTANT_MODULE, raising=False)
        mp.setattr(step_mod, "make_train_step", make)
        mp.setattr(so, "efficiency_reward", observed_shaping)
        run_sdrl(cfg, progress=False, mesh=make_mesh({"fsdp": 1}, devices=jax.devices()[:1]))
    assert len(batches) == 1 and len(shaping) == 1
    return batches[0], shaping[0]


def test_advantages_are_computed_from_the_shaped_reward(full_credit_run):
    """Every rollout is full credit, so the raw rewards give Â = 0 everywhere; the bonus R (1 + η (1 − steps/K_max))
    differs between a prompt's rollouts (they stopped at different steps), so the advantages the update is fed are
    the group-normalised shaped rewards, hand-computed here from the steps each rollout used; advantages of the raw
    reward (all zero) fail."""
    batch, shaping = full_credit_run
    raw, steps, k_max = shaping["reward"], shaping["steps"].astype(np.float64), float(shaping["max_steps"])
    np.testing.assert_array_equal(raw, 1.0)
    assert float(shaping["eta"]) == SHAPED_ETA and float(shaping["reward_max"]) == 1.0
    shaped = raw * (1.0 + SHAPED_ETA * (1.0 - steps / k_max))  # by hand: every output is full credit
    np.testing.assert_allclose(shaping["out"], shaped, rtol=1e-6)
    r = shaped.reshape(Q, G)  # scoring order = rollout order: row r belongs to prompt r // G
    std = r.std(1, keepdims=True)
    want = np.where(std > 0, (r - r.mean(1, keepdims=True)) / (std + 1e-6), 0.0)
    assert (np.abs(want) > 0.1).any(), steps  # some prompt's rollouts used different steps: the bonus shows
    # each state row carries its rollout's Â (rows do not name their rollout): per prompt, the set of values fed is
    # the set of that prompt's hand-computed advantages
    a = np.asarray(batch["advantage"], np.float64)[:, 0]
    got = sorted(tuple(np.unique(np.round(a[g], 4))) for g in _prompt_groups(batch))
    np.testing.assert_allclose(np.concatenate(got), np.concatenate(
        sorted(tuple(np.unique(np.round(w, 4))) for w in want)), atol=2e-4)


TERMINATED_MODULE = "sdrl_pins_terminated"
# full credit to the outputs that end (an EOS anywhere): some answers of the random model do, some do not, so the
# verifier gates both ways and every verified answer fits the anchor's canvas with its EOS
TERMINATED_REWARD = """
def reward(examples, generations, tokenizer):
    return [float(tokenizer.eos_id in g) for g in generations]
"""
COUPLED_Q = 4


@pytest.fixture(scope="module")
def coupled_run(tmp_path_factory):
    """One iteration with `sdrl.sd_target=coupled_teacher` and the verified anchor on; observed through wrappers that
    call the real functions: the student rollouts, the coupled teacher's call and answers, y* (`build_targets`) and the
    first optimizer step's batch."""
    import dgemma.inference.rollout as rollout_mod
    import dgemma.train.sdrl.iteration as iteration_mod
    import dgemma.train.sdrl.teacher as teacher_mod
    import dgemma.train.step as step_mod
    from dgemma.config import load_config
    from dgemma.parallel.mesh import make_mesh
    from dgemma.train.sdrl import run_sdrl
    from dgemma.train.sdrl.states import per_row_batch

    tmp = tmp_path_factory.mktemp("sdrl_pins_coupled")
    (tmp / f"{TERMINATED_MODULE}.py").write_text(TERMINATED_REWARD)
    seen = {"rollouts": [], "coupled": [], "targets": [], "batches": []}
    real_rollout, real_coupled, real_targets = rollout_mod.rollout, teacher_mod.coupled_teacher_tokens, \
        iteration_mod.build_targets
    real_step = step_mod.make_train_step

    def rollout(model, prompts, prompt_valid, scfg, key, group_size=1, **kw):
        out = real_rollout(model, prompts, prompt_valid, scfg, key, group_size, **kw)
        seen["rollouts"].append((group_size, np.asarray(jax.random.key_data(key)), out))
        return out

    def coupled(model, rows_prompts, rows_valid, teacher_cfg, student_key, *args, **kw):
        out = real_coupled(model, rows_prompts, rows_valid, teacher_cfg, student_key, *args, **kw)
        seen["coupled"].append((np.asarray(rows_prompts), np.asarray(jax.random.key_data(student_key)), out))
        return out

    def targets(*args, **kw):
        out = real_targets(*args, **kw)
        seen["targets"].append(out)
        return out

    def make(*args, **kwargs):
        fn = real_step(*args, **kwargs)

        def observed(state, batch):
            seen["batches"].append(per_row_batch(jax.device_get(batch)))
            return fn(state, batch)

        return observed

    cfg = load_config(REPO / "configs/stage2/tiny.yaml", [
        "model.num_hidden_layers=1", "model.layer_types=[full_attention]", "trainer.steps=1",
        f"data.batch_size={COUPLED_Q}", "sdrl.group_size=2", "sampler.max_steps=4", "sdrl.teacher_sampler.max_steps=8",
        "sdrl.curriculum_max_steps=[]", "sdrl.kl_estimator=k3", "sdrl.kl_weight=0.01", "sdrl.anchor_weight=0.5",
        "sdrl.anchor_target=verified", "sdrl.sd_target=coupled_teacher", "sdrl.inner_epochs=1",
        "sdrl.num_minibatches=1", f"sdrl.reward={TERMINATED_MODULE}:reward", "sdrl.reward_max=1.0", "optim.lr=0.01",
        "sdrl.allow_random_init=true", "checkpoint.every=0", "checkpoint.async_save=false", "trainer.eval_every=0",
        "logging.jsonl=false", f"run.output_dir={tmp}", "run.name=coupled"])
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(tmp))
        mp.delitem(sys.modules, TERMINATED_MODULE, raising=False)
        mp.setattr(rollout_mod, "rollout", rollout)
        mp.setattr(teacher_mod, "coupled_teacher_tokens", coupled)
        mp.setattr(iteration_mod, "build_targets", targets)
        mp.setattr(step_mod, "make_train_step", make)
        history = run_sdrl(cfg, progress=False, mesh=make_mesh({"fsdp": 1}, devices=jax.devices()[:1])).history
    assert len(seen["batches"]) == 1 and len(seen["coupled"]) == 1 and len(seen["targets"]) == 1
    return cfg, seen, history[0]


def test_coupled_sd_targets_in_the_iteration(coupled_run):
    """The coupled teacher decodes the student rollouts' rows with the student rollouts' own key; every fed row that
    trains L_SD trains toward its own rollout's coupled answer (tail-filled), and only where that answer is verified
    (rewarded); the logged gate rate is the share of verified coupled answers."""
    from dgemma.train.sdrl.states import committed_blocks
    from dgemma.train.sdrl.targets import supervised_tokens

    cfg, seen, metrics = coupled_run
    (G, student_key, ro), = [r for r in seen["rollouts"] if r[0] == cfg.sdrl.group_size]
    rows_prompts, key, answers = seen["coupled"][0]
    np.testing.assert_array_equal(key, student_key)
    np.testing.assert_array_equal(rows_prompts, np.asarray(ro.prompts))
    eos, pad = cfg.model_config.eos_token_id[0], cfg.model_config.pad_token_id
    verified = (answers == eos).any((1, 2))
    assert 0 < verified.sum() < len(verified), verified  # the gate goes both ways
    np.testing.assert_allclose(metrics["coupled_gate_rate"], verified.mean())
    assert metrics["sd_from_teacher"] == 1.0
    supervised = supervised_tokens(answers, (eos,), pad, eos)
    committed = committed_blocks(ro.record.tokens, cfg.data.layout.n_blocks, pad)
    student_rows = [(np.asarray(ro.prompts)[r].tobytes(), committed[r].tobytes()) for r in range(len(committed))]
    batch = seen["batches"][0]
    sd = np.asarray(batch["sd_mask"])
    trained = set()
    for i in np.flatnonzero(sd.any((1, 2))):
        row = (np.asarray(batch["prompts"][i]).tobytes(), np.asarray(batch["committed"][i]).tobytes())
        (r,) = [j for j, s in enumerate(student_rows) if s == row]  # the rollout this state row belongs to
        assert verified[r], r
        np.testing.assert_array_equal(np.asarray(batch["target"][i])[sd[i]], supervised[r][sd[i]])
        trained.add(r)
    assert trained == set(np.flatnonzero(verified).tolist())  # every verified rollout trains (its step 0 agrees)


def test_anchor_rows_in_the_iteration_carry_y_star(coupled_run):
    """The anchor rows the update is fed: for each prompt with y* (the verified anchor), the prompt followed by y* up
    to its EOS, with diffusion weight on the response; prompts without y* carry zero weight; the logged anchor rate
    and a positive anchor loss follow."""
    cfg, seen, metrics = coupled_run
    y = seen["targets"][0]
    batch = seen["batches"][0]
    eos = cfg.model_config.eos_token_id[0]
    P = cfg.data.layout.prompt_len
    tokens, weight = np.asarray(batch["anchor/tokens"]), np.asarray(batch["anchor/diffusion_weight"])
    assert len(tokens) == COUPLED_Q
    assert 0 < y.has_target.sum(), y.has_target  # something is anchored
    np.testing.assert_allclose(metrics["anchor_rate"], y.has_target.mean())
    assert metrics["loss_anchor"] > 0.0
    for q in range(COUPLED_Q):
        if not y.has_target[q]:
            assert not weight[q].any(), q
            continue
        flat = y.committed[q].reshape(-1)
        resp = flat[: int(np.flatnonzero(flat == eos)[0]) + 1]  # y* up to and including its EOS
        np.testing.assert_array_equal(tokens[q, P:P + len(resp)], resp)
        assert weight[q, :len(resp)].all(), q

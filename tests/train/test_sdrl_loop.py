"""SD·RL stage 2: curriculum, state rows, bad input (default suite); end to end runs, exact resume after SIGKILL and
1 vs 8 devices (slow: every run compiles the sampler twice and the train step once)."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from support import fast_xla

from dgemma.cli.main import main as cli_main
from dgemma.inference.record import RolloutRecord
from dgemma.train.sdrl.curriculum import MaxStepsCurriculum
from dgemma.train.sdrl.states import build_state_rows, minibatches, pad_rows
from dgemma.train.sdrl.targets import build_targets

REPO = Path(__file__).resolve().parents[2]
EOS, PAD = 1, 0
# a 2-layer tiny_toy, short budgets, no anchor: the smallest run that exercises every part of an iteration
SMALL = ["model.num_hidden_layers=2", "model.layer_types=[sliding_attention, full_attention]", "trainer.steps=4",
         "data.batch_size=8", "sdrl.group_size=2", "sampler.max_steps=4", "sdrl.teacher_sampler.max_steps=8",
         "sdrl.curriculum_max_steps=[3]", "sdrl.kl_estimator=k3", "sdrl.anchor_weight=0.1", "checkpoint.every=1",
         "checkpoint.async_save=false", "logging.jsonl=true",
         "sdrl.allow_random_init=true"]


# MARK: curriculum --------------------------------------------------------------------------------------------------
def test_curriculum_lowers_at_teacher_level_raises_on_drop_and_round_trips():
    c = MaxStepsCurriculum(ladder=(16, 12, 8), ratio=0.97, drop=0.05, window=2)
    assert [c.update(0.5, 1.0), c.update(0.6, 1.0)] == [None, None] and c.max_steps == 16  # below the teacher
    assert [c.update(1.0, 1.0), c.update(1.0, 1.0)] == [None, "lower"] and c.max_steps == 12
    saved = c.state_dict()
    assert [c.update(0.9, 1.0), c.update(0.9, 1.0)] == [None, "raise"] and c.max_steps == 16  # dropped > 5 points
    again = MaxStepsCurriculum(ladder=(16, 12, 8), ratio=0.97, drop=0.05, window=2)
    again.load_state(json.loads(json.dumps(saved)))
    assert again.max_steps == 12 and again.reference == 1.0
    with pytest.raises(ValueError, match="ladder"):
        MaxStepsCurriculum(ladder=(16, 8)).load_state(saved)
    off = MaxStepsCurriculum(ladder=(16, 12), enabled=False, window=1)
    assert off.update(1.0, 1.0) is None and off.max_steps == 16


# MARK: state rows ---------------------------------------------------------------------------------------------------
def _record(nb=2, K=3, B=4, L=2, H=3):
    rng = np.random.default_rng(0)
    step_ran = np.zeros((nb, K, B), bool)
    steps = np.array([[3, 1, 2, 3], [2, 0, 1, 0]])  # [nb, B]; rows 1 and 3 finished after block 0
    for b in range(nb):
        for r in range(B):
            step_ran[b, :steps[b, r], r] = True
    tokens = np.array([[[5, 6], [5, 9], [7, 7], [7, EOS]], [[EOS, PAD], [PAD, PAD], [EOS, PAD], [PAD, PAD]]])
    f = lambda *s: jnp.asarray(rng.integers(2, 9, s), jnp.int32)  # noqa: E731
    return RolloutRecord(canvas=f(nb, K, B, L), soft_embeds=jnp.asarray(rng.normal(size=(nb, K, B, L, H)), jnp.float32),
                         tau=jnp.full((nb, K, B), 0.5), accept=jnp.zeros((nb, K, B, L), bool), draft=f(nb, K, B, L),
                         proposal=f(nb, K, B, L), mean_entropy=jnp.zeros((nb, K, B)),
                         step_ran=jnp.asarray(step_ran), tokens=jnp.asarray(tokens), steps=jnp.asarray(steps),
                         stop_reason=jnp.zeros((nb, B), jnp.int32), block_ran=jnp.asarray(steps > 0))


def test_state_rows_masks_gates_and_weights():
    rec = _record()
    G = 2
    committed = np.asarray(rec.tokens).transpose(1, 0, 2)
    t = build_targets(committed[[0, 2]], np.array([1.0, 0.0]), committed, np.array([1.0, 0.0, 0.0, 0.0]),
                      np.array([5, 1, 3, 3]), G, reward_max=1.0, eos_ids=(EOS,), pad_id=PAD, tail_id=EOS)
    adv = np.array([1.0, -1.0, 0.0, 0.0])
    rows = build_state_rows(rec, np.ones((4, 3), np.int32), np.ones((4, 3), bool), np.array([0, 0, 1, 1]), t, adv,
                            n_blocks=2, eos_ids=(EOS,), pad_id=PAD, tail_id=EOS, omega="early")
    # states (k, r) where some block ran step k: r0 k0-2, r1 k0, r2 k0-1, r3 k0-2
    assert sorted(zip(rows["rollout"].tolist(), rows["step"].tolist())) == [
        (0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2)]
    assert np.array_equal(rows["pg_mask"].any(-1), rows["state_ran"])
    # SD only for prompt 0 (teacher verified); row 1 differs from y* in block 0, so its block 1 is not gated in --
    # and block 1 of row 1 never ran anyway; row 0 matches y* fully
    sd_rows = set(rows["rollout"][rows["sd_mask"].any((1, 2))].tolist())
    assert sd_rows == {0, 1}
    # each rollout's pairs carry total weight 1/R
    w_pairs = rows["weight"][..., None] * rows["pg_mask"]
    per_rollout = np.bincount(rows["rollout"], weights=w_pairs.sum((1, 2)), minlength=4)
    np.testing.assert_allclose(per_rollout, 0.25, rtol=1e-6)
    # omega "early" = 1 + (K_rb - k)/K_rb: row 0, block 0 (3 steps), step 0 -> 2
    i = int(np.flatnonzero((rows["rollout"] == 0) & (rows["step"] == 0))[0])
    assert rows["omega"][i, 0] == pytest.approx(2.0)
    assert rows["output"][0, 1].tolist() in ([EOS, EOS], [PAD, PAD])  # tail-filled output
    padded = pad_rows(rows, 8)
    n = len(padded["rollout"])
    assert n == 16 and not padded["pg_mask"][9:].any() and not padded["weight"][9:].any()
    mbs = minibatches(padded, 2, np.random.default_rng(0))
    assert len(mbs) == 2 and sum(m["weight"].sum() for m in mbs) == pytest.approx(2 * padded["weight"].sum())


def test_state_rows_agree_keeps_only_states_consistent_with_the_target():
    rec = _record()
    committed = np.asarray(rec.tokens).transpose(1, 0, 2)
    t = build_targets(committed[[0, 2]], np.array([1.0, 0.0]), committed, np.array([1.0, 0.0, 0.0, 0.0]),
                      np.array([5, 1, 3, 3]), 2, reward_max=1.0, eos_ids=(EOS,), pad_id=PAD, tail_id=EOS)
    accept = np.zeros(rec.accept.shape, bool)
    accept[0, 1, 0, 0] = True  # row 0 accepts a token at step 1 of block 0 that differs from y* (5): random 2..8
    proposal = np.asarray(rec.proposal).copy()
    proposal[0, 1, 0, 0] = 8
    rec = dataclasses.replace(rec, accept=jnp.asarray(accept), proposal=jnp.asarray(proposal))
    kw = dict(n_blocks=2, eos_ids=(EOS,), pad_id=PAD, tail_id=EOS)
    args = (rec, np.ones((4, 3), np.int32), np.ones((4, 3), bool), np.array([0, 0, 1, 1]), t, np.zeros(4))
    prefix, agree = build_state_rows(*args, **kw), build_state_rows(*args, sd_target="verified_agree", **kw)
    assert np.array_equal(prefix["pg_mask"], agree["pg_mask"])  # PG / KL pairs do not change
    i = int(np.flatnonzero((agree["rollout"] == 0) & (agree["step"] == 2))[0])
    assert prefix["sd_mask"][i, 0].all() and not agree["sd_mask"][i, 0].any()  # after the disagreeing accept
    j = int(np.flatnonzero((agree["rollout"] == 0) & (agree["step"] == 1))[0])
    assert agree["sd_mask"][j, 0].all()  # the state before it still agrees
    assert agree["sd_mask"][j, 1].all()  # block 1 (accepted nothing that differs) agrees at its last step
    assert (agree["sd_mask"] <= prefix["sd_mask"]).all()
    with pytest.raises(ValueError, match="sd_target"):
        build_state_rows(*args, sd_target="nonsense", **kw)
    # M = 1: a rollout's kept state is drawn among its agreeing states first (row 0: steps 0-1, never step 2);
    # rollouts without any agreeing state (no target) still keep one state for PG / KL
    for seed in range(8):
        one = build_state_rows(*args, sd_target="verified_agree", states_per_rollout=1,
                               rng=np.random.default_rng(seed), **kw)
        assert sorted(one["rollout"].tolist()) == [0, 1, 2, 3]
        assert one["step"][one["rollout"] == 0][0] in (0, 1) and one["sd_mask"][one["rollout"] == 0].any()


def test_state_rows_state_argmax_targets_the_recorded_argmax_of_verified_rollouts():
    rec = _record()
    argmax = np.asarray(rec.draft).copy()
    argmax[0, 0, 1] = [5, 3]  # row 1's output block 0 is [5, 9]: its step-0 mode agrees at position 0 only
    rec = dataclasses.replace(rec, draft=jnp.asarray(argmax))
    committed = np.asarray(rec.tokens).transpose(1, 0, 2)
    t = build_targets(committed[[0, 2]], np.array([1.0, 0.0]), committed, np.array([1.0, 0.0, 0.0, 0.0]),
                      np.array([5, 1, 3, 3]), 2, reward_max=1.0, eos_ids=(EOS,), pad_id=PAD, tail_id=EOS)
    verified = np.array([False, True, True, False])  # the rollouts' own rewards, not the prompt's y*
    rows = build_state_rows(rec, np.ones((4, 3), np.int32), np.ones((4, 3), bool), np.array([0, 0, 1, 1]), t,
                            np.zeros(4), n_blocks=2, eos_ids=(EOS,), pad_id=PAD, tail_id=EOS,
                            sd_target="state_argmax", rollout_verified=verified)
    argmax = np.asarray(rec.draft)
    for i, (r, k) in enumerate(zip(rows["rollout"], rows["step"])):
        assert rows["target"][i].tolist() == argmax[:, k, r].tolist()  # the argmax of that very state
        assert rows["sd_mask"][i].any() == (verified[r] and rows["state_ran"][i].any())
    assert np.array_equal(rows["sd_mask"], rows["pg_mask"] & verified[rows["rollout"]][:, None, None])
    agree = build_state_rows(rec, np.ones((4, 3), np.int32), np.ones((4, 3), bool), np.array([0, 0, 1, 1]), t,
                             np.zeros(4), n_blocks=2, eos_ids=(EOS,), pad_id=PAD, tail_id=EOS,
                             sd_target="state_argmax_agree", rollout_verified=verified)
    same = rows["target"] == rows["output"]
    assert same.any() and (~same & rows["sd_mask"]).any()  # the fixture has both kinds of position
    assert np.array_equal(agree["sd_mask"], rows["sd_mask"] & same)  # only where the mode became the output
    with pytest.raises(ValueError, match="rollout_verified"):
        build_state_rows(rec, np.ones((4, 3), np.int32), np.ones((4, 3), bool), np.array([0, 0, 1, 1]), t,
                         np.zeros(4), n_blocks=2, eos_ids=(EOS,), pad_id=PAD, tail_id=EOS, sd_target="state_argmax")


def test_rollout_metrics_count_outputs_and_tokens_after_eos():
    from types import SimpleNamespace

    from dgemma.train.sdrl.metrics import rollout_metrics

    tokens = np.array([[5, 6, EOS, 7, EOS, PAD],  # 1 token after the first EOS (7)
                       [5, EOS, EOS, PAD, PAD, PAD],  # tail-filled: none
                       [5, 6, 7, 8, 9, 9]])  # no EOS: none, length 6
    res = SimpleNamespace(decoder_passes=np.array([3, 2, 6]), ar_forwards=np.zeros(3, np.int64),
                          commit_passes=np.ones(3, np.int64), stop_reason=np.array([[0], [0], [1]]),
                          steps_per_block=np.array([[3], [2], [6]]))
    m = rollout_metrics(SimpleNamespace(result=res, tokens=tokens, record=None), 6, (EOS,), PAD)
    assert m["tokens_after_eos"] == pytest.approx(1 / 3) and m["eos_rate"] == pytest.approx(2 / 3)
    assert m["output_length"] == pytest.approx((2 + 1 + 6) / 3)
    assert m["tpf"] == pytest.approx(14 / 11) and m["tpf_total"] == pytest.approx(14 / 14)  # corpus ratios
    assert m["pct_at_kmax"] == pytest.approx(100 / 3) and m["steps_per_block"] == pytest.approx(11 / 3)


# MARK: bad input ----------------------------------------------------------------------------------------------------
def _small(*overrides):
    """SMALL with `overrides` replacing its entries for the same keys."""
    keys = {o.split("=", 1)[0] for o in overrides}
    return [o for o in SMALL if o.split("=", 1)[0] not in keys] + list(overrides)


def _cli(tmp_path, capsys, *overrides):
    code = cli_main(["train", "-c", str(REPO / "configs/stage2/tiny.yaml"), "--no-progress",
                     f"run.output_dir={tmp_path}", "run.name=bad", *_small(*overrides)])
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize(("override", "pattern"), [
    ("sdrl.arm=rl_onyl", r"sdrl\.arm: expected one of 'rl_only'"),
    ("sdrl.sd_weight=-0.5", r"sdrl\.sd_weight: -0\.5 must be >= 0"),
    ("sdrl.kl_weight=-1", r"sdrl\.kl_weight"),
    ("sdrl.group_size=1", r"sdrl\.group_size: 1 must be >= 2"),
    ("sdrl.reference_memory=gpu", r"sdrl\.reference_memory"),
    ("sdrl.teacher_sampler.max_steps=3",
     r"sdrl\.teacher_sampler\.max_steps=3 is below the student's K_max sampler\.max_steps=4"),
    ("sdrl.curriculum_max_steps=[6]", r"sdrl\.curriculum_max_steps=\[6\] must all be below sampler\.max_steps=4"),
    ("sdrl.reward=no_such_module_xyz:f", r"sdrl\.reward='no_such_module_xyz:f': cannot import"),
])
def test_bad_input_is_one_line_nonzero_and_writes_nothing(tmp_path, capsys, override, pattern):
    import re

    code, err = _cli(tmp_path, capsys, override)
    assert code != 0 and len(err.splitlines()) == 1 and re.search(pattern, err), err
    assert not (tmp_path / "bad").exists()


REWARDS = '''
def raises(examples, generations, tokenizer):
    raise RuntimeError("verifier offline")

def wrong_length(examples, generations, tokenizer):
    return [1.0]

def words(examples, generations, tokenizer):
    return ["correct" for _ in examples]

def nested(examples, generations, tokenizer):
    return [[1.0, 0.0] for _ in examples]

def ok(examples, generations, tokenizer):
    return [0.5 for _ in examples]
'''


@pytest.mark.parametrize(("fn", "pattern"), [
    ("raises", r"sdrl\.reward: reward function raises raised RuntimeError: verifier offline"),
    ("wrong_length", r"returned shape \(1,\), expected \(8,\): one float per row"),
    ("words", r"sdrl\.reward: reward function words returned list, not one float per row \(8 rows\)"),
    ("nested", r"sdrl\.reward: reward function nested returned shape \(8, 2\), expected \(8,\)"),
])
def test_user_reward_that_fails_is_one_line_error(tmp_path, capsys, monkeypatch, fn, pattern):
    import re

    (tmp_path / "my_rewards_e.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, err = _cli(tmp_path, capsys, f"sdrl.reward=my_rewards_e:{fn}")
    assert code == 2 and len(err.splitlines()) == 1 and re.search(pattern, err), err
    assert not (tmp_path / "bad").exists()


# MARK: end to end (slow) --------------------------------------------------------------------------------------------
def _env(cache):
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PLATFORMS="cpu", WANDB_MODE="disabled")
    env["XLA_FLAGS"] = fast_xla.xla_flags()
    return env


def _cmd(out, name, *extra):
    return [sys.executable, "-m", "dgemma", "train", "-c", str(REPO / "configs/stage2/tiny.yaml"), "--no-progress",
            f"run.output_dir={out}", f"run.name={name}", *SMALL, *extra]


def _last_metrics(run_dir, step):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x["step"] == step][-1]


def _params(run_dir, step):
    import orbax.checkpoint as ocp

    tree = ocp.PyTreeCheckpointer().restore(str(run_dir / "params" / str(step) / "params"))
    import jax

    return jax.tree.leaves(tree)


@pytest.mark.slow
def test_dgemma_train_sdrl_resumes_exactly_after_sigkill(tmp_path):
    """Straight run of 4 iterations vs a run SIGKILLed after its first checkpoint and resumed: identical params and
    identical metrics of the last iteration (rollouts, rewards, losses)."""
    env = _env(tmp_path / "xla_cache")
    straight = subprocess.run(_cmd(tmp_path, "straight"), env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=1800)
    assert straight.returncode == 0, straight.stderr[-3000:]
    proc = subprocess.Popen(_cmd(tmp_path, "killed"), env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    ckpt = tmp_path / "killed" / "checkpoints"
    deadline = time.time() + 1800
    while time.time() < deadline and proc.poll() is None and not (ckpt / "1").is_dir():
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    steps_at_kill = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    assert steps_at_kill and steps_at_kill[-1] < 4, steps_at_kill  # killed mid-run
    resumed = subprocess.run(_cmd(tmp_path, "killed"), env=env, cwd=REPO, capture_output=True, text=True,
                             timeout=1800)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"steps {steps_at_kill[-1]}->4" in resumed.stdout
    a, b = _last_metrics(tmp_path / "straight", 4), _last_metrics(tmp_path / "killed", 4)
    for k in ("loss", "loss_pg", "loss_sd", "loss_kl", "loss_anchor", "reward", "teacher_reward", "steps_per_block",
              "grad_norm", "k_max", "sd_gate_rate"):
        assert a[k] == b[k], (k, a[k], b[k])
    for x, y in zip(_params(tmp_path / "straight", 4), _params(tmp_path / "killed", 4), strict=True):
        np.testing.assert_array_equal(x, y)


def _mesh(sizes, n):
    import jax

    from dgemma.parallel.mesh import make_mesh

    return make_mesh(sizes, devices=jax.devices()[:n])


PARITY = """
def parity(examples, generations, tokenizer):
    return [float(sum(1 for t in g if t % 2 == 0) % 2) for g in generations]
"""


@pytest.mark.slow
def test_same_losses_on_one_and_eight_devices(tmp_path, monkeypatch):
    """One iteration with ONE optimizer step (so the logged losses and grad norm are those of the same parameters
    on both meshes) and a reward that varies within groups (a real PG gradient): same rollouts, same losses.
    (After Adam updates the comparison would be meaningless here: at θ = reference with zero-std groups every
    gradient is rounding noise, which Adam normalises into lr-sized steps.)"""
    from dgemma.config import load_config
    from dgemma.train.sdrl import run_sdrl

    (tmp_path / "parity_reward_e.py").write_text(PARITY)
    monkeypatch.syspath_prepend(str(tmp_path))
    base = [f"run.output_dir={tmp_path}", *_small("trainer.steps=1", "sdrl.inner_epochs=1", "sdrl.num_minibatches=1",
                                                   "sdrl.reward=parity_reward_e:parity")]
    out = {}
    for name, mesh in (("one", _mesh({"fsdp": 1}, 1)), ("eight", _mesh({"data": 2, "fsdp": 4}, 8))):
        cfg = load_config(REPO / "configs/stage2/tiny.yaml", [*base, f"run.name={name}"])
        out[name] = run_sdrl(cfg, progress=False, mesh=mesh).history[0]
    assert out["one"]["zero_std_fraction"] < 1.0  # some groups carry a PG signal
    for k in ("reward", "teacher_reward", "steps_per_block", "states", "sd_gate_rate"):
        assert out["one"][k] == out["eight"][k], k
    for k in ("loss", "loss_pg", "loss_sd", "loss_kl", "loss_anchor", "grad_norm"):
        np.testing.assert_allclose(out["eight"][k], out["one"][k], rtol=1e-4, atol=1e-7, err_msg=k)


# every per-iteration SD·RL metric (docs/sdrl.md §5, step 5), by its metrics.jsonl key (K_max 4: steps 1..4)
SDRL_METRICS = (
    "reward", "reward_copy", "reward_sort", "teacher_reward", "teacher_steps_per_block",  # reward and accuracy
    "steps_per_block", "steps_p50", "steps_p90", "pct_at_kmax", "tpf", "tpf_total",  # steps and stops
    "pct_converged", "pct_max_steps",  # stop-reason histogram (the rest of the ran blocks stopped on EOS)
    *(f"{m}_step{k}" for m in ("entropy", "accept_frac") for k in range(1, 5)), "argmax_flip_rate",  # per step
    "output_length", "eos_rate", "tokens_after_eos",  # outputs
    "loss_kl", "clip_fraction", "zero_std_fraction", "sd_gate_rate", "loss_pg", "loss_sd", "loss_anchor", "loss",
    "grad_norm", "k_max")  # optimization (+ the curriculum's K_max)
SDRL_EVAL_METRICS = ("eval/diffusion_current/exact_match", "eval/diffusion/exact_match", "eval/ar/exact_match",
             "eval/diffusion_current/tpf", "eval/diffusion/tpf", "eval/heldout_overlap")


@pytest.mark.slow
def test_short_run_logs_every_sdrl_metric(tmp_path):
    """Two iterations through `dgemma train` with a held-out evaluation after the second: every SD·RL metric is in
    metrics.jsonl, finite, and the held-out prompts' overlap with the training stream is 0."""
    import math

    cmd = [sys.executable, "-m", "dgemma", "train", "-c", str(REPO / "configs/stage2/tiny.yaml"), "--no-progress",
           f"run.output_dir={tmp_path}", "run.name=m",
           *_small("trainer.steps=2", "trainer.eval_every=2", "trainer.eval_batches=1", "checkpoint.every=0")]
    proc = subprocess.run(cmd, env=_env(tmp_path / "xla_cache"), cwd=REPO, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    from dgemma.train.objectives import TRAIN_METRICS

    for r in rows:
        assert set(TRAIN_METRICS) <= set(r), sorted(set(TRAIN_METRICS) - set(r))  # named as for every objective
        missing = [k for k in SDRL_METRICS if k not in r]
        assert not missing, (r["step"], missing)
        assert all(math.isfinite(r[k]) for k in SDRL_METRICS), r
    missing = [k for k in SDRL_EVAL_METRICS if k not in rows[1]]
    assert not missing and not any(k in rows[0] for k in SDRL_EVAL_METRICS), missing
    assert rows[1]["eval/heldout_overlap"] == 0.0 and all(0.0 <= rows[1][k] <= 1.0 for k in SDRL_EVAL_METRICS[:3])


@pytest.mark.slow
def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    """lr = 1e30 blows the weights up in the first update (one per iteration here), so iteration 2 has a non-finite
    loss: `dgemma train` exits 1 with one line naming the step and the last good checkpoint, checkpoint 1 stays the
    latest, and nothing of iteration 2 (no checkpoint 2, no final params) is written; its metrics are logged with
    `nonfinite` = 1 (as for every objective)."""
    import re

    cmd = [sys.executable, "-m", "dgemma", "train", "-c", str(REPO / "configs/stage2/tiny.yaml"), "--no-progress",
           f"run.output_dir={tmp_path}", "run.name=nan",
           *_small("trainer.steps=3", "optim.lr=1e30", "sdrl.inner_epochs=1", "sdrl.num_minibatches=1")]
    proc = subprocess.run(cmd, env=_env(tmp_path / "xla_cache"), cwd=REPO, capture_output=True, text=True,
                          timeout=1800)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert re.match(r"dgemma train: non-finite loss at step 2 .* last good checkpoint is step 1 in ", last), last
    run = tmp_path / "nan"
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["1"]
    assert not (run / "params").exists()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2], rows  # the non-finite iteration is logged for diagnosis, marked
    assert rows[1]["nonfinite"] == 1.0 and "nonfinite" not in rows[0]


@pytest.mark.slow
def test_state_rows_replay_the_sampler_states(tmp_path):
    """The rows the loss trains on replay the recorded states: at every valid (row, block) the replayed tempered
    logits give the recorded argmax and mean entropy (fp32, 1e-5), and both token sets come from the same forward."""
    import jax
    from flax import nnx

    from dgemma.config import load_config
    from dgemma.inference.rollout import rollout
    from dgemma.model.transformer import Transformer
    from dgemma.train.sdrl.loss import state_logits, state_logprobs
    from dgemma.train.sdrl.teacher import student_sampler

    cfg = load_config(REPO / "configs/stage2/tiny.yaml", _small())
    model = Transformer(cfg.model_config, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(0)
    prompts = rng.integers(2, 32, (2, 6)).astype(np.int32)
    ro = rollout(model, prompts, np.ones((2, 6), bool), student_sampler(cfg, 4, 16), jax.random.key(0), group_size=2)
    committed = np.asarray(ro.record.tokens).transpose(1, 0, 2)
    t = build_targets(committed[[0, 2]], np.ones(2), committed, np.zeros(4), np.ones(4), 2, reward_max=1.0,
                      eos_ids=(EOS,), pad_id=PAD, tail_id=EOS)
    rows = build_state_rows(ro.record, ro.prompts, ro.prompt_valid, ro.prompt_index, t, np.zeros(4), n_blocks=2,
                            eos_ids=(EOS,), pad_id=PAD, tail_id=EOS)
    z = np.asarray(state_logits(model, rows))  # [N, nb, L, V]
    rec = jax.device_get(ro.record)
    valid = rows["state_ran"]
    k, r = rows["step"], rows["rollout"]
    for b in range(valid.shape[1]):
        v = valid[:, b]
        np.testing.assert_array_equal(z[v, b].argmax(-1), np.asarray(rec.draft)[b, k[v], r[v]])
        p = jax.nn.softmax(z[v, b], -1)
        ent = -(p * jax.nn.log_softmax(z[v, b], -1)).sum(-1).mean(-1)
        np.testing.assert_allclose(ent, np.asarray(rec.mean_entropy)[b, k[v], r[v]], atol=1e-5)
    lp = np.asarray(state_logprobs(model, rows, np.stack([rows["output"], rows["target"]], -1)))
    ref = np.asarray(jax.nn.log_softmax(z, -1))
    np.testing.assert_allclose(lp[..., 0], np.take_along_axis(ref, rows["output"][..., None], -1)[..., 0],
                               atol=1e-5)
    np.testing.assert_allclose(lp[..., 1], np.take_along_axis(ref, rows["target"][..., None], -1)[..., 0],
                               atol=1e-5)


# MARK: reference params in pinned host memory -----------------------------------------------------------------------
def _live_arrays() -> list:
    """The live (not deleted) jax arrays of this process."""
    import jax

    return [a for a in jax.live_arrays() if not a.is_deleted()]


def _new_bytes(before: list) -> dict[str, int]:
    """Bytes by memory kind of the live jax arrays that are not in `before`. The caller holds `before` (the arrays
    live before its run, other tests' leftovers included) for the whole run, so none of them is freed meanwhile and
    no new array can reuse one's id: what is counted is the run's own arrays, whatever the rest of the process does."""
    from dgemma.parallel.memory import memory_kinds

    old = {id(a) for a in before}
    live = {}
    for a in _live_arrays():
        if id(a) not in old:
            (kind,) = memory_kinds(a)
            live[kind] = live.get(kind, 0) + a.nbytes
    return live


def _recording_step(monkeypatch, seen, before):
    """Wrap the real train step so every optimizer step records the run's own live bytes by memory kind just before
    it runs."""
    import dgemma.train.step as step_mod

    real = step_mod.make_train_step

    def make(*args, **kwargs):
        fn = real(*args, **kwargs)

        def recorded(state, batch):
            seen.append(_new_bytes(before))
            return fn(state, batch)

        return recorded

    monkeypatch.setattr(step_mod, "make_train_step", make)


@pytest.mark.slow  # 63 s: a whole iteration twice; the device-copy mechanism's unit tests below stay default
def test_reference_in_host_memory_same_iteration_no_device_copy_at_the_update(tmp_path, monkeypatch):
    """sdrl.reference_memory=host: during every optimizer step the pinned host memory holds exactly one parameter
    copy (the reference) and the devices hold at least that much less than with the reference on the devices; the
    iteration's rollouts, rewards and losses are the same bit for bit; a resumed run restores the reference into
    pinned host memory and goes on the same way."""
    import gc

    import jax

    from dgemma.config import load_config
    from dgemma.train.sdrl import run_sdrl

    def overrides(steps, name, memory):
        return [f"run.output_dir={tmp_path}", f"run.name={name}", f"sdrl.reference_memory={memory}",
                *_small(f"trainer.steps={steps}", "sdrl.inner_epochs=1", "sdrl.num_minibatches=2")]

    out, seen = {}, {}
    for name in ("host", "device"):
        seen[name] = []
        gc.collect()
        before = _live_arrays()  # other tests' leftovers: held (so kept alive) and left out of the counts
        with monkeypatch.context() as mp:
            _recording_step(mp, seen[name], before)
            cfg = load_config(REPO / "configs/stage2/tiny.yaml", overrides(1, name, name))
            summary = run_sdrl(cfg, progress=False, mesh=_mesh({"fsdp": 2}, 2))
        out[name] = summary.history[0]
        param_bytes = sum(a.nbytes for a in jax.tree.leaves(summary.state.params))
        del summary, before
        gc.collect()
    assert len(seen["host"]) == len(seen["device"]) == 2

    def own(live):
        return {k: live.get(k, 0) for k in ("device", "pinned_host")}

    for h, d in zip(map(own, seen["host"]), map(own, seen["device"])):
        assert h["pinned_host"] == param_bytes and d["pinned_host"] == 0, (h, d)
        assert d["device"] - h["device"] >= param_bytes, (h, d)
    for k in ("reward", "teacher_reward", "steps_per_block", "states", "loss", "loss_pg", "loss_sd", "loss_kl",
              "loss_anchor", "grad_norm"):
        assert out["host"][k] == out["device"][k], (k, out["host"][k], out["device"][k])
    # resume the host run for a second iteration: the reference comes back from the checkpoint into pinned host memory
    resumed = []
    gc.collect()
    before = _live_arrays()
    with monkeypatch.context() as mp:
        _recording_step(mp, resumed, before)
        cfg = load_config(REPO / "configs/stage2/tiny.yaml", overrides(2, "host", "host"))
        summary = run_sdrl(cfg, progress=False, mesh=_mesh({"fsdp": 2}, 2))
    assert summary.resumed and summary.steps_run == 1 and np.isfinite(summary.history[0]["loss"])
    assert [own(r)["pinned_host"] for r in resumed] == [param_bytes] * 2


def test_reference_memory_must_be_a_known_place_the_devices_have():
    import jax

    from dgemma.config.sdrl_section import SDRLConfig
    from dgemma.parallel.memory import HOST, require_memory_kind

    with pytest.raises(ValueError, match=r"SDRLConfig\.reference_memory: 'gpu' is not 'device' or 'host'"):
        SDRLConfig(reference_memory="gpu")
    require_memory_kind(jax.devices()[0], HOST, "sdrl.reference_memory=host")  # CPU, GPU and TPU devices have it
    with pytest.raises(ValueError, match=r"^sdrl\.reference_memory=host: the cpu devices have no 'hbm' memory \(they "
                                         r"have \[.*'pinned_host'.*\]\)$"):
        require_memory_kind(jax.devices()[0], "hbm", "sdrl.reference_memory=host")


def test_device_copy_copies_a_host_tree_on_first_use_only_and_frees_only_its_own_copy():
    """The loop's reference holder (`dgemma.parallel.memory.DeviceCopy`): an iteration that never reads the reference
    (teacher=ema, KL off, anchor on verified outputs) makes no device copy; one that reads it twice makes one; the
    release frees that copy and never the stored tree, nor a tree that was on the devices already."""
    import jax

    from dgemma.parallel.memory import DEVICE, HOST, DeviceCopy, memory_kinds, to_memory

    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    stored = to_memory(params, HOST)
    unused = DeviceCopy(stored, HOST)
    unused.release()
    assert unused._on_devices is None and not any(a.is_deleted() for a in jax.tree.leaves(stored))
    ref = DeviceCopy(stored, HOST)
    first = ref.params()
    assert ref.params() is first and memory_kinds(first) == {DEVICE} and memory_kinds(stored) == {HOST}
    np.testing.assert_array_equal(np.asarray(first["w"]), np.asarray(params["w"]))
    ref.release()
    assert all(a.is_deleted() for a in jax.tree.leaves(first))
    assert not any(a.is_deleted() for a in jax.tree.leaves(stored))
    on_devices = DeviceCopy(params, DEVICE)
    assert on_devices.params() is params
    on_devices.release()
    assert not any(a.is_deleted() for a in jax.tree.leaves(params))


@pytest.mark.slow
def test_sdrl_update_keeps_one_scanned_gradient_stack(tmp_path, monkeypatch):
    """Scanned layers: the anchor's stage-1 passes run on the replay's twin model, so the SD·RL update's backward
    keeps one stacked gradient of the scanned layers (dgemma.model.shared_scan_grads): on a real minibatch of state
    rows + anchor rows, the loss and every gradient equal the two-stack update (fp32, 1e-5) and XLA:CPU allocates
    less temporary memory for it."""
    import jax
    from flax import nnx

    import dgemma.train.step as step_mod
    from dgemma.config import load_config
    from dgemma.diffusion.stage1 import Stage1Config
    from dgemma.train.sdrl import run_sdrl
    from dgemma.train.sdrl.loss import make_sdrl_loss_fn

    scan = ["model.execution.scan_layers=true", "model.execution.scan_period=2", "model.execution.remat=save_dots"]
    cfg = load_config(REPO / "configs/stage2/tiny.yaml", [f"run.output_dir={tmp_path}", "run.name=s", *scan,
                                                          *_small("trainer.steps=1", "sdrl.inner_epochs=1")])
    captured = []
    real = step_mod.make_train_step

    def make(*args, **kwargs):
        fn = real(*args, **kwargs)
        captured.append(args[0])  # the graphdef

        def step(state, batch):
            captured.append(jax.tree.map(jnp.copy, (state.params, batch)))  # the step donates its state
            return fn(state, batch)

        return step

    monkeypatch.setattr(step_mod, "make_train_step", make)
    run_sdrl(cfg, progress=False, mesh=_mesh({"fsdp": 1}, 1))
    graphdef, (params, batch) = captured[0], captured[1]
    params = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), params)
    out = {}
    for share in (True, False):
        loss_fn = make_sdrl_loss_fn(cfg.sdrl, Stage1Config.from_section(cfg.diffusion), share_scan_grads=share)
        f = jax.jit(jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), batch, jax.random.key(2))[0]))
        compiled = f.lower(params).compile()
        out[share] = compiled(params)
    (l_1, g_1), (l_2, g_2) = out[True], out[False]
    assert float(l_1) == pytest.approx(float(l_2), rel=1e-6, abs=1e-7)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_1), jax.tree.leaves(g_2)):
        # fp32 relative, with an absolute floor for gradients that are rounding noise (a layer scalar's ~1e-10)
        assert float(jnp.abs(a - b).max()) <= 1e-5 * float(jnp.abs(b).max()) + 1e-9, jax.tree_util.keystr(path)


def test_sd_teacher_share_counts_sd_pairs_whose_target_is_the_teachers():
    from dgemma.train.sdrl.states import sd_teacher_share

    rec = _record()
    committed = np.asarray(rec.tokens).transpose(1, 0, 2)
    kw = dict(n_blocks=2, eos_ids=(EOS,), pad_id=PAD, tail_id=EOS)
    index = np.array([0, 0, 1, 1])
    args = (rec, np.ones((4, 3), np.int32), np.ones((4, 3), bool), index)

    def share(teacher_reward, student_reward, sd_target="verified"):
        t = build_targets(committed[[0, 2]], np.asarray(teacher_reward, float), committed,
                          np.asarray(student_reward, float), np.array([5, 1, 3, 3]), 2, reward_max=1.0, eos_ids=(EOS,),
                          pad_id=PAD, tail_id=EOS)
        rows = build_state_rows(*args, t, np.zeros(4), **kw)
        return sd_teacher_share(rows, t, index, sd_target), rows["sd_mask"], t

    only_teacher, sd, t = share([1, 0], [0, 0, 0, 0])  # y* of prompt 0 is the teacher's; prompt 1 has none
    assert sd.any() and t.source.tolist() == [1, 0] and only_teacher == 1.0
    only_students, sd, t = share([0, 0], [1, 0, 1, 0])  # the teacher fails: both y* are students' outputs
    assert sd.any() and t.source.tolist() == [2, 2] and only_students == 0.0
    mixed, sd, t = share([1, 0], [1, 0, 1, 0])  # prompt 0 from the teacher, prompt 1 from student row 2
    rows_prompt = index[build_state_rows(*args, t, np.zeros(4), **kw)["rollout"]]
    assert t.source.tolist() == [1, 2] and mixed == pytest.approx(sd[rows_prompt == 0].sum() / sd.sum())
    # the same prompts under state_argmax: every SD target is the student's own argmax, none the teacher's
    own = build_state_rows(*args, t, np.zeros(4), sd_target="state_argmax",
                           rollout_verified=np.array([True, False, True, False]), **kw)
    assert own["sd_mask"].any() and sd_teacher_share(own, t, index, "state_argmax") == 0.0
    # nothing trains SD: 0, not a division by zero
    none = build_targets(committed[[0, 2]], np.zeros(2), committed, np.zeros(4), np.array([5, 1, 3, 3]), 2,
                         reward_max=1.0, eos_ids=(EOS,), pad_id=PAD, tail_id=EOS)
    assert sd_teacher_share(build_state_rows(*args, none, np.zeros(4), **kw), none, index, "verified") == 0.0

"""How the SD·RL teacher decodes (`sdrl.teacher_decoding`): its diffusion sampler, greedy AR on the same weights, or
both with the better-rewarded output per prompt.

Default suite: the selection rule on host arrays, its interplay with the verifier gate, and the config check.
Slow: one SD·RL iteration per setting from the shipped stage-1 toy checkpoint on sort, where the diffusion teacher
verifies nothing and greedy AR verifies most prompts, so only the AR settings open the SD gate.
"""

import numpy as np
import pytest

from dgemma.config.sdrl_section import SDRLConfig
from dgemma.train.sdrl.targets import TEACHER, build_targets
from dgemma.train.sdrl.teacher import pick_teacher_outputs

EOS, PAD = 1, 0


def _outputs(seed, reward):
    tok = np.random.default_rng(seed).integers(2, 30, (len(reward), 2, 4)).astype(np.int32)
    return tok, np.asarray(reward, np.float64)


def test_pick_teacher_outputs_per_setting():
    diff = _outputs(0, [1.0, 0.0, 0.0, 0.5])
    ar = _outputs(1, [1.0, 1.0, 0.0, 0.25])
    tok, rew, from_ar = pick_teacher_outputs("diffusion", diff, None)
    np.testing.assert_array_equal(tok, diff[0])
    assert not from_ar.any() and rew.tolist() == diff[1].tolist()
    tok, rew, from_ar = pick_teacher_outputs("ar", None, ar)
    np.testing.assert_array_equal(tok, ar[0])
    assert from_ar.all() and rew.tolist() == ar[1].tolist()
    tok, rew, from_ar = pick_teacher_outputs("diffusion_else_ar", diff, ar)
    # ties (prompts 0 and 2) keep the diffusion output; prompt 1 only AR verifies; prompt 3 diffusion scores higher
    assert from_ar.tolist() == [False, True, False, False]
    assert rew.tolist() == [1.0, 1.0, 0.0, 0.5]
    for q, src in enumerate((diff, ar, diff, diff)):
        np.testing.assert_array_equal(tok[q], src[0][q])


def test_ar_teacher_opens_the_gate_where_diffusion_verifies_nothing():
    diff = _outputs(0, [0.0, 0.0])
    ar = _outputs(1, [1.0, 0.0])
    students = np.random.default_rng(2).integers(2, 30, (4, 2, 4)).astype(np.int32)
    kw = dict(reward_max=1.0, eos_ids=(EOS,), pad_id=PAD, tail_id=EOS)
    args = (students, np.zeros(4), np.full(4, 3), 2)
    closed = build_targets(*pick_teacher_outputs("diffusion", diff, None)[:2], *args, **kw)
    assert not closed.has_target.any()
    opened = build_targets(*pick_teacher_outputs("diffusion_else_ar", diff, ar)[:2], *args, **kw)
    assert opened.has_target.tolist() == [True, False] and opened.source[0] == TEACHER
    np.testing.assert_array_equal(opened.committed[0], ar[0][0])


def test_bad_teacher_decoding_is_refused():
    with pytest.raises(ValueError, match="SDRLConfig.teacher_decoding: 'beam' is not one of"):
        SDRLConfig(teacher_decoding="beam")
    with pytest.raises(ValueError, match="unknown 'beam'"):
        pick_teacher_outputs("beam", None, None)
    with pytest.raises(ValueError, match=r"diffusion \(2, 2, 4\)/\(2,\) != AR \(3, 2, 4\)/\(3,\)"):
        pick_teacher_outputs("diffusion_else_ar", _outputs(0, [1.0, 0.0]), _outputs(1, [1.0, 0.0, 0.0]))


@pytest.mark.slow
def test_ar_teacher_verifies_sort_where_the_diffusion_teacher_does_not(tmp_path):
    """One iteration per setting on sort from the shipped stage-1 toy checkpoint (its diffusion sampler almost never
    sorts 40 digits; its greedy AR mode mostly does). Same prompts and keys in both runs."""
    import dataclasses
    from pathlib import Path

    import jax

    from dgemma.config import load_config
    from dgemma.parallel.mesh import make_mesh
    from dgemma.train.sdrl import run_sdrl

    repo = Path(__file__).resolve().parents[2]
    small = [f"checkpoint.init_from={repo / 'experiments/sdrl_study/checkpoint/stage1_toy'}", "trainer.steps=1",
             "data.batch_size=4", "sdrl.group_size=2", "sampler.max_steps=8", "sdrl.teacher_sampler.max_steps=16",
             "sdrl.curriculum_max_steps=[4]", "sdrl.states_per_rollout=2", "sdrl.inner_epochs=1",
             "checkpoint.every=0", f"run.output_dir={tmp_path}"]
    out = {}
    for mode in ("diffusion", "diffusion_else_ar"):
        cfg = load_config(repo / "experiments/sdrl_study/stage2.yaml",
                          [*small, f"run.name={mode}", f"sdrl.teacher_decoding={mode}"])
        tasks = tuple(t for t in cfg.data.tasks if t.name == "sort")
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tasks=tasks))
        out[mode] = run_sdrl(cfg, progress=False, mesh=make_mesh({"fsdp": 1}, devices=jax.devices()[:1])).history[0]
    d, both = out["diffusion"], out["diffusion_else_ar"]
    assert both["teacher_reward_diffusion"] == d["teacher_reward_diffusion"] == d["teacher_reward"]
    # per prompt the better of the two: at least each mean, at most their sum
    assert max(both["teacher_reward_ar"], both["teacher_reward_diffusion"]) <= both["teacher_reward"]
    assert both["teacher_reward"] <= both["teacher_reward_ar"] + both["teacher_reward_diffusion"]
    assert both["teacher_reward_ar"] > d["teacher_reward"]
    assert both["target_from_teacher_ar"] > 0.0 and both["sd_gate_rate"] > d["sd_gate_rate"]
    assert both["loss_sd"] > 0.0

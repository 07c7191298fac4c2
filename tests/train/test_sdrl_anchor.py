"""The anchor's response (`sdrl.anchor_target`): y* only, the frozen reference's greedy AR output, or y* else that.

Default suite: the selection rule on host arrays and the config check. Slow: one SD·RL iteration per setting through
`run_sdrl` on the tiny stage-2 config, where the random model verifies nothing, so only the task-independent
settings anchor anything.
"""

import numpy as np
import pytest

from dgemma.config.sdrl_section import SDRLConfig
from dgemma.train.sdrl.targets import anchor_targets, build_targets

EOS, PAD = 1, 0


def _targets():
    # Q = 3 prompts, G = 2 students each; prompt 0 verified by the teacher, prompt 1 by its student row 3, prompt 2 not
    rng = np.random.default_rng(0)
    teacher = rng.integers(2, 30, (3, 2, 4)).astype(np.int32)
    students = rng.integers(2, 30, (6, 2, 4)).astype(np.int32)
    t = build_targets(teacher, np.array([1.0, 0.0, 0.0]), students, np.array([0, 0, 0, 1, 0, 0.0]),
                      np.array([3, 3, 3, 2, 3, 3]), 2, reward_max=1.0, eos_ids=(EOS,), pad_id=PAD, tail_id=EOS)
    return t, teacher, students


def test_anchor_targets_select_per_setting():
    t, teacher, students = _targets()
    ref = np.random.default_rng(1).integers(2, 30, (3, 2, 4)).astype(np.int32)
    y, has = anchor_targets("verified", t, ref)
    np.testing.assert_array_equal(has, [True, True, False])
    np.testing.assert_array_equal(y[0], teacher[0])
    np.testing.assert_array_equal(y[1], students[3])
    y, has = anchor_targets("reference_ar", t, ref)
    assert has.all()
    np.testing.assert_array_equal(y, ref)
    y, has = anchor_targets("verified_else_reference_ar", t, ref)
    assert has.all()
    np.testing.assert_array_equal(y[0], teacher[0])
    np.testing.assert_array_equal(y[1], students[3])
    np.testing.assert_array_equal(y[2], ref[2])
    # verified never reads the reference (the loop does not decode it then)
    y, has = anchor_targets("verified", t, None)
    np.testing.assert_array_equal(has, [True, True, False])


def test_anchor_targets_reject_bad_input():
    t, _, _ = _targets()
    with pytest.raises(ValueError, match=r"reference tokens \(3, 2, 5\) != targets \(3, 2, 4\)"):
        anchor_targets("reference_ar", t, np.zeros((3, 2, 5), np.int32))
    with pytest.raises(ValueError, match="SDRLConfig.anchor_target: 'teacher' is not one of"):
        SDRLConfig(anchor_target="teacher")


@pytest.mark.slow
def test_reference_ar_anchor_covers_what_the_verifier_does_not(tmp_path):
    """One iteration per setting from the shipped stage-1 toy checkpoint (copy + sort): the verified anchor covers at
    most the prompts with y* (sd_gate_rate); the reference's AR outputs (greedy copy is solved by that checkpoint, so
    they terminate) anchor at least as many prompts, and a positive anchor rate gives a positive anchor loss."""
    import dataclasses
    from pathlib import Path

    import jax

    from dgemma.config import load_config
    from dgemma.parallel.mesh import make_mesh
    from dgemma.train.sdrl import run_sdrl

    repo = Path(__file__).resolve().parents[2]
    small = [f"checkpoint.init_from={repo / 'experiments/sdrl_study/checkpoint/stage1_toy'}", "trainer.steps=1",
             "data.batch_size=4", "sdrl.group_size=2", "sampler.max_steps=8", "sdrl.teacher_sampler.max_steps=16",
             "sdrl.curriculum_max_steps=[4]", "sdrl.states_per_rollout=2", "sdrl.anchor_weight=0.5",
             "sdrl.inner_epochs=1", "checkpoint.every=0", f"run.output_dir={tmp_path}"]
    out = {}
    for mode in ("verified", "reference_ar"):
        cfg = load_config(repo / "experiments/sdrl_study/stage2.yaml",
                          [*small, f"run.name={mode}", f"sdrl.anchor_target={mode}"])
        tasks = tuple(t for t in cfg.data.tasks if t.name in ("copy", "sort"))
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tasks=tasks))
        out[mode] = run_sdrl(cfg, progress=False, mesh=make_mesh({"fsdp": 1}, devices=jax.devices()[:1])).history[0]
    v, r = out["verified"], out["reference_ar"]
    assert v["anchor_rate"] <= v["sd_gate_rate"]
    assert r["anchor_rate"] > 0.0 and r["anchor_rate"] >= v["anchor_rate"]
    for m in (v, r):
        assert (m["loss_anchor"] > 0.0) == (m["anchor_rate"] > 0.0), m


def test_y_star_falls_back_to_a_verified_student_with_int32_decoder_passes():
    """The sampler's decoder_passes are int32: the best verified student of a group is still the verified one (the
    unverified rows' sentinel once wrapped to -1 in int32 and won the argmin, so y* was an unverified output)."""
    rng = np.random.default_rng(2)
    teacher = rng.integers(2, 30, (2, 2, 4)).astype(np.int32)
    students = rng.integers(2, 30, (4, 2, 4)).astype(np.int32)
    t = build_targets(teacher, np.zeros(2), students, np.array([0.0, 1.0, 1.0, 1.0]),
                      np.array([8, 4, 6, 3], np.int32), 2, reward_max=1.0, eos_ids=(EOS,), pad_id=PAD, tail_id=EOS)
    np.testing.assert_array_equal(t.student_row, [1, 3])  # prompt 0: its only verified row; prompt 1: fewer passes
    np.testing.assert_array_equal(t.committed, students[[1, 3]])

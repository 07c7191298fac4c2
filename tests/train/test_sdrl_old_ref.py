"""π_old and π_ref in one jitted program (`Iteration._old_ref_impl`) give the same numbers, bit for bit, as the
previous two separate passes (`Iteration._logp_impl`), for the exact KL's reference logits and the k3 estimator's
reference log-probs; and a whole iteration with either path gives bit-identical metrics and parameters (slow)."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from dgemma.config import load_config
from dgemma.inference.rollout import rollout
from dgemma.model.transformer import Transformer
from dgemma.train.sdrl.iteration import Iteration
from dgemma.train.sdrl.states import REPLAY_FIELDS, build_state_rows
from dgemma.train.sdrl.targets import build_targets
from dgemma.train.sdrl.teacher import student_sampler

REPO = Path(__file__).resolve().parents[2]
EOS, PAD = 1, 0
SMALL = ["model.num_hidden_layers=2", "model.layer_types=[sliding_attention, full_attention]", "trainer.steps=1",
         "data.batch_size=8", "sdrl.group_size=2", "sampler.max_steps=4", "sdrl.teacher_sampler.max_steps=8",
         "sdrl.curriculum_max_steps=[3]", "sdrl.anchor_weight=0.1", "checkpoint.every=0", "logging.jsonl=false",
         "trainer.eval_every=0", "sdrl.allow_random_init=true"]


def _rows_and_models():
    cfg = load_config(REPO / "configs/stage2/tiny.yaml", SMALL)
    student = Transformer(cfg.model_config, rngs=nnx.Rngs(3))
    reference = Transformer(cfg.model_config, rngs=nnx.Rngs(4))  # different weights: the two outputs must differ
    prompts = np.random.default_rng(0).integers(2, 32, (2, 6)).astype(np.int32)
    ro = rollout(student, prompts, np.ones((2, 6), bool), student_sampler(cfg, 4, 16), jax.random.key(0),
                 group_size=2)
    committed = np.asarray(ro.record.tokens).transpose(1, 0, 2)
    t = build_targets(committed[[0, 2]], np.ones(2), committed, np.zeros(4), np.ones(4), 2, reward_max=1.0,
                      eos_ids=(EOS,), pad_id=PAD, tail_id=EOS)
    rows = build_state_rows(ro.record, ro.prompts, ro.prompt_valid, ro.prompt_index, t, np.zeros(4), n_blocks=2,
                            eos_ids=(EOS,), pad_id=PAD, tail_id=EOS)
    graphdef, params = nnx.split(student)
    return graphdef, params, nnx.state(reference), rows.batch((*REPLAY_FIELDS, "output"))


@pytest.mark.parametrize("ref", ["logits", "logp", "none"])
def test_one_program_for_old_and_reference_equals_two_passes_bit_for_bit(ref):
    graphdef, params, ref_params, batch = _rows_and_models()
    it = Iteration.__new__(Iteration)  # only the graphdefs are read by the passes
    it.graphdef = it.ref_graphdef = graphdef  # the reference's graph is the student's without adapters
    fused = jax.jit(it._old_ref_impl, static_argnames=("ref",))
    single = jax.jit(it._logp_impl, static_argnames=("full",))
    old, got = jax.device_get(fused(params, None if ref == "none" else ref_params, batch, ref=ref))
    np.testing.assert_array_equal(old, np.asarray(single(params, batch, full=False)))
    if ref == "none":
        assert got is None
        return
    want = np.asarray(single(ref_params, batch, full=ref == "logits"))
    assert got.shape == want.shape and got.shape[:3] == old.shape and got.ndim == (4 if ref == "logits" else 3)
    np.testing.assert_array_equal(got, want)
    if ref == "logp":
        assert not np.array_equal(got, old)  # the reference pass really ran on the reference's weights


@pytest.mark.slow
def test_iteration_with_fused_passes_is_bit_identical_to_the_previous_path(tmp_path, monkeypatch):
    """One whole iteration (exact KL, anchor on) through `run_sdrl` with each path: every metric but the clocks and
    every updated parameter are equal bit for bit."""
    from dgemma.parallel.mesh import make_mesh
    from dgemma.train.sdrl import run_sdrl

    CLOCKS = ("step_time", "tokens_per_sec", "time", "elapsed")  # wall-clock metrics: differ between any two runs

    out = {}
    for fused in (True, False):
        monkeypatch.setattr(Iteration, "fused_old_ref", fused)
        cfg = load_config(REPO / "configs/stage2/tiny.yaml", [f"run.output_dir={tmp_path}", f"run.name=f{fused}",
                                                               *SMALL, "sdrl.kl_estimator=exact"])
        s = run_sdrl(cfg, progress=False, mesh=make_mesh({}, devices=jax.devices()[:1]))
        out[fused] = ({k: v for k, v in s.history[0].items() if not k.startswith("time_") and k not in CLOCKS},
                      jax.device_get(s.state.params))
    (m_new, p_new), (m_old, p_old) = out[True], out[False]
    assert m_new.keys() == m_old.keys() and "loss_kl" in m_new
    differ = [(k, m_new[k], m_old[k]) for k in m_new if m_new[k] != m_old[k]]
    assert not differ, differ
    for a, b in zip(jax.tree.leaves(p_new), jax.tree.leaves(p_old), strict=True):
        np.testing.assert_array_equal(a, b)

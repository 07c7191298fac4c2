"""Room for fewer steps (dgemma.eval.room): the per-step shares and the clairvoyant bound, on a record written by hand
(every number checked) and on a real recorded rollout (the invariants that tie the measures to the sampler)."""

from types import SimpleNamespace

import numpy as np

import jax

from dgemma.eval.room import answer_reference, room_by_step
from dgemma.inference.rollout import rollout
from dgemma.inference.sampler import SamplerConfig
from support.sampler_helpers import batch_prompts, converging_model

PAD = 0


def hand_record():
    """1 block, K 3, 2 rows, L 3. Row 0 runs 3 steps to [5 6 7]; row 1 stops after 1 step at [4 PAD PAD]."""
    T, F = True, False
    draft = np.zeros((1, 3, 2, 3), np.int32)
    accept = np.zeros((1, 3, 2, 3), bool)
    draft[0, :, 0] = [[5, 9, 7], [5, 6, 8], [5, 6, 7]]
    accept[0, :, 0] = [[T, F, F], [T, T, F], [T, T, T]]
    draft[0, 0, 1], accept[0, 0, 1] = [4, 3, 3], [T, T, T]
    draft[0, 1:, 1] = 8  # never ran: must not count
    return SimpleNamespace(draft=draft, accept=accept, step_ran=np.array([[[T, T], [T, F], [T, F]]]),
                           tokens=np.array([[[5, 6, 7], [4, PAD, PAD]]]), steps=np.array([[3, 1]]),
                           block_ran=np.array([[T, T]]))


def test_the_shares_and_the_oracle_of_a_hand_written_record():
    room = room_by_step(hand_record(), pad_id=PAD, reference=np.array([[[5, 6, 9], [4, PAD, PAD]]]))
    assert room["positions"] == [4, 3, 3] and room["states"] == [2, 1, 1]
    np.testing.assert_allclose(room["accepted"], [2 / 4, 2 / 3, 1.0])
    np.testing.assert_allclose(room["final_not_accepted"], [1 / 4, 0.0, 0.0])  # row 0's 7 at step 0
    np.testing.assert_allclose(room["not_final"], [1 / 4, 1 / 3, 0.0])  # row 0's 9, then its 8
    np.testing.assert_allclose(room["wrong"], [2 / 4, 1 / 3, 1 / 3])  # against the reference's 9
    # row 0: position 2 is final at step 0 but changes at step 1, so it is ready only at step 2: the oracle needs 3
    np.testing.assert_array_equal(room["oracle_steps"], [[3, 1]])
    np.testing.assert_array_equal(room["steps"], [[3, 1]])
    assert room["ready_at_first_step"] == 2 / 4  # row 0's 5 and row 1's 4


def test_answer_reference_pads_after_the_first_eos():
    ref = answer_reference(np.array([[3, 4, 2, 2, 2, 2], [5, 2, 6, 2, 7, 7]]), 2, 3, eos_ids=(2,), pad_id=PAD)
    np.testing.assert_array_equal(ref, [[[3, 4, 2], [5, 2, PAD]], [[PAD, PAD, PAD], [PAD, PAD, PAD]]])


def test_a_real_rollout_meets_the_invariants():
    """On a recorded rollout: the clairvoyant rule never needs more steps than the sampler took, the shares of a step
    partition its positions (accepted, or final but not accepted, or not final and not accepted), the last step's
    draft is the committed answer."""
    cfg = SamplerConfig(max_steps=6, max_new_tokens=24, eos_ids=(999,), entropy_bound=1.0, confidence_threshold=0.02)
    prompts, valid, _ = batch_prompts(B=4, P=6, seed=4)
    # test_rollout_record.py's shapes and settings (2 prompts x 2 copies): a worker that ran it reuses the compile
    rec = jax.device_get(rollout(converging_model(), prompts, valid, cfg, jax.random.key(3), group_size=2).record)
    room = room_by_step(rec, pad_id=cfg.pad_id)
    has = room["has_answer"]
    assert has.any()
    assert (room["oracle_steps"][has] >= 1).all() and (room["oracle_steps"] <= room["steps"]).all()
    assert (room["oracle_steps"][has] < room["steps"][has]).any() or (room["steps"][has] == 1).all()
    draft, acc = np.asarray(rec.draft), np.asarray(rec.accept)
    same = draft == np.asarray(rec.tokens)[:, None]
    not_final_rejected = [float((~same[:, k] & ~acc[:, k] & np.asarray(rec.step_ran)[:, k, :, None]
                                 & has[..., None] & (np.asarray(rec.tokens) != cfg.pad_id)).sum() / n)
                          for k, n in enumerate(room["positions"])]
    np.testing.assert_allclose(np.add(room["accepted"], room["final_not_accepted"]) + not_final_rejected, 1.0)
    last = np.asarray(rec.steps) - 1  # [nb, B]
    nb, _, B, _ = draft.shape
    for b in range(nb):
        for r in range(B):
            if has[b, r]:
                ans = np.asarray(rec.tokens)[b, r] != cfg.pad_id
                np.testing.assert_array_equal(draft[b, last[b, r], r][ans], np.asarray(rec.tokens)[b, r][ans])

"""Room for fewer denoising steps: what the model's drafts already knew while the accept rule still waited.

Before training a model to decode in fewer steps (stage 2), measure whether a stage-1 model leaves room for it. From
a recorded rollout (`dgemma.inference.rollout`: per block b, step k, row r and canvas position j the draft
argmax z_k, the accept set A_k and the committed tokens), at the answer positions (committed token not PAD, i.e. up
to and including the first EOS):

  final_not_accepted[k]  share of positions whose draft at step k already equals the committed token but that A_k does
                         not accept: a bolder accept rule would have kept a correct token here;
  not_final[k]           share whose draft at step k differs from the committed token: committing it now would have
                         changed the answer;
  wrong[k]               (with a reference answer, for tasks whose answer is unique) share whose draft differs from
                         the reference: committing it now would have made an error;
  accepted[k]            share in A_k;
  ready step             per position, the first step from which its draft equals the committed token at every later
                         step of the block (the earliest step a clairvoyant rule could commit it without changing the
                         answer);
  oracle steps           per block and row, 1 + the latest ready step of its positions: the forwards a clairvoyant
                         accept rule would have needed for the same answer, against the `steps` the sampler took.

Shares are over the (block, row) states that ran step k. The oracle is a bound on what accept rules can do with these
drafts, not on what training can do (training changes the drafts); a gap between the sampler's steps and the oracle's
is room a sampler setting or a distilled student may use, a small gap says the steps go to drafts that still change.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["room_by_step", "answer_reference"]


def answer_reference(tokens: np.ndarray, n_blocks: int, length: int, eos_ids, pad_id: int) -> np.ndarray:
    """The reference answer [n_blocks, B, L] of a training-layout response `tokens` [B, R] (R >= n_blocks·L): PAD
    after the first EOS, as the sampler's committed tokens are."""
    tok = np.asarray(tokens)[:, : n_blocks * length].copy()
    is_eos = np.isin(tok, np.asarray(list(eos_ids)))
    after = np.cumsum(is_eos, axis=1) - is_eos > 0  # strictly after the first EOS
    tok[after] = pad_id
    return tok.reshape(tok.shape[0], n_blocks, length).transpose(1, 0, 2)


def room_by_step(record: Any, *, pad_id: int, reference: np.ndarray | None = None) -> dict:
    """The module docstring's measures of one `RolloutRecord` (reference [nb', B, L] or None; blocks beyond the
    record's or the reference's are ignored). Returns per-step lists (index k) and per-(block, row) arrays."""
    draft = np.asarray(record.draft)  # [nb, K, B, L]
    accept = np.asarray(record.accept, bool)
    ran = np.asarray(record.step_ran, bool)  # [nb, K, B]
    final = np.asarray(record.tokens)  # [nb, B, L]
    steps = np.asarray(record.steps)  # [nb, B]
    nb, K, B, L = draft.shape
    answer = (final != pad_id) & np.asarray(record.block_ran, bool)[..., None]  # [nb, B, L]
    same = draft == final[:, None]  # [nb, K, B, L]
    at = ran[..., None] & answer[:, None]  # answer positions of the states that ran
    # ready step: the first step from which the draft equals the committed token at every later step that ran
    ok = same | ~ran[..., None]  # steps that did not run do not count against
    stays = np.flip(np.cumprod(np.flip(ok, axis=1), axis=1), axis=1).astype(bool)  # all of k..K-1 are ok
    ready = np.where((stays & ran[..., None]).any(axis=1), np.argmax(stays & ran[..., None], axis=1), K)  # [nb, B, L]
    oracle = np.where(answer, ready + 1, 0).max(axis=2)  # [nb, B]; 0 where the block has no answer position
    has = answer.any(axis=2)
    out: dict = {"states": [], "positions": [], "accepted": [], "final_not_accepted": [], "not_final": []}
    wrong_at = None
    if reference is not None:
        ref = np.asarray(reference)
        n = min(nb, ref.shape[0])
        ref_full = np.full((nb, B, L), pad_id, ref.dtype)
        ref_full[:n] = ref[:n]
        ref_answer = (ref_full != pad_id) & answer  # positions both answer and reference fill
        wrong_at = (draft != ref_full[:, None]) & ran[..., None] & ref_answer[:, None]
        ref_at = ran[..., None] & ref_answer[:, None]
        out["wrong"] = []
    for k in range(K):
        n_pos = int(at[:, k].sum())
        if n_pos == 0:
            break
        out["states"].append(int((ran[:, k] & has).sum()))
        out["positions"].append(n_pos)
        out["accepted"].append(float((accept[:, k] & at[:, k]).sum() / n_pos))
        out["final_not_accepted"].append(float((same[:, k] & ~accept[:, k] & at[:, k]).sum() / n_pos))
        out["not_final"].append(float((~same[:, k] & at[:, k]).sum() / n_pos))
        if wrong_at is not None:
            m = int(ref_at[:, k].sum())
            out["wrong"].append(float(wrong_at[:, k].sum() / m) if m else float("nan"))
    out["steps"] = np.where(has, steps, 0)  # [nb, B]
    out["oracle_steps"] = oracle
    out["has_answer"] = has
    out["ready_at_first_step"] = float((ready == 0)[answer].mean()) if answer.any() else float("nan")
    return out

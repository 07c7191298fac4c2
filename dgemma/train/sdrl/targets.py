"""Verifier-gated SD targets y* and the per-block prefix gate (docs/sdrl.md §3), on host numpy arrays.

    y*(q) = the teacher's output            if R(teacher) >= R_max
          = the best correct student output of the group (fewest decoder forwards, then lowest row) otherwise
          = none (gate g(q) = 0)             if no output of q is verified

Outputs are the sampler's committed tokens [rows, n_blocks, L] (PAD after the first EOS, all PAD once finished).
Two forms of y* are kept: `committed` (compared with a student row's committed blocks for the prefix gate) and
`supervised` (the denoising target: positions after the EOS inside the EOS block get the tail fill, EOS or PAD, as
the stage-1 layout trains them, so SD does not teach a different tail than stage 1).

Block b of student row r may use y* only if g(q) and the row's committed blocks < b equal y*'s (`prefix_gate`).
With `sdrl.sd_target = verified_agree` a state must also agree with y* inside its block (`agreement_gate`): no token the
student accepted at an earlier step of that block differs from y*. On a task with many correct answers y*(q) is one
of them, and a state whose accepted tokens already chose another cannot reach y* (the docs/sdrl.md §3 premise that y* is a
deterministic function of the state fails there); training it toward y* teaches the denoiser to override its own
canvas, and steps per block rise (experiments/sdrl_study/results.md).

`sdrl.sd_target = coupled_teacher` keeps one target per student ROLLOUT instead (`coupled_targets`): the teacher's
answer decoded from that rollout's own initial canvases and random stream (`teacher.coupled_teacher_tokens`), a
deterministic function of (prompt, initial canvas, key), so a many-answer task keeps the answer its noise chose. The
same gates apply with the rollout as the "prompt" (`prompt_index` = the row itself).
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["Targets", "agreement_gate", "anchor_targets", "build_targets", "coupled_targets", "prefix_gate",
           "supervised_tokens"]

NONE, TEACHER, STUDENT = 0, 1, 2


def supervised_tokens(committed: np.ndarray, eos_ids, pad_id: int, tail_id: int) -> np.ndarray:
    """Committed tokens [rows, n, L] -> denoising targets: after the first EOS of a row, positions of the SAME block
    take `tail_id` (the canvas tail fill); later blocks stay PAD (they are never trained)."""
    x = np.array(committed, dtype=np.int32, copy=True)
    rows, n, L = x.shape
    flat = x.reshape(rows, n * L)
    is_eos = np.isin(flat, np.asarray(tuple(eos_ids)))
    has = is_eos.any(1)
    first = np.where(has, is_eos.argmax(1), n * L)
    pos = np.arange(n * L)[None]
    eos_block_end = np.where(has, (first // L + 1) * L, 0)[:, None]
    tail = (pos > first[:, None]) & (pos < eos_block_end)
    flat = np.where(tail, tail_id, flat)
    return flat.reshape(rows, n, L).astype(np.int32)


@dataclasses.dataclass
class Targets:
    """y* per prompt. committed / supervised [Q, n, L] int32 (PAD where no target); has_target [Q] bool (the gate
    g(q)); source [Q] int (0 none, 1 teacher, 2 student); student_row [Q] (the chosen row, -1 if not a student's)."""

    committed: np.ndarray
    supervised: np.ndarray
    has_target: np.ndarray
    source: np.ndarray
    student_row: np.ndarray

    @property
    def gate_rate(self) -> float:
        return float(np.mean(self.has_target)) if self.has_target.size else 0.0


def build_targets(teacher_tokens: np.ndarray, teacher_reward: np.ndarray, student_tokens: np.ndarray,
                  student_reward: np.ndarray, student_passes: np.ndarray, group_size: int, *, reward_max: float,
                  eos_ids, pad_id: int, tail_id: int, use_teacher: bool = True) -> Targets:
    """y* for Q prompts from the teacher's output [Q, n, L] and G student outputs per prompt [Q·G, n, L].

    Rewards are the raw (unshaped) verifier rewards; an output is verified when its reward >= `reward_max`.
    `student_passes` [Q·G]: decoder forwards per row (ties among correct students go to the shortest trajectory).
    """
    Q = teacher_tokens.shape[0]
    if student_tokens.shape[0] != Q * group_size:
        raise ValueError(f"build_targets: {student_tokens.shape[0]} student rows != Q={Q} x G={group_size}")
    committed = np.full_like(teacher_tokens, pad_id, dtype=np.int32)
    source = np.zeros(Q, np.int32)
    student_row = np.full(Q, -1, np.int32)
    ok_s = np.asarray(student_reward).reshape(Q, group_size) >= reward_max
    # int64: the sentinel below wraps to -1 in an int32 array (the sampler's decoder_passes), and argmin then picked an
    # unverified row
    passes = np.asarray(student_passes, np.int64).reshape(Q, group_size)
    for q in range(Q):
        if use_teacher and teacher_reward[q] >= reward_max:
            committed[q], source[q] = teacher_tokens[q], TEACHER
        elif ok_s[q].any():
            g = int(np.argmin(np.where(ok_s[q], passes[q], np.iinfo(np.int64).max)))
            student_row[q] = q * group_size + g
            committed[q], source[q] = student_tokens[student_row[q]], STUDENT
    has = source != NONE
    supervised = np.where(has[:, None, None], supervised_tokens(committed, eos_ids, pad_id, tail_id), pad_id)
    return Targets(committed=committed, supervised=supervised.astype(np.int32), has_target=has, source=source,
                   student_row=student_row)


def coupled_targets(teacher_tokens: np.ndarray, teacher_reward: np.ndarray, *, reward_max: float, eos_ids,
                    pad_id: int, tail_id: int) -> Targets:
    """One target per student rollout [R, n, L] from the coupled teacher's answers (`teacher.coupled_teacher_tokens`):
    the answer where its reward >= `reward_max` (source TEACHER), none elsewhere (gate 0; no student fallback: another
    rollout's answer is not coupled to this rollout's noise)."""
    tok = np.asarray(teacher_tokens, np.int32)
    reward = np.asarray(teacher_reward)
    if reward.shape != tok.shape[:1]:
        raise ValueError(f"coupled_targets: {reward.shape} rewards for {tok.shape[0]} teacher answers")
    has = reward >= reward_max
    committed = np.where(has[:, None, None], tok, pad_id).astype(np.int32)
    supervised = np.where(has[:, None, None], supervised_tokens(committed, eos_ids, pad_id, tail_id), pad_id)
    return Targets(committed=committed, supervised=supervised.astype(np.int32), has_target=has,
                   source=np.where(has, TEACHER, NONE).astype(np.int32), student_row=np.full(len(has), -1, np.int32))


def prefix_gate(student_tokens: np.ndarray, targets: Targets, prompt_index: np.ndarray) -> np.ndarray:
    """[rows, n] bool: g(q) and the row's committed blocks < b equal y*'s (block 0 only needs the gate)."""
    y = targets.committed[prompt_index]  # [rows, n, L]
    same_block = np.all(np.asarray(student_tokens) == y, axis=-1)  # [rows, n]
    # prefix_ok[:, b] = all(same_block[:, :b]); block 0 has an empty prefix
    prefix_ok = np.concatenate([np.ones_like(same_block[:, :1]), np.cumprod(same_block, axis=1)[:, :-1]], axis=1)
    return prefix_ok.astype(bool) & targets.has_target[prompt_index][:, None]


def agreement_gate(accept: np.ndarray, proposal: np.ndarray, targets: Targets, prompt_index: np.ndarray,
                   pad_id: int) -> np.ndarray:
    """[nb, K, B] bool: the state at step k of block b of row r agrees with y*, i.e. at every earlier step k' < k of
    that block the accepted proposals equal y*'s tokens (`accept`, `proposal` [nb, K, B, L] from the record). Step 0
    (pure noise) always agrees. Positions where y* is PAD (after its EOS) are not compared: the sampler's tail there
    is EOS or PAD as trained. Rows without a target give False (the gate g(q))."""
    accept, proposal = np.asarray(accept, bool), np.asarray(proposal)
    nb = accept.shape[0]
    y = targets.committed[prompt_index].transpose(1, 0, 2)[:nb]  # [nb, B, L]
    compared = accept & (y != pad_id)[:, None]  # [nb, K, B, L]
    step_agrees = ~np.any(compared & (proposal != y[:, None]), axis=-1)  # [nb, K, B]
    before = np.concatenate([np.ones_like(step_agrees[:, :1]), np.cumprod(step_agrees, axis=1)[:, :-1]], axis=1)
    return before.astype(bool) & targets.has_target[prompt_index][None, None, :]


def anchor_targets(mode: str, targets: Targets, reference_tokens: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The anchor's responses [Q, n, L] and which prompts get an anchor [Q] (`sdrl.anchor_target`):

        verified                     y*; prompts without y* get none (the anchor follows the verifier)
        reference_ar                 the frozen reference's greedy AR output `reference_tokens`, on every prompt
        verified_else_reference_ar   y* where it exists, else the reference's AR output

    The reference outputs need no verifier, so a task the student never solves still anchors its AR mode."""
    if mode == "verified":
        return targets.committed, targets.has_target
    if mode not in ("reference_ar", "verified_else_reference_ar"):
        raise ValueError(f"sdrl.anchor_target: unknown {mode!r}")
    ref = np.asarray(reference_tokens, np.int32)
    if ref.shape != targets.committed.shape:
        raise ValueError(f"anchor_targets: reference tokens {ref.shape} != targets {targets.committed.shape}")
    has = np.ones(len(ref), bool)
    if mode == "reference_ar":
        return ref, has
    return np.where(targets.has_target[:, None, None], targets.committed, ref).astype(np.int32), has

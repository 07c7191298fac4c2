"""Training rows of one SD·RL iteration, built on the host from the student rollouts (docs/sdrl.md §2, §5).

One row = one recorded step k of one rollout r, with every block b of that rollout at its step k (the replay
forward evaluates all blocks of a row in one pass: clean = prompt + the rollout's committed blocks, noisy = the
recorded canvas of each block at step k with its recorded SC embedding). Rows where no block ran step k are dropped.
The loss treats each (row, block) as one state s_{r,b,k} with L positions. The rows are one typed container,
`StateRows`, whose fields, shapes and dtypes are defined once in `ROW_FIELDS` (leading axis N, padded):

    prompts [N, P] i32, prompt_valid [N, P] bool           the rollout's (left-padded) prompt
    committed [N, nb, L] i32                                the rollout's committed blocks (the replay context)
    canvas [N, nb, L] i32, tau [N, nb]                      the recorded decoder inputs and τ_k at step k,
    soft_embeds [N, nb, L, H]                               with the recorded self-conditioning embedding
    state_ran [N, nb] bool                                  block b of rollout r ran step k
    output [N, nb, L] i32                                   o: the rollout's output (tail-filled) = PG / KL tokens
    target [N, nb, L] i32                                   y* of the rollout's prompt (tail-filled), or with
                                                            sd_target=state_argmax the recorded argmax at the state,
                                                            with coupled_teacher the rollout's coupled answer
    pg_mask, sd_mask [N, nb, L] bool                        PG/KL pairs; SD pairs (+ gate g(q), prefix check and,
                                                            with sd_target=verified_agree, the in-block agreement)
    advantage, weight, omega [N, nb] f32                    Â of the rollout; pair weight 1/(R n_r); ω_k
    rollout, step [N] i32                                   bookkeeping (metrics, minibatch shuffling; not fed)
    logp_old [N, nb, L] f32                                 log π_old(o), added before the update
    logp_ref [N, nb, L] f32 | ref_logits [N, nb, L, V] f32  the reference (k3 | exact KL), added when the KL is on

The trainer's iteration (`dgemma.train.sdrl.iteration`), the loss (`dgemma.train.sdrl.loss`) and the planner's
abstract update batch (`dgemma.planning.plan_config.abstract_sdrl_batch_shapes` via `row_shapes`) all read this table.

`valid` positions are every position of the blocks a rollout ran (up to and including its EOS block), as docs/sdrl.md §2 asks:
the tail after EOS is supervised because it drives the stop rule. Padding rows have all masks False and weight 0.
"""

from __future__ import annotations

import jax
import numpy as np

import dataclasses
import math
from typing import Any

from dgemma.config.sdrl_section import SD_TARGETS
from dgemma.diffusion.sdrl_objective import pair_weights
from dgemma.inference.replay_shared import STATE_INDEX
from dgemma.train.sdrl.targets import TEACHER, Targets, agreement_gate, prefix_gate, supervised_tokens

__all__ = ["COUPLED_TARGET", "LOSS_FIELDS", "OWN_ARGMAX_TARGETS", "REPLAY_FIELDS", "ROW_FIELDS", "RowField", "StateRows",
           "build_state_rows", "committed_blocks", "minibatches", "pad_rows", "per_row_batch", "prefix_rows",
           "ran_states", "ran_states_apply", "row_shapes", "sd_teacher_share", "shared_prefix_batch",
           "shared_prefix_shapes", "subsample_states"]


@dataclasses.dataclass(frozen=True)
class RowField:
    """One field of the state rows: its trailing dims after N (symbols P, nb, L, H, V) and dtype ("act": the model's
    activation dtype); `fed`: part of the update's batch (False: host bookkeeping)."""

    name: str
    dims: tuple[str, ...]
    dtype: str
    fed: bool = True


ROW_FIELDS = (
    RowField("prompts", ("P",), "int32"), RowField("prompt_valid", ("P",), "bool"),
    RowField("committed", ("nb", "L"), "int32"), RowField("canvas", ("nb", "L"), "int32"),
    RowField("soft_embeds", ("nb", "L", "H"), "act"), RowField("tau", ("nb",), "float32"),
    RowField("state_ran", ("nb",), "bool"), RowField("output", ("nb", "L"), "int32"),
    RowField("target", ("nb", "L"), "int32"), RowField("pg_mask", ("nb", "L"), "bool"),
    RowField("sd_mask", ("nb", "L"), "bool"), RowField("advantage", ("nb",), "float32"),
    RowField("weight", ("nb",), "float32"), RowField("omega", ("nb",), "float32"),
    RowField("rollout", (), "int32", fed=False), RowField("step", (), "int32", fed=False),
    RowField("logp_old", ("nb", "L"), "float32"), RowField("logp_ref", ("nb", "L"), "float32"),
    RowField("ref_logits", ("nb", "L", "V"), "float32"),
)
# what one replay forward reads
REPLAY_FIELDS = ("prompts", "prompt_valid", "committed", "canvas", "soft_embeds", "tau", "state_ran")
LOSS_FIELDS = ("output", "target", "pg_mask", "sd_mask", "logp_old", "logp_ref", "advantage", "weight", "omega")
PREFIX_OF_ROW = ("prompts", "prompt_valid", "committed")  # a row's clean stream: the same for all states of a rollout
_OPTIONAL = ("soft_embeds", "logp_old", "logp_ref", "ref_logits")
_MASKS = ("pg_mask", "sd_mask", "state_ran")
_ZEROED = ("weight", "advantage")


@dataclasses.dataclass(frozen=True)
class StateRows:
    """The state rows of one iteration (module docstring); numpy arrays with leading axis N. Read like a mapping
    (`rows["canvas"]`, `rows.get("soft_embeds")`), so the replay functions take rows or a minibatch dict alike."""

    prompts: np.ndarray
    prompt_valid: np.ndarray
    committed: np.ndarray
    canvas: np.ndarray
    tau: np.ndarray
    state_ran: np.ndarray
    output: np.ndarray
    target: np.ndarray
    pg_mask: np.ndarray
    sd_mask: np.ndarray
    advantage: np.ndarray
    weight: np.ndarray
    omega: np.ndarray
    rollout: np.ndarray
    step: np.ndarray
    soft_embeds: np.ndarray | None = None
    logp_old: np.ndarray | None = None
    logp_ref: np.ndarray | None = None
    ref_logits: np.ndarray | None = None

    def keys(self) -> list[str]:
        """The fields present (optional ones only when set), in `ROW_FIELDS` order."""
        return [f.name for f in ROW_FIELDS if getattr(self, f.name) is not None]

    def __getitem__(self, name: str) -> np.ndarray:
        value = getattr(self, name, None) if name in _NAMES else None
        if value is None:
            raise KeyError(name)
        return value

    def __contains__(self, name: object) -> bool:
        return name in _NAMES and getattr(self, name) is not None

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self else default

    def __len__(self) -> int:
        return len(self.rollout)

    def replace(self, **fields: np.ndarray) -> StateRows:
        return dataclasses.replace(self, **fields)

    def take(self, index) -> StateRows:
        """The rows at `index` (a slice or an index array)."""
        return StateRows(**{k: self[k][index] for k in self.keys()})

    def batch(self, names: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
        """The fields the update is fed (or `names`), present ones only, as a plain dict."""
        names = tuple(f.name for f in ROW_FIELDS if f.fed) if names is None else names
        return {k: self[k] for k in names if k in self}


_NAMES = frozenset(f.name for f in ROW_FIELDS)


def row_shapes(n: int, *, P: int, nb: int, L: int, H: int, V: int, act_dtype: Any, self_conditioning: bool,
               kl: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{field: ((n, *dims), dtype)} of the state-row fields the update is fed, for `kl` in k3 | exact | off."""
    sizes = {"P": P, "nb": nb, "L": L, "H": H, "V": V}
    reference = {"exact": "ref_logits", "k3": "logp_ref"}.get(kl)  # off: neither
    skip = {"logp_ref", "ref_logits"} - {reference} | (set() if self_conditioning else {"soft_embeds"})
    return {f.name: ((n, *(sizes[d] for d in f.dims)), np.dtype(act_dtype if f.dtype == "act" else f.dtype))
            for f in ROW_FIELDS if f.fed and f.name not in skip}


def committed_blocks(record_tokens, n_blocks: int, pad_id: int) -> np.ndarray:
    """Record tokens [nb, B, L] -> [B, n_blocks, L] (blocks never run are all PAD)."""
    t = np.asarray(jax.device_get(record_tokens)).transpose(1, 0, 2)
    if t.shape[1] < n_blocks:
        t = np.concatenate([t, np.full((t.shape[0], n_blocks - t.shape[1], t.shape[2]), pad_id, t.dtype)], 1)
    return t.astype(np.int32)


def _pad_blocks(x: np.ndarray, n_blocks: int, fill) -> np.ndarray:
    """Pad axis 0 (blocks) of a record field to n_blocks."""
    if x.shape[0] >= n_blocks:
        return x
    pad = np.full((n_blocks - x.shape[0], *x.shape[1:]), fill, x.dtype)
    return np.concatenate([x, pad], 0)


OWN_ARGMAX_TARGETS = ("state_argmax", "state_argmax_agree")  # train toward the state's own argmax
COUPLED_TARGET = "coupled_teacher"  # train toward the teacher's answer from the rollout's own noise


def build_state_rows(record, prompts, prompt_valid, prompt_index: np.ndarray, targets: Targets,
                     advantages: np.ndarray, *, n_blocks: int, eos_ids, pad_id: int, tail_id: int,
                     omega: str = "uniform", states_per_rollout: int = 0, sd_target: str = "verified",
                     rollout_verified: np.ndarray | None = None, coupled: Targets | None = None,
                     rng: np.random.Generator | None = None) -> StateRows:
    """The training rows of one iteration (module docstring). `advantages` [R] per rollout row.

    `states_per_rollout` = M > 0 keeps M of each rollout's recorded steps, drawn uniformly without replacement by
    `rng`. The pair weights 1/(R n_r) are computed on the kept states, so each rollout's loss is the mean over
    its kept states: an unbiased estimate of the mean over all of its states, at M/K_r of the replay cost.
    `sd_target` (`sdrl.sd_target`): "verified" is docs/sdrl.md §3's y*(q) with the block-prefix gate; "verified_agree" also
    drops the states whose block already accepted a token that differs from y* (`targets.agreement_gate`), and the
    M kept states are drawn among the agreeing ones first (PG/KL then see early states more often; the weights stay
    1/(R n_r) on the kept states); "state_argmax" trains every kept state of a rollout whose own output is verified
    (`rollout_verified` [R] bool) toward the recorded argmax at that state; "state_argmax_agree" only at the positions
    where that argmax equals the rollout's (tail-filled) output; "coupled_teacher" trains toward `coupled` [R] (one
    target per rollout, `targets.coupled_targets`) with the gates of "verified_agree", the rollout as its own prompt."""
    rec = jax.device_get(record)
    own_argmax = sd_target in OWN_ARGMAX_TARGETS
    if sd_target not in SD_TARGETS:
        raise ValueError(f"sdrl.sd_target: unknown {sd_target!r}; expected one of {SD_TARGETS}")
    if own_argmax and rollout_verified is None:
        raise ValueError("build_state_rows: sd_target=state_argmax needs rollout_verified")
    step_ran = _pad_blocks(np.asarray(rec.step_ran, bool), n_blocks, False)  # [nb, K, B]
    R = step_ran.shape[2]
    if sd_target == COUPLED_TARGET:  # one target per rollout: the rollout is its own "prompt" for the gates
        if coupled is None or len(coupled.has_target) != R:
            raise ValueError(f"build_state_rows: sd_target={COUPLED_TARGET} needs one coupled target per rollout "
                             f"({R}), got {None if coupled is None else len(coupled.has_target)}")
        targets, prompt_index = coupled, np.arange(R)
    committed_all = committed_blocks(rec.tokens, n_blocks, pad_id)  # [B, nb, L]
    gate_all = None if own_argmax else prefix_gate(committed_all, targets, prompt_index)  # [B, nb]
    agree = None
    if sd_target in ("verified_agree", COUPLED_TARGET):
        assert gate_all is not None  # (set for every target but the own-argmax ones)
        agree = agreement_gate(_pad_blocks(np.asarray(rec.accept, bool), n_blocks, False),
                               _pad_blocks(np.asarray(rec.proposal), n_blocks, pad_id), targets, prompt_index,
                               pad_id) & gate_all.T[:, None, :]  # [nb, K, B]
    ks, rs = np.nonzero(step_ran.any(0))  # states (k, r) where some block ran step k
    if states_per_rollout > 0:
        # with `agree`, the M states are drawn among those that can carry SD first (they are the early ones)
        prefer = None if agree is None else (agree & step_ran).any(0)[ks, rs]
        ks, rs = subsample_states(ks, rs, states_per_rollout, rng or np.random.default_rng(0), prefer=prefer)
    out_all = supervised_tokens(committed_all, eos_ids, pad_id, tail_id)
    valid = step_ran[:, ks, rs].T  # [N, nb]
    L = committed_all.shape[-1]
    pg = np.repeat(valid[..., None], L, -1)
    if own_argmax:
        sd = pg & np.asarray(rollout_verified, bool)[rs][:, None, None]
        target = _pad_blocks(np.asarray(rec.draft), n_blocks, pad_id)[:, ks, rs].transpose(1, 0, 2)
        if sd_target == "state_argmax_agree":  # only where the state's mode is what the verified output became
            sd &= target == out_all[rs]
    else:
        assert gate_all is not None  # (not an own-argmax target)
        sd = pg & (gate_all[rs] if agree is None else agree[:, ks, rs].T)[..., None]
        target = targets.supervised[prompt_index[rs]]
    steps = _pad_blocks(np.asarray(rec.steps), n_blocks, 0)[:, rs].T.astype(np.float32)  # [N, nb] K_r,b
    if omega == "early":
        om = 1.0 + (steps - ks[:, None]) / np.maximum(steps, 1.0)
    else:
        om = np.ones_like(steps)
    w = np.asarray(pair_weights(pg.reshape(-1, L), np.repeat(rs, n_blocks), R)).reshape(-1, n_blocks)
    soft_embeds = (None if rec.soft_embeds is None
                   else _pad_blocks(np.asarray(rec.soft_embeds), n_blocks, 0)[:, ks, rs].transpose(1, 0, 2, 3))
    return StateRows(
        prompts=np.asarray(prompts)[rs].astype(np.int32),
        prompt_valid=np.asarray(prompt_valid)[rs].astype(bool),
        committed=committed_all[rs],
        canvas=_pad_blocks(np.asarray(rec.canvas), n_blocks, pad_id)[:, ks, rs].transpose(1, 0, 2),
        tau=np.where(valid, _pad_blocks(np.asarray(rec.tau, np.float32), n_blocks, 1.0)[:, ks, rs].T, 1.0),
        state_ran=valid,
        output=out_all[rs],
        target=target.astype(np.int32),
        pg_mask=pg, sd_mask=sd,
        advantage=np.repeat(np.asarray(advantages, np.float32)[rs][:, None], n_blocks, 1),
        weight=w.astype(np.float32), omega=om.astype(np.float32),
        rollout=rs.astype(np.int32), step=ks.astype(np.int32), soft_embeds=soft_embeds)


def sd_teacher_share(rows: StateRows, targets: Targets, prompt_index: np.ndarray, sd_target: str) -> float:
    """The share of the SD-trained (state, position) pairs whose target is the teacher's output. Under the verified
    targets that is where y*(q) came from the teacher (`targets.source`); the state_argmax* targets train toward the
    student's own argmax at the state, so none is the teacher's even when the prompt's y* is (the per-prompt
    `target_from_teacher` metric reads 1 there). 0 when no pair trains SD."""
    sd = np.asarray(rows["sd_mask"], bool)
    if not sd.any() or sd_target in OWN_ARGMAX_TARGETS:
        return 0.0
    if sd_target == COUPLED_TARGET:  # every coupled target is a teacher's answer
        return 1.0
    from_teacher = np.asarray(targets.source)[np.asarray(prompt_index)[rows["rollout"]]] == TEACHER  # [N]
    return float(sd[from_teacher].sum() / sd.sum())


def subsample_states(ks: np.ndarray, rs: np.ndarray, m: int, rng: np.random.Generator,
                     prefer: np.ndarray | None = None):
    """At most `m` of the states (k, r) of each rollout r, uniformly without replacement; order (by k, then r) kept.
    With `prefer` [len(rs)] bool, a rollout's preferred states are drawn first and the others fill the remaining
    places (uniformly within each group)."""
    keep = np.zeros(len(rs), bool)
    for r in np.unique(rs):
        idx = np.flatnonzero(rs == r)
        if len(idx) <= m:
            keep[idx] = True
            continue
        first = idx[prefer[idx]] if prefer is not None else idx
        pick = rng.choice(first, min(m, len(first)), replace=False)
        if len(pick) < m:
            rest = np.setdiff1d(idx, first)
            pick = np.concatenate([pick, rng.choice(rest, m - len(pick), replace=False)])
        keep[pick] = True
    return ks[keep], rs[keep]


def pad_rows(rows: StateRows, multiple: int) -> StateRows:
    """Pad N up to the next power of two that is a multiple of `multiple` (few distinct shapes -> few compiles);
    padding rows repeat row 0 with masks False and weight 0, so they change nothing."""
    n = len(rows)
    size = multiple
    while size < n:
        size *= 2
    extra = size - n
    if not extra:
        return rows
    out = {}
    for k in rows.keys():
        v = rows[k]
        fill = np.repeat(v[:1], extra, 0)
        if k in _MASKS or k in _ZEROED:
            fill = np.zeros_like(fill)
        out[k] = np.concatenate([v, fill], 0)
    return StateRows(**out)


def minibatches(rows: StateRows, num: int, key: np.random.Generator) -> list[StateRows]:
    """`num` equal minibatches of a shuffled permutation of the rows (N must be divisible by `num`). Weights are
    scaled by `num`, so each minibatch's loss is an unbiased estimate of the whole iteration's loss."""
    n = len(rows)
    if n % num:
        raise ValueError(f"{n} state rows are not divisible into {num} minibatches")
    perm = key.permutation(n) if num > 1 else np.arange(n)
    size = n // num
    out = []
    for i in range(num):
        mb = rows.take(perm[i * size:(i + 1) * size])
        out.append(mb.replace(weight=mb.weight * np.float32(num)))
    return out


def shared_prefix_batch(rows: StateRows, names: tuple[str, ...] | None = None, multiple: int = 1,
                        ran_only: bool = False) -> dict:
    """`rows.batch(names)` with each distinct clean stream (prompt, prompt validity, committed blocks) once: the
    per-row `prompts`, `prompt_valid`, `committed` become `prefix_prompts` [U, P], `prefix_prompt_valid`,
    `prefix_committed` [U, nb, L] and `prefix_index` [N] (row -> prefix row), which the replay reads to run the clean
    stream once per rollout (`dgemma.inference.replay_shared`). Rows are grouped by their content, not by their
    rollout id, so rows can only share a prefix that is really the same. U is padded like `pad_rows` (a power of
    two times `multiple`, so its sharding divides it and few shapes compile) with copies of prefix row 0 that no row
    reads. `ran_only` adds `state_index` [S]: the flat (row, block) index n·nb + b of every state that ran, padded
    with N·nb to `ran_states(...)` entries, so the replay runs only those blocks' noisy streams."""
    out = {k: v for k, v in rows.batch(names).items() if k not in PREFIX_OF_ROW}
    if ran_only:
        ran = np.flatnonzero(np.asarray(rows.state_ran).reshape(-1)).astype(np.int32)
        total = rows.state_ran.size
        out[STATE_INDEX] = np.concatenate([ran, np.full(ran_states(len(ran), total, multiple) - len(ran), total,
                                                          np.int32)])
    n = len(rows)
    key = np.concatenate([rows.prompts, rows.prompt_valid.astype(np.int32), rows.committed.reshape(n, -1)], 1)
    _, first, index = np.unique(key, axis=0, return_index=True, return_inverse=True)
    first = np.concatenate([first, np.zeros(prefix_rows(len(first), multiple) - len(first), first.dtype)])
    out.update(prefix_prompts=rows.prompts[first], prefix_prompt_valid=rows.prompt_valid[first],
               prefix_committed=rows.committed[first], prefix_index=index.reshape(-1).astype(np.int32))
    return out


def prefix_rows(distinct: int, multiple: int) -> int:
    """The padded number of prefix rows U for `distinct` clean streams (`shared_prefix_batch`, the planner)."""
    size = multiple
    while size < distinct:
        size *= 2
    return size


def ran_states_apply(attention_impl: str) -> bool:
    """Whether the update replays only the states that ran (`shared_prefix_batch(ran_only=True)`): with dense
    attention only; a state's single block as the noisy stream is a layout the chunked / Splash tilings do not take
    (its L queries are not a multiple of their query chunk)."""
    return attention_impl == "dense"


def ran_states(ran: int, total: int, multiple: int) -> int:
    """The padded length S of `state_index` for `ran` of `total` (row, block) states: rounded up to an eighth of
    `total` (a multiple of `multiple`, so its sharding divides it), at most `total`: at most 8 shapes compile."""
    step = multiple * max(1, total // (8 * multiple))
    return min(total, max(step, -(-ran // step) * step))


def shared_prefix_shapes(shapes: dict, prefixes: int, ran_only: bool = False) -> dict:
    """`row_shapes` output in the `shared_prefix_batch` layout with `prefixes` (U) prefix rows: what the update is
    fed by default (the planner's abstract batch); `ran_only`: with `state_index` at its worst case (every state
    ran)."""
    out = {k: v for k, v in shapes.items() if k not in PREFIX_OF_ROW}
    for name in PREFIX_OF_ROW:
        shape, dtype = shapes[name]
        out[f"prefix_{name}"] = ((prefixes, *shape[1:]), dtype)
    out["prefix_index"] = ((shapes["canvas"][0][0],), np.dtype(np.int32))
    if ran_only:
        out[STATE_INDEX] = ((math.prod(shapes["state_ran"][0]),), np.dtype(np.int32))
    return out


def per_row_batch(batch: dict) -> dict:
    """The inverse of `shared_prefix_batch`: each row's `prompts`, `prompt_valid`, `committed` from its prefix row
    (other keys unchanged; a batch without `prefix_index` is returned as it is)."""
    if "prefix_index" not in batch:
        return dict(batch)
    index = np.asarray(batch["prefix_index"])
    out = {k: v for k, v in batch.items() if not k.startswith("prefix_") and k != STATE_INDEX}
    out.update({name: np.asarray(batch[f"prefix_{name}"])[index] for name in PREFIX_OF_ROW})
    return out

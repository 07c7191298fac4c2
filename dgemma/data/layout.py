"""The training layout: (prompt ids, response ids) -> one fixed-shape block-diffusion training example (`to_layout`).

Block diffusion denoises the response in blocks of L tokens, left to right, each conditioned on the
prompt and the committed earlier blocks (docs/stage1.md §4). Training therefore needs every example in the same
fixed layout, the clean stream of docs/stage1.md §4::

    [ left-padded prompt: P ][ block 0: L ][ block 1: L ] ... [ block N-1: L ]      T = P + R,  R = N * L

The response is EOS-terminated (EOS is appended here). The block holding the EOS is completed with the *tail*:
`tail_fill="eos"` repeats EOS (Google's CanvasChunker, the default) and `"pad"` uses PAD (TraceRL style). The tail
is supervised by the diffusion loss, so the denoiser learns to settle post-EOS positions quickly instead of
leaving them high-entropy (which would delay the mean-entropy stop rule). Blocks after the EOS block are never
created: they are padding, `block_used=False`, zero weight.

Worked example: P = 4, L = 4, N = 3, prompt = [BOS 7 8], response = [5 6 9 4 3], tail_fill = "eos"::

    i             0    1    2    3 |  4    5    6    7 |  8    9   10   11 | 12   13   14   15
    tokens      PAD  BOS    7    8 |  5    6    9    4 |  3  EOS  EOS  EOS | PAD  PAD  PAD  PAD
    positions     0    1    2    3 |  4    5    6    7 |  8    9   10   11 | 12   13   14   15
    valid         0    1    1    1 |  1    1    1    1 |  1    1    1    1 |  0    0    0    0
    prompt_mask   0    1    1    1 |  0    0    0    0 |  0    0    0    0 |  0    0    0    0
    block_id     -2   -1   -1   -1 |  0    0    0    0 |  1    1    1    1 | -2   -2   -2   -2
    ar_targets  BOS    7    8    5 |  6    9    4    3 | EOS EOS  EOS  PAD | PAD  PAD  PAD  PAD
    ar_weight     0    0    0    1 |  1    1    1    1 |  1    0    0    0 |  0    0    0    0
    diffusion_weight (R)           |  1    1    1    1 |  1    1    1    1 |  0    0    0    0
    block_used (N)                         1                  1                   0

Contract (per example; the pipeline stacks a leading batch axis):

=================  ==========  =======  ==============================================================
key                shape       dtype    meaning
=================  ==========  =======  ==============================================================
tokens             [P+R]       int32    clean stream: left-padded prompt, then response blocks
positions          [P+R]       int32    absolute position = arange(P+R); pads consume positions
valid              [P+R]       bool     real prompt tokens and tokens of used blocks (incl. the tail)
prompt_mask        [P+R]       bool     real (non-pad) prompt tokens
block_id           [P+R]       int32    -1 real prompt token, b for block b, -2 (PAD_BLOCK_ID) if invalid
block_used         [N]         bool     block b is used (b <= the EOS block)
diffusion_weight   [R]         float32  1 on every position of used blocks (response, EOS, tail)
ar_targets         [P+R]       int32    tokens shifted left by one (next-token target), PAD at the end
ar_weight          [P+R]       float32  1 where i predicts a response token up to and including EOS;
                                        i = P-1 (last prompt token -> first response token) counts;
                                        `ar_on_prompt` adds prompt->prompt, `ar_on_tail` adds the tail
example_mask       []          bool     False only for a row dropped by response_overflow="drop"
prompt_length      []          int32    real prompt tokens after truncation
response_length    []          int32    response tokens including the EOS (tail excluded)
=================  ==========  =======  ==============================================================

Structural block ids for mask building are `floor((positions - P) / L)` on the response; `block_id` marks
invalid positions with -2 so that a mask builder cannot mistake padding for a prompt or block token.

Overflow policy:
* prompt longer than P: `truncate_prompt="left"` keeps the last tokens (and a leading BOS, which Gemma needs);
  `"right"` keeps the first P; `"error"` raises `LayoutOverflowError`.
* response + EOS longer than R: `response_overflow="error"` raises; `"drop"` returns an all-padding row with
  `example_mask=False` and zero weights, which keeps shapes and the step -> data map fixed (a filtered
  MapDataset could not be batched random-access). Consumers must tolerate rows with no valid key (finite masks).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dgemma.data.config import LayoutConfig
from dgemma.data.tokenizer import BOS_ID, EOS_ID, PAD_ID

PROMPT_BLOCK_ID = -1
PAD_BLOCK_ID = -2
EXAMPLE_KEYS = (
    "tokens",
    "positions",
    "valid",
    "prompt_mask",
    "block_id",
    "block_used",
    "diffusion_weight",
    "ar_targets",
    "ar_weight",
    "example_mask",
    "prompt_length",
    "response_length",
)


class LayoutOverflowError(ValueError):
    """A prompt or response does not fit the configured layout and the policy is 'error'."""


def example_spec(cfg: LayoutConfig) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shape and dtype of every key of one example (prepend the batch size for a batch)."""
    T, R, N = cfg.seq_len, cfg.response_len, cfg.n_blocks
    i32, b, f32 = np.dtype(np.int32), np.dtype(np.bool_), np.dtype(np.float32)
    return {
        "tokens": ((T,), i32),
        "positions": ((T,), i32),
        "valid": ((T,), b),
        "prompt_mask": ((T,), b),
        "block_id": ((T,), i32),
        "block_used": ((N,), b),
        "diffusion_weight": ((R,), f32),
        "ar_targets": ((T,), i32),
        "ar_weight": ((T,), f32),
        "example_mask": ((), b),
        "prompt_length": ((), i32),
        "response_length": ((), i32),
    }


def _where(index: int | None) -> str:
    return "example" if index is None else f"example {index}"


def _fit_prompt(prompt: np.ndarray, cfg: LayoutConfig, bos_id: int | None, index: int | None) -> np.ndarray:
    P = cfg.prompt_len
    if prompt.size <= P:
        return prompt
    if cfg.truncate_prompt == "error":
        raise LayoutOverflowError(
            f"{_where(index)}: prompt has {prompt.size} tokens > LayoutConfig.prompt_len={P} "
            "(truncate_prompt='error'; use 'left'/'right' or raise prompt_len)"
        )
    if cfg.truncate_prompt == "right":
        return prompt[:P]
    if bos_id is not None and prompt[0] == bos_id and P > 1:
        return np.concatenate([prompt[:1], prompt[prompt.size - (P - 1) :]])
    return prompt[prompt.size - P :]


def empty_example(cfg: LayoutConfig, pad_id: int = PAD_ID) -> dict[str, np.ndarray]:
    """An all-padding row with zero weight (what response_overflow='drop' emits)."""
    out = {}
    for key, (shape, dtype) in example_spec(cfg).items():
        out[key] = np.zeros(shape, dtype)
    out["tokens"][:] = pad_id
    out["ar_targets"][:] = pad_id
    out["positions"][:] = np.arange(cfg.seq_len, dtype=np.int32)
    out["block_id"][:] = PAD_BLOCK_ID
    return out


def to_layout(
    prompt_ids: Sequence[int] | np.ndarray,
    response_ids: Sequence[int] | np.ndarray,
    cfg: LayoutConfig,
    *,
    pad_id: int = PAD_ID,
    eos_id: int = EOS_ID,
    bos_id: int | None = BOS_ID,
    index: int | None = None,
) -> dict[str, np.ndarray]:
    """Lays out one example per the module contract.

    Args:
      prompt_ids: prompt token ids, BOS included if wanted (it is not added here).
      response_ids: response ids *without* the terminating EOS (it is appended; a response that already ends in
        EOS is taken as terminated).
      cfg: layout and overflow policy.
      pad_id, eos_id: fill ids. bos_id: protects a leading BOS from left truncation (None disables).
      index: the example's source index, used only in error messages.
    """
    P, N, R = cfg.prompt_len, cfg.n_blocks, cfg.response_len  # response_len checks canvas_length is set
    L, T = cfg.canvas_length, P + R
    assert L is not None  # response_len above raised if it is unset
    prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
    resp = np.asarray(response_ids, dtype=np.int64).reshape(-1)
    if resp.size == 0 or resp[-1] != eos_id:
        resp = np.append(resp, eos_id)
    prompt = _fit_prompt(prompt, cfg, bos_id, index)
    n_resp = int(resp.size)
    if n_resp > R:
        if cfg.response_overflow == "drop":
            return empty_example(cfg, pad_id)
        raise LayoutOverflowError(
            f"{_where(index)}: response has {n_resp} tokens incl. EOS > n_blocks*canvas_length = "
            f"{N}*{L} = {R} (prompt {prompt.size} tokens); raise n_blocks or set response_overflow='drop'"
        )
    n_prompt = int(prompt.size)
    n_blocks = -(-n_resp // L)
    used = n_blocks * L
    prompt_start = P - n_prompt

    tokens = np.full(T, pad_id, dtype=np.int32)
    tokens[prompt_start:P] = prompt
    tokens[P : P + n_resp] = resp
    tokens[P + n_resp : P + used] = eos_id if cfg.tail_fill == "eos" else pad_id

    idx = np.arange(T, dtype=np.int32)
    prompt_mask = (idx >= prompt_start) & (idx < P)
    in_response = (idx >= P) & (idx < P + used)
    valid = prompt_mask | in_response
    block_id = np.full(T, PAD_BLOCK_ID, dtype=np.int32)
    block_id[prompt_mask] = PROMPT_BLOCK_ID
    block_id[in_response] = (idx[in_response] - P) // L

    # ar_supervised[j]: token j is a next-token target. ar_weight[i] = valid[i] and ar_supervised[i + 1].
    ar_supervised = (idx >= P) & (idx < P + (used if cfg.ar_on_tail else n_resp))
    if cfg.ar_on_prompt:
        ar_supervised |= prompt_mask
    ar_weight = np.zeros(T, dtype=np.float32)
    ar_weight[:-1] = (valid[:-1] & ar_supervised[1:]).astype(np.float32)
    ar_targets = np.full(T, pad_id, dtype=np.int32)
    ar_targets[:-1] = tokens[1:]

    return {
        "tokens": tokens,
        "positions": idx.copy(),
        "valid": valid,
        "prompt_mask": prompt_mask,
        "block_id": block_id,
        "block_used": np.arange(N) < n_blocks,
        "diffusion_weight": in_response[P:].astype(np.float32),
        "ar_targets": ar_targets,
        "ar_weight": ar_weight,
        "example_mask": np.array(True),
        "prompt_length": np.array(n_prompt, dtype=np.int32),
        "response_length": np.array(n_resp, dtype=np.int32),
    }


def response_before_eos(example: dict[str, np.ndarray], cfg: LayoutConfig, eos_id: int = EOS_ID) -> np.ndarray:
    """The response ids of a (single) example up to, excluding, the first EOS — the inverse of to_layout."""
    resp = np.asarray(example["tokens"])[cfg.prompt_len :]
    hits = np.flatnonzero(resp == eos_id)
    return resp[: hits[0]] if hits.size else resp

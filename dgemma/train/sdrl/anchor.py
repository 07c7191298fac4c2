"""The anchor rows of an SD·RL iteration: the stage-1 layout of (q, y*) (docs/sdrl.md §5, `sdrl.anchor`)."""

from __future__ import annotations

import numpy as np

from dgemma.data.layout import LayoutOverflowError, to_layout

__all__ = ["anchor_rows"]


def anchor_rows(batch: dict, committed_targets: np.ndarray, has_target: np.ndarray, layout_cfg, *, eos_id: int,
                pad_id: int, bos_id: int | None) -> dict[str, np.ndarray]:
    """The stage-1 rows of (q, y*): the data batch's prompt with y* (before its EOS) as the response, laid out like
    training data. Rows without y* (or whose y* has no room for its EOS) keep their layout with zero loss weights,
    so the anchor never trains on the data's reference answer."""
    P = layout_cfg.prompt_len
    out = {k: np.array(v, copy=True) for k, v in batch.items() if k != "index"}
    for q in range(len(has_target)):
        keep = False
        if has_target[q]:
            prompt = np.asarray(batch["tokens"][q, :P])[np.asarray(batch["prompt_mask"][q, :P], bool)]
            y = committed_targets[q].reshape(-1)
            hits = np.flatnonzero(y == eos_id)
            resp = y[: hits[0]] if hits.size else y
            try:
                row = to_layout(prompt, resp, layout_cfg, pad_id=pad_id, eos_id=eos_id, bos_id=bos_id)
                for k, v in row.items():
                    out[k][q] = v
                keep = True
            except LayoutOverflowError:
                keep = False
        if not keep:
            out["diffusion_weight"][q] = 0.0
            out["ar_weight"][q] = 0.0
    return out

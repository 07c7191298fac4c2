"""Exact-match evaluation on verifiable tasks: decode held-out prompts and score them with the task rewards.

Prompts come straight from pipeline batches (left-padded prompt region + valid mask), so evaluation sees exactly the
training encoding; the reward target is `pipeline.source[index]`. Rewards cut generations at the first EOS.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import numpy as np

from dgemma.data.rewards import reward


def decode_ar(model, prompt, prompt_valid, max_new_tokens: int):
    from dgemma.inference.ar import generate

    return np.asarray(generate(model, prompt, prompt_valid, max_new_tokens=max_new_tokens))


def evaluate_exact_match(model, pipeline, steps: range | list[int], *,
                         decode: Callable | None = None) -> dict[str, dict[str, float]]:
    """Per-task exact match over the batches `pipeline.batch(s)` for s in `steps`.

    decode(model, prompt [B,P], prompt_valid [B,P], max_new_tokens) -> [B, >=1] tokens; default: AR greedy.
    Returns {task: {"exact_match": mean reward, "n": count}} plus an "all" entry.
    """
    decode = decode or decode_ar
    scores: dict[str, list[float]] = defaultdict(list)
    for s in steps:
        batch = pipeline.batch(s)
        R = batch["diffusion_weight"].shape[1]
        P = batch["tokens"].shape[1] - R
        out = decode(model, batch["tokens"][:, :P], batch["valid"][:, :P], R)
        for row, idx in enumerate(batch["index"]):
            if not bool(batch["example_mask"][row]):
                continue
            example = pipeline.source[int(idx)]
            r = reward(example, [int(t) for t in out[row]], pipeline.tokenizer)
            scores[example.task].append(r)
            scores["all"].append(r)
    return {task: {"exact_match": float(np.mean(v)), "n": len(v)} for task, v in sorted(scores.items())}

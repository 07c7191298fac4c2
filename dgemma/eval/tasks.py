"""Exact-match evaluation on verifiable tasks: decode held-out prompts and score them with the task rewards.

Prompts come straight from pipeline batches (left-padded prompt region + valid mask), so evaluation sees exactly the
training encoding; the reward target is `pipeline.source[index]`. Rewards cut generations at the first EOS.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Callable

import numpy as np

from dgemma.data.rewards import reward


HELD_OUT_SEED_OFFSET = 10_007


def held_out_pipeline(data_cfg, batch_size: int):
    """The data config's stream with another seed (held-out prompts), unshuffled, single process, synchronous."""
    from dgemma.data.pipeline import DataPipeline

    data = dataclasses.replace(data_cfg, seed=data_cfg.seed + HELD_OUT_SEED_OFFSET, batch_size=batch_size,
                               shuffle=False, num_threads=0)
    return DataPipeline(data, process_index=0, process_count=1)


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


def evaluate_modes(model, pipeline, steps, sampler_cfg, modes=("ar", "diffusion", "auto"), key=None) -> dict:
    """Exact match per task for each decoding mode on the same prompts, with the sampler's efficiency metrics.

    Returns {mode: {"exact_match": {task: {...}}, "tpf": mean tokens per forward, "steps_per_block": mean decoder
    forwards per block, "pct_max_steps": share of blocks that hit max_steps, "commit_step": [N, blocks, L] array
    (diffusion modes; for the commitment heatmap)}}.
    """
    import jax

    from dgemma.inference.sampler import MAX_STEPS, sample

    key = jax.random.key(0) if key is None else key
    out = {}
    for mode in modes:
        results = []

        def decode(m, prompt, valid, max_new_tokens, _mode=mode):
            cfg = dataclasses.replace(sampler_cfg, max_new_tokens=max_new_tokens)
            res = sample(m, prompt, valid, cfg, jax.random.fold_in(key, len(results)), _mode)
            results.append(res)
            return res.tokens

        em = evaluate_exact_match(model, pipeline, steps, decode=decode)
        row = {"exact_match": em, "tpf": float(np.nanmean(np.concatenate([r.tokens_per_forward for r in results])))}
        if mode != "ar":
            steps_pb = np.concatenate([r.steps_per_block.reshape(-1) for r in results])
            active = steps_pb > 0
            reasons = np.concatenate([r.stop_reason.reshape(-1) for r in results])
            row.update(steps_per_block=float(steps_pb[active].mean()) if active.any() else float("nan"),
                       pct_max_steps=float((reasons[active] == MAX_STEPS).mean()) if active.any() else float("nan"),
                       commit_step=np.concatenate([r.commit_step for r in results]))
        out[mode] = row
    return out

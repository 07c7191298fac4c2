"""Generative perplexity: how likely a reference AR model finds the answers a decoding produced.

The standard quality measure of diffusion LMs beside task accuracy: each generated answer (its tokens up to and
including the first stop token; pads never count) is teacher-forced through a causal model after its own prompt, and

    gen_ppl = exp(Σ NLL of the answer tokens / number of answer tokens)        (token-weighted over all rows)

The scoring model is typically the stage-0 AR model (the conversion's starting point), so a stage-1 decoding that
drifts from fluent text scores higher. Collapse lowers it (a repeated likely token is cheap), so it is read beside
answer entropy (`dgemma.eval.diversity.plugin_entropy`), never alone. The encoding is the training one: prompts are
left-padded with a valid mask, positions are absolute (pads consume positions, `dgemma.data.layout`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["answer_tokens", "generative_perplexity"]


def answer_tokens(generated: Sequence[int], stop_ids: Sequence[int], pad_id: int) -> list[int]:
    """The scored part of a generation: its tokens up to and including the first stop id, pads dropped."""
    out = []
    stops = set(int(s) for s in stop_ids)
    for t in (int(x) for x in np.asarray(generated).reshape(-1)):
        if t == pad_id:
            continue
        out.append(t)
        if t in stops:
            break
    return out


def generative_perplexity(model, prompts, prompt_valid, answers: Sequence[Sequence[int]], *,
                          batch_size: int = 8) -> dict:
    """Teacher-forced NLL of `answers[i]` after prompt row i under the causal `model` (module docstring).

    Args:
      model: a `dgemma.model.transformer.Transformer` (its causal call gives next-token logits).
      prompts, prompt_valid: int [N, P] left-padded prompts and their bool valid mask [N, P].
      answers: N token lists (already cut, e.g. by `answer_tokens`); an empty answer contributes nothing.
      batch_size: rows per forward.

    Returns {"gen_ppl", "nll" (mean per token), "tokens" (scored tokens), "row_nll" (per row: Σ NLL, or NaN for an
    empty answer), "row_tokens"}.
    """
    import jax
    import jax.numpy as jnp

    prompts = np.asarray(prompts, np.int32)
    prompt_valid = np.asarray(prompt_valid, bool)
    if prompts.ndim != 2 or prompts.shape != prompt_valid.shape or len(answers) != prompts.shape[0]:
        raise ValueError(f"generative_perplexity: prompts {prompts.shape}, valid {prompt_valid.shape} and "
                         f"{len(answers)} answers do not match")
    n, p = prompts.shape
    r = max([len(a) for a in answers] + [1])
    row_nll = np.full(n, np.nan)
    row_tokens = np.zeros(n, np.int64)

    from flax import nnx

    graphdef, state = nnx.split(model)

    @jax.jit
    def token_nll(st, tokens, valid):
        logits = nnx.merge(graphdef, st)(tokens, None, valid).astype(jnp.float32)[:, :-1]
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]  # NLL of token t+1 given <= t

    for s in range(0, n, batch_size):
        rows = list(range(s, min(s + batch_size, n)))
        b = batch_size  # fixed shapes: one compile for every batch (the tail repeats row 0, masked out)
        ans = np.zeros((b, r), np.int32)
        ans_valid = np.zeros((b, r), bool)
        for j, i in enumerate(rows):
            ans[j, :len(answers[i])] = answers[i]
            ans_valid[j, :len(answers[i])] = True
        pr = np.concatenate([prompts[rows], np.repeat(prompts[rows[:1]], b - len(rows), 0)])
        pv = np.concatenate([prompt_valid[rows], np.repeat(prompt_valid[rows[:1]], b - len(rows), 0)])
        nll = np.asarray(token_nll(state, jnp.asarray(np.concatenate([pr, ans], 1)),
                                   jnp.asarray(np.concatenate([pv, ans_valid], 1))), np.float64)
        scored = nll[:, p - 1:p - 1 + r] * ans_valid  # logits at position p-1+k predict answer token k
        for j, i in enumerate(rows):
            row_tokens[i] = len(answers[i])
            if row_tokens[i]:
                row_nll[i] = float(scored[j].sum())
    total = int(row_tokens.sum())
    mean = float(np.nansum(row_nll) / total) if total else float("nan")
    return {"gen_ppl": math.exp(mean) if total else float("nan"), "nll": mean, "tokens": total,
            "row_nll": row_nll.tolist(), "row_tokens": row_tokens.tolist()}

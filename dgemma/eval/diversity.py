"""Diversity beside accuracy: do a decoding's answers keep the data's choices, or does it buy steps with collapse?

Exact match cannot see mode collapse on the many-answer tasks (any valid answer scores 1). Here each held-out prompt
is decoded with K sampler keys (same prompt, same settings, different keys) and, per task, compared with what the
data itself gives the same prompts (`dgemma.data.tasks.free_choices`, `answer_count`):

    entropy_free        mean over (prompt, free position) of the plug-in (maximum-likelihood) entropy, in nats, of
                        the K answer characters at that position. Plug-in entropy of K draws is biased low (at most
                        ln K), so it is compared with
    entropy_free_ci     (mean, lo, hi): its 95 % bootstrap CI over prompts
    entropy_free_data   the data's expected plug-in entropy of K draws from that position's distribution: exact
                        (binomial counts per character, by linearity), i.e. bias-matched, not ln 10
    entropy_pooled      entropy of the characters' choice index pooled over every (prompt, free position, key) of the
                        task (PICK/AGREE: 0 = the prompt digit, 1 = one more; FILL: the digit; PERM: the rank among
                        the prompt's digits; an invalid character is one more symbol): many draws, so it is close to
    entropy_pooled_data the data's value, exact (ln 2 for PICK and AGREE, ln 10 for FILL)
    plus_one_rate       PICK/AGREE: the pooled rate of choice 1 (data 0.5)
    distinct            mean over prompts of #distinct answers (text before EOS) / K; distinct_data: the data's
                        expected value, exact: N (1 - (1 - 1/N)^K) / K for N equally likely answers
    invalid_free        fraction of free-position characters that are no valid choice
    collapse            entropy_free < collapse_ratio * entropy_free_data (default 0.5)
    entropy_free_per_prompt  [Σ entropy, #free positions] per prompt (what `pool_models` resamples)

`measure` computes these from decoded outputs; `evaluate_diversity` decodes with K keys through the one evaluator
(`dgemma.eval.evaluator.evaluate`, key k = fold_in(key, k)); `dgemma.eval.frontier.sweep(..., diversity=True)` uses
its seeds as the K keys. `pool_models` pools the measures of several models of one arm (e.g. one per training seed),
each measured over its own K keys: a trained arm's diversity is each model's spread across keys, never the spread
between models (that would hide a collapse that lands on a different answer in each seed).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

__all__ = ["COLLAPSE_RATIO", "evaluate_diversity", "expected_distinct", "expected_plugin_entropy", "measure",
           "measure_rows", "plugin_entropy", "pool_models"]

COLLAPSE_RATIO = 0.5
MANY_ANSWER_TASKS = ("pick", "fill", "agree", "perm")  # the tasks whose data gives a prompt more than one answer


def plugin_entropy(symbols: Sequence) -> float:
    """Plug-in entropy (nats) of the empirical distribution of `symbols`."""
    if not len(symbols):
        raise ValueError("plugin_entropy: no symbols")
    p = np.asarray(list(Counter(symbols).values()), np.float64) / len(symbols)
    return float(-(p * np.log(p)).sum())


def expected_plugin_entropy(dist: dict, k: int) -> float:
    """E[plug-in entropy of k iid draws from `dist`] (nats), exact: sum over characters c and counts n of
    Binomial(k, p_c)(n) * -(n/k) ln(n/k)."""
    if k < 1:
        raise ValueError(f"expected_plugin_entropy: k = {k} draws; need >= 1")
    n = np.arange(1, k + 1)
    h = -(n / k) * np.log(n / k)
    logc = np.array([math.lgamma(k + 1) - math.lgamma(i + 1) - math.lgamma(k - i + 1) for i in n])
    total = 0.0
    for p in dist.values():
        if p <= 0.0:
            continue
        if p >= 1.0:
            continue  # a certain character: entropy 0
        total += float((np.exp(logc + n * math.log(p) + (k - n) * math.log1p(-p)) * h).sum())
    return total


def expected_distinct(n_answers: int, k: int) -> float:
    """E[#distinct among k iid draws, uniform over n_answers] = N (1 - (1 - 1/N)^k), exact (N may be huge)."""
    if n_answers < 1 or k < 1:
        raise ValueError(f"expected_distinct: N = {n_answers}, k = {k}; need both >= 1")
    if n_answers == 1:
        return 1.0
    return float(n_answers * -math.expm1(k * math.log1p(-1.0 / n_answers)))


def _text(generated, tokenizer) -> str:
    from dgemma.data.rewards import cut_at_eos

    head, _ = cut_at_eos(generated, tokenizer)
    if isinstance(head, str):
        return head.strip()
    if tokenizer is None:
        raise ValueError("diversity: outputs are token ids; pass the tokenizer that encoded the prompts")
    # an id outside the tokenizer (a model vocabulary larger than it) is one unknown character, so positions align
    return "".join(tokenizer.decode([t]) if 0 <= t < tokenizer.vocab_size else "\ufffd" for t in head).strip()


def measure(examples: Sequence, outputs_per_key: Sequence[Sequence], tokenizer=None, *,
            collapse_ratio: float = COLLAPSE_RATIO) -> dict[str, dict]:
    """Per task (module docstring) from `outputs_per_key[k][i]`, the generation (token ids or text) of prompt
    `examples[i]` under key k (token ids need `tokenizer`). Tasks without free positions (copy, sort, add, mul) are
    left out."""
    from dgemma.data.tasks import answer_count, free_choices

    K = len(outputs_per_key)
    if K < 2:
        raise ValueError(f"diversity: {K} sampler key(s); need >= 2 decodings of each prompt")
    if any(len(o) != len(examples) for o in outputs_per_key):
        raise ValueError(f"diversity: outputs per key {[len(o) for o in outputs_per_key]} != {len(examples)} prompts")
    acc: dict[str, dict] = {}
    for i, ex in enumerate(examples):
        if ex.task not in MANY_ANSWER_TASKS:
            continue
        free = free_choices(ex)
        a = acc.setdefault(ex.task, {"h": [], "h_data": [], "pooled": Counter(), "pooled_data": Counter(),
                                     "distinct": [], "distinct_data": [], "invalid": 0, "chars": 0, "prompts": 0,
                                     "h_prompt": []})
        texts = [_text(o[i], tokenizer) for o in outputs_per_key]
        a["prompts"] += 1
        a["distinct"].append(len(set(texts)) / K)
        a["distinct_data"].append(expected_distinct(answer_count(ex), K) / K)
        for j, dist in free:
            choices = list(dist)
            chars = [t[j] if j < len(t) else "" for t in texts]
            a["h"].append(plugin_entropy(chars))
            a["h_data"].append(expected_plugin_entropy(dist, K))
            for c in chars:
                a["pooled"][choices.index(c) if c in dist else "invalid"] += 1
            for r, c in enumerate(choices):
                a["pooled_data"][r] += dist[c] * K
            a["invalid"] += sum(c not in dist for c in chars)
            a["chars"] += K
        if free:
            a["h_prompt"].append((float(np.sum(a["h"][-len(free):])), len(free)))
    out = {}
    for task, a in sorted(acc.items()):
        nan = float("nan")
        h = float(np.mean(a["h"])) if a["h"] else nan
        h_data = float(np.mean(a["h_data"])) if a["h_data"] else nan
        row = {"keys": K, "prompts": a["prompts"], "free_positions": len(a["h"]), "entropy_free": h,
             "entropy_free_data": h_data, "entropy_free_ci": _prompt_ci(a["h_prompt"]),
             "entropy_pooled": _entropy_of_counts(a["pooled"]),
             "entropy_pooled_data": _entropy_of_counts(a["pooled_data"]),
             "distinct": float(np.mean(a["distinct"])), "distinct_data": float(np.mean(a["distinct_data"])),
             "invalid_free": a["invalid"] / a["chars"] if a["chars"] else nan,
             "collapse": bool(h_data > 0 and h < collapse_ratio * h_data), "collapse_ratio": float(collapse_ratio),
             "entropy_free_per_prompt": [[float(v), int(n)] for v, n in a["h_prompt"]]}
        if task in ("pick", "agree") and a["chars"]:
            row["plus_one_rate"] = a["pooled"][1] / a["chars"]
        out[task] = row
    return out


def _prompt_ci(per_prompt: list) -> tuple[float, float, float]:
    """The mean over free positions with a 95 % bootstrap CI over prompts (a prompt's positions stay together)."""
    from dgemma.eval.stats import ratio_ci

    if not per_prompt:
        return (float("nan"),) * 3
    sums, counts = zip(*per_prompt)
    return ratio_ci([sums], [counts])


def pool_models(per_model: Sequence[dict], *, collapse_ratio: float = COLLAPSE_RATIO) -> dict[str, dict]:
    """One measure per task over several models' `measure` results on the same prompts, each over its own K keys:
    entropy_free = Σ entropy / Σ free positions over every model, its CI resampling models, then prompts
    (`dgemma.eval.stats.ratio_ci`); the other rates are means over models; the data's values are the models'
    (same prompts, same K); `collapse` is the pooled entropy's, `collapsed_models` counts the models that collapse
    alone, and `entropy_free_models` lists each model's value."""
    from dgemma.eval.stats import ratio_ci

    if not per_model:
        raise ValueError("pool_models: no models")
    tasks = set(per_model[0])
    if any(set(m) != tasks for m in per_model):
        raise ValueError(f"pool_models: the models measured different tasks {[sorted(m) for m in per_model]}")
    out = {}
    for task in sorted(tasks):
        ms = [m[task] for m in per_model]
        if len({(m["keys"], m["prompts"], m["free_positions"]) for m in ms}) != 1:
            raise ValueError(f"pool_models: {task}: the models were measured on different prompts or keys")
        sums = [[v for v, _ in m["entropy_free_per_prompt"]] for m in ms]
        counts = [[n for _, n in m["entropy_free_per_prompt"]] for m in ms]
        ci = ratio_ci(sums, counts) if all(counts) else (float("nan"),) * 3
        h_data = ms[0]["entropy_free_data"]
        r = {"keys": ms[0]["keys"], "prompts": ms[0]["prompts"], "free_positions": ms[0]["free_positions"],
             "models": len(ms), "entropy_free": ci[0], "entropy_free_ci": ci, "entropy_free_data": h_data,
             "entropy_free_models": [m["entropy_free"] for m in ms],
             "entropy_pooled_data": ms[0]["entropy_pooled_data"], "distinct_data": ms[0]["distinct_data"],
             "collapse": bool(h_data > 0 and ci[0] < collapse_ratio * h_data), "collapse_ratio": float(collapse_ratio),
             "collapsed_models": sum(bool(m["collapse"]) for m in ms)}
        for name in ("entropy_pooled", "distinct", "invalid_free", "plus_one_rate"):
            if name in ms[0]:
                r[name] = float(np.mean([m[name] for m in ms]))
        out[task] = r
    return out


def _entropy_of_counts(counts: Counter) -> float:
    p = np.asarray([v for v in counts.values() if v > 0], np.float64)
    if not p.size:
        return float("nan")
    p /= p.sum()
    return float(-(p * np.log(p)).sum())


def measure_rows(held_out, per_key_rows: Sequence[dict], *, collapse_ratio: float = COLLAPSE_RATIO) -> dict:
    """`measure` on the evaluator's `rows` of the same held-out prompts decoded under K keys."""
    index = list(per_key_rows[0]["index"])
    if any(list(r["index"]) != index for r in per_key_rows):
        raise ValueError("diversity: the decodings under different keys scored different prompts")
    examples = [held_out.source[int(i)] for i in index]
    return measure(examples, [r["output"] for r in per_key_rows], held_out.tokenizer, collapse_ratio=collapse_ratio)


def evaluate_diversity(model, held_out, sampler, *, keys: int = 4, decoding="diffusion", key=None,
                       collapse_ratio: float = COLLAPSE_RATIO, **evaluate_kw) -> dict:
    """Decode every held-out prompt with `keys` sampler keys (fold_in(key, k), default key(0)) through
    `dgemma.eval.evaluator.evaluate` and measure the diversity (module docstring). Returns {"per_task": {task:
    measures}, "keys", "settings" (how it decoded), "exact_match" (mean over keys), "evaluations" (per key)}."""
    import jax

    from dgemma.eval.evaluator import Decoding, evaluate

    if keys < 2:
        raise ValueError(f"evaluate_diversity: keys = {keys}; need >= 2 decodings of each prompt")
    d = Decoding(decoding, decoding) if isinstance(decoding, str) else decoding
    key = jax.random.key(0) if key is None else key
    runs = [evaluate(model, held_out, sampler, (d,), key=jax.random.fold_in(key, k), **evaluate_kw)[d.label]
            for k in range(keys)]
    return {"per_task": measure_rows(held_out, [r["rows"] for r in runs], collapse_ratio=collapse_ratio),
            "keys": int(keys), "settings": runs[0]["settings"],
            "exact_match": float(np.mean([r["metrics"]["exact_match"] for r in runs])), "evaluations": runs}

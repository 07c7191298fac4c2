"""Held-out prompts disjoint from the training stream, corpus tokens per forward, bootstrap CIs, decoding settings."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from dgemma.data.config import LayoutConfig, DataConfig, TaskConfig
from dgemma.data.pipeline import DataPipeline
from dgemma.eval.heldout import build_held_out, stream_indices, training_prompts
from dgemma.eval.stats import bootstrap_ci, fmt_ci, hierarchical_ci, ratio_ci
from dgemma.eval.evaluator import Decoding, corpus_tpf, decoding_settings, evaluate, scalars
from dgemma.inference.sampler import SamplerConfig, sample
from dgemma.model.config import tiny

# a small prompt space (copy of 1-2 digits: 110 prompts) so that the training stream really repeats held-out prompts
SMALL = DataConfig(tasks=(TaskConfig(name="copy", min_len=1, max_len=2), TaskConfig(name="sort", min_len=3, max_len=6)),
                   layout=LayoutConfig(prompt_len=10, canvas_length=8, n_blocks=1), batch_size=8, num_threads=0)


def test_stream_indices_are_the_pipelines():
    pipe = DataPipeline(SMALL, process_index=0, process_count=1)
    want = np.concatenate([pipe.batch(s)["index"] for s in range(5)])
    np.testing.assert_array_equal(stream_indices(SMALL, 5), want)


def test_held_out_is_disjoint_from_training_and_deduplicated():
    steps = 30
    held = build_held_out(SMALL, n_per_task=20, batch_size=16, train_streams=[(SMALL, steps)])
    pipe = DataPipeline(SMALL, process_index=0, process_count=1)
    seen = {pipe.source[int(i)].prompt for s in range(steps) for i in pipe.batch(s)["index"]}  # independent recount
    prompts = [e.prompt for e in held.examples]
    assert held.dropped_overlap > 0  # the premise: the seed change alone would have leaked training prompts
    assert held.overlap == 0 and not seen & set(prompts)
    assert len(set(prompts)) == len(prompts) == 40 and held.per_task() == {"copy": 20, "sort": 20}
    assert "overlap with the training stream: 0" in held.summary()
    # batches: pipeline encoding, index = position, padding rows of the last batch masked out
    assert held.num_batches == 3
    last = held.batch(2)
    assert last["example_mask"].sum() == 8 and last["tokens"].shape == (16, 18)
    ex = held.source[int(last["index"][0])]
    assert pipe.tokenizer.decode(last["tokens"][0][last["valid"][0]].tolist()).startswith("<bos>" + ex.prompt)
    # a later training stream (more steps) is excluded too
    assert training_prompts([(SMALL, steps)]) == seen


def test_held_out_refuses_an_exhausted_prompt_space():
    with pytest.raises(ValueError, match=r"task\(s\) \{'copy'"):
        build_held_out(SMALL, n_per_task=200, batch_size=8, train_streams=[(SMALL, 30)], max_candidates=2000)


def test_bootstrap_helpers():
    m, lo, hi = bootstrap_ci([0.5, 0.5, 0.5])
    assert m == lo == hi == 0.5
    m, lo, hi = bootstrap_ci([0.2, 0.5, 0.8])
    assert lo < m < hi and 0.2 - 1e-9 <= lo and hi <= 0.8 + 1e-9
    # the corpus ratio is a ratio of sums, not a mean of per-row ratios
    num, den = [[1.0, 10.0], [1.0, 10.0]], [[1.0, 10.0], [1.0, 5.0]]
    point, lo, hi = ratio_ci(num, den)
    assert point == pytest.approx(22 / 17) and lo <= point <= hi
    assert point != pytest.approx(np.mean([1, 1, 1, 2]))
    m, lo, hi = hierarchical_ci([[1, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]])
    assert m == pytest.approx(10 / 12) and lo < m <= hi <= 1.0
    assert fmt_ci((0.5, 0.25, 0.75), 2) == "0.50 [0.25, 0.75]"
    with pytest.raises(ValueError, match="ratio_ci"):
        ratio_ci([[1.0]], [[1.0, 2.0]])


def test_corpus_tpf_and_settings():
    out = corpus_tpf([3, 30], [3, 10], [1, 1])
    assert out == {"tpf": 33 / 13, "tpf_total": 33 / 15}
    s = SamplerConfig(max_steps=48)
    assert "greedy" in decoding_settings(s, "ar")
    d = decoding_settings(s, "diffusion")
    assert "K_max = 48" in d and "gamma = 0.1" in d and "0.8 -> 0.4" in d and "argmax" in d


def test_evaluate_reports_unified_metrics_per_decoding():
    """One evaluator, one set of names: per decoding (label, mode, max_steps) exact match per task, corpus TPF and steps
    per block, recounted here from the sampler's own per-row counters on the scored rows (padding rows excluded)."""
    cfg = dataclasses.replace(SMALL, tokenizer=dataclasses.replace(SMALL.tokenizer, num_reserved=104),
                              layout=dataclasses.replace(SMALL.layout, n_blocks=2))
    from dgemma.data.rewards import reward
    from dgemma.model.transformer import Transformer

    # vocab 128 = 3 specials + 21 symbols + 104 reserved; 2 layers (sliding + full): the counters do not depend on
    # depth, the compile time does
    model = Transformer(tiny(num_hidden_layers=2, layer_types=("sliding_attention", "full_attention")),
                        rngs=nnx.Rngs(0))
    held = build_held_out(cfg, n_per_task=2, batch_size=3, train_streams=[(cfg, 5)])  # 2 batches, 1 pad row
    tok = held.tokenizer
    scfg = SamplerConfig(max_steps=3)  # eos / pad: the held-out tokenizer's
    key = jax.random.key(3)
    decodings = ("ar", Decoding("diffusion", "diffusion"), Decoding("diffusion_k2", "diffusion", 2))
    res = evaluate(model, held, scfg, decodings, key=key)
    assert list(res) == ["ar", "diffusion", "diffusion_k2"]
    for label, mode, K in (("ar", "ar", 3), ("diffusion", "diffusion", 3), ("diffusion_k2", "diffusion", 2)):
        r, m = res[label], res[label]["metrics"]
        assert r["mode"] == mode and r["max_steps"] == K == m["max_steps"]
        assert len(r["rows"]["reward"]) == 4 == m["n"] == m["n/copy"] + m["n/sort"]
        # recount from the sampler's own per-row counters, scored rows only
        tokens = forwards = commits = 0
        rewards = {"copy": [], "sort": []}
        for s in range(held.num_batches):
            b = held.batch(s)
            R = b["diffusion_weight"].shape[1]
            P = b["tokens"].shape[1] - R
            want = SamplerConfig(max_steps=K, max_new_tokens=R, eos_ids=tuple(tok.stop_ids), pad_id=tok.pad_id)
            out = sample(model, b["tokens"][:, :P], b["valid"][:, :P], want, jax.random.fold_in(key, s), mode)
            keep = b["example_mask"]
            tokens += int((out.tokens[keep] != tok.pad_id).sum())
            forwards += int((out.decoder_passes + out.ar_forwards)[keep].sum())
            commits += int(out.commit_passes[keep].sum())
            for row in np.flatnonzero(keep):
                ex = held.source[int(b["index"][row])]
                rewards[ex.task].append(reward(ex, [int(t) for t in out.tokens[row]], tok))
        assert (m["tokens"], m["forwards"], m["commit_passes"]) == (tokens, forwards, commits)
        assert m["tpf"] == pytest.approx(tokens / forwards)
        assert m["tpf_total"] == pytest.approx(tokens / (forwards + commits))
        for task, v in rewards.items():
            assert m[f"exact_match/{task}"] == pytest.approx(np.mean(v))
        assert m["exact_match"] == pytest.approx(np.mean(rewards["copy"] + rewards["sort"]))
        assert r["settings"] == decoding_settings(scfg.replace(max_steps=K), mode)
        assert ("steps_per_block" in m) == (mode != "ar")
    assert 1 <= res["diffusion"]["metrics"]["steps_per_block"] <= 3 and len(res["diffusion"]["entropy_per_step"]) == 3
    assert res["diffusion_k2"]["metrics"]["steps_per_block"] <= 2 and len(res["diffusion_k2"]["entropy_per_step"]) == 2
    flat = scalars(res, "eval/")
    assert flat["eval/diffusion/exact_match/copy"] == res["diffusion"]["metrics"]["exact_match/copy"]
    assert flat["eval/diffusion_k2/tpf"] == res["diffusion_k2"]["metrics"]["tpf"] and "eval/ar/tpf" in flat
    with pytest.raises(ValueError, match="two decodings are labelled 'ar'"):
        evaluate(model, held, scfg, ("ar", Decoding("ar", "diffusion")))


def test_perm_diagnostics():
    from dgemma.data.rewards import TaskExample, perm_diagnostics, reward
    from dgemma.data.tokenizer import ToyTokenizer

    tok = ToyTokenizer()
    ex = TaskExample(task="perm", prompt="P1123|", response="2131", answer="1123")
    cases = {"3211<eos>": (1, 0, 0, 0, 0), "1123<eos>9": (1, 0, 0, 0, 1), "1223<eos>": (0, 1, 1, 0, 0),
             "112<eos>": (0, 0, 1, 1, 0), "11233<eos>": (0, 1, 0, 1, 0)}
    for gen, want in cases.items():
        d = perm_diagnostics(ex, gen, tok)
        assert (d["valid"], d["duplicate"], d["missing"], d["length_error"], d["copy"]) == want, gen
        assert d["valid"] == reward(ex, gen, tok)
    assert perm_diagnostics(ex, tok.encode("3121") + [tok.eos_id, 5], tok)["valid"] == 1.0  # token input


def test_ratio_ci_matches_the_two_level_bootstrap_loop():
    """The vectorised two-level bootstrap gives the interval of the plain loop (resample seeds, then rows)."""
    rng = np.random.default_rng(1)
    num = [rng.integers(0, 40, n).astype(float) for n in (144, 100, 120)]
    den = [rng.integers(1, 20, n).astype(float) for n in (144, 100, 120)]
    groups = [np.stack([n, d], 1) for n, d in zip(num, den)]
    draws = []
    for _ in range(8000):
        rows = np.concatenate([groups[i][rng.integers(0, groups[i].shape[0], groups[i].shape[0])]
                               for i in rng.integers(0, 3, 3)])
        draws.append(rows[:, 0].sum() / rows[:, 1].sum())
    point, lo, hi = ratio_ci(num, den, resamples=8000)
    ref_lo, ref_hi = np.quantile(draws, [0.025, 0.975])
    assert point == pytest.approx(sum(n.sum() for n in num) / sum(d.sum() for d in den))
    assert lo == pytest.approx(ref_lo, rel=0.02) and hi == pytest.approx(ref_hi, rel=0.02)


def test_training_prompts_read_identical_streams_once():
    """Two streams of the same data config (stage 1 and its AR control) are read once, at the longer length: the
    union is unchanged."""
    from dgemma.eval.heldout import training_prompts

    assert training_prompts([(SMALL, 3), (SMALL, 6), (SMALL, 6)]) == training_prompts([(SMALL, 6)])
    assert training_prompts([(SMALL, 3)]) < training_prompts([(SMALL, 6)])

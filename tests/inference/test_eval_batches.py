"""Evaluation over batches that ran different numbers of sampler blocks (a batch stops when all its rows finished).

Padding is checked on synthetic results; evaluation runs the real sampler on a random tiny model, where a batch is made to finish in its first block by declaring every vocabulary
id an EOS for that batch only, so the block counts of the batches differ on every machine.
"""

from pathlib import Path

import numpy as np
import pytest

import jax
from flax import nnx

from dgemma.config import load_config
from dgemma.eval.evaluator import evaluate, held_out_pipeline
from dgemma.inference import sampler as sampler_mod
from dgemma.inference.batches import concat_results, pad_blocks
from dgemma.inference.sampler import EOS_FINISHED, SampleResult, SamplerConfig, sample
from dgemma.model.transformer import Transformer

TINY = str(Path(__file__).resolve().parents[2] / "configs/stage1/tiny.yaml")


@pytest.fixture(scope="module")
def setup():
    cfg = load_config(TINY, ["data.layout.n_blocks=2"], env={})
    model = Transformer(cfg.model_config, rngs=nnx.Rngs(0))
    pipeline = held_out_pipeline(cfg.data, 4)
    tok = pipeline.tokenizer
    scfg = SamplerConfig(max_steps=3, eos_ids=tuple(tok.stop_ids), pad_id=tok.pad_id)
    return model, pipeline, scfg


def _all_eos(model, scfg):
    return scfg.replace(eos_ids=tuple(range(model.cfg.vocab_size)))


def _result(B, n_blocks, L=4, N=3, seed=0):
    """A SampleResult with random per-block data (the shapes `sample` returns)."""
    rng = np.random.default_rng(seed)
    per_row = lambda dtype=np.int32: rng.integers(1, 9, B).astype(dtype)  # noqa: E731
    return SampleResult(
        tokens=rng.integers(3, 50, (B, n_blocks * L)).astype(np.int32), tpf=per_row(np.float64),
        tpf_total=per_row(np.float64), decoder_passes=per_row(), ar_forwards=per_row(),
        commit_passes=per_row(), steps_per_block=rng.integers(1, N + 1, (B, n_blocks)).astype(np.int32),
        stop_reason=rng.integers(0, 2, (B, n_blocks)).astype(np.int32),
        entropy_trace=rng.random((B, n_blocks, N)).astype(np.float32),
        commit_step=rng.integers(1, N + 1, (B, n_blocks, L)).astype(np.int32),
        steps_run=rng.integers(1, N + 1, n_blocks).astype(np.int32), mode=("diffusion",) * B,
        drafts=rng.integers(3, 50, (n_blocks, N, B, L)).astype(np.int32))


def test_concat_results_pads_missing_blocks():
    short, long = _result(2, 1, seed=1), _result(3, 2, seed=2)
    joined = concat_results([short, long], pad_id=0)
    assert joined.n_blocks == 2 and joined.tokens.shape == (5, 8) and joined.drafts.shape == (2, 3, 5, 4)
    # the missing block of the short batch reads as "no row took part", as the sampler writes it for finished rows
    assert (joined.steps_per_block[:2, 1] == 0).all() and (joined.stop_reason[:2, 1] == EOS_FINISHED).all()
    assert np.isnan(joined.entropy_trace[:2, 1]).all() and (joined.commit_step[:2, 1] == 0).all()
    assert (joined.tokens[:2, 4:] == 0).all() and (joined.drafts[1, :, :2] == 0).all()
    # everything else is the batches' own data, unchanged
    np.testing.assert_array_equal(joined.tokens[:2, :4], short.tokens)
    np.testing.assert_array_equal(joined.commit_step[2:], long.commit_step)
    np.testing.assert_array_equal(joined.drafts[:, :, 2:], long.drafts)
    np.testing.assert_array_equal(joined.tpf, np.r_[short.tpf, long.tpf])
    np.testing.assert_array_equal(joined.steps_run, [max(short.steps_run[0], long.steps_run[0]), long.steps_run[1]])
    assert joined.mode == ("diffusion",) * 5 and joined.cache is None
    with pytest.raises(ValueError, match="cannot pad"):
        pad_blocks(long, 1, 0)


def test_evaluate_with_batches_of_different_block_counts(setup, monkeypatch):
    model, pipeline, scfg = setup
    blocks = []

    def first_batch_finishes_at_once(m, prompt, valid, cfg, key, mode, **kw):
        # the real sampler; the first batch of each mode declares every id an EOS, so it stops after one block, and
        # the others no id, so they run every block
        first = blocks[-1] == "new"
        res = sample(m, prompt, valid, _all_eos(m, cfg) if first else cfg.replace(eos_ids=(-1,)), key,
                     mode, **kw)
        blocks.append(res.n_blocks)
        return res

    blocks.append("new")
    monkeypatch.setattr(sampler_mod, "sample", first_batch_finishes_at_once)
    row = evaluate(model, pipeline, scfg, ("diffusion",), batches=range(2), key=jax.random.key(0))["diffusion"]
    assert blocks == ["new", 1, 2]  # the premise: the two batches ran different numbers of blocks
    L = model.cfg.canvas_length
    assert row["commit_step"].shape == (8, 2, L) and (row["commit_step"][:4, 1] == 0).all()
    m = row["metrics"]
    assert m["n"] == 8 and m["max_steps"] == scfg.max_steps
    assert 1 <= m["steps_per_block"] <= scfg.max_steps and 0 <= m["pct_max_steps"] <= 100

"""Generative perplexity (`dgemma.eval.genppl`) on cases with a known answer: a model whose logits are uniform scores
exactly V; and the number does not depend on prompt left-padding or batching (it is the model's own causal NLL)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flax import nnx

from dgemma.eval.genppl import answer_tokens, generative_perplexity


def _model(vocab: int = 32):
    from dgemma.config import load_config
    from dgemma.model.transformer import Transformer

    cfg = load_config(None, {"model.preset": "tiny", "model.vocab_size": vocab, "model.num_hidden_layers": 2,
                             "model.layer_types": ["sliding_attention", "full_attention"]}, env={})
    return Transformer(cfg.model_config, rngs=nnx.Rngs(0))


def test_answer_tokens_cut_after_the_first_stop_and_drop_pads():
    assert answer_tokens([5, 0, 7, 6, 9, 6], stop_ids=(6, 1), pad_id=0) == [5, 7, 6]
    assert answer_tokens([5, 7], stop_ids=(6,), pad_id=0) == [5, 7]
    assert answer_tokens([0, 0], stop_ids=(6,), pad_id=0) == []


def test_uniform_logits_give_perplexity_v():
    model = _model(32)
    model.embedder.embedding[...] = 0.0  # tied head: every logit is 0, so p = 1/V for every token
    prompts = np.array([[0, 0, 3, 4], [5, 6, 7, 8]], np.int32)
    valid = prompts != 0
    out = generative_perplexity(model, prompts, valid, [[9, 10, 11], [12]], batch_size=2)
    assert out["tokens"] == 4 and out["row_tokens"] == [3, 1]
    assert out["gen_ppl"] == pytest.approx(32.0, rel=1e-5)
    assert out["row_nll"] == pytest.approx([3 * math.log(32), math.log(32)], rel=1e-5)


def test_left_padding_and_batching_do_not_change_the_number():
    model = _model(32)
    ans = [[9, 10, 11, 6], [12, 13]]
    tight = generative_perplexity(model, np.array([[3, 4, 5]]), np.ones((1, 3), bool), ans[:1], batch_size=1)
    padded = generative_perplexity(model, np.array([[0, 0, 3, 4, 5], [7, 8, 9, 10, 11]]),
                                   np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], bool), ans, batch_size=3)
    # pads consume positions (the training encoding): the padded row sees positions 2.. for its prompt, so compare the
    # unpadded row against a batch of its own with the same absolute positions
    shifted = generative_perplexity(model, np.array([[0, 0, 3, 4, 5]]), np.array([[0, 0, 1, 1, 1]], bool), ans[:1],
                                    batch_size=1)
    assert padded["row_nll"][0] == pytest.approx(shifted["row_nll"][0], rel=1e-5)
    assert tight["row_nll"][0] > 0 and math.isfinite(padded["gen_ppl"])
    manual = (padded["row_nll"][0] + padded["row_nll"][1]) / 6
    assert padded["nll"] == pytest.approx(manual, rel=1e-9) and padded["gen_ppl"] == pytest.approx(math.exp(manual))


def test_mismatched_inputs_are_refused():
    with pytest.raises(ValueError, match="do not match"):
        generative_perplexity(_model(), np.zeros((2, 3), np.int32), np.ones((2, 3), bool), [[1]])

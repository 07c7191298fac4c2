"""The real sampler on a chat config ends a row at the first `<turn|>` inside a block, in diffusion and in AR mode.

tests/inference/test_sampler.py shows the EOS mechanics on a mock LM with an arbitrary stop id. Here the parts a chat
model adds: the config's tokenizer (configs/chat/tiny.yaml, `dgemma:tiny_chat`, `chat: true`) gives the stop ids as
`dgemma sample` passes them (`tokenizer.stop_ids`: `<turn|>` first; the HF tokenizer's own EOS is `<eos>`, another
id), a real tiny Gemma-4-architecture `Transformer` decodes, and the answer text (`dgemma.cli.answers`, streamed block
by block as `dgemma sample` prints it) ends at the end of the turn.

The model is the tiny chat model (two layers, canvases of 8) with every sublayer's output muted (post-norm scales 0,
self-conditioning input norm 0), so its logits are a fixed function of the input token through the tied embedding,
which is set so that:
  - each answer word w (and `<turn|>`) predicts itself, confidently: a canvas the sampler starts from (its initial
    canvas and per-step draws injected, `InjectedDraws`) is what it commits, so `<turn|>` lands where the draws put it;
  - the chat prompt's last token "\\n" (of "<|turn>model\\n") predicts " Y", " Y" predicts "es", "es" predicts
    `<turn|>`: greedy AR decoding answers " Yes" and ends its turn.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dgemma.cli.answers import TextStream, answer_text, stop_reason
from dgemma.cli.sample import encode_prompts
from dgemma.config import load_config
from dgemma.data.tokenizer import build_tokenizer
from dgemma.inference.sampler import CONVERGED, EOS_FINISHED, InjectedDraws, SamplerConfig, sample
from support.scripts import REPO

L, BLOCKS = 8, 3  # canvas length, token budget in canvases
ROW1 = "The sky is blue"  # ends in block 0 at position 5
ROW2 = "The sky is blue because air scatters blue light"  # 12 ids: ends in block 1 at position 4
FILL = "The"  # the model's output after a row's <turn|> (the sampler must pad it)


@pytest.fixture(scope="module")
def chat():
    cfg = load_config(REPO / "configs/chat/tiny.yaml", {"model.canvas_length": L, "model.num_hidden_layers": 2,
                                                        "model.layer_types": ["sliding_attention", "full_attention"]},
                      env={})
    assert cfg.data.tokenizer.chat
    tok = build_tokenizer(cfg.data.tokenizer)
    eot = tok.hf_tokenizer.convert_tokens_to_ids("<turn|>")
    assert tok.stop_ids[0] == eot and tok.hf_tokenizer.eos_token_id != eot  # the stop is the end of turn, not EOS
    ids = {name: tok.encode(text) for name, text in (("row1", ROW1), ("row2", ROW2), ("fill", FILL))}
    assert ids["fill"] == ids["row1"][:1] and 8 < len(ids["row2"]) < 16 - 1 and tok.decode(ids["row2"]) == ROW2
    newline, (y, es) = tok.encode("\n")[-1], tok.encode(" Yes")
    words = sorted(set(ids["row1"] + ids["row2"]))
    assert not {newline, y, es, eot} & set(words)
    model = _turn_model(cfg.model_config, words, chain=(newline, y, es, eot))
    prompts, valid = encode_prompts(tok, ["Why is the sky blue?"], add_bos=False)  # a user turn, by the template
    raw, _ = encode_prompts(tok, ["<bos>The sky is"], add_bos=False, raw=True)  # ends on a word: no end of turn
    assert prompts[0, -1] == newline and raw[0, -1] in words
    P = prompts.shape[1]
    both = np.zeros((2, P), np.int32)
    both[0], both[1, P - raw.shape[1]:] = prompts[0], raw[0]
    both_valid = np.stack([valid[0], np.arange(P) >= P - raw.shape[1]])
    return dict(cfg=cfg, tok=tok, eot=eot, ids=ids, model=model, prompts=both, valid=both_valid)


def _turn_model(mcfg, words, chain):
    """The tiny chat model with muted sublayers and the tied embedding of the module docstring."""
    from dgemma.model.transformer import Transformer

    model = Transformer(mcfg, rngs=nnx.Rngs(0))
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    H = mcfg.hidden_size
    assert len(words) + len(chain) <= H
    table = np.zeros((mcfg.vocab_size, H), np.float32)
    for j, w in enumerate(words):  # orthogonal: w's logit 8 x 4 = 32 (soft-capped 23), every other id's 0
        table[w, j] = 4.0
    # the chain m -> a -> b -> <turn|> on directions u_m, u_a, u_b, u_T: E_k = s_k (u_k + u_next), s growing x 2.5,
    # so that from k the next token's logit beats k's own (s_next / sqrt 2 > s_k sqrt 2); <turn|> = s_T u_T predicts
    # itself
    u = len(words) + np.arange(len(chain))
    for k, (token, s) in enumerate(zip(chain, (0.5, 1.25, 3.125, 7.8))):
        table[token, u[k]] = s
        if k + 1 < len(chain):
            table[token, u[k + 1]] = s
    for path, var in flat:
        name = "/".join(map(str, path))
        if name.endswith("embedder/embedding"):
            var.set_value(jnp.asarray(table, var.dtype))
        elif name.endswith("scale") and ("post_" in name or name.startswith("self_conditioning/pre_norm")):
            var.set_value(jnp.zeros(var.shape, var.dtype))  # the sublayer's output (or the SC input) is 0
    nnx.update(model, nnx.from_flat_state(flat))
    return model


def _draws(canvases: list[list[list[int]]], max_steps: int) -> InjectedDraws:
    """Per block, each row's canvas as its initial canvas and as every step's proposal and renoise draw."""
    blocks = []
    for rows in canvases:
        c = np.asarray(rows, np.int32)
        every_step = np.repeat(c[None], max_steps, 0)
        blocks.append({"init": c, "samples": every_step, "noise": every_step})
    return InjectedDraws(blocks)


def _sampler(chat, **over):
    """The sampler settings as `dgemma sample` builds them from the chat config."""
    tok = chat["tok"]
    return SamplerConfig.from_section(chat["cfg"].sampler, **{"eos_ids": tuple(tok.stop_ids), "pad_id": tok.pad_id,
                                                              "max_new_tokens": BLOCKS * L, **over})


def _canvases(chat):
    ids, eot = chat["ids"], chat["eot"]
    fill = ids["fill"][0]
    row1 = ids["row1"] + [eot] + [fill] * (2 * L - len(ids["row1"]) - 1)
    row2 = ids["row2"] + [eot] + [fill] * (2 * L - len(ids["row2"]) - 1)
    return [[row1[b * L:(b + 1) * L], row2[b * L:(b + 1) * L]] for b in range(2)] + [[[fill] * L] * 2]


def test_diffusion_ends_each_row_at_its_first_turn_token_mid_block(chat):
    tok, eot, pad = chat["tok"], chat["eot"], chat["tok"].pad_id
    scfg = _sampler(chat)
    lines: list[str] = []
    stream = TextStream(tok, 2, write=lines.append)  # what `dgemma sample` prints, one line per row and block
    res = sample(chat["model"], chat["prompts"], chat["valid"], scfg, jax.random.key(0), "diffusion",
                 draws=_draws(_canvases(chat), scfg.max_steps), on_block=stream.on_block)
    n1, n2 = len(chat["ids"]["row1"]), len(chat["ids"]["row2"])
    # row 1: <turn|> kept at position 5 of block 0, PAD after it; block 1 did not run for it; block 2 for nobody
    assert res.tokens.shape == (2, 2 * L)
    np.testing.assert_array_equal(res.tokens[0], chat["ids"]["row1"] + [eot] + [pad] * (2 * L - n1 - 1))
    np.testing.assert_array_equal(res.tokens[1], chat["ids"]["row2"] + [eot] + [pad] * (2 * L - n2 - 1))
    assert res.steps_per_block[0, 1] == 0 and res.stop_reason[0, 1] == EOS_FINISHED
    assert res.steps_per_block[1, 1] > 0 and (res.stop_reason[:, 0] == CONVERGED).all()
    assert res.decoder_passes[0] == res.steps_per_block[0, 0] and res.commit_passes[0] == 0
    # the text stops at the end of the turn, streamed and whole
    answers = stream.finish(res.tokens)
    assert [tok.decode(a.ids) for a in answers] == [ROW1, ROW2] and stream.shown == [ROW1, ROW2]
    assert [a.stop for a in answers] == [eot, eot] and stop_reason(tok, answers[0], scfg.max_new_tokens) == \
        "end of turn (<turn|>)"
    first = tok.decode(chat["ids"]["row2"][:L])  # row 2's text after block 0
    assert lines == [f"[block 0] prompt 1: {ROW1!r}\n", f"[block 0] prompt 2: {first!r}\n",
                     f"[block 1] prompt 2: {ROW2[len(first):]!r}\n"]  # nothing of row 1 after its end of turn

    # the same canvases with the HF tokenizer's own EOS as the only stop id (a chat model's turn would not end)
    own_eos = _sampler(chat, eos_ids=(tok.hf_tokenizer.eos_token_id,))
    rerun = sample(chat["model"], chat["prompts"], chat["valid"], own_eos, jax.random.key(0), "diffusion",
                   draws=_draws(_canvases(chat), scfg.max_steps))
    assert res.tokens.shape[1] < rerun.tokens.shape[1] == BLOCKS * L and rerun.steps_per_block[0, 1] > 0
    assert rerun.tokens[0, n1] == eot and rerun.tokens[0, n1 + 1] == chat["ids"]["fill"][0]
    assert answer_text(tok, rerun.tokens[0]) == ROW1  # what is shown still ends at <turn|>: answers.py cuts there


def test_ar_ends_the_answer_at_the_turn_token(chat):
    tok, eot, pad = chat["tok"], chat["eot"], chat["tok"].pad_id
    res = sample(chat["model"], chat["prompts"], chat["valid"], _sampler(chat), jax.random.key(0), "ar")
    y, es = tok.encode(" Yes")
    np.testing.assert_array_equal(res.tokens[0], [y, es, eot] + [pad] * (BLOCKS * L - 3))
    # the other row never ends its turn (its prompt ends on a word that predicts itself): the whole budget
    assert (res.tokens[1] == chat["prompts"][1, -1]).all()
    np.testing.assert_array_equal(res.ar_forwards, [3, BLOCKS * L])  # row 1 stopped decoding at <turn|>
    assert answer_text(tok, res.tokens[0]) == " Yes"
    answers = TextStream(tok, 2, write=lambda s: None).finish(res.tokens)
    assert answers[0].stop == eot and answers[1].stop is None

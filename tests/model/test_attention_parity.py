"""Transformers parity with model.execution.attention_impl=chunked (the P1 / P2 checks of test_model_parity, chunked
variant): Gemma 4 causal logits with left padding past the window, DiffusionGemma decoder logits (prompt > W, self-conditioning,
a committed canvas then the next block) -- with chunk sizes small enough that tiles are skipped and keys padded."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from support import jitted as J  # noqa: E402
from support import hf_reference as R  # noqa: E402
from dgemma.convert.hf_import import load_hf_checkpoint  # noqa: E402
from dgemma.model.cache import KVCache  # noqa: E402
from dgemma.model.transformer import Transformer  # noqa: E402

TOL = 1e-4


def _chunked(model, q_chunk=4, kv_chunk=3):
    cfg = model.cfg.with_execution(attention_impl="chunked", attention_q_chunk=q_chunk, attention_kv_chunk=kv_chunk)
    twin = Transformer(cfg, rngs=nnx.Rngs(0))
    nnx.update(twin, nnx.state(model))
    return twin


def _err(a, b):
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())


@pytest.mark.parity
def test_gemma4_causal_left_padding_chunked(tmp_path):
    hf = R.gemma4_causal("c", seed=12)
    hf.save_pretrained(tmp_path)
    model = _chunked(load_hf_checkpoint(tmp_path)[0], q_chunk=4, kv_chunk=4)
    pad = 3
    tokens, valid, ref = R.left_padded_reference(hf, T=16, pad=pad)  # 16 = 3 x the window of 5 + 1 = 4 x the chunk
    out = np.asarray(J.forward(model, jnp.asarray(tokens), valid=jnp.asarray(valid)))
    assert _err(out[0], ref[0]) <= TOL and _err(out[1, pad:], ref[1, pad:]) <= TOL


@pytest.mark.parity
def test_diffusion_decoder_logits_chunked(tmp_path):
    hf = R.diffusion_gemma("a", seed=21)
    hf.save_pretrained(tmp_path)
    model = _chunked(load_hf_checkpoint(tmp_path)[0])
    V, L = hf.config.text_config.vocab_size - 3, hf.config.canvas_length
    g = torch.Generator().manual_seed(0)
    prompt, canvas, canvas2 = (torch.randint(3, V, (2, n), generator=g) for n in (13, L, L))
    with torch.no_grad():
        o1 = hf(input_ids=prompt, decoder_input_ids=canvas)
        sc = o1.logits / 0.7
        o2 = hf(cache=o1.cache, decoder_input_ids=canvas2, self_conditioning_logits=sc)
        o3 = hf(input_ids=canvas2, cache=o1.cache, decoder_input_ids=canvas)  # commit, then the next block
    cache = KVCache.init(model.cfg, 2, 48)
    assert cache.keys[0].shape[1] < 48  # sliding layers read a ring
    enc_hidden, cache = J.encode(model, jnp.asarray(prompt.numpy()), cache)
    assert _err(enc_hidden, o1.encoder_last_hidden_state.numpy()) <= TOL
    l1 = J.logits(model, J.decode(model, jnp.asarray(canvas.numpy()), cache))
    l2 = J.logits(model, J.decode(model, jnp.asarray(canvas2.numpy()), cache, sc_logits=jnp.asarray(sc.numpy())))
    _, cache2 = J.encode(model, jnp.asarray(canvas2.numpy()), cache)
    l3 = J.logits(model, J.decode(model, jnp.asarray(canvas.numpy()), cache2))
    for ours, ref in [(l1, o1), (l2, o2), (l3, o3)]:
        assert _err(ours, ref.logits.numpy()) <= TOL

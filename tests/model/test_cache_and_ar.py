"""KV cache: incremental decoding equals the full causal forward; AR greedy equals transformers' greedy generate."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from support import jitted as J
from dgemma.inference.ar import generate
from dgemma.model.cache import KVCache
from dgemma.model.config import tiny
from dgemma.model.transformer import Transformer
from support.block_layout import assert_rel_close


@pytest.fixture(scope="module")
def model():
    m = Transformer(tiny(), rngs=nnx.Rngs(3))
    # randomize norms/scalars too, so the cache path is exercised with non-trivial weights
    state = nnx.state(m, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(state))))
    state = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape, x.dtype), state)
    nnx.update(m, state)
    return m


def test_incremental_decode_equals_full_forward(model):
    T = 13  # > 3x the sliding window of 4
    tokens = jax.random.randint(jax.random.key(0), (2, T), 0, model.cfg.vocab_size)
    full = J.forward(model, tokens)
    cache = KVCache.init(model.cfg, 2, T + 3)
    chunks = [(0, 5), (5, 6), (6, 11), (11, 12), (12, 13)]  # prefill, single steps and a multi-token commit
    outs = []
    for a, b in chunks:
        hidden, cache = J.encode(model, tokens[:, a:b], cache)
        outs.append(J.logits(model, hidden))
    assert_rel_close(np.concatenate(outs, axis=1), full)
    assert int(cache.length) == T


def test_cache_truncate_then_reencode(model):
    tokens = jax.random.randint(jax.random.key(1), (1, 9), 0, model.cfg.vocab_size)
    cache = KVCache.init(model.cfg, 1, 12)
    _, cache = J.encode(model, tokens, cache)
    other = jax.random.randint(jax.random.key(2), (1, 3), 0, model.cfg.vocab_size)
    hidden, _ = J.encode(model, other, cache.truncate(6))
    expected = J.forward(model, jnp.concatenate([tokens[:, :6], other], axis=1))[:, 6:]
    assert_rel_close(J.logits(model, hidden), expected)


def test_left_padded_rows_decode_like_unpadded(model):
    prompt = jax.random.randint(jax.random.key(4), (1, 6), 3, model.cfg.vocab_size)
    alone = generate(model, prompt, max_new_tokens=8, eos_ids=(999,))
    padded = jnp.concatenate([jnp.zeros((1, 3), jnp.int32), prompt], axis=1)
    valid = jnp.concatenate([jnp.zeros((1, 3), bool), jnp.ones((1, 6), bool)], axis=1)
    batch = generate(model, jnp.concatenate([padded, padded]), jnp.concatenate([valid, valid]), max_new_tokens=8,
                     eos_ids=(999,))
    np.testing.assert_array_equal(batch[0], alone[0])


def test_temperature_sampling_is_seeded(model):
    prompt = jnp.array([[5, 6, 7, 8]])
    a = generate(model, prompt, max_new_tokens=10, temperature=50.0, key=jax.random.key(1), eos_ids=(999,))
    b = generate(model, prompt, max_new_tokens=10, temperature=50.0, key=jax.random.key(1), eos_ids=(999,))
    c = generate(model, prompt, max_new_tokens=10, temperature=50.0, key=jax.random.key(2), eos_ids=(999,))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.parity
def test_ar_greedy_equals_transformers_generate(tmp_path):
    pytest.importorskip("torch")
    from support import hf_reference as R
    from dgemma.convert.hf_import import load_hf_checkpoint

    hf, prompt, ref = R.greedy_reference(max_new_tokens=12)
    hf.save_pretrained(tmp_path)
    model, _ = load_hf_checkpoint(tmp_path, self_conditioning=False)
    ours = np.asarray(generate(model, prompt, max_new_tokens=12, eos_ids=(1,), pad_id=0))
    assert (ref == 1).any(), "the reference should stop one row at EOS"
    np.testing.assert_array_equal(ours[:, : ref.shape[1]], ref)
    assert (ours[:, ref.shape[1]:] == 0).all()

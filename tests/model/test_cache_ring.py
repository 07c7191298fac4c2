"""Sliding-layer KV cache as a ring of W - 1 + L slots: same outputs as a full-length cache far past the window
(encoder steps, long prefills that wrap the ring, decoder reads with the W - 1 rule), O(W) memory, refused truncation."""

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


@pytest.fixture(scope="module", params=["dense", "chunked"])
def model(request):
    m = Transformer(tiny().with_execution(attention_impl=request.param, attention_q_chunk=4, attention_kv_chunk=4),
                    rngs=nnx.Rngs(5))
    state = nnx.state(m, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(8), len(jax.tree.leaves(state))))
    nnx.update(m, jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape, x.dtype), state))
    return m


def test_ring_shapes_and_memory_do_not_grow_with_capacity():
    cfg = tiny()  # W = 4, L = 8: ring of 11 slots
    small, big = KVCache.init(cfg, 2, 64), KVCache.init(cfg, 2, 4096)
    for i in range(cfg.num_hidden_layers):
        if cfg.is_sliding(i):
            assert small.keys[i].shape[1] == big.keys[i].shape[1] == cfg.sliding_window - 1 + cfg.canvas_length
        else:
            assert big.keys[i].shape[1] == 4096
    assert KVCache.init(cfg, 2, 6).keys[0].shape[1] == 6  # capacity below the ring: the linear layout
    with pytest.raises(ValueError, match="sliding_slots=2 is below the W - 1"):
        KVCache.init(cfg, 2, 64, sliding_slots=2)


def test_slot_positions_after_wrapping():
    cfg = tiny()
    cache = KVCache.init(cfg, 1, 40)
    valid = jnp.ones((1, 25), bool).at[0, 20].set(False)
    cache = cache.write([(jnp.zeros(k.shape[:1] + (25,) + k.shape[2:]),) * 2 for k in cache.keys], valid)
    pos, ok = cache.slot_positions(11)
    assert sorted(np.asarray(pos).tolist()) == list(range(14, 25))  # the last 11 positions
    assert np.asarray(pos)[24 % 11] == 24 and not bool(ok[0, 20 % 11]) and int(ok.sum()) == 10


def test_ring_equals_full_length_cache_past_the_window(model):
    """Prefill longer than the ring, single steps, a multi-token commit and canvas decodes: ring == full length."""
    T, C = 30, 40
    tokens = jax.random.randint(jax.random.key(0), (2, T), 3, model.cfg.vocab_size)
    valid = jnp.ones((2, T), bool).at[1, :5].set(False)
    canvas = jax.random.randint(jax.random.key(1), (2, model.cfg.canvas_length), 0, model.cfg.vocab_size)
    outs = {}
    for name, slots in (("ring", None), ("full", C)):
        # one program per call shape (4 encoder lengths, 1 decoder), not one unrolled program of all ten calls
        cache = KVCache.init(model.cfg, 2, C, sliding_slots=slots)
        got = []
        for a, b in [(0, 17), (17, 18), (18, 19), (19, 27), (27, 30)]:  # 17 > 11 slots: the prefill wraps
            hidden, cache = J.encode(model, tokens[:, a:b], cache, valid[:, a:b])
            got.append(hidden)
            got.append(J.decode(model, canvas, cache))

        skips = [s for a in (0, 17, 18, 19, 27) for s in (max(0, 5 - a), 0)]  # row 1: its valid (non-pad) queries
        outs[name] = list(zip(got, skips))
    for (r, skip), (f, _) in zip(outs["ring"], outs["full"]):
        assert_rel_close(np.asarray(r)[0], np.asarray(f)[0])
        assert_rel_close(np.asarray(r)[1, skip:], np.asarray(f)[1, skip:])


def test_ar_generation_past_the_window_is_unchanged(model):
    prompt = jax.random.randint(jax.random.key(2), (2, 7), 3, model.cfg.vocab_size)
    out = generate(model, prompt, max_new_tokens=22, eos_ids=(999,))  # 29 positions, ring of 11
    full = J.forward(model, jnp.concatenate([prompt, out[:, :-1]], axis=1))  # teacher-forced (28 = 7 chunks of 4)
    np.testing.assert_array_equal(np.asarray(jnp.argmax(full[:, 6:], -1)), np.asarray(out))


def test_truncating_past_the_ring_is_refused():
    cfg = tiny()
    cache = KVCache.init(cfg, 1, 40)
    cache = cache.write([(jnp.zeros(k.shape[:1] + (20,) + k.shape[2:]),) * 2 for k in cache.keys],
                        jnp.ones((1, 20), bool))
    cache.truncate(20 - 8)  # one canvas back: fine
    with pytest.raises(ValueError, match="sliding_slots=W - 1 \\+ 11"):
        cache.truncate(20 - 11)

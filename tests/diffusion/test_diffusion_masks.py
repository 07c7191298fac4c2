"""One-pass block-diffusion mask vs a literal brute-force reading of the rule in docs/stage1.md §4."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma.diffusion.masks import TokenInfo, block_diffusion_mask, block_starts, concat_streams


@dataclasses.dataclass
class Tok:
    noisy: bool
    pos: int
    blk: int
    valid: bool
    seg: int
    s_b: int  # first position of the token's block (P + b·L), known from the layout generator


def allow(q: Tok, k: Tok, *, sliding: bool, w: int, decoder_sliding: str, clean_attention: str, strict: bool) -> bool:
    """The docs/stage1.md §4 rule, written as literally as possible."""
    if not k.valid or q.seg != k.seg:
        return False
    if not q.noisy and not k.noisy:
        if clean_attention == "causal" or q.blk < 0:
            ok = k.pos <= q.pos
        else:  # block_causal: response block sees earlier blocks, the prompt and its whole own block
            ok = (-1 <= k.blk < q.blk) or k.blk == q.blk
        if sliding:
            ok = ok and k.pos > q.pos - w
        return ok
    if not q.noisy and k.noisy:
        return False
    if q.noisy and not k.noisy:
        ok = (k.blk < q.blk if strict else k.blk <= q.blk) and k.blk >= -1
        if sliding:
            if decoder_sliding == "hf_fixed":
                ok = ok and k.pos >= q.s_b - (w - 1)
            else:
                ok = ok and k.pos > q.pos - w
        return ok
    return k.blk == q.blk and q.blk >= 0


def random_example(rng: np.random.Generator, p: int, block_len: int, n_blocks: int):
    """One example: left-padded prompt of total length P, N_b canvases of L tokens, trailing unused blocks."""
    r = block_len * n_blocks
    n_pad = int(rng.integers(0, p - 1))
    n_used = int(rng.integers(1, n_blocks + 1))
    tokens = rng.integers(0, 100, size=p + r)
    positions = np.arange(p + r)  # absolute: left pads consume positions (HF generate convention)
    block_id = np.full(p + r, -2)
    block_id[n_pad:p] = -1
    for b in range(n_used):
        block_id[p + b * block_len : p + (b + 1) * block_len] = b
    valid = block_id != -2
    if rng.random() < 0.5:  # unused tail slots may be valid clean tokens (never in any block, never noised)
        valid[p:] = True
    x_t = rng.integers(0, 100, size=r)
    return tokens, x_t, positions, valid, block_id


def literal_tokens(p, block_len, positions, valid, block_id, seg=0):
    r = len(block_id) - p
    clean = [Tok(False, int(positions[i]), int(block_id[i]), bool(valid[i]), seg, p + max(block_id[i], 0) * block_len)
             for i in range(p + r)]
    noisy = [Tok(True, int(positions[p + j]), int(block_id[p + j]), bool(valid[p + j] and block_id[p + j] >= 0), seg,
                 p + max(block_id[p + j], 0) * block_len) for j in range(r)]
    return clean + noisy


def brute_mask(rows: list[list[Tok]], **kw) -> np.ndarray:
    t = len(rows[0])
    out = np.zeros((len(rows), t, t), bool)
    for b, row in enumerate(rows):
        for i, j in itertools.product(range(t), range(t)):
            out[b, i, j] = allow(row[i], row[j], **kw)
    return out


P, L, NB = 6, 3, 3


def build_batch(seed: int, packed: bool):
    """Unpacked: B = 3 rows. Packed: each row holds two examples' [clean ; noisy] runs with segment ids."""
    rng = np.random.default_rng(seed)
    if not packed:
        exs = [random_example(rng, P, L, NB) for _ in range(3)]
        arr = lambda i: jnp.asarray(np.stack([e[i] for e in exs]))  # noqa: E731
        streams = concat_streams(arr(0), arr(1), arr(2), arr(3), arr(4))
        rows = [literal_tokens(P, L, e[2], e[3], e[4]) for e in exs]
        return streams.info, rows, streams
    infos, rows = [], []
    for row_idx in range(2):
        # row 0 interleaves [clean_0 ; noisy_0 ; clean_1 ; noisy_1]; row 1 groups [clean_0 ; clean_1 ; noisy_0 ;
        # noisy_1] with one block of 3L tokens per example and prompts of P ∓ 2, so the block-0 runs of the two
        # segments touch and have different block starts
        grouped = row_idx == 1
        block_len, nb = (L * NB, 1) if grouped else (L, NB)
        parts, lits, n_clean = [], [], []
        for seg in range(2):
            p = P + (4 * seg - 2 if grouped else 0)
            tok, x_t, pos, val, blk = random_example(rng, p, block_len, nb)
            st = concat_streams(*(jnp.asarray(a)[None] for a in (tok, x_t, pos, val, blk)),
                                segment=jnp.full((1, p + len(x_t)), seg))
            parts.append(st)
            lits.append(literal_tokens(p, block_len, pos, val, blk, seg))
            n_clean.append(p + len(x_t))
        if grouped:
            pieces = [(0, slice(0, n_clean[0])), (1, slice(0, n_clean[1])),
                      (0, slice(n_clean[0], None)), (1, slice(n_clean[1], None))]
        else:
            pieces = [(0, slice(None)), (1, slice(None))]
        cat = lambda f: jnp.concatenate([getattr(parts[i], f)[:, sl] for i, sl in pieces], axis=1)  # noqa: E731
        infos.append(TokenInfo(cat("positions"), cat("block_id"), cat("is_noisy"), cat("valid"), cat("segment")))
        rows.append([t for i, sl in pieces for t in lits[i][sl]])
    info = TokenInfo(*(jnp.concatenate([getattr(i, f) for i in infos], axis=0) for f in TokenInfo._fields[:5]))
    return info, rows, None  # block_start=None: derived inside the mask builder


CONFIGS = [
    (layer, ds, ca, w, packed)
    for layer in ("sliding_attention", "full_attention")
    for ds in ("hf_fixed", "jax_per_query")
    for ca in ("causal", "block_causal")
    for w, packed in ((4, False), (2, True), (7, False))
    if not (layer == "full_attention" and ds == "jax_per_query")  # decoder_sliding is irrelevant on full layers
]


@pytest.mark.parametrize("layer,decoder_sliding,clean_attention,window,packed", CONFIGS)
def test_mask_equals_brute_force(layer, decoder_sliding, clean_attention, window, packed):
    info, rows, _ = build_batch(seed=window * 10 + packed, packed=packed)
    # the stream index arrays follow the docs/stage1.md §4 table
    for name, attr in (("pos", "pos"), ("blk", "blk"), ("valid", "valid"), ("noisy", "is_noisy")):
        literal = [[getattr(t, name) for t in row] for row in rows]
        np.testing.assert_array_equal(np.asarray(getattr(info, attr)), literal)
    kw = dict(window=window, layer_type=layer, decoder_sliding=decoder_sliding, clean_attention=clean_attention)
    got = np.asarray(block_diffusion_mask(info, info, **kw))
    want = brute_mask(rows, sliding=layer.startswith("sliding"), w=window, decoder_sliding=decoder_sliding,
                      clean_attention=clean_attention, strict=True)
    assert got.shape == want.shape and got.dtype == bool
    np.testing.assert_array_equal(got, want)
    # non-vacuous: every allowed quadrant occurs, and on sliding layers the window removes some noisy -> clean pairs
    noisy = np.asarray(info.is_noisy)
    for qn, kn in ((False, False), (True, False), (True, True)):
        assert (want & (noisy[:, :, None] == qn) & (noisy[:, None, :] == kn)).any()
    if layer.startswith("sliding"):
        no_window = brute_mask(rows, sliding=False, w=window, decoder_sliding=decoder_sliding,
                               clean_attention=clean_attention, strict=True)
        assert (no_window & ~want & noisy[:, :, None] & ~noisy[:, None, :]).any()


@pytest.mark.parametrize(
    "layer,decoder_sliding", [("sliding", "hf_fixed"), ("sliding", "jax_per_query"), ("full", "hf_fixed")]
)
def test_strict_vs_leaky_differ_exactly_on_same_block_clean_keys(layer, decoder_sliding):
    info, rows, _ = build_batch(seed=1, packed=False)
    kw = dict(window=4, layer_type=layer, decoder_sliding=decoder_sliding)
    strict = np.asarray(block_diffusion_mask(info, info, **kw))
    leaky = np.asarray(block_diffusion_mask(info, info, strict=False, **kw))
    assert not np.any(strict & ~leaky)
    diff = leaky & ~strict
    expected = np.zeros_like(diff)
    for b, row in enumerate(rows):
        for i, j in itertools.product(range(len(row)), range(len(row))):
            q, k = row[i], row[j]
            expected[b, i, j] = (q.noisy and not k.noisy and k.valid and q.blk >= 0 and k.blk == q.blk and
                                 (layer == "full" or decoder_sliding == "hf_fixed" or k.pos > q.pos - 4))
    np.testing.assert_array_equal(diff, expected)
    assert diff.sum() > 0


def test_sliding_w_minus_1_edge():
    # P = 8, L = 2, three blocks, no padding, W = 4: block 2 starts at s_2 = 12
    p, block_len, w = 8, 2, 4
    blk = jnp.asarray([[-1] * p + [0, 0, 1, 1, 2, 2]])
    n = blk.shape[1]
    st = concat_streams(jnp.zeros((1, n), jnp.int32), jnp.zeros((1, 6), jnp.int32), jnp.arange(n)[None],
                        jnp.ones((1, n), bool), blk)
    hf = np.asarray(block_diffusion_mask(st.info, st.info, window=w, layer_type="sliding"))[0]
    pq = np.asarray(block_diffusion_mask(st.info, st.info, window=w, layer_type="sliding",
                                         decoder_sliding="jax_per_query"))[0]
    q12, q13 = n + 4, n + 5  # noisy twins of positions 12 and 13
    clean_keys = lambda m, q: list(np.nonzero(m[q, :n])[0])  # noqa: E731  (clean index == position here)
    assert clean_keys(hf, q12) == [9, 10, 11] and clean_keys(hf, q13) == [9, 10, 11]  # exactly W − 1 keys
    assert clean_keys(pq, q12) == [9, 10, 11] and clean_keys(pq, q13) == [10, 11]
    # clean stream: causal band of W keys
    assert list(np.nonzero(hf[12, :n])[0]) == [9, 10, 11, 12]
    np.testing.assert_array_equal(np.asarray(st.block_start)[0, n:], [8, 8, 10, 10, 12, 12])


def test_hf_fixed_and_per_query_agree_only_while_context_fits():
    # they agree iff every block start s_b <= W − L (docs/stage1.md §4, "W − 1")
    p, block_len = 2, 2
    blk = jnp.asarray([[-1, -1, 0, 0, 1, 1]])
    st = concat_streams(jnp.zeros((1, 6), jnp.int32), jnp.zeros((1, 4), jnp.int32), jnp.arange(6)[None],
                        jnp.ones((1, 6), bool), blk)
    for w, agree in ((6, True), (5, False), (3, False)):
        masks = [np.asarray(block_diffusion_mask(st.info, st.info, window=w, layer_type="sliding", decoder_sliding=d))
                 for d in ("hf_fixed", "jax_per_query")]
        assert np.array_equal(*masks) == agree, w
    del p, block_len


def test_concat_streams_layout():
    tokens = jnp.asarray([[0, 5, 6, 7, 8, 9, 1, 1]])  # pad, prompt(2), block 0 (2), block 1 (2) unused, ...
    block_id = jnp.asarray([[-2, -1, -1, 0, 0, 1, 1, -2]])
    valid = block_id != -2
    st = concat_streams(tokens, jnp.asarray([[40, 41, 42, 43, 44]]), jnp.arange(8)[None], valid, block_id)
    np.testing.assert_array_equal(np.asarray(st.tokens)[0], [0, 5, 6, 7, 8, 9, 1, 1, 40, 41, 42, 43, 44])
    np.testing.assert_array_equal(np.asarray(st.positions)[0], list(range(8)) + [3, 4, 5, 6, 7])
    np.testing.assert_array_equal(np.asarray(st.block_id)[0, 8:], [0, 0, 1, 1, -2])
    np.testing.assert_array_equal(np.asarray(st.is_noisy)[0], [False] * 8 + [True] * 5)
    np.testing.assert_array_equal(np.asarray(st.valid)[0], [0, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(np.asarray(st.block_start)[0, 8:12], [3, 3, 5, 5])
    assert st.segment is None and st.info.block_start is st.block_start
    # a valid unused clean slot (block −2) never gets a valid noisy twin
    st2 = concat_streams(tokens, jnp.zeros((1, 5), jnp.int32), jnp.arange(8)[None], jnp.ones((1, 8), bool), block_id)
    np.testing.assert_array_equal(np.asarray(st2.valid)[0, 8:], [1, 1, 1, 1, 0])
    bs = block_starts(st.positions, st.block_id, st.is_noisy)
    np.testing.assert_array_equal(np.asarray(bs), np.asarray(st.block_start))


# MARK: behavioural check with a toy 2-layer attention network


def toy_forward(params, tokens, pos, masks):
    h = params["emb"][tokens] + params["pos"][pos]
    for layer, mask in zip(params["layers"], masks):
        q, k, v = h @ layer["q"], h @ layer["k"], h @ layer["v"]
        s = jnp.einsum("btd,bsd->bts", q, k)
        s = jnp.where(mask, s, -1e30)
        h = h + jax.nn.softmax(s, axis=-1) @ v
    return h


def test_noisy_block_logits_ignore_own_and_later_clean_blocks():
    rng = np.random.default_rng(0)
    p, block_len, nb, w, d, vocab = 5, 3, 3, 5, 8, 30
    r = block_len * nb
    n = p + r
    keys = jax.random.split(jax.random.key(0), 8)
    params = {
        "emb": jax.random.normal(keys[0], (vocab, d)),
        "pos": jax.random.normal(keys[1], (n, d)),
        "layers": [{m: jax.random.normal(k, (d, d)) / np.sqrt(d) for m, k in zip("qkv", jax.random.split(kk, 3))}
                   for kk in keys[2:4]],
    }
    block_id = jnp.asarray([[-2] + [-1] * (p - 1) + [b for b in range(nb) for _ in range(block_len)]])
    valid = block_id != -2
    clean = jnp.asarray(rng.integers(0, vocab, size=(1, n)))
    x_t = jnp.asarray(rng.integers(0, vocab, size=(1, r)))

    def run(clean_tokens, strict=True):
        st = concat_streams(clean_tokens, x_t, jnp.arange(n)[None], valid, block_id)
        masks = [block_diffusion_mask(st.info, st.info, window=w, layer_type=lt, strict=strict)
                 for lt in ("sliding", "full")]
        return np.asarray(toy_forward(params, st.tokens, st.positions, masks))[0, n:]  # noisy stream outputs

    b = 1
    sl = slice(b * block_len, (b + 1) * block_len)
    base = run(clean)
    later = clean.at[0, p + b * block_len :].set((clean[0, p + b * block_len :] + 1) % vocab)
    np.testing.assert_array_equal(run(later)[sl], base[sl])  # bit-identical
    earlier = clean.at[0, p + (b - 1) * block_len].set((clean[0, p + (b - 1) * block_len] + 1) % vocab)
    assert np.abs(run(earlier)[sl] - base[sl]).max() > 1e-4
    prompt = clean.at[0, p - 1].set((clean[0, p - 1] + 1) % vocab)
    assert np.abs(run(prompt)[sl] - base[sl]).max() > 1e-4
    # the leaky mask is detected: block b's own clean answer changes its noisy outputs
    own = clean.at[0, p + b * block_len].set((clean[0, p + b * block_len] + 1) % vocab)
    assert np.abs(run(own, strict=False)[sl] - run(clean, strict=False)[sl]).max() > 1e-4

"""Block sampler (docs/sampler.md): step counts, stop rule, accept rule, per-row RNG, sharding, AR fallback / modes, metrics.

HF bit-parity is in test_sampler_parity.py. Here:
- pure pieces (EB accept vs brute force, entropy, temperature, stability, EOS finalize), several against the
  transformers implementation on the same inputs;
- a deterministic mock LM (`ChainLM`) with known step counts (steps per block, stop rule), the ancestral option and AR fallback;
- a tiny dgemma Transformer made to converge (the stop rule fires), batch invariance, sharding and mixed modes.
"""

import itertools

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from dgemma.inference import eb_accept
from dgemma.inference.ar import generate as ar_generate
from dgemma.inference.metrics import format_summary, summarize
from dgemma.inference.sampler import (AR_FALLBACK, CONVERGED, EOS_FINISHED, MAX_STEPS, InjectedDraws, SamplerConfig,
                                      finalize_canvas, sample)
from dgemma.model.config import tiny
from dgemma.model.transformer import abstract_model
from support.sampler_helpers import batch_prompts as _batch_prompts, converging_model


# MARK: pure pieces ------------------------------------------------------------------------------------------------


def _brute_force_accept(h, gamma, narrow=False):
    """Largest k such that the k lowest entropies satisfy sum - max <= gamma (stable order), as a mask. The bound
    is widened by fp32 rounding (1e-6 relative), or with `narrow` narrowed by it: a partial sum within rounding of
    gamma may go either way (an exact zero sum never does)."""
    order = np.argsort(h, kind="stable")
    best = 1
    for k in range(1, len(h) + 1):
        s = h[order[:k]]
        rest = s.sum() - s.max()  # exact when every entry but the largest is 0
        if rest <= gamma + (-1e-6 * rest if narrow else 1e-6 * (1 + s.sum())):
            best = k
    mask = np.zeros(len(h), bool)
    mask[order[:best]] = True
    return mask


def test_entropy_bound_accept_equals_brute_force():
    rng = np.random.default_rng(0)
    rows = [rng.exponential(0.05, 12) for _ in range(40)] + [np.zeros(12), np.full(12, 3.0),
                                                           np.round(rng.exponential(0.05, 12), 2)]  # ties
    h = np.stack(rows).astype(np.float32)
    masks = {}
    for gamma in (0.0, 0.05, 0.1, 0.3, 1.0):
        got = np.asarray(eb_accept.entropy_bound_accept(jnp.asarray(h), gamma))
        for r in range(len(h)):
            # exact ties straddling the bound may pick either tied position; compare counts there. A row whose
            # partial sum lands on gamma itself (the rounded-ties row: six entries summing to 0.1 exactly in real
            # arithmetic) is decided by fp32 summation order, so its count may be either side of that sum.
            want, lo = _brute_force_accept(h[r], gamma), _brute_force_accept(h[r], gamma, narrow=True)
            assert lo.sum() <= got[r].sum() <= want.sum(), (gamma, r)
            if len(np.unique(h[r])) == len(h[r]) and lo.sum() == want.sum():
                np.testing.assert_array_equal(got[r], want)
        assert (got.sum(1) >= 1).all()
        masks[gamma] = got
    for g1, g2 in itertools.pairwise(sorted(masks)):  # A(g1) ⊆ A(g2)
        assert not (masks[g1] & ~masks[g2]).any()
    assert masks[0.0][40].all()  # all H = 0 -> everything accepted, even with gamma = 0


def test_fixed_count_and_confidence_accept():
    h = jnp.asarray([[0.5, 0.1, 0.3, 0.0], [1.0, 1.0, 1.0, 1.0]])
    np.testing.assert_array_equal(eb_accept.fixed_count_accept(h, 2), [[False, True, False, True],
                                                                         [True, True, False, False]])
    z = jnp.log(jnp.asarray([[[0.95, 0.05], [0.6, 0.4]], [[0.5, 0.5], [0.7, 0.3]]]))
    chosen = jnp.asarray([[0, 1], [1, 0]])
    np.testing.assert_array_equal(eb_accept.confidence_accept(z, chosen, 0.9), [[True, False], [False, True]])


def test_argmax_and_categorical_sampling():
    rng = np.random.default_rng(2)
    z = rng.standard_normal((3, 5, 50)).astype(np.float32)
    z[0, 0, [3, 9]] = 9.0  # tie: first index wins, as jnp.argmax
    z[1, 1] = -np.inf
    np.testing.assert_array_equal(eb_accept.argmax(jnp.asarray(z)), np.argmax(z, -1))
    # both samplers draw from softmax(z): chi-square on 20000 draws of one 6-way distribution
    logits = np.log(np.asarray([0.4, 0.25, 0.2, 0.1, 0.05, 0.0]) + 1e-30).astype(np.float32)
    zz = jnp.broadcast_to(jnp.asarray(logits), (4, 5000, 6))
    keys = jax.random.split(jax.random.key(0), 4)
    for method in ("inverse_cdf", "gumbel"):
        draws = np.asarray(eb_accept.sample_categorical(keys, zz, method)).ravel()
        counts = np.bincount(draws, minlength=6)
        assert counts[5] == 0  # a zero-probability token is never drawn
        expected = 20000 * np.asarray([0.4, 0.25, 0.2, 0.1, 0.05])
        chi2 = (((counts[:5] - expected) ** 2) / expected).sum()
        assert chi2 < 20.5, (method, counts)  # p ≈ 4e-4 for 4 degrees of freedom
    # per-row keys: a row's draws depend only on its own key
    one = eb_accept.sample_categorical(keys[2:3], zz[2:3], "inverse_cdf")
    np.testing.assert_array_equal(one[0], eb_accept.sample_categorical(keys, zz, "inverse_cdf")[2])


def test_temperature_endpoints():
    for N, tmin, tmax in [(48, 0.4, 0.8), (7, 0.1, 0.3), (1, 0.4, 0.8)]:
        sched = eb_accept.temperature_schedule(N, tmin, tmax)
        assert sched[0] == np.float32(tmax)
        assert sched[-1] == np.float32(np.float32(tmin) + np.float32(tmax - tmin) / np.float32(N))
        assert (np.diff(sched) < 0).all()


@pytest.mark.parity
def test_pieces_match_transformers():
    """Entropy, temperature, EB accept and the stop criterion equal transformers' on the same inputs."""
    torch = pytest.importorskip("torch")
    from transformers.models.diffusion_gemma import generation_diffusion_gemma as G

    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((3, 16, 40)) * rng.uniform(0.1, 8, (3, 16, 1))).astype(np.float32)
    logits[0, 0, :5] = -np.inf
    t_logits = torch.from_numpy(logits)
    # temperature: bit-exact fp32 tau at every step; the tempered logits to 1 ulp (XLA rewrites x / scalar as
    # x * (1 / scalar) on CPU, which differs from an IEEE division in the last bit for ~40% of elements)
    proc = G.LinearTemperatureScheduleLogitsProcessor(t_min=0.4, t_max=0.8, max_denoising_steps=7)
    for i in range(7):
        cur = torch.tensor(7 - i, dtype=torch.int32)
        tau = eb_accept.temperature(i, 7, np.float32(0.4), np.float32(0.8 - 0.4))
        assert float(tau) == (0.4 + (0.8 - 0.4) * (cur / 7)).item()
        ref = proc(None, t_logits, cur_step=cur).numpy()
        np.testing.assert_allclose(np.asarray(jnp.asarray(logits) / tau), ref, rtol=2.5e-7, atol=0)
    # entropy
    ref_h = torch.distributions.Categorical(logits=t_logits).entropy().numpy()
    np.testing.assert_allclose(eb_accept.token_entropy(jnp.asarray(logits)), ref_h, rtol=1e-5, atol=1e-6)
    # EB accept (distinct entropies, so sort stability does not matter)
    for gamma in (0.1, 1.0, 5.0):
        sampler = G.EntropyBoundSampler(G.EntropyBoundSamplerConfig(entropy_bound=gamma), 16, 40, 7)
        cur, den = torch.zeros(3, 16, dtype=torch.long), torch.ones(3, 16, dtype=torch.long)
        ref_acc = sampler.accept_canvas(cur, den, t_logits, 1).numpy().astype(bool)
        got = eb_accept.entropy_bound_accept(jnp.asarray(ref_h), gamma)
        np.testing.assert_array_equal(got, ref_acc)
    # stop criterion over a sequence of argmaxes, S in {0, 1, 2}
    seq = [rng.integers(0, 3, (3, 4)) for _ in range(3)]
    seq += [seq[-1]] * 3
    low = torch.full((3, 4, 5), -30.0)
    low[..., 0] = 30.0
    for S in (0, 1, 2):
        crit = G.StableAndConfidentStoppingCriteria(S, 0.005)
        hist = jnp.full((max(S, 1), 3, 4), -1, jnp.int32)
        for a in seq:
            want = crit(torch.from_numpy(a), low).numpy()
            stable, hist = eb_accept.stability_update(hist, jnp.asarray(a, jnp.int32), S)
            confident = np.asarray(eb_accept.token_entropy(jnp.asarray(low.numpy())).mean(-1)) < 0.005
            np.testing.assert_array_equal(np.asarray(stable) & confident, want)


def test_finalize_canvas():
    eos, pad = jnp.asarray([1, 7]), 0
    draft = jnp.asarray([[5, 1, 6, 7, 1], [5, 6, 8, 9, 4], [3, 3, 7, 2, 2], [1, 2, 3, 4, 5]])
    finished = jnp.asarray([False, False, False, True])
    toks, fin = finalize_canvas(draft, finished, eos, pad, jnp.asarray(False))
    np.testing.assert_array_equal(toks, [[5, 1, 0, 0, 0], [5, 6, 8, 9, 4], [3, 3, 7, 0, 0], [0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(fin, [True, False, True, True])
    _, fin = finalize_canvas(draft, finished, eos, pad, jnp.asarray(True))  # budget exhausted: everyone finishes
    assert bool(fin.all())


def test_config_from_section_and_validation():
    from dgemma.config.sections import SamplerSection

    sec = SamplerSection(max_steps=12, entropy_bound=0.2, mode="auto", max_new_tokens=64)
    cfg = SamplerConfig.from_section(sec, greedy=True)
    assert (cfg.max_steps, cfg.entropy_bound, cfg.mode, cfg.max_new_tokens, cfg.greedy) == (12, 0.2, "auto", 64, True)
    assert cfg.static_part() == cfg.replace(entropy_bound=0.9, max_new_tokens=8).static_part()
    assert cfg.static_part() != cfg.replace(stability_threshold=2).static_part()
    for bad in (dict(max_steps=0), dict(t_min=0.9), dict(mode="fast"), dict(algorithm="x"), dict(accept="y")):
        with pytest.raises(ValueError, match="SamplerConfig"):
            SamplerConfig(**bad)


def test_injected_draws_parse_hf_stream():
    r = lambda v: ("randint", np.full((2, 3), v))  # noqa: E731
    m = lambda v: ("multinomial", np.full((6, 1), v))  # noqa: E731
    d = InjectedDraws.from_hf_stream([r(0), m(1), r(2), m(3), r(4), r(5), m(6), r(7)], 2, 3)
    assert [d.steps(0), d.steps(1)] == [2, 1]
    blk = d.block(0, 2, 3, 4)
    assert blk["samples"].shape == (4, 2, 3) and int(blk["samples"][1, 0, 0]) == 3 and int(blk["noise"][2, 0, 0]) == 0
    with pytest.raises(ValueError):
        InjectedDraws.from_hf_stream([m(1)], 2, 3)
    srt = ("sort", np.tile([2, 0, 1], (2, 1)))
    d = InjectedDraws.from_hf_stream([r(0), m(1), srt, r(2)], 2, 3)
    blk = d.block(0, 2, 3, 2)
    np.testing.assert_array_equal(blk["order"][0], [[2, 0, 1]] * 2)
    np.testing.assert_array_equal(blk["order"][1], [[0, 1, 2]] * 2)  # unrecorded steps: identity
    # a replayed order decides which of two equal entropies is accepted
    h = jnp.asarray([[0.06, 0.06, 0.06]])
    np.testing.assert_array_equal(eb_accept.entropy_bound_accept(h, 0.1), [[True, True, False]])
    np.testing.assert_array_equal(eb_accept.entropy_bound_accept(h, 0.1, order=jnp.asarray([[2, 0, 1]])),
                                  [[True, False, True]])


# MARK: mock LM with known dynamics --------------------------------------------------------------------------------


class ChainLM(nnx.Module):
    """Deterministic 'bigram chain' LM implementing the encode/decode/logits/soft_embed interface.

    next(u) = nxt[u]; logits for source u are sharp·onehot(next(u)), except "flat" sources (all-zero logits: uniform,
    argmax 0 = next). The encoder stores each token id in the K cache; the decoder reads the last cached token p and
    predicts canvas position j from source next^j(p), i.e. exactly the AR greedy continuation, ignoring the canvas.
    A canvas containing a flat source is never confident, so its block runs max_steps.
    """

    def __init__(self, L, V=16, sharp=30.0, flat=(7,)):
        self.cfg = tiny(vocab_size=V, canvas_length=L)
        nxt = (np.arange(V) + 1) % V
        flat = list(flat)
        nxt[flat] = 0
        table = sharp * np.eye(V, dtype=np.float32)[nxt]
        table[flat] = 0.0
        chain = np.zeros((V, L), np.int32)
        for u in range(V):
            s = u
            for j in range(L):
                chain[u, j] = s
                s = nxt[s]
        self.nxt = nxt
        self.table = nnx.Variable(jnp.asarray(table))
        self.chain = nnx.Variable(jnp.asarray(chain))

    def encode(self, tokens, cache, valid=None):
        B, T = tokens.shape
        valid = jnp.ones((B, T), bool) if valid is None else valid
        kvs = []
        for i in range(self.cfg.num_hidden_layers):
            k = jnp.zeros((B, T, self.cfg.layer_kv_heads(i), self.cfg.layer_head_dim(i)), jnp.float32)
            k = k.at[:, :, 0, 0].set(tokens.astype(jnp.float32))
            kvs.append((k, k))
        return jax.nn.one_hot(tokens, self.cfg.vocab_size), cache.write(kvs, valid)

    def decode(self, canvas, cache, **_):
        # the last (full-attention) layer: slot s holds position s (sliding layers may keep a ring of slots)
        prev = jax.lax.dynamic_index_in_dim(cache.keys[-1], cache.length - 1, axis=1, keepdims=False)
        prev = prev[:, 0, 0].astype(jnp.int32)
        return jax.nn.one_hot(self.chain[...][prev], self.cfg.vocab_size)

    def logits(self, hidden):
        return (hidden @ self.table[...]).astype(jnp.float32)

    def soft_embed(self, z):
        return jnp.zeros(z.shape[:-1] + (self.cfg.hidden_size,), jnp.float32)


def test_canvas_of_one_reproduces_ar_greedy():
    lm = ChainLM(L=1, flat=())
    prompt = jnp.asarray([[3, 4, 5], [0, 9, 12]])
    valid = jnp.asarray([[True, True, True], [False, True, True]])
    cfg = SamplerConfig(max_steps=6, max_new_tokens=5, eos_ids=(98,), pad_id=99)
    res = sample(lm, prompt, valid, cfg, jax.random.key(0))
    ref = np.asarray(ar_generate(lm, prompt, valid, max_new_tokens=5, eos_ids=(98,), pad_id=99))
    np.testing.assert_array_equal(res.tokens, ref)
    np.testing.assert_array_equal(res.tokens, [[6, 7, 8, 9, 10], [13, 14, 15, 0, 1]])
    assert (res.steps_per_block == 2).all() and (res.stop_reason == CONVERGED).all()
    np.testing.assert_allclose(res.tpf, 0.5)


def test_confidence_test_is_strict():
    """mean H < c, strictly: at c = H exactly a block never stops; one ulp above, it stops at step 2 (S = 1)."""
    lm = ChainLM(L=1)
    prompt = jnp.asarray([[5, 6]])  # block 0 predicts 7 (sharp); block 1's source is the flat token 7
    cfg = SamplerConfig(max_steps=5, max_new_tokens=2, eos_ids=(98,), pad_id=99, confidence_threshold=0.0)
    h = sample(lm, prompt, None, cfg, jax.random.key(0)).entropy_trace[0, 1, 0]
    assert h == np.float32(np.log(16.0)) or abs(h - np.log(16.0)) < 1e-5
    at = sample(lm, prompt, None, cfg.replace(confidence_threshold=float(h)), jax.random.key(0))
    above = sample(lm, prompt, None, cfg.replace(confidence_threshold=float(np.nextafter(h, np.float32(np.inf)))),
                   jax.random.key(0))
    np.testing.assert_array_equal(at.steps_per_block, [[2, 5]])
    np.testing.assert_array_equal(above.steps_per_block, [[2, 2]])
    np.testing.assert_array_equal(at.tokens, [[7, 0]])


def test_tpf_accounting_with_known_step_counts():
    K = 9
    lm = ChainLM(L=4)
    prompt = jnp.asarray([[2, 1], [8, 9]])
    cfg = SamplerConfig(max_steps=K, max_new_tokens=12, eos_ids=(12,), pad_id=14)
    res = sample(lm, prompt, None, cfg, jax.random.key(1))
    # row 0: canvases from 1 -> [2,3,4,5] (2 steps), [6,7,0,1] (source 7 is flat: K steps), [2,3,4,5] (2 steps)
    # row 1: [10,11,12,13] -> EOS 12 at position 2, then PAD; finished: later blocks count no passes
    np.testing.assert_array_equal(res.tokens, [[2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5],
                                               [10, 11, 12, 14, 14, 14, 14, 14, 14, 14, 14, 14]])
    np.testing.assert_array_equal(res.steps_per_block, [[2, K, 2], [2, 0, 0]])
    np.testing.assert_array_equal(res.stop_reason, [[CONVERGED, MAX_STEPS, CONVERGED],
                                                    [CONVERGED, EOS_FINISHED, EOS_FINISHED]])
    np.testing.assert_array_equal(res.steps_run, [2, K, 2])  # the finished row does not hold the loop
    np.testing.assert_array_equal(res.decoder_passes, [4 + K, 2])
    np.testing.assert_allclose(res.tpf, [12 / (4 + K), 3 / 2])
    np.testing.assert_array_equal(res.commit_passes, [2, 0])
    np.testing.assert_allclose(res.tpf_total, [12 / (4 + K + 2), 3 / 2])
    # HF semantics (wait for finished rows) change neither tokens nor accounting here
    hf_like = sample(lm, prompt, None, cfg.replace(wait_for_finished_rows=True), jax.random.key(1))
    np.testing.assert_array_equal(hf_like.tokens, res.tokens)
    np.testing.assert_array_equal(hf_like.decoder_passes, res.decoder_passes)
    # metrics: the entropy trace is NaN once a row stopped; commitment at step 1 (the chain never changes)
    assert np.isnan(res.entropy_trace[0, 0, 2:]).all() and not np.isnan(res.entropy_trace[0, 1]).any()
    assert (res.commit_step[0, 0] == 1).all() and (res.commit_step[1, 1] == 0).all()
    s = summarize(res, max_steps=K)
    assert s["steps_mean"] == pytest.approx((2 + K + 2 + 2) / 4) and s["pct_max_steps"] == 25.0
    assert "tpf_mean" in format_summary(s)


def test_auto_mode_falls_back_to_ar_on_unconverged_blocks():
    K = 9
    lm = ChainLM(L=4)
    prompt = jnp.asarray([[2, 1], [8, 9]])
    cfg = SamplerConfig(max_steps=K, max_new_tokens=12, eos_ids=(12,), pad_id=14)
    res = sample(lm, prompt, None, cfg, jax.random.key(1), mode="auto")
    np.testing.assert_array_equal(res.tokens[0], [2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5])
    assert res.stop_reason[0, 1] == AR_FALLBACK and res.stop_reason[0, 2] == CONVERGED
    np.testing.assert_array_equal(res.ar_forwards, [4, 0])
    np.testing.assert_allclose(res.tpf[0], 12 / (4 + K + 4))
    # per-row modes: row 1 fully AR (no decoder passes), row 0 diffusion only
    mixed = sample(lm, prompt, None, cfg, jax.random.key(1), mode=("diffusion", "ar"))
    np.testing.assert_array_equal(mixed.tokens, res.tokens)
    np.testing.assert_array_equal(mixed.decoder_passes, [4 + K, 0])
    np.testing.assert_array_equal(mixed.ar_forwards, [0, 3])
    assert mixed.stop_reason[0, 1] == MAX_STEPS and mixed.stop_reason[1, 0] == AR_FALLBACK


def test_ancestral_option_runs_fixed_steps_and_commits_x0():
    lm = ChainLM(L=4)
    prompt = jnp.asarray([[2, 1], [8, 9]])
    cfg = SamplerConfig(max_steps=5, max_new_tokens=8, eos_ids=(99,), pad_id=14, algorithm="ancestral", greedy=True)
    res = sample(lm, prompt, None, cfg, jax.random.key(2))
    ref = np.asarray(ar_generate(lm, prompt, max_new_tokens=8, eos_ids=(99,), pad_id=14))
    np.testing.assert_array_equal(res.tokens, ref)  # the committed canvas is the last step's x̂0
    assert (res.steps_per_block == 5).all() and (res.stop_reason == MAX_STEPS).all()
    assert (res.commit_step[0, 0] == 1).all()  # x̂0 is the chain from the first step on


def test_eb_variants_run():
    lm = ChainLM(L=4)
    prompt = jnp.asarray([[2, 1]])
    for kw in (dict(greedy=True), dict(accept="confidence"), dict(accept="fixed_count")):
        cfg = SamplerConfig(max_steps=6, max_new_tokens=4, eos_ids=(99,), pad_id=14, **kw)
        res = sample(lm, prompt, None, cfg, jax.random.key(0))
        np.testing.assert_array_equal(res.tokens, [[2, 3, 4, 5]])
        assert res.steps_per_block[0, 0] == 2


# MARK: tiny dgemma Transformer that converges ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def conv_model():
    return converging_model()


# one compiled configuration shared by the B = 2 tests (the convergence test looks at the first block only)
PAIR_CFG = SamplerConfig(max_steps=12, max_new_tokens=16, eos_ids=(999,), entropy_bound=1.0, record_drafts=True)


def test_stop_step_monotone_in_c_and_matches_recorded_trajectory(conv_model):
    prompts, valid, _ = _batch_prompts(B=2, P=6, seed=4)
    base = PAIR_CFG
    K = base.max_steps
    free = sample(conv_model, prompts, valid, base.replace(confidence_threshold=0.0), jax.random.key(5))
    assert (free.steps_per_block == K).all()
    drafts = free.drafts[0]  # [K, B, L]
    mean_h = free.entropy_trace[:, 0]  # [B, K]
    stable = np.concatenate([np.zeros((1, 2), bool), (drafts[1:] == drafts[:-1]).all(-1)], axis=0).T  # [B, K]
    prev = None
    for c in (0.02, 0.05, 0.1, 0.3, 1.0, 5.0):
        res = sample(conv_model, prompts, valid, base.replace(confidence_threshold=c), jax.random.key(5))
        for r in range(2):
            hits = np.nonzero(stable[r] & (mean_h[r] < c))[0]
            want = hits[0] + 1 if hits.size else K
            assert res.steps_per_block[r, 0] == want, (c, r)
            np.testing.assert_array_equal(res.tokens[r, :8], drafts[want - 1, r])
        if prev is not None:
            assert (res.steps_per_block <= prev).all()
        prev = res.steps_per_block
    assert prev.max() < K, "the largest c should stop some row early"


@pytest.fixture(scope="module")
def batch_run(conv_model):
    prompts, valid, lengths = _batch_prompts()
    cfg = SamplerConfig(max_steps=8, max_new_tokens=16, eos_ids=(999,), entropy_bound=1.0, confidence_threshold=0.1)
    res = sample(conv_model, prompts, valid, cfg, jax.random.key(7))
    return prompts, valid, lengths, cfg, res


def test_row_output_independent_of_batch(conv_model, batch_run):
    """Row r sampled alone (its unpadded prompt, row_ids=[r]) equals row r of the left-padded batch of 8."""
    prompts, valid, lengths, cfg, res = batch_run
    assert len({tuple(t) for t in res.tokens}) == 8
    r = int(np.argmin(lengths))
    assert lengths[r] < prompts.shape[1]  # this row is left-padded inside the batch
    streamed = []
    alone = sample(conv_model, prompts[r:r + 1, -lengths[r]:], None, cfg, jax.random.key(7), row_ids=[r],
                   on_block=lambda b, t: streamed.append((b, t)))
    np.testing.assert_array_equal(alone.tokens[0], res.tokens[r])
    np.testing.assert_array_equal(alone.steps_per_block[0], res.steps_per_block[r])
    assert [b for b, _ in streamed] == [0, 1]
    np.testing.assert_array_equal(np.concatenate([t for _, t in streamed], axis=1)[0], res.tokens[r])
    other = sample(conv_model, prompts[r:r + 1, -lengths[r]:], None, cfg, jax.random.key(7), row_ids=[r + 1])
    assert not np.array_equal(other.tokens[0], res.tokens[r])  # the row id really feeds the RNG


def test_sharded_equals_single_device(conv_model, batch_run):
    from dgemma.parallel.mesh import make_mesh

    prompts, valid, _, cfg, res = batch_run
    mesh = make_mesh({"data": 2, "fsdp": 4})
    sharded = sample(conv_model, prompts, valid, cfg, jax.random.key(7), mesh=mesh, rules="fsdp")
    leaf = sharded.cache.keys[0]
    assert len(leaf.sharding.device_set) == 8
    np.testing.assert_array_equal(sharded.tokens, res.tokens)
    np.testing.assert_array_equal(sharded.steps_per_block, res.steps_per_block)


def test_sharded_pads_rows_to_whole_shards(conv_model, batch_run):
    """3 rows on a mesh of 8 batch shards: padded with copies of the last row, which are dropped again; each row equals
    its single-device decode, the streamed blocks and the cache have 3 rows."""
    from dgemma.parallel.mesh import make_mesh

    prompts, valid, _, cfg, res = batch_run
    mesh = make_mesh({"data": 2, "fsdp": 4})
    streamed = []
    part = sample(conv_model, prompts[:3], valid[:3], cfg, jax.random.key(7), mesh=mesh, rules="fsdp",
                  on_block=lambda b, t: streamed.append(t))
    assert part.tokens.shape[0] == 3 and part.cache.batch_size == 3 and len(part.mode) == 3
    np.testing.assert_array_equal(part.tokens, res.tokens[:3])
    np.testing.assert_array_equal(part.steps_per_block, res.steps_per_block[:3])
    np.testing.assert_allclose(part.entropy_trace, res.entropy_trace[:3], rtol=1e-4)  # batch-size rounding
    np.testing.assert_array_equal(np.concatenate(streamed, axis=1), part.tokens)
    with pytest.raises(ValueError, match="do not split over the mesh's 8 batch shards"):
        sample(conv_model, prompts[:3], valid[:3], cfg.replace(record_states=True), jax.random.key(7), mesh=mesh)


def test_mixed_modes_keep_the_cache_consistent(conv_model):
    """Row 1 decodes AR (one token at a time into the cache) while row 0 diffuses: row 0 is unaffected and row 1
    equals plain AR greedy; an unconverged auto block equals AR greedy on the same prefix."""
    prompts, valid, _ = _batch_prompts(B=2, P=6, seed=9)
    cfg = PAIR_CFG.replace(confidence_threshold=0.1)
    diff = sample(conv_model, prompts, valid, cfg, jax.random.key(3))
    mixed = sample(conv_model, prompts, valid, cfg, jax.random.key(3), mode=("diffusion", "ar"))
    ar = np.asarray(ar_generate(conv_model, prompts, valid, max_new_tokens=16, eos_ids=(999,), pad_id=0))
    np.testing.assert_array_equal(mixed.tokens[0], diff.tokens[0])
    np.testing.assert_array_equal(mixed.tokens[1], ar[1])
    never = sample(conv_model, prompts, valid, cfg.replace(confidence_threshold=0.0), jax.random.key(3), mode="auto")
    np.testing.assert_array_equal(never.tokens, ar)
    assert (never.stop_reason == AR_FALLBACK).all() and (never.ar_forwards == 16).all()

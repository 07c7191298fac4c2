"""Logits parity with the transformers reference (fp32, eager attention, eager experts, DynamicCache).

P1: Gemma4ForCausalLM on three tiny random configs (every weight, norm, scale and layer_scalar randomized; sequences
longer than the sliding window; batch with left padding).
P2: DiffusionGemmaForBlockDiffusion decoder logits: prompt + canvas, without and with self-conditioning, context
longer than the window, a committed canvas then a second block, per-row self-conditioning mask.
P3: negative control: a decoder that shows W (instead of W - 1) cached tokens on sliding layers must fail P2.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from support import jitted as J  # noqa: E402
from support import hf_reference as R  # noqa: E402
from dgemma.convert.hf_import import load_hf_checkpoint  # noqa: E402
from dgemma.model import masks as mask_lib  # noqa: E402
from dgemma.model.cache import KVCache  # noqa: E402
from dgemma.model.config import FULL, SLIDING  # noqa: E402

TOL = 1e-4


def _max_err(a, b):
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())


def _load(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    model, _ = load_hf_checkpoint(tmp_path)
    return model


@pytest.mark.parity
@pytest.mark.parametrize("name", ["a", "b", "c"])
def test_gemma4_causal_logits(name, tmp_path):
    hf = R.gemma4_causal(name, seed=11)
    model = _load(hf, tmp_path)
    V, W = hf.config.vocab_size, hf.config.sliding_window
    T = 3 * W + 2  # longer than the sliding window
    tokens = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits.numpy()
    out = J.forward(model, jnp.asarray(tokens.numpy()))
    assert _max_err(out, ref) <= TOL
    assert np.abs(ref).max() > 1.0  # non-degenerate logits


@pytest.mark.parity
def test_gemma4_causal_left_padding(tmp_path):
    """Batch with left padding: valid positions match HF run with the same 2-D attention mask and positions."""
    hf = R.gemma4_causal("a", seed=12)
    model = _load(hf, tmp_path)
    pad = 3
    tokens, valid, ref = R.left_padded_reference(hf, T=12, pad=pad)
    out = np.asarray(J.forward(model, jnp.asarray(tokens), valid=jnp.asarray(valid)))
    assert _max_err(out[0], ref[0]) <= TOL
    assert _max_err(out[1, pad:], ref[1, pad:]) <= TOL


@pytest.fixture(scope="module", params=["a", "c"])
def diffusion_pair(request, tmp_path_factory):
    hf = R.diffusion_gemma(request.param, seed=21)
    d = tmp_path_factory.mktemp(f"dg_{request.param}")
    hf.save_pretrained(d)
    model, _ = load_hf_checkpoint(d)
    return hf, model


def _dg_inputs(hf, seed=0, B=2, P=13):
    V = hf.config.text_config.vocab_size - 3  # keep clear of the image/boi/eoi ids
    L = hf.config.canvas_length
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(3, V, (B, P), generator=g), torch.randint(0, V, (B, L), generator=g),
            torch.randint(0, V, (B, L), generator=g))


@pytest.mark.parity
def test_diffusion_decoder_logits(diffusion_pair):
    hf, model = diffusion_pair
    assert not model.cfg.tie_layer_scalar  # the fixture randomizes the two scalar copies independently
    prompt, canvas, canvas2 = _dg_inputs(hf)
    assert prompt.shape[1] > hf.config.text_config.sliding_window
    sc_mask = torch.tensor([True, False])
    with torch.no_grad():
        o1 = hf(input_ids=prompt, decoder_input_ids=canvas)  # step 1: no self-conditioning
        sc = o1.logits / 0.7  # tempered logits, as the sampler feeds them
        o2 = hf(cache=o1.cache, decoder_input_ids=canvas2, self_conditioning_logits=sc)
        o2m = hf(cache=o1.cache, decoder_input_ids=canvas2, self_conditioning_logits=sc,
                 self_conditioning_mask=sc_mask)
        o3 = hf(input_ids=canvas2, cache=o1.cache, decoder_input_ids=canvas)  # commit, then the next block
    cache = KVCache.init(model.cfg, 2, 48)
    enc_hidden, cache = J.encode(model, jnp.asarray(prompt.numpy()), cache)
    assert _max_err(enc_hidden, o1.encoder_last_hidden_state.numpy()) <= TOL
    l1 = J.logits(model, J.decode(model, jnp.asarray(canvas.numpy()), cache))
    l2 = J.logits(model, J.decode(model, jnp.asarray(canvas2.numpy()), cache, sc_logits=jnp.asarray(sc.numpy())))
    l2m = J.logits(model, J.decode(model, jnp.asarray(canvas2.numpy()), cache, sc_logits=jnp.asarray(sc.numpy()),
                                   sc_mask=jnp.asarray(sc_mask.numpy())))
    _, cache2 = J.encode(model, jnp.asarray(canvas2.numpy()), cache)
    l3 = J.logits(model, J.decode(model, jnp.asarray(canvas.numpy()), cache2))
    for ours, ref in [(l1, o1), (l2, o2), (l2m, o2m), (l3, o3)]:
        assert _max_err(ours, ref.logits.numpy()) <= TOL
    assert _max_err(o1.logits, o2.logits) > 1e-3  # self-conditioning really changes the output


@pytest.mark.parity
def test_decoder_window_w_instead_of_w_minus_1_fails(diffusion_pair):
    """P3: showing W cached tokens on sliding layers (an off-by-one) must be detected by the parity check."""
    hf, model = diffusion_pair
    prompt, canvas, _ = _dg_inputs(hf, seed=3)
    with torch.no_grad():
        ref = hf(input_ids=prompt, decoder_input_ids=canvas).logits.numpy()
    cache = KVCache.init(model.cfg, 2, 32)
    _, cache = J.encode(model, jnp.asarray(prompt.numpy()), cache)
    B, L = canvas.shape
    positions = jnp.broadcast_to(cache.length + jnp.arange(L)[None], (B, L))
    good = mask_lib.decoder_masks(model.cfg, cache, positions, jnp.ones((B, L), bool))
    wrong_cfg = model.cfg.replace(sliding_window=model.cfg.sliding_window + 1)  # keeps W cached tokens
    bad = mask_lib.decoder_masks(wrong_cfg, cache, positions, jnp.ones((B, L), bool))
    assert bool(jnp.any(good[SLIDING] != bad[SLIDING])) and bool(jnp.all(good[FULL] == bad[FULL]))
    x = model.decoder_input(jnp.asarray(canvas.numpy()))
    outs = {}
    for name, masks in (("good", good), ("bad", bad)):
        hidden, _ = J.stack(model, None, positions, masks, embeds=x, cache=cache, decoder_tokens=True)
        outs[name] = J.logits(model, hidden)
    assert _max_err(outs["good"], ref) <= TOL
    assert _max_err(outs["bad"], ref) > 1e-2

"""Scanned layers (`model.execution.scan_layers`) and remat policies: same function as the per-layer stack, same HF
weights.

A scanned model built with the same seed holds the per-layer model's weights (stacked), so logits and gradients must
agree to fp32 rounding; the remainder (num_hidden_layers % scan_period tail layers) is covered by every case here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from support import jitted as J
from dgemma.convert import keymap
from dgemma.diffusion.stage1 import Stage1Config, stage1_loss
from dgemma.model.cache import KVCache
from dgemma.model.config import FULL, SLIDING, tiny
from dgemma.model.scan import unstack_state
from dgemma.model.transformer import Transformer

# 5 layers, period 2 ([sliding, full]) -> 2 scanned periods + 1 tail layer
LAYERS = (SLIDING, FULL, SLIDING, FULL, FULL)


def _model(**execution):
    m = Transformer(tiny(num_hidden_layers=5, layer_types=LAYERS, tie_layer_scalar=False).with_execution(
        scan_period=2, **execution), rngs=nnx.Rngs(0))
    # randomise norms / scalars too (init 1 would hide a misplaced layer)
    state = nnx.state(m, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(9), len(jax.tree.leaves(state))))
    nnx.update(m, jax.tree.map(lambda x: x + 0.1 * jax.random.normal(next(keys), x.shape, x.dtype), state))
    return m


def _pair(**execution):
    """(per-layer model, scanned model with the same weights)."""
    ref = _model(**execution)
    scanned = Transformer(ref.cfg.with_execution(scan_layers=True), rngs=nnx.Rngs(0))
    flat = {tuple(p): v[...] for p, v in nnx.to_flat_state(nnx.state(ref))}
    stacked = keymap.scanned_params(scanned.cfg, flat)
    nnx.update(scanned, nnx.from_flat_state([(p, v.replace(stacked[tuple(p)]))
                                             for p, v in nnx.to_flat_state(nnx.state(scanned))]))
    return ref, scanned


def _flat_grads(model, grads):
    flat = {tuple(p): np.asarray(v[...]) for p, v in nnx.to_flat_state(grads)}
    return unstack_state(model.cfg, flat) if model.cfg.execution.scan_layers else flat


def _stage1_batch(P=6, L=8, N=3):
    """Rows of different lengths: left-padded prompts, partly used blocks; context P + 2L > window."""
    from dgemma.data.layout import to_layout
    from dgemma.data.config import LayoutConfig

    cc = LayoutConfig(prompt_len=P, canvas_length=L, n_blocks=N)
    rng = np.random.default_rng(0)
    rows = [to_layout(list(rng.integers(3, 100, size=p)), list(rng.integers(3, 100, size=n)), cc)
            for p, n in ((4, 3), (6, 17))]
    return {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}


def test_same_seed_gives_the_same_weights_stacked():
    ref = Transformer(tiny(num_hidden_layers=5, layer_types=LAYERS).with_execution(scan_period=2), rngs=nnx.Rngs(3))
    scanned = Transformer(ref.cfg.with_execution(scan_layers=True), rngs=nnx.Rngs(3))
    a = {tuple(p): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(ref))}
    b = unstack_state(scanned.cfg, {tuple(p): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(scanned))})
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))
    gate = nnx.state(scanned)["scan_blocks"][0]["moe"]["experts"]["gate"]
    assert gate.shape[0] == 2 and gate.get_metadata()["axes"][0] == "layers"


# remat="full" (scan + rematerialised backward) runs by default; the plain-scan case is slow (the same check)
@pytest.mark.parametrize("remat", [pytest.param("none", marks=pytest.mark.slow), "full"])
def test_stage1_loss_and_gradients_equal_per_layer(remat):
    """The one-pass stage-1 layout (sliding + full layers, context > window, left padding, per-token decoder
    scalars): scanned == per-layer in loss and every gradient (fp32)."""
    batch = _stage1_batch()
    out = {}
    for model in _pair(remat=remat):
        graphdef, state = nnx.split(model)

        def f(state):
            return stage1_loss(nnx.merge(graphdef, state), batch, jax.random.key(0), Stage1Config(p_self_cond=0.5))[0]

        loss, grads = jax.jit(jax.value_and_grad(f))(state)
        out[model.cfg.execution.scan_layers] = (float(loss), _flat_grads(model, grads))
    np.testing.assert_allclose(out[True][0], out[False][0], rtol=1e-6)
    assert set(out[True][1]) == set(out[False][1])
    # XLA compiles the scan body on its own (other fusions, other fp32 rounding): measured ||diff|| / ||g|| ~ 3e-5
    # per tensor, max |diff| 2.5e-4 (on |g| up to 6.6); a misplaced layer or a dropped gradient gives O(|g|)
    every = np.concatenate([g.ravel() for g in out[False][1].values()])
    diff = np.concatenate([(out[True][1][k] - g).ravel() for k, g in out[False][1].items()])
    assert np.linalg.norm(diff) <= 1e-4 * np.linalg.norm(every)
    for k, g in out[False][1].items():
        err = float(np.abs(out[True][1][k] - g).max())
        assert err <= 1e-4 * float(np.abs(g).max()) + 5e-5, (k, err, float(np.abs(g).max()))


def test_encode_and_decode_with_cache_equal_per_layer():
    ref, scanned = _pair()
    tokens = jax.random.randint(jax.random.key(2), (2, 9), 3, 120)
    canvas = jax.random.randint(jax.random.key(3), (2, 8), 3, 120)
    outs = []
    for model in (ref, scanned):
        cache = KVCache.init(model.cfg, 2, 32)
        hidden, cache = J.encode(model, tokens, cache)
        dec = J.decode(model, canvas, cache)
        outs.append((np.asarray(J.logits(model, hidden)), np.asarray(cache.keys[3]), np.asarray(J.logits(model, dec))))
    for a, b in zip(*outs):
        np.testing.assert_allclose(b, a, atol=2e-5, rtol=1e-5)


def test_export_reads_a_scanned_model_per_layer():
    from dgemma.convert.hf_export import text_groups

    ref, scanned = _pair()
    want = {k: v for g in text_groups(ref, "diffusion_gemma", np.dtype("float32")) for k, v in g.produce().items()}
    got = {k: v for g in text_groups(scanned, "diffusion_gemma", np.dtype("float32")) for k, v in g.produce().items()}
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_bad_scan_settings_are_named():
    with pytest.raises(ValueError, match="scan_period: layer_types do not repeat with period 1"):
        tiny().with_execution(scan_layers=True, scan_period=1)  # [sliding, sliding, full]
    with pytest.raises(ValueError, match="scan_period: 7 must be in"):
        tiny().with_execution(scan_layers=True, scan_period=7)
    with pytest.raises(ValueError, match="remat: 'some'"):
        tiny().with_execution(remat="some")


@pytest.mark.parity
def test_hf_import_into_a_scanned_model_matches_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    from support import hf_reference as R
    from dgemma.convert.hf_import import load_hf_checkpoint

    hf = R.gemma4_causal("a", seed=5)  # [sliding, sliding, full]: period 2 -> 1 scanned period + 1 tail layer
    hf.save_pretrained(tmp_path)
    model, _ = load_hf_checkpoint(tmp_path, self_conditioning=False, scan_layers=True, scan_period=2)
    assert model.cfg.execution.scan_layers and "scan_blocks" in nnx.state(model)
    tokens = torch.randint(3, hf.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(input_ids=tokens).logits.numpy()
    assert float(np.abs(np.asarray(J.forward(model, jnp.asarray(tokens.numpy()))) - ref).max()) <= 1e-4


@pytest.mark.slow  # 19 s: convert + export through a scanned config; the scan's parity tests stay default
def test_convert_and_export_with_a_scanned_run_config(tmp_path):
    """`dgemma convert` writes the run's layout (stacked when model.execution.scan_layers), so init_from / export
    restore it; the export reads the stacked params back to the same HF tensors."""
    from pathlib import Path

    from dgemma.cli.main import main
    from dgemma.config import load_config
    from dgemma.convert.hf_export import export_hf
    from dgemma.convert.hf_import import load_hf_checkpoint

    tiny_cfg = str(Path(__file__).resolve().parents[2] / "configs/stage1/tiny.yaml")
    scan = ["model.execution.scan_layers=true"]
    cfg = load_config(tiny_cfg, [])
    source = Transformer(cfg.model_config, rngs=nnx.Rngs(5))
    hf_dir = export_hf(source, tmp_path / "hf", layout="gemma4", dtype="float32")
    assert main(["convert", "-c", tiny_cfg, *scan, "--hf", str(hf_dir), "--out", str(tmp_path / "params")]) == 0
    assert main(["export", "-c", tiny_cfg, *scan, "--checkpoint", str(tmp_path / "params"), "--out",
                 str(tmp_path / "back"), "--dtype", "float32", "--layout", "gemma4"]) == 0
    back, _ = load_hf_checkpoint(tmp_path / "back", self_conditioning=False)
    tokens = jax.random.randint(jax.random.key(1), (1, 7), 0, cfg.model_config.vocab_size)
    np.testing.assert_array_equal(np.asarray(back(tokens)), np.asarray(source(tokens)))

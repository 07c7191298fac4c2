"""HF checkpoint import: layouts, sharded round trip, AR -> DiffusionGemma conversion, and every bad input."""

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from support import jitted as J  # noqa: E402
from support import hf_reference as R  # noqa: E402
from dgemma.convert.hf_config import CheckpointError  # noqa: E402
from dgemma.convert.hf_import import load_hf_checkpoint  # noqa: E402
from dgemma.convert.safetensors_io import SafetensorsFile  # noqa: E402
from dgemma.model.cache import KVCache  # noqa: E402
from support.block_layout import assert_rel_close  # noqa: E402


@pytest.fixture(scope="module")
def causal_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("causal")
    hf = R.gemma4_causal("a", seed=5)
    hf.save_pretrained(d)
    return d, hf


def _tokens(V, shape=(2, 11), seed=0):
    return torch.randint(3, V, shape, generator=torch.Generator().manual_seed(seed))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


# MARK: layouts and round trips ---------------------------------------------------------------------------------


@pytest.mark.parity
def test_sharded_multimodal_layout_round_trip(tmp_path):
    """Released layout (model.language_model.*) written sharded by save_pretrained imports with nothing left over."""
    hf = R.gemma4_conditional("b", seed=6)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    model, report = load_hf_checkpoint(tmp_path, self_conditioning=False)
    assert report.loaded == len(index["weight_map"]) and not report.skipped
    tokens = _tokens(hf.config.text_config.vocab_size)
    with torch.no_grad():
        ref = hf(input_ids=tokens).logits.numpy()
    assert float(np.abs(np.asarray(J.forward(model, jnp.asarray(tokens.numpy()))) - ref).max()) <= 1e-4


@pytest.mark.parity
def test_ar_to_diffusion_conversion_encoder_equals_ar(causal_dir):
    d, hf = causal_dir
    model, report = load_hf_checkpoint(d)  # gemma4_text -> DiffusionGemma model
    assert model.cfg.self_conditioning and model.self_conditioning is not None
    assert any(p.startswith("self_conditioning") for p in report.initialised)
    ar_only, _ = load_hf_checkpoint(d, self_conditioning=False)
    tokens = jnp.asarray(_tokens(hf.config.vocab_size).numpy())
    cache = KVCache.init(model.cfg, 2, 16)
    hidden, _ = J.encode(model, tokens, cache)
    # encoder + tied head + soft-cap of the converted model == the AR model's logits, to fp32 rounding: two programs
    # (encode then head, vs one forward) that XLA may fuse differently (bit-equal with the suite's flags, 4e-6 apart
    # with XLA's defaults)
    assert_rel_close(J.logits(model, hidden), J.forward(ar_only, tokens), tol=1e-6)
    with torch.no_grad():
        ref = hf(torch.from_numpy(np.asarray(tokens))).logits.numpy()
    assert float(np.abs(np.asarray(J.logits(model, hidden)) - ref).max()) <= 1e-4
    # the self-conditioning init rule is documented and deterministic in the seed
    again, _ = load_hf_checkpoint(d, seed=0)
    np.testing.assert_array_equal(np.asarray(again.self_conditioning.mlp.gate[...]),
                                  np.asarray(model.self_conditioning.mlp.gate[...]))


@pytest.mark.parity
def test_diffusion_gemma_layout_and_tied_scalars(tmp_path):
    hf = R.diffusion_gemma("a", seed=7, untie_scalars=False)
    hf.save_pretrained(tmp_path)
    model, report = load_hf_checkpoint(tmp_path)
    assert model.cfg.tie_layer_scalar  # equal copies -> one shared scalar
    assert report.skipped and all("vision" in k for k in report.skipped)
    untied, _ = load_hf_checkpoint(tmp_path, tie_layer_scalar=False)
    np.testing.assert_array_equal(np.asarray(untied.layers[0].decoder_layer_scalar[...]),
                                  np.asarray(untied.layers[0].layer_scalar[...]))


def test_own_reader_matches_safetensors_library(causal_dir):
    d, _ = causal_dir
    ref = load_file(d / "model.safetensors")
    f = SafetensorsFile(d / "model.safetensors")
    assert sorted(f.keys()) == sorted(ref)
    for k in ref:
        np.testing.assert_array_equal(f.read(k), ref[k].numpy())


# MARK: bad input: one test each ---------------------------------------------------------------------------------


def _edit_weights(d, fn):
    path = d / "model.safetensors"
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path)


def test_missing_key_is_named(causal_dir, tmp_path):
    d = _copy(causal_dir[0], tmp_path / "m")
    _edit_weights(d, lambda t: t.pop("model.layers.1.router.scale"))
    with pytest.raises(CheckpointError, match=r"missing tensors .*layers\.1\.moe\.router\.scale"):
        load_hf_checkpoint(d)


def test_unexpected_key_is_named(causal_dir, tmp_path):
    d = _copy(causal_dir[0], tmp_path / "m")
    _edit_weights(d, lambda t: t.update({"model.layers.0.mystery.weight": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.0\.mystery"):
        load_hf_checkpoint(d)


def test_shape_mismatch_names_file_key_and_both_shapes(causal_dir, tmp_path):
    d = _copy(causal_dir[0], tmp_path / "m")
    _edit_weights(d, lambda t: t.update({"model.norm.weight": torch.ones(63)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.norm\.weight' .*\[63\].*\[64\]"):
        load_hf_checkpoint(d)


def test_dtype_mismatch(causal_dir, tmp_path):
    d = _copy(causal_dir[0], tmp_path / "m")
    _edit_weights(d, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)}))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has dtype int32, expected a floating"):
        load_hf_checkpoint(d)


def test_unknown_model_type(causal_dir, tmp_path):
    d = _copy(causal_dir[0], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: unknown model_type 'llama'"):
        load_hf_checkpoint(d)


def test_truncated_file(causal_dir, tmp_path):
    d = _copy(causal_dir[0], tmp_path / "m")
    path = d / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated file"):
        load_hf_checkpoint(d)


def test_corrupt_header(causal_dir, tmp_path):
    d = _copy(causal_dir[0], tmp_path / "m")
    path = d / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[10:20] = b"\x00garbage!!"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt"):
        load_hf_checkpoint(d)


def test_config_weights_disagreement(causal_dir, tmp_path):
    d = _copy(causal_dir[0], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_intermediate_size"] = 16  # weights were written with 32
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"experts\.(gate_up|down)_proj' .*shape \[4, (64, 32|32, 64)\] in the checkpoint "
                       r"but \[4, (64, 16|16, 64)\] expected from config\.json"):
        load_hf_checkpoint(d)


def test_pickle_checkpoint_refused(tmp_path, causal_dir):
    shutil.copy(causal_dir[0] / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match=r"never unpickles"):
        load_hf_checkpoint(tmp_path)


def test_index_naming_missing_shard(tmp_path):
    hf = R.gemma4_causal("a", seed=1)
    hf.save_pretrained(tmp_path, max_shard_size="30KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=rf"shard file\(s\) \['{shards[1].name}'\] listed in the index"):
        load_hf_checkpoint(tmp_path)


def test_unsupported_feature_refused(causal_dir, tmp_path):
    d = _copy(causal_dir[0], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["hidden_activation"] = "gelu"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"hidden_activation='gelu' is not supported"):
        load_hf_checkpoint(d)


def test_stored_lm_head_must_be_tied(causal_dir, tmp_path):
    d = _copy(causal_dir[0], tmp_path / "m")
    _edit_weights(d, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    load_hf_checkpoint(d)  # an explicitly stored, equal head is accepted
    _edit_weights(d, lambda t: t.update({"lm_head.weight": t["lm_head.weight"] + 1.0}))
    with pytest.raises(CheckpointError, match=r"'lm_head\.weight' differs from the embedding"):
        load_hf_checkpoint(d)


@pytest.mark.parity
def test_streaming_import_onto_a_mesh(causal_dir):
    """Each tensor lands directly on its target sharding; the sharded model computes the same logits."""
    from jax.sharding import PartitionSpec as P

    from dgemma.parallel.mesh import make_mesh

    d, hf = causal_dir
    mesh = make_mesh({"data": 2, "fsdp": 4})
    model, _ = load_hf_checkpoint(d, mesh=mesh, rules="experts_on_fsdp", self_conditioning=False)
    experts = model.layers[0].moe.experts.gate[...]
    assert experts.sharding.spec == P("fsdp", None, None)
    assert len({str(s.index) for s in experts.addressable_shards}) == 4
    emb = model.embedder.embedding[...]
    assert emb.sharding.spec == P(None, "fsdp")
    tokens = _tokens(hf.config.vocab_size, shape=(2, 9))
    with torch.no_grad():
        ref = hf(tokens).logits.numpy()
    import jax

    with jax.set_mesh(mesh):
        out = np.asarray(J.forward(model, jnp.asarray(tokens.numpy())))
    assert float(np.abs(out - ref).max()) <= 1e-4

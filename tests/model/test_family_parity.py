"""The Gemma 4 family beyond 26B-A4B (E2B-, E4B- and 31B-like tiny twins) against transformers' Gemma4ForCausalLM:
per-layer embeddings, KV sharing, double-wide and dense-only MLPs, full layers with or without their own V.

Every weight of the reference is randomized (norms, layer scalars and the PLE norms too, `hf_reference.randomize_`);
checkpoints go through `save_pretrained` (sharded) and dgemma's streaming import."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from support import jitted as J  # noqa: E402
from support import hf_reference as R  # noqa: E402
from support.block_layout import assert_rel_close  # noqa: E402
from dgemma.convert.hf_import import load_hf_checkpoint  # noqa: E402
from dgemma.inference.ar import generate  # noqa: E402
from dgemma.model.cache import KVCache  # noqa: E402
from dgemma.model.config import FULL, SLIDING, preset  # noqa: E402

S, F = SLIDING, FULL
COMMON = dict(vocab_size=128, sliding_window=4, num_attention_heads=4, head_dim=16, global_head_dim=32,
              final_logit_softcapping=30.0, tie_word_embeddings=True, max_position_embeddings=2048, pad_token_id=0,
              eos_token_id=1, bos_token_id=2)
# transformers' own fields, written out independently of dgemma's presets (test_twins_are_these_architectures ties
# the two together)
HF_TWINS = {
    "tiny_e2b": dict(hidden_size=64, intermediate_size=48, num_hidden_layers=5, layer_types=[S, S, F, S, F],
                     num_key_value_heads=1, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
                     num_kv_shared_layers=2, use_double_wide_mlp=True, enable_moe_block=False,
                     attention_k_eq_v=False),
    "tiny_e4b": dict(hidden_size=48, intermediate_size=64, num_hidden_layers=6, layer_types=[S, F, S, S, S, F],
                     num_key_value_heads=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
                     num_kv_shared_layers=3, enable_moe_block=False, attention_k_eq_v=False),
    "tiny_31b": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, layer_types=[S, S, S, F],
                     num_key_value_heads=2, num_global_key_value_heads=1, hidden_size_per_layer_input=0,
                     enable_moe_block=False, attention_k_eq_v=True),
}
TWINS = sorted(HF_TWINS)
# the cache, generate and mesh checks compile several programs per twin: the E2B-like twin (PLE, KV sharing of both
# layer types, double-wide MLP: every new path) runs in the default suite, the other two under -m slow
COSTLY = [pytest.param(n, marks=() if n == "tiny_e2b" else pytest.mark.slow) for n in TWINS]
ARCHITECTURE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "global_head_dim", "layer_types", "sliding_window",
                "hidden_size_per_layer_input", "vocab_size_per_layer_input", "num_kv_shared_layers",
                "use_double_wide_mlp", "enable_moe_block", "attention_k_eq_v")


def hf_twin(name, seed=0, std=0.2):
    cfg = tf.Gemma4TextConfig(**COMMON, **HF_TWINS[name], attn_implementation="eager")
    return R.randomize_(tf.Gemma4ForCausalLM(cfg).eval(), seed, std)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (name, HF model, its sharded save_pretrained directory), built once per twin."""
    cache = {}

    def get(name):
        if name not in cache:
            d = tmp_path_factory.mktemp(name)
            hf = hf_twin(name, seed=TWINS.index(name) + 3)
            hf.save_pretrained(d, max_shard_size="20KB")
            cache[name] = (name, hf, d)
        return cache[name]
    return get


@pytest.fixture(params=TWINS)
def twin(request, saved):
    return saved(request.param)


@pytest.fixture(params=COSTLY)
def costly_twin(request, saved):
    return saved(request.param)


def _tokens(shape=(2, 11), seed=0):
    return torch.randint(3, 128, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parity
def test_sharded_import_has_every_key_and_equal_logits(twin):
    name, hf, d = twin
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    model, report = load_hf_checkpoint(d, self_conditioning=False)
    assert report.loaded == len(index["weight_map"]) and not report.skipped and not report.initialised
    tokens, valid, ref = R.left_padded_reference(hf, T=11, pad=3)
    out = np.asarray(J.forward(model, jnp.asarray(tokens), None, jnp.asarray(valid)))
    assert float(np.abs(out[valid] - ref[valid]).max()) <= 1e-4
    if model.cfg.num_kv_shared_layers:  # the shared layers hold no K/V parameters and no cache slots
        shared = [i for i in range(model.cfg.num_hidden_layers) if model.cfg.kv_producer(i) is not None]
        assert all(model.layers[i].attn.k_proj is None for i in shared)
        assert all(KVCache.init(model.cfg, 1, 8).keys[i].shape[1] == 0 for i in shared)


@pytest.mark.parity
def test_twins_are_these_architectures(twin):
    """The dgemma presets `tiny_e2b`, `tiny_e4b`, `tiny_31b` are exactly the imported transformers configs, with the
    same parameter count."""
    from dgemma.model.transformer import count_params

    name, hf, d = twin
    model, _ = load_hf_checkpoint(d, self_conditioning=False)
    ours = preset(name)
    assert {f: getattr(model.cfg, f) for f in ARCHITECTURE} == {f: getattr(ours, f) for f in ARCHITECTURE}
    assert [model.cfg.layer_kv_heads(i) for i in range(ours.num_hidden_layers)] == \
        [ours.layer_kv_heads(i) for i in range(ours.num_hidden_layers)]
    scalars = sum(b.numel() for n, b in hf.named_buffers() if n.endswith("layer_scalar"))  # a buffer in HF
    assert count_params(ours) == sum(p.numel() for p in hf.parameters()) + scalars


@pytest.mark.parity
def test_incremental_encode_equals_full_forward(costly_twin):
    """Cache path with KV sharing: prefill, a single step and a multi-token commit (the sliding ring wraps)."""
    _, _, d = costly_twin
    model, _ = load_hf_checkpoint(d, self_conditioning=False)
    tokens = jnp.asarray(_tokens((2, 13), seed=1).numpy())
    full = J.forward(model, tokens)
    cache = KVCache.init(model.cfg, 2, 16)
    outs = []
    for a, b in [(0, 5), (5, 6), (6, 13)]:
        hidden, cache = J.encode(model, tokens[:, a:b], cache)
        outs.append(J.logits(model, hidden))
    assert_rel_close(np.concatenate(outs, axis=1), full)


@pytest.mark.parity
def test_greedy_equals_transformers_generate(costly_twin, tmp_path):
    name = costly_twin[0]
    hf = hf_twin(name, seed=1, std=0.05)
    hf.save_pretrained(tmp_path)
    model, _ = load_hf_checkpoint(tmp_path, self_conditioning=False)
    prompt = _tokens((2, 7), seed=0)
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=1, pad_token_id=0)
    ref = ref[:, prompt.shape[1]:].numpy()
    ours = np.asarray(generate(model, prompt.numpy(), max_new_tokens=10, eos_ids=(1,), pad_id=0))
    np.testing.assert_array_equal(ours[:, : ref.shape[1]], ref)


@pytest.mark.parity
def test_streaming_import_onto_a_mesh(costly_twin):
    """Each tensor lands on its sharding (the PLE table's columns on fsdp); the sharded model gives equal logits."""
    from jax.sharding import PartitionSpec as P

    from dgemma.parallel.mesh import make_mesh

    _, hf, d = costly_twin
    mesh = make_mesh({"data": 2, "fsdp": 4})
    model, _ = load_hf_checkpoint(d, mesh=mesh, rules="fsdp", self_conditioning=False)
    if model.per_layer_embedder is not None:
        table = model.per_layer_embedder.table[...]
        assert table.sharding.spec == P(None, "fsdp") and len({str(s.index) for s in table.addressable_shards}) == 4
    tokens = _tokens((2, 9), seed=2)
    with torch.no_grad():
        ref = hf(tokens).logits.numpy()
    with jax.set_mesh(mesh):
        out = np.asarray(J.forward(model, jnp.asarray(tokens.numpy())))
    assert float(np.abs(out - ref).max()) <= 1e-4


@pytest.mark.parity
def test_gemma4_text_export_reloads_with_equal_logits(twin, tmp_path):
    """Export in the gemma4_text layout: transformers reloads it with no missing, unexpected or mismatched keys and
    computes the imported model's logits."""
    from dgemma.convert.hf_export import export_hf

    _, hf, d = twin
    model, _ = load_hf_checkpoint(d, self_conditioning=False)
    out = export_hf(model, tmp_path / "out", layout="gemma4_text", dtype="float32")
    reloaded, info = tf.Gemma4ForCausalLM.from_pretrained(out, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tokens = _tokens((2, 9), seed=3)
    with torch.no_grad():
        ref, again = hf(tokens).logits.numpy(), reloaded.eval()(tokens).logits.numpy()
    np.testing.assert_array_equal(again, ref)  # the same weights, bit for bit, in the same program


def test_diffusion_gemma_layout_refused_with_the_feature_named(twin, tmp_path):
    """transformers' DiffusionGemma has no PLE, KV sharing or dense-only MLP: a one-line refusal naming the feature
    and the gemma4 route, and nothing written."""
    from dgemma.convert.hf_export import export_hf

    name, _, d = twin
    model, _ = load_hf_checkpoint(d)
    feature = {"tiny_e2b": "per-layer embeddings", "tiny_e4b": "KV sharing", "tiny_31b": "dense-only MLP"}[name]
    with pytest.raises(ValueError, match=f"cannot represent .*{feature}.*layout 'gemma4'") as info:
        export_hf(model, tmp_path / "dg", layout="diffusion_gemma", dtype="float32")
    assert "\n" not in str(info.value) and not (tmp_path / "dg").exists()

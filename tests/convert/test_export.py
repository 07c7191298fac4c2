"""HF export: diffusion_gemma loads into transformers with equal logits and `generate`, byte-identical round trips,
config.json / generation_config.json equal transformers' own serialisation (P7), AR layouts, params-only export."""

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (  # noqa: E402
    DiffusionGemmaGenerationConfig, EntropyBoundSamplerConfig)

from support import chat_tokenizer  # noqa: E402
from support import jitted as J  # noqa: E402
from support import hf_reference as R  # noqa: E402
from dgemma.config.sections import SamplerSection  # noqa: E402
from dgemma.convert.hf_config import model_config_from_hf  # noqa: E402
from dgemma.convert.hf_config import hf_config, hf_generation_config  # noqa: E402
from dgemma.convert.hf_export import MANIFEST, export_from_params, export_hf, text_groups, verify  # noqa: E402
from dgemma.convert.hf_import import load_hf_checkpoint  # noqa: E402
from dgemma.convert.safetensors_io import SafetensorsFile  # noqa: E402
from dgemma.model.cache import KVCache  # noqa: E402
from dgemma.model.config import gemma4_26b_a4b  # noqa: E402
from dgemma.model.transformer import abstract_model, count_params  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny HF DiffusionGemma (vision tower, untied layer_scalar copies) saved with tokenizer files, and its
    dgemma import."""
    d = tmp_path_factory.mktemp("hf_src")
    hf = R.diffusion_gemma("a", seed=3)
    hf.save_pretrained(d)
    chat_tokenizer.build(d, hf.config.text_config.vocab_size)
    model, _ = load_hf_checkpoint(d)
    return d, hf, model


@pytest.fixture(scope="module")
def exported(source, tmp_path_factory):
    d, _, model = source
    return export_hf(model, tmp_path_factory.mktemp("exp") / "dg", dtype="float32", vision_source=d,
                     tokenizer_dir=d)


def _load(path, cls=None):
    cls = cls or tf.DiffusionGemmaForBlockDiffusion
    m, info = cls.from_pretrained(path, attn_implementation="eager", output_loading_info=True)
    m.set_experts_implementation("eager")
    return m.eval(), info


def _inputs(V, B=2, P=11, L=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, V - 3, (B, P), generator=g), torch.randint(0, V - 3, (B, L), generator=g)


@pytest.mark.parity
def test_diffusion_gemma_loads_with_equal_weights_logits_and_generate(source, exported):
    d, hf, model = source
    files = {p.name for p in exported.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", MANIFEST, "tokenizer.json",
            "tokenizer_config.json"} <= files
    assert (exported / "tokenizer.json").read_bytes() == (d / "tokenizer.json").read_bytes()
    keys = SafetensorsFile(exported / "model.safetensors").keys()
    assert len(keys) == 90 and any(k.startswith("model.encoder.vision_tower.") for k in keys)
    reloaded, info = _load(exported)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    src_sd, new_sd = hf.state_dict(), reloaded.state_dict()  # tied weights, both layer_scalar copies, vision
    assert src_sd.keys() == new_sd.keys()
    assert all(torch.equal(src_sd[k], new_sd[k]) for k in src_sd)

    prompt, canvas = _inputs(hf.config.text_config.vocab_size)
    with torch.no_grad():
        ref = reloaded(input_ids=prompt, decoder_input_ids=canvas).logits.numpy()
    cache = KVCache.init(model.cfg, 2, 24)
    _, cache = J.encode(model, jnp.asarray(prompt.numpy()), cache)
    ours = np.asarray(J.logits(model, J.decode(model, jnp.asarray(canvas.numpy()), cache)))
    assert float(np.abs(ours - ref).max()) <= TOL

    kw = dict(max_new_tokens=16, max_denoising_steps=4, eos_token_id=1, pad_token_id=0)
    outs = []
    for m in (hf, reloaded):
        with torch.random.fork_rng(), torch.no_grad():  # the global torch seed is put back for the tests after this
            torch.manual_seed(1234)
            outs.append(m.generate(prompt, **kw))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert torch.equal(outs[0].tokens_per_forward, outs[1].tokens_per_forward)


def test_export_import_export_is_byte_identical(source, tmp_path):
    d, _, model = source
    first = export_hf(model, tmp_path / "one", vision_source=d, tokenizer_dir=d, max_shard_size=200_000)
    assert (first / "model.safetensors.index.json").exists()
    again, _ = load_hf_checkpoint(first)
    second = export_hf(again, tmp_path / "two", vision_source=first, tokenizer_dir=first, max_shard_size=200_000)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir()) and len(names) > 6
    for n in names:
        assert (first / n).read_bytes() == (second / n).read_bytes(), n
    verify(second)


def test_p7_config_json_equals_transformers_serialisation(source, tmp_path):
    d, _, model = source
    out = export_hf(model, tmp_path / "cfg", dtype="float32", vision_source=d)
    ours, theirs = json.loads((out / "config.json").read_text()), json.loads((d / "config.json").read_text())
    assert ours == theirs  # written by save_pretrained of the HF model itself
    # 26B: derived from the preset, nothing hard-coded, and read back to the same ModelConfig
    cfg = gemma4_26b_a4b()
    conf = hf_config(cfg, "diffusion_gemma", R.tiny_vision_config().to_dict())
    conf.save_pretrained(tmp_path / "c26")
    back = model_config_from_hf(json.loads((tmp_path / "c26" / "config.json").read_text()))
    assert back == cfg
    text = json.loads((tmp_path / "c26" / "config.json").read_text())["text_config"]
    assert text["final_logit_softcapping"] == 30.0 and text["eos_token_id"] == [1, 106, 50]


def test_p7_generation_config_equals_transformers_serialisation(tmp_path):
    cfg = gemma4_26b_a4b()
    hf_generation_config(cfg, "diffusion_gemma").save_pretrained(tmp_path / "ours")
    DiffusionGemmaGenerationConfig(
        max_new_tokens=256, max_denoising_steps=48, sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.1),
        t_min=0.4, t_max=0.8, stability_threshold=1, confidence_threshold=0.005, eos_token_id=[1, 106, 50],
        pad_token_id=0, bos_token_id=2).save_pretrained(tmp_path / "theirs")
    ours = (tmp_path / "ours" / "generation_config.json").read_text()
    assert ours == (tmp_path / "theirs" / "generation_config.json").read_text()
    # dgemma's sampler section maps field by field (max_steps -> max_denoising_steps, entropy_bound -> sampler_config)
    s = dataclasses.replace(SamplerSection(), max_steps=12, entropy_bound=0.25, t_min=0.3, stability_threshold=2)
    hf_generation_config(cfg, "diffusion_gemma", s).save_pretrained(tmp_path / "s")
    g = DiffusionGemmaGenerationConfig.from_pretrained(tmp_path / "s")
    assert (g.max_denoising_steps, g.sampler_config.entropy_bound, g.t_min, g.t_max, g.stability_threshold,
            g.confidence_threshold, g.max_new_tokens) == (12, 0.25, 0.3, 0.8, 2, 0.005, 256)
    with pytest.raises(ValueError, match="unknown sampler setting 'temperature'"):
        hf_generation_config(cfg, "diffusion_gemma", {"temperature": 1.0})
    # a decoding rule transformers does not run is refused, not exported as if it were HF's
    for change in (dict(algorithm="ancestral"), dict(accept="confidence"), dict(greedy=True)):
        with pytest.raises(ValueError, match=f"sampler.{next(iter(change))}=.* has no diffusion_gemma equivalent"):
            hf_generation_config(cfg, "diffusion_gemma", dataclasses.replace(s, **change))


def test_26b_plan_without_allocation():
    """The export plan of the 26B model comes from shapes alone (abstract model, nothing fetched)."""
    groups = text_groups(abstract_model(gemma4_26b_a4b()), "diffusion_gemma", np.dtype("float32"))
    keys = [e[0] for g in groups for e in g.entries]
    assert len(keys) == len(set(keys))
    scalars = 30  # the encoder layer_scalar copies are stored in addition to the decoder's
    assert sum(g.nbytes for g in groups) == 4 * (count_params(gemma4_26b_a4b(), include_self_conditioning=True)
                                                 + scalars)


@pytest.mark.parity
@pytest.mark.parametrize("layout", ["gemma4_text", "gemma4"])
def test_ar_export_loads_with_equal_logits(source, layout, tmp_path):
    d, _, model = source
    cls = tf.Gemma4ForCausalLM if layout == "gemma4_text" else tf.Gemma4ForConditionalGeneration
    out = export_hf(model, tmp_path / layout, layout=layout, dtype="float32",
                    vision_source=d if layout == "gemma4" else None)
    reloaded, info = _load(out, cls)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    if layout == "gemma4":  # vision tower renamed model.encoder.* -> model.*, bytes unchanged
        src = SafetensorsFile(d / "model.safetensors")
        dst = SafetensorsFile(out / "model.safetensors")
        for k in (k for k in src.keys() if "vision" in k):
            np.testing.assert_array_equal(dst.read(k.replace("model.encoder.", "model.")), src.read(k))
    tokens, _ = _inputs(model.cfg.vocab_size, P=13, seed=4)
    with torch.no_grad():
        ref = reloaded(input_ids=tokens).logits.numpy()
    assert float(np.abs(np.asarray(J.forward(model, jnp.asarray(tokens.numpy()))) - ref).max()) <= TOL


def test_export_from_params_state_or_pure_dict(source, tmp_path):
    d, _, model = source
    ref = export_hf(model, tmp_path / "ref")
    state = nnx.state(model, nnx.Param)
    a = export_from_params(state, model.cfg, tmp_path / "a")
    b = export_from_params(state.to_pure_dict(), model.cfg, tmp_path / "b")
    for out in (a, b):
        for p in ref.iterdir():
            assert (out / p.name).read_bytes() == p.read_bytes(), p.name

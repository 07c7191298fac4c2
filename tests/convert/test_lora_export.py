"""`dgemma export --merge-lora` and `--peft-adapters` on the params of an adapted run (adapters on attention, dense
MLPs, self-conditioning, router and experts, all weights random). Merged: transformers reloads them with no missing
or unexpected keys and the logits of the dgemma LoRA model (fp32 to 1e-4; bf16 and FP8 at their usual error).
Unmerged (PEFT's format): peft loads every adapter tensor onto an export of the base and gives the same logits.
Exporting adapters without either flag, or a flag on a checkpoint it does not fit, is a one-line refusal that writes
nothing."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from support import jitted as J  # noqa: E402
from dgemma.cli.main import main  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs/stage1/tiny.yaml")
TWO_LAYERS = ["model.num_hidden_layers=2", "model.layer_types=[sliding_attention,full_attention]"]
LORA = ["lora.rank=2", "lora.alpha=3.0",
        "lora.targets=['attn/[qkvo]_proj$', 'mlp/(gate|up|down)$', 'router/proj$', 'experts/(gate|up|down)$']"]
TOL = 1e-4


def _randomize(model, key, which, scale):
    state = nnx.state(model, which)
    keys = iter(jax.random.split(jax.random.key(key), len(jax.tree.leaves(state))))
    nnx.update(model, jax.tree.map(lambda x: x + scale * jax.random.normal(next(keys), x.shape, x.dtype), state))


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """(params dir of an adapted model as the trainer writes it, the LoRA model, the config)."""
    from dgemma.checkpoint import save_params
    from dgemma.checkpoint.lora_params import lora_metadata
    from dgemma.config import load_config
    from dgemma.model.lora import attach_adapters
    from dgemma.model.transformer import Transformer

    cfg = load_config(TINY, [*TWO_LAYERS, *LORA])
    model = Transformer(cfg.model_config, rngs=nnx.Rngs(4))
    _randomize(model, 1, nnx.Param, 0.05)  # norms and scalars too
    attached = attach_adapters(model, cfg.lora.spec(), nnx.Rngs(2))
    assert any("experts/gate" in p for p in attached) and any("self_conditioning/mlp" in p for p in attached)
    assert any("router/proj" in p for p in attached)
    _randomize(model, 3, nnx.LoRAParam, 0.3)
    d = tmp_path_factory.mktemp("lora")
    save_params(d / "params", 5, nnx.state(model, nnx.Param), metadata=lora_metadata(cfg.lora))
    return d / "params", model, cfg


def _export(params, out, *extra):
    return main(["export", "-c", TINY, *TWO_LAYERS, "--checkpoint", str(params), "--out", str(out), *extra])


def _inputs(V, B=2, P=11, L=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, V - 3, (B, P), generator=g), torch.randint(0, V - 3, (B, L), generator=g)


def _ours(model, prompt, canvas):
    from dgemma.model.cache import KVCache

    _, cache = J.encode(model, jnp.asarray(prompt.numpy()), KVCache.init(model.cfg, prompt.shape[0], 24))
    return np.asarray(J.logits(model, J.decode(model, jnp.asarray(canvas.numpy()), cache)))


def _reload(out, cls=None):
    cls = cls or tf.DiffusionGemmaForBlockDiffusion
    m, info = cls.from_pretrained(out, attn_implementation="eager", output_loading_info=True, dtype=torch.float32)
    m.set_experts_implementation("eager")
    # a text-only export (no --vision-source) carries the null vision tower: nothing is missing, random or left over
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return m.eval()


def test_merged_fp32_export_reloads_with_the_lora_logits(adapted, tmp_path):
    from dgemma.model.lora import adapters_disabled

    params, model, cfg = adapted
    assert _export(params, tmp_path / "dg", "--merge-lora", "--dtype", "float32") == 0
    prompt, canvas = _inputs(cfg.model_config.vocab_size)
    with torch.no_grad():
        theirs = _reload(tmp_path / "dg")(input_ids=prompt, decoder_input_ids=canvas).logits.numpy()
    ours = _ours(model, prompt, canvas)
    with adapters_disabled(model):  # the adapters matter: an export of the base alone would fail the check below
        assert float(np.abs(_ours(model, prompt, canvas) - ours).max()) > 100 * TOL
    assert float(np.abs(ours - theirs).max()) <= TOL
    # the AR layout too: Gemma4ForCausalLM gives the LoRA model's AR logits
    assert _export(params, tmp_path / "ar", "--merge-lora", "--dtype", "float32", "--layout", "gemma4_text") == 0
    tokens, _ = _inputs(cfg.model_config.vocab_size, P=13, seed=4)
    with torch.no_grad():
        ar = _reload(tmp_path / "ar", tf.Gemma4ForCausalLM)(input_ids=tokens).logits.numpy()
    assert float(np.abs(np.asarray(J.forward(model, jnp.asarray(tokens.numpy()))) - ar).max()) <= TOL


def test_merged_bf16_and_fp8_exports(adapted, tmp_path):
    from dgemma.convert import fp8
    from dgemma.convert.safetensors_io import SafetensorsFile

    params, model, cfg = adapted
    assert _export(params, tmp_path / "bf16", "--merge-lora") == 0
    assert _export(params, tmp_path / "fp8", "--merge-lora", "--fp8") == 0
    prompt, canvas = _inputs(cfg.model_config.vocab_size)
    ref = torch.from_numpy(_ours(model, prompt, canvas))
    reloaded = _reload(tmp_path / "bf16")
    with torch.no_grad():
        bf16 = reloaded(input_ids=prompt, decoder_input_ids=canvas).logits
    block = tuple(json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
                  ["weight_block_size"])
    f = SafetensorsFile(tmp_path / "fp8" / "model.safetensors")
    t = {k: f.read(k) for k in f.keys()}
    sd = {k: torch.from_numpy(np.ascontiguousarray(
        fp8.dequantize(v, t[fp8.scale_key(k)], block) if v.dtype == fp8.FP8 else v.astype(np.float32)))
        for k, v in t.items() if not k.endswith("scale_inv")}
    missing, unexpected = reloaded.load_state_dict(sd, strict=False)
    assert not unexpected and all(not k.startswith("model.decoder.") for k in missing)  # (encoder aliases, vision)
    reloaded.tie_weights()
    with torch.no_grad():
        q = reloaded(input_ids=prompt, decoder_input_ids=canvas).logits
    e_bf16, e_fp8 = (bf16 - ref).abs(), (q - bf16).abs()
    print(f"max|logit| {float(ref.abs().max()):.3f}; mean |dlogit| bf16 {float(e_bf16.mean()):.5f} fp8 "
          f"{float(e_fp8.mean()):.5f}")
    # bf16 keeps 8 bits of mantissa; e4m3 3 (16x the weight noise), as in tests/convert/test_export_fp8.py
    assert float(e_bf16.mean()) < 0.02 * float(ref.abs().max())
    assert float(e_fp8.mean()) <= 16 * float(e_bf16.mean()) and float(e_fp8.mean()) < 0.1 * float(ref.abs().max())


def test_lora_export_refusals(adapted, tmp_path, capsys):
    from dgemma.checkpoint import save_params
    from dgemma.model.transformer import Transformer

    params, _, cfg = adapted
    assert _export(params, tmp_path / "a") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds LoRA adapters (lora.rank=2); add --merge-lora" in err[0]
    plain = tmp_path / "plain"
    save_params(plain, 1, nnx.state(Transformer(cfg.model_config, rngs=nnx.Rngs(0)), nnx.Param))
    assert _export(plain, tmp_path / "b", "--merge-lora") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--merge-lora: --checkpoint" in err[0] and "holds no LoRA adapters" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]  # nothing written


def test_sample_and_eval_on_adapted_params(adapted, tmp_path, capsys):
    """`dgemma sample` and `dgemma eval` run on an adapted run's params (restored merged; without the adapters'
    metadata the config's model would not fit them)."""
    params, _, _ = adapted
    common = ["-c", TINY, "--checkpoint", str(params), *TWO_LAYERS, "sampler.max_steps=3",
              "sampler.max_new_tokens=16"]
    assert main(["sample", *common, "--prompt", "C1234|", "--mode", "diffusion"]) == 0
    assert "'C1234|' ->" in capsys.readouterr().out
    assert main(["eval", *common, "--batches", "1", "--batch-size", "4", "--modes", "ar",
                 "--plot-dir", str(tmp_path / "ev")]) == 0
    assert json.loads((tmp_path / "ev" / "eval.json").read_text())["ar"]["metrics"]["n"] == 4


# MARK: unmerged adapters in PEFT's format (`--peft-adapters`) -----------------------------------------------------
def _base_params(model, d):
    """The run's base as the run that started it would have it: the params without the adapters."""
    from dgemma.checkpoint import save_params

    save_params(d, 1, nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))
    return d


def _peft_model(base_dir, adapter_dir, cls):
    """transformers' model of the base export with the adapters loaded by peft; checks that every tensor of the
    adapter file was loaded into a PEFT module (same key set, same values) and that peft adapted every module the
    config names."""
    peft = pytest.importorskip("peft")
    from dgemma.convert.safetensors_io import SafetensorsFile

    pm = peft.PeftModel.from_pretrained(_reload(base_dir, cls), str(adapter_dir)).eval()
    f = SafetensorsFile(adapter_dir / "adapter_model.safetensors")
    loaded = peft.get_peft_model_state_dict(pm)
    assert sorted(loaded) == sorted(f.keys())
    for k in f.keys():
        assert np.array_equal(loaded[k].float().numpy(), f.read(k).astype(np.float32)), k
    return pm


def test_peft_adapters_load_in_transformers_with_the_lora_logits(adapted, tmp_path):
    """Every target kind (attention, dense MLP, router, self-conditioning, the experts' fused gate_up and down,
    nested in one module): the base export + peft give the dgemma LoRA model's logits (fp32, 1e-4), diffusion and AR
    layouts; the base alone does not."""
    params, model, cfg = adapted
    base = _base_params(model, tmp_path / "base_params")
    for layout, cls in (("diffusion_gemma", tf.DiffusionGemmaForBlockDiffusion), ("gemma4_text", tf.Gemma4ForCausalLM)):
        assert main(["export", "-c", TINY, *TWO_LAYERS, "--checkpoint", str(base), "--out", str(tmp_path / layout),
                     "--dtype", "float32", "--layout", layout]) == 0
        assert _export(params, tmp_path / f"{layout}_lora", "--peft-adapters", "--dtype", "float32", "--layout", layout,
                       "--base-model", str(tmp_path / layout)) == 0
        config = json.loads((tmp_path / f"{layout}_lora" / "adapter_config.json").read_text())
        assert config["r"] == 2 and config["lora_alpha"] == 3.0 and config["base_model_name_or_path"].endswith(layout)
        assert any(k.endswith("experts.gate_up_proj") for k in config["target_parameters"])
        pm = _peft_model(tmp_path / layout, tmp_path / f"{layout}_lora", cls)
        if layout == "diffusion_gemma":
            assert any("self_conditioning" in m for m in config["target_modules"])
            prompt, canvas = _inputs(cfg.model_config.vocab_size)
            with torch.no_grad():
                theirs = pm(input_ids=prompt, decoder_input_ids=canvas).logits.numpy()
                with pm.disable_adapter():
                    plain = pm(input_ids=prompt, decoder_input_ids=canvas).logits.numpy()
            ours = _ours(model, prompt, canvas)
        else:
            tokens, _ = _inputs(cfg.model_config.vocab_size, P=13, seed=4)
            with torch.no_grad():
                theirs = pm(input_ids=tokens).logits.numpy()
                with pm.disable_adapter():
                    plain = pm(input_ids=tokens).logits.numpy()
            ours = np.asarray(J.forward(model, jnp.asarray(tokens.numpy())))
        assert float(np.abs(ours - plain).max()) > 100 * TOL, layout  # the adapters matter
        assert float(np.abs(ours - theirs).max()) <= TOL, layout


@pytest.mark.parametrize("targets,scan", [(["experts/up$"], False), (["experts/gate$", "experts/down$"], False),
                                          (["attn/o_proj$"], False), (["attn/q_proj$", "experts/(gate|down)$"], True)],
                         ids=["up-only", "gate-and-down", "o_proj-only", "scanned-layers"])
def test_peft_adapters_of_partial_targets(targets, scan, tmp_path):
    """One half of the fused gate_up (zeros in the other), gate with down (nested wrappers), a dense module alone, a
    scanned-layers model (stacked adapters, one PEFT pair per layer): the AR logits of the LoRA model through peft."""
    from dgemma.checkpoint import save_params
    from dgemma.checkpoint.lora_params import lora_metadata
    from dgemma.config import load_config
    from dgemma.model.lora import attach_adapters
    from dgemma.model.transformer import Transformer

    four = "[sliding_attention,full_attention,sliding_attention,full_attention]"
    layers = ["model.num_hidden_layers=4", f"model.layer_types={four}", "model.execution.scan_layers=true",
              "model.execution.scan_period=2"] if scan else TWO_LAYERS
    cfg = load_config(TINY, [*layers, "lora.rank=3", "lora.alpha=2.0", f"lora.targets={targets}"])
    model = Transformer(cfg.model_config, rngs=nnx.Rngs(7))
    _randomize(model, 8, nnx.Param, 0.05)
    attach_adapters(model, cfg.lora.spec(), nnx.Rngs(9))
    _randomize(model, 10, nnx.LoRAParam, 0.3)
    save_params(tmp_path / "params", 3, nnx.state(model, nnx.Param), metadata=lora_metadata(cfg.lora))
    base = _base_params(model, tmp_path / "base_params")
    assert main(["export", "-c", TINY, *layers, "--checkpoint", str(base), "--out", str(tmp_path / "base"),
                 "--dtype", "float32", "--layout", "gemma4_text"]) == 0
    assert main(["export", "-c", TINY, *layers, "--checkpoint", str(tmp_path / "params"), "--out",
                 str(tmp_path / "lora"), "--peft-adapters", "--dtype", "float32", "--layout", "gemma4_text"]) == 0
    pm = _peft_model(tmp_path / "base", tmp_path / "lora", tf.Gemma4ForCausalLM)
    tokens, _ = _inputs(cfg.model_config.vocab_size, P=13, seed=5)
    with torch.no_grad():
        theirs = pm(input_ids=tokens).logits.numpy()
    ours = np.asarray(J.forward(model, jnp.asarray(tokens.numpy())))
    assert float(np.abs(ours - theirs).max()) <= TOL


def test_peft_adapters_refusals(adapted, tmp_path, capsys):
    """One line each, nothing written: no adapters in the checkpoint, flags of a model export, a run that trained the
    router in full, --base-model without --peft-adapters."""
    from dgemma.checkpoint import save_params
    from dgemma.checkpoint.lora_params import lora_metadata
    from dgemma.config import load_config

    params, model, cfg = adapted
    plain = _base_params(model, tmp_path / "plain")
    cases = [([str(plain), "--peft-adapters"], "holds no LoRA adapters"),
             ([str(params), "--peft-adapters", "--merge-lora"], "--merge-lora belong to a model export"),
             ([str(params), "--peft-adapters", "--fp8"], "--fp8 belong to a model export"),
             ([str(params), "--base-model", "x"], "--base-model is recorded only with --peft-adapters")]
    routed = load_config(TINY, [*TWO_LAYERS, *LORA, "lora.train_router=true"])
    save_params(tmp_path / "routed", 5, nnx.state(model, nnx.Param), metadata=lora_metadata(routed.lora))
    cases.append(([str(tmp_path / "routed"), "--peft-adapters"], "also trained lora.train_router in full"))
    for i, (argv, message) in enumerate(cases):
        assert main(["export", "-c", TINY, *TWO_LAYERS, "--checkpoint", argv[0], "--out", str(tmp_path / f"o{i}"),
                     *argv[1:]]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "routed"]  # nothing written


@pytest.mark.parametrize("name", ["tiny_e2b", pytest.param("tiny_e4b", marks=pytest.mark.slow),
                                  pytest.param("tiny_31b", marks=pytest.mark.slow)])
def test_peft_adapters_of_family_twins(name, tmp_path):
    """The family's layouts (per-layer embeddings, KV-shared layers without k/v projections, K=V layers, dense MLPs
    only): adapters on every attention and MLP weight, through the library API, load with peft onto the base export
    and give the LoRA model's AR logits."""
    from dgemma.convert.hf_export import export_hf
    from dgemma.convert.peft_export import export_peft
    from dgemma.model.config import preset
    from dgemma.model.lora import LoraSpec, attach_adapters, merged_params
    from dgemma.model.transformer import Transformer, model_from_params

    model = Transformer(preset(name), rngs=nnx.Rngs(0))
    _randomize(model, 1, nnx.Param, 0.05)
    spec = LoraSpec(rank=2, alpha=5.0, targets=(r"attn/[qkvo]_proj$", r"mlp/(gate|up|down)$"))
    attach_adapters(model, spec, nnx.Rngs(2))
    _randomize(model, 3, nnx.LoRAParam, 0.3)
    export_hf(model, tmp_path / "base", layout="gemma4_text", dtype="float32")  # the base weights (adapters apart)
    export_peft(model, tmp_path / "lora", layout="gemma4_text", rank=spec.rank, alpha=spec.alpha, dtype="float32")
    pm = _peft_model(tmp_path / "base", tmp_path / "lora", tf.Gemma4ForCausalLM)
    tokens, _ = _inputs(model.cfg.vocab_size, P=13, seed=6)
    with torch.no_grad():
        theirs = pm(input_ids=tokens).logits.numpy()
    ours = np.asarray(J.forward(model, jnp.asarray(tokens.numpy())))
    # fp32 floor of this model: dgemma's own merged model (W + scale.A.B) against its adapted one, two exact forms of
    # the same function (1.2e-4 for the 31B twin under the suite's XLA flags, its adapters moving logits by ~2); a
    # wrong layout is off by O(1)
    merged = model_from_params(model.cfg, merged_params(model))
    floor = float(np.abs(np.asarray(J.forward(merged, jnp.asarray(tokens.numpy()))) - ours).max())
    assert floor <= 5e-4, floor
    assert float(np.abs(ours - theirs).max()) <= max(TOL, 2 * floor)

"""`dgemma export --merge-lora`: the params of an adapted run (adapters on attention, dense MLPs, self-conditioning,
router and experts, all weights random) export merged; transformers reloads them with no missing or unexpected keys
and the logits of the dgemma LoRA model (fp32 to 1e-4; bf16 and FP8 at their usual error). Exporting adapters
without the flag, or the flag on a checkpoint without adapters, is a one-line refusal that writes nothing."""

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

import jitted as J  # noqa: E402
from dgemma.cli.main import main  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
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
    # a text-only export (no --vision-source) leaves the vision tower to its initialisation: nothing else is missing
    assert all("vision" in k for k in info["missing_keys"]), info
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info["missing_keys"] or cls is tf.DiffusionGemmaForBlockDiffusion
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
    # bf16 keeps 8 bits of mantissa; e4m3 3 (16x the weight noise), as in tests/test_export_fp8.py
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

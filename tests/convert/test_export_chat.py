"""Exports the ecosystem runs as they are: a text-only diffusion_gemma export carries the null vision tower (loads in
transformers with no missing, unexpected or mismatched keys), the tokenizer with its chat template, and a
generation_config.json holding the config's sampler settings and the tokenizer's stop ids (`<turn|>` included);
transformers' `generate` from a chat prompt, with nothing but that file, equals dgemma's sampler token for token on
the same draws."""

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from support import chat_tokenizer  # noqa: E402
from support.torch_draws import recording  # noqa: E402
from dgemma.config.sections import SamplerSection  # noqa: E402
from dgemma.convert import tokenizer_files  # noqa: E402
from dgemma.convert.hf_export import NULL_VISION_CONFIG, export_hf  # noqa: E402
from dgemma.convert.hf_import import load_hf_checkpoint  # noqa: E402
from dgemma.convert.safetensors_io import SafetensorsFile  # noqa: E402
from dgemma.inference.sampler import InjectedDraws, SamplerConfig, sample  # noqa: E402
from support.sampler_helpers import GAMMA, MIN_MARGINS, converging_dg as _converging_dg  # noqa: E402
from support.sampler_helpers import margins as _margins, record_decisions as _record_decisions  # noqa: E402

pytestmark = pytest.mark.parity

# the settings of tests/inference/test_sampler_parity.py (its converging tiny model stops within K there)
SAMPLER = dataclasses.replace(SamplerSection(), max_steps=12, entropy_bound=GAMMA, confidence_threshold=0.3,
                              stability_threshold=1, t_min=0.3, t_max=0.9, max_new_tokens=24)
MESSAGES = [[{"role": "user", "content": "why is the sky blue ?"}], [{"role": "user", "content": "hello w3 w9 w4 w5 ."}]]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(dgemma model, tokenizer dir, text-only float32 export) of the converging tiny DiffusionGemma."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: intra-op threads only contend with XLA's
    root = tmp_path_factory.mktemp("chat")
    hf = _converging_dg()
    hf.save_pretrained(root / "hf")
    model, _ = load_hf_checkpoint(root / "hf")
    tok = chat_tokenizer.build(root / "tok", model.cfg.vocab_size)
    out = export_hf(model, root / "dg", dtype="float32", tokenizer_dir=tok, generation_config=SAMPLER)
    yield model, tok, out
    torch.set_num_threads(threads)


def test_text_only_export_loads_with_no_missing_keys(exported):
    model, tok, out = exported
    conf = json.loads((out / "config.json").read_text())
    assert {k: conf["vision_config"][k] for k in NULL_VISION_CONFIG} == NULL_VISION_CONFIG
    reloaded, info = tf.DiffusionGemmaForBlockDiffusion.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    vision = {k: v for k, v in reloaded.state_dict().items() if ".vision_tower." in k or ".embed_vision." in k}
    assert len(vision) == 3 and all(not v.any() for v in vision.values())  # zeros, as written
    stored = SafetensorsFile(out / "model.safetensors").keys()
    assert sum(("vision" in k) for k in stored) == 3
    # what transformers does without it: DiffusionGemmaConfig(vision_config=None) builds the 16-layer default
    # tower, whose weights a text-only checkpoint lacks (the failure this export avoids)
    default = tf.DiffusionGemmaConfig(text_config=reloaded.config.text_config.to_dict(), vision_config=None)
    assert default.vision_config.num_hidden_layers > 0


def test_export_carries_the_tokenizer_chat_template_and_sampler_settings(exported):
    model, tok, out = exported
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / f).read_bytes() == (tok / f).read_bytes(), f
    loaded = tf.AutoTokenizer.from_pretrained(out)
    assert loaded.chat_template == chat_tokenizer.CHAT_TEMPLATE
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    g = DiffusionGemmaGenerationConfig.from_pretrained(out)
    turn = loaded.convert_tokens_to_ids("<turn|>")
    assert g.eos_token_id == [1, turn] and g.pad_token_id == 0 and g.bos_token_id == 2
    assert (g.max_denoising_steps, g.sampler_config.entropy_bound, g.t_min, g.t_max, g.stability_threshold,
            g.confidence_threshold, g.max_new_tokens) == (12, GAMMA, 0.3, 0.9, 1, 0.3, 24)


def test_stop_ids_without_an_end_of_turn_token(tmp_path):
    """A tokenizer without `<turn|>` adds only its EOS; its PAD replaces the model's."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = ["<p>", "<e>", "<b>", "<u>", "x"]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<u>"))
    PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<p>", eos_token="<e>", bos_token="<b>",
                            unk_token="<u>").save_pretrained(tmp_path)
    assert tokenizer_files.special_ids(tmp_path) == {"eos": [1], "pad": 0}
    with pytest.raises(ValueError, match=r"tokenizer directory .*nope does not exist"):
        tokenizer_files.tokenizer_files(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty: no tokenizer.json / tokenizer_config.json"):
        tokenizer_files.tokenizer_files(tmp_path / "empty")


def _generate_recorded(hf, prompt, seed):
    """transformers' generate with the exported generation_config alone; its global-RNG draws recorded."""
    calls = []
    wrapped = recording(calls, prompt.shape[0], hf.config.canvas_length)

    with pytest.MonkeyPatch.context() as mp, torch.random.fork_rng():
        for name, fn in wrapped.items():
            mp.setattr(torch, name, fn)
        steps = _record_decisions(mp)
        torch.manual_seed(seed)
        out = hf.generate(prompt)  # every sampler setting from generation_config.json
    out.decision_margins = _margins(steps, hf.generation_config.confidence_threshold)
    return out, InjectedDraws.from_hf_stream(calls, prompt.shape[0], hf.config.canvas_length)


def test_generate_from_a_chat_prompt_equals_dgemma_sampler(exported):
    model, tok, out = exported
    hf = tf.DiffusionGemmaForBlockDiffusion.from_pretrained(out, attn_implementation="eager").eval()
    hf.set_experts_implementation("eager")
    tokenizer = tf.AutoTokenizer.from_pretrained(out)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)["input_ids"]
    assert prompt.shape == (2, 12) and (prompt[:, -2:] == torch.tensor([4, 7])).all()  # ... <|turn> model
    res_hf, draws = _generate_recorded(hf, prompt, seed=2)
    for name, least in MIN_MARGINS.items():
        assert res_hf.decision_margins[name] >= least, f"knife-edge {name} decision: {res_hf.decision_margins}"
    g = hf.generation_config
    cfg = SamplerConfig.from_section(SAMPLER, eos_ids=tuple(g.eos_token_id), pad_id=g.pad_token_id,
                                     wait_for_finished_rows=True)
    ours = sample(model, prompt.numpy(), None, cfg, draws=draws)
    np.testing.assert_array_equal(ours.tokens, res_hf.sequences[:, prompt.shape[1]:].numpy())
    np.testing.assert_array_equal(ours.steps_run, [draws.steps(b) for b in range(len(draws.blocks))])
    assert (ours.stop_reason == 0).any(), "no block converged: the comparison would not exercise the stop rule"
    assert isinstance(tokenizer.batch_decode(ours.tokens, skip_special_tokens=True)[0], str)


def test_cli_takes_the_tokenizer_from_the_config(tmp_path):
    """`dgemma export` copies the config's data.tokenizer (kind hf) without --tokenizer-dir; --layout diffusers
    without a tokenizer is a one-line refusal before the checkpoint is read."""
    from pathlib import Path

    from flax import nnx

    from dgemma.checkpoint import save_params
    from dgemma.cli.main import main
    from dgemma.config import load_config
    from dgemma.model.transformer import Transformer

    tiny = str(Path(__file__).resolve().parents[2] / "configs/stage1/tiny.yaml")
    two = ["model.num_hidden_layers=2", "model.layer_types=[sliding_attention,full_attention]"]
    cfg = load_config(tiny, two)
    save_params(tmp_path / "params", 1, nnx.state(Transformer(cfg.model_config, rngs=nnx.Rngs(0)), nnx.Param))
    tok = chat_tokenizer.build(tmp_path / "tok", cfg.model_config.vocab_size)
    hf_tok = ["data.tokenizer.kind=hf", f"data.tokenizer.path={tok}"]
    args = ["export", "-c", tiny, *two, "--checkpoint", str(tmp_path / "params")]
    assert main([*args, "--out", str(tmp_path / "no_tok"), "--layout", "diffusers"]) == 2
    assert not (tmp_path / "no_tok").exists()
    assert main([*args, *hf_tok, "--out", str(tmp_path / "pipe"), "--layout", "diffusers"]) == 0
    assert (tmp_path / "pipe" / "processor" / "chat_template.jinja").read_bytes() == \
        (tok / "chat_template.jinja").read_bytes()
    assert main([*args, *hf_tok, "--out", str(tmp_path / "dg")]) == 0
    assert (tmp_path / "dg" / "chat_template.jinja").exists()
    gen = json.loads((tmp_path / "dg" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 5] and gen["max_denoising_steps"] == cfg.sampler.max_steps
    _, info = tf.DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "dg", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info

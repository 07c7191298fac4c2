"""`dgemma export --layout diffusers`: diffusers 0.42.1's `DiffusionGemmaPipeline.from_pretrained(DIR)` loads the
repository and a call with a chat prompt returns text with no other argument; the files are what diffusers' own
`save_pretrained` writes; on the same draws the pipeline equals dgemma's sampler token for token on every row whose
blocks converge, and where a block reaches K_max the pipeline commits its last renoised canvas while dgemma (like
transformers' generate) commits the argmax. PEFT adapters: a PeftModel as the pipeline's model fails,
`merge_and_unload()` works and equals `--merge-lora`.

The pipeline runs in a child process under the released pair diffusers 0.42.1 + transformers 5.23.0
(tests/support/diffusers_pair.py): diffusers 0.42.1 does not run on the transformers >= 5.24 dgemma uses.
"""

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from support import chat_tokenizer  # noqa: E402
from support import diffusers_pair  # noqa: E402
from dgemma.config.sections import SamplerSection  # noqa: E402
from dgemma.convert import diffusers_layout  # noqa: E402
from dgemma.convert.hf_export import export_hf, verify  # noqa: E402
from dgemma.convert.hf_import import load_hf_checkpoint  # noqa: E402
from dgemma.inference.sampler import InjectedDraws, SamplerConfig, sample  # noqa: E402
from support.sampler_helpers import GAMMA, converging_dg as _converging_dg  # noqa: E402

pytestmark = pytest.mark.parity

L = 8
SAMPLER = dataclasses.replace(SamplerSection(), max_steps=12, entropy_bound=GAMMA, confidence_threshold=0.3,
                              stability_threshold=1, t_min=0.3, t_max=0.9, max_new_tokens=24)
MESSAGES = [[{"role": "user", "content": "why is the sky blue ?"}], [{"role": "user", "content": "hello w3 w9 w4 w5 ."}]]


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """(dgemma model, float32 diffusers export) of the converging tiny DiffusionGemma, with the chat tokenizer."""
    root = tmp_path_factory.mktemp("pipe")
    hf = _converging_dg()
    hf.save_pretrained(root / "hf")
    model, _ = load_hf_checkpoint(root / "hf")
    tok = chat_tokenizer.build(root / "tok", model.cfg.vocab_size)
    return model, export_hf(model, root / "pipe", layout="diffusers", dtype="float32", tokenizer_dir=tok,
                            generation_config=SAMPLER)


def test_repository_is_what_diffusers_writes(repo, tmp_path):
    """Also a call with nothing but a prompt, on an export of the same weights with a 256-token canvas (as the
    released checkpoint: the call's default 256 tokens are one canvas, not 32 of the parity model's 8)."""
    model, out = repo
    hf = _converging_dg()
    hf.config.canvas_length = 256
    hf.save_pretrained(tmp_path / "hf256")
    model256, _ = load_hf_checkpoint(tmp_path / "hf256")
    big = export_hf(model256, tmp_path / "pipe256", layout="diffusers", dtype="float32",
                    tokenizer_dir=out / diffusers_layout.PROCESSOR, generation_config=SAMPLER)
    manifest = verify(out)  # every file, the sub-folders' included, is in the manifest
    assert {"model_index.json", "model/model.safetensors", "model/config.json", "model/generation_config.json",
            "scheduler/scheduler_config.json", "processor/tokenizer.json", "processor/chat_template.jinja"} <= \
        set(manifest["files"]) and manifest["layout"] == "diffusers"
    sched = json.loads((out / "scheduler" / "scheduler_config.json").read_text())
    gen = json.loads((out / "model" / "generation_config.json").read_text())
    assert (sched["entropy_bound"], sched["t_min"], sched["t_max"], sched["num_inference_steps"]) == \
        (gen["sampler_config"]["entropy_bound"], gen["t_min"], gen["t_max"], gen["max_denoising_steps"]) == \
        (GAMMA, 0.3, 0.9, 12)
    theirs = diffusers_pair.run("save_pretrained", big, tmp_path / "resaved")
    assert theirs["plain_sequences"].shape == (1, 256) and len(str(theirs["plain_texts"][0]).split()) > 0
    assert json.loads((big / "model_index.json").read_text()) == json.loads((out / "model_index.json").read_text())
    ours_index, their_index = json.loads((out / "model_index.json").read_text()), json.loads(str(theirs["model_index"]))
    # diffusers 0.42.1's save_pretrained records the model's library as "diffusion_gemma" (its rule for classes of
    # its own pipeline folders matches transformers' module path models/diffusion_gemma/); dgemma writes the
    # "transformers" entry diffusers' documentation gives, the one from_pretrained just loaded
    assert their_index.pop("model") == ["diffusion_gemma", "DiffusionGemmaForBlockDiffusion"]
    assert ours_index.pop("model") == ["transformers", "DiffusionGemmaForBlockDiffusion"]
    their_index.pop("_name_or_path")
    assert their_index == ours_index
    assert json.loads(str(theirs["scheduler"])) == sched
    assert set(theirs["processor_files"]) >= {"tokenizer.json", "tokenizer_config.json"}


def test_layout_refuses_a_tokenizer_without_chat_template(repo, tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    model, _ = repo
    words = [f"t{i}" for i in range(8)]
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                                                        unk_token="t3")),
                            eos_token="t1").save_pretrained(tmp_path / "tok")
    for tok, why in ((None, "needs the tokenizer it was trained with"), (tmp_path / "tok", "has no chat template")):
        with pytest.raises(ValueError, match=f"export layout 'diffusers': .*{why}"):
            export_hf(model, tmp_path / "out", layout="diffusers", tokenizer_dir=tok)
        assert not (tmp_path / "out").exists()


def _draws(saved) -> InjectedDraws:
    calls = [(str(k), saved[f"draw_{i}"]) for i, k in enumerate(saved["draw_kinds"])]
    return InjectedDraws.from_hf_stream(calls, len(MESSAGES), L)


def _prompt(out):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / diffusers_layout.PROCESSOR)
    return tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="np",
                                   return_dict=True)["input_ids"]


def test_pipeline_equals_dgemma_sampler_on_converged_rows(repo):
    model, out = repo
    settings = dict(num_inference_steps=SAMPLER.max_steps, stability_threshold=SAMPLER.stability_threshold,
                    confidence_threshold=SAMPLER.confidence_threshold, gen_length=SAMPLER.max_new_tokens)
    saved = diffusers_pair.run("generate", out, json.dumps(MESSAGES), 2, json.dumps(settings))
    draws = _draws(saved)
    ours = sample(model, _prompt(out), None, SamplerConfig.from_section(
        SAMPLER, eos_ids=(1,), pad_id=0, wait_for_finished_rows=True), draws=draws)
    theirs = saved["sequences"]
    compared = tokens = 0
    for row in range(len(MESSAGES)):
        for b in range(theirs.shape[1] // L):
            if ours.stop_reason[row, b] != 0:  # reached K_max, or finished by EOS: compared below / not at all
                break
            block = theirs[row, b * L:(b + 1) * L]
            end = int(np.argmax(block == 1)) + 1 if (block == 1).any() else L  # dgemma pads after EOS, the
            np.testing.assert_array_equal(ours.tokens[row, b * L:b * L + end], block[:end])  # pipeline goes on
            compared, tokens = compared + 1, tokens + end
            if end < L or (block == 1).any():
                break
    assert compared >= 2 and tokens >= L + 2, f"{compared} converged blocks, {tokens} tokens compared " \
        f"({ours.stop_reason}): pick another seed"


def test_at_k_max_the_pipeline_commits_its_renoised_canvas(repo):
    """confidence_threshold=None: every block runs K steps; dgemma (c = 0 never stops early) replays the draws."""
    model, out = repo
    K = 3
    settings = dict(num_inference_steps=K, confidence_threshold=None, gen_length=L)
    saved = diffusers_pair.run("generate", out, json.dumps(MESSAGES), 5, json.dumps(settings))
    draws = _draws(saved)
    assert draws.steps(0) == K
    ours = sample(model, _prompt(out), None, SamplerConfig.from_section(
        SAMPLER, max_steps=K, confidence_threshold=0.0, max_new_tokens=L, eos_ids=(1,), pad_id=0,
        wait_for_finished_rows=True, record_drafts=True), draws=draws)
    theirs = saved["sequences"][:, :L]
    last = draws.blocks[0]
    # the pipeline's block is its canvas after the last scheduler step: the accepted samples and the renoise tokens
    np.testing.assert_array_equal(theirs, saved["step_canvases"][K - 1])
    assert np.isin(theirs == last["samples"][K - 1], True).any()
    noise_only = (theirs == last["noise"][K - 1]) & (theirs != last["samples"][K - 1])
    assert ((theirs == last["samples"][K - 1]) | (theirs == last["noise"][K - 1])).all() and noise_only.any()
    # dgemma commits the argmax of the last step (as transformers' generate does), not the renoised canvas
    assert (ours.stop_reason[:, 0] != 0).all()
    np.testing.assert_array_equal(ours.tokens[:, :L], ours.drafts[0, K - 1])
    assert (ours.tokens[:, :L] != theirs).any()


def test_peft_adapters_with_the_pipeline(tmp_path):
    """A PeftModel as the pipeline's model fails; its get_base_model() runs and equals dgemma's --merge-lora export;
    merge_and_unload() adds every text adapter twice (the adapters are written for the encoder's and the decoder's
    modules, which share one weight)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dgemma.convert.hf_export import export_from_params
    from dgemma.convert.peft_export import export_peft
    from dgemma.model.lora import LoraSpec, attach_adapters, merged_params

    hf = _converging_dg()
    hf.save_pretrained(tmp_path / "hf")
    model, _ = load_hf_checkpoint(tmp_path / "hf")
    tok = chat_tokenizer.build(tmp_path / "tok", model.cfg.vocab_size)
    base = export_hf(model, tmp_path / "base", layout="diffusers", dtype="float32", tokenizer_dir=tok)
    assert attach_adapters(model, LoraSpec(rank=2, alpha=4.0, targets=("attn/[qkvo]_proj$",)), nnx.Rngs(3))
    rng = np.random.default_rng(1)
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(0.3 * rng.standard_normal(x.shape), x.dtype),
                                   nnx.state(model, nnx.LoRAParam)))
    adapters = export_peft(model, tmp_path / "adapters", layout="diffusers", rank=2, alpha=4.0, dtype="float32")
    merged = export_from_params(merged_params(model), model.cfg, tmp_path / "merged", dtype="float32")
    saved = diffusers_pair.run("peft", base, adapters, merged)
    assert "has no attribute 'encoder'" in str(saved["error"])
    assert len(saved["texts"]) == 1  # get_base_model(): the pipeline runs with the adapters applied
    assert float(saved["unmerged_diff"]) <= 1e-4
    # merge_and_unload() folds the encoder's and the decoder's copy of each adapter into the one tied weight
    delta = saved["export_w"] - saved["base_w"]
    assert float(np.abs(delta).max()) > 1e-2
    np.testing.assert_allclose(saved["unloaded_w"] - saved["base_w"], 2 * delta, atol=1e-5)
    assert float(saved["merged_diff"]) > 1e-2

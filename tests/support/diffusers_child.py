"""Run in a child process under the diffusers / transformers pair (tests/support/diffusers_pair.py): load a `dgemma export
--layout diffusers` repository with `DiffusionGemmaPipeline.from_pretrained` and record what the tests compare.

    python diffusers_child.py FUNCTION '["arg", ...]' OUT.npz
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from torch_draws import recording  # this folder is the script's sys.path[0]

PAIR_VERSIONS = {"diffusers": "0.42.1", "transformers": "5.23.0"}


def _pipeline(directory, eager: bool = True):
    import diffusers
    import transformers
    from diffusers import DiffusionGemmaPipeline

    got = {"diffusers": diffusers.__version__, "transformers": transformers.__version__}
    assert got == PAIR_VERSIONS, f"the child runs {got}, not the pinned pair {PAIR_VERSIONS}"
    pipe = DiffusionGemmaPipeline.from_pretrained(directory)
    pipe.set_progress_bar_config(disable=True)
    if eager:  # the parity references' attention and experts (dgemma's own parity tests use the same)
        pipe.model.set_attn_implementation("eager")
        pipe.model.set_experts_implementation("eager")
    return pipe


def _recording(calls: list, batch: int, length: int):
    """The recording wrappers (torch_draws.recording) and the originals they wrap."""
    originals = (torch.randint, torch.multinomial, torch.sort)
    return recording(calls, batch, length), originals


def generate(directory, messages, seed, settings, out):
    """One pipeline call on a batch of chat conversations with `settings` (call arguments, JSON), its draws recorded.
    Saves sequences, texts, the draw stream and the canvas after every step (for the K_max check)."""
    pipe = _pipeline(directory)
    messages, settings = json.loads(messages), json.loads(settings)
    batch, length = len(messages), pipe.model.config.canvas_length
    calls, steps = [], []
    wrapped, originals = _recording(calls, batch, length)

    def on_step(p, i, t, kw):
        steps.append(kw["canvas"].numpy().copy())
        return {}

    torch.manual_seed(int(seed))
    for name, fn in wrapped.items():
        setattr(torch, name, fn)
    try:
        res = pipe(messages=messages, callback_on_step_end=on_step, **settings)
    finally:
        for name, fn in zip(("randint", "multinomial", "sort"), originals):
            setattr(torch, name, fn)
    saved = {"sequences": res.sequences.numpy(), "texts": np.array(res.texts),
             "draw_kinds": np.array([k for k, _ in calls]), "step_canvases": np.stack(steps)}
    saved.update({f"draw_{i}": a for i, (_, a) in enumerate(calls)})
    np.savez(out, **saved)


def save_pretrained(directory, dest, out):
    """A call with a chat prompt and no other argument (the released checkpoint's defaults: 256 tokens, K = 48);
    then what diffusers itself writes for the loaded pipeline: model_index.json and the scheduler config."""
    from pathlib import Path

    pipe = _pipeline(directory, eager=False)
    torch.manual_seed(0)
    plain = pipe(prompt="why is the sky blue?")
    pipe.save_pretrained(dest)
    np.savez(out, plain_texts=np.array(plain.texts), plain_sequences=plain.sequences.numpy(),
             model_index=np.array((Path(dest) / "model_index.json").read_text()),
             scheduler=np.array((Path(dest) / "scheduler" / "scheduler_config.json").read_text()),
             processor_files=np.array(sorted(p.name for p in (Path(dest) / "processor").iterdir())))


def peft(directory, adapters, merged, out):
    """The pipeline with PEFT adapters: a PeftModel as `model` fails (the pipeline reads model.model.encoder);
    `get_base_model()` (adapters applied, unmerged) runs and equals dgemma's --merge-lora export; so would
    `merge_and_unload()`, but it adds each text adapter twice (below). Saves the error, the logit differences and
    the q_proj weight deltas of merge_and_unload and of the --merge-lora export."""
    from peft import PeftModel
    from transformers import DiffusionGemmaForBlockDiffusion

    pipe = _pipeline(directory)
    key = "model.decoder.layers.0.self_attn.q_proj.weight"
    base_w = pipe.model.state_dict()[key].clone()
    peft_model = PeftModel.from_pretrained(pipe.model, adapters).eval()
    pipe.model = peft_model
    try:
        pipe(prompt="why is the sky blue?", gen_length=8, num_inference_steps=2)
        error = ""
    except AttributeError as e:
        error = str(e)
    reference = DiffusionGemmaForBlockDiffusion.from_pretrained(merged, attn_implementation="eager").eval()
    reference.set_experts_implementation("eager")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 100, (2, 7), generator=g)
    canvas = torch.randint(0, 100, (2, reference.config.canvas_length), generator=g)

    def logits(model):
        with torch.no_grad():
            return model(input_ids=prompt, decoder_input_ids=canvas).logits

    ref = logits(reference)
    pipe.model = peft_model.get_base_model()
    torch.manual_seed(0)
    texts = pipe(prompt="why is the sky blue?", gen_length=8, num_inference_steps=2).texts
    unmerged = float((logits(pipe.model) - ref).abs().max())
    pipe.model = peft_model.merge_and_unload()
    merged_diff = float((logits(pipe.model) - ref).abs().max())
    np.savez(out, error=np.array(error), texts=np.array(texts), unmerged_diff=np.array(unmerged),
             merged_diff=np.array(merged_diff), base_w=base_w.numpy(),
             unloaded_w=pipe.model.state_dict()[key].numpy(), export_w=reference.state_dict()[key].numpy())


if __name__ == "__main__":
    function, args, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    globals()[function](*args, out=out)

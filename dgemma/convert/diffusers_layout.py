"""The `diffusers` export layout: a repository diffusers 0.42.1's `DiffusionGemmaPipeline.from_pretrained(DIR)` loads.

    DIR/model_index.json                     _class_name DiffusionGemmaPipeline; one [library, class] per component
    DIR/model/                               the diffusion_gemma export (config.json, generation_config.json, weights)
    DIR/scheduler/scheduler_config.json      EntropyBoundScheduler: entropy_bound, t_min, t_max, num_inference_steps
    DIR/processor/                           the tokenizer with its chat template (the pipeline's `processor`)

These are the files `DiffusionGemmaPipeline.save_pretrained` writes (tests/convert/test_export_diffusers.py compares them in
a diffusers environment); dgemma writes them without importing diffusers. The scheduler settings are taken from the
model's generation config, so `model/generation_config.json` and the scheduler always agree. The pipeline reads
K_max, the stability and the confidence thresholds as call arguments, not from any file: docs/export.md gives the
call that runs the exported settings.
"""

from __future__ import annotations

import json
from pathlib import Path

from dgemma.convert import tokenizer_files

DIFFUSERS_VERSION = "0.42.1"
MODEL, SCHEDULER, PROCESSOR = "model", "scheduler", "processor"
PIPELINE_CLASS, SCHEDULER_CLASS, MODEL_CLASS = "DiffusionGemmaPipeline", "EntropyBoundScheduler", \
    "DiffusionGemmaForBlockDiffusion"


def check_tokenizer(tokenizer_dir) -> None:
    """The pipeline encodes prompts only through the processor's chat template: refuse an export without one."""
    if tokenizer_dir is None:
        raise ValueError("export layout 'diffusers': the pipeline needs the tokenizer it was trained with (its "
                         "processor): set data.tokenizer (kind hf) in the config or pass --tokenizer-dir")
    if not tokenizer_files.has_chat_template(tokenizer_dir):
        raise ValueError(f"export layout 'diffusers': tokenizer directory {tokenizer_dir} has no chat template "
                         f"(DiffusionGemmaPipeline applies one to every prompt)")


def scheduler_config(gen) -> dict:
    """scheduler_config.json of the EntropyBoundScheduler from a `DiffusionGemmaGenerationConfig`."""
    return {"_class_name": SCHEDULER_CLASS, "_diffusers_version": DIFFUSERS_VERSION,
            "entropy_bound": float(gen.sampler_config.entropy_bound),
            "num_inference_steps": int(gen.max_denoising_steps),
            "t_max": float(gen.t_max), "t_min": float(gen.t_min)}


def model_index(processor_class: str) -> dict:
    return {"_class_name": PIPELINE_CLASS, "_diffusers_version": DIFFUSERS_VERSION,
            MODEL: ["transformers", MODEL_CLASS], PROCESSOR: ["transformers", processor_class],
            SCHEDULER: ["diffusers", SCHEDULER_CLASS]}


def write_pipeline_files(root: Path, gen, tokenizer_dir) -> None:
    """model_index.json, scheduler/ and processor/ under `root` (the model itself goes to root/model)."""
    processor_class = type(tokenizer_files.load(tokenizer_dir)).__name__  # what save_pretrained would record
    (root / PROCESSOR).mkdir()
    tokenizer_files.copy_tokenizer(tokenizer_dir, root / PROCESSOR)
    (root / SCHEDULER).mkdir()
    _write_json(root / SCHEDULER / "scheduler_config.json", scheduler_config(gen))
    _write_json(root / "model_index.json", model_index(processor_class))


def _write_json(path: Path, body: dict) -> None:
    path.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")

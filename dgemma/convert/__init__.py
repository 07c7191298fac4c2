"""dgemma.convert: Hugging Face checkpoints in and out, and serialized compiled functions.

Modules:
  hf_import        streaming import of Gemma 4 / DiffusionGemma safetensors into a dgemma `Transformer`
  hf_export        export to Hugging Face safetensors: `diffusion_gemma`, or plain Gemma 4 for AR serving
  hf_config        Hugging Face `config.json` <-> `ModelConfig` (`gemma4`, `gemma4_text`, `diffusion_gemma`)
  keymap           the one table between Hugging Face tensor names and dgemma parameter paths
  safetensors_io   minimal, strict safetensors reader / writer (no pickle, bf16 / fp8 without numpy dtypes)
  fp8              FP8 (e4m3) block quantisation in the FineGrainedFP8 / DeepSeek-V3 format
  peft_export      an adapted run's adapters, unmerged, in PEFT's LoRA format
  destination      where exports may write: what may be replaced, cleanup on SIGTERM
  artifact         `jax.export` artifacts: ship a jitted sampler step, reload it anywhere
  tokenizer_files  the tokenizer (and chat template) an export carries, and its special ids
  diffusers_layout  `--layout diffusers`: a DiffusionGemmaPipeline repository (model_index, scheduler, processor)
"""

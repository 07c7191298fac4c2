"""dgemma: turn an autoregressive Gemma 4 MoE LM into a block discrete-diffusion LM (DiffusionGemma) and back.

Package map (one concern per package; nothing heavy is imported here):
  dgemma.model      Gemma 4 MoE transformer + DiffusionGemma encoder/decoder/self-conditioning, KV cache
  dgemma.diffusion  noise schedule, corruption, bridge posterior, ELBO, one-pass training mask, losses
  dgemma.parallel   meshes, logical-axis sharding rules, multi-host init, launch rendering, memory planner
  dgemma.data       synthetic tasks, local/GSM8K/TFDS sources, tokenizers, canvasing, grain pipeline
  dgemma.train      optimizer, train state, jitted train step, training loop
  dgemma.checkpoint orbax checkpointing (the only module that calls orbax)
  dgemma.tracking   metric sinks: JSONL, wandb, no-op (process 0 only)
  dgemma.eval       task exact match per decoding mode, denoising metrics, NELBO, plots
  dgemma.convert    Hugging Face safetensors import/export (Gemma 4, diffusion_gemma)
  dgemma.inference  AR decoding and the block-diffusion sampler
  dgemma.config     strict YAML configs with inheritance and dotted overrides
  dgemma.cli        the `dgemma` command
"""

__version__ = "0.1.0"
__all__ = ["__version__"]

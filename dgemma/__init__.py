"""dgemma: turn an autoregressive Gemma 4 MoE LM into a block discrete-diffusion LM (DiffusionGemma) and back.

One concern per subpackage; layers, low to high (`.importlinter`, checked by tests/repo/test_layering.py): model <
diffusion | parallel < data | inference < eval | convert | checkpoint | tracking < config < train < planning < cli.
Nothing heavy is imported here.

Modules:
  model/       Gemma 4 MoE transformer + DiffusionGemma encoder / decoder / self-conditioning, KV cache, LoRA
  diffusion/   noise schedule, corruption, bridge posterior, ELBO, one-pass mask, the stage-1 and SD·RL losses
  parallel/    meshes, logical-axis sharding rules and checks, host-memory moves, multi-host init
  data/        synthetic verifiable tasks and rewards, local / GSM8K / TFDS sources, tokenizers, training layout, grain
  inference/   AR decoding, the entropy-bounded block sampler, the ancestral sampler, recorded rollouts and replay
  eval/        the held-out evaluator, denoising metrics, sampler frontier, diversity, statistics, plots, reports
  convert/     Hugging Face safetensors import / export (Gemma 4, diffusion_gemma), FP8, PEFT, `jax.export`
  checkpoint/  orbax checkpoints of the training state and params-only checkpoints
  tracking/    metric sinks: JSONL, wandb, no-op (process 0 only)
  config/      strict YAML run configs with `base:` inheritance, env and dotted overrides
  train/       optimizer, train state and step, the one trainer and its objectives, stage 2 (SD·RL), studies
  planning/    memory / FLOPs planner, deviceless compiles, launch rendering, the CPU rehearsal
  cli/         the `dgemma` command
  __main__     `python -m dgemma` = the `dgemma` command
  _lazy        lazy re-exports for the package `__init__` modules (PEP 562)
"""

__version__ = "0.1.0"
__all__ = ["__version__"]

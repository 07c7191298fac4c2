"""The `dgemma` command line: one entry point with a subcommand per module (`dgemma/cli/<name>.py`).

Each command module exposes `NAME`, `HELP`, `add_arguments(parser)` (its own arguments; `common.add_command` adds
the shared `--config` / overrides and registers it) and `run(args) -> int`, and can also be
run directly (`python -m dgemma.cli.train --config x.yaml trainer.steps=10`). Command modules import nothing heavy at
module level: jax, flax, transformers, torch are imported inside `run`, and `jax.distributed` is initialised only by
the commands that need it, inside `run`, never at import or config load.

Modules:
  main      the console entry point: builds the argparse tree from the command modules and dispatches
  __main__  `python -m dgemma.cli` = `dgemma`
  common    shared plumbing: `--config` / overrides, config loading, dispatch, model restore
  answers   sampled ids as text: answers cut at the stop, the stop reason, committed blocks streamed as text
  train     `dgemma train`: config-driven training (`trainer.objective`: ar, stage1, sdrl)
  sample    `dgemma sample`: generate with a trained model (diffusion, AR fallback, auto)
  eval      `dgemma eval`: exact match per task and decoding mode on held-out prompts, TPF, steps per block
  export    `dgemma export`: params checkpoint -> Hugging Face safetensors (bf16 / FP8, merged or PEFT adapters)
  convert   `dgemma convert`: Hugging Face Gemma 4 / DiffusionGemma checkpoint -> params checkpoint
  plan      `dgemma plan`: resolve a config and plan its memory and FLOPs per device
  launch    `dgemma launch`: render, check and submit a run (local | slurm | xpk | tpu-vm)
  rehearse  `dgemma rehearse`: the full-shape CPU rehearsal of a shipped run, only the widths shrunk
  demo      `dgemma demo`: the 30-second tour on the built-in tiny default
"""

COMMANDS: tuple[str, ...] = ("train", "sample", "eval", "export", "convert", "plan", "launch", "rehearse", "demo")
"""Subcommand module names, in `dgemma --help` order."""

"""The start-up that the study's checkpoint tools share (frontier.py, room.py): their common arguments; refuse a
missing checkpoint or a used --out before any work, load the config (with --tasks), and build the held-out prompts
disjoint from the config's own training stream and every --train-stream."""

from __future__ import annotations

import sys
from pathlib import Path

# where --tasks finds a task the config does not train (the toy regime's stage-0/1 mix)
TASK_CONFIG = Path(__file__).resolve().parent / "configs" / "common.yaml"


def add_checkpoint_arguments(ap) -> None:
    """The arguments `config_and_held_out` reads (but --out), and the decoding seeds, on an argparse parser."""
    ap.add_argument("--checkpoint", required=True, nargs="+",
                    help="params checkpoint (a directory of step directories); or one per --seeds entry, in order (a "
                         "trained arm: seed s is decoded with checkpoint s, so its CIs span training seeds)")
    ap.add_argument("--config", required=True, help="run config whose model, data and sampler sections apply")
    ap.add_argument("--tasks", nargs="+", default=None, help="default: the config's data.tasks")
    ap.add_argument("--train-stream", action="append", default=[], metavar="CONFIG:STEPS",
                    help="another training stream the held-out prompts must avoid (empty STEPS = trainer.steps)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--eval-per-task", type=int, default=48)
    ap.add_argument("--eval-batch", type=int, default=48)


def config_and_held_out(args, tool: str, overrides=()):
    """(cfg, held-out set) from a tool's parsed arguments (checkpoint, out, config, tasks, train_stream,
    eval_per_task, eval_batch), or the exit code after a one-line refusal on stderr naming `tool`: 2 for a missing
    checkpoint or an --out that holds files (never overwritten), 1 for held-out prompts that overlap training."""
    from dgemma.eval.heldout import build_held_out
    from dgemma.train.study import load_cfg, select_tasks

    out = Path(args.out)
    checkpoints = args.checkpoint if isinstance(args.checkpoint, list) else [args.checkpoint]
    for path in checkpoints:
        if not Path(path).is_dir():
            print(f"{tool}: --checkpoint {path}: no such checkpoint directory", file=sys.stderr)
            return 2
    if len(checkpoints) > 1 and len(checkpoints) != len(args.seeds):
        print(f"{tool}: {len(checkpoints)} --checkpoint directories for {len(args.seeds)} --seeds; give one, or one per "
              f"seed", file=sys.stderr)
        return 2
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"{tool}: --out {out} exists and is not an empty directory; choose a new one", file=sys.stderr)
        return 2
    cfg = load_cfg(args.config, list(overrides))
    if args.tasks:
        cfg = select_tasks(cfg, args.tasks, TASK_CONFIG)
    streams = [(load_cfg(args.config, []).data, cfg.trainer.steps)]
    for spec in args.train_stream:
        path, _, steps = spec.rpartition(":")
        c = load_cfg(path, [])
        streams.append((c.data, int(steps) if steps else c.trainer.steps))
    held = build_held_out(cfg.data, n_per_task=args.eval_per_task, batch_size=args.eval_batch, train_streams=streams)
    print(held.summary(), flush=True)
    if held.overlap != 0:
        print(f"{tool}: held-out prompts overlap the training stream ({held.overlap}); refusing", file=sys.stderr)
        return 1
    return cfg, held

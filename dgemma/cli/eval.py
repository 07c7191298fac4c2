"""`dgemma eval`: exact match per task for each decoding mode on held-out prompts, with TPF and steps per block.

    dgemma eval -c experiments/tiny_pipeline/stage1.yaml --checkpoint runs/tiny_pipeline/stage1/params \\
        --modes ar,diffusion,auto --batches 4 --plot-dir runs/eval sampler.max_steps=16

Held-out prompts are the config's task mix drawn with another seed and deduplicated: every prompt the config's
training stream reads in its `trainer.steps` steps (and those of each `--exclude` config, e.g. the stage-1 config a
stage-2 run started from) is dropped (`dgemma.eval.heldout`), ceil(batches x batch-size / tasks) prompts per task.
The overlap with training is printed and must be 0. Rewards are the tasks' exact-match rewards
(`dgemma.data.rewards`). `--plot-dir` also writes the commitment-dynamics heatmap and `eval.json` (with the held-out
prompts and their overlap).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from dgemma.cli import common

if TYPE_CHECKING:
    from dgemma.config import RunConfig
    from dgemma.data.config import DataConfig

NAME = "eval"
HELP = "exact match / TPF / steps per block on held-out task prompts, per decoding mode"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `dgemma eval` besides the shared config ones."""
    parser.add_argument("--checkpoint", metavar="PATH", required=True, help="params-only checkpoint")
    parser.add_argument("--modes", default="ar,diffusion,auto", help="comma-separated: ar, diffusion, auto")
    parser.add_argument("--batches", type=int, default=4, help="held-out batches")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--plot-dir", metavar="DIR", help="write eval.json and commitment.png here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-steps", type=int, metavar="N",
                        help="training steps whose prompts are excluded (default: the config's trainer.steps)")
    parser.add_argument("--exclude", action="append", default=[], metavar="CONFIG[:STEPS]",
                        help="also exclude the prompts this config's training stream reads (repeatable; STEPS "
                             "default: its trainer.steps)")


def _train_streams(cfg: RunConfig, args) -> list[tuple[DataConfig, int]]:
    """(data config, steps) of every training stream whose prompts the held-out set must avoid."""
    from dgemma.config import load_config

    streams = [(cfg.data, cfg.trainer.steps if args.train_steps is None else args.train_steps)]
    for spec in args.exclude:
        path, _, steps = spec.rpartition(":")
        if not steps.isdigit():  # no ":STEPS" suffix
            path, steps = spec, ""
        other = load_config(path, [])
        streams.append((other.data, int(steps) if steps else other.trainer.steps))
    return streams


def run(args: argparse.Namespace) -> int:
    cfg, done = common.load_or_print(args)
    if done:
        return common.EXIT_OK
    for flag, value in (("--batches", args.batches), ("--batch-size", args.batch_size)):
        if value < 1:
            raise common.CommandError(f"{flag} {value}: must be >= 1")
    if args.train_steps is not None and args.train_steps < 0:
        raise common.CommandError(f"--train-steps {args.train_steps}: must be >= 0")
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    bad = [m for m in modes if m not in ("ar", "diffusion", "auto")]
    if bad:
        print(f"dgemma eval: unknown mode(s) {bad}; choose from ar, diffusion, auto", file=sys.stderr)
        return common.EXIT_USAGE
    common.check_decodable(cfg.diffusion, modes)
    import json
    from pathlib import Path

    import jax

    from dgemma.eval.evaluator import evaluate
    from dgemma.eval.heldout import held_out_rows

    try:
        pipeline = held_out_rows(cfg.data, rows=args.batches * args.batch_size, batch_size=args.batch_size,
                                 train_streams=_train_streams(cfg, args), field="dgemma eval")
    except ValueError as e:
        raise common.CommandError(str(e)) from None
    print(pipeline.summary())
    model, _ = common.restore_model(cfg, args.checkpoint, sampling=True)
    # on the run's mesh, like the params: each batch split over its batch axes (not every device decoding it all)
    res = evaluate(model, pipeline, cfg.sampler, modes, key=jax.random.key(args.seed),
                   mesh=common.run_mesh(cfg.mesh), rules=cfg.mesh.rules)
    metrics = {m: res[m]["metrics"] for m in modes}
    tasks = sorted(k.split("/", 1)[1] for k in metrics[modes[0]] if k.startswith("exact_match/"))
    print("task".ljust(8) + "".join(m.rjust(11) for m in modes))
    for t in tasks:
        print(t.ljust(8) + "".join(f"{metrics[m][f'exact_match/{t}']:11.3f}" for m in modes))
    print("all".ljust(8) + "".join(f"{metrics[m]['exact_match']:11.3f}" for m in modes))
    for m in modes:
        extra = "" if m == "ar" else (f"  steps/block {metrics[m]['steps_per_block']:.2f}  "
                                      f"at max_steps {metrics[m]['pct_max_steps']:.0f}%")
        print(f"{m}: tokens/forward {metrics[m]['tpf']:.2f}{extra}\n  {res[m]['settings']}")
    if args.plot_dir:
        from dgemma.eval.plots import commitment_heatmap

        out = Path(args.plot_dir)
        out.mkdir(parents=True, exist_ok=True)
        for m in modes:
            commit = res[m].pop("commit_step", None)
            if commit is not None and m == "diffusion":
                commitment_heatmap(commit, res[m]["max_steps"], out / "commitment.png",
                                   "commit step per canvas position")
        res["held_out"] = {"overlap": pipeline.overlap, "per_task": pipeline.per_task(),
                           "dropped_overlap": pipeline.dropped_overlap,
                           "dropped_duplicate": pipeline.dropped_duplicate,
                           "prompts": [e.prompt for e in pipeline.examples]}
        (out / "eval.json").write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {out / 'eval.json'}")
    return common.EXIT_OK


if __name__ == "__main__":
    sys.exit(common.standalone(sys.modules[__name__]))

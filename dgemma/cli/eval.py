"""`dgemma eval`: exact match per task for each decoding mode on held-out prompts, with TPF and steps per block.

    dgemma eval -c experiments/tiny_pipeline/stage1.yaml --checkpoint runs/tiny_pipeline/stage1/params \\
        --modes ar,diffusion,auto --batches 4 --plot-dir runs/eval sampler.max_steps=16

Held-out prompts are the config's task mix drawn with another seed and deduplicated: every prompt the config's
training stream reads in its `trainer.steps` steps (and those of each `--exclude` config, e.g. the stage-1 config a
stage-2 run started from) is dropped (`dgemma.eval.heldout`), ceil(batches x batch-size / tasks) prompts per task.
The overlap with training is printed and must be 0. Rewards are the tasks' exact-match rewards
(`dgemma.data.rewards`). `--plot-dir` also writes the commitment-dynamics heatmap and `eval.json` (with the held-out
prompts and their overlap).

    dgemma eval -c configs/chat/tiny.yaml --checkpoint runs/chat_tiny/params \\
        --data data/chat/gsm8k_chat_heldout.jsonl --modes ar,diffusion

A config whose data are files (`data.source: messages`, json, gsm8k ...) is evaluated on the held-out file `--data`,
read as the config reads its training files (chat template, canvas, `data.messages.reward`: GSM8K's `#### N` or the
answer's exact text), every row in file order (`--batches` limits it); a file with a prompt the training streams read
is refused. Each mode's first `--show` answers are printed as text (cut at the end of turn), and `eval.json` holds
every answer's text.
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
    parser.add_argument("--data", metavar="FILE", help="held-out rows of a config whose data are files (a messages "
                        "jsonl for a chat config), read as its training files are")
    parser.add_argument("--batches", type=int, default=None,
                        help="held-out batches (default: 4 of drawn task prompts; every row of --data)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--plot-dir", metavar="DIR", help="write eval.json and commitment.png here")
    parser.add_argument("--show", type=int, default=3, metavar="N", help="answers printed as text per mode")
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


def _held_out(cfg, args):
    """The held-out set: drawn task prompts (synthetic data), or the rows of `--data` (file data)."""
    from dgemma.eval.heldout import TrainingOverlapError, held_out_file, held_out_rows

    synthetic = cfg.data.source == "synthetic"
    if synthetic and args.data:
        raise common.CommandError(f"--data {args.data}: the config's data are drawn task prompts (data.source="
                                  "synthetic), whose held-out prompts are drawn too; drop --data")
    if not synthetic and not args.data:
        raise common.CommandError(f"data.source={cfg.data.source!r}: give the held-out rows with --data FILE (read as "
                                  "the training files are)")
    streams = _train_streams(cfg, args)
    try:
        if synthetic:
            rows = (4 if args.batches is None else args.batches) * args.batch_size
            return held_out_rows(cfg.data, rows=rows, batch_size=args.batch_size, train_streams=streams,
                                 field="dgemma eval")
        from pathlib import Path

        if not Path(args.data).is_file():
            raise common.CommandError(f"--data {args.data}: no such file")
        rows = None if args.batches is None else args.batches * args.batch_size
        return held_out_file(cfg.data, args.data, batch_size=args.batch_size, train_streams=streams, rows=rows,
                             tokenizer=common.build_tokenizer(cfg))
    except TrainingOverlapError as e:
        raise common.CommandError(f"{e} (--train-steps 0 scores them anyway)") from None
    except ValueError as e:
        raise common.CommandError(common.one_line(e)) from None


def _add_answers(res, modes, held_out, show: int) -> None:
    """Each mode's answers as text (cut at the stop) and reference answers into its rows; the first `show` printed."""
    from dgemma.cli.answers import answer_text

    tok = held_out.tokenizer
    where = getattr(getattr(held_out, "pipeline", None), "source", None)
    where = getattr(where, "location", None) or (lambda i: f"example {i}")
    for m in modes:
        rows = res[m]["rows"]
        rows["text"] = [answer_text(tok, out) for out in rows["output"]]
        rows["reference"] = [held_out.source[i].answer for i in rows["index"]]
        if show:
            print(f"{m}: answers ({min(show, len(rows['text']))} of {len(rows['text'])})")
        for i, text, ref, r in list(zip(rows["index"], rows["text"], rows["reference"], rows["reward"]))[:show]:
            print(f"  {where(i)}: reward {r:g}  {text!r}  (reference {ref!r})")


def run(args: argparse.Namespace) -> int:
    cfg, done = common.load_or_print(args)
    if done:
        return common.EXIT_OK
    for flag, value in (("--batches", args.batches), ("--batch-size", args.batch_size)):
        if value is not None and value < 1:
            raise common.CommandError(f"{flag} {value}: must be >= 1")
    if args.show < 0:
        raise common.CommandError(f"--show {args.show}: must be >= 0")
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

    pipeline = _held_out(cfg, args)
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
    _add_answers(res, modes, pipeline, args.show)
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

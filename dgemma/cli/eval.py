"""`dgemma eval`: exact match per task for each decoding mode on held-out prompts, with TPF and steps per block.

    dgemma eval -c experiments/tiny_pipeline/stage1.yaml --checkpoint runs/tiny_pipeline/stage1/params \\
        --modes ar,diffusion,auto --batches 4 --plot-dir runs/eval sampler.max_steps=16

Held-out prompts are the config's data stream with another seed (`dgemma.eval.tasks.held_out_pipeline`); rewards are
the tasks' exact-match rewards (`dgemma.data.rewards`). `--plot-dir` also writes the commitment-dynamics heatmap and
`eval.json`.
"""

from __future__ import annotations

import argparse
import sys

from dgemma.cli import common

NAME = "eval"
HELP = "exact match / TPF / steps per block on held-out task prompts, per decoding mode"
ISSUE = "sampler"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(NAME, help=HELP, description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_config_args(parser)
    parser.add_argument("--checkpoint", metavar="PATH", required=True, help="params-only checkpoint")
    parser.add_argument("--modes", default="ar,diffusion,auto", help="comma-separated: ar, diffusion, auto")
    parser.add_argument("--batches", type=int, default=4, help="held-out batches")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--plot-dir", metavar="DIR", help="write eval.json and commitment.png here")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def run(args: argparse.Namespace) -> int:
    cfg, done = common.load_or_print(args)
    if done:
        return common.EXIT_OK
    for flag, value in (("--batches", args.batches), ("--batch-size", args.batch_size)):
        if value < 1:
            raise common.CommandError(f"{flag} {value}: must be >= 1")
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    bad = [m for m in modes if m not in ("ar", "diffusion", "auto")]
    if bad:
        print(f"dgemma eval: unknown mode(s) {bad}; choose from ar, diffusion, auto", file=sys.stderr)
        return common.EXIT_USAGE
    common.check_decodable(cfg, modes)
    import json
    from pathlib import Path

    import jax

    from dgemma.eval.tasks import evaluate_modes, held_out_pipeline
    from dgemma.inference.sampler import SamplerConfig

    pipeline = held_out_pipeline(cfg.data, args.batch_size)
    model, _ = common.restore_model(cfg, args.checkpoint, sampling=True)
    tok = pipeline.tokenizer
    scfg = SamplerConfig.from_section(cfg.sampler, eos_ids=tuple(tok.stop_ids), pad_id=tok.pad_id)
    res = evaluate_modes(model, pipeline, range(args.batches), scfg, modes, key=jax.random.key(args.seed))
    tasks = sorted(next(iter(res.values()))["exact_match"])
    print("task".ljust(8) + "".join(m.rjust(11) for m in modes))
    for t in tasks:
        print(t.ljust(8) + "".join(f"{res[m]['exact_match'][t]['exact_match']:11.3f}" for m in modes))
    for m in modes:
        extra = "" if m == "ar" else (f"  steps/block {res[m]['steps_per_block']:.2f}  "
                                      f"at max_steps {100 * res[m]['pct_max_steps']:.0f}%")
        print(f"{m}: tokens/forward {res[m]['tpf']:.2f}{extra}")
    if args.plot_dir:
        from dgemma.eval.plots import commitment_heatmap

        out = Path(args.plot_dir)
        out.mkdir(parents=True, exist_ok=True)
        for m in modes:
            commit = res[m].pop("commit_step", None)
            if commit is not None and m == "diffusion":
                commitment_heatmap(commit, scfg.max_steps, out / "commitment.png", "commit step per canvas position")
        (out / "eval.json").write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {out / 'eval.json'}")
    return common.EXIT_OK


if __name__ == "__main__":
    sys.exit(common.standalone(sys.modules[__name__]))

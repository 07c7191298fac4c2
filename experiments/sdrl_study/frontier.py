"""The sampler frontier of a checkpoint (`dgemma.eval.frontier`): the fair sampler-only baseline of the SD·RL study.

    python experiments/sdrl_study/frontier.py --checkpoint experiments/sdrl_study/checkpoint/stage1_agree \
        --config experiments/sdrl_study/configs/agree.yaml --tasks agree --out runs/frontier_agree

Decodes deduplicated held-out prompts (disjoint from the config's own training stream and every --train-stream) with
the base sampler of the config and with every setting of the sweep, once per seed, and writes --out/frontier.json
(the rows), frontier.md (the table, the frontier and the best sampler-only setting within 1 point of the default's
exact match) and frontier.png. Given one --checkpoint per seed (the seeds of a trained arm), seed s is decoded
with checkpoint s at key 1000 + s, and its diversity is each model's spread over its own keys, pooled. The sweep: the entropy bound x temperature product at the default K_max and stop
rule, then one axis at a time around the default (K_max, stability, the confidence and fixed-count accept rules).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# this folder's module (the folder is first on sys.path when the script runs)
from checkpoint_tools import add_checkpoint_arguments, config_and_held_out


def _temps(text: str) -> tuple[float, float]:
    hi, sep, lo = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"--temperatures: {text!r} is not T_MAX:T_MIN (e.g. 0.8:0.4)")
    return float(hi), float(lo)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(ap)
    ap.add_argument("--gamma", nargs="+", type=float, default=[0.03, 0.1, 0.3, 1.0, 3.0, 10.0])
    ap.add_argument("--temperatures", nargs="+", type=_temps, default=[(0.8, 0.4), (0.4, 0.2), (0.2, 0.1)],
                    metavar="T_MAX:T_MIN")
    ap.add_argument("--max-steps", nargs="*", type=int, default=[8, 16, 24])
    ap.add_argument("--stability", nargs="*", type=int, default=[0, 2])
    ap.add_argument("--accept-confidence", nargs="*", type=float, default=[0.5, 0.7, 0.9])
    ap.add_argument("--fixed-count-steps", nargs="*", type=int, default=[4, 8, 16],
                    help="K_max values of the fixed-count accept rule (ceil(L / K_max) positions per step)")
    ap.add_argument("--diversity", action="store_true",
                    help="add per many-answer task the entropy at free positions and the distinct-answer rate over the "
                         "seeds' keys, against the data's values (dgemma.eval.diversity)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="")
    return ap


def settings_of(args, base) -> list[dict]:
    """The sweep (module docstring, `dgemma.eval.frontier.around`), deduplicated, without the default itself."""
    from dgemma.eval.frontier import around

    return around(base, entropy_bound=args.gamma, temperatures=args.temperatures, max_steps=args.max_steps,
                  stability_threshold=args.stability, accept_confidence=args.accept_confidence,
                  fixed_count_steps=args.fixed_count_steps)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from dgemma.eval.frontier import best_sampler_only, pareto_front, plot_frontier, sweep, table_md
    from dgemma.inference.sampler_types import SamplerConfig
    from dgemma.train.study import restore

    got = config_and_held_out(args, "frontier")
    if isinstance(got, int):
        return got
    cfg, held = got
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # one checkpoint: every seed decodes it; one per seed: a trained arm (dgemma.eval.frontier.sweep)
    models = [restore(cfg, path) for path in args.checkpoint]
    model = models[0] if len(models) == 1 else models
    base = SamplerConfig.from_section(cfg.sampler)
    settings = settings_of(args, base)
    print(f"{len(settings) + 1} settings x {len(args.seeds)} seeds", flush=True)

    def progress(r):
        em, spb = r["exact_match"], r["steps_per_block"]
        wv = f"  word-valid {r['word_valid'][0]:.3f}" if "word_valid" in r else ""
        print(f"{r['label']:<40} EM {em[0]:.3f} [{em[1]:.3f}, {em[2]:.3f}]  steps/block {spb[0]:.2f}{wv}", flush=True)

    extra = {}
    if "agree" in held.per_task():  # partial credit: with exact match 0 everywhere the words still tell apart
        from dgemma.data.rewards import agree_word_validity

        extra["word_valid"] = agree_word_validity
    rows = sweep(model, held, cfg.sampler, settings, args.seeds, progress=progress, row_metrics=extra,
                 diversity=args.diversity)
    best, front = best_sampler_only(rows), pareto_front(rows)
    (out / "frontier.json").write_text(json.dumps(
        {"checkpoint": args.checkpoint, "config": args.config, "tasks": sorted(held.per_task()), "seeds": args.seeds,
         "held_out": held.summary(), "rows": rows, "frontier": front, "best_sampler_only": best}, indent=1) + "\n")
    title = args.title or f"{Path(args.checkpoint[0]).name}: {', '.join(sorted(held.per_task()))}"
    plot_frontier(rows, out / "frontier.png", title=title)
    for name in extra:
        plot_frontier(rows, out / f"frontier_{name}.png", title=title, y=name)
    md = (f"# Sampler frontier: {title}\n\n{held.summary()}; seeds {args.seeds} (sampler key 1000 + seed).\n"
          f"Base sampler: {rows[0]['text']}.\n\n{table_md(rows)}\n\nBest sampler-only setting within 1 point of the "
          f"default's exact match: **{rows[best]['label']}**.\n")
    (out / "frontier.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

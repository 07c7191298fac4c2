"""E2: the SD·RL study (docs/sdrl.md, experiments/sdrl_study/README.md) on the long-canvas toy regime: train arms from a
stage-1 checkpoint, evaluate, report.

    python experiments/sdrl_study/run.py --stage1 runs/toy/stage1/params                    # full: 4 arms x 3 seeds
    python experiments/sdrl_study/run.py --stage1 ... --arms sdrl --tasks perm --name e2c   # E2c (PERM)
    python experiments/sdrl_study/run.py --reduced --stage1 ...                             # CI: 1 seed, copy+sort

From the stage-1 checkpoint, each arm (rl_only, sd_only, sdrl, sdrl_curriculum) x seed runs `--iterations` SD·RL
iterations through the library entry point (`dgemma.train.sdrl.run_sdrl`). Every model (stage 1 and each arm x seed)
is then decoded on the same held-out prompts, deduplicated and disjoint from every training stream (stage 0, stage 1,
the AR control and the SD·RL prompt stream; the overlap is printed and must be 0), by the held-out evaluator
(`dgemma.eval.evaluator`): diffusion at the full budget and greedy AR (`dgemma.train.study`: configs, held-out
prompts, evaluation). Stage 1 is evaluated once per seed with that seed's sampler key, so its row has the same
sampling noise as the arms. Tables with CIs come from `dgemma.eval.study_report`, the figures, results.md and the
verdict from `sdrl_report.py` here; results.json holds the table, the settings and every run's iteration metrics.
Writes --out/results.json, results.md and the PNGs; results.md states what ran (seeds, iterations, settings).

`notebooks/sdrl_study.py` and tests/studies/test_sdrl_study.py load this file by path (`run_study`, `main`), with this
folder on sys.path while it loads (its own modules import by name, as when it runs as a script).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import sdrl_report as rep  # this folder's module: first on sys.path when run as a script or loaded by path

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE / "stage2.yaml"
# the toy regime's stage-0/1 mix: where --tasks / --retention-tasks find a task the stage-2 config lacks
TASK_CONFIG = HERE / "configs" / "common.yaml"
# training streams the held-out prompts avoid without --train-stream: stage 0, stage 1, the AR control
TRAIN_STREAMS = tuple(HERE / "configs" / n for n in ("stage0_ar.yaml", "stage1.yaml", "ar_control.yaml"))


def build_parser() -> argparse.ArgumentParser:
    """The study's command line (`dgemma.train.study.build_parser`) at this study's defaults."""
    from dgemma.train.study import build_parser as study_parser

    ap = study_parser(DEFAULT_CONFIG, train_streams=TRAIN_STREAMS, task_config=TASK_CONFIG)
    ap.description = __doc__
    return ap


def _headline(e: dict) -> str:
    m = e["diffusion"]["metrics"]
    return f"EM {m['exact_match']:.3f}, steps/block {m['steps_per_block']:.2f}, corpus TPF {m['tpf']:.2f}"


def run_study(args: argparse.Namespace) -> dict:
    """Run the study `args` describes (`build_parser`); writes --out/results.json, results.md, table.json and the
    figures, and returns results.json's content."""
    from dgemma.eval.evaluator import decoding_settings
    from dgemma.eval.study_report import machine_description, retention, summarize
    from dgemma.inference.sampler_types import SamplerConfig
    from dgemma.model.transformer import model_from_params
    from dgemma.train.sdrl import run_sdrl
    from dgemma.train.study import evaluate_model, held_out, load_cfg, refuse_foreign_run_dir, restore, run_history, \
        study_cfg, study_mesh

    if args.tasks is None:
        args.tasks = [t.name for t in load_cfg(args.config, args.override).data.tasks]
    if args.reduced:
        args.seeds, args.tasks, args.arms = [0], args.tasks[:2], ["sdrl"]
        args.eval_per_task = min(args.eval_per_task, 16)
    args.iterations = args.iterations or (3 if args.reduced else 20)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if args.compile_cache:  # every arm x seed builds the same programs: compile them once
        import jax

        jax.config.update("jax_compilation_cache_dir", str(Path(args.compile_cache).resolve()))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    for arm in args.arms:  # before any work: the same config resumes (a killed study continues where it stopped)
        for seed in args.seeds:
            refuse_foreign_run_dir(study_cfg(args, arm, seed))
    cfg0 = study_cfg(args, (args.arms or ["sdrl"])[0], args.seeds[0])
    held = held_out(args, cfg0)
    print(held.summary(), flush=True)
    if held.overlap != 0:
        raise SystemExit(f"held-out prompts overlap the training stream ({held.overlap}); refusing to report")
    K = cfg0.sampler.max_steps
    evals: dict[str, list[dict]] = {}

    def record(label: str, e: dict) -> None:
        evals.setdefault(label, []).append(e)
        evals.setdefault(f"{label}:ar", []).append(e)

    for label, path in [("stage1", args.stage1), *(spec.partition("=")[::2] for spec in args.extra)]:
        model = restore(cfg0, path)
        for seed in args.seeds:
            record(label, evaluate_model(model, held, cfg0, seed))
        print(f"{label}: {_headline(evals[label][-1])}", flush=True)
    histories: dict[str, list[list[dict]]] = {}
    for arm in args.arms:
        for seed in args.seeds:
            cfg = study_cfg(args, arm, seed)
            ts = time.time()
            summary = run_sdrl(cfg, progress=False, mesh=study_mesh(cfg))
            history = run_history(cfg, summary)
            histories.setdefault(arm, []).append(history)
            e = evaluate_model(model_from_params(cfg.model_config, summary.state.params), held, cfg, seed)
            record(arm, e)
            print(f"{arm} seed {seed}: {len(history)} iterations ({len(summary.history)} in this start) in "
                  f"{time.time() - ts:.0f} s, final K_max {summary.max_steps}; {_headline(e)}", flush=True)
            (out / "table.json").write_text(json.dumps(summarize(evals, args.tasks, args.retention_tasks),
                                                       indent=1) + "\n")  # so far
    table = summarize(evals, args.tasks, args.retention_tasks)
    (out / "table.json").write_text(json.dumps(table, indent=1) + "\n")  # kept even if a figure fails
    files = rep.plots(out, table, histories, evals, K)
    scfg = SamplerConfig.from_section(cfg0.sampler)
    perm = {k: rep.perm_diagnostics(held, v[0]) for k, v in evals.items() if not k.endswith(":ar")} \
        if "perm" in args.tasks else {}
    meta = {"machine": machine_description(), "kmax": K,
            "settings": {m: decoding_settings(scfg, m) for m in ("ar", "diffusion")},
            "ran": {"stage-1 checkpoint": args.stage1, "other checkpoints": ", ".join(args.extra) or "none",
                    "arms": ", ".join(args.arms) or "none (evaluation only)", "seeds": args.seeds,
                    "tasks": ", ".join(args.tasks),
                    "retention tasks (decoded, not trained)": ", ".join(args.retention_tasks) or "none",
                    "SD·RL iterations per run": args.iterations,
                    "config": f"{Path(args.config).name} + overrides: {' '.join(args.override) or 'none'}",
                    "Q prompts x G rollouts": f"{args.prompts} x {args.group_size}",
                    "held-out prompts per task": args.eval_per_task, "wall time": f"{time.time() - t0:.0f} s",
                    "figures": ", ".join(files)}}
    meta["verdict"] = rep.verdict(table, args.tasks)
    kept = retention(evals, args.retention_tasks)
    md = rep.report(meta, table, [*args.tasks, *args.retention_tasks], held.summary(), perm, kept)
    (out / "results.md").write_text(md)
    results = {"meta": meta, "table": table, "retention": kept, "histories": histories}
    (out / "results.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
    if args.results_md:
        Path(args.results_md).write_text(md)
    print(md)
    return results


def main(argv=None) -> int:
    run_study(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())

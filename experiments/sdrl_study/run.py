"""E2: the SD·RL study (issue 12, diffusion_math.md §12-§13) on the long-canvas toy regime.

    python experiments/sdrl_study/run.py --stage1 runs/toy/stage1/params                    # full: 4 arms x 3 seeds
    python experiments/sdrl_study/run.py --stage1 ... --arms sdrl --tasks perm --name e2c   # E2c (PERM)
    python experiments/sdrl_study/run.py --reduced --stage1 ...                             # CI: 1 seed, copy+sort

From the stage-1 checkpoint, each arm (rl_only, sd_only, sdrl, sdrl_curriculum) x seed runs `--iterations` SD·RL
iterations through the library entry point (`dgemma.train.sdrl.run_sdrl`, config `stage2.yaml`). Every model (stage 1
and each arm x seed) is then decoded on the same held-out prompts, deduplicated and disjoint from every training
stream (stage 0, stage 1, the AR control and the SD·RL prompt stream; the overlap is printed and must be 0):
  * diffusion at the full budget (K_max 48, EB sampler, argmax output) and greedy AR (the AR fallback);
  * exact match per task, mean steps per block, corpus tokens per forward (Σ tokens / Σ forwards; with commit passes;
    the per-row mean as a secondary column), entropy per step, commitment heatmaps.
Stage 1 is evaluated once per seed with that seed's sampler key, so its row has the same sampling noise as the arms.
Tables: mean over seeds with 95 % bootstrap CIs (seeds, then prompts). Figures: EM vs steps per block, corpus TPF vs
EM, entropy / accept fraction by step, reward and K_max over iterations, commitment heatmaps before/after.
Writes --out/results.json, results.md and the PNGs; results.md states what ran (seeds, iterations, settings).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ARMS = ("rl_only", "sd_only", "sdrl", "sdrl_curriculum")
TOY = ROOT / "configs" / "toy"
# training streams the held-out prompts must avoid: (config, steps read) -- stage 0, stage 1, the AR control
TRAIN_CONFIGS = ("stage0_ar.yaml", "stage1.yaml", "ar_control.yaml")


def machine_description() -> str:
    import os
    import platform

    import jax

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, {jax.default_backend()} (jax {jax.__version__}), shared with other jobs"


def load_cfg(path, overrides):
    from dgemma.config import load_config

    return load_config(path, list(overrides))


def study_cfg(args, arm: str, seed: int):
    tasks = ",".join(args.tasks)
    out = [f"run.output_dir={args.out}", f"run.name={args.name}_{arm}_s{seed}", f"run.seed={seed}",
           f"sdrl.arm={arm}", f"trainer.steps={args.iterations}", f"checkpoint.init_from={args.stage1}",
           f"sdrl.group_size={args.group_size}", f"data.batch_size={args.prompts}", *args.override]
    cfg = load_cfg(args.config, out)
    return _select_tasks(cfg, tasks.split(","))


def _select_tasks(cfg, names):
    import dataclasses

    from dgemma.data.config import TaskConfig

    have = {t.name: t for t in cfg.data.tasks}
    ref = {t.name: t for t in load_cfg(TOY / "common.yaml", []).data.tasks}  # perm's lengths: the stage-0/1 mix
    picked = []
    for n in names:
        if n not in have and n not in ref:
            raise SystemExit(f"--tasks: unknown task {n!r}; known: {sorted(set(have) | set(ref))}")
        picked.append(have.get(n) or ref[n])
    picked = [TaskConfig(**{**dataclasses.asdict(t), "weight": 1.0}) for t in picked]
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tasks=tuple(picked)))


def refuse_foreign_run_dir(cfg) -> None:
    """A run directory left by a study with other settings must not be resumed: the library allows a config change on
    resume (it warns and keeps the old config), which here would silently mix two arms' iterations in one row."""
    from dgemma.config import config_hash
    from dgemma.train.run_dir import recorded_config_sha

    run_dir = Path(cfg.run.run_dir)
    if recorded_config_sha(run_dir) not in (None, config_hash(cfg)):
        raise SystemExit(f"{run_dir}: holds a run with another config (e.g. other --override or --iterations); "
                         "choose another --out or --name, or delete that directory")


def run_history(cfg, summary) -> list[dict]:
    """Every iteration of the run: `summary.history` holds only this process's iterations, so a resumed run (a killed
    study restarted) reads its metrics.jsonl, which the tracker truncates to the restored step on resume."""
    from dgemma.tracking import read_jsonl

    path = Path(cfg.run.run_dir) / "metrics.jsonl"
    rows = read_jsonl(path) if cfg.logging.jsonl and cfg.trainer.log_every == 1 else []
    return rows if len(rows) >= len(summary.history) else summary.history


def study_mesh(cfg):
    """The config's mesh on the first devices it needs (a fixed-size mesh such as mesh/single.yaml runs on one device
    also where more are visible, e.g. the test suite's 8 simulated CPU devices)."""
    import math

    import jax

    from dgemma.parallel.mesh import make_mesh_from_config

    n = math.prod(int(v) for v in dict(cfg.mesh.ici).values()) * math.prod(int(v) for v in dict(cfg.mesh.dcn).values())
    return make_mesh_from_config(cfg.mesh, jax.devices()[:n] if n > 0 else None)


def held_out(args, cfg):
    """Deduplicated held-out prompts for the study's tasks, disjoint from stages 0/1, the AR control and SD·RL."""
    from dgemma.eval.heldout import build_held_out

    streams = [(cfg.data, args.iterations)]
    for spec in args.train_stream or [f"{TOY / n}:" for n in TRAIN_CONFIGS]:
        path, _, steps = spec.rpartition(":")
        c = load_cfg(path, [])
        streams.append((c.data, int(steps) if steps else c.trainer.steps))
    return build_held_out(cfg.data, n_per_task=args.eval_per_task, batch_size=args.eval_batch, train_streams=streams)


def restore(cfg, path):
    from dgemma.checkpoint import restore_params
    from dgemma.model.transformer import abstract_model, model_from_params
    from flax import nnx

    from dgemma.parallel.mesh import make_mesh
    from dgemma.parallel.rules import get_rules, state_shardings
    from dgemma.train.state import with_shardings

    abstract = nnx.state(abstract_model(cfg.model_config), nnx.Param)
    shardings = state_shardings(abstract, make_mesh({"fsdp": -1}), get_rules(cfg.mesh.rules))
    return model_from_params(cfg.model_config, restore_params(path, with_shardings(abstract, shardings)))


def evaluate(model, held, cfg, seed: int, max_steps: int | None = None) -> dict:
    import jax

    from dgemma.eval.tasks import evaluate_modes
    from dgemma.inference.sampler import SamplerConfig

    tok = held.tokenizer
    over = {"max_steps": max_steps} if max_steps else {}
    scfg = SamplerConfig.from_section(cfg.sampler, eos_ids=tuple(tok.stop_ids), pad_id=tok.pad_id, **over)
    return evaluate_modes(model, held, range(held.num_batches), scfg, ("ar", "diffusion"),
                          key=jax.random.key(1000 + seed))


def perm_diagnostics(held, res) -> dict:
    """E2c: validity, duplicate and missing digits of the PERM outputs (diffusion mode)."""
    from dgemma.data.rewards import perm_diagnostics as diag

    rows = res["diffusion"]["rows"]
    out = [diag(held.source[i], toks, held.tokenizer) for i, toks in zip(rows["index"], rows["output"])
           if held.source[i].task == "perm"]
    if not out:
        return {}
    return {k: float(np.mean([d[k] for d in out])) for k in out[0]}


def summarize(evals: dict[str, list[dict]], tasks: list[str]) -> dict:
    """Per label (stage1, arms, AR), per task: EM, steps per block, corpus TPF with 95 % bootstrap CIs over seeds."""
    from dgemma.eval.stats import hierarchical_ci, ratio_ci

    table = {}
    for label, per_seed in evals.items():
        mode = "ar" if label.endswith(":ar") else "diffusion"
        rows = [e[mode]["rows"] for e in per_seed]
        entry = {}
        for task in [*tasks, "all"]:
            sel = [np.asarray(r["task"]) == task if task != "all" else np.ones(len(r["task"]), bool) for r in rows]
            if not all(s.any() for s in sel):
                continue
            d = {"em": hierarchical_ci([np.asarray(r["reward"])[s] for r, s in zip(rows, sel)]),
                 "tpf": ratio_ci([np.asarray(r["tokens"])[s] for r, s in zip(rows, sel)],
                                 [np.asarray(r["forwards"])[s] for r, s in zip(rows, sel)]),
                 "tpf_total": ratio_ci([np.asarray(r["tokens"])[s] for r, s in zip(rows, sel)],
                                       [np.asarray(r["forwards"])[s] + np.asarray(r["commit_passes"])[s]
                                        for r, s in zip(rows, sel)]),
                 "n": int(sum(s.sum() for s in sel))}
            if mode == "diffusion":
                d["steps"] = hierarchical_ci([np.asarray(r["steps_per_block"], float)[s] for r, s in zip(rows, sel)])
            entry[task] = d
        entry["tpf_row_mean"] = float(np.mean([e[mode]["tpf_row_mean"] for e in per_seed]))
        table[label] = entry
    return table


def plots(out: Path, table: dict, histories: dict, evals: dict, max_steps: int, tasks: list[str]) -> list[str]:
    from dgemma.eval.plots import by_step, commitment_heatmap, tradeoff, training_curves

    files = []
    diff = {k: v["all"] for k, v in table.items() if not k.endswith(":ar")}
    tradeoff({k: {"x": v["steps"], "y": v["em"]} for k, v in diff.items()}, "x", "y", out / "em_vs_steps.png",
             "exact match vs mean steps per block (all tasks)", "mean decoder steps per block", "exact match")
    tradeoff({k: {"x": v["all"]["tpf"], "y": v["all"]["em"]} for k, v in table.items() if "all" in v}, "x", "y",
             out / "tpf_vs_em.png", "corpus tokens per forward vs exact match", "corpus tokens per forward",
             "exact match")
    files += ["em_vs_steps.png", "tpf_vs_em.png"]
    histories = {arm: [h for h in hs if h] for arm, hs in histories.items()}  # no record: nothing to plot
    histories = {arm: hs for arm, hs in histories.items() if hs}
    if histories:
        runs = {}
        for arm, hs in histories.items():  # mean over seeds per iteration
            n = min(len(h) for h in hs)
            runs[arm] = [{"step": i + 1, **{k: float(np.mean([h[i].get(k, np.nan) for h in hs]))
                                             for k in ("reward", "k_max", "steps_per_block", "tpf")}}
                         for i in range(n)]
        training_curves(runs, ["reward", "k_max", "steps_per_block", "tpf"], out / "iterations.png",
                        "SD·RL training rollouts (mean over seeds)")
        series = {}
        for arm, hs in histories.items():
            for tag, idx in (("first", 0), ("last", -1)):
                series[f"{arm} ({tag} iteration)"] = {
                    k: [float(np.mean([h[idx].get(f"{k}_step{j}", np.nan) for h in hs])) for j in range(1, 7)]
                    for k in ("entropy", "accept_frac")}
        by_step(series, ["entropy", "accept_frac"], out / "per_step_train.png",
                "training rollouts: mean entropy and accept fraction at steps 1-6")
        files += ["iterations.png", "per_step_train.png"]
    eval_series = {k: {"entropy": list(np.nanmean([e["diffusion"]["entropy_per_step"] for e in v], 0))}
                   for k, v in evals.items() if not k.endswith(":ar")}
    by_step(eval_series, ["entropy"], out / "per_step_eval.png", "held-out decoding: mean entropy by step (K_max)")
    files.append("per_step_eval.png")
    for label, per_seed in evals.items():
        if label.endswith(":ar"):
            continue
        commit = np.concatenate([np.asarray(e["diffusion"]["commit_step"]) for e in per_seed])
        commitment_heatmap(commit, max_steps, out / f"commitment_{label}.png", f"{label}: commit step per position")
        files.append(f"commitment_{label}.png")
    return files


def report(meta: dict, table: dict, tasks: list[str], held_summary: str, perm: dict) -> str:
    from dgemma.eval.stats import fmt_ci

    lines = ["# E2: SD·RL study results", "", f"machine: {meta['machine']}", "",
             "## What ran", "", *[f"- {k}: {v}" for k, v in meta["ran"].items()], "",
             "## Decoding settings", "", f"- {meta['settings']['diffusion']}", f"- {meta['settings']['ar']}", "",
             f"Held-out: {held_summary}", ""]
    base = table.get("stage1", {})
    for task in [*tasks, "all"]:
        lines += [f"## {task}", "", "| model | mode | EM [95% CI] | steps/block [95% CI] | Δ steps vs stage 1 | "
                  "corpus TPF [CI] | TPF incl. commits | n |", "|---|---|---|---|---|---|---|---|"]
        for label, entry in table.items():
            if task not in entry:
                continue
            d = entry[task]
            mode = "AR (greedy)" if label.endswith(":ar") else f"diffusion (argmax, K_max {meta['kmax']})"
            steps = fmt_ci(d["steps"], 2) if "steps" in d else "–"
            delta = "–"
            if "steps" in d and task in base and label != "stage1":
                delta = f"{100 * (d['steps'][0] / base[task]['steps'][0] - 1):+.0f} %"
            lines.append(f"| {label.removesuffix(':ar')} | {mode} | {fmt_ci(d['em'])} | {steps} | {delta} | "
                         f"{fmt_ci(d['tpf'], 2)} | {d['tpf_total'][0]:.2f} | {d['n']} |")
        lines.append("")
    lines += ["Per-row mean TPF (secondary; over-weights short answers): " +
              ", ".join(f"{k} {v['tpf_row_mean']:.2f}" for k, v in table.items()), ""]
    if perm:
        lines += ["## E2c: PERM diagnostics (diffusion outputs)", "",
                  *[f"- {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in d.items()) for label, d in perm.items()],
                  ""]
    lines += ["## Hypothesis (issue 12)", "", meta["verdict"], ""]
    return "\n".join(lines)


def verdict(table: dict, tasks: list[str]) -> str:
    """SD·RL (or + curriculum) cuts mean steps per block by >= 30 % vs stage 1 on every task, at EM >= stage 1 - 1
    point on every task (point estimates; the tables give the CIs)."""
    base = table.get("stage1")
    out = []
    for arm in ("sdrl", "sdrl_curriculum", "sd_only", "rl_only"):
        if arm not in table or base is None:
            continue
        present = [t for t in tasks if t in table[arm] and t in base]
        cuts = {t: 1 - table[arm][t]["steps"][0] / base[t]["steps"][0] for t in present}
        drops = {t: table[arm][t]["em"][0] - base[t]["em"][0] for t in present}
        ok = bool(present) and all(cuts[t] >= 0.30 and drops[t] >= -0.01 for t in present)
        cut_all = 1 - table[arm]["all"]["steps"][0] / base["all"]["steps"][0]
        per_task = ", ".join(f"{t} {100 * -cuts[t]:+.0f} %" for t in present)
        out.append(f"- {arm}: steps per block vs stage 1 {per_task} (all {100 * -cut_all:+.0f} %; target <= -30 % on "
                   "every task); EM change " + ", ".join(f"{t} {100 * v:+.1f} pts" for t, v in drops.items())
                   + f" -> {'meets' if ok else 'does NOT meet'} the target (point estimates; see CIs above)")
    return "\n".join(out) or "no arm ran"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage1", required=True, help="stage-1 params checkpoint (runs/toy/stage1/params)")
    ap.add_argument("--out", default="runs/sdrl_study")
    ap.add_argument("--name", default="e2")
    ap.add_argument("--config", default=str(HERE / "stage2.yaml"), help="stage-2 run config (default stage2.yaml)")
    ap.add_argument("--train-stream", action="append", default=None, metavar="CONFIG:STEPS",
                    help="a training stream the held-out prompts must avoid (repeatable; default: the toy stage 0, "
                         "stage 1 and AR-control configs at their trainer.steps; empty STEPS = trainer.steps)")
    ap.add_argument("--arms", nargs="*", default=list(ARMS), choices=ARMS,
                    help="in this order (none: evaluate the checkpoints only); table.json is rewritten after each run")
    ap.add_argument("--extra", action="append", default=[], metavar="LABEL=PARAMS",
                    help="another checkpoint to evaluate beside stage 1 (e.g. stage0=runs/toy/stage0_ar/params)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--tasks", nargs="+", default=None, help="default: the config's data.tasks")
    ap.add_argument("--iterations", type=int, default=None, help="SD·RL iterations per run (default 20; reduced 3)")
    ap.add_argument("--prompts", type=int, default=8, help="Q prompts per iteration")
    ap.add_argument("--group-size", type=int, default=4, help="G rollouts per prompt")
    ap.add_argument("--eval-per-task", type=int, default=64)
    ap.add_argument("--eval-batch", type=int, default=32)
    ap.add_argument("--reduced", action="store_true",
                    help="CI: 1 seed, the config's first two tasks, 3 iterations, sdrl vs stage 1")
    ap.add_argument("--results-md", default=None, help="also write results.md here (e.g. experiments/sdrl_study)")
    ap.add_argument("--compile-cache", default=None, help="persistent XLA compilation cache directory (optional)")
    ap.add_argument("--override", nargs="*", default=[], help="extra dotted overrides for stage2.yaml")
    args = ap.parse_args(argv)
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

    from dgemma.eval.tasks import decoding_settings
    from dgemma.inference.sampler import SamplerConfig
    from dgemma.train.sdrl import run_sdrl

    for arm in args.arms:  # before any work: the same config resumes (a killed study continues where it stopped)
        for seed in args.seeds:
            refuse_foreign_run_dir(study_cfg(args, arm, seed))
    cfg0 = study_cfg(args, (args.arms or ["sdrl"])[0], args.seeds[0])
    held = held_out(args, cfg0)
    print(held.summary(), flush=True)
    if held.overlap != 0:
        raise SystemExit(f"held-out prompts overlap the training stream ({held.overlap}); refusing to report")
    K = cfg0.sampler.max_steps
    stage1 = restore(cfg0, args.stage1)
    evals: dict[str, list[dict]] = {"stage1": [], "stage1:ar": []}
    for seed in args.seeds:
        e = evaluate(stage1, held, cfg0, seed)
        evals["stage1"].append(e)
        evals["stage1:ar"].append(e)
    print(f"stage 1: EM {e['diffusion']['exact_match']['all']['exact_match']:.3f}, steps/block "
          f"{e['diffusion']['steps_per_block']:.2f}, corpus TPF {e['diffusion']['tpf_corpus']:.2f}", flush=True)
    for spec in args.extra:
        label, _, path = spec.partition("=")
        model = restore(cfg0, path)
        for seed in args.seeds:
            e = evaluate(model, held, cfg0, seed)
            evals.setdefault(label, []).append(e)
            evals.setdefault(f"{label}:ar", []).append(e)
    histories: dict[str, list[list[dict]]] = {}
    for arm in args.arms:
        for seed in args.seeds:
            cfg = study_cfg(args, arm, seed)
            ts = time.time()
            summary = run_sdrl(cfg, progress=False, mesh=study_mesh(cfg))
            history = run_history(cfg, summary)
            histories.setdefault(arm, []).append(history)
            from dgemma.model.transformer import model_from_params

            model = model_from_params(cfg.model_config, summary.state.params)
            e = evaluate(model, held, cfg, seed)
            evals.setdefault(arm, []).append(e)
            evals.setdefault(f"{arm}:ar", []).append(e)
            print(f"{arm} seed {seed}: {len(history)} iterations ({len(summary.history)} in this start) in "
                  f"{time.time() - ts:.0f} s, final K_max {summary.budget}; EM "
                  f"{e['diffusion']['exact_match']['all']['exact_match']:.3f}, steps/block "
                  f"{e['diffusion']['steps_per_block']:.2f}, corpus TPF {e['diffusion']['tpf_corpus']:.2f}",
                  flush=True)
            (out / "table.json").write_text(json.dumps(summarize(evals, args.tasks), indent=1) + "\n")  # so far
    table = summarize(evals, args.tasks)
    (out / "table.json").write_text(json.dumps(table, indent=1) + "\n")  # kept even if a figure fails
    files = plots(out, table, histories, evals, K, args.tasks)
    scfg = SamplerConfig.from_section(cfg0.sampler)
    perm = {k: perm_diagnostics(held, v[0]) for k, v in evals.items() if not k.endswith(":ar")} \
        if "perm" in args.tasks else {}
    meta = {"machine": machine_description(), "kmax": K,
            "settings": {m: decoding_settings(scfg, m) for m in ("ar", "diffusion")},
            "ran": {"stage-1 checkpoint": args.stage1, "other checkpoints": ", ".join(args.extra) or "none",
                    "arms": ", ".join(args.arms) or "none (evaluation only)", "seeds": args.seeds,
                    "tasks": ", ".join(args.tasks), "SD·RL iterations per run": args.iterations,
                    "config": f"{Path(args.config).name} + overrides: {' '.join(args.override) or 'none'}",
                    "Q prompts x G rollouts": f"{args.prompts} x {args.group_size}",
                    "held-out prompts per task": args.eval_per_task, "wall time": f"{time.time() - t0:.0f} s",
                    "figures": ", ".join(files)}}
    meta["verdict"] = verdict(table, args.tasks)
    md = report(meta, table, args.tasks, held.summary(), perm)
    (out / "results.md").write_text(md)
    (out / "results.json").write_text(json.dumps({"meta": meta, "table": table, "histories": histories}, indent=1,
                                                 default=float) + "\n")
    if args.results_md:
        Path(args.results_md).write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

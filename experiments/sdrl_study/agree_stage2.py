"""Stage-2 arms on whole-answer AGREE against stage 1's sampler frontier, on the study's own held-out prompts.

    python experiments/sdrl_study/agree_stage2.py --out runs/s21_stage2/eval \
        --arm verified=runs/s21_stage2/a_verified/a_verified_sdrl --arm ...

Each --arm LABEL=PREFIX names the SD·RL runs PREFIX_s0, PREFIX_s1, ... that `experiments/sdrl_study/run.py` wrote
(one trained model per seed; seed s's model is decoded with sampler key 1000 + s). The held-out prompts are the ones
run.py builds for the same --config / --train-stream / --iterations / --eval-per-task (so stage 1's default row here
equals the study's). Stage 1 and every arm are swept over the same sampler grid (the AGREE frontier's:
gamma x temperatures at K_max 48, then K_max 16, stability 0, confidence 0.9, fixed-count at 8) at the config's
sampler, whatever the arm trained at (an arm trained at a tight K_max is still judged at the default sampler).
Per arm: the default row, its own best frontier point within 1 point of stage 1's default exact match, the
`dgemma.eval.frontier.versus` verdict against stage 1's best sampler-only row, the steps ratios the stage-2 target
asks for (>= 4x fewer than stage 1's default, >= 2x fewer than its best sampler-only row), the share of prompts that
stop at the stop rule's floor (2 steps: one to propose, one for the stability check), and from each run's
metrics.jsonl how often L_PG was non-zero and how often the teacher's output was the SD target.
Writes --out/agree_stage2.json and the table as --out/summary.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage1", default=str(HERE / "checkpoint" / "stage1_agree_whole"))
    ap.add_argument("--config", default=str(HERE / "configs" / "agree_whole_sdrl.yaml"))
    ap.add_argument("--train-stream", action="append", default=None, metavar="CONFIG:STEPS")
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--eval-per-task", type=int, default=32)
    ap.add_argument("--eval-batch", type=int, default=32)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--arm", action="append", default=[], metavar="LABEL=RUN_PREFIX")
    ap.add_argument("--no-grid", action="store_true", help="arms: the default row only (stage 1 keeps its grid)")
    ap.add_argument("--stage1-from", default=None, metavar="JSON",
                    help="reuse stage 1's rows from an earlier agree_stage2.json of the same prompts and seeds")
    ap.add_argument("--out", required=True)
    return ap


def settings():
    from dgemma.eval.frontier import grid, row_label

    common = dict(max_steps=[48], stability_threshold=[1], confidence_threshold=[0.005])
    temps = [(0.8, 0.4)]
    out = grid(entropy_bound=[0.1, 0.3, 1.0, 3.0], temperatures=[(0.8, 0.4), (0.2, 0.1)], **common)
    out += grid(entropy_bound=[0.1], temperatures=temps, **{**common, "max_steps": [16]})
    out += grid(entropy_bound=[0.1], temperatures=temps, **{**common, "stability_threshold": [0]})
    out += grid(accept=["confidence"], accept_confidence=[0.9], temperatures=temps, **common)
    out += grid(accept=["fixed_count"], temperatures=temps, **{**common, "max_steps": [8]})
    default = row_label(grid(entropy_bound=[0.1], temperatures=temps, **common)[0])
    return [s for s in out if row_label(s) != default]


def floor_share(models, held, sampler, seeds) -> dict:
    """Per-prompt steps per block at the default sampler: share of prompts at <= 2 steps, mean and min."""
    import jax
    import numpy as np

    from dgemma.eval.evaluator import evaluate

    spb = []
    for i, s in enumerate(seeds):
        m = models[i] if isinstance(models, list) else models
        spb += evaluate(m, held, sampler, ("diffusion",), key=jax.random.key(1000 + int(s)))["diffusion"]["rows"][
            "steps_per_block"]
    a = np.asarray(spb, np.float64)
    return {"at_most_2": float(np.mean(a <= 2.0)), "at_most_3": float(np.mean(a <= 3.0)), "min": float(a.min()),
            "mean": float(a.mean()), "n": int(a.size)}


def counters(run_dirs) -> dict:
    """From each run's metrics.jsonl: fraction of iterations with L_PG != 0, mean share of prompts whose SD target
    y* came from the teacher, and the reward / zero-std / gate means, pooled over the runs (seeds)."""
    import numpy as np

    from dgemma.tracking import read_jsonl

    rows = [r for d in run_dirs for r in read_jsonl(Path(d) / "metrics.jsonl") if "reward" in r]
    if not rows:
        return {}

    def mean(k):
        v = [r[k] for r in rows if k in r]
        return float(np.mean(v)) if v else float("nan")

    # L_PG's gradient is zero exactly when every group's rewards are equal (all advantages 0): zero_std_fraction 1
    return {"iterations": len(rows), "pg_nonzero": float(np.mean([r.get("loss_pg", 0.0) != 0.0 for r in rows])),
            "pg_signal": float(np.mean([r.get("zero_std_fraction", 1.0) < 1.0 for r in rows])),
            "target_from_teacher": mean("target_from_teacher"), "teacher_reward": mean("teacher_reward"),
            "reward": mean("reward"), "reward_min": float(min(r["reward"] for r in rows)),
            "zero_std_fraction": mean("zero_std_fraction"), "sd_gate_rate": mean("sd_gate_rate"),
            "train_steps_per_block": mean("steps_per_block"),
            "teacher_steps_per_block": mean("teacher_steps_per_block")}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from dgemma.eval.frontier import best_sampler_only, sweep, versus
    from dgemma.train.study import held_out, restore, study_cfg

    args.train_stream = args.train_stream or [f"{HERE}/configs/agree_whole.yaml:",
                                              f"{HERE}/configs/agree_whole_more.yaml:"]
    arms = [a.partition("=")[::2] for a in args.arm]
    for label, prefix in arms:
        for s in args.seeds:
            if not (Path(f"{prefix}_s{s}") / "params").is_dir():
                print(f"agree_stage2: --arm {label}: no params under {prefix}_s{s}", file=sys.stderr)
                return 2
    ns = argparse.Namespace(out="runs/unused", name="e", stage1=args.stage1, iterations=args.iterations,
                            group_size=4, prompts=8, override=[], config=args.config, tasks=["agree"],
                            task_config=None, train_stream=args.train_stream, default_train_streams=[],
                            eval_per_task=args.eval_per_task,
                            eval_batch=args.eval_batch)
    cfg = study_cfg(ns, "sdrl", 0)
    held = held_out(ns, cfg)
    print(held.summary(), flush=True)
    if held.overlap != 0:
        print("agree_stage2: held-out prompts overlap the training stream; refusing", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    grid = settings()

    def progress(r):
        em, spb = r["exact_match"], r["steps_per_block"]
        print(f"  {r['label']:<40} EM {em[0]:.3f} [{em[1]:.3f}, {em[2]:.3f}]  steps/block {spb[0]:.2f} "
              f"[{spb[1]:.2f}, {spb[2]:.2f}]", flush=True)

    if args.stage1_from:
        prev = json.loads(Path(args.stage1_from).read_text())
        if prev["held_out"] != held.summary() or prev["seeds"] != args.seeds:
            print(f"agree_stage2: --stage1-from {args.stage1_from}: other prompts or seeds", file=sys.stderr)
            return 2
        s1_result = prev["stage1"]
    else:
        s1_result = stage1_rows(args, cfg, held, grid, progress)
    s1, best = s1_result["rows"], s1_result["best_sampler_only"]
    ref_em = s1[0]["exact_match"][0]
    result = {"held_out": held.summary(), "seeds": args.seeds, "stage1": s1_result, "arms": {}}
    for label, prefix in arms:
        print(label, flush=True)
        runs = [f"{prefix}_s{s}" for s in args.seeds]
        models = [restore(cfg, f"{r}/params") for r in runs]
        rows = (sweep(models, held, cfg.sampler, [], args.seeds, progress=progress, diversity=True)
                + ([] if args.no_grid else sweep(models, held, cfg.sampler, grid, args.seeds, progress=progress,
                                                 include_default=False)))
        own = best_sampler_only(rows, reference=ref_em)
        d = rows[0]
        result["arms"][label] = {
            "runs": runs, "rows": rows, "own_best": own,
            "versus_best_sampler_only": versus(d, s1[best], reference=ref_em),
            "own_best_versus": None if own is None else versus(rows[own], s1[best], reference=ref_em),
            "ratio_vs_stage1_default": s1[0]["steps_per_block"][0] / d["steps_per_block"][0],
            "ratio_vs_best_sampler_only": s1[best]["steps_per_block"][0] / d["steps_per_block"][0],
            "em_within_1pt": bool(d["exact_match"][0] >= ref_em - 0.01 - 1e-12),
            "floor": floor_share(models, held, cfg.sampler, args.seeds), "counters": counters(runs)}
        (out / "agree_stage2.json").write_text(json.dumps(result, indent=1, default=float) + "\n")
    (out / "agree_stage2.json").write_text(json.dumps(result, indent=1, default=float) + "\n")
    (out / "summary.md").write_text(table(result))
    print(table(result))
    return 0


def stage1_rows(args, cfg, held, grid, progress) -> dict:
    from dgemma.eval.frontier import best_sampler_only, sweep
    from dgemma.train.study import restore

    print("stage 1", flush=True)
    model = restore(cfg, args.stage1)
    # diversity on the default row only (the 24 digits share one choice: pooled choice entropy and distinct answers
    # over keys tell a model that keeps both answers from one that collapsed onto one, which could stop in 1 step)
    rows = (sweep(model, held, cfg.sampler, [], args.seeds, progress=progress, diversity=True)
            + sweep(model, held, cfg.sampler, grid, args.seeds, progress=progress, include_default=False))
    return {"rows": rows, "best_sampler_only": best_sampler_only(rows),
            "floor": floor_share(model, held, cfg.sampler, args.seeds)}


def _ci(v, f="{:.2f}"):
    return f"{f.format(v[0])} [{f.format(v[1])}, {f.format(v[2])}]"


def _div(row) -> str:
    d = row.get("diversity", {}).get("agree")
    if not d:
        return " | "
    return (f"{d['entropy_pooled']:.2f} ({d['entropy_pooled_data']:.2f}) | {d['distinct']:.2f} "
            f"({d['distinct_data']:.2f})")


def table(result) -> str:
    s1 = result["stage1"]
    b = s1["rows"][s1["best_sampler_only"]]
    lines = ["| row | setting | EM [95 % CI] | steps / block [95 % CI] | x fewer vs stage-1 default | "
             "x fewer vs best sampler-only | prompts at <= 2 steps | L_PG != 0 (iterations) | y* from teacher "
             "(prompts) | train reward (min) | H pooled (data) | distinct (data) | vs best sampler-only |",
             "|" + "---|" * 13]
    d = s1["rows"][0]
    lines.append(f"| stage 1: default | default | {_ci(d['exact_match'], '{:.3f}')} | {_ci(d['steps_per_block'])} "
                 f"| 1.00 | {b['steps_per_block'][0] / d['steps_per_block'][0]:.2f} | {s1['floor']['at_most_2']:.2f} "
                 f"| | | | {_div(d)} | more steps |")
    lines.append(f"| stage 1: best sampler-only | {b['label']} | {_ci(b['exact_match'], '{:.3f}')} | "
                 f"{_ci(b['steps_per_block'])} | {d['steps_per_block'][0] / b['steps_per_block'][0]:.2f} | 1.00 | | "
                 f"| | | | | (the baseline) |")
    for label, a in result["arms"].items():
        r, c = a["rows"][0], a["counters"]
        lines.append(
            f"| {label}: default | default | {_ci(r['exact_match'], '{:.3f}')} | {_ci(r['steps_per_block'])} | "
            f"{a['ratio_vs_stage1_default']:.2f} | {a['ratio_vs_best_sampler_only']:.2f} | "
            f"{a['floor']['at_most_2']:.2f} | {c.get('pg_signal', float('nan')):.2f} | "
            f"{c.get('target_from_teacher', float('nan')):.2f} | {c.get('reward', float('nan')):.2f} "
            f"({c.get('reward_min', float('nan')):.2f}) | {_div(r)} | {a['versus_best_sampler_only']} |")
        if a["own_best"] not in (None, 0):
            o = a["rows"][a["own_best"]]
            lines.append(f"| {label}: own best point | {o['label']} | {_ci(o['exact_match'], '{:.3f}')} | "
                         f"{_ci(o['steps_per_block'])} | {d['steps_per_block'][0] / o['steps_per_block'][0]:.2f} | "
                         f"{b['steps_per_block'][0] / o['steps_per_block'][0]:.2f} | | | | | | | "
                         f"{a['own_best_versus']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

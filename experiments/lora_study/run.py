"""The LoRA study (README.md here): SD·RL with adapters (ranks 4, 16, 64; attention-only / attention + MLPs + experts)
vs full-parameter SD·RL at matched iterations from the many-answer stage-1 checkpoint. The grid as recorded in
results.md: `bash experiments/lora_study/grid.sh`; one arm set in one process:

    python experiments/lora_study/run.py --stage1 experiments/sdrl_study/checkpoint/stage1_choice --arms full r16_all

Every arm runs the `sdrl` arm of the SD·RL study (`dgemma.train.study`) for the same `--iterations` from the same
stage-1 checkpoint, seeds and SD·RL prompt stream; arms differ only in `lora` and `optim.lr`:

    full           lora.rank=0, optim.lr=--lr                      (every parameter trains)
    full_lr{LR}    lora.rank=0, optim.lr=LR                        (the lr control, e.g. full_lr3e-4)
    r{R}_attn      lora.rank=R, targets = the attention projections
    r{R}_all       lora.rank=R, targets = attention + dense / self-conditioning MLPs + the experts' grouped matmuls

The LoRA rule, one for every rank and target set, chosen before any run and never tuned on the held-out prompts:
alpha = `LORA_ALPHA` (fixed, so the adapter scale is alpha / r) and lr = `LORA_LR_FACTOR` x the full arm's lr.
At matched iterations that rule makes "adapters vs full" partly a comparison of step sizes; the lr control separates
the two: `full_lr{LR}` trains every parameter at the lr its name states (the only arm whose lr is not set by --lr),
so `full_lr3e-4` with --lr 3e-5 is full-parameter SD·RL at the adapters' lr (`arm_lr` gives every arm's lr).
Every model (stage 1 once per seed with that seed's sampler key, and each arm x seed) is decoded by the held-out
evaluator (`dgemma.eval.evaluator`) with the config's default diffusion sampler on one held-out set, built once and
disjoint from every training stream (`dgemma.train.study.held_out`; overlap must be 0). Per arm: exact match and steps
per block per task (mean [95 % CI] over seeds and prompts, `dgemma.eval.study_report.summarize`), the trainable
parameter count (the leaves the optimizer updates), seconds per iteration, the answer entropy at the free positions
over the seeds' decodings (`dgemma.eval.diversity.measure_rows`) and how many base leaves moved (0 for an adapter arm).
Tables, figures and results.md: `lora_report.py` here. Two processes on one --out share the runs (`shared_runs`); each
finished run is kept, so a killed grid restarts where it stopped.

`notebooks/lora_study.py` and tests/studies/test_lora_study.py load this file by path, with this folder on sys.path
while it loads (its own modules import by name, as when it runs as a script).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import sys
import time
from pathlib import Path

import lora_report as rep  # this folder's module: first on sys.path when run as a script or loaded by path
import numpy as np

__all__ = ["ATTENTION", "EVERYTHING", "LORA_ALPHA", "LORA_LR_FACTOR", "all_arms", "arm_lr", "arm_overrides",
           "build_parser", "held_out_once", "run_lora_study", "trainable_count"]

ATTENTION = (r"attn/[qkvo]_proj$",)
EVERYTHING = (r"attn/[qkvo]_proj$", r"mlp/(gate|up|down)$", r"experts/(gate|up|down)$")
LORA_ALPHA = 32.0  # fixed over ranks: scale alpha / r, so one lr serves every rank
LORA_LR_FACTOR = 10.0  # adapters take a larger lr than full-parameter training; one factor, all arms
RANKS = (4, 16, 64)
SDRL_STUDY = Path(__file__).resolve().parents[1] / "sdrl_study"  # the SD·RL study's configs and checkpoints
DEFAULT_CONFIG = SDRL_STUDY / "stage2_choice.yaml"
TASK_CONFIG = SDRL_STUDY / "configs" / "common.yaml"  # where --tasks finds a task the stage-2 config lacks
# training streams the held-out prompts avoid without --train-stream: the toy stage 0, stage 1, the AR control
TRAIN_STREAMS = tuple(SDRL_STUDY / "configs" / n for n in ("stage0_ar.yaml", "stage1.yaml", "ar_control.yaml"))


def all_arms(ranks=RANKS) -> list[str]:
    return ["full", *(f"r{r}_{t}" for t in ("attn", "all") for r in ranks)]


LR_CONTROL_PREFIX = "full_lr"  # full_lr<LR>: every parameter at the lr the name states (the lr control)


def _explicit_lr(arm: str) -> float | None:
    """The lr a `full_lr<LR>` arm names (a positive, finite number), else None."""
    if not arm.startswith(LR_CONTROL_PREFIX):
        return None
    try:
        lr = float(arm[len(LR_CONTROL_PREFIX):])
    except ValueError:
        return None
    return lr if math.isfinite(lr) and lr > 0 else None


def arm_lr(arm: str, full_lr: float) -> float:
    """optim.lr of `arm` given the full arm's lr (--lr): the module docstring's rule, one place."""
    if arm == "full":
        return full_lr
    explicit = _explicit_lr(arm)
    if explicit is not None:
        return explicit
    _rank_and_targets(arm)  # refuses an unknown name
    return full_lr * LORA_LR_FACTOR


def _rank_and_targets(arm: str) -> tuple[int, tuple[str, ...]]:
    rank, _, kind = arm[1:].partition("_")
    if not arm.startswith("r") or not rank.isdigit() or int(rank) < 1 or kind not in ("attn", "all"):
        raise SystemExit(f"--arms: unknown arm {arm!r}; arms are 'full', full_lr<lr> (e.g. full_lr3e-4) or "
                         "r<rank>_attn / r<rank>_all (e.g. r16_all)")
    return int(rank), ATTENTION if kind == "attn" else EVERYTHING


def arm_overrides(arm: str, full_lr: float) -> list[str]:
    """The config overrides that make `arm` (module docstring); a one-line error for an unknown arm name."""
    if arm == "full" or _explicit_lr(arm) is not None:
        return ["lora.rank=0", f"optim.lr={arm_lr(arm, full_lr)}"]
    rank, targets = _rank_and_targets(arm)
    return [f"lora.rank={rank}", f"lora.alpha={LORA_ALPHA}", f"lora.targets={list(targets)!r}",
            f"optim.lr={arm_lr(arm, full_lr)}"]


def arm_args(args: argparse.Namespace, arm: str) -> argparse.Namespace:
    """The SD·RL study's arguments for one arm (its own run name; the arm's overrides after the study's)."""
    return argparse.Namespace(**{**vars(args), "name": f"{args.name}_{arm}",
                                 "override": [*args.override, *arm_overrides(arm, args.lr)]})


def trainable_count(cfg, params) -> int:
    """Parameters the optimizer updates: leaves matching no `optim.freeze` regex (the adapters' freeze included)."""
    import jax

    from dgemma.train.lora_setup import optim_section
    from dgemma.train.optim import param_labels

    labels = jax.tree.leaves(param_labels(params, optim_section(cfg).freeze))
    return sum(math.prod(x.shape) for x, lab in zip(jax.tree.leaves(params), labels) if lab == "trainable")


def changed_base_leaves(stage1_model, summary) -> int:
    """How many of the stage-1 model's parameter leaves (the base) differ after the run (0 for every LoRA arm: frozen;
    -1: the trained paths are not the stage-1 model's)."""
    from flax import nnx

    start = {p: v[...] for p, v in nnx.to_flat_state(nnx.state(stage1_model, nnx.Param))}
    after = {p: v[...] for p, v in nnx.to_flat_state(summary.state.params) if not isinstance(v, nnx.LoRAParam)}
    if set(start) != set(after):  # not comparable leaf by leaf (reported as -1, never as unchanged)
        return -1
    return sum(not np.array_equal(np.asarray(start[p]), np.asarray(after[p])) for p in start)


def trained_model(cfg, params):
    """The trained model around `params` (with its adapters, unmerged, when the arm has them)."""
    from flax import nnx

    from dgemma.checkpoint.lora_params import LORA_KEY, abstract_adapted_model, lora_metadata
    from dgemma.model.transformer import model_from_params

    if not cfg.lora.enabled:
        return model_from_params(cfg.model_config, params)
    graphdef, _ = nnx.split(abstract_adapted_model(cfg.model_config, lora_metadata(cfg.lora)[LORA_KEY]), nnx.Param)
    return nnx.merge(graphdef, params)


def held_out_once(args, arms):
    """(the arms' configs per seed, the one held-out set). Arms must differ in nothing that feeds the held-out set
    (data section, iterations), else one set could not serve them all: refused, naming the arm."""
    from dgemma.train.study import held_out, refuse_foreign_run_dir, study_cfg

    cfgs = {arm: {s: study_cfg(arm_args(args, arm), "sdrl", s) for s in args.seeds} for arm in arms}
    cfg0 = cfgs[arms[0]][args.seeds[0]]
    for arm, per_seed in cfgs.items():
        for cfg in per_seed.values():
            if cfg.data != cfg0.data or cfg.sampler != cfg0.sampler:
                raise SystemExit(f"arm {arm}: its data or sampler section differs from {arms[0]}'s; the arms must "
                                 "share the prompt stream, the held-out prompts and the decoding settings")
            refuse_foreign_run_dir(cfg)
    held = held_out(args, cfg0)
    if held.overlap != 0:
        raise SystemExit(f"held-out prompts overlap the training stream ({held.overlap}); refusing to report")
    return cfgs, held


def build_parser(default_config: str | Path = DEFAULT_CONFIG) -> argparse.ArgumentParser:
    """The LoRA study's command line over `dgemma.train.study.build_parser` (same --stage1, --train-stream, ...);
    `default_config` is the stage-2 config used without --config."""
    from dgemma.train.study import build_parser as study_parser

    ap = study_parser(default_config, train_streams=TRAIN_STREAMS, task_config=TASK_CONFIG)
    ap.description = __doc__
    for action in ap._actions:  # the SD·RL study's own arm names do not apply here
        if action.dest == "arms":
            action.choices, action.default = None, all_arms()
            action.help = ("full, full_lr<lr> (the lr control), r<rank>_attn, r<rank>_all (default: full + ranks "
                           "4, 16, 64 x attn / all)")
    ap.set_defaults(out="runs/lora_study", name="lora", eval_per_task=48)
    ap.add_argument("--lr", type=float, default=3e-5,
                    help=f"the full arm's optim.lr; adapters take {LORA_LR_FACTOR:g} x it, alpha {LORA_ALPHA:g}")
    ap.add_argument("--figures", default=None, help="also copy the figures here (e.g. experiments/lora_study/figures)")
    ap.add_argument("--results-json", default=None, help="also write results.json here")
    return ap


def run_lora_study(args: argparse.Namespace) -> dict:
    """Run the study `args` describes; writes --out/results.json, results.md and the figures, and returns results."""
    import jax

    from dgemma.eval.diversity import measure_rows
    from dgemma.eval.evaluator import decoding_settings, evaluate
    from dgemma.eval.study_report import machine_description, summarize
    from dgemma.inference.sampler_types import SamplerConfig
    from dgemma.train.sdrl import run_sdrl
    from dgemma.train.study import load_cfg, restore, run_history, study_mesh

    if args.tasks is None:
        args.tasks = [t.name for t in load_cfg(args.config, args.override).data.tasks]
    args.iterations = args.iterations or 20
    arms = list(args.arms)
    owned = [o for o in args.override if o.split("=")[0] == "optim.lr" or o.startswith("lora.")]
    if owned:
        raise SystemExit(f"--override: {owned} are set per arm (the full arm's lr is --lr; the arms set lora.*)")
    if not arms:
        raise SystemExit("--arms: give at least one arm (e.g. full r16_all)")
    lrs = {a: arm_lr(a, args.lr) for a in arms}  # refuses an unknown arm name before anything is written
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if args.compile_cache:  # every seed of an arm builds the same programs: compile them once
        jax.config.update("jax_compilation_cache_dir", str(Path(args.compile_cache).resolve()))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    free = ("arms", "seeds", "results_md", "results_json", "figures", "compile_cache")  # no effect on a run's result
    settings = json.dumps({k: v for k, v in sorted(vars(args).items()) if k not in free}, default=str)
    recorded = out / "done" / "settings.json"
    if recorded.exists() and recorded.read_text() != settings:
        raise SystemExit(f"{recorded}: the runs kept in {out} were made with other settings; choose another --out")
    cfgs, held = held_out_once(args, arms)
    recorded.parent.mkdir(parents=True, exist_ok=True)
    recorded.write_text(settings)
    print(held.summary(), flush=True)
    cfg0 = cfgs[arms[0]][args.seeds[0]]

    def decode(model, seed):
        return evaluate(model, held, cfg0.sampler, ("diffusion",), key=jax.random.key(1000 + seed))

    stage1 = []

    def stage1_model():
        if not stage1:
            stage1.append(restore(cfg0, args.stage1))
        return stage1[0]

    def run(arm: str, seed: int) -> dict:
        """One arm x seed trained (stage 1: nothing trained) and decoded: {eval, history, trainable, s/iteration}."""
        if arm == "stage1":
            return {"eval": decode(stage1_model(), seed), "history": [], "trainable": 0, "seconds_per_iteration": 0.0}
        cfg = cfgs[arm][seed]
        ts = time.time()
        summary = run_sdrl(cfg, progress=False, mesh=study_mesh(cfg))
        history = run_history(cfg, summary)
        if len(history) != args.iterations:
            raise SystemExit(f"arm {arm} seed {seed}: {len(history)} iterations, not --iterations "
                             f"{args.iterations}; arms must be matched")
        te = time.time()
        e = decode(trained_model(cfg, summary.state.params), seed)
        m = e["diffusion"]["metrics"]
        print(f"{arm} seed {seed}: {len(history)} iterations in {te - ts:.0f} s, evaluated in {time.time() - te:.0f} "
              f"s; EM {m['exact_match']:.3f}, steps/block {m['steps_per_block']:.2f}", flush=True)
        spi = summary.wall_seconds / summary.steps_run if summary.steps_run else float("nan")
        return {"eval": e, "history": history, "trainable": trainable_count(cfg, summary.state.params),
                "seconds_per_iteration": spi, "base_leaves_changed": changed_base_leaves(stage1_model(), summary)}

    done = shared_runs(out, [(a, s) for a in ["stage1", *arms] for s in args.seeds], run)
    evals = {a: [done[(a, s)]["eval"] for s in args.seeds] for a in ["stage1", *arms]}
    histories = {a: [done[(a, s)]["history"] for s in args.seeds] for a in arms}
    info = {a: {"trainable": done[(a, args.seeds[0])]["trainable"],
                "seconds_per_iteration": float(np.nanmean([done[(a, s)]["seconds_per_iteration"]
                                                           for s in args.seeds])),
                "base_leaves_changed": [done[(a, s)].get("base_leaves_changed", 0) for s in args.seeds]}
            for a in ["stage1", *arms]}
    table = summarize(evals, args.tasks)
    for label, per_seed in evals.items():  # diversity over the seeds' decodings (>= 2 needed)
        div = measure_rows(held, [e["diffusion"]["rows"] for e in per_seed]) if len(per_seed) > 1 else {}
        for task in args.tasks:
            if task in table[label] and task in div:
                table[label][task]["entropy_free"] = div[task]["entropy_free"]
                table[label][task]["entropy_free_data"] = div[task]["entropy_free_data"]
        table[label]["trainable"] = info[label]["trainable"]
        table[label]["seconds_per_iteration"] = info[label]["seconds_per_iteration"]
        table[label]["base_leaves_changed"] = info[label]["base_leaves_changed"]
    scfg = SamplerConfig.from_section(cfg0.sampler)
    meta = {"machine": machine_description(), "arms": ["stage1", *arms], "arm_lr": lrs,
            "settings": decoding_settings(scfg, "diffusion"),
            "ran": {"stage-1 checkpoint": args.stage1, "seeds": args.seeds, "tasks": ", ".join(args.tasks),
                    "SD·RL iterations per run (every arm)": args.iterations,
                    "config": f"{Path(args.config).name} + overrides: {' '.join(args.override) or 'none'}",
                    "full-parameter lr": args.lr,
                    "LoRA rule": f"alpha {LORA_ALPHA:g} for every rank (scale alpha/r), lr {LORA_LR_FACTOR:g} x "
                                 f"{args.lr:g} = {args.lr * LORA_LR_FACTOR:g} for every arm",
                    "lr control": (", ".join(f"{a}: every parameter at lr {lrs[a]:g}" for a in arms
                                             if _explicit_lr(a) is not None) or "none ran"),
                    "Q prompts x G rollouts": f"{args.prompts} x {args.group_size}",
                    "held-out prompts per task": args.eval_per_task, "wall time": f"{time.time() - t0:.0f} s"}}
    files = rep.plots(out, table, args.tasks, meta["arms"])
    meta["ran"]["figures"] = ", ".join(files)
    md = rep.report(meta, table, args.tasks, held.summary(), figure_dir=".")
    results = {"meta": meta, "table": table, "histories": histories}
    (out / "results.md").write_text(md)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
    if args.results_md:  # its figure link points at the copies in --figures (else at --out's)
        fig_dir = Path(args.figures) if args.figures else out
        rel = os.path.relpath(fig_dir.resolve(), Path(args.results_md).resolve().parent)
        Path(args.results_md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.results_md).write_text(rep.report(meta, table, args.tasks, held.summary(), figure_dir=rel))
    if args.results_json:
        Path(args.results_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.results_json).write_text(json.dumps(results, indent=1, default=float) + "\n")
    if args.figures:
        import shutil

        Path(args.figures).mkdir(parents=True, exist_ok=True)
        for f in files:
            shutil.copy(out / f, Path(args.figures) / f)
    print(md)
    return results



def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def shared_runs(out: Path, keys: list[tuple[str, int]], run, *, poll_s: float = 10.0) -> dict:
    """{key: run(*key)} for every key, shared among the processes started on the same --out (the grid runs two):
    each result is kept in out/done/<arm>_s<seed>.pkl (a restarted study reuses it); a process claims a key by
    creating out/done/<arm>_s<seed>.claim (its pid) and skips keys another live process holds, then waits for them.
    A claim whose process is gone is taken over."""
    d = out / "done"
    d.mkdir(parents=True, exist_ok=True)
    results = {}
    while len(results) < len(keys):
        waiting = False
        for arm, seed in keys:
            if (arm, seed) in results:
                continue
            path, claim = d / f"{arm}_s{seed}.pkl", d / f"{arm}_s{seed}.claim"
            if path.exists():
                results[(arm, seed)] = pickle.loads(path.read_bytes())
                continue
            try:
                fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                try:
                    holder = int(claim.read_text() or 0)
                except (OSError, ValueError):
                    holder = 0
                if not holder or _alive(holder):  # (0: its creator has not written its pid yet)
                    waiting = True
                    continue
                claim.write_text(str(os.getpid()))  # its process is gone: take it over
            else:
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
            result = run(arm, seed)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(pickle.dumps(result))
            tmp.replace(path)
            claim.unlink(missing_ok=True)
            results[(arm, seed)] = result
        if waiting and len(results) < len(keys):
            time.sleep(poll_s)
    return results


def main(argv=None) -> int:
    run_lora_study(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())

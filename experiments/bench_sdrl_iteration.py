#!/usr/bin/env python
"""One SD·RL iteration broken down by phase, and recorded rollouts vs the plain sampler on the same batch (CPU).

    python experiments/bench_sdrl_iteration.py                       # configs/stage2/tiny.yaml, 3 iterations
    python experiments/bench_sdrl_iteration.py --iterations 4 --reps 5 --json /tmp/bench_sdrl.json sdrl.group_size=4
    python experiments/bench_sdrl_iteration.py --compare --reps 5 --config experiments/sdrl_study/stage2.yaml
        checkpoint.init_from=experiments/sdrl_study/checkpoint/stage1_toy   # (one line) previous vs current path

What it measures (docs/benchmarks_sdrl.md):

1. **Breakdown of one iteration** (`dgemma.train.sdrl.run_sdrl` on the config, `trainer.steps = --iterations`, no
   checkpoints, one device): the loop's own per-phase clocks, i.e. `time_student_rollouts` (Q·G recorded student
   rollouts), `time_teacher_rollout` (Q greedy teacher rollouts at K_T), `time_scoring` (rewards, advantages,
   targets y*, state rows), `time_old_ref_passes` (log π_old and π_ref, or the reference logits for the exact KL, by
   the training forward without gradient) and `time_update` (μ × minibatches AdamW steps on (4.2)). Iteration 1
   includes compiling every program; the steady state is the mean over iterations 2..N. Each phase is also given as
   a share of its iteration (ratios within the same run, robust to the machine's load).
2. **Recording vs the plain sampler on the same batch**: the iteration's student rollout (`rollout`: the first data
   batch's Q prompts × G, per-row keys, `record_states=True`) against `sample(record_states=False)` on exactly the
   same repeated prompts, keys and weights, after one warm-up call each; interleaved rounds (drift hits both alike),
   min and median; target ratio ≤ 1.15.

3. **--compare**: the previous implementation against the current one on the same iteration. A one-iteration
   `run_sdrl` captures the inputs of its iteration (the train state, reference, batch, index, K_max); then
   `Iteration.run` runs on copies of them with the previous path (`Iteration.shared_prefix = False`: every state row
   replays its rollout's clean stream itself) and the current one (`shared_prefix = True`: once per distinct clean
   stream, `dgemma.inference.replay_shared`), one warm-up each, then `--reps` interleaved rounds; per-phase medians
   of both, the ratio of the medians, whether the metrics (all but the clocks) and the updated parameters are
   bit-identical, and where they are not the largest absolute and relative differences (the clean stream's
   gradient is summed over the rows that read it, so fp32 summation order changes).

Weights: `checkpoint.init_from` if given as an override, else the run seed's random init (`sdrl.allow_random_init`;
then most blocks run to K_max: the most expensive case for rollouts and state rows). Positional arguments are config overrides.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TARGET = 1.15
PHASES = ("student_rollouts", "teacher_rollout", "scoring", "old_ref_passes", "update")


def breakdown(cfg) -> dict:
    """Per-phase seconds of every iteration of a `run_sdrl` run, iteration 1 and the mean of the rest."""
    from dgemma.train.sdrl import run_sdrl

    summary = run_sdrl(cfg, progress=False)
    its = [{p: m[f"time_{p}"] for p in PHASES} | {"states": m["states"], "steps_per_block": m.get("steps_per_block"),
                                                  "k_max": m["k_max"]} for m in summary.history]
    for it in its:
        it["total"] = sum(it[p] for p in PHASES)
    rest = its[1:] or its
    steady = {p: statistics.mean(it[p] for it in rest) for p in (*PHASES, "total")}
    share = {p: statistics.mean(it[p] / it["total"] for it in rest) for p in PHASES}
    return {"iterations": its, "first": its[0], "steady": steady, "steady_share": share,
            "wall_seconds": summary.wall_seconds}


def recording_ratio(cfg, reps: int) -> dict:
    """Recorded rollout vs the plain sampler on the first batch's Q·G rows (same keys, weights, compiled loop)."""
    import jax
    import numpy as np
    from flax import nnx

    from dgemma.checkpoint import restore_params
    from dgemma.data.pipeline import DataPipeline
    from dgemma.inference.rollout import repeat_prompts, rollout
    from dgemma.inference.sampler import sample
    from dgemma.model.transformer import Transformer
    from dgemma.parallel.mesh import make_mesh_from_config
    from dgemma.train.sdrl.teacher import student_sampler

    model = Transformer(cfg.model_config, rngs=nnx.Rngs(cfg.run.seed))
    if cfg.checkpoint.init_from:
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                              nnx.state(model, nnx.Param))
        nnx.update(model, restore_params(cfg.checkpoint.init_from, target))
    mesh, rules = make_mesh_from_config(cfg.mesh), cfg.mesh.rules
    P, G = cfg.data.layout.prompt_len, cfg.sdrl.group_size
    batch = DataPipeline(cfg.data).batch(0)
    prompts = np.asarray(batch["tokens"])[:, :P]
    valid = np.asarray(batch["prompt_mask"])[:, :P].astype(bool)
    scfg = student_sampler(cfg, cfg.sampler.max_steps, cfg.data.layout.n_blocks * cfg.model_config.canvas_length)
    key = jax.random.key(7)
    rep, rep_valid = repeat_prompts(prompts, valid, G)
    rows = np.arange(rep.shape[0])

    def recorded():
        ro = rollout(model, prompts, valid, scfg, key, group_size=G, mesh=mesh, rules=rules)
        jax.block_until_ready(ro.record)
        return ro

    def plain():
        res = sample(model, rep, rep_valid, scfg.replace(record_states=False), key, mode="diffusion", row_ids=rows,
                     mesh=mesh, rules=rules)
        jax.block_until_ready(res.tokens)
        return res

    ro, res = recorded(), plain()  # warm-up: compile both
    same = bool(np.array_equal(np.asarray(ro.tokens), np.asarray(res.tokens)))
    times = {"plain": [], "record": []}
    for _ in range(reps):
        for name, fn in (("plain", plain), ("record", recorded)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    out = {f"{k}_{stat}": f(v) for k, v in times.items() for stat, f in (("min", min), ("median", statistics.median))}
    out.update(ratio_min=out["record_min"] / out["plain_min"], ratio_median=out["record_median"] / out["plain_median"],
               rows=int(rep.shape[0]), steps_per_block=float(np.asarray(ro.result.steps_per_block).mean()),
               identical_tokens=same, record_bytes=int(ro.record.nbytes()), reps=reps,
               ratio_per_round=[r / p for r, p in zip(times["record"], times["plain"], strict=True)])
    return out


PATHS = {"previous": {"shared_prefix": False, "ran_states_only": False},  # `Iteration` class flags
         "current": {"shared_prefix": True, "ran_states_only": True}}


def _max_diff(a, b) -> tuple[float, float]:
    """(max |a - b|, max |a - b| / |a|) over the elements (|a| of 0: the absolute difference)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    d = np.abs(a - b)
    return float(d.max(initial=0.0)), float(np.max(d / np.where(a == 0, 1.0, np.abs(a)), initial=0.0))


def compare(cfg, reps: int) -> dict:
    """Previous (`PATHS`) vs current implementation of one iteration on the same captured inputs: per-phase medians
    over `reps` interleaved rounds after one warm-up each, and how far apart the results are."""
    import jax
    import jax.numpy as jnp

    from dgemma.inference.replay_shared import STATE_INDEX
    from dgemma.train.sdrl import iteration as iteration_lib
    from dgemma.train.sdrl import run_sdrl

    captured = {}
    run = iteration_lib.Iteration.run

    def capture(self, state, reference, ema, batch, i, max_steps):  # keep copies: the train step donates the state
        if not captured:
            copy = lambda t: None if t is None else jax.tree.map(jnp.copy, t)  # noqa: E731
            captured.update(it=self, state=copy(state), reference=copy(reference), ema=copy(ema), batch=dict(batch),
                            i=i, max_steps=max_steps)
        return run(self, state, reference, ema, batch, i, max_steps)

    iteration_lib.Iteration.run = capture
    try:
        run_sdrl(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, steps=1)), progress=False)
    finally:
        iteration_lib.Iteration.run = run
    it = captured["it"]

    def once(name: str):
        for flag, value in PATHS[name].items():
            setattr(it, flag, value)
        state = jax.tree.map(jnp.copy, captured["state"])
        state, m, _ = it.run(state, captured["reference"], captured["ema"], captured["batch"], captured["i"],
                             captured["max_steps"])
        return jax.device_get(state.params), m

    fed = []  # what the current path's replays were fed: (state rows, (row, block) states, states that ran, run)
    batch_of = iteration_lib.shared_prefix_batch

    def counting(rows, *args, **kw):
        out = batch_of(rows, *args, **kw)
        if STATE_INDEX in out:
            fed.append((len(rows), rows.state_ran.size, int(rows.state_ran.sum()), len(out[STATE_INDEX])))
        return out

    iteration_lib.shared_prefix_batch = counting
    try:
        results = {name: once(name) for name in PATHS}  # warm-up: compiles
    finally:
        iteration_lib.shared_prefix_batch = batch_of
    times = {name: [] for name in PATHS}
    for _ in range(reps):
        for name in PATHS:
            params, m = once(name)
            times[name].append({p: m[f"time_{p}"] for p in PHASES})
            results[name] = (params, m)
    for flag, value in PATHS["current"].items():
        setattr(it, flag, value)
    (p_old, m_old), (p_new, m_new) = results["previous"], results["current"]
    p0 = jax.device_get(captured["state"].params)
    leaves = list(zip(jax.tree.leaves(p_old), jax.tree.leaves(p_new), jax.tree.leaves(p0), strict=True))
    same_params = all(np.array_equal(a, b) for a, b, _ in leaves)
    param_diff = max((_max_diff(a, b) for a, b, _ in leaves), key=lambda d: d[0])
    # the scale to read the difference against: the update itself (Adam's step: ~lr per element)
    step_size = max(float(np.abs(a - z).max(initial=0.0)) for a, _, z in leaves)
    keys = sorted(k for k in m_old if not k.startswith("time_"))
    differ = [k for k in keys if not (m_old[k] == m_new[k] or (m_old[k] != m_old[k] and m_new[k] != m_new[k]))]
    metric_diff = {k: _max_diff(m_old[k], m_new[k]) for k in differ}
    med = {name: {p: statistics.median(t[p] for t in ts) for p in PHASES} for name, ts in times.items()}
    for name in med:
        med[name]["total"] = statistics.median(sum(t.values()) for t in times[name])
    return {"median": med, "ratio": {p: med["previous"][p] / med["current"][p] for p in (*PHASES, "total")},
            "per_round": times, "identical_params": same_params, "identical_metrics": not differ,
            "differing_metrics": differ, "metric_diff": metric_diff, "param_max_abs_diff": param_diff[0],
            "param_max_rel_diff": param_diff[1], "update_max_abs": step_size,
            "paths": PATHS, "reps": reps,
            "replayed": [dict(zip(("rows", "states", "ran", "replayed"), f, strict=True)) for f in fed]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(REPO / "configs/stage2/tiny.yaml"))
    ap.add_argument("--iterations", type=int, default=3, help="SD·RL iterations (>= 2: the first compiles)")
    ap.add_argument("--reps", type=int, default=5, help="interleaved rounds of the recording-vs-plain timing")
    ap.add_argument("--compare", action="store_true",
                    help="only the previous vs current implementation of one iteration (interleaved, --reps rounds)")
    ap.add_argument("--json", default=None)
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    import jax

    from dgemma.config import load_config

    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(args.config, [f"run.output_dir={tmp}", "run.name=bench", f"trainer.steps={args.iterations}",
                                        "checkpoint.every=0", "trainer.eval_every=0", "logging.jsonl=false",
                                        "sdrl.allow_random_init=true", *args.overrides])
        if args.compare:
            out = compare(cfg, args.reps)
            print(f"machine: 2-core AMD EPYC VM, CPU only, jax {jax.__version__}; load {load0:.2f} -> "
                  f"{os.getloadavg()[0]:.2f}; {args.reps} interleaved rounds, medians")
            print(f"{'phase':18s}{'previous s':>12s}{'current s':>12s}{'ratio':>8s}")
            for p in (*PHASES, "total"):
                print(f"{p:18s}{out['median']['previous'][p]:12.3f}{out['median']['current'][p]:12.3f}"
                      f"{out['ratio'][p]:8.2f}")
            print(f"paths: {PATHS}")
            for f in out["replayed"]:  # one line per jitted replay call of the current path's warm-up
                print(f"  replay call: {f['rows']} state rows, {f['states']} (row, block) states, {f['ran']} ran, "
                      f"{f['replayed']} replayed (bucketed)")
            print(f"bit-identical params: {out['identical_params']}; metrics: {out['identical_metrics']}")
            print(f"params: max abs diff {out['param_max_abs_diff']:.3g}, max rel diff {out['param_max_rel_diff']:.3g}"
                  f" (the update itself: max |step| {out['update_max_abs']:.3g})")
            for k, (a, r) in out["metric_diff"].items():
                print(f"  metric {k}: abs diff {a:.3g}, rel diff {r:.3g}")
            if args.json:
                Path(args.json).write_text(json.dumps(out, indent=2, default=float))
            return out
        t0 = time.perf_counter()
        it = breakdown(cfg)
        t1 = time.perf_counter()
        rec = recording_ratio(cfg, args.reps)
        t2 = time.perf_counter()
    s = cfg.sdrl
    out = {"config": str(Path(args.config).resolve().relative_to(REPO)) if REPO in Path(args.config).resolve().parents
           else args.config, "overrides": args.overrides, "iterations": args.iterations,
           "setting": dict(Q=cfg.data.batch_size, G=s.group_size, K_max=cfg.sampler.max_steps,
                           K_teacher=s.teacher_max_steps(cfg.sampler.max_steps), blocks=cfg.data.layout.n_blocks,
                           L=cfg.model_config.canvas_length, V=cfg.model_config.vocab_size,
                           layers=cfg.model_config.num_hidden_layers, H=cfg.model_config.hidden_size,
                           inner_epochs=s.inner_epochs, minibatches=s.num_minibatches, kl=s.kl_estimator,
                           weights=bool(cfg.checkpoint.init_from) and str(cfg.checkpoint.init_from) or "random init"),
           "breakdown": it, "recording": rec, "seconds": {"breakdown": t1 - t0, "recording": t2 - t1},
           "load_avg_1min": [load0, os.getloadavg()[0]],
           "machine": f"2-core AMD EPYC VM, CPU only, jax {jax.__version__}, shared with other work"}
    st = out["setting"]
    print(f"machine: {out['machine']}; load {load0:.2f} -> {out['load_avg_1min'][1]:.2f}")
    print(f"{out['config']} {' '.join(args.overrides)}: Q {st['Q']} x G {st['G']}, K_max {st['K_max']} (teacher "
          f"{st['K_teacher']}), {st['blocks']} blocks of L {st['L']}, V {st['V']}, {st['layers']} layers H {st['H']}, "
          f"mu {st['inner_epochs']} x {st['minibatches']} minibatch(es), KL {st['kl']}, weights: {st['weights']}")
    print(f"{'phase':18s}{'iter 1 (compile) s':>20s}{'steady s':>11s}{'share':>8s}")
    for p in (*PHASES, "total"):
        share = f"{100 * it['steady_share'][p]:7.1f}%" if p != "total" else f"{100.0:7.1f}%"
        print(f"{p:18s}{it['first'][p]:20.2f}{it['steady'][p]:11.2f}{share}")
    print(f"states per iteration {it['first']['states']:.0f}, steps/block {it['first']['steps_per_block']}")
    print(f"recording vs plain sampler, {rec['rows']} rows, steps/block {rec['steps_per_block']:.1f}: plain "
          f"{rec['plain_min']:.3f} s (median {rec['plain_median']:.3f}), recorded {rec['record_min']:.3f} s (median "
          f"{rec['record_median']:.3f}); ratio {rec['ratio_min']:.3f} (median {rec['ratio_median']:.3f}) target <= "
          f"{TARGET}; identical tokens: {rec['identical_tokens']}; record {rec['record_bytes'] / 1e6:.1f} MB")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=float))
    return out


if __name__ == "__main__":
    main()

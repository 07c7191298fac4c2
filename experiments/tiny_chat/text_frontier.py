"""Stage 1's sampler frontier on text: generative perplexity and answer entropy at matched steps per block.

    python experiments/tiny_chat/text_frontier.py --out runs/text_frontier            # the shipped checkpoints
    python experiments/tiny_chat/text_frontier.py --stage0 runs/tiny_chat_s1/stage0_ar/params \
        --stage1 runs/tiny_chat_s1/stage1/params --out runs/text_frontier_s1

On the tiny chat job's held-out conversations (GSM8K rows no training step or tokenizer merge saw, the same rows and
order as run.py's report), the stage-1 model is decoded with the diffusion sampler at a ladder of settings that trade
steps per block against quality: the job's default (entropy-bounded accept, K_max 32), a lower temperature, a larger
entropy bound, and the fixed-count rule at K_max 16 / 8 / 4 / 2 / 1 (ceil(32 / K) positions per step). For every
setting it reports, beside steps per block and tokens per forward: generative perplexity of the answers under the
stage-0 AR model (`dgemma.eval.genppl`) and answer entropy (unigram over the pooled answer tokens, and per prompt
across sampler keys), because a lower temperature lowers perplexity by itself: never read one without the other
(the SD·RL issue's text measurement). Stage 0's greedy AR answers and the reference answers are the two anchors.

Writes --out/text_frontier.json, text_frontier.md and text_frontier.png (perplexity and unigram entropy against steps
per block); --out must be new or empty (never overwritten).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHECKPOINT = HERE / "checkpoint"
# (label, SamplerConfig changes) in the order of the table; K_max = the canvas (32) unless the setting says otherwise
LADDER = (("EB default", {}),
          ("EB, tau 0.4 -> 0.2", {"t_max": 0.4, "t_min": 0.2}),
          ("EB, gamma 1.0", {"entropy_bound": 1.0}),
          *((f"fixed-count K {k}", {"accept": "fixed_count", "max_steps": k}) for k in (16, 8, 4, 2, 1)))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage0", default=str(CHECKPOINT / "stage0_ar"), help="stage-0 (AR) params: the scorer")
    ap.add_argument("--stage1", default=str(CHECKPOINT / "stage1"), help="stage-1 params: the model decoded")
    ap.add_argument("--rows", type=int, default=32, help="held-out conversations (a multiple of --batch)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--keys", type=int, default=3, help="sampler keys per setting (per-prompt entropy needs >= 2)")
    ap.add_argument("--seed", type=int, default=0, help="sampler key seed (run.py's run.seed)")
    ap.add_argument("--settings", nargs="*", default=None, metavar="LABEL",
                    help=f"a subset of the ladder by label (default all: {[label for label, _ in LADDER]})")
    ap.add_argument("--out", required=True)
    return ap


def tiny_chat_job():
    """run.py of this folder (the job's data, decoding and measures), under a name no other study's run.py shares."""
    import importlib.util

    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    spec = importlib.util.spec_from_file_location("tiny_chat_run", HERE / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refuse(msg: str) -> int:
    print(f"text_frontier: {msg}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    ladder = [(label, change) for label, change in LADDER if args.settings is None or label in args.settings]
    unknown = sorted(set(args.settings or ()) - {label for label, _ in LADDER})
    out = Path(args.out)
    for flag, path in (("--stage0", args.stage0), ("--stage1", args.stage1)):
        if not Path(path).is_dir():
            return refuse(f"{flag} {path}: no such checkpoint directory")
    if unknown:
        return refuse(f"--settings {unknown}: not in the ladder {[label for label, _ in LADDER]}")
    if args.keys < 2 or args.rows < 1 or args.batch < 1 or args.rows % args.batch:
        return refuse(f"--keys {args.keys} (>= 2), --rows {args.rows}, --batch {args.batch} (rows a positive multiple"
                      " of batch)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        return refuse(f"--out {out} exists and is not an empty directory; choose a new one")

    import dataclasses

    import jax

    from dgemma.data.gsm8k_chat import write_gsm8k_chat
    from dgemma.eval.diversity import plugin_entropy
    from dgemma.eval.evaluator import decoding_settings, held_out_pipeline
    from dgemma.eval.study_report import machine_description
    from dgemma.inference.sampler_types import SamplerConfig
    from dgemma.train.study import restore

    job = tiny_chat_job()
    SAMPLER_MAX_STEPS, answer_text, decode_all, diversity, gen_ppl, load, reference_answers = (
        job.SAMPLER_MAX_STEPS, job.answer_text, job.decode_all, job.diversity, job.gen_ppl, job.load,
        job.reference_answers)
    from build_data import GSM8K

    out.mkdir(parents=True, exist_ok=True)
    t_all, c_all = time.perf_counter(), time.process_time()
    paths = write_gsm8k_chat(str(GSM8K), str(out / "data"))
    extra = [f"data.paths=[{paths['train']}]", f"run.seed={args.seed}"]
    cfg0, cfg1 = load("stage0_ar.yaml", out, extra), load("stage1.yaml", out, extra)
    held = held_out_pipeline(dataclasses.replace(cfg1.data, paths=[paths["heldout"]]), args.batch)
    if len(held.source) < args.rows:
        return refuse(f"{paths['heldout']}: {len(held.source)} held-out conversations fit the layout; --rows {args.rows}")
    batches = list(range(args.rows // args.batch))
    tok = held.tokenizer
    stop_ids, pad_id = tuple(tok.stop_ids), int(tok.pad_id)
    model0, model1 = restore(cfg0, args.stage0), restore(cfg1, args.stage1)
    base = SamplerConfig.from_section(cfg1.sampler).replace(max_steps=SAMPLER_MAX_STEPS)
    key = jax.random.key(args.seed)

    def measure(label, model, sampler, mode, keys):
        t0, c0 = time.perf_counter(), time.process_time()
        runs = decode_all(model, held, sampler, label, mode, batches, key, keys, max_steps=None)["runs"]

        def mean(name):  # over the keys (one value per key's decoding)
            values = [r["metrics"].get(name) for r in runs]
            return None if values[0] is None else sum(values) / len(values)

        row = {"label": label, "settings": decoding_settings(sampler, mode), "steps_per_block": mean("steps_per_block"),
               "tokens_per_forward": mean("tpf"), "exact_match": mean("exact_match"),
               "gen_ppl": gen_ppl(model0, held, batches, runs, stop_ids, pad_id),
               "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0, **diversity(tok, runs)}
        print(f"{label:<22} steps/block {row['steps_per_block'] or float('nan'):6.2f}  gen ppl "
              f"{row['gen_ppl']['gen_ppl']:7.2f}  unigram H {row['unigram_entropy']:.2f}  format "
              f"{row['format_share']:.2f}  ({row['cpu_seconds']:.0f} CPU s)", flush=True)
        return row

    results: dict = {"machine": machine_description(), "stage0": args.stage0, "stage1": args.stage1,
                     "rows": args.rows, "keys": args.keys, "seed": args.seed}
    refs = reference_answers(held, batches)
    ref_texts = [answer_text(tok, a) for a in refs]
    results["reference"] = {"gen_ppl": gen_ppl(model0, held, batches, [{"rows": {"output": refs}}], stop_ids, pad_id),
                            "unigram_entropy": plugin_entropy([t for a in ref_texts for t in tok.encode(a)]) + 0.0}
    results["stage0_ar"] = measure("stage 0, AR (greedy)", model0, base, "ar", 1)
    results["ladder"] = [measure(label, model1, base.replace(**change), "diffusion", args.keys)
                         for label, change in ladder]
    results["total_seconds"], results["total_cpu_seconds"] = time.perf_counter() - t_all, time.process_time() - c_all
    (out / "text_frontier.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
    (out / "text_frontier.md").write_text(report_md(results))
    plot(results, out / "text_frontier.png")
    print((out / "text_frontier.md").read_text())
    return 0


def report_md(r: dict) -> str:
    from dgemma.eval.stats import fmt_ci

    ref = r["reference"]
    lines = [f"# Stage 1's text frontier (tiny chat): {r['rows']} held-out conversations x {r['keys']} sampler keys",
             "", f"Machine: {r['machine']}. Stage 0 (scorer): `{r['stage0']}`; stage 1: `{r['stage1']}`; sampler key "
             f"seed {r['seed']}. Reference answers: generative perplexity {ref['gen_ppl']['gen_ppl']:.2f}, unigram "
             f"entropy {ref['unigram_entropy']:.2f}. Time {r['total_seconds']:.0f} s wall, "
             f"{r['total_cpu_seconds']:.0f} CPU s.", "",
             "| decoding | steps / block | tokens / forward | gen. perplexity (stage 0) | unigram entropy | per-prompt "
             "entropy across keys [95 % CI] | `#### N` format | exact match |", "|---|---|---|---|---|---|---|---|"]
    for row in [r["stage0_ar"], *r["ladder"]]:
        spb = "–" if row["steps_per_block"] is None else f"{row['steps_per_block']:.2f}"
        tpf = "–" if row["tokens_per_forward"] is None else f"{row['tokens_per_forward']:.2f}"
        ppe = fmt_ci(row["per_prompt_entropy"]) if "per_prompt_entropy" in row else "– (greedy)"
        lines.append(f"| {row['label']} | {spb} | {tpf} | {row['gen_ppl']['gen_ppl']:.2f} | "
                     f"{row['unigram_entropy']:.2f} | {ppe} | {row['format_share']:.2f} | {row['exact_match']:.3f} |")
    lines += ["", "Decoding settings (one line each):", ""]
    lines += [f"- {row['label']}: {row['settings']}" for row in [r["stage0_ar"], *r["ladder"]]]
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = r["ladder"]
    x = [row["steps_per_block"] for row in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, name, ref, ar in ((axes[0], "generative perplexity (stage 0)", r["reference"]["gen_ppl"]["gen_ppl"],
                               r["stage0_ar"]["gen_ppl"]["gen_ppl"]),
                              (axes[1], "unigram answer entropy (nats)", r["reference"]["unigram_entropy"],
                               r["stage0_ar"]["unigram_entropy"])):
        y = [row["gen_ppl"]["gen_ppl"] if name.startswith("gen") else row["unigram_entropy"] for row in rows]
        ax.plot(x, y, "o")
        for xi, yi, row in zip(x, y, rows):
            ax.annotate(row["label"], (xi, yi), fontsize=7)
        ax.axhline(ref, color="g", ls="--", label="reference answers")
        ax.axhline(ar, color="k", ls=":", label="stage 0, AR greedy")
        ax.set_xlabel("steps per block (canvas 32)")
        ax.set_ylabel(name)
        ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    fig.suptitle("tiny chat stage 1: diffusion sampler settings on held-out conversations")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

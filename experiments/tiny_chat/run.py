"""The tiny chat job (the second main job): AR fine-tuning on conversations, stage-1 conversion, a text report.

    python experiments/tiny_chat/run.py                 # full: 500 AR + 250 stage-1 steps (README.md: the time)
    python experiments/tiny_chat/run.py --quick         # CI-sized: a few steps, a few held-out conversations

The tiny Gemma-4-architecture model (configs/chat/tiny.yaml: tiny_toy with the tiny-chat tokenizer) is trained on
GSM8K as chat (the user asks, the assistant answers with the worked solution ending `#### N`): stage 0 with the AR
objective, stage 1 with the block-diffusion objective initialised from stage 0 (experiments/tiny_pipeline's recipe).
Rows that do not fit the layout (common.yaml) are skipped and counted. On held-out conversations (GSM8K rows the
tokenizer and training never saw, `dgemma.data.gsm8k_chat`) it reports:
  * sample conversations decoded by stage 0 (AR), stage 1 (AR) and stage 1 (diffusion), side by side;
  * generative perplexity of every decoding's answers under the stage-0 AR model (`dgemma.eval.genppl`), and of the
    reference answers as the floor a fluent answer reaches;
  * answer entropy: unigram (plug-in entropy of the pooled answer tokens) and per prompt across sampler keys (plug-in
    entropy of the K answers of a prompt, at most ln K; 0 = every key gave the same answer), with bootstrap CIs;
  * exact match (GSM8K's `#### N` equals the reference) and the share of answers in the expected format (a `#### N`
    line), tokens per forward and steps per block (`dgemma.eval.evaluator`);
  * wall-clock text tokens per second at batch 1, diffusion vs AR, on the stage-1 weights (after a warm-up call).
Outputs in --out: report.md, metrics.json, curves.png, commitment.png, entropy_per_step.png (and each stage's run dir
with metrics.jsonl and checkpoints; re-running resumes them). Times are CPU seconds (`time.process_time`) beside wall.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SAMPLER_MAX_STEPS = 32  # K_max per canvas of 32 (entropy bound and temperatures: the sampler section's defaults)
EVAL_ROWS, EVAL_BATCH, KEYS, SHOWN = 32, 8, 3, 3  # held-out conversations, their batch, sampler keys, shown in full
QUICK = ["trainer.steps=4", "trainer.log_every=2", "checkpoint.every=4", "optim.warmup_steps=1", "data.batch_size=2"]
QUICK_EVAL = dict(rows=4, batch=4, keys=2, shown=2)
FORMAT = re.compile(r"####\s*-?[\d,]*\.?\d+\s*$", re.MULTILINE)  # GSM8K's final-answer line


def load(name: str, out: Path, extra: list[str]):
    from dgemma.config import load_config

    return load_config(HERE / name, [f"run.output_dir={out}", *extra])


def answer_text(tok, ids) -> str:
    """A generation as text, cut before its first stop token (the answer the reward reads)."""
    from dgemma.data.rewards import cut_at_eos

    head, _ = cut_at_eos(ids, tok)
    return tok.decode(head, skip_special_tokens=True).strip()


def decode_all(model, held, sampler, label: str, mode: str, batches, key, keys: int,
               max_steps: int | None = SAMPLER_MAX_STEPS) -> dict:
    """`dgemma.eval.evaluator.evaluate` once per sampler key (fold_in(key, k)); AR greedy decodes once (deterministic).
    `max_steps` None: the sampler's own K_max (text_frontier.py's fixed-count ladder)."""
    import jax

    from dgemma.eval.evaluator import Decoding, evaluate

    runs = []
    for k in range(1 if mode == "ar" else keys):
        t0, c0 = time.perf_counter(), time.process_time()
        res = evaluate(model, held, sampler, [Decoding(label, mode, max_steps)], batches=batches,
                       key=jax.random.fold_in(key, k))[label]
        res["seconds"], res["cpu_seconds"] = time.perf_counter() - t0, time.process_time() - c0
        runs.append(res)
    return {"runs": runs, "settings": runs[0]["settings"]}


def diversity(tok, runs: list[dict]) -> dict:
    """Unigram answer entropy (pooled tokens of the first key's answers) and per-prompt entropy across keys."""
    from dgemma.eval.diversity import plugin_entropy
    from dgemma.eval.stats import bootstrap_ci

    first = [answer_text(tok, o) for o in runs[0]["rows"]["output"]]
    pooled = [t for o in runs[0]["rows"]["output"] for t in tok.encode(answer_text(tok, o))]
    out = {"unigram_entropy": plugin_entropy(pooled) + 0.0 if pooled else float("nan"), "answer_tokens": len(pooled),
           "keys": len(runs), "format_share": sum(bool(FORMAT.search(a)) for a in first) / len(first)}
    if len(runs) > 1:
        per_prompt = [plugin_entropy([answer_text(tok, r["rows"]["output"][i]) for r in runs]) + 0.0
                      for i in range(len(first))]
        out.update(per_prompt_entropy=bootstrap_ci(per_prompt), per_prompt_entropy_max=math.log(len(runs)),
                   distinct=sum(len({answer_text(tok, r["rows"]["output"][i]) for r in runs}) for i in
                                range(len(first))) / (len(first) * len(runs)))
    return out


def gen_ppl(scorer, held, batches, runs: list[dict], stop_ids, pad_id) -> dict:
    """Generative perplexity of the answers of every key under `scorer`, pooled over keys."""
    import numpy as np

    from dgemma.eval.genppl import answer_tokens, generative_perplexity

    batch = [held.batch(s) for s in batches]
    P = batch[0]["tokens"].shape[1] - batch[0]["diffusion_weight"].shape[1]
    prompts = np.concatenate([b["tokens"][:, :P] for b in batch])
    valid = np.concatenate([b["valid"][:, :P] for b in batch]).astype(bool)
    answers = [answer_tokens(o, stop_ids, pad_id) for r in runs for o in r["rows"]["output"]]
    k = len(runs)
    out = generative_perplexity(scorer, np.tile(prompts, (k, 1)), np.tile(valid, (k, 1)), answers)
    return {key: out[key] for key in ("gen_ppl", "nll", "tokens")}


def reference_answers(held, batches) -> list[list[int]]:
    """The held-out reference answers as the pipeline encodes them (response region, up to its first <turn|>)."""
    out = []
    for s in batches:
        b = held.batch(s)
        R = b["diffusion_weight"].shape[1]
        out += [[int(t) for t in row] for row in b["tokens"][:, -R:]]
    return out


def throughput(model, held, sampler_section, stop_ids, pad_id, key) -> dict:
    """Wall-clock text tokens per second at batch 1 (one held-out prompt), AR vs diffusion: the second of two calls
    (the first compiles), tokens = the answer up to and including its stop token."""
    import numpy as np

    from dgemma.eval.genppl import answer_tokens
    from dgemma.inference.sampler import sample
    from dgemma.inference.sampler_types import SamplerConfig

    b = held.batch(0)
    R = b["diffusion_weight"].shape[1]
    P = b["tokens"].shape[1] - R
    prompt, valid = np.asarray(b["tokens"])[:1, :P], np.asarray(b["valid"])[:1, :P].astype(bool)
    out = {}
    for mode in ("ar", "diffusion"):
        cfg = SamplerConfig.from_section(sampler_section, mode=mode, max_steps=SAMPLER_MAX_STEPS, max_new_tokens=R,
                                         eos_ids=tuple(stop_ids), pad_id=pad_id)
        sample(model, prompt, valid, cfg, key, mode)  # compile
        t0, c0 = time.perf_counter(), time.process_time()
        res = sample(model, prompt, valid, cfg, key, mode)
        np.asarray(res.tokens)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        n = len(answer_tokens(np.asarray(res.tokens)[0], stop_ids, pad_id))
        out[mode] = {"tokens": n, "seconds": wall, "cpu_seconds": cpu, "tokens_per_second": n / wall}
    return out


def report_md(r: dict) -> str:
    from dgemma.eval.stats import fmt_ci

    d = r["decodings"]
    lines = ["# Tiny chat results", "", f"machine: {r['machine']}", "", f"data: {r['data']}", "",
             "## Decodings (held-out conversations)", "", *[f"- {k}: {v['settings']}" for k, v in d.items()], "",
             "| decoding | exact match | `#### N` format | gen. perplexity (stage-0 AR) | unigram entropy (nats) | "
             "per-prompt entropy across keys (max ln K) | distinct / keys | tokens per forward | steps per block | n |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    ref = r["reference"]
    lines.append(f"| reference answers | 1 | {ref['format_share']:.3f} | {ref['gen_ppl']['gen_ppl']:.2f} | "
                 f"{ref['unigram_entropy']:.3f} | - | - | - | - | {r['eval_rows']} |")
    for k, v in d.items():
        m = v["metrics"]
        pp = (f"{fmt_ci(v['per_prompt_entropy'])} (ln {v['keys']} = {v['per_prompt_entropy_max']:.3f})"
              if "per_prompt_entropy" in v else "- (greedy: one decoding)")
        dist = f"{v['distinct']:.2f}" if "distinct" in v else "-"
        spb = f"{m['steps_per_block']:.2f}" if "steps_per_block" in m else "1 token / forward"
        lines.append(f"| {k} | {m['exact_match']:.3f} | {v['format_share']:.3f} | {v['gen_ppl']['gen_ppl']:.2f} | "
                     f"{v['unigram_entropy']:.3f} | {pp} | {dist} | {m['tpf']:.2f} | {spb} | {int(m['n'])} |")
    t = r["throughput"]
    lines += ["", "## Wall-clock text tokens per second, batch 1, stage-1 weights (one prompt, after a warm-up call)", "",
              "| mode | tokens | wall s | CPU s | tokens / s |", "|---|---|---|---|---|",
              *[f"| {m} | {v['tokens']} | {v['seconds']:.2f} | {v['cpu_seconds']:.2f} | {v['tokens_per_second']:.1f} |"
                for m, v in t.items()],
              "", f"diffusion / AR tokens per second: {t['diffusion']['tokens_per_second'] / t['ar']['tokens_per_second']:.2f}x"
              " (the machine is shared: wall-clock is inflated; CPU s beside it)", "", "## Sample conversations", ""]
    for i, s in enumerate(r["samples"]):
        lines += [f"### Conversation {i + 1}", "", "**user:**", "", "```", s["question"], "```", ""]
        for k in ("reference", *d):
            lines += [f"**{k}:**", "", "```", s[k] or "(empty)", "```", ""]
    lines += ["## Training", "", *[f"- {k}: {v['steps']} steps, {v['seconds']:.0f} s wall, {v['cpu_seconds']:.0f} CPU s"
                                   for k, v in r["stages"].items()],
              f"- total: {r['total_seconds']:.0f} s wall, {r['total_cpu_seconds']:.0f} CPU s", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/tiny_chat", help="output directory")
    ap.add_argument("--quick", action="store_true", help="CI-sized run (a few steps, a few conversations)")
    ap.add_argument("--gsm8k", type=Path, default=None, help="GSM8K jsonl (default: build_data.py's)")
    ap.add_argument("overrides", nargs="*", help="extra dotted overrides applied to both stages")
    args = ap.parse_args(argv)

    import jax

    from dgemma.data.gsm8k_chat import write_gsm8k_chat
    from dgemma.data.pipeline import DataPipeline
    from dgemma.eval.evaluator import held_out_pipeline
    from dgemma.eval.plots import by_step, commitment_heatmap, training_curves
    from dgemma.eval.study_report import machine_description
    from dgemma.model.transformer import model_from_params
    from dgemma.tracking import read_jsonl
    from dgemma.train import trainer as trainer_lib

    sys.path.insert(0, str(HERE))
    from build_data import GSM8K

    ev = QUICK_EVAL if args.quick else dict(rows=EVAL_ROWS, batch=EVAL_BATCH, keys=KEYS, shown=SHOWN)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t_all, c_all = time.perf_counter(), time.process_time()
    paths = write_gsm8k_chat(str(args.gsm8k or GSM8K), str(out / "data"))
    extra = [f"data.paths=[{paths['train']}]", *(QUICK if args.quick else []), *args.overrides]
    results: dict = {"machine": machine_description(), "quick": args.quick, "stages": {}}

    def train(name, cfg):
        c0 = time.process_time()
        s = trainer_lib.train(cfg)
        results["stages"][name] = {"steps": s.final_step, "seconds": s.wall_seconds,
                                   "cpu_seconds": time.process_time() - c0}
        return s

    print("== stage 0: AR fine-tuning on conversations ==", flush=True)
    cfg0 = load("stage0_ar.yaml", out, extra)
    s0 = train("stage 0 (AR)", cfg0)
    print("== stage 1: block-diffusion conversion ==", flush=True)
    cfg1 = load("stage1.yaml", out, [*extra, f"checkpoint.init_from={Path(s0.run_dir) / 'params'}"])
    s1 = train("stage 1", cfg1)

    train_src = DataPipeline(dataclasses.replace(cfg0.data, num_threads=0), process_index=0, process_count=1).source
    held = held_out_pipeline(dataclasses.replace(cfg1.data, paths=[paths["heldout"]]), ev["batch"])
    n_held = len(held.source)
    if n_held < ev["rows"]:
        raise SystemExit(f"{paths['heldout']}: {n_held} held-out conversations fit the layout; need {ev['rows']}")
    batches = list(range(ev["rows"] // ev["batch"]))
    layout = cfg1.data.layout
    results["data"] = (f"train {len(train_src)} conversations ({len(train_src.skipped)} skipped: context > "
                       f"{layout.prompt_len} or answer + <turn|> > {layout.n_blocks} x {cfg1.model_config.canvas_length} "
                       f"tokens); held-out {n_held} fit ({len(held.source.skipped)} skipped), the first "
                       f"{len(batches) * ev['batch']} evaluated")
    results["eval_rows"] = len(batches) * ev["batch"]
    print(results["data"], flush=True)

    tok = held.tokenizer
    stop_ids, pad_id = tuple(tok.stop_ids), int(tok.pad_id)
    model0 = model_from_params(cfg0.model_config, s0.state.params)
    model1 = model_from_params(cfg1.model_config, s1.state.params)
    key = jax.random.key(cfg1.run.seed)
    print("== decoding the held-out conversations ==", flush=True)
    decodings = {"stage 0, AR": decode_all(model0, held, cfg1.sampler, "stage0_ar", "ar", batches, key, ev["keys"]),
                 "stage 1, AR": decode_all(model1, held, cfg1.sampler, "stage1_ar", "ar", batches, key, ev["keys"]),
                 "stage 1, diffusion": decode_all(model1, held, cfg1.sampler, "stage1_diffusion", "diffusion",
                                                  batches, key, ev["keys"])}
    refs = reference_answers(held, batches)
    from dgemma.eval.diversity import plugin_entropy
    ref_runs = [{"rows": {"output": refs}}]
    ref_texts = [answer_text(tok, a) for a in refs]
    results["reference"] = {"gen_ppl": gen_ppl(model0, held, batches, ref_runs, stop_ids, pad_id),
                            "unigram_entropy": plugin_entropy([t for a in ref_texts for t in tok.encode(a)]) + 0.0,
                            "format_share": sum(bool(FORMAT.search(a)) for a in ref_texts) / len(ref_texts)}
    results["decodings"] = {}
    for name, d in decodings.items():
        runs = d["runs"]
        results["decodings"][name] = {"settings": d["settings"], "metrics": runs[0]["metrics"],
                                      "seconds": sum(r["seconds"] for r in runs),
                                      "cpu_seconds": sum(r["cpu_seconds"] for r in runs),
                                      "gen_ppl": gen_ppl(model0, held, batches, runs, stop_ids, pad_id),
                                      **diversity(tok, runs)}
        print(name, json.dumps({k: v for k, v in results["decodings"][name].items() if k != "metrics"}), flush=True)
    examples = [held.source[int(i)] for s in batches for i in held.batch(s)["index"]]
    results["samples"] = [{"question": examples[i].prompt.strip(), "reference": ref_texts[i],
                           **{name: answer_text(tok, d["runs"][0]["rows"]["output"][i]) for name, d in decodings.items()}}
                          for i in range(min(ev["shown"], len(examples)))]
    print("== tokens per second, batch 1 ==", flush=True)
    results["throughput"] = throughput(model1, held, cfg1.sampler, stop_ids, pad_id, key)
    diff = decodings["stage 1, diffusion"]["runs"][0]
    results["total_seconds"] = time.perf_counter() - t_all
    results["total_cpu_seconds"] = time.process_time() - c_all

    (out / "metrics.json").write_text(json.dumps(results, indent=2, default=float) + "\n")
    (out / "report.md").write_text(report_md(results))
    stage0_rows = [{**row, "loss_ar": row["loss"]} for row in read_jsonl(Path(s0.run_dir) / "metrics.jsonl")]
    training_curves({"stage 0 (AR)": stage0_rows, "stage 1": read_jsonl(Path(s1.run_dir) / "metrics.jsonl")},
                    ["loss", "loss_ar", "loss_diffusion"], out / "curves.png", "tiny chat training")
    commitment_heatmap(diff["commit_step"], SAMPLER_MAX_STEPS, out / "commitment.png",
                       "stage-1 chat model: step at which each canvas position committed")
    by_step({"stage 1, diffusion": {"mean entropy": diff["entropy_per_step"]}}, ["mean entropy"],
            out / "entropy_per_step.png", "stage-1 chat model: mean canvas entropy by denoising step")
    print((out / "report.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The tiny chat job over seeds: one table of means, ranges and CIs from several `run.py` output directories.

    python experiments/tiny_chat/run.py --out runs/tiny_chat_s0 run.seed=0 data.seed=0     # and seeds 1, 2
    python experiments/tiny_chat/seeds.py runs/tiny_chat_s0 runs/tiny_chat_s1 runs/tiny_chat_s2 --out results

Reads each directory's metrics.json (the training seed is `run.seed`; the held-out conversations and the sampler
keys are the same in every run) and writes --out/results.md and results.json: per decoding and measure, the mean over
seeds, the range (min-max) and a 95 % percentile-bootstrap CI over seeds (`dgemma.eval.stats.bootstrap_ci`; with 3
seeds it cannot be wider than the range), and seeds.png (each measure's seeds as points beside the mean).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MEASURES = [  # (key in a decoding's entry, label, digits)
    ("exact_match", "exact match", 3), ("format_share", "`#### N` format", 3), ("gen_ppl", "gen. perplexity", 2),
    ("unigram_entropy", "unigram entropy (nats)", 3), ("per_prompt_entropy", "per-prompt entropy across keys", 3),
    ("distinct", "distinct / keys", 2), ("tpf", "tokens per forward", 2), ("steps_per_block", "steps per block", 2)]


def measure(entry: dict, key: str) -> float | None:
    """One number of a decoding's entry in metrics.json (None where the decoding has no such measure)."""
    if key in ("exact_match", "tpf", "steps_per_block"):
        return entry["metrics"].get(key)
    if key == "gen_ppl":
        return entry["gen_ppl"]["gen_ppl"]
    if key == "per_prompt_entropy":
        return entry[key][0] if key in entry else None
    return entry.get(key)


def collect(runs: list[dict]) -> dict:
    """{row: {measure: [value per seed]}} for every decoding, the reference answers and the throughput."""
    rows: dict[str, dict[str, list[float]]] = {}
    for r in runs:
        ref = r["reference"]
        for k, v in (("format_share", ref["format_share"]), ("gen_ppl", ref["gen_ppl"]["gen_ppl"]),
                     ("unigram_entropy", ref["unigram_entropy"])):
            rows.setdefault("reference answers", {}).setdefault(k, []).append(float(v))
        for name, entry in r["decodings"].items():
            for key, _, _ in MEASURES:
                v = measure(entry, key)
                if v is not None:
                    rows.setdefault(name, {}).setdefault(key, []).append(float(v))
        t = r["throughput"]
        for mode in ("ar", "diffusion"):
            rows.setdefault("tokens per second, batch 1", {}).setdefault(mode, []).append(t[mode]["tokens_per_second"])
        rows["tokens per second, batch 1"].setdefault("diffusion / AR", []).append(
            t["diffusion"]["tokens_per_second"] / t["ar"]["tokens_per_second"])
        for k in ("total_seconds", "total_cpu_seconds"):
            rows.setdefault("time", {}).setdefault(k, []).append(float(r[k]))
    return rows


def summarize(values: list[float]) -> dict:
    from dgemma.eval.stats import bootstrap_ci

    return {"mean": float(sum(values) / len(values)), "min": min(values), "max": max(values),
            "ci95": list(bootstrap_ci(values))[1:], "seeds": values}


def cell(s: dict, digits: int) -> str:
    f = f"{{:.{digits}f}}"
    return f"{f.format(s['mean'])} ({f.format(s['min'])}-{f.format(s['max'])})"


def report_md(dirs: list[str], runs: list[dict], table: dict) -> str:
    first = runs[0]
    digits = {k: d for k, _, d in MEASURES}
    lines = ["# Tiny chat: results over seeds", "",
             f"{len(runs)} training seeds ({', '.join(dirs)}); each cell is the mean over seeds and (min-max); "
             "results.json has the 95 % bootstrap CI over seeds and every seed's value.", "",
             f"machine: {first['machine']}", "", f"data: {first['data']}", "",
             "Decodings (held-out conversations, the same in every run):", "",
             *[f"- {k}: {v['settings']}" for k, v in first["decodings"].items()], "",
             "| decoding | " + " | ".join(label for _, label, _ in MEASURES) + " |",
             "|---" * (len(MEASURES) + 1) + "|"]
    for name, row in table.items():
        if name in ("tokens per second, batch 1", "time"):
            continue
        lines.append(f"| {name} | " + " | ".join(cell(row[k], digits[k]) if k in row else "-"
                                                 for k, _, _ in MEASURES) + " |")
    t = table["tokens per second, batch 1"]
    lines += ["", "Wall-clock text tokens per second at batch 1 (stage-1 weights, one prompt, after a warm-up call): "
              f"AR {cell(t['ar'], 1)}, diffusion {cell(t['diffusion'], 1)}, diffusion / AR {cell(t['diffusion / AR'], 2)}.",
              "", f"Job time per seed: {cell(table['time']['total_seconds'], 0)} s wall, "
              f"{cell(table['time']['total_cpu_seconds'], 0)} CPU s.", ""]
    return "\n".join(lines)


def plot(table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("gen_ppl", "gen. perplexity"), ("unigram_entropy", "unigram entropy"), ("exact_match", "exact match"),
            ("format_share", "format share")]
    names = [n for n in table if n not in ("tokens per second, batch 1", "time")]
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3.4))
    for ax, (k, label) in zip(axes, keys):
        for i, n in enumerate(names):
            if k in table[n]:
                s = table[n][k]
                ax.scatter([i] * len(s["seeds"]), s["seeds"], s=12, color="0.5")
                ax.scatter([i], [s["mean"]], marker="_", s=300, color="C0")
        ax.set_xticks(range(len(names)), [n.replace(", ", "\n") for n in names], fontsize=7)
        ax.set_title(label, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run.py output directories (one per seed)")
    ap.add_argument("--out", required=True, help="directory for results.md, results.json, seeds.png")
    args = ap.parse_args(argv)
    runs = []
    for d in args.runs:
        p = Path(d) / "metrics.json"
        if not p.is_file():
            print(f"seeds: {p}: no such file (run experiments/tiny_chat/run.py --out {d} first)", file=sys.stderr)
            return 2
        runs.append(json.loads(p.read_text()))
    if len(runs) < 2:
        print("seeds: give at least two run directories (a range needs seeds)", file=sys.stderr)
        return 2
    if len({r["quick"] for r in runs}) != 1 or len({r["eval_rows"] for r in runs}) != 1:
        print("seeds: the runs differ in --quick or in the held-out rows; compare like with like", file=sys.stderr)
        return 2
    table = {name: {k: summarize(v) for k, v in row.items()} for name, row in collect(runs).items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"runs": args.runs, "table": table}, indent=1) + "\n")
    (out / "results.md").write_text(report_md(args.runs, runs, table))
    plot(table, out / "seeds.png")
    print((out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

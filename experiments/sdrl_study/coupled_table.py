"""The coupled-target study's comparison table (coupled.md): several frontier.json files (stage 1, the trained arms,
the control; each from frontier.py on the same held-out prompts) in one table, each row checked against the issue's
AGREE-whole target: one decoder step per block at exact match >= 0.99 keeping >= 0.8 x the data's answer entropy.

    python experiments/sdrl_study/coupled_table.py "stage 1=runs/coupled/frontier_stage1" \
        "coupled=runs/coupled/frontier_coupled" "control=runs/coupled/frontier_control" --out TABLE

Per model it also names the best sampler-only row (fewest steps at exact match >= 0.99) and the best such row that
keeps the data's diversity (`dgemma.eval.frontier.best_keeping_diversity`), the fair baseline of a stage-2 claim.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TARGET_EM, TARGET_STEPS, KEPT = 0.99, 1.0, 0.8


def load(spec: str) -> tuple[str, dict]:
    label, sep, path = spec.partition("=")
    if not sep:
        raise SystemExit(f"coupled_table: {spec!r} is not LABEL=FRONTIER_DIR")
    f = Path(path) / "frontier.json"
    if not f.is_file():
        raise SystemExit(f"coupled_table: {f}: no frontier.json (run frontier.py first)")
    return label, json.loads(f.read_text())


def table(models: list[tuple[str, dict]]) -> str:
    from dgemma.eval.frontier import best_keeping_diversity, best_sampler_only, diversity_kept, keeps_diversity
    from dgemma.eval.stats import fmt_ci

    held = {json.dumps(m["held_out"]) for _, m in models}
    lines = [f"Held-out prompts: {models[0][1]['held_out']}" + ("" if len(held) == 1 else
             " (**the models' held-out sets differ**: not comparable)"), "",
             "| model | sampler | exact match [95 % CI] | steps / block [95 % CI] | H pooled / data | entropy kept "
             "(library rule) | distinct (data) | meets the target |", "|---|---|---|---|---|---|---|---|"]
    notes = []
    for label, m in models:
        rows = m["rows"]
        for row in rows:
            d = next(iter(row.get("diversity", {}).values()), None)
            pooled = f"{d['entropy_pooled'] / d['entropy_pooled_data']:.2f}" if d else "–"
            kept = min(diversity_kept(row).values()) if d else float("nan")
            meets = (row["exact_match"][0] >= TARGET_EM and row["steps_per_block"][0] <= TARGET_STEPS
                     and keeps_diversity(row, kept=KEPT))
            kept_cell = f"{kept:.2f} {'yes' if keeps_diversity(row, kept=KEPT) else 'no'}" if d else "–"
            distinct = f"{d['distinct']:.3f} ({d['distinct_data']:.3f})" if d else "–"
            lines.append(f"| {label} | {row['label']} | {fmt_ci(row['exact_match'])} | "
                         f"{fmt_ci(row['steps_per_block'], 2)} | {pooled} | {kept_cell} | {distinct} | "
                         f"{'**yes**' if meets else 'no'} |")
        best = best_sampler_only(rows, reference=TARGET_EM, tolerance=0.0)
        keep = best_keeping_diversity(rows, reference=TARGET_EM, tolerance=0.0, kept=KEPT)
        describe = lambda i: "none" if i is None else (  # noqa: E731
            f"{rows[i]['label']} ({rows[i]['steps_per_block'][0]:.2f} steps at EM {rows[i]['exact_match'][0]:.3f})")
        notes.append(f"- {label}: fewest steps at EM >= {TARGET_EM}: {describe(best)}; keeping >= {KEPT} x the data's "
                     f"entropy: {describe(keep)}.")
    return "\n".join(lines + ["", *notes]) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", metavar="LABEL=FRONTIER_DIR")
    ap.add_argument("--out", default=None, help="also write the table here")
    args = ap.parse_args(argv)
    md = table([load(s) for s in args.models])
    if args.out:
        Path(args.out).write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

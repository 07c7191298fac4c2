"""Room for fewer steps in a checkpoint's decoding (`dgemma.eval.room`): the diagnosis before any stage-2 arm.

    python experiments/sdrl_study/room.py --checkpoint experiments/sdrl_study/checkpoint/stage1_add \
        --config experiments/sdrl_study/stage2_add.yaml --tasks add --reference --out runs/room_add

Decodes deduplicated held-out prompts (disjoint from the config's training stream and every --train-stream) with the
config's sampler, recording every state, once per seed (key 1000 + seed), and writes --out/room.json, room.md (per
step: the share of answer positions accepted, already final but not accepted, not final yet, and with --reference
wrong against the data's answer; the sampler's steps per block against a clairvoyant accept rule's, with 95 %
bootstrap CIs over prompts within seeds) and room.png. --reference is meant for unique-answer tasks (add, copy,
sort), where a draft that differs from the data's answer is an error; on many-answer tasks (agree, pick, fill) it
only says "another answer than the data's row".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# this folder's module (the folder is first on sys.path when the script runs)
from checkpoint_tools import add_checkpoint_arguments, config_and_held_out



def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(ap)
    ap.add_argument("--override", nargs="*", default=[], help="dotted overrides of the config (e.g. sampler.*)")
    ap.add_argument("--reference", action="store_true", help="also the share of drafts that differ from the data's "
                                                             "answer (unique-answer tasks)")
    ap.add_argument("--out", required=True)
    return ap


def decode(model, held, cfg, seed: int, reference: bool) -> list[dict]:
    """`dgemma.eval.room.room_by_step` of every held-out batch, decoded with the config's sampler, key 1000 + seed."""
    import jax
    import numpy as np

    from dgemma.eval.room import answer_reference, room_by_step
    from dgemma.inference.rollout import rollout
    from dgemma.inference.sampler_types import SamplerConfig

    out = []
    for s in range(held.num_batches):
        batch = held.batch(s)
        R = batch["diffusion_weight"].shape[1]
        P = batch["tokens"].shape[1] - R
        tok = held.tokenizer  # the evaluator's defaults: the tokenizer's stop ids and pad id
        scfg = SamplerConfig.from_section(cfg.sampler, max_new_tokens=R, eos_ids=tuple(tok.stop_ids),
                                          pad_id=int(tok.pad_id))
        ro = rollout(model, np.asarray(batch["tokens"])[:, :P], np.asarray(batch["valid"])[:, :P].astype(bool),
                     scfg, jax.random.fold_in(jax.random.key(1000 + seed), s))
        rec = jax.device_get(ro.record)
        L = rec.canvas_length
        ref = (answer_reference(np.asarray(batch["tokens"])[:, P:], rec.n_blocks, L, scfg.eos_ids, scfg.pad_id)
               if reference else None)
        room = room_by_step(rec, pad_id=scfg.pad_id, reference=ref)
        keep = np.asarray(batch.get("example_mask", np.ones(len(batch["index"]), bool)), bool)
        room["rows"] = keep
        out.append(room)
    return out


def summarize(rooms: list[list[dict]]) -> dict:
    """Per-step shares pooled over seeds and batches (position-weighted) and steps per block vs the oracle's, with a
    hierarchical CI over prompts within seeds (`dgemma.eval.stats.hierarchical_ci`)."""
    import numpy as np

    from dgemma.eval.stats import hierarchical_ci

    names = ["accepted", "final_not_accepted", "not_final", *(["wrong"] if "wrong" in rooms[0][0] else [])]
    K = max(len(r["positions"]) for seed in rooms for r in seed)
    per_step = {n: [] for n in ["positions", *names]}
    for k in range(K):
        parts = [(r["positions"][k], {n: r[n][k] for n in names}) for seed in rooms for r in seed
                 if k < len(r["positions"])]
        total = sum(p for p, _ in parts)
        per_step["positions"].append(total)
        for n in names:
            per_step[n].append(sum(p * v[n] for p, v in parts if v[n] == v[n]) / total)
    def per_row(field):
        rows = []
        for seed in rooms:
            vals = []
            for r in seed:
                has, x = r["has_answer"], r[field]
                blocks = has.sum(axis=0)
                mean = np.where(blocks > 0, (x * has).sum(axis=0) / np.maximum(blocks, 1), np.nan)
                vals += [float(v) for v, keep in zip(mean, r["rows"]) if keep and v == v]
            rows.append(vals)
        return rows
    return {"per_step": per_step, "steps_per_block": hierarchical_ci(per_row("steps")),
            "oracle_steps_per_block": hierarchical_ci(per_row("oracle_steps")),
            "ready_at_first_step": float(np.mean([r["ready_at_first_step"] for seed in rooms for r in seed]))}


def report_md(title: str, text: str, summary: dict) -> str:
    ps = summary["per_step"]
    names = [n for n in ("accepted", "final_not_accepted", "not_final", "wrong") if n in ps]
    head = "| step k | answer positions | " + " | ".join(n.replace("_", " ") for n in names) + " |\n"
    head += "|---" * (len(names) + 2) + "|\n"
    body = "".join(f"| {k} | {ps['positions'][k]} | " + " | ".join(f"{ps[n][k]:.3f}" for n in names) + " |\n"
                   for k in range(len(ps["positions"])))
    spb, orc = summary["steps_per_block"], summary["oracle_steps_per_block"]
    return (f"# Room for fewer steps: {title}\n\n{text}\n\n"
            f"Steps per block: sampler **{spb[0]:.2f}** [{spb[1]:.2f}, {spb[2]:.2f}], clairvoyant accept rule on the "
            f"same drafts **{orc[0]:.2f}** [{orc[1]:.2f}, {orc[2]:.2f}] (95 % CI over prompts within seeds). Answer "
            f"positions whose first-step draft is already final: {summary['ready_at_first_step']:.3f}.\n\n"
            f"Shares of the answer positions of the states that ran step k (`dgemma.eval.room`):\n\n{head}{body}")


def plot(summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = summary["per_step"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for n in ("accepted", "final_not_accepted", "not_final", "wrong"):
        if n in ps:
            ax.plot(range(len(ps[n])), ps[n], marker="o", ms=3, label=n.replace("_", " "))
    ax.set_xlabel("denoising step k")
    ax.set_ylabel("share of answer positions")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from dgemma.eval.evaluator import decoding_settings
    from dgemma.inference.sampler_types import SamplerConfig
    from dgemma.train.study import restore

    got = config_and_held_out(args, "room", args.override)
    if isinstance(got, int):
        return got
    cfg, held = got
    out = Path(args.out)
    models = [restore(cfg, path) for path in args.checkpoint]  # one, or one per seed (checkpoint_tools)
    rooms = [decode(models[i % len(models)], held, cfg, s, args.reference) for i, s in enumerate(args.seeds)]
    summary = summarize(rooms)
    text = (f"{held.summary()}; seeds {args.seeds} (sampler key 1000 + seed). Sampler: "
            f"{decoding_settings(SamplerConfig.from_section(cfg.sampler), 'diffusion')}.")
    title = f"{Path(args.checkpoint[0]).name}: {', '.join(sorted(held.per_task()))}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "room.json").write_text(json.dumps({"checkpoint": args.checkpoint, "config": args.config,
                                               "overrides": args.override, "seeds": args.seeds, "text": text,
                                               **summary}, indent=1) + "\n")
    md = report_md(title, text, summary)
    (out / "room.md").write_text(md)
    plot(summary, out / "room.png", title)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

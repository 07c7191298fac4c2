# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # The LoRA study: SD·RL with adapters vs full parameters, and what the experts' adapters add
#
# From the many-answer stage-1 checkpoint (`experiments/sdrl_study/checkpoint/stage1_choice`, tasks PICK and FILL),
# SD·RL trains either every parameter (`full`) or low-rank adapters only (`lora` section): on the attention
# projections (`r<R>_attn`) or on attention + the dense / self-conditioning MLPs + the experts' grouped matmuls
# (`r<R>_all`), all at the same number of iterations, seeds 0 1 2, and decoded by the config's default sampler on
# the same held-out prompts. One LoRA rule for every arm: alpha 32 (scale 32 / r), lr 10 x the full arm's; the lr
# control `full_lr3e-4` trains every parameter at the adapters' lr, separating the step size from the adapters.
# The recorded grid (`experiments/lora_study/grid.sh`, results in `experiments/lora_study/results.md`) is read and
# plotted first; then a reduced live run of the same study code (`experiments/lora_study/run.py`) on a tiny untrained
# MoE model (plumbing only: one adapter arm, one seed, one iteration).

# %%
import json
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

ROOT = Path.cwd()
while not (ROOT / "experiments" / "lora_study").is_dir() and ROOT != ROOT.parent:
    ROOT = ROOT.parent
RESULTS = ROOT / "experiments" / "lora_study" / "results.json"

# %% [markdown]
# ## The recorded grid
# Mean over 3 seeds and the held-out prompts with its 95 % bootstrap CI (seeds, then prompts), per task.

# %%
if RESULTS.exists():
    rec = json.loads(RESULTS.read_text())
    table, arms, tasks = rec["table"], rec["meta"]["arms"], [t.strip() for t in rec["meta"]["ran"]["tasks"].split(",")]
    for k, v in rec["meta"]["ran"].items():
        print(f"{k}: {v}")
    print("decoding:", rec["meta"]["settings"])
    for task in tasks:
        print(f"\n{task}: arm | trainable | EM [95% CI] | steps/block [95% CI]")
        for a in arms:
            d = table[a][task]
            em, st = d["exact_match"], d["steps_per_block"]
            print(f"  {a:9s} {table[a]['trainable']:>8,} | {em[0]:.3f} [{em[1]:.3f}, {em[2]:.3f}] | "
                  f"{st[0]:.2f} [{st[1]:.2f}, {st[2]:.2f}]")
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for a in arms:
            d = table[a][task]
            x, y = np.array(d["steps_per_block"]), np.array(d["exact_match"])
            ax.errorbar(x[0], y[0], xerr=[[x[0] - x[1]], [x[2] - x[0]]], yerr=[[y[0] - y[1]], [y[2] - y[0]]],
                        fmt="o", capsize=3, label=a)
        ax.set_xlabel("mean steps per block")
        ax.set_ylabel("exact match")
        ax.set_title(task)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    plt.show()
else:
    print(f"{RESULTS}: not recorded yet (run experiments/lora_study/grid.sh)")

# %% [markdown]
# ## A reduced live run of the study
# The tiny toy config shrunk to canvas 8, K_max 4 and 3-5 digit copy/sort prompts, an untrained MoE model saved as
# "stage 1", one `r2_all` arm, one seed, one SD·RL iteration. Checked: the base is bit-identical after training, the
# optimizer trains exactly the adapters, and stage 1 and the arm are scored on the same held-out prompts.

# %%
import importlib.util
import pickle
import sys

from dgemma.train.study_toy import write_toy_study

# the study's run script (experiments/ is not a package): loaded by path under a name of its own, with its folder on
# sys.path as when it runs as a script (it imports its own modules by name)
sys.path.insert(0, str(ROOT / "experiments" / "lora_study"))
study_spec = importlib.util.spec_from_file_location("lora_study_run", ROOT / "experiments" / "lora_study" / "run.py")
lora_study = importlib.util.module_from_spec(study_spec)
study_spec.loader.exec_module(lora_study)

work = Path(tempfile.mkdtemp(prefix="lora_study_"))
config, stage1 = write_toy_study(work, base=ROOT / "experiments" / "sdrl_study" / "stage2.yaml",
                                 model={"num_hidden_layers": 1, "layer_types": ["full_attention"]})
args = lora_study.build_parser(config).parse_args(
    ["--stage1", str(stage1), "--out", str(work / "out"), "--arms", "r2_all", "--seeds", "0", "--iterations", "1",
     "--prompts", "2", "--group-size", "2", "--eval-per-task", "4", "--eval-batch", "4",
     "--train-stream", f"{config}:5", "--override", "sdrl.inner_epochs=1"])
live = lora_study.run_lora_study(args)

# %%
row = live["table"]["r2_all"]
print("trainable parameters:", row["trainable"], "| base leaves changed:", row["base_leaves_changed"])
assert row["trainable"] > 0 and row["base_leaves_changed"] == [0], row
done = {p.stem: pickle.loads(p.read_bytes()) for p in (work / "out" / "done").glob("*.pkl")}
idx = [list(d["eval"]["diffusion"]["rows"]["index"]) for d in done.values()]
assert all(i == idx[0] for i in idx), "the rows must score the same held-out prompts"
for label in ("stage1", "r2_all"):
    print(label, {t: round(live["table"][label][t]["steps_per_block"][0], 2) for t in ("copy", "sort")})

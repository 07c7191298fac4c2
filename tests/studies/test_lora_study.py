"""The LoRA study (experiments/lora_study/run.py, loaded by path) at a toy budget: one adapter arm of the MoE toy model from a saved
"stage-1" checkpoint, one SD·RL iteration, decoded beside stage 1 on one held-out set. Checks what the study's
comparison rests on: only the adapters train (the base is bit-identical), the trainable count is the adapters' size
(attention-only < attention + MLPs + experts, counted independently from the adapted model), every row scores the
same held-out prompts, the arms' settings follow the one LoRA rule, and bad arm names / overrides are refused."""

import json
import math
import pickle
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from support.scripts import load_script
from support.study_stage1 import tiny_study_dir

ls = load_script("experiments/lora_study/run.py", "lora_study_run")

REPO = Path(__file__).resolve().parents[2]



@pytest.fixture(scope="module")
def stage1(tmp_path_factory):
    return tiny_study_dir(tmp_path_factory.mktemp("lora_study"), "canvas_length: 8, num_hidden_layers: 1, layer_types: [full_attention]")


def _args(d, *extra):
    return ls.build_parser(d / "tiny.yaml").parse_args(
        ["--stage1", str(d / "stage1" / "params"), "--out", str(d / "out"), "--iterations", "1", "--prompts", "2",
         "--group-size", "2", "--eval-per-task", "4", "--eval-batch", "4", "--seeds", "0",
         "--train-stream", f"{d / 'tiny.yaml'}:5", "--override", "sdrl.inner_epochs=1", *extra])


def _adapter_size(cfg, targets) -> int:
    """Adapter parameters of the config's model with rank-2 adapters on `targets`, from the adapted model itself."""
    from dgemma.model.lora import LoraSpec, attach_adapters
    from dgemma.model.transformer import Transformer

    def build():
        m = Transformer(cfg.model_config, rngs=nnx.Rngs(0))
        attach_adapters(m, LoraSpec(rank=2, alpha=32.0, targets=targets), nnx.Rngs(1))
        return m

    state = nnx.state(nnx.eval_shape(build), nnx.LoRAParam)
    return sum(math.prod(x.shape) for x in jax.tree.leaves(state))


def test_arm_rule_and_refusals():
    assert ls.arm_overrides("full", 3e-5) == ["lora.rank=0", "optim.lr=3e-05"]
    r16 = ls.arm_overrides("r16_all", 3e-5)
    assert "lora.rank=16" in r16 and f"lora.alpha={ls.LORA_ALPHA}" in r16
    assert f"optim.lr={3e-5 * ls.LORA_LR_FACTOR}" in r16  # one lr for every rank and target set
    assert ls.arm_overrides("r4_attn", 3e-5)[2] == f"lora.targets={list(ls.ATTENTION)!r}"
    assert ls.all_arms() == ["full", "r4_attn", "r16_attn", "r64_attn", "r4_all", "r16_all", "r64_all"]
    for bad in ("r0_all", "r16_mlp", "lora16", "rx_attn", "full_lr", "full_lrx", "full_lr-1e-4", "full_lrnan"):
        with pytest.raises(SystemExit, match=rf"^--arms: unknown arm '{bad}'"):
            ls.arm_overrides(bad, 3e-5)
        with pytest.raises(SystemExit, match=rf"^--arms: unknown arm '{bad}'"):
            ls.arm_lr(bad, 3e-5)


def test_lr_control_arm_trains_every_parameter_at_the_lr_its_name_states():
    assert ls.arm_overrides("full_lr3e-4", 3e-5) == ["lora.rank=0", "optim.lr=0.0003"]
    assert ls.arm_lr("full_lr3e-4", 1.0) == 3e-4  # not tied to --lr, unlike every other arm
    assert ls.arm_lr("full", 3e-5) == 3e-5 and ls.arm_lr("r64_attn", 3e-5) == 3e-5 * ls.LORA_LR_FACTOR
    # the control is lr-matched to the adapter arms at the precision the optimizer runs at
    assert np.float32(ls.arm_lr("full_lr3e-4", 3e-5)) == np.float32(ls.arm_lr("r16_all", 3e-5))


def _row(em, spb):
    return {"exact_match": em, "steps_per_block": spb, "n": 4}


def test_report_links_the_figure_and_compares_the_lr_control():
    rep = load_script("experiments/lora_study/lora_report.py", "lora_report")

    table = {"stage1": {"t": _row((1.0, 1.0, 1.0), (20.0, 19.0, 21.0))},
             "full": {"t": _row((1.0, 1.0, 1.0), (18.0, 17.0, 19.0))},
             "full_lr3e-4": {"t": _row((0.9, 0.8, 1.0), (10.0, 9.0, 11.0))},
             "r4_all": {"t": _row((1.0, 0.9, 1.0), (10.5, 9.5, 11.5))},
             "r4_attn": {"t": _row((1.0, 1.0, 1.0), (15.0, 14.0, 16.0))}}
    for label in table:
        table[label].update(trainable=1, seconds_per_iteration=1.0, base_leaves_changed=[0])
    arms = list(table)
    meta = {"machine": "m", "settings": "s", "ran": {"x": 1}, "arms": arms,
            "arm_lr": {a: ls.arm_lr(a, 3e-5) for a in arms if a != "stage1"}}
    md = rep.report(meta, table, ["t"], "held", figure_dir="figures")
    assert "](figures/lora_arms.png)" in md
    assert "](lora_arms.png)" in rep.report(meta, table, ["t"], "held")
    assert "| full_lr3e-4 | 0.0003 | 1 |" in md and "| full | 3e-05 | 1 |" in md
    assert "- full_lr3e-4 - full, t: EM -0.100 (CIs overlap), steps/block -8.00 (CIs disjoint)" in md
    assert "- r4_all - full_lr3e-4, t: EM +0.100 (CIs overlap), steps/block +0.50 (CIs overlap)" in md
    assert "- r4_attn - full_lr3e-4, t: EM +0.100 (CIs overlap), steps/block +5.00 (CIs disjoint)" in md
    assert "- rank 4, t: EM +0.000 (CIs overlap), steps/block -4.50 (CIs disjoint)" in md
    meta["arms"] = ["stage1", "full"]
    assert "- no lr-control arm ran" in rep.report(meta, table, ["t"], "held")


def test_lr_override_is_refused_before_anything_is_written(stage1, tmp_path):
    args = _args(stage1, "optim.lr=1e-3", "--arms", "r2_all")
    args.out = str(tmp_path / "o")
    with pytest.raises(SystemExit, match=r"^--override: \['optim.lr=1e-3'\] are set per arm"):
        ls.run_lora_study(args)
    assert not (tmp_path / "o").exists()


def test_tiny_study_trains_only_adapters_on_shared_prompts(stage1):
    from dgemma.train.study import study_cfg

    args = _args(stage1, "--arms", "r2_all")
    res = ls.run_lora_study(args)
    table = res["table"]
    cfg = study_cfg(ls.arm_args(args, "r2_all"), "sdrl", 0)
    assert cfg.lora.rank == 2 and cfg.optim.lr == pytest.approx(3e-5 * ls.LORA_LR_FACTOR)
    n_all, n_attn = _adapter_size(cfg, ls.EVERYTHING), _adapter_size(cfg, ls.ATTENTION)
    assert 0 < n_attn < n_all  # the MoE toy model: MLP and expert adapters add parameters
    assert table["r2_all"]["trainable"] == n_all  # the optimizer updates exactly the adapters
    assert table["r2_all"]["base_leaves_changed"] == [0]  # the frozen base is bit-identical after training
    assert table["stage1"]["trainable"] == 0
    done = {p.stem: pickle.loads(p.read_bytes()) for p in (stage1 / "out" / "done").glob("*.pkl")}
    assert set(done) == {"stage1_s0", "r2_all_s0"}
    rows = [done[k]["eval"]["diffusion"]["rows"] for k in sorted(done)]
    assert list(rows[0]["index"]) == list(rows[1]["index"]) and len(rows[0]["index"]) == 8  # same held-out prompts
    assert len(done["r2_all_s0"]["history"]) == 1  # the matched iteration count
    for task in ("copy", "sort"):
        em = table["r2_all"][task]["exact_match"]
        assert len(em) == 3 and em[1] <= em[0] <= em[2]
    md = (stage1 / "out" / "results.md").read_text()
    assert "lora.rank" not in md.split("## What ran")[0] and "alpha 32 for every rank" in md
    assert "](lora_arms.png)" in md and "| r2_all | 0.0003 |" in md
    assert (stage1 / "out" / "lora_arms.png").stat().st_size > 0
    assert json.loads((stage1 / "out" / "results.json").read_text())["meta"]["arms"] == ["stage1", "r2_all"]
    # a second start with the same settings reuses every kept run (nothing retrained); other settings are refused
    report = stage1 / "report"
    again = ls.run_lora_study(_args(stage1, "--arms", "r2_all", "--results-md", str(report / "results.md"),
                                    "--figures", str(report / "figures")))
    assert again["table"]["r2_all"]["copy"] == table["r2_all"]["copy"]
    link = (report / "results.md").read_text().split("](")[1].split(")")[0]
    assert link == "figures/lora_arms.png" and (report / link).stat().st_size > 0  # relative to that results.md
    with pytest.raises(SystemExit, match=r"done/settings.json: the runs kept in .* were made with other settings"):
        ls.run_lora_study(_args(stage1, "--arms", "r2_all", "--lr", "1e-4"))

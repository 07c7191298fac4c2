"""The LoRA study (`dgemma.train.lora_study`) at a toy budget: one adapter arm of the MoE toy model from a saved
"stage-1" checkpoint, one SD·RL iteration, decoded beside stage 1 on one held-out set. Checks what the study's
comparison rests on: only the adapters train (the base is bit-identical), the trainable count is the adapters' size
(attention-only < attention + MLPs + experts, counted independently from the adapted model), every row scores the
same held-out prompts, the arms' settings follow the one LoRA rule, and bad arm names / overrides are refused."""

import json
import math
import pickle
from pathlib import Path

import jax
import pytest
from flax import nnx
from study_stage1 import tiny_study_dir

from dgemma.train import lora_study as ls

REPO = Path(__file__).resolve().parents[1]



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
    for bad in ("r0_all", "r16_mlp", "lora16", "rx_attn"):
        with pytest.raises(SystemExit, match=rf"^--arms: unknown arm '{bad}'"):
            ls.arm_overrides(bad, 3e-5)


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
    assert (stage1 / "out" / "lora_arms.png").stat().st_size > 0
    assert json.loads((stage1 / "out" / "results.json").read_text())["meta"]["arms"] == ["stage1", "r2_all"]
    # a second start with the same settings reuses every kept run (nothing retrained); other settings are refused
    again = ls.run_lora_study(_args(stage1, "--arms", "r2_all"))
    assert again["table"]["r2_all"]["copy"] == table["r2_all"]["copy"]
    with pytest.raises(SystemExit, match=r"done/settings.json: the runs kept in .* were made with other settings"):
        ls.run_lora_study(_args(stage1, "--arms", "r2_all", "--lr", "1e-4"))

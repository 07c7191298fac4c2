"""The planner with adapters (dgemma/planning/lora_plan.py): the adapter count equals the real model's LoRA
parameters (the trainer's own model factory, abstract), for the tiny model and the 26B-A4B preset; only the adapters
have gradients and AdamW state; SD·RL's reference costs nothing; the shipped 26B LoRA configs fit one H200 and the
LoRA rows of docs/scaling.md are the planner's figures."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

REPO = Path(__file__).resolve().parents[2]
GiB = 2**30
STAGE2_LORA = "configs/stage2/gemma4_26b_a4b_lora.yaml"


def _cfg(path, *overrides):
    from dgemma.config import load_config

    return load_config(REPO / path, list(overrides), env={})


def _plan(cfg, devices=1, accelerator="h200"):
    from dgemma.planning.plan_config import plan_for, spec_from_config

    return plan_for(spec_from_config(cfg, devices=devices, accelerator=accelerator))


def _real_adapter_count(cfg) -> int:
    """LoRA parameters of the model the trainer builds (adapted factory, abstract: nothing allocated)."""
    from dgemma.train.lora_setup import adapted_factory
    from dgemma.train.trainer import _default_model_factory

    model = nnx.eval_shape(lambda: adapted_factory(cfg, _default_model_factory(cfg.model_config))(nnx.Rngs(0)))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))


@pytest.mark.parametrize("path,overrides", [
    ("configs/stage1/tiny.yaml", ["lora.rank=3", "lora.targets=['attn/[qkvo]_proj$', 'experts/(gate|up|down)$']"]),
    ("configs/stage1/tiny.yaml", ["lora.rank=2", "lora.train_router=true"]),
    ("configs/stage2/tiny.yaml", ["lora.rank=2"]),  # SD·RL: no reference copy
    pytest.param(STAGE2_LORA, [], marks=pytest.mark.slow),  # ~45 s; its adapter count is in the default test below
])
def test_adapter_count_and_state_bytes(path, overrides):
    from dgemma.planning.lora_plan import lora_terms
    from dgemma.planning.plan_config import spec_from_config

    cfg = _cfg(path, *overrides)
    spec = spec_from_config(cfg, devices=1, accelerator="h200")
    terms = lora_terms(spec)
    real = _real_adapter_count(cfg)
    assert real > 0 and terms["adapter_params"] == real
    plan = _plan(cfg)
    full = _plan(_cfg(path, *[o for o in overrides if not o.startswith("lora.")], "lora.rank=0"))
    adapters_fp32 = 4 * real
    assert terms["adapter_bytes"] == adapters_fp32
    router = plan.trainable_params - real  # what lora.train_router trains in full beside the adapters
    assert (router > 0) == ("lora.train_router=true" in overrides)
    assert plan.total_params == full.total_params + real
    if plan.spec.grad_accum_steps == 1:  # grads and AdamW moments of the trainable parameters only
        assert plan.grads == terms["trainable_bytes"]
    moments = 2 * terms["trainable_bytes"]  # (+ AdamW's step counters, a few scalars)
    assert moments <= plan.optimizer <= moments + 64 and plan.optimizer < full.optimizer / 10
    state = lambda p: p.grads + p.optimizer + sum(p.resident.values())  # noqa: E731
    assert state(plan) < state(full)
    # the activations are the base's plus the adapters' own (tests/planning/test_plan_lora_activations.py); on these tiny
    # models (megabytes of state, gigabytes of activations) they outweigh the state the adapters save
    assert plan.activations == full.activations + plan.activation_terms["lora_activations"] > full.activations
    if plan.resident:  # SD·RL: the reference is the frozen base with the adapters off
        assert plan.resident["reference_params"] == terms["kept_bytes"] == 0
        assert full.resident["reference_params"] == full.params


def test_shipped_lora_configs_fit_one_h200_and_the_scaling_rows_are_the_planner():
    from dgemma.config import load_config
    from dgemma.planning.lora_plan import lora_terms

    rows = [line for line in (REPO / "docs/scaling.md").read_text().splitlines()
            if line.startswith("| `dgemma plan configs/stage") and "_lora.yaml" in line]
    assert len(rows) == 4
    seen = set()
    for row in rows:
        cmd = shlex.split(re.match(r"\| `dgemma plan (.*?)` \|", row).group(1))
        path, overrides = cmd[0], [a for a in cmd[1:] if "=" in a]
        devices, acc = int(cmd[cmd.index("--devices") + 1]), cmd[cmd.index("--accelerator") + 1]
        plan = _plan(load_config(REPO / path, overrides, env={}), devices, acc)
        cells = [c.strip() for c in row.split("|")[1:-1]]
        figures = [float(re.match(r"[\d.]+", c).group(0)) for c in cells[2:7]]
        assert figures == [round(x / GiB, 2) for x in (plan.params, plan.grads, plan.optimizer, plan.activations,
                                                        plan.total)], row
        assert plan.fits and cells[7].startswith("fits")
        if path == STAGE2_LORA:  # the 26B-shaped adapter count: the planner's = the trainer's model's
            assert lora_terms(plan.spec)["adapter_params"] == _real_adapter_count(load_config(REPO / path, env={}))
        seen.add((path, acc, tuple(overrides)))
    assert (STAGE2_LORA, "h200", ()) in seen  # the shipped stage-2 config as it is, on one H200
    assert ("configs/stage1/gemma4_26b_a4b_lora.yaml", "h200", ()) in seen

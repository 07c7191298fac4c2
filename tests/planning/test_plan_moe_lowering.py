"""How the planner lowers the experts' grouped matmul on TPU with `model.execution.moe_kernel=xla`
(`dgemma.planning.plan_config.moe_lowering`): this libtpu expands `jax.lax.ragged_dot` into masked dense dots over
all experts inside fusions (docs/planner_compile.md), so the step's FLOPs are those of a dense expansion while its
memory is the ragged one, as the recorded deviceless v5p-64 compiles of ragged_dot show
(tests/golden/tpu_compiled_memory.json: their peaks are within 15 % of the ragged memory model and a quarter of the
dense one). `auto` (Megablox on TPU) stays ragged in both."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dgemma.config import load_config
from dgemma.planning.flops import step_flops
from dgemma.planning.plan_config import plan_for, spec_from_config
from dgemma.planning.planner import estimate

REPO = Path(__file__).resolve().parents[2]
S1 = REPO / "configs/stage1/gemma4_26b_a4b.yaml"


def _spec(kernel: str, accelerator: str | None, config: Path = S1, overrides=()):
    cfg = load_config(str(config), [*overrides, f"model.execution.moe_kernel={kernel}"], env={})
    return spec_from_config(cfg, devices=32, accelerator=accelerator)


def test_xla_on_tpu_costs_the_flops_of_every_expert_and_the_memory_of_the_routed_ones():
    xla, auto = _spec("xla", "v5p"), _spec("auto", "v5p")
    gpu_dense = dataclasses.replace(xla, moe_lowering="dense")  # XLA:GPU's expansion: dense in FLOPs and memory
    assert xla.moe_lowering == "dense_compute" and auto.moe_lowering == "ragged"
    flops, model_flops = step_flops(xla)
    assert flops == step_flops(gpu_dense)[0]  # every expert's matmuls
    assert flops > 20 * step_flops(auto)[0] and flops / model_flops > 20  # E / k = 16 x the expert work and more
    assert step_flops(auto)[0] / model_flops < 1.5
    plan, ragged = plan_for(xla), estimate(auto)
    assert plan.total == ragged.total and plan.activation_terms == ragged.activation_terms  # memory: not expanded
    assert plan.total < estimate(gpu_dense).total / 2
    assert any("moe_kernel=xla on TPU" in n and "megablox|auto does not" in n for n in plan.notes)
    assert not any("moe_kernel=xla on TPU" in n for n in plan_for(auto).notes)


@pytest.mark.parametrize("section", ["cases", "sampler_block_cases", "stage2_update_cases"])
def test_recorded_tpu_compiles_of_ragged_dot_pin_the_xla_kernel(section):
    """The recorded compiles that ran XLA's ragged_dot say so in their overrides (auto is Megablox on TPU now), so
    the planner plans them with the TPU lowering; the memory comparison itself is
    tests/planning/test_plan_planner.py::test_planner_agrees_with_the_recorded_tpu_compiles."""
    recorded = json.loads((REPO / "tests/golden/tpu_compiled_memory.json").read_text())[section]
    for case in recorded:
        kernels = [o.split("=", 1)[1] for o in case["overrides"] if o.startswith("model.execution.moe_kernel=")]
        assert len(kernels) == 1 and kernels[0] in ("xla", "megablox"), case["overrides"]
        cfg = load_config(str(REPO / case["config"]), case["overrides"], env={})
        lowering = spec_from_config(cfg, devices=32, accelerator="v5p").moe_lowering
        assert lowering == {"xla": "dense_compute", "megablox": "ragged"}[kernels[0]]

"""The recorded cost analysis of the 26B stage-1 step compiled deviceless for v5p with `moe_kernel: auto`
(tests/golden/tpu_moe_flops.json, written by `experiments/regenerate_compiled_golden.py --only tpu-flops` with
libtpu; docs/planner_compile.md, "MoE FLOPs on TPU"): one sliding layer, the difference of the [sliding, full] and
[full] compiles, costs at most 1.3 x 6 x its active params x tokens, so the grouped matmul `auto` picks on TPU is not
expanded densely over the experts (libtpu's `ragged_dot` is: E / k = 16 x the experts' matmuls). The figures
themselves come from libtpu; what is checked here, on CPU, is that they are what the script's arithmetic makes of
them and what the config says."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from support.scripts import load_script

from dgemma.config import load_config
from dgemma.model.kernels import resolve_moe_kernel
from dgemma.planning.flops import layer_matmul_params
from dgemma.planning.plan_config import spec_from_config

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests/golden/tpu_moe_flops.json"
regen = load_script("experiments/regenerate_compiled_golden.py", "regenerate_compiled_golden")


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    if not GOLDEN.exists():
        pytest.skip(f"{GOLDEN.relative_to(REPO)} not recorded (needs libtpu: regenerate_compiled_golden.py)")
    return json.loads(GOLDEN.read_text())["cases"]


def _sliding_spec(case: dict):
    cfg = load_config(str(REPO / case["config"]), regen.tpu_flops_overrides(case, "SF"), env={})
    return cfg, spec_from_config(cfg, devices=case["chips"], accelerator="v5p")


def test_recorded_tpu_moe_flops_are_what_the_config_and_the_two_compiles_make(cases):
    for case in cases:
        assert case["resolved"] == resolve_moe_kernel(case["moe_kernel"], "tpu") != "xla"
        chips = math.prod(int(n) for n in case["topology"].split(":")[1].split("x"))
        assert case["chips"] == chips
        per_chip = case["flops_per_chip"]
        assert set(per_chip) == set(regen.DEPTHS) and per_chip["SF"] > per_chip["F"] > 0
        assert case["sliding_layer_flops"] == pytest.approx((per_chip["SF"] - per_chip["F"]) * chips, rel=1e-12)
        cfg, spec = _sliding_spec(case)
        assert cfg.model_config.layer_types[0] == "sliding_attention"  # the layer the difference adds
        assert (case["global_batch"], case["tokens_per_example"]) == (spec.global_batch, spec.tokens_per_example)
        assert case["sliding_layer_model_flops"] == pytest.approx(
            6.0 * layer_matmul_params(cfg.model_config, 0) * spec.tokens_per_example * spec.global_batch, rel=1e-12)
        assert case["ratio"] == round(case["sliding_layer_flops"] / case["sliding_layer_model_flops"], 3)


def test_recorded_tpu_moe_flops_of_a_sliding_layer_are_those_of_the_routed_experts(cases):
    for case in cases:
        cfg, _ = _sliding_spec(case)
        m = cfg.model_config
        # the experts expanded over all E would cost ~60 x the layer's active matmuls on this config
        assert layer_matmul_params(m, 0, dense_moe=True) > 40 * layer_matmul_params(m, 0)
        # every active matmul runs forward and backward at least once: 6 x active x tokens is a floor
        assert 1.0 <= case["ratio"] <= 1.3

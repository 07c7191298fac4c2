"""`data.batch_size` is the global batch: how it splits over processes and the batch axes, and the derived
accumulation (`trainer.grad_accum_steps: 0`), as `dgemma train` and `dgemma plan` both use it."""

from __future__ import annotations

import pytest

from dgemma.parallel.checks import batch_layout


def test_the_global_batch_splits_over_processes_and_batch_axes():
    per_gpu = batch_layout(64, 8, {"data": 1, "fsdp": 8, "expert": 1, "tensor": 1}, "experts_on_fsdp", 0)
    per_node = batch_layout(64, 1, {"data": 1, "fsdp": 8, "expert": 1, "tensor": 1}, "experts_on_fsdp", 0)
    assert (per_gpu.rows_per_process, per_node.rows_per_process) == (8, 64)  # one batch whatever the processes
    assert per_gpu.grad_accum_steps == per_node.grad_accum_steps == 8 and per_gpu.micro_batch_per_device == 1
    v5p = batch_layout(64, 8, {"data": 1, "fsdp": 32}, "experts_on_fsdp", 0)
    assert (v5p.grad_accum_steps, v5p.micro_batch_per_device) == (2, 1)
    explicit = batch_layout(64, 2, {"data": 2, "fsdp": 4}, "fsdp", 2)
    assert (explicit.grad_accum_steps, explicit.micro_batch_per_device) == (2, 4)
    assert "global batch 64 (data.batch_size) = 2 processes x 32 rows" in explicit.describe()


@pytest.mark.parametrize("batch,processes,mesh,accum,message", [
    (60, 8, {"fsdp": 8}, 0, r"data.batch_size=60 \(the global batch\) is not divisible by the 8 processes"),
    (12, 1, {"fsdp": 8}, 1, r"use a multiple of 8"),
    (16, 1, {"fsdp": 8}, 4, r"micro-batch 4 \(global 16 / 4\) is not divisible"),
])
def test_a_batch_that_does_not_split_is_a_one_line_error(batch, processes, mesh, accum, message):
    with pytest.raises(ValueError, match=message) as e:
        batch_layout(batch, processes, mesh, "fsdp", accum)
    assert "\n" not in str(e.value)


def test_sdrl_prompts_must_split_over_the_batch_axes(tmp_path):
    """Stage 2's prompts (and its anchor rows) are sharded over the batch axes like any batch: `dgemma plan` and the
    SD·RL loop refuse a prompt count that does not split, in one line naming data.batch_size, before anything is
    written (the loop used to fail later with an IndivisibleError from the first sharded array)."""
    from pathlib import Path

    import jax

    from dgemma.config import load_config
    from dgemma.parallel.mesh import make_mesh
    from dgemma.planning.plan_config import plan_for, spec_from_config
    from dgemma.train.sdrl import run_sdrl

    repo = Path(__file__).resolve().parents[2]
    small = ["model.num_hidden_layers=2", "model.layer_types=[sliding_attention, full_attention]", "trainer.steps=1",
             "sdrl.group_size=2", "sampler.max_steps=4", "sdrl.teacher_sampler.max_steps=8",
             "sdrl.curriculum_max_steps=[3]", "sdrl.allow_random_init=true", f"run.output_dir={tmp_path}",
             "mesh.ici.fsdp=8"]
    cfg = load_config(repo / "configs/stage2/tiny.yaml", [*small, "data.batch_size=4"], env={})
    with pytest.raises(ValueError, match=r"data.batch_size=4 \(the global batch of prompts\) is not divisible .* = 8"):
        spec_from_config(cfg, devices=8)
    assert plan_for(spec_from_config(load_config(repo / "configs/stage2/tiny.yaml", [*small, "data.batch_size=8"],
                                                 env={}), devices=8)).total > 0
    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices")
    with pytest.raises(ValueError, match=r"data.batch_size=4 \(the global batch of prompts\) is not divisible"):
        run_sdrl(cfg, progress=False, mesh=make_mesh({"fsdp": 8}, devices=jax.devices()[:8]))
    assert not any(tmp_path.iterdir())  # nothing written

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

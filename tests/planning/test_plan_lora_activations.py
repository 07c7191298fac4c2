"""The planner's adapter activations (`lora_activations`, dgemma/planning/lora_plan.py) against what JAX's autodiff
keeps: the saved residuals (`jax.ad_checkpoint`) of the real stage-1 loss of a tiny adapted model, differentiated
with respect to the adapters as training does, under remat none / save_dots / full, with float32 and bfloat16
activations (the float32 adapters' casts). Also: no term without adapters, and how it scales with the rank."""

from __future__ import annotations

import dataclasses

import jax
import pytest
from flax import nnx
try:  # the residual list behind jax.ad_checkpoint.print_saved_residuals (private: may move in a newer jax)
    from jax._src.ad_checkpoint import saved_residuals
except ImportError:  # the public printer's lines ("bf16[4,16] output of dot_general from /path:line") parsed
    import contextlib
    import io
    import re
    import types

    import jax.ad_checkpoint
    import numpy as np

    def saved_residuals(f, *args):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            jax.ad_checkpoint.print_saved_residuals(f, *args)
        out = []
        for line in buf.getvalue().splitlines():
            m = re.match(r"(\w+)\[([\d,]*)\] (.*)", line.strip())
            if m:
                shape = tuple(int(d) for d in m.group(2).split(",") if d)
                dtype = {"f32": np.float32, "bf16": np.float16, "f16": np.float16, "i32": np.int32,
                         "bool": np.bool_, "u32": np.uint32}.get(m.group(1), np.float32)  # bf16: 2 bytes too
                out.append((types.SimpleNamespace(shape=shape, size=int(np.prod(shape)), dtype=np.dtype(dtype)),
                            m.group(3)))
        return out

from support.block_layout import stage1_batch
from dgemma.diffusion.stage1 import Stage1Config, stage1_loss
from dgemma.model.config import FULL, tiny
from dgemma.model.lora import LoraSpec, adapter_dropout, attach_adapters
from dgemma.model.transformer import Transformer
from dgemma.planning.lora_plan import lora_activation_split
from dgemma.planning.planner import PlanSpec, activation_bytes

P, L, N, ROWS = 6, 8, 2, 2  # prompt 6, two blocks of 8: T = P + 2R = 38 tokens per example, 2 examples
RANK = 3  # no other dimension of the tiny model is 3: the experts' x.A rows are told apart by it
TARGETS = ("attn/[qkvo]_proj$", "mlp/(gate|up|down)$", "experts/(gate|up|down)$")


def _lora(rank: int = RANK) -> LoraSpec:
    return LoraSpec(rank=rank, alpha=2.0 * rank, targets=TARGETS)


def _spec(cfg, lora, remat: str) -> PlanSpec:
    return PlanSpec(model=cfg, rules="fsdp", mesh={"fsdp": 1}, global_batch=ROWS, prompt_len=P, response_len=N * L,
                    remat=remat, self_cond_pass="noisy_stream", lora=lora)


def _adapter_residual_bytes(cfg, lora: LoraSpec) -> int:
    """Bytes of the residuals the adapters add to the stage-1 loss's backward: what lora.py / lora_experts.py make
    (x.A, (x.A).B, the weight casts) and the experts' x.A rows (ragged dots of width r), without the adapted sums
    y + delta, which stand in for the base outputs y."""
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    attach_adapters(model, lora, nnx.Rngs(1))
    batch = stage1_batch(P, L, N, (0, 2), (False, False))
    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
    loss_cfg = Stage1Config(p_self_cond=0.5, self_cond_pass="noisy_stream")

    def loss(adapters, rest):
        model = nnx.merge(graphdef, adapters, jax.lax.stop_gradient(rest))
        with adapter_dropout(model, jax.random.key(7)):  # sets keys only where lora.dropout > 0
            return stage1_loss(model, batch, jax.random.key(4), loss_cfg)[0]

    total = 0
    for aval, source in saved_residuals(loss, adapters, rest):
        if source.startswith("from the argument") or "output of add" in source:
            continue
        adapter_code = "/model/lora.py:" in source or "/model/lora_experts.py:" in source
        expert_low = "ragged_dot_general" in source and aval.shape[-1] == lora.rank
        if adapter_code or expert_low:
            total += aval.size * aval.dtype.itemsize
    return total


def _cast_slack(cfg, remat: str) -> int:
    """The casts the planner counts that autodiff does not keep: an A cast is needed only for its input's gradient,
    and neither the self-conditioning MLP's input (the stop-gradient soft embedding) nor, in the clean-stream pass,
    the first layer's attention input (the frozen embedding) has one. Float32 activations cast nothing."""
    if cfg.execution.dtype == "float32":
        return 0
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    attach_adapters(model, _lora(), nnx.Rngs(1))
    unneeded = ["self_conditioning/mlp/lora/gate/a", "self_conditioning/mlp/lora/up/a"]
    if remat == "none":
        unneeded += [f"layers/0/attn/lora/{w}_proj/a" for w in "qkv"]
    flat = {"/".join(map(str, path)): v for path, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}
    return sum(flat[name].size * 2 for name in unneeded)


@pytest.mark.parametrize("remat,dtype", [("none", "float32"), ("none", "bfloat16"), ("save_dots", "float32"),
                                         ("full", "bfloat16")])
def test_kept_adapter_activations_are_the_saved_residuals(remat, dtype):
    cfg = tiny().with_execution(remat=remat, dtype=dtype, param_dtype=dtype)  # the base in the activation dtype
    a = 2 if dtype == "bfloat16" else 4
    kept, recomputed = lora_activation_split(_spec(cfg, _lora(), remat), a, ROWS)
    assert kept - _cast_slack(cfg, remat) == _adapter_residual_bytes(cfg, _lora())
    assert (recomputed > 0) == (remat != "none")


def test_the_recomputed_block_is_one_layer_without_remat():
    """Under full remat the largest layer's adapters are held while it is recomputed: on a one-layer model, that
    layer's remat=none bytes (the self-conditioning MLP's are kept under both)."""
    one = tiny(num_hidden_layers=1, layer_types=(FULL,))
    none_kept, _ = lora_activation_split(_spec(one.with_execution(remat="none"), _lora(), "none"), 4, ROWS)
    full_kept, full_recomputed = lora_activation_split(_spec(one.with_execution(remat="full"), _lora(), "full"), 4,
                                                       ROWS)
    assert full_kept + full_recomputed == none_kept and full_kept > 0
    assert full_kept == _adapter_residual_bytes(one.with_execution(remat="full"), _lora())  # float32: no casts


def test_no_term_without_adapters_and_linear_in_the_rank():
    cfg = tiny().with_execution(dtype="bfloat16")
    plain = _spec(cfg, None, "none")
    assert "lora_activations" not in activation_bytes(plain)[1]
    with_adapters = activation_bytes(_spec(cfg, _lora(), "none"))
    assert with_adapters[1]["lora_activations"] == sum(lora_activation_split(_spec(cfg, _lora(), "none"), 2, ROWS))
    assert with_adapters[0] == activation_bytes(plain)[0] + with_adapters[1]["lora_activations"]
    for remat in ("none", "full"):  # the rank-r intermediates and casts: proportional to r
        one = sum(lora_activation_split(_spec(cfg, _lora(1), remat), 2, ROWS))
        assert one > 0
        for r in (2, 8, 16):
            assert sum(lora_activation_split(_spec(cfg, _lora(r), remat), 2, ROWS)) == r * one
    # save_dots also keeps each dense adapter's full-width product (x.A).B, whatever r: affine in r
    f = [sum(lora_activation_split(_spec(cfg, _lora(r), "save_dots"), 2, ROWS)) for r in (4, 8, 12)]
    assert f[2] - f[1] == f[1] - f[0] > 0 and f[0] - (f[1] - f[0]) > 0  # the r-independent products


def test_dropout_keeps_the_dropped_inputs():
    """lora.dropout > 0: each adapter's dropped input and keep mask are residuals too."""
    cfg = tiny().with_execution(dtype="bfloat16", param_dtype="bfloat16")
    drop = dataclasses.replace(_lora(), dropout=0.1)
    kept, _ = lora_activation_split(_spec(cfg, drop, "none"), 2, ROWS)
    assert kept > lora_activation_split(_spec(cfg, _lora(), "none"), 2, ROWS)[0]
    # the inputs without a gradient keep no mask (nor its select): the first layer's q / k / v in the clean pass
    # (P + R tokens), the self-conditioning gate / up (R tokens); 64 wide, 2 + 1 bytes per element
    no_grad_masks = ROWS * 64 * 3 * (3 * (P + N * L) + 2 * N * L)
    assert kept - _cast_slack(cfg, "none") - no_grad_masks == _adapter_residual_bytes(cfg, drop)

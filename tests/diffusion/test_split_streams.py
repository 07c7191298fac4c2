"""`diffusion.self_cond_pass=noisy_stream` (dgemma.diffusion.split_streams) is the same stage-1 loss as the one-pass
forward: loss, per-block NLL and every gradient (fp32), across attention implementations, layer scan, head
alignment and self-conditioning temperature; and XLA counts fewer FLOPs for the compiled step."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from support.block_layout import max_rel, perturb_params, stage1_batch
from dgemma.diffusion import masks as bd_masks
from dgemma.diffusion.split_streams import stream_masks
from dgemma.diffusion.stage1 import Stage1Config, one_pass_masks, stage1_loss
from dgemma.model.config import FULL, SLIDING, ExecutionConfig, tiny
from dgemma.model.transformer import Transformer

P, L, N = 6, 8, 3  # streams T = 6 + 2 * 24 = 54, context far beyond the window (4)
TOL = 1e-5


def _batch(left_pad=(0, 2, 5), unused_last_block=(False, True, False), seed=0):
    return stage1_batch(P, L, N, left_pad, unused_last_block, seed)


def _loss_and_grads(model, batch, cfg):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def f(p):
        loss, metrics = stage1_loss(nnx.merge(graphdef, p, rest), batch, jax.random.key(4), cfg)
        return loss, metrics["block_nll"]

    compiled = jax.jit(jax.value_and_grad(f, has_aux=True)).lower(params).compile()
    cost = compiled.cost_analysis()
    return compiled(params), float((cost[0] if isinstance(cost, list) else cost)["flops"])


@pytest.mark.parametrize("model_over,cfg_over", [
    (dict(), dict()),
    pytest.param(dict(execution=ExecutionConfig(scan_layers=True, scan_period=3, remat="save_dots")), dict(),
                 marks=pytest.mark.slow),
    pytest.param(dict(execution=ExecutionConfig(attention_impl="chunked", attention_q_chunk=18, attention_kv_chunk=9)),
                 dict(), marks=pytest.mark.slow),
    pytest.param(dict(execution=ExecutionConfig(scan_layers=True, scan_period=3, remat="full")),
                 dict(sc_train_temperature="sampled_tau"), marks=pytest.mark.slow),
    pytest.param(dict(decoder_sliding="jax_per_query"), dict(head_alignment="shift", clean_attention="block_causal"),
                 marks=pytest.mark.slow),
])
def test_noisy_stream_pass_equals_the_one_pass_forward(model_over, cfg_over):
    model = perturb_params(Transformer(tiny(tie_layer_scalar=False, **model_over), rngs=nnx.Rngs(0)))
    batch = _batch(left_pad=(0, 5), unused_last_block=(True, False))
    full = Stage1Config(p_self_cond=0.5, **cfg_over)  # rows with and without self-conditioning
    split = Stage1Config(p_self_cond=0.5, self_cond_pass="noisy_stream", **cfg_over)
    ((l_f, nll_f), g_f), flops_full = _loss_and_grads(model, batch, full)
    ((l_s, nll_s), g_s), flops_split = _loss_and_grads(model, batch, split)
    assert flops_split < 0.95 * flops_full, (flops_split, flops_full)  # XLA's count: the SC pass covers R tokens
    assert max_rel(l_s, l_f) <= TOL and float(l_f) > 1.0
    assert max_rel(nll_s, nll_f) <= TOL
    for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(g_f)):
        assert max_rel(a, b) <= TOL
    assert float(max(jnp.abs(x).max() for x in jax.tree.leaves(g_f))) > 1e-3


def test_stream_masks_are_the_one_pass_mask_blocks():
    """Clean queries see only clean keys in the one-pass rule, so the clean pass drops no key; the noisy rows are
    the one-pass rows unchanged."""
    cfg = tiny()
    batch = _batch()
    streams = bd_masks.concat_streams(batch["tokens"], batch["tokens"][:, P:], batch["positions"], batch["valid"],
                                      batch["block_id"])
    Tc = P + N * L
    for impl in ("dense", "chunked"):
        masks = one_pass_masks(cfg.with_execution(attention_impl=impl, attention_q_chunk=54, attention_kv_chunk=54),
                               streams)
        clean, noisy = stream_masks(masks, Tc)
        for kind in (SLIDING, FULL):
            whole = masks[kind] if impl == "dense" else masks[kind].to_dense()
            c = clean[kind] if impl == "dense" else clean[kind].to_dense()
            n = noisy[kind] if impl == "dense" else noisy[kind].to_dense()
            np.testing.assert_array_equal(np.asarray(c), np.asarray(whole[:, :Tc, :Tc]))
            np.testing.assert_array_equal(np.asarray(n), np.asarray(whole[:, Tc:]))
            assert not np.asarray(whole[:, :Tc, Tc:]).any()  # nothing clean attends to the noisy stream


def test_bad_self_cond_pass_is_refused():
    with pytest.raises(ValueError, match="self_cond_pass"):
        Stage1Config(self_cond_pass="noisy")


# slow (35 s and more): the one-pass gradient stack stays pinned in the default run by the twin test below
@pytest.mark.parametrize("remat", [pytest.param("save_dots", marks=pytest.mark.slow), pytest.param("none", marks=pytest.mark.slow)])
def test_scanned_split_streams_keep_one_gradient_stack(monkeypatch, remat):
    """Scanned layers: the main noisy pass's gradient of the scanned parameters accumulates into the clean pass's
    backward (dgemma.model.shared_scan_grads) instead of a second stack added at the end. Same loss and gradients as
    the two-stack split (fp32, 1e-6: the same two addends per element), and XLA:CPU allocates less temporary memory
    for the compiled step (at 26B on 8 x H100 the second stack is 11.41 GiB per GPU at the peak, docs/planner_gpu.md)."""
    import functools

    import dgemma.diffusion.stage1 as stage1_mod
    from dgemma.diffusion.split_streams import split_hidden

    cfg = tiny(tie_layer_scalar=False, num_hidden_layers=4, layer_types=(SLIDING, FULL) * 2, num_experts=16,
               moe_intermediate_size=128, intermediate_size=128).with_execution(
        scan_layers=True, scan_period=2, remat=remat, attention_impl="chunked", attention_q_chunk=18,
        attention_kv_chunk=9)
    model = perturb_params(Transformer(cfg, rngs=nnx.Rngs(0)))
    batch = _batch(left_pad=(0, 5), unused_last_block=(True, False))
    split = Stage1Config(p_self_cond=0.5, self_cond_pass="noisy_stream")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    out = {}
    for share in (True, False):
        monkeypatch.setattr(stage1_mod, "split_hidden", functools.partial(split_hidden, share_scan_grads=share))

        def f(p):
            return stage1_loss(nnx.merge(graphdef, p, rest), batch, jax.random.key(4), split)[0]

        compiled = jax.jit(jax.value_and_grad(f)).lower(params).compile()
        out[share] = compiled(params), compiled.memory_analysis().temp_size_in_bytes
    (l_1, g_1), temp_1 = out[True]
    (l_2, g_2), temp_2 = out[False]
    assert float(l_1) == pytest.approx(float(l_2), rel=1e-6) and float(l_1) > 1.0
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_1), jax.tree.leaves(g_2)):
        assert max_rel(a, b) <= 1e-6, jax.tree_util.keystr(path)
    stack = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model.scan_blocks, nnx.Param)))
    assert temp_1 <= temp_2 - 0.3 * stack, (temp_1, temp_2, stack)  # 2026-12-03, jax 0.10.2: about 0.5 x stack


def test_a_later_pass_on_the_twin_adds_its_gradient_into_the_one_pass_stack():
    """The SD·RL update's use (dgemma.train.sdrl.loss): a one-pass forward with decoder-token flags
    (`one_pass_hidden_and_twin`) returns a twin; a second forward over other rows on the twin adds its
    scanned-parameter gradient into the first pass's backward. Same gradients as two independent passes (fp32)."""
    from dgemma.diffusion.stage1 import one_pass_hidden, one_pass_hidden_and_twin

    cfg = tiny(tie_layer_scalar=False, num_hidden_layers=4,
               layer_types=(SLIDING, FULL) * 2).with_execution(scan_layers=True, scan_period=2, remat="save_dots")
    model = perturb_params(Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    a, b = _batch(seed=0), _batch(left_pad=(1, 0, 3), seed=1)
    Tc = P + N * L
    layouts = []
    for batch in (a, b):
        streams = bd_masks.concat_streams(batch["tokens"], batch["tokens"][:, P:], batch["positions"],
                                          batch["valid"], batch["block_id"])
        layouts.append((streams, one_pass_masks(cfg, streams, num_clean=Tc)))

    def f(p, share):
        m = nnx.merge(graphdef, p, rest)
        h1, later = (one_pass_hidden_and_twin(m, *layouts[0], Tc) if share
                     else (one_pass_hidden(m, *layouts[0], Tc), m))
        h2 = one_pass_hidden(later, *layouts[1], Tc)
        return jnp.sum(h1 * h1) + jnp.sum(jnp.sin(h2))

    (l_1, g_1), (l_2, g_2) = (jax.jit(jax.value_and_grad(f), static_argnums=1)(params, s) for s in (True, False))
    assert float(l_1) == pytest.approx(float(l_2), rel=1e-6)
    for x, y in zip(jax.tree.leaves(g_1), jax.tree.leaves(g_2)):
        assert max_rel(x, y) <= TOL
    assert float(max(jnp.abs(x).max() for x in jax.tree.leaves(g_1))) > 1e-3

"""The Pallas TPU kernels (Splash attention, Megablox grouped matmul) against the reference paths, in interpret mode.

Interpret mode runs the kernels' own code (tiling, block skipping, masking, custom VJPs) on CPU; what it cannot
check is Mosaic's TPU code generation, which the deviceless TPU compiles of `dgemma plan --compile` exercise."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from support.block_layout import max_rel, perturb_params, stage1_batch
from dgemma.diffusion.stage1 import Stage1Config, canonical_one_pass_pattern, one_pass_masks, stage1_loss
from dgemma.diffusion import masks as bd_masks
from dgemma.model.config import FULL, SLIDING, tiny
from dgemma.model.kernels import grouped_matmul, splash_attention
from dgemma.model.moe import MoEBlock
from dgemma.model.transformer import Transformer
from dgemma.parallel.mesh import make_mesh
from dgemma.parallel.rules import get_rules, state_shardings

jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts (as tests/model/test_moe_ep.py)

# prompt 64 + 2 x 6 canvases of 16 = 256 streams: two 128-row Splash blocks per axis, so whole tiles are skipped
P, L, N = 64, 16, 6
TOL = 1e-5


def _batch(left_pad=(0, 5), unused_last_block=(True, False), seed=0):
    return stage1_batch(P, L, N, left_pad, unused_last_block, seed)


@pytest.mark.parametrize("decoder_sliding", ["hf_fixed", "jax_per_query"])
def test_splash_pattern_with_key_validity_equals_the_dense_rule(decoder_sliding):
    """The static pattern of a canonical row AND per-example key validity is the dense one-pass mask on every valid query
    (left padding, an unused canvas, context far beyond the window)."""
    cfg = tiny(canvas_length=L, decoder_sliding=decoder_sliding).with_execution(
        attention_impl="splash", attention_q_chunk=128, attention_kv_chunk=128)
    batch = _batch()
    streams = bd_masks.concat_streams(batch["tokens"], batch["tokens"][:, P:], batch["positions"], batch["valid"],
                                      batch["block_id"])
    splash = one_pass_masks(cfg, streams, num_clean=P + N * L)
    dense = one_pass_masks(cfg.with_execution(attention_impl="dense"), streams)
    for kind in (SLIDING, FULL):
        got, want = np.asarray(splash[kind].to_dense()), np.asarray(dense[kind])
        rows = np.asarray(streams.valid)
        np.testing.assert_array_equal(got[rows], want[rows])
        assert want[rows].sum() > 0 and not want[rows].all()


def test_splash_pattern_refuses_a_response_that_is_not_whole_canvases():
    with pytest.raises(ValueError, match="canvas_length"):
        canonical_one_pass_pattern(100, 36, 16, None, FULL, decoder_sliding="hf_fixed", clean_attention="causal",
                                   strict=True)


@pytest.mark.parametrize("kind", [SLIDING, FULL])
def test_splash_kernel_equals_dense_attention_on_the_one_pass_layout(kind):
    """The kernel alone (GQA, 2 rows with left padding and an unused canvas): outputs and q/k/v gradients equal a dense
    masked softmax on every valid query row (invalid rows are never read)."""
    cfg = tiny(canvas_length=L).with_execution(attention_impl="splash", attention_q_chunk=128, attention_kv_chunk=128)
    batch = _batch()
    streams = bd_masks.concat_streams(batch["tokens"], batch["tokens"][:, P:], batch["positions"], batch["valid"],
                                      batch["block_id"])
    mask = one_pass_masks(cfg, streams, num_clean=P + N * L)[kind]
    B, T = streams.tokens.shape
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
               for shape in ((B, T, 2, 2, 16), (B, T, 2, 16), (B, T, 2, 16)))
    rows = streams.valid[:, :, None, None, None].astype(jnp.float32)
    probe = jnp.asarray(rng.standard_normal(q.shape), jnp.float32) * rows

    def dense(q, k, v):
        scores = jnp.einsum("btkgd,bskd->bkgts", q, k)
        scores = jnp.where(mask.to_dense()[:, None, None], scores, -1e30)
        return jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(scores, axis=-1), v)

    def kernel(q, k, v):
        return splash_attention(q, k, v, mask, block_q=128, block_kv=128, interpret=True)

    np.testing.assert_allclose(np.asarray(kernel(q, k, v) * rows), np.asarray(dense(q, k, v) * rows), atol=1e-5)
    grads = [jax.grad(lambda *a: jnp.sum(f(*a) * probe), (0, 1, 2))(q, k, v) for f in (kernel, dense)]
    for a, b in zip(*grads):
        assert max_rel(a, b) <= TOL


@pytest.mark.slow
def test_stage1_loss_and_grads_splash_equal_dense():
    """Stage-1 one-pass layout through the Splash kernel: loss, per-block NLL and every gradient equal the dense
    reference (fp32), with self-conditioning, sliding + full layers, left padding and an unused canvas."""
    base = tiny(canvas_length=L, tie_layer_scalar=False).with_execution(attention_q_chunk=128, attention_kv_chunk=128)
    dense = perturb_params(Transformer(base, rngs=nnx.Rngs(0)))
    splash = Transformer(base.with_execution(attention_impl="splash", kernel_interpret=True), rngs=nnx.Rngs(0))
    nnx.update(splash, nnx.state(dense))
    batch = _batch(left_pad=(5,), unused_last_block=(True,))  # one row: left padding and an unused canvas
    cfg = Stage1Config(p_self_cond=1.0)

    def loss_and_grads(model):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def f(p):
            loss, metrics = stage1_loss(nnx.merge(graphdef, p, rest), batch, jax.random.key(4), cfg)
            return loss, metrics["block_nll"]

        return jax.jit(jax.value_and_grad(f, has_aux=True))(params)

    (l_d, nll_d), g_d = loss_and_grads(dense)
    (l_s, nll_s), g_s = loss_and_grads(splash)
    assert max_rel(l_s, l_d) <= TOL and float(l_d) > 1.0
    assert max_rel(nll_s, nll_d) <= TOL
    # The gradients' fp32 floor here: XLA's chunked attention (another exact implementation, online softmax) differs
    # from dense by ~1.2e-5 on this model (two decoder passes with self-conditioning); Splash must stay within 2x of
    # that floor, and the floor itself small.
    chunked = Transformer(base.with_execution(attention_impl="chunked"), rngs=nnx.Rngs(0))
    nnx.update(chunked, nnx.state(dense))
    _, g_c = loss_and_grads(chunked)
    floor = max(max_rel(a, b) for a, b in zip(jax.tree.leaves(g_c), jax.tree.leaves(g_d)))
    assert floor <= 3e-5
    for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(g_d)):
        assert max_rel(a, b) <= max(TOL, 2 * floor)
    assert float(max(jnp.abs(x).max() for x in jax.tree.leaves(g_d))) > 1e-3


def test_splash_needs_tpu_or_interpret_and_lane_sized_blocks():
    with pytest.raises(ValueError, match="attention_q_chunk.*multiple of 128"):
        tiny().with_execution(attention_impl="splash", attention_q_chunk=64, attention_kv_chunk=128)
    cfg = tiny(canvas_length=L).with_execution(attention_impl="splash", attention_q_chunk=128, attention_kv_chunk=128)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="attention_impl='splash' is a TPU .* targets 'cpu'.*kernel_interpret"):
        stage1_loss(model, _batch(), jax.random.key(0), Stage1Config())


@pytest.mark.parametrize("shape", [(100, 64, 704, 3), pytest.param((40, 32, 24, 4), marks=pytest.mark.slow),
                                   pytest.param((256, 128, 256, 5), marks=pytest.mark.slow)])
def test_megablox_equals_ragged_dot_with_gradients(shape):
    """Rows past the routed ones (and the tile padding) give 0 and get no gradient, as with ragged_dot."""
    M, K, Nn, G = shape
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((G, K, Nn)), jnp.float32)
    sizes = jnp.asarray([M // 4] * (G - 1) + [0], jnp.int32)  # the last group empty; M - sum rows unrouted

    def f(a, b, kernel):
        return jnp.sum(grouped_matmul(a, b, sizes, kernel=kernel, interpret=True) ** 2)

    out = grouped_matmul(lhs, rhs, sizes, kernel="megablox", interpret=True)
    ref = jax.lax.ragged_dot(lhs, rhs, sizes)
    # Relative to the output's scale (|out| ~ 40 at K = 128): the kernel sums K in tiles, ragged_dot in one go, so an
    # absolute 1e-5 is below fp32 rounding there and passed or failed with the machine's summation order.
    assert max_rel(out, ref) <= TOL and float(jnp.abs(ref).max()) > 1.0
    assert not np.asarray(out)[int(sizes.sum()):].any()  # unrouted rows give exactly 0
    for a, b in zip(jax.grad(f, (0, 1))(lhs, rhs, "megablox"), jax.grad(f, (0, 1))(lhs, rhs, "xla")):
        assert np.isfinite(np.asarray(a)).all() and max_rel(a, b) <= TOL


def test_moe_block_with_megablox_equals_xla_and_refuses_cpu_without_interpret():
    cfg = tiny()
    ref = perturb_params(MoEBlock(cfg, param_dtype=jnp.float32, rngs=nnx.Rngs(0)))
    mb = MoEBlock(cfg.with_execution(moe_kernel="megablox", kernel_interpret=True), param_dtype=jnp.float32,
                  rngs=nnx.Rngs(0))
    nnx.update(mb, nnx.state(ref))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 24, cfg.hidden_size)), jnp.float32)

    def loss(m):
        return jnp.sum(m(x) ** 2)

    assert max_rel(mb(x), ref(x)) <= TOL  # relative to the output scale, not an absolute 1e-5 (see above)
    g_mb, g_ref = nnx.grad(loss)(mb), nnx.grad(loss)(ref)
    for a, b in zip(jax.tree.leaves(g_mb), jax.tree.leaves(g_ref)):
        assert max_rel(a, b) <= TOL
    cpu = MoEBlock(cfg.with_execution(moe_kernel="megablox"), param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="moe_kernel='megablox' is a TPU"):
        cpu(x)
    with pytest.raises(ValueError, match="moe_kernel"):
        tiny().with_execution(moe_kernel="pallas")


@pytest.mark.parametrize("impl,sizes,rules,expert_axis", [
    ("sharded", {"data": 2, "fsdp": 4}, "experts_on_fsdp", "expert"),
    pytest.param("ep", {"data": 2, "fsdp": 2, "expert": 2}, "ep", "expert", marks=pytest.mark.slow),
])
def test_megablox_inside_the_per_device_dispatches_on_8_devices(impl, sizes, rules, expert_axis):
    """The kernel runs inside the dispatch's shard_map (check_vma off there): outputs and gradients, including the
    replicated / expert-split weights' cotangents, equal the single-device MoE."""
    cfg = tiny(num_experts=8, top_k_experts=3).with_execution(moe_impl=impl, expert_axis=expert_axis)
    ref = perturb_params(MoEBlock(cfg, param_dtype=jnp.float32, rngs=nnx.Rngs(0)))
    graphdef_mb = nnx.graphdef(MoEBlock(cfg.with_execution(moe_kernel="megablox", kernel_interpret=True),
                                        param_dtype=jnp.float32, rngs=nnx.Rngs(0)))
    state = nnx.state(ref)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((8, 12, cfg.hidden_size)), jnp.float32)

    def run(graphdef, state, x):
        def loss(s, x):
            out = nnx.merge(graphdef, s)(x)
            return jnp.sum(jnp.sin(out)), out
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(state, x)

    (_, want), want_g = run(nnx.graphdef(MoEBlock(cfg.with_execution(moe_impl="local"), param_dtype=jnp.float32,
                                                  rngs=nnx.Rngs(0))), state, x)
    mesh = make_mesh(sizes)
    sharded = jax.device_put(state, state_shardings(state, mesh, get_rules(rules)))
    with jax.set_mesh(mesh):
        (_, got), got_g = run(graphdef_mb, sharded, x)
    assert max_rel(got, want) <= TOL
    for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        assert max_rel(a, b) <= TOL


def test_megablox_with_the_local_dispatch_on_a_mesh_is_refused():
    cfg = tiny(num_experts=8, top_k_experts=3).with_execution(moe_impl="local", moe_kernel="megablox",
                                                               kernel_interpret=True)
    block = MoEBlock(cfg, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    with jax.set_mesh(make_mesh({"data": 2, "fsdp": 4})):
        with pytest.raises(ValueError, match="needs model.execution.moe_impl 'sharded' or 'ep' on a 8-device mesh"):
            jax.jit(lambda x: block(x))(jnp.ones((8, 4, cfg.hidden_size)))


@pytest.mark.slow
def test_splash_on_8_devices_equals_dense():
    """Splash runs in a shard_map over the batch on a {data 2, fsdp 4} mesh: loss and gradients equal dense."""
    base = tiny(canvas_length=L).with_execution(attention_q_chunk=128, attention_kv_chunk=128)
    dense = perturb_params(Transformer(base, rngs=nnx.Rngs(0)))
    graphdef_d, params, rest = nnx.split(dense, nnx.Param, ...)
    graphdef_s = nnx.graphdef(Transformer(base.with_execution(attention_impl="splash", kernel_interpret=True),
                                          rngs=nnx.Rngs(0)))
    batch = _batch(left_pad=(0, 5, 1, 0, 7, 2, 0, 3), unused_last_block=(True, False) * 4)
    cfg = Stage1Config(p_self_cond=0.0)

    def loss_and_grads(graphdef, params):
        def f(p):
            return stage1_loss(nnx.merge(graphdef, p, rest), batch, jax.random.key(4), cfg)[0]
        return jax.jit(jax.value_and_grad(f))(params)

    l_d, g_d = loss_and_grads(graphdef_d, params)
    with jax.set_mesh(make_mesh({"data": 2, "fsdp": 4})):
        l_s, g_s = loss_and_grads(graphdef_s, params)
    assert max_rel(l_s, l_d) <= TOL
    for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(g_d)):
        assert max_rel(a, b) <= TOL


@pytest.mark.slow
def test_splash_with_the_noisy_stream_self_conditioning_pass_equals_dense():
    """Splash over [clean K/V ; noisy keys] (the restricted pattern, R = 128 noisy queries) in the split passes of
    `diffusion.self_cond_pass=noisy_stream`: loss and gradients equal the dense one-pass forward."""
    global P, N
    saved = (P, N)
    P, N = 128, 8  # clean 256, noisy 128: whole 128-row Splash blocks in every pass
    try:
        base = tiny(canvas_length=L).with_execution(attention_q_chunk=128, attention_kv_chunk=128)
        dense = perturb_params(Transformer(base, rngs=nnx.Rngs(0)))
        splash = Transformer(base.with_execution(attention_impl="splash", kernel_interpret=True), rngs=nnx.Rngs(0))
        nnx.update(splash, nnx.state(dense))
        batch = _batch(left_pad=(0, 9), unused_last_block=(False, True))
        graphdef, params, rest = nnx.split(dense, nnx.Param, ...)
        graphdef_s = nnx.graphdef(splash)

        def loss_and_grads(graphdef, cfg):
            def f(p):
                return stage1_loss(nnx.merge(graphdef, p, rest), batch, jax.random.key(4), cfg)[0]
            return jax.jit(jax.value_and_grad(f))(params)

        l_d, g_d = loss_and_grads(graphdef, Stage1Config(p_self_cond=0.5))
        l_s, g_s = loss_and_grads(graphdef_s, Stage1Config(p_self_cond=0.5, self_cond_pass="noisy_stream"))
    finally:
        P, N = saved
    assert max_rel(l_s, l_d) <= TOL
    for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(g_d)):
        assert max_rel(a, b) <= TOL


def test_a_run_asking_for_a_tpu_kernel_on_cpu_fails_before_writing(tmp_path):
    """`dgemma train` with a Pallas kernel on a CPU mesh: one line naming the setting, no run directory."""
    from dgemma.config import load_config
    from dgemma.train.trainer import train

    repo = __import__("pathlib").Path(__file__).resolve().parents[2]
    for override in ("model.execution.attention_impl=splash", "model.execution.moe_kernel=megablox"):
        cfg = load_config(repo / "configs/stage1/tiny.yaml", [override, "trainer.steps=1",
                                                               f"run.output_dir={tmp_path}/runs"])
        with pytest.raises(ValueError, match=f"{override.split('=')[0]}='{override.split('=')[1]}' is a TPU"):
            train(cfg, progress=False, mesh=make_mesh({"fsdp": 1}, jax.devices()[:1]))
        assert not (tmp_path / "runs").exists()

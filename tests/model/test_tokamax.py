"""model.execution.attention_impl=tokamax / model.execution.moe_kernel=tokamax: Tokamax's kernels behind the same
structured masks, run here through Tokamax's XLA implementations (the same API, mask handling and head grouping its GPU
kernels take; the Mosaic / Triton kernels themselves need a GPU and are Tokamax's to test). Forward and gradients equal
the dense reference (fp32) on the one-pass stage-1 layout and over the cache; a kernel the platform cannot run is
refused."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

pytest.importorskip("tokamax")

from support import jitted as J  # noqa: E402
from support.block_layout import max_rel, perturb_params, stage1_batch  # noqa: E402
from dgemma.diffusion.stage1 import Stage1Config, stage1_loss  # noqa: E402
from dgemma.model.cache import KVCache  # noqa: E402
from dgemma.model.config import tiny  # noqa: E402
from dgemma.model.kernels import check_kernel_platform, grouped_matmul  # noqa: E402
from dgemma.model.transformer import Transformer  # noqa: E402

P, L, N = 6, 8, 3  # context far beyond the window (4)
TOL = 1e-5


def _pair(**tokamax):
    cfg = tiny(tie_layer_scalar=False).with_execution(attention_q_chunk=18, attention_kv_chunk=9)
    dense = perturb_params(Transformer(cfg, rngs=nnx.Rngs(0)))
    twin = Transformer(cfg.with_execution(attention_impl="tokamax", **tokamax), rngs=nnx.Rngs(0))
    nnx.update(twin, nnx.state(dense))
    return dense, twin


def test_stage1_loss_and_grads_tokamax_equal_dense():
    """One-pass layout: sliding + full layers, left padding, an unused block, self-conditioning; experts through
    Tokamax's ragged_dot as well."""
    dense, tk = _pair(tokamax_backend="xla", moe_kernel="tokamax")
    batch = stage1_batch(P, L, N, (0, 2, 5), (False, True, False), 0)

    def loss_and_grads(model):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        f = lambda p: stage1_loss(nnx.merge(graphdef, p, rest), batch, jax.random.key(4),  # noqa: E731
                                  Stage1Config(p_self_cond=0.5))[0]
        return jax.value_and_grad(f)(params)

    (l_d, g_d), (l_t, g_t) = loss_and_grads(dense), loss_and_grads(tk)
    assert max_rel(l_t, l_d) <= TOL and float(l_d) > 1.0
    for a, b in zip(jax.tree.leaves(g_t), jax.tree.leaves(g_d)):
        assert max_rel(a, b) <= TOL
    assert float(max(jnp.abs(x).max() for x in jax.tree.leaves(g_d))) > 1e-3


def test_encoder_and_decoder_over_the_cache_tokamax_equal_dense():
    """Encoder with a cache (left padding), decoder over the cache ring with self-conditioning, the next block."""
    dense, tk = _pair(tokamax_backend="xla_chunked")
    prompt = jax.random.randint(jax.random.key(2), (2, 13), 3, 120)
    prompt_valid = jnp.ones((2, 13), bool).at[1, :4].set(False)
    canvas = jax.random.randint(jax.random.key(3), (2, L), 0, 120)
    sc = 2.0 * jax.random.normal(jax.random.key(4), (2, L, 128))

    def run(model):
        cache = KVCache.init(model.cfg, 2, 13 + 2 * L)
        h, cache = J.encode(model, prompt, cache, prompt_valid)
        l1 = J.logits(model, J.decode(model, canvas, cache))
        _, cache = J.encode(model, canvas, cache)
        l2 = J.logits(model, J.decode(model, canvas[:, ::-1], cache, sc_logits=sc, sc_mask=jnp.array([True, False])))
        return h, l1, l2

    (h_d, a_d, b_d), (h_t, a_t, b_t) = run(dense), run(tk)
    assert max_rel(h_t[0], h_d[0]) <= TOL and max_rel(h_t[1, 4:], h_d[1, 4:]) <= TOL
    assert max_rel(a_t, a_d) <= TOL and max_rel(b_t, b_d) <= TOL


def test_tokamax_ragged_dot_zeroes_unrouted_rows():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((10, 6)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 6, 5)), jnp.float32)
    sizes = jnp.array([3, 0, 4], jnp.int32)  # rows 7..9 belong to no group
    f = lambda kernel: lambda x: grouped_matmul(x, w, sizes, kernel=kernel, interpret=False,  # noqa: E731
                                                tokamax_backend="xla")
    assert max_rel(f("tokamax")(x), f("xla")(x)) <= 1e-6  # relative to the output scale: summation orders differ
    g = jax.grad(lambda x: jnp.sum(f("tokamax")(x) ** 2))(x)
    assert float(jnp.abs(g[7:]).max()) == 0.0 and float(jnp.abs(g[:7]).max()) > 0


@pytest.mark.parametrize("override,match", [
    (dict(attention_impl="tokamax", tokamax_backend="mosaic"), "tokamax_backend='mosaic'.*targets 'cpu'"),
    (dict(moe_kernel="tokamax", tokamax_backend="triton"), "moe_kernel='tokamax'.*'triton'.*targets 'cpu'"),
])
def test_a_gpu_kernel_on_cpu_is_refused_in_one_line(override, match):
    with pytest.raises(ValueError, match=match):
        check_kernel_platform(tiny().with_execution(**override), "cpu")
    check_kernel_platform(tiny().with_execution(**override), "gpu")  # what the kernel is for


def test_bad_tokamax_settings_name_the_field():
    with pytest.raises(ValueError, match="tokamax_backend"):
        tiny().with_execution(tokamax_backend="cuda")
    with pytest.raises(ValueError, match="tokamax_backend.*attention implementation"):
        tiny().with_execution(moe_kernel="tokamax", tokamax_backend="xla_chunked")


def test_wide_heads_mosaic_refused_on_gpu_triton_splits_the_head():
    """Head_dim 512 (the full layers): Mosaic GPU attention cannot tile it on a Hopper SM (refused before a run on
    GPU, still allowed on TPU), Triton gets head-split tiles; heads up to 256 keep Tokamax's own choice."""
    from dgemma.model.kernels import WIDE_HEAD, _tokamax_attention_implementation

    wide = tiny(global_head_dim=2 * WIDE_HEAD).with_execution(attention_impl="tokamax", tokamax_backend="mosaic")
    with pytest.raises(ValueError, match="tokamax_backend='mosaic' cannot run head_dim 512 on GPU.*'triton'"):
        check_kernel_platform(wide, "gpu")
    check_kernel_platform(wide, "tpu")
    check_kernel_platform(wide.with_execution(tokamax_backend="triton"), "gpu")
    check_kernel_platform(tiny(global_head_dim=WIDE_HEAD).with_execution(attention_impl="tokamax",
                                                                          tokamax_backend="mosaic"), "gpu")
    op = _tokamax_attention_implementation("triton", 512)
    assert op.config.block_d == op.config.block_d_out == 128 and 512 % op.config.block_d == 0
    assert [_tokamax_attention_implementation(b, d) for b, d in (("triton", 256), ("mosaic", 512), ("xla", 512))] \
        == ["triton", "mosaic", "xla"]


def test_moe_kernel_auto_is_tokamax_on_gpu_and_xla_elsewhere():
    """model.execution.moe_kernel=auto (the shipped 26B configs): Tokamax's grouped matmul where XLA would expand
    ragged_dot over every expert (GPU), Megablox on TPU, ragged_dot on CPU; checked before a run and resolved at trace
    time for the platform the program is for (the deviceless H100 compile of it is tests/planning/test_gpu_aot.py, slow)."""
    from dgemma.model.kernels import resolve_moe_kernel
    from dgemma.model.moe import Experts

    assert [resolve_moe_kernel("auto", p) for p in ("gpu", "tpu", "cpu")] == ["tokamax", "megablox", "xla"]
    assert [resolve_moe_kernel(k, "gpu") for k in ("xla", "megablox", "tokamax")] == ["xla", "megablox", "tokamax"]
    auto = tiny().with_execution(moe_kernel="auto", tokamax_backend="triton")
    for platform in ("gpu", "tpu", "cpu"):  # Triton is a GPU kernel, but only GPU resolves auto to Tokamax
        check_kernel_platform(auto, platform)
    chunked = tiny().with_execution(moe_kernel="auto", attention_impl="tokamax", tokamax_backend="xla_chunked")
    check_kernel_platform(chunked, "cpu")  # XLA's ragged_dot here; xla_chunked is attention's
    with pytest.raises(ValueError, match=r"^model\.execution\.moe_kernel='auto' \(tokamax on gpu\): "
                                         r"model\.execution\.tokamax_backend="
                                         r"'xla_chunked' is an attention implementation"):
        check_kernel_platform(chunked, "gpu")
    # traced on CPU: XLA's ragged_dot, the same values as moe_kernel=xla
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(6, 16)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, 4, (6, 2)), jnp.int32)
    w = jnp.asarray(rng.random((6, 2)), jnp.float32)
    outs = {}
    for kernel in ("auto", "xla"):
        experts = Experts(4, 16, 8, param_dtype=jnp.float32, rngs=nnx.Rngs(0), impl="local", kernel=kernel)
        assert "ragged_dot" in str(jax.make_jaxpr(lambda a: experts(a, w, idx))(x))
        outs[kernel] = np.asarray(experts(x, w, idx))
    np.testing.assert_array_equal(outs["auto"], outs["xla"])

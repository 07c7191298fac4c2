"""LoRA adapters on the model (`dgemma.model.lora`, `dgemma.model.lora_experts`): zero adapters change nothing bit
for bit; trained (random) adapters equal the merged model W + scale * A.B to fp32 rounding, for every target kind
(attention q/k/v/o, dense MLP, self-conditioning MLP, router, experts), per-layer and scanned, and under the
per-device expert dispatches; adapters carry their base weight's sharding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dgemma.model.config import FULL, SLIDING, tiny
from dgemma.model.lora import LoraSpec, attach_adapters, merged_params
from dgemma.model.transformer import Transformer

ALL = (r"attn/[qkvo]_proj$", r"mlp/(gate|up|down)$", r"router/proj$", r"experts/(gate|up|down)$")
LAYERS = (SLIDING, FULL, FULL)  # scanned with period 2: one scanned period + one tail layer


def _randomize(model, key, which=nnx.Param, scale=0.1):
    """Perturb every leaf of `which` (norms, scalars, adapters' B too: init values would hide a misplaced term)."""
    state = nnx.state(model, which)
    keys = iter(jax.random.split(jax.random.key(key), len(jax.tree.leaves(state))))
    nnx.update(model, jax.tree.map(lambda x: x + scale * jax.random.normal(next(keys), x.shape, x.dtype), state))


def _model(scan_layers=False):
    cfg = tiny(num_hidden_layers=3, layer_types=LAYERS, self_conditioning=True).with_execution(
        scan_layers=scan_layers, scan_period=2)
    m = Transformer(cfg, rngs=nnx.Rngs(0))
    _randomize(m, 9)
    return m


def _tokens(B=2, T=12):
    return jax.random.randint(jax.random.key(3), (B, T), 0, 128)


def _decoder_logits(model):
    """The encoder over a prompt, then the decoder (self-conditioning MLP included) over a canvas."""
    from dgemma.model.cache import KVCache

    canvas = _tokens(2, 8)
    _, cache = model.encode(_tokens(2, 6), KVCache.init(model.cfg, 2, 32))
    sc = jax.random.normal(jax.random.key(5), (2, 8, model.cfg.vocab_size))
    return model.logits(model.decode(canvas, cache, sc_logits=sc))


@pytest.mark.parametrize("scan,decoder", [(False, False), pytest.param(False, True, marks=pytest.mark.slow),
                                          pytest.param(True, True, marks=pytest.mark.slow)])
def test_zero_adapters_are_bit_identical(scan, decoder):
    base = _model(scan_layers=scan)
    dec = _decoder_logits if decoder else (lambda m: jnp.zeros(()))  # the decoder path: slow variants only
    ref_ar, ref_dec = np.asarray(base(_tokens())), np.asarray(dec(base))
    attached = attach_adapters(base, LoraSpec(rank=3, alpha=6.0, targets=ALL), nnx.Rngs(1))
    assert any("experts/gate" in p for p in attached) and any("self_conditioning/mlp/up" in p for p in attached)
    assert any("attn/o_proj" in p for p in attached) and any("router/proj" in p for p in attached)
    if not scan:  # op by op, every base matmul runs the same kernel: y + (x.A).0 = y exactly
        assert np.array_equal(np.asarray(base(_tokens())), ref_ar)
        assert np.array_equal(np.asarray(dec(base)), ref_dec)
    else:  # a compiled scan body around extra ops may get other kernels for the base matmuls (<= 6e-6 measured
        # under the suite's CPU flags, 0 under XLA's defaults): equal to fp32 rounding
        np.testing.assert_allclose(np.asarray(base(_tokens())), ref_ar, atol=2e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(_decoder_logits(base)), ref_dec, atol=2e-5, rtol=0)


@jax.jit
def _both(model):
    return model(_tokens()), _decoder_logits(model)


@pytest.mark.parametrize("scan,targets", [
    (False, ALL[:1]), pytest.param(False, ALL[1:2], marks=pytest.mark.slow),
    pytest.param(False, ALL[2:3], marks=pytest.mark.slow), (False, ALL[3:4]),
    pytest.param(True, ALL, marks=pytest.mark.slow)], ids=["attn", "mlp", "router", "experts", "scanned-all"])
def test_merged_model_matches_adapters(scan, targets):
    model = _model(scan_layers=scan)
    before, _ = _both(model)
    attached = attach_adapters(model, LoraSpec(rank=2, alpha=4.0, targets=targets), nnx.Rngs(1))
    _randomize(model, 11, nnx.LoRAParam, scale=0.3)
    lora_ar, lora_dec = _both(model)
    assert np.abs(np.asarray(lora_ar - before)).max() > 1e-3  # the adapters do change the function
    merged = Transformer(model.cfg, rngs=nnx.Rngs(0))
    nnx.update(merged, merged_params(model))
    merged_ar, merged_dec = _both(merged)
    np.testing.assert_allclose(np.asarray(merged_ar), np.asarray(lora_ar), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(merged_dec), np.asarray(lora_dec), atol=1e-4, rtol=1e-4)
    # the merged weights differ from the base exactly where an adapter was attached
    changed = {"/".join(map(str, p)) for p, v in nnx.to_flat_state(nnx.state(merged, nnx.Param))
               if not np.array_equal(np.asarray(v[...]), np.asarray(dict(nnx.to_flat_state(
                   nnx.state(model, nnx.Param)))[p][...]))}
    assert changed == set(attached)


@pytest.mark.parametrize("impl,axes", [("sharded", {"data": 2, "fsdp": 4}), ("ep", {"data": 2, "expert": 4})])
def test_expert_adapters_under_per_device_dispatch(impl, axes):
    """The adapters ride the shard_map dispatches (experts split over the expert axis under 'ep', gathered under
    'sharded'): the MoE block gives the single-device numbers."""
    from dgemma.parallel.mesh import make_mesh
    from dgemma.parallel.rules import get_rules, state_shardings

    model = Transformer(tiny(vocab_size=32, num_hidden_layers=1, layer_types=(FULL,), num_experts=8), rngs=nnx.Rngs(0))
    attach_adapters(model, LoraSpec(rank=2, alpha=2.0, targets=ALL[3:]), nnx.Rngs(1))
    _randomize(model, 11)
    block = model.layers[0].moe
    rows = jax.random.normal(jax.random.key(3), (8, 5, model.cfg.hidden_size))
    want = jax.jit(lambda r: block(r))(rows)
    graphdef, state = nnx.split(block)
    mesh = make_mesh(axes)
    sharded = nnx.merge(graphdef, jax.device_put(state, state_shardings(state, mesh, get_rules("ep"))))
    sharded.experts.impl = impl
    with jax.set_mesh(mesh):
        got = jax.jit(lambda r: sharded(r))(rows)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_adapters_follow_base_sharding():
    from dgemma.parallel.rules import get_rules, logical_to_spec

    model = _model(scan_layers=True)
    attach_adapters(model, LoraSpec(rank=2, alpha=2.0, targets=ALL), nnx.Rngs(1))
    flat = {"/".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    rules = get_rules("ep")
    a, b = flat["scan_blocks/0/moe/experts/lora/gate/a"], flat["scan_blocks/0/moe/experts/lora/gate/b"]
    assert a.get_metadata()["axes"] == ("layers", "exp", "embed", "lora_rank")
    assert b.get_metadata()["axes"] == ("layers", "exp", "lora_rank", "exp_mlp")
    assert logical_to_spec(a.get_metadata()["axes"], rules)[1] == "expert"  # expert adapters follow the expert axis
    q = flat["layers/0/attn/lora/q_proj/b"] if "layers/0/attn/lora/q_proj/b" in flat else \
        flat["scan_blocks/0/attn/lora/q_proj/b"]
    assert q.get_metadata()["axes"][-2:] == ("heads", "head_dim")


def test_bad_targets_are_refused():
    model = _model()
    with pytest.raises(ValueError, match=r"lora.targets: \['attn/qq_proj'\] match no adaptable weight"):
        attach_adapters(model, LoraSpec(rank=2, alpha=2.0, targets=("attn/qq_proj",)), nnx.Rngs(1))
    with pytest.raises(ValueError, match=r"lora.targets: .*embedder.* match no adaptable"):
        attach_adapters(model, LoraSpec(rank=2, alpha=2.0, targets=("embedder/embedding",)), nnx.Rngs(1))
    with pytest.raises(ValueError, match=r"lora.rank=-1"):
        LoraSpec(rank=-1, alpha=1.0, targets=ALL)
    assert not nnx.state(model, nnx.LoRAParam)  # nothing attached by a refused call


def test_adapters_disabled_runs_the_base_model():
    """`adapters_disabled` gives the base model's logits bit for bit (eagerly), re-attaches the adapters after the
    block, and works inside a traced function (the SD·RL reference policy: the same weights, adapters off)."""
    from dgemma.model.lora import adapters_disabled

    model = _model()
    ref = np.asarray(model(_tokens()))
    attach_adapters(model, LoraSpec(rank=2, alpha=4.0, targets=ALL), nnx.Rngs(1))
    _randomize(model, 11, nnx.LoRAParam, scale=0.3)
    adapted = np.asarray(model(_tokens()))
    assert np.abs(adapted - ref).max() > 1e-3
    with adapters_disabled(model):
        assert np.array_equal(np.asarray(model(_tokens())), ref)
    assert np.array_equal(np.asarray(model(_tokens())), adapted)  # re-attached
    graphdef, state = nnx.split(model)

    @jax.jit
    def base_logits(state):
        m = nnx.merge(graphdef, state)
        with adapters_disabled(m):
            return m(_tokens())

    np.testing.assert_allclose(np.asarray(base_logits(state)), ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_adapter_dropout_trains_only_inside_its_block(scan):
    """`adapter_dropout`: rate 0 changes nothing (bit-identical, compiled the same way); rate > 0 changes the
    logits inside the block only (dense and expert adapters), the same key repeats them bit for bit, another key
    gives others; outside the block (evaluation, sampling) the rate is irrelevant."""
    from dgemma.model.lora import adapter_dropout

    evals = {}
    for rate in (0.0, 0.5):
        model = _model(scan_layers=scan)
        attach_adapters(model, LoraSpec(rank=2, alpha=4.0, targets=ALL, dropout=rate), nnx.Rngs(1))
        _randomize(model, 11, nnx.LoRAParam, scale=0.3)
        graphdef, state = nnx.split(model)

        @jax.jit
        def under(state, key, graphdef=graphdef):  # (one jit per graphdef: the rate is static graph data)
            m = nnx.merge(graphdef, state)
            with adapter_dropout(m, key):
                return m(_tokens())
        a, b, c = (np.asarray(under(state, jax.random.key(k))) for k in (0, 0, 1))
        assert np.array_equal(a, b)  # same key, same masks
        evals[rate] = np.asarray(model(_tokens()))
        if rate == 0.0:  # nothing is inserted: the same program as the plain forward
            plain = np.asarray(jax.jit(lambda s: nnx.merge(graphdef, s)(_tokens()))(state))
            assert np.array_equal(a, plain) and np.array_equal(c, plain)
        else:  # (eager vs compiled differ by fp32 rounding only, < 1e-4)
            assert np.abs(a - evals[rate]).max() > 1e-2 and np.abs(a - c).max() > 1e-2
        assert not any(hasattr(m, "dropout_key") for _, m in nnx.iter_modules(model))  # keys gone after the block
    assert np.array_equal(evals[0.0], evals[0.5])


def test_expert_adapter_dropout_alone_changes_the_moe_block():
    """Dropout on the experts' adapters (inside the ragged path) is keyed and active: experts-only targets."""
    from dgemma.model.lora import adapter_dropout

    model = _model()
    attach_adapters(model, LoraSpec(rank=2, alpha=4.0, targets=ALL[3:], dropout=0.5), nnx.Rngs(1))
    _randomize(model, 11, nnx.LoRAParam, scale=0.3)
    block = model.layers[0].moe
    rows = jax.random.normal(jax.random.key(3), (2, 5, model.cfg.hidden_size))
    plain = np.asarray(block(rows))
    with adapter_dropout(model, jax.random.key(0)):
        a = np.asarray(block(rows))
    with adapter_dropout(model, jax.random.key(0)):
        b = np.asarray(block(rows))
    assert np.array_equal(a, b) and np.abs(a - plain).max() > 1e-3
    with pytest.raises(ValueError, match=r"lora.dropout=1.0: must be in \[0, 1\)"):
        LoraSpec(rank=2, alpha=1.0, targets=ALL, dropout=1.0)

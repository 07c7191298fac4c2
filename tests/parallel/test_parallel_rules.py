"""Rule presets (training and sampling), divisibility errors, and the sufficiently-sharded check."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dgemma.model.config import gemma4_26b_a4b, tiny
from dgemma.model.transformer import Transformer, abstract_model
from dgemma.parallel.checks import (
    InsufficientShardingError,
    assert_sufficiently_sharded,
    check_batch_divisibility,
    check_model_divisibility,
    replication_report,
)
from dgemma.parallel.mesh import abstract_mesh, make_mesh
from dgemma.parallel.rules import (
    PRESETS,
    SAMPLING_PRESETS,
    TRAINING_PRESETS,
    get_rules,
    logical_to_spec,
    sampling_rules,
    state_shardings,
    state_specs,
)


@pytest.fixture(scope="module")
def params_26b():
    return nnx.state(abstract_model(gemma4_26b_a4b()), nnx.Param)


def test_presets_exist_and_sampling_variants_drop_fsdp_on_dense_weights():
    assert set(TRAINING_PRESETS) == {"fsdp", "fsdp_tp", "experts_on_fsdp", "ep"}
    assert set(SAMPLING_PRESETS) == {f"{n}_sampling" for n in TRAINING_PRESETS}
    assert set(PRESETS) >= set(SAMPLING_PRESETS)
    for name in TRAINING_PRESETS:
        train, sample = get_rules(name), sampling_rules(name)
        assert sample is get_rules(f"{name}_sampling") is sampling_rules(f"{name}_sampling")
        assert train["embed"] == "fsdp" and sample["embed"] is None
        assert sample["exp"] == train["exp"] and sample["heads"] == train["heads"]  # expert / tensor placement kept
    with pytest.raises(KeyError, match="unknown sharding rules preset"):
        get_rules("nope")


def test_sampling_preset_runs_the_tiny_model_like_one_device():
    model = Transformer(tiny(num_experts=8), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(1), (8, 10), 0, 128)
    f = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    want = f(state, tokens)
    mesh = make_mesh({"data": 2, "fsdp": 4})
    sharded = jax.device_put(state, state_shardings(state, mesh, sampling_rules("experts_on_fsdp")))
    dense = sharded["layers"][0]["attn"]["q_proj"][...]
    assert dense.sharding.is_fully_replicated  # dense weights replicated for decoding
    experts = sharded["layers"][0]["moe"]["experts"]["gate"][...]
    assert len({str(s.index) for s in experts.addressable_shards}) == 4  # experts still split over fsdp
    with jax.set_mesh(mesh):
        got = f(sharded, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


def test_26b_specs_of_the_default_preset(params_26b):
    specs = dict(nnx.to_flat_state(state_specs(params_26b, get_rules("experts_on_fsdp"))))
    assert specs[("layers", 3, "moe", "experts", "down")] == P("fsdp", None, None)
    assert specs[("layers", 5, "attn", "o_proj")] == P(None, None, "fsdp")
    assert specs[("layers", 0, "moe", "router", "proj")] == P("fsdp", None)


# MARK: divisibility
def test_divisibility_errors_name_config_fields():
    m = gemma4_26b_a4b()
    check_model_divisibility(m, {"fsdp": 32}, "experts_on_fsdp")
    with pytest.raises(ValueError, match=r"model.num_experts=128 is not divisible by mesh axis fsdp of size 48"):
        check_model_divisibility(m, {"fsdp": 48}, "experts_on_fsdp")
    with pytest.raises(ValueError, match=r"model.num_attention_heads=16 is not divisible by mesh axis tensor of "
                                         r"size 32.*'heads'"):
        check_model_divisibility(m, {"tensor": 32}, "fsdp_tp")
    with pytest.raises(ValueError, match=r"model.num_experts=128 is not divisible by mesh axis expert of size 3"):
        check_model_divisibility(m, {"expert": 3}, "ep")
    # kv heads: a custom rule sharding kv_heads on tensor=4 fails on the full layers' 2 kv heads only
    rules = {**get_rules("fsdp_tp"), "kv_heads": "tensor"}
    with pytest.raises(ValueError) as info:
        check_model_divisibility(m, {"tensor": 4}, rules)
    assert "num_global_key_value_heads=2" in str(info.value) and "num_key_value_heads=8" not in str(info.value)


def test_batch_divisibility():
    assert check_batch_divisibility(64, {"data": 2, "fsdp": 8}, "fsdp") == 4
    with pytest.raises(ValueError, match=r"global batch 12 is not divisible by the data axes data x fsdp = 16"):
        check_batch_divisibility(12, {"data": 2, "fsdp": 8}, "fsdp")
    with pytest.raises(ValueError, match=r"micro-batch 8 \(global 32 / 4\) is not divisible"):
        check_batch_divisibility(32, {"fsdp": 16}, "fsdp", grad_accum_steps=4)
    with pytest.raises(ValueError, match="grad_accum_steps=3"):
        check_batch_divisibility(32, {"fsdp": 2}, "fsdp", grad_accum_steps=3)


def test_state_shardings_error_names_the_parameter():
    state = nnx.state(abstract_model(tiny()), nnx.Param)  # 4 experts
    with pytest.raises(ValueError, match=r"moe/experts/(gate|up|down) dim 0 \(size 4, logical 'exp'\)"):
        state_shardings(state, abstract_mesh({"fsdp": 8}), get_rules("experts_on_fsdp"))


# MARK: replication tolerance
@pytest.mark.parametrize("preset,sizes", [("fsdp", {"fsdp": 8}), ("experts_on_fsdp", {"fsdp": 32}),
                                          ("fsdp_tp", {"fsdp": 8, "tensor": 4}), ("ep", {"fsdp": 4, "expert": 8})])
def test_training_presets_are_sufficiently_sharded(params_26b, preset, sizes):
    report = assert_sufficiently_sharded(params_26b, sizes, preset, tolerance=0.02)
    assert report.fraction < 1e-4 and report.relevant_devices > 1


def test_replicating_rules_fail_the_check(params_26b):
    broken = {**get_rules("experts_on_fsdp"), "exp": None, "embed": None}  # experts and embedding left replicated
    with pytest.raises(InsufficientShardingError, match=r"fully replicated .* largest: embedder/embedding"):
        assert_sufficiently_sharded(params_26b, {"fsdp": 8}, broken)
    with pytest.raises(InsufficientShardingError):  # sampling presets replicate dense weights by design
        assert_sufficiently_sharded(params_26b, {"data": 2, "fsdp": 8}, "experts_on_fsdp_sampling")
    # pure data parallelism: nothing could shard the weights, so replication is not an error
    report = assert_sufficiently_sharded(params_26b, {"data": 8}, broken)
    assert report.fraction == 1.0 and report.relevant_devices == 1
    # the threshold is a parameter: 10% tolerance accepts the sampling preset's ~9.5% dense weights
    assert replication_report(params_26b, {"fsdp": 8}, "experts_on_fsdp_sampling").fraction < 0.1
    assert_sufficiently_sharded(params_26b, {"fsdp": 8}, "experts_on_fsdp_sampling", tolerance=0.1)


def test_check_accepts_a_real_sharded_model_and_mesh():
    model = Transformer(tiny(num_experts=8), rngs=nnx.Rngs(0))
    mesh = make_mesh({"fsdp": 8})
    report = assert_sufficiently_sharded(model, mesh, "experts_on_fsdp")
    assert 0 < report.fraction < 0.02
    assert logical_to_spec(("exp", "embed", "exp_mlp"), get_rules("experts_on_fsdp"), mesh.axis_names) == \
        P("fsdp", None, None)


def test_constrain_uses_the_active_mesh_and_is_a_noop_without_one():
    from dgemma.parallel.rules import constrain

    x = jax.numpy.ones((8, 4, 16))
    f = jax.jit(lambda y: constrain(y * 2, ("batch", None, "embed"), "fsdp_tp"))
    np.testing.assert_array_equal(np.asarray(f(x)), 2 * np.ones((8, 4, 16)))  # no mesh: plain computation
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    with jax.set_mesh(mesh):
        y = f(x)
    want = jax.sharding.NamedSharding(mesh, P(("data", "fsdp"), None, None))  # embed's fsdp is taken by batch
    assert y.sharding.is_equivalent_to(want, 3)
    with jax.set_mesh(mesh):
        z = jax.jit(lambda y: constrain(y, (None, None, "vocab"), "fsdp_tp"))(x)
    assert z.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, P(None, None, "tensor")), 3)

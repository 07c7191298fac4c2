"""Model presets: the 26B-A4B geometry from abstract shapes only (no allocation); config validation errors."""

import pytest

from dgemma.model.config import FULL, SLIDING, ModelConfig, gemma4_26b_a4b, preset, tiny
from dgemma.model.transformer import count_params
from pathlib import Path
from dgemma.config import load_config
from dgemma.model.config import FULL, preset


def test_26b_a4b_text_parameter_count():
    cfg = gemma4_26b_a4b()
    assert cfg.layer_types.count(FULL) == 5 and [i for i, t in enumerate(cfg.layer_types) if t == FULL] == [
        5, 11, 17, 23, 29]
    assert count_params(cfg) == 25_233_141_790
    # self-conditioning adds pre_norm [H] + gate/up [H, I] + down [I, H]
    H, I = cfg.hidden_size, cfg.intermediate_size
    assert count_params(cfg, include_self_conditioning=True) == 25_233_141_790 + H + 3 * H * I


def test_untied_scalar_adds_one_per_layer():
    cfg = tiny()
    assert count_params(cfg.replace(tie_layer_scalar=False)) == count_params(cfg) + cfg.num_hidden_layers


@pytest.mark.parametrize("bad,msg", [
    (dict(layer_types=(SLIDING, SLIDING, SLIDING)), "last layer must be 'full_attention'"),
    (dict(num_key_value_heads=3), "must divide num_attention_heads"),
    (dict(top_k_experts=9), "top_k_experts"),
    (dict(layer_types=(SLIDING, FULL)), "has 2 entries but num_hidden_layers=3"),
    (dict(decoder_sliding="window"), "decoder_sliding"),
])
def test_invalid_configs_name_the_field(bad, msg):
    with pytest.raises(ValueError, match=msg):
        tiny(**bad)


def test_unknown_preset():
    with pytest.raises(KeyError, match="unknown model preset 'huge'"):
        preset("huge")
    assert isinstance(preset("tiny_toy"), ModelConfig)


# MARK: Presets of the Gemma 4 family (E2B, E4B, 31B): parameter counts equal transformers' Gemma4ForCausalLM built on the ----------
REPO = Path(__file__).resolve().parents[2]
MEMBERS = ["gemma4_e2b", "gemma4_e4b", "gemma4_31b"]


@pytest.mark.parity
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "gemma4_e2b" else pytest.mark.slow)
                                  for n in MEMBERS])
def test_parameter_count_equals_transformers(name):
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    from dgemma.convert.hf_config import hf_config

    cfg = preset(name)
    with torch.device("meta"):  # shapes only: 31B is not allocated
        hf = tf.Gemma4ForCausalLM(hf_config(cfg, "gemma4_text"))
    scalars = sum(b.numel() for n, b in hf.named_buffers() if n.endswith("layer_scalar"))  # a buffer in HF
    assert count_params(cfg) == sum(p.numel() for p in hf.parameters()) + scalars
    modes = hf.config.kv_sharing_modes
    assert [m == "reuse" for m in modes] == [cfg.kv_producer(i) is not None for i in range(cfg.num_hidden_layers)]
    producers = sorted({cfg.kv_producer(i) for i in range(cfg.num_hidden_layers)} - {None})
    if producers:  # transformers marks its "store" layers even when no layer reuses them
        assert [i for i, m in enumerate(modes) if m == "store"] == producers


def test_published_geometry():
    """The fields that distinguish the members (transformers' Gemma4TextConfig names)."""
    e2b, e4b, b31 = (preset(n) for n in MEMBERS)
    assert (e2b.num_hidden_layers, e2b.hidden_size, e2b.num_kv_shared_layers, e2b.use_double_wide_mlp) == \
        (35, 1536, 20, True)
    assert (e4b.num_hidden_layers, e4b.hidden_size, e4b.num_kv_shared_layers, e4b.use_double_wide_mlp) == \
        (42, 2560, 18, False)
    assert e2b.hidden_size_per_layer_input == e4b.hidden_size_per_layer_input == 256
    assert not b31.hidden_size_per_layer_input
    assert b31.attention_k_eq_v and [b31.layer_kv_heads(i) for i in (0, 5)] == [16, 4]
    assert not e2b.attention_k_eq_v and e2b.layer_kv_heads(4) == 1 and e2b.layer_types[4] == FULL
    assert not any(c.enable_moe_block for c in (e2b, e4b, b31))


@pytest.mark.parametrize("stage", ["stage1", "stage2"])
def test_shipped_configs_load_and_plan(stage):
    from dgemma.planning.plan_config import plan_for, spec_from_config

    for name in MEMBERS:
        cfg = load_config(REPO / f"configs/{stage}/{name}.yaml", env={})
        assert cfg.model.preset == name and cfg.model.build().num_hidden_layers == preset(name).num_hidden_layers
        # 8 GPUs shard the batch 8 ways: a config shipped for one GPU (E2B stage 2: 4 prompts) plans there with 8
        batch = -(-cfg.data.batch_size // 8) * 8
        plan = plan_for(spec_from_config(cfg, devices=8, accelerator="h100", global_batch=batch))
        assert plan.params > 0

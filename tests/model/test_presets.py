"""Model presets: the 26B-A4B geometry from abstract shapes only (no allocation); config validation errors."""

import pytest

from dgemma.model.config import FULL, SLIDING, ModelConfig, gemma4_26b_a4b, preset, tiny
from dgemma.model.transformer import count_params


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

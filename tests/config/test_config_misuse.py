"""Nonsense config values are refused at load, naming the field (no value is silently clamped or ignored)."""

from pathlib import Path

import pytest

from dgemma.config import ConfigError, load_config

TINY = str(Path(__file__).resolve().parents[2] / "configs/stage1/tiny.yaml")


@pytest.mark.parametrize("override, message", [
    ("optim.lr=.nan", "optim.lr: nan is not a finite number"),
    ("optim.lr=.inf", "optim.lr: inf is not a finite number"),
    ("optim.clip_norm=.nan", "optim.clip_norm: nan"),
    ("optim.weight_decay=.nan", "optim.weight_decay: nan"),
    ("sampler.entropy_bound=.nan", "sampler.entropy_bound: nan"),
    ("model.rms_norm_eps=-1e-6", "model.rms_norm_eps: -1e-06 must be a finite number > 0"),
    ("model.partial_rotary_factor_full=1.5", "model.partial_rotary_factor_full: 1.5 must be in (0, 1]"),
    ("model.eos_token_id=[40]", "model.eos_token_id: [40] must be non-empty ids in [0, vocab_size=32)"),
    ("model.pad_token_id=-1", "model.pad_token_id: [-1]"),
    ("model.num_hidden_layers=0", "model.num_hidden_layers: 0 must be >= 1"),
    ("model.hidden_size=0", "model.hidden_size: 0 must be >= 1"),
])
def test_nonsense_values_are_refused_at_load(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [override], env={})
    assert message in str(info.value)


def test_sane_values_still_load():
    cfg = load_config(TINY, ["optim.lr=1e-3", "model.rms_norm_eps=1e-5", "model.partial_rotary_factor_full=1.0"],
                      env={})
    assert cfg.optim.lr == 1e-3 and cfg.model_config.partial_rotary_factor_full == 1.0


@pytest.mark.parametrize("override", ["data.tokenizer.eos_id=5", "data.tokenizer.pad_id=3",
                                      "data.tokenizer.extra_stop_ids=[4]"])
def test_toy_tokenizer_id_overrides_are_refused(override):
    with pytest.raises(ConfigError, match=override.split("=")[0].split(".")[-1] + ".*kind='hf' only"):
        load_config(TINY, [override], env={})


def test_freeze_regex_matching_nothing_is_refused():
    import numpy as np

    from dgemma.train.optim import frozen_flags

    params = {"embedder": {"embedding": np.zeros((4, 2))}, "layers": {"0": {"router": {"kernel": np.zeros((2, 2))}}}}
    assert frozen_flags(params, ("router",)) == (False, True)
    with pytest.raises(ValueError, match=r"optim.freeze: \['routr'\] match no parameter path"):
        frozen_flags(params, ("router", "routr"))
    with pytest.raises(ValueError, match="optim.freeze: invalid regex"):
        frozen_flags(params, ("(",))

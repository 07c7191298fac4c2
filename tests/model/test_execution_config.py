"""`ModelConfig` holds the architecture, `ModelConfig.execution` (`ExecutionConfig`) how it runs: the old flat
execution attributes and config keys are gone (one-line errors naming the new key), `architecture()` drops the
execution settings, and a checkpoint saved under one execution restores under another unless the setting shapes the
parameters (scan_layers)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from support.cli_errors import one_line_error
from dgemma.config import ConfigError, load_config
from dgemma.model.config import EXECUTION_FIELDS, ExecutionConfig, ModelConfig, tiny

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs/stage1/tiny.yaml")


def test_execution_settings_are_no_longer_model_attributes():
    cfg = tiny()
    assert set(EXECUTION_FIELDS) == {f.name for f in dataclasses.fields(ExecutionConfig)}
    assert {"remat", "scan_layers", "param_dtype"} <= set(EXECUTION_FIELDS)
    arch = {f.name for f in dataclasses.fields(ModelConfig)}
    assert not arch & set(EXECUTION_FIELDS) and "execution" in arch
    for name in EXECUTION_FIELDS:
        assert not hasattr(cfg, name), name
        assert hasattr(cfg.execution, name), name
    with pytest.raises(TypeError, match="remat"):
        tiny(remat="full")


def test_architecture_drops_execution_and_with_execution_keeps_architecture():
    cfg = tiny(canvas_length=6).with_execution(remat="full", attention_impl="chunked", dtype="bfloat16")
    assert cfg.execution == ExecutionConfig(remat="full", attention_impl="chunked", dtype="bfloat16")
    assert cfg.architecture() == tiny(canvas_length=6) and cfg.architecture().execution == ExecutionConfig()
    assert cfg != tiny(canvas_length=6) and hash(cfg) != hash(cfg.architecture())
    assert cfg.with_execution(remat="none").execution.attention_impl == "chunked"
    assert tiny(execution=ExecutionConfig(scan_layers=True, scan_period=3)).execution.scan_layers


def test_execution_errors_name_the_execution_field():
    with pytest.raises(ValueError, match=r"^ExecutionConfig\.remat: 'fast' is not one of"):
        ExecutionConfig(remat="fast")
    with pytest.raises(ValueError, match=r"^ExecutionConfig\.attention_q_chunk: 100 is the Splash block size"):
        tiny().with_execution(attention_impl="splash", attention_q_chunk=100)
    # the cross check that needs both the layer pattern and the execution settings stays in ModelConfig
    with pytest.raises(ValueError, match=r"^ModelConfig\.execution\.scan_period: 4 must be in \[1, num_hidden_layers"):
        tiny().with_execution(scan_layers=True, scan_period=4)


def test_config_keys_moved_under_model_execution(tmp_path):
    cfg = load_config(TINY, ["model.execution.remat=full", "model.execution.dtype=bfloat16"], env={})
    assert cfg.model_config.execution.remat == "full" and cfg.model_config.execution.dtype == "bfloat16"
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["model.remat=full"], env={})
    assert str(err.value).splitlines() == ["invalid config: model.remat: replaced by model.execution.remat"]
    yaml = tmp_path / "old.yaml"
    yaml.write_text("model:\n  preset: tiny\n  scan_layers: true\n")
    with pytest.raises(ConfigError, match=r"model\.scan_layers: replaced by model\.execution\.scan_layers"):
        load_config(yaml, env={})
    with pytest.raises(ConfigError, match=r"model\.execution\.scan_period: 99 must be in \[1, num_hidden_layers="):
        load_config(TINY, ["model.execution.scan_layers=true", "model.execution.scan_period=99"], env={})


def test_cli_refuses_the_old_key_in_one_line(capsys):
    from dgemma.cli.main import main

    assert main(["plan", "-c", TINY, "model.remat=full"]) != 0
    one_line_error(capsys, "model.remat: replaced by model.execution.remat")


def test_an_execution_change_restores_the_same_checkpoint_but_scan_layers_reshapes_it(tmp_path):
    from dgemma.checkpoint import CheckpointMismatchError, save_params
    from dgemma.checkpoint.model import restore_model
    from dgemma.model.transformer import Transformer
    from dgemma.parallel.mesh import make_mesh

    cfg = tiny(num_hidden_layers=2, layer_types=("sliding_attention", "full_attention"))
    params = nnx.state(Transformer(cfg, rngs=nnx.Rngs(3)), nnx.Param)
    save_params(tmp_path / "params", 1, params)
    mesh = make_mesh({"fsdp": 1}, jax.devices()[:1])
    other = cfg.with_execution(remat="full", attention_impl="chunked", attention_q_chunk=8, moe_impl="local")
    model, _ = restore_model(other, tmp_path / "params", mesh=mesh, rules="fsdp")
    assert model.cfg.execution.remat == "full"
    want, got = jax.tree.leaves(params), jax.tree.leaves(nnx.state(model, nnx.Param))
    assert len(want) == len(got) and all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(want, got))
    # scan_layers is an execution setting that stacks the layer parameters: the stored per-layer tree does not fit
    with pytest.raises(CheckpointMismatchError):
        restore_model(cfg.with_execution(scan_layers=True, scan_period=2), tmp_path / "params", mesh=mesh,
                      rules="fsdp")

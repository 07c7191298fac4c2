"""Tests of RunConfig (dgemma.config.schema / sections) and of every YAML file under configs/ and experiments/."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dgemma.config import (
    CONFIGS_DIR,
    SECTION_NAMES,
    ConfigError,
    MeshSection,
    ModelSection,
    RunConfig,
    SamplerSection,
    config_hash,
    dump_resolved,
    field_help,
    is_fragment,
    load_config,
    validate_config_file,
)
from dgemma.model.config import ModelConfig, tiny_toy

REPO = Path(__file__).resolve().parents[2]
CONFIG_FILES = sorted(
    [*REPO.glob("configs/**/*.yaml"), *REPO.glob("configs/**/*.yml"),
     *REPO.glob("experiments/**/*.yaml"), *REPO.glob("experiments/**/*.yml")]
)


def _load(*overrides: str) -> RunConfig:
    return load_config(None, list(overrides), env={})


# MARK: every config file


def test_config_files_were_found():
    assert CONFIGS_DIR == REPO / "configs"
    names = {p.relative_to(REPO).as_posix() for p in CONFIG_FILES}
    assert {"configs/base.yaml", "configs/stage1/tiny.yaml", "configs/model/tiny_toy.yaml"} <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_config_file_loads(path):
    cfg = validate_config_file(path)
    assert isinstance(cfg.model.build(), ModelConfig)
    assert cfg.data.layout.canvas_length == cfg.model.build().canvas_length


def test_fragment_convention():
    assert is_fragment(REPO / "configs/model/tiny.yaml") and is_fragment(REPO / "configs/mesh/fsdp8.yaml")
    assert not is_fragment(REPO / "configs/base.yaml") and not is_fragment(REPO / "configs/stage1/tiny.yaml")
    assert not is_fragment(REPO / "experiments/x/model/base.yaml")


def test_stage1_tiny_inherits_base_and_tiny_toy():
    cfg = load_config(REPO / "configs/stage1/tiny.yaml", env={})
    assert cfg.model.preset == "tiny_toy" and cfg.model.build() == tiny_toy()
    assert cfg.run.name == "stage1_tiny" and cfg.mesh.ici["fsdp"] == 1
    assert cfg.sampler.max_steps == 48  # from base.yaml


def test_stage1_26b_is_the_released_geometry():
    cfg = load_config(REPO / "configs/stage1/gemma4_26b_a4b.yaml", env={})
    m = cfg.model.build()
    assert (m.num_experts, m.canvas_length, m.hidden_size, cfg.mesh.rules) == (128, 256, 2816, "experts_on_fsdp")


# MARK: sections and cross-field validation


def test_defaults_are_valid_and_inherit_from_model():
    cfg = RunConfig()
    assert cfg.data.layout.canvas_length == cfg.model.build().canvas_length == 8
    assert tuple(SECTION_NAMES) == ("run", "model", "mesh", "trainer", "optim", "diffusion", "sampler", "data",
                                    "logging", "checkpoint", "sdrl", "lora")


def test_model_section_mirrors_model_config():
    model_fields = {f.name for f in dataclasses.fields(ModelConfig) if f.init}
    section_fields = {f.name for f in dataclasses.fields(ModelSection)}
    assert section_fields == model_fields | {"preset"}
    cfg = _load("model.preset=tiny_toy", "model.hidden_size=128", "model.canvas_length=16")
    assert cfg.model.build() == tiny_toy(hidden_size=128, canvas_length=16)
    assert cfg.model.overrides() == {"hidden_size": 128, "canvas_length": 16}
    assert cfg.data.layout.canvas_length == 16


def test_canvas_length_has_one_owner():
    # The model owns the canvas length: an explicit, different data layout value is an error naming both fields
    # (it used to be overwritten silently when it equalled the data default, 256).
    for value in (256, 16):
        with pytest.raises(ConfigError, match=rf"data\.layout\.canvas_length={value} disagrees with "
                                              r"model\.canvas_length=8"):
            _load(f"data.layout.canvas_length={value}")
    cfg = _load("data.layout.canvas_length=16", "model.canvas_length=16")
    assert cfg.data.layout.canvas_length == 16
    assert _load("model.canvas_length=16").data.layout.canvas_length == 16
    # the diffusion section has no copy of model-owned settings; the old keys point at the owner
    with pytest.raises(ConfigError, match=r"diffusion\.canvas_length: unknown key \(did you mean 'model\.canvas_length'"):
        _load("diffusion.canvas_length=8")
    with pytest.raises(ConfigError, match=r"diffusion\.decoder_sliding: unknown key \(did you mean "
                                          r"'model\.decoder_sliding'"):
        _load("diffusion.decoder_sliding=hf_fixed")


def test_cli_help_example_override_loads_on_every_shipped_config():
    from dgemma.cli.common import OVERRIDES_HELP

    example = [t for t in OVERRIDES_HELP.split("e.g. ", 1)[1].split() if "=" in t and "'" not in t]
    assert example, OVERRIDES_HELP
    for path in CONFIG_FILES:
        if not is_fragment(path):
            load_config(path, example, env={})


def test_experts_divisible_by_expert_axis():
    with pytest.raises(ConfigError, match=r"model\.num_experts=4 is not divisible by the mesh expert axis size 8"):
        _load("mesh.ici.expert=8", "mesh.ici.fsdp=1")
    _load("mesh.ici.expert=2")  # 4 experts over 2: fine; fsdp stays auto


def test_experts_on_fsdp_divisibility():
    with pytest.raises(ConfigError, match=r"num_experts=4 is not divisible by the fsdp axis size 8"):
        _load("mesh.rules=experts_on_fsdp", "mesh.ici.fsdp=8")


def test_batch_divisible_by_grad_accum():
    # (divisibility by the mesh's batch axes is checked at run time, when the process count is known)
    with pytest.raises(ConfigError, match=r"grad_accum_steps=3"):
        _load("trainer.grad_accum_steps=3")


def test_sampler_temperature_order():
    with pytest.raises(ConfigError, match=r"sampler\.t_min: need 0 <= t_min <= t_max"):
        _load("sampler.t_min=0.9")
    with pytest.raises(ValueError, match="SamplerSection.t_min"):
        SamplerSection(t_min=0.9, t_max=0.8)
    assert _load("sampler.t_min=0").sampler.build().t_min == 0.0  # one validator: the sampler's own


def test_derived_sections_are_the_code_dataclasses():
    from dgemma.config.sections import SAMPLER_RUNTIME_FIELDS, DiffusionSection
    from dgemma.diffusion.stage1_config import Stage1Config
    from dgemma.inference.sampler_types import SamplerConfig

    for section, target, runtime in ((SamplerSection, SamplerConfig, SAMPLER_RUNTIME_FIELDS),
                                     (DiffusionSection, Stage1Config, ())):
        target_fields = {f.name: f for f in dataclasses.fields(target)}
        fields = {f.name: f for f in dataclasses.fields(section)}
        assert set(fields) == set(target_fields) - set(runtime)
        assert all(fields[n].default == target_fields[n].default for n in fields)
        assert all(f.metadata["help"] for f in fields.values()), [n for n, f in fields.items() if not f.metadata["help"]]
        assert section().build() == target()
    cfg = _load("diffusion.lambda_ar=0.5", "sampler.max_steps=3")
    assert cfg.diffusion.build() == Stage1Config(lambda_ar=0.5) == Stage1Config.from_section(cfg.diffusion)
    assert SamplerConfig.from_section(cfg.sampler, pad_id=0) == SamplerConfig(max_steps=3, pad_id=0)


def test_from_section_refuses_unknown_fields():
    # a renamed field must not be dropped silently
    from dgemma.diffusion.stage1_config import Stage1Config
    from dgemma.inference.sampler_types import SamplerConfig

    @dataclasses.dataclass(frozen=True)
    class Renamed:
        max_step: int = 3

    with pytest.raises(ValueError, match=r"\['max_step'\] are not SamplerConfig fields"):
        SamplerConfig.from_section(Renamed())
    with pytest.raises(ValueError, match=r"\['max_step'\] are not Stage1Config fields"):
        Stage1Config.from_section(Renamed())


def test_mesh_validation():
    assert dict(MeshSection(ici={"fsdp": 4}).ici) == {"data": 1, "fsdp": 4, "expert": 1, "tensor": 1}
    m = MeshSection(ici={"fsdp": 4, "data": 2}, dcn={"data": 2})
    assert m.axis_size("data", "fsdp") == 16 and MeshSection().axis_size("fsdp") is None


@pytest.mark.parametrize(
    ("token", "pattern"),
    [
        ("optim.lr=0", r"optim\.lr: 0\.0 must be > 0"),
        ("optim.freeze=['(']", r"optim\.freeze\[0\]: invalid regex"),
        ("optim.schedule=linear", r"optim\.schedule: expected one of 'cosine', 'constant'"),
        ("diffusion.t_min=0.9995", r"diffusion\.t_min: need 0 <= t_min < t_max <= 1"),
        ("diffusion.head_alignment=shfit", r"did you mean 'shift'"),
        ("diffusion.p_self_cond=2", r"diffusion\.p_self_cond"),
        ("trainer.steps=0", r"trainer\.steps: 0 must be >= 1"),
        ("run.name=a/b", r"run\.name"),
        ("logging.wandb_mode=maybe", r"logging\.wandb_mode"),
        ("checkpoint.keep=0", r"checkpoint\.keep"),
        ("trainer.lr=1", r"trainer\.lr: unknown key \(did you mean 'optim\.lr'\?\)"),
        ("data.layout.prompt_len=2040", r"exceeds model\.max_position_embeddings=2048"),
        # model errors point at model keys
        ("model.preset=nope", r"model\.preset: unknown preset 'nope'"),
        ("model.num_hidden_layers=4", r"model\.layer_types: has 3 entries but num_hidden_layers=4"),
        ("model.decoder_sliding=both", r"model\.decoder_sliding: expected one of 'hf_fixed', 'jax_per_query'"),
        # mesh
        ("mesh.ici.data=-1", r"mesh\.ici: at most one axis may be -1"),
        ("mesh.ici.fdsp=2", r"mesh\.ici\.fdsp: unknown mesh axis \(did you mean 'fsdp'\?\)"),
        ("mesh.dcn.data=0", r"mesh\.dcn\.data: size 0 must be >= 1"),
    ],
)
def test_section_validation_errors(token, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _load(token)


def test_checkpoint_directory_and_run_dir():
    cfg = _load("run.name=r1", "run.output_dir=/tmp/out")
    assert cfg.checkpoint.directory(cfg.run) == Path("/tmp/out/r1/checkpoints")
    assert _load("checkpoint.dir=/ck").checkpoint.directory(cfg.run) == Path("/ck")


def test_run_config_is_frozen_and_hashable():
    cfg = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.trainer.steps = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.mesh.ici["fsdp"] = 2  # type: ignore[index]
    assert hash(cfg) == hash(RunConfig())


def test_env_override_on_run_config_and_conflict():
    cfg = load_config(None, [], env={"DGEMMA_TRAINER__STEPS": "12", "DGEMMA_MESH__ICI__FSDP": "2"})
    assert cfg.trainer.steps == 12 and cfg.mesh.ici["fsdp"] == 2
    with pytest.raises(ConfigError, match="set both on the command line and by env DGEMMA_TRAINER__STEPS"):
        load_config(None, ["trainer.steps=3"], env={"DGEMMA_TRAINER__STEPS": "12"})


def test_resolved_run_config_round_trips(tmp_path):
    cfg = load_config(REPO / "configs/stage1/tiny.yaml", ["optim.freeze=['router', '.*embed']"], env={})
    digest = dump_resolved(cfg, tmp_path)
    again = load_config(tmp_path / "resolved_config.yaml", env={})
    assert again == cfg and config_hash(again) == digest


def test_every_field_has_help():
    rows = field_help(RunConfig)
    assert not [path for path, _, _, doc in rows if not doc]
    assert len(rows) > 60


def test_run_config_with_overrides_method():
    cfg = RunConfig()
    new = cfg.with_overrides("trainer.steps=3", **{"optim.lr": 1e-3})
    assert (new.trainer.steps, new.optim.lr, cfg.trainer.steps) == (3, 1e-3, 1000)
    with pytest.raises(ConfigError, match="did you mean 'trainer.steps'"):
        cfg.with_overrides("trainer.step=3")

"""Tests of the generic strict loader (dgemma.config.types / yaml_io / loader) on small test dataclasses."""

from __future__ import annotations

import dataclasses
from typing import Literal

import pytest

from dgemma.config import (
    ConfigError,
    FrozenDict,
    config_hash,
    deep_merge,
    dump_resolved,
    env_overrides,
    from_dict,
    load,
    parse_override,
    parse_yaml,
    to_dict,
    with_overrides,
)
from dgemma.config.types import RawValue, Section


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inner(Section):
    steps: int = 10
    lr: float = 0.1
    flag: bool = False
    name: str = "x"
    mode: Literal["a", "b"] = "a"
    dims: tuple[int, ...] = (1, 2)
    pair: tuple[str, int] = ("k", 1)
    maybe: str | None = None
    sizes: dict[str, int] = dataclasses.field(default_factory=lambda: FrozenDict(a=1))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Other(Section):
    lr_scale: float = 1.0
    seed: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Top(Section):
    required: str
    inner: Inner = dataclasses.field(default_factory=Inner)
    other: Other = dataclasses.field(default_factory=Other)


def _build(data):
    return from_dict(Top, {"required": "r", **data})


# MARK: strictness


def test_unknown_key_suggests_nearest_in_same_section():
    with pytest.raises(ConfigError, match=r"inner\.stpes: unknown key \(did you mean 'inner\.steps'\?\)"):
        _build({"inner": {"stpes": 3}})


def test_unknown_key_suggests_same_key_in_other_section():
    with pytest.raises(ConfigError, match=r"other\.flag: unknown key \(did you mean 'inner\.flag'\?\)"):
        _build({"other": {"flag": True}})


def test_unknown_key_lists_valid_keys_when_nothing_is_close():
    with pytest.raises(ConfigError, match=r"zzz: unknown key \(valid keys here: required, inner, other\)"):
        _build({"zzz": 1})


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        ({"steps": "3"}, r"inner\.steps: expected int, got '3' \(str\)"),
        ({"steps": True}, r"inner\.steps: expected int, got True \(bool\)"),
        ({"steps": 1.5}, r"inner\.steps: expected int, got 1\.5 \(float\)"),
        ({"flag": 1}, r"inner\.flag: expected bool, got 1 \(int\)"),
        ({"flag": "yes"}, r"inner\.flag: expected bool, got 'yes' \(str\)"),
        ({"lr": True}, r"inner\.lr: expected float, got True"),
        ({"name": 3}, r"inner\.name: expected str, got 3 \(int\)"),
        ({"mode": "c"}, r"inner\.mode: expected one of 'a', 'b', got 'c'"),
        ({"dims": [1, "x"]}, r"inner\.dims\[1\]: expected int, got 'x'"),
        ({"dims": 3}, r"inner\.dims: expected tuple\[int, \.\.\.\], got 3"),
        ({"pair": ["k"]}, r"inner\.pair: expected tuple\[str, int\] with 2 items"),
        ({"maybe": 3}, r"inner\.maybe: expected str, got 3"),
        ({"sizes": {"a": "b"}}, r"inner\.sizes\.a: expected int, got 'b'"),
    ],
)
def test_wrong_type_names_field_expected_type_and_value(data, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _build({"inner": data})


def test_missing_required_field():
    with pytest.raises(ConfigError, match=r"required: missing required key \(expected str\)"):
        from_dict(Top, {})


def test_all_errors_reported_together():
    with pytest.raises(ConfigError) as info:
        from_dict(Top, {"inner": {"steps": "x", "flag": 0}, "nope": 1})
    assert len(info.value.errors) == 4  # steps, flag, nope, missing required


def test_float_accepts_int_and_normalises():
    cfg = _build({"inner": {"lr": 1}})
    assert cfg.inner.lr == 1.0 and isinstance(cfg.inner.lr, float)
    assert config_hash(cfg) == config_hash(_build({"inner": {"lr": 1.0}}))


def test_direct_construction_is_type_checked_and_normalised():
    assert Inner(dims=[3, 4]).dims == (3, 4)
    assert isinstance(Inner(sizes={"b": 2}).sizes, FrozenDict)
    with pytest.raises(ConfigError, match="Inner.steps: expected int"):
        Inner(steps="3")


# MARK: frozen


def test_frozen_mutation_raises():
    cfg = _build({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.inner = Inner()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.inner.steps = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.inner.sizes["a"] = 2  # type: ignore[index]
    assert isinstance(cfg.inner.dims, tuple)
    hash(cfg)  # hashable all the way down


# MARK: YAML scalars, bases and merge


def test_yaml_scalar_schema():
    assert parse_yaml("[1e-4, 010, yes, on, true, False, 1_000, .inf, null, 0x10]") == [
        1e-4, 10, "yes", "on", True, False, 1000, float("inf"), None, 16]


def test_duplicate_yaml_keys_are_errors():
    with pytest.raises(ConfigError, match="duplicate key 'a'"):
        parse_yaml("a: 1\na: 2\n")


def test_deep_merge_mappings_merge_lists_replace():
    merged = deep_merge({"a": {"x": 1, "y": [1, 2]}, "b": 1}, {"a": {"y": [3]}, "c": 2})
    assert merged == {"a": {"x": 1, "y": [3]}, "b": 1, "c": 2}


def test_base_inheritance_left_to_right_then_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "one.yaml").write_text("required: one\ninner: {steps: 1, name: one, dims: [1, 1, 1]}\n")
    (tmp_path / "sub" / "two.yaml").write_text("inner: {steps: 2, flag: true}\n")
    (tmp_path / "child.yaml").write_text("base: [one.yaml, sub/two.yaml]\ninner: {dims: [9]}\n")
    cfg = load(Top, tmp_path / "child.yaml", env={})
    assert (cfg.required, cfg.inner.steps, cfg.inner.name, cfg.inner.flag, cfg.inner.dims) == ("one", 2, "one",
                                                                                               True, (9,))


def test_base_cycle_and_missing_base_are_errors(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: [a.yaml]\n")
    with pytest.raises(ConfigError, match="cycle"):
        load(Top, tmp_path / "a.yaml", env={})
    (tmp_path / "c.yaml").write_text("base: [nope.yaml]\n")
    with pytest.raises(ConfigError, match="base file 'nope.yaml' not found"):
        load(Top, tmp_path / "c.yaml", env={})


# MARK: overrides


@pytest.mark.parametrize(
    ("token", "field", "expected"),
    [
        ("inner.steps=200", "steps", 200),
        ("inner.lr=1e-4", "lr", 1e-4),
        ("inner.lr=3", "lr", 3.0),
        ("inner.flag=true", "flag", True),
        ("inner.flag=False", "flag", False),
        ("inner.name=no", "name", "no"),  # str target keeps the text (no YAML-1.1 bool surprise)
        ("inner.name=123", "name", "123"),
        ("inner.name=a=b", "name", "a=b"),
        ("inner.mode=b", "mode", "b"),
        ("inner.dims=[1,2,3]", "dims", (1, 2, 3)),
        ("inner.dims=[]", "dims", ()),
        ("inner.maybe=null", "maybe", None),
        ("inner.maybe=hello", "maybe", "hello"),
        ("inner.sizes={b: 2}", "sizes", {"a": 1, "b": 2}),  # mapping overrides deep-merge
        ("inner.sizes.c=3", "sizes", {"a": 1, "c": 3}),
    ],
)
def test_cli_override_parsing(token, field, expected):
    cfg = load(Top, None, ["required=r", token], env={})
    assert getattr(cfg.inner, field) == expected


@pytest.mark.parametrize("token", ["inner.flag=1", "inner.flag=yes", "inner.steps=1.5", "inner.steps=x"])
def test_cli_override_type_errors(token):
    with pytest.raises(ConfigError, match=f"inner.{token.split('.')[1].split('=')[0]}: expected"):
        load(Top, None, ["required=r", token], env={})


@pytest.mark.parametrize("token", ["steps", "=3", "inner..steps=3", "inner.steps"])
def test_malformed_override_token(token):
    with pytest.raises(ConfigError, match="expected `dotted.key=value`"):
        parse_override(token)


def test_same_key_twice_on_cli_is_an_error():
    with pytest.raises(ConfigError, match="set twice"):
        load(Top, None, ["required=r", "inner.steps=1", "inner.steps=2"], env={})


def test_unknown_override_key_suggests():
    with pytest.raises(ConfigError, match=r"did you mean 'inner\.steps'"):
        load(Top, None, ["required=r", "inner.step=1"], env={})


def test_env_overrides():
    env = {"DGEMMA_INNER__STEPS": "7", "DGEMMA_INNER__NAME": "no", "DGEMMA_REQUIRED__X": "1", "DGEMMA_HOME": "/x",
           "OTHER__A": "1"}
    assert set(env_overrides(env)) == {"inner.steps", "inner.name", "required.x"}
    cfg = load(Top, None, ["required=r"], env={"DGEMMA_INNER__STEPS": "7", "DGEMMA_INNER__SIZES__B": "4"})
    assert cfg.inner.steps == 7 and dict(cfg.inner.sizes) == {"a": 1, "b": 4}


def test_env_override_unknown_key_is_an_error():
    with pytest.raises(ConfigError, match=r"inner\.stepz: unknown key"):
        load(Top, None, ["required=r"], env={"DGEMMA_INNER__STEPZ": "7"})


@pytest.mark.parametrize(("cli", "env_key"), [("inner.steps=1", "DGEMMA_INNER__STEPS"),
                                              ("inner.sizes.a=1", "DGEMMA_INNER__SIZES"),
                                              ("inner.sizes={a: 1}", "DGEMMA_INNER__SIZES__A")])
def test_same_key_from_cli_and_env_is_an_error(cli, env_key):
    with pytest.raises(ConfigError, match=f"set both on the command line and by env {env_key}"):
        load(Top, None, ["required=r", cli], env={env_key: "2"})


def test_cli_override_beats_file_and_env_beats_file(tmp_path):
    (tmp_path / "c.yaml").write_text("required: r\ninner: {steps: 1, lr: 0.5}\n")
    cfg = load(Top, tmp_path / "c.yaml", ["inner.steps=3"], env={"DGEMMA_INNER__LR": "0.25"})
    assert (cfg.inner.steps, cfg.inner.lr) == (3, 0.25)


def test_with_overrides_revalidates():
    cfg = _build({})
    new = with_overrides(cfg, ["inner.steps=5"])
    assert new.inner.steps == 5 and cfg.inner.steps == 10
    assert with_overrides(cfg, {"inner.dims": [7]}).inner.dims == (7,)
    with pytest.raises(ConfigError):
        with_overrides(cfg, ["inner.steps=x"])


def test_raw_value_resolution():
    assert RawValue("null").resolve(str | None) is None
    assert RawValue("null").resolve(str) == "null"
    assert RawValue("3").resolve(int) == 3


# MARK: hashing and provenance


def test_hash_is_independent_of_key_order(tmp_path):
    (tmp_path / "a.yaml").write_text("required: r\ninner: {steps: 3, name: n, sizes: {a: 1, b: 2}}\nother: {seed: 1}\n")
    (tmp_path / "b.yaml").write_text("other: {seed: 1}\ninner: {sizes: {b: 2, a: 1}, name: n, steps: 3}\nrequired: r\n")
    a, b = load(Top, tmp_path / "a.yaml", env={}), load(Top, tmp_path / "b.yaml", env={})
    assert a == b and config_hash(a) == config_hash(b)
    assert config_hash(a) != config_hash(with_overrides(a, ["inner.steps=4"]))
    assert len(config_hash(a)) == 64


def test_dump_resolved_round_trips(tmp_path):
    cfg = _build({"inner": {"name": "1e-4", "maybe": "yes", "lr": 1e-7, "dims": []}})
    digest = dump_resolved(cfg, tmp_path / "run")
    assert (tmp_path / "run" / "config.sha256").read_text().strip() == digest == config_hash(cfg)
    again = load(Top, tmp_path / "run" / "resolved_config.yaml", env={})
    assert again == cfg and config_hash(again) == digest
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.endswith(".tmp")]


def test_to_dict_is_plain_data():
    d = to_dict(_build({}))
    assert d["inner"]["dims"] == [1, 2] and type(d["inner"]["sizes"]) is dict

"""`sdrl.teacher_sampler`: the teacher's sampler as a nested section of the `sampler` section's type (only what
differs is given, the rest inherits from `sampler`), built by the one `SamplerConfig` construction path; the flat keys
it replaced are refused with the new key's name."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dgemma.config import ConfigError, load_config, to_dict
from dgemma.config.sdrl_section import TeacherSamplerSection
from dgemma.config.sections import SamplerSection
from dgemma.inference.sampler_types import SamplerConfig
from dgemma.train.sdrl.teacher import student_sampler, teacher_sampler

REPO = Path(__file__).resolve().parents[2]
STAGE2 = REPO / "configs/stage2/tiny.yaml"


def test_section_has_the_sampler_sections_fields():
    assert [f.name for f in dataclasses.fields(TeacherSamplerSection)] == \
        [f.name for f in dataclasses.fields(SamplerSection)]


def test_teacher_defaults_and_inheritance_from_the_sampler_section():
    cfg = load_config(STAGE2, ["sampler.confidence_threshold=0.01", "sampler.accept=confidence"], env={})
    t = teacher_sampler(cfg, 64)
    # the documented teacher defaults (configs/stage2/tiny.yaml gives max_steps 32, entropy_bound, stability)
    assert (t.max_steps, t.entropy_bound, t.t_max, t.t_min, t.greedy, t.stability_threshold) == \
        (32, 0.02, 0.6, 0.4, True, 2)
    # everything the teacher section leaves unset is the sampler section's
    assert (t.confidence_threshold, t.accept, t.max_new_tokens, t.mode) == (0.01, "confidence", 64, "diffusion")
    s = student_sampler(cfg, 8, 64)
    assert (s.max_steps, s.greedy, s.t_max, s.stability_threshold) == (8, cfg.sampler.greedy, cfg.sampler.t_max,
                                                                      cfg.sampler.stability_threshold)


def test_null_inherits_and_max_steps_defaults_to_twice_the_students():
    cfg = load_config(STAGE2, ["sdrl.teacher_sampler.max_steps=null", "sdrl.teacher_sampler.t_max=null",
                               "sampler.t_max=0.9", "sampler.max_steps=12"], env={})
    t = teacher_sampler(cfg, 16)
    assert t.max_steps == 24 and t.t_max == 0.9 and t.t_min == 0.4  # 2 x 12; sampler's t_max; teacher's t_min
    assert cfg.sdrl.teacher_max_steps(12) == 24
    low = load_config(STAGE2, ["sdrl.teacher_sampler.max_steps=3"], env={})
    with pytest.raises(ValueError, match=r"sdrl\.teacher_sampler\.max_steps=3 is below the student's K_max "
                                         r"sampler\.max_steps=16"):
        teacher_sampler(low, 16)


@pytest.mark.parametrize(("old", "new"), [
    ("teacher_max_steps=16", "teacher_sampler.max_steps"),
    ("teacher_entropy_bound=0.1", "teacher_sampler.entropy_bound"),
    ("teacher_t_max=0.7", "teacher_sampler.t_max"), ("teacher_t_min=0.3", "teacher_sampler.t_min"),
    ("teacher_greedy=false", "teacher_sampler.greedy"), ("teacher_stability=1", "teacher_sampler.stability_threshold")])
def test_old_flat_keys_name_the_new_key(old, new):
    with pytest.raises(ConfigError) as e:
        load_config(STAGE2, [f"sdrl.{old}"], env={})
    assert e.value.errors == [f"sdrl.{old.split('=')[0]}: replaced by sdrl.{new}"]  # one line


def test_old_flat_key_in_a_file_is_refused(tmp_path):
    f = tmp_path / "old.yaml"
    f.write_text(f"base: [{STAGE2}]\nsdrl:\n  teacher_stability: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(f, env={})
    assert e.value.errors == ["sdrl.teacher_stability: replaced by sdrl.teacher_sampler.stability_threshold"]


def test_bad_teacher_values_name_the_nested_field():
    with pytest.raises(ConfigError, match=r"sdrl\.teacher_sampler\.stability_threshold: -1 must be >= 0"):
        load_config(STAGE2, ["sdrl.teacher_sampler.stability_threshold=-1"], env={})
    with pytest.raises(ConfigError, match=r"sdrl\.teacher_sampler\.greedy: expected bool"):
        load_config(STAGE2, ["sdrl.teacher_sampler.greedy=3"], env={})
    with pytest.raises(ConfigError, match=r"sdrl\.teacher_sampler\.no_such: unknown key"):
        load_config(STAGE2, ["sdrl.teacher_sampler.no_such=1"], env={})


def test_resolved_config_round_trips(tmp_path):
    from dgemma.config import RESOLVED_NAME, dump_resolved

    cfg = load_config(STAGE2, [f"run.output_dir={tmp_path}", "sdrl.teacher_sampler.t_min=0.3"], env={})
    dump_resolved(cfg, tmp_path)
    again = load_config(tmp_path / RESOLVED_NAME, env={})
    assert again == cfg and to_dict(again)["sdrl"]["teacher_sampler"]["t_min"] == 0.3


def test_one_construction_path_layers_and_overrides():
    """`SamplerConfig.from_section(section, *layers, **overrides)`: later layers' set fields win, then overrides; an
    unknown name is an error, never dropped; `.replace` goes through the same path (and its validation)."""
    base = SamplerConfig(max_steps=10, t_max=0.9, greedy=False)
    layer = TeacherSamplerSection(max_steps=None, greedy=None, t_max=0.7)
    got = SamplerConfig.from_section(base, layer, max_steps=5)
    assert (got.max_steps, got.t_max, got.greedy, got.entropy_bound) == (5, 0.7, False, 0.02)
    with pytest.raises(ValueError, match=r"\['no_such'\] are not SamplerConfig fields"):
        SamplerConfig.from_section(base, no_such=1)
    with pytest.raises(ValueError, match=r"SamplerConfig\.max_steps: 0 must be >= 1"):
        base.replace(max_steps=0)

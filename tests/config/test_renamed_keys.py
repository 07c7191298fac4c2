"""Config keys renamed to the glossary's names (docs/glossary.md): the old key is refused in one line naming the new
one (config file, CLI override), and a checkpoint that recorded a resume setting under its old name is still compared
under the new one on resume."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.cli_errors import one_line_error
from dgemma.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
STAGE1 = REPO / "configs/stage1/tiny.yaml"
STAGE2 = REPO / "configs/stage2/tiny.yaml"

RENAMED = [  # (old dotted key with a value, new dotted key, a config that has the section)
    ("data.canvas={prompt_len: 16}", "data.layout", STAGE1),  # a renamed section
    ("data.layout.num_canvases=2", "data.layout.n_blocks", STAGE1),
    ("diffusion.canvas_selection=one_random", "diffusion.block_selection", STAGE1),
    ("sdrl.curriculum_budgets=[3]", "sdrl.curriculum_max_steps", STAGE2),
]


@pytest.mark.parametrize(("old", "new", "config"), RENAMED)
def test_an_old_key_is_one_line_naming_the_new_key(old, new, config):
    with pytest.raises(ConfigError) as e:
        load_config(config, [old], env={})
    assert e.value.errors == [f"{old.split('=')[0]}: replaced by {new}"]


@pytest.mark.parametrize(("old", "new", "config"), RENAMED)
def test_an_old_key_in_a_yaml_file_is_refused(tmp_path, old, new, config):
    dotted, value = old.split("=")
    *sections, key = dotted.split(".")
    body = f"{key}: {value}"
    for section in reversed(sections):
        body = f"{section}:\n" + "\n".join("  " + line for line in body.splitlines())
    path = tmp_path / "old.yaml"
    path.write_text(f"base: [{config}]\n{body}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, env={})
    assert e.value.errors == [f"{dotted}: replaced by {new}"]


@pytest.mark.parametrize(("old", "new", "config"), RENAMED)
def test_dgemma_train_with_an_old_key_exits_nonzero_in_one_line(tmp_path, capsys, old, new, config):
    from dgemma.cli.main import main

    code = main(["train", "--no-progress", "-c", str(config), f"run.output_dir={tmp_path}", old])
    assert code != 0
    one_line_error(capsys, f"{old.split('=')[0]}: replaced by {new}")
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_key_in_a_renamed_section_names_the_new_section():
    with pytest.raises(ConfigError) as e:
        load_config(STAGE1, ["data.canvas.prompt_len=12"], env={})
    assert e.value.errors == ["data.canvas: replaced by data.layout"]


def test_the_new_keys_load():
    cfg = load_config(STAGE1, ["data.layout.n_blocks=3", "data.layout.prompt_len=12",
                               "diffusion.block_selection=one_random"], env={})
    assert cfg.data.layout.n_blocks == 3 and cfg.data.layout.prompt_len == 12
    assert cfg.diffusion.block_selection == "one_random"
    assert load_config(STAGE2, ["sdrl.curriculum_max_steps=[3]"], env={}).sdrl.curriculum_max_steps == (3,)


def _sdrl_checkpoint(tmp_path, settings: dict):
    """A real (orbax) checkpoint directory of an SD·RL run `s2` whose metadata recorded `settings`."""
    import jax.numpy as jnp

    from dgemma.checkpoint import CheckpointManager

    cfg = load_config(STAGE2, [f"run.output_dir={tmp_path}", "run.name=s2"], env={})
    ckpt = cfg.checkpoint.directory(cfg.run)
    with CheckpointManager(ckpt, async_save=False,
                           metadata={"run_name": "s2", "objective": "sdrl", "settings": settings}) as m:
        m.save(1, {"stand_in": jnp.zeros(2)})
    return ckpt


def test_resume_reads_a_setting_recorded_under_its_old_name_as_the_new_one(tmp_path):
    """Checkpoints written before the rename recorded `sdrl.curriculum_budgets`; a resume compares it with
    `sdrl.curriculum_max_steps` (a changed ladder is refused, the same ladder resumes)."""
    from dgemma.train.objectives import get_objective
    from dgemma.train.resume import check_checkpoint_dir

    sdrl = get_objective("sdrl")
    same = load_config(STAGE2, [f"run.output_dir={tmp_path}", "run.name=s2"], env={})
    old_settings = {("sdrl.curriculum_budgets" if k == "sdrl.curriculum_max_steps" else k): v
                    for k, v in sdrl.recorded_settings(same).items()}
    assert "sdrl.curriculum_budgets" in old_settings  # the metadata as an earlier version wrote it
    ckpt = _sdrl_checkpoint(tmp_path, old_settings)
    check_checkpoint_dir(same, sdrl, ckpt)  # same settings: may resume
    ladder = list(same.sdrl.curriculum_max_steps)
    changed = load_config(STAGE2, [f"run.output_dir={tmp_path}", "run.name=s2",
                                   f"sdrl.curriculum_max_steps={ladder[:-1]}"], env={})
    with pytest.raises(ConfigError, match=rf"with sdrl\.curriculum_max_steps={ladder[:-1]!r}: its checkpoints were "
                                          rf"written with sdrl\.curriculum_max_steps={ladder!r}".replace("[", r"\[")):
        check_checkpoint_dir(changed, sdrl, ckpt)

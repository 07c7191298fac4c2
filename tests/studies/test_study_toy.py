"""The toy study setup (dgemma/train/study_toy.py): its tasks can be the many-answer regime's, over that regime's
config and vocabulary."""

from pathlib import Path

import pytest

STUDY = Path(__file__).resolve().parents[2] / "experiments" / "sdrl_study"


def test_toy_study_with_pick_and_fill_over_the_choice_config(tmp_path):
    from dgemma.config import load_config
    from dgemma.data.tokenizer import build_tokenizer
    from dgemma.train.study_toy import TOY_TASKS, write_toy_study

    tasks = [{"name": "pick", "min_len": 3, "max_len": 5}, {"name": "fill", "min_len": 3, "max_len": 5,
                                                               "wildcard_rate": 0.5}]
    config, params = write_toy_study(tmp_path / "choice", base=STUDY / "stage2_choice.yaml", tasks=tasks)
    cfg = load_config(config)
    assert [(t.name, t.min_len, t.max_len) for t in cfg.data.tasks] == [("pick", 3, 5), ("fill", 3, 5)]
    assert cfg.data.tasks[1].wildcard_rate == 0.5 and cfg.sampler.max_steps == 4 and params.is_dir()
    tok = build_tokenizer(cfg.data.tokenizer)
    assert tok.decode(tok.encode("F1?2|")) == "F1?2|"  # the choice regime's symbols
    default = load_config(write_toy_study(tmp_path / "copy", base=STUDY / "stage2.yaml")[0])
    assert [t.name for t in default.data.tasks] == [t["name"] for t in TOY_TASKS] == ["copy", "sort"]
    with pytest.raises(FileExistsError, match="choose an empty directory"):
        write_toy_study(tmp_path / "choice", base=STUDY / "stage2_choice.yaml", tasks=tasks)
    with pytest.raises(FileNotFoundError, match=r"^write_toy_study: base config .*nowhere.yaml not found$"):
        write_toy_study(tmp_path / "none", base=tmp_path / "nowhere.yaml")
    assert not (tmp_path / "none").exists()  # refused before anything is written

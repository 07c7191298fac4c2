"""The toy SD·RL-study setup the study tests share: `dgemma.train.study_toy.write_toy_study` (a tiny config over
experiments/sdrl_study/stage2.yaml and an untrained "stage-1" params checkpoint; plumbing only)."""

from pathlib import Path

import yaml

STUDY_CONFIG = Path(__file__).resolve().parents[2] / "experiments" / "sdrl_study" / "stage2.yaml"


def tiny_study_dir(directory: Path, model: str = "canvas_length: 8") -> Path:
    """Write `directory`/tiny.yaml (`model` is the model section's body) and `directory`/stage1/params; return it."""
    from dgemma.train.study_toy import write_toy_study

    write_toy_study(directory, base=STUDY_CONFIG, model=yaml.safe_load("{" + model + "}"))
    return directory

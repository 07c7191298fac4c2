"""The LoRA study (README.md here): SD·RL with adapters (ranks 4, 16, 64; attention-only / attention + MLPs + experts)
vs full-parameter SD·RL at matched iterations from the many-answer stage-1 checkpoint; the command line over
`dgemma.train.lora_study`. The grid as recorded in results.md: `bash experiments/lora_study/grid.sh`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dgemma.train.lora_study import build_parser, run_lora_study

SDRL_STUDY = Path(__file__).resolve().parents[1] / "sdrl_study"  # the SD·RL study's configs and checkpoints
DEFAULT_CONFIG = SDRL_STUDY / "stage2_choice.yaml"
TASK_CONFIG = SDRL_STUDY / "configs" / "common.yaml"  # where --tasks finds a task the stage-2 config lacks
# training streams the held-out prompts avoid without --train-stream: the toy stage 0, stage 1, the AR control
TRAIN_STREAMS = tuple(SDRL_STUDY / "configs" / n for n in ("stage0_ar.yaml", "stage1.yaml", "ar_control.yaml"))


def main(argv=None) -> int:
    run_lora_study(build_parser(DEFAULT_CONFIG, train_streams=TRAIN_STREAMS, task_config=TASK_CONFIG).parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())

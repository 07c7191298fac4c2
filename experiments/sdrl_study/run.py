"""E2: the SD·RL study (docs/sdrl.md, experiments/sdrl_study/README.md) on the long-canvas toy regime; the command line over
`dgemma.train.study` (which trains the arms, evaluates them and writes the report).

    python experiments/sdrl_study/run.py --stage1 runs/toy/stage1/params                    # full: 4 arms x 3 seeds
    python experiments/sdrl_study/run.py --stage1 ... --arms sdrl --tasks perm --name e2c   # E2c (PERM)
    python experiments/sdrl_study/run.py --reduced --stage1 ...                             # CI: 1 seed, copy+sort

Writes --out/results.json, results.md and the PNGs; results.md states what ran (seeds, iterations, settings).
"""

from __future__ import annotations

import sys
from pathlib import Path

from dgemma.train.study import build_parser, run_study

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE / "stage2.yaml"
# the toy regime's stage-0/1 mix: where --tasks / --retention-tasks find a task the stage-2 config lacks
TASK_CONFIG = HERE / "configs" / "common.yaml"
# training streams the held-out prompts avoid without --train-stream: stage 0, stage 1, the AR control
TRAIN_STREAMS = tuple(HERE / "configs" / n for n in ("stage0_ar.yaml", "stage1.yaml", "ar_control.yaml"))


def main(argv=None) -> int:
    run_study(build_parser(DEFAULT_CONFIG, train_streams=TRAIN_STREAMS, task_config=TASK_CONFIG).parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

DEFAULT_CONFIG = Path(__file__).resolve().parent / "stage2.yaml"


def main(argv=None) -> int:
    run_study(build_parser(DEFAULT_CONFIG).parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())

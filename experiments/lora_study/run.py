"""The LoRA study (README.md here): SD·RL with adapters (ranks 4, 16, 64; attention-only / attention + MLPs + experts)
vs full-parameter SD·RL at matched iterations from the many-answer stage-1 checkpoint; the command line over
`dgemma.train.lora_study`. The grid as recorded in results.md: `bash experiments/lora_study/grid.sh`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dgemma.train.lora_study import build_parser, run_lora_study

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "sdrl_study" / "stage2_choice.yaml"


def main(argv=None) -> int:
    run_lora_study(build_parser(DEFAULT_CONFIG).parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())

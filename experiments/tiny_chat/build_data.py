"""Writes the tiny chat data set: GSM8K as `messages` rows, split train / held-out (dgemma.data.gsm8k_chat).

    python experiments/tiny_chat/build_data.py                 # -> data/chat/gsm8k_chat_{train,heldout}.jsonl

configs/chat/tiny.yaml reads data/chat/gsm8k_chat_train.jsonl (relative to the directory `dgemma train` runs in).
The bytes are a pure function of the GSM8K file: the split is by row-index hash, the rows in file order.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dgemma.data.gsm8k_chat import write_gsm8k_chat

REPO = Path(__file__).resolve().parents[2]
# shared/ lies next to the repository (CI) or next to the folder of worktrees holding it
GSM8K = next((p for p in (REPO.parent / "shared/data/gsm8k/test.jsonl", REPO.parents[1] / "shared/data/gsm8k/test.jsonl")
              if p.exists()), REPO.parent / "shared/data/gsm8k/test.jsonl")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gsm8k", type=Path, default=GSM8K, help="GSM8K jsonl (question / answer rows)")
    p.add_argument("--out", type=Path, default=Path("data/chat"), help="output directory")
    args = p.parse_args(argv)
    for split, path in write_gsm8k_chat(str(args.gsm8k), str(args.out)).items():
        print(f"{split}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

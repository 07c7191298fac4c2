"""GSM8K as chat data, and the one train / held-out split of the GSM8K rows that every tiny-chat artefact uses.

The split is a pure function of a row's 0-based index in the GSM8K file (the test split shipped at
`shared/data/gsm8k/test.jsonl`, 1,319 rows): row i is held out when the first 8 bytes of
`sha256(b"gsm8k-heldout:" + str(i))`, as a big-endian integer, are < HELD_OUT_FRACTION * 2**64. A hash rather than
"the last N rows" so that the held-out rows are spread over the file (GSM8K is not shuffled by topic, but nothing
here relies on that), and a fixed function rather than a seeded shuffle so that the tokenizer builder, the chat data
writer and any later evaluation agree without sharing state. The tiny-chat tokenizer is trained on the train rows
only (experiments/tiny_chat/build_tokenizer.py), so a held-out question never shaped its vocabulary.

A chat row is `{"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
"gsm8k_row": i}`: the worked answer ends with GSM8K's `#### N` line, which `rewards.gsm8k_reward` scores.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable

HELD_OUT_FRACTION = 0.2
_SALT = b"gsm8k-heldout:"
SPLITS = ("train", "heldout")


def is_held_out(index: int) -> bool:
    """Whether GSM8K row `index` (0-based, in file order) belongs to the held-out split."""
    digest = hashlib.sha256(_SALT + str(int(index)).encode()).digest()
    return int.from_bytes(digest[:8], "big") < int(HELD_OUT_FRACTION * 2**64)


def read_gsm8k(path: str) -> list[dict]:
    """The rows of a GSM8K jsonl file (`question`, `answer` text, the answer with a `#### N` line), in file order;
    a row without them is an error naming the file and line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not a JSON object ({e})") from None
            for key in ("question", "answer"):
                if not isinstance(row, dict) or not isinstance(row.get(key), str):
                    raise ValueError(f"{path}:{line_no}: GSM8K row needs a text {key!r} field")
            if "####" not in row["answer"]:
                raise ValueError(f"{path}:{line_no}: GSM8K answer has no '####' final-answer line")
            rows.append(row)
    return rows


def chat_row(row: dict, index: int) -> dict:
    """One GSM8K row as a `messages` row (the user asks the question, the assistant gives the worked answer)."""
    return {"messages": [{"role": "user", "content": row["question"]},
                         {"role": "assistant", "content": row["answer"]}],
            "gsm8k_row": int(index)}


def split_rows(rows: list[dict], split: str) -> Iterable[tuple[int, dict]]:
    """(index, row) of the rows in `split` ('train' or 'heldout'), in file order."""
    if split not in SPLITS:
        raise ValueError(f"GSM8K split must be one of {SPLITS}, got {split!r}")
    want = split == "heldout"
    return ((i, r) for i, r in enumerate(rows) if is_held_out(i) == want)


def write_gsm8k_chat(gsm8k_path: str, out_dir: str) -> dict[str, str]:
    """Writes `gsm8k_chat_train.jsonl` and `gsm8k_chat_heldout.jsonl` under `out_dir` (deterministic bytes: one
    `json.dumps(..., sort_keys=True, ensure_ascii=False)` line per row, file order); returns {split: path}."""
    rows = read_gsm8k(gsm8k_path)
    os.makedirs(out_dir, exist_ok=True)
    out = {}
    for split in SPLITS:
        path = os.path.join(out_dir, f"gsm8k_chat_{split}.jsonl")
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            for i, row in split_rows(rows, split):
                f.write(json.dumps(chat_row(row, i), sort_keys=True, ensure_ascii=False) + "\n")
        out[split] = path
    return out

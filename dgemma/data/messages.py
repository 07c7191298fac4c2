"""`source: messages`: chat rows from local jsonl / parquet / arrow files or an HF `datasets.Dataset`, one example
per assistant turn (dgemma.data.chat renders them with the tokenizer's chat template).

Every row is read, checked and rendered when the source is built, so a bad row is found before training starts,
and the token ids are kept for the pipeline (`encoded_rows`), which reads them instead of tokenizing text again.
A row is bad when `chat.check_messages` refuses it (no messages, unknown role, non-text content, no assistant
turn), when a turn's context is longer than `data.layout.prompt_len` or its answer + `<turn|>` longer than
`n_blocks x canvas_length`, or, with `data.messages.reward: gsm8k`, when an answer has no `#### N` line. Nothing is
truncated. `data.messages.bad_rows: error` refuses the source with one line naming the first bad row's file and
line (jsonl) or record (parquet, arrow, a JSON array; `dataset row N` for a Dataset) and how many rows are bad;
`skip` leaves those rows out (all their turns), logs the same line and keeps the list in `skipped`.

Reference answers (SD·RL rewards, evaluation): an example's `answer` is its assistant turn as the model must write
it (`reward: text`, thinking included where kept) or that turn's final number after `####` (`reward: gsm8k`);
with `turns: last` the examples are each row's last assistant turn, so a row's reference answer is its last
assistant turn.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

from dgemma.data.chat import BadRow, chat_turns, check_messages
from dgemma.data.config import LayoutConfig, MessagesConfig
from dgemma.data.rewards import TaskExample, extract_gsm8k_answer
from dgemma.data.encoded import EncodedRows

log = logging.getLogger(__name__)
_EXTENSIONS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


def _json_rows(path: str) -> Iterable[tuple[str, Any]]:
    """(location, row) of a JSON Lines file (`file:line`) or a JSON array document (`file: record N`); a line that
    is not JSON becomes a row that `check_messages` refuses, with its parse error."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip()[:1] == "[":
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a JSON array ({e})") from None
        yield from ((f"{path}: record {i + 1}", r) for i, r in enumerate(records))
        return
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{line_no}", json.loads(line)
        except json.JSONDecodeError as e:
            yield f"{path}:{line_no}", BadRow(f"not a JSON object ({e.msg} at column {e.colno})")


def _table_rows(path: str, fmt: str) -> Iterable[tuple[str, Any]]:
    if fmt == "parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        import datasets

        rows = datasets.Dataset.from_file(path).to_list()
    return ((f"{path}: record {i + 1}", r) for i, r in enumerate(rows))


def read_rows(paths: Sequence[str], fmt: str | None = None) -> Iterable[tuple[str, Any]]:
    """(location, row) of every row of local files of one format ('json' | 'parquet' | 'arrow'; None: from the
    extensions)."""
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(f"data files not found: {missing}")
    found = [_EXTENSIONS.get(os.path.splitext(p)[1].lower()) for p in paths]
    if fmt is None:
        kinds = {k for k in found if k is not None}
        if len(kinds) != 1 or None in found:
            raise ValueError(f"cannot infer one data format from {list(paths)}; expected one of {sorted(_EXTENSIONS)}")
        fmt = kinds.pop()
    for p in paths:
        yield from (_json_rows(p) if fmt == "json" else _table_rows(p, fmt))


class MessagesSource:
    """Random access to the examples (assistant turns) of chat rows; `__getitem__(i) -> TaskExample`.

    Args:
      paths: local jsonl / json / parquet / arrow files (one format), or
      dataset: an HF `datasets.Dataset` (or any sequence of row dicts) instead of files.
      tokenizer: an `HFTokenizer(chat=True)` (its chat template renders, its EOS is `<turn|>`).
      config: `data.messages`. layout: `data.layout` (the length limits).
    """

    def __init__(self, paths: Sequence[str] | str = (), *, tokenizer: Any, config: MessagesConfig,
                 layout: LayoutConfig, dataset: Any = None):
        self.paths = [str(paths)] if isinstance(paths, (str, os.PathLike)) else [str(p) for p in paths]
        if (dataset is None) == (not self.paths):
            raise ValueError("MessagesSource needs either local files (paths) or a dataset, not both")
        self.config, self.layout, self.tokenizer = config, layout, tokenizer
        rows = read_rows(self.paths) if dataset is None else ((f"dataset row {i}", r) for i, r in enumerate(dataset))
        self.task = "gsm8k" if config.reward == "gsm8k" else "text"
        self._examples: list[tuple[str, str]] = []  # (location, answer) per example
        self.skipped: list[str] = []  # "location: reason" of every bad row
        prompts, responses = [], []
        n_rows = 0
        for where, row in rows:
            n_rows += 1
            try:
                turns = self._turns(row)
            except BadRow as e:
                self.skipped.append(f"{where}: {e}")
                continue
            for context, target, answer in turns:
                prompts.append(context)
                responses.append(target)
                self._examples.append((where, answer))
        self._report(n_rows)
        self.encoded_rows = EncodedRows.from_lists(prompts, responses)

    def _turns(self, row: Any) -> list[tuple[list[int], list[int], str]]:
        if isinstance(row, BadRow):
            raise row
        cfg, layout = self.config, self.layout
        messages = check_messages(row, cfg.field)
        turns = chat_turns(self.tokenizer.hf_tokenizer, messages, thinking=cfg.thinking)
        if cfg.turns == "last":
            turns = turns[-1:]
        out = []
        for k, context, target in turns:
            if len(context) > layout.prompt_len:
                raise BadRow(f"the context of the assistant turn at message {k} has {len(context)} tokens > "
                             f"data.layout.prompt_len={layout.prompt_len} (nothing is truncated)")
            if len(target) + 1 > layout.response_len:
                raise BadRow(f"the assistant turn at message {k} has {len(target) + 1} tokens incl. <turn|> > "
                             f"data.layout.n_blocks x canvas_length = {layout.response_len} (nothing is truncated)")
            if cfg.reward == "gsm8k":
                answer = extract_gsm8k_answer(messages[k]["content"])
                if answer is None:
                    raise BadRow(f"the assistant turn at message {k} has no '####' final answer "
                                 "(data.messages.reward='gsm8k')")
            else:
                answer = self.tokenizer.decode(target)
            out.append((context, target, answer))
        return out

    def _report(self, n_rows: int) -> None:
        where = self.paths or ["the dataset"]
        if self.skipped:
            more = f" ({len(self.skipped)} of {n_rows} rows are bad)"
            if self.config.bad_rows == "error":
                raise ValueError(f"{self.skipped[0]}{more}; fix them or set data.messages.bad_rows: skip")
            log.warning("skipped %d of %d chat rows of %s (data.messages.bad_rows=skip); first: %s",
                        len(self.skipped), n_rows, where, self.skipped[0])
        if not self._examples:
            raise ValueError(f"no usable chat rows in {where}" + (f": {self.skipped[0]}" if self.skipped else ""))

    def location(self, index: int) -> str:
        """Where example `index` comes from: file and line / record, or `dataset row N`."""
        return self._examples[index][0]

    def __len__(self) -> int:
        return len(self._examples)

    def __getitem__(self, index: int) -> TaskExample:
        index = int(index)
        if not 0 <= index < len(self._examples):
            raise IndexError(f"index {index} out of range for {len(self._examples)} chat examples")
        rows = self.encoded_rows
        return TaskExample(task=self.task, prompt=self.tokenizer.decode(rows.prompt(index)),
                           response=self.tokenizer.decode(rows.response(index)), answer=self._examples[index][1],
                           index=index)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.paths or 'dataset'}, n={len(self)}, skipped={len(self.skipped)})"

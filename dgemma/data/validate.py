"""Whole-file validation of a local data source, at pipeline construction, before anything is written.

The pipeline tokenizes an example and lays it out only when a batch reads it, so a row the tokenizer cannot encode,
a GSM8K answer without its `####` line, or a prompt / response longer than the training layout allows under an
`'error'` policy would otherwise surface mid-run (or never, for rows a short run does not reach), without its file
and line. `encode_file_rows` checks every row in one pass and raises one line naming the first bad row's file and
1-based line (JSON Lines) or record (JSON array, parquet, arrow), the problem and how many rows share it:

    data/train.jsonl:1042: prompt has 611 tokens incl. BOS > data.layout.prompt_len=512 (...; 7 rows in all); ...

Cost: the texts are read column-wise from the memory-mapped Arrow table and tokenized in batches when the tokenizer
offers `encode_batch` (the HF wrapper: one call into the Rust tokenizer per batch). The token ids are kept
(`EncodedRows`, flat int32 arrays, up to `CACHE_MAX_TOKENS`) and the pipeline reads them instead of tokenizing each
example again, so the whole-file check costs no extra tokenization over a run that reads every row once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dgemma.data.config import DataConfig
from dgemma.data.encoded import EncodedRows

__all__ = ["CACHE_MAX_TOKENS", "EncodedRows", "encode_file_rows", "row_locations"]

_BATCH = 1024  # rows per tokenizer call
CACHE_MAX_TOKENS = 2**26
"""Token ids kept for the pipeline (int32: 256 MiB per host); a larger file is validated but tokenized again per
example."""


def row_locations(paths: Sequence[str], fmt: str, num_rows: int) -> Callable[[int], str]:
    """`row -> "file:line"` for JSON Lines files (one record per non-blank line, the order HF `datasets` reads them);
    `row -> "file: record N"` (1-based) otherwise (JSON array, parquet, arrow) when the file of a row is known."""
    spans: list[tuple[str, list[int] | None, int]] = []  # (path, line numbers of its records or None, rows)
    lines_known, rows_known = fmt == "json", True  # rows_known: every file's row count is known
    for path in paths:
        lines = _record_lines(path) if fmt == "json" else None
        lines_known = lines_known and lines is not None
        n = len(lines) if lines is not None else _row_count(path, fmt)
        if n is None:
            rows_known = False
        else:
            spans.append((path, lines, n))
    if not rows_known or sum(n for _, _, n in spans) != num_rows:
        if len(paths) == 1:
            return lambda i: f"{paths[0]}: record {i + 1}"
        return lambda i: f"{list(paths)}: record {i + 1}"

    def where(i: int) -> str:
        for path, lines, n in spans:
            if i < n:
                return f"{path}:{lines[i]}" if lines_known and lines is not None else f"{path}: record {i + 1}"
            i -= n
        raise IndexError(i)

    return where


def _record_lines(path: str) -> list[int] | None:
    """1-based numbers of the non-blank lines of a JSON Lines file; None for a JSON array document."""
    with open(path, "rb") as f:
        if f.read(4096).lstrip()[:1] == b"[":
            return None
        f.seek(0)
        return [n for n, line in enumerate(f, 1) if line.strip()]


def _row_count(path: str, fmt: str) -> int | None:
    """Rows of one parquet file from its footer; None where it is not cheap to know."""
    if fmt != "parquet":
        return None
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows


def _texts(table: Any, column: str) -> list[str]:
    return [v.decode("utf-8") if isinstance(v, bytes) else v for v in table.column(column).to_pylist()]


def _encode_all(tokenizer: Any, texts: list[str], where: Callable[[int], str], what: str) -> list[list[int]]:
    """The ids of every text, tokenized in batches when the tokenizer can (`encode_batch`); a text the tokenizer
    cannot encode is an error naming its row and how many rows fail."""
    encode_batch = getattr(tokenizer, "encode_batch", None)
    out: list[list[int]] = []
    for start in range(0, len(texts), _BATCH):
        chunk = texts[start:start + _BATCH]
        try:
            out.extend(encode_batch(chunk) if encode_batch else map(tokenizer.encode, chunk))
        except ValueError:  # find the row: a batch call does not say which text failed
            bad = [j for j in range(start, len(texts)) if not _encodes(tokenizer, texts[j])]
            if not bad:
                raise
            try:
                tokenizer.encode(texts[bad[0]])
            except ValueError as e:
                more = f"; {len(bad)} rows in all" if len(bad) > 1 else ""
                raise ValueError(f"{where(bad[0])}: the tokenizer cannot encode the {what} ({e}{more})") from None
    return out


def _encodes(tokenizer: Any, text: str) -> bool:
    try:
        tokenizer.encode(text)
    except ValueError:
        return False
    return True


def _first_over(counts: Sequence[int], limit: int) -> tuple[int, int]:
    """(index of the first count > limit or -1, how many are)."""
    over = [i for i, n in enumerate(counts) if n > limit]
    return (over[0] if over else -1), len(over)


def encode_file_rows(source: Any, tokenizer: Any, cfg: DataConfig) -> EncodedRows | None:
    """Check every row of a file source (`HFFileSource` / `GSM8KSource`; a `MessagesSource` checks itself) against the tokenizer and the training layout
    (module docstring); return its token ids (None when over `CACHE_MAX_TOKENS`). Other sources (synthetic, TFDS)
    are not checked here: None.

    Raises:
      ValueError: one line naming the file and line / record of the first bad row.
    """
    from dgemma.data.sources import GSM8KSource, HFFileSource

    if isinstance(getattr(source, "encoded_rows", None), EncodedRows):  # a MessagesSource: checked when built
        return source.encoded_rows
    if not isinstance(source, HFFileSource):
        return None
    table = source.hf_dataset.data
    where = row_locations(source.paths, source.format, len(source))
    responses = _texts(table, source.response_field)
    if isinstance(source, GSM8KSource):
        from dgemma.data.rewards import extract_gsm8k_answer

        missing = [i for i, r in enumerate(responses) if extract_gsm8k_answer(r) is None]
        if missing:
            more = f"; {len(missing)} rows in all" if len(missing) > 1 else ""
            raise ValueError(f"{where(missing[0])}: GSM8K answer has no '####' final-answer line{more}")
    prompts = [source.prompt_template.format(prompt=p) for p in _texts(table, source.prompt_field)]
    prompt_ids = _encode_all(tokenizer, prompts, where, "prompt")
    response_ids = _encode_all(tokenizer, responses, where, "response")
    layout, bos, eos = cfg.layout, int(cfg.add_bos), tokenizer.eos_id
    if layout.truncate_prompt == "error":
        i, n = _first_over([len(x) + bos for x in prompt_ids], layout.prompt_len)
        if i >= 0:
            raise ValueError(f"{where(i)}: prompt has {len(prompt_ids[i]) + bos} tokens{' incl. BOS' if bos else ''} "
                             f"> data.layout.prompt_len={layout.prompt_len} (data.layout.truncate_prompt='error'"
                             f"{f'; {n} rows in all' if n > 1 else ''}); raise prompt_len or truncate 'left'/'right'")
    if layout.response_overflow == "error":
        # + the EOS `to_layout` appends (unless the response already ends in it)
        counts = [len(x) + (0 if x and x[-1] == eos else 1) for x in response_ids]
        limit = layout.response_len
        i, n = _first_over(counts, limit)
        if i >= 0:
            raise ValueError(f"{where(i)}: response has {counts[i]} tokens incl. EOS > data.layout.n_blocks x "
                             f"canvas_length = {layout.n_blocks} x {layout.canvas_length} = {limit} "
                             f"(data.layout.response_overflow='error'{f'; {n} rows in all' if n > 1 else ''}); raise "
                             f"n_blocks or set response_overflow='drop'")
    if sum(map(len, prompt_ids)) + sum(map(len, response_ids)) > CACHE_MAX_TOKENS:
        return None
    return EncodedRows.from_lists(prompt_ids, response_ids)

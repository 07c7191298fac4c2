"""Random-access data sources. Each has `__len__` and `__getitem__(i) -> TaskExample`, which is exactly what
`grain.MapDataset.source` needs for a global shuffle and a step-addressable stream.

* synthetic tasks (`dgemma.data.tasks`): generated from (seed, index), no storage;
* local jsonl / parquet / arrow files through HF `datasets` (`load_dataset("json"|"parquet"|"arrow",
  data_files=...)`), fully offline: only the packaged builders and local paths are used;
* GSM8K-format files (`question`, `answer` with the final answer after `####`), scored by `gsm8k_reward`;
* chat (`messages`) rows: `dgemma.data.messages.MessagesSource`, one example per assistant turn;
* TFDS datasets via `tfds.data_source` (ArrayRecord, random access), behind the optional `tfds` extra.

HF `datasets` and TFDS are imported lazily so that `import dgemma.data` stays light.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypedDict

from dgemma.data.config import DataConfig
from dgemma.data.rewards import TaskExample, extract_gsm8k_answer
from dgemma.data.tasks import MixtureSource, TaskSource

_HF_FORMATS = ("json", "parquet", "arrow")
_EXTENSIONS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


class Source(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> TaskExample: ...


def infer_format(paths: Sequence[str]) -> str:
    """'json' | 'parquet' | 'arrow' from the file extensions (all files must agree)."""
    found = [_EXTENSIONS.get(os.path.splitext(str(p))[1].lower()) for p in paths]
    kinds = {k for k in found if k is not None}
    if len(kinds) != 1 or None in found:
        raise ValueError(f"cannot infer one data format from {list(paths)}; expected one of {sorted(_EXTENSIONS)}")
    return kinds.pop()


def _as_text(value: Any, field: str, index: int) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if not isinstance(value, str):
        raise TypeError(f"example {index}: field {field!r} must be text, got {type(value).__name__}")
    return value


class HFFileSource:
    """Local files loaded with HF `datasets` (memory-mapped Arrow; random access by row).

    Args:
      paths: local files of one format.
      format: 'json' (jsonl), 'parquet' or 'arrow'; None infers it from the extensions.
      prompt_field, response_field: column names of the prompt and the training response.
      answer_field: column holding the reward target; None -> the response (exact match).
      prompt_template: `str.format` template with `{prompt}` (e.g. a chat wrapper).
      task: the `TaskExample.task` name, which selects the reward ('text' = exact match).
      cache_dir: HF datasets cache directory for the converted Arrow files.
    """

    def __init__(
        self,
        paths: Sequence[str] | str,
        *,
        format: str | None = None,  # noqa: A002 - mirrors load_dataset's builder name
        prompt_field: str = "prompt",
        response_field: str = "response",
        answer_field: str | None = None,
        prompt_template: str = "{prompt}",
        task: str = "text",
        cache_dir: str | None = None,
    ):
        import datasets  # lazy

        self.paths = [str(paths)] if isinstance(paths, (str, os.PathLike)) else [str(p) for p in paths]
        missing = [p for p in self.paths if not os.path.exists(p)]
        if missing:
            raise FileNotFoundError(f"data files not found: {missing}")
        self.format = format or infer_format(self.paths)
        if self.format not in _HF_FORMATS:
            raise ValueError(f"format must be one of {_HF_FORMATS}, got {self.format!r}")
        empty = [p for p in self.paths if os.path.getsize(p) == 0]
        if empty:
            raise ValueError(f"data files are empty: {empty}")
        try:
            self._ds = datasets.load_dataset(self.format, data_files=self.paths, split="train", cache_dir=cache_dir)
        except Exception as e:  # datasets wraps parse errors (a malformed row) in several exception types
            cause = e.__cause__ or e
            raise ValueError(f"cannot read {self.paths} as {self.format}: {type(cause).__name__}: "
                             f"{str(cause).splitlines()[0] if str(cause) else ''}") from e
        columns = set(self._ds.column_names)
        for name, col in (("prompt_field", prompt_field), ("response_field", response_field)):
            if col not in columns:
                raise KeyError(f"{name}={col!r} is not a column of {self.paths}; columns: {sorted(columns)}")
        if answer_field is not None and answer_field not in columns:
            raise KeyError(f"answer_field={answer_field!r} is not a column of {self.paths}; columns: {sorted(columns)}")
        self._check_rows([prompt_field, response_field] + ([answer_field] if answer_field else []))
        self.prompt_field, self.response_field, self.answer_field = prompt_field, response_field, answer_field
        self.prompt_template = prompt_template
        self.task = task

    def _check_rows(self, fields: list[str]) -> None:
        """Every row up front (Arrow column metadata, no row decoding): at least one row, the text columns are text
        and have no missing values; errors name the file, column and first bad row (= its line in a jsonl file)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if len(self._ds) == 0:
            raise ValueError(f"no rows in {self.paths}")
        table = self._ds.data
        for col in fields:
            column = table.column(col)
            if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
                    or pa.types.is_binary(column.type)):
                raise ValueError(f"{self.paths}: column {col!r} must be text, it holds {column.type}")
            if column.null_count:
                row = int(pc.index(pc.is_null(column), True).as_py())
                where = f"line {row + 1} of {self.paths[0]}" if len(self.paths) == 1 and self.format == "json" \
                    else f"row {row} of {self.paths}"
                raise ValueError(f"{where}: column {col!r} is missing ({column.null_count} rows in all)")

    @property
    def hf_dataset(self):
        return self._ds

    def __len__(self) -> int:
        return len(self._ds)

    def _answer(self, row: Mapping[str, Any], response: str, index: int) -> str:
        if self.answer_field is None:
            return response
        return _as_text(row[self.answer_field], self.answer_field, index)

    def __getitem__(self, index: int) -> TaskExample:
        index = int(index)
        if not 0 <= index < len(self._ds):
            raise IndexError(f"index {index} out of range for {len(self._ds)} rows of {self.paths}")
        row = self._ds[index]
        prompt = _as_text(row[self.prompt_field], self.prompt_field, index)
        response = _as_text(row[self.response_field], self.response_field, index)
        return TaskExample(
            task=self.task,
            prompt=self.prompt_template.format(prompt=prompt),
            response=response,
            answer=self._answer(row, response, index),
            index=index,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.paths}, format={self.format!r}, n={len(self)})"


class GSM8KSource(HFFileSource):
    """GSM8K-format jsonl/parquet: `question` -> prompt, the full worked `answer` -> response, and the number
    after `####` -> the reward target (`task='gsm8k'`, scored by `rewards.gsm8k_reward`)."""

    def __init__(
        self,
        paths: Sequence[str] | str,
        *,
        question_field: str = "question",
        answer_field: str = "answer",
        prompt_template: str = "{prompt}",
        cache_dir: str | None = None,
    ):
        super().__init__(
            paths,
            prompt_field=question_field,
            response_field=answer_field,
            prompt_template=prompt_template,
            task="gsm8k",
            cache_dir=cache_dir,
        )

    def _answer(self, row: Mapping[str, Any], response: str, index: int) -> str:
        final = extract_gsm8k_answer(response)
        if final is None:
            raise ValueError(f"GSM8K example {index} of {self.paths} has no '####' final answer")
        return final


class TFDSSource:
    """A TFDS dataset through `tfds.data_source` (random access over ArrayRecord files).

    Needs the optional extra: `pip install 'dgemma[tfds]'`. Text features may be bytes; they are decoded as UTF-8.
    """

    def __init__(
        self,
        name: str,
        *,
        split: str = "train",
        data_dir: str | None = None,
        prompt_field: str = "prompt",
        response_field: str = "response",
        answer_field: str | None = None,
        prompt_template: str = "{prompt}",
        task: str = "text",
    ):
        try:
            import tensorflow_datasets as tfds  # lazy, optional
        except ImportError as e:
            raise ImportError(
                "TFDSSource needs the optional dependency tensorflow_datasets, which is not installed. "
                "Install the extra with `pip install 'dgemma[tfds]'`, or use a json/parquet/arrow source."
            ) from e
        self.name, self.split = name, split
        self._ds = tfds.data_source(name, split=split, data_dir=data_dir)
        self.prompt_field, self.response_field, self.answer_field = prompt_field, response_field, answer_field
        self.prompt_template = prompt_template
        self.task = task

    def __len__(self) -> int:
        return len(self._ds)

    def __getitem__(self, index: int) -> TaskExample:
        index = int(index)
        row = self._ds[index]
        prompt = _as_text(row[self.prompt_field], self.prompt_field, index)
        response = _as_text(row[self.response_field], self.response_field, index)
        answer = response if self.answer_field is None else _as_text(row[self.answer_field], self.answer_field, index)
        return TaskExample(
            task=self.task, prompt=self.prompt_template.format(prompt=prompt), response=response, answer=answer,
            index=index,
        )


class _TextColumns(TypedDict):
    """The columns of a file / TFDS source (`HFFileSource`, `TFDSSource`)."""

    prompt_field: str
    response_field: str
    answer_field: str | None
    prompt_template: str


def build_source(cfg: DataConfig, tokenizer: Any = None) -> Source:
    """The source a `DataConfig` describes; `source: messages` renders with `tokenizer` (None: built from
    `cfg.tokenizer`)."""
    if cfg.source == "synthetic":
        if len(cfg.tasks) == 1:
            return TaskSource(cfg.tasks[0], seed=cfg.seed, num_examples=cfg.num_examples)
        return MixtureSource(cfg.tasks, seed=cfg.seed, num_examples=cfg.num_examples)
    text = _TextColumns(prompt_field=cfg.prompt_field, response_field=cfg.response_field,
                        answer_field=cfg.answer_field, prompt_template=cfg.prompt_template)
    if cfg.source in _HF_FORMATS:
        return HFFileSource(cfg.paths, format=cfg.source, cache_dir=cfg.cache_dir, **text)
    if cfg.source == "gsm8k":
        return GSM8KSource(cfg.paths, prompt_template=cfg.prompt_template, cache_dir=cfg.cache_dir)
    if cfg.source == "messages":
        from dgemma.data.messages import MessagesSource
        from dgemma.data.tokenizer import build_tokenizer

        tokenizer = tokenizer if tokenizer is not None else build_tokenizer(cfg.tokenizer)
        return MessagesSource(cfg.paths, tokenizer=tokenizer, config=cfg.messages, layout=cfg.layout)
    if cfg.source == "tfds":
        assert cfg.tfds_name is not None  # DataConfig refuses source='tfds' without a dataset name
        return TFDSSource(cfg.tfds_name, split=cfg.split, data_dir=cfg.data_dir, **text)
    raise ValueError(f"DataConfig.source: unknown {cfg.source!r}")

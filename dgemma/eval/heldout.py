"""Held-out evaluation prompts that are provably disjoint from the training stream.

Synthetic tasks draw prompts from small spaces (a 4-digit COPY has 10^4 prompts), so "another data seed" alone does
not make a held-out set: the same prompt can occur in training at another index. `build_held_out` draws candidates
from the held-out seed, drops every prompt that any of the given training streams read in its first `steps` steps
(the exact indices the training pipeline visits: the same grain shuffle over the same source length) and every
duplicate, and keeps `n_per_task` prompts per task. The overlap with the training stream is then recounted from
scratch (`HeldOutSet.overlap`, which must be 0) so a caller can print it.

Data read from files (`data.source: messages`, json, parquet, gsm8k ...) has no prompt space to draw from: its held-out
rows are a file of their own (GSM8K as chat: `data/chat/gsm8k_chat_heldout.jsonl`). `held_out_file` reads that file
as the config reads its training files (the same source kind, tokenizer, chat template and canvas) and refuses it
when any of its prompts is one the training streams read (`TrainingOverlapError`): a file is a fixed set, so its
overlapping rows are refused rather than dropped. `held_out_files` does the same for a run's periodic evaluation
(`data.eval_paths`), against every row of the training files (`data.paths`), comparing the prompts as the model reads
them: a hash of each row's rendered prompt ids (for chat rows the context, the chat template's rendering of the
conversation before the assistant turn). `periodic_held_out` picks the drawn or the file set for a run's config.

A `HeldOutSet` quacks like a `DataPipeline` for evaluation: `batch(s)` (the pipeline's encoding, `index` = position in
`source`, `example_mask` False on the padding rows of the last batch), `source[i]`, `tokenizer`, `num_batches`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from dgemma.data.config import DataConfig
    from dgemma.data.pipeline import DataPipeline

HELD_OUT_SEED_OFFSET = 10_007


def held_out_pipeline(data_cfg, batch_size: int, *, tokenizer=None):
    """The data config's stream with another seed, unshuffled, single process, synchronous (`tokenizer`: an already
    built one, else `data_cfg.tokenizer`'s). Not deduplicated against training: prefer
    `dgemma.eval.heldout.build_held_out` (drawn prompts) or `held_out_files` (files) for reported numbers."""
    from dgemma.data.pipeline import DataPipeline

    data = dataclasses.replace(data_cfg, seed=data_cfg.seed + HELD_OUT_SEED_OFFSET, batch_size=batch_size,
                               shuffle=False, num_threads=0)
    return DataPipeline(data, tokenizer=tokenizer, process_index=0, process_count=1)


def stream_indices(data_cfg, steps: int) -> np.ndarray:
    """Source indices read by the first `steps` steps of the training pipeline for `data_cfg` (all processes:
    `data.batch_size` is the global batch)."""
    import grain

    from dgemma.data.sources import build_source

    n = len(build_source(data_cfg))
    ds = grain.MapDataset.range(n)
    if data_cfg.shuffle:
        ds = ds.shuffle(seed=data_cfg.seed)
    ds = ds.repeat(data_cfg.num_epochs)
    total = min(int(steps) * data_cfg.batch_size, len(ds))
    return np.fromiter((ds[i] for i in range(total)), dtype=np.int64, count=total)


def training_prompts(streams: Sequence[tuple[DataConfig, int]]) -> set[str]:
    """Prompt texts read by each (data_cfg, steps) training stream (their union)."""
    from dgemma.data.sources import build_source

    longest: dict[str, tuple[DataConfig, int]] = {}  # identical data configs (stage 1 and its AR control): read once
    for data_cfg, steps in streams:
        key = repr(data_cfg)
        if key not in longest or int(steps) > longest[key][1]:
            longest[key] = (data_cfg, int(steps))
    seen: set[str] = set()
    for data_cfg, steps in longest.values():
        if steps <= 0:  # reads nothing: its data (files that may not be at hand) is not opened
            continue
        source = build_source(data_cfg)
        seen.update(source[int(i)].prompt for i in np.unique(stream_indices(data_cfg, steps)))
    return seen


@dataclasses.dataclass
class HeldOutSet:
    """Deduplicated held-out examples (index = position) with the pipeline's encoding."""

    examples: list
    pipeline: DataPipeline  # of the held-out data config (encode + tokenizer)
    batch_size: int
    overlap: int  # held-out prompts that occur in the training streams (recounted; 0 by construction)
    dropped_overlap: int  # candidates dropped because the training stream read them
    dropped_duplicate: int  # candidates dropped as repeats of an earlier held-out prompt

    @property
    def source(self) -> list:
        return self.examples

    @property
    def tokenizer(self):
        return self.pipeline.tokenizer

    @property
    def num_batches(self) -> int:
        return -(-len(self.examples) // self.batch_size)

    def per_task(self) -> dict[str, int]:
        return dict(sorted(Counter(e.task for e in self.examples).items()))

    def batch(self, step: int) -> dict:
        if not 0 <= step < self.num_batches:
            raise IndexError(f"held-out batch {step} out of range [0, {self.num_batches})")
        rows = list(range(step * self.batch_size, min((step + 1) * self.batch_size, len(self.examples))))
        encoded = [self.pipeline.encode(self.examples[i]) for i in rows]
        while len(encoded) < self.batch_size:  # fixed shapes: repeat row 0, masked out of every metric
            encoded.append({**encoded[0], "example_mask": np.array(False)})
        out = {k: np.stack([e[k] for e in encoded]) for k in encoded[0]}
        out["index"] = np.asarray(rows + [rows[0]] * (self.batch_size - len(rows)), np.int32)
        return out

    def summary(self) -> str:
        return (f"{len(self.examples)} held-out prompts {self.per_task()}; dropped {self.dropped_overlap} seen in "
                f"training and {self.dropped_duplicate} duplicates; overlap with the training stream: {self.overlap}")


def build_held_out(data_cfg, *, n_per_task: int, batch_size: int, train_streams: Sequence[tuple[DataConfig, int]],
                   seed_offset: int = HELD_OUT_SEED_OFFSET, max_candidates: int | None = None) -> HeldOutSet:
    """`n_per_task` distinct prompts per task of `data_cfg`, none of which any (data_cfg, steps) stream in
    `train_streams` reads. Candidates come from the same task mix with seed `data_cfg.seed + seed_offset`.

    Raises ValueError naming the task when its prompt space is too small to supply `n_per_task` unseen prompts within
    `max_candidates` draws (default 50 x the requested total).
    """
    from dgemma.data.pipeline import DataPipeline

    if n_per_task < 1:
        raise ValueError(f"build_held_out: n_per_task must be >= 1, got {n_per_task}")
    held_cfg = dataclasses.replace(data_cfg, seed=data_cfg.seed + seed_offset, batch_size=batch_size, shuffle=False,
                                   num_threads=0)
    pipe = DataPipeline(held_cfg, process_index=0, process_count=1)
    seen = training_prompts(train_streams)
    tasks = sorted({t.name for t in data_cfg.tasks}) if data_cfg.source == "synthetic" else None
    if tasks is None:
        raise ValueError(f"build_held_out: needs a synthetic task mix, got data.source={data_cfg.source!r}")
    want = n_per_task * len(tasks)
    max_candidates = max_candidates or 50 * want
    kept: dict[str, list] = {t: [] for t in tasks}
    prompts: set[str] = set()
    dropped_overlap = dropped_duplicate = 0
    for i in range(min(max_candidates, len(pipe.source))):
        ex = pipe.source[i]
        if len(kept[ex.task]) >= n_per_task:
            continue
        if ex.prompt in seen:
            dropped_overlap += 1
        elif ex.prompt in prompts:
            dropped_duplicate += 1
        else:
            prompts.add(ex.prompt)
            kept[ex.task].append(ex)
            if sum(map(len, kept.values())) == want:
                break
    short = {t: len(v) for t, v in kept.items() if len(v) < n_per_task}
    if short:
        raise ValueError(f"build_held_out: task(s) {short} have fewer than n_per_task={n_per_task} unseen distinct "
                         f"prompts within {max_candidates} candidates (prompt space too small for this training "
                         "stream); lower n_per_task or widen the task lengths")
    examples = [dataclasses.replace(ex, index=j) for j, ex in enumerate(e for t in tasks for e in kept[t])]
    overlap = sum(ex.prompt in seen for ex in examples)
    return HeldOutSet(examples, pipe, batch_size, overlap, dropped_overlap, dropped_duplicate)


class TrainingOverlapError(ValueError):
    """Held-out rows whose prompts a training stream reads."""


def held_out_file(data_cfg, path: str, *, batch_size: int, train_streams: Sequence[tuple[DataConfig, int]],
                  rows: int | None = None, tokenizer=None, field: str = "--data") -> HeldOutSet:
    """The examples of the local file `path` read as `data_cfg` reads its training files, in file order (the first
    `rows` of them when given), with the pipeline's encoding.

    Raises:
      ValueError: `data_cfg` does not read files, or the file is unreadable / has bad rows (named by the source).
      TrainingOverlapError: a prompt of the file is one that a (data_cfg, steps) stream of `train_streams` reads.
    """
    from dgemma.data.config import FILE_SOURCE_KINDS
    from dgemma.data.pipeline import DataPipeline

    if data_cfg.source not in FILE_SOURCE_KINDS:
        raise ValueError(f"{field} {path}: the config's data.source={data_cfg.source!r} does not read files (file "
                         f"sources: {', '.join(FILE_SOURCE_KINDS)})")
    held_cfg = dataclasses.replace(data_cfg, paths=(str(path),), seed=data_cfg.seed + HELD_OUT_SEED_OFFSET,
                                   batch_size=batch_size, shuffle=False, num_threads=0)
    pipe = DataPipeline(held_cfg, tokenizer=tokenizer, process_index=0, process_count=1)
    n = len(pipe.source) if rows is None else min(int(rows), len(pipe.source))
    examples = [pipe.source[i] for i in range(n)]  # index = position, as HeldOutSet.batch and the pipeline read it
    seen = training_prompts(train_streams)
    overlap = [i for i, ex in enumerate(examples) if ex.prompt in seen]
    if overlap:
        where = getattr(pipe.source, "location", lambda i: f"example {i}")(overlap[0])
        raise TrainingOverlapError(f"{field} {path}: {len(overlap)} of its {n} prompts occur in the training stream "
                                   f"(first: {where}); held-out rows must not have been trained on")
    return HeldOutSet(examples, pipe, batch_size, overlap=0, dropped_overlap=0, dropped_duplicate=0)


def held_out_rows(data_cfg, *, rows: int, batch_size: int, train_streams: Sequence[tuple[DataConfig, int]],
                  field: str = "trainer.eval_every") -> HeldOutSet:
    """At least `rows` held-out prompts, ceil(rows / tasks) per task of `data_cfg` (`build_held_out`), refusing a
    non-synthetic source with a one-line error naming `field` (the setting that asked for an evaluation)."""
    if data_cfg.source != "synthetic":
        raise ValueError(f"{field}: held-out prompts disjoint from training are drawn from a synthetic task mix, but "
                         f"data.source={data_cfg.source!r}; evaluate such data with your own held-out split")
    n_tasks = len({t.name for t in data_cfg.tasks})
    held = build_held_out(data_cfg, n_per_task=math.ceil(rows / n_tasks), batch_size=batch_size,
                          train_streams=train_streams)
    if held.overlap:  # cannot happen by construction; a reported number must never rest on training prompts
        raise ValueError(f"{field}: {held.overlap} held-out prompts occur in the training stream")
    return held


def prompt_digests(pipeline) -> list[bytes]:
    """A hash of each source row's prompt ids as the pipeline encodes them (after the prompt template or the chat
    template, before BOS and canvasing): rows with equal digests give the model the same prompt."""
    rows = pipeline.encoded_rows
    if rows is not None:
        ids = (rows.prompt(i) for i in range(len(rows)))
    else:  # a file too large to keep its ids: tokenized again
        ids = (pipeline.tokenizer.encode(pipeline.source[i].prompt) for i in range(len(pipeline.source)))
    return [hashlib.blake2b(np.asarray(x, np.int32).tobytes(), digest_size=16).digest() for x in ids]


def row_locator(source):
    """`index -> "file:line"` (or `file: record N`) of a file source's examples; `example N` where unknown."""
    where = getattr(source, "location", None)  # MessagesSource: the row of each assistant turn
    if where is not None:
        return where
    paths, fmt = getattr(source, "paths", None), getattr(source, "format", None)
    if paths and fmt:
        from dgemma.data.validate import row_locations

        return row_locations(paths, fmt, len(source))
    return lambda i: f"example {i}"


def _check_readable(paths: Sequence[str], field: str) -> None:
    if not paths:
        raise ValueError(f"{field}: no files given")
    for p in paths:
        if not os.path.exists(p):
            raise ValueError(f"{field}: {p}: no such file")
        if not os.path.isfile(p):
            raise ValueError(f"{field}: {p}: not a file")
        if not os.access(p, os.R_OK):
            raise ValueError(f"{field}: {p}: not readable")
        if os.path.getsize(p) == 0:
            raise ValueError(f"{field}: {p}: the file is empty")


def held_out_files(data_cfg, paths: Sequence[str], *, batch_size: int, rows: int | None = None, train=None,
                   field: str = "data.eval_paths") -> HeldOutSet:
    """The examples of the local files `paths` read as `data_cfg` reads its training files (same source kind,
    columns, tokenizer, chat template and canvas layout), the first `rows` of them in file order.

    `train`: the run's training `DataPipeline` (its tokenizer and kept prompt ids are reused; default: built from
    `data_cfg`). Every held-out prompt is compared with every row of the training files (`prompt_digests`).

    Raises:
      ValueError: one line naming the file: missing, not a file, unreadable, empty, or with a bad row.
      TrainingOverlapError: one line naming the first held-out row whose prompt a training row has, and that row.
    """
    from dgemma.data.config import FILE_SOURCE_KINDS
    from dgemma.data.pipeline import DataPipeline

    if data_cfg.source not in FILE_SOURCE_KINDS:
        raise ValueError(f"{field}: data.source={data_cfg.source!r} does not read files (file sources: "
                         f"{', '.join(FILE_SOURCE_KINDS)})")
    paths = [str(p) for p in paths]
    _check_readable(paths, field)
    if train is None:
        train = DataPipeline(dataclasses.replace(data_cfg, num_threads=0), process_index=0, process_count=1)
    try:  # the training files' reading (source kind, columns, template, layout) of the held-out files
        pipe = held_out_pipeline(dataclasses.replace(data_cfg, paths=tuple(paths), eval_paths=()), batch_size,
                                 tokenizer=train.tokenizer)
    except (ValueError, KeyError, TypeError, OSError) as e:  # a bad row, a missing column, a file it cannot parse
        text = " ".join(str(e.args[0] if isinstance(e, KeyError) and e.args else e).split())
        raise ValueError(f"{field}: {text}" if any(p in text for p in paths) else f"{field} {paths}: {text}") from None
    seen: dict[bytes, int] = {}
    for i, d in enumerate(prompt_digests(train)):
        seen.setdefault(d, i)
    held = prompt_digests(pipe)
    hits = [i for i, d in enumerate(held) if d in seen]
    if hits:
        first = hits[0]
        raise TrainingOverlapError(
            f"{field}: {row_locator(pipe.source)(first)} has the prompt of the training row "
            f"{row_locator(train.source)(seen[held[first]])} ({len(hits)} of the {len(held)} held-out prompts occur in "
            "data.paths); held-out rows must not have been trained on")
    n = len(pipe.source) if rows is None else min(int(rows), len(pipe.source))
    examples = [pipe.source[i] for i in range(n)]  # index = position, as HeldOutSet.batch and the pipeline read it
    overlap = sum(held[i] in seen for i in range(n))  # recounted for the log: 0
    return HeldOutSet(examples, pipe, batch_size, overlap=overlap, dropped_overlap=0, dropped_duplicate=0)


def periodic_held_out(data_cfg, *, rows: int, batch_size: int, train_steps: int, train=None,
                      field: str = "trainer.eval_every") -> HeldOutSet:
    """The held-out set of a run's periodic evaluation (`field` names the setting that asked for it): `rows` prompts
    drawn from a synthetic task mix disjoint from the training stream (`held_out_rows`), or the first `rows`
    examples of `data.eval_paths` for a file source, disjoint from every row of `data.paths` (`held_out_files`).
    Other sources, and a file source without `data.eval_paths`, are refused in one line."""
    from dgemma.data.config import FILE_SOURCE_KINDS

    if data_cfg.source == "synthetic":
        return held_out_rows(data_cfg, rows=rows, batch_size=batch_size, train_streams=[(data_cfg, train_steps)],
                             field=field)
    if data_cfg.source not in FILE_SOURCE_KINDS:
        raise ValueError(f"{field}: data.source={data_cfg.source!r} has no held-out split dgemma can check against "
                         "training; turn the evaluation off (0) and evaluate with `dgemma eval`")
    if not data_cfg.eval_paths:
        raise ValueError(f"{field}: data.source={data_cfg.source!r} evaluates on held-out files: set data.eval_paths: "
                         "[FILE, ...] (the format of data.paths, no prompt in common with them), or turn the evaluation off (0)")
    return held_out_files(data_cfg, data_cfg.eval_paths, batch_size=batch_size, rows=rows, train=train)

"""The grain input pipeline: deterministic, random-access, and resumable from the step alone.

    source --shuffle(seed)--> --repeat(epochs)--> --[process_index::process_count]--> --tokenize+to_layout-->
    --batch(batch_size, drop_remainder)--> --to_iter_dataset(read options)--> iterator

Why this order (docs/architecture.md §4):
* Every stage is a `grain.MapDataset`, i.e. random access, so batch `s` of process `p` is a pure function of
  (config, s, p, process_count) — `pipeline.batch(s)` computes it directly and `iterator_from_step(s)` starts
  there in O(1), without replaying earlier steps (the anti-lesson of skipping seen examples on resume).
* The shuffle is a global index permutation (no buffer) that grain reseeds per epoch, because repeat comes after
  shuffle and passes the epoch through the index.
* The host slice comes after repeat and before batching, so step `s` consumes exactly the global stream positions
  [s*G, (s+1)*G) with G = batch_size (the global batch), split across processes (G / process_count rows each).
  Resuming with another process count but the same global batch therefore reads the same examples per step.
* Tokenization runs after slicing so each host only tokenizes its own examples, in grain's prefetch threads.

Resume: `DataIterator.get_state()` is a JSON dict with the step, grain's own iterator state and a fingerprint of
everything that defines the stream. `set_state` restores grain's state and checks the fingerprint and that the
step and grain's index agree, so a checkpoint can never silently resume a different stream.

Each batch is the dict of `dgemma.data.layout` stacked on a leading [batch_size / process_count] axis (this
process's rows of the global batch), plus `index` [rows]
int32: the source row of each example (look up `pipeline.source[index]` for its reward target).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from dgemma.data.layout import to_layout
from dgemma.data.config import DataConfig
from dgemma.data.rewards import TaskExample
from dgemma.data.sources import Source, build_source
from dgemma.data.tokenizer import Tokenizer, build_tokenizer
from dgemma.data.validate import encode_file_rows

Batch = dict[str, np.ndarray]
STATE_VERSION = 1
# Fields that change neither which examples a step sees nor their encoding (eval_paths: the held-out files).
_NON_STREAM_FIELDS = ("batch_size", "num_threads", "prefetch_buffer_size", "cache_dir", "data_dir", "eval_paths")


def _default_process_layout() -> tuple[int, int]:
    import jax  # lazy: only needed when the caller does not pass the layout

    return jax.process_index(), jax.process_count()


class DataPipeline:
    """Builds the per-process batch stream described by a `DataConfig`.

    Args:
      config: the data config.
      tokenizer: overrides `config.tokenizer`.
      source: overrides the source built from `config` (any random-access `Source`).
      process_index, process_count: the host layout; default `jax.process_index()/process_count()`.
    """

    def __init__(
        self,
        config: DataConfig,
        *,
        tokenizer: Tokenizer | None = None,
        source: Source | None = None,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        import grain  # lazy

        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else build_tokenizer(config.tokenizer)
        self.source = source if source is not None else build_source(config, self.tokenizer)
        if process_index is None or process_count is None:
            dpi, dpc = _default_process_layout()
            process_index = dpi if process_index is None else process_index
            process_count = dpc if process_count is None else process_count
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index={process_index} must be in [0, process_count={process_count})")
        self.process_index, self.process_count = int(process_index), int(process_count)
        if len(self.source) == 0:
            raise ValueError(f"data source {self.source!r} is empty")
        # every row of a local file, now: a bad row would otherwise fail only when a batch reaches it; its token ids
        # are kept, so `encode` does not tokenize a file row twice
        self._encoded_rows = encode_file_rows(self.source, self.tokenizer, config)

        ds = grain.MapDataset.source(self.source)
        if config.shuffle:
            ds = ds.shuffle(seed=config.seed)
        ds = ds.repeat(config.num_epochs)
        ds = ds[self.process_index :: self.process_count]
        self.examples = ds.map(self.encode)  # per-example, this process's slice
        if config.batch_size % self.process_count:  # one meaning: data.batch_size is the global batch
            raise ValueError(f"data.batch_size={config.batch_size} (the global batch) is not divisible by the "
                             f"{self.process_count} processes; use a multiple of {self.process_count}")
        self.rows_per_process = config.batch_size // self.process_count
        self.batches = self.examples.batch(self.rows_per_process, drop_remainder=True)
        self._read_options = grain.ReadOptions(
            num_threads=config.num_threads, prefetch_buffer_size=config.prefetch_buffer_size
        )

    @property
    def encoded_rows(self):
        """The token ids of every row of a file source (`dgemma.data.encoded.EncodedRows`; None: a synthetic or TFDS
        source, or a file too large to keep them)."""
        return self._encoded_rows

    @property
    def global_batch_size(self) -> int:
        return self.config.batch_size

    def __len__(self) -> int:
        """Number of batches this process yields (huge when repeating forever)."""
        return len(self.batches)

    def encode(self, example: TaskExample) -> Batch:
        """Tokenizes one example and lays it out (BOS on the prompt if `add_bos`; EOS appended by `to_layout`)."""
        tok, cfg, rows = self.tokenizer, self.config, self._encoded_rows
        response_ids: Sequence[int] | np.ndarray  # the encoded rows' slice or the tokenizer's list
        if rows is not None and 0 <= example.index < len(rows):
            prompt, response_ids = rows.prompt(example.index).tolist(), rows.response(example.index)
        else:
            prompt, response_ids = tok.encode(example.prompt), tok.encode(example.response)
        prompt_ids = ([tok.bos_id] if cfg.add_bos else []) + prompt
        out = to_layout(
            prompt_ids,
            response_ids,
            cfg.layout,
            pad_id=tok.pad_id,
            eos_id=tok.eos_id,
            bos_id=tok.bos_id if cfg.add_bos else None,
            index=example.index,
        )
        top = int(out["tokens"].max())
        if top >= tok.vocab_size:
            raise ValueError(f"example {example.index}: token id {top} >= tokenizer vocab_size {tok.vocab_size}")
        out["index"] = np.array(example.index, dtype=np.int32)
        return out

    def batch(self, step: int) -> Batch:
        """The batch this process reads at `step`, computed directly (random access)."""
        if not 0 <= step < len(self.batches):
            raise IndexError(f"step {step} out of range [0, {len(self.batches)})")
        return self.batches[step]

    def fingerprint(self) -> str:
        """Hash of everything that defines the global stream (not the process layout or per-process batch)."""
        cfg = dataclasses.asdict(self.config)
        for key in _NON_STREAM_FIELDS:
            cfg.pop(key, None)
        # hashed under the section's name before the glossary rename (data.canvas -> data.layout): the data-iterator
        # states of checkpoints written before it still match the same stream
        cfg["canvas"] = cfg.pop("layout")
        # Basenames only: moving the data or tokenizer directory must not invalidate a checkpoint.
        cfg["paths"] = [os.path.basename(p) for p in cfg["paths"]]
        if cfg["tokenizer"]["path"]:
            cfg["tokenizer"]["path"] = os.path.basename(os.path.normpath(cfg["tokenizer"]["path"]))
        desc = {
            "config": cfg,
            "global_batch_size": self.global_batch_size,
            "source": [type(self.source).__name__, len(self.source)],
            "tokenizer": [type(self.tokenizer).__name__, self.tokenizer.vocab_size],
        }
        blob = json.dumps(desc, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def iterator(self, step: int = 0) -> DataIterator:
        """An iterator whose first batch is `batch(step)`."""
        return DataIterator(self, step)

    def iterator_from_step(self, step: int) -> DataIterator:
        """Alias of `iterator(step)`: resume as a pure function of the step (no replay of earlier steps)."""
        return DataIterator(self, step)

    def __iter__(self) -> DataIterator:
        return DataIterator(self, 0)


class DataIterator:
    """Python iterator over a pipeline's batches with JSON-serializable, checked state."""

    def __init__(self, pipeline: DataPipeline, step: int = 0):
        self._pipeline = pipeline
        self._it = iter(pipeline.batches.to_iter_dataset(pipeline._read_options))
        if step:
            self._set_step(step)

    def _set_step(self, step: int) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= len(self._pipeline):
            raise ValueError(f"step must be an int in [0, {len(self._pipeline)}], got {step!r}")
        self._it.set_state({"next_index": step})

    def __iter__(self) -> DataIterator:
        return self

    def __next__(self) -> Batch:
        return next(self._it)

    @property
    def step(self) -> int:
        """Index of the next batch this iterator returns."""
        return int(self._it.get_state()["next_index"])

    def get_state(self) -> dict[str, Any]:
        grain_state = self._it.get_state()
        return {
            "version": STATE_VERSION,
            "step": int(grain_state["next_index"]),
            "grain": json.loads(json.dumps(grain_state)),
            "fingerprint": self._pipeline.fingerprint(),
            "global_batch_size": self._pipeline.global_batch_size,
        }

    def set_state(self, state: dict[str, Any], *, check_fingerprint: bool = True) -> None:
        """Restores a `get_state()` dict; raises ValueError if it belongs to a different stream."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data iterator state version {state.get('version')!r} != {STATE_VERSION}")
        fp = self._pipeline.fingerprint()
        if check_fingerprint and state.get("fingerprint") != fp:
            raise ValueError(
                f"data iterator state fingerprint {state.get('fingerprint')!r} != this pipeline's {fp!r}: the data "
                f"config, source or global batch size changed (saved global batch {state.get('global_batch_size')}, "
                f"now {self._pipeline.global_batch_size}); pass check_fingerprint=False to override"
            )
        step = state["step"]
        grain_state = state.get("grain")
        if grain_state is not None and grain_state.get("next_index") != step:
            raise ValueError(f"inconsistent data state: step {step} but grain next_index {grain_state['next_index']}")
        self._set_step(int(step))
        if grain_state is not None:
            self._it.set_state(dict(grain_state))

    def close(self) -> None:
        close = getattr(self._it, "close", None)
        if close is not None:
            close()


def to_global_batch(batch: Batch, sharding: Any) -> dict[str, Any]:
    """Assembles process-local batches into global jax Arrays (every leaf sharded on its leading batch axis)."""
    import jax  # lazy

    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()}

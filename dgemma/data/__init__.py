"""dgemma data: verifiable tasks and file sources -> tokens -> the fixed-shape training layout -> a resumable grain
stream.

Attributes are imported lazily, so `import dgemma.data` pulls in neither grain, datasets nor transformers.

Modules:
  config     frozen `DataConfig`, `LayoutConfig`, `TaskConfig`, `TokenizerConfig` (validated)
  tokenizer  `ToyTokenizer` (hermetic, PAD/EOS/BOS = 0/1/2) and `HFTokenizer` (local `AutoTokenizer`)
  tasks      synthetic verifiable tasks (copy, sort, perm, pick, fill, agree, add, mul) and their weighted mixture
  rewards    `TaskExample` and binary rewards (exact match, multiset, GSM8K final answer)
  sources    local json/parquet/arrow via HF datasets, GSM8K adapter, TFDS (optional extra)
  validate   whole-file validation of a local data source before anything is written
  chat       conversations -> (context, target) ids through the tokenizer's chat template
  messages   `MessagesSource`: chat rows (jsonl/parquet/arrow/`datasets`), one example per assistant turn
  encoded    `EncodedRows`: prompt / response ids and the reference answers of a source, encoded once
  gsm8k_chat  GSM8K as chat rows and its fixed train / held-out split
  layout     prompt/response -> the block-diffusion example contract, the training layout (see its docstring)
  pipeline   grain MapDataset pipeline, `DataIterator` with JSON state, `iterator_from_step`
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dgemma._lazy import lazy_exports

_EXPORTS = {
    "config": ("LayoutConfig", "DataConfig", "MessagesConfig", "TaskConfig", "TokenizerConfig"),
    "tokenizer": ("BOS_ID", "EOS_ID", "PAD_ID", "HFTokenizer", "Tokenizer", "ToyTokenizer", "build_tokenizer"),
    "tasks": ("MixtureSource", "SyntheticTask", "TaskSource"),
    "rewards": (
        "TaskExample",
        "cut_at_eos",
        "exact_match_reward",
        "extract_gsm8k_answer",
        "gsm8k_reward",
        "multiset_reward",
        "normalize_number",
        "reward",
    ),
    "sources": ("GSM8KSource", "HFFileSource", "TFDSSource", "build_source"),
    "messages": ("MessagesSource",),
    "chat": ("BadRow", "chat_turns", "check_conversation", "check_messages", "conversation_prompt_ids",
             "read_conversation"),
    "layout": (
        "LayoutOverflowError",
        "EXAMPLE_KEYS",
        "PAD_BLOCK_ID",
        "PROMPT_BLOCK_ID",
        "to_layout",
        "empty_example",
        "example_spec",
        "response_before_eos",
    ),
    "pipeline": ("DataIterator", "DataPipeline", "to_global_batch"),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # the type checker sees the lazily exported names' own types
    from dgemma.data.config import LayoutConfig, DataConfig, TaskConfig, TokenizerConfig
    from dgemma.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, HFTokenizer, Tokenizer, ToyTokenizer, build_tokenizer
    from dgemma.data.tasks import MixtureSource, SyntheticTask, TaskSource
    from dgemma.data.rewards import (
        TaskExample, cut_at_eos, exact_match_reward, extract_gsm8k_answer, gsm8k_reward, multiset_reward,
        normalize_number, reward,
    )
    from dgemma.data.sources import GSM8KSource, HFFileSource, TFDSSource, build_source
    from dgemma.data.layout import (
        LayoutOverflowError, EXAMPLE_KEYS, PAD_BLOCK_ID, PROMPT_BLOCK_ID, to_layout, empty_example, example_spec,
        response_before_eos,
    )
    from dgemma.data.pipeline import DataIterator, DataPipeline, to_global_batch

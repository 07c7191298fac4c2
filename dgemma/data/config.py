"""Frozen, validated configuration for the data package.

Every config is a `@dataclasses.dataclass(frozen=True, kw_only=True)` so that the YAML loader can instantiate it
field by field and so that a config can be hashed into the data-iterator fingerprint. `__post_init__` validates
and raises `ValueError("<Class>.<field>: ...")` naming the offending field, and normalises YAML-friendly inputs
(lists -> tuples, mappings -> nested dataclasses) so that configs built from YAML and from Python compare equal.

Annotations here are real types (no `from __future__ import annotations`) so `dataclasses.fields(...).type` is
usable by a loader without `get_type_hints`.
"""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal

TASK_NAMES = ("copy", "sort", "add", "mul", "perm", "pick", "fill", "agree")
SOURCE_KINDS = ("synthetic", "json", "parquet", "arrow", "gsm8k", "tfds", "messages")
FILE_SOURCE_KINDS = ("json", "parquet", "arrow", "gsm8k", "messages")
TAIL_FILLS = ("eos", "pad")
PROMPT_TRUNCATIONS = ("left", "right", "error")
RESPONSE_OVERFLOWS = ("error", "drop")
TOKENIZER_KINDS = ("toy", "hf")
THINKING_MODES = ("keep", "drop")
BAD_ROW_POLICIES = ("error", "skip")
MESSAGES_TURNS = ("all", "last")
MESSAGES_REWARDS = ("text", "gsm8k")

# grain's index shuffle works on 32-bit indices and 32-bit seeds; source indices travel as int32.
_MAX_U32 = 2**32
_MAX_I32 = 2**31


def _f(default: Any, help: str) -> Any:  # noqa: A002
    """A dataclass field with a description (shown by `dgemma plan --schema`)."""
    return dataclasses.field(default=default, metadata={"help": help})


def _fail(cls: str, field: str, msg: str) -> None:
    raise ValueError(f"{cls}.{field}: {msg}")


def _check_choice(cls: str, field: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        _fail(cls, field, f"must be one of {tuple(choices)}, got {value!r}")


def _check_int(cls: str, field: str, value: Any, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(cls, field, f"must be an int, got {type(value).__name__} {value!r}")
    if value < lo or (hi is not None and value >= hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
        _fail(cls, field, f"must be {bound}, got {value}")


def _coerce(value: Any, cls: type) -> Any:
    """Turns a mapping (e.g. a YAML section) into `cls(**mapping)`; passes dataclass instances through."""
    if isinstance(value, Mapping):
        for old, new in getattr(cls, "__moved_keys__", {}).items():
            if old in value:
                raise ValueError(f"{cls.__name__}.{old}: replaced by {cls.__name__}.{new}")
        return cls(**value)
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayoutConfig:
    """Fixed layout of one example: a left-padded prompt of `prompt_len` and `n_blocks` blocks of
    `canvas_length` tokens. See `dgemma.data.layout` for the full contract."""

    __moved_keys__ = {"num_canvases": "n_blocks"}  # renamed keys: the loader names the new one

    prompt_len: int = _f(512, "prompt tokens per example (left-padded)")
    canvas_length: int | None = _f(None, "canvas (block) length L; None: in a run config, model.canvas_length "
                                   "(the model owns it; a different value is an error)")
    n_blocks: int = _f(4, "max response blocks per example (N_b; the response is n_blocks x canvas_length tokens)")
    tail_fill: Literal["eos", "pad"] = _f("eos", "fill of the EOS block after the EOS (supervised either way)")
    truncate_prompt: Literal["left", "right", "error"] = _f("left", "'left' drops the oldest tokens, keeps BOS")
    response_overflow: Literal["error", "drop"] = _f("error", "'drop' emits a zero-weight all-padding row")
    ar_on_prompt: bool = _f(False, "also put AR next-token loss on prompt tokens")
    ar_on_tail: bool = _f(False, "also put AR next-token loss on the post-EOS tail (off: AR stops at the EOS)")

    def __post_init__(self) -> None:
        c = "LayoutConfig"
        _check_int(c, "prompt_len", self.prompt_len, 1)
        if self.canvas_length is not None:
            _check_int(c, "canvas_length", self.canvas_length, 1)
        _check_int(c, "n_blocks", self.n_blocks, 1)
        _check_choice(c, "tail_fill", self.tail_fill, TAIL_FILLS)
        _check_choice(c, "truncate_prompt", self.truncate_prompt, PROMPT_TRUNCATIONS)
        _check_choice(c, "response_overflow", self.response_overflow, RESPONSE_OVERFLOWS)

    @property
    def response_len(self) -> int:
        """R = n_blocks * canvas_length."""
        if self.canvas_length is None:
            raise ValueError("LayoutConfig.canvas_length: unset; set it, or build the data config through a run "
                             "config (dgemma.config), which takes it from model.canvas_length")
        return self.n_blocks * self.canvas_length

    @property
    def seq_len(self) -> int:
        """P + R, the length of the clean stream."""
        return self.prompt_len + self.response_len


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """One synthetic verifiable task and its weight in the mixture.

    `min_len`/`max_len` bound the digit-string length of copy/sort/perm/pick/fill; `min_digits`/`max_digits` bound
    each operand of add/mul. `wildcard_rate` is the chance that a FILL prompt position is a free '?'.
    `lsb_first=True` writes operands and answers least-significant digit first, which makes carries flow left to
    right (the toy studies' order); `False` is the human (MSB-first) order.
    """

    name: Literal["copy", "sort", "add", "mul", "perm", "pick", "fill", "agree"]
    weight: float = _f(1.0, "mixture weight of this task")
    min_len: int = _f(4, "copy/sort/perm/pick/fill: min number of digits")
    max_len: int = _f(12, "copy/sort/perm/pick/fill: max number of digits")
    min_digits: int = _f(1, "add/mul: min digits per operand")
    max_digits: int = _f(4, "add/mul: max digits per operand")
    lsb_first: bool = _f(True, "add/mul: write numbers least-significant digit first")
    wildcard_rate: float = _f(0.5, "fill: probability that a prompt position is a wildcard '?' (any digit answers it)")
    word_len: int = _f(3, "agree: digits per space-separated word (every digit of a word shares one hidden choice)")

    def __post_init__(self) -> None:
        c = "TaskConfig"
        _check_choice(c, "name", self.name, TASK_NAMES)
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or not self.weight > 0:
            _fail(c, "weight", f"must be a positive number, got {self.weight!r}")
        _check_int(c, "min_len", self.min_len, 1)
        _check_int(c, "max_len", self.max_len, self.min_len)
        _check_int(c, "min_digits", self.min_digits, 1)
        _check_int(c, "max_digits", self.max_digits, self.min_digits, 65)  # long-carry toys use ~32
        _check_int(c, "word_len", self.word_len, 1)
        rate = self.wildcard_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
            _fail(c, "wildcard_rate", f"must be a probability in [0, 1], got {rate!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizerConfig:
    """`toy`: the hermetic `ToyTokenizer` (symbols + reserved ids); `hf`: `AutoTokenizer.from_pretrained(path)`
    from a local directory. Special-id overrides apply to `hf` only (the toy ids are fixed at 0/1/2)."""

    kind: Literal["toy", "hf"] = _f("toy", "toy (hermetic) or hf (AutoTokenizer from a local directory)")
    path: str | None = _f(None, "hf: local tokenizer directory, or dgemma:NAME for one shipped in the package "
                               "(dgemma:tiny_chat)")
    symbols: tuple[str, ...] | None = _f(None, "toy: None -> DEFAULT_SYMBOLS")
    num_reserved: int = _f(8, "toy: ids that data never produces (they occur only as diffusion noise)")
    pad_id: int | None = _f(None, "override the tokenizer's PAD id")
    eos_id: int | None = _f(None, "override the tokenizer's EOS id")
    bos_id: int | None = _f(None, "override the tokenizer's BOS id")
    extra_stop_ids: tuple[int, ...] = _f((), "hf: more ids that end a generation (Gemma: 106, 50)")
    chat: bool = _f(False, "hf: chat data (source: messages): EOS, what a response ends on and the sampler stops on, "
                           "is the end-of-turn token <turn|>; the tokenizer's own EOS stays a stop id")

    def __post_init__(self) -> None:
        c = "TokenizerConfig"
        _check_choice(c, "kind", self.kind, TOKENIZER_KINDS)
        if self.kind == "hf" and not self.path:
            _fail(c, "path", "kind='hf' needs a local tokenizer directory")
        if self.symbols is not None:
            object.__setattr__(self, "symbols", tuple(self.symbols))
        object.__setattr__(self, "extra_stop_ids", tuple(self.extra_stop_ids))
        _check_int(c, "num_reserved", self.num_reserved, 0)
        if self.chat and self.eos_id is not None:
            _fail(c, "eos_id", f"{self.eos_id!r}: with chat=True the EOS is the end-of-turn token <turn|>; drop one")
        if self.kind == "toy":  # the toy ids are fixed: an override would be silently ignored
            if self.chat:
                _fail(c, "chat", "applies to kind='hf' only (a chat template and Gemma 4's control tokens)")
            for name in ("pad_id", "eos_id", "bos_id", "extra_stop_ids"):
                if getattr(self, name) not in (None, ()):
                    _fail(c, name, f"{getattr(self, name)!r}: special-id overrides apply to kind='hf' only (the toy "
                                   f"tokenizer's ids are fixed: pad 0, eos 1, bos 2)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MessagesConfig:
    """How `source: messages` rows (`{"messages": [{"role", "content"[, "thinking"]}, ...]}`) become examples
    (dgemma.data.chat, dgemma.data.messages). They are rendered with the tokenizer's chat template; only assistant
    tokens are targets, each with the conversation before it as its context; nothing is truncated: a row that does
    not fit the training layout (`data.layout`) is a bad row."""

    field: str = _f("messages", "column holding the list of messages")
    thinking: Literal["keep", "drop"] = _f("keep", "keep or drop assistant thinking text (<|channel>thought...)")
    bad_rows: Literal["error", "skip"] = _f("error", "a malformed row (no messages, unknown role, non-text content, "
                                            "no assistant turn, a context or answer too long): refuse the file (error) "
                                            "or skip the row and report it (skip); either way naming file and row")
    turns: Literal["all", "last"] = _f("all", "all: every assistant turn is an example (training); last: only each "
                                       "row's last assistant turn (SD·RL prompts, evaluation: the reference answer)")
    reward: Literal["text", "gsm8k"] = _f("text", "how the reference answer (the assistant turn) is scored: exact "
                                          "text, or GSM8K's final number after '####'")

    def __post_init__(self) -> None:
        c = "MessagesConfig"
        if not isinstance(self.field, str) or not self.field:
            _fail(c, "field", f"must be a non-empty column name, got {self.field!r}")
        _check_choice(c, "thinking", self.thinking, THINKING_MODES)
        _check_choice(c, "bad_rows", self.bad_rows, BAD_ROW_POLICIES)
        _check_choice(c, "turns", self.turns, MESSAGES_TURNS)
        _check_choice(c, "reward", self.reward, MESSAGES_REWARDS)


def _default_tasks() -> tuple[TaskConfig, ...]:
    return (TaskConfig(name="copy"), TaskConfig(name="sort"), TaskConfig(name="add"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Everything that determines the batch stream, except the process layout.

    `batch_size` is the global batch (all processes together); each process reads `batch_size / process_count` rows
    of it. The step -> examples map depends
    only on the global batch, so resuming on a different host count with the same global batch is exact.
    """

    __moved_keys__ = {"canvas": "layout"}  # renamed section (docs/glossary.md): the loader names the new one

    source: Literal["synthetic", "json", "parquet", "arrow", "gsm8k", "tfds", "messages"] = _f(
        "synthetic", "data source kind (messages: chat rows, jsonl/parquet/arrow, see `messages`)")
    # synthetic
    tasks: tuple[TaskConfig, ...] = dataclasses.field(default_factory=_default_tasks,
                                                      metadata={"help": "synthetic task mixture"})
    num_examples: int = _f(1_000_000, "length of one synthetic 'epoch' (indices are cheap; this sets reshuffling)")
    # file sources (json/parquet/arrow/gsm8k) via HF datasets, offline
    paths: tuple[str, ...] = _f((), "local data files (json/parquet/arrow/gsm8k)")
    eval_paths: tuple[str, ...] = _f((), "held-out files for trainer.eval_every with a file source: the format and "
                                     "columns of `paths`, read as they are (chat template, canvas layout); none of "
                                     "their prompts may occur in `paths` (checked at start-up)")
    prompt_field: str = _f("prompt", "column holding the prompt")
    response_field: str = _f("response", "column holding the response")
    answer_field: str | None = _f(None, "reward target column; None -> the response")
    prompt_template: str = _f("{prompt}", "str.format template applied to the prompt text")
    cache_dir: str | None = _f(None, "HF datasets cache (None -> its default)")
    messages: MessagesConfig = dataclasses.field(default_factory=MessagesConfig,
                                                 metadata={"help": "source: messages (chat rows)"})
    # tfds (optional extra)
    tfds_name: str | None = _f(None, "TFDS dataset name (tfds extra)")
    split: str = _f("train", "dataset split")
    data_dir: str | None = _f(None, "TFDS data directory")
    # tokenization and layout
    tokenizer: TokenizerConfig = dataclasses.field(default_factory=TokenizerConfig, metadata={"help": "tokenizer"})
    layout: LayoutConfig = dataclasses.field(default_factory=LayoutConfig,
                                             metadata={"help": "training layout: [prompt P][blocks N x L]"})
    add_bos: bool = _f(True, "prepend BOS to the prompt")
    # order and batching
    seed: int = _f(0, "shuffle / synthetic-generation seed")
    shuffle: bool = _f(True, "global index shuffle")
    num_epochs: int | None = _f(None, "None -> repeat forever")
    batch_size: int = _f(8, "global batch: examples per optimizer step over all processes (each reads "
                            "batch_size / process_count rows)")
    num_threads: int = _f(4, "grain prefetch threads (0 -> synchronous)")
    prefetch_buffer_size: int = _f(16, "grain prefetch buffer")

    def __post_init__(self) -> None:
        c = "DataConfig"
        _check_choice(c, "source", self.source, SOURCE_KINDS)
        object.__setattr__(self, "tasks", tuple(_coerce(t, TaskConfig) for t in self.tasks))
        object.__setattr__(self, "paths", tuple(str(p) for p in self.paths))
        object.__setattr__(self, "eval_paths", tuple(str(p) for p in self.eval_paths))
        object.__setattr__(self, "tokenizer", _coerce(self.tokenizer, TokenizerConfig))
        object.__setattr__(self, "layout", _coerce(self.layout, LayoutConfig))
        object.__setattr__(self, "messages", _coerce(self.messages, MessagesConfig))
        for i, t in enumerate(self.tasks):
            if not isinstance(t, TaskConfig):
                _fail(c, "tasks", f"entry {i} must be a TaskConfig or mapping, got {type(t).__name__}")
        if self.source == "synthetic":
            if not self.tasks:
                _fail(c, "tasks", "source='synthetic' needs at least one task")
            names = [t.name for t in self.tasks]
            if len(set(names)) != len(names):
                _fail(c, "tasks", f"task names must be unique, got {names}")
            if self.tokenizer.kind == "toy":
                self._check_toy_symbols()
        if self.source in FILE_SOURCE_KINDS and not self.paths:
            _fail(c, "paths", f"source={self.source!r} needs at least one local file path")
        if self.eval_paths and self.source not in FILE_SOURCE_KINDS:  # (their overlap with `paths`: at start-up)
            why = "draws its held-out prompts from the task mix" if self.source == "synthetic" else "reads no files"
            _fail(c, "eval_paths", f"held-out files apply to the file sources {FILE_SOURCE_KINDS}; source="
                  f"{self.source!r} {why}")
        if self.source == "messages":
            if self.tokenizer.kind != "hf" or not self.tokenizer.chat:
                _fail(c, "tokenizer", "source='messages' renders with an HF tokenizer's chat template and ends each "
                      "answer on <turn|>: set tokenizer: {kind: hf, path: ..., chat: true}")
            if self.add_bos:
                _fail(c, "add_bos", "source='messages': the chat template writes BOS itself; set add_bos: false")
        elif self.tokenizer.chat:
            _fail(c, "tokenizer.chat", f"chat=True ends responses on <turn|>, which only source='messages' renders "
                  f"(source={self.source!r})")
        if self.source == "tfds" and not self.tfds_name:
            _fail(c, "tfds_name", "source='tfds' needs a dataset name")
        if "{prompt}" not in self.prompt_template:
            _fail(c, "prompt_template", f"must contain '{{prompt}}', got {self.prompt_template!r}")
        _check_int(c, "num_examples", self.num_examples, 1, _MAX_I32)
        _check_int(c, "seed", self.seed, 0, _MAX_U32)
        if self.num_epochs is not None:
            _check_int(c, "num_epochs", self.num_epochs, 1)
        _check_int(c, "batch_size", self.batch_size, 1)
        _check_int(c, "num_threads", self.num_threads, 0)
        _check_int(c, "prefetch_buffer_size", self.prefetch_buffer_size, 0)

    def _check_toy_symbols(self) -> None:
        """Every task's tag (and FILL's wildcard) must be a toy symbol: fail here, naming the setting, rather than at
        the first example inside the data pipeline."""
        from dgemma.data.tokenizer import DEFAULT_SYMBOLS, TASK_TAGS, WILDCARD

        symbols = set(self.tokenizer.symbols if self.tokenizer.symbols is not None else DEFAULT_SYMBOLS)
        for t in self.tasks:
            missing = [s for s in (TASK_TAGS[t.name], *([WILDCARD] if t.name == "fill" else [])) if s not in symbols]
            if missing:
                _fail("DataConfig", "tokenizer.symbols", f"task {t.name!r} needs the symbols {missing}, which the toy "
                      "vocabulary lacks; append them (dgemma.data.tokenizer.CHOICE_SYMBOLS for pick/fill, as in "
                      "experiments/sdrl_study/configs/choice.yaml)")

"""Tokenizers with one small interface: a hermetic toy tokenizer and a wrapper around a local HF tokenizer.

Both expose `vocab_size`, `pad_id`, `eos_id`, `bos_id`, `stop_ids`, `eos_token`, `encode(str) -> list[int]` and
`decode(list[int]) -> str`. `encode` never adds special tokens: the pipeline adds BOS to the prompt and the
`to_layout` adds the terminating EOS, so there is exactly one place for each.

The special ids follow Gemma: PAD = 0, EOS = 1, BOS = 2. A toy model trained with them therefore uses the same
pad/eos conventions as the real one (sampler EOS handling, tail fill, padding masks).

`ToyTokenizer` default vocabulary (V = 32)::

    0 <pad>  1 <eos>  2 <bos>  3 |  4 +  5 *  6..15 0-9  16 C  17 S  18 A  19 M  20 P  21 ' '  22 =  23 -
    24..31 <r0>..<r7>   reserved: never produced by data, but reachable by uniform diffusion noise

`ToyTokenizer(symbols="0123456789+|CSAP", num_reserved=5)` gives exactly a V = 24 vocabulary (3 specials,
16 symbols, 5 reserved ids). Symbols may be longer than one character (a word-level vocabulary); encoding is greedy
longest-match, and an unknown character raises `ValueError` naming it and its offset (no silent UNK).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>")
SEP = "|"
TASK_TAGS = {"copy": "C", "sort": "S", "add": "A", "mul": "M", "perm": "P", "pick": "K", "fill": "F",
             "agree": "G"}
WILDCARD = "?"  # a FILL prompt position whose answer digit is free
# Symbols a tokenizer needs beyond DEFAULT_SYMBOLS for the many-answer tasks (pick, fill). They are not in the
# defaults so that every existing toy vocabulary keeps its ids; a config appends them (experiments/sdrl_study/configs/choice.yaml).
CHOICE_SYMBOLS: tuple[str, ...] = (TASK_TAGS["pick"], TASK_TAGS["fill"], WILDCARD)
DEFAULT_SYMBOLS: tuple[str, ...] = (SEP, "+", "*", *"0123456789", *"CSAMP", " ", "=", "-")


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline, the layout and rewards need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def bos_id(self) -> int: ...

    @property
    def stop_ids(self) -> tuple[int, ...]: ...

    @property
    def eos_token(self) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str: ...


def _as_int_list(ids: Iterable[int]) -> list[int]:
    """Accepts lists, tuples, generators, numpy and jax arrays."""
    if not hasattr(ids, "shape"):
        ids = list(ids)
    return np.asarray(ids, dtype=np.int64).reshape(-1).tolist()


class ToyTokenizer:
    """Character/word-level tokenizer with a fixed, tiny vocabulary (see the module docstring)."""

    def __init__(self, symbols: Sequence[str] | str = DEFAULT_SYMBOLS, num_reserved: int = 8):
        symbols = tuple(symbols)
        if len(set(symbols)) != len(symbols) or any(not s for s in symbols):
            raise ValueError(f"ToyTokenizer symbols must be unique non-empty strings, got {symbols}")
        reserved = tuple(f"<r{i}>" for i in range(num_reserved))
        clash = set(symbols) & set(SPECIAL_TOKENS + reserved)
        if clash:
            raise ValueError(f"ToyTokenizer symbols clash with special/reserved tokens: {sorted(clash)}")
        self._itos: tuple[str, ...] = SPECIAL_TOKENS + symbols + reserved
        self._stoi = {s: i for i, s in enumerate(self._itos)}
        self._reserved_ids = tuple(range(len(SPECIAL_TOKENS) + len(symbols), len(self._itos)))
        # Longest match first so that multi-character symbols (and "<eos>" markers) win over single characters.
        alternatives = sorted(self._itos, key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(s) for s in alternatives))

    @property
    def vocab_size(self) -> int:
        return len(self._itos)

    @property
    def pad_id(self) -> int:
        return PAD_ID

    @property
    def eos_id(self) -> int:
        return EOS_ID

    @property
    def bos_id(self) -> int:
        return BOS_ID

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (EOS_ID,)

    @property
    def eos_token(self) -> str:
        return SPECIAL_TOKENS[EOS_ID]

    @property
    def reserved_ids(self) -> tuple[int, ...]:
        """Ids that `encode` of task data never yields (they are reachable only as noise)."""
        return self._reserved_ids

    @property
    def vocab(self) -> tuple[str, ...]:
        return self._itos

    def token_id(self, symbol: str) -> int:
        return self._stoi[symbol]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        pos = 0
        while pos < len(text):
            m = self._pattern.match(text, pos)
            if m is None:
                raise ValueError(
                    f"ToyTokenizer cannot encode {text[pos]!r} at offset {pos} of {text[:40]!r}; "
                    f"vocabulary: {self._itos}"
                )
            ids.append(self._stoi[m.group(0)])
            pos = m.end()
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        out = []
        for i in _as_int_list(ids):
            if not 0 <= i < len(self._itos):
                raise ValueError(f"ToyTokenizer id {i} is outside the vocabulary [0, {len(self._itos)})")
            if skip_special_tokens and i < len(SPECIAL_TOKENS):
                continue
            out.append(self._itos[i])
        return "".join(out)


SHIPPED_PREFIX = "dgemma:"
END_OF_TURN = "<turn|>"  # Gemma 4's end of a conversation turn: what a chat answer ends on


def shipped_tokenizer_dir(path: str) -> str:
    """`dgemma:NAME` -> the directory of the tokenizer NAME shipped in the package (dgemma/data/tokenizers/NAME,
    package data, so a non-editable install has it); any other path as it is."""
    if not path.startswith(SHIPPED_PREFIX):
        return path
    import os

    name = path[len(SHIPPED_PREFIX):]
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizers")
    found = os.path.join(root, name)
    if not name or os.sep in name or not os.path.isdir(found):
        shipped = sorted(os.listdir(root)) if os.path.isdir(root) else []
        raise ValueError(f"TokenizerConfig.path: no shipped tokenizer {path!r}; shipped: "
                         f"{[SHIPPED_PREFIX + n for n in shipped]}")
    return found


class HFTokenizer:
    """Wraps `transformers.AutoTokenizer.from_pretrained(local_dir)` behind the `Tokenizer` interface.

    Loading is local-only (`local_files_only=True`): a missing directory is an error, never a download. Special ids
    default to the tokenizer's own and may be overridden (some tokenizers have no pad token).

    `chat=True` (chat data): EOS is the end-of-turn token `<turn|>`, since a chat answer ends its turn rather than the
    document. `to_layout` then appends `<turn|>` to every answer, the supervised tail repeats it, rewards cut the text
    at it, and the sampler stops on `stop_ids` = (`<turn|>`, the tokenizer's own EOS, `extra_stop_ids`...).
    """

    def __init__(self, path: str, *, pad_id: int | None = None, eos_id: int | None = None, bos_id: int | None = None,
                 extra_stop_ids: Sequence[int] = (), chat: bool = False):
        from transformers import AutoTokenizer  # lazy: keeps `import dgemma.data` light

        path = shipped_tokenizer_dir(path)
        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self._pad = self._resolve("pad", pad_id, self._tok.pad_token_id, path)
        native_eos = self._resolve("eos", eos_id, self._tok.eos_token_id, path)
        self._bos = self._resolve("bos", bos_id, self._tok.bos_token_id, path)
        if chat:
            if eos_id is not None:
                raise ValueError("TokenizerConfig.eos_id: with chat=True the EOS is the end-of-turn token <turn|>")
            self._eos = self._special_id(END_OF_TURN, path)
            if not getattr(self._tok, "chat_template", None):
                raise ValueError(f"HF tokenizer at {path!r} has no chat_template (TokenizerConfig.chat=True renders "
                                 "conversations with it)")
        else:
            self._eos = native_eos
        self.chat = bool(chat)
        self._stop = tuple(dict.fromkeys((self._eos, native_eos, *map(int, extra_stop_ids))))

    def _special_id(self, token: str, path: str) -> int:
        ids = self._tok.encode(token, add_special_tokens=False)
        if len(ids) != 1 or self._tok.convert_ids_to_tokens(ids[0]) != token:
            raise ValueError(f"HF tokenizer at {path!r} has no single token {token!r} (TokenizerConfig.chat=True "
                             f"needs Gemma 4's control tokens)")
        return int(ids[0])

    @staticmethod
    def _resolve(name: str, override: int | None, native: int | None, path: str) -> int:
        value = override if override is not None else native
        if value is None:
            raise ValueError(f"HF tokenizer at {path!r} has no {name} token; set TokenizerConfig.{name}_id")
        return int(value)

    @property
    def hf_tokenizer(self):
        return self._tok

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def bos_id(self) -> int:
        return self._bos

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop

    @property
    def eos_token(self) -> str:
        # transformers annotates both overloads' result as str | list[str]; one id gives one token
        return self._tok.convert_ids_to_tokens(self._eos)  # type: ignore[return-value]

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`[encode(t) for t in texts]` in one call (a fast tokenizer encodes the batch in Rust)."""
        return [list(ids) for ids in self._tok(list(texts), add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        # transformers annotates decode's result as str | list[str]; one sequence of ids decodes to one str
        text = self._tok.decode(_as_int_list(ids), skip_special_tokens=skip_special_tokens)
        return text  # type: ignore[return-value]


class TokenizerSettings(Protocol):
    """What `build_tokenizer` reads: a `dgemma.data.config.TokenizerConfig` (which imports this module)."""

    @property
    def kind(self) -> str: ...
    @property
    def path(self) -> str | None: ...
    @property
    def symbols(self) -> tuple[str, ...] | None: ...
    @property
    def num_reserved(self) -> int: ...
    @property
    def pad_id(self) -> int | None: ...
    @property
    def eos_id(self) -> int | None: ...
    @property
    def chat(self) -> bool: ...
    @property
    def bos_id(self) -> int | None: ...
    @property
    def extra_stop_ids(self) -> tuple[int, ...]: ...


def build_tokenizer(cfg: TokenizerSettings) -> Tokenizer:
    """Builds a tokenizer from a `TokenizerConfig`."""
    if cfg.kind == "toy":
        symbols = DEFAULT_SYMBOLS if cfg.symbols is None else cfg.symbols
        return ToyTokenizer(symbols, num_reserved=cfg.num_reserved)
    if cfg.kind == "hf":
        assert cfg.path is not None  # TokenizerConfig refuses kind='hf' without a path
        return HFTokenizer(
            cfg.path, pad_id=cfg.pad_id, eos_id=cfg.eos_id, bos_id=cfg.bos_id, extra_stop_ids=cfg.extra_stop_ids,
            chat=cfg.chat,
        )
    raise ValueError(f"TokenizerConfig.kind: unknown {cfg.kind!r}")

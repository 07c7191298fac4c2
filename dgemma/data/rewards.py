"""Verifiable examples and their binary rewards.

A `TaskExample` is what every source yields: the prompt text, the response text the model is trained on, and the
`answer` the reward checks (for synthetic tasks the answer is the response; for GSM8K it is the final number after
`####`). Rewards are used by evaluation and SD·RL (docs/sdrl.md), so they are strict:

* Generation ends at the first stop token (EOS). Anything after it — the supervised tail, padding, junk from a
  sampler that kept running — is ignored. Text before it must match exactly; a PAD or BOS before the EOS is a miss.
* Token input is cut at the first id in `tokenizer.stop_ids`; text input at the first `tokenizer.eos_token`
  (`"<eos>"` for the toy tokenizer). Without any EOS the whole generation is the answer, unless `require_eos`.
* A token generation matches if its ids equal `encode(answer)` or its decoded text equals the answer, so a BPE
  model that spells the answer with a different segmentation is not penalised. An id outside the tokenizer's
  vocabulary before the EOS (a model whose vocabulary is larger than the tokenizer's) scores 0.
"""

from __future__ import annotations

import dataclasses
import decimal
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dgemma.data.tokenizer import SPECIAL_TOKENS, EOS_ID, WILDCARD, Tokenizer, ToyTokenizer

Generated = str | Sequence[int] | np.ndarray
EXACT_MATCH_TASKS = ("copy", "sort", "add", "mul", "text")


@dataclasses.dataclass(frozen=True)
class TaskExample:
    """One prompt/response pair with what its reward needs. `index` is its position in its source."""

    task: str
    prompt: str
    response: str
    answer: str
    index: int = -1


_DEFAULT_TOKENIZER: ToyTokenizer | None = None


def _default_tokenizer() -> ToyTokenizer:
    global _DEFAULT_TOKENIZER
    if _DEFAULT_TOKENIZER is None:
        _DEFAULT_TOKENIZER = ToyTokenizer()
    return _DEFAULT_TOKENIZER


def cut_at_eos(
    generated: Generated, tokenizer: Tokenizer | None = None, *, require_eos: bool = False
) -> tuple[str | list[int], bool]:
    """Returns (the generation before its first stop token, whether a stop token was found).

    Text stays text and tokens stay a list of ints. With `require_eos` and no stop token, returns ("", False)
    for text or ([], False) for tokens so that callers score it 0.
    """
    if isinstance(generated, str):
        eos = tokenizer.eos_token if tokenizer is not None else SPECIAL_TOKENS[EOS_ID]
        head, sep, _ = generated.partition(eos)
        found = bool(sep)
        return (head if (found or not require_eos) else ""), found
    ids = np.asarray(generated).reshape(-1).tolist()
    stops = set(tokenizer.stop_ids) if tokenizer is not None else {EOS_ID}
    for i, t in enumerate(ids):
        if t in stops:
            return ids[:i], True
    return (ids if not require_eos else []), False


def _tokenizer_or_default(tokenizer: Tokenizer | None) -> Tokenizer:
    return tokenizer if tokenizer is not None else _default_tokenizer()


def _as_text(head: str | list[int], tokenizer: Tokenizer | None, skip_special_tokens: bool = False) -> str:
    """Text as it is; ids decoded (special tokens kept by default, so a PAD inside the answer is a miss)."""
    if isinstance(head, str):
        return head
    return _tokenizer_or_default(tokenizer).decode(head, skip_special_tokens=skip_special_tokens)


def _reward_before_eos(score: Callable[[TaskExample, str | list[int], Tokenizer | None], float]):
    """A task reward `fn(example, generated, tokenizer=None, *, require_eos=False) -> float` that scores the
    generation before its first stop token with `score(example, head, tokenizer)`; 0 when `require_eos` and the
    generation has no stop token."""

    @functools.wraps(score)
    def reward_fn(example: TaskExample, generated: Generated, tokenizer: Tokenizer | None = None, *,
                  require_eos: bool = False) -> float:
        head, found = cut_at_eos(generated, tokenizer, require_eos=require_eos)
        if require_eos and not found:
            return 0.0
        if not isinstance(head, str):  # an id the tokenizer lacks (a model vocabulary larger than it) answers nothing
            vocab = _tokenizer_or_default(tokenizer).vocab_size
            if any(not 0 <= t < vocab for t in head):
                return 0.0
        return score(example, head, tokenizer)

    return reward_fn


@_reward_before_eos
def exact_match_reward(example: TaskExample, head, tokenizer) -> float:
    """1.0 iff the generation before the first EOS is exactly `example.answer`."""
    if not isinstance(head, str) and head == _tokenizer_or_default(tokenizer).encode(example.answer):
        return 1.0
    return float(_as_text(head, tokenizer).strip() == example.answer)


@_reward_before_eos
def multiset_reward(example: TaskExample, head, tokenizer) -> float:
    """PERM: 1.0 iff the generation is some permutation of the answer's characters (many answers are correct)."""
    return float(sorted(_as_text(head, tokenizer).strip()) == sorted(example.answer))


@_reward_before_eos
def pick_reward(example: TaskExample, head, tokenizer) -> float:
    """PICK: 1.0 iff the generation has the prompt's length and digit j is prompt digit j or one more (mod 10)."""
    out = _as_text(head, tokenizer).strip()
    return float(len(out) == len(example.answer) and all(
        o in (a, str((int(a) + 1) % 10)) for o, a in zip(out, example.answer)))


@_reward_before_eos
def fill_reward(example: TaskExample, head, tokenizer) -> float:
    """FILL: 1.0 iff the generation matches the pattern `example.answer` with each wildcard '?' answered by a digit."""
    out = _as_text(head, tokenizer).strip()
    return float(len(out) == len(example.answer) and all(
        o.isdigit() if a == WILDCARD else o == a for o, a in zip(out, example.answer)))


def bump_word(word: str, bump: int) -> str:
    """AGREE: every digit of `word` plus `bump` (mod 10)."""
    return "".join(str((int(d) + bump) % 10) for d in word)


@_reward_before_eos
def agree_reward(example: TaskExample, head, tokenizer) -> float:
    """AGREE: 1.0 iff the generation has the answer's words (space-separated, same lengths) and each word is the
    prompt word with one bump b in {0, 1} shared by all its digits; a word mixing the two alternatives is invalid."""
    out, want = _as_text(head, tokenizer).strip().split(" "), example.answer.split(" ")
    return float(len(out) == len(want) and all(
        o in (w, bump_word(w, 1)) for o, w in zip(out, want)))


def agree_word_validity(example: TaskExample, generated: Generated, tokenizer: Tokenizer | None = None) -> float:
    """AGREE partial credit: the fraction of the answer's words that the generation (before its EOS) gets valid, word
    by word (0 when the word layout differs). Independent per-digit choices score (2 / 2^len)^1 per word on average,
    e.g. 0.25 for 3-digit words: a factorised sampler's level."""
    out = _as_text(cut_at_eos(generated, tokenizer)[0], tokenizer).strip().split(" ")
    want = example.answer.split(" ")
    if len(out) != len(want):
        return 0.0
    return float(np.mean([o in (w, bump_word(w, 1)) for o, w in zip(out, want)]))


def perm_diagnostics(example: TaskExample, generated: Generated, tokenizer: Tokenizer | None = None) -> dict:
    """PERM output diagnostics (E2c, experiments/sdrl_study/README.md): `valid` (the reward), `duplicate` (some digit occurs more
    often than in the prompt), `missing` (some prompt digit occurs less often), `length_error` (|output| != |answer|),
    and `copy` (the output is the prompt order itself, a degenerate but valid answer). Special tokens before the EOS
    count as wrong symbols."""
    from collections import Counter

    head = _as_text(cut_at_eos(generated, tokenizer)[0], tokenizer)
    out, want = Counter(head.strip()), Counter(example.answer)
    return {"valid": float(out == want), "duplicate": float(any(out[c] > want[c] for c in out)),
            "missing": float(any(out[c] < want[c] for c in want)),
            "length_error": float(sum(out.values()) != sum(want.values())),
            "copy": float(head.strip() == example.answer)}


# MARK: GSM8K


def normalize_number(text: str) -> str:
    """Canonical form of a numeric answer: no commas, whitespace, leading '$' or trailing '.'; numerically equal
    decimals compare equal ("1,600" == "1600", "18.00" == "18"). Non-numbers are returned stripped."""
    s = "".join(text.split()).replace(",", "").lstrip("$").rstrip(".")
    try:
        d = decimal.Decimal(s)
    except decimal.InvalidOperation:
        return s
    if not d.is_finite():
        return s
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def extract_gsm8k_answer(text: str) -> str | None:
    """The normalized final answer after the last `####` (first line only), or None if there is no `####`."""
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].strip()
    first_line = tail.splitlines()[0] if tail else ""
    value = normalize_number(first_line)
    return value or None


@_reward_before_eos
def gsm8k_reward(example: TaskExample, head, tokenizer) -> float:
    """1.0 iff the generation's `####` answer equals the reference final answer after normalization."""
    pred = extract_gsm8k_answer(_as_text(head, tokenizer, skip_special_tokens=True))
    return float(pred is not None and pred == normalize_number(example.answer))


_REWARDS: dict[str, Any] = {
    **{name: exact_match_reward for name in EXACT_MATCH_TASKS},
    "perm": multiset_reward,
    "pick": pick_reward,
    "fill": fill_reward,
    "agree": agree_reward,
    "gsm8k": gsm8k_reward,
}


def reward(
    example: TaskExample, generated: Generated, tokenizer: Tokenizer | None = None, *, require_eos: bool = False
) -> float:
    """Dispatches on `example.task` to the task's binary reward."""
    try:
        fn = _REWARDS[example.task]
    except KeyError:
        raise ValueError(f"no reward for task {example.task!r}; known: {sorted(_REWARDS)}") from None
    return fn(example, generated, tokenizer, require_eos=require_eos)


# MARK: user reward callables (SD·RL `sdrl.reward`)


class RewardError(ValueError):
    """A user reward function failed or returned something other than one finite float per row."""


def load_reward_fn(path: str, *, field: str = "sdrl.reward"):
    """Import a reward callable named 'package.module:function' (or 'package.module.function').

    The callable is called as `fn(examples, generations, tokenizer)` with a list of `TaskExample`s, a list of token
    id lists (the generations, EOS and padding included) and the run's tokenizer, and returns one float per row.
    It is returned wrapped (`_guard_exit`) so that a `sys.exit()` inside it is a `RewardError`, not the end of the
    run with exit code 0.

    Raises:
      RewardError: one line naming `field`, the module and what failed (import error, syntax error with its file
        and line, exception or `sys.exit` while importing, no such callable).
    """
    import importlib

    mod_name, sep, attr = path.partition(":")
    if not sep:
        mod_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(mod_name)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - user code: ImportError, SyntaxError, any error or sys.exit at import
        raise RewardError(f"{field}={path!r}: cannot import module {mod_name!r} ({_describe(e)})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"{field}={path!r}: module {mod_name!r} has no callable {attr!r}")
    return _guard_exit(fn, path, field)


def _describe(e: BaseException) -> str:
    """`Type: message` of an exception on one line; a SyntaxError with its file and line."""
    if isinstance(e, SyntaxError):
        return f"SyntaxError: {e.msg} at {e.filename}:{e.lineno}"
    if isinstance(e, SystemExit):
        return f"it called sys.exit({e.code!r})"
    text = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _guard_exit(fn, path: str, field: str):
    """`fn` with `SystemExit` (and any other non-`Exception` BaseException but KeyboardInterrupt, which stays a real
    interrupt) turned into a `RewardError` naming the function: user code must not end the run, least of all with
    exit code 0 and no result."""

    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (Exception, KeyboardInterrupt):
            raise
        except BaseException as e:  # noqa: BLE001 - SystemExit, GeneratorExit, custom BaseException subclasses
            raise RewardError(f"{field}={path!r}: reward function {getattr(fn, '__qualname__', path)} raised "
                              f"{type(e).__name__} ({_describe(e)}); a reward must return one float per row") from None

    return guarded


def score_rows(examples: Sequence[TaskExample], generations: Sequence[Generated], tokenizer: Tokenizer | None = None,
               *, fn=None, require_eos: bool = False, field: str = "sdrl.reward") -> np.ndarray:
    """Rewards [rows] float64 of `generations` for `examples`: the task rewards (`reward`), or the user callable `fn`
    (see `load_reward_fn`), checked to return one finite float per row."""
    if fn is None:
        return np.asarray([reward(e, g, tokenizer, require_eos=require_eos) for e, g in zip(examples, generations)],
                          np.float64)
    name = getattr(fn, "__qualname__", repr(fn))
    gens = [np.asarray(g).reshape(-1).tolist() if not isinstance(g, str) else g for g in generations]
    try:
        out = fn(list(examples), gens, tokenizer)
    except RewardError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of user code becomes one clear error
        raise RewardError(f"{field}: reward function {name} raised {type(e).__name__}: {e}") from e
    try:
        values = np.asarray(out, dtype=np.float64)
    except (TypeError, ValueError):
        raise RewardError(f"{field}: reward function {name} returned {type(out).__name__}, not one float per row "
                          f"({len(gens)} rows)") from None
    if values.shape != (len(gens),):
        raise RewardError(f"{field}: reward function {name} returned shape {values.shape}, expected ({len(gens)},): "
                          "one float per row")
    if not np.all(np.isfinite(values)):
        raise RewardError(f"{field}: reward function {name} returned non-finite rewards at rows "
                          f"{np.flatnonzero(~np.isfinite(values))[:5].tolist()}")
    return values

"""Synthetic verifiable tasks, generated on the fly and random-access: example `i` is a pure function of
(seed, task, i), so a task is a grain `MapDataset` source with no storage and exact resume.

Formats (toy vocabulary of `dgemma.data.tokenizer`; shown one token per column, the text has no spaces; the
pipeline prepends BOS and `to_layout` appends EOS)::

    task  prompt            response        reward
    copy  C 3 1 4 1 5 |     3 1 4 1 5       exact match before the first EOS
    sort  S 3 1 4 1 5 |     1 1 3 4 5       exact match
    perm  P 3 1 4 1 5 |     5 1 4 3 1       any permutation of the prompt digits (many correct answers)
    pick  K 3 1 4 1 5 |     4 1 4 2 5       digit j is prompt digit j or one more (mod 10): 2^n correct answers
    fill  F 3 ? 4 ? 5 |     3 7 4 0 5       the prompt with every '?' replaced by any digit: 10^#? correct answers
    agree G 3 1 4 _ 1 5 |   3 1 4 _ 2 6     each word (digits between spaces '_') is the prompt word, or the prompt
                                            word with EVERY digit one more (mod 10): 2^#words correct answers
    add   A 5 2 + 8 9 |     3 4 1           a+b; here 25 + 98 = 123 written LSB first
    mul   M 5 2 * 3 |       5 7             a*b; here 25 * 3 = 75 written LSB first

Digit order. `lsb_first=True` (the default, as in the toy studies) writes operands and the answer
least-significant digit first. Digit k of a sum depends on digits <= k of the operands and a carry from digit k-1,
so in LSB order every answer digit depends only on what is to its left: a tiny causal model can learn ADD with
no look-ahead, and MUL likewise produces its low digits first. `lsb_first=False` gives the human order, where the
first digit written depends on every carry, as an ablation of the left-to-right dependency.

PICK and FILL are the many-answer tasks of the SD·RL study (experiments/sdrl_study): their answer positions are
independent choices, so a model of the data distribution stays uncertain at every free position however well it is
trained (1 bit per PICK digit, log 10 per '?'), as a language model stays uncertain between valid continuations.
They train on a uniform choice per position; any valid choice earns the reward. Their tags and the wildcard are not
in the default toy vocabulary (`tokenizer.CHOICE_SYMBOLS`).

AGREE is PICK whose choices are shared: one hidden bump per word (`word_len` digits; the last word may be
shorter), which every digit of the word must agree on. Its positions depend on each other, as in language: sampling
the digits of a word independently (committing them in parallel) mixes the two alternatives, and a mixed word is
invalid. Its tag is not in the default toy vocabulary either (experiments/sdrl_study/configs/agree.yaml appends it).

Numbers have no leading zeros (MSB order); an operand with k digits is uniform over [10^(k-1), 10^k), with k
uniform in [min_digits, max_digits], so short operands are as common as long ones.

Held-out sets: use a different seed (collisions are possible for small spaces, e.g. 4-digit COPY has 10^4 inputs).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import numpy as np

from dgemma.data.config import TaskConfig
from dgemma.data.rewards import Generated, TaskExample, bump_word, reward
from dgemma.data.tokenizer import SEP, TASK_TAGS, WILDCARD, Tokenizer

_MIXTURE_SALT = zlib.crc32(b"dgemma/mixture")


def _rng(seed: int, salt: str | int, index: int) -> np.random.Generator:
    """Independent stream per (seed, salt, index); stable across platforms and numpy versions (SeedSequence)."""
    if isinstance(salt, str):
        salt = zlib.crc32(salt.encode())
    if index < 0:
        raise IndexError(f"negative example index {index}")
    return np.random.default_rng(np.random.SeedSequence([seed, salt, index]))


def _digits(rng: np.random.Generator, lo: int, hi: int) -> str:
    n = int(rng.integers(lo, hi + 1))
    return "".join(str(d) for d in rng.integers(0, 10, size=n))


def _operand(rng: np.random.Generator, lo_digits: int, hi_digits: int) -> int:
    k = int(rng.integers(lo_digits, hi_digits + 1))
    if k > 18:  # beyond int64: digit by digit (leading digit 1-9), still uniform over the k-digit numbers
        return int(str(int(rng.integers(1, 10))) + "".join(str(d) for d in rng.integers(0, 10, size=k - 1)))
    lo = 0 if k == 1 else 10 ** (k - 1)
    return int(rng.integers(lo, 10**k))


class SyntheticTask:
    """One task family; `example(seed, index)` is deterministic and `reward(...)` scores a generation."""

    def __init__(self, cfg: TaskConfig):
        self.cfg = cfg
        self.name = cfg.name
        self.tag = TASK_TAGS[cfg.name]

    def _fmt(self, n: int) -> str:
        s = str(n)
        return s[::-1] if self.cfg.lsb_first else s

    def parse_number(self, text: str) -> int:
        """Inverse of the answer format (for diagnostics such as per-digit accuracy)."""
        return int(text[::-1] if self.cfg.lsb_first else text)

    def example(self, seed: int, index: int) -> TaskExample:
        rng = _rng(seed, self.name, index)
        c = self.cfg
        if self.name in ("copy", "sort", "perm"):
            digits = _digits(rng, c.min_len, c.max_len)
            prompt = f"{self.tag}{digits}{SEP}"
            if self.name == "copy":
                response = answer = digits
            elif self.name == "sort":
                response = answer = "".join(sorted(digits))
            else:  # perm: train on one random permutation, reward any permutation of the multiset
                response = "".join(rng.permutation(list(digits)).tolist())
                answer = digits
        elif self.name == "pick":  # answer = the prompt digits; the reward accepts d or d+1 at each position
            digits = _digits(rng, c.min_len, c.max_len)
            bumps = rng.integers(0, 2, size=len(digits))
            prompt = f"{self.tag}{digits}{SEP}"
            response = "".join(str((int(d) + int(b)) % 10) for d, b in zip(digits, bumps))
            answer = digits
        elif self.name == "fill":  # answer = the pattern; the reward accepts any digit at each wildcard
            digits = _digits(rng, c.min_len, c.max_len)
            wild = rng.random(len(digits)) < c.wildcard_rate
            pattern = "".join(WILDCARD if w else d for d, w in zip(digits, wild))
            prompt = f"{self.tag}{pattern}{SEP}"
            response, answer = digits, pattern
        elif self.name == "agree":  # answer = the prompt words; the reward accepts one shared bump per word
            digits = _digits(rng, c.min_len, c.max_len)
            words = [digits[i:i + c.word_len] for i in range(0, len(digits), c.word_len)]
            bumps = rng.integers(0, 2, size=len(words))
            prompt = f"{self.tag}{' '.join(words)}{SEP}"
            response = " ".join(bump_word(w, int(b)) for w, b in zip(words, bumps))
            answer = " ".join(words)
        elif self.name in ("add", "mul"):
            a = _operand(rng, c.min_digits, c.max_digits)
            b = _operand(rng, c.min_digits, c.max_digits)
            op, value = ("+", a + b) if self.name == "add" else ("*", a * b)
            prompt = f"{self.tag}{self._fmt(a)}{op}{self._fmt(b)}{SEP}"
            response = answer = self._fmt(value)
        else:  # pragma: no cover - TaskConfig validates the name
            raise ValueError(f"unknown task {self.name!r}")
        return TaskExample(task=self.name, prompt=prompt, response=response, answer=answer, index=index)

    def reward(
        self, example: TaskExample, generated: Generated, tokenizer: Tokenizer | None = None, **kw: bool
    ) -> float:
        return reward(example, generated, tokenizer, **kw)


def free_choices(example: TaskExample) -> list[tuple[int, dict[str, float]]]:
    """The answer positions the data leaves free, with the data's distribution of each: [(character index in
    `example.answer`, {character: probability})], for the many-answer tasks (exact, from the generator's definition:
    PICK and AGREE draw each bump uniform over {0, 1}, FILL each wildcard digit uniform over 0-9, PERM a uniform
    permutation, whose marginal at every position is the digits' frequencies). AGREE's digits of one word are not
    independent (their marginals are still these); the tasks with one answer (copy, sort, add, mul) have none."""
    a, name = example.answer, example.task
    if name in ("pick", "agree"):
        return [(j, {d: 0.5, str((int(d) + 1) % 10): 0.5}) for j, d in enumerate(a) if d.isdigit()]
    if name == "fill":
        return [(j, {str(d): 0.1 for d in range(10)}) for j, c in enumerate(a) if c == WILDCARD]
    if name == "perm":
        freq = {d: a.count(d) / len(a) for d in sorted(set(a))}
        return [(j, dict(freq)) for j in range(len(a))] if len(freq) > 1 else []
    return []


def answer_count(example: TaskExample) -> int:
    """How many answers the data gives this prompt, each equally likely (the generator's choices are uniform):
    2^digits (PICK), 10^wildcards (FILL), 2^words (AGREE), the distinct orderings of the digits (PERM), else 1."""
    a, name = example.answer, example.task
    if name == "pick":
        return 2 ** len(a)
    if name == "fill":
        return 10 ** a.count(WILDCARD)
    if name == "agree":
        return 2 ** len(a.split(" "))
    if name == "perm":
        n = math.factorial(len(a))
        for d in set(a):
            n //= math.factorial(a.count(d))
        return n
    return 1


class TaskSource:
    """Random-access source over one task: `source[i] = task.example(seed, i)` for i < num_examples."""

    def __init__(self, task: TaskConfig | SyntheticTask, *, seed: int = 0, num_examples: int = 1_000_000):
        self.task = task if isinstance(task, SyntheticTask) else SyntheticTask(task)
        self.seed = int(seed)
        self.num_examples = int(num_examples)

    def __len__(self) -> int:
        return self.num_examples

    def __getitem__(self, index: int) -> TaskExample:
        index = int(index)
        if not 0 <= index < self.num_examples:
            raise IndexError(f"index {index} out of range for TaskSource of length {self.num_examples}")
        return self.task.example(self.seed, index)

    def __repr__(self) -> str:
        return f"TaskSource({self.task.cfg!r}, seed={self.seed}, num_examples={self.num_examples})"


class MixtureSource:
    """Random-access weighted mixture of tasks: example i draws its task from a (seed, i)-seeded categorical with
    the normalized weights, then generates that task's example i. The draw is per index, so proportions hold in
    expectation over any window and the mixture stays random-access (grain's `mix` would also work, but this keeps
    one index space shared by every source kind)."""

    def __init__(self, tasks: Sequence[TaskConfig], *, seed: int = 0, num_examples: int = 1_000_000):
        if not tasks:
            raise ValueError("MixtureSource needs at least one task")
        self.tasks = [SyntheticTask(t) for t in tasks]
        w = np.asarray([t.weight for t in tasks], dtype=np.float64)
        self.weights = w / w.sum()
        self._cdf = np.cumsum(self.weights)
        self._cdf[-1] = 1.0
        self.seed = int(seed)
        self.num_examples = int(num_examples)

    def __len__(self) -> int:
        return self.num_examples

    def task_of(self, index: int) -> SyntheticTask:
        u = _rng(self.seed, _MIXTURE_SALT, index).random()
        return self.tasks[int(np.searchsorted(self._cdf, u, side="right"))]

    def __getitem__(self, index: int) -> TaskExample:
        index = int(index)
        if not 0 <= index < self.num_examples:
            raise IndexError(f"index {index} out of range for MixtureSource of length {self.num_examples}")
        return self.task_of(index).example(self.seed, index)

    def __repr__(self) -> str:
        names = [t.name for t in self.tasks]
        return f"MixtureSource({names}, weights={self.weights.round(4).tolist()}, seed={self.seed})"

"""Sampled ids as text, for `dgemma sample` and `dgemma eval`: a row's answer cut at its stop token, why it stopped,
and the committed blocks streamed as text while the sampler runs.

A row's answer is its generated ids up to, excluding, the first stop id (`tokenizer.stop_ids`; a chat tokenizer's
`<turn|>` first): the sampler keeps that first stop and pads everything after it, so nothing past the end of the
turn is ever shown. PAD ids before the stop are the model's own output and are shown (as `<pad>`); trailing PAD
(rows of a batch that ran fewer blocks) are not.

Streaming (`TextStream`): a subword tokenizer may split one character over several ids (a byte-level BPE writes `€`
as three), and a block boundary can fall between them. Decoding each block on its own would print broken characters,
so the stream decodes the whole answer so far after every block and prints only what extends the text already
printed, holding back a trailing U+FFFD (an incomplete character that the next block may complete). `finish` prints
what is left and returns each row's answer text.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole UTF-8 character


def decode_shown(tokenizer, ids: list[int]) -> str:
    """The text of sampled `ids`; an id the tokenizer cannot decode shows as `<id N>` instead of failing the command:
    a model's vocabulary may be larger than its tokenizer's (the rehearsal's 128 over the toy tokenizer's ids), and
    an untrained model samples anywhere in it."""
    try:
        return tokenizer.decode(ids)
    except ValueError:
        pieces = []
        for i in ids:
            try:
                pieces.append(tokenizer.decode([i]))
            except ValueError:
                pieces.append(f"<id {i}>")
        return "".join(pieces)


@dataclasses.dataclass(frozen=True)
class Answer:
    """A row's answer ids (before its stop) and the stop id that ended it (None: it ran to the token budget)."""

    ids: list[int]
    stop: int | None


def cut_answer(tokenizer, ids: Sequence[int]) -> Answer:
    """The answer in a row of generated `ids` (module docstring)."""
    ids = [int(t) for t in ids]
    stops = set(tokenizer.stop_ids)
    for i, t in enumerate(ids):
        if t in stops:
            return Answer(ids[:i], t)
    while ids and ids[-1] == tokenizer.pad_id:
        ids.pop()
    return Answer(ids, None)


def answer_text(tokenizer, ids: Sequence[int]) -> str:
    """The decoded answer in a row of generated `ids`."""
    return decode_shown(tokenizer, cut_answer(tokenizer, ids).ids)


def stop_reason(tokenizer, answer: Answer, budget: int) -> str:
    """Why a row stopped, in words: its end of turn / end of sequence token, or the token budget."""
    if answer.stop is None:
        return f"token budget (sampler.max_new_tokens={budget}, rounded up to whole canvases)"
    token = decode_shown(tokenizer, [answer.stop])
    if answer.stop == tokenizer.eos_id and getattr(tokenizer, "chat", False):
        return f"end of turn ({token})"
    return f"stop token {token}"


def _stable(text: str) -> str:
    """`text` without a trailing incomplete character (its U+FFFD run), which a later id may still complete."""
    return text.rstrip(REPLACEMENT)


class TextStream:
    """Prints each row's new answer text after every committed block (`on_block`, the sampler's streaming callback).

    One row: the text itself, as a chat client shows it. Several rows: one line per row with new text,
    `[block b] prompt r: '...'`. `finish(tokens)` prints the rest of each answer (everything, when the sampler never
    streamed: all-AR decoding is one call) and returns the answers.
    """

    def __init__(self, tokenizer, rows: int, write: Callable[[str], object] | None = None):
        self.tokenizer, self.rows = tokenizer, rows
        self.write = write or (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
        self.ids: list[list[int]] = [[] for _ in range(rows)]
        self.shown = [""] * rows  # the text printed so far, per row

    def on_block(self, b: int, tokens) -> None:
        for r in range(self.rows):
            self.ids[r] += [int(t) for t in tokens[r]]
            new = self._new_text(r, _stable(answer_text(self.tokenizer, self.ids[r])))
            if new:
                self._show(r, new, f"[block {b}] ")

    def finish(self, tokens) -> list[Answer]:
        """Print what is left of each answer (`tokens` [rows, T]: the sampler's result) and return the answers."""
        answers = [cut_answer(self.tokenizer, row) for row in tokens]
        for r, a in enumerate(answers):
            text = decode_shown(self.tokenizer, a.ids)
            new = self._new_text(r, text)
            if new is None:  # the decoder rewrote text already printed (not a prefix-stable tokenizer)
                self.write(f"\n[the answer, decoded whole, differs from the streamed text:]\n{text}")
                self.shown[r] = text
            elif new:
                self._show(r, new, "[end] ")
        if self.rows == 1 and self.shown[0]:
            self.write("\n")
        return answers

    def _new_text(self, r: int, text: str) -> str | None:
        """What `text` adds to row r's printed text ("" nothing; None: it does not extend it)."""
        return text[len(self.shown[r]):] if text.startswith(self.shown[r]) else None

    def _show(self, r: int, new: str, head: str) -> None:
        self.shown[r] += new
        self.write(new if self.rows == 1 else f"{head}prompt {r + 1}: {new!r}\n")

"""Token ids of every row of a source, kept so that the pipeline does not tokenize a row twice (`EncodedRows`)."""

from __future__ import annotations

import dataclasses

import numpy as np


def flat_ids(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(the ids of all rows concatenated as int32, row offsets: row i is flat[offsets[i]:offsets[i + 1]])."""
    offsets = np.zeros(len(ids) + 1, np.int64)
    np.cumsum([len(x) for x in ids], out=offsets[1:])
    flat = np.fromiter((t for x in ids for t in x), np.int32, count=int(offsets[-1]))
    return flat, offsets


@dataclasses.dataclass(frozen=True)
class EncodedRows:
    """The token ids of every row of a file source: row i's prompt is `prompt_ids[prompt_offsets[i]:
    prompt_offsets[i + 1]]` (after `prompt_template`, without BOS), likewise its response (without EOS)."""

    prompt_ids: np.ndarray
    prompt_offsets: np.ndarray
    response_ids: np.ndarray
    response_offsets: np.ndarray

    @classmethod
    def from_lists(cls, prompts: list[list[int]], responses: list[list[int]]) -> EncodedRows:
        return cls(*flat_ids(prompts), *flat_ids(responses))

    def __len__(self) -> int:
        return len(self.prompt_offsets) - 1

    def prompt(self, i: int) -> np.ndarray:
        return self.prompt_ids[self.prompt_offsets[i]:self.prompt_offsets[i + 1]]

    def response(self, i: int) -> np.ndarray:
        return self.response_ids[self.response_offsets[i]:self.response_offsets[i + 1]]

"""Injected randomness for the block sampler: replay another implementation's draws (parity tests).

transformers' DiffusionGemma `generate` draws from torch's global RNG; JAX cannot replay that stream, so parity tests
record it (wrapping `torch.randint` / `torch.multinomial` / `torch.sort`) and feed the same canvases, samples, renoise
tokens and entropy order to dgemma's sampler through this hook.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np


class InjectedDraws:
    """Externally supplied randomness for the EB sampler (parity tests).

    Per block: `init` [B, L] (the initial canvas), `samples` [n, B, L] (x̂ of each step) and `noise` [n, B, L]
    (the renoise tokens of each step), n ≤ N; optionally `order` [n, B, L], the entropy sort permutation of each step
    (to replay another implementation's order among exactly equal entropies: torch.sort is not stable). Steps
    beyond n read zeros (a run that takes more steps than the recording then differs visibly).
    """

    def __init__(self, blocks: Sequence[dict]):
        self.blocks = [{k: np.asarray(v, np.int32) for k, v in b.items()} for b in blocks]

    @classmethod
    def from_hf_stream(cls, calls: Sequence[tuple[str, np.ndarray]], batch: int, length: int) -> "InjectedDraws":
        """Parse transformers' global-RNG stream: per block `randint(B, L)`; per step `multinomial(B·L, 1)`, then
        optionally ("sort", indices) (EntropyBoundSampler's `torch.sort` of the entropies), then `randint(B, L)`
        (transformers' draw order). `calls` are (kind, array) in call order; kind in randint | multinomial | sort."""
        blocks, i = [], 0
        while i < len(calls):
            kind, arr = calls[i]
            if kind != "randint":
                raise ValueError(f"draw {i}: expected a block's initial randint, got {kind}")
            block: dict[str, Any] = {"init": np.asarray(arr).reshape(batch, length), "samples": [], "noise": [],
                                     "order": []}
            i += 1
            while i < len(calls) and calls[i][0] == "multinomial":
                block["samples"].append(np.asarray(calls[i][1]).reshape(batch, length))
                i += 1
                if i < len(calls) and calls[i][0] == "sort":
                    block["order"].append(np.asarray(calls[i][1]).reshape(batch, length))
                    i += 1
                if i >= len(calls) or calls[i][0] != "randint":
                    raise ValueError(f"draw {i}: a multinomial must be followed by the renoise randint")
                block["noise"].append(np.asarray(calls[i][1]).reshape(batch, length))
                i += 1
            if len(block["order"]) not in (0, len(block["samples"])):
                raise ValueError("sort permutations must be recorded for every step or for none")
            if not block["order"]:
                del block["order"]
            blocks.append(block)
        return cls(blocks)

    def steps(self, block: int) -> int:
        return len(self.blocks[block]["samples"])

    def block(self, block: int, batch: int, length: int, max_steps: int) -> dict:
        b = self.blocks[block]
        out: dict[str, np.ndarray] = {"init": b["init"].reshape(batch, length)}
        for name in ("samples", "noise", "order"):
            if name not in b:
                continue
            arr = np.zeros((max_steps, batch, length), np.int32)
            if name == "order":
                arr[:] = np.arange(length, dtype=np.int32)
            got = np.asarray(b[name], np.int32).reshape(-1, batch, length)[:max_steps]
            arr[: len(got)] = got
            out[name] = arr
        return {k: jnp.asarray(v) for k, v in out.items()}

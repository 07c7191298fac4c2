"""Recording the global-RNG draws of transformers' DiffusionGemma `generate` and diffusers' pipeline (and the entropy
sort, whose permutation decides ties between equal entropies), in call order: the stream
`dgemma.inference.draws.InjectedDraws.from_hf_stream` replays. Imported by the parity tests and, by plain name, by the
diffusers child process (tests/support/diffusers_child.py runs as a script from this folder)."""

import torch


def recording(calls: list, batch: int, length: int) -> dict:
    """Wrappers of `torch.randint`, `torch.multinomial` and `torch.sort` (keyed by name, to set on `torch`) that append
    ("randint" | "multinomial" | "sort", array) to `calls`; only the [batch, length] float sort (the EB accept's) is
    recorded."""
    orig_r, orig_m, orig_s = torch.randint, torch.multinomial, torch.sort

    def randint(*a, **k):
        out = orig_r(*a, **k)
        calls.append(("randint", out.numpy().copy()))
        return out

    def multinomial(*a, **k):
        out = orig_m(*a, **k)
        calls.append(("multinomial", out.numpy().copy()))
        return out

    def sort(x, *a, **k):
        out = orig_s(x, *a, **k)
        if x.is_floating_point() and tuple(x.shape) == (batch, length):
            calls.append(("sort", out[1].numpy().copy()))
        return out

    return {"randint": randint, "multinomial": multinomial, "sort": sort}

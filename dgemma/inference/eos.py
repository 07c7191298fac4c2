"""End-of-sequence processing of a committed canvas, exactly as transformers' DiffusionGemma `generate` does it."""

from __future__ import annotations

import jax.numpy as jnp


def _pad_after_first_eos(tokens, eos, pad_id):
    is_eos = jnp.isin(tokens, eos)
    cs = jnp.cumsum(is_eos.astype(jnp.int32), axis=-1)
    after = (cs > 0) & ~((cs == 1) & is_eos)
    return jnp.where(after, pad_id, tokens)


def finalize_canvas(draft, finished, eos, pad_id, is_last):
    """HF `_finalize_canvas`: returns (tokens, finished').

    Rows finished in an earlier block become all PAD; in rows with an EOS the first EOS is kept and every later
    position (later EOS ids included) becomes PAD; a row is finished once it emitted an EOS or the token budget ends.
    """
    tokens = jnp.where(finished[:, None], pad_id, draft)
    has_eos = jnp.any(jnp.isin(tokens, eos), axis=-1)
    tokens = _pad_after_first_eos(tokens, eos, pad_id)
    return tokens.astype(jnp.int32), finished | has_eos | is_last

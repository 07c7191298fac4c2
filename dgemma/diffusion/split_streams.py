"""The one-pass [clean ; noisy] layout as separate stream passes that share the clean stream's keys and values.

Stage 1's self-conditioning needs a gradient-free first prediction on the noisy stream. Re-running the whole layout
for it (`diffusion.self_cond_pass: full`) recomputes the clean stream, which never reads the self-conditioning input
and so is identical in both passes. `self_cond_pass: noisy_stream` runs instead

    clean pass : clean queries over clean keys                              -> h_clean, the clean stream's (k, v)
    SC pass    : noisy queries over [stop_grad(clean k, v) ; noisy keys]    -> the first prediction (no gradient)
    main pass  : noisy queries over [clean k, v ; noisy keys], with SC      -> h_noisy (its gradient reaches the
                                                                               clean pass through k and v)

with the one-pass masks restricted to those query and key ranges (scanned layers: the main pass's gradient of the
scanned parameters accumulates into the clean pass's backward, `dgemma.model.shared_scan_grads`, so only one
gradient stack is ever alive), so every query attends to exactly the keys it does
in the one-pass forward: the same loss and gradients (fp32: equal up to summation order). The SC pass covers the R
noisy tokens instead of P + 2R (docs/planner_estimate.md, "FLOPs: from 1.77"); the clean stream's keys and values stay alive for the
backward of the noisy passes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def restrict(mask, rows: slice, cols: slice):
    """A one-pass mask (dense [B, T, S] array, `IntervalMask` or `SplashMask`) for a sub-range of queries and keys."""
    if isinstance(mask, (jax.Array, np.ndarray)):
        return mask[:, rows, cols]
    return mask.restrict(rows, cols)


def stream_masks(masks: dict, num_clean: int) -> tuple[dict, dict]:
    """({layer_type: clean-over-clean mask}, {layer_type: noisy-over-[clean ; noisy] mask})."""
    clean = {kind: restrict(m, slice(0, num_clean), slice(0, num_clean)) for kind, m in masks.items()}
    noisy = {kind: restrict(m, slice(num_clean, None), slice(None)) for kind, m in masks.items()}
    return clean, noisy


def clean_pass(model, streams, clean_masks: dict, num_clean: int):
    """The clean stream alone (it reads only clean keys): (final hidden [B, P+R, H], per-layer (k, v))."""
    x = model.embedder.encode(streams.tokens[:, :num_clean], model.dtype)
    return model.forward(None, streams.positions[:, :num_clean], clean_masks, embeds=x, decoder_tokens=False,
                         per_layer_tokens=streams.tokens[:, :num_clean])


def clean_pass_and_twin(model, streams, clean_masks: dict, num_clean: int):
    """`clean_pass` and a twin model whose later passes add their scanned-layer gradient into the clean pass's stack
    (`Transformer.forward_sharing_scan_grads`): (hidden, per-layer (k, v), twin)."""
    x = model.embedder.encode(streams.tokens[:, :num_clean], model.dtype)
    return model.forward_sharing_scan_grads(streams.positions[:, :num_clean], clean_masks, embeds=x,
                                            per_layer_tokens=streams.tokens[:, :num_clean])


def noisy_pass(model, streams, noisy_masks: dict, num_clean: int, clean_kvs, soft_embeds=None, sc_mask=None):
    """The noisy stream over [the clean stream's (k, v) ; its own keys]: final hidden [B, R, H]."""
    x = model.decoder_input(streams.tokens[:, num_clean:], soft_embeds, sc_mask)
    hidden, _ = model.forward(None, streams.positions[:, num_clean:], noisy_masks, embeds=x, prefix_kvs=clean_kvs,
                              decoder_tokens=True, per_layer_tokens=streams.tokens[:, num_clean:])
    return hidden


def split_hidden(model, streams, masks: dict, num_clean: int, self_conditioning, *, share_scan_grads: bool = True):
    """Final hidden states of the whole layout [B, P + 2R, H] with a noisy-stream-only self-conditioning pass.

    `self_conditioning(first)` maps the gradient-free first pass's hidden states over the whole layout to the
    main pass's (soft_embeds, sc_mask), as in the one-pass path. `share_scan_grads=False` lets each pass's backward
    keep its own scanned-parameter gradient stack (the layout before 2026-12-03; for comparisons)."""
    clean_masks, noisy_masks = stream_masks(masks, num_clean)
    if share_scan_grads:  # the main noisy pass's scanned-layer gradient accumulates into the clean pass's stack
        h_clean, clean_kvs, main = clean_pass_and_twin(model, streams, clean_masks, num_clean)
    else:
        (h_clean, clean_kvs), main = clean_pass(model, streams, clean_masks, num_clean), model
    first_noisy = noisy_pass(model, streams, noisy_masks, num_clean, jax.lax.stop_gradient(clean_kvs))
    first = jax.lax.stop_gradient(jnp.concatenate([h_clean, first_noisy], axis=1))
    soft, sc_mask = self_conditioning(first)
    h_noisy = noisy_pass(main, streams, noisy_masks, num_clean, clean_kvs, soft, sc_mask)
    return jnp.concatenate([h_clean, h_noisy], axis=1)


__all__ = ["clean_pass", "clean_pass_and_twin", "noisy_pass", "restrict", "split_hidden", "stream_masks"]

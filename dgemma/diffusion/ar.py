"""The `ar` objective's loss: next-token cross-entropy on the clean stream, `ar_loss_fn(model, batch, rng)`.

It lives beside the other objectives' losses (`stage1`: `dgemma.diffusion.stage1`, `sdrl`:
`dgemma.diffusion.sdrl_objective`): the loss math of every `trainer.objective` sits in this package, the train
layer (`dgemma.train.objectives`) names it and `dgemma.train.step` differentiates it. It shares the reduction and the
fused head + CE of the diffusion losses (`dgemma.diffusion.losses`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from dgemma.diffusion.losses import per_example_mean, token_nll_from_hidden
from dgemma.model.masks import full_forward_masks

if TYPE_CHECKING:
    from dgemma.model.transformer import Transformer

__all__ = ["ar_loss_fn"]


def ar_loss_fn(model: Transformer, batch: dict[str, jax.Array],
               rng: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """AR next-token cross-entropy on the clean stream (`tokens` -> `ar_targets`, weights `ar_weight`).

    Reduction: per example, the `ar_weight`-weighted mean NLL over its supervised positions; then the plain mean over
    the examples that have any weight (rows without supervised tokens are excluded rather than counted as 0). This is
    the same reduction as the diffusion losses (`dgemma.diffusion.losses.per_example_mean`, docs/stage1.md §3),
    so AR and diffusion numbers are comparable per example. The head and CE are fused and chunked over tokens
    (`token_nll_from_hidden`), so [B, T, V] fp32 logits are never materialised (268 MB per 256 tokens at V=262k).

    Aux metrics: `ar_accuracy` (token-weighted argmax accuracy) and `ar_tokens` (supervised tokens in the batch).
    """
    del rng
    tokens = batch["tokens"]
    positions = batch.get("positions")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1])[None], tokens.shape)
    valid = batch.get("valid")
    valid = jnp.ones(tokens.shape, bool) if valid is None else valid
    hidden, _ = model.forward(tokens, positions, full_forward_masks(model.cfg, positions, valid))
    nll, correct = token_nll_from_hidden(hidden, model.embedder.embedding[...], batch["ar_targets"],
                                         softcap=model.cfg.final_logit_softcapping or None, with_correct=True)
    weights = batch["ar_weight"].astype(jnp.float32)
    per_example, has = per_example_mean(nll, weights)
    loss = jnp.sum(per_example) / jnp.maximum(jnp.sum(has.astype(jnp.float32)), 1.0)
    n_tokens = jnp.sum(weights)
    accuracy = jnp.sum(correct.astype(jnp.float32) * weights) / jnp.maximum(n_tokens, 1.0)
    return loss, {"ar_accuracy": accuracy, "ar_tokens": n_tokens}

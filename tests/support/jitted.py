"""Jitted entry points of the model for tests that compare whole forwards.

Run eagerly, one tiny-model forward dispatches hundreds of primitives and XLA compiles each distinct one (a parity test
with four decoder calls compiled 446 programs, ~30 s on a 2-core CPU VM); one jitted forward is one program
(~1-2 s). The traced computation is the same model code, so parity tolerances are unchanged. Each call with new shapes
compiles again, as any jit does.
"""

from __future__ import annotations

from flax import nnx


@nnx.jit
def forward(model, tokens, positions=None, valid=None):
    return model(tokens, positions, valid)


@nnx.jit
def encode(model, tokens, cache, valid=None):
    return model.encode(tokens, cache, valid)


@nnx.jit
def decode(model, canvas, cache, sc_logits=None, soft_embeds=None, sc_mask=None, canvas_valid=None):
    return model.decode(canvas, cache, sc_logits=sc_logits, soft_embeds=soft_embeds, sc_mask=sc_mask,
                        canvas_valid=canvas_valid)


@nnx.jit
def logits(model, hidden):
    return model.logits(hidden)


@nnx.jit(static_argnames=("decoder_tokens",))
def stack(model, tokens, positions, masks, embeds=None, cache=None, decoder_tokens=False):
    """The layer stack under explicit masks (Transformer.forward): for tests that swap in a deliberately wrong mask."""
    return model.forward(tokens, positions, masks, embeds=embeds, cache=cache, decoder_tokens=decoder_tokens)

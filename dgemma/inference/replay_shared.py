"""Replay of SD·RL state rows with the clean stream computed once per rollout, not once per row.

The rows of one iteration (`dgemma.train.sdrl.states`) are several recorded steps k of each rollout; all of them
have the same clean stream (prompt + the rollout's committed blocks), and the clean stream is causal and never reads
the noisy one (docs/stage1.md §4). The one-pass replay (`dgemma.inference.replay`) still runs it for every row. Here

    clean pass : the U distinct clean streams (prompt + committed), clean queries over clean keys -> per-layer (k, v)
    noisy pass : every row's noisy stream over [its rollout's clean (k, v) (gathered by `prefix_index`) ; its own keys]

with the one-pass masks restricted to those query and key ranges (`dgemma.diffusion.split_streams`), so every noisy
query attends to exactly the keys it does in the one-pass forward: the same hidden states, log-probabilities and
gradients up to fp32 summation order (the clean pass's gradient is the sum over the rows that read its keys). At the
SD·RL study setting (P 56, 2 blocks of 32, 4 states per rollout) the tokens through the stack fall from 184 per row
to 64 per row + 120 per rollout, and the dense attention scores from 184² to 64·184 per row + 120² per rollout.

    hidden, tau, twin = replay_hidden_shared(model, batch)     # [N, nb, L, H], [N, nb], model or its twin

`batch` holds the per-row `canvas` [N, nb, L], `soft_embeds` [N, nb, L, H] (optional), `tau`, `state_ran` [N, nb]
and the per-rollout prefix: `prefix_prompts` [U, P], `prefix_prompt_valid` [U, P], `prefix_committed` [U, nb, L] and
`prefix_index` [N] (row -> its rollout's prefix row), as `dgemma.train.sdrl.states.shared_prefix_batch` builds them.

With `state_index` [S] in the batch (`shared_prefix_batch(..., ran_only=True)`, dense attention only) the noisy pass
runs only the (row, block) states that ran, each as one block of L queries over [clean keys ; its own L keys]:

    noisy pass : state s = (row n, block b) -> block b's canvas over [row n's rollout's clean (k, v) ; its L keys]

A row's blocks never attend to each other's noisy tokens (docs/stage1.md §4: noisy block b reads clean blocks < b
and its own block), so splitting a row into its blocks changes no query's keys; states that did not run (about 40 %
at the SD·RL study setting: a block that stopped early has no state at a later k) are skipped instead of replayed
at weight 0. `state_index` holds the flat index n·nb + b of each state that ran, padded with N·nb (out of range)
to a bucketed length so few shapes compile; their hidden states land in place and the states not run get zeros
(finite; every loss mask is False there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dgemma.diffusion.split_streams import clean_pass, clean_pass_and_twin, noisy_pass, stream_masks
from dgemma.diffusion.stage1 import one_pass_masks
from dgemma.inference.replay import layout_streams

__all__ = ["PREFIX_FIELDS", "STATE_INDEX", "replay_hidden_shared"]

PREFIX_FIELDS = ("prefix_prompts", "prefix_prompt_valid", "prefix_committed", "prefix_index")
STATE_INDEX = "state_index"  # present: only the states that ran are replayed (module docstring)


def replay_hidden_shared(model, batch: dict, *, share_scan_grads: bool = False):
    """(hidden [N, nb, L, H] of the noisy stream, tempered τ [N, nb] (1 where the state did not run), twin): the
    one-pass replay's values (module docstring). `twin`: the model, or with `share_scan_grads` the clean pass's
    twin, on which the noisy pass ran: a later pass run on it adds its scanned-layer gradient into the same stack."""
    canvas = batch["canvas"]
    N, nb, L = canvas.shape
    index = batch["prefix_index"]
    committed_u = batch["prefix_committed"]
    prompts_u, prompt_valid_u = batch["prefix_prompts"], batch["prefix_prompt_valid"]
    # per-row streams only for their noisy half's tokens, positions and masks (index arrays; no model work)
    rows = layout_streams(committed_u[index], prompts_u[index], prompt_valid_u[index], canvas)
    prefix = layout_streams(committed_u, prompts_u, prompt_valid_u, committed_u)  # its noisy half is never run
    num_clean = rows.tokens.shape[1] - nb * L
    clean_masks, _ = stream_masks(one_pass_masks(model.cfg, prefix, num_clean=num_clean), num_clean)
    if share_scan_grads:
        _, kvs, twin = clean_pass_and_twin(model, prefix, clean_masks, num_clean)
    else:
        (_, kvs), twin = clean_pass(model, prefix, clean_masks, num_clean), model
    soft = batch.get("soft_embeds")
    if STATE_INDEX in batch:
        hidden = _ran_states_hidden(model, twin, rows, kvs, index, batch[STATE_INDEX], soft, num_clean, nb, L)
    else:
        _, noisy_masks = stream_masks(one_pass_masks(model.cfg, rows, num_clean=num_clean), num_clean)
        row_kvs = jax.tree.map(lambda a: a[index], kvs)  # None (KV-shared layers) stays None
        soft = None if soft is None else soft.reshape(N, nb * L, -1)
        hidden = noisy_pass(twin, rows, noisy_masks, num_clean, row_kvs, soft)
    # as `replay.gather_states`: a state the block never ran is replayed at τ 1 (its loss weight is 0)
    tau = jnp.where(batch["state_ran"], batch["tau"], 1.0)
    return hidden.reshape(N, nb, L, -1), tau, twin


def _ran_states_hidden(model, twin, rows, kvs, prefix_index, state_index, soft, num_clean: int, nb: int, L: int):
    """Noisy hidden states [N, nb·L, H] with only the states in `state_index` run (module docstring), zeros
    elsewhere. `rows`: the per-row one-pass streams, from which each state takes its row's clean stream and its
    block's L noisy tokens, so positions, block ids and validity (hence the masks) are the row layout's own."""
    N = rows.tokens.shape[0]
    state_index = jnp.asarray(state_index, jnp.int32)
    flat = jnp.minimum(state_index, N * nb - 1)  # padding entries (N·nb) read the last state and are dropped below
    row, block = flat // nb, flat % nb
    cols = jnp.concatenate([jnp.broadcast_to(jnp.arange(num_clean), (flat.shape[0], num_clean)),
                            num_clean + block[:, None] * L + jnp.arange(L)[None]], axis=1)  # [S, num_clean + L]
    pick = lambda a: None if a is None else jnp.take_along_axis(a[row], cols, axis=1)  # noqa: E731
    states = type(rows)(*(pick(a) for a in rows))
    _, noisy_masks = stream_masks(one_pass_masks(model.cfg, states, num_clean=num_clean), num_clean)
    state_kvs = jax.tree.map(lambda a: a[prefix_index[row]], kvs)
    soft = None if soft is None else soft.reshape(N * nb, L, -1)[flat]
    hidden = noisy_pass(twin, states, noisy_masks, num_clean, state_kvs, soft)  # [S, L, H]
    out = jnp.zeros((N * nb, L, hidden.shape[-1]), hidden.dtype).at[state_index].set(hidden, mode="drop")
    return out.reshape(N, nb * L, -1)

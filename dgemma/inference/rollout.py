"""Rollouts that record their states, for SD·RL (docs/sdrl.md §1, §5). THIS DOCSTRING IS THE CONTRACT.

    from dgemma.inference.rollout import rollout
    ro = rollout(model, prompts, prompt_valid, SamplerConfig(max_steps=16, max_new_tokens=64), key, group_size=8)
    ro.tokens, ro.record, ro.result.steps_per_block, ro.prompt_index

`SamplerConfig(record_states=True)` makes the compiled sampler (the same `while_loop`, the same sharding) also return
`SampleResult.record`, a `RolloutRecord`: every state s_k = (context, canvas x^(k), SC embedding e^(k)) the sampler
visited and the decisions it took from it. Replaying a state through the training forward
(`dgemma.inference.replay`) gives back the sampler's tempered logits at that state.

RolloutRecord (a `flax.struct` pytree of device arrays; nb = blocks run, K = max_steps, B rows, L canvas length,
H hidden size). Step k of block b of row r:

| field | shape, dtype | meaning |
|---|---|---|
| canvas | [nb, K, B, L] int32 | the decoder's INPUT canvas x^(k) (k = 0: the uniform initial canvas) |
| soft_embeds | [nb, K, B, L, H] activation dtype, or None | the self-conditioning soft embedding INPUT e^(k) = softmax(z_{k−1})·E·sqrt(H); exact zeros at k = 0; None if the model has no SC |
| tau | [nb, K, B] f32 | τ_k, the temperature of step k: z_k = logits_k / τ_k |
| accept | [nb, K, B, L] bool | the accept set A_k (EB rule on the entropies of softmax(z_k)) |
| draft | [nb, K, B, L] int32 | argmax z_k (the draft; the committed block is EOS-processed argmax of the last step) |
| proposal | [nb, K, B, L] int32 | the sampled y_k ~ softmax(z_k); canvas x^(k+1) = y_k on A_k, fresh uniform noise elsewhere |
| logp | [nb, K, B, L] f32 | the sampler's own log softmax(z_k)[y_k] of each proposed token, computed in the loop (replay must give it back) |
| mean_entropy | [nb, K, B] f32 | mean over L of the tempered entropy at step k |
| step_ran | [nb, K, B] bool | the row really ran step k of block b (False once it stopped, or when finished before b) |
| tokens | [nb, B, L] int32 | the committed tokens of block b (PAD after the first EOS; all PAD once finished) |
| steps | [nb, B] int32 | decoder forwards of the row in block b (= step_ran.sum over k) |
| stop_reason | [nb, B] int32 | codes into `sampler.STOP_REASONS`: converged / max_steps / eos_finished |
| block_ran | [nb, B] bool | the row took part in block b (had not finished in an earlier block) |

Entries where step_ran is False are meaningless (zeros, or the state of a frozen row). Never V-wide logits: at the
26B shape a state costs L·H·2 B = 1.44 MB of SC embedding plus ~5 L ints, against L·V·4 B = 268 MB of fp32 logits
(see `docs/benchmarks_rollout.md` for the measured figures and why we store the embedding instead of replaying it);
`logp` adds 4 L bytes per state.

The clean context of block b is the prompt (left-padded, `prompt_valid` False on pads, positions 0..P−1 shared by
the batch) followed by the committed `tokens` of blocks < b at positions P + b'·L, all valid: that is what the
sampler's cache held when it denoised block b. Only algorithm="eb" with mode="diffusion" records.

`rollout(...)` repeats each of Q prompts G times (row r = prompt r // G, copy r % G); row r's key is
fold_in(key, r), so the G copies draw different canvases, samples and renoise tokens, and the same key gives the same
rollouts. A teacher rollout is the same call with its own settings, e.g.
`scfg.replace(greedy=True, stability_threshold=2, entropy_bound=0.02, max_steps=2 * K)` (deterministic given its key).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from dgemma.inference.record import RolloutRecord
from dgemma.inference.sampler import SampleResult, SamplerConfig, sample

__all__ = ["Rollout", "RolloutRecord", "rollout", "repeat_prompts"]


@dataclasses.dataclass
class Rollout:
    """G rollouts per prompt. tokens [Q·G, T] numpy; prompts / prompt_valid [Q·G, P] (the repeated prompts, device);
    prompt_index [Q·G] numpy (r // G); record: RolloutRecord; result: the full `SampleResult` (per-row metrics:
    tpf(_total), decoder_passes, steps_per_block [B, nb], stop_reason [B, nb], entropy_trace)."""

    tokens: np.ndarray
    prompts: jnp.ndarray
    prompt_valid: jnp.ndarray
    prompt_index: np.ndarray
    group_size: int
    record: RolloutRecord
    result: SampleResult

    @property
    def steps_per_block(self) -> np.ndarray:
        return self.result.steps_per_block

    @property
    def stop_reason(self) -> np.ndarray:
        return self.result.stop_reason


def repeat_prompts(prompts, prompt_valid, group_size: int):
    """[Q, P] -> [Q·G, P], each prompt repeated G times consecutively (row r = prompt r // G)."""
    if group_size < 1:
        raise ValueError(f"rollout: group_size must be >= 1, got {group_size}")
    prompts = jnp.asarray(prompts, jnp.int32)
    if prompts.ndim != 2:
        raise ValueError(f"rollout: prompts must be [Q, P], got shape {prompts.shape}")
    valid = jnp.ones(prompts.shape, bool) if prompt_valid is None else jnp.asarray(prompt_valid, bool)
    if valid.shape != prompts.shape:
        raise ValueError(f"rollout: prompt_valid shape {valid.shape} != prompts shape {prompts.shape}")
    return jnp.repeat(prompts, group_size, axis=0), jnp.repeat(valid, group_size, axis=0)


def rollout(model, prompts, prompt_valid, scfg: SamplerConfig, key, group_size: int = 1, *, row_offset: int = 0,
            mesh=None, rules="fsdp") -> Rollout:
    """Sample `group_size` recorded rollouts of each prompt with distinct per-row keys (see module docstring).

    row_offset: row r uses fold_in(key, row_offset + r) (to keep keys distinct across calls with one base key).
    """
    rep, valid = repeat_prompts(prompts, prompt_valid, group_size)
    B = rep.shape[0]
    res = sample(model, rep, valid, scfg.replace(record_states=True, mode="diffusion"), key, mode="diffusion",
                 row_ids=np.arange(row_offset, row_offset + B), mesh=mesh, rules=rules)
    return Rollout(tokens=res.tokens, prompts=rep, prompt_valid=valid,
                   prompt_index=np.arange(B, dtype=np.int32) // group_size, group_size=group_size,
                   record=res.record, result=res)

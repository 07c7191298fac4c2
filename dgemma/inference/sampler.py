"""DiffusionGemma block sampler: compiled entropy-bounded renoise loop, exact ancestral option, AR fallback.

    from dgemma.inference.sampler import SamplerConfig, sample
    res = sample(model, prompts, prompt_valid, SamplerConfig(max_new_tokens=64), jax.random.key(0), mode="auto")
    res.tokens, res.tpf, res.stop_reason_names()

Algorithm (transformers' `DiffusionGemmaGenerationMixin.generate`, docs/sampler.md §1; decisions made exactly as
there, see `eb_accept`):

    prefill: encode the (left-padded) prompt into the KV cache
    for each block b (n_blocks = ceil(max_new_tokens / L)):
        canvas ~ Unif(V)^L; SC soft embedding = 0; done = False; argmax history = −1
        for step = K_max … 1 (at most K_max = max_steps decoder forwards):
            passes += not (done or finished)
            z = decoder(canvas, cache, SC) / τ(step);   τ = t_min + (t_max − t_min)·step/K_max
            x̂ ~ softmax(z), a = argmax z, H = entropy(softmax z)
            accept = EB(H, γ);  canvas' = x̂ where accepted, fresh uniform noise elsewhere
            rows already done are frozen (a, canvas, SC unchanged)
            done |= (a equals the last S argmaxes, or S = 0) and mean H < c
            SC = soft_embed(z)  (softmax(z)·E·sqrt(H): the [B, L, H] embedding is carried, never V-wide logits)
            stop when every row is done
        commit the ARGMAX canvas; rows finished earlier -> all PAD; in rows with an EOS keep the first EOS, PAD after
        encode the committed canvas into the cache (the decoder never writes it); stop when every row is finished

Engineering (docs/sampler.md §6):
- One block = one jitted call: the denoising loop is a `jax.lax.while_loop` over a typed `LoopState` whose body is
  the model call, the draws and `eb_accept.eb_step` (every per-step decision), followed by EOS processing and the
  commit (an encoder pass, or `ar.decode_loop`, the package's one AR loop). The cache stays on device; the host sees
  each block's tokens once (`on_block(block_idx, tokens)`) and stops when every row is finished. With
  `record_states` the loop also fills a `record.StepRecord` (`dgemma.inference.rollout`).
- Per-row RNG: row r's key is fold_in(key, row_ids[r]); per block fold_in(·, block), per step fold_in(·, step + 1)
  (split into sample / renoise keys); fold_in(·, 0) draws the initial canvas. A row's tokens therefore do not depend
  on the rest of the batch (up to XLA's batch-size-dependent rounding).
- Sharding: pass `mesh` (and `rules`): parameters are placed with `dgemma.parallel.rules.state_shardings`, the batch
  on ('data', 'fsdp'); the same jitted code runs on one device or on a mesh.
- Test hook: `draws` replays externally recorded randomness (initial canvases, per-step sampled tokens and renoise
  tokens, optionally the entropy sort order, e.g. recorded from transformers' global torch RNG and torch.sort; see
  `InjectedDraws.from_hf_stream`).

Modes (per request, or per row): "diffusion"; "ar" (the same weights decode causally: `dgemma.inference.ar`);
"auto" (a block that hits max_steps without meeting the stop rule drops its draft and is decoded autoregressively on
the same cache, then diffusion continues). See docs/sampler.md §4. A block with AR rows is decoded one token at
a time for the whole batch, teacher-forcing the committed diffusion tokens of the other rows, so the cache always
holds exactly the committed tokens. (The ancestral algorithm has no stop rule: under "auto" every block falls back.)

Differences from transformers, all output-neutral:
- HF keeps denoising rows that finished in earlier blocks (their output is replaced by PAD and their passes are not
  counted) and waits for them in its "all done" test; here they do not hold the loop unless
  `wait_for_finished_rows=True` (needed only to consume an injected HF draw stream step for step).
- The last committed canvas is also encoded, so the returned cache holds prompt + every generated block.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from dgemma.inference import eb_accept
from dgemma.inference.ancestral import ancestral_block_step
from dgemma.inference.ar import decode_loop, row_keys_of
from dgemma.inference.batches import batch_shards, global_rows, pad_rows, take_rows
from dgemma.inference.record import StepRecord, stack_blocks
from dgemma.model.cache import KVCache

__all__ = ["SamplerConfig", "SampleResult", "InjectedDraws", "STOP_REASONS", "sample", "finalize_canvas"]

from dgemma.inference.draws import InjectedDraws  # noqa: E402,F401  (re-exported)
from dgemma.inference.eos import finalize_canvas  # noqa: E402,F401  (re-exported)
from dgemma.inference.sampler_types import (  # noqa: E402,F401  (re-exported)
    _DYNAMIC_FIELDS, AR_FALLBACK, CONVERGED, EOS_FINISHED, MAX_STEPS, MODES, STOP_REASONS, Mode, SampleResult,
    SamplerConfig)


# MARK: compiled pieces ------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("graphdef", "capacity"))
def _prefill(graphdef, state, prompt, prompt_valid, *, capacity):
    model = nnx.merge(graphdef, state)
    cache = KVCache.init(model.cfg, prompt.shape[0], capacity)
    hidden, cache = model.encode(prompt, cache, prompt_valid)
    return cache, hidden[:, -1]


def _fold_rows(keys, data):
    return jax.vmap(jax.random.fold_in)(keys, jnp.broadcast_to(jnp.asarray(data, jnp.uint32), keys.shape))


@struct.dataclass
class LoopState:
    """The carry of the per-block denoising while_loop (one row per batch element)."""

    step: jax.Array  # [] int32 loop iteration i (HF's cur_step = K_max − i)
    canvas: jax.Array  # [B, L] decoder input of the next step
    soft_embeds: jax.Array  # [B, L, H] self-conditioning soft embedding (zero before the first step)
    history: jax.Array  # [max(S, 1), B, L] last S drafts (stability test)
    draft: jax.Array  # [B, L] argmax of the last executed step (frozen once done): the block's output
    done: jax.Array  # [B] the stop rule fired
    passes: jax.Array  # [B] decoder forwards while active
    commit: jax.Array  # [B, L] 1-based step at which each position took its final draft value
    entropy: jax.Array  # [B, K] mean tempered entropy per step (NaN while inactive)
    last_entropy: jax.Array  # [B] mean entropy of the row's last active step
    drafts: jax.Array | None  # [K, B, L] draft after every step (record_drafts)
    record: StepRecord | None  # visited states (record_states)


def _denoise(model, cache, finished, skip, block_keys, dyn, draws, scfg: SamplerConfig) -> LoopState:
    """The per-block while_loop; returns the final `LoopState`."""
    cfg = model.cfg
    B = finished.shape[0]
    L, V, Hd = cfg.canvas_length, cfg.vocab_size, cfg.hidden_size
    K, S = scfg.max_steps, scfg.stability_threshold
    act_dtype = jnp.dtype(cfg.execution.dtype)
    emb_dtype = jnp.dtype(cfg.execution.param_dtype)
    ancestral = scfg.algorithm == "ancestral"

    if draws is not None:
        canvas0 = draws["init"].astype(jnp.int32)
    else:
        canvas0 = jax.vmap(lambda k: jax.random.randint(jax.random.fold_in(k, 0), (L,), 0, V, jnp.int32))(block_keys)
    # rows that never block the exit test: AR rows always; finished rows unless HF's waiting semantics are asked
    nonblocking = skip if scfg.wait_for_finished_rows else (skip | finished)
    has_sc = getattr(model, "self_conditioning", None) is not None
    init = LoopState(
        step=jnp.int32(0), canvas=canvas0, soft_embeds=jnp.zeros((B, L, Hd), act_dtype),
        history=jnp.full((max(S, 1), B, L), -1, jnp.int32), draft=canvas0, done=jnp.zeros((B,), bool),
        passes=jnp.zeros((B,), jnp.int32), commit=jnp.zeros((B, L), jnp.int32),
        entropy=jnp.full((B, K), jnp.nan, jnp.float32), last_entropy=jnp.zeros((B,), jnp.float32),
        drafts=jnp.zeros((K, B, L), jnp.int32) if scfg.record_drafts else None,
        record=StepRecord.init(K, B, L, Hd if has_sc else None, act_dtype) if scfg.record_states else None)

    def cond(c: LoopState):
        return (c.step < K) & ~jnp.all(c.done | nonblocking)

    def body(c: LoopState) -> LoopState:
        i = c.step
        active = ~(c.done | finished | skip)
        logits = model.logits(model.decode(c.canvas, cache, soft_embeds=c.soft_embeds))  # [B, L, V] fp32
        step_keys = _fold_rows(block_keys, i + 1)
        if ancestral:
            tau = dyn["ancestral_temperature"]
            z = logits / tau
            new_canvas, x0 = ancestral_block_step(step_keys, logits, c.canvas, i, K, temperature=tau,
                                                  greedy=scfg.greedy)
            mean_h = jnp.mean(eb_accept.token_entropy(z), axis=-1)
            draft = jnp.where(c.done[:, None], c.draft, x0)
            new_canvas = jnp.where(c.done[:, None], c.canvas, new_canvas)
            dec = None
            done, history = c.done, c.history  # fixed number of steps
        else:
            tau, z, proposal, dec = eb_accept.eb_denoise_step(
                logits, step_keys, i, c.canvas, c.draft, c.done, c.history, dyn, vocab_size=V, max_steps=K,
                accept_rule=scfg.accept, greedy=scfg.greedy, sampling=scfg.sampling, stability=S, draws=draws)
            draft, new_canvas, mean_h, done, history = dec.draft, dec.canvas, dec.mean_entropy, dec.done, dec.history
        # frozen rows keep their SC embedding (HF keeps their previous logits)
        soft_embeds = jnp.where(c.done[:, None, None], c.soft_embeds,
                                model.soft_embed(z.astype(emb_dtype)).astype(act_dtype))
        changed = (i == 0) | (draft != c.draft)
        record = c.record
        if record is not None:  # EB only (checked in `sample`): the state's inputs and the decisions made from it
            assert dec is not None  # (EB's step returns its decisions)
            logp = jnp.take_along_axis(z, proposal[..., None].astype(jnp.int32), -1)[..., 0] - jax.nn.logsumexp(z, -1)
            record = record.write(i, canvas=c.canvas, soft_embeds=c.soft_embeds, tau=tau, accept=dec.accept,
                                  draft=dec.argmax, proposal=proposal, logp=logp, mean_entropy=mean_h, active=active)
        return LoopState(
            step=i + 1, canvas=new_canvas, soft_embeds=soft_embeds, history=history, draft=draft, done=done,
            passes=c.passes + active.astype(jnp.int32),
            commit=jnp.where(changed & active[:, None], i + 1, c.commit),
            entropy=c.entropy.at[:, i].set(jnp.where(active, mean_h, jnp.nan)),
            last_entropy=jnp.where(active, mean_h, c.last_entropy),
            drafts=None if c.drafts is None else c.drafts.at[i].set(draft), record=record)

    final = jax.lax.while_loop(cond, body, init)
    if final.drafts is not None:  # steps after the loop ended show the committed draft (what a streamer displays)
        after = jnp.arange(K)[:, None, None] >= final.step
        final = dataclasses.replace(final, drafts=jnp.where(after, final.draft[None], final.drafts))
    # EB commits the argmax of the last executed step; ancestral commits its final canvas (= x̂0 of the last step)
    return final


@functools.partial(jax.jit, static_argnames=("graphdef", "scfg", "use_ar"), donate_argnames=("cache",))
def _run_block(graphdef, state, cache, last_hidden, finished, row_keys, force_ar, auto_rows, block_idx, is_last,
               dyn, eos_arr, pad_id, draws, *, scfg, use_ar):
    model = nnx.merge(graphdef, state)
    block_keys = _fold_rows(row_keys, block_idx)
    loop = _denoise(model, cache, finished, force_ar, block_keys, dyn, draws, scfg)
    tokens, _ = finalize_canvas(loop.draft, finished, eos_arr, pad_id, is_last)
    ar_rows = jnp.zeros_like(finished)
    ar_fwd = jnp.zeros(finished.shape, jnp.int32)
    if use_ar:
        failed = eb_accept.needs_fallback(loop.done, loop.last_entropy, dyn["auto_entropy_threshold"])
        ar_rows = ~finished & (force_ar | (auto_rows & failed))

        def with_ar(args):  # the one AR loop (`ar.decode_loop`); keys continue after the block's K steps
            cache, last_hidden = args
            return decode_loop(model, cache, last_hidden, tokens.shape[1], block_keys, dyn["ar_temperature"],
                               eos_arr, pad_id, key_offset=scfg.max_steps + 1, forced=tokens, ar_rows=ar_rows,
                               finished=finished, stop_when_done=False)

        def commit_only(args):
            cache, _ = args
            hidden, cache = model.encode(tokens, cache)
            return tokens, cache, hidden[:, -1], jnp.zeros(finished.shape, jnp.int32)

        tokens, cache, last_hidden, ar_fwd = jax.lax.cond(jnp.any(ar_rows), with_ar, commit_only,
                                                          (cache, last_hidden))
    else:
        hidden, cache = model.encode(tokens, cache)
        last_hidden = hidden[:, -1]
    tokens, new_finished = finalize_canvas(tokens, finished, eos_arr, pad_id, is_last)
    reason = jnp.where(finished, EOS_FINISHED,
                       jnp.where(ar_rows, AR_FALLBACK, jnp.where(loop.done, CONVERGED, MAX_STEPS)))
    metrics = dict(passes=loop.passes, ar_forwards=ar_fwd, reason=reason.astype(jnp.int32),
                   entropy=loop.entropy, commit=jnp.where(ar_rows[:, None], 0, loop.commit), steps_run=loop.step,
                   active=~finished)
    if loop.drafts is not None:
        metrics["drafts"] = loop.drafts
    if loop.record is not None:
        metrics["record"] = loop.record
    return tokens, new_finished, cache, last_hidden, metrics


# MARK: public entry point ---------------------------------------------------------------------------------------


def _row_modes(mode, default: str, batch: int) -> tuple[str, ...]:
    mode = default if mode is None else mode
    modes = (mode,) * batch if isinstance(mode, str) else tuple(mode)
    if len(modes) != batch:
        raise ValueError(f"sample: got {len(modes)} modes for a batch of {batch}")
    bad = sorted({m for m in modes if m not in MODES})
    if bad:
        raise ValueError(f"sample: unknown mode(s) {bad}; expected one of {MODES}")
    return modes


def _row_keys(key, row_ids, batch: int):
    """Row r's key: fold_in(key, row_ids[r]) (default ids arange(B)); [B] keys are taken as they are."""
    return row_keys_of(key, batch, row_ids)


def _place(model, arrays, mesh, rules):
    """Shard parameters (rules) and the batch dimension of `arrays` on ('data', 'fsdp')."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from dgemma.parallel.rules import get_rules, state_shardings

    graphdef, state = nnx.split(model)
    state = jax.device_put(state, state_shardings(state, mesh, get_rules(rules)))
    batch_axes = tuple(a for a in ("data", "fsdp") if a in mesh.axis_names)

    def put(x):  # across processes too: every process holds the whole batch
        return global_rows(x, NamedSharding(mesh, P(batch_axes, *([None] * (x.ndim - 1)))))

    return graphdef, state, [put(a) for a in arrays]


def _ar_only(model, prompt, valid, cfg: SamplerConfig, keys, eos, pad_id, modes, mesh, rules) -> SampleResult:
    """mode="ar" for every row: `dgemma.inference.ar.generate` (exact token budget, the same per-row keys)."""
    from dgemma.inference import ar

    kw = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.ar_temperature, eos_ids=eos, pad_id=pad_id)
    if mesh is not None:
        graphdef, state, (prompt, valid, keys) = _place(model, [prompt, valid, keys], mesh, rules)
        with jax.set_mesh(mesh):
            out = ar.generate(nnx.merge(graphdef, state), prompt, valid, key=keys, **kw)
    else:
        out = ar.generate(model, prompt, valid, key=keys, **kw)
    tokens = np.asarray(out)
    B, T = tokens.shape
    is_eos = np.isin(tokens, eos)
    first = np.where(is_eos.any(1), is_eos.argmax(1) + 1, T)  # forwards while active
    non_pad = (tokens != pad_id).sum(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        tpf = non_pad / first
    empty = np.zeros((B, 0), np.int32)
    return SampleResult(tokens=tokens, tpf=tpf, tpf_total=tpf,
                        decoder_passes=np.zeros(B, np.int32), ar_forwards=first.astype(np.int32),
                        commit_passes=np.zeros(B, np.int32), steps_per_block=empty, stop_reason=empty,
                        entropy_trace=np.zeros((B, 0, cfg.max_steps), np.float32),
                        commit_step=np.zeros((B, 0, model.cfg.canvas_length), np.int32),
                        steps_run=np.zeros(0, np.int32), mode=modes)


def _to_host(tree):
    """`tree` on the host, whole. Arrays sharded over devices of other processes (the model keeps activations on the
    batch axes, dgemma.model.activation_sharding; multi-host meshes put the batch over processes) are gathered from
    every process; every process runs the same blocks, so the collective is entered in the same order everywhere."""
    from jax.experimental import multihost_utils

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return jax.device_get(x)

    return jax.tree.map(one, tree)


def sample(model, prompts, prompt_valid=None, cfg: SamplerConfig | None = None, key=None, mode=None, *,
           row_ids=None, draws: InjectedDraws | None = None, on_block: Callable[[int, np.ndarray], None] | None = None,
           mesh=None, rules="fsdp") -> SampleResult:
    """Generate continuations of left-padded `prompts` [B, P] (valid mask [B, P], False on pads).

    Args:
      model: a `dgemma.model.transformer.Transformer` (DiffusionGemma weights; "ar" also works on a plain AR model).
      prompts, prompt_valid: int [B, P] and bool [B, P]; positions are absolute and shared by the batch.
      cfg: SamplerConfig (defaults: DiffusionGemma's).
      key: base PRNG key (or [B] per-row keys); row r uses fold_in(key, row_ids[r]), in every mode.
      mode: "diffusion" | "ar" | "auto", or one per row; defaults to cfg.mode.
      row_ids: stable per-request ids for the RNG (default arange(B)).
      draws: InjectedDraws replaying external randomness (tests; EB algorithm only).
      on_block: streaming callback, called with (block_idx, tokens [B, L] numpy) after each committed block
        (not called when every row is "ar": that path is `ar.generate`, one call).
      mesh, rules: run sharded: parameters by `rules`, batch on ('data', 'fsdp') (rows padded to whole shards with
        copies of the last row, dropped from the result: `dgemma.inference.batches`).
    """
    cfg = SamplerConfig() if cfg is None else cfg
    mcfg = model.cfg
    prompts = jnp.asarray(prompts, jnp.int32)
    B, P = prompts.shape
    valid = jnp.ones((B, P), bool) if prompt_valid is None else jnp.asarray(prompt_valid, bool)
    eos = tuple(mcfg.eos_token_id if cfg.eos_ids is None else cfg.eos_ids)
    pad_id = int(mcfg.pad_token_id if cfg.pad_id is None else cfg.pad_id)
    modes = _row_modes(mode, cfg.mode, B)
    if draws is not None and (cfg.algorithm != "eb" or any(m != "diffusion" for m in modes)):
        raise ValueError("sample: injected draws replay the EB diffusion sampler only")
    if cfg.record_states and (cfg.algorithm != "eb" or any(m != "diffusion" for m in modes)):
        raise ValueError(f"sample: record_states needs algorithm='eb' and mode='diffusion' on every row, got "
                         f"algorithm={cfg.algorithm!r}, modes={sorted(set(modes))}")

    keys = _row_keys(key, row_ids, B)
    if mesh is not None and (extra := -B % batch_shards(mesh)):  # whole shards: decode copies of the last row too
        if draws is not None or cfg.record_states:
            raise ValueError(f"sample: {B} rows do not split over the mesh's {batch_shards(mesh)} batch shards; "
                             f"injected draws and record_states need a multiple")
        res = sample(model, pad_rows(prompts, extra), pad_rows(valid, extra), cfg, pad_rows(keys, extra),
                     modes + modes[-1:] * extra, mesh=mesh, rules=rules,
                     on_block=None if on_block is None else (lambda b, t: on_block(b, t[:B])))
        return take_rows(res, B)
    if all(m == "ar" for m in modes):
        return _ar_only(model, prompts, valid, cfg, keys, eos, pad_id, modes, mesh, rules)

    L, K = mcfg.canvas_length, cfg.max_steps
    n_blocks = math.ceil(cfg.max_new_tokens / L)
    force_ar = jnp.asarray([m == "ar" for m in modes])
    auto_rows = jnp.asarray([m == "auto" for m in modes])
    use_ar = any(m != "diffusion" for m in modes)
    finished = jnp.zeros((B,), bool)
    if mesh is not None:
        graphdef, state, (prompts, valid, keys, force_ar, auto_rows, finished) = _place(
            model, [prompts, valid, keys, force_ar, auto_rows, finished], mesh, rules)
    else:
        graphdef, state = nnx.split(model)
    dyn = cfg.dynamic_part()
    scfg = cfg.static_part()
    eos_arr = jnp.asarray(eos, jnp.int32)

    def run():
        cache, last_hidden = _prefill(graphdef, state, prompts, valid, capacity=P + n_blocks * L)
        fin = finished
        outs, recs = [], []
        for b in range(n_blocks):
            blk_draws = None if draws is None else draws.block(b, B, L, K)
            tokens, fin, cache, last_hidden, m = _run_block(
                graphdef, state, cache, last_hidden, fin, keys, force_ar, auto_rows, jnp.int32(b),
                jnp.asarray(b == n_blocks - 1), dyn, eos_arr, jnp.int32(pad_id), blk_draws, scfg=scfg, use_ar=use_ar)
            if "record" in m:
                recs.append(m.pop("record"))  # stays on device
            host = _to_host((tokens, fin, m))  # the one host transfer per block
            outs.append(host)
            if on_block is not None:
                on_block(b, host[0])
            if bool(np.all(host[1])):
                break
        return outs, recs, cache

    if mesh is not None:
        with jax.set_mesh(mesh):
            outs, recs, cache = run()
    else:
        outs, recs, cache = run()
    res = _assemble(outs, cache, cfg, pad_id, modes)
    if recs:
        res.record = stack_blocks(recs, [o[0] for o in outs], [o[2]["passes"] for o in outs],
                                  [o[2]["reason"] for o in outs], [o[2]["active"] for o in outs])
    return res


def _assemble(outs, cache, cfg: SamplerConfig, pad_id: int, modes) -> SampleResult:
    tokens = np.concatenate([o[0] for o in outs], axis=1).astype(np.int32)
    ms = [o[2] for o in outs]
    steps = np.stack([m["passes"] for m in ms], axis=1).astype(np.int32)
    ar_fwd = np.stack([m["ar_forwards"] for m in ms], axis=1).sum(1).astype(np.int32)
    active = np.stack([m["active"] for m in ms], axis=1)
    dec = steps.sum(1).astype(np.int32)
    commits = np.maximum(active.sum(1) - 1, 0).astype(np.int32)
    non_pad = (tokens != pad_id).sum(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        tpf = non_pad / (dec + ar_fwd)
        tpf_total = non_pad / (dec + ar_fwd + commits)
    return SampleResult(
        tokens=tokens, tpf=tpf, tpf_total=tpf_total, decoder_passes=dec,
        ar_forwards=ar_fwd, commit_passes=commits, steps_per_block=steps,
        stop_reason=np.stack([m["reason"] for m in ms], axis=1).astype(np.int32),
        entropy_trace=np.stack([m["entropy"] for m in ms], axis=1).astype(np.float32),
        commit_step=np.stack([m["commit"] for m in ms], axis=1).astype(np.int32),
        steps_run=np.asarray([m["steps_run"] for m in ms], np.int32), mode=tuple(modes),
        drafts=np.stack([m["drafts"] for m in ms]) if cfg.record_drafts else None, cache=cache)


# MARK: the block step as a pure function (for jax.export artifacts) ---------------------------------------------


def block_function(model, cfg: SamplerConfig):
    """The sampler's per-block program (diffusion rows) as a pure function of plain arrays, for `jax.export`.

    Returns (fn, prefill, params) where
      fn(params, cache, last_hidden, finished, row_key_data [B, 2] u32, block_idx i32, is_last bool)
        -> (tokens [B, L], finished, cache, last_hidden)
    runs exactly the code `sample` runs for a block (denoising while_loop + EOS processing + commit encoder pass);
    prefill(params, prompts, valid, capacity) -> (cache, last_hidden) is its prompt prefill. `params` is the model
    state as a flat {"layers.0.attn.q_proj": array} dict, `cache` the KV cache as a tuple (keys, values, valid, length) -- plain pytrees that
    `jax.export` can serialise. Row keys are `row_key_data(key, B)`, as `sample` derives them.
    """
    mcfg = model.cfg
    graphdef, state = nnx.split(model)
    eos = jnp.asarray(tuple(mcfg.eos_token_id if cfg.eos_ids is None else cfg.eos_ids), jnp.int32)
    pad_id = jnp.int32(mcfg.pad_token_id if cfg.pad_id is None else cfg.pad_id)
    dyn, scfg = cfg.dynamic_part(), cfg.static_part()

    # flat {"layers.0.attn.q_proj": array} params: jax.export serialises only string-keyed dicts
    paths = {".".join(map(str, p)): (tuple(p), v) for p, v in nnx.to_flat_state(state)}

    def rebuild(params):
        return nnx.from_flat_state([(path, var.replace(params[name])) for name, (path, var) in paths.items()])

    def fn(params, cache, last_hidden, finished, row_key_data, block_idx, is_last):
        keys = jax.random.wrap_key_data(row_key_data)
        no = jnp.zeros(finished.shape, bool)
        # the function jax.jit wrapped (its `__wrapped__`, which jax's types do not declare): traced in `fn`
        tokens, fin, kv, last_hidden, _ = inspect.unwrap(_run_block)(
            graphdef, rebuild(params), KVCache(*cache), last_hidden, finished, keys, no, no, block_idx, is_last, dyn,
            eos, pad_id, None, scfg=scfg, use_ar=False)
        return tokens, fin, (kv.keys, kv.values, kv.valid, kv.length), last_hidden

    def prefill(params, prompts, valid, capacity):
        kv, last_hidden = _prefill(graphdef, rebuild(params), prompts, valid, capacity=capacity)
        return (kv.keys, kv.values, kv.valid, kv.length), last_hidden

    # get_raw_value: also for an abstract model (`nnx.eval_shape`: ShapeDtypeStruct leaves), as the planner compiles it
    return fn, prefill, {name: var.get_raw_value() for name, (_, var) in paths.items()}


def row_key_data(key, batch: int, row_ids=None):
    """Raw per-row key data exactly as `sample` derives the row keys (fold_in(key, row_id))."""
    return jax.random.key_data(_row_keys(key, row_ids, batch))

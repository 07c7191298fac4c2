"""One SD·RL iteration (docs/sdrl.md §5): what one trainer step of `trainer.objective=sdrl` does.

Per iteration i (keys are fold_in(seed key, i), so a run is a pure function of (config, checkpoint)):
  1. Q = data.batch_size prompts (global) from the data stream (position i); G student rollouts each with the run's
     sampler at the curriculum's K_max, recording every visited state (`dgemma.inference.rollout`).
  2. one greedy teacher rollout per prompt (frozen stage-1 weights or the EMA, its own sampler, or its greedy AR
     decode per `sdrl.teacher_decoding`: `teacher`); verifier rewards (task rewards or `sdrl.reward`); targets y*
     and gates (`targets`). With `sdrl.sd_target=coupled_teacher` the teacher also decodes every student rollout's
     own noise (`teacher.coupled_teacher_tokens`): one SD target per rollout.
  3. group-normalised advantages; the state rows (`states.StateRows`); log π_old (the student before any update) and
     log π_ref (or the reference logits for the exact KL) by the training forward, without gradient.
  4. μ = `sdrl.inner_epochs` passes over `sdrl.num_minibatches` shuffled minibatches: one AdamW step each on (4.2)
     (`dgemma.train.step.make_train_step` with `loss.make_sdrl_loss_fn`).
The session around it (`dgemma.train.sdrl.session.SDRLSession`) holds the reference, the EMA and the curriculum.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dgemma.diffusion import sdrl_objective as so
from dgemma.parallel.memory import DeviceCopy
from dgemma.train.sdrl import metrics as metrics_lib
from dgemma.train.sdrl.anchor import anchor_rows
from dgemma.train.sdrl.loss import ANCHOR_PREFIX, RETENTION_PREFIX
from dgemma.train.sdrl.retention import RetentionStream
from dgemma.train.sdrl.states import (COUPLED_TARGET, REPLAY_FIELDS, build_state_rows, committed_blocks, minibatches,
                                      pad_rows, ran_states_apply, sd_teacher_share, shared_prefix_batch)
from dgemma.train.sdrl.targets import TEACHER, anchor_targets, build_targets, coupled_targets

if TYPE_CHECKING:
    from dgemma.config import RunConfig

__all__ = ["Iteration", "SDRL_STREAM", "load_reward_fn"]

SDRL_STREAM = 2  # fold_in constant: iteration keys never collide with the stage-1 noise keys of the same seed


class Iteration:
    """Everything one iteration needs that does not change between iterations."""

    # False: π_old and π_ref as two separate jitted passes, the previous implementation, kept so that
    # experiments/bench_sdrl_iteration.py --compare can time both and check they give bit-identical results
    fused_old_ref = True
    # False: every state row replays its rollout's clean stream (prompt + committed blocks) itself, the previous
    # implementation; True: once per distinct clean stream (`states.shared_prefix_batch`,
    # `dgemma.inference.replay_shared`): the same values up to fp32 summation order
    shared_prefix = True
    # False: every (row, block) state is replayed, those that did not run at weight 0, the previous implementation;
    # True (with `shared_prefix`, dense attention only): only the states that ran (`replay_shared`, `state_index`)
    ran_states_only = True

    def __init__(self, cfg: RunConfig, data, graphdef, step_fn, mesh, reward_fn, reference_kind: str, reference_graphdef=None):
        from dgemma.train.sdrl.teacher import teacher_sampler

        self.cfg, self.data, self.graphdef, self.step_fn, self.mesh = cfg, data, graphdef, step_fn, mesh
        self.reward_fn = reward_fn
        mc = cfg.model_config
        self.L = mc.canvas_length
        self.n_blocks = cfg.data.layout.n_blocks
        self.max_new = self.n_blocks * self.L
        self.eos, self.pad = tuple(mc.eos_token_id), int(mc.pad_token_id)
        self.ran_only_layout = ran_states_apply(mc.execution.attention_impl)
        # what a response ends on is the tokenizer's EOS, as in the stage-1 canvases: the same id as the model's first
        # eos_token_id, except for chat data, whose answers end on <turn|> (dgemma.data.tokenizer.HFTokenizer(chat))
        self.response_eos = int(data.tokenizer.eos_id)
        self.tail = self.response_eos if cfg.data.layout.tail_fill == "eos" else self.pad
        self.teacher_cfg = teacher_sampler(cfg, self.max_new)
        self.n_batch = math.prod(mesh.shape[a] for a in ("data", "fsdp"))
        self.multiple = self.n_batch * cfg.sdrl.num_minibatches
        from dgemma.train.step import batch_sharding

        self.bsh = batch_sharding(mesh)
        self.reference_kind = reference_kind  # where the reference lives between iterations (HOST or DEVICE)
        # the reference's (and frozen teacher's) graph: the adapters-off base model with lora, else the student's
        self.ref_graphdef = graphdef if reference_graphdef is None else reference_graphdef
        # sdrl.retention_mix: stage-1 rows of tasks outside the SD·RL stream, a term of their own (`retention`)
        self.retention = RetentionStream(cfg, data.tokenizer) if cfg.sdrl.retention_mix else None
        self._logp = jax.jit(self._logp_impl, static_argnames=("full", "ref"))
        self._old_ref = jax.jit(self._old_ref_impl, static_argnames=("ref",))

    def _logp_impl(self, params, rows, *, full: bool, ref: bool = False):
        from dgemma.train.sdrl.loss import state_logits, state_logprobs

        model = nnx.merge(self.ref_graphdef if ref else self.graphdef, params)
        return state_logits(model, rows) if full else state_logprobs(model, rows, rows["output"])

    def _old_ref_impl(self, params, ref_params, rows, *, ref: str):
        """log π_old(o) and, per `ref` ("logits" | "logp" | "none"), the reference's logits / log π_ref(o) at the
        same rows: one program, so the rows go to the devices once and the layout and masks, which do not depend on
        the weights, are built once for both forwards."""
        old = self._logp_impl(params, rows, full=False)
        if ref == "none":
            return old, None
        return old, self._logp_impl(ref_params, rows, full=ref == "logits", ref=True)

    def _no_grad(self, params, rows, *, full=False, ref=False):
        """log π(o) [N, nb, L] (or the logits, `full`) at every row, in minibatch-sized chunks."""
        from dgemma.parallel.mesh import use_mesh

        n = len(rows)
        size = n // self.cfg.sdrl.num_minibatches
        outs = []
        for s in range(0, n, size):
            chunk = self._fed(rows.take(slice(s, s + size)), (*REPLAY_FIELDS, "output"))
            with use_mesh(self.mesh):
                outs.append(np.asarray(self._logp(params, self._global(chunk), full=full, ref=ref)))
        return np.concatenate(outs, 0)

    def _old_and_ref(self, params, ref_params, rows, ref: str):
        """(log π_old [N, nb, L], the reference's [N, nb, L(, V)] or None) in minibatch-sized chunks, both from one
        jitted call per chunk (`_old_ref_impl`)."""
        from dgemma.parallel.mesh import use_mesh

        n = len(rows)
        size = n // self.cfg.sdrl.num_minibatches
        olds: list[np.ndarray] = []
        refs: list[np.ndarray] = []  # (none with ref == "none": `_old_ref_impl` returns None for it)
        for s in range(0, n, size):
            chunk = self._fed(rows.take(slice(s, s + size)), (*REPLAY_FIELDS, "output"))
            with use_mesh(self.mesh):
                o, r = jax.device_get(self._old_ref(params, ref_params, self._global(chunk), ref=ref))
            olds.append(np.asarray(o))
            if r is not None:
                refs.append(np.asarray(r))
        return np.concatenate(olds, 0), (None if ref == "none" else np.concatenate(refs, 0))

    def _fed(self, rows, names=None) -> dict:
        """What a jitted pass reads of `rows`: its fields `names` (default: the update's), per `shared_prefix`."""
        # per process, `prefix_index` points into that process's own prefix rows: one process only
        if self.shared_prefix and jax.process_count() == 1:
            ran_only = self.ran_states_only and self.ran_only_layout
            return shared_prefix_batch(rows, names, self.n_batch, ran_only=ran_only)
        return rows.batch(names)

    def _global(self, batch):
        from dgemma.data.pipeline import to_global_batch

        return to_global_batch(batch, self.bsh)

    def _score(self, examples, tokens):
        from dgemma.data.rewards import score_rows

        return score_rows(examples, list(tokens.reshape(tokens.shape[0], -1)), self.data.tokenizer,
                          fn=self.reward_fn, require_eos=self.cfg.sdrl.reward_require_eos)

    def _ar_decode(self, params, prompts, prompt_valid, key, graphdef=None):
        """Greedy AR outputs [Q, n, L] of `params` (PAD after the last generated token)."""
        from dgemma.inference.sampler import sample
        from dgemma.train.sdrl.teacher import student_sampler

        cfg_ar = student_sampler(self.cfg, self.cfg.sampler.max_steps, self.max_new).replace(
            mode="ar", ar_temperature=0.0)
        res = sample(nnx.merge(graphdef or self.graphdef, params), prompts, prompt_valid, cfg_ar, key, mode="ar",
                     mesh=self.mesh, rules=self.cfg.mesh.rules)
        got = np.asarray(res.tokens)[:, : self.max_new]
        out = np.full((len(prompts), self.max_new), self.pad, np.int32)
        out[:, : got.shape[1]] = got
        return out.reshape(len(prompts), self.n_blocks, self.L)

    def _teacher(self, params, prompts, prompt_valid, examples, key, graphdef=None):
        """(tokens [Q, n, L], rewards [Q], from_ar [Q], AR tokens [Q, n, L] or None, teacher metrics) per
        `sdrl.teacher_decoding` (`teacher.pick_teacher_outputs`); the AR tokens let a frozen teacher's decode serve
        the reference_ar anchor too."""
        from dgemma.inference.rollout import rollout
        from dgemma.train.sdrl.teacher import pick_teacher_outputs

        mode = self.cfg.sdrl.teacher_decoding
        tro = diff = ar = None
        m = {}
        if mode != "ar":
            tro = rollout(nnx.merge(graphdef or self.graphdef, params), prompts, prompt_valid, self.teacher_cfg, key,
                          group_size=1, mesh=self.mesh, rules=self.cfg.mesh.rules)
            tok = committed_blocks(tro.record.tokens, self.n_blocks, self.pad)
            diff = (tok, self._score(examples, tok))
            m.update(metrics_lib.rollout_metrics(tro, self.teacher_cfg.max_steps, self.eos, self.pad, "teacher_"))
            m["teacher_reward_diffusion"] = float(np.mean(diff[1]))
        if mode != "diffusion":
            tok = self._ar_decode(params, prompts, prompt_valid, jax.random.fold_in(key, 1), graphdef)
            ar = (tok, self._score(examples, tok))
            m["teacher_reward_ar"] = float(np.mean(ar[1]))
        t_tok, t_raw, from_ar = pick_teacher_outputs(mode, diff, ar)
        return t_tok, t_raw, from_ar, (None if ar is None else ar[0]), m

    def _coupled_teacher(self, params, graphdef, ro, student_key, row_examples, student_tokens):
        """(`targets.coupled_targets` [R], metrics): the teacher's answers from each student rollout's noise
        (`teacher.coupled_teacher_tokens`), verified by the run's reward."""
        from dgemma.train.sdrl.teacher import coupled_teacher_tokens

        tok = coupled_teacher_tokens(nnx.merge(graphdef, params), ro.prompts, ro.prompt_valid, self.teacher_cfg,
                                     student_key, self.n_blocks, self.pad, mesh=self.mesh, rules=self.cfg.mesh.rules)
        reward = self._score(row_examples, tok)
        out = coupled_targets(tok, reward, reward_max=self.cfg.sdrl.reward_max, eos_ids=self.eos, pad_id=self.pad,
                              tail_id=self.tail)
        # how often the student's own output already is the answer its noise leads the teacher to
        same = np.all(np.asarray(student_tokens) == tok, axis=(1, 2))
        return out, {"coupled_teacher_reward": float(np.mean(reward)), "coupled_gate_rate": out.gate_rate,
                     "coupled_student_agrees": float(np.mean(same))}

    def _anchor_targets(self, reference: DeviceCopy, prompts, prompt_valid, key, targets, reference_ar=None):
        """(responses [Q, n, L], has [Q]) of the anchor rows per `sdrl.anchor_target` (`targets.anchor_targets`);
        the reference's greedy AR decode runs only when that setting reads it and `reference_ar` is not given."""
        mode = self.cfg.sdrl.anchor_target
        ref = reference_ar
        if mode != "verified" and ref is None:
            ref = self._ar_decode(reference.params(), prompts, prompt_valid, key, self.ref_graphdef)
        return anchor_targets(mode, targets, ref)

    def run(self, state, reference, ema, batch, i: int, max_steps: int):
        """One iteration; returns (new TrainState, metrics, per-step finiteness). `reference` stays where it is
        (device or pinned host memory); the update runs without a device copy of it when it lives on the host."""
        from dgemma.inference.rollout import rollout
        from dgemma.parallel.mesh import use_mesh
        from dgemma.train.sdrl.teacher import student_sampler

        cfg, s = self.cfg, self.cfg.sdrl
        G, P = s.group_size, cfg.data.layout.prompt_len
        key = jax.random.fold_in(jax.random.fold_in(state.key(), SDRL_STREAM), i)
        k_student, k_teacher = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)
        prompts = np.asarray(batch["tokens"])[:, :P]
        prompt_valid = np.asarray(batch["prompt_mask"])[:, :P].astype(bool)
        examples = [self.data.source[int(ix)] for ix in np.asarray(batch["index"])]
        t0 = time.time()
        rules = cfg.mesh.rules
        student = nnx.merge(self.graphdef, state.params)
        ro = rollout(student, prompts, prompt_valid, student_sampler(cfg, max_steps, self.max_new), k_student,
                     group_size=G, mesh=self.mesh, rules=rules)
        t1 = time.time()
        reference = DeviceCopy(reference, self.reference_kind)  # on the devices from first use to the update
        t_params, t_graphdef = ((ema, self.graphdef) if ema is not None
                                else (reference.params(), self.ref_graphdef))
        t_tok, t_raw, t_from_ar, t_ar, t_metrics = self._teacher(t_params, prompts, prompt_valid, examples,
                                                                 k_teacher, t_graphdef)
        row_examples = [examples[q] for q in ro.prompt_index]
        s_tok = committed_blocks(ro.record.tokens, self.n_blocks, self.pad)
        coupled = None
        if s.sd_target == COUPLED_TARGET:  # the teacher decodes every student rollout's own noise (its key)
            coupled, c_metrics = self._coupled_teacher(t_params, t_graphdef, ro, k_student, row_examples, s_tok)
            t_metrics.update(c_metrics)
        t2 = time.time()
        raw = self._score(row_examples, s_tok)
        blocks_ran = np.maximum((ro.result.steps_per_block > 0).sum(1), 1)
        shaped = raw if not s.efficiency_reward else np.asarray(so.efficiency_reward(
            jnp.asarray(raw), jnp.asarray(ro.result.decoder_passes / blocks_ran), max_steps, s.efficiency_reward,
            reward_max=s.reward_max))
        adv, zero_std = so.rollout_advantages(shaped, ro.prompt_index, len(prompts))  # grouped by prompt, not by order
        targets = build_targets(t_tok, t_raw, s_tok, raw, ro.result.decoder_passes, G, reward_max=s.reward_max,
                                eos_ids=self.eos, pad_id=self.pad, tail_id=self.tail)
        rows = build_state_rows(ro.record, ro.prompts, ro.prompt_valid, ro.prompt_index, targets,
                                np.asarray(adv).reshape(-1), n_blocks=self.n_blocks, eos_ids=self.eos,
                                pad_id=self.pad, tail_id=self.tail, omega=s.sd_step_weighting,
                                states_per_rollout=s.states_per_rollout, sd_target=s.sd_target,
                                rollout_verified=raw >= s.reward_max, coupled=coupled,
                                rng=np.random.default_rng([*np.asarray(jax.random.key_data(key)).tolist(), 7]))
        n_states = int(rows.state_ran.sum())
        sd_from_teacher = sd_teacher_share(rows, targets, ro.prompt_index, s.sd_target)
        rows = pad_rows(rows, self.multiple)
        t3 = time.time()
        weights = s.weights()
        ref_kind = "none" if not weights.kl else "logits" if s.kl_estimator == "exact" else "logp"
        ref_field = {"logits": "ref_logits", "logp": "logp_ref"}.get(ref_kind)
        if self.fused_old_ref:  # π_old (the student before any update) and π_ref in one program per chunk
            logp_old, ref_out = self._old_and_ref(state.params, reference.params() if weights.kl else None, rows,
                                                  ref_kind)
            rows = rows.replace(logp_old=logp_old, **({ref_field: ref_out} if ref_field else {}))
        else:
            rows = rows.replace(logp_old=self._no_grad(state.params, rows))
            if ref_field:
                rows = rows.replace(**{ref_field: self._no_grad(reference.params(), rows, full=ref_kind == "logits",
                                                                ref=True)})
        # rows every minibatch carries besides its state rows: the anchor's and the retention stream's
        side_rows, anchor_rate = {}, 0.0
        if weights.anchor:
            tok = self.data.tokenizer
            # a frozen teacher is the reference: its AR outputs (teacher_decoding != diffusion) are the reference's
            y_anc, has_anc = self._anchor_targets(reference, prompts, prompt_valid, jax.random.fold_in(key, 2), targets,
                                                  reference_ar=t_ar if ema is None else None)
            a = anchor_rows(batch, y_anc, has_anc, cfg.data.layout,
                            eos_id=self.response_eos, pad_id=self.pad,
                            bos_id=tok.bos_id if cfg.data.add_bos else None)
            side_rows = {f"{ANCHOR_PREFIX}{k}": v for k, v in a.items()}
            anchor_rate = float(np.mean(a["diffusion_weight"].reshape(len(prompts), -1).max(-1) > 0))
        if self.retention is not None:
            side_rows.update({f"{RETENTION_PREFIX}{k}": v for k, v in self.retention.rows(i).items() if k != "index"})
        reference.release()  # a device copy of a host reference goes before the update
        del reference
        t4 = time.time()
        step_metrics = []
        mb_rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).astype(np.uint32).tolist())
        for _ in range(s.inner_epochs):
            for mb in minibatches(rows, s.num_minibatches, mb_rng):
                with use_mesh(self.mesh):
                    state, m = self.step_fn(state, self._global({**self._fed(mb), **side_rows}))
                step_metrics.append(m)
        step_metrics = [{k: float(v) for k, v in jax.device_get(m).items()} for m in step_metrics]
        t5 = time.time()
        out = {k: float(np.mean([m[k] for m in step_metrics])) for k in step_metrics[0]}
        out["grad_norm"] = step_metrics[-1]["grad_norm"]
        out.update(metrics_lib.rollout_metrics(ro, max_steps, self.eos, self.pad))
        out.update(t_metrics)
        out.update(reward=float(raw.mean()), reward_shaped=float(np.mean(shaped)), teacher_reward=float(t_raw.mean()),
                   zero_std_fraction=float(np.mean(np.asarray(zero_std))), sd_gate_rate=targets.gate_rate,
                   target_from_teacher=float(np.mean(targets.source == TEACHER)), sd_from_teacher=sd_from_teacher,
                   anchor_rate=anchor_rate,
                   retention_rows=float(0 if self.retention is None else cfg.sdrl.retention_rows),
                   target_from_teacher_ar=float(np.mean((targets.source == TEACHER) & t_from_ar)),
                   k_max=float(max_steps),
                   states=float(n_states), time_student_rollouts=t1 - t0, time_teacher_rollout=t2 - t1,
                   time_scoring=t3 - t2, time_old_ref_passes=t4 - t3, time_update=t5 - t4)
        for task in sorted({e.task for e in examples}):
            sel = np.asarray([examples[q].task == task for q in ro.prompt_index])
            out[f"reward_{task}"] = float(raw[sel].mean())
        finite = all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in step_metrics)
        return state, out, finite


def load_reward_fn(cfg: RunConfig, data):
    """The user reward callable (None: task rewards), probed on the first batch's reference responses so a function
    that raises or returns the wrong shape fails before the run directory is written."""
    if cfg.sdrl.reward is None:
        return None
    from dgemma.data.rewards import load_reward_fn, score_rows

    fn = load_reward_fn(cfg.sdrl.reward)
    it = data.iterator_from_step(0)
    try:
        index = np.asarray(next(it)["index"])
    finally:
        getattr(it, "close", lambda: None)()
    examples = [data.source[int(i)] for i in index]
    tok = data.tokenizer
    gens = [tok.encode(e.response) + [tok.eos_id] for e in examples]
    score_rows(examples, gens, tok, fn=fn)
    return fn

"""Stage 2 (SD·RL) in the planner: memory per device and FLOPs of one iteration (`dgemma plan` on an sdrl config).

    plan = estimate_sdrl(spec)          # spec.objective with rollouts (sdrl), spec.sdrl an SDRLShape (plan_config)

One iteration (`dgemma.train.sdrl.iteration`) runs four phases on the same devices; the planner reports the peak:

  resident      student params + AdamW state (as stage 1) + the frozen reference params (the KL reference and the
                frozen teacher; none with adapters, `dgemma.planning.lora_plan`; with `sdrl.reference_memory=host` they are in pinned host memory instead and count
                in the teacher and no-grad phases only) [+ the EMA teacher's params] + the recorded states of the student rollouts and of the
                teacher rollout (`RolloutRecord`: the Rollout objects stay referenced for the whole iteration)
  rollouts      (student, then teacher) KV cache of the sampled rows (full layers: P + nb L slots, sliding layers: a ring of W - 1 + L)
                + the decoder step's V-wide fp32 arrays (logits, tempered logits, probabilities, log-probabilities:
                `VOCAB_ARRAYS` of [rows, L, V]) + the per-block records before they are stacked (x 2 at the stack)
  no-grad       the pi_old / pi_ref replay forwards over minibatch-sized chunks: one layer's activations at a time
                (the exact KL also holds the chunk's V-wide reference logits)
  update        gradients + the one-pass training activations (`planner.activation_bytes`, the model's remat and
                attention) over the minibatch's state rows plus the anchor rows (every minibatch carries the anchor's
                stage-1 batch of Q prompts), + the minibatch's recorded SC embeddings (the anchor runs on the replay's
                twin model: one stacked gradient of the scanned layers, `dgemma.model.shared_scan_grads`)

State rows are bounded by the worst case the loop pads to: every rollout runs K_max steps (the curriculum starts at
`sampler.max_steps` and only lowers it) and keeps min(M, K_max) of them (`sdrl.states_per_rollout` = M, 0: all), so
N = Q x G x min(M, K_max) rows per process, rounded up to the loop's
power-of-two multiple of (data x fsdp) x `sdrl.num_minibatches`; each row is one replay forward over P + 2 nb L
tokens. `trainer.grad_accum_steps` does not apply to stage 2 (one optimizer step per minibatch; the trainer
refuses it).

FLOPs (global, per iteration): rollouts = prefill + per step and row one decoder forward over L tokens (attending
to the cache) with its V-wide head and soft embedding + one commit encode per block; no-grad = 1 (pi_old) or 2
(+ pi_ref) replay forwards per row; update = inner_epochs x rows x (3 forwards + remat) + the anchor's stage-1 step
per minibatch. `model_flops_per_step` is 6 x active x the tokens the update trains on.
"""

from __future__ import annotations

import dataclasses
import math

from dgemma.model.config import SLIDING
from dgemma.planning.flops import active_params, forward_flops, layer_matmul_params, model_matmul_params, step_flops
from dgemma.planning.layer_bytes import per_layer_input_bytes
from dgemma.planning.planner import Plan, PlanSpec, activation_bytes, state_bytes
from dgemma.train.objectives import get_objective

__all__ = ["SDRLShape", "VOCAB_ARRAYS", "estimate_sdrl", "state_rows"]

VOCAB_ARRAYS = 4  # V-wide fp32 arrays of a sampler step per row (logits, z, probs, log-probs); the TPU compile of
# the 26B block grows by 1.02 GiB per row of 256 positions = 4.1 such arrays (docs/planner_compile.md)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SDRLShape:
    """What stage 2 adds to a `PlanSpec` (built from the `sdrl`, `sampler` and `data` sections)."""

    prompts_per_process: int  # Q = data.batch_size
    processes: int
    group_size: int  # G
    num_minibatches: int
    inner_epochs: int
    student_steps: int  # K_max at the start (sampler.max_steps)
    teacher_steps: int  # K_T
    n_blocks: int  # nb
    states_per_rollout: int = 0  # M (0: every visited step, up to K_max)
    kl: str = "k3"  # k3 | exact | off
    anchor: bool = True
    ema_teacher: bool = False
    reference_on_host: bool = False  # sdrl.reference_memory=host
    retention_rows: int = 0  # sdrl.retention_rows (global; 0 without sdrl.retention_mix): a stage-1 pass of its own


def state_rows(spec: PlanSpec) -> tuple[int, int]:
    """(state rows per process before padding, padded global rows) in the worst case: every rollout runs K_max steps
    and keeps min(M, K_max) of them (`sdrl.states_per_rollout` = M; 0 keeps all)."""
    s = spec.sdrl
    kept = s.student_steps if s.states_per_rollout <= 0 else min(s.states_per_rollout, s.student_steps)
    n = s.prompts_per_process * s.group_size * kept
    multiple = _batch_devices(spec) * s.num_minibatches
    size = multiple
    while size < n:
        size *= 2
    return n, size * s.processes


def _batch_devices(spec: PlanSpec) -> int:
    return math.prod(int(spec.mesh.get(x, 1)) for x in ("data", "fsdp"))


def _act_bytes(m) -> int:
    return 2 if m.execution.dtype in ("bfloat16", "float16") else 4


def _kv_cache_row_bytes(m, capacity: int) -> int:
    a = _act_bytes(m)
    ring = min(capacity, m.sliding_window - 1 + m.canvas_length)
    per_layer = [(ring if m.layer_types[i] == SLIDING else capacity) * m.layer_kv_heads(i) * m.layer_head_dim(i)
                 for i in range(m.num_hidden_layers) if m.kv_producer(i) is None]  # KV-shared layers keep no slots
    return 2 * a * sum(per_layer) + capacity  # keys + values, the valid mask


def _record_state_bytes(m) -> int:
    """One (block, step, row) of a `RolloutRecord`: canvas / argmax / proposal int32, accept bool, the proposal's
    log-prob f32, SC embedding."""
    L = m.canvas_length
    return L * 17 + (L * m.hidden_size * _act_bytes(m) if m.self_conditioning else 0) + 9


def _decode_step_bytes(m, rows: float, capacity: int) -> float:
    """Transient of one sampler step over `rows` rows: V-wide arrays + the largest layer's forward (no gradient)
    + the head's copy of the table in the activation dtype (`Embedder.decode` casts the fp32 master table each step;
    1.48 GB at 26B in the TPU compile of the block, docs/planner_compile.md)."""
    L, H, a = m.canvas_length, m.hidden_size, _act_bytes(m)
    vocab = VOCAB_ARRAYS * rows * L * m.vocab_size * 4 + m.vocab_size * H * a
    ffw = (m.top_k_experts * (2 * H * a + 4 * m.moe_intermediate_size * a) if m.enable_moe_block
           else 4 * max(m.layer_mlp_width(i) for i in range(m.num_hidden_layers)) * a)
    layer = rows * L * (8 * H * 4 + m.num_attention_heads * capacity * 4 * 2 + ffw)
    return vocab + layer + rows * L * per_layer_input_bytes(m, a)  # + the canvas's per-layer inputs (PLE)


def _nograd_bytes(spec: PlanSpec, rows: float) -> float:
    """One replay forward without gradient over `rows` rows: the largest layer's activations + the chunked head."""
    from dgemma.planning.planner import _layer_token_bytes

    m, T, a = spec.model, spec.tokens_per_example, _act_bytes(spec.model)
    layer = max(sum(_layer_token_bytes(m, i, T, a).values()) for i in range(m.num_hidden_layers))
    return rows * (T * (layer + m.hidden_size * a + per_layer_input_bytes(m, a))
                   + min(spec.ce_chunk, T) * m.vocab_size * 4 * 2)


def _decode_flops(m, rows: float, steps: int, blocks: int, prompt_len: int) -> float:
    """A rollout: prefill + `steps` decoder forwards per block and row (head + soft embedding) + a commit encode."""
    L, H, V = m.canvas_length, m.hidden_size, m.vocab_size
    total = rows * forward_flops(m, prompt_len, 1)
    for b in range(blocks):
        ctx = prompt_len + b * L
        per = sum(2 * layer_matmul_params(m, i) + 4 * min(ctx + L, m.sliding_window + L if m.layer_types[i] ==
                                                           SLIDING else ctx + L)
                  * m.num_attention_heads * m.layer_head_dim(i) for i in range(m.num_hidden_layers))
        per += 2 * model_matmul_params(m)  # the canvas's per-layer inputs (PLE)
        total += rows * (steps * L * (per + 4 * H * V) + L * per)
    return total


def estimate_sdrl(spec: PlanSpec) -> Plan:
    """The SD·RL plan (module docstring): the peak over the iteration's phases, per device."""
    from dgemma.parallel.checks import check_model_divisibility

    s, m = spec.sdrl, spec.model
    if not get_objective(spec.objective).rollouts or s is None:
        raise ValueError("estimate_sdrl needs objective='sdrl' and an SDRLShape in spec.sdrl")
    check_model_divisibility(m, spec.mesh, spec.rules)
    nb_dev = _batch_devices(spec)
    L, P, nb = m.canvas_length, spec.prompt_len, s.n_blocks
    capacity = P + nb * L
    n_proc, n_pad = state_rows(spec)
    mb_rows = n_pad // s.num_minibatches  # global rows per optimizer step
    q_global = s.prompts_per_process * s.processes
    anchor_rows = q_global if s.anchor else 0
    static = state_bytes(m, spec.rules, spec.mesh, spec.optim, spec.lora)
    # update: a stage-1-shaped step over the minibatch + anchor (+ retention) rows (the replay has no extra SC pass)
    train = dataclasses.replace(spec, objective="stage1", sdrl=None,
                                global_batch=mb_rows + anchor_rows + s.retention_rows,
                                grad_accum_steps=1, self_conditioning_pass=False)
    act, terms, b = activation_bytes(train)
    if s.retention_rows and m.execution.scan_layers:
        # the retention pass runs on the model, not on the replay's scan twin (dgemma.train.sdrl.loss): its scanned
        # layers' gradient is a second stacked buffer until the two are added
        terms["retention_grad_stack"] = int(static["grads"])
    mb_dev = mb_rows / nb_dev
    terms["minibatch_sc_inputs"] = int(mb_dev * nb * L * (m.hidden_size * _act_bytes(m) + 20))
    if s.kl == "exact":
        terms["reference_logits"] = int(mb_dev * nb * L * m.vocab_size * 4)
    act = sum(terms.values())
    # resident: reference params (on the devices unless sdrl.reference_memory=host) (+ EMA), the student and teacher
    # records; on the host the reference comes to the devices for the phases after the student rollouts only
    rec = _record_state_bytes(m)
    student_rows = q_global * s.group_size / nb_dev
    teacher_rows = q_global / nb_dev
    reference = ema = static["params"]
    if spec.lora is not None:  # the student's own base with the adapters off: no copy (dgemma.planning.lora_plan)
        from dgemma.planning.lora_plan import sdrl_reference_bytes

        reference, ema = sdrl_reference_bytes(spec)
    resident = {} if s.reference_on_host else {"reference_params": reference}
    resident.update(student_record=int(nb * s.student_steps * student_rows * rec),
                    teacher_record=int(nb * s.teacher_steps * teacher_rows * rec))
    if s.ema_teacher:
        resident["ema_params"] = ema
    on_demand = reference if s.reference_on_host else 0

    def rollout(rows: float, record: int) -> float:  # cache + step transient + the unstacked record
        return rows * _kv_cache_row_bytes(m, capacity) + _decode_step_bytes(m, rows, capacity) + record

    nograd = _nograd_bytes(spec, mb_dev) + (mb_dev * nb * L * m.vocab_size * 4 if s.kl == "exact" else 0)
    phases = {"student_rollouts": int(rollout(student_rows, resident["student_record"])),
              "teacher_rollout": int(rollout(teacher_rows, resident["teacher_record"]) + on_demand),
              "old_ref_passes": int(nograd + on_demand)}
    # FLOPs (global)
    T = spec.tokens_per_example
    replay = forward_flops(m, T, nb * L, prompt_len=P)
    flops = {
        "student_rollouts": _decode_flops(m, q_global * s.group_size, s.student_steps, nb, P),
        "teacher_rollout": _decode_flops(m, q_global, s.teacher_steps, nb, P),
        "old_ref_passes": n_pad * replay * (1 + (s.kl != "off")),
    }
    upd, _ = step_flops(dataclasses.replace(train, global_batch=mb_rows))
    anc, _ = step_flops(dataclasses.replace(spec, objective="stage1", sdrl=None, global_batch=max(anchor_rows, 1),
                                            grad_accum_steps=1))
    ret = 0.0
    if s.retention_rows:  # the stage-1 loss as stage 1 trained it: with its self-conditioning pass
        ret, _ = step_flops(dataclasses.replace(spec, objective="stage1", sdrl=None, global_batch=s.retention_rows,
                                                grad_accum_steps=1))
    steps = s.inner_epochs * s.num_minibatches
    flops["update"] = steps * (upd + (anc if s.anchor else 0.0) + ret)
    model_flops = 6 * active_params(m) * T * steps * (mb_rows + anchor_rows + s.retention_rows)
    kept = (f"K_max {s.student_steps}" if s.states_per_rollout <= 0 else
            f"min(M {s.states_per_rollout}, K_max {s.student_steps})")
    notes = [f"worst case: {n_proc} state rows per process (Q {s.prompts_per_process} x G {s.group_size} x {kept}) "
             f"padded to {n_pad} globally; {mb_rows} rows (+ {anchor_rows} anchor rows"
             + (f" + {s.retention_rows} retention rows" if s.retention_rows else "") + ") per "
             f"optimizer step, {mb_dev + (anchor_rows + s.retention_rows) / nb_dev:g} per device, {steps} steps per "
             f"iteration"]
    if s.reference_on_host:
        notes.append(f"sdrl.reference_memory=host: the reference params ({reference / 2**30:.2f} GiB per device) "
                     f"live in pinned host memory and are on the devices for the teacher rollout and the pi_ref "
                     f"passes only, not at the update")
    if spec.grad_accum_steps > 1:
        notes.append(f"trainer.grad_accum_steps={spec.grad_accum_steps} does not apply to stage 2 (one optimizer step "
                     f"per minibatch; more sdrl.num_minibatches shrink the update)")
    return Plan(spec=spec, params=static["params"], grads=static["grads"], optimizer=static["optimizer"],
                activations=int(act), activation_terms=terms, examples_per_device=b,
                total_params=static["total_params"], trainable_params=static["trainable_params"],
                active_params=active_params(m), flops_per_step=sum(flops.values()), model_flops_per_step=model_flops,
                notes=tuple(notes), resident=resident, phases=phases, phase_flops=flops,
                collective_bytes_per_step=0, host={"reference_params": reference} if s.reference_on_host else {})

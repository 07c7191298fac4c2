"""Stage 2 (SD·RL) and expert parallelism in the planner: each term tied to the component it models."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma.config import load_config
from dgemma.model.config import gemma4_26b_a4b, tiny_toy
from dgemma.planning.plan_config import plan_for, spec_from_config
from dgemma.planning.accelerators import get_accelerator
from dgemma.planning.planner import PlanSpec, activation_bytes, estimate
from dgemma.planning.sdrl_plan import (
    SDRLShape,
    _kv_cache_row_bytes,
    _record_state_bytes,
    estimate_sdrl,
    state_rows,
)

REPO = Path(__file__).resolve().parents[2]
BIG2 = str(REPO / "configs/stage2/gemma4_26b_a4b.yaml")
TINY2 = str(REPO / "configs/stage2/tiny.yaml")
M26 = gemma4_26b_a4b().with_execution(dtype="bfloat16", attention_impl="chunked", scan_layers=True, remat="full")


def _shape(**kw) -> SDRLShape:
    base = dict(prompts_per_process=8, processes=1, group_size=16, num_minibatches=4, inner_epochs=2,
                student_steps=48, teacher_steps=96, n_blocks=2)
    base.update(kw)
    return SDRLShape(**base)


def _spec(model=M26, **kw) -> PlanSpec:
    base = dict(model=model, rules="experts_on_fsdp", mesh={"fsdp": 8}, global_batch=8, prompt_len=512,
                response_len=512, objective="sdrl", remat="full", accelerator=get_accelerator("h100"),
                sdrl=_shape())
    base.update(kw)
    return PlanSpec(**base)


@pytest.mark.parametrize("sc", [True, False])
def test_record_bytes_match_the_sampler_record(sc):
    """Bytes per recorded (block, step, row) state == the RolloutRecord the sampler builds (abstract shapes)."""
    from dgemma.inference.record import PER_STEP_FIELDS, StepRecord, stack_blocks

    m = tiny_toy(self_conditioning=sc).with_execution(dtype="bfloat16")
    nb, K, B, L = 3, 5, 4, m.canvas_length

    def build():
        steps = [StepRecord.init(K, B, L, m.hidden_size if sc else None, jnp.bfloat16) for _ in range(nb)]
        ints = [jnp.zeros((B, L), jnp.int32)] * nb
        per_row = [jnp.zeros((B,), jnp.int32)] * nb
        return stack_blocks(steps, ints, per_row, per_row, [jnp.zeros((B,), bool)] * nb)

    rec = jax.eval_shape(build)
    step_fields = PER_STEP_FIELDS  # every per-step field the sampler records (a new field must be planned too)
    assert "logp" in step_fields and rec.logp is not None
    nbytes = sum(int(np.prod(getattr(rec, f).shape)) * getattr(rec, f).dtype.itemsize
                 for f in step_fields if getattr(rec, f) is not None)
    assert nbytes == nb * K * B * _record_state_bytes(m)


def test_kv_cache_bytes_match_the_cache():
    from dgemma.model.cache import KVCache

    m = tiny_toy().with_execution(dtype="bfloat16")
    for capacity in (8, 40, 200):  # below, around and past the sliding ring (W - 1 + L = 23)
        cache = jax.eval_shape(lambda c=capacity: KVCache.init(m, 3, c))
        nbytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(cache) if x.ndim)
        assert nbytes == 3 * _kv_cache_row_bytes(m, capacity), capacity


@pytest.mark.parametrize("n_rows_cap,minibatches", [(6, 1), (48, 4), (100, 2)])
def test_state_rows_pad_like_the_loop(n_rows_cap, minibatches):
    """The worst-case row count is padded exactly as dgemma.train.sdrl.states.pad_rows pads it."""
    from dgemma.train.sdrl.states import ROW_FIELDS, StateRows, pad_rows

    shape = _shape(prompts_per_process=1, group_size=2, student_steps=n_rows_cap // 2, num_minibatches=minibatches)
    spec = _spec(sdrl=shape)
    n, padded = state_rows(spec)
    assert n == n_rows_cap
    optional = ("soft_embeds", "logp_old", "logp_ref", "ref_logits")
    rows = StateRows(**{f.name: np.ones(n, np.float32) for f in ROW_FIELDS if f.name not in optional})
    assert padded == len(pad_rows(rows, 8 * minibatches))


@pytest.mark.parametrize("m", [0, 3, 48, 60])
def test_state_rows_keep_m_states_per_rollout_like_the_loop(m):
    """With sdrl.states_per_rollout = M the worst case (every rollout ran K_max steps) keeps min(M, K_max) states per
    rollout, as dgemma.train.sdrl.states.subsample_states keeps them (M = 0: all)."""
    from dgemma.train.sdrl.states import subsample_states

    Q, G, K = 2, 3, 48
    spec = _spec(sdrl=_shape(prompts_per_process=Q, group_size=G, student_steps=K, states_per_rollout=m))
    n, _ = state_rows(spec)
    ks, rs = np.nonzero(np.ones((K, Q * G), bool))  # every rollout ran every step
    if m:
        ks, rs = subsample_states(ks, rs, m, np.random.default_rng(0))
    assert n == len(ks) == Q * G * (min(m, K) if m else K)


def test_shipped_26b_stage2_config_on_gpus_by_the_planner():
    """The shipped 26B stage-2 config (M 4 states per rollout, 16 minibatches, G 8, moe_kernel auto = Tokamax's grouped
    matmul on GPU, the reference params in pinned host memory) fits 8 x H100, 8 x H200 and, with 16 prompts, 16 x H100. With the reference resident on the
    devices it does not fit 8 x H100 once XLA:GPU's double-buffered layer-scan gradients are counted, nor with XLA's
    ragged_dot (dense over every expert on GPU), nor with every recorded state (M = 0)."""
    cfg = load_config(BIG2, env={})
    assert cfg.sdrl.reference_memory == "host" and cfg.model_config.execution.moe_kernel == "auto"
    spec = spec_from_config(cfg, devices=8, accelerator="h100")
    assert spec.sdrl.states_per_rollout == 4 and spec.sdrl.reference_on_host
    h100 = plan_for(spec)
    assert h100.fits and "reference_params" not in h100.resident
    assert h100.total < 0.85 * h100.usable_bytes  # headroom since the update keeps one scanned gradient stack
    assert plan_for(spec_from_config(cfg, devices=8, accelerator="h200")).fits
    with pytest.raises(ValueError, match="data.batch_size=8 .* batch axes data x fsdp = 16"):  # prompts over 16 shards
        spec_from_config(cfg, devices=16, accelerator="h100")
    two_nodes = load_config(BIG2, ["data.batch_size=16"], env={})
    assert plan_for(spec_from_config(two_nodes, devices=16, accelerator="h100")).fits
    resident = plan_for(spec_from_config(load_config(BIG2, ["sdrl.reference_memory=device"], env={}), devices=8,
                                         accelerator="h100"))
    assert resident.total - h100.total == resident.resident["reference_params"] > 0  # one more model copy
    xla_moe = load_config(BIG2, ["model.execution.moe_kernel=xla"], env={})
    assert not plan_for(spec_from_config(xla_moe, devices=8, accelerator="h100")).fits
    spec_all = spec_from_config(load_config(BIG2, ["sdrl.states_per_rollout=0"], env={}), devices=8,
                                accelerator="h200")
    assert not plan_for(spec_all).fits


def test_sdrl_plan_terms():
    plan = estimate_sdrl(_spec())
    s = plan.spec.sdrl
    rows_dev = 8 * 16 / 8
    assert plan.resident["reference_params"] == plan.params  # the frozen stage-1 copy, sharded like the student
    assert plan.resident["student_record"] == int(2 * 48 * rows_dev * _record_state_bytes(M26))
    assert plan.resident["teacher_record"] == int(2 * 96 * 1 * _record_state_bytes(M26))
    # update = the one-pass step over one minibatch of state rows + the anchor rows, plus the recorded SC inputs
    _, padded = state_rows(plan.spec)
    train = dataclasses.replace(plan.spec, objective="stage1", sdrl=None, global_batch=padded // 4 + 8,
                                self_conditioning_pass=False)
    act, terms, _ = activation_bytes(train)
    assert plan.activations == act + plan.activation_terms["minibatch_sc_inputs"]
    assert plan.total == (plan.params + plan.optimizer + sum(plan.resident.values())
                          + max(plan.grads + plan.activations, *plan.phases.values()))
    # more minibatches -> smaller update; the EMA teacher is one more parameter copy; the exact KL is V-wide
    assert estimate_sdrl(_spec(sdrl=_shape(num_minibatches=64))).activations < plan.activations / 8
    assert estimate_sdrl(_spec(sdrl=_shape(ema_teacher=True))).total - plan.total == plan.params
    exact = estimate_sdrl(_spec(sdrl=_shape(kl="exact")))
    assert exact.activation_terms["reference_logits"] == int(padded / 4 / 8 * 2 * 256 * 262_144 * 4)
    # the reference in pinned host memory: off the devices except in the phases after the student rollouts
    host = estimate_sdrl(_spec(sdrl=_shape(reference_on_host=True)))
    assert "reference_params" not in host.resident and host.update_bytes == plan.update_bytes
    for phase in ("teacher_rollout", "old_ref_passes"):
        assert host.phases[phase] == plan.phases[phase] + plan.params, phase
    assert host.phases["student_rollouts"] == plan.phases["student_rollouts"]
    assert host.total == plan.total - plan.params  # the update is this spec's peak phase
    assert set(plan.phases) == {"student_rollouts", "teacher_rollout", "old_ref_passes"}
    assert set(plan.phase_flops) == {"student_rollouts", "teacher_rollout", "old_ref_passes", "update"}
    assert plan.flops_per_step == pytest.approx(sum(plan.phase_flops.values()))
    assert s.group_size * plan.phase_flops["teacher_rollout"] / s.teacher_steps == pytest.approx(
        plan.phase_flops["student_rollouts"] / s.student_steps, rel=0.1)  # same work per row and step
    with pytest.raises(ValueError, match="objective=sdrl"):
        estimate(_spec())


def test_sdrl_plan_counts_the_retention_rows():
    """`sdrl.retention_rows` (a stage-1 pass of their own in the update, dgemma.train.sdrl.retention) are planned:
    rows in the update's activations, a second stacked gradient of the scanned layers, their FLOPs, the abstract
    batch's `retention/` keys; a config without a retention mix plans none."""
    from dgemma.planning.plan_config import abstract_sdrl_batch_shapes

    plan = estimate_sdrl(_spec())
    ret = estimate_sdrl(_spec(sdrl=_shape(retention_rows=16)))
    _, padded = state_rows(plan.spec)
    train = dataclasses.replace(plan.spec, objective="stage1", sdrl=None, global_batch=padded // 4 + 8 + 16,
                                self_conditioning_pass=False)
    act, _, _ = activation_bytes(train)
    assert ret.activation_terms["retention_grad_stack"] == plan.grads  # M26 scans its layers
    assert ret.activations == act + plan.activation_terms["minibatch_sc_inputs"] + plan.grads
    assert ret.phase_flops["update"] > plan.phase_flops["update"]
    assert ret.model_flops_per_step > plan.model_flops_per_step
    assert any("+ 16 retention rows" in n for n in ret.notes), ret.notes
    unscanned = M26.with_execution(scan_layers=False)
    assert "retention_grad_stack" not in estimate_sdrl(_spec(model=unscanned,
                                                             sdrl=_shape(retention_rows=16))).activation_terms
    mix = "sdrl.retention_mix=[{name: copy}, {name: sort}]"
    cfg = load_config(TINY2, [mix, "sdrl.retention_rows=4", "data.batch_size=4"], env={})
    spec = spec_from_config(cfg, devices=1)
    assert spec.sdrl.retention_rows == 4
    batch = abstract_sdrl_batch_shapes(cfg, spec)
    assert batch["retention/tokens"][0][0] == 4 and batch["retention/tokens"][0][1:] == batch["anchor/tokens"][0][1:]
    assert spec_from_config(load_config(TINY2, ["data.batch_size=4"], env={}), devices=1).sdrl.retention_rows == 0


def test_sdrl_spec_from_config_and_cli(capsys):
    from dgemma.cli.main import main

    cfg = load_config(BIG2, env={})
    spec = spec_from_config(cfg, devices=8, accelerator="h100")
    s = spec.sdrl
    assert (s.group_size, s.num_minibatches, s.student_steps, s.teacher_steps, s.n_blocks) == (8, 16, 48, 96, 2)
    assert s.kl == "k3" and s.anchor and not s.ema_teacher and spec.tokens_per_example == 512 + 2 * 512
    assert plan_for(spec).resident["student_record"] > 0
    code = main(["plan", TINY2, "--devices", "1", "--accelerator", "cpu"])
    out = capsys.readouterr().out
    assert code == 0, out
    for word in ("student_record", "teacher_record", "reference_params", "student_rollouts", "old_ref_passes",
                 "by phase: student_rollouts", "worst case: 2048 state rows"):  # Q 16 x G 8 x K 16
        assert word in out, out


def test_expert_parallel_terms_are_in_the_estimate():
    from dgemma.planning.expert_parallel import ep_plan_terms

    base = PlanSpec(model=M26, rules="experts_on_fsdp", mesh={"fsdp": 8}, global_batch=8, prompt_len=1024,
                    response_len=1024, remat="full", accelerator=get_accelerator("h100"))
    ep = dataclasses.replace(base, model=M26.with_execution(expert_axis="fsdp"))
    local, par = estimate(base), estimate(ep)
    assert local.collective_bytes_per_step == 0
    assert par.collective_bytes_per_step == ep_plan_terms(ep)["collective_bytes_per_step"] > 0
    # the dropless buffer: ep * min(k, E/ep) = 64 rows per own token against k = 8 for the single-sort MoE
    _, lt, _ = activation_bytes(dataclasses.replace(base, remat="none"))
    _, pt, _ = activation_bytes(dataclasses.replace(ep, remat="none"))
    assert 6 < pt["moe"] / lt["moe"] < 10
    assert par.activation_terms["ep_gathered_experts"] == 0  # experts_on_fsdp: each shard holds whole experts
    gathered = estimate(PlanSpec(model=M26, rules="ep", mesh={"fsdp": 2, "expert": 4}, global_batch=2,
                                 prompt_len=1024, response_len=1024, remat="full"))
    assert gathered.activation_terms["ep_gathered_experts"] == 3 * 32 * 2816 * 704 * 4 // 2  # half was stored
    assert "expert parallel over fsdp (ep=8)" in " ".join(par.notes)


def test_topology_names_are_checked(capsys):
    from dgemma.cli.main import main
    from dgemma.planning.tpu_aot import parse_topology

    assert parse_topology("v5p:2x4x4") == ("v5p", 32, "v5p") and parse_topology("v6e:2x2")[1] == 4
    for bad in ("v5p-64", "v5p:2x0x4", "h100:8"):
        with pytest.raises(ValueError, match="--topology"):
            parse_topology(bad)
    assert main(["plan", BIG2, "--topology", "v5p:2x4x4"]) == 2
    assert "--topology needs --compile" in capsys.readouterr().err


def test_sampler_block_compiles_and_its_inputs_match_the_planner(capsys):
    """`dgemma plan --compile --sampler` compiles the sampler's block program (the code `sample` runs) for the
    stage-2 config on 8 simulated devices with abstract inputs; the compiled arguments are the planner's parameters
    and KV cache of the student rollout rows."""
    import re

    from dgemma.cli.main import main

    argv = ["plan", str(REPO / "configs/stage2/tiny.yaml"), "--compile", "--sampler", "--devices", "8",
            "mesh.ici={data: 1, fsdp: 8, expert: 1, tensor: 1}"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    head = re.search(r"compiled   sampler block \(diffusion rows; K_max (\d+), canvas (\d+), (\d+) rows = (\d+) per", out)
    assert head and int(head.group(3)) == 8 * int(head.group(4)), out
    args = re.search(r"arguments +([0-9.]+) MiB +\(estimate params \+ KV cache ([0-9.]+) MiB", out)
    assert args, out
    assert float(args.group(1)) == pytest.approx(float(args.group(2)), rel=0.01)
    assert re.search(r"peak +[0-9.]+ MiB += [0-9.]+ x the estimate", out)


@pytest.mark.parametrize("flags,message", [(["--sampler"], "--sampler needs --compile"),
                                           (["--compile", "--sampler", "--sampler-rows", "0"],
                                            "--sampler-rows 0: must be a positive integer")])
def test_sampler_compile_misuse_is_a_one_line_error(flags, message, capsys):
    from dgemma.cli.main import main

    assert main(["plan", str(REPO / "configs/stage2/tiny.yaml"), *flags]) == 2
    assert capsys.readouterr().err.strip() == f"dgemma plan: {message}"


def test_sampler_estimate_agrees_with_the_recorded_tpu_compiles():
    """The planner's sampler-block terms (params + KV cache + one decoder step) are within 15 % of XLA's peak for the
    recorded deviceless v5p-64 compiles of the 26B block at two row counts, and its params + cache equal the compiled
    arguments to 0.5 %."""
    import json

    from dgemma.planning.sampler_aot import sampler_block_estimate

    recorded = json.loads((REPO / "tests/golden/tpu_compiled_memory.json").read_text())["sampler_block_cases"]
    assert len(recorded) >= 2
    for case in recorded:
        cfg = load_config(str(REPO / case["config"]), case["overrides"], env={})
        spec = spec_from_config(cfg, devices=case["devices"], accelerator="v5p")
        terms = sampler_block_estimate(spec, case["rows_per_device"], spec.prompt_len + spec.response_len,
                                       plan_for(spec).params)
        gib = 2 ** 30
        assert (terms["params"] + terms["kv_cache"]) / gib == pytest.approx(case["argument_gib"], rel=5e-3)
        assert 1 / 1.15 < case["peak_gib"] / (sum(terms.values()) / gib) < 1.15, (case, terms)


@pytest.mark.slow  # one real SD·RL iteration (~1-2 min on 2 cores)
@pytest.mark.parametrize("retention", [False, True], ids=["plain", "retention"])
def test_abstract_sdrl_batch_is_what_the_loop_feeds_the_update(tmp_path, monkeypatch, retention):
    """The planner's compiled stage-2 step is fed `abstract_sdrl_batch_shapes`: the same keys, trailing shapes and
    dtypes as the minibatch a real SD·RL iteration passes to its train step (rows differ: the planner's worst case)."""
    import dgemma.train.step as step_mod
    from dgemma.planning.plan_config import abstract_sdrl_batch_shapes
    from dgemma.train.sdrl.run import run_sdrl

    seen = {}
    make = step_mod.make_train_step

    def capturing(*args, **kwargs):
        fn = make(*args, **kwargs)

        def step(state, batch):
            seen.setdefault("batch", {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in batch.items()})
            return fn(state, batch)
        return step

    monkeypatch.setattr(step_mod, "make_train_step", capturing)
    over = ["trainer.steps=1", f"run.output_dir={tmp_path}", "logging.wandb=false", "data.batch_size=2",
            "sdrl.group_size=2", "sdrl.states_per_rollout=2", "sdrl.kl_estimator=k3", "sdrl.allow_random_init=true"]
    if retention:  # sdrl.retention_mix: its rows come under retention/ (dgemma.train.sdrl.retention)
        over += ["sdrl.retention_mix=[{name: copy, min_len: 3, max_len: 5}]", "sdrl.retention_rows=2"]
    cfg = load_config(TINY2, over, env={})
    from dgemma.parallel.mesh import make_mesh

    run_sdrl(cfg, progress=False, mesh=make_mesh({"fsdp": 1}, devices=jax.devices()[:1]))
    want = abstract_sdrl_batch_shapes(cfg, spec_from_config(cfg, devices=1))
    got = seen["batch"]
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))
    for k, (shape, dtype) in want.items():
        assert got[k][0][1:] == shape[1:] and got[k][1] == dtype, (k, got[k], (shape, dtype))
        if k.startswith(("anchor/", "retention/")):
            assert got[k][0] == shape, k  # the anchor rows are the Q prompts, not a worst case


@pytest.mark.slow  # the SD·RL update step compiles in ~1 min on 2 cores even at one layer
def test_stage2_update_step_compiles_on_a_simulated_mesh(capsys):
    """`dgemma plan --compile` on a stage-2 config compiles the real SD·RL update step (the loss over replayed state
    rows + anchor rows) with the abstract batch of `abstract_sdrl_batch_shapes`."""
    import re

    from dgemma.cli.main import main

    argv = ["plan", TINY2, "--compile", "--devices", "8", "mesh.ici={data: 1, fsdp: 8, expert: 1, tensor: 1}",
            "data.batch_size=8", "sdrl.group_size=2", "sdrl.states_per_rollout=2", "sdrl.kl_estimator=k3",
            "model.num_hidden_layers=1", "model.layer_types=[full_attention]"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    args = re.search(r"arguments +([0-9.]+) MiB +\(estimate params \+ optimizer ([0-9.]+) MiB", out)
    assert args and float(args.group(1)) >= float(args.group(2)), out  # + the batch rows


def test_stage2_planner_does_not_underestimate_the_recorded_tpu_update_step():
    """The recorded v5p-64 compile of the shipped stage-2 update step peaks below the planner's update phase (the
    planner is conservative there, by 1.4 x: docs/planner_compile.md), and its arguments are the planner's params + optimizer
    plus the batch rows."""
    import json

    case = json.loads((REPO / "tests/golden/tpu_compiled_memory.json").read_text())["stage2_update_cases"][0]
    plan = plan_for(spec_from_config(load_config(str(REPO / case["config"]), case["overrides"], env={}),
                                     devices=case["devices"], accelerator="v5p"))
    gib = 2 ** 30
    assert case["peak_gib"] <= (plan.params + plan.optimizer + plan.update_bytes) / gib
    assert 0 <= case["argument_gib"] - (plan.params + plan.optimizer) / gib < 0.1

"""The planner on every Gemma 4 member (E2B, E4B, 31B beside 26B-A4B): each planned term tied to the model code it
counts (parameters, matmul weights, the save_dots residuals of each real block, the KV cache, the clean stream's K/V),
and the "what fits where" table of docs/scaling.md re-derived cell by cell from `dgemma plan`."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dgemma.config.sections import OptimSection
from dgemma.model.config import gemma4_e2b, preset, tiny, tiny_31b, tiny_e2b, tiny_e4b
from dgemma.model.transformer import Transformer, abstract_model, count_params
from dgemma.planning.accelerators import GiB, get_accelerator
from dgemma.planning.flops import active_params
from dgemma.planning.layer_bytes import saved_dot_bytes
from dgemma.planning.planner import PlanSpec, activation_bytes, estimate, state_bytes
from dgemma.planning.sdrl_plan import _kv_cache_row_bytes

REPO = Path(__file__).resolve().parents[2]
MEMBERS = ["gemma4_e2b", "gemma4_e4b", "gemma4_31b"]
TWINS = [tiny_e2b, tiny_e4b, tiny_31b]


def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "gemma4_e2b" else pytest.mark.slow)
                                  for n in MEMBERS])
def test_planner_counts_every_parameter(name):
    """Parameter count = the model's (= transformers' + the self-conditioning MLP, tests/model/test_presets.py);
    the per-layer embedding table and projections are in params, gradients and AdamW state."""
    m = preset(name)
    state = state_bytes(m, "fsdp", {"fsdp": 1})
    H, V = m.hidden_size, m.vocab_size
    assert state["total_params"] == count_params(m, include_self_conditioning=True)
    assert state["total_params"] - (3 * H * m.intermediate_size + H) == count_params(m)  # SC MLP + its norm
    assert state["params"] == 4 * state["total_params"] == state["grads"] - 4 * V * H  # + the tied head's gradient
    assert 0 <= state["optimizer"] - 2 * state["params"] < 1024
    if m.hidden_size_per_layer_input:
        table = m.vocab_size_per_layer_input * m.num_hidden_layers * m.hidden_size_per_layer_input
        projection = H * m.num_hidden_layers * m.hidden_size_per_layer_input
        assert table + projection < state["total_params"]
        frozen = state_bytes(m, "fsdp", {"fsdp": 1}, OptimSection(freeze=("per_layer_embedder/table",)))
        assert (state["grads"] - frozen["grads"], state["optimizer"] - frozen["optimizer"]) == (4 * table, 8 * table)


def _matmul_weights(m) -> int:
    """Weights a token multiplies with in the real model: every matrix but the PLE lookup table and the
    self-conditioning MLP (the tied embedding counted once, as the head)."""
    params = nnx.state(abstract_model(m.replace(self_conditioning=False)), nnx.Param)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return sum(int(np.prod(x.shape)) for path, x in flat
               if len(x.shape) >= 2 and "per_layer_embedder/table" not in "/".join(str(getattr(p, "key", p))
                                                                                 for p in path))


@pytest.mark.parametrize("make", TWINS + [gemma4_e2b] + [
    pytest.param(lambda n=n: preset(n), marks=pytest.mark.slow, id=n) for n in ("gemma4_e4b", "gemma4_31b")])
def test_active_params_are_the_models_matmul_weights(make):
    """No K/V projections on KV-shared layers, no v on K = V layers, the double-wide MLP, no experts or router on
    dense-only members, the per-layer gates and the PLE projection: the FLOP count's weights are the model's."""
    m = make()
    assert active_params(m) == _matmul_weights(m)


@pytest.mark.parametrize("make", TWINS + [tiny])
def test_saved_dots_are_each_blocks_residuals(make):
    """remat=save_dots keeps exactly the weight-matmul outputs of each real block (the residuals of a block under the
    save_dots policy minus those under full remat), layer by layer: shared, double-wide, PLE-gated and K = V layers."""
    from dgemma.model.scan import _policy

    m = make().with_execution(dtype="float32")
    model = nnx.eval_shape(lambda: Transformer(m, rngs=nnx.Rngs(0)))
    B, T = 2, 16
    x = jax.ShapeDtypeStruct((B, T, m.hidden_size), jnp.float32)
    for i, block in enumerate(model.layers):
        graphdef, params = nnx.split(block)
        producer = m.kv_producer(i)

        def residual_bytes(policy: str) -> int:
            def run(x, params):
                pli = jnp.ones((B, T, m.hidden_size_per_layer_input)) if m.hidden_size_per_layer_input else None
                shared = None if producer is None else (
                    jnp.ones((B, T, m.layer_kv_heads(producer), m.layer_head_dim(producer))),) * 2
                out, _ = nnx.merge(graphdef, params)(x, jnp.arange(T)[None], jnp.ones((B, T, T), bool), None, False,
                                                     pli, shared)
                return out

            fn = jax.checkpoint(run, policy=_policy(policy))
            return _nbytes(jax.eval_shape(lambda x, p: jax.vjp(fn, x, p)[1], x, params))

        assert residual_bytes("save_dots") - residual_bytes("full") == B * T * saved_dot_bytes(m, i, 4), i


@pytest.mark.parametrize("make,capacity", [(tiny_e2b, 40), (tiny_e4b, 40), (tiny_31b, 9), (gemma4_e2b, 1536)])
def test_kv_cache_bytes_are_the_caches(make, capacity):
    """A rollout's cache: what `KVCache.init` allocates (KV-shared layers keep no slots; E2B at full size)."""
    from dgemma.model.cache import KVCache

    m = make().with_execution(dtype="bfloat16")
    cache = jax.eval_shape(lambda: KVCache.init(m, 3, capacity))
    assert _nbytes([x for x in jax.tree.leaves(cache) if x.ndim]) == 3 * _kv_cache_row_bytes(m, capacity)


def _twin_spec(m, **kw) -> PlanSpec:
    base = dict(model=m, rules="fsdp", mesh={"fsdp": 1}, global_batch=2, prompt_len=16, response_len=16,
                self_cond_pass="noisy_stream", accelerator=get_accelerator("h100"))
    base.update(kw)
    return PlanSpec(**base)


@pytest.mark.parametrize("make", TWINS)
def test_clean_stream_kv_is_what_the_forward_returns(make):
    """The clean stream's K/V kept for the noisy passes: the K/V the real forward returns (None on shared layers)."""
    m = make().with_execution(dtype="bfloat16", attention_impl="chunked")
    spec = _twin_spec(m)
    _, terms, b = activation_bytes(spec)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(m.with_execution(attention_impl="dense"),
                                                                    rngs=nnx.Rngs(0))))
    n = spec.prompt_len + spec.response_len
    masks = {t: jnp.ones((1, n, n), bool) for t in set(m.layer_types)}
    _, kvs = jax.eval_shape(lambda p: nnx.merge(graphdef, p).forward(jnp.zeros((1, n), jnp.int32),
                                                                      jnp.arange(n)[None], masks), params)
    assert any(kv is None for kv in kvs) == bool(m.num_kv_shared_layers)
    assert terms["clean_stream_kv"] == b * _nbytes([kv for kv in kvs if kv is not None])


def test_dense_members_plan_no_experts():
    """The 31B twin (dense MLP, K = V full layers): no MoE activations, dispatch terms or MoE notes, even with
    moe_kernel=xla on GPU (which expands experts densely on MoE models)."""
    m = tiny_31b().with_execution(dtype="bfloat16", attention_impl="chunked", remat="full")
    spec = PlanSpec(model=m, rules="fsdp", mesh={"fsdp": 4}, global_batch=8, prompt_len=16, response_len=16,
                    moe_lowering="dense", accelerator=get_accelerator("h100"), remat="none")
    plan = estimate(spec)
    assert plan.activation_terms["moe"] == 0 and not {"moe_dispatch_backward", "sharded_gathered_experts",
                                                      "ep_gathered_experts"} & set(plan.activation_terms)
    assert not any("moe" in note.lower() or "expert" in note.lower() for note in plan.notes)
    assert plan.active_params == _matmul_weights(m)


def _jaxpr_eqns(jaxpr):
    """Every equation of a jaxpr, the bodies of its loops and checkpoints included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _jaxpr_eqns(inner)


def test_head_backward_term_is_the_loss_heads_buffers():
    """The loss head's backward term counts the chunked head of `token_nll_from_hidden` on the model's tied table:
    the table as the head's dot reads it (activation dtype: gathered, and its gradient all-reduced at that width), the
    table's gradient whole in the parameter dtype, and one chunk of the dot's fp32 logits."""
    from dgemma.diffusion.losses import token_nll_from_hidden
    from dgemma.planning.layer_bytes import head_backward_bytes

    m = tiny_e2b().with_execution(dtype="bfloat16")
    table = abstract_model(m).embedder.embedding.value  # ShapeDtypeStruct [V, H], the parameter dtype
    b, t, chunk = 2, 40, 16
    hidden = jax.ShapeDtypeStruct((b, t, m.hidden_size), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda h, e, y: token_nll_from_hidden(h, e, y, chunk=chunk))(
        hidden, table, jnp.zeros((b, t), jnp.int32))
    dots = [e for e in _jaxpr_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 1
    (hc, tab), (logits,) = [v.aval for v in dots[0].invars], [v.aval for v in dots[0].outvars]
    assert tab.shape == table.shape and hc.shape == (b, chunk, m.hidden_size)
    read, grad, out = (_nbytes(x) for x in (tab, table, logits))
    assert head_backward_bytes(m, 2, b, chunk) == grad + 2 * read + out


def test_head_phase_only_where_a_sharded_table_trains_on_tpu():
    """The phase exists for a trained, FSDP-sharded tied table on a TPU (measured there); not on one device, with
    the table frozen, or on a GPU (unmeasured); it is the gradients, the activations the layers keep, and the
    head's buffers, and it decides the total when larger than the update."""
    from dgemma.planning.layer_bytes import HEAD_PHASE_FREED, head_backward_bytes

    m = gemma4_e2b().with_execution(dtype="bfloat16", attention_impl="chunked", remat="save_dots")
    v5p = get_accelerator("v5p")
    spec = PlanSpec(model=m, rules="fsdp", mesh={"fsdp": 32}, global_batch=64, prompt_len=1024, response_len=1024,
                    self_cond_pass="noisy_stream", accelerator=v5p)
    plan = estimate(spec)
    kept = sum(v for k, v in plan.activation_terms.items() if k not in HEAD_PHASE_FREED)
    assert plan.phases == {"loss_head_backward": int(plan.grads + kept + head_backward_bytes(m, 2, 2, 256))}
    assert plan.total == plan.params + plan.optimizer + max(plan.update_bytes, plan.phases["loss_head_backward"])
    assert plan.phases["loss_head_backward"] > plan.update_bytes  # E2B: the head decides (262,144 x 1536)
    for other in (dict(mesh={"fsdp": 1}, global_batch=2), dict(accelerator=get_accelerator("h100")),
                  dict(optim=OptimSection(freeze=("embedder/embedding",)))):
        assert estimate(dataclasses.replace(spec, **other)).phases == {}, other


def _recorded_reduced_depth_compiles() -> list[dict]:
    """The deviceless v5p-64 compiles of the family members' stage 1 at reduced depth (the real widths and vocabulary,
    2 and 4 layers, one 512-token prompt and one canvas per chip; docs/planner_compile.md, "E2B stage 1 on v5p-64"
    and "E4B and 31B stage 1 on v5p-64"), as experiments/regenerate_compiled_golden.py records them."""
    import json

    return json.loads((REPO / "tests/golden/tpu_compiled_memory.json").read_text())["reduced_depth_cases"]


def _case_id(case: dict) -> str:
    layers = next(o.split("=")[1] for o in case["overrides"] if o.startswith("model.num_hidden_layers="))
    return f"{Path(case['config']).stem}-{layers}layers"


def _planned_for_head_schedule(cfg, plan, tables: int) -> float:
    """The planner's per-chip total (GiB) with `tables` [V, H] tables in the activation dtype at the loss heads'
    backward peak. The planner counts two (`head_backward_bytes`: the AR head's all-reduced gradient and a gathered
    table; E2B's schedule, where XLA gathers the diffusion head's table before the AR head's chunk loop and keeps it
    across it); E4B's and 31B's compiles hold one (XLA frees the gathered table before the gradient's all-reduce).
    The recorded compiles say which (`bf16_vh_tables_at_peak`, read in their live ranges)."""
    m = cfg.model_config
    extra = (2 - tables) * m.vocab_size * m.hidden_size * np.dtype(m.execution.dtype).itemsize
    phase = plan.phases.get("loss_head_backward", 0)
    return (plan.params + plan.optimizer + max(plan.update_bytes, phase - extra)) / GiB


@pytest.mark.parametrize("case", _recorded_reduced_depth_compiles(), ids=_case_id)
def test_planner_agrees_with_the_recorded_reduced_depth_v5p_compiles(case):
    """Within 15 % of XLA's peak per chip on each recorded reduced-depth compile (2 and 4 layers of every dense member:
    the gap does not grow with depth, so it is neither the per-layer table, whose size doubles, nor a per-layer term),
    with the loss heads' tables the compile held at its peak; the planner as it plans (two tables) is never below the
    compiled peak by more than 15 %; its params + optimizer are the compiled arguments (2 decimals of a GiB)."""
    from dgemma.config import load_config
    from dgemma.planning.plan_config import plan_for, spec_from_config

    cfg = load_config(REPO / case["config"], case["overrides"], env={})
    plan = plan_for(spec_from_config(cfg, devices=case["devices"], accelerator="v5p"))
    assert plan.examples_per_device == case["examples_per_chip"]
    assert (plan.params + plan.optimizer) / GiB == pytest.approx(case["argument_gib"], abs=0.006)
    peak = case["peak_gib"]
    assert peak <= 1.15 * plan.total / GiB, (peak, plan.total / GiB)
    assert _planned_for_head_schedule(cfg, plan, 2) == pytest.approx(plan.total / GiB)
    matched = _planned_for_head_schedule(cfg, plan, case["bf16_vh_tables_at_peak"])
    assert abs(matched / peak - 1) <= 0.15, (peak, matched, plan.total / GiB)


def test_recorded_reduced_depth_compiles_cover_each_dense_member_at_two_depths():
    """E2B, E4B and 31B each have a recorded compile at 2 and at 4 layers."""
    got = {_case_id(c) for c in _recorded_reduced_depth_compiles()}
    assert got >= {f"gemma4_{m}-{n}layers" for m in ("e2b", "e4b", "31b") for n in (2, 4)}


# MARK: docs/scaling.md's "what fits where" table ------------------------------------------------------------------
TARGETS = {"1×H100": (1, "h100"), "1×H200": (1, "h200"), "8×H100": (8, "h100"), "v5p-64": (32, "v5p")}
CELL = re.compile(r"^([0-9.]+) (FITS|\*\*DOES NOT FIT\*\*)(?: \((.+)\))?$")


def _family_table() -> tuple[list[str], list[list[str]]]:
    text = (REPO / "docs/scaling.md").read_text()
    section = text.split("### Gemma 4 family: what fits where\n", 1)[1].split("\n#", 1)[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    cols = [c.strip() for c in lines[0].strip("|").split("|")]
    return cols, [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]


def test_family_table_lists_every_member_and_stage():
    """Each member's shipped stage-1 and stage-2 config has a row, every target a column, and the shipped configs fit
    their targets (E2B: 1 x H200; E4B, 31B, 26B-A4B: 8 x H100)."""
    cols, rows = _family_table()
    assert cols[3:] == list(TARGETS)
    shipped = {(r[0], r[1]): r for r in rows if r[2].count("`") == 2 and "_lora.yaml" not in r[2]}
    target = {"E2B": "1×H200", "E4B": "8×H100", "31B": "8×H100", "26B-A4B": "8×H100"}
    for member, where in target.items():
        for stage in ("1", "2"):
            row = shipped[(member, stage)]
            assert row[2] == f"`configs/stage{stage}/gemma4_{member.lower().replace('-', '_')}.yaml`"
            assert CELL.match(row[3 + list(TARGETS).index(where)]).group(2) == "FITS", (member, stage)


def _check_row(row: list[str], targets: list[str]) -> None:
    from dgemma.config import load_config
    from dgemma.planning.plan_config import plan_for, spec_from_config

    path, *overrides = re.findall(r"`([^`]+)`", row[2])
    for name, cell in zip(TARGETS, row[3:]):
        if name not in targets or cell == "—":
            continue
        got = CELL.match(cell)
        assert got, (row[:3], name, cell)
        extra = re.findall(r"`([^`]+)`", got.group(3) or "")
        devices, acc = TARGETS[name]
        plan = plan_for(spec_from_config(load_config(REPO / path, overrides + extra, env={}), devices=devices,
                                         accelerator=acc))
        assert f"{plan.total / GiB:.1f}" == got.group(1), (row[:3], name)
        assert plan.fits == (got.group(2) == "FITS"), (row[:3], name)


@pytest.mark.parametrize("members", [("E2B",), pytest.param(("E4B", "31B", "26B-A4B"), marks=pytest.mark.slow)])
def test_family_table_cells_are_the_planners(members):
    """Every cell of the table: `dgemma plan` of the row's config and overrides on the column's target."""
    rows = [r for r in _family_table()[1] if r[0] in members and "_lora.yaml" not in r[2]]
    assert {r[0] for r in rows} == set(members)
    for row in rows:
        _check_row(row, list(TARGETS))


# The adapter rows: each member's shipped `_lora.yaml` configs and the one GPU they fit as shipped (no override).
ADAPTER_TARGET = {"E2B": "1×H100", "E4B": "1×H100", "31B": "1×H200", "26B-A4B": "1×H200"}


def _adapter_rows() -> dict[tuple[str, str], list[str]]:
    return {(r[0], r[1]): r for r in _family_table()[1] if "_lora.yaml" in r[2]}


def test_family_table_has_every_members_adapter_configs():
    """A rank-16 adapter row per member and stage, its config the shipped `_lora.yaml` with no overrides, adapting what
    the 26B-A4B configs adapt (attention projections and MLPs; experts only where there are experts), and FITS on its
    one-GPU target as shipped."""
    from dgemma.config import load_config

    rows = _adapter_rows()
    assert set(rows) == {(m, s) for m in ADAPTER_TARGET for s in ("1", "2")}
    moe_targets = load_config(REPO / "configs/stage1/gemma4_26b_a4b_lora.yaml", env={}).lora.targets
    for (member, stage), row in rows.items():
        path = f"configs/stage{stage}/gemma4_{member.lower().replace('-', '_')}_lora.yaml"
        assert row[2] == f"`{path}`", (member, stage)
        lora = load_config(REPO / path, env={}).lora
        assert lora.rank == 16 and lora.alpha == 32.0, path
        want = moe_targets if member == "26B-A4B" else tuple(t for t in moe_targets if not t.startswith("experts/"))
        assert tuple(lora.targets) == tuple(want), path
        cell = row[3 + list(TARGETS).index(ADAPTER_TARGET[member])]
        assert CELL.match(cell).group(2) == "FITS" and CELL.match(cell).group(3) is None, (member, stage, cell)


@pytest.mark.parametrize("key", [pytest.param(k, marks=pytest.mark.slow, id="-".join(k)) for k in [
    ("E2B", "1"), ("E2B", "2"), ("E4B", "1"), ("E4B", "2"), ("31B", "1"), ("31B", "2"), ("26B-A4B", "1"), ("26B-A4B", "2")]])
def test_family_table_adapter_cells_are_the_planners(key):
    """Every cell of an adapter row: `dgemma plan` of the `_lora.yaml` config and the cell's overrides."""
    _check_row(_adapter_rows()[key], list(TARGETS))

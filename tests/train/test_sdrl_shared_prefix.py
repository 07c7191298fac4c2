"""The replay of SD·RL state rows with each rollout's clean stream run once (`Iteration.shared_prefix`,
`states.shared_prefix_batch`, `dgemma.inference.replay_shared`) equals the previous per-row one-pass replay: the
tempered logits and log-probs, and the loss, its metrics and every gradient of the update (exact KL and k3, anchor
on; unscanned, and scanned layers with the anchor on the replay's twin), to fp32 summation order; also with only the
(row, block) states that ran replayed (`state_index`, `Iteration.ran_states_only`)."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from support.block_layout import assert_rel_close, perturb_params
from dgemma.config import load_config
from dgemma.inference.rollout import rollout
from dgemma.model.transformer import Transformer
from dgemma.train.sdrl.loss import make_sdrl_loss_fn, state_logits, state_logprobs
from dgemma.train.sdrl.states import build_state_rows, pad_rows, per_row_batch, ran_states, shared_prefix_batch
from dgemma.train.sdrl.targets import build_targets
from dgemma.train.sdrl.teacher import student_sampler

REPO = Path(__file__).resolve().parents[2]
EOS, PAD = 1, 0
SMALL = ["model.num_hidden_layers=2", "model.layer_types=[sliding_attention, full_attention]", "data.batch_size=2",
         "sdrl.group_size=2", "sampler.max_steps=4", "sdrl.anchor_weight=0.1", "sdrl.anchor_ar_weight=0.1"]
TOL = 1e-5


@functools.lru_cache(maxsize=4)
def _setup(kl: str, scan: bool = False):
    """(cfg, graphdef, params, rows, anchor): the first data batch's 2 prompts x 2 rollouts, every recorded state
    (several rows per rollout), padded to a power of two; π_old / π_ref stand-ins; the anchor rows of (q, y*)."""
    from dgemma.data.pipeline import DataPipeline
    from dgemma.train.sdrl.anchor import anchor_rows

    cfg = load_config(REPO / "configs/stage2/tiny.yaml", [*SMALL, f"sdrl.kl_estimator={kl}"])
    mc = cfg.model_config.with_execution(scan_layers=True, scan_period=2) if scan else cfg.model_config
    model = perturb_params(Transformer(mc, rngs=nnx.Rngs(3)))
    batch = DataPipeline(cfg.data).batch(0)
    P = cfg.data.layout.prompt_len
    prompts = np.asarray(batch["tokens"])[:, :P]
    valid = np.asarray(batch["prompt_mask"])[:, :P].astype(bool)
    assert (~valid).any()  # left padding: the prefix rows carry their own prompt validity
    ro = rollout(model, prompts, valid, student_sampler(cfg, 4, 16), jax.random.key(0), group_size=2)
    committed = np.asarray(ro.record.tokens).transpose(1, 0, 2)
    t = build_targets(committed[[0, 2]], np.ones(2), committed, np.zeros(4), np.ones(4), 2, reward_max=1.0,
                      eos_ids=(EOS,), pad_id=PAD, tail_id=EOS)
    rows = build_state_rows(ro.record, ro.prompts, ro.prompt_valid, ro.prompt_index, t,
                            np.asarray([1.0, -1.0, 0.5, -0.5]), n_blocks=2, eos_ids=(EOS,), pad_id=PAD, tail_id=EOS)
    # this random model never stops a block early; as a block that stops early would, block 1 of every other row
    # has no state at that step (what `build_state_rows` writes then: state_ran False, masks False, τ 1)
    gone = np.zeros_like(rows.state_ran)
    gone[::2, 1] = gone[1, 1] = True  # 23 of 32 states ran: `state_index` pads them to 24
    rows = rows.replace(state_ran=rows.state_ran & ~gone, pg_mask=rows.pg_mask & ~gone[..., None],
                        sd_mask=rows.sd_mask & ~gone[..., None], tau=np.where(gone, 1.0, rows.tau).astype(np.float32))
    rows = pad_rows(rows, 8)
    rng = np.random.default_rng(1)
    n, nb, L = rows.output.shape
    rows = rows.replace(logp_old=rng.normal(-2.0, 0.5, (n, nb, L)).astype(np.float32),
                        logp_ref=rng.normal(-2.0, 0.5, (n, nb, L)).astype(np.float32),
                        ref_logits=rng.normal(0.0, 1.0, (n, nb, L, mc.vocab_size)).astype(np.float32))
    y = committed[[0, 2]].copy()
    y[:, 1, 0] = EOS  # a one-block answer: y* fits the canvas with its EOS, so the anchor rows carry weight
    a = anchor_rows(batch, y, np.ones(2, bool), cfg.data.layout, eos_id=EOS, pad_id=PAD, bos_id=None)
    graphdef, params = nnx.split(model)
    return cfg, graphdef, params, rows, {f"anchor/{k}": v for k, v in a.items()}


def test_prefix_batch_holds_each_distinct_clean_stream_once():
    _, _, _, rows, _ = _setup("k3")
    b = shared_prefix_batch(rows, multiple=2)
    idx = b["prefix_index"]
    assert "prompts" not in b and "committed" not in b and b["canvas"].shape[0] == len(rows)
    np.testing.assert_array_equal(b["prefix_prompts"][idx], rows.prompts)
    np.testing.assert_array_equal(b["prefix_prompt_valid"][idx], rows.prompt_valid)
    np.testing.assert_array_equal(b["prefix_committed"][idx], rows.committed)
    distinct = len(np.unique(rows.rollout))  # the 4 rollouts (padding rows repeat row 0's)
    assert len(np.unique(idx)) == distinct and len(rows) >= 2 * distinct
    assert b["prefix_prompts"].shape[0] % 2 == 0 and b["prefix_prompts"].shape[0] >= distinct
    back, want = per_row_batch(b), rows.batch()  # the inverse gives every row its own fields back
    assert back.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(back[k], want[k], err_msg=k)


def test_state_index_lists_the_states_that_ran_padded_out_of_range():
    _, _, _, rows, _ = _setup("k3")
    b = shared_prefix_batch(rows, multiple=2, ran_only=True)
    total = rows.state_ran.size
    ran = np.flatnonzero(rows.state_ran.reshape(-1))
    idx = b["state_index"]
    assert 0 < len(ran) < total  # some blocks stopped early: their later states did not run
    np.testing.assert_array_equal(idx[:len(ran)], ran)
    assert (idx[len(ran):] == total).all() and len(idx) == ran_states(len(ran), total, 2) and len(idx) % 2 == 0
    assert "state_index" not in per_row_batch(b)
    # bucketed: an eighth of the states per step, never above them all
    assert [ran_states(r, 256, 2) for r in (0, 1, 32, 33, 145, 256)] == [32, 32, 32, 64, 160, 256]


@pytest.mark.parametrize("with_soft,ran_only", [(True, False), (True, True),
                                                pytest.param(False, True, marks=pytest.mark.slow)])
def test_shared_prefix_replay_equals_the_per_row_replay(with_soft, ran_only):
    _, graphdef, params, rows, _ = _setup("k3")
    if not with_soft:
        rows = rows.replace(soft_embeds=None)
    old, new = rows.batch(), shared_prefix_batch(rows, ran_only=ran_only)
    if ran_only:  # the padding entries (dropped on the way back) are exercised
        assert len(new["state_index"]) > rows.state_ran.sum()
    both = np.stack([rows.output, rows.target], -1)

    @jax.jit
    def f(batch):
        model = nnx.merge(graphdef, params)
        return state_logits(model, batch), state_logprobs(model, batch, both)

    (z_old, lp_old), (z_new, lp_new) = f(old), f(new)
    ran = rows.state_ran
    assert ran.sum() > len(rows)  # many states, more than one per rollout
    assert_rel_close(np.asarray(z_new)[ran], np.asarray(z_old)[ran], TOL, "logits")
    assert_rel_close(np.asarray(lp_new)[ran], np.asarray(lp_old)[ran], TOL, "log-probs")


@pytest.mark.parametrize("kl,scan,ran_only", [("k3", False, True),
                                              pytest.param("k3", False, False, marks=pytest.mark.slow),
                                              pytest.param("exact", False, True, marks=pytest.mark.slow),
                                              pytest.param("k3", True, True, marks=pytest.mark.slow)])
def test_shared_prefix_update_has_the_same_loss_metrics_and_gradients(kl, scan, ran_only):
    cfg, graphdef, params, rows, anchor = _setup(kl, scan)
    loss_fn = make_sdrl_loss_fn(cfg.sdrl, cfg.diffusion)

    @jax.jit
    def grads(p, batch):
        return jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), batch, jax.random.key(5)),
                                  has_aux=True)(p)

    (l_old, m_old), g_old = grads(params, {**rows.batch(), **anchor})
    (l_new, m_new), g_new = grads(params, {**shared_prefix_batch(rows, ran_only=ran_only), **anchor})
    assert float(m_old["loss_anchor"]) > 0 and float(m_old["loss_pg"]) != 0 and float(m_old["loss_kl"]) != 0
    assert_rel_close(l_new, l_old, TOL, "loss")
    for k in m_old:
        assert_rel_close(m_new[k], m_old[k], TOL, k)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_new), jax.tree.leaves(g_old), strict=True):
        assert_rel_close(a, b, TOL, jax.tree_util.keystr(path))


def test_the_shared_prefix_replay_is_the_iterations_default():
    from dgemma.train.sdrl.iteration import Iteration

    assert Iteration.shared_prefix is True  # the previous path stays selectable for the benchmark's --compare
    assert Iteration.ran_states_only is True

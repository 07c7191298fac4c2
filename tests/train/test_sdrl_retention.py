"""Retention rows of the SD·RL anchor (`sdrl.retention_mix`, `sdrl.retention_rows`; dgemma.train.sdrl.retention).

Default suite: the config check, the retention stream's rows (the mix's tasks, the stage-1 layout with the data's
answers), their term in the total loss, and the study's held-out prompts avoiding them. Slow: one SD·RL
iteration from random weights, where nothing is verified: the anchor has no rows, the retention term trains.
"""

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from dgemma.config import load_config
from dgemma.config.errors import ConfigError
from dgemma.train.sdrl.retention import RetentionStream, retention_data_config, term_weights

REPO = Path(__file__).resolve().parents[2]
CHOICE = REPO / "experiments/sdrl_study/stage2_choice.yaml"
MIX = "sdrl.retention_mix=[{name: copy, min_len: 6, max_len: 6}, {name: sort, min_len: 6, max_len: 6}]"


def _cfg(*overrides):
    return load_config(CHOICE, list(overrides))


@pytest.mark.parametrize("overrides, pattern", [
    (["sdrl.retention_rows=4"], r"sdrl.retention_rows=4 and sdrl.retention_mix \(0 tasks\): set both"),
    ([MIX], r"sdrl.retention_rows=0 and sdrl.retention_mix \(2 tasks\): set both"),
    ([MIX, "sdrl.retention_rows=2", "sdrl.retention_weight=0"],
     r"sdrl.retention_mix: its rows train with weight sdrl.retention_weight, which is 0"),
    ([MIX, "sdrl.retention_rows=2", "sdrl.retention_weight=-1"], r"sdrl.retention_weight: -1.0 must be >= 0"),
    (["sdrl.retention_mix=[{name: copy}, {name: copy}]", "sdrl.retention_rows=2"], "task names must be unique"),
])
def test_bad_retention_settings_are_one_line_errors(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern) as e:
        _cfg(*overrides)
    assert "\n" not in str(e.value)


def test_retention_rows_are_the_mix_with_the_data_answers_behind_the_anchor():
    cfg = _cfg(MIX, "sdrl.retention_rows=4")
    assert retention_data_config(_cfg()) is None
    stream = RetentionStream(cfg, _tokenizer(cfg))
    tasks = [t for i in range(4) for t in stream.tasks(i)]
    assert set(tasks) == {"copy", "sort"} and len(tasks) == 16  # never a task of the SD·RL stream (pick, fill)
    rows = stream.rows(0)
    assert rows["tokens"].shape[0] == 4 and rows["diffusion_weight"].sum() > 0 and rows["ar_weight"].sum() > 0
    # the data's answer is the response: the sorted digits for sort, the prompt's digits for copy
    tok = stream.pipeline.tokenizer
    src = stream.pipeline.source
    for r, ix in enumerate(rows["index"]):
        ex = src[int(ix)]
        w = np.asarray(rows["diffusion_weight"][r]) > 0  # over the response canvases, after the prompt
        resp = rows["tokens"][r][-w.size:][w]
        text = tok.decode([t for t in resp.tolist() if t != tok.eos_id])
        assert text.replace(" ", "") == ex.response.replace(" ", "")
    assert np.array_equal(stream.rows(1)["index"], RetentionStream(cfg, _tokenizer(cfg)).rows(1)["index"])  # resume


def test_retention_is_a_term_of_its_own_weighted_by_lambda_ret():
    import jax.numpy as jnp

    from dgemma.diffusion import sdrl_objective as so

    cfg = _cfg(MIX, "sdrl.retention_rows=4", "sdrl.retention_weight=0.5", "sdrl.anchor_weight=0.1")
    w = term_weights(cfg.sdrl)
    assert w.retention == 0.5 and w.anchor == 0.1 and term_weights(_cfg().sdrl).retention == 0.0
    terms = {"loss_pg": jnp.float32(0.0), "loss_sd": jnp.float32(0.0), "loss_kl": jnp.float32(0.0)}
    assert float(so.total_loss(terms, w, anchor=2.0, retention=3.0)) == pytest.approx(0.1 * 2.0 + 0.5 * 3.0)
    # off without a mix: a NaN there cannot leak
    assert float(so.total_loss(terms, term_weights(_cfg().sdrl), anchor=0.0, retention=float("nan"))) == 0.0


def test_study_held_out_avoids_the_retention_stream_and_decodes_retention_tasks():
    from dgemma.train.study import build_parser, held_out

    from dgemma.eval.heldout import training_prompts
    from dgemma.train.study import study_cfg

    # 2-digit copy and sort: 100 prompts each, so the retention stream's 48 rows would collide with 20 held-out ones
    short = "[{name: copy, min_len: 2, max_len: 2}, {name: sort, min_len: 2, max_len: 2}]"
    args = build_parser(CHOICE).parse_args([
        "--stage1", "unused", "--tasks", "pick", "fill", "--retention-tasks", "copy", "sort", "--iterations", "3",
        "--eval-per-task", "20", "--train-stream", f"{CHOICE}:1", "--override", f"sdrl.retention_mix={short}",
        "sdrl.retention_rows=16", "data.tasks=[{name: pick, min_len: 40, max_len: 40}, "
        "{name: fill, min_len: 40, max_len: 40}, " + short[1:]])
    cfg = study_cfg(args, "sdrl", 0)
    held = held_out(args, cfg)
    assert {len(e.prompt) for e in held.examples if e.task == "copy"} == {4}  # C d d | : the study config's lengths
    assert held.per_task() == {"copy": 20, "fill": 20, "pick": 20, "sort": 20} and held.overlap == 0
    assert not {e.prompt for e in held.examples} & training_prompts([(retention_data_config(cfg), 3)])
    args.retention_tasks = ["pick"]
    with pytest.raises(SystemExit, match=r"--retention-tasks: \['pick'\] are SD·RL tasks"):
        held_out(args, cfg)


def _tokenizer(cfg):
    from dgemma.data.tokenizer import build_tokenizer

    return build_tokenizer(cfg.data.tokenizer)


@pytest.mark.slow
def test_retention_rows_train_where_nothing_is_verified(tmp_path):
    """From random weights nothing is verified, so the anchor on (q, y*) has no rows (loss 0); retention rows train
    their own term (loss > 0, added to the total) and the iteration reports their count."""
    import jax

    from dgemma.parallel.mesh import make_mesh
    from dgemma.train.sdrl import run_sdrl

    small = ["model.num_hidden_layers=2", "model.layer_types=[sliding_attention, full_attention]", "trainer.steps=1",
             "data.batch_size=4", "sdrl.group_size=2", "sampler.max_steps=4", "sdrl.teacher_sampler.max_steps=8",
             "sdrl.curriculum_max_steps=[3]", "sdrl.states_per_rollout=2", "sdrl.inner_epochs=1",
             "sdrl.anchor_weight=0.5", "checkpoint.every=0", "sdrl.allow_random_init=true",
             f"run.output_dir={tmp_path}"]
    out = {}
    for name, extra in [("off", []), ("on", [MIX, "sdrl.retention_rows=2"])]:
        cfg = _cfg(*small, f"run.name={name}", *extra)
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(
            cfg.data, tasks=tuple(t for t in cfg.data.tasks if t.name == "pick")))
        out[name] = run_sdrl(cfg, progress=False, mesh=make_mesh({"fsdp": 1}, devices=jax.devices()[:1])).history[0]
    assert out["off"]["anchor_rate"] == 0.0 and out["off"]["loss_anchor"] == 0.0
    assert out["off"]["retention_rows"] == 0.0 and out["off"]["loss_retention"] == 0.0
    assert out["on"]["retention_rows"] == 2.0 and out["on"]["loss_retention"] > 0.0
    assert out["on"]["loss_anchor"] == 0.0  # the anchor is untouched: its (q, y*) rows are still none
    assert out["on"]["loss"] > out["off"]["loss"]

"""`dgemma eval` and the SD·RL periodic evaluation read held-out prompts disjoint from the training stream.

Both use a small prompt space (copy/sort of 1-2 digits: 110 prompts per task), where a seed change alone puts most
training prompts in the "held-out" set, and recount the training prompts independently from the pipeline's batches.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dgemma.cli.main import main
from dgemma.config import load_config
from dgemma.data.pipeline import DataPipeline

REPO = Path(__file__).resolve().parents[2]
STAGE1 = REPO / "configs/stage1/tiny.yaml"
STAGE2 = REPO / "configs/stage2/tiny.yaml"
SMALL_SPACE = "data.tasks=[{name: copy, min_len: 1, max_len: 2}, {name: sort, min_len: 1, max_len: 2}]"


def _seen(data_cfg, steps: int) -> set[str]:
    """Prompts the training pipeline reads in its first `steps` batches (independent of dgemma.eval.heldout)."""
    pipe = DataPipeline(data_cfg, process_index=0, process_count=1)
    return {pipe.source[int(i)].prompt for s in range(steps) for i in pipe.batch(s)["index"]}


def test_sdrl_periodic_eval_default_is_deduplicated_against_the_iterations(caplog):
    from dgemma.train.sdrl.session import EVAL_SEED_OFFSET, _eval_data

    cfg = load_config(STAGE2, [SMALL_SPACE, "trainer.steps=12", "trainer.eval_every=4", "trainer.eval_batches=2",
                               "data.batch_size=8", "data.num_threads=0"])
    seen = _seen(cfg.data, 12)
    # the premise: the old default (the same mix at another seed) evaluates on prompts the iterations train on
    shifted = DataPipeline(dataclasses.replace(cfg.data, seed=cfg.data.seed + EVAL_SEED_OFFSET), process_index=0, process_count=1)
    assert any(shifted.source[i].prompt in seen for i in range(16))
    with caplog.at_level("INFO", logger="dgemma.train.sdrl.session"):
        held, overlap = _eval_data(cfg, DataPipeline(cfg.data), None)
    prompts = [e.prompt for e in held.examples]
    assert overlap == held.overlap == 0 and held.dropped_overlap > 0
    assert not seen & set(prompts) and len(set(prompts)) == len(prompts) == 16  # eval_batches x batch_size
    assert held.per_task() == {"copy": 8, "sort": 8} and held.num_batches == 2
    assert "overlap with the training stream: 0" in caplog.text
    # a caller's set that overlaps training is refused; a plain pipeline is accepted with a warning
    held.overlap = 3
    with pytest.raises(ValueError, match="3 held-out prompts occur in the training stream"):
        _eval_data(cfg, None, held)
    assert _eval_data(cfg, None, shifted) == (shifted, None)


def test_sdrl_periodic_eval_refuses_non_synthetic_data_before_writing(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "12", "response": "12"}\n' * 8)
    code = main(["train", "-c", str(STAGE2), "--no-progress", f"run.output_dir={tmp_path}", "run.name=ev",
                 "data.source=json", f"data.paths=[{data}]", "data.batch_size=4", "trainer.eval_every=1",
                 "sdrl.allow_random_init=true"])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (earlier lines: the json loader's progress bar)
    assert code != 0 and err.startswith("dgemma train: "), err
    assert "trainer.eval_every" in err and "data.source='json'" in err, err
    assert not (tmp_path / "ev").exists()


def _other_config(tmp_path) -> Path:
    """E.g. the stage-1 config a stage-2 run started from: the same small mix at another seed, 100 steps."""
    other = tmp_path / "other.yaml"
    other.write_text(f"base: [{STAGE1}]\ndata:\n  seed: 5\n  tasks:\n    - {{name: copy, min_len: 1, max_len: 2}}\n"
                     "    - {name: sort, min_len: 1, max_len: 2}\ntrainer:\n  steps: 100\n")
    return other


def test_dgemma_eval_streams_exclude_the_config_and_every_exclude_config(tmp_path):
    """The streams `dgemma eval` deduplicates against (reduced version of the slow end-to-end test below)."""
    import argparse

    from dgemma.cli.eval import _train_streams
    from dgemma.eval.heldout import held_out_rows

    other = _other_config(tmp_path)
    cfg = load_config(STAGE1, [SMALL_SPACE, "trainer.steps=20"])
    ns = lambda steps, *ex: argparse.Namespace(train_steps=steps, exclude=list(ex))  # noqa: E731
    assert [s for _, s in _train_streams(cfg, ns(None, f"{other}:10", str(other)))] == [20, 10, 100]
    assert [s for _, s in _train_streams(cfg, ns(7))] == [7]
    streams = _train_streams(cfg, ns(None, f"{other}:10"))
    held = held_out_rows(cfg.data, rows=6, batch_size=6, train_streams=streams)
    seen_other = _seen(streams[1][0], 10)
    assert held.overlap == 0 and not (_seen(cfg.data, 20) | seen_other) & {e.prompt for e in held.examples}
    alone = held_out_rows(cfg.data, rows=6, batch_size=6, train_streams=streams[:1])
    assert seen_other & {e.prompt for e in alone.examples}  # the premise: the --exclude stream is what keeps them out


@pytest.mark.slow  # restores a model and compiles AR decoding (~80 s on the loaded 2-core VM)
def test_dgemma_eval_prompts_are_disjoint_from_every_training_stream(tmp_path, capsys):
    """`dgemma eval` (AR mode: the cheapest compile) excludes the config's own stream and an --exclude stream."""
    from flax import nnx

    from dgemma.checkpoint import save_params
    from dgemma.model.transformer import Transformer

    cfg = load_config(STAGE1, [])
    save_params(tmp_path / "params", 1, nnx.state(Transformer(cfg.model_config, rngs=nnx.Rngs(0)), nnx.Param))
    other = _other_config(tmp_path)
    args = ["eval", "-c", str(STAGE1), "--checkpoint", str(tmp_path / "params"), SMALL_SPACE, "trainer.steps=20",
            "--modes", "ar", "--batches", "1", "--batch-size", "6", "--exclude", f"{other}:10",
            "--plot-dir", str(tmp_path / "ev"), "sampler.max_new_tokens=8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "overlap with the training stream: 0" in out
    res = json.loads((tmp_path / "ev" / "eval.json").read_text())
    held = res["held_out"]
    run_cfg = load_config(STAGE1, [SMALL_SPACE])
    seen = _seen(run_cfg.data, 20) | _seen(load_config(other, []).data, 10)
    assert held["overlap"] == 0 and held["dropped_overlap"] > 0 and held["per_task"] == {"copy": 3, "sort": 3}
    assert not seen & set(held["prompts"]) and res["ar"]["metrics"]["n"] == 6
    # bad flags: one line, exit 2
    assert main([*args[:5], "--train-steps", "-1"]) == 2
    assert "--train-steps -1: must be >= 0" in capsys.readouterr().err

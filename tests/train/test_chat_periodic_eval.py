"""`trainer.eval_every` on chat (file) data: held-out files `data.eval_paths`, read as the training files are (the
tiny-chat template and canvas layout), evaluated with the denoising metrics and the sampler's held-out metrics, and
refused at start-up, before the run dir exists, when they share a prompt with `data.paths` or cannot be read.

The data are a few hand-written GSM8K-style conversations (context 23 tokens, answer + <turn|> 16 under the
template), in a tiny layout: canvases of 8, prompt 32, 3 blocks, two layers of the tiny chat model."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from support.scripts import REPO

CHAT = REPO / "configs/chat/tiny.yaml"


def _conversation(a: int, b: int) -> dict:
    return {"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                         {"role": "assistant", "content": f"{a} + {b} = {a + b}\n#### {a + b}"}]}


def _write(path, pairs) -> str:
    path.write_text("".join(json.dumps(_conversation(a, b)) + "\n" for a, b in pairs))
    return str(path)


TRAIN = [(1, 2), (3, 4), (5, 6), (7, 8), (11, 12), (13, 14)]
HELD_OUT = [(21, 22), (23, 24), (25, 26)]


def _cfg(tmp_path, eval_paths, **overrides):
    from dgemma.config import load_config

    base = {"run.output_dir": str(tmp_path / "runs"), "data.paths": [_write(tmp_path / "train.jsonl", TRAIN)],
            "data.eval_paths": eval_paths, "model.canvas_length": 8, "model.num_hidden_layers": 2,
            "model.layer_types": ["sliding_attention", "full_attention"],
            "data.layout": {"prompt_len": 32, "n_blocks": 3}, "data.batch_size": 2, "data.num_threads": 0,
            "trainer.steps": 2, "trainer.log_every": 1, "trainer.eval_every": 1, "trainer.eval_batches": 2,
            "sampler.max_steps": 3, "checkpoint.every": 0}
    base.update(overrides)
    return load_config(CHAT, base, env={})


def test_eval_every_evaluates_the_held_out_chat_files(tmp_path):
    import jax

    from dgemma.parallel.mesh import make_mesh
    from dgemma.train.trainer import train

    held = _write(tmp_path / "heldout.jsonl", HELD_OUT)
    # one device, as the config's configs/mesh/single.yaml says (the suite's process simulates 8)
    summary = train(_cfg(tmp_path, [held]), progress=False, save_params_at_end=False,
                    mesh=make_mesh({"fsdp": 1}, devices=jax.devices()[:1]))
    rows = [json.loads(line) for line in (tmp_path / "runs/chat_tiny/metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/diffusion/exact_match" in r]
    assert [r["step"] for r in evals] == [1, 2]
    for r in evals:
        # eval_batches x batch_size = 4 rows asked, the file has 3: the padding row of the last batch is not scored
        assert r["eval/diffusion/n"] == 3 and r["eval/diffusion/n/gsm8k"] == 3 and r["eval/heldout_overlap"] == 0
        assert 0.0 <= r["eval/diffusion/exact_match/gsm8k"] <= 1.0 and r["eval/diffusion/tpf"] > 0
        assert 1.0 <= r["eval/diffusion/steps_per_block"] <= 3.0 and r["eval/diffusion/max_steps"] == 3
        for t in (0.1, 0.5, 0.9):
            assert math.isfinite(r[f"eval/nll_t{t:g}"]) and 0.0 <= r[f"eval/acc_t{t:g}"] <= 1.0
    # a random start over the 4,096 ids, and training moved the model between the two evaluations
    assert evals[0]["eval/nll_t0.5"] < math.log(4096) + 1 and evals[0]["eval/nll_t0.5"] != evals[1]["eval/nll_t0.5"]
    assert summary.last_metrics["eval/diffusion/tpf"] == evals[-1]["eval/diffusion/tpf"]


def test_the_held_out_set_is_the_eval_files_read_as_training_reads_its_files(tmp_path):
    from dgemma.data.pipeline import DataPipeline
    from dgemma.train.periodic_eval import held_out_for

    held = _write(tmp_path / "heldout.jsonl", HELD_OUT)
    cfg = _cfg(tmp_path, [held])
    train = DataPipeline(cfg.data, process_index=0, process_count=1)
    held_out = held_out_for(cfg, train)
    assert [e.answer for e in held_out.source] == ["43", "47", "51"] and held_out.overlap == 0
    assert held_out.num_batches == 2 and not bool(held_out.batch(1)["example_mask"][1])
    # the same encoding as a training row: the held-out conversation written as the training file encodes alike
    as_train = DataPipeline(dataclasses.replace(cfg.data, paths=(held,)), tokenizer=train.tokenizer,
                            process_index=0, process_count=1)
    for key in ("tokens", "valid", "diffusion_weight"):
        assert (held_out.batch(0)[key][0] == as_train.encode(as_train.source[0])[key]).all(), key


SDRL = {"trainer.objective": "sdrl", "sdrl.allow_random_init": True, "data.messages.turns": "last",
        "sampler.max_steps": 16}


@pytest.mark.parametrize("objective", ["stage1", "sdrl"])
def test_a_held_out_file_sharing_a_prompt_with_training_is_refused_before_anything_is_written(tmp_path, objective):
    """The same set and check for every objective's periodic evaluation (SD·RL's reads it too)."""
    from dgemma.eval.heldout import TrainingOverlapError
    from dgemma.train.trainer import train

    # line 2 asks what training line 4 asks (another answer: the prompt is what must be new)
    held = tmp_path / "heldout.jsonl"
    held.write_text(json.dumps(_conversation(21, 22)) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "What is 7 + 8?"},
                                               {"role": "assistant", "content": "#### 16"}]}) + "\n")
    with pytest.raises(TrainingOverlapError) as e:
        train(_cfg(tmp_path, [str(held)], **(SDRL if objective == "sdrl" else {})), progress=False)
    msg = str(e.value)
    assert "\n" not in msg and f"{held}:2 has the prompt of the training row {tmp_path / 'train.jsonl'}:4" in msg
    assert "1 of the 2 held-out prompts" in msg
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("case", ["unset", "missing", "empty", "bad row"])
def test_eval_paths_missing_empty_or_unreadable_is_refused_naming_the_file(tmp_path, case):
    from dgemma.train.trainer import train

    path = tmp_path / "heldout.jsonl"
    if case == "empty":
        path.write_text("")
    elif case == "bad row":
        path.write_text(json.dumps(_conversation(21, 22)) + "\n" + '{"messages": [{"role": "robot", "content": "x"}]}\n')
    want = {"unset": r"trainer\.eval_every=1: data\.source='messages' evaluates on held-out files: set "
                     r"data\.eval_paths",
            "missing": f"data.eval_paths: {path}: no such file", "empty": f"data.eval_paths: {path}: the file is empty",
            "bad row": f"data.eval_paths: {path}:2: "}[case]
    with pytest.raises(ValueError, match=want if case == "unset" else None) as e:
        train(_cfg(tmp_path, [] if case == "unset" else [str(path)]), progress=False)
    assert "\n" not in str(e.value) and (case == "unset" or str(e.value).startswith(want)), str(e.value)
    assert not (tmp_path / "runs").exists()


def test_eval_paths_belong_to_file_sources():
    from dgemma.data.config import DataConfig

    with pytest.raises(ValueError, match=r"DataConfig\.eval_paths: .*source='synthetic' draws its held-out prompts"):
        DataConfig(eval_paths=["held.jsonl"])


def test_the_synthetic_held_out_set_is_unchanged(tmp_path):
    """A synthetic run's periodic evaluation draws the same prompts as before held-out files existed: ceil(rows /
    tasks) per task, disjoint from the training stream (`build_held_out`)."""
    from dgemma.config import load_config
    from dgemma.eval.heldout import build_held_out
    from dgemma.train.periodic_eval import held_out_for

    cfg = load_config(None, {"trainer.eval_every": 1, "trainer.eval_batches": 2, "trainer.steps": 3,
                             "data.batch_size": 4}, env={})
    got = held_out_for(cfg)
    want = build_held_out(cfg.data, n_per_task=math.ceil(8 / 3), batch_size=4, train_streams=[(cfg.data, 3)])
    assert [(e.task, e.prompt) for e in got.source] == [(e.task, e.prompt) for e in want.source]
    assert got.overlap == 0 and len(got.source) == 9

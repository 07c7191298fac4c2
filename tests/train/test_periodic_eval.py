"""`trainer.eval_every` / `trainer.eval_batches`: held-out evaluation inside the training loop, logged like training."""

from __future__ import annotations

import json
import math

import pytest


def _cfg(tmp_path, **overrides):
    from dgemma.config import load_config

    base = {
        "run.name": "ev", "run.output_dir": str(tmp_path), "model.preset": "tiny", "model.vocab_size": 32,
        "model.num_hidden_layers": 2, "model.layer_types": ["sliding_attention", "full_attention"],
        "trainer.steps": 2, "trainer.log_every": 1, "trainer.eval_every": 1, "trainer.eval_batches": 1,
        "data.layout": {"prompt_len": 16, "n_blocks": 2}, "data.batch_size": 8, "data.num_threads": 0,
        "sampler.max_steps": 2, "checkpoint.every": 0, "optim.lr": 3e-3,
    }
    base.update(overrides)
    return load_config(None, base, env={})


@pytest.mark.slow  # trains 2 steps and compiles the sampler and the denoising metrics (~minutes on 2 busy cores)
def test_periodic_eval_logs_held_out_metrics_every_n_steps(tmp_path):
    from dgemma.train.trainer import train

    summary = train(_cfg(tmp_path), progress=False, save_params_at_end=False)
    rows = [json.loads(line) for line in (tmp_path / "ev" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/diffusion/exact_match" in r]  # the evaluator's names, under the sampler's mode
    assert [r["step"] for r in evals] == [1, 2]
    for r in evals:
        assert 0.0 <= r["eval/diffusion/exact_match"] <= 1.0
        assert {"eval/diffusion/exact_match/copy", "eval/diffusion/exact_match/add"} <= set(r)
        for t in (0.1, 0.5, 0.9):
            assert math.isfinite(r[f"eval/nll_t{t:g}"]) and 0.0 <= r[f"eval/acc_t{t:g}"] <= 1.0
        assert 1.0 <= r["eval/diffusion/steps_per_block"] <= 2.0 and r["eval/diffusion/tpf"] > 0
        assert r["eval/diffusion/max_steps"] == 2 and r["eval/heldout_overlap"] == 0
    # training moved the model: held-out denoising CE at t = 0.5 changed between the two evaluations
    assert evals[0]["eval/nll_t0.5"] != evals[1]["eval/nll_t0.5"]
    assert summary.last_metrics["eval/diffusion/exact_match"] == evals[-1]["eval/diffusion/exact_match"]


def test_eval_cadence():
    from dgemma.train.periodic_eval import eval_due

    assert [s for s in range(1, 11) if eval_due(s, 4)] == [4, 8] and not any(eval_due(s, 0) for s in range(1, 9))


def test_periodic_eval_refuses_what_it_cannot_evaluate_before_writing_anything(tmp_path):
    from dgemma.train.trainer import train

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1", "response": "1"}\n')
    with pytest.raises(ValueError, match=r"trainer\.eval_every=1: data\.source='json' evaluates on held-out files: "
                                         r"set data\.eval_paths"):
        train(_cfg(tmp_path, **{"data.source": "json", "data.paths": [str(data)]}), progress=False)
    with pytest.raises(ValueError, match=r"head_alignment='shift'; set sampler\.mode=ar"):
        train(_cfg(tmp_path, **{"diffusion.head_alignment": "shift"}), progress=False)
    assert not (tmp_path / "ev").exists()

"""`dgemma train` / `dgemma sample` misused: the exit codes `dgemma train --help` documents, the
changed-config notice on resume as one clean line, and an empty prompt refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from flax import nnx

from support.cli_errors import one_line_error
from dgemma.cli.main import main

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs/stage1/tiny.yaml")
TRAIN = ["train", "-c", TINY, "--no-progress", "trainer.objective=ar", "model.preset=tiny", "model.vocab_size=32",
         "model.num_hidden_layers=1", "model.layer_types=[full_attention]", "mesh.ici={fsdp: -1}",
         "optim.schedule=constant", "optim.warmup_steps=0", "trainer.log_every=1", "trainer.eval_every=0",
         "checkpoint.every=1", "data.num_threads=0", "data.batch_size=8", "run.name=r"]


def test_train_help_states_the_exit_codes_tested_here(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "2 bad config: a config error, a model that does not fit the run's checkpoints on resume, or a reward" \
           in help_text, help_text


def test_resume_with_a_changed_config_and_a_changed_model(tmp_path, capsys):
    """A changed config on resume: one plain line on stderr (not a RuntimeWarning with its source line); a changed
    model on resume: exit 2 (`--help`: a model that does not fit the run's checkpoints is a bad config), one line."""
    out = f"run.output_dir={tmp_path}"
    assert main([*TRAIN, out, "trainer.steps=1"]) == 0
    capsys.readouterr()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DGEMMA_")}
    proc = subprocess.run([sys.executable, "-m", "dgemma", *TRAIN, out, "trainer.steps=2"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    notice = [ln for ln in proc.stderr.splitlines() if "the config changed since the last start" in ln]
    assert len(notice) == 1, proc.stderr[-3000:]
    assert f"{tmp_path / 'r'}: the config changed" in notice[0] and "resolved_config." in notice[0], notice
    assert "RuntimeWarning" not in proc.stderr and "warnings.warn" not in proc.stderr, proc.stderr[-3000:]
    assert main([*TRAIN, out, "trainer.steps=3", "model.num_hidden_layers=2",
                 "model.layer_types=[full_attention, full_attention]"]) == 2
    one_line_error(capsys, "dgemma train: ")


def test_sample_refuses_an_empty_or_blank_prompt(tmp_path, capsys):
    from dgemma.checkpoint import save_params
    from dgemma.config import load_config
    from dgemma.model.transformer import Transformer

    cfg = load_config(TINY, [], env={})
    save_params(tmp_path / "params", 1, nnx.state(Transformer(cfg.model_config, rngs=nnx.Rngs(0)), nnx.Param))
    for prompts in (["--prompt", ""], ["--prompt", "C12|", "--prompt", " \t"]):
        assert main(["sample", "-c", TINY, "mesh.ici={fsdp: -1}", "--checkpoint", str(tmp_path / "params"),
                     *prompts]) == 2
        one_line_error(capsys, "--prompt number", "empty or whitespace only")

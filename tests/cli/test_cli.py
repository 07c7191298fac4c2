"""Tests of the `dgemma` CLI skeleton: subcommand registration, help, config handling, exit codes, lazy imports."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support import jitted as J
from dgemma.cli import COMMANDS
from dgemma.cli.main import main
from dgemma.config import config_hash, load_config, parse_yaml

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs/stage1/tiny.yaml")
# 2 layers (one sliding + one full) instead of tiny_toy's 6 in the end-to-end commands: eager compiles dominate them
TWO_LAYERS = ["model.num_hidden_layers=2", "model.layer_types=[sliding_attention,full_attention]"]
HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax", "grain", "transformers", "torch", "wandb")


def _python(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DGEMMA_")}
    cmd = [sys.executable, *(["-c", code] if code else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)


@pytest.fixture(autouse=True)
def _no_dgemma_env(monkeypatch):
    for key in [k for k in os.environ if k.startswith("DGEMMA_")]:
        monkeypatch.delenv(key)


def test_help_lists_every_subcommand_subprocess():
    out = _python("-m", "dgemma", "--help")
    assert out.returncode == 0, out.stderr
    for name in ("train", "sample", "eval", "export", "convert", "plan", "launch", "demo"):
        assert re.search(rf"^\s+{name}\s", out.stdout, re.MULTILINE), name


@pytest.mark.parametrize("command", COMMANDS)
def test_subcommand_help(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert f"dgemma {command}" in text and "--config" in text and "KEY=VALUE" in text


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "commands:" in capsys.readouterr().err


def test_cli_import_and_config_load_are_jax_free():
    code = (
        "import sys, json\n"
        "import dgemma.cli.main as m\n"
        "m.build_parser()\n"
        "from dgemma.config import load_config\n"
        f"load_config({TINY!r}, ['trainer.steps=3'], env={{}}).model.build()\n"
        f"print(json.dumps(sorted(n for n in {HEAVY!r} if n in sys.modules)))\n"
    )
    out = _python(code=code)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


REQUIRED_ARGS = {"sample": ["--checkpoint", "x"], "eval": ["--checkpoint", "x"],
                 "export": ["--checkpoint", "x", "--out", "y"], "convert": ["--hf", "x", "--out", "y"]}


@pytest.mark.parametrize("command", COMMANDS)
def test_config_errors_exit_2_with_suggestion(command, capsys):
    assert main([command, *REQUIRED_ARGS.get(command, []), "--config", TINY, "trainer.stpes=3"]) == 2
    assert "trainer.stpes: unknown key (did you mean 'trainer.steps'?)" in capsys.readouterr().err


def test_malformed_override_and_unknown_option(capsys):
    assert main(["train", "--config", TINY, "steps"]) == 2
    assert "expected `dotted.key=value`" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["train", "--config", TINY, "--bogus"])
    assert info.value.code == 2


def test_print_config_round_trips(capsys):
    assert main(["train", "-c", TINY, "trainer.steps=7", "--print-config"]) == 0
    text = capsys.readouterr().out
    expected = load_config(TINY, ["trainer.steps=7"], env={})
    assert text.startswith(f"# sha256 {config_hash(expected)}")
    assert parse_yaml(text)["trainer"]["steps"] == 7


def test_overrides_may_follow_options(capsys):
    argv = ["sample", "-c", TINY, "trainer.steps=3", "--prompt", "hi", "sampler.max_steps=4", "--checkpoint", "x",
            "--print-config"]
    assert main(argv) == 0
    data = parse_yaml(capsys.readouterr().out)
    assert (data["trainer"]["steps"], data["sampler"]["max_steps"]) == (3, 4)


def test_env_and_cli_conflict_via_cli(monkeypatch, capsys):
    monkeypatch.setenv("DGEMMA_TRAINER__STEPS", "5")
    assert main(["plan", "-c", TINY, "--print-config"]) == 0
    assert parse_yaml(capsys.readouterr().out)["trainer"]["steps"] == 5
    assert main(["plan", "-c", TINY, "trainer.steps=3"]) == 2
    assert "set both on the command line and by env DGEMMA_TRAINER__STEPS" in capsys.readouterr().err


def test_plan_summary_and_provenance(tmp_path, capsys):
    assert main(["plan", "-c", TINY, "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    cfg = load_config(TINY, env={})
    assert f"sha256     {config_hash(cfg)}" in out and "preset=tiny_toy" in out
    assert (tmp_path / "run" / "config.sha256").read_text().strip() == config_hash(cfg)
    assert load_config(tmp_path / "run" / "resolved_config.yaml", env={}) == cfg


def test_plan_schema(capsys):
    assert main(["plan", "--schema"]) == 0
    out = capsys.readouterr().out
    assert "sampler.entropy_bound" in out and "optim.freeze" in out


def test_module_entry_points_subprocess():
    out = _python("-m", "dgemma.cli.train", "-c", TINY, "--print-config")  # train is implemented; print only
    assert out.returncode == 0, out.stderr
    assert parse_yaml(out.stdout)["run"]["name"] == "stage1_tiny"
    out = _python("-m", "dgemma.cli", "sample", "-c", TINY)
    assert out.returncode == 2 and "--checkpoint" in out.stderr  # required argument named


@pytest.mark.skipif(shutil.which("dgemma") is None, reason="console script not on PATH")
def test_console_script():
    out = subprocess.run(["dgemma", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "demo" in out.stdout


def test_demo_main_job_end_to_end(tmp_path, capsys):
    """The README's main job on the built-in tiny default: write HF Gemma 4 -> import as DiffusionGemma -> decode."""
    rc = main(["demo", f"run.output_dir={tmp_path}", "--max-new-tokens", "4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    summary = json.loads((tmp_path / "dgemma" / "demo" / "summary.json").read_text())
    assert summary["encoder_vs_ar_max_abs_diff"] == 0.0
    assert len(summary["ar_tokens"]) == 2 and len(summary["ar_tokens"][0]) == 4
    assert len(list((tmp_path / "dgemma" / "demo" / "hf_gemma4").glob("model-*.safetensors"))) > 1


def test_export_command_round_trip(tmp_path):
    """params-only checkpoint -> `dgemma export` -> HF diffusion_gemma dir -> import: identical logits."""
    import jax
    import numpy as np
    from flax import nnx

    from dgemma.checkpoint import save_params
    from dgemma.config import load_config
    from dgemma.convert.hf_import import load_hf_checkpoint
    from dgemma.model.transformer import Transformer

    cfg = load_config(TINY, TWO_LAYERS)
    model = Transformer(cfg.model_config, rngs=nnx.Rngs(4))
    save_params(tmp_path / "params", 7, nnx.state(model, nnx.Param))
    out = tmp_path / "hf"
    assert main(["export", "-c", TINY, *TWO_LAYERS, "--checkpoint", str(tmp_path / "params"), "--out", str(out),
                 "--dtype", "float32"]) == 0
    assert main(["export", "-c", TINY, *TWO_LAYERS, "--checkpoint", str(tmp_path / "params"),
                 "--out", str(out)]) != 0  # exists
    back, _ = load_hf_checkpoint(out)
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, cfg.model_config.vocab_size)
    np.testing.assert_array_equal(np.asarray(J.forward(back, tokens)), np.asarray(J.forward(model, tokens)))
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["max_denoising_steps"] == cfg.sampler.max_steps


def test_convert_then_train_init_from(tmp_path):
    """HF Gemma 4 dir -> `dgemma convert` -> params checkpoint that `dgemma export` reads back identically."""
    import jax
    import numpy as np
    from flax import nnx

    from dgemma.config import load_config
    from dgemma.convert.hf_export import export_hf
    from dgemma.convert.hf_import import load_hf_checkpoint
    from dgemma.model.transformer import Transformer

    cfg = load_config(TINY, TWO_LAYERS)
    source = Transformer(cfg.model_config, rngs=nnx.Rngs(5))
    hf_dir = export_hf(source, tmp_path / "hf", layout="gemma4", dtype="float32")
    assert main(["convert", "-c", TINY, *TWO_LAYERS, "--hf", str(hf_dir), "--out", str(tmp_path / "params")]) == 0
    assert main(["export", "-c", TINY, *TWO_LAYERS, "--checkpoint", str(tmp_path / "params"), "--out",
                 str(tmp_path / "back"), "--dtype", "float32", "--layout", "gemma4"]) == 0
    back, _ = load_hf_checkpoint(tmp_path / "back", self_conditioning=False)
    tokens = jax.random.randint(jax.random.key(1), (1, 7), 0, cfg.model_config.vocab_size)
    np.testing.assert_array_equal(np.asarray(back(tokens)), np.asarray(source(tokens)))
    # a geometry mismatch with the run config is refused with the field named
    assert main(["convert", "-c", TINY, *TWO_LAYERS, "model.num_experts=4", "--hf", str(hf_dir), "--out",
                 str(tmp_path / "p2")]) == 2


def test_sample_and_eval_commands(tmp_path, capsys):
    """`dgemma sample` and `dgemma eval` run end to end on a params checkpoint (random tiny_toy weights)."""
    from flax import nnx

    from dgemma.checkpoint import save_params
    from dgemma.config import load_config
    from dgemma.model.transformer import Transformer

    two_layers = TWO_LAYERS
    cfg = load_config(TINY, two_layers)
    save_params(tmp_path / "params", 1, nnx.state(Transformer(cfg.model_config, rngs=nnx.Rngs(0)), nnx.Param))
    common = ["-c", TINY, "--checkpoint", str(tmp_path / "params"), "sampler.max_steps=3",
              "sampler.max_new_tokens=16", *two_layers]
    assert main(["sample", *common, "--prompt", "C1234|", "--prompt", "S321|", "--mode", "diffusion"]) == 0
    out = capsys.readouterr().out
    assert "[block 1]" in out and "'C1234|' ->" in out and "tokens/forward" in out
    assert main(["eval", *common, "--batches", "1", "--batch-size", "4", "--modes", "ar,diffusion",
                 "--plot-dir", str(tmp_path / "ev")]) == 0
    out = capsys.readouterr().out
    assert "diffusion: tokens/forward" in out and (tmp_path / "ev" / "commitment.png").exists()
    res = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert set(res) == {"ar", "diffusion", "held_out"} and res["ar"]["metrics"]["n"] == 4
    assert res["held_out"]["overlap"] == 0 and "overlap with the training stream: 0" in out
    assert main(["eval", *common, "--modes", "beam"]) == 2


def test_plan_refused_by_the_planner_writes_no_out(tmp_path, capsys):
    """A batch the planner refuses (global 64 over 128 batch-sharding devices) is one line, exit 2, and --out is not
    written: the provenance files of a plan exist only for a config the planner accepted."""
    big = str(REPO / "configs" / "stage1" / "gemma4_26b_a4b.yaml")
    out = tmp_path / "plan_out"
    assert main(["plan", "-c", big, "--devices", "128", "--accelerator", "h200", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.batch_size=64" in err[0]
    assert not out.exists()

"""The CLI under misuse : nothing is deleted or silently kept, errors are one line with a non-zero exit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from support.cli_errors import one_line_error as _one_line_error
from dgemma.cli.main import main

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs/stage1/tiny.yaml")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run dir as `dgemma train` leaves it: checkpoints/, params/<step>/, metrics.jsonl (random tiny_toy weights)."""
    from dgemma.checkpoint import save_params
    from dgemma.config import load_config
    from dgemma.model.transformer import Transformer

    root = tmp_path_factory.mktemp("runs") / "v"
    cfg = load_config(TINY, [], env={})
    save_params(root / "params", 4, nnx.state(Transformer(cfg.model_config, rngs=nnx.Rngs(0)), nnx.Param))
    (root / "checkpoints" / "4").mkdir(parents=True)
    (root / "metrics.jsonl").write_text('{"step": 4}\n')
    return root


def test_export_overwrite_never_deletes_the_run_dir(run_dir, tmp_path, capsys):
    before = sorted(p.name for p in run_dir.iterdir())
    assert main(["export", "-c", TINY, "--checkpoint", str(run_dir / "params"), "--out", str(run_dir),
                 "--overwrite"]) == 2
    _one_line_error(capsys, "contains the source")
    other = tmp_path / "not_an_export"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    assert main(["export", "-c", TINY, "--checkpoint", str(run_dir / "params"), "--out", str(other),
                 "--overwrite"]) == 2
    _one_line_error(capsys, "replaces only a previous export")
    assert sorted(p.name for p in run_dir.iterdir()) == before and (other / "notes.txt").exists()


def test_export_argument_errors_before_writing(run_dir, tmp_path, capsys):
    common = ["export", "-c", TINY, "--checkpoint", str(run_dir / "params")]
    assert main([*common, "--out", str(tmp_path / "a"), "--tokenizer-dir", str(tmp_path / "missing")]) == 2
    _one_line_error(capsys, "--tokenizer-dir", "no such directory")
    assert main([*common, "--out", str(tmp_path / "b"), "--max-shard-size", "0"]) == 2
    _one_line_error(capsys, "--max-shard-size 0")
    assert main([*common, "--out", str(tmp_path / "c"), "--fp8", "--fp8-block", "0x64"]) == 2
    _one_line_error(capsys, "--fp8-block")
    assert list(tmp_path.iterdir()) == []


def test_convert_into_an_existing_out_refuses_or_replaces_whole(run_dir, tmp_path, capsys):
    from dgemma.checkpoint import restore_params
    from dgemma.config import load_config
    from dgemma.convert.hf_export import export_hf
    from dgemma.model.transformer import Transformer

    cfg = load_config(TINY, [], env={})
    a, b = (Transformer(cfg.model_config, rngs=nnx.Rngs(s)) for s in (1, 2))
    hf_a = export_hf(a, tmp_path / "hf_a", layout="gemma4", dtype="float32")
    hf_b = export_hf(b, tmp_path / "hf_b", layout="gemma4", dtype="float32")
    out = tmp_path / "params"
    assert main(["convert", "-c", TINY, "--hf", str(hf_a), "--out", str(out)]) == 0
    capsys.readouterr()
    # the run config's mesh is the one used: a mesh this host cannot form is refused (it was silently fsdp=all)
    assert main(["convert", "-c", TINY, "mesh.ici.data=16", "--hf", str(hf_a), "--out", str(tmp_path / "m")]) == 1
    _one_line_error(capsys, "mesh.ici")
    assert not (tmp_path / "m").exists()
    assert main(["convert", "-c", TINY, "--hf", str(hf_b), "--out", str(out)]) == 2
    _one_line_error(capsys, "exists", "--overwrite")
    # a training params/ dir with more than step dirs, or the source inside --out: refused even with --overwrite
    assert main(["convert", "-c", TINY, "--hf", str(hf_b), "--out", str(run_dir), "--overwrite"]) == 2
    _one_line_error(capsys, "refusing")
    assert main(["convert", "-c", TINY, "--hf", str(hf_b), "--out", str(out), "--overwrite"]) == 0
    assert [p.name for p in out.iterdir()] == ["0"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    import jax

    want = nnx.state(b, nnx.Param)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), want)
    got = restore_params(out, target)
    np.testing.assert_array_equal(np.asarray(got["embedder"]["embedding"][...]),
                                  np.asarray(want["embedder"]["embedding"][...]))


def test_sample_and_eval_input_errors_are_one_line(run_dir, tmp_path, capsys):
    ckpt = str(run_dir / "params")
    mesh = "mesh.ici={fsdp: -1}"  # all the (simulated) devices
    sample = ["sample", "-c", TINY, mesh, "--prompt", "C12|"]
    empty = tmp_path / "empty"
    empty.mkdir()
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    for path, needle in ((tmp_path / "missing", "does not exist"), (empty, "no params checkpoint"),
                         (hf, "a Hugging Face checkpoint")):
        assert main([*sample, "--checkpoint", str(path)]) == 2
        _one_line_error(capsys, str(path), needle)
    assert main([*sample, "--checkpoint", ckpt, "model.num_experts=4"]) == 2  # shapes differ from the checkpoint
    _one_line_error(capsys, "cannot restore the config's model")
    assert main(["sample", "-c", TINY, mesh, "--checkpoint", ckpt, "--prompt-file",
                 str(tmp_path / "nope.txt")]) == 1
    _one_line_error(capsys, "nope.txt")
    assert main(["sample", "-c", TINY, mesh, "--checkpoint", ckpt, "--prompt", "C12é|"]) == 2
    _one_line_error(capsys, "prompt:", "é")
    # the prompt plus the generation budget must fit the model's positions
    assert main(["sample", "-c", TINY, mesh, "--checkpoint", ckpt, "--prompt", "C12|" * 600]) == 2
    _one_line_error(capsys, "> model.max_position_embeddings=1024")
    for flag in ("--batches", "--batch-size"):
        assert main(["eval", "-c", TINY, mesh, "--checkpoint", ckpt, flag, "0"]) == 2
        _one_line_error(capsys, f"{flag} 0: must be >= 1")
    assert main(["sample", "-c", TINY, "--prompt", "C12|", "--checkpoint", ckpt, "mesh.ici={fsdp: 64}"]) != 0
    _one_line_error(capsys, "64")


def test_config_and_init_from_errors_before_compiling(tmp_path, capsys):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("run: {name: caf\xe9}\n".encode("latin-1"))
    assert main(["plan", str(bad)]) == 2
    _one_line_error(capsys, "latin1.yaml", "not UTF-8")
    out = ["run.output_dir=" + str(tmp_path / "runs")]
    assert main(["train", "-c", TINY, "--no-progress", f"checkpoint.init_from={tmp_path / 'nope'}", *out]) == 2
    _one_line_error(capsys, "checkpoint.init_from", "does not exist")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert main(["train", "-c", TINY, "--no-progress", f"checkpoint.init_from={hf}", *out]) == 2
    _one_line_error(capsys, "dgemma convert")
    assert not (tmp_path / "runs").exists()  # nothing left behind
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    assert main(["plan", TINY, "--out", str(blocker / "sub")]) != 0  # an unwritable --out
    _one_line_error(capsys, "file.txt")

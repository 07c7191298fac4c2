"""Export safety: atomic temp-dir + rename (a SIGKILLed export leaves no destination), no silent overwrite, and a
manifest of sizes + sha256 that detects tampering."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from flax import nnx

from dgemma.convert.hf_export import MANIFEST, export_hf, verify
from dgemma.model.config import tiny
from dgemma.model.transformer import Transformer

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model():
    return Transformer(tiny(), rngs=nnx.Rngs(0))


def test_refuses_existing_destination_and_overwrite_swaps(model, tmp_path):
    out = export_hf(model, tmp_path / "e", max_shard_size=100_000)
    n_shards = len(list(out.glob("*.safetensors")))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_hf(model, out)
    (out / "stray.txt").write_text("from an older export")
    export_hf(model, out, overwrite=True)  # single-file export replaces the sharded one, stray file included
    assert sorted(p.name for p in out.iterdir()) == ["config.json", MANIFEST, "generation_config.json",
                                                     "model.safetensors"]
    assert n_shards > 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp / old dirs left behind
    verify(out)


def test_manifest_detects_tampering(model, tmp_path):
    out = export_hf(model, tmp_path / "e", max_shard_size=100_000)
    manifest = verify(out)
    assert set(manifest["files"]) == {p.name for p in out.iterdir() if p.name != MANIFEST}
    for name, meta in manifest["files"].items():
        assert (out / name).stat().st_size == meta["bytes"]
    shard = sorted(out.glob("model-*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # one bit in the last tensor
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{shard.name}: size/sha256 differ"):
        verify(out)
    shard.unlink()
    with pytest.raises(ValueError, match="listed in .* but missing"):
        verify(out)
    out2 = export_hf(model, tmp_path / "f")
    (out2 / "extra.bin").write_bytes(b"x")
    assert verify(out2)["unlisted"] == ["extra.bin"]  # extra files are allowed (a model hub adds some)
    cfg = json.loads((out2 / "config.json").read_text())
    (out2 / "extra.bin").unlink()
    cfg["canvas_length"] += 1
    (out2 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json: size/sha256 differ"):
        verify(out2)


def test_exception_midway_leaves_nothing(model, tmp_path):
    def boom(name):
        raise RuntimeError(f"disk full after {name}")

    with pytest.raises(RuntimeError, match="disk full"):
        export_hf(model, tmp_path / "e", max_shard_size=100_000, on_shard=boom)
    assert list(tmp_path.iterdir()) == []


def _signal_export_midway(dest: Path, sig: int) -> int:
    """Export the tiny model to `dest` in a subprocess that stalls after its first shard, send it `sig` while the temp
    dir holds that shard, and return the subprocess's exit status."""
    script = textwrap.dedent(f"""
        import time
        from flax import nnx
        from dgemma.convert.hf_export import export_hf
        from dgemma.model.config import tiny
        from dgemma.model.transformer import Transformer

        def slow(name):
            print("SHARD", name, flush=True)
            time.sleep(60)

        export_hf(Transformer(tiny(), rngs=nnx.Rngs(0)), {str(dest)!r}, max_shard_size=100_000, on_shard=slow)
    """)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        line = proc.stdout.readline()  # blocks until the first shard is complete
        assert line.startswith("SHARD model-00001-of-"), (line, proc.stderr.read() if proc.poll() else "")
        assert any(p.name.startswith(f".{dest.name}.tmp-") for p in dest.parent.iterdir())
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode


def test_sigkill_midway_leaves_no_destination(tmp_path):
    """A separate process is SIGKILLed between two shards (no cleanup can run): no destination appears, and the
    next export to the same place succeeds and removes the dead process's temp dir."""
    dest = tmp_path / "exp"
    assert _signal_export_midway(dest, signal.SIGKILL) == -signal.SIGKILL
    time.sleep(0.1)
    assert not dest.exists()
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".exp.tmp-")]
    assert len(leftovers) == 1 and any(leftovers[0].glob("model-00001-of-*.safetensors"))
    export_hf(Transformer(tiny(), rngs=nnx.Rngs(0)), dest, max_shard_size=100_000)
    verify(dest)
    assert [p.name for p in tmp_path.iterdir()] == ["exp"]


def test_import_verifies_the_export_manifest(tmp_path):
    """A file modified after export is refused on re-import (unless verify=False)."""
    from flax import nnx

    from dgemma.convert.hf_config import CheckpointError
    from dgemma.convert.hf_export import export_hf
    from dgemma.convert.hf_import import load_hf_checkpoint
    from dgemma.model.config import tiny
    from dgemma.model.transformer import Transformer

    out = export_hf(Transformer(tiny(), rngs=nnx.Rngs(0)), tmp_path / "x", layout="gemma4_text", dtype="float32")
    load_hf_checkpoint(out)
    cfg = out / "config.json"
    cfg.write_text(cfg.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    with pytest.raises(CheckpointError, match="config.json"):
        load_hf_checkpoint(out)
    load_hf_checkpoint(out, verify=False)


def test_overwrite_replaces_only_a_previous_export(model, tmp_path):
    """--overwrite never deletes what is not an export (a run dir, a file) nor a directory holding the source."""
    run = tmp_path / "run"
    (run / "params/4").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(FileExistsError, match="contains the source"):
        export_hf(model, run, overwrite=True, sources=[run / "params"])
    with pytest.raises(FileExistsError, match="replaces only a previous export"):
        export_hf(model, run, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "params"]
    f = tmp_path / "file.bin"
    f.write_bytes(b"data")
    with pytest.raises(FileExistsError, match="replaces only a previous export"):
        export_hf(model, f, overwrite=True)
    assert f.read_bytes() == b"data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.bin", "run"]  # no hidden .old / .tmp left


def test_sigterm_midway_leaves_nothing(tmp_path):
    """SIGTERM (the usual way a job is stopped) between two shards: the temporary directory is removed."""
    assert _signal_export_midway(tmp_path / "exp", signal.SIGTERM) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


def test_export_through_a_model_hub_reimports(tmp_path):
    """A hub adds README.md / .gitattributes: still importable; a tampered listed file is still refused."""
    from dgemma.convert.hf_config import CheckpointError
    from dgemma.convert.hf_import import load_hf_checkpoint

    out = export_hf(Transformer(tiny(), rngs=nnx.Rngs(0)), tmp_path / "x", layout="gemma4_text", dtype="float32")
    (out / "README.md").write_text("---\nlicense: apache-2.0\n---\n")
    (out / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    load_hf_checkpoint(out)
    shard = out / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_hf_checkpoint(out)

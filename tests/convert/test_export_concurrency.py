"""Export destinations under contention and on a full disk: two exports of one new `--out` at once
give one export and one refusal, never two successes over one directory; a directory that appears at `--out` while
an export is written is not replaced; a full disk is one line naming the destination, and nothing is left there."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from flax import nnx

from support.cli_errors import one_line_error
from dgemma.cli.main import main
from dgemma.convert.destination import EXPORT_MANIFEST, write_export_dir
from dgemma.convert.hf_export import verify

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs/stage1/tiny.yaml")
MESH = "mesh.ici={fsdp: -1}"


@pytest.fixture(scope="module")
def params(tmp_path_factory):
    """A params checkpoint of the tiny config's model (random weights), as `dgemma export --checkpoint` takes it."""
    from dgemma.checkpoint import save_params
    from dgemma.config import load_config
    from dgemma.model.transformer import Transformer

    root = tmp_path_factory.mktemp("ckpt") / "params"
    cfg = load_config(TINY, [], env={})
    save_params(root, 1, nnx.state(Transformer(cfg.model_config, rngs=nnx.Rngs(0)), nnx.Param))
    return root


def _complete(out: Path) -> None:
    """`out` is one whole export: every file its manifest lists, with its bytes, and no file it does not list."""
    manifest = verify(out)
    assert manifest["unlisted"] == []
    assert sorted(p.name for p in out.iterdir()) == sorted([*manifest["files"], EXPORT_MANIFEST])


def test_two_export_processes_to_one_new_out(params, tmp_path):
    out = tmp_path / "exports" / "dg"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DGEMMA_")}
    argv = [sys.executable, "-m", "dgemma", "export", "-c", TINY, MESH, "--checkpoint", str(params), "--out", str(out)]
    procs = [subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]  # started together: both pass the check made before the checkpoint is restored
    results = [(p.wait(timeout=900), *p.communicate()) for p in procs]
    codes = sorted(rc for rc, _, _ in results)
    assert codes == [0, 2], results
    (_, _, refusal), = [r for r in results if r[0] == 2]
    ours = [ln for ln in refusal.splitlines() if not ln.startswith("WARNING:absl:")]  # orbax's read-only notices
    assert len(ours) == 1 and ours[0].startswith(f"dgemma export: {out}") and "Traceback" not in refusal, refusal
    _complete(out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["dg"]  # no temporary directory or lock file left


def test_a_second_writer_is_refused_while_the_first_holds_the_destination(tmp_path):
    """Deterministic overlap: the first export is still filling its temporary directory when the second starts."""
    out = tmp_path / "e"
    filling, release = threading.Event(), threading.Event()
    errors = []

    def slow_fill(tmp: Path) -> None:
        (tmp / "a.bin").write_bytes(b"first")
        filling.set()
        assert release.wait(60)

    def first():
        try:
            write_export_dir(out, slow_fill, {"who": "first"})
        except BaseException as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    t = threading.Thread(target=first)
    t.start()
    assert filling.wait(60)
    with pytest.raises(FileExistsError, match=f"{out}: another export .*is writing it now"):
        write_export_dir(out, lambda tmp: (tmp / "b.bin").write_bytes(b"second") and None, {"who": "second"})
    release.set()
    t.join(60)
    assert errors == []
    _complete(out)
    assert (out / "a.bin").read_bytes() == b"first" and not (out / "b.bin").exists()
    with pytest.raises(FileExistsError, match="exists; pass --overwrite"):  # afterwards: the usual refusal
        write_export_dir(out, lambda tmp: None, {"who": "third"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]


def test_a_directory_made_at_out_during_the_export_is_not_replaced(tmp_path):
    """On Linux a rename onto an existing empty directory succeeds; the export must not publish over it."""
    out = tmp_path / "e"

    def fill(tmp: Path) -> None:
        (tmp / "a.bin").write_bytes(b"x")
        out.mkdir()  # someone else claims the name meanwhile

    with pytest.raises(FileExistsError, match=f"{out} appeared while this write was in progress"):
        write_export_dir(out, fill, {})
    assert out.is_dir() and list(out.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]


@pytest.fixture
def small_disk(tmp_path):
    """A real 1 MiB filesystem (tmpfs), unmounted afterwards."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()}); needs root")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_a_full_disk_is_one_line_naming_the_destination(params, small_disk, capsys):
    out = small_disk / "dg"
    assert main(["export", "-c", TINY, MESH, "--checkpoint", str(params), "--out", str(out)]) == 1
    err = one_line_error(capsys, f"{out}: no space left on device while writing model.safetensors",
                         "nothing was written there")
    assert "[Errno" not in err, err
    assert list(small_disk.iterdir()) == []  # no destination, temporary directory or lock file left

"""diffusers' DiffusionGemmaPipeline in its own environment: the released diffusers / transformers version pair.

diffusers 0.42.1's pipeline calls `create_diffusion_decoder_attention_mask(..., past_key_values=...)`, an argument
transformers 5.24 renamed to `cache`: on the transformers dgemma runs on (>= 5.24) the pipeline raises TypeError.
The pipeline is therefore tested with the pair that works, diffusers 0.42.1 + transformers 5.23.0, installed (without
their dependencies) into a cached directory that is put first on the PYTHONPATH of a child process: the child imports
that pair and everything else (the same torch 2.13.0 CPU wheel, tokenizers, peft, ...) from the test environment.
Nothing in diffusers or transformers is patched. The directory is made once per machine (about 17 MB from the package
index, 190 MB installed; `DGEMMA_TEST_DIFFUSERS_PAIR` names another) and reused; the child runs functions of
tests/support/diffusers_child.py and writes its results to a file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

PAIR = ("diffusers==0.42.1", "transformers==5.23.0")
TESTS = Path(__file__).resolve().parent


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def pair_dir() -> Path:
    """The directory holding the pair (installed on first use); skips the test off CI when it cannot be installed
    (no package index), fails under CI."""
    d = Path(os.environ.get("DGEMMA_TEST_DIFFUSERS_PAIR")
             or Path.home() / ".cache" / "dgemma-tests" / "_".join(p.replace("==", "-") for p in PAIR))
    if (d / "READY").exists():
        return d
    tmp = d.parent / f".{d.name}.tmp-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp), *PAIR]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        msg = f"cannot install {' + '.join(PAIR)} for the pipeline test: {done.stderr.strip()[-400:]}"
        if _ci():
            pytest.fail(msg)
        pytest.skip(msg)
    (tmp / "READY").write_text(" ".join(PAIR) + "\n")
    try:
        tmp.rename(d)  # a concurrent installer may have won: its copy is as good
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return d


def run(function: str, *args, timeout: int = 900) -> dict:
    """`tests/support/diffusers_child.py` `function(*args, out=<file>)` under the pair; returns what it saved (npz -> dict)."""
    import numpy as np

    pair = pair_dir()
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"dgemma-pair-{uuid.uuid4().hex}.npz"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pair), str(TESTS)]))
    cmd = [sys.executable, str(TESTS / "diffusers_child.py"), function, json.dumps([str(a) for a in args]), str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    try:
        if done.returncode != 0:
            raise AssertionError(f"diffusers child {function} failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
        with np.load(out, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    finally:
        out.unlink(missing_ok=True)

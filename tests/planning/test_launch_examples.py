"""Every `dgemma launch ...` / `dgemma plan ...` example in README.md, docs/scaling.md, docs/rehearsal.md,
launch/README.md and the two commands' help
texts runs: launch examples render with `--dry-run`, plan examples plan, and both exit 0 (the shipped 26B configs fit
the packaged profiles they are shown with). Placeholder syntax (CONFIG, N, {a,b}; an optional [part] is left out),
examples of a file that does not exist and `--compile` examples (they need the accelerator's compiler,
`tests/planning/test_gpu_aot.py`) are skipped.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from dgemma.cli import launch as launch_cli
from dgemma.cli import plan as plan_cli
from dgemma.cli.main import main

REPO = Path(__file__).resolve().parents[2]
SOURCES = {**{name: (REPO / name).read_text() for name in ("README.md", "docs/scaling.md", "docs/rehearsal.md",
                                                           "launch/README.md")},
           "dgemma launch --help": launch_cli.__doc__, "dgemma plan --help": plan_cli.__doc__}
PLACEHOLDER = re.compile(r"^([A-Z][A-Z_|]*|\[.*|.*\]|\{[^=]*\}|<.*>)$")


def _examples() -> list[tuple[str, list[str]]]:
    out = []
    for source, text in SOURCES.items():
        for m in re.finditer(r"dgemma (launch|plan) [^`\n]*", text):
            try:  # an optional [part] is left out
                tokens = shlex.split(re.sub(r"(?<=\s)\[[^\]]*\]", "", m.group(0)), comments=True)[1:]
            except ValueError:
                continue
            if any(PLACEHOLDER.match(t) for t in tokens) or "--compile" in tokens or "--schema" in tokens:
                continue
            configs = [t for t in tokens if t.endswith((".yaml", ".yml")) and "=" not in t]
            if not configs or not all((REPO / c).exists() for c in configs):
                continue
            out.append((f"{source}: {m.group(0).strip()}", tokens))
    return out


EXAMPLES = _examples()


def test_the_examples_are_found():
    names = " ".join(n for n, _ in EXAMPLES)
    assert len(EXAMPLES) >= 8 and "slurm_h100" in names and "gemma4_26b_a4b" in names and "dgemma plan" in names


@pytest.mark.parametrize("name,tokens", EXAMPLES, ids=[n for n, _ in EXAMPLES])
def test_documented_example_exits_0(name, tokens, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    tokens = [str(REPO / t) if t.endswith((".yaml", ".yml")) and "=" not in t else t for t in tokens]
    if "--out" in tokens:  # provenance files go to a temporary directory, not the checkout
        tokens[tokens.index("--out") + 1] = str(tmp_path / "out")
    if tokens[0] == "launch" and "--dry-run" not in tokens:
        tokens.append("--dry-run")
    tokens.append(f"run.output_dir={tmp_path}")
    rc = main(tokens)
    err = capsys.readouterr().err
    assert rc == 0, f"{name} exited {rc}: {err.strip().splitlines()[-1:] }"

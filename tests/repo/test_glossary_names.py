"""The code follows docs/glossary.md: the names it retired do not come back.

Scans every Python file under dgemma/ (code, comments and docstrings) for the retired identifiers as whole words, and
the shipped configs, notebooks, README.md and docs/ (but the glossary) for the retired config keys and sections. The scan runs in
a fresh python (tests/support/fresh_python.py says why source scans do). A moved-key entry (`"old": "new"`, the mapping that turns an old key into a one-line error
naming the new one) is the one place an old key may be spelled; `ALLOWED` lists the names an outside format fixes.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from support import fresh_python  # tests/ is on sys.path (rootdir conftest)

REPO = Path(__file__).resolve().parents[2]

RETIRED = {  # retired name -> the glossary's name
    "num_blocks": "n_blocks", "num_canvases": "n_blocks", "canvas_mask": "block_used",
    "canvas_selection": "block_selection", "step_valid": "step_ran", "block_valid": "block_ran",
    "state_valid": "state_ran", "k_valid": "key_valid", "pvalid": "prompt_valid",
    "curriculum_budgets": "curriculum_max_steps", "tokens_per_forward": "tpf", "sc": "soft_embeds",
    # the denoising-step limit K_max is `max_steps`, not a budget (a *token* budget, `max_new_tokens`, stays)
    "teacher_budget": "teacher_max_steps", "budget_ladder": "max_steps_ladder",
    "stopped_at_budget": "stopped_at_max_steps", "BudgetCurriculum": "MaxStepsCurriculum",
    # the [prompt P][blocks N x L] training layout is a layout (the decoder's L tokens at one step stay a canvas)
    "canvasize": "to_layout", "CanvasConfig": "LayoutConfig", "CanvasOverflowError": "LayoutOverflowError",
}
RECORD_FIELDS = {r"\b(?:rec|record)\.argmax\b": "the record field `draft`"}  # StepDecision.argmax is another thing
ATTRIBUTES = {r"\.budget\b": "`.max_steps` (K_max: the curriculum's, the SD·RL session's and summary's)"}
CONFIG_KEYS = ("num_canvases", "canvas_selection", "curriculum_budgets")
CONFIG_SECTIONS = {  # a renamed section, as a dotted key or as a YAML key (`canvas` alone is the decoder's word)
    r"\bdata\.canvas\b": "data.layout", r"^\s*canvas:": "layout: (the data section's)",
}
ALLOWED = {  # (path, name): why the name stays there
    ("dgemma/inference/sampler_types.py", "tokens_per_forward"):
        "names the field of transformers' DiffusionGemma `generate` output that `tpf` equals",
}


def scan() -> list[str]:
    """'path:line: name (use new)' for every retired name found (runs in a fresh python)."""
    moved = re.compile(r'"(?:[a-z_]+\.)?(\w+)": "(?:[a-z_]+\.)?(\w+)"')  # an "old": "new" moved-key entry
    words = re.compile(r"\b(" + "|".join(RETIRED) + r")\b")
    found = []

    def check(path: Path, names: re.Pattern, extra: dict[str, str]) -> None:
        rel = path.relative_to(REPO).as_posix()
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            line = moved.sub(lambda m: "" if RETIRED.get(m[1]) == m[2] else m[0], line)
            for m in names.finditer(line):
                if (rel, m[1]) not in ALLOWED:
                    found.append(f"{rel}:{n}: {m[1]} (use {RETIRED[m[1]]})")
            for pattern, new in extra.items():
                if re.search(pattern, line):
                    found.append(f"{rel}:{n}: {pattern} (use {new})")

    for path in sorted((REPO / "dgemma").rglob("*.py")):
        check(path, words, {**RECORD_FIELDS, **ATTRIBUTES})
    keys = re.compile(r"\b(" + "|".join(CONFIG_KEYS) + r")\b")
    shipped = [*(REPO / "configs").rglob("*.yaml"), *(REPO / "experiments").rglob("*.yaml"),
               *(REPO / "notebooks").glob("*.py"), REPO / "README.md",
               *(p for p in (REPO / "docs").glob("*.md") if p != REPO / "docs/glossary.md")]  # it names them
    for path in sorted(p for p in shipped if p.is_file()):
        check(path, keys, CONFIG_SECTIONS)
    return found


def test_retired_names_do_not_come_back():
    assert fresh_python.call(Path(__file__).stem, "scan") == []


def test_the_scan_finds_a_retired_name(tmp_path, monkeypatch):
    """The scan is able to fail: a retired name in a file it reads is reported, a moved-key entry is not."""
    (tmp_path / "dgemma").mkdir()
    (tmp_path / "dgemma" / "x.py").write_text('a = rec.argmax\nnum_canvases = 1\nK = {"num_canvases": "n_blocks"}\n'
                                              "sc = 2  # sc_mask and sc_logits are other words\n"
                                              "to_layout = canvasize\n")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "x.yaml").write_text("data:\n  canvas: {prompt_len: 8}  # the decoder's canvas stays\n"
                                                 "# dgemma train data.canvas.n_blocks=2\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert scan() == ["dgemma/x.py:1: \\b(?:rec|record)\\.argmax\\b (use the record field `draft`)",
                      "dgemma/x.py:2: num_canvases (use n_blocks)", "dgemma/x.py:4: sc (use soft_embeds)",
                      "dgemma/x.py:5: canvasize (use to_layout)",
                      "configs/x.yaml:2: ^\\s*canvas: (use layout: (the data section's))",
                      "configs/x.yaml:3: \\bdata\\.canvas\\b (use data.layout)"]

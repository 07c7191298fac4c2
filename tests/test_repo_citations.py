"""Docstrings, comments, configs and docs cite only what a reader of this repository can open.

A newcomer reading `dgemma/` should be able to follow every reference: a `*.md` path must exist in the repository
(resolved from the citing file's folder or from the repository root), design documents kept outside it (the
`../shared` folder and its documents by name) are not cited, a section sign `§N` names a numbered section that
exists in the document cited before it on the same line (in a Markdown file, a bare `§N` is that file's own
section), and no text cites an issue number: say what the behaviour is, or which test guards it. Plain text scan
(no `ast`), so it runs in the pytest worker.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()

# names of the design documents outside the repository (built from pieces so this file does not cite them itself)
_OUTSIDE_DOCS = ("diffusion" + "_math", "framework" + ".md", "gemma4" + ".md", "diffusiongemma" + ".md",
                 "scale" + ".md", "family_lora" + ".md")
OUTSIDE = re.compile(r"\.\./shared|shared/design|(?<![\w-])(?:" + "|".join(map(re.escape, _OUTSIDE_DOCS)) + ")")
MD_PATH = re.compile(r"(?<![\w/.-])((?:\.{1,2}/)*[\w./-]*?[\w-]+\.md)(?![\w])")
SECTION = re.compile(r"§\s?(\d+(?:\.\d+)*)")
ISSUE = re.compile(r"(?i)\bissues?\s*#?\s*\d+|\(issue:|(?<![\w&/#])#\d{1,4}(?![\w.])")
HEADING_NUMBER = re.compile(r"^#+\s+(\d+(?:\.\d+)*)\.?\s", re.M)

# files the code writes (report names), not references to files in the repository
WRITTEN_NAMES = {"report.md", "results.md", "summary.md"}


def scanned_files() -> list[Path]:
    """dgemma/ (sources, templates, package data), tests/, experiments/ (scripts, configs, READMEs, results),
    notebooks/, configs/, launch/, README.md, docs/."""
    files: set[Path] = set()
    for pattern in ("dgemma/**/*", "tests/**/*", "experiments/**/*", "notebooks/**/*", "configs/**/*", "launch/**/*",
                    "docs/*.md"):
        files.update(p for p in REPO.glob(pattern) if p.is_file())
    files.add(REPO / "README.md")
    keep = {".py", ".md", ".yaml", ".yml", ".tmpl", ".txt", ".toml", ".txtpb", ".sh"}
    # dgemma/configs links to configs/: scan each real file once
    return sorted({p.resolve() for p in files if p.suffix in keep and "__pycache__" not in p.parts} - {THIS})


def resolve_md(cited: str, citing: Path) -> Path | None:
    for base in (citing.parent, REPO):
        path = (base / cited).resolve()
        if path.is_file() and REPO in path.parents:
            return path
    return None


def numbered_sections(doc: Path) -> set[str]:
    return set(HEADING_NUMBER.findall(doc.read_text(encoding="utf-8")))


def line_problems(line: str, citing: Path, sections_of) -> list[str]:
    """What is wrong with one line of `citing` (empty: nothing)."""
    problems = [f"cites a document outside the repository: {m.group(0)!r}" for m in OUTSIDE.finditer(line)]
    problems += [f"cites an issue number: {m.group(0)!r}" for m in ISSUE.finditer(line)]
    cited_docs: list[tuple[int, Path | None]] = []
    for m in MD_PATH.finditer(line):
        name = m.group(1)
        path = resolve_md(name, citing)
        if path is None and not (Path(name).name in WRITTEN_NAMES or OUTSIDE.search(name)):
            problems.append(f"cites {name!r}, which is not in the repository")
        cited_docs.append((m.start(), path))
    for m in SECTION.finditer(line):
        before = [path for start, path in cited_docs if start < m.start()]
        doc = before[-1] if before else (citing if citing.suffix == ".md" else None)
        if doc is None:
            if not before:
                problems.append(f"§{m.group(1)} without a document cited before it on the line")
            continue
        if m.group(1) not in sections_of(doc):
            problems.append(f"§{m.group(1)} is not a numbered section of {doc.relative_to(REPO)}")
    return problems


def citation_problems(files: list[Path]) -> list[str]:
    cache: dict[Path, set[str]] = {}

    def sections_of(doc: Path) -> set[str]:
        if doc not in cache:
            cache[doc] = numbered_sections(doc)
        return cache[doc]

    out = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            out += [f"{path.relative_to(REPO)}:{number}: {p}" for p in line_problems(line, path, sections_of)]
    return out


def test_every_citation_in_the_repository_resolves():
    files = scanned_files()
    assert any(p.name == "transformer.py" for p in files) and any(p.suffix == ".yaml" for p in files)
    problems = citation_problems(files)
    assert not problems, f"{len(problems)} citations a reader cannot follow:\n" + "\n".join(problems)


@pytest.mark.parametrize("line, expected", [
    ("see docs/stage1.md §4 for the layout", None),
    ("see docs/stage1.md §9 for the layout", "§9 is not a numbered section of docs/stage1.md"),
    ("see docs/nowhere.md", "cites 'docs/nowhere.md', which is not in the repository"),
    ("(" + "diffusion" + "_math.md §12)", "cites a document outside the repository"),
    ("design: `../shared/design/x.md`", "cites a document outside the repository"),
    ("fixed in issue 12, item 6", "cites an issue number"),
    ("(see #41)", "cites an issue number"),
    ("the §8.2 rule", "§8.2 without a document cited before it on the line"),
    ("the rule of [sampler.md](sampler.md) §2", None),
])
def test_the_scan_catches_each_kind_of_broken_citation(line, expected):
    citing = REPO / "docs" / "architecture.md" if "](" in line else REPO / "dgemma" / "model" / "transformer.py"
    problems = line_problems(line, citing, numbered_sections)
    if expected is None:
        assert problems == []
    else:
        assert any(expected in p for p in problems), problems

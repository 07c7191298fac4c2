"""Docstrings, comments, configs and docs cite only what a reader of this repository can open.

A newcomer reading `dgemma/` should be able to follow every reference: a `*.md` path must exist in the repository
(resolved from the citing file's folder or from the repository root), design documents kept outside it (the
`../shared` folder and its documents by name) are not cited, a section sign `§N` names a numbered section that
exists in the document cited before it on the same line (in a Markdown file, a bare `§N` is that file's own
section), a `file.md#anchor` or `](#anchor)` link and a quoted section name after a cited document
(`docs/x.md, "Some heading"`) name a heading of that document, and no text cites an issue number: say what the
behaviour is, or which test guards it. Every PNG under experiments/ is shown or linked by a Markdown file or a
notebook, and every image a Markdown file shows exists. Plain text scan (no `ast`), so it runs in the pytest worker.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve()

# names of the design documents outside the repository (built from pieces so this file does not cite them itself)
_OUTSIDE_DOCS = ("diffusion" + "_math", "framework" + ".md", "gemma4" + ".md", "diffusiongemma" + ".md",
                 "scale" + ".md", "family_lora" + ".md")
OUTSIDE = re.compile(r"\.\./shared|shared/design|(?<![\w-])(?:" + "|".join(map(re.escape, _OUTSIDE_DOCS)) + ")")
MD_PATH = re.compile(r"(?<![\w/.-])((?:\.{1,2}/)*[\w./-]*?[\w-]+\.md)(?![\w])")
SECTION = re.compile(r"§\s?(\d+(?:\.\d+)*)")
ISSUE = re.compile(r"(?i)\bissues?\s*#?\s*\d+|\(issue:|(?<![\w&/#])#\d{1,4}(?![\w.-])")  # `#1-layers` is an anchor
HEADING_NUMBER = re.compile(r"^#+\s+(\d+(?:\.\d+)*)\.?\s", re.M)
# `docs/x.md#anchor` anywhere; `](x.md#anchor)` and `](#anchor)` in Markdown (an empty path: the citing file)
PATH_ANCHOR = re.compile(r"(?<![\w/.-])((?:\.{1,2}/)*[\w./-]*?[\w-]+\.md)#([\w-]+)")
LINK_ANCHOR = re.compile(r"\]\(#([^)\s]+)\)")
# a section named in quotes right after a cited document: `docs/x.md, "FLOPs"`, `[x.md](x.md), "FLOPs"`
QUOTED_SECTION = re.compile(r'^[)\]]*(?:\([^)\s]*\))?,?\s"([^"]{2,80})"')
IMAGE = re.compile(r"\]\(([^)\s#]+\.(?:png|svg|jpg|gif))\)|<img [^>]*src=\"([^\"]+)\"")

# files the code writes (report names), not references to files in the repository
WRITTEN_NAMES = {"report.md", "results.md", "summary.md", "frontier.md", "text_frontier.md"}


def not_ignored(paths) -> list[Path]:
    """The paths git does not ignore (tracked or new): what a clean checkout holds, not what earlier runs left in
    ignored folders (runs/, caches, venvs). Outside a git checkout, all of them."""
    paths = sorted(paths)
    try:
        listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "--cached", "--others", "--exclude-standard",
                                 "-z"], capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        return paths
    known = {(REPO / name).resolve() for name in listed if name}
    return [p for p in paths if p.resolve() in known]


def scanned_files() -> list[Path]:
    """dgemma/ (sources, templates, package data), tests/, experiments/ (scripts, configs, READMEs, results),
    notebooks/, configs/, launch/, README.md, docs/."""
    files: set[Path] = set()
    for pattern in ("dgemma/**/*", "tests/**/*", "experiments/**/*", "notebooks/**/*", "configs/**/*", "launch/**/*",
                    "docs/*.md"):
        files.update(not_ignored(p for p in REPO.glob(pattern) if p.is_file()))
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


def headings(doc: Path) -> list[str]:
    """The Markdown headings of `doc`, outside code fences."""
    out, fenced = [], False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            out.append(m.group(1))
    return out


def anchors(doc: Path) -> set[str]:
    """The link anchors GitHub gives `doc`'s headings: lower case, punctuation dropped, spaces to hyphens, a repeated
    anchor suffixed -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for heading in headings(doc):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors on its text
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def line_problems(line: str, citing: Path, sections_of, anchors_of=anchors, headings_of=headings) -> list[str]:
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
        quoted = QUOTED_SECTION.match(line[m.end():])
        if path is not None and quoted and not any(quoted.group(1).lower() in h.replace("`", "").lower()
                                                   for h in headings_of(path)):
            problems.append(f"cites section {quoted.group(1)!r} of {name}, which has no such heading")
    for m in PATH_ANCHOR.finditer(line):
        path = resolve_md(m.group(1), citing)
        if path is not None and m.group(2) not in anchors_of(path):
            problems.append(f"cites {m.group(1)}#{m.group(2)}: no such heading in {path.relative_to(REPO)}")
    if citing.suffix == ".md":
        problems += [f"links #{m.group(1)}: no such heading in this file" for m in LINK_ANCHOR.finditer(line)
                     if m.group(1) not in anchors_of(citing)]
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
    cache: dict[tuple, object] = {}

    def cached(fn):
        def of(doc: Path):
            if (fn, doc) not in cache:
                cache[fn, doc] = fn(doc)
            return cache[fn, doc]
        return of

    sections_of, anchors_of, headings_of = cached(numbered_sections), cached(anchors), cached(headings)

    out = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            out += [f"{path.relative_to(REPO)}:{number}: {p}"
                    for p in line_problems(line, path, sections_of, anchors_of, headings_of)]
    return out


def test_every_citation_in_the_repository_resolves():
    files = scanned_files()
    assert any(p.name == "transformer.py" for p in files) and any(p.suffix == ".yaml" for p in files)
    problems = citation_problems(files)
    assert not problems, f"{len(problems)} citations a reader cannot follow:\n" + "\n".join(problems)


def image_problems() -> list[str]:
    """Images a Markdown file or notebook shows that do not exist; PNGs under experiments/ that nothing shows."""
    shown, problems = set(), []
    docs = not_ignored(p for p in REPO.glob("**/*.md") if ".git" not in p.parts)
    docs += not_ignored(p for p in REPO.glob("notebooks/*") if p.suffix in {".py", ".ipynb"})
    for doc in docs:
        for m in IMAGE.finditer(doc.read_text(encoding="utf-8")):
            image = (doc.parent / (m.group(1) or m.group(2))).resolve()
            if not image.is_file():
                problems.append(f"{doc.relative_to(REPO)} shows {m.group(1) or m.group(2)}, which does not exist")
            shown.add(image)
    problems += [f"{png.relative_to(REPO)} is shown or linked by no Markdown file or notebook"
                 for png in not_ignored(REPO.glob("experiments/**/*.png")) if png.resolve() not in shown]
    return problems


def test_every_experiment_figure_is_shown_and_every_shown_image_exists():
    problems = image_problems()
    assert not problems, "\n".join(problems)


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
    ("see docs/stage1.md#5-self-conditioning for it", None),
    ("see [layers](#1-layers) and (docs/stage1.md, \"Self-conditioning\")", None),
    ("see docs/stage1.md#what-the-model-learns for it", "no such heading in docs/stage1.md"),
    ("see [the layout](#no-such-heading)", "links #no-such-heading: no such heading in this file"),
    ("(docs/stage1.md, \"No such section\")", "cites section 'No such section' of docs/stage1.md"),
])
def test_the_scan_catches_each_kind_of_broken_citation(line, expected):
    citing = REPO / "docs" / "architecture.md" if "](" in line else REPO / "dgemma" / "model" / "transformer.py"
    problems = line_problems(line, citing, numbered_sections)
    if expected is None:
        assert problems == []
    else:
        assert any(expected in p for p in problems), problems

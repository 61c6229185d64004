"""README.md as a test: its quick start runs as printed on a GPU, and every relative link in
README.md and docs/*.md leads to a file that exists (and to a heading there, when it names one).

The quick start asserts its own result (the toy's tokens equal the target's greedy output), so
running it is the whole test; it is marked `gpu` and takes the `engine` fixture only to be
skipped, with the reason, where there is no GPU. The link check needs no GPU and is not marked:
it runs in every `make test`.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def readme() -> str:
    if not README.is_file():
        pytest.skip(f"no README.md at {README} (an installed package, not a checkout)")
    return README.read_text(encoding="utf-8")


def quick_start(text: str) -> str:
    """The first ```python block after the "## Quick start" heading."""
    section = re.search(r"^## Quick start\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, 'README.md has no "## Quick start" section'
    block = re.search(r"^```python\s*\n(.*?)^```\s*$", section.group(1), re.M | re.S)
    assert block, "README.md's quick start has no ```python block"
    return block.group(1)


@pytest.mark.gpu
def test_quick_start_runs_as_printed(engine):
    code = quick_start(readme())
    assert re.search(r"^assert ", code, re.M), "the quick start must assert its own result"
    exec(compile(code, f"{README}:quick start", "exec"), {"__name__": "__readme__"})


# -- links --------------------------------------------------------------------------------------

def outside_fences(text: str) -> list[str]:
    """The lines of a Markdown text that are not inside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link syntax reduced to its text, lower case, punctuation
    dropped (letters, digits, '_', '-' and spaces stay), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, repeats numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for line in outside_fences(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(path: Path) -> list[str]:
    """The link targets of a Markdown file, outside code blocks and inline code."""
    targets = []
    for line in outside_fences(path.read_text(encoding="utf-8")):
        targets += LINK.findall(re.sub(r"`[^`]*`", "``", line))
    return targets


def markdown_files() -> list[Path]:
    readme()
    return [README, *sorted(DOCS.glob("*.md"))]


def test_slugs_follow_github():
    assert slug("1. spec_seed_gather") == "1-spec_seed_gather"
    assert slug("Capture through `torch.cuda.graph`") == "capture-through-torchcudagraph"
    assert slug("What a capture refuses") == "what-a-capture-refuses"


def test_relative_links_lead_to_files_and_headings():
    broken = []
    for path in markdown_files():
        for target in links(path):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto: ...
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where}: {dest.name} has no heading with anchor #{anchor}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_links_every_docs_page():
    linked = {(README.parent / target.partition("#")[0]).resolve() for target in links(README)}
    missing = [page.name for page in markdown_files()[1:] if page.resolve() not in linked]
    assert not missing, f"README.md does not link docs pages {missing}"

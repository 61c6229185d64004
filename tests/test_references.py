"""Everything a docstring or comment refers to is in the repository: the project's contract is
docs/, and a user who clones or installs memra_cuda has every page it cites, with the section it
names (a page split or a heading renamed leaves no citation pointing at nothing)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [*ROOT.glob("memra_cuda/**/*.py"), *ROOT.glob("ptx/*.cu"), *ROOT.glob("ptx/*.cuh"),
           *ROOT.glob("ptx/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("benchmarks/*.py"),
           *ROOT.glob("examples/*.py"), ROOT / "Makefile", ROOT / "pyproject.toml"]
CITED = re.compile(r"\b((?:docs|benchmarks)/[\w./-]+\.md)")
# A section cited by its heading on the same line: docs/kernels.md, "Launchers" (or 's ("...")).
SECTION = re.compile(r"\b(docs/[\w./-]+\.md)(?:'s)?,? \(?\"([^\"\n]{2,80})\"")


def test_sources_cite_only_files_of_the_repository():
    assert len(SOURCES) > 30, "the sources were not found next to the tests"
    missing = [f"{path.relative_to(ROOT)}: {doc}" for path in SOURCES for doc in CITED.findall(path.read_text("utf-8"))
               if not (ROOT / doc).is_file()]
    assert missing == []
    design = [str(path.relative_to(ROOT)) for path in SOURCES
              if path.name != "test_references.py" and "DESIGN.md" in path.read_text("utf-8")]
    assert design == [], "DESIGN.md is not part of the repository: cite docs/ instead"


def headings(page: Path) -> list[str]:
    return [line.lstrip("#").strip().lower() for line in page.read_text("utf-8").splitlines() if line.startswith("#")]


def test_a_cited_section_is_a_heading_of_the_page_cited():
    """A page cited with a section, as `docs/kernels.md, "Launchers"`, has a heading that is the
    section or starts with it, so a reader finds what the code points to."""
    cited = [(path, doc, section) for path in SOURCES for doc, section in SECTION.findall(path.read_text("utf-8"))
             if (ROOT / doc).is_file()]
    assert cited, "no source cites a section of docs/ by its heading: the pattern no longer finds them"
    stale = [f"{path.relative_to(ROOT)}: {doc}, {section!r}" for path, doc, section in cited
             if not any(heading.startswith(section.lower()) for heading in headings(ROOT / doc))]
    assert stale == [], "sections cited that their page does not have:\n" + "\n".join(stale)


PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *ROOT.glob("docs/*.md"), *ROOT.glob("benchmarks/*.md")]
LINK = re.compile(r"\]\(([^)\s#]*)(?:#([^)\s]+))?\)")


def anchor(heading: str) -> str:
    """A heading's anchor as GitHub writes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def test_a_pages_links_reach_a_file_and_its_heading():
    """Every relative link of a page, `[text](other.md#section)`, names a file of the repository
    and, where it names a section, a heading of that file: a heading renamed, or a section cited
    from memory, leaves a link that opens the page at its top."""
    assert len(PAGES) > 10, "the pages were not found next to the tests"
    broken = []
    for page in PAGES:
        for target, section in LINK.findall(page.read_text("utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            linked = (page.parent / target).resolve() if target else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif section and linked.suffix == ".md" and section not in map(anchor, headings(linked)):
                broken.append(f"{page.relative_to(ROOT)}: {target}#{section} (no such heading)")
    assert broken == [], "links that reach nothing:\n" + "\n".join(broken)

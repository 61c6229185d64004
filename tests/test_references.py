"""Everything a docstring or comment refers to is in the repository: the project's contract is
docs/, and a user who clones or installs memra_cuda has every page it cites."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [*ROOT.glob("memra_cuda/**/*.py"), *ROOT.glob("ptx/*.cu"), *ROOT.glob("ptx/*.cuh"),
           *ROOT.glob("ptx/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("benchmarks/*.py"),
           *ROOT.glob("examples/*.py"), ROOT / "Makefile", ROOT / "pyproject.toml"]
CITED = re.compile(r"\b(docs/[\w./-]+\.md)")


def test_sources_cite_only_files_of_the_repository():
    assert len(SOURCES) > 30, "the sources were not found next to the tests"
    missing = [f"{path.relative_to(ROOT)}: {doc}" for path in SOURCES for doc in CITED.findall(path.read_text("utf-8"))
               if not (ROOT / doc).is_file()]
    assert missing == []
    design = [str(path.relative_to(ROOT)) for path in SOURCES
              if path.name != "test_references.py" and "DESIGN.md" in path.read_text("utf-8")]
    assert design == [], "DESIGN.md is not part of the repository: cite docs/ instead"

"""README.md as a test: every ```python block of it runs as printed on a GPU (the quick start
and the "Plugging in your model" snippet), and every relative link in README.md, docs/*.md and
benchmarks/RESULTS.md leads to a file that exists (and to a heading there, when it names one).

Each block asserts its own result (the tokens equal the target's greedy output), so running it
is the whole GPU test; those are marked `gpu` and take the `engine` fixture only to be skipped,
with the reason, where there is no GPU. What needs no GPU runs in every `make test`: each block
parses, asserts something, imports only names that exist and type-checks (mypy); the CUDA C a
block compiles with compile_ptx compiles (where NVRTC is installed); and the links.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
# The sections whose blocks the README promises run as printed: a block that goes missing fails.
RUNNABLE = ("Quick start", "Plugging in your model")

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def readme() -> str:
    if not README.is_file():
        pytest.skip(f"no README.md at {README} (an installed package, not a checkout)")
    return README.read_text(encoding="utf-8")


def python_blocks(text: str) -> dict[str, str]:
    """Every ```python block of `text`, by the `## ` section it is in (a second one in the same
    section numbered: "Section 2")."""
    blocks: dict[str, str] = {}
    for section in re.finditer(r"^## (.+?)\s*$(.*?)(?=^## |\Z)", text, re.M | re.S):
        for i, block in enumerate(re.findall(r"^```python\s*\n(.*?)^```\s*$", section.group(2), re.M | re.S)):
            blocks[section.group(1) + (f" {i + 1}" if i else "")] = block
    return blocks


def block(name: str) -> str:
    blocks = python_blocks(readme())
    assert name in blocks, f'README.md has no ```python block in its "## {name}" section'
    return blocks[name]


def test_the_runnable_sections_have_their_blocks():
    blocks = python_blocks(readme())
    assert set(RUNNABLE) <= set(blocks), f"README.md's python blocks are in {sorted(blocks)}, not all of {RUNNABLE}"


@pytest.mark.parametrize("name", RUNNABLE)
def test_a_block_parses_asserts_and_imports_what_exists(name):
    """On the CPU: the block is Python, asserts its result at its top level, and every name it
    imports exists (a renamed or moved name fails here, in every `make test`)."""
    tree = ast.parse(block(name), f"README.md: {name}")
    assert any(isinstance(node, ast.Assert) for node in tree.body), f"README.md's {name} block must assert its result"
    imports = ast.Module(body=[node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))],
                         type_ignores=[])
    assert imports.body, f"README.md's {name} block imports nothing"
    exec(compile(imports, f"README.md: {name}, its imports", "exec"), {})


def test_the_blocks_type_check(tmp_path):
    """On the CPU: what a user's type checker says of each block is nothing. mypy, with the
    settings the package and the examples are checked with (pyproject.toml's [tool.mypy]), reads
    each block as a module of its own against the memra_cuda this suite imports, its lines where
    README.md has them, so that an error names the README's line (a block that hands a buffer
    that may be None to a copy fails here)."""
    pytest.importorskip("mypy", reason="mypy comes with the test extra")
    import memra_cuda

    text, files = readme(), []
    for name in RUNNABLE:
        code, module = block(name), re.sub(r"\W+", "_", name.lower())
        path = tmp_path / f"README_{module}.py"
        path.write_text("\n" * text[:text.index(code)].count("\n") + code, encoding="utf-8")
        files.append(path.name)
    imported = str(Path(memra_cuda.__file__).resolve().parents[1])  # the tree or site-packages, first
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (imported, os.environ.get("PYTHONPATH"))))}
    run = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                          "--cache-dir", str(tmp_path / "mypy"), *files], cwd=tmp_path, env=env, capture_output=True,
                         text=True)
    assert run.returncode == 0, f"mypy on README.md's blocks:\n{run.stdout}{run.stderr}"
    assert f"no issues found in {len(files)} source files" in run.stdout, run.stdout  # both read, none skipped


def kernel_sources(code: str) -> list[str]:
    """The CUDA C a block compiles: string constants given to compile_ptx by name."""
    tree = ast.parse(code)
    strings = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
               for target in node.targets if isinstance(target, ast.Name)
               and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}
    called = [arg.id for node in ast.walk(tree) if isinstance(node, ast.Call)
              and getattr(node.func, "id", getattr(node.func, "attr", None)) == "compile_ptx"
              for arg in node.args[:1] if isinstance(arg, ast.Name)]
    return [strings[name] for name in called]


def test_the_plugging_in_kernel_compiles():
    """The snippet's CUDA C compiles to PTX with its kernel in it (NVRTC from the test extra;
    skipped where none is installed, failed where one is found but refused)."""
    from memra_cuda import compile_ptx
    from memra_cuda.errors import NvrtcUnavailable

    sources = kernel_sources(block("Plugging in your model"))
    assert len(sources) == 1, "the snippet compiles one CUDA C source, a string constant given to compile_ptx"
    try:
        ptx = compile_ptx(sources[0], name="model.cu")
    except NvrtcUnavailable as exc:
        if exc.found is None:
            pytest.skip(f"no NVRTC here: {exc}")
        raise
    assert re.search(r"\.entry\s+model\b", ptx), "the snippet's kernel `model` is not in its PTX"


@pytest.mark.gpu
@pytest.mark.parametrize("name", RUNNABLE)
def test_a_block_runs_as_printed(engine, name):
    """The block, run whole: it asserts its own result. The snippet's NVRTC is the test extra's;
    without any, it skips with the reason, as the other compile_ptx tests do."""
    from memra_cuda.errors import NvrtcUnavailable

    code = block(name)
    try:
        exec(compile(code, f"README.md: {name}", "exec"), {"__name__": "__readme__"})
    except NvrtcUnavailable as exc:
        if exc.found is None:
            pytest.skip(f"no NVRTC here: {exc}")
        raise


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
    return [README, *sorted(DOCS.glob("*.md")), *([RESULTS] if RESULTS.is_file() else [])]


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


def test_the_docs_index_links_every_page_and_the_readme_links_the_index():
    index = DOCS / "README.md"
    linked = {(DOCS / target.partition("#")[0]).resolve() for target in links(index)}
    missing = [page.name for page in sorted(DOCS.glob("*.md")) if page != index and page.resolve() not in linked]
    assert not missing, f"docs/README.md, the index, does not link docs pages {missing}"
    assert index.resolve() in {(ROOT / target.partition("#")[0]).resolve() for target in links(README)}, \
        "README.md does not link docs/README.md"

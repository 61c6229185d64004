"""The user pages stay what a user reads: a README of at most 120 lines, no docs page over 250,
no performance figure in them (they live in benchmarks/RESULTS.md, each with its machine, date
and model), no name the library no longer has, docs/errors.md listing exactly the errors of
memra_cuda.errors, every name memra_cuda and memra_cuda.torch export named in a page's code, every
name a page's python block imports there and every memra name it uses bound on the page, every
`memra_cuda.a.b` a page writes there, every file of the checkout it names and every call and
signature of memra's its prose writes (keywords, and a signature's parameters and defaults) the
code's, every fenced block tagged with its language and every python one parsing or a signature
the code has, each kernel's parameters as a page writes them the signature table's, install
lines that work from a checkout or a wheel, no address the project does not have, the toy page's
ToyModel signature whole, the Unreleased section's migration table for the calls the Geometry
changed, and `make` alone listing the Makefile's targets, each the README names among them. CPU
only: it runs in every `make test`.
"""
from __future__ import annotations

import ast
import builtins
import fnmatch
import importlib
import inspect
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

import memra_cuda
import memra_cuda.errors

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PYPROJECT = ROOT / "pyproject.toml"
DOCS = ROOT / "docs"
ERRORS = DOCS / "errors.md"

# What a measured figure looks like: the machine, a throughput, a speed-up, a bandwidth.
FIGURES = {
    "the machine measured on": re.compile(r"\bH200\b"),
    "a throughput": re.compile(r"\d\s*(tok/s|tokens/s|tokens per second)"),
    "a speed-up": re.compile(r"\d(\.\d+)?×(?!\s*\d)|\b\d+(\.\d+)?x (faster|slower|the)\b"),  # 1.19×, not 8 × 64
    "a bandwidth": re.compile(r"\d\s*[GT]B/s"),
}
# Names 0.3.0 removed (CHANGELOG.md's migration table gives each one's replacement).
REMOVED = {
    "a module of the flat 0.2 layout": re.compile(
        r"\bmemra_cuda\.(acceptance|bufs|capacity|compiler|device_loop|layout|pace|philox|reference|reference_tree"
        r"|round|sampling|stream|tables|tree|tree_kernels|models|moved|bench\w*)\b"),
    "memra_cuda.compile (now compile_ptx)": re.compile(r"\bmemra_cuda\.compile\b(?!_)"),
    "bufs.pos_ctr (now bufs.pos_ctr_d)": re.compile(r"\bbufs\.pos_ctr\b(?!_)"),
    "drain_ring(bufs) (now bufs.drain_ring())": re.compile(r"(?<!\.)\bdrain_ring\(bufs"),
    "a deprecation (0.3.0 has none)": re.compile(r"DeprecationWarning|\bdeprecated\b", re.I),
}


def pages() -> list[Path]:
    found = sorted(DOCS.glob("*.md"))
    if not README.is_file() or not found:
        pytest.skip(f"no README.md and docs/ at {ROOT} (an installed package, not a checkout)")
    return found


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)


def code(path: Path) -> list[str]:
    """What a page writes as code: each fenced block's text, and each inline `span` of its prose,
    whitespace made one space. Spans are paired paragraph by paragraph (none crosses a blank
    line), so the prose between two spans is not taken for code, as a pattern over the whole
    text took it (`digest`, named only in "a digest of its tokens" between two spans, passed for
    documented); a paragraph whose backticks do not pair fails here."""
    text = path.read_text(encoding="utf-8")
    spans = FENCED.findall(text)
    for paragraph in re.split(r"\n\s*\n", FENCED.sub("", text)):
        flat = " ".join(paragraph.split())
        assert flat.count("`") % 2 == 0, f"{path.name}: a paragraph's backticks do not pair: {flat[:80]}"
        spans += re.findall(r"`([^`]+)`", flat)
    return spans


def python_blocks(page: Path) -> list[str]:
    """The text of each ```python block of a page, in order."""
    return re.findall(r"^```python\s*\n(.*?)^```", page.read_text(encoding="utf-8"), re.M | re.S)


def test_the_readme_is_at_most_120_lines():
    pages()
    assert len(lines(README)) <= 120, f"README.md has {len(lines(README))} lines: the details belong in docs/"


def test_make_alone_says_what_each_target_the_readme_names_does():
    """`make help` was no target, and `make` alone ran the first rule (made .venv) and said
    nothing. Both list the Makefile's targets now, each the README names among them, a line each."""
    pages()
    if shutil.which("make") is None:
        pytest.skip("no make here")
    phony = re.search(r"^\.PHONY: (.+)$", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M)
    assert phony, "the Makefile lists no .PHONY targets"
    targets = set(phony.group(1).split()) - {"help"}
    others = README.read_text(encoding="utf-8").split("The Makefile's others", 1)[1].split("\n\n", 1)[0]
    named = {"test", "demo", *re.findall(r"`([a-z][\w-]*)`", others)} - {"make help", "torch"}
    assert named <= targets, f"the README names targets the Makefile does not have: {sorted(named - targets)}"
    env = {key: value for key, value in os.environ.items() if not key.startswith("MAKE")}  # not `make test`'s
    said = [subprocess.run(["make", "-s", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
            for argv in ([], ["help"])]
    assert said[0].returncode == 0 and said[0].stdout == said[1].stdout, said[0].stdout + said[0].stderr
    listed = {line.split()[1] for line in said[1].stdout.splitlines() if line.startswith("make ")}
    assert listed == targets, f"make help lists {sorted(listed)}, not the targets {sorted(targets)}"


def test_no_docs_page_is_over_250_lines():
    long = {page.name: len(lines(page)) for page in pages() if len(lines(page)) > 250}
    assert not long, f"split these pages, one topic each: {long}"


def test_no_performance_figure_in_the_user_pages():
    """A figure needs its machine, date and model beside it, which benchmarks/RESULTS.md keeps;
    a user page says what a figure means for a choice and points there."""
    found = [f"{path.relative_to(ROOT)}:{number}: {what}: {line.strip()}"
             for path in [README, *pages()] for number, line in enumerate(lines(path), 1)
             for what, pattern in FIGURES.items() if pattern.search(line)]
    assert not found, "performance figures belong in benchmarks/RESULTS.md:\n" + "\n".join(found)


def test_no_user_page_names_what_0_3_removed():
    found = [f"{path.relative_to(ROOT)}:{number}: {what}: {line.strip()}"
             for path in [README, *pages()] for number, line in enumerate(lines(path), 1)
             for what, pattern in REMOVED.items() if pattern.search(line)]
    assert not found, "names the library no longer has:\n" + "\n".join(found)


def documented_errors() -> tuple[list[str], list[str]]:
    """docs/errors.md's table of exceptions (its first column, in order) and its `## Name`
    headings."""
    pages()
    text = ERRORS.read_text(encoding="utf-8")
    table = re.findall(r"^\| `(\w+)` \|", text, re.M)
    headings = re.findall(r"^## (\w+)\s*$", text, re.M)
    return table, headings


def test_the_errors_page_lists_exactly_memra_cuda_errors():
    """Both ways: every name of memra_cuda.errors.__all__ in the table and under a heading of
    its own, and nothing there that is not an error of memra_cuda.errors; MemraError, the base,
    first."""
    table, headings = documented_errors()
    exported = set(memra_cuda.errors.__all__)
    assert table and table[0] == "MemraError", f"docs/errors.md's table must start with the base, not {table[:1]}"
    assert sorted(table) == sorted(exported), (f"in the table only: {sorted(set(table) - exported)}; "
                                               f"in memra_cuda.errors only: {sorted(exported - set(table))}")
    assert sorted(headings) == sorted(exported), (f"headings only: {sorted(set(headings) - exported)}; "
                                                  f"in memra_cuda.errors only: {sorted(exported - set(headings))}")


def test_every_documented_error_derives_from_memra_error_and_its_builtin():
    """The page says each error is a MemraError and also the builtin of its row's second column
    (or a subclass of the error named there)."""
    pages()
    rows = re.findall(r"^\| `(\w+)` \| `(\w+)` \|", ERRORS.read_text(encoding="utf-8"), re.M)
    assert rows
    for name, base in rows:
        error = getattr(memra_cuda.errors, name)
        parent = getattr(memra_cuda.errors, base, None) or getattr(builtins, base)
        assert issubclass(error, memra_cuda.errors.MemraError), name
        assert issubclass(error, parent) and error is not parent, f"{name} is not a {base}"


# -- where memra_cuda comes from ----------------------------------------------------------------

def install_lines() -> list[str]:
    """The commands of README.md's "## Install" block, without their comments."""
    pages()
    section = re.search(r"^## Install\s*$(.*?)(?=^## )", README.read_text(encoding="utf-8"), re.M | re.S)
    assert section, 'README.md has no "## Install" section'
    block = re.search(r"^```sh\s*\n(.*?)^```", section.group(1), re.M | re.S)
    assert block, 'README.md\'s "## Install" section has no ```sh block'
    return [line.partition("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def declared(table: str) -> str:
    """The text of one [table] of pyproject.toml, up to the next table."""
    found = re.search(rf"^\[{re.escape(table)}\]\s*$(.*?)(?=^\[|\Z)", PYPROJECT.read_text(encoding="utf-8"),
                      re.M | re.S)
    assert found, f"pyproject.toml has no [{table}]"
    return found.group(1)


def test_the_install_lines_work_from_a_checkout_or_a_wheel():
    """Issue 49, item 2: memra_cuda is on no package index and has no address to fetch it from,
    so every install line takes it from what the user has: the checkout (`.`) or the wheel built
    in one (named as `pip wheel` names it), with extras pyproject.toml declares; anything else it
    names is a dependency pyproject.toml declares (the CUDA 12 bindings)."""
    extras = set(re.findall(r"^([\w-]+) = \[", declared("project.optional-dependencies"), re.M))
    dependencies = {re.split(r"[<>=!~;\[ ]", spec)[0]
                    for spec in re.findall(r'"([^"]+)"', re.search(r"^dependencies = \[(.*?)\]",
                                                                   declared("project"), re.M | re.S).group(1))}
    wheel = f"memra_cuda-{memra_cuda.__version__}-py3-none-any.whl"
    lines = install_lines()
    assert lines and all(line.startswith("pip install ") for line in lines), f"not all pip installs: {lines}"
    for line in lines:
        ours = []
        for arg in shlex.split(line)[2:]:
            if re.split(r"[<>=!~;\[ ]", arg)[0] in dependencies:
                continue
            target, _, asked = arg.partition("[")
            assert target == "." or ("/" in target and fnmatch.fnmatch(wheel, Path(target).name)), \
                f"{line}: {arg!r} is neither the checkout (.) nor a wheel built in one ({wheel})"
            assert set(filter(None, asked.rstrip("]").split(","))) <= extras, f"{line}: extras not in {sorted(extras)}"
            ours.append(arg)
        assert len(ours) == 1, f"{line}: installs memra_cuda from {ours}, not from one checkout or wheel"


# Any web address naming memra: the package's own would be one, and it has none.
OWN_ADDRESS = re.compile(r"https?://[^\s\"'<>()\]]*memra[^\s\"'<>()\]]*", re.I)


def test_no_page_gives_memra_cuda_an_address_it_does_not_have():
    """No address of memra_cuda's own (a repository, a home page, issues) in what a user reads or
    pip shows: none is published, and one that leads nowhere is worse than none (0.3.0's README
    and pyproject.toml's [project.urls] named a repository that nothing showed exists)."""
    read = [README, PYPROJECT, ROOT / "CHANGELOG.md", *pages(), *sorted(ROOT.glob("benchmarks/*.md")),
            *sorted(ROOT.glob("memra_cuda/**/*.py")), *sorted(ROOT.glob("examples/*.py"))]
    found = [f"{path.relative_to(ROOT)}:{number}: {match}" for path in read
             for number, line in enumerate(lines(path), 1) for match in OWN_ADDRESS.findall(line)]
    assert not found, "addresses memra_cuda does not have:\n" + "\n".join(found)


# memra_cuda by its name from an index: `pip install 'memra_cuda[torch]'`, say, which fetches whatever
# someone else publishes under that name
FROM_INDEX = re.compile(r"pip install\s+(?:[^\s()`:#]+\s+)*?['\"]?memra[_-]cuda\b", re.I)  # one of its arguments


def test_no_page_message_or_skip_installs_memra_cuda_from_an_index():
    """Every way of installing memra_cuda a user is told (pages, examples, the package's own
    errors, the tests' skip reasons) takes it from the checkout or a wheel built in one, as the
    README's Install block does: memra_cuda is on no index, and a `pip install memra_cuda[...]`
    installs what another publisher put there under the name. An error of the package names the
    wheel its extra installs instead (nvidia-cuda-nvrtc-cu12, nvidia-nccl-cu12)."""
    read = [README, ROOT / "CHANGELOG.md", *pages(), *sorted(ROOT.glob("benchmarks/*.md")),
            *sorted(ROOT.glob("memra_cuda/**/*.py")), *sorted(ROOT.glob("examples/*.py")),
            *sorted(ROOT.glob("tests/**/*.py")), ROOT / "Makefile"]
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for path in read
             for number, line in enumerate(lines(path), 1) if FROM_INDEX.search(line) and path != Path(__file__)]
    assert not found, "installs of memra_cuda from an index:\n" + "\n".join(found)


def test_the_toy_page_gives_toy_models_whole_signature():
    """docs/toy-model.md gave ToyModel(...) without tree_spread: its signature there names every
    field of ToyModel, in order, with its default."""
    from dataclasses import fields

    from memra_cuda.testing.toy.lm import ToyModel
    pages()
    text = " ".join((DOCS / "toy-model.md").read_text(encoding="utf-8").split())
    written = max(re.findall(r"`(ToyModel\([^`]*\))`", text), key=len)  # the whole signature, not an example
    call = ast.parse(written, mode="eval").body
    assert isinstance(call, ast.Call)
    assert [(kw.arg, ast.literal_eval(kw.value)) for kw in call.keywords] == \
        [(field.name, field.default) for field in fields(ToyModel)], written


# The calls whose loose k, M and B became one Geometry (0.3.0's signatures), each a row of the
# Unreleased section's migration table.
GEOMETRY_CALLS = ("StreamBufs(engine, k, m_rounds", "kv_capacity(prompt_len, max_new_tokens, k, m_rounds",
                  "Capacity(entries, k, batch, m_rounds", "Capacity.of(capacities, k, batch, m_rounds",
                  "capacity_for(prompt_len, tokens, k, m_rounds", "RoundDecoder(model, draft, *, k=",
                  "Round(..., width=")


def test_the_unreleased_breaks_come_with_a_migration_table_that_runs():
    """CHANGELOG.md's header promises a migration table for a release that breaks code; the
    Unreleased section broke 0.3.0's calls (a Geometry for loose k, M and B) and had none. Every
    such call has a row whose replacement takes a Geometry, and the rows' kv_capacity calls do what
    they say: the old a TypeError, the new a capacity."""
    from memra_cuda import Geometry, kv_capacity
    unreleased = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8").split("## [Unreleased]", 1)[1]
    unreleased = unreleased.split("\n## [", 1)[0]
    assert "### Changed (breaking)" in unreleased and "### Migrating from 0.3.0" in unreleased
    rows = re.findall(r"^\| (.+) \| (.+) \|$", unreleased.split("### Migrating from 0.3.0", 1)[1], re.M)[2:]
    for call in GEOMETRY_CALLS:
        assert any(call in old and "geometry" in new.lower() for old, new in rows), f"no row migrates {call}"
    olds, news = ([code for cell in cells for code in re.findall(r"`(kv_capacity\(5, [^`]*)`", cell)]
                  for cells in zip(*rows))
    assert olds and news
    for code in olds:
        with pytest.raises(TypeError):
            eval(code, {"kv_capacity": kv_capacity})
    for code in news:
        assert eval(code, {"kv_capacity": kv_capacity, "Geometry": Geometry}) > 256, code


def exported(path: Path) -> list[str]:
    """A module's `__all__`, read from its source (memra_cuda.torch's needs torch to import)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{path} has no __all__")


@pytest.mark.parametrize("package", ["memra_cuda", "memra_cuda.torch", "memra_cuda.buffers", "memra_cuda.comm",
                                     "memra_cuda.driver", "memra_cuda.kernels", "memra_cuda.rounds",
                                     "memra_cuda.testing.toy"])
def test_every_public_name_is_documented(package):
    """Each name in the __all__ of memra_cuda, of memra_cuda.torch and of each subpackage above is
    named, in backticks, on a page of docs/ (memra_cuda.torch.best_ranks was exported and on none,
    and so were memra_cuda.driver.KernelArgs, memra_cuda.comm.Watch, memra_cuda.buffers.AddressTable
    and others). Every package but memra_cuda.torch imports here, without a GPU (NCCL is loaded
    by a communicator), and its `__all__` is the one its source declares. A name counts where a
    page's code names it, alone or as `package.name` (an attribute of something else, `x.name`,
    does not), not in the prose between two spans."""
    spans = "\n".join(span for page in pages() for span in code(page))
    names = exported(ROOT.joinpath(*package.split("."), "__init__.py"))
    assert names
    if package != "memra_cuda.torch":
        assert importlib.import_module(package).__all__ == names
    missing = [name for name in names
               if not re.search(rf"(?:(?<![\w.])|(?<={re.escape(package)}\.)){re.escape(name)}\b", spans)]
    assert not missing, f"{package} exports names no page of docs/ names: {missing}"


def test_the_pages_python_blocks_import_what_exists():
    """Every name a ```python block of docs/ imports from memra_cuda is there (the README's blocks
    are tests/test_readme_gpu.py's): a name renamed or moved fails here, not in a newcomer's first
    paste. A module that needs torch is read from its source's `__all__`, so no torch is needed."""
    blocks = [(page.name, block) for page in pages() for block in python_blocks(page)]
    imports = [(name, statement) for name, block in blocks for line in block.splitlines()
               if line.startswith(("from memra_cuda", "import memra_cuda"))
               for statement in ast.parse(line).body]
    assert len(imports) >= 5, f"the pages' imports were not found: {imports}"
    missing = []
    for name, statement in imports:
        if isinstance(statement, ast.Import):
            modules = [(alias.name, []) for alias in statement.names]
        else:
            assert isinstance(statement, ast.ImportFrom) and statement.module
            modules = [(statement.module, [alias.name for alias in statement.names])]
        for module, names in modules:
            path = ROOT.joinpath(*module.split("."))
            path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
            if not path.is_file():
                missing.append(f"{name}: no module {module}")
            elif module.startswith("memra_cuda.torch"):
                missing += [f"{name}: {module}.{n}" for n in names if n not in exported(path)]
            else:
                missing += [f"{name}: {module}.{n}" for n in names if not hasattr(importlib.import_module(module), n)]
    assert not missing, "the pages import what memra_cuda does not have:\n" + "\n".join(missing)


def memra_names() -> set[str]:
    """What a block could use of memra_cuda's: every class a module of it defines (not private)
    and every name a module exports (`__all__`), read from the source (memra_cuda.torch's needs
    torch to import)."""
    names: set[str] = set()
    for path in sorted(ROOT.glob("memra_cuda/**/*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                names.add(node.name)
            elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                names.update(ast.literal_eval(node.value))
    return names


def fences(page: Path) -> list[tuple[int, str]]:
    """Each fenced block's opening line of a page: its number and the language it names ("" for none)."""
    opened, found = False, []
    for number, line in enumerate(lines(page), 1):
        if line.startswith("```"):
            if not opened:
                found.append((number, line[3:].strip()))
            opened = not opened
    return found


REQUIRED = "(no default)"  # a parameter without one, on the page and in the code


def signature_of(name: str) -> inspect.Signature:
    """The signature of `Name` or `Name.method`, a name memra_cuda or one of its subpackages exports."""
    head, _, method = name.partition(".")
    for package in ("memra_cuda", "memra_cuda.buffers", "memra_cuda.rounds", "memra_cuda.driver",
                    "memra_cuda.kernels", "memra_cuda.testing.toy"):
        found = getattr(importlib.import_module(package), head, None)
        if found is not None:
            return inspect.signature(getattr(found, method) if method else found)
    raise AssertionError(f"{name} is no name memra_cuda exports")


def test_a_pages_code_names_its_language_and_its_python_parses_or_is_the_codes_signature():
    """Every fenced block names its language (trees.md's untagged one, python, escaped every check
    of the python blocks: its names imported nowhere), and each ```python block parses or is a
    signature, `RoundStream(bufs, *, ...)`, whose parameters, in order, and defaults are the
    code's (round-stream.md's was left out of every check as a block that does not parse)."""
    untagged = [f"{page.name}:{number}" for page in [README, *pages()] for number, tag in fences(page) if not tag]
    assert not untagged, "fenced blocks that name no language (```python, ```sh):\n" + "\n".join(untagged)
    signatures = 0
    for page in [README, *pages()]:
        for block in python_blocks(page):
            try:
                ast.parse(block)
                continue
            except SyntaxError:
                written = re.fullmatch(r"([A-Za-z]\w*(?:\.\w+)?)\((.*)\)\s*", block, re.S)
            assert written, f"{page.name}: a python block that neither parses nor is a signature:\n{block}"
            name, params = written.groups()
            args = ast.parse(f"def f({params}): pass").body[0].args
            positional = [*args.posonlyargs, *args.args]
            page_form = [(a.arg, REQUIRED) for a in positional[:len(positional) - len(args.defaults)]]
            page_form += [(a.arg, ast.literal_eval(d)) for a, d in zip(positional[len(page_form):], args.defaults)]
            page_form += [("*", REQUIRED)] * bool(args.kwonlyargs) + [
                (a.arg, REQUIRED if d is None else ast.literal_eval(d))
                for a, d in zip(args.kwonlyargs, args.kw_defaults)]
            code_form = []
            for param in signature_of(name).parameters.values():
                if param.kind is param.KEYWORD_ONLY and ("*", REQUIRED) not in code_form:
                    code_form.append(("*", REQUIRED))
                if param.name not in ("self", "cls"):
                    code_form.append((param.name, REQUIRED if param.default is param.empty else param.default))
            assert page_form == code_form, f"{page.name}: {name}'s signature, not the code's:\n{page_form}\n{code_form}"
            signatures += 1
    assert signatures, "no python block is a signature: the pattern no longer finds round-stream.md's"


def test_the_pages_python_blocks_bind_the_memra_names_they_use():
    """A ```python block that uses a name of memra_cuda's imports it, there or in a block before it
    on the same page (a fragment goes on from the blocks above it): docs/nccl.md's toy over ranks
    used ToyTensorParallel, ToyModel and Geometry and imported none of them, so a newcomer's paste
    met a NameError. A fragment's own placeholders (`cache`, `decoder`) are no names of memra's;
    a block that is a signature, not code, does not parse and is left out."""
    known = memra_names()
    assert {"RoundStream", "ToyTensorParallel", "Geometry"} <= known
    unbound, read = [], 0
    for page in pages():
        bound = set(dir(builtins))
        for block in python_blocks(page):
            try:
                tree = ast.parse(block)
            except SyntaxError:
                continue
            read += 1
            for node in ast.walk(tree):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
                elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    bound.add(node.name)
                elif isinstance(node, ast.arg):
                    bound.add(node.arg)
                elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                    bound.add(node.id)
            used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
            unbound += [f"{page.name}: {name}" for name in sorted(used & known - bound)]
    assert read >= 5, f"the pages' python blocks were not found ({read})"
    assert not unbound, "python blocks use memra names no block of their page imports:\n" + "\n".join(unbound)


def test_the_kernel_signatures_a_page_writes_are_the_tables():
    """Where a page writes a kernel with its parameters (`spec_ring_commit(vtok_d, acc_d, ...)`),
    they are the ones memra_cuda.kernels.SIGNATURES gives it, by name and in order: the table is
    checked against ptx/*.cu (tests/kernels/test_signatures.py), and this the pages against it."""
    from memra_cuda.kernels import SIGNATURES

    written = [(page.name, match.group(1), [arg.strip() for arg in match.group(2).split(",")])
               for page in pages() for span in code(page)
               for match in [re.fullmatch(r"((?:spec|toy|probe)_\w+)\(([^()]*)\)", span)] if match]
    assert len(written) >= 10, f"the pages' kernel signatures were not found: {written}"
    wrong = [f"{page}: {name}({', '.join(args)}), but SIGNATURES has "
             + (f"{name}{SIGNATURES[name]}" if name in SIGNATURES else "no such kernel")
             for page, name, args in written
             if name not in SIGNATURES or args != [param.name for param in SIGNATURES[name].params]]
    assert not wrong, "kernel signatures the pages write wrong:\n" + "\n".join(wrong)


# -- what a page's code names is there ----------------------------------------------------------

def top_level(path: Path) -> dict[str, ast.stmt]:
    """Each name a module's source binds at its top level (inside a top-level `if` or `try` too):
    the def, class, assignment or import that binds it."""
    found: dict[str, ast.stmt] = {}

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.If, ast.Try)):
                walk([*node.body, *node.orelse, *getattr(node, "finalbody", []),
                      *(statement for handler in getattr(node, "handlers", []) for statement in handler.body)])
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found[node.name] = node
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                found.update({(alias.asname or alias.name).split(".")[0]: node for alias in node.names})
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found.update({name.id: node for target in targets for name in ast.walk(target)
                              if isinstance(name, ast.Name)})
    walk(ast.parse(path.read_text(encoding="utf-8")).body)
    return found


def module_path(parts: list[str]) -> tuple[Path, list[str]]:
    """The source file of the longest module a dotted name starts with (a package's
    `__init__.py`), and the parts of the name after it."""
    path, rest = ROOT / parts[0], parts[1:]
    while rest and (path / rest[0]).is_dir():
        path, rest = path / rest[0], rest[1:]
    if rest and (path / f"{rest[0]}.py").is_file():
        return path / f"{rest[0]}.py", rest[1:]
    return path / "__init__.py", rest


def definition(path: Path, name: str) -> tuple[Path, ast.stmt] | None:
    """Where the module at `path` gets `name` from: its own statement, or, for a name it imports
    relatively (`from .serving import Server`), the statement of the module it imports from."""
    node = top_level(path).get(name)
    if not (isinstance(node, ast.ImportFrom) and node.level):
        return (path, node) if node is not None else None
    imported = next(alias.name for alias in node.names if (alias.asname or alias.name) == name)
    source = path.parents[node.level - 1].joinpath(*(node.module or imported).split("."))
    source = source / "__init__.py" if source.is_dir() else source.with_suffix(".py")
    if not source.is_file():
        return None
    return definition(source, imported) if node.module else (source, node)  # `from . import module`: the module


def class_attributes(path: Path, cls: ast.ClassDef) -> set[str]:
    """What a class defines (methods, properties, class-level names, every `self.X` it assigns),
    with what its bases of memra_cuda define, followed where they are defined."""
    names = {node.name for node in cls.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names |= {target.id for node in cls.body if isinstance(node, (ast.Assign, ast.AnnAssign))
              for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
              if isinstance(target, ast.Name)}
    names |= {node.attr for node in ast.walk(cls) if isinstance(node, ast.Attribute)
              and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) and node.value.id == "self"}
    for base in cls.bases:
        found = definition(path, base.id) if isinstance(base, ast.Name) else None
        if found and isinstance(found[1], ast.ClassDef):
            names |= class_attributes(*found)
    return names


def test_every_dotted_memra_name_a_page_writes_is_there():
    """A `memra_cuda.a.b` a page's code names (a span or a block) is a module of the package, a
    name that module binds (followed through its imports) and, after a class, something that
    class defines: `memra_cuda.rounds.pace.AHEAD`, `memra_cuda.rounds.Server`,
    `memra_cuda.torch.attention.MOST_SLOTS`. Read from the source, so memra_cuda.torch's names
    need no torch; the imports of a python block are test_the_pages_python_blocks_import_what_exists'."""
    written = {(page.name, match) for page in [README, *pages()] for span in code(page)
               for match in re.findall(r"(?<![\w.])memra_cuda(?:\.\w+)+", span)}
    assert len(written) >= 50, f"the pages' dotted names were not found: {sorted(written)}"
    missing = []
    for page, dotted in sorted(written):
        path, rest = module_path(dotted.split("."))
        if not path.is_file():
            missing.append(f"{page}: {dotted}: no module {path.relative_to(ROOT)}")
            continue
        found = definition(path, rest[0]) if rest else (path, None)
        if found is None:
            missing.append(f"{page}: {dotted}: {path.relative_to(ROOT)} has no {rest[0]}")
        elif len(rest) > 1 and isinstance(found[1], ast.ClassDef) and rest[1] not in class_attributes(*found):
            missing.append(f"{page}: {dotted}: {rest[0]} has no {rest[1]}")
    assert not missing, "dotted names the pages write that memra_cuda does not have:\n" + "\n".join(missing)


# A file or folder of the checkout, as a page writes one: `ptx/device_loop.cu`, `tests/comm/`.
REPO_PATH = re.compile(r"(?<![\w./-])((?:memra_cuda|tests|benchmarks|examples|ptx|tools|docs)/[\w./*-]*\w/?)")


def test_every_file_a_page_names_is_in_the_checkout():
    """A path a page's code names (`memra_cuda/rounds/pace.py`, `tests/rounds/test_follow.py`,
    `ptx/*.cu`) is in the checkout, so a newcomer sent to read it finds it; a pattern matches
    something. A placeholder in capitals (`examples/NAME.py`) is one to fill in."""
    written = {(page.name, path) for page in [README, *pages()] for span in code(page)
               for path in REPO_PATH.findall(span) if not re.search(r"/[A-Z]+(\.\w+)?$", path)}
    assert len(written) >= 20, f"the pages' paths were not found: {sorted(written)}"
    missing = [f"{page}: {path}" for page, path in sorted(written)
               if not (any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists())]
    assert not missing, "paths the pages name that the checkout does not have:\n" + "\n".join(missing)


KWARGS = "**"  # a parameter list's mark that it takes any keyword


def listed(args: ast.arguments, method: bool = False) -> list[tuple[str, ast.expr | None]]:
    """A parameter list's names in order, each with its default (None: none), `*` where the
    keyword-only ones start and KWARGS where it takes any keyword; a method's without its first."""
    positional = [*args.posonlyargs, *args.args][int(method):]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    return ([(a.arg, d) for a, d in zip(positional, defaults)] + [("*", None)] * bool(args.kwonlyargs)
            + list(zip((a.arg for a in args.kwonlyargs), args.kw_defaults)) + [(KWARGS, None)] * bool(args.kwarg))


def code_signatures() -> dict[str, list[list[tuple[str, ast.expr | None]]]]:
    """Every function, method and class of memra_cuda's source by its name, read from the source
    (memra_cuda.torch's needs torch to import): each one's parameters as `listed` gives them; a
    class's are its `__init__`'s, else its fields' (a dataclass's, a NamedTuple's)."""
    found: dict[str, list[list[tuple[str, ast.expr | None]]]] = {}
    for path in sorted(ROOT.glob("memra_cuda/**/*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.setdefault(node.name, []).append(listed(node.args, False))
            elif isinstance(node, ast.ClassDef):
                init = None
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        method = not any(getattr(d, "id", None) == "staticmethod" for d in item.decorator_list)
                        found.setdefault(item.name, []).append(listed(item.args, method))
                        init = found[item.name][-1] if item.name == "__init__" else init
                fields = [(item.target.id, item.value) for item in node.body
                          if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)]
                found.setdefault(node.name, []).append(init if init is not None else fields)
    return found


# A call or a signature a span writes, `Name(...)` or `x.name(...)`, one level of parentheses inside.
CALL = re.compile(r"(?<![\w.])((?:\w+\.)*)([A-Za-z_]\w*)\(([^()]*(?:\([^()]*\)[^()]*)*)\)")


class Named(str):
    """A default the code gives by a name (`look_s=LOOK_S`), its text: no page's literal is
    compared with it."""


def literal(node: ast.expr | None) -> object:
    """A default as a value where it is a literal (REQUIRED where there is none), else Named."""
    if node is None:
        return REQUIRED
    try:
        return ast.literal_eval(node)
    except ValueError:
        return Named(ast.unparse(node))


def test_the_calls_and_signatures_a_page_writes_are_the_codes():
    """Where a page's prose writes a function, method or class of memra_cuda's with keywords, as
    a call (`kv_len_ptr_table(engine, cache, pos_ctr=bufs.pos_ctr_d)`) each keyword is a parameter
    of one of that name; as a signature, which no call could be (`bufs.start_row(row, pending,
    position, *, budget, eos=None)`), its parameters are, in order, one of that name's, and each
    default it writes as a literal is the code's. A keyword renamed, a parameter reordered or a
    default changed in the code fails here, not in a newcomer's call (buffers.md wrote `b` for
    start_row's `row`). Placeholders (`...`, `slots=`) stand for what they elide; another
    library's calls (`torch.`, `np.`) are left out, and so are the blocks
    (test_a_pages_code_names_its_language_and_its_python_parses_or_is_the_codes_signature)."""
    known = code_signatures()
    calls, signatures, wrong = 0, 0, []
    for page in [README, *pages()]:
        for span in code(page):
            if "\n" in span:
                continue
            for receiver, name, written in CALL.findall(span):
                if name not in known or receiver.split(".")[0] in ("torch", "np", "numpy"):
                    continue
                written = re.sub(r"(?<![=\w])\.\.\.\s*,?\s*", "", written).strip(" ,")
                written = re.sub(r"(\w)=\s*(?=,|$)", r"\1=...", written)
                try:
                    call = ast.parse(f"f({written})", mode="eval").body
                except SyntaxError:
                    try:
                        args = ast.parse(f"def f({written}): pass").body[0].args
                    except SyntaxError:
                        continue  # neither: a kernel's C parameters, say
                    page_form = listed(args)
                    signatures += 1
                    if not any([p for p, _ in page_form] == [p for p, _ in form] and all(
                            mine in (..., theirs) or isinstance(theirs, Named)
                            for mine, theirs in zip((literal(d) for _, d in page_form), (literal(d) for _, d in form)))
                            for form in known[name]):
                        wrong.append(f"{page.name}: {span}: not {name}'s signature, " + " or ".join(
                            f"({', '.join(p if d is None else f'{p}={ast.unparse(d)}' for p, d in form)})"
                            for form in known[name]))
                    continue
                keywords = {keyword.arg for keyword in call.keywords if keyword.arg}
                if keywords:
                    calls += 1
                    taken = [{p for p, _ in form} for form in known[name]]
                    if not any(keywords <= names or KWARGS in names for names in taken):
                        wrong.append(f"{page.name}: {span}: no {name} of memra_cuda takes "
                                     f"{sorted(keywords - set().union(*taken))}")
    assert calls >= 50 and signatures >= 20, f"the pages' calls ({calls}) and signatures ({signatures}) were not found"
    assert not wrong, "calls and signatures the pages write that are not the code's:\n" + "\n".join(wrong)

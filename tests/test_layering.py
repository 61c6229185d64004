"""The package's layering, read from its source: no circle among its modules' imports (type-only
imports count: a reader follows them too), and the numpy reference, the tests' oracle, imported
by no production module but the toy's numpy loop that exists to run it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import memra_cuda

PACKAGE = Path(memra_cuda.__file__).resolve().parent
ORACLE_USERS = {"memra_cuda.models.toy_reference", "memra_cuda.reference_tree"}


def module_imports(deferred: bool = False) -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports at module level (in
    `if TYPE_CHECKING:` blocks too), and with `deferred` inside functions too (a reader follows
    those as well: acceptance -> kernels -> sampling -> acceptance once closed through a
    function's import)."""
    names = {".".join(("memra_cuda", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__"): path
             for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in names.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found: set[str] = set()
        nodes = list(ast.walk(ast.parse(path.read_text(encoding="utf-8")))) if deferred else \
            list(ast.parse(path.read_text(encoding="utf-8")).body)
        while nodes:
            node = nodes.pop()
            if isinstance(node, ast.If) and not deferred:
                nodes += node.body + node.orelse
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else (node.module or "")
                found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in names else base for alias in node.names}
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        graph[name] = {target for target in found if target in names and target != name}
    return graph


@pytest.mark.parametrize("deferred", [False, True], ids=["module level", "with imports inside functions"])
def test_no_module_imports_itself_through_others(deferred):
    graph, state, stack = module_imports(deferred), {}, []

    def visit(name: str) -> None:
        state[name] = "open"
        stack.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                circle = stack[stack.index(target):] + [target]
                raise AssertionError(f"import circle: {' -> '.join(circle)}")
            if target not in state:
                visit(target)
        stack.pop()
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_only_the_toys_numpy_loop_imports_the_reference():
    oracles = {"memra_cuda.reference", "memra_cuda.reference_tree"}
    importers = {name for name, targets in module_imports().items() if targets & oracles}
    assert importers <= ORACLE_USERS, \
        f"production modules import the numpy reference: {sorted(importers - ORACLE_USERS)}"


def test_the_import_graph_is_read_at_all():
    graph = module_imports()
    assert "memra_cuda.driver.buffer" in graph["memra_cuda.bufs"]
    assert "memra_cuda.reference" in graph["memra_cuda.models.toy_reference"]


def test_the_example_reads_the_stream_state_through_the_library_not_the_oracle():
    """examples/torch_llama.py learns a row's done flag from StreamBufs (issue 18, case 5), not
    from the numpy reference's layout; skipped where the package is installed without it."""
    example = PACKAGE.parent / "examples" / "torch_llama.py"
    if not example.is_file():
        pytest.skip("examples/ is part of the source checkout, not the installed package")
    imported = set()
    for node in ast.walk(ast.parse(example.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
            imported.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    assert "memra_cuda.reference" not in imported and "memra_cuda" in {m.split(".")[0] for m in imported}

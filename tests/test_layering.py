"""The package's architecture, read from its source: the folders are layers, and every import
points down or sideways, never up; no circle among the modules' imports (type-only imports and
imports inside functions count: a reader follows them too); the numpy reference, the tests'
oracle, is imported by nothing but the testing subpackage that holds it; no command line but the
demo's. The benchmarks, a program of the checkout beside it, have no circle either, and no
module of theirs takes another's private name."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import memra_cuda

PACKAGE = Path(memra_cuda.__file__).resolve().parent
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# Each folder's layer: a module may import its own folder's and lower layers' modules, never a
# higher one's. comm sits beside buffers: it needs the driver alone. The root's modules (the
# face, errors, the demo) gather from every layer and are imported by none.
LAYERS = {"driver": 0, "buffers": 1, "comm": 1, "kernels": 2, "rounds": 3, "torch": 4, "testing": 4}


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Each module of the package in the folder `root` (memra_cuda's, or the checkout's
    benchmarks) by its dotted name -> its file."""
    return {".".join((root.name, *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__"): path
            for path in root.rglob("*.py")}


def module_imports(deferred: bool = True, root: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of the package in `root` -> the package's modules it imports at module level
    (in `if TYPE_CHECKING:` blocks too), and with `deferred` inside functions too."""
    names = modules(root)
    graph = {}
    for name, path in names.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found: set[str] = set()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        nodes = list(ast.walk(tree)) if deferred else list(tree.body)
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


def layer(module: str) -> int | None:
    """The layer of a module's folder; None for the root's own modules."""
    parts = module.split(".")
    return LAYERS[parts[1]] if len(parts) > 2 or parts[1:] and parts[1] in LAYERS else None


def test_every_folder_has_a_layer():
    folders = {path.parent.relative_to(PACKAGE).parts[0] for path in PACKAGE.rglob("*/__init__.py")}
    assert folders == set(LAYERS), f"folders without a layer, or layers without a folder: {folders ^ set(LAYERS)}"


def test_every_import_points_down_or_sideways():
    upward = [f"{name} (layer {layer(name)}) imports {target} (layer {layer(target)})"
              for name, targets in module_imports().items() if layer(name) is not None
              for target in sorted(targets) if layer(target) is None or layer(target) > layer(name)]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("root", [PACKAGE, BENCHMARKS], ids=["memra_cuda", "benchmarks"])
@pytest.mark.parametrize("deferred", [False, True], ids=["module level", "with imports inside functions"])
def test_no_module_imports_itself_through_others(deferred, root):
    graph, state, stack = module_imports(deferred, root), {}, []

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


def test_no_benchmark_takes_another_modules_private_name():
    """What a benchmark shares it names in public: a leading underscore says that nothing outside
    the module relies on the name."""
    names = modules(BENCHMARKS)
    taken = []
    for name, path in names.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("benchmarks")):
                taken += [f"{name} takes {alias.name} from {node.module or '.'}" for alias in node.names
                          if alias.name.startswith("_")]
    assert len(names) > 5, f"the benchmarks were not found in {BENCHMARKS}"
    assert not taken, "\n".join(taken)


def test_only_the_demo_parses_a_command_line():
    """A command line is a program's: the wheel's one program is the demo (python -m memra_cuda).
    The examples' options are the examples' (examples/_cli.py), not a module a user tests against."""
    parsers = sorted({name for name, path in modules().items()
                      for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                      if isinstance(node, ast.Import) and any(alias.name == "argparse" for alias in node.names)
                      or isinstance(node, ast.ImportFrom) and node.module == "argparse"})
    assert parsers == ["memra_cuda.__main__"], f"modules of the wheel that parse a command line: {parsers}"


def test_only_the_testing_subpackage_imports_the_reference():
    oracles = {"memra_cuda.testing.reference", "memra_cuda.testing.reference_tree"}
    importers = {name for name, targets in module_imports().items() if targets & oracles}
    assert importers and all(name.startswith("memra_cuda.testing.") for name in importers), \
        f"production modules import the numpy reference: {sorted(importers)}"


def test_the_library_imports_nothing_of_the_testing_subpackage_but_the_demo():
    """memra_cuda.testing is what users test against and the demo decodes: no layer of the
    library may need it (torch, beside it, could import it and pass the layering)."""
    importers = {name for name, targets in module_imports().items()
                 if any(target.startswith("memra_cuda.testing") for target in targets)}
    outside = sorted(name for name in importers if not name.startswith("memra_cuda.testing"))
    assert outside == ["memra_cuda.__main__"], f"the library imports memra_cuda.testing: {outside}"


def test_the_import_graph_is_read_at_all():
    graph = module_imports()
    assert "memra_cuda.driver.buffer" in graph["memra_cuda.buffers.stream_bufs"]
    assert "memra_cuda.testing.reference" in graph["memra_cuda.testing.toy.numpy_loop"]
    assert layer("memra_cuda.rounds.stream") == 3 and layer("memra_cuda.errors") is None


def test_the_server_is_host_logic_that_plain_and_speculative_decoding_share():
    """memra_cuda.rounds.serving schedules requests without the device or torch (a CPU test
    drives it): of the package it takes the driver's errors and host values alone; the
    speculative decoders and the plain loop both serve through it, never a loop of their own."""
    graph = module_imports()
    assert graph["memra_cuda.rounds.serving"] == {"memra_cuda.driver.errors", "memra_cuda.driver.values"}
    servers = {name for name, targets in graph.items() if "memra_cuda.rounds.serving" in targets}
    assert {"memra_cuda.torch.decoder", "memra_cuda.torch.greedy"} <= servers, servers


def test_only_the_torch_subpackage_imports_torch_or_transformers():
    """The core and the testing subpackage import without the optional PyTorch stack: a module
    outside memra_cuda/torch that imported torch (or transformers, tokenizers) anywhere would
    make that import need it."""
    optional = ("torch", "transformers", "tokenizers", "safetensors")
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] == "torch":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{path.relative_to(PACKAGE)} imports {name}" for name in names
                      if name.split(".")[0] in optional]
    assert not found, found


def test_every_torch_graph_is_made_and_captured_by_torch_graph():
    """torch no longer collects before a capture, and a collection inside one destroyed a dropped
    decoder's graph there, which invalidates the capture: every torch.cuda.graph and CUDAGraph of
    the package and of the benchmarks is memra_cuda.torch.adapter.torch_graph's, which holds the
    collector off as memra's own captures do and makes graphs destroyed relaxed."""
    found = []
    for path in [*sorted(PACKAGE.rglob("*.py")), *sorted(BENCHMARKS.rglob("*.py"))]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        allowed = {id(node) for function in ast.walk(tree)
                   if isinstance(function, ast.FunctionDef) and function.name == "torch_graph"
                   and path == PACKAGE / "torch" / "adapter.py" for node in ast.walk(function)}
        found += [f"{path.name}:{node.lineno}" for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and id(node) not in allowed
                  and (node.func.attr == "graph" and ast.unparse(node.func.value).endswith("cuda")
                       or node.func.attr == "CUDAGraph")]
    assert not found, f"a torch graph outside adapter.torch_graph: {found}"


def test_the_torch_side_puts_host_values_on_the_device_without_waiting_for_it():
    """torch.tensor(values, device=...) synchronises the stream after its copy: a request's start
    made six such waits, the GPU idle after each while the host queued the next step. The package's
    torch code uploads through memra_cuda.torch.uploads.uploaded (pinned memory, a non-blocking
    copy) or copies from a CPU tensor with non_blocking=True; Hugging Face's own generate
    (greedy.hf_generate, a reference, not a decoder) is left as its callers write it."""
    found = []
    for path in sorted((PACKAGE / "torch").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        allowed = {id(node) for function in ast.walk(tree)
                   if isinstance(function, ast.FunctionDef) and function.name == "hf_generate"
                   and path.name == "greedy.py" for node in ast.walk(function)}
        found += [f"{path.name}:{node.lineno}" for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and id(node) not in allowed
                  and (node.func.attr == "tensor" and ast.unparse(node.func.value) == "torch"
                       and any(keyword.arg == "device" for keyword in node.keywords)
                       or node.func.attr == "copy_" and bool(node.args)
                       and ast.unparse(node.args[0]).startswith("torch.tensor(")
                       and not any(keyword.arg == "non_blocking" for keyword in node.keywords))]
    assert not found, f"torch.tensor(..., device=...) waits for the stream: uploads.uploaded instead: {found}"

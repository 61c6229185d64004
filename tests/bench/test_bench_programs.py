"""The benchmarks are programs of the checkout, run as packages from its root (`make bench`:
python -m benchmarks.bench): each says what it measures and how it is called, without a GPU, and
every name one imports from the package or another benchmark is there, where this machine can
import the module that holds it."""
from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import benchmarks


@pytest.mark.parametrize("program", ["benchmarks.bench", "benchmarks.ranks", "benchmarks.headline", "benchmarks.soak",
                                     "benchmarks.served", "benchmarks.pair_twice"])
def test_each_benchmark_program_prints_its_whole_description_with_help(program):
    root = Path(benchmarks.__file__).absolute().parents[1]  # where this run found `benchmarks`
    run = subprocess.run([sys.executable, "-m", program, "--help"], cwd=root, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0 and not run.stderr, run.stderr
    assert run.stdout.startswith(f"usage: python -m {program} "), run.stdout
    doc = importlib.import_module(program).__doc__
    assert doc and " ".join(doc.split()) in " ".join(run.stdout.split())


@pytest.mark.parametrize("argv, error", [
    (["--sections", "headline"], "give --only torch with it"),
    (["--only", "torch", "--sections", "headline,bogus"], "not 'headline,bogus'")])
def test_the_torch_sections_are_refused_before_any_gpu_is_asked_for_unless_they_name_sections(argv, error):
    root = Path(benchmarks.__file__).absolute().parents[1]
    run = subprocess.run([sys.executable, "-m", "benchmarks.bench", *argv], cwd=root, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2 and error in run.stderr, run.stderr


OPTIONAL = {"torch", "transformers", "tokenizers", "matplotlib"}  # what a module may need that is not here


def test_every_name_a_benchmark_imports_is_there():
    """Imports inside a section's function run only on a GPU: a name moved to another module would
    fail there first. Each is looked up here, where the module holding it imports (not where it
    needs the optional PyTorch stack and this machine lacks it)."""
    root = Path(benchmarks.__file__).absolute().parent
    missing, looked = [], 0
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            name = importlib.util.resolve_name("." * node.level + (node.module or ""), "benchmarks")
            if name.split(".")[0] not in ("benchmarks", "memra_cuda"):
                continue
            try:
                module = importlib.import_module(name)
                for alias in node.names:
                    if not hasattr(module, alias.name):
                        importlib.import_module(f"{name}.{alias.name}")  # a submodule, or ImportError
                    looked += 1
            except ImportError as exc:
                if (exc.name or "").split(".")[0] not in OPTIONAL:
                    missing.append(f"{path.name}:{node.lineno}: from {name} import "
                                   f"{', '.join(alias.name for alias in node.names)}: {exc}")
    assert looked > 20, "the benchmarks' imports were not found"
    assert not missing, "\n".join(missing)

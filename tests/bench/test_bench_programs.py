"""The benchmarks are programs of the checkout, run as packages from its root (`make bench`:
python -m benchmarks.bench): each says what it measures and how it is called, without a GPU, and
every name one imports from the package or another benchmark is there, where this machine can
import the module that holds it."""
from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import benchmarks

ROOT = Path(benchmarks.__file__).absolute().parents[1]  # where this run found `benchmarks`


def helped(program: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`python -m PROGRAM --help` from the checkout's root."""
    return subprocess.run([sys.executable, "-m", program, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("program", ["benchmarks.bench", "benchmarks.ranks", "benchmarks.headline", "benchmarks.soak",
                                     "benchmarks.served", "benchmarks.pair_twice", "benchmarks.launches"])
def test_each_benchmark_program_prints_its_whole_description_with_help(program):
    run = helped(program)
    assert run.returncode == 0 and not run.stderr, run.stderr
    assert run.stdout.startswith(f"usage: python -m {program} "), run.stdout
    doc = importlib.import_module(program).__doc__
    assert doc and " ".join(doc.split()) in " ".join(run.stdout.split())


@pytest.mark.parametrize("program", ["benchmarks.steps", "benchmarks.tiles", "benchmarks.torch_engine"])
def test_a_pytorch_benchmarks_usage_says_how_it_is_run(program):
    """Their usage named the file ("usage: steps.py"), which runs only as a module of the
    checkout (its relative imports): `python -m PROGRAM`, as the others' usage says."""
    for name in ("torch", "transformers"):
        pytest.importorskip(name, reason="the PyTorch benchmarks need torch, transformers and tokenizers")
    run = helped(program, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith(f"usage: python -m {program} "), run.stdout + run.stderr


@pytest.mark.parametrize("argv, error", [
    (["--sections", "headline"], "give --only torch with it"),
    (["--only", "torch", "--sections", "headline,bogus"], "not 'headline,bogus'")])
def test_the_torch_sections_are_refused_before_any_gpu_is_asked_for_unless_they_name_sections(argv, error):
    run = subprocess.run([sys.executable, "-m", "benchmarks.bench", *argv], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2 and error in run.stderr, run.stderr


def test_ranks_refuses_its_sizes_and_a_missing_launcher_without_a_traceback():
    """bench.py prints a failed rank's stderr: each was a traceback (Geometry's, Ranks.from_env's
    ValueError), and TOKENS < 1 was taken. Its sizes are the parser's errors, before the rank joins
    its peers; no launcher's environment (or no GPU, no NCCL) is one line, exit status 1."""
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE")}
    for argv, status, said in ((["0", "4", "16"], 2, "error: TOKENS must be an int of at least 1, not 0"),
                               (["8", "-1", "16"], 2, "error: K -1 M 16: k must be an int of at least 0, not -1"),
                               (["8", "4", "0"], 2, "error: K 4 M 0: m_rounds must be an int of at least 1, not 0"),
                               (["8", "4", "16"], 1, "benchmarks.ranks: a rank's environment names RANK and WORLD")):
        run = subprocess.run([sys.executable, "-m", "benchmarks.ranks", *argv], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == status and said in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_torch_engine_refuses_a_section_named_twice_before_any_gpu_is_asked_for():
    """It ran twice, a whole section measured again, its first figures dropped from the report.
    Refused by listed, as bench.py's --sections are."""
    run = subprocess.run([sys.executable, "-m", "benchmarks.torch_engine", "trees", "trees"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and ("sections: a comma-separated list of headline, one_request, batches, serving, "
                                    "hybrid, trees, tree_costs, each once, not 'trees,trees'") in run.stderr, run.stderr


@pytest.mark.parametrize("program", ["benchmarks.bench", "benchmarks.headline", "benchmarks.served", "benchmarks.steps",
                                     "benchmarks.soak", "benchmarks.tiles", "benchmarks.launches",
                                     "benchmarks.torch_engine", "benchmarks.pair_twice"])
def test_a_json_path_that_cannot_be_written_is_refused_before_the_run(program, tmp_path):
    """Each opened --json only once its figures were in: a folder, or a file in none, was an
    IsADirectoryError or FileNotFoundError minutes (pair_twice: two trainings) into the run."""
    for path in (tmp_path, tmp_path / "missing" / "figures.json"):
        run = subprocess.run([sys.executable, "-m", program, "--json", str(path)], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
        want = f"--json: a file to write, in a folder that exists, not '{path}'"
        assert run.returncode == 2 and want in run.stderr, run.stderr


@pytest.mark.parametrize("program", ["benchmarks.headline", "benchmarks.served"])
def test_a_pair_that_is_no_trained_pair_is_refused_before_any_gpu_is_asked_for(program, tmp_path):
    """Refused after the GPU check, as the run opened the pair (a traceback from load_pair's FileNotFoundError)."""
    (tmp_path / "file").write_text("x")
    for path in (tmp_path / "missing", tmp_path / "file", tmp_path):
        run = subprocess.run([sys.executable, "-m", program, "--pair", str(path)], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
        assert run.returncode == 2 and f"--pair: {path} is not a trained pair" in run.stderr, run.stderr


def test_a_json_path_to_a_new_or_existing_file_in_a_folder_is_taken(tmp_path):
    from benchmarks.torch_common import writable
    (tmp_path / "old.json").write_text("{}")
    assert writable(str(tmp_path / "new.json")) == str(tmp_path / "new.json")
    assert writable(str(tmp_path / "old.json")) == str(tmp_path / "old.json")


# The PyTorch programs, each with what it needs beside torch (benchmarks/needs.py's TORCH or PAIR)
TORCH_PROGRAMS = [("benchmarks.steps", [], "transformers"), ("benchmarks.soak", [], "transformers"),
                  ("benchmarks.headline", [], "tokenizers"), ("benchmarks.served", [], "tokenizers"),
                  ("benchmarks.bench", ["--only", "torch"], "tokenizers"), ("benchmarks.tiles", [], "triton"),
                  ("benchmarks.launches", [], "transformers"), ("benchmarks.torch_engine", [], "tokenizers")]
# `python -m PROGRAM ARGV...` where torch, transformers and tokenizers are not installed, here or not
WITHOUT_TORCH = ("import runpy, sys; sys.modules.update(dict.fromkeys(('torch', 'transformers', 'tokenizers'))); "
                 "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)")


def one_line_refusal(run: subprocess.CompletedProcess, program: str) -> str:
    """The one line of stderr that `run` of `program` exited 1 with (no traceback): its words after the name."""
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    [line] = run.stderr.splitlines()
    assert line.startswith(f"{program}: "), line
    return line


@pytest.mark.parametrize("program, argv, also", [*TORCH_PROGRAMS, ("benchmarks.pair", [], "tokenizers")])
def test_a_pytorch_benchmark_without_torch_says_so_in_one_line(program, argv, also):
    """Each died with an import's ModuleNotFoundError traceback (pair.py's at its import of tokenizers)."""
    run = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, program, *argv], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    line = one_line_refusal(run, program)
    assert "no module named 'torch'" in line and also in line and "[torch]" in line, line


@pytest.mark.parametrize("program, argv, also", TORCH_PROGRAMS)
def test_a_pytorch_benchmark_without_a_gpu_says_so_in_one_line(program, argv, also):
    """Each died with torch's "Torch not compiled with CUDA enabled" traceback (steps in headline's copy_bandwidth).
    Where what a program needs beside torch is absent (a CPU torch without triton: tiles), it says that
    first, in its one line (test_a_pytorch_benchmark_without_torch_says_so_in_one_line's refusal)."""
    need = "the PyTorch benchmarks need torch, transformers and tokenizers"  # a skip's one line in `make test`
    need += "" if also in ("transformers", "tokenizers") else f"; {program}, {also} too"
    for name in ("torch", "transformers", "tokenizers", also):
        pytest.importorskip(name, reason=need)
    import torch
    if torch.cuda.is_available():
        pytest.skip("torch reaches a GPU here: the programs would measure on it")
    run = subprocess.run([sys.executable, "-m", program, *argv], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert one_line_refusal(run, program).startswith(f"{program}: no GPU to measure on: PyTorch ")


OPTIONAL = {"torch", "transformers", "tokenizers", "matplotlib", "triton"}  # what a module may need that is not here


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

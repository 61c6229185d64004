"""The benchmarks are programs of the checkout, run as packages from its root (`make bench`:
python -m benchmarks.bench): each says what it measures and how it is called, without a GPU."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import benchmarks


@pytest.mark.parametrize("program", ["benchmarks.bench", "benchmarks.ranks", "benchmarks.headline"])
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

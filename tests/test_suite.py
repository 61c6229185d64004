"""The suite's own rules, checked on the CPU: a GPU test that wants the GPU to itself (it reads the
device's free memory, or fills most of its memory) is marked `alone`, so that `make gpu-test
GPU_JOBS=N` runs it after the others and by itself, and a pytest-xdist worker skips it."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# Helpers whose callers want the GPU alone: the device's free memory, and the 20 000-row theorems
# on the real model (tens of GB of probabilities a test).
ALONE_HELPERS = {"free_memory", "assert_first_sampled_token_is_the_targets_softmax",
                 "assert_first_sampled_tree_token_is_the_targets_softmax"}


def _marks(func: ast.FunctionDef) -> set[str]:
    return {ast.unparse(d).removeprefix("pytest.mark.") for d in func.decorator_list}


def _calls(func: ast.FunctionDef) -> set[str]:
    return {node.func.id for node in ast.walk(func) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}


def test_every_test_that_reads_free_memory_or_fills_the_gpu_is_marked_alone():
    found, unmarked = [], []
    for path in sorted(TESTS.rglob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and _calls(node) & ALONE_HELPERS:
                found.append(node.name)
                if "alone" not in _marks(node):
                    unmarked.append(f"{path.relative_to(TESTS)}::{node.name}")
    assert len(found) >= 6, f"the helpers' callers moved: {found}"
    assert not unmarked, f"want the GPU to themselves but are not marked alone: {unmarked}"


def test_a_pytest_xdist_worker_skips_the_tests_marked_alone_with_the_reason():
    env = dict(os.environ, PYTEST_XDIST_WORKER="gw0")
    env.pop("MEMRA_REQUIRE_GPU", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "alone", "-rs",
                          str(TESTS / "driver" / "test_driver_gpu.py")], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 skipped" in run.stdout and "SKIPPED [2]" in run.stdout and "wants the GPU to itself" in run.stdout, \
        run.stdout

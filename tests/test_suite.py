"""The suite's own rules, checked on the CPU: a GPU test that wants the GPU to itself (it reads the
device's free memory, or fills most of its memory) is marked `alone`, so that `make gpu-test
GPU_JOBS=N` runs it after the others and by itself, and a pytest-xdist worker skips it; a test
that leaves a sticky fault ends its pytest-xdist worker, whose tests after it would all fail; a
GPU run (MEMRA_REQUIRE_GPU) on a machine without a GPU ends in a line, before any test."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memra_cuda.driver.errors import driver
from memra_cuda.errors import CudaUnavailable

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


def test_a_worker_ends_after_the_report_of_a_test_that_left_a_sticky_fault_and_not_before():
    """conftest's teardown hook, in a pytest-xdist worker (PYTEST_XDIST_WORKER, as test_a_pytest_
    xdist_worker_skips... sets it: xdist itself starts a fresh worker for the rest): a plain
    failure goes on, the sticky fault's report is written and the process ends (70) before the
    next test; outside a worker the fault is one failure among the others."""
    stand_in = str(TESTS / "sticky_stand_in.py")
    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", stand_in]
    env = dict(os.environ, PYTEST_XDIST_WORKER="gw0")
    worker = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert worker.returncode == 70, worker.stdout + worker.stderr
    assert "test_a_plain_failure_first FAILED" in worker.stdout and "test_then_a_sticky_fault FAILED" in worker.stdout
    assert "test_then_one_the_faulted_context_would_fail" not in worker.stdout, worker.stdout
    assert "test_then_a_sticky_fault left a sticky CUDA fault: ending worker gw0" in worker.stderr
    env.pop("PYTEST_XDIST_WORKER")
    alone = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert alone.returncode == 1 and "2 failed, 1 passed" in alone.stdout, alone.stdout + alone.stderr


def test_a_gpu_run_without_a_gpu_ends_in_a_line_before_any_test():
    """`make gpu-test` on a machine without a GPU failed every GPU test's set-up, each reported in
    full: thousands of lines, the same reason in each. Now the run ends at its start, exit status
    1, the reason said once on each stream."""
    try:
        driver()
    except CudaUnavailable as exc:
        reason = str(exc)
    else:
        pytest.skip("there is a GPU here: the GPU tests run")
    env = dict(os.environ, MEMRA_REQUIRE_GPU="1")
    env.pop("PYTEST_XDIST_WORKER", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider",
                          str(TESTS / "driver" / "test_driver_gpu.py")], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    said = (run.stdout + run.stderr).splitlines()
    assert len(said) <= 2 and all(f"MEMRA_REQUIRE_GPU is set (make gpu-test, sanitize, racecheck), but {reason}"
                                  in line for line in said), said

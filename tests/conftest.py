"""Shared fixtures. GPU tests are marked `gpu` and take the `engine` fixture, which skips them
with the driver's reason where there is no GPU, or fails them under MEMRA_REQUIRE_GPU=1 (set by
`make gpu-test`, so a machine that lost its GPU cannot pass for a green GPU run): where the driver
is missing, the whole run, in one line, before any test.

A test that leaves the device with a sticky fault (a kernel's illegal address, a device-side
assert: sticky_fault) ends its pytest-xdist worker after its report, and xdist starts a fresh
one for the tests still to run: in the worker that went on, every later test failed at its
set-up (stop 72: one fault, 92 failures after it).

Skips are summarised at the end as one line per distinct reason with its count (pyproject's
addopts report failures and errors in full, `-rfE`, not each skip): without a GPU, hundreds of
tests skip for the same reason. `-rs` (or `-ra`) lists them one by one instead."""
from __future__ import annotations

import gc
import os
import sys
import time
from collections import Counter

import pytest

from memra_cuda import Engine
from memra_cuda.driver.errors import STICKY, driver
from memra_cuda.errors import CudaUnavailable

# torch's words for the sticky faults (its own CUDA errors name no CUDA_ERROR_ code)
TORCH_STICKY = ("device-side assert triggered", "an illegal memory access was encountered",
                "unspecified launch failure", "misaligned address", "an illegal instruction was encountered")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under MEMRA_REQUIRE_GPU on a machine without a GPU, the run ends before any test, in one line
    and exit status 1: `make gpu-test` there failed every GPU test's set-up instead, each reported
    in full (-rfE), thousands of lines saying the same (9 000 for tests/driver alone)."""
    if os.environ.get("MEMRA_REQUIRE_GPU"):
        try:
            driver()
        except CudaUnavailable as exc:
            pytest.exit(f"MEMRA_REQUIRE_GPU is set (make gpu-test, sanitize, racecheck), but {exc}", returncode=1)


@pytest.fixture(scope="session")
def engine():
    try:
        eng = Engine()
    except CudaUnavailable as exc:
        if os.environ.get("MEMRA_REQUIRE_GPU"):
            pytest.fail(f"MEMRA_REQUIRE_GPU is set, but {exc}")
        pytest.skip(f"needs a GPU: {exc}")
    yield eng
    eng.close()


def _random_llama(hybrid: bool = False, **kwargs):
    """The small random-weight Llama of memra_cuda.torch.testing (fp32), with `kwargs` (its
    layers HYBRID recurrent where `hybrid`); skipped with the reason where torch or transformers
    is missing (imported only here, so the core suite never needs them)."""
    pytest.importorskip("torch", reason="needs PyTorch (pip install '.[torch]' in the checkout)")
    pytest.importorskip("transformers", reason="memra_cuda.torch.testing needs transformers")
    from memra_cuda.torch.testing import HYBRID, build_model
    return build_model("small", recurrent_layers=HYBRID if hybrid else (), **kwargs)


@pytest.fixture
def conditionals(engine):
    """A test that builds conditional IF or WHILE nodes: skipped, naming what is missing, where
    the driver or the binding has none (CUDA 12.4+)."""
    from memra_cuda.driver.graph import check_loops
    from memra_cuda.errors import LoopUnsupported
    try:
        check_loops()
    except LoopUnsupported as missing:
        pytest.skip(str(missing))


@pytest.fixture
def switches(engine):
    """A test that builds a SWITCH of bodies by width: skipped, naming what is missing, where
    the driver or the binding has no SWITCH nodes (CUDA 12.8+)."""
    from memra_cuda.driver.graph import check_switch
    from memra_cuda.errors import SwitchUnsupported
    try:
        check_switch()
    except SwitchUnsupported as missing:
        pytest.skip(str(missing))


@pytest.fixture(scope="module")
def small(engine):
    """The small random-weight Llama (fp32), built once a module that asks for it."""
    return _random_llama()


@pytest.fixture(scope="module")
def peaked(engine):
    """The small model with a head scaled up, so its sampled law is far from uniform."""
    return _random_llama(logit_scale=8.0)


@pytest.fixture(scope="module")
def hybrid(engine):
    """The small model with layers HYBRID a gated linear recurrence."""
    return _random_llama(hybrid=True)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked `alone` is skipped in a pytest-xdist worker: beside the other workers' tests
    on the same GPU, its measure of free memory or of the host's timing, or its share of memory,
    would fail for their sake, not its own. Run, it has the GPU to itself from this process too:
    what earlier tests left in reference cycles (a RoundStream holds its decoder's methods, and
    the decoder its buffers) is collected, and torch's cache is given back to the driver (on the
    H200 the 17 GB stand-in of test_device_loop_gpu ran out of memory after the 20 000-row
    theorems, run one after another in the `alone` pass)."""
    if not item.get_closest_marker("alone"):
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("wants the GPU to itself: run without -n (make gpu-test GPU_JOBS=N runs it after the others)")
    gc.collect()
    torch = sys.modules.get("torch")  # imported by an earlier test, never here
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def sticky_fault(text: str) -> bool:
    """Whether a failure's text names a fault after which the process's CUDA context is unusable."""
    return any(name in text for name in STICKY) or any(words in text for words in TORCH_STICKY)


FAULTED = pytest.StashKey[bool]()  # a test's setup or call failed on a sticky fault


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Marks a test whose setup or call failed on a sticky fault (sticky_fault), for its teardown."""
    outcome = yield
    report = outcome.get_result()
    if report.when in ("setup", "call") and report.failed and sticky_fault(str(report.longrepr)):
        item.stash[FAULTED] = True


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """In a pytest-xdist worker, after the report of a test that left a sticky fault was sent,
    the worker ends: xdist names the test as the one its worker crashed in and runs the rest in a
    fresh worker, where this one's context would fail every test after it."""
    if item.stash.get(FAULTED, False) and os.environ.get("PYTEST_XDIST_WORKER"):
        capture = item.config.pluginmanager.getplugin("capturemanager")
        if capture is not None:  # the words reach the worker's stderr, not the test's captured output
            capture.suspend_global_capture(in_=False)
        sys.stderr.write(f"{item.nodeid} left a sticky CUDA fault: ending worker "
                         f"{os.environ['PYTEST_XDIST_WORKER']} for a fresh one\n")
        sys.stderr.flush()
        time.sleep(1.0)  # execnet's thread sends the call's report before the process goes
        os._exit(70)


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return " ".join(reason.removeprefix("Skipped: ").split())


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line per distinct skip reason, most frequent first, unless the skips were asked for one
    by one (-rs, -ra)."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped or "s" in terminalreporter.reportchars:
        return
    reasons = Counter(_skip_reason(report) for report in skipped)
    terminalreporter.write_sep("=", f"{len(skipped)} skipped, by reason")
    for reason, count in reasons.most_common():
        terminalreporter.write_line(f"SKIPPED {count}: {reason}")

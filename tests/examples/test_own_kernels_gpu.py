"""examples/own_kernels.py on the GPU, run as the program a user runs: a model of one's own CUDA C,
compiled with compile_ptx and decoded through RoundStream, equals its own greedy decoding, for
several k and M (k = 0 among them: plain autoregressive rounds) and in every host-driven mode; and
compile_ptx's PTX loads as a Module. NVRTC comes from the test extra."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from memra_cuda import Module, compile_ptx
from memra_cuda.errors import NvrtcUnavailable

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
MATCH = "matches its own greedy decoding: yes"


@pytest.fixture(scope="module")
def nvrtc() -> None:
    """Skips where no NVRTC is found at all; one found but refused fails the tests that need it."""
    try:
        compile_ptx('extern "C" __global__ void nothing() {}')
    except NvrtcUnavailable as exc:
        if exc.found is None:
            pytest.skip(f"no NVRTC here: {exc}")
        raise


def own_kernels(*args: str) -> str:
    """The example's output for `args`, after asserting that it ran and found a match."""
    run = subprocess.run([sys.executable, "examples/own_kernels.py", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0 and MATCH in run.stdout, run.stdout + run.stderr
    return run.stdout


@pytest.mark.parametrize(("k", "m_rounds"), [(0, 4), (1, 1), (4, 8), (7, 3)])
def test_own_model_decodes_to_its_greedy_output(engine, nvrtc, k, m_rounds):
    out = own_kernels("--k", str(k), "--m-rounds", str(m_rounds), "--tokens", "96")
    assert out.startswith(f"k={k} M={m_rounds} graph: 96 tokens in "), out


@pytest.mark.parametrize("mode", ["readback", "eager", "overlap"])
def test_own_model_in_the_other_modes(engine, nvrtc, mode):
    out = own_kernels("--k", "3", "--m-rounds", "4", "--tokens", "40", "--mode", mode)
    assert out.startswith(f"k=3 M=4 {mode}: 40 tokens in "), out


def test_a_one_token_prompt_has_nothing_to_prefill(engine, nvrtc):
    out = own_kernels("--k", "2", "--m-rounds", "2", "--tokens", "20", "--prompt", "5")
    assert out.startswith("k=2 M=2 graph: 20 tokens in "), out


def test_the_example_as_it_comes_reports_a_match(engine, nvrtc):
    assert own_kernels().startswith("k=4 M=8 graph: 64 tokens in ")


def test_compiled_ptx_loads_as_a_module_and_runs(engine, nvrtc):
    source = r"""
    #include "step.cuh"
    extern "C" __global__ void add(const unsigned* x, unsigned* y, unsigned n) {
        const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) y[i] = x[i] + STEP;
    }
    """
    ptx = compile_ptx(source, name="add.cu", headers={"step.cuh": "#define STEP 3u\n"})
    module = Module(engine, ptx)
    x = engine.htod(np.arange(1000, dtype=np.uint32))
    y = engine.zeros(np.uint32, 1000)
    module.kernel("add").prepare(["ptr", "ptr", "u32"], grid=4, block=256)(x, y, 1000)
    assert (engine.dtoh(y) == np.arange(1000, dtype=np.uint32) + 3).all()

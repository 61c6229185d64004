"""examples/own_kernels.py on the GPU: a model of one's own CUDA C, compiled with
memra_cuda.compile and decoded through RoundStream, equals its own greedy decoding, for several
k and M (k = 0 among them: plain autoregressive rounds), and compile's PTX loads as a Module.

The example lives in the source checkout, not in the installed package: where examples/ is
absent these tests are skipped with the reason. NVRTC comes from the test extra."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

import memra_cuda
from memra_cuda import Module
from memra_cuda.errors import NvrtcUnavailable

pytestmark = pytest.mark.gpu

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_kernels.py"


@pytest.fixture(scope="module")
def own() -> ModuleType:
    if not EXAMPLE.is_file():
        pytest.skip(f"no {EXAMPLE}: examples/ is in the source checkout, not the installed package")
    spec = importlib.util.spec_from_file_location("own_kernels", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def nvrtc() -> None:
    try:
        memra_cuda.compiler._nvrtc()
    except NvrtcUnavailable as exc:
        if exc.found is None:
            pytest.skip(f"no NVRTC here: {exc}")
        raise


@pytest.mark.parametrize(("k", "m_rounds"), [(0, 4), (1, 1), (4, 8), (7, 3)])
def test_own_model_decodes_to_its_greedy_output(engine, own, nvrtc, k, m_rounds):
    tokens, summary = own.decode(engine, own.PROMPT, 96, k, m_rounds)
    assert tokens == own.greedy(own.PROMPT, 96), summary


@pytest.mark.parametrize("mode", ["readback", "eager", "overlap"])
def test_own_model_in_the_other_modes(engine, own, nvrtc, mode):
    tokens, summary = own.decode(engine, own.PROMPT, 40, 3, 4, mode=mode)
    assert tokens == own.greedy(own.PROMPT, 40), summary


def test_a_one_token_prompt_has_nothing_to_prefill(engine, own, nvrtc):
    tokens, summary = own.decode(engine, [5], 20, 2, 2)
    assert tokens == own.greedy([5], 20), summary


def test_the_example_main_reports_a_match(own, nvrtc, capsys, engine):
    assert own.main() == 0
    assert "matches its own greedy decoding: yes" in capsys.readouterr().out


def test_compiled_ptx_loads_as_a_module_and_runs(engine, nvrtc):
    source = r"""
    #include "step.cuh"
    extern "C" __global__ void add(const unsigned* x, unsigned* y, unsigned n) {
        const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) y[i] = x[i] + STEP;
    }
    """
    ptx = memra_cuda.compile_ptx(source, name="add.cu", headers={"step.cuh": "#define STEP 3u\n"})
    module = Module(engine, ptx)
    x = engine.htod(np.arange(1000, dtype=np.uint32))
    y = engine.zeros(np.uint32, 1000)
    module.kernel("add").prepare(["ptr", "ptr", "u32"], grid=4, block=256)(x, y, 1000)
    assert (engine.dtoh(y) == np.arange(1000, dtype=np.uint32) + 3).all()

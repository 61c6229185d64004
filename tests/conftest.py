"""Shared fixtures. GPU tests are marked `gpu` and take the `engine` fixture, which skips them
with the driver's reason where there is no GPU, or fails them under MEMRA_REQUIRE_GPU=1 (set by
`make gpu-test`, so a machine that lost its GPU cannot pass for a green GPU run)."""
from __future__ import annotations

import os

import pytest

from memra_cuda import CudaUnavailable, Engine


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


@pytest.fixture(scope="session")
def llama():
    """examples/torch_llama.py as a module; skipped with the reason where torch or transformers
    is missing (imported only here, so the core suite never needs them)."""
    pytest.importorskip("torch", reason="needs PyTorch (pip install 'memra_cuda[torch]')")
    pytest.importorskip("transformers", reason="the example needs transformers")
    from memra_cuda.bench_torch import load_example
    return load_example()

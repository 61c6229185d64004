"""memra_cuda.compile: your CUDA C as PTX that CUDA 12 and CUDA 13 drivers load (ISA 8.0,
sm_80), NVRTC's log on a compile error, headers in memory, one error naming the extra where
NVRTC 12.0 is missing, and PTX that ptxas assembles for sm_90. No GPU needed: CI runs these
with the test extra's NVRTC 12.0 (skipped, with the reason, where no NVRTC is installed)."""
from __future__ import annotations

import locale
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import memra_cuda
from memra_cuda.driver import compiler
from memra_cuda.driver.compiler import CompileError, NvrtcUnavailable

KERNEL = r"""
#include "scale.cuh"

extern "C" __global__ void scale(const unsigned* x, unsigned* y, unsigned n) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] * SCALE;
}
"""
HEADERS = {"scale.cuh": "#define SCALE 7919u\n"}


@pytest.fixture(scope="module")
def nvrtc():
    """Skip where no NVRTC is installed; a wrong release is a failure (the test extra pins 12.0)."""
    try:
        compiler._nvrtc()
    except NvrtcUnavailable as exc:
        if exc.found is None:
            pytest.skip(f"no NVRTC here: {exc}")
        raise


@pytest.fixture
def lookup(monkeypatch):
    """A test that fakes the library lookup starts and ends with nothing cached."""
    compiler._nvrtc.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    compiler._nvrtc.cache_clear()


def test_compile_ptx_is_exported_from_the_package():
    assert memra_cuda.compile_ptx is compiler.compile_ptx and "compile_ptx" in memra_cuda.__all__


def test_ptx_is_isa_8_0_for_sm_80(nvrtc):
    ptx = compiler.compile_ptx(KERNEL, name="scale.cu", headers=HEADERS)
    assert re.search(r"^\.version 8\.0$", ptx, re.M), ptx[:400]
    assert re.search(r"^\.target sm_80$", ptx, re.M), ptx[:400]
    assert re.search(r"^\.visible \.entry scale\(", ptx, re.M), "an extern \"C\" kernel keeps its plain name"
    assert compiler.compile_ptx(KERNEL, name="scale.cu", headers=HEADERS) == ptx, "the same inputs, the same PTX"


def test_headers_and_options_reach_the_compiler(nvrtc):
    assert "7919" in compiler.compile_ptx(KERNEL, headers=HEADERS)
    assert "7919" not in compiler.compile_ptx(KERNEL, headers={"scale.cuh": "#define SCALE 104729u\n"})
    with pytest.raises(CompileError, match="scale.cuh") as missing:
        compiler.compile_ptx(KERNEL)  # no header given: NVRTC cannot open it
    assert "scale.cuh" in missing.value.log
    guarded = "#ifndef SCALE\n#define SCALE 3u\n#endif\n"
    assert "104729" in compiler.compile_ptx(KERNEL, headers={"scale.cuh": guarded}, options=["-DSCALE=104729u"])


def test_an_architecture_option_replaces_the_default(nvrtc):
    """NVRTC refuses a flag given twice: an option of yours replaces the default of its flag."""
    ptx = compiler.compile_ptx(KERNEL, headers=HEADERS, options=["--gpu-architecture=compute_90"])
    assert re.search(r"^\.target sm_90$", ptx, re.M) and re.search(r"^\.version 8\.0$", ptx, re.M)
    sm_86 = compiler.compile_ptx(KERNEL, headers=HEADERS, options=["-arch", "compute_86"])
    assert re.search(r"^\.target sm_86$", sm_86, re.M)


def test_a_syntax_error_raises_compile_error_with_the_log(nvrtc):
    source = 'extern "C" __global__ void broken(unsigned* y) { y[0] = 1u }\n'  # no ';'
    with pytest.raises(CompileError) as error:
        compiler.compile_ptx(source, name="broken.cu")
    assert not isinstance(error.value, NvrtcUnavailable)
    log = error.value.log
    assert re.search(r'broken\.cu\(1\): error: expected a ";"', log), log
    assert str(error.value).startswith("broken.cu: nvrtcCompileProgram: NVRTC_ERROR_COMPILATION")
    assert log in str(error.value), "the message carries NVRTC's log"


def test_arguments_are_checked_before_nvrtc_sees_them():
    with pytest.raises(TypeError, match="source"):
        compiler.compile_ptx(KERNEL.encode())
    with pytest.raises(TypeError, match="sequence of options"):
        compiler.compile_ptx(KERNEL, options="-DSCALE=3u")
    with pytest.raises(ValueError, match="NUL"):
        compiler.compile_ptx(KERNEL, headers={"scale.cuh": "#define SCALE 3u\0"})


def _one_error(exc: NvrtcUnavailable) -> str:
    message = str(exc)
    assert isinstance(exc, CompileError) and len(message.splitlines()) == 1, message
    assert "pip install 'memra_cuda[nvrtc]'" in message and "12.0" in message, message
    return message


def test_no_library_is_one_error_naming_the_extra(lookup):
    lookup.setattr(compiler, "_find_library", lambda: None)
    with pytest.raises(NvrtcUnavailable) as missing:
        compiler.compile_ptx(KERNEL, headers=HEADERS)
    assert "libnvrtc.so.12 not found" in _one_error(missing.value) and missing.value.found is None


def test_a_library_that_is_not_nvrtc_is_the_same_error(lookup, tmp_path):
    fake = tmp_path / "libnvrtc.so.12"
    fake.write_bytes(b"not a shared object")
    lookup.setattr(compiler, "_find_library", lambda: fake)
    with pytest.raises(NvrtcUnavailable) as broken:
        compiler.compile_ptx(KERNEL)
    assert str(fake) in _one_error(broken.value)


def test_another_nvrtc_release_is_the_same_error(lookup):
    """NVRTC 12.4 writes ISA 8.4, which a CUDA 12.0 driver refuses: only 12.0 is taken."""
    lookup.setattr(compiler, "_find_library", lambda: Path("/opt/cuda/lib/libnvrtc.so.12"))
    lookup.setattr(compiler, "_load", lambda path: object())
    lookup.setattr(compiler, "_version", lambda lib: (12, 4))
    with pytest.raises(NvrtcUnavailable) as wrong:
        compiler.compile_ptx(KERNEL)
    assert "found NVRTC 12.4" in _one_error(wrong.value) and wrong.value.found == "12.4"


def test_importing_the_package_loads_no_nvrtc():
    """The library is found and loaded on the first compile, not at import."""
    code = ("import sys, memra_cuda, memra_cuda.driver.compiler as c; "
            "assert c._nvrtc.cache_info().currsize == 0; "
            "assert not [m for m in sys.modules if m.startswith('nvidia')], sorted(sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas is not on PATH")
def test_ptxas_assembles_the_output_for_sm_90(nvrtc, tmp_path):
    image = tmp_path / "scale.ptx"
    image.write_text(compiler.compile_ptx(KERNEL, name="scale.cu", headers=HEADERS))
    run = subprocess.run(["ptxas", "-arch=sm_90", str(image), "-o", str(tmp_path / "scale.cubin")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_compiling_leaves_the_threads_locale_as_it_was(nvrtc):
    """NVRTC 12.0 leaves the thread on a "C" locale of its own: after it, every file opened
    without an encoding was read as ASCII (tests/test_layering.py failed on UTF-8 sources)."""
    before = locale.getpreferredencoding(False)
    compiler.compile_ptx(KERNEL, headers=HEADERS)
    with pytest.raises(CompileError):
        compiler.compile_ptx("this is not CUDA C")
    assert locale.getpreferredencoding(False) == before

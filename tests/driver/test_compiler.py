"""compile_ptx: your CUDA C as PTX for sm_80 that the driver loads (NVRTC 12.0's ISA 8.0, which
CUDA 12 and 13 drivers load, where it is installed; else the ISA of an NVRTC no newer than the
driver), NVRTC's log on a compile error, headers in memory, one error naming the extra where no
NVRTC will do, and PTX that ptxas assembles for sm_90. Which NVRTC is taken is tested on the CPU
with made-up releases and drivers; the rest compiles for real with the NVRTC installed (CI: the
test extra's 12.0; skipped, with the reason, where there is none), and the GPU test loads and
runs what it wrote."""
from __future__ import annotations

import locale
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import memra_cuda
from memra_cuda.driver import Module, Signature, compiler
from memra_cuda.driver.compiler import CompileError, Nvrtc, NvrtcUnavailable

KERNEL = r"""
#include "scale.cuh"

extern "C" __global__ void scale(const unsigned* x, unsigned* y, unsigned n) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] * SCALE;
}
"""
HEADERS = {"scale.cuh": "#define SCALE 7919u\n"}


def _installed(portable: bool = False) -> Nvrtc:
    """The NVRTC compile_ptx takes here; skip where none is installed, fail where one is found and
    refused (the test extra pins 12.0, which is never refused)."""
    try:
        return compiler.nvrtc(portable)
    except NvrtcUnavailable as exc:
        if exc.found is None:
            pytest.skip(f"no NVRTC here: {exc}")
        raise


@pytest.fixture(scope="module")
def nvrtc() -> Nvrtc:
    return _installed()


@pytest.fixture(scope="module")
def portable() -> Nvrtc:
    """NVRTC 12.0, the only one ptx/build.py takes (skipped where there is no libnvrtc.so.12)."""
    return _installed(portable=True)


@pytest.fixture
def lookup(monkeypatch):
    """A test that fakes the library lookup starts and ends with nothing cached."""
    compiler.nvrtc.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    compiler.nvrtc.cache_clear()


def isa_of(ptx: str) -> tuple[int, int]:
    isa = compiler.ptx_isa(ptx)
    assert isa != "unknown", ptx[:400]
    major, minor = isa.split(".")
    return int(major), int(minor)


def test_compile_ptx_is_exported_from_the_package():
    assert memra_cuda.compile_ptx is compiler.compile_ptx and "compile_ptx" in memra_cuda.__all__


def test_ptx_is_for_sm_80_in_the_isa_of_the_nvrtc_taken(nvrtc, caplog):
    """ISA 8.x from NVRTC 12.x, 9.x from 13.x (8.0 from 12.0 exactly), and the log says which."""
    with caplog.at_level(logging.INFO, logger=compiler.__name__):
        ptx = compiler.compile_ptx(KERNEL, name="scale.cu", headers=HEADERS)
    isa = isa_of(ptx)
    assert isa[0] == nvrtc.version[0] - 4 and (isa == (8, 0) or nvrtc.version != (12, 0)), (isa, nvrtc)
    assert re.search(r"^\.target sm_80$", ptx, re.M), ptx[:400]
    assert re.search(r"^\.visible \.entry scale\(", ptx, re.M), "an extern \"C\" kernel keeps its plain name"
    assert compiler.compile_ptx(KERNEL, name="scale.cu", headers=HEADERS) == ptx, "the same inputs, the same PTX"
    assert f"scale.cu: PTX ISA {isa[0]}.{isa[1]} by NVRTC {nvrtc.release} at {nvrtc.path}" in caplog.text


def test_portable_ptx_is_isa_8_0_from_nvrtc_12_0(portable):
    """What ptx/build.py writes the committed PTX with: NVRTC 12.0, ISA 8.0, whatever else is here."""
    assert portable.version == (12, 0)
    assert isa_of(compiler.compile_ptx(KERNEL, headers=HEADERS, portable=True)) == (8, 0)


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
    assert re.search(r"^\.target sm_90$", ptx, re.M)
    assert isa_of(ptx) == isa_of(compiler.compile_ptx(KERNEL, headers=HEADERS)), "the same NVRTC, the same ISA"
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


@pytest.mark.parametrize("options", [iter(["-DSCALE=104729u"]), (o for o in ["-DSCALE=104729u"]),
                                     {"-DSCALE=104729u"}, {"-DSCALE=104729u": 1}],
                         ids=["iterator", "generator", "set", "mapping"])
def test_options_are_a_list_not_an_iterator_used_up_looking_for_the_defaults_flags(options):
    """An iterator of options was used up by the search for the flags they replace, so none of them
    reached NVRTC: -DSCALE=104729u was dropped and the header's default compiled, silently. A set's
    order is its hashes' and a mapping's items its keys: options are a list or a tuple (as_listed),
    a TypeError naming them, before any NVRTC is looked for."""
    with pytest.raises(TypeError, match="^options must be a list, a tuple or a 1-D array of NVRTC options"):
        compiler.compile_ptx(KERNEL, headers=HEADERS, options=options)


@pytest.mark.parametrize("portable", ["False", "True", 0, None, [True]])
def test_portable_is_true_or_false_not_read_by_its_truth(portable):
    """portable="False" (a command line's word, a config's) was read by its truth: NVRTC 12.0 or
    nothing, where any NVRTC the driver loads was asked for; a list met functools.cache's
    "unhashable type". A TypeError naming portable, before any NVRTC is looked for."""
    with pytest.raises(TypeError, match="^portable must be True or False"):
        compiler.compile_ptx(KERNEL, headers=HEADERS, portable=portable)


@pytest.mark.parametrize("headers", [["scale.cuh"], [("scale.cuh", "#define SCALE 3u\n")], "scale.cuh"],
                         ids=["names", "pairs", "name"])
def test_headers_are_a_mapping_of_names_to_texts(headers):
    """headers went through dict(): a list of names met "dictionary update sequence element #0 has
    length 9", naming nothing, and a list of (name, text) pairs was taken, silently. A Mapping it
    is (None for none, as before): a TypeError naming headers, before any NVRTC is looked for."""
    with pytest.raises(TypeError, match="^headers must map the names the source #includes to their text"):
        compiler.compile_ptx(KERNEL, headers=headers)


def _one_error(exc: NvrtcUnavailable) -> str:
    message = str(exc)
    assert isinstance(exc, CompileError) and len(message.splitlines()) == 1, message
    assert "pip install 'nvidia-cuda-nvrtc-cu12==12.0.140' (memra_cuda's nvrtc extra)" in message, message
    return message


def fake(lookup, releases: list[str], driver: tuple[int, int] | None) -> None:
    """NVRTCs of `releases` where the lookup looks (none loaded: nothing is compiled), and a driver
    of CUDA `driver` (None: no driver on this machine)."""
    paths = {Path(f"/nvidia/r{release}/lib/libnvrtc.so.{release.split('.')[0]}"): release for release in releases}
    lookup.setattr(compiler, "_find_libraries", lambda portable=False: [
        path for path in paths if not portable or path.name == "libnvrtc.so.12"])
    lookup.setattr(compiler, "_open", lambda path: Nvrtc(tuple(map(int, paths[path].split("."))), path, None))
    lookup.setattr(compiler, "_driver_version", lambda: driver)


@pytest.mark.parametrize(("releases", "driver", "taken"), [
    (["13.0", "12.0"], (13, 0), "12.0"),  # 12.0's PTX every driver loads, wherever it is installed
    (["12.0", "13.0"], (12, 2), "12.0"),
    (["13.0"], (13, 0), "13.0"),  # the H200's torch image: NVRTC 13.0 alone beside a CUDA 13 driver
    (["13.0"], (13, 2), "13.0"),
    (["13.2", "12.4"], (13, 0), "12.4"),  # the oldest that suits: its PTX the most drivers load
    (["12.4", "13.0"], (12, 8), "12.4"),
    (["13.0"], None, "13.0"),  # no driver to ask (a machine without a GPU): the one found
    (["12.8", "13.1"], None, "12.8"),
])
def test_the_nvrtc_taken(lookup, releases, driver, taken):
    fake(lookup, releases, driver)
    assert compiler.nvrtc().release == taken


@pytest.mark.parametrize(("releases", "driver"), [(["13.0"], (12, 8)), (["12.4", "13.0"], (12, 2)),
                                                  (["13.1"], (13, 0))])
def test_an_nvrtc_newer_than_the_driver_is_refused_naming_both(lookup, releases, driver):
    """Its PTX is of an ISA the driver refuses: refused at compile, not at Module's load."""
    fake(lookup, releases, driver)
    with pytest.raises(NvrtcUnavailable) as newer:
        compiler.compile_ptx(KERNEL)
    message = _one_error(newer.value)
    assert f"newer than this driver's CUDA {driver[0]}.{driver[1]}" in message
    assert all(f"NVRTC {release} at /nvidia/r{release}/lib" in message for release in releases), message
    assert newer.value.found == ", ".join(sorted(releases))


def test_portable_takes_nvrtc_12_0_alone(lookup):
    """NVRTC 12.4 writes ISA 8.4, which a CUDA 12.0 driver refuses: ptx/build.py takes only 12.0,
    driver or none, and looks at no NVRTC 13."""
    fake(lookup, ["12.4", "13.0"], (13, 0))
    assert compiler.nvrtc().release == "12.4"
    with pytest.raises(NvrtcUnavailable) as wrong:
        compiler.compile_ptx(KERNEL, portable=True)
    assert "found NVRTC 12.4 at" in _one_error(wrong.value) and wrong.value.found == "12.4"
    fake(lookup, ["13.0"], (13, 0))
    with pytest.raises(NvrtcUnavailable) as none:
        compiler.compile_ptx(KERNEL, portable=True)
    assert "no libnvrtc.so.12 found" in _one_error(none.value) and none.value.found is None


def test_the_lookup_finds_the_cuda_12_and_13_wheels_libraries(monkeypatch, tmp_path):
    """nvidia-cuda-nvrtc-cu12 installs nvidia/cuda_nvrtc/lib/libnvrtc.so.12, the CUDA 13 wheels
    nvidia/cu13/lib/libnvrtc.so.13 (beside its builtins and an .alt copy, which are not NVRTC's
    entry point)."""
    site = tmp_path / "site"
    for name in ("cuda_nvrtc/lib/libnvrtc.so.12", "cuda_nvrtc/lib/libnvrtc-builtins.so.12.0",
                 "cu13/lib/libnvrtc.so.13", "cu13/lib/libnvrtc.alt.so.13", "cu13/lib/libnvrtc-builtins.so.13.0",
                 "cu13/lib/libnvrtc.so.13.0.48"):
        (site / "nvidia" / name).parent.mkdir(parents=True, exist_ok=True)
        (site / "nvidia" / name).write_bytes(b"")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "elsewhere"), str(site), str(site)])
    wheels = [site / "nvidia/cu13/lib/libnvrtc.so.13", site / "nvidia/cuda_nvrtc/lib/libnvrtc.so.12"]
    assert compiler._find_libraries() == [path.resolve() for path in wheels]
    assert compiler._find_libraries(portable=True) == [wheels[1].resolve()]


def test_no_library_is_one_error_naming_the_extra(lookup):
    lookup.setattr(compiler, "_find_libraries", lambda portable=False: [])
    with pytest.raises(NvrtcUnavailable) as missing:
        compiler.compile_ptx(KERNEL, headers=HEADERS)
    assert "no libnvrtc.so.<major> found" in _one_error(missing.value) and missing.value.found is None


def test_a_library_that_is_not_nvrtc_is_the_same_error(lookup, tmp_path):
    fake = tmp_path / "libnvrtc.so.12"
    fake.write_bytes(b"not a shared object")
    lookup.setattr(compiler, "_find_libraries", lambda portable=False: [fake])
    with pytest.raises(NvrtcUnavailable) as broken:
        compiler.compile_ptx(KERNEL)
    assert str(fake) in _one_error(broken.value) and broken.value.found is None


def test_a_library_that_does_not_load_leaves_the_others(lookup):
    fake(lookup, ["12.0", "13.0"], (13, 0))
    opened = compiler._open

    def broken_12(path: Path) -> Nvrtc:
        if path.name == "libnvrtc.so.12":
            raise OSError(f"{path} does not load as NVRTC")
        return opened(path)

    lookup.setattr(compiler, "_open", broken_12)
    assert compiler.nvrtc().release == "13.0"


def test_ptx_isa_reads_the_version_directive():
    assert compiler.ptx_isa("//\n.version 9.0\n.target sm_80\n") == "9.0"
    assert compiler.ptx_isa(".target sm_80\n") == "unknown"


def test_importing_the_package_loads_no_nvrtc():
    """The library is found and loaded on the first compile, not at import."""
    code = ("import sys, memra_cuda, memra_cuda.driver.compiler as c; "
            "assert c.nvrtc.cache_info().currsize == 0; "
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


@pytest.mark.gpu
def test_the_ptx_loads_on_this_driver_and_runs_with_its_signature_checked(engine, nvrtc):
    """What compile_ptx writes with the NVRTC it takes here, this driver loads and runs (on a
    machine with NVRTC 13 alone and a CUDA 13 driver as much as with 12.0); a module of your own
    given its kernels' signatures refuses a type swap at prepare, naming the parameter."""
    ptx = compiler.compile_ptx(KERNEL, name="scale.cu", headers=HEADERS)
    module = Module(engine, ptx, signatures={"scale": Signature.of(x="ptr", y="ptr", n="u32")})
    x = engine.htod(np.arange(1000, dtype=np.uint32))
    y = engine.zeros(np.uint32, 1000)
    module.kernel("scale").prepare(grid=4, block=256).set(x=x, y=y, n=1000)()
    assert (engine.dtoh(y) == np.arange(1000, dtype=np.uint32) * np.uint32(7919)).all()
    with pytest.raises(TypeError, match="scale: parameter 'n' is u32, not f32"):
        module.kernel("scale").prepare(["ptr", "ptr", "f32"], grid=4, block=256)


def test_bindings_newer_than_the_driver_are_refused_where_nvrtc_is_chosen(monkeypatch):
    """No driver: any NVRTC will do (None). Bindings the driver cannot serve (refused as the
    driver loads, errors.bindings_refusal): the refusal, not a choice made as if no driver were
    there, which took an NVRTC newer than that driver loads."""
    from memra_cuda.driver import compiler
    from memra_cuda.errors import CudaUnavailable

    def refused(call: str):
        def version():
            raise CudaUnavailable("refused", call=call)
        return version
    monkeypatch.setattr(compiler, "driver_version", refused("cuInit"))
    assert compiler._driver_version() is None
    monkeypatch.setattr(compiler, "driver_version", refused("cuDriverGetVersion"))
    with pytest.raises(CudaUnavailable, match="refused") as raised:
        compiler._driver_version()
    assert raised.value.call == "cuDriverGetVersion"

"""The committed PTX: rebuilt from its sources on every run, loadable by CUDA 12 drivers
(ISA <= 8.0, sm_80), and assembled by ptxas without local-memory spills; and the constants the
sources share with Python (buffer layouts, block sizes, draw purposes) equal on both sides."""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from memra_cuda.driver.compiler import NvrtcUnavailable

PTX_DIR = Path(__file__).resolve().parents[2] / "ptx"
SOURCES = sorted(PTX_DIR.glob("*.cu"))
IMAGES = sorted(PTX_DIR.glob("*.ptx"))


def _build_script():
    spec = importlib.util.spec_from_file_location("ptx_build", PTX_DIR / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_source_has_committed_ptx_and_back():
    assert [p.stem for p in SOURCES] == [p.stem for p in IMAGES]
    assert {"spec_stream", "toy_lm", "probe"} <= {p.stem for p in SOURCES}


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_committed_ptx_is_what_its_source_builds(source):
    build = _build_script()
    try:
        fresh = build.compile_cu(source)
    except NvrtcUnavailable as exc:
        if exc.found is None:  # no NVRTC here; another release of it is a failure
            pytest.skip(f"cannot rebuild PTX here: {exc}")
        raise
    assert source.with_suffix(".ptx").read_text() == fresh, f"run `make ptx`: {source.name} changed"


@pytest.mark.parametrize("image", IMAGES, ids=lambda p: p.name)
def test_ptx_loads_on_cuda12_drivers(image):
    text = image.read_text()
    version = re.search(r"^\.version (\d+)\.(\d+)$", text, re.M)
    assert version and (int(version[1]), int(version[2])) <= (8, 0), f"{image.name}: PTX ISA above 8.0"
    assert re.search(r"^\.target sm_80$", text, re.M), f"{image.name}: not .target sm_80"


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas is not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("image", IMAGES, ids=lambda p: p.name)
def test_ptxas_assembles_without_spills(image, arch):
    run = subprocess.run(["ptxas", f"-arch={arch}", "-v", str(image), "-o", "/dev/null"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    usage = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", run.stderr)
    kernels = re.findall(r"Compiling entry function '(\w+)'", run.stderr)
    assert usage and len(usage) == len(kernels), run.stderr
    assert all(row == ("0", "0", "0") for row in usage), f"{image.name} on {arch}: local memory used\n{run.stderr}"


def defines(source: str, *names: str) -> dict[str, int]:
    """The integer #defines of `source` named `names` (every one, where no names are given)."""
    text = (PTX_DIR / source).read_text()
    pattern = "|".join(names) or r"\w+"
    return {name: int(value) for name, value in re.findall(rf"^#define ({pattern}) (\d+)", text, re.M)}


def test_launchers_use_the_block_sizes_the_kernels_were_written_for():
    """Block reductions and launch bounds assume blockDim.x is the source's block size (the
    length chooser's shared sums are sized by it), and a sampling block covers THREADS *
    PER_THREAD entries per pass: the launchers must agree."""
    from memra_cuda.kernels import sampling
    from memra_cuda.testing.toy import lm as toy

    assert defines("spec_sample.cu", "THREADS", "PER_THREAD") == {"THREADS": sampling.THREADS,
                                                                  "PER_THREAD": sampling.PER_THREAD}
    assert defines("toy_lm.cu", "BLOCK", "SAMPLE_BLOCK") == {"BLOCK": toy.BLOCK, "SAMPLE_BLOCK": toy.SAMPLE_BLOCK}
    from memra_cuda.kernels import spec
    assert defines("spec_stream.cu", "CHOOSE_THREADS") == {"CHOOSE_THREADS": spec.CHOOSE_THREADS}
    from memra_cuda.kernels import tree as tk
    assert defines("spec_tree.cu", "TREE_THREADS", "JUDGED_WORDS", "PASS_PER_THREAD") == {  # MAX_TREE_OFFERS: layout
        "TREE_THREADS": tk.THREADS, "JUDGED_WORDS": tk.JUDGED_WORDS,
        "PASS_PER_THREAD": tk.PASS_PER_THREAD}


def test_buffer_layouts_have_one_value_in_python_and_cuda():
    """memra_cuda.buffers.layout and ptx/layout.cuh name the same words of ctl, brk, acc and ring rows with
    the same values: StreamBufs and the reference index the rows the kernels write."""
    from memra_cuda.buffers import layout

    assert defines("layout.cuh") == {name: value for name, value in vars(layout).items() if name.isupper()}


def test_the_reference_draws_and_settles_with_the_kernels_constants():
    """Philox's purpose words (philox.cuh) and the bonus of a row without mass (spec_sample.cu)."""
    from memra_cuda.testing import reference as ref

    purposes = re.findall(r"\b(PURPOSE_\w+) = (\d+)", (PTX_DIR / "philox.cuh").read_text())
    assert {name: int(value) for name, value in purposes} == {
        name: getattr(ref, name) for name in ("PURPOSE_ACCEPT", "PURPOSE_SAMPLE", "PURPOSE_DRAFT")}
    assert defines("spec_sample.cu", "NO_MASS_TOKEN") == {"NO_MASS_TOKEN": ref.NO_MASS_TOKEN}
    assert defines("spec_tree.cu", "NO_MASS_TOKEN") == {"NO_MASS_TOKEN": ref.NO_MASS_TOKEN}

"""The installed package is whole: `make test` installs the wheel into a virtualenv outside the
tree and runs the suite from outside it, and these tests check that what it imports is that
installed copy, with every subpackage, the committed PTX and the demo script, and without what
stays in the repository (ptx/build.py, the CUDA sources).

Run from the tree (`make gpu-test`, PYTHONPATH=.) they are skipped: there is no installed
package to check. Under MEMRA_TEST_INSTALLED=1 (set by `make test`) a package imported from the
tree is a failure, not a skip.
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import memra_cuda

REPO = Path(__file__).resolve().parents[1]
PACKAGE = Path(memra_cuda.__file__).resolve().parent
INSTALLED_RUN = bool(os.environ.get("MEMRA_TEST_INSTALLED"))
FROM_TREE = PACKAGE.is_relative_to(REPO)

if FROM_TREE and not INSTALLED_RUN:
    pytest.skip(f"memra_cuda is imported from the source tree ({PACKAGE}): the packaging checks need the "
                "installed wheel (`make test`)", allow_module_level=True)


def test_memra_cuda_is_the_installed_package_not_the_tree():
    assert not FROM_TREE, (f"memra_cuda was imported from the source tree ({PACKAGE}), not from the installed "
                           f"wheel: run pytest from outside the repository with the wheel installed")


def _modules(package: Path) -> set[str]:
    return {str(path.relative_to(package)) for path in package.rglob("*.py")}


def test_every_module_of_the_tree_is_installed():
    """A module left out of the wheel (as memra_cuda.driver once was) fails here by name."""
    missing = sorted(_modules(REPO / "memra_cuda") - _modules(PACKAGE))
    assert not missing, f"in the tree's memra_cuda/ but not in the installed package {PACKAGE}: {missing}"


@pytest.mark.parametrize("name", ["memra_cuda.driver", "memra_cuda.driver.module", "memra_cuda.buffers",
                                  "memra_cuda.kernels", "memra_cuda.rounds", "memra_cuda.testing.toy",
                                  "memra_cuda.errors", "memra_cuda.__main__"])
def test_subpackages_import_from_the_installed_package(name):
    module = importlib.import_module(name)
    assert Path(module.__file__).resolve().is_relative_to(PACKAGE), module.__file__


def test_packaged_ptx_is_the_committed_ptx_from_the_installed_package():
    from memra_cuda.driver.module import packaged_ptx

    committed = sorted(path.stem for path in (REPO / "ptx").glob("*.ptx"))
    assert {"spec_stream", "spec_sample", "device_loop", "toy_lm", "probe"} <= set(committed)
    installed = sorted(path.stem for path in (PACKAGE / "ptx").glob("*.ptx"))
    assert installed == committed, f"{PACKAGE / 'ptx'} holds {installed}, ptx/ holds {committed}"
    for name in committed:
        assert packaged_ptx(name) == (PACKAGE / "ptx" / f"{name}.ptx").read_text() \
            == (REPO / "ptx" / f"{name}.ptx").read_text(), name


def test_the_docs_the_docstrings_cite_are_shipped():
    """A user of the wheel has the contract too: docs/*.md, as memra_cuda/docs."""
    committed = sorted(path.name for path in (REPO / "docs").glob("*.md"))
    installed = sorted(path.name for path in (PACKAGE / "docs").glob("*.md"))
    assert committed and installed == committed


def test_only_the_ptx_is_shipped_from_ptx():
    """ptx/build.py and the CUDA sources stay in the repository; the wheel has only the PTX."""
    shipped = sorted(path.name for path in (PACKAGE / "ptx").iterdir() if path.name != "__pycache__")
    assert shipped and all(name.endswith(".ptx") for name in shipped), shipped
    assert not (PACKAGE.parent / "ptx").exists(), "a top-level ptx/ was installed beside the package"


def _demo_script() -> Path:
    script = Path(sys.executable).parent / ("memra-cuda-demo.exe" if os.name == "nt" else "memra-cuda-demo")
    assert script.is_file(), f"the memra-cuda-demo script is not installed beside {sys.executable}"
    return script


def test_the_demo_script_names_itself_in_its_usage():
    """memra-cuda-demo --help said `usage: python -m memra_cuda`, another command than the one typed."""
    run = subprocess.run([str(_demo_script()), "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("usage: memra-cuda-demo "), run.stdout + run.stderr


def test_demo_without_a_gpu_says_so_in_one_line():
    from memra_cuda.driver.errors import CudaUnavailable, driver

    script = _demo_script()
    try:
        driver()
    except CudaUnavailable:
        pass
    else:
        pytest.skip("there is a GPU here: the demo runs on it (`make demo`)")
    run = subprocess.run([str(script)], capture_output=True, text=True, timeout=120)
    lines = (run.stdout + run.stderr).splitlines()
    assert run.returncode == 1, lines  # as the examples' and benchmarks' (2 is a refused option's)
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert "NVIDIA" in lines[0] or "GPU" in lines[0] or "cuda-python" in lines[0], lines


def test_the_wheel_is_the_library_alone():
    """No benchmark, example or test module in the installed package (issue 39): they are
    programs of the repository."""
    strays = sorted(name for name in _modules(PACKAGE) if "bench" in name or "example" in name or "test_" in name)
    assert not strays, f"not the library: {strays}"
    assert not (PACKAGE.parent / "benchmarks").exists(), "a top-level benchmarks/ was installed beside the package"


def test_metadata_says_what_a_user_trusts():
    """One version (memra_cuda.__version__, which the wheel's metadata reads), the Apache-2.0
    licence as a PEP 639 expression with its text, the py.typed marker, and the CUDA bindings
    bounded above."""
    from importlib.metadata import distribution

    dist = distribution("memra_cuda")
    meta = dist.metadata
    assert dist.version == memra_cuda.__version__, (dist.version, memra_cuda.__version__)
    assert meta["License-Expression"] == "Apache-2.0", meta["License-Expression"]
    licence = [f for f in dist.files if f.name == "LICENSE"]
    assert licence and "Apache License" in licence[0].read_text()
    assert licence[0].read_text() == (REPO / "LICENSE").read_text()
    assert (PACKAGE / "py.typed").is_file()
    assert "Typing :: Typed" in meta.get_all("Classifier")
    requires = meta.get_all("Requires-Dist")
    assert any(r.startswith("cuda-python") and "<14" in r for r in requires), requires
    assert {"nvrtc", "test", "torch"} <= set(meta.get_all("Provides-Extra"))

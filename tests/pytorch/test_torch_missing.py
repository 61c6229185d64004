"""memra_cuda.torch where torch is missing, on the CPU (with or without torch here: a subprocess
blocks it): the import says how to install the extra (from the checkout: memra_cuda is on no
index) and is still a ModuleNotFoundError naming torch, which callers that tolerate a missing
extra read (tests/driver/test_errors.py)."""
from __future__ import annotations

import subprocess
import sys

# sys.modules["torch"] = None: `import torch` raises ModuleNotFoundError(name="torch"), as where it
# is not installed, whether or not it is installed here.
WITHOUT_TORCH = """
import sys
sys.modules["torch"] = None
try:
    import memra_cuda.torch
except ModuleNotFoundError as exc:
    print(exc.name)
    print(exc)
else:
    print("imported")
"""


def test_importing_memra_cuda_torch_without_torch_says_to_install_the_extra():
    run = subprocess.run([sys.executable, "-c", WITHOUT_TORCH], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    name, message = run.stdout.splitlines()
    assert name == "torch", run.stdout
    assert message.startswith("memra_cuda.torch needs PyTorch ('torch' is not installed)"), message
    assert message.endswith("in memra_cuda's checkout, install the torch extra: pip install '.[torch]'"), message

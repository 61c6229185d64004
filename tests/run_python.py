"""A Python script run in a fresh interpreter, for the GPU tests of what a test process cannot
survive or observe in itself: interpreter exit, a fault that loses the context, a process abort."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout, ahead of PYTHONPATH: this tree's memra_cuda


def run_script(script: str, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -c script argv...` with the checkout first on its path; its output captured as text."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": path})

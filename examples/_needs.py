"""What the PyTorch examples need, said in one line where it is missing, as `make demo` and
examples/own_kernels.py say a missing GPU or NVRTC: PyTorch and transformers (the `torch` extra),
checked as this module is imported (--help then gives the example's description and what to
install), and a CUDA device torch reaches (gpu()).

An example imports this module before torch: its own `import torch` would fail first, with a
traceback that names neither the extra nor how to install it; and a model built on a CPU-only
torch fails with an assertion deep in transformers.
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import NoReturn

try:
    import torch
    import transformers  # noqa: F401
except ModuleNotFoundError as exc:
    missing: ModuleNotFoundError | None = exc
else:
    missing = None

CHECKOUT = Path(__file__).resolve().parents[1]  # the examples' repository, whose torch extra installs them


def refuse(what: str) -> NoReturn:
    """Exit with status 1 after `what`, in one line on stderr after the program's name: no traceback."""
    print(f"{Path(sys.argv[0]).stem}: {' '.join(what.split())}", file=sys.stderr)
    raise SystemExit(1)


def gpu() -> None:
    """Exit with one line where torch reaches no CUDA device: a build of torch without CUDA, or a
    machine without an NVIDIA GPU (or its driver). Called once the command line is read, so that
    --help and the options' errors need no GPU."""
    if torch.version.cuda is None:
        refuse(f"PyTorch {torch.__version__} is built without CUDA, and the example runs on an NVIDIA GPU: install "
               "a CUDA build of torch (PyPI's torch for Linux x86_64 is one)")
    if not torch.cuda.is_available():
        refuse("PyTorch finds no CUDA device: the example runs on an NVIDIA GPU, with its driver")


def described(install: str) -> NoReturn:
    """--help where torch is missing: the example's description (its docstring, which gives its
    usage) and what its --help needs, exit status 0 as argparse's --help. The parser is made of
    memra_cuda.torch's sizes and modes, so it cannot list the options without torch."""
    print((getattr(sys.modules.get("__main__"), "__doc__", None) or "").strip())
    print(f"\n--help lists the options once the torch extra (PyTorch and transformers) is installed: {install}")
    raise SystemExit(0)


if missing is not None:
    install = f"pip install {shlex.quote(f'{CHECKOUT}[torch]')}"
    if {"-h", "--help"} & set(sys.argv[1:]):  # what the example does, read before installing what it needs
        described(install)
    refuse(f"no module named {missing.name!r}: the PyTorch examples need the torch extra (PyTorch and "
           f"transformers): {install}")

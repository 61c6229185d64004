"""What the PyTorch benchmarks need, said in one line where it is missing, as `python -m
benchmarks.bench` says a missing GPU and examples/_needs.py what the examples lack: PyTorch and
transformers (the `torch` extra, which brings tokenizers with transformers) and, for those that
measure on a GPU, a CUDA device torch reaches. Without it, each failed with a traceback: an import's
ModuleNotFoundError, or torch's "Torch not compiled with CUDA enabled" from its first tensor on the
device.

The standard library alone: benchmarks/pair.py, which imports no memra_cuda, asks before its own
imports of torch fail.
"""
from __future__ import annotations

import importlib.util
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

TORCH = ("torch", "transformers")  # memra_cuda.torch's: the random-weight Llamas (steps, soak)
PAIR = (*TORCH, "tokenizers")  # pair.py's, and what runs the pair's tokenizer (the headline, served)
CHECKOUT = Path(__file__).resolve().parents[1]  # the benchmarks' repository, whose torch extra installs them


def refuse(program: str, what: str) -> NoReturn:
    """Exit with status 1 after `what`, in one line on stderr after `program`'s name: no traceback."""
    print(f"{program}: {' '.join(what.split())}", file=sys.stderr)
    raise SystemExit(1)


def needs(program: str, packages: Sequence[str], *, gpu: bool) -> None:
    """Refuse (exit 1, one line) where one of `packages` is not installed, or, with `gpu`, where
    torch reaches no CUDA device: a build of torch without CUDA, or a machine without an NVIDIA GPU
    (or its driver). Called once the command line is read, so that --help and the options' errors
    need neither."""
    for name in packages:
        if importlib.util.find_spec(name) is None:
            needed = " and ".join(filter(None, (", ".join(packages[:-1]), packages[-1])))
            refuse(program, f"no module named {name!r}: the benchmark needs {needed}, which the torch extra "
                   f"installs: pip install {shlex.quote(f'{CHECKOUT}[torch]')}")
    if not gpu:
        return
    import torch
    if torch.version.cuda is None:
        refuse(program, f"no GPU to measure on: PyTorch {torch.__version__} is built without CUDA: install a CUDA "
               "build of torch (PyPI's torch for Linux x86_64 is one)")
    if not torch.cuda.is_available():
        refuse(program, "no GPU to measure on: PyTorch finds no CUDA device (an NVIDIA GPU, with its driver)")

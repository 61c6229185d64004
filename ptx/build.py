"""Compile ptx/*.cu to ptx/*.ptx with NVRTC 12.0 (the `nvidia-cuda-nvrtc-cu12==12.0.140` wheel).

NVRTC 12.0 writes PTX ISA 8.0 for sm_80, which every CUDA 12 and CUDA 13 driver can JIT; nvcc 13
writes ISA 9.0, which CUDA 12 drivers refuse. The library is driven
through ctypes (cuda-python's nvrtc binding targets CUDA 13), and the output depends only on the
sources: the program name is the bare file name, the headers a source includes (every ptx/*.cuh)
reach NVRTC in memory under their bare file names, and no option carries a path or line info.

    python ptx/build.py              rewrite ptx/<name>.ptx where its content changed
    python ptx/build.py --out DIR    write the PTX into DIR instead
    python ptx/build.py --check      exit 1, naming the files, if a committed .ptx is stale
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import importlib.util
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
REQUIREMENT = "nvidia-cuda-nvrtc-cu12==12.0.140"
NVRTC_VERSION = (12, 0)
OPTIONS = ("--gpu-architecture=compute_80", "--std=c++17")

_PROGRAM = ctypes.c_void_p
_SIGNATURES = {
    "nvrtcVersion": (ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)),
    "nvrtcCreateProgram": (
        ctypes.POINTER(_PROGRAM),
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_char_p),
        ctypes.POINTER(ctypes.c_char_p),
    ),
    "nvrtcCompileProgram": (_PROGRAM, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
    "nvrtcGetProgramLogSize": (_PROGRAM, ctypes.POINTER(ctypes.c_size_t)),
    "nvrtcGetProgramLog": (_PROGRAM, ctypes.c_char_p),
    "nvrtcGetPTXSize": (_PROGRAM, ctypes.POINTER(ctypes.c_size_t)),
    "nvrtcGetPTX": (_PROGRAM, ctypes.c_char_p),
    "nvrtcDestroyProgram": (ctypes.POINTER(_PROGRAM),),
}


class BuildError(RuntimeError):
    """NVRTC is missing, is the wrong version, or failed; the message says which."""


def _find_library() -> Path:
    try:
        spec = importlib.util.find_spec("nvidia.cuda_nvrtc")
    except ModuleNotFoundError:
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec else []
    locations += [str(Path(entry, "nvidia", "cuda_nvrtc")) for entry in sys.path]
    for location in locations:
        library = Path(location, "lib", "libnvrtc.so.12")
        if library.is_file():
            return library
    raise BuildError(f"libnvrtc.so.12 not found: pip install '{REQUIREMENT}'")


@functools.cache
def _nvrtc() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(_find_library()))
    lib.nvrtcGetErrorString.argtypes = (ctypes.c_int,)
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def check(result: int, func: Callable[..., int], _args: tuple) -> None:
        if result != 0:
            raise BuildError(f"{func.__name__}: {lib.nvrtcGetErrorString(result).decode()}")

    for name, argtypes in _SIGNATURES.items():
        func = getattr(lib, name)
        func.argtypes = argtypes
        func.restype = ctypes.c_int
        func.errcheck = check
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    if (major.value, minor.value) != NVRTC_VERSION:
        found = f"{major.value}.{minor.value}"
        raise BuildError(f"NVRTC is {found}, not 12.0: pip install '{REQUIREMENT}'")
    return lib


def _read(prog: _PROGRAM, get_size: Callable[..., int], get: Callable[..., int]) -> str:
    size = ctypes.c_size_t()
    get_size(prog, ctypes.byref(size))
    buffer = ctypes.create_string_buffer(size.value)
    get(prog, buffer)
    return buffer.value.decode()  # .value stops at the trailing NUL


def compile_cu(path: Path) -> str:
    """Return the PTX NVRTC 12.0 makes of the CUDA source at `path`; `#include "<name>.cuh"`
    finds the header of that name beside it."""
    lib = _nvrtc()
    prog = _PROGRAM()
    headers = sorted(path.parent.glob("*.cuh"))
    contents = (ctypes.c_char_p * len(headers))(*(header.read_bytes() for header in headers))
    names = (ctypes.c_char_p * len(headers))(*(header.name.encode() for header in headers))
    lib.nvrtcCreateProgram(ctypes.byref(prog), path.read_bytes(), path.name.encode(), len(headers), contents, names)
    try:
        options = (ctypes.c_char_p * len(OPTIONS))(*(option.encode() for option in OPTIONS))
        try:
            lib.nvrtcCompileProgram(prog, len(OPTIONS), options)
        except BuildError as error:
            log = _read(prog, lib.nvrtcGetProgramLogSize, lib.nvrtcGetProgramLog)
            raise BuildError(f"{path.name}: {error}\n{log.rstrip()}") from None
        return _read(prog, lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def build(out_dir: Path) -> list[Path]:
    """Compile every ptx/*.cu into `out_dir`/<name>.ptx; return the PTX paths in name order.

    A file whose content is unchanged is left untouched.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    outputs = []
    for source in sorted(HERE.glob("*.cu")):
        ptx = compile_cu(source).encode()
        target = out_dir / f"{source.stem}.ptx"
        if not target.is_file() or target.read_bytes() != ptx:
            target.write_bytes(ptx)
        outputs.append(target)
    return outputs


def _stale() -> list[str]:
    """Committed .ptx files that differ from a fresh build, are missing, or have no source."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {path.name: path.read_bytes() for path in build(Path(tmp))}
    committed = {path.name: path.read_bytes() for path in HERE.glob("*.ptx")}
    names = fresh.keys() | committed.keys()
    return sorted(name for name in names if fresh.get(name) != committed.get(name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--out", type=Path, default=HERE, help="write the PTX here instead")
    mode.add_argument("--check", action="store_true", help="fail if a committed .ptx is stale")
    args = parser.parse_args(argv)
    try:
        if not args.check:
            build(args.out)
        elif stale := _stale():
            print(f"ptx/build.py: stale PTX, run ptx/build.py: {', '.join(stale)}", file=sys.stderr)
            return 1
    except BuildError as error:
        print(f"ptx/build.py: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

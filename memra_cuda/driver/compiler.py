"""Your own CUDA C as PTX that every CUDA 12 and CUDA 13 driver loads: `compile_ptx(source)`.

`Module(engine, ptx)` takes PTX text, and which PTX a driver accepts depends on its version:
a driver JIT-compiles PTX up to the ISA of its own CUDA release and refuses anything newer.
nvcc 13 writes ISA 9.0, which no CUDA 12 driver loads; NVRTC 12.0 writes ISA 8.0, which every
CUDA 12 and 13 driver does. So this module compiles with NVRTC 12.0, for `compute_80` (PTX of
`.target sm_80`, which the driver JITs for any GPU from Ampere on), exactly as the package's
own kernels are built (ptx/build.py uses this module).

NVRTC is an optional dependency, the `nvidia-cuda-nvrtc-cu12==12.0.140` wheel
(`pip install 'memra_cuda[nvrtc]'`). It is driven through ctypes, not cuda-python's nvrtc
binding: that binding loads the NVRTC of cuda-python's own CUDA release, and every NVRTC after
12.0 writes PTX that some CUDA 12 driver refuses (12.4 writes ISA 8.4; 13.0, ISA 9.0).
Importing this module loads nothing; the library is found and loaded on the first `compile`.
The module uses the standard library alone, so ptx/build.py can load it from a checkout
without the package's dependencies.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from .errors import MemraError

__all__ = ["CompileError", "NvrtcUnavailable", "compile_ptx", "EXTRA", "REQUIREMENT", "OPTIONS"]

EXTRA = "memra_cuda[nvrtc]"  # the extra that installs REQUIREMENT
REQUIREMENT = "nvidia-cuda-nvrtc-cu12==12.0.140"
NVRTC_VERSION = (12, 0)  # the one release whose PTX (ISA 8.0) every CUDA 12 and 13 driver loads
LIBRARY = "libnvrtc.so.12"
# compute_80: `.target sm_80`, JIT-compiled by the driver for the GPU it runs on (sm_80 and up).
# No option names a path or asks for line info, so the PTX depends on the sources alone.
OPTIONS = ("--gpu-architecture=compute_80", "--std=c++17")
# The spellings of each default's flag: an option of yours that sets one replaces that default
# (NVRTC refuses a flag given twice).
_FLAGS = (("--gpu-architecture", "-arch"), ("--std", "-std"))

_PROGRAM = ctypes.c_void_p
_SIGNATURES: dict[str, tuple[Any, ...]] = {
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


class CompileError(MemraError, RuntimeError):
    """`compile` failed. For a source NVRTC refuses, the message is NVRTC's verdict followed by
    its log, and `log` is the log alone (the compiler's errors and warnings, by line of `name`).
    """

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


class NvrtcUnavailable(CompileError):
    """No NVRTC 12.0 to compile with: none found, or another release (whose PTX some drivers
    refuse). The message names the extra that installs the right one; `found` is the version
    found ("12.4", say), None where no library was found or it would not load. A CompileError,
    so that one `except CompileError` covers everything `compile` raises."""

    def __init__(self, reason: str, found: str | None = None):
        super().__init__(f"memra_cuda.compile needs NVRTC 12.0 ({REQUIREMENT}): {reason}; "
                         f"pip install '{EXTRA}'")
        self.found = found


def _find_library() -> Path | None:
    """libnvrtc.so.12 of the `nvidia-cuda-nvrtc-cu12` wheel (its `nvidia/cuda_nvrtc/lib`), in the
    installed namespace package or under any sys.path entry; None where there is none. Only the
    wheel's copy is looked for, never a system CUDA's, whose release is whatever is installed."""
    try:
        spec = importlib.util.find_spec("nvidia.cuda_nvrtc")
    except (ImportError, ValueError):  # no `nvidia` namespace package at all
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec else []
    locations += [str(Path(entry, "nvidia", "cuda_nvrtc")) for entry in sys.path]
    for location in locations:
        library = Path(location, "lib", LIBRARY)
        if library.is_file():
            return library
    return None


def _version(lib: ctypes.CDLL) -> tuple[int, int]:
    """The (major, minor) release the loaded library reports."""
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def _load(path: Path) -> ctypes.CDLL:
    """The library at `path`, every function's signature set; a call that fails raises
    CompileError naming the function and NVRTC's error string."""
    lib = ctypes.CDLL(str(path))
    lib.nvrtcGetErrorString.argtypes = (ctypes.c_int,)
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def check(result: int, func: Callable[..., int], _args: tuple) -> None:
        if result != 0:
            raise CompileError(f"{func.__name__}: {lib.nvrtcGetErrorString(result).decode()}")

    for name, argtypes in _SIGNATURES.items():
        func = getattr(lib, name)
        func.argtypes = argtypes
        func.restype = ctypes.c_int
        func.errcheck = check
    return lib


@functools.cache
def _nvrtc() -> ctypes.CDLL:
    """NVRTC 12.0, found and loaded on the first compile, then kept. A failed lookup is not
    cached: installing the extra mends the next call."""
    path = _find_library()
    if path is None:
        raise NvrtcUnavailable(f"{LIBRARY} not found")
    try:
        lib = _load(path)
    except (OSError, AttributeError) as exc:  # not a loadable library, or not NVRTC
        raise NvrtcUnavailable(f"{path} does not load as NVRTC ({exc})") from None
    version = _version(lib)
    if version != NVRTC_VERSION:
        found = f"{version[0]}.{version[1]}"
        raise NvrtcUnavailable(f"found NVRTC {found} at {path}", found=found)
    return lib


@functools.cache
def _uselocale() -> Any:
    """libc's uselocale (POSIX.1-2008), or None where the C library has none."""
    try:
        func = ctypes.CDLL(None).uselocale
    except (OSError, AttributeError):
        return None
    func.argtypes, func.restype = (ctypes.c_void_p,), ctypes.c_void_p
    return func


@contextlib.contextmanager
def _thread_locale() -> Iterator[None]:
    """Give the calling thread its locale back after NVRTC. NVRTC 12.0's compile leaves the
    thread on a "C" locale of its own (uselocale), so every text file the thread opened after it
    without naming an encoding would be read as ASCII, and Python code of UTF-8 text would fail
    to load."""
    uselocale = _uselocale()
    saved = uselocale(None) if uselocale is not None else None  # LC_GLOBAL_LOCALE, or the thread's own
    try:
        yield
    finally:
        if saved is not None:
            uselocale(saved)


def _read(prog: _PROGRAM, get_size: Callable[..., int], get: Callable[..., int], errors: str = "strict") -> str:
    size = ctypes.c_size_t()
    get_size(prog, ctypes.byref(size))
    buffer = ctypes.create_string_buffer(size.value)
    get(prog, buffer)
    return buffer.value.decode(errors=errors)  # .value stops at the trailing NUL


def _defaults(options: Sequence[str]) -> list[str]:
    """OPTIONS but those whose flag one of `options` sets."""
    def sets(option: str, spellings: tuple[str, ...]) -> bool:
        return any(option == flag or option.startswith((f"{flag}=", f"{flag} ")) for flag in spellings)

    return [default for default, spellings in zip(OPTIONS, _FLAGS)
            if not any(isinstance(option, str) and sets(option, spellings) for option in options)]


def _strings(values: Sequence[bytes]) -> Any:
    return (ctypes.c_char_p * len(values))(*values)


def compile_ptx(source: str, *, name: str = "kernel.cu", headers: Mapping[str, str] | None = None,
            options: Sequence[str] = ()) -> str:
    """The PTX NVRTC 12.0 makes of the CUDA C `source`: ISA 8.0 for `.target sm_80`, which every
    CUDA 12 and CUDA 13 driver loads (give it to `Module(engine, ptx)`).

    `name` is the program's name, the file name NVRTC's messages cite. `headers` maps the names
    the source `#include`s to their text: they reach NVRTC in memory, so nothing is read from
    disk and the PTX depends on the texts alone. `options` are NVRTC options added after
    OPTIONS (`-DBLOCK=256`, `--use_fast_math`, ...), or replacing the one of the same flag
    (`--std=c++20`; `--gpu-architecture=compute_90` gives PTX that only GPUs of sm_90 and up
    load). Declare kernels `extern "C"`, so that `module.kernel(name)` finds them by their
    plain names. The same inputs give the same PTX, byte for byte.

    Raises CompileError carrying NVRTC's log where the source does not compile, and
    NvrtcUnavailable (a CompileError) naming `memra_cuda[nvrtc]` where NVRTC 12.0 is missing
    or another release is found. Needs no GPU.
    """
    if isinstance(options, str):
        raise TypeError(f"options is a sequence of options, not one string: ({options!r},)")
    headers = dict(headers or {})
    all_options = [*_defaults(options), *options]
    texts = [("source", source), ("name", name), *(("header name", key) for key in headers),
             *(("header", value) for value in headers.values()), *(("option", option) for option in all_options)]
    for what, text in texts:  # refused here, not as a ctypes error or a silently cut string
        if not isinstance(text, str):
            raise TypeError(f"a {what} must be a str, not {type(text).__name__}")
        if "\0" in text:
            raise ValueError(f"a {what} holds a NUL character, which would end its C string early")
    lib = _nvrtc()
    prog = _PROGRAM()
    contents, names = [text.encode() for text in headers.values()], [key.encode() for key in headers]
    encoded = [option.encode() for option in all_options]
    with _thread_locale():
        lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), len(headers), _strings(contents),
                               _strings(names))
        try:
            try:
                lib.nvrtcCompileProgram(prog, len(encoded), _strings(encoded))
            except CompileError as error:
                log = _read(prog, lib.nvrtcGetProgramLogSize, lib.nvrtcGetProgramLog, "replace").rstrip()
                raise CompileError(f"{name}: {error}\n{log}", log) from None
            return _read(prog, lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))

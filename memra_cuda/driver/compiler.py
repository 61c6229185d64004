"""Your own CUDA C as PTX the driver loads: `compile_ptx(source)`.

`Module(engine, ptx)` takes PTX text, and which PTX a driver accepts depends on its version:
a driver JIT-compiles PTX up to the ISA of its own CUDA release and refuses anything newer
(NVRTC 12.4 writes ISA 8.4, which a CUDA 12.2 driver refuses; 13.0, ISA 9.0, which no CUDA 12
driver loads). NVRTC 12.0 writes ISA 8.0, which every CUDA 12 and 13 driver loads, so it is
preferred wherever it is installed (the `nvidia-cuda-nvrtc-cu12==12.0.140` wheel, memra_cuda's
`nvrtc` extra); the package's own kernels are built with it alone (ptx/build.py,
`portable=True`). Without it, the NVRTC present is used where this machine's driver loads what
it writes: its release no newer than the driver's (NVRTC 13.0 for a CUDA 13.0 driver, as
PyTorch's CUDA 13 wheels install it); a newer one is refused, naming both. With no driver to
ask (a machine without a GPU), the NVRTC found is used. Every compile logs which NVRTC wrote
which ISA, and the PTX says it too (its `.version` line). The target is `compute_80` (PTX of
`.target sm_80`, which the driver JITs for any GPU from Ampere on), as for the package's kernels.

NVRTC is driven through ctypes, not cuda-python's nvrtc binding, which loads the NVRTC of
cuda-python's own CUDA release. Only NVIDIA's wheels are looked in (`nvidia/<folder>/lib` under
any sys.path entry: nvidia-cuda-nvrtc-cu12's `cuda_nvrtc`, the CUDA 13 wheels' `cu13`), never a
system CUDA, whose release is whatever is installed. Importing this module loads nothing; the
library is found and loaded on the first compile.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import re
import reprlib
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CudaUnavailable, MemraError, driver_version
from .values import as_flag, as_listed, c_string

__all__ = ["CompileError", "Nvrtc", "NvrtcUnavailable", "compile_ptx", "nvrtc", "ptx_isa", "EXTRA", "REQUIREMENT",
           "OPTIONS"]

logger = logging.getLogger(__name__)

EXTRA = "nvrtc"  # memra_cuda's extra that installs REQUIREMENT (memra_cuda is not on PyPI: the package is named)
REQUIREMENT = "nvidia-cuda-nvrtc-cu12==12.0.140"
PORTABLE = (12, 0)  # the one release whose PTX (ISA 8.0) every CUDA 12 and 13 driver loads
# NVRTC's library in NVIDIA's wheels: libnvrtc.so.<major> in nvidia/<folder>/lib (nvidia-cuda-nvrtc-cu12's
# folder is cuda_nvrtc, the CUDA 13 wheels' cu13). NVRTC 12.0 is a libnvrtc.so.12.
LIBRARY = re.compile(r"libnvrtc\.so\.\d+")
PORTABLE_LIBRARY = f"libnvrtc.so.{PORTABLE[0]}"
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
    """`compile_ptx` failed. For a source NVRTC refuses, the message is NVRTC's verdict followed
    by its log, and `log` is the log alone (the compiler's errors and warnings, by line of `name`).
    """

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


class NvrtcUnavailable(CompileError):
    """No NVRTC to compile with: none found, none that loads, or only releases whose PTX this
    driver refuses (or, asked for PTX every driver loads, none of 12.0). The message says what was
    found and what is needed, and names the extra that installs NVRTC 12.0; `found` is the
    release(s) found ("13.0", say), None where no library was found or it would not load. A
    CompileError, so that one `except CompileError` covers everything `compile_ptx` raises."""

    def __init__(self, reason: str, found: str | None = None):
        super().__init__(f"compile_ptx has no NVRTC to use: {reason}. NVRTC 12.0 ({REQUIREMENT}) writes PTX every "
                         f"CUDA 12 and 13 driver loads: pip install '{REQUIREMENT}' "
                         f"(memra_cuda's {EXTRA} extra)")
        self.found = found


@dataclass(frozen=True)
class Nvrtc:
    """An NVRTC library, loaded: its release and where it lies."""

    version: tuple[int, int]
    path: Path
    lib: ctypes.CDLL = field(repr=False, compare=False)  # every function's signature set (_load)

    @property
    def release(self) -> str:
        return f"{self.version[0]}.{self.version[1]}"

    @property
    def loads_on(self) -> str:
        """Which drivers load the PTX it writes."""
        if self.version == PORTABLE:
            return "every CUDA 12 and 13 driver"
        return f"drivers of CUDA {self.release} and later only"


def _find_libraries(portable: bool = False) -> list[Path]:
    """NVRTC's libraries in NVIDIA's wheels (module docstring) under every sys.path entry, each
    once; with `portable`, libnvrtc.so.12 alone (the only major release that has a 12.0)."""
    found: dict[Path, None] = {}
    for entry in sys.path:
        for library in sorted(Path(entry or ".", "nvidia").glob("*/lib/libnvrtc.so.*")):
            if LIBRARY.fullmatch(library.name) and (not portable or library.name == PORTABLE_LIBRARY) \
                    and library.is_file():
                found.setdefault(library.resolve(), None)
    return list(found)


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


def _open(path: Path) -> Nvrtc:
    """The NVRTC at `path`, loaded, with its builtins: NVRTC opens libnvrtc-builtins.so.<release>
    by name when it compiles, and the CUDA 13.0 wheel's library has no run path to find the one
    beside it, so it is loaded here first (the loader then finds it by its name). OSError, saying
    why, where either does not load."""
    try:
        lib = _load(path)
        version = _version(lib)
    except (OSError, AttributeError) as exc:  # not a loadable library, or not NVRTC
        raise OSError(f"{path} does not load as NVRTC ({exc})") from None
    builtins = path.with_name(f"libnvrtc-builtins.so.{version[0]}.{version[1]}")
    if builtins.is_file():
        try:
            ctypes.CDLL(str(builtins))
        except OSError as exc:
            raise OSError(f"{builtins}, NVRTC {version[0]}.{version[1]}'s builtins, does not load ({exc})") from None
    return Nvrtc(version, path, lib)


def _driver_version() -> tuple[int, int] | None:
    """The CUDA release of this machine's driver (cuDriverGetVersion); None where there is none.
    Bindings newer than the driver are refused here as everywhere (errors.bindings_refusal): the
    NVRTC to choose depends on a driver they cannot serve."""
    try:
        return driver_version()
    except CudaUnavailable as exc:
        if exc.call == "cuDriverGetVersion":
            raise
        return None


@functools.cache
def nvrtc(portable: bool = False) -> Nvrtc:
    """The NVRTC compile_ptx uses (module docstring): 12.0 where it is installed; else, without
    `portable`, the oldest found whose release is no newer than the driver's (any found, where
    there is no driver). Found and loaded on the first call, then kept; NvrtcUnavailable where
    none will do (a failed lookup is not kept: installing the extra mends the next call)."""
    found: list[Nvrtc] = []
    broken: list[str] = []
    for path in sorted(_find_libraries(portable), key=lambda path: path.name != PORTABLE_LIBRARY):
        try:
            lib = _open(path)
        except OSError as exc:
            broken.append(str(exc))
            continue
        if lib.version == PORTABLE:
            return lib
        found.append(lib)
    if not found:
        wanted = PORTABLE_LIBRARY if portable else "libnvrtc.so.<major>"
        raise NvrtcUnavailable("; ".join(broken) or f"no {wanted} found (looked in nvidia/*/lib of every sys.path "
                                                     f"entry)")
    found.sort(key=lambda lib: lib.version)
    names = ", ".join(f"NVRTC {lib.release} at {lib.path}" for lib in found)
    releases = ", ".join(lib.release for lib in found)
    if portable:
        raise NvrtcUnavailable(f"asked for PTX every driver loads (portable=True), found {names}", found=releases)
    driver = _driver_version()
    suits = [lib for lib in found if driver is None or lib.version <= driver]
    if driver is not None and not suits:
        raise NvrtcUnavailable(f"found {names}, newer than this driver's CUDA {driver[0]}.{driver[1]}, which refuses "
                               f"the PTX ISA a newer NVRTC writes", found=releases)
    return suits[0]


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
                options: Sequence[str] = (), portable: bool = False) -> str:
    """The PTX NVRTC makes of the CUDA C `source` for `.target sm_80` (give it to `Module(engine,
    ptx)`): NVRTC 12.0's ISA 8.0, which every CUDA 12 and 13 driver loads, where it is installed;
    else the ISA of the NVRTC present, which this machine's driver loads (module docstring). With
    `portable`, NVRTC 12.0 or nothing: PTX to ship to other machines' drivers.

    `name` is the program's name, the file name NVRTC's messages cite. `headers` maps the names
    the source `#include`s to their text (a Mapping, or None for none: a list of names or pairs is
    a TypeError): they reach NVRTC in memory, so nothing is read from disk and the PTX depends on
    the texts alone. `options` are NVRTC options added after
    OPTIONS (`-DBLOCK=256`, `--use_fast_math`, ...), or replacing the one of the same flag
    (`--std=c++20`; `--gpu-architecture=compute_90` gives PTX that only GPUs of sm_90 and up
    load). Declare kernels `extern "C"`, so that `module.kernel(name)` finds them by their
    plain names. The same inputs and NVRTC give the same PTX, byte for byte.

    Raises CompileError carrying NVRTC's log where the source does not compile, and
    NvrtcUnavailable (a CompileError) naming the NVRTC 12.0 wheel where no NVRTC will do (none
    found, or only releases newer than the driver; with `portable`, none of 12.0). Needs no GPU.
    """
    if isinstance(options, str):
        raise TypeError(f"options is a sequence of options, not one string: ({options!r},)")
    # listed once: an iterator was used up looking for the defaults' flags (_defaults), so none of
    # its options reached NVRTC, silently (-DBLOCK=256 dropped); a set's order is its hashes'
    options = as_listed(options, "options", "NVRTC options (strings)")
    portable = as_flag(portable, "portable")  # "False" was read by its truth: NVRTC 12.0 or nothing
    if headers is not None and not isinstance(headers, Mapping):
        # dict() took a list of (name, text) pairs silently, and met a list of names as "dictionary
        # update sequence element #0 has length 3", naming nothing
        raise TypeError(f"headers must map the names the source #includes to their text (a dict), not "
                        f"{reprlib.repr(headers)}")
    headers = dict(headers or {})
    all_options = [*_defaults(options), *options]
    texts = [("source", source), ("name", name), *(("header name", key) for key in headers),
             *(("header", value) for value in headers.values()), *(("option", option) for option in all_options)]
    for what, text in texts:  # refused here, not as a ctypes error or a silently cut string
        c_string(text, f"a {what}")
    compiler = nvrtc(portable)
    lib = compiler.lib
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
            ptx = _read(prog, lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))
    logger.info("compile_ptx: %s: PTX ISA %s by NVRTC %s at %s, for %s", name, ptx_isa(ptx), compiler.release,
                compiler.path, compiler.loads_on)
    return ptx


def ptx_isa(ptx: str) -> str:
    """The ISA a PTX text is written in ("8.0"), from its `.version` directive; "unknown" without one."""
    found = re.search(r"^\.version (\d+\.\d+)\s*$", ptx, re.M)
    return found[1] if found else "unknown"

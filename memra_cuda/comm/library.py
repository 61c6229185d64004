"""libnccl, found and bound once: the one place where an NCCL result becomes a value or an
exception, as driver/errors.py is for the driver.

NCCL is optional (the `nccl` extra installs nvidia-nccl-cu12's wheel; -cu13's, torch's or a
system install serve as well):
nothing here loads it before a communicator is asked for, so `import memra_cuda` and everything
that needs no NCCL work without it. The library bound is, in order, the one MEMRA_NCCL_LIBRARY
names, one this process loaded already (torch's, say: two copies of NCCL in one process would
each keep their own state), an `nvidia/.../libnccl.so.2` of an installed wheel, or the system's.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from ..driver.errors import MemraError

EXTRA = "pip install nvidia-nccl-cu12, the nccl extra's wheel"  # memra_cuda is on no index: the wheel is named
UNIQUE_ID_BYTES = 128

RESULTS = ("ncclSuccess", "ncclUnhandledCudaError", "ncclSystemError", "ncclInternalError", "ncclInvalidArgument",
           "ncclInvalidUsage", "ncclRemoteError", "ncclInProgress", "ncclTimeout")
IN_PROGRESS = RESULTS.index("ncclInProgress")

# ncclDataType_t of the element types memra's buffers hold (numpy has no bfloat16: a bf16 tensor
# is reduced as NCCL's ncclBfloat16 through dtype="bfloat16").
DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5, "float16": 6, "float32": 7,
          "float64": 8, "bfloat16": 9}
OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}

_COMM = ctypes.c_void_p


def check_id(unique_id: object, what: str, kinds: tuple[type[bytes | bytearray], ...] = (bytes,)) -> None:
    """Whether `unique_id` is a communicator id, one of `kinds` of UNIQUE_ID_BYTES bytes: else a
    TypeError that `what` opens ("unique_id must be", "make_id must return") or a ValueError
    naming its length. The one check of an id, where a Communicator is given one and where rank 0
    makes the one it serves (exchange_id)."""
    if not isinstance(unique_id, kinds):
        raise TypeError(f"{what} the communicator id as bytes (Nccl.unique_id's), not a {type(unique_id).__name__}")
    if len(unique_id) != UNIQUE_ID_BYTES:
        raise ValueError(f"a communicator id is {UNIQUE_ID_BYTES} bytes, not {len(unique_id)} (Nccl.unique_id's)")


class UniqueIdArg(ctypes.Structure):
    """ncclUniqueId, passed by value."""
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


_SIGNATURES: dict[str, tuple[Any, ...]] = {
    "ncclGetVersion": (ctypes.POINTER(ctypes.c_int),),
    "ncclGetUniqueId": (ctypes.c_char_p,),
    "ncclCommInitRank": (ctypes.POINTER(_COMM), ctypes.c_int, UniqueIdArg, ctypes.c_int),
    "ncclCommFinalize": (_COMM,),
    "ncclCommDestroy": (_COMM,),
    "ncclCommAbort": (_COMM,),
    "ncclCommGetAsyncError": (_COMM, ctypes.POINTER(ctypes.c_int)),
    "ncclCommCount": (_COMM, ctypes.POINTER(ctypes.c_int)),
    "ncclAllReduce": (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _COMM,
                      ctypes.c_void_p),
    "ncclBroadcast": (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _COMM,
                      ctypes.c_void_p),
    "ncclSend": (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _COMM, ctypes.c_void_p),
    "ncclRecv": (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _COMM, ctypes.c_void_p),
    "ncclGroupStart": (),
    "ncclGroupEnd": (),
}


def result_name(code: int) -> str:
    """NCCL's word for a result code."""
    return RESULTS[code] if 0 <= code < len(RESULTS) else f"ncclResult {code}"


class NcclError(MemraError, RuntimeError):
    """An NCCL call returned something other than ncclSuccess (`name`, NCCL's own word for it;
    `detail`, its last error message, where it left one)."""

    def __init__(self, code: int, call: str, detail: str = "", *, name: str | None = None,
                 message: str | None = None):
        """`name` and `message` for memra's own failures (a subclass's), which no NCCL result names."""
        self.code, self.call, self.detail = code, call, detail
        self.name = result_name(code) if name is None else name
        super().__init__(message or f"{call} failed: {self.name}" + (f": {detail}" if detail else ""))


class NcclUnavailable(NcclError):
    """No libnccl could be loaded."""

    def __init__(self, reason: str):
        super().__init__(-1, "dlopen", reason, name="NCCL_UNAVAILABLE", message=reason)


def candidates(environ: Mapping[str, str] | None = None, paths: list[str] | None = None) -> list[str]:
    """Where libnccl is looked for, in order (module docstring)."""
    env = os.environ if environ is None else environ
    if env.get("MEMRA_NCCL_LIBRARY"):
        return [env["MEMRA_NCCL_LIBRARY"]]
    found = _loaded()
    for entry in sys.path if paths is None else paths:
        found += sorted(glob.glob(os.path.join(entry or ".", "nvidia", "*", "lib", "libnccl.so*")))
        found += sorted(glob.glob(os.path.join(entry or ".", "nvidia", "*", "*", "lib", "libnccl.so*")))
    return [*dict.fromkeys(found), "libnccl.so.2"]


def _loaded() -> list[str]:
    """libnccl files this process has mapped already (Linux: /proc/self/maps)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return list(dict.fromkeys(line.split()[-1] for line in maps.splitlines() if "/libnccl.so" in line))


class Nccl:
    """libnccl's calls memra makes, each checked: `call(name, *args)` raises NcclError naming
    the call and NCCL's last error message."""

    def __init__(self, path: str):
        self.path = path
        self.lib = ctypes.CDLL(path)
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
        self.lib.ncclGetErrorString.argtypes, self.lib.ncclGetErrorString.restype = [ctypes.c_int], ctypes.c_char_p
        last = getattr(self.lib, "ncclGetLastError", None)  # NCCL 2.13 and later
        if last is not None:
            last.argtypes, last.restype = [_COMM], ctypes.c_char_p
        self._last = last
        version = ctypes.c_int()
        self.call("ncclGetVersion", ctypes.byref(version))
        self.version = version.value

    def call(self, name: str, *args: Any) -> None:
        result = getattr(self.lib, name)(*args)
        if result:
            raise self.failure(result, name)

    def failure(self, code: int, call: str, comm: Any = None) -> NcclError:
        """The exception for `call`'s result `code`, with NCCL's last error message (as the
        driver layer's PrimaryContext.failure)."""
        detail = self._last(comm).decode(errors="replace") if self._last is not None else ""
        return NcclError(code, call, detail)

    @property
    def version_text(self) -> str:
        """"2.23.4" from NCCL's version code (major * 10000 + minor * 100 + patch since 2.9)."""
        code = self.version
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"

    def unique_id(self) -> bytes:
        """A new communicator's id (rank 0 makes it, every rank joins with it)."""
        out = ctypes.create_string_buffer(UNIQUE_ID_BYTES)
        self.call("ncclGetUniqueId", out)
        return out.raw

    def __repr__(self) -> str:
        return f"Nccl({self.version_text}, {self.path})"


@functools.lru_cache(maxsize=1)
def nccl() -> Nccl:
    """The process's libnccl (NcclUnavailable, naming where it looked, if none loads)."""
    tried = []
    for path in candidates():
        try:
            return Nccl(path)
        except OSError as exc:
            tried.append(f"{path} ({exc})")
        except AttributeError as exc:  # a library without one of the calls: too old an NCCL
            tried.append(f"{path} (not an NCCL memra can use: {exc})")
    raise NcclUnavailable(f"no libnccl could be loaded ({EXTRA}, or name one in MEMRA_NCCL_LIBRARY); tried: "
                          + "; ".join(tried))


def nccl_type(dtype: DTypeLike) -> tuple[int, int]:
    """NCCL's data type for a buffer's element type (a numpy dtype, or "bfloat16", which numpy
    has not), and the bytes one element holds."""
    bf16 = isinstance(dtype, str) and dtype == "bfloat16"
    name = "bfloat16" if bf16 else np.dtype(dtype).name
    if name not in DTYPES:
        raise ValueError(f"NCCL reduces {', '.join(DTYPES)}, not {name}")
    return DTYPES[name], 2 if bf16 else np.dtype(dtype).itemsize


def nccl_dtype(dtype: DTypeLike) -> int:
    """NCCL's data type for a buffer's element type (nccl_type's)."""
    return nccl_type(dtype)[0]


def nccl_op(op: str) -> int:
    """NCCL's reduction for its name ("sum", "prod", "max", "min", "avg"), as ncclAllReduce takes
    it; ValueError for any other name, before anything is queued."""
    if op not in OPS:
        raise ValueError(f"a reduction is one of {', '.join(OPS)}, not {op!r}")
    return OPS[op]

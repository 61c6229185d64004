"""Device memory that frees itself exactly once, and pinned host memory for readbacks."""
from __future__ import annotations

import ctypes
import operator
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import call

if TYPE_CHECKING:
    from .engine import Engine


class DeviceBuffer:
    """A typed 1-D array in device memory, like cudarc's CudaSlice.

    An owning buffer frees its allocation once: by free(), by leaving a `with` block, or by its
    finaliser when it is collected. Its finaliser holds the context, never the buffer, so the
    context is alive whenever the memory is freed. Views and wrapped foreign pointers own
    nothing: a view keeps its parent alive and dies with it; a foreign buffer keeps `keepalive`
    (the other framework's tensor, say) alive. Any use after free raises ValueError without
    touching the driver.
    """

    def __init__(self, ptr: int, dtype: Any, length: int, *, engine: Engine | None = None,
                 base: DeviceBuffer | None = None, keepalive: Any = None):
        self._ptr = int(ptr)
        self.dtype = np.dtype(dtype)
        self.len = int(length)
        self.engine = engine
        self._base = base
        self._keepalive = keepalive
        self._released = False
        self._finalizer: weakref.finalize | None = None

    @classmethod
    def allocate(cls, engine: Engine, dtype: Any, length: int) -> DeviceBuffer:
        dtype = np.dtype(dtype)
        if int(length) < 1:
            raise ValueError(f"a device buffer needs at least one element, not {length}")
        ctx = engine.activate()
        ptr = int(call("cuMemAlloc", int(length) * dtype.itemsize))
        buf = cls(ptr, dtype, length, engine=engine)
        buf._finalizer = weakref.finalize(buf, ctx.finalize, "cuMemFree", ptr)
        return buf

    @classmethod
    def wrap(cls, ptr: int, dtype: Any, length: int, *, engine: Engine | None = None,
             keepalive: Any = None) -> DeviceBuffer:
        """Borrow memory allocated elsewhere (PyTorch, CuPy, another engine): never freed here."""
        if int(ptr) == 0:
            raise ValueError("cannot wrap a null device pointer")
        if int(length) < 1:
            raise ValueError(f"a device buffer needs at least one element, not {length}")
        return cls(ptr, dtype, length, engine=engine, keepalive=keepalive)

    @property
    def freed(self) -> bool:
        return self._released or (self._base is not None and self._base.freed)

    @property
    def ptr(self) -> int:
        if self.freed:
            raise ValueError("DeviceBuffer used after free")
        return self._ptr

    @property
    def nbytes(self) -> int:
        return self.len * self.dtype.itemsize

    @property
    def owns_memory(self) -> bool:
        return self._finalizer is not None

    def __len__(self) -> int:
        return self.len

    def view(self, start: int, count: int) -> DeviceBuffer:
        """A non-owning window [start, start+count) that keeps this buffer alive."""
        if not (0 <= start and 1 <= count and start + count <= self.len):
            raise ValueError(f"view [{start}, {start + count}) is outside a buffer of {self.len}")
        return DeviceBuffer(self.ptr + start * self.dtype.itemsize, self.dtype, count,
                            engine=self.engine, base=self._base or self)

    def free(self) -> None:
        """Free the memory (owning buffers) or drop the borrow (views, foreign); idempotent."""
        self._released = True
        self._keepalive = None
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> DeviceBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    @property
    def __cuda_array_interface__(self) -> dict:
        """Zero-copy access for CuPy, Numba, PyTorch (version 3 of the protocol)."""
        iface = {"shape": (self.len,), "typestr": self.dtype.str, "data": (self.ptr, False),
                 "strides": None, "version": 3}
        if self.engine is not None:
            iface["stream"] = self.engine.stream_handle
        return iface

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"0x{self._ptr:x}"
        return f"DeviceBuffer({self.dtype.name}[{self.len}] at {state})"


class PinnedBuffer:
    """Page-locked host memory: the target of asynchronous (and graph-captured) readbacks.

    Reads hand out copies, so no numpy array can outlive the memory it would point into.
    """

    def __init__(self, engine: Engine, dtype: Any, length: int):
        self.dtype = np.dtype(dtype)
        self.len = int(length)
        if self.len < 1:
            raise ValueError(f"a pinned buffer needs at least one element, not {length}")
        ctx = engine.activate()
        self.ptr = int(call("cuMemHostAlloc", self.nbytes, 0))
        self._array = np.frombuffer((ctypes.c_char * self.nbytes).from_address(self.ptr), self.dtype)
        self._finalizer = weakref.finalize(self, ctx.finalize, "cuMemFreeHost", self.ptr)

    @property
    def nbytes(self) -> int:
        return self.len * self.dtype.itemsize

    def read(self) -> np.ndarray:
        """A copy of the contents (wait for the copies into it first)."""
        if not self._finalizer.alive:
            raise ValueError("PinnedBuffer used after free")
        return self._array.copy()

    def free(self) -> None:
        self._finalizer()


def exact_int(value: Any, dtype: Any) -> int:
    """`value` as a Python int that `dtype` holds exactly: floats and out-of-range values are
    refused instead of being truncated or wrapped (whatever numpy's casting rules)."""
    dtype = np.dtype(dtype)
    if isinstance(value, (float, np.floating)):
        raise ValueError(f"{value!r} is not an integer ({dtype.name} expected)")
    number = operator.index(value)
    info = np.iinfo(dtype)
    if not info.min <= number <= info.max:
        raise ValueError(f"{value!r} is outside the range of {dtype.name}")
    return number


def exact_array(values: Any, dtype: Any) -> np.ndarray:
    """`values` as a flat `dtype` array, refusing any value the conversion would change."""
    dtype = np.dtype(dtype)
    arr = values if isinstance(values, np.ndarray) else np.asarray(values)
    if arr.dtype == dtype or dtype.kind not in "iu":
        return arr.astype(dtype, copy=False).reshape(-1)
    if arr.dtype.kind in "iub":
        for extreme in (arr.min(), arr.max()) if arr.size else ():
            exact_int(int(extreme), dtype)
        return arr.astype(dtype).reshape(-1)
    if not isinstance(values, np.ndarray):  # Python ints past int64 arrive as float64 or object
        return np.array([exact_int(v, dtype) for v in np.array(values, dtype=object).reshape(-1)], dtype)
    raise ValueError(f"{arr.dtype.name} values given for a {dtype.name} buffer")

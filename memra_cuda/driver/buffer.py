"""Device memory that frees itself exactly once, and pinned host memory for readbacks.

Thread safety: a buffer may be shared between threads (its memory is freed once, whichever
thread lets go last); what the threads queue into it is ordered by the stream, not by Python.
"""
from __future__ import annotations

import ctypes
import math
import operator
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import CaptureError, call, driver
from .handle import Handle

if TYPE_CHECKING:
    from .context import PrimaryContext
    from .engine import Engine


class DeviceBuffer(Handle):
    """A typed 1-D array in device memory, like cudarc's CudaSlice.

    An owning buffer (`allocate`, `Engine.alloc`) frees its allocation once: by free(), by
    leaving a `with` block, or by its finaliser when it is collected. Views and adopted
    foreign memory own nothing: a view keeps its parent alive and dies with it; a foreign
    buffer keeps `keepalive` (the other framework's tensor, say) alive until it is freed.
    Any use after free raises ValueError without touching the driver, and so does every
    launch, graph or pointer table that holds this buffer's address (see Handle).

    `engine` is the engine whose stream orders the work on this memory (None for foreign
    memory, which any engine on `device` may use); `label` names the buffer in messages.
    """

    def __init__(self, ptr: int, dtype: Any, length: int, *, engine: Engine | None = None,
                 base: DeviceBuffer | None = None, keepalive: Any = None, device: int | None = None,
                 label: str | None = None):
        ptr, length = as_index(ptr, "ptr"), as_index(length, "length")
        self.dtype = device_dtype(dtype)
        if ptr <= 0:
            raise ValueError(f"a device buffer needs a device address, not {ptr:#x}")
        if length < 1:
            raise ValueError(f"a device buffer needs at least one element, not {length}")
        if ptr + length * self.dtype.itemsize > 2**64:
            raise ValueError(f"{length} elements at {ptr:#x} run past the end of the address space")
        self._ptr = ptr
        self.len = length
        self.engine = engine
        self.device = engine.device if engine is not None else device
        self.label = label
        self._base = base
        self._keepalive = keepalive

    @classmethod
    def allocate(cls, engine: Engine, dtype: Any, length: int, *, label: str | None = None) -> DeviceBuffer:
        dtype, length = device_dtype(dtype), as_index(length, "length")
        if length < 1:
            raise ValueError(f"a device buffer needs at least one element, not {length}")
        ctx, ptr = device_allocation(engine, length * dtype.itemsize)
        buf = cls(ptr, dtype, length, engine=engine, label=label)
        buf._own(ctx, "cuMemFree", ptr)
        return buf

    @classmethod
    def wrap(cls, ptr: int, dtype: Any, length: int, *, engine: Engine | None = None,
             keepalive: Any = None) -> DeviceBuffer:
        """Borrow memory allocated elsewhere: never freed here. Prefer from_cuda_array, which
        reads the type and size from the owner and keeps it alive."""
        return cls(ptr, dtype, length, engine=engine, keepalive=keepalive)

    @classmethod
    def from_cuda_array(cls, obj: Any, engine: Engine | None = None) -> DeviceBuffer:
        """Adopt a contiguous `__cuda_array_interface__` object (v2/v3: a PyTorch tensor, a
        CuPy array) without owning it, keeping `obj` alive.

        With `engine`, work the engine queues on this memory is ordered after the stream the
        producer names (v3's `stream`), so nothing reads the tensor before it is written.
        Empty, masked, non-contiguous or host memory is a ValueError.
        """
        iface = obj.__cuda_array_interface__
        shape = tuple(as_index(d, "shape") for d in iface["shape"])
        dtype = device_dtype(iface["typestr"])
        ptr = as_index(iface["data"][0], "data pointer")
        count = math.prod(shape)
        if iface.get("mask") is not None:
            raise ValueError("a masked array cannot be a device buffer")
        if count == 0:
            raise ValueError(f"an empty array (shape {shape}) cannot be a device buffer")
        strides = iface.get("strides")
        if strides is not None and not _c_contiguous(shape, strides, dtype.itemsize):
            raise ValueError(f"array of shape {shape} with strides {tuple(strides)} is not contiguous: "
                             "pass a contiguous copy")
        if engine is not None:
            engine.activate()
        device = _device_of(ptr)
        buf = cls(ptr, dtype, count, keepalive=obj, device=device)
        stream = iface.get("stream")
        if engine is not None and stream is not None:
            engine.wait(stream)
        return buf

    @property
    def freed(self) -> bool:
        return self._freed or (self._base is not None and self._base._freed)

    @property
    def ptr(self) -> int:
        if self._refusal is not None:
            raise ValueError(self._refusal)
        if self._base is not None and self._base._refusal is not None:
            raise ValueError(self._base._refusal)
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
        start, count = as_index(start, "start"), as_index(count, "count")
        if not (0 <= start and 1 <= count and start + count <= self.len):
            raise ValueError(f"view [{start}, {start + count}) is outside a buffer of {self.len}")
        return DeviceBuffer(self.ptr + start * self.dtype.itemsize, self.dtype, count, engine=self.engine,
                            base=self._base or self, device=self.device, label=self.label)

    def depend(self, dependent: Handle) -> None:
        """A dependent of a view also depends on the memory's owner."""
        super().depend(dependent)
        if self._base is not None:
            self._base.depend(dependent)

    def names(self, handle: Handle) -> bool:
        """Whether freeing `handle` frees this buffer's memory."""
        return handle is self or handle is self._base

    def free(self) -> None:
        """Free the memory (owning buffers) or drop the borrow (views, foreign); idempotent."""
        self._keepalive = None
        super().free()

    @property
    def __cuda_array_interface__(self) -> dict:
        """Zero-copy access for CuPy, Numba, PyTorch (version 3 of the protocol)."""
        iface = {"shape": (self.len,), "typestr": self.dtype.str, "data": (self.ptr, False),
                 "strides": None, "version": 3}
        if self.engine is not None:
            iface["stream"] = self.engine.stream_handle or 1  # 0 is not allowed: it means legacy (1)
        return iface

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"0x{self._ptr:x}"
        label = f"{self.label} " if self.label else ""
        return f"{type(self).__name__}({label}{short_name(self.dtype)}[{self.len}] at {state})"


class PinnedBuffer(Handle):
    """Page-locked host memory: the target of asynchronous (and graph-captured) readbacks.

    Reads hand out copies, so no numpy array can outlive the memory it would point into.
    """

    def __init__(self, engine: Engine, dtype: Any, length: int, *, label: str | None = None):
        self.dtype = device_dtype(dtype)
        self.len = as_index(length, "length")
        if self.len < 1:
            raise ValueError(f"a pinned buffer needs at least one element, not {length}")
        self.engine = engine
        self.label = label
        _no_alloc_in_capture(engine, "pinned memory")
        ctx = engine.activate()
        self._ptr = int(ctx.call("cuMemHostAlloc", self.nbytes, 0))
        self._own(ctx, "cuMemFreeHost", self._ptr)
        self._array = np.frombuffer((ctypes.c_char * self.nbytes).from_address(self._ptr), self.dtype)

    @property
    def ptr(self) -> int:
        self._usable()
        return self._ptr

    @property
    def nbytes(self) -> int:
        return self.len * self.dtype.itemsize

    def names(self, handle: Handle) -> bool:
        return handle is self

    def read(self) -> np.ndarray:
        """A copy of the contents (wait for the copies into it first)."""
        self._usable()
        return self._array.copy()

    def __repr__(self) -> str:
        label = f"{self.label} " if self.label else ""
        return f"PinnedBuffer({label}{short_name(self.dtype)}[{self.len}]{' freed' if self.freed else ''})"


def as_buffer(obj: Any, what: str = "buffer", engine: Engine | None = None) -> DeviceBuffer:
    """`obj` as a DeviceBuffer: itself, or adopted through `__cuda_array_interface__`."""
    if isinstance(obj, DeviceBuffer):
        return obj
    if hasattr(obj, "__cuda_array_interface__"):
        return DeviceBuffer.from_cuda_array(obj, engine)
    raise TypeError(f"{what} must be a DeviceBuffer or an object with __cuda_array_interface__, "
                    f"not {type(obj).__name__}")


def device_dtype(dtype: Any) -> np.dtype:
    """`dtype` if device memory can hold it: bool, integers and floats of 1 to 8 bytes, in the
    machine's byte order (objects, strings and complex numbers have no meaning there)."""
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"{dtype!r} is not a dtype") from exc
    if dt.kind not in "biuf" or dt.itemsize not in (1, 2, 4, 8) or not dt.isnative:
        raise ValueError(f"{dt} cannot be the element type of device memory: use a bool, an integer or a "
                         "float of 1, 2, 4 or 8 bytes in native byte order")
    return dt


def short_name(dtype: np.dtype) -> str:
    """u32, i64, f16, bool: how DESIGN.md writes element types."""
    return "bool" if dtype.kind == "b" else f"{dtype.kind}{8 * dtype.itemsize}"


def exact_int(value: Any, dtype: Any) -> int:
    """`value` as a Python int that `dtype` holds exactly: floats and out-of-range values are
    refused instead of being truncated or wrapped (whatever numpy's casting rules)."""
    dtype = np.dtype(dtype)
    if isinstance(value, (float, np.floating)):
        raise ValueError(f"{value!r} is not an integer ({dtype.name} expected)")
    number = as_index(value, f"a {dtype.name} value")
    info = np.iinfo(dtype)
    if not info.min <= number <= info.max:
        raise ValueError(f"{value!r} is outside the range of {dtype.name}")
    return number


def exact_array(values: Any, dtype: Any) -> np.ndarray:
    """`values` as a flat `dtype` array, refusing any value the conversion would change and
    anything that is not numbers (objects, strings, complex)."""
    dtype = np.dtype(dtype)
    arr = values if isinstance(values, np.ndarray) else np.asarray(values)
    if arr.dtype == dtype:
        return arr.reshape(-1)
    if arr.dtype.kind in "fO" and not isinstance(values, np.ndarray) and dtype.kind in "iu":
        # Python ints past int64 arrive as float64 or objects: convert them one by one, exactly.
        return np.array([exact_int(v, dtype) for v in np.array(values, dtype=object).reshape(-1)], dtype)
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"{arr.dtype} values cannot be copied to device memory (numbers only)")
    if dtype.kind not in "iu":
        return arr.astype(dtype).reshape(-1)
    if arr.dtype.kind == "f":
        raise ValueError(f"{arr.dtype.name} values given for a {dtype.name} buffer")
    for extreme in (arr.min(), arr.max()) if arr.size else ():
        exact_int(int(extreme), dtype)
    return arr.astype(dtype).reshape(-1)


def as_index(value: Any, what: str) -> int:
    """`value` as an int (ints and numpy integers, never floats), TypeError naming `what`."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, not {value!r}") from None


def device_allocation(engine: Engine, nbytes: int) -> tuple[PrimaryContext, int]:
    """A fresh cuMemAlloc of `nbytes` on the engine's device, and the context that must free it
    (the caller takes ownership with Handle._own). Refused inside a capture."""
    _no_alloc_in_capture(engine, "device memory")
    ctx = engine.activate()
    return ctx, int(ctx.call("cuMemAlloc", nbytes))


def _no_alloc_in_capture(engine: Engine, what: str) -> None:
    if engine.capturing_graph is not None:
        raise CaptureError(f"{what} cannot be allocated inside a graph capture (the driver forbids it while "
                           "the stream is captured): allocate before capturing")


def _c_contiguous(shape: tuple[int, ...], strides: Any, itemsize: int) -> bool:
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(tuple(strides))):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


def _device_of(ptr: int) -> int:
    """The ordinal of the device `ptr` lives on; ValueError for host memory."""
    attr = driver().CUpointer_attribute
    try:
        kind = call("cuPointerGetAttribute", attr.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr)
    except Exception:
        raise ValueError(f"{ptr:#x} is not device memory the driver knows") from None
    if int(kind) != int(driver().CUmemorytype.CU_MEMORYTYPE_DEVICE):
        raise ValueError(f"{ptr:#x} is host memory, not device memory")
    # The device of the context that owns the memory: DEVICE_ORDINAL answers 0 for device 1's
    # memory (seen with cuda-bindings 13.3 on two H200s); memory no context owns (virtual memory
    # management) has only the ordinal to go by.
    ctx = call("cuPointerGetAttribute", attr.CU_POINTER_ATTRIBUTE_CONTEXT, ptr)
    if not int(ctx):
        return int(call("cuPointerGetAttribute", attr.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr))
    drv = driver()
    call("cuCtxPushCurrent", ctx)
    try:
        return int(call("cuCtxGetDevice"))
    finally:
        drv.cuCtxPopCurrent()

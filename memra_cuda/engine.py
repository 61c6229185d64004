"""Engine: one device's primary context, one stream, copies and the counters that prove
how often the host waited on the GPU."""
from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from .buffer import DeviceBuffer, PinnedBuffer, exact_array, exact_int
from .context import PrimaryContext
from .errors import call, driver
from .event import Event
from .module import Module, packaged_ptx


class Engine:
    """Driver-level access to one GPU.

    Every call makes the engine's context current first, so engines on several devices can be
    used from one thread. All work goes onto one non-blocking stream: stream order is the only
    ordering the round-stream machinery relies on. `readbacks` counts device-to-host transfers
    the host waited for and `syncs` explicit stream synchronisations, so "one readback per
    burst" can be asserted rather than believed.
    """

    def __init__(self, device: int = 0):
        self.ctx = PrimaryContext(device)
        self.ctx.make_current()
        drv = driver()
        self.stream = call("cuStreamCreate", drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
        self.stream_handle = int(self.stream)
        self._finalizer = weakref.finalize(self, self.ctx.finalize, "cuStreamDestroy", self.stream)
        self.readbacks = 0
        self.syncs = 0
        self._modules: dict[str, Module] = {}

    @property
    def device(self) -> int:
        return self.ctx.device

    @property
    def multiprocessors(self) -> int:
        """Streaming multiprocessors on the device: how wide a grid-wide kernel should be."""
        attr = driver().CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
        return int(call("cuDeviceGetAttribute", attr, self.ctx.cu_device))

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def activate(self, force: bool = False) -> PrimaryContext:
        """Make this engine's context current (force: even if we believe it already is)."""
        if not self._finalizer.alive:
            raise ValueError("Engine is closed")
        self.ctx.make_current(force)
        return self.ctx

    # -- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        """Finish queued work and destroy the stream; buffers still alive keep the context."""
        if not self.closed:
            self.synchronize()
            self._finalizer()
            self._modules.clear()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- memory ---------------------------------------------------------------------------
    def alloc(self, dtype: Any, length: int, zeroed: bool = False) -> DeviceBuffer:
        buf = DeviceBuffer.allocate(self, dtype, length)
        if zeroed:
            self.memset(buf, 0)
        return buf

    def alloc_u32_zeroed(self, length: int) -> DeviceBuffer:
        return self.alloc(np.uint32, length, zeroed=True)

    def alloc_i32_zeroed(self, length: int) -> DeviceBuffer:
        return self.alloc(np.int32, length, zeroed=True)

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        self.activate()
        free, total = call("cuMemGetInfo")
        return int(free), int(total)

    def pinned(self, dtype: Any, length: int) -> PinnedBuffer:
        return PinnedBuffer(self, dtype, length)

    # -- host to device -------------------------------------------------------------------
    def htod(self, values: Any, dtype: Any = None) -> DeviceBuffer:
        """A new device buffer holding `values` (queued on the stream)."""
        host = np.ascontiguousarray(values if dtype is None else exact_array(values, dtype)).reshape(-1)
        buf = self.alloc(host.dtype, host.size)
        self.copy_htod(buf, host)
        return buf

    def htod_u32(self, values: Any) -> DeviceBuffer:
        return self.htod(values, np.uint32)

    def htod_i32(self, values: Any) -> DeviceBuffer:
        return self.htod(values, np.int32)

    def htod_u64(self, values: Any) -> DeviceBuffer:
        return self.htod(values, np.uint64)

    def copy_htod(self, dst: DeviceBuffer, values: Any, start: int = 0) -> None:
        """Write `values` into dst[start:start+len(values)], converted to dst's dtype."""
        host = np.ascontiguousarray(exact_array(values, dst.dtype))
        if not 0 <= start or start + host.size > dst.len:
            raise ValueError(f"writing {host.size} elements at {start} overruns a buffer of {dst.len}")
        if host.size:
            self.activate()
            offset = start * dst.dtype.itemsize
            call("cuMemcpyHtoDAsync", dst.ptr + offset, host, host.nbytes, self.stream)

    def set_u32(self, buf: DeviceBuffer, index: int, value: int) -> None:
        """Set one 32-bit word on the stream (a memset node when captured)."""
        if buf.dtype.itemsize != 4:
            raise ValueError(f"set_u32 needs a 32-bit buffer, not {buf.dtype.name}")
        if not 0 <= index < buf.len:
            raise ValueError(f"index {index} is outside a buffer of {buf.len}")
        value = exact_int(value, buf.dtype if buf.dtype.kind in "iu" else np.uint32)
        ptr = buf.ptr + 4 * index
        self.activate()
        call("cuMemsetD32Async", ptr, value & 0xFFFFFFFF, 1, self.stream)

    def memset(self, buf: DeviceBuffer, value: int) -> None:
        """Fill an integer buffer of 8-, 16- or 32-bit elements with `value` (any buffer with 0)."""
        size, ptr = buf.dtype.itemsize, buf.ptr
        if value != 0 and (size > 4 or buf.dtype.kind not in "iu"):
            raise ValueError(f"memset of {buf.dtype.name} elements supports only 0")
        bits = exact_int(value, buf.dtype) & ((1 << 8 * size) - 1) if value else 0
        self.activate()
        if value == 0 or size == 1:
            call("cuMemsetD8Async", ptr, bits, buf.nbytes, self.stream)
        elif size == 2:
            call("cuMemsetD16Async", ptr, bits, buf.len, self.stream)
        else:
            call("cuMemsetD32Async", ptr, bits, buf.len, self.stream)

    # -- device to host -------------------------------------------------------------------
    def dtoh(self, buf: DeviceBuffer, dtype: Any = None) -> np.ndarray:
        """Wait for the stream and copy `buf` back (one readback), as `dtype` of the same size
        (u32 of an i32 buffer, say) if given."""
        ptr = buf.ptr
        if dtype is not None and np.dtype(dtype).itemsize != buf.dtype.itemsize:
            raise ValueError(f"cannot read {buf!r} as {np.dtype(dtype).name}")
        self._no_capture("dtoh")
        out = np.empty(buf.len, buf.dtype)
        call("cuMemcpyDtoHAsync", out, ptr, buf.nbytes, self.stream)
        call("cuStreamSynchronize", self.stream)
        self.readbacks += 1
        return out if dtype is None else out.view(dtype)

    def dtoh_u32(self, buf: DeviceBuffer) -> np.ndarray:
        return self.dtoh(buf, np.uint32)

    def dtoh_i32(self, buf: DeviceBuffer) -> np.ndarray:
        return self.dtoh(buf, np.int32)

    def dtoh_u64(self, buf: DeviceBuffer) -> np.ndarray:
        return self.dtoh(buf, np.uint64)

    def copy_dtoh_async(self, dst: PinnedBuffer, src: DeviceBuffer, start: int = 0) -> None:
        """Queue src → dst[start:] without waiting (capturable); finish_readback() waits."""
        if src.dtype.itemsize != dst.dtype.itemsize or start < 0 or start + src.len > dst.len:
            raise ValueError(f"{src!r} does not fit pinned {dst.dtype.name}[{dst.len}] at {start}")
        self.activate()
        call("cuMemcpyDtoHAsync", dst.ptr + start * dst.dtype.itemsize, src.ptr, src.nbytes, self.stream)

    def finish_readback(self, event: Event | None = None) -> None:
        """Wait for queued copies into pinned memory: one readback, however many copies.

        With `event` (recorded after the copies) only that far: work queued behind it runs on.
        """
        self._no_capture("finish_readback")
        if event is None:
            call("cuStreamSynchronize", self.stream)
        else:
            event.synchronize()
        self.readbacks += 1

    def synchronize(self) -> None:
        self._no_capture("synchronize")
        self.activate()
        call("cuStreamSynchronize", self.stream)
        self.syncs += 1

    @property
    def capturing(self) -> bool:
        """Whether the stream is being captured into a graph (host waits are illegal then)."""
        self.activate()
        status = call("cuStreamIsCapturing", self.stream)
        return status != driver().CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE

    def _no_capture(self, what: str) -> None:
        """Refuse a host wait during capture (also makes the context current)."""
        if self.capturing:
            raise RuntimeError(f"{what} waits for the GPU, which cannot happen inside a graph capture")

    # -- modules --------------------------------------------------------------------------
    def load_ptx(self, name: str) -> Module:
        """The module built from ptx/<name>.cu, loaded once per engine."""
        if name not in self._modules:
            self._modules[name] = Module(self, packaged_ptx(name))
        return self._modules[name]

    def __repr__(self) -> str:
        return f"Engine(device={self.device}{', closed' if self.closed else ''})"

"""Engine: one device's primary context, one stream, copies and the counters that prove
how often the host waited on the GPU."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from .buffer import DeviceBuffer, PinnedBuffer, as_buffer, as_index, exact_array, exact_int
from .context import PrimaryContext
from .errors import CaptureError, CudaError, driver
from .event import Event
from .handle import Handle
from .module import Module, packaged_ptx

if TYPE_CHECKING:
    from .graph import Graph

log = logging.getLogger("memra_cuda")


class Engine(Handle):
    """Driver-level access to one GPU.

    Every call makes the engine's context current first, so engines on several devices can be
    used from one thread. All work goes onto one stream: stream order is the only ordering the
    round-stream machinery relies on. The stream is the engine's own (non-blocking), or one
    borrowed from the embedding framework (`stream=`: an int handle, a CUstream, or an object
    with `cuda_stream` such as a torch.cuda.Stream), which is never destroyed here; `wait()`
    joins another stream or an event without the host.

    `readbacks` counts device-to-host transfers the host waited for and `syncs` explicit
    stream synchronisations, so "one readback per burst" can be asserted rather than believed.

    Thread safety: an engine may be shared between threads for allocation, copies and frees
    (the counters are then approximate); its stream orders their work in the order the calls
    reach the driver. A capture belongs to the thread that runs it: do not queue work on the
    engine from other threads while a Graph is being captured.
    """

    def __init__(self, device: int = 0, stream: Any = None):
        self.ctx = PrimaryContext.of(as_index(device, "device"))
        self.ctx.adopt_thread()
        self.readbacks = 0
        self.syncs = 0
        self.capturing_graph: Graph | None = None  # set by Graph while it captures this stream
        self._modules: dict[str, Module] = {}
        self._join: Event | None = None
        self._peers: set[int] = set()  # devices this context has peer access to
        if stream is None:
            flags = driver().CUstream_flags.CU_STREAM_NON_BLOCKING
            self.stream = self.ctx.call("cuStreamCreate", flags)
            self._own(self.ctx, "cuStreamDestroy", self.stream)
        else:
            self.stream = as_stream(stream)
            self._check_stream_context()
        self.stream_handle = int(self.stream)

    def _check_stream_context(self) -> None:
        if int(self.stream) in (0, 1, 2):  # the legacy and per-thread default streams: any context
            return
        owner = self.ctx.call("cuStreamGetCtx", self.stream)
        if int(owner) != int(self.ctx.handle):
            raise ValueError(f"stream {int(self.stream):#x} belongs to another context than device {self.device}'s")

    @property
    def device(self) -> int:
        return self.ctx.device

    @property
    def borrowed(self) -> bool:
        """Whether the stream belongs to someone else (and is never destroyed here)."""
        return self._finalizer is None

    @property
    def multiprocessors(self) -> int:
        """Streaming multiprocessors on the device: how wide a grid-wide kernel should be."""
        attr = driver().CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
        return int(self.ctx.call("cuDeviceGetAttribute", attr, self.ctx.cu_device))

    @property
    def closed(self) -> bool:
        return self._freed

    def activate(self) -> PrimaryContext:
        """This engine's context, for a driver call made in it (ValueError once closed).
        PrimaryContext.call makes it current for that call alone."""
        if self._freed:
            raise ValueError("Engine is closed")
        return self.ctx

    # -- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        """Finish queued work and release the stream (an owned one); buffers still alive keep
        the context. Never raises: after a fault, or if the last work fails, it logs and
        releases what it can."""
        if self._freed:
            return
        if self.ctx.fault is None:
            try:
                self.synchronize()
            except Exception as exc:  # noqa: BLE001 - close() is cleanup: report, go on
                log.warning("memra_cuda: closing %r: %s", self, exc)
        super().free()
        self._modules.clear()

    def free(self) -> None:
        self.close()

    def __enter__(self) -> Engine:
        return self

    # -- buffers ----------------------------------------------------------------------------
    def check_owns(self, buf: DeviceBuffer, what: str = "buffer") -> None:
        """ValueError unless work on `buf` may be queued on this engine's stream: the buffer
        is this engine's, or foreign memory on this device."""
        if buf.engine is not None and buf.engine is not self:
            raise ValueError(f"{what} {buf!r} belongs to {buf.engine!r}, not {self!r}: its work is ordered "
                             "by that engine's stream")
        if buf.device is not None and buf.device != self.device:
            raise ValueError(f"{what} {buf!r} is memory of device {buf.device}, not of {self!r}")

    def buffer(self, obj: Any, what: str = "buffer") -> DeviceBuffer:
        """`obj` (a DeviceBuffer or a __cuda_array_interface__ object) as a buffer this engine
        may use, refusing memory of another engine or device."""
        buf = as_buffer(obj, what, self)
        self.check_owns(buf, what)
        return buf

    def alloc(self, dtype: Any, length: int, zeroed: bool = False, *, label: str | None = None) -> DeviceBuffer:
        buf = DeviceBuffer.allocate(self, dtype, length, label=label)
        if zeroed:
            self.memset(buf, 0)
        return buf

    def alloc_u32_zeroed(self, length: int, *, label: str | None = None) -> DeviceBuffer:
        return self.alloc(np.uint32, length, zeroed=True, label=label)

    def alloc_i32_zeroed(self, length: int, *, label: str | None = None) -> DeviceBuffer:
        return self.alloc(np.int32, length, zeroed=True, label=label)

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        free, total = self.activate().call("cuMemGetInfo")
        return int(free), int(total)

    def pinned(self, dtype: Any, length: int, *, label: str | None = None) -> PinnedBuffer:
        return PinnedBuffer(self, dtype, length, label=label)

    def _uses(self, *handles: Handle) -> None:
        """Queued work names `handles`: a graph being captured must hold them."""
        if self.capturing_graph is not None:
            self.capturing_graph.hold(*handles)

    # -- host to device -------------------------------------------------------------------
    def htod(self, values: Any, dtype: Any = None, *, label: str | None = None) -> DeviceBuffer:
        """A new device buffer holding `values` (queued on the stream)."""
        host = np.ascontiguousarray(values if dtype is None else exact_array(values, dtype)).reshape(-1)
        buf = self.alloc(host.dtype, host.size, label=label)
        self.copy_htod(buf, host)
        return buf

    def htod_u32(self, values: Any) -> DeviceBuffer:
        return self.htod(values, np.uint32)

    def htod_i32(self, values: Any) -> DeviceBuffer:
        return self.htod(values, np.int32)

    def htod_u64(self, values: Any) -> DeviceBuffer:
        return self.htod(values, np.uint64)

    def copy_htod(self, dst: Any, values: Any, start: int = 0) -> None:
        """Write `values` into dst[start:start+len(values)], converted to dst's dtype.

        Refused during a capture: the graph would read the host memory at every replay, long
        after this call's temporary copy is gone. Upload before capturing, or capture a
        device-to-device copy or a set_u32 instead."""
        dst = self.buffer(dst, "dst")
        host = np.ascontiguousarray(exact_array(values, dst.dtype))
        start = as_index(start, "start")
        if not 0 <= start or start + host.size > dst.len:
            raise ValueError(f"writing {host.size} elements at {start} overruns a buffer of {dst.len}")
        if host.size:
            self._no_capture("copy_htod", "reads pageable host memory, which a graph would read again at "
                                          "every replay after it is gone")
            offset = start * dst.dtype.itemsize
            self.ctx.call("cuMemcpyHtoDAsync", dst.ptr + offset, host, host.nbytes, self.stream)

    def set_u32(self, buf: Any, index: int, value: int, *, every: int = 0) -> None:
        """Set the 32-bit word at `index`, and with `every` > 0 each `every`-th word after it
        (one column of a row-major table: every ring count of a batch), as one memset (a memset
        node when captured)."""
        buf = self.buffer(buf)
        if buf.dtype.itemsize != 4:
            raise ValueError(f"set_u32 needs a 32-bit buffer, not {buf.dtype.name}")
        index, every = as_index(index, "index"), as_index(every, "every")
        if not 0 <= index < buf.len or every < 0:
            raise ValueError(f"index {index} (every {every}) is outside a buffer of {buf.len}")
        value = exact_int(value, buf.dtype if buf.dtype.kind in "iu" else np.uint32)
        ptr, ctx = buf.ptr + 4 * index, self.activate()
        if every:
            words = (buf.len - index + every - 1) // every
            ctx.call("cuMemsetD2D32Async", ptr, 4 * every, value & 0xFFFFFFFF, 1, words, self.stream)
        else:
            ctx.call("cuMemsetD32Async", ptr, value & 0xFFFFFFFF, 1, self.stream)
        self._uses(buf)

    def memset(self, buf: Any, value: int) -> None:
        """Fill an integer buffer of 8-, 16- or 32-bit elements with `value` (any buffer with 0)."""
        buf = self.buffer(buf)
        size, ptr = buf.dtype.itemsize, buf.ptr
        if value != 0 and (size > 4 or buf.dtype.kind not in "iu"):
            raise ValueError(f"memset of {buf.dtype.name} elements supports only 0")
        bits = exact_int(value, buf.dtype) & ((1 << 8 * size) - 1) if value else 0
        ctx = self.activate()
        if value == 0 or size == 1:
            ctx.call("cuMemsetD8Async", ptr, bits, buf.nbytes, self.stream)
        elif size == 2:
            ctx.call("cuMemsetD16Async", ptr, bits, buf.len, self.stream)
        else:
            ctx.call("cuMemsetD32Async", ptr, bits, buf.len, self.stream)
        self._uses(buf)

    def copy_to_peer(self, dst: DeviceBuffer, src: Any) -> None:
        """Queue src → dst on this engine's stream, where dst is memory of another engine, on
        this device or another (a pipeline stage's activations or accept state; capturable).
        The other engine must order its use of dst after this stream (engine.wait on an Event
        recorded after the copy); peer access between the devices is enabled on first use."""
        src = self.buffer(src, "src")
        if not isinstance(dst, DeviceBuffer) or dst.engine is None:
            raise ValueError(f"dst must be a DeviceBuffer of an engine, not {dst!r}")
        if dst.dtype.itemsize != src.dtype.itemsize or dst.len != src.len:
            raise ValueError(f"copying {src!r} to {dst!r}: sizes differ")
        ctx = self.activate()
        peer = dst.engine.ctx
        if peer is not ctx and peer.device not in self._peers:
            try:
                ctx.call("cuCtxEnablePeerAccess", peer.handle, 0)
            except CudaError as exc:
                if exc.name != "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED":
                    raise
            self._peers.add(peer.device)
        # Unified addressing names both devices' memory; unlike cuMemcpyPeerAsync, this copy
        # can be captured into a graph.
        ctx.call("cuMemcpyAsync", dst.ptr, src.ptr, src.nbytes, self.stream)
        self._uses(dst, src)

    # -- device to host -------------------------------------------------------------------
    def dtoh(self, buf: Any, dtype: Any = None) -> np.ndarray:
        """Wait for the stream and copy `buf` back (one readback), as `dtype` of the same size
        (u32 of an i32 buffer, say) if given."""
        buf = self.buffer(buf)
        ptr = buf.ptr
        if dtype is not None and np.dtype(dtype).itemsize != buf.dtype.itemsize:
            raise ValueError(f"cannot read {buf!r} as {np.dtype(dtype).name}")
        self._no_capture("dtoh", "waits for the GPU")
        out = np.empty(buf.len, buf.dtype)
        self.ctx.call("cuMemcpyDtoHAsync", out, ptr, buf.nbytes, self.stream)
        self.ctx.call("cuStreamSynchronize", self.stream)
        self.readbacks += 1
        return out if dtype is None else out.view(dtype)

    def dtoh_u32(self, buf: Any) -> np.ndarray:
        return self.dtoh(buf, np.uint32)

    def dtoh_i32(self, buf: Any) -> np.ndarray:
        return self.dtoh(buf, np.int32)

    def dtoh_u64(self, buf: Any) -> np.ndarray:
        return self.dtoh(buf, np.uint64)

    def copy_dtoh_async(self, dst: PinnedBuffer, src: Any, start: int = 0) -> None:
        """Queue src → dst[start:] without waiting (capturable); finish_readback() waits."""
        src = self.buffer(src, "src")
        if not isinstance(dst, PinnedBuffer) or dst.engine is not self:
            raise ValueError(f"dst must be pinned memory of {self!r}, not {dst!r}")
        start = as_index(start, "start")
        if src.dtype.itemsize != dst.dtype.itemsize or start < 0 or start + src.len > dst.len:
            raise ValueError(f"{src!r} does not fit pinned {dst.dtype.name}[{dst.len}] at {start}")
        self.activate().call("cuMemcpyDtoHAsync", dst.ptr + start * dst.dtype.itemsize, src.ptr, src.nbytes,
                             self.stream)
        self._uses(dst, src)

    def finish_readback(self, event: Event | None = None) -> None:
        """Wait for queued copies into pinned memory: one readback, however many copies.

        With `event` (recorded after the copies) only that far: work queued behind it runs on.
        """
        self._no_capture("finish_readback", "waits for the GPU")
        if event is None:
            self.ctx.call("cuStreamSynchronize", self.stream)
        else:
            event.synchronize()
        self.readbacks += 1

    def synchronize(self) -> None:
        self._no_capture("synchronize", "waits for the GPU")
        self.ctx.call("cuStreamSynchronize", self.stream)
        self.syncs += 1

    # -- ordering against other streams ----------------------------------------------------
    def wait(self, other: Any) -> None:
        """Order this engine's stream after `other` without the host: after an Event's last
        record(), or after everything queued so far on another stream (a handle, a CUstream
        or an object with `cuda_stream`)."""
        ctx = self.activate()
        if isinstance(other, Event):
            other._usable()
            ctx.call("cuStreamWaitEvent", self.stream, other.handle, 0)
            return
        stream = as_stream(other)
        if _same_stream(int(stream), self.stream_handle):
            return
        if self._join is None:
            self._join = Event(self, timing=False)
        ctx.call("cuEventRecord", self._join.handle, stream)
        ctx.call("cuStreamWaitEvent", self.stream, self._join.handle, 0)

    @property
    def capturing(self) -> bool:
        """Whether the stream is being captured into a graph (host waits are illegal then)."""
        status = self.activate().call("cuStreamIsCapturing", self.stream)
        return status != driver().CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE

    def _no_capture(self, what: str, why: str) -> None:
        """Refuse work a graph cannot hold during capture (also makes the context current)."""
        if self.capturing:
            raise CaptureError(f"{what} {why}: it cannot happen inside a graph capture")

    # -- modules --------------------------------------------------------------------------
    def load_ptx(self, name: str) -> Module:
        """The module built from ptx/<name>.cu, loaded once per engine (again if unloaded)."""
        module = self._modules.get(name)
        if module is None or module.freed:
            module = self._modules[name] = Module(self, packaged_ptx(name))
        return module

    def __repr__(self) -> str:
        return f"Engine(device={self.device}{', closed' if self.closed else ''})"


def as_stream(stream: Any) -> Any:
    """A CUstream from an int handle, a CUstream, or an object with `cuda_stream` (PyTorch)."""
    drv = driver()
    if isinstance(stream, drv.CUstream):
        return stream
    handle = getattr(stream, "cuda_stream", stream)
    try:
        return drv.CUstream(as_index(handle, "stream"))
    except TypeError:
        raise TypeError(f"a stream must be an int handle, a CUstream or have `cuda_stream`, not {stream!r}") from None


def _same_stream(a: int, b: int) -> bool:
    """0 and 1 both name the legacy default stream."""
    return (a or 1) == (b or 1)

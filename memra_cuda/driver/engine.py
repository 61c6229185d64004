"""Engine: a Stream with memory, copies and modules on top, the facade engines embed."""
from __future__ import annotations

import reprlib
from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from .buffer import BufferLike, DeviceBuffer, PinnedBuffer, as_buffer
from .call import Prepared
from .errors import CaptureError, CudaError, CudaUnavailable, driver
from .event import Event
from .framework import DRIVER, Framework
from .module import Module, packaged_ptx, ptx_name
from .signature import Signature
from .stream import Stream
from .values import as_flag, as_index, device_dtype, exact_array, exact_int, host_array, past_int64


# The least compute capability memra's own kernels serve: their PTX targets sm_80 (ptx/), which a
# driver compiles for that GPU or a newer one, and refuses below it (CUDA_ERROR_NO_BINARY_FOR_GPU).
# The rest of the driver layer (buffers, copies, graphs, a module of the caller's own PTX) serves any
LEAST_CAPABILITY = (8, 0)


def capability_refusal(device: int, major: int, minor: int) -> str | None:
    """Why device `device`, of compute capability `major`.`minor`, cannot run memra's own
    kernels, or None where it can: said as the first of them loads, in one line."""
    if (major, minor) >= LEAST_CAPABILITY:
        return None
    least = ".".join(map(str, LEAST_CAPABILITY))
    return (f"device {device} is of compute capability {major}.{minor}, and memra_cuda's kernels need "
            f"{least} or later (an Ampere GPU or newer: their PTX targets sm_80, which the driver cannot "
            f"compile for it)")


class Engine(Stream):
    """Driver-level access to one GPU: its primary context, one stream (see Stream), device
    memory, copies and the PTX modules loaded into the context.

    Every call makes the engine's context current for that call alone, so engines on several
    devices can be used from one thread. Copies that the per-round path repeats can be
    prepared once (prepare_dtoh, prepare_set_u32) and issued at the cost of the bare binding.
    """

    def __init__(self, device: int = 0, stream: Any = None, framework: Framework = DRIVER):
        super().__init__(device, stream, framework)
        self._modules: dict[str, Module] = {}
        self._peers: set[int] = set()  # devices this context has peer access to

    def close(self) -> None:
        super().close()
        self._modules.clear()

    # -- buffers ----------------------------------------------------------------------------
    def buffer(self, obj: BufferLike, what: str = "buffer") -> DeviceBuffer:
        """`obj` (a DeviceBuffer or a __cuda_array_interface__ object) as a buffer this engine
        may use, refusing memory of another engine or device."""
        buf = as_buffer(obj, what, self)
        self.check_owns(buf, what)
        buf.queued_on(self)
        return buf

    def alloc(self, dtype: DTypeLike, length: int, zeroed: bool = False, *, label: str | None = None) -> DeviceBuffer:
        """A new owned buffer of `length` elements of `dtype`, freed exactly once (free(), a `with`
        block, or collection); `zeroed` queues a memset to 0 on the stream (what zeros() does)."""
        zeroed = as_flag(zeroed, "zeroed")  # "False" was read by its truth: a memset asked for none
        buf = DeviceBuffer.allocate(self, dtype, length, label=label)
        if zeroed:
            self.memset(buf, 0)
        return buf

    def zeros(self, dtype: DTypeLike, length: int, *, label: str | None = None) -> DeviceBuffer:
        """A new buffer of `length` zeros."""
        return self.alloc(dtype, length, zeroed=True, label=label)

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        free, total = self.activate().call("cuMemGetInfo")
        return int(free), int(total)

    def pinned(self, dtype: DTypeLike, length: int, *, label: str | None = None) -> PinnedBuffer:
        """A PinnedBuffer of `length` elements of page-locked host memory: the target of an
        asynchronous or captured readback (copy_dtoh_async), which pageable memory cannot be."""
        return PinnedBuffer(self, dtype, length, label=label)

    # -- host to device -------------------------------------------------------------------
    def htod(self, values: ArrayLike, dtype: DTypeLike | None = None, *, label: str | None = None) -> DeviceBuffer:
        """A new device buffer holding `values` (queued on the stream), of `dtype` or, where None,
        of the type numpy reads them as: checked by exact_array either way, so a masked array's
        masked values are not sent and bools among ints not stored as 1 (both were, without a
        dtype, silently). Ints past int64 without a dtype are a ValueError: numpy reads a list of
        them ([2**63 + 1, 1], a u64 beside an int) as float64, and they were sent rounded, silently."""
        if dtype is None:
            dtype = host_array(values).dtype  # a ragged list refused naming it, as exact_array refuses it
            if dtype.kind in "fO" and np.size(values) and past_int64(values):
                raise ValueError(f"ints past int64 given without a dtype, which numpy reads as {dtype.name}: give one "
                                 f"(htod(values, np.uint64)), not {reprlib.repr(values)}")
        host = np.ascontiguousarray(exact_array(values, dtype)).reshape(-1)
        buf = self.alloc(host.dtype, host.size, label=label)
        self.copy_htod(buf, host)
        return buf

    def copy_htod(self, dst: BufferLike, values: ArrayLike, start: int = 0) -> None:
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
            self.no_capture("copy_htod", "reads pageable host memory, which a graph would read again at "
                                          "every replay after it is gone")
            offset = start * dst.dtype.itemsize
            self.ctx.call("cuMemcpyHtoDAsync", dst.ptr + offset, host, host.nbytes, self.stream)

    def set_u32(self, buf: BufferLike, index: int, value: int, *, every: int = 0) -> None:
        """Set the 32-bit word at `index`, and with `every` > 0 each `every`-th word after it
        (one column of a row-major table: every ring count of a batch), as one memset (a memset
        node when captured)."""
        self.prepare_set_u32(buf, index, value, every=every)()

    def prepare_set_u32(self, buf: BufferLike, index: int, value: int, *, every: int = 0) -> Prepared:
        """set_u32, checked once, to issue again and again (see Prepared)."""
        buf = self.buffer(buf)
        if buf.dtype.itemsize != 4:
            raise ValueError(f"set_u32 needs a 32-bit buffer, not {buf.dtype.name}")
        index, every = as_index(index, "index"), as_index(every, "every")
        if not 0 <= index < buf.len or every < 0:
            raise ValueError(f"index {index} (every {every}) is outside a buffer of {buf.len}")
        bits = exact_int(value, buf.dtype if buf.dtype.kind in "iu" else np.uint32) & 0xFFFFFFFF
        ptr, drv = buf.ptr + 4 * index, driver()
        if every:
            words = (buf.len - index + every - 1) // every
            return Prepared(self, drv.cuMemsetD2D32Async, "cuMemsetD2D32Async",
                            (ptr, 4 * every, bits, 1, words, self.stream), (buf,))
        return Prepared(self, drv.cuMemsetD32Async, "cuMemsetD32Async", (ptr, bits, 1, self.stream), (buf,))

    def memset(self, buf: BufferLike, value: int) -> None:
        """Fill an integer buffer of 8-, 16- or 32-bit elements with `value` (any buffer with 0).
        `value` is an int (a numpy integer too), by exact_int's rules, as set_u32's: a float is
        refused (ValueError), 0.0 too, and a bool (TypeError), False too; both were taken as 0."""
        buf = self.buffer(buf)
        dtype = buf.dtype
        size, ptr = dtype.itemsize, buf.ptr
        # an int, 0 above all (zeros()), costs the type test alone
        number = value if type(value) is int else _memset_value(value, dtype)
        if number and (size > 4 or dtype.kind not in "iu"):
            raise ValueError(f"memset of {dtype.name} elements supports only the int 0, not {value!r}")
        bits = exact_int(number, dtype) & ((1 << 8 * size) - 1) if number else 0
        ctx = self.activate()
        if number == 0 or size == 1:
            ctx.call("cuMemsetD8Async", ptr, bits, buf.nbytes, self.stream)
        elif size == 2:
            ctx.call("cuMemsetD16Async", ptr, bits, buf.len, self.stream)
        else:
            ctx.call("cuMemsetD32Async", ptr, bits, buf.len, self.stream)
        self._uses(buf)

    def copy_to_peer(self, dst: DeviceBuffer, src: BufferLike) -> None:
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
    def dtoh(self, buf: BufferLike, dtype: DTypeLike | None = None) -> np.ndarray:
        """Wait for the stream and copy `buf` back (one readback), as `dtype` of the same size
        (u32 of an i32 buffer, say) if given: an element type device memory holds (device_dtype),
        so a big-endian one (">u4": every word byte-swapped), text ("S4", "U1") or a complex is
        refused, not a reading of the words as it."""
        buf = self.buffer(buf)
        ptr = buf.ptr
        dtype = None if dtype is None else device_dtype(dtype)
        if dtype is not None and dtype.itemsize != buf.dtype.itemsize:
            raise ValueError(f"cannot read {buf!r} as {dtype.name}")
        self.no_capture("dtoh", "waits for the GPU")
        out = np.empty(buf.len, buf.dtype)
        # A copy to pageable memory waits for the stream itself: a host wait, which the guards see.
        self.host_wait(self.ctx.call, "cuMemcpyDtoHAsync", out, ptr, buf.nbytes, self.stream)
        self._wait_host()
        self.readbacks += 1
        return out if dtype is None else out.view(dtype)

    def copy_dtoh_async(self, dst: PinnedBuffer, src: BufferLike, start: int = 0) -> None:
        """Queue src → dst[start:] without waiting (capturable); finish_readback() waits."""
        self.prepare_dtoh(dst, src, start)()

    def prepare_dtoh(self, dst: PinnedBuffer, src: BufferLike, start: int = 0) -> Prepared:
        """copy_dtoh_async, checked once, to issue again and again (see Prepared): the one
        readback copy of every burst."""
        src = self.buffer(src, "src")
        if not isinstance(dst, PinnedBuffer) or dst.engine is not self:
            raise ValueError(f"dst must be pinned memory of {self!r}, not {dst!r}")
        start = as_index(start, "start")
        if src.dtype.itemsize != dst.dtype.itemsize or start < 0 or start + src.len > dst.len:
            raise ValueError(f"{src!r} does not fit pinned {dst.dtype.name}[{dst.len}] at {start}")
        argv = (dst.ptr + start * dst.dtype.itemsize, src.ptr, src.nbytes, self.stream)
        return Prepared(self, driver().cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync", argv, (dst, src))

    def finish_readback(self, event: Event | None = None) -> None:
        """Wait for queued copies into pinned memory: one readback, however many copies.

        With `event` (recorded after the copies) only that far: work queued behind it runs on.
        A wait inside a capture is a CaptureError (memra's capture is refused here; a
        framework's, by the driver, whose refusal is reported as such).
        """
        if self.capture_hold is not None:
            raise CaptureError("finish_readback waits for the GPU: it cannot happen inside a graph capture")
        if event is None:
            self._wait_host()
        else:
            event.synchronize()
        self.readbacks += 1

    # -- ordering against other streams ----------------------------------------------------
    def wait(self, other: Any) -> None:
        """Order this engine's stream after `other` without the host: after an Event's last
        record(), or after everything queued so far on another stream (a handle, a CUstream,
        an object speaking __cuda_stream__ or one with `cuda_stream`; see Stream.wait_stream).

        An event recorded inside a graph's capture on another engine joins this stream to that
        capture: its work is then the graph's, and the graph holds what it names only where this
        engine is one of the capture's `joined` engines (a RoundStream's stages are). Elsewhere,
        CaptureError before the wait: the graph would replay work over memory it does not hold.
        The other way round, a stream being captured waits only on work of its own capture: CUDA
        forbids a wait on an event recorded outside it (before it began, say), or on a stream not
        in it, and invalidates the capture; CaptureError before the wait here too."""
        if isinstance(other, Event):
            other._usable()
            self._joins(other.engine)
            if self.capture_hold is not None:
                self._waits_inside(other.recorded_in(self.capture_hold), other)
            self.activate().call("cuStreamWaitEvent", self.stream, other.handle, 0)
        else:
            if isinstance(other, Stream):
                self._joins(other)
            if self.capture_hold is not None:  # a stream of the capture: memra's joined, or forked in by hand
                self._waits_inside((isinstance(other, Stream) and other.capture_hold is self.capture_hold)
                                   or (getattr(other, "capture_hold", None) is None and self.captures(other)),
                                   other)
            self.wait_stream(other)

    def _joins(self, other: Stream) -> None:
        """CaptureError where a wait after `other`'s stream would join a capture under way there
        that this engine is not one of (Graph's `joined`): its launches would hold nothing."""
        hold = other.capture_hold
        if hold is not None and hold is not self.capture_hold:
            raise CaptureError(f"{self!r} would wait on a graph being captured on {other!r} that does not hold its "
                               "work (what it names could be freed under the graph): capture with this engine among "
                               "the graph's joined engines (Graph(engine, issue, joined=[...]))")

    def _waits_inside(self, inside: bool, other: Any) -> None:
        """CaptureError where this stream is being captured and `other` (what it would wait on)
        is not `inside` its capture. Asked only during a capture of memra's, never a round."""
        if not inside and self.capturing:
            raise CaptureError(f"{self!r} is being captured and would wait on {other!r}, which is not of its capture "
                               "(an event recorded outside it, before it began say, or a stream not in it): CUDA "
                               "forbids the wait and invalidates the capture; wait before capturing, or record the "
                               "event inside the capture")

    # -- modules --------------------------------------------------------------------------
    def load_ptx(self, name: str, signatures: Mapping[str, Signature] | None = None) -> Module:
        """The module built from ptx/<name>.cu, loaded once per engine (again if unloaded), its
        kernels checked against `signatures` from the first call that gives them (the package's
        own table: memra_cuda.kernels.signatures, whose `load` passes it). `name` is a stem of ptx/,
        an identifier (ptx_name): TypeError or ValueError naming it otherwise."""
        name = ptx_name(name)  # before the cache: a list met "unhashable type", "../x" reached outside ptx/
        module = self._modules.get(name)
        if module is None or module.freed:
            refusal = capability_refusal(self.device, *self.capability)
            if refusal:
                raise CudaUnavailable(refusal, call="cuModuleLoadData")
            module = self._modules[name] = Module(self, packaged_ptx(name), signatures)
        elif signatures is not None:
            module.declare(signatures)
        return module


def _memset_value(value: Any, dtype: np.dtype) -> int:
    """memset's `value`, given as something other than an int, as one by exact_int's rules (a
    float, 0.0 too, ValueError; a bool, False too, TypeError: `value != 0` was asked first, and
    took both as 0): within `dtype`'s range for an integer buffer; for a float or a bool one, whose
    one value is the int 0, refused in memset's own words (exact_int's would name int64)."""
    if dtype.kind in "iu":
        return exact_int(value, dtype)
    try:
        return exact_int(value, np.int64)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"memset of {dtype.name} elements supports only the int 0, not {value!r}") from None


def as_engine(engine: object, what: str = "engine") -> Engine:
    """`engine` if it is an Engine, else TypeError naming `what`: for what allocates on an engine
    it is given (StreamBufs, a KV layer, a table), before anything is asked of it, so a wrong one
    (None, a stream, a torch device) is named rather than failing on an attribute it lacks."""
    if not isinstance(engine, Engine):
        raise TypeError(f"{what} must be an Engine, not {engine!r}")
    return engine

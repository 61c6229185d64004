"""Stream: one device's primary context and one CUDA stream, the ground every buffer, module,
launch, event and graph stands on (an Engine is a Stream with copies and modules on top).

Stream order is the only ordering round-stream relies on, so everything queued here goes onto
this one stream. The stream is the Stream's own (non-blocking, destroyed once) or borrowed
from an embedding framework (`stream=`: an int handle, a CUstream, an object speaking the CUDA
stream protocol `__cuda_stream__`, or one with `cuda_stream` such as a torch.cuda.Stream); a
borrowed one is never destroyed here, and the object it came from is kept alive with it, so
the handle cannot be recycled under us.
"""
from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

from .context import PrimaryContext, relaxed_capture
from .errors import CaptureError, CudaError, driver
from .framework import DRIVER, Framework
from .handle import Handle
from .release import AtCollection, StreamEnd, drain
from .values import U64_MOST, as_size

log = logging.getLogger("memra_cuda")

# Errors with which the driver refuses a host wait inside a capture: synchronize() reports them
# as CaptureError (checked on failure, so a wait costs nothing more than the wait).
_CAPTURE_ERRORS = frozenset({"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
                             "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT", "CUDA_ERROR_CAPTURED_EVENT"})


class Stream(Handle):
    """A context and a stream to queue work on; the counters prove how often the host waited.

    `readbacks` counts device-to-host transfers the host waited for and `syncs` explicit
    stream synchronisations, so "one readback per burst" can be asserted rather than believed.
    `capture_hold` is set while a Graph captures this stream: whatever queues work naming a
    handle passes it there, so the graph holds the memory its nodes address. `framework` is the
    policy of whoever owns the memory the work uses (framework.py): how graphs are captured and
    the model's work scoped.

    Thread safety: a Stream may be shared between threads for allocation, copies and frees
    (the counters are then approximate); the stream orders their work in the order the calls
    reach the driver. A capture belongs to the thread that runs it: do not queue work on the
    stream from other threads while a Graph is being captured.
    """

    _exported = False  # whether the handle was handed out (__cuda_stream__, a borrower): see close()

    def __init__(self, device: int = 0, stream: Any = None, framework: Framework = DRIVER):
        if not isinstance(framework, Framework):
            raise TypeError(f"framework must be a Framework (how graphs are captured, the model's work scoped), "
                            f"not {framework!r}")
        self.framework = framework
        # a device index below 0 names no device on any machine: refused before the driver is asked
        self.ctx = PrimaryContext.of(as_size(device, "device", 0))
        self.ctx.adopt_thread()
        self.readbacks = 0
        self.syncs = 0
        self.capture_hold: Callable[..., None] | None = None
        # What watches this stream's host waits (a Communicator's watchdog, docs/nccl.md): each
        # guard's begin() before a wait and end(error) after it, which may raise instead.
        self.guards: list[Any] = []
        self._stream_owner: Any = None
        if stream is None:
            flags = driver().CUstream_flags.CU_STREAM_NON_BLOCKING
            self._stream = self.ctx.call("cuStreamCreate", flags)
            self._end = StreamEnd(self.ctx)  # marked as its collection destroys it (release.StreamEnd)
            self._finalizer = weakref.finalize(self, _destroy, self.ctx, self._stream, self._end)
        else:
            self._stream = as_stream(stream)
            self._check_stream_context()
            if not isinstance(stream, (int, driver().CUstream)):
                self._stream_owner = stream  # its owner destroys the stream when it goes
            if isinstance(stream, Stream):
                stream._exported = True  # this one works on its handle: its close() must leave it (close)
                self._end = stream._end  # its end is the owner's: marked as the owner's collection destroys it
        self._stream_handle = int(self._stream)
        self._synchronize = driver().cuStreamSynchronize

    # The raw handle, read through `stream` and `stream_handle` while the stream is open: once
    # closed it is destroyed (or left to the consumer it was handed to) and may name another stream
    # by then, so both refuse, as a freed buffer's `ptr` does, by activate()'s one check. The
    # finalizer holds its own copy; memra's own calls read _stream once they have activated.
    _stream: Any = None
    _stream_handle = 0
    _end: StreamEnd | None = None  # an owned stream's end (a borrowed Stream's: its owner's), marked as destroyed

    @property
    def stream(self) -> Any:
        """The CUstream work is queued on; ValueError once closed (activate)."""
        self.activate()
        return self._stream

    @property
    def stream_handle(self) -> int:
        """The stream's raw handle, an int; ValueError once closed (activate)."""
        self.activate()
        return self._stream_handle

    def _check_stream_context(self) -> None:
        if int(self._stream) in (0, 1, 2):  # the legacy and per-thread default streams: any context
            return
        owner = self.ctx.call("cuStreamGetCtx", self._stream)
        if int(owner) != int(self.ctx.handle):
            raise ValueError(f"stream {int(self._stream):#x} belongs to another context than device {self.device}'s")

    @property
    def device(self) -> int:
        """The ordinal of the device this stream's context is on (0: the first GPU)."""
        return self.ctx.device

    @property
    def stream_owner(self) -> Any:
        """The object a borrowed stream came from (a torch.cuda.Stream, say), kept alive while
        the stream is used; None for an owned stream or one given as a bare handle."""
        return self._stream_owner

    def __cuda_stream__(self) -> tuple[int, int]:
        """The CUDA stream protocol (version 0, the raw handle): cuda.core, CuPy and others take
        this stream as it is. ValueError once closed: the destroyed handle may name another
        stream by then (an Engine.wait on a closed engine recorded an event onto it). The
        consumer keeps this object and works on the handle for as long as it likes, so the handle
        is exported: close() then leaves the stream to this object's collection (close)."""
        self.activate()
        self._exported = True
        return 0, self._stream_handle

    @property
    def borrowed(self) -> bool:
        """Whether the stream belongs to someone else (and is never destroyed here)."""
        return self._finalizer is None

    def _attribute(self, name: str) -> int:
        """The device's attribute CU_DEVICE_ATTRIBUTE_<name> (cuDeviceGetAttribute)."""
        attr = getattr(driver().CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")
        return int(self.ctx.call("cuDeviceGetAttribute", attr, self.ctx.cu_device))

    @property
    def multiprocessors(self) -> int:
        """Streaming multiprocessors on the device: how wide a grid-wide kernel should be."""
        return self._attribute("MULTIPROCESSOR_COUNT")

    @property
    def capability(self) -> tuple[int, int]:
        """The device's compute capability, (major, minor): (9, 0) for an H100 or H200."""
        return self._attribute("COMPUTE_CAPABILITY_MAJOR"), self._attribute("COMPUTE_CAPABILITY_MINOR")

    @property
    def closed(self) -> bool:
        """Whether close() (or free()) has run: the stream refuses every use from then on."""
        return self._freed

    def activate(self) -> PrimaryContext:
        """This stream's context, for a driver call made in it (ValueError once closed).
        PrimaryContext.call makes it current for that call alone."""
        if self._freed:
            raise ValueError(f"{self!r} is closed")
        return self.ctx

    # -- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        """Finish queued work and release the stream (an owned one); buffers still alive keep
        the context. Never raises: after a fault, or if the last work fails, it logs and
        releases what it can.

        A stream whose handle was handed out (__cuda_stream__: a cuda.core or CuPy stream made
        from this one, or an Engine borrowing it) is closed to memra at once, but destroyed (and
        a borrowed one's owner let go) only when this object is collected: the consumer keeps it,
        and destroyed now, the handle would name whatever stream the driver made next."""
        if self._freed:
            return
        if self.ctx.fault is None:
            try:
                self.synchronize()
            except Exception as exc:  # noqa: BLE001 - close() is cleanup: report, go on
                log.warning("memra_cuda: closing %r: %s", self, exc)
        if self._exported:
            self._retire()  # closed from now on, dependents poisoned; the stream not yet destroyed
        else:
            if self._end is not None and not self.borrowed:  # its own end: its work waited for (a handed-out
                self._end.wanted = False  # handle's users may queue more); a release of it lets go at once
            super().free()
            self._stream_owner = None
        drain()  # borrowed memory kept for this stream's work goes back, that work done (release.py)

    def free(self) -> None:
        self.close()

    # -- what may be queued here ----------------------------------------------------------
    def check_owns(self, buf: Any, what: str = "buffer") -> None:
        """ValueError unless work on `buf` (a DeviceBuffer) may be queued on this stream: the
        buffer is this stream's, or foreign memory on this device."""
        if buf.engine is not None and buf.engine is not self:
            raise ValueError(f"{what} {buf!r} belongs to {buf.engine!r}, not {self!r}: its work is ordered "
                             "by that engine's stream")
        if buf.device is not None and buf.device != self.device:
            raise ValueError(f"{what} {buf!r} is memory of device {buf.device}, not of {self!r}")

    def _uses(self, *handles: Handle) -> None:
        """Queued work names `handles`: a graph being captured must hold them."""
        if self.capture_hold is not None:
            self.capture_hold(*handles)

    @property
    def capturing(self) -> bool:
        """Whether the stream is being captured into a graph, by memra or anyone else."""
        return self.captures(self._stream)  # captures() activates: refused once closed

    def captures(self, stream: Any) -> bool:
        """Whether `stream` (anything as_stream takes; a stream of this context) is being captured
        into a graph, by memra or anyone else."""
        status = self.activate().call("cuStreamIsCapturing", as_stream(stream))
        return status != driver().CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE

    def no_capture(self, what: str, why: str) -> None:
        """CaptureError if the stream is being captured (by memra's Graph or a framework's):
        for work a graph cannot hold, refused before anything is queued."""
        if self.capture_hold is not None or self.capturing:
            raise CaptureError(f"{what} {why}: it cannot happen inside a graph capture")

    # -- waiting --------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait on the host until the stream has run everything queued so far."""
        if self.capture_hold is not None:
            raise CaptureError("synchronize waits for the GPU: it cannot happen inside a graph capture")
        self._wait_host()
        self.syncs += 1
        drain()  # borrowed memory kept for work now done goes back (release.py)

    def _wait_host(self) -> None:
        try:
            self.host_wait(self.activate().run, self._synchronize, "cuStreamSynchronize", (self._stream,))
        except CudaError as exc:
            if exc.name in _CAPTURE_ERRORS:
                raise CaptureError("a host wait cannot happen inside a graph capture (the driver refused it and "
                                   "invalidated the capture)") from exc
            raise

    def host_wait(self, wait: Callable[..., Any], *args: Any) -> Any:
        """`wait(*args)`, a call that blocks the host on this stream's work, bracketed by the
        stream's guards: a rank's communicator times such a wait and, where a peer failed,
        raises in place of what the wait returned (RankFailure), so that no wait on a dead
        peer's data hangs."""
        guards = tuple(self.guards)
        if not guards:
            return wait(*args)
        for guard in guards:
            guard.begin()
        error: BaseException | None = None
        try:
            return wait(*args)
        except BaseException as exc:
            error = exc
            raise
        finally:
            raised = None
            for guard in guards:  # every guard ends its wait, whichever raises
                try:
                    guard.end(error)
                except Exception as exc:  # noqa: BLE001 - the first is raised below
                    raised = raised or exc
            if raised is not None:
                raise raised

    def wait_stream(self, other: Any) -> None:
        """Order this stream after everything queued so far on `other` (anything as_stream
        takes), without the host."""
        self._order(as_stream(other), self.stream)

    def check_wait(self, other: int, what: str) -> None:
        """CaptureError, before anything is queued, unless this stream may wait on the stream of
        handle `other` (a producer's, named by an array interface, `what`): neither being captured,
        or both in one capture (CUDA joins them). Where only this one is captured, CUDA forbids the
        wait and invalidates the capture; where only `other` is, the wait would pull this stream
        into that capture (its work captured, not run, the capture left unjoined). Asked only
        where there is a stream to wait on: a cuStreamIsCapturing each (and their captures' ids
        where both are captured)."""
        if _same_stream(other, self.stream_handle):
            return
        try:
            mine, theirs = self.capturing, self.captures(other)
            if mine and theirs and self._capture_id(self._stream) == self._capture_id(other):
                return
        except CudaError as exc:
            if exc.name in _CAPTURE_ERRORS:  # the legacy stream asked while a blocking stream is captured
                raise CaptureError(f"{what} names {_stream_name(other)}, which cannot be waited on while a stream "
                                   f"is being captured: adopt the array before capturing") from exc
            raise
        if mine:
            raise CaptureError(f"{self!r} is being captured and {what} names {_stream_name(other)}, which is not of "
                               "its capture: CUDA forbids the wait there and invalidates the capture; adopt the "
                               "array before capturing (the captured work then uses its buffer as it is)")
        if theirs:
            raise CaptureError(f"{what} names {_stream_name(other)}, which is being captured and {self!r}'s stream "
                               "is not: the wait would pull this stream into that capture (its work captured, not "
                               "run); adopt the array before capturing, or with an engine on the capturing stream")

    def _capture_id(self, stream: Any) -> int:
        """The id of the capture `stream` (a stream of this context being captured) is in."""
        return int(self.activate().call("cuStreamGetCaptureInfo", as_stream(stream))[1])

    def precede(self, other: Any, what: str = "work") -> None:
        """Order what `other` (anything as_stream takes) queues from now on after everything
        queued so far on this stream, without the host: a consumer of this stream's buffers on a
        stream of its own (memra_cuda.torch.tensor). Refused while `other` is being captured
        (CaptureError naming `what`): a capture cannot wait on work queued outside it."""
        then = as_stream(other)
        if _same_stream(int(then), self.stream_handle):
            return
        if self.captures(then):
            raise CaptureError(f"{what} would order a stream being captured after {self!r}'s queued work, which the "
                               f"capture cannot wait for: do it before capturing")
        self._order(self.stream, then)

    def _mark(self) -> Any:
        """A new event recorded at the end of the stream, or None while the stream is captured
        (recorded there, an event marks a point of the graph, not the work queued before the
        capture): what a deferred release of borrowed memory waits for (release.py), the caller's
        to destroy. Made with the thread's capture mode relaxed: a release runs from a collection,
        inside anyone's capture (PrimaryContext.finalize)."""
        if self.capture_hold is not None:
            return None
        return self._marked(self.activate(), self._stream)

    @staticmethod
    def _marked(ctx: PrimaryContext, stream: Any) -> Any:
        """A new event recorded at the end of `stream` now, or None while it is captured (by anyone),
        asked with the thread's capture mode relaxed: _mark's, and an owned stream's finaliser's."""
        with relaxed_capture():
            if ctx.call("cuStreamIsCapturing", stream) != driver().CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE:
                return None
            return Stream._recorded(ctx, stream)

    @staticmethod
    def _recorded(ctx: PrimaryContext, stream: Any) -> Any:
        """A new event (no timing) recorded at the end of `stream` now, the caller's to destroy;
        destroyed here where the record fails."""
        event = ctx.call("cuEventCreate", int(driver().CUevent_flags.CU_EVENT_DISABLE_TIMING))
        try:
            ctx.call("cuEventRecord", event, stream)
        except BaseException:
            ctx.finalize("cuEventDestroy", event)
            raise
        return event

    def _order(self, first: Any, then: Any) -> None:
        """`then` after everything queued so far on `first` (CUstreams of this context). Each call
        records its own event, so waits from several threads never wait on each other's record."""
        if _same_stream(int(first), int(then)):
            return
        ctx = self.activate()
        event = self._recorded(ctx, first)
        try:
            ctx.call("cuStreamWaitEvent", then, event, 0)
        finally:
            ctx.call("cuEventDestroy", event)  # released once the wait is satisfied

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device}{', closed' if self.closed else ''})"


def as_engine_stream(engine: Any, what: str = "engine") -> Stream:
    """`engine` if it is a Stream (an Engine is one), else TypeError naming `what`: for what needs
    of an engine its context and stream alone (a Module, an Event, a Graph and its joined engines,
    a LoopBuilder, borrowed memory's ordering: DeviceBuffer.wrap), checked where it is given, so a
    wrong one (None, a torch stream or device) is named rather than failing later on an attribute
    it lacks. engine.py's as_engine, for what allocates, sits above the modules that ask this."""
    if not isinstance(engine, Stream):
        raise TypeError(f"{what} must be an Engine, not {engine!r}")
    return engine


def as_stream(stream: Any) -> Any:
    """A CUstream from a CUstream or anything handle_of takes."""
    drv = driver()
    return stream if isinstance(stream, drv.CUstream) else drv.CUstream(handle_of(stream))


def handle_of(stream: Any) -> int:
    """The raw handle of a stream given as an int, by the CUDA stream protocol
    (`__cuda_stream__()` -> (0, handle): cuda.core, CuPy and others), or by `cuda_stream`
    (PyTorch); TypeError naming the forms otherwise, ValueError for an int no handle is (below 0
    or past 64 bits: the binding's CUstream met "can't convert negative value to unsigned
    PY_LONG_LONG", an OverflowError naming nothing), as_size's range check naming the handle."""
    if isinstance(stream, Stream):  # read for a wait now, not handed out (__cuda_stream__ exports it)
        return stream.stream_handle  # refused once closed
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        given = protocol()
        if not (isinstance(given, tuple) and len(given) == 2 and given[0] == 0):
            raise TypeError(f"{stream!r}.__cuda_stream__() must return (0, handle), the protocol's version 0, "
                            f"not {given!r}")
        stream = given[1]
    try:
        return as_size(getattr(stream, "cuda_stream", stream), "a stream handle (an address)", 0, U64_MOST)
    except TypeError:
        raise TypeError(f"a stream must be an int handle, a CUstream, speak __cuda_stream__ or have `cuda_stream`, "
                        f"not {stream!r}") from None


def _destroy(ctx: PrimaryContext, stream: Any, end: StreamEnd) -> None:
    """An owned stream's finaliser: cuStreamDestroy, and first, unless close() waited for its work
    (or the interpreter is exiting), an event recorded at its end into `end`, for the releases of
    borrowed memory that its collection comes before (release.StreamEnd). Never raises."""
    end.destroyed = True
    if end.wanted and ctx.fault is None and not AtCollection.exiting:
        try:
            end.event = Stream._marked(ctx, stream)
        except Exception as exc:  # noqa: BLE001 - a finaliser must not raise
            log.warning("memra_cuda: marking the end of a stream collected unclosed failed: %s", exc)
    ctx.finalize("cuStreamDestroy", stream)


def _stream_name(handle: int) -> str:
    """A stream handle in words: 1 and 2 name the default streams (the array interface's values)."""
    return {1: "the legacy default stream", 2: "the per-thread default stream"}.get(handle, f"stream {handle:#x}")


def _same_stream(a: int, b: int) -> bool:
    """0 and 1 both name the legacy default stream."""
    return (a or 1) == (b or 1)

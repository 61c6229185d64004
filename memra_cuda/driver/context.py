"""The device's primary context, shared by every Engine on that device.

Everything that owns driver memory holds a reference to its PrimaryContext, so the context
outlives its last buffer (as in cudarc): closing an Engine never pulls memory out from under a
buffer that is still in use, and a finaliser never runs against a dead context.

Every driver call made on behalf of a context goes through `PrimaryContext.call`, which is
where a sticky fault is recognised and remembered: after an illegal address or a failed
launch, every later call on that device raises the same CudaFault, and cleanup skips the
driver instead of failing (or hanging) on a context that is gone.

Which context is current is per-thread driver state that other libraries share (PyTorch's
current device is the current context's). So no call here changes it for the caller: a call
on a context that is not current pushes it for that call alone and pops it after. (An Engine
made on a thread with no current context leaves its own current there: adopt_thread.) A thread on
the right context (one device, the common case) pays one cuCtxGetCurrent per call; engines on
two devices in one thread each get their own context, whatever anyone switched to in between.
Thread safety: a PrimaryContext may be shared by any number of threads.
"""
from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .errors import STICKY, CudaError, CudaFault, call, driver, error, values

log = logging.getLogger("memra_cuda")

# One PrimaryContext per device while anything holds it, so a fault seen by one engine is known
# to every engine on that device; and the first fault of each device for the life of the
# process, so an engine made after every other one is gone still knows its device is lost.
_live: weakref.WeakValueDictionary[int, PrimaryContext] = weakref.WeakValueDictionary()
_live_lock = threading.Lock()
_faults: dict[int, CudaFault] = {}


class PrimaryContext:
    """A retained primary context; released once, when the last owner lets go of it."""

    @classmethod
    def of(cls, device: int) -> PrimaryContext:
        with _live_lock:
            ctx = _live.get(device)
            if ctx is None:
                ctx = _live[device] = cls(device)
            return ctx

    def __init__(self, device: int):
        count = call("cuDeviceGetCount")
        if not 0 <= device < count:
            raise ValueError(f"device {device} does not exist: this machine has {count} CUDA device(s)")
        self.device = device
        self.fault: CudaFault | None = _faults.get(device)
        self.cu_device = call("cuDeviceGet", device)
        self.handle = call("cuDevicePrimaryCtxRetain", self.cu_device)
        self.address = int(self.handle)
        drv = driver()
        self._get_current, self._push, self._pop = drv.cuCtxGetCurrent, drv.cuCtxPushCurrent, drv.cuCtxPopCurrent
        weakref.finalize(self, _release_primary, self.cu_device, device)

    def make_current(self) -> None:
        """Leave this context current on the calling thread (for code that calls the driver
        itself, such as the bench's bare launches; memra's own calls do not need it). Not
        through call(), whose push and pop would undo it."""
        if self.fault is not None:
            raise self.fault.again("cuCtxSetCurrent")
        (err,) = driver().cuCtxSetCurrent(self.handle)
        if err:
            raise self.failure(err, "cuCtxSetCurrent")

    def adopt_thread(self) -> None:
        """Make this context current if the thread has none (no one else's choice to disturb),
        so later calls from this thread find it current and need not push it."""
        err, current = driver().cuCtxGetCurrent()
        if not err and int(current) == 0:
            self.make_current()

    def call(self, name: str, *args: Any) -> Any:
        """Call the driver function `name` with this context current; failures name the call."""
        return values(self.run(getattr(driver(), name), name, args))

    def run(self, fn: Callable[..., tuple], name: str, args: tuple) -> tuple:
        """`fn(*args)` (a driver binding) with this context current, its result checked: the
        path of every call memra makes, prepared ones included. A faulted device refuses
        before the driver is reached; the context is popped whatever the binding raises."""
        if self.fault is not None:
            raise self.fault.again(name)
        err, current = self._get_current()
        if not err and int(current) == self.address:
            result = fn(*args)
        else:
            (err,) = self._push(self.handle)
            if err:
                raise self.failure(err, "cuCtxPushCurrent")
            try:
                result = fn(*args)
            finally:
                self._pop()
        if result[0]:
            raise self.failure(result[0], name)
        return result

    def failure(self, err: Any, call: str) -> CudaError:
        """The exception for a failed call, remembering the first sticky fault."""
        exc = error(err, call)
        if exc.name not in STICKY:
            return exc
        if self.fault is None:
            self.fault = _faults.setdefault(self.device, CudaFault(exc, self.device))
            return self.fault
        return self.fault.again(call)

    def reached(self, event: Any) -> bool:
        """Whether the stream `event` (a CUevent of this context) was recorded on has run up to it,
        without waiting: cuEventQuery, whose NOT_READY is an answer, not a failure; Event.query's
        and a deferred release's of borrowed memory. Asked with the thread's capture mode relaxed,
        as a release is (finalize): release.py asks from a collection, inside anyone's capture."""
        if self.fault is not None:
            raise self.fault.again("cuEventQuery")
        drv = driver()
        with relaxed_capture():
            (err,) = drv.cuEventQuery(event)
        if err == drv.CUresult.CUDA_ERROR_NOT_READY:
            return False
        if err:
            raise self.failure(err, "cuEventQuery")
        return True

    def finalize(self, name: str, *args: Any) -> None:
        """Run a destroy/free call in this context, from any thread, never raising.

        Finalisers run from the garbage collector or at interpreter exit, where an exception
        has nowhere to go: failures are logged instead. After a fault nothing is released: the
        context is lost with everything in it, and the driver would only repeat the fault.

        The collector runs whenever Python allocates, inside someone's stream capture too (a
        user's torch.cuda.graph, another thread's): in CUDA's default capture mode ("global") the
        driver refuses a free or a destroy there and invalidates that capture, whose next call
        fails ("operation failed due to a previous error during capture"). So the call goes with
        the thread's capture mode relaxed (relaxed_capture), as torch's allocator calls the
        driver during a capture.
        """
        if self.fault is not None:
            return
        try:
            with relaxed_capture():
                self.call(name, *args)
        except CudaFault:
            log.debug("memra_cuda: %s skipped: device %d has faulted", name, self.device)
        except Exception as exc:  # noqa: BLE001 - a finaliser must not raise
            log.warning("memra_cuda: %s during cleanup failed: %s", name, exc)


@contextmanager
def relaxed_capture() -> Iterator[None]:
    """This thread's stream-capture mode relaxed while it lasts (cuThreadExchangeStreamCaptureMode:
    no context, never raises), then restored."""
    drv = driver()
    err, was = drv.cuThreadExchangeStreamCaptureMode(drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    try:
        yield
    finally:
        if not err:
            drv.cuThreadExchangeStreamCaptureMode(was)


def _release_primary(cu_device: Any, device: int) -> None:
    try:
        call("cuDevicePrimaryCtxRelease", cu_device)
    except Exception as exc:  # noqa: BLE001 - a finaliser must not raise
        log.warning("memra_cuda: releasing the primary context of device %d failed: %s", device, exc)

"""The device's primary context, shared by every Engine on that device.

Everything that owns driver memory holds a reference to its PrimaryContext, so the context
outlives its last buffer (as in cudarc): closing an Engine never pulls memory out from under a
buffer that is still in use, and a finaliser never runs against a dead context.

Every driver call made on behalf of a context goes through `PrimaryContext.call`, which is
where a sticky fault is recognised and remembered: after an illegal address or a failed
launch, every later call on that device raises the same CudaFault, and cleanup skips the
driver instead of failing (or hanging) on a context that is gone.

Thread safety: a PrimaryContext may be shared by any number of threads. Which context is
current is a per-thread driver state; each thread switches on its first call.
"""
from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from .errors import STICKY, CudaError, CudaFault, call, driver, error, values

log = logging.getLogger("memra_cuda")

# The context this library last made current on each thread. Switching costs a driver call,
# so it is skipped when the thread is already on the right context; code that switches contexts
# behind our back (another library on another device) should call Engine.activate(force=True).
_current = threading.local()

# One PrimaryContext per device while anything holds it: a fault seen by one engine is then
# known to every engine on that device.
_live: weakref.WeakValueDictionary[int, PrimaryContext] = weakref.WeakValueDictionary()
_live_lock = threading.Lock()


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
        self.fault: CudaFault | None = None
        self.cu_device = call("cuDeviceGet", device)
        self.handle = call("cuDevicePrimaryCtxRetain", self.cu_device)
        weakref.finalize(self, _release_primary, self.cu_device, device)

    def make_current(self, force: bool = False) -> None:
        ref = getattr(_current, "ref", None)
        if force or ref is None or ref() is not self:
            self.call("cuCtxSetCurrent", self.handle)
            _current.ref = weakref.ref(self)  # weak: the marker must not keep the context alive

    def call(self, name: str, *args: Any) -> Any:
        """Call the driver function `name` in this context's name; failures name the call."""
        if self.fault is not None:
            raise self.fault.again(name)
        result = getattr(driver(), name)(*args)
        if result[0]:
            raise self.failure(result[0], name)
        return values(result)

    def failure(self, err: Any, call: str, detail: str = "") -> CudaError:
        """The exception for a failed call, remembering the first sticky fault."""
        exc = error(err, call, detail)
        if exc.name not in STICKY:
            return exc
        if self.fault is None:
            self.fault = CudaFault(exc, self.device)
            return self.fault
        return self.fault.again(call)

    def finalize(self, name: str, *args: Any) -> None:
        """Run a destroy/free call with this context pushed, from any thread, never raising.

        Finalisers run from the garbage collector or at interpreter exit, where an exception
        has nowhere to go: failures are logged instead. After a fault nothing is released: the
        context is lost with everything in it, and the driver would only repeat the fault.
        """
        if self.fault is not None:
            return
        try:
            drv = driver()
            (err, *_) = drv.cuCtxPushCurrent(self.handle)
            if err:
                raise error(err, "cuCtxPushCurrent")
            try:
                self.call(name, *args)
            finally:
                drv.cuCtxPopCurrent()
        except CudaFault:
            log.debug("memra_cuda: %s skipped: device %d has faulted", name, self.device)
        except Exception as exc:  # noqa: BLE001 - a finaliser must not raise
            log.warning("memra_cuda: %s during cleanup failed: %s", name, exc)


def _release_primary(cu_device: Any, device: int) -> None:
    try:
        call("cuDevicePrimaryCtxRelease", cu_device)
    except Exception as exc:  # noqa: BLE001 - a finaliser must not raise
        log.warning("memra_cuda: releasing the primary context of device %d failed: %s", device, exc)

"""The device's primary context, shared by every Engine on that device.

Everything that owns driver memory holds a reference to its PrimaryContext, so the context
outlives its last buffer (as in cudarc): closing an Engine never pulls memory out from under a
buffer that is still in use, and a finaliser never runs against a dead context.
"""
from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from .errors import call, driver

log = logging.getLogger("memra_cuda")

# The context this library last made current on each thread. Switching costs a driver call,
# so it is skipped when the thread is already on the right context; code that switches contexts
# behind our back (another library on another device) should call Engine.activate() after.
_current = threading.local()


class PrimaryContext:
    """A retained primary context; released once, when the last owner lets go of it."""

    def __init__(self, device: int):
        count = call("cuDeviceGetCount")
        if not 0 <= device < count:
            raise ValueError(f"device {device} does not exist: this machine has {count} CUDA device(s)")
        self.device = device
        self.cu_device = call("cuDeviceGet", device)
        self.handle = call("cuDevicePrimaryCtxRetain", self.cu_device)
        weakref.finalize(self, _release_primary, self.cu_device, device)

    def make_current(self, force: bool = False) -> None:
        ref = getattr(_current, "ref", None)
        if force or ref is None or ref() is not self:
            call("cuCtxSetCurrent", self.handle)
            _current.ref = weakref.ref(self)  # weak: the marker must not keep the context alive

    def finalize(self, name: str, *args: Any) -> None:
        """Run a destroy/free call with this context pushed, from any thread, never raising.

        Finalisers run from the garbage collector or at interpreter exit, where an exception
        has nowhere to go: failures are logged instead.
        """
        try:
            drv = driver()
            (err, *_) = drv.cuCtxPushCurrent(self.handle)
            if err:
                raise RuntimeError(f"cuCtxPushCurrent: {err}")
            try:
                call(name, *args)
            finally:
                drv.cuCtxPopCurrent()
        except Exception as exc:  # noqa: BLE001 - a finaliser must not raise
            log.warning("memra_cuda: %s during cleanup failed: %s", name, exc)


def _release_primary(cu_device: Any, device: int) -> None:
    try:
        call("cuDevicePrimaryCtxRelease", cu_device)
    except Exception as exc:  # noqa: BLE001 - a finaliser must not raise
        log.warning("memra_cuda: releasing the primary context of device %d failed: %s", device, exc)

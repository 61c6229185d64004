"""CUDA events: a point in the stream the host can wait for, or time the device against."""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from .errors import call

if TYPE_CHECKING:
    from .engine import Engine


class Event:
    """An owned event on an engine's stream, destroyed exactly once like a buffer.

    Waiting on an event instead of the stream lets the host collect one burst while the next
    one is already running behind it.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        ctx = engine.activate()
        self.handle = call("cuEventCreate", 0)
        self._finalizer = weakref.finalize(self, ctx.finalize, "cuEventDestroy", self.handle)

    def record(self) -> None:
        """Mark the current end of the engine's stream."""
        self.engine.activate()
        call("cuEventRecord", self.handle, self.engine.stream)

    def synchronize(self) -> None:
        """Wait until the stream has reached the last record()."""
        self.engine.activate()
        call("cuEventSynchronize", self.handle)

    def elapsed_ms(self, start: Event) -> float:
        """Device milliseconds from `start` to this event (both recorded, this one waited for)."""
        self.synchronize()
        return float(call("cuEventElapsedTime", start.handle, self.handle))

    def free(self) -> None:
        self._finalizer()

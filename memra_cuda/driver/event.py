"""CUDA events: a point in the stream the host can wait for, or time the device against."""
from __future__ import annotations

import weakref
from typing import Any

from .errors import driver
from .handle import Handle
from .stream import Stream, as_engine_stream
from .values import as_flag


class Event(Handle):
    """An owned event on an engine's stream, destroyed exactly once like a buffer.

    Waiting on an event instead of the stream lets the host collect one burst while the next
    one is already running behind it; `Engine.wait(event)` joins another stream to it without
    the host. A destroyed event's handle can be reused by the driver for the next event, so
    every use after free is refused here.
    """

    # The capture (its hold, weakly: no graph kept alive) the last record() was queued in, if any:
    # a stream being captured may wait only on an event of its own capture (Engine.wait).
    _captured: weakref.ref | None = None

    def __init__(self, engine: Stream, *, timing: bool = True):
        timing = as_flag(timing, "timing")
        self.engine = as_engine_stream(engine)  # a wrong one met AttributeError 'activate', naming nothing
        ctx = engine.activate()
        flags = 0 if timing else int(driver().CUevent_flags.CU_EVENT_DISABLE_TIMING)
        self._handle = ctx.call("cuEventCreate", flags)
        self._own(ctx, "cuEventDestroy", self._handle)

    @property
    def handle(self) -> Any:
        """The raw CUevent; ValueError once freed (the driver may reuse it for the next event, as
        a freed buffer's `ptr` refuses). The finalizer holds its own copy."""
        self._usable()
        return self._handle

    def record(self) -> None:
        """Mark the current end of the engine's stream."""
        self._usable()
        hold = self.engine.capture_hold
        self._captured = None if hold is None else weakref.ref(hold)
        self.engine.activate().call("cuEventRecord", self._handle, self.engine._stream)  # both checked above

    def recorded_in(self, hold: object) -> bool:
        """Whether the last record() was queued inside the capture of `hold` (a capture_hold)."""
        return self._captured is not None and self._captured() is hold

    def synchronize(self) -> None:
        """Wait until the stream has reached the last record()."""
        self._usable()
        self.engine.host_wait(self.engine.activate().call, "cuEventSynchronize", self._handle)

    def query(self) -> bool:
        """Whether the stream has reached the last record(), without waiting."""
        self._usable()
        return self.engine.activate().reached(self._handle)

    def elapsed_ms(self, start: Event) -> float:
        """Device milliseconds from `start`, an Event, to this event (both recorded, this one waited
        for): anything else is a TypeError naming `start` (it met AttributeError '_usable')."""
        if not isinstance(start, Event):
            raise TypeError(f"start must be an Event, not {start!r}")
        start._usable()
        self.synchronize()
        return float(self.engine.ctx.call("cuEventElapsedTime", start._handle, self._handle))

    def __repr__(self) -> str:
        return f"Event({'freed' if self.freed else int(self._handle)})"


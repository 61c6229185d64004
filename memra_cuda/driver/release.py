"""Borrowed memory let go in stream order: what a collected DeviceBuffer on another framework's
memory kept of its owner (a torch tensor and its storage, a CuPy array) is dropped only once the
streams that queued work on that memory have run it.

Memory memra allocates goes back by cuMemFree, which waits for the device first. Borrowed
memory goes back to its owner's allocator the moment the last reference to the owner drops, and
torch's caching allocator hands the block to the next tensor of its size at once, on the stream
the tensor was made on: a kernel still queued on memra's stream would then write into that new
tensor. free() waits for those streams on the host (DeviceBuffer.free); a buffer that is
collected cannot (its finaliser would block on the GPU), nor can free() wait for a stream being
captured. So `release_after` keeps the references here, with an event recorded at the end of
each such stream, and `drain` drops them once their events are reached (cuEventQuery, never
waiting): at the next release, and at every Stream's synchronize() and close(). Nothing here
runs on the per-round path, nor from a host callback.

The list is the process's, not a stream's: a Stream collected unclosed is destroyed at once,
its queued work running on, and an event recorded on it before still tells when that work is
done; each entry holds its context, so the context (and every allocation in it) outlives it.
A stream being captured cannot mark its queued work (an event recorded there is a point of the
graph), so its entry keeps the stream and records the event at a later drain, once the capture
is over, or lets go once the stream is closed (close() waits for its work). torch's own answer,
`tensor.record_stream`, is not used: it records an event on memra's stream whenever the tensor
is freed, by which time memra may have destroyed that stream.
"""
from __future__ import annotations

import atexit
import collections
import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from .context import PrimaryContext

log = logging.getLogger("memra_cuda")


class StreamLike(Protocol):
    """What a release asks of a stream (a driver.stream.Stream, which imports this module)."""

    ctx: PrimaryContext
    _end: StreamEnd | None  # an owned stream's end, marked as its collection destroys it

    @property
    def closed(self) -> bool: ...

    def _mark(self) -> Any: ...


class _Later:
    """`keep`, held until its stream has run what was queued on it before `event` (None until
    recorded: the stream was being captured), an event of the release's own or, for a stream
    destroyed by its collection, its StreamEnd's (`end`, kept with it)."""

    __slots__ = ("ctx", "stream", "event", "keep", "end")

    def __init__(self, stream: StreamLike, keep: Any):
        self.ctx: PrimaryContext = stream.ctx
        self.stream: StreamLike | None = stream  # None once the event is recorded
        self.event: Any = None
        self.keep: Any = keep
        self.end: StreamEnd | None = None

    def settled(self) -> bool:
        """Whether `keep` may go now; never raises (a failure keeps it, for the next drain)."""
        try:
            if self.ctx.fault is not None:  # the context is lost, with every allocation in it
                return True
            if self.event is None:
                stream = self.stream
                if stream is None or stream.closed:  # close() waited for its work
                    return True
                end = stream._end
                if end is not None and end.destroyed:  # collected: destroyed, its end marked as it went
                    if end.event is None:  # none could be (captured, or the record failed): as a failed close()
                        return True
                    self.event, self.end = end.event, end
                else:
                    self.event = stream._mark()
                    if self.event is None:  # still captured
                        return False
                self.stream = None  # an owned stream may be destroyed now: the event still tells
            if not self.ctx.reached(self.event):
                return False
            if self.end is None:  # a StreamEnd's event goes with it
                self.ctx.finalize("cuEventDestroy", self.event)
            return True
        except Exception as exc:  # noqa: BLE001 - run from finalisers: report, keep, try again later
            log.warning("memra_cuda: borrowed memory kept for a later release: %s", exc)
            return False


# What waits for its stream. A deque, whose appends and pops are atomic: drains on several
# threads, or one that a collection runs in the middle of another, each take entries of their own,
# with no lock for a finaliser to deadlock on.
_pending: collections.deque[_Later] = collections.deque()


def release_after(streams: Iterable[StreamLike], keep: Any) -> None:
    """Drop `keep` (what borrowed memory's buffer held of its owner) only once each of `streams`
    has run the work queued on it so far. A closed stream's work is done (close() waited for it),
    and a faulted context's memory is lost: neither holds anything. Never raises: it runs from a
    buffer's finaliser, at any allocation, on any thread."""
    drain()
    for stream in list(streams):
        _hold(_Later(stream, keep))


def drain() -> None:
    """Drop what each reached event kept, without waiting; cheap when nothing waits."""
    for _ in range(len(_pending)):
        try:
            later = _pending.popleft()
        except IndexError:  # another thread's drain took the rest
            return
        _hold(later)


def _hold(later: _Later) -> None:
    """Keep `later` in the list unless it may go now. An interrupt in its query (a KeyboardInterrupt,
    or a signal handler's exception, which settled() lets through as it must) keeps it too: it was
    dropped, between the drain's pop and its append, and the memory went back to its owner while
    the stream could still be writing it (a notebook's interrupted synchronize() goes on running)."""
    settled = False
    try:
        settled = later.settled()
    finally:
        if not settled:
            _pending.append(later)


class AtCollection:
    """release_after(streams, keep) as this object is collected, unless free() let go first
    (`keep` set to None): a borrowed buffer's, which alone holds it (DeviceBuffer.queued_on), so
    it runs as the buffer goes, with the buffer's set of streams as it last filled it.

    A __del__, not a weakref.finalize on the buffer: a finalize's arguments are held from its
    registry, so where what the buffer keeps reaches the buffer back (a tensor keeping its adoption
    as an attribute, a stream whose owner holds the buffer), the buffer was reachable from that
    registry for good: it, the tensor and the streams were never collected. A __del__ runs in such
    a cycle too, once (PEP 442): the release holds the cycle until the streams have run its work,
    and the collector frees it then. What it holds is the owner's deallocation, where a tensor's
    and a CuPy array's memory goes back: an owner that gives its memory back in a finaliser of its
    own (a Python __del__, a weakref.finalize), collected in the same cycle, is finalised by the
    collector before this runs, as every object of the garbage is, and no release can hold that.
    At exit nothing is handed out again: `exiting` is set by a hook registered with the first,
    after the contexts' own (a stream came first), so it runs before weakref's at-exit finalisers
    release them."""

    __slots__ = ("streams", "keep")
    exiting = False
    _hooked = False

    def __init__(self, streams: Iterable[StreamLike], keep: Any):
        self.streams, self.keep = streams, keep
        AtCollection.hook()

    @staticmethod
    def hook() -> None:
        """Register the at-exit hook that sets `exiting`, once (after the contexts' finalisers)."""
        if not AtCollection._hooked:
            AtCollection._hooked = True
            atexit.register(AtCollection._exit)

    @staticmethod
    def _exit() -> None:
        AtCollection.exiting = True

    def __del__(self, release: Callable[[Iterable[StreamLike], Any], None] = release_after) -> None:
        if self.keep is not None and not self.exiting:  # names bound here: module globals may be gone
            release(self.streams, self.keep)


class StreamEnd:
    """An owned stream's end, marked as its collection destroys it (Stream's finaliser, which
    records `event` there first, unless close() ran: it waited for the stream's work).

    The collector runs a weakref.finalize's callback before any __del__ of the same garbage: a
    stream collected with a borrowed buffer that queued work on it (an object holding the engine
    and the adoption, in a reference cycle) was destroyed before the buffer's AtCollection asked
    for its mark, which then named a destroyed stream (cuStreamIsCapturing and cuEventRecord on a
    freed handle), failed at every drain, and kept the owner for good. Such a release waits for
    this event instead (_Later): the stream's work queued before it was destroyed runs on, and the
    event tells when it has. The event is this object's, destroyed as it goes (the stream keeps
    it, and a release waiting for its event keeps it too)."""

    __slots__ = ("ctx", "event", "destroyed", "wanted")

    def __init__(self, ctx: PrimaryContext):
        self.ctx, self.event, self.destroyed, self.wanted = ctx, None, False, True
        AtCollection.hook()  # at exit, no stream is marked (Stream's _destroy) and no end destroyed

    def __del__(self, at_collection: type[AtCollection] = AtCollection) -> None:
        if self.event is not None and not at_collection.exiting:  # names bound here: globals may be gone
            self.ctx.finalize("cuEventDestroy", self.event)


def pending() -> int:
    """How many releases wait for their streams (for tests and diagnostics)."""
    return len(_pending)

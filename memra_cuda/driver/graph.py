"""Stream capture into an executable CUDA graph, owned like a buffer."""
from __future__ import annotations

import contextlib
import gc
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from .errors import CaptureError, driver
from .handle import Handle

if TYPE_CHECKING:
    from .stream import Stream

# capture(engine, issue) -> (executable graph, owner): runs issue() while engine.stream is being
# captured and returns the instantiated graph. With owner None the Graph destroys the
# executable itself; otherwise `owner` (a framework's graph object, say) destroys it, and the
# Graph keeps the owner alive for as long as it may replay. An owner with a `replay()` method
# replays the graph itself (on the engine's stream): a framework may have state to advance at
# every launch, such as PyTorch's random-number offsets.
Capture = Callable[["Stream", Callable[[], None]], "tuple[Any, Any]"]


def stream_capture(engine: Stream, issue: Callable[[], None]) -> tuple[Any, None]:
    """The driver's own capture: cuStreamBeginCapture (this thread only) → issue → instantiate."""
    drv = driver()
    ctx = engine.activate()
    ctx.call("cuStreamBeginCapture", engine.stream, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
    try:
        issue()
    except BaseException:
        err, broken = drv.cuStreamEndCapture(engine.stream)
        if not err and broken is not None:
            drv.cuGraphDestroy(broken)
        raise
    graph = ctx.call("cuStreamEndCapture", engine.stream)
    try:
        return ctx.call("cuGraphInstantiate", graph, 0), None
    finally:
        ctx.call("cuGraphDestroy", graph)


class Graph(Handle):
    """The work `issue` put on the engine's stream, captured once and replayable.

    Whatever the captured kernels read through pointers is read at replay time, which is why
    round-stream keeps every per-round value on the device: the graph replays unchanged. The
    addresses themselves are fixed at capture, so the graph holds every buffer, pinned buffer
    and module that the captured launches and copies named at that moment (not the launches:
    a launch re-bound after capture still leaves the graph its old buffers). If one of them is
    freed explicitly, the graph refuses to replay, naming it.

    `capture` says how the stream is captured (see Capture): by default the driver's own
    capture; `memra_cuda.torch.capture` captures through `torch.cuda.graph`, so that PyTorch's
    allocator knows memory used inside the capture belongs to the graph. `joined` are other
    engines (pipeline stages, on other devices too) whose streams `issue` forks from and joins
    back to the engine's stream with events: their work is in the graph, and the graph holds
    what it names as well.

    Python's garbage collector is held off while the stream is captured: a collection there
    would free unreachable buffers (or a framework's graphs), and a free during capture is an
    error that invalidates the capture. What it would have freed is freed after.
    """

    def __init__(self, engine: Stream, issue: Callable[[], None], *, capture: Capture | None = None,
                 joined: Sequence[Stream] = ()):
        self.engine = engine
        self._held: dict[int, Handle] = {}
        self._owner: Any = None
        ctx = engine.activate()
        engines = [engine, *(e for e in joined if e is not engine)]
        if any(e.capture_hold is not None for e in engines):
            raise CaptureError("a graph is already being captured on one of these engines' streams")
        for e in engines:
            e.capture_hold = self.hold
        try:
            with _collector_held():
                self.handle, self._owner = (capture or stream_capture)(engine, issue)
        finally:
            for e in engines:
                e.capture_hold = None
        self._launch, self._argv = driver().cuGraphLaunch, (self.handle, engine.stream)
        self._replay = getattr(self._owner, "replay", None)
        engine.depend(self)  # a closed engine's stream may be reused: the graph refuses then
        if self._owner is None:
            self._own(ctx, "cuGraphExecDestroy", self.handle)

    def hold(self, *handles: Handle | None) -> None:
        """Keep `handles` alive with the graph and refuse to replay if one is freed (called by
        launches and copies while they are being captured)."""
        for handle in handles:
            if handle is not None and id(handle) not in self._held:
                self._held[id(handle)] = handle
                handle.depend(self)

    def launch(self) -> None:
        """Replay on the engine's stream: what was checked at capture is not checked again."""
        if self._refusal is not None:
            raise ValueError(self._refusal)
        if self._replay is not None:
            self._replay()
        else:
            self.engine.ctx.run(self._launch, "cuGraphLaunch", self._argv)

    def free(self) -> None:
        super().free()
        self._owner = self._replay = None
        self._held.clear()

    def __repr__(self) -> str:
        return f"Graph({len(self._held)} handles held{', freed' if self.freed else ''})"


_captures = 0  # captures in progress, in any thread
_captures_lock = threading.Lock()
_collector_was_on = False


@contextlib.contextmanager
def _collector_held() -> Iterator[None]:
    """Python's garbage collector off while any thread captures: the first capture to begin
    turns it off, the last to end restores it (a process-wide switch, so a per-capture
    save-and-restore would let one thread turn it back on under another's capture)."""
    global _captures, _collector_was_on
    with _captures_lock:
        if _captures == 0:
            _collector_was_on = gc.isenabled()
            gc.disable()
        _captures += 1
    try:
        yield
    finally:
        with _captures_lock:
            _captures -= 1
            if _captures == 0 and _collector_was_on:
                gc.enable()

"""Stream capture into an executable CUDA graph, owned like a buffer."""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Callable

from .errors import call, driver

if TYPE_CHECKING:
    from .engine import Engine


class Graph:
    """The work `issue` put on the engine's stream, captured once and replayable.

    Whatever the captured kernels read through pointers is read at replay time, which is why
    round-stream keeps every per-round value on the device: the graph replays unchanged. The
    graph holds on to `issue`, and through it to the launches and buffers it captured, so
    none of that memory is collected while the graph can still replay into it.
    """

    def __init__(self, engine: Engine, issue: Callable[[], None]):
        drv = driver()
        self.engine = engine
        self._issue = issue
        ctx = engine.activate()
        mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        call("cuStreamBeginCapture", engine.stream, mode)
        try:
            issue()
        except BaseException:
            err, broken = drv.cuStreamEndCapture(engine.stream)
            if not err and broken is not None:
                drv.cuGraphDestroy(broken)
            raise
        graph = call("cuStreamEndCapture", engine.stream)
        try:
            self.handle = call("cuGraphInstantiate", graph, 0)
        finally:
            call("cuGraphDestroy", graph)
        self._finalizer = weakref.finalize(self, ctx.finalize, "cuGraphExecDestroy", self.handle)

    def launch(self) -> None:
        if not self._finalizer.alive:
            raise ValueError("Graph used after free")
        self.engine.activate()
        call("cuGraphLaunch", self.handle, self.engine.stream)

    def free(self) -> None:
        self._finalizer()

    def __enter__(self) -> Graph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

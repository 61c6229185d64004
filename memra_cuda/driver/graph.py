"""Stream capture into an executable CUDA graph, owned like a buffer."""
from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .errors import CaptureError, MemraError, driver, driver_version
from .handle import Handle
from .stream import Stream, as_engine_stream
from .values import as_listed

if TYPE_CHECKING:
    from .module import Launch

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


class LoopUnsupported(MemraError, RuntimeError):
    """The driver or the binding has no conditional WHILE nodes (CUDA 12.4 and later have)."""


LOOP_REQUIREMENT = ("device-resident loops need conditional WHILE graph nodes: a CUDA 12.4+ driver and "
                    "cuda-bindings with cuGraphConditionalHandleCreate and cuStreamBeginCaptureToGraph")


def check_loops() -> None:
    """LoopUnsupported naming the requirement unless this driver and binding build WHILE nodes."""
    drv = driver()
    have = all(hasattr(drv, name) for name in ("cuGraphConditionalHandleCreate", "cuStreamBeginCaptureToGraph",
                                                "cuGraphAddNode", "cuStreamGetCaptureInfo"))
    _require(LoopUnsupported, LOOP_REQUIREMENT, have, (12, 4))


def _require(missing: type[LoopUnsupported], requirement: str, have: bool, release: tuple[int, int]) -> None:
    """`missing` naming `requirement` unless the binding `have`s the calls and this driver is of
    `release` or later."""
    major, minor = driver_version()
    if not have or (major, minor) < release:
        lacking = "" if have else " with a binding that lacks them"
        raise missing(f"{requirement}; this is driver {major}.{minor}{lacking}")


class SwitchUnsupported(LoopUnsupported):
    """The driver or the binding has no conditional SWITCH nodes (CUDA 12.8 and later have): a
    LoopUnsupported, as what lacks them lacks a kind of conditional node."""


SWITCH_REQUIREMENT = ("a switch of bodies needs conditional SWITCH graph nodes: a CUDA 12.8+ driver and "
                      "cuda-bindings with CU_GRAPH_COND_TYPE_SWITCH")


def check_switch() -> None:
    """SwitchUnsupported naming the requirement unless this driver and binding build SWITCH nodes
    (and WHILE nodes' machinery, which a switch is built with: check_loops)."""
    try:
        check_loops()
    except LoopUnsupported as missing:
        raise SwitchUnsupported(f"{SWITCH_REQUIREMENT}; {missing}") from None
    _require(SwitchUnsupported, SWITCH_REQUIREMENT,
             hasattr(driver().CUgraphConditionalNodeType, "CU_GRAPH_COND_TYPE_SWITCH"), (12, 8))


class LoopBuilder:
    """Builds a graph of straight segments and conditional WHILE loops, in order, every part
    captured from the engine's own stream (cuStreamBeginCaptureToGraph), so prepared launches
    bound to that stream capture as they are. Used inside a Graph's capture (see `loops`).

    handle() makes a loop's condition, to give the kernels that set it (cudaGraphSetConditional)
    before they are captured; issue() captures work after everything so far; loop() adds a
    WHILE node on a handle after everything so far, its body captured from `body`, which runs
    as long as the last kernel to set the condition set it non-zero; when() adds an IF node,
    which runs its body once where the condition is non-zero; switch() adds a SWITCH
    node, which runs the one of its `bodies` the condition names (none where it names no body;
    check_switch says whether the driver has them). The condition has no default value at
    launch: a kernel issued before the node must set it, deciding what runs.
    """

    def __init__(self, engine: Stream):
        self.engine = as_engine_stream(engine)
        self.ctx = engine.activate()
        self.graph = self.ctx.call("cuGraphCreate", 0)
        self._after: list[Any] = []  # the nodes the next part depends on

    def handle(self) -> Any:
        """A CUgraphConditionalHandle; a kernel takes int(handle) as a u64."""
        return self.ctx.call("cuGraphConditionalHandleCreate", self.graph, self.ctx.handle, 0, 0)

    def issue(self, work: Callable[[], None]) -> None:
        self._after = self._capture_into(self.graph, self._after, work, sinks=True)

    def loop(self, handle: Any, body: Callable[[], None]) -> None:
        self._conditional(handle, "CU_GRAPH_COND_TYPE_WHILE", [body])

    def when(self, handle: Any, body: Callable[[], None]) -> None:
        self._conditional(handle, "CU_GRAPH_COND_TYPE_IF", [body])

    def switch(self, handle: Any, bodies: Sequence[Callable[[], None]]) -> None:
        # in order, a body a case: a generator met "object of type 'generator' has no len()" inside the build
        bodies = as_listed(bodies, "a switch's bodies", "callables (one a case, in order)")
        if not bodies:
            raise ValueError("a switch needs at least one body")
        self._conditional(handle, "CU_GRAPH_COND_TYPE_SWITCH", bodies)

    def _conditional(self, handle: Any, kind: str, bodies: Sequence[Callable[[], None]]) -> None:
        """A conditional node of `kind` on `handle` after everything so far, each of its graphs
        captured from one of `bodies`, in order."""
        drv = driver()
        params = drv.CUgraphNodeParams()
        params.type = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        params.conditional.handle = handle
        params.conditional.type = getattr(drv.CUgraphConditionalNodeType, kind)
        params.conditional.size = len(bodies)
        params.conditional.ctx = self.ctx.handle
        node = self.ctx.call(_with_edges("cuGraphAddNode"), self.graph, self._after, _edges(self._after),
                             len(self._after), params)
        graphs = list(params.conditional.phGraph_out)
        if len(graphs) != len(bodies):
            raise CaptureError(f"the driver made {len(graphs)} body graph(s) for a conditional node of {len(bodies)}")
        for graph, body in zip(graphs, bodies):
            self._capture_into(graph, [], body, sinks=False)
        self._after = [node]

    def _capture_into(self, graph: Any, after: list[Any], work: Callable[[], None], sinks: bool) -> list[Any]:
        drv, stream = driver(), self.engine.stream
        mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        self.ctx.call("cuStreamBeginCaptureToGraph", stream, graph, after or None, _edges(after), len(after), mode)
        try:
            work()
            if sinks:  # the nodes the next part follows
                after = _capture_end(self.engine)[1]
        except BaseException:
            drv.cuStreamEndCapture(stream)
            raise
        self.ctx.call("cuStreamEndCapture", stream)
        return after

    def instantiate(self) -> Any:
        try:
            return self.ctx.call("cuGraphInstantiate", self.graph, 0)
        finally:
            self.ctx.call("cuGraphDestroy", self.graph)


def branch(launch: Launch) -> Any:
    """Capture `launch` as a branch off the end of its engine's stream: a kernel node after the
    work captured so far, which the stream's next work does not wait for, until join(). Device
    mode publishes tokens this way, beside the next round instead of in its path."""
    graph, after = _capture_end(launch.engine)
    if graph is None:
        raise CaptureError("a branch is added to a graph being captured: the stream is not capturing")
    return launch.add_node(graph, after)


def capturing(engine: Stream) -> bool:
    """Whether the engine's stream is being captured: the work queued on it now lands in a graph
    (where branch() may add a node), not on the GPU."""
    return _capture_end(engine)[0] is not None


def join(engine: Stream, node: Any) -> None:
    """Make the next work captured on the engine's stream wait for `node` (a branch) as well."""
    add = int(driver().CUstreamUpdateCaptureDependencies_flags.CU_STREAM_ADD_CAPTURE_DEPENDENCIES)
    engine.activate().call(_with_edges("cuStreamUpdateCaptureDependencies"), engine.stream, [node], _edges([node]), 1,
                           add)


def _capture_end(engine: Stream) -> tuple[Any, list[Any]]:
    """The graph being captured on the engine's stream (None if it is not capturing) and the
    nodes its next captured work will follow: cuStreamGetCaptureInfo's (status, id, graph,
    nodes, [edge data,] count)."""
    info = engine.activate().call("cuStreamGetCaptureInfo", engine.stream)
    if info[0] != driver().CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
        return None, []
    return info[2], list(info[3])[:int(info[-1])]


def _edges(nodes: Sequence[Any]) -> list[Any] | None:
    """Edge data for dependencies on `nodes`: a default (zeroed) edge each. CUDA 13's bindings
    take None for default edges; CUDA 12's check that the list is as long as the dependencies
    ("List is too small: 0 < 1") even though the driver would take NULL."""
    return [driver().CUgraphEdgeData() for _ in nodes] or None


def _with_edges(name: str) -> str:
    """The form of a graph call that takes edge data: <name>_v2 in the CUDA 12 bindings, <name>
    itself in 13."""
    return f"{name}_v2" if hasattr(driver(), f"{name}_v2") else name


def loops(build: Callable[[LoopBuilder], None]) -> Capture:
    """A Capture that builds its graph with `build(LoopBuilder)` instead of capturing `issue`."""
    def capture(engine: Stream, _issue: Callable[[], None]) -> tuple[Any, None]:
        check_loops()
        builder = LoopBuilder(engine)
        try:
            build(builder)
        except BaseException:
            driver().cuGraphDestroy(builder.graph)
            raise
        return builder.instantiate(), None
    return capture


class Graph(Handle):
    """The work `issue` put on the engine's stream, captured once and replayable.

    Whatever the captured kernels read through pointers is read at replay time, which is why
    round-stream keeps every per-round value on the device: the graph replays unchanged. The
    addresses themselves are fixed at capture, so the graph holds every buffer, pinned buffer
    and module that the captured launches and copies named at that moment (not the launches:
    a launch re-bound after capture still leaves the graph its old buffers). If one of them is
    freed explicitly, the graph refuses to replay, naming it.

    `capture` says how the stream is captured (see Capture): by default the engine's framework's
    (the driver's own capture, or through `torch.cuda.graph` for an engine from
    `memra_cuda.torch.engine()`, so that PyTorch's allocator knows memory used inside the
    capture belongs to the graph). `joined` are other
    engines (pipeline stages, on other devices too), a list or a tuple of them (one alone is
    `[other]`), whose streams `issue` forks from and joins back to the engine's stream with
    events: their work is in the graph, and the graph holds what it names as well.

    Python's garbage collector is held off while the stream is captured: a collection there
    would free unreachable buffers (or a framework's graphs), and a free during capture is an
    error that invalidates the capture. What it would have freed is freed after.
    """

    def __init__(self, engine: Stream, issue: Callable[[], None], *, capture: Capture | None = None,
                 joined: Sequence[Stream] = ()):
        # a list or a tuple: one engine given for them met "'Engine' object is not iterable", naming nothing
        joined = as_listed(joined, "joined", "engines")
        # each an engine: a wrong one met AttributeError 'capture_hold' or 'activate', naming nothing
        self.engine = as_engine_stream(engine)
        joined = [as_engine_stream(other, "each of joined") for other in joined]
        self._held: dict[int, Handle] = {}
        self._owner: Any = None
        ctx = engine.activate()
        engines = [engine, *(e for e in joined if e is not engine)]
        if any(e.capture_hold is not None for e in engines):
            raise CaptureError("a graph is already being captured on one of these engines' streams")
        hold = self.hold  # one object for every engine: a joined engine's wait knows its capture by it (Engine.wait)
        for e in engines:
            e.capture_hold = hold
        try:
            with collector_held():
                self.handle, self._owner = (capture or engine.framework.capture or stream_capture)(engine, issue)
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
def collector_held() -> Iterator[None]:
    """Python's garbage collector off while any thread captures: the first capture to begin
    turns it off, the last to end restores it (a process-wide switch, so a per-capture
    save-and-restore would let one thread turn it back on under another's capture). memra's
    own captures (Graph) and the torch graphs memra_cuda.torch captures (adapter.torch_graph)."""
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

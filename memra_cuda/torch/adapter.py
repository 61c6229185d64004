"""An Engine that carries torch's Framework, so that every round over it is safe by default.

What a user forgets must not give wrong tokens or overwrite tensors, so an engine made by
`engine()` carries torch's policy, and every round over it gets all of this without being told
(docs/torch.md):

- **One stream.** The draft chain and verify trunk run with the engine's stream as torch's
  current stream, so their torch ops and memra's kernels are ordered by the stream itself,
  with no synchronisation in between and no wrapping of each callable.
- **One mode.** They run with autograd off and `torch.inference_mode()` as it was when the
  engine was made, whatever the caller's at each burst (scope): a compiled step's guards see
  its tensors' dispatch keys, so a decoder warmed up outside inference mode and captured inside
  it compiled every step again inside the capture.
- **Capture torch knows about.** Bursts are captured through `torch.cuda.graph` with a private
  memory pool kept alive with the graph (capture), so torch's allocator never hands the graph's
  scratch memory to tensors allocated later; every torch graph memra_cuda.torch captures, with
  Python's collector held off while it does, and destroyed without breaking another's capture
  (torch_graph).
- **Random numbers that move on.** A captured burst replays through `CUDAGraph.replay`, which
  advances torch's random-number offsets, so `torch.rand` in a burst draws new numbers at
  every launch.

The core never looks at a foreign object's module to find this out: a plain `Engine` over
tensors would capture with the driver's own stream capture, behind torch's allocator. Graph
capture needs a stream other than the default one: create the engine inside
`with torch.cuda.stream(torch.cuda.Stream()):`, or give it such a stream.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..driver.engine import Engine
from ..driver.context import relaxed_capture
from ..driver.errors import CaptureError, CudaUnavailable, driver
from ..driver.framework import Framework
from ..driver.graph import Capture, LoopBuilder, collector_held, loops
from ..driver.stream import Stream

log = logging.getLogger("memra_cuda")


def engine(stream: torch.cuda.Stream | None = None) -> Engine:
    """An Engine on `stream`, borrowed and never destroyed; the stream object is kept alive with
    the engine. Left out, `stream` is torch's current stream: inside `with torch.cuda.stream(s):`
    that is s (the decoders make theirs so, on a stream of their own), elsewhere normally torch's
    default stream, the legacy stream 0, which waits for and holds up the work of every other
    stream on the device and which no graph can capture (eager rounds run; graph and overlap
    modes raise CaptureError at their first capture). An engine's own stream:
    `engine(torch.cuda.Stream())`; tensors made on another stream are then ready for it only once
    it waits for them (`engine.wait(...)`, or torch.cuda.synchronize()). The engine carries
    torch's Framework: the model's work runs with that stream as torch's current stream, and
    graphs capture through torch (so its allocator knows what a graph uses, and its random
    numbers move on)."""
    need_cuda("memra_cuda.torch.engine()")
    stream = stream if stream is not None else torch.cuda.current_stream()
    return Engine(stream.device.index, stream=stream, framework=framework(stream))


def need_cuda(what: str, instead: str = "") -> None:
    """CudaUnavailable, naming `what` (and what to do `instead`, where there is something), where
    torch sees no CUDA GPU (a CPU build of torch, no driver, no GPU): the error memra_cuda raises
    for a missing GPU everywhere else, where torch's own was an AssertionError ("Torch not
    compiled with CUDA enabled") or a RuntimeError from inside its stream."""
    if not torch.cuda.is_available():
        raise CudaUnavailable(f"{what} needs a CUDA GPU, and torch {torch.__version__} sees none "
                              f"(torch.cuda.is_available() is False){instead}", call="torch.cuda.is_available")


def decoder_stream() -> torch.cuda.Stream:
    """A stream of a decoder's own, ordered after the caller's current stream: torch's streams are
    non-blocking, so nothing else orders it after the work queued there, such as a model's
    weights made, cast or loaded a moment ago, which the decoder fuses (copies) on its stream. A
    wait on the GPU; the host goes on."""
    need_cuda("a decoder")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    return stream


def framework(stream: torch.cuda.Stream) -> Framework:
    """torch's Framework for an engine on `stream` (see memra_cuda.driver.framework): capture and
    loop_capture below, and the model's work scoped as torch's mode is now (scope)."""
    return Framework(capture=capture, loop_capture=loop_capture,
                     scope=functools.partial(scope, stream, torch.is_inference_mode_enabled()))


@contextlib.contextmanager
def scope(stream: torch.cuda.Stream | None, inference: bool) -> Iterator[None]:
    """A burst's model work: on `stream` (torch's current stream), autograd off, and
    torch.inference_mode() on where `inference` (as the engine was made), whatever the caller's.
    A decoder's warm-up round compiles every step and arithmetic its rounds run, and its capture
    replays them, so the two must pass the same guards: under the caller's inference mode the
    tensors' dispatch keys differed (`with torch.inference_mode(): spec.generate(...)` after a
    construction outside it compiled every step again inside the first burst's capture); and a
    decoder made inside inference mode holds inference tensors, which a burst outside it may not
    write in place."""
    with torch.cuda.stream(stream), torch.inference_mode(inference), torch.no_grad():
        yield


def _torch_stream(engine: Stream) -> torch.cuda.ExternalStream:
    return torch.cuda.ExternalStream(engine.stream_handle, device=torch.device("cuda", engine.device))


_RNG_REFUSAL = ("torch drew random numbers inside a device-mode loop, whose passes replay the capture's "
                "random-number offsets: every pass would draw the same numbers. Draw with memra's position-keyed "
                "kernels (sampling.prepare_draft_sample), or use graph mode, which advances them at every launch")


def loop_capture(build: Callable[[LoopBuilder], None]) -> Capture:
    """driver.graph.loops(build) for torch-backed rounds (device mode's loop, which
    torch.cuda.graph cannot build): torch's allocations during the capture go to a private
    memory pool that the graph keeps until it is destroyed, so no tensor allocated later is
    given the loop's memory. torch's random-number generator must not move inside: a loop
    replays its body with the capture's offsets at every pass, so the same numbers would come
    back (device mode samples with memra's position-keyed draws)."""
    def capture(engine: Stream, issue: Callable[[], None]) -> tuple[Any, Any]:
        pool, generator = _Pool(engine.device), torch.cuda.default_generators[engine.device]
        offset = generator.get_offset()
        try:
            with pool.allocating():
                graph, _ = loops(build)(engine, issue)
        except BaseException as exc:
            pool.release()
            if isinstance(exc, RuntimeError) and "generator" in str(exc):  # torch refuses a draw in a capture
                raise CaptureError(_RNG_REFUSAL) from exc  # it did not begin
            raise
        owner = _PooledGraph(engine, graph, pool)
        if generator.get_offset() != offset:
            del owner  # destroys the graph, then releases the pool
            raise CaptureError(_RNG_REFUSAL)
        return graph, owner
    return capture


class _Pool:
    """A private pool of torch's caching allocator, held by its id as torch.cuda.graph holds a
    graph's: this thread's allocations go to it inside allocating(), and release() gives its
    memory back to the allocator, which frees it when it next empties its cache. Not
    torch.cuda.MemPool: its destructor empties the pool at once, and torch (2.11) aborts the
    process there ("captures_underway.empty() INTERNAL ASSERT FAILED") while any capture is under
    way in the process, and a loop's pool goes whenever its graph's last reference does, which
    may be in the middle of another decoder's capture or the user's own."""

    def __init__(self, device: int):
        self.device, self.id, self._held = device, torch.cuda.graph_pool_handle(), False

    @contextlib.contextmanager
    def allocating(self) -> Iterator[None]:
        torch._C._cuda_beginAllocateCurrentThreadToPool(self.device, self.id)  # makes the pool, held once
        self._held = True
        try:
            yield
        finally:
            torch._C._cuda_endAllocateToPool(self.device, self.id)

    def release(self) -> None:
        if self._held:
            self._held = False
            torch._C._cuda_releasePool(self.device, self.id)


def _destroy(ctx: Any, graph: Any, pool: _Pool) -> None:
    """The finaliser of a _PooledGraph, which must not raise: the graph destroyed as every memra
    finaliser releases (Context.finalize: inside someone's capture too), then the pool released."""
    ctx.finalize("cuGraphExecDestroy", graph)
    try:
        pool.release()
    except Exception as exc:  # noqa: BLE001 - at interpreter exit torch may be gone first
        log.warning("memra_cuda: releasing a loop's torch memory pool failed: %s", exc)


class _PooledGraph:
    """Owns an executable graph memra built and the torch memory pool its kernels use: the graph
    is destroyed first, then the pool goes."""

    def __init__(self, engine: Stream, graph: Any, pool: _Pool):
        weakref.finalize(self, _destroy, engine.ctx, graph, pool)  # which holds the pool till then


class _TorchGraph:
    """What a memra Graph keeps of a capture through torch: the CUDAGraph, which holds its
    private memory pool as long as the graph may replay, and the replay that advances torch's
    RNG."""

    def __init__(self, graph: torch.cuda.CUDAGraph, stream: torch.cuda.ExternalStream):
        self.graph, self.stream = graph, stream

    def replay(self) -> None:
        with torch.cuda.stream(self.stream):
            self.graph.replay()


class _RelaxedGraph(torch.cuda.CUDAGraph):
    """A torch CUDA graph of memra_cuda.torch's, destroyed with this thread's capture mode
    relaxed, as memra's own releases are (context.finalize): a decoder dropped in a reference
    cycle goes when the collector meets it, which may be inside a caller's own torch.cuda.graph,
    and a graph destroyed there in CUDA's default mode invalidates that capture."""

    def __del__(self) -> None:
        with contextlib.suppress(Exception), relaxed_capture():  # under the collector: nowhere to raise to
            self.reset()
        with contextlib.suppress(Exception):
            getattr(super(), "__del__", lambda: None)()  # torch's own (2.12 and later: its liveness tracker)


@contextlib.contextmanager
def torch_graph(stream: torch.cuda.Stream | None = None, mode: str = "global",
                keep_graph: bool = False) -> Iterator[torch.cuda.CUDAGraph]:
    """A new CUDAGraph, captured on `stream` as torch.cuda.graph captures (capture_error_mode
    `mode`) while the block runs; the one way memra_cuda.torch captures torch work. Python's
    garbage collector is held off meanwhile, as memra's own captures hold it (collector_held):
    torch no longer collects before a capture (from 2.6, unless told to), so garbage made before,
    such as a dropped decoder's graph in a reference cycle, was collected inside it when Python
    allocated there, and a graph's destruction there invalidated the capture (seen: a decoder's
    capture after other tests' decoders, its next cuBLAS call failing). The graph itself is
    destroyed relaxed (_RelaxedGraph), so it never breaks another's capture either."""
    graph = _RelaxedGraph(keep_graph=keep_graph)
    with collector_held(), torch.cuda.graph(graph, stream=stream, capture_error_mode=mode):
        yield graph


def capture(engine: Stream, issue: Callable[[], None]) -> tuple[Any, Any]:
    """A `Capture` (see memra_cuda.driver.graph) through `torch.cuda.graph` on the engine's
    stream, with the private memory pool torch gives a graph. The torch graph owns the
    executable graph and replays it (CUDAGraph.replay, so the random-number offsets move on);
    the memra Graph keeps it, and with it the pool, alive. A `Graph` of torch work of your own
    takes it as `capture=`."""
    if engine.stream_handle in (0, 1, 2):
        raise CaptureError("the default stream cannot be captured: create the engine inside "
                           "`with torch.cuda.stream(torch.cuda.Stream()):`")
    stream = _torch_stream(engine)
    with torch_graph(stream, "thread_local") as graph:
        issue()
    return driver().CUgraphExec(int(graph.raw_cuda_graph_exec())), _TorchGraph(graph, stream)

"""Device-resident generation: a RoundStream's rounds inside conditional WHILE graph nodes, so
one graph launch generates until every row is done, and the committed tokens streamed to the
host through mapped pinned memory while it runs (docs/round-stream.md, "Device mode").

The host launches once and then only watches: each round's commit also publishes the row's
tokens (spec_ring_commit_publish), and a decider kernel after every pass (spec_loop_decide)
ends the loop when every row is done or the round cap is reached. Pacing moves to the device:
loops of M-round passes while some live row is expected to need M rounds more, then of
shorter ones (powers of four) and single rounds to the end, so the tail wastes few rounds and
the long middle pays the per-pass cost once per M rounds.
"""
from __future__ import annotations

import contextlib
import ctypes
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np

from .driver.buffer import MappedBuffer
from .driver.event import Event
from .driver.graph import Capture, Graph, LoopBuilder, LoopUnsupported, check_loops

if TYPE_CHECKING:
    from .bufs import StreamBufs
    from .kernels import SpecKernels

Step = Callable[[], None]


class RoundCapError(RuntimeError):
    """The device loop reached its round cap with rows still live. `tokens` holds what each row
    generated before it; the buffers stay usable for the next request."""

    def __init__(self, message: str, tokens: list[np.ndarray]):
        super().__init__(message)
        self.tokens = tokens


class Landed(NamedTuple):
    """Tokens the host found published since it last looked, per row (empty where none), with
    the device's %globaltimer (ns, low 32 bits) at each one's commit; when the host took them
    (time.perf_counter_ns), and whether the loop was still running then."""

    tokens: list[np.ndarray]
    stamps: list[np.ndarray]
    seen_ns: int
    running: bool


class TokenStream:
    """The mapped words the rounds publish into: a word the loop's last node sets once it has
    ended, then one row per sequence: each row's published count, then its tokens and their
    stamps (u32[B][cap] each). The device writes tokens and stamps, then
    __threadfence_system(), then the count, so the host reads a count first and may then read
    every token below it. The host learns that the loop ended from the memory too, with no
    driver call while it runs (a cuEventQuery there crashed the host under compute-sanitizer's
    racecheck)."""

    def __init__(self, engine: Any, batch: int, cap: int):
        self.batch, self.cap = batch, cap
        self._memory = MappedBuffer(engine, np.uint32, 1 + batch * (1 + 2 * cap), label="token stream")
        device = self._memory.device
        self.ended_d = device.view(0, 1)
        self.count_d = device.view(1, batch)
        self.tokens_d = device.view(1 + batch, batch * cap)
        self.stamps_d = device.view(1 + batch + batch * cap, batch * cap)
        self._views(self._memory.live)
        self.seen = np.zeros(batch, np.uint32)  # what the host has taken of each row

    def _views(self, words: np.ndarray | None) -> None:
        """The host's views of the words (None once freed: no view outlives the memory)."""
        batch, cap = self.batch, self.cap
        self._head = None if words is None else words[:1 + batch]
        self._counts = None if words is None else words[1:1 + batch]
        self._tokens = None if words is None else words[1 + batch:1 + batch + batch * cap].reshape(batch, cap)
        self._stamps = None if words is None else words[1 + batch + batch * cap:].reshape(batch, cap)

    def clear(self) -> None:
        """Zero the ended word and the counts before a launch (the loop before it has finished)."""
        self._head[:] = 0
        self.seen[:] = 0

    @property
    def ended(self) -> bool:
        """Whether the loop's last node has run (read before the counts: all is published)."""
        return bool(self._head[0])

    def take(self, running: bool) -> Landed | None:
        """The tokens published since the last take, or None if there are none."""
        counts = self._counts.copy()  # the counts first: every token below them is written
        if counts.tobytes() == self.seen.tobytes():
            return None
        seen_ns = time.perf_counter_ns()
        low, high = int(self.seen.min()), int(counts.max())  # one copy of the new columns for all rows
        tokens, stamps = self._tokens[:, low:high].copy(), self._stamps[:, low:high].copy()
        rows = [slice(int(a) - low, int(b) - low) for a, b in zip(self.seen, counts)]
        landed = Landed([tokens[b, r] for b, r in enumerate(rows)], [stamps[b, r] for b, r in enumerate(rows)],
                        seen_ns, running)
        self.seen = counts
        return landed

    def free(self) -> None:
        self._views(None)
        self._memory.free()


class DeviceLoop:
    """The device mode of a RoundStream: its loop graph (captured once per stream size and
    pacing) and the host's side of the token stream. RoundStream.stream and
    generate_batch(mode="device") use it; it is not built by hand.

    It is given the round's steps around the commit (`before`, `after`), which it issues with
    its own publishing commit between them inside `scope` (a framework's stream scope), and
    `capture`, what builds a graph of loops (driver.graph.loops, or the torch adapter's): it
    holds no reference to its RoundStream.
    """

    # The host sleeps between looks at the stream: until the next commit is due, less EARLY_S
    # for the sleep's own lateness, and at least MIN_SLEEP_S. With `spin` set it looks again at
    # once instead (yielding the GIL): the lowest delay, at a whole core (docs/round-stream.md).
    MIN_SLEEP_S = 50e-6
    EARLY_S = 15e-6

    def __init__(self, spec: SpecKernels, bufs: StreamBufs, before: Sequence[Step], after: Sequence[Step],
                 scope: Callable[[], Any], capture: Callable[[Callable[[LoopBuilder], None]], Capture]):
        engine = spec.engine
        check_loops(engine)  # before the decider's module, which an older driver cannot load
        self.engine, self.spec, self.bufs = engine, spec, bufs
        self._before, self._after, self._scope, self._loops = tuple(before), tuple(after), scope, capture
        self._decide = engine.load_ptx("device_loop").kernel("spec_loop_decide").prepare(
            ["ptr", "ptr", "ptr", "u32", "ptr", "u64", "u32", "u32", "u32"], 1, 256)
        # The cap, the rounds run, then each row's published tokens: one memset zeroes all but the cap.
        self._state_d = engine.zeros(np.uint32, 2 + bufs.batch, label="device loop state")
        self._ran = engine.pinned(np.uint32, 1, label="device loop rounds")
        self._stream: TokenStream | None = None
        self._graph: Graph | None = None
        self._paced: bool | None = None
        self._event = Event(engine)
        self.captures = 0  # loop graphs captured
        self.running = False  # launched, and finish() not yet called
        self.spin = False

    def prepare(self, cap: int, paced: bool) -> None:
        """Capture the loop for a token stream of `cap` tokens per row and the given pacing,
        unless one that large with that pacing is captured already. The stream holds the next
        power of two, so a server's requests capture it a few times at most (call this up front
        with the largest budget to capture it once). A failed capture leaves the last loop."""
        cap = 1 << (max(cap, 1) - 1).bit_length()
        if self._graph is not None and self._stream.cap >= cap and self._paced == paced:
            return
        stream = TokenStream(self.engine, self.bufs.batch, max(cap, self._stream.cap if self._stream else 0))
        try:
            graph = self._capture(stream, paced)
        except BaseException:
            stream.free()
            raise
        if self._graph is not None:
            self._graph.free()
            self._stream.free()
        self._stream, self._graph, self._paced = stream, graph, paced
        self.captures += 1

    def launch(self, max_rounds: int) -> None:
        """Clear the stream, set the round cap and launch the loop (prepare first)."""
        self._stream.clear()
        self.engine.set_u32(self._state_d, 0, max_rounds)
        self._graph.launch()
        self._event.record()
        self.running = True

    def follow(self) -> Iterator[Landed]:
        """Each batch of tokens as the host finds them published, until the loop has ended and
        its last tokens are taken; the host sleeps between looks unless `spin` is set.

        When is the next commit due? Stamps are device time, the host's clock another: the
        smallest (seen - stamp) so far stands for the offset between them (low by the shortest
        delay seen), and one row's newest stamp against the one of the last look, over the
        rounds between (its distinct new stamps), for a round."""
        stream = self._stream
        round_ns, due_ns = 0, 0
        lag_ns: int | None = None
        row, newest_seen = 0, None  # the row whose stamps time the rounds, and its newest one
        with _fine_timer():
            while True:
                ended = stream.ended  # before the look: a loop that has ended published everything
                landed = stream.take(running=not ended)
                if landed is not None:
                    if landed.stamps[row].size == 0:  # the row followed so far is done: take another
                        row = max(range(stream.batch), key=lambda b: landed.stamps[b].size)
                        newest_seen = None
                    stamps = landed.stamps[row].tolist()
                    newest = stamps[-1]
                    lag = (landed.seen_ns - newest) % 2**32
                    if lag_ns is None or _signed(lag - lag_ns) < 0:
                        lag_ns = lag
                    if newest_seen is not None:  # rounds since the row's last look: its new stamps
                        round_ns = ((newest - newest_seen) % 2**32) // len(set(stamps))
                    newest_seen = newest
                    due_ns = newest + lag_ns + round_ns  # host time, low 32 bits
                    yield landed
                if ended:
                    return
                if self.spin:
                    time.sleep(0)
                    continue
                wait_s = 0.0 if lag_ns is None else _signed(due_ns - time.perf_counter_ns()) * 1e-9 - self.EARLY_S
                time.sleep(max(wait_s, self.MIN_SLEEP_S))

    def finish(self) -> tuple[np.ndarray, int]:
        """Wait for the loop: the final readback's done flags, and the rounds it ran."""
        received = self.bufs.receive(self.engine, 0, self._event)
        self.running = False
        return received.done, int(self._ran.read()[0])

    def _capture(self, stream: TokenStream, paced: bool) -> Graph:
        engine, bufs, state = self.engine, self.bufs, self._state_d
        published = state.view(2, bufs.batch)
        publish = self.spec.prepare_ring_commit_publish(bufs, published, stream.count_d, stream.tokens_d,
                                                        stream.stamps_d, stream.cap)
        steps = (*self._before, publish, *self._after)
        decide = self._decide

        def decider(handle: Any, ran: int, body: int) -> Step:
            def issue() -> None:  # bound now, captured at once: the graph keeps these values
                decide.set(bufs.ctl_d, published, bufs.acc_d, bufs.batch, state, int(handle), ran, body,
                           int(paced and body > 1))
                decide()
            return issue

        def rounds_then(n: int, decide_pass: Step) -> Step:
            def issue() -> None:
                with self._scope():
                    for _ in range(n):
                        for step in steps:
                            step()
                decide_pass()
            return issue

        def read_back() -> None:  # the rows' done flags and positions, the rounds run, then "ended"
            bufs.queue_readback(engine, 0)
            engine.copy_dtoh_async(self._ran, state.view(1, 1))
            engine.set_u32(stream.ended_d, 0, 1)

        def build(graph: LoopBuilder) -> None:
            graph.issue(lambda: engine.memset(state.view(1, 1 + bufs.batch), 0))
            for body in _pass_lengths(bufs.m_rounds, paced):
                handle = graph.handle()
                graph.issue(decider(handle, 0, body))
                graph.loop(handle, rounds_then(body, decider(handle, body, body)))
            graph.issue(read_back)

        return Graph(engine, lambda: None, capture=self._loops(build))


def _signed(ns: int) -> int:
    """A difference of two low-32-bit nanosecond times, as the signed span it stands for."""
    return (ns + 2**31) % 2**32 - 2**31


def _pass_lengths(m_rounds: int, pace: bool) -> list[int]:
    """The rounds a pass runs, loop by loop: M, then (paced) every power of four below it, then
    one, which also ends a generation the round cap cuts inside a longer pass."""
    lengths = [m_rounds]
    if pace:
        lengths += [4**i for i in range((m_rounds - 1).bit_length() // 2, 0, -1) if 4**i < m_rounds]
    return lengths + [1] if m_rounds > 1 else lengths


@contextlib.contextmanager
def _fine_timer() -> Iterator[None]:
    """Linux sleeps at least the thread's timer slack (50 µs by default) past what was asked:
    while the host follows a loop, 1 µs, then what it was."""
    prctl = _prctl()
    if prctl is None:
        yield
        return
    before = prctl(30, 0, 0, 0, 0)  # PR_GET_TIMERSLACK
    prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, ns
    try:
        yield
    finally:
        prctl(29, before, 0, 0, 0)


def _prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.restype = ctypes.c_long
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return prctl


__all__ = ["DeviceLoop", "Landed", "LoopUnsupported", "RoundCapError", "TokenStream"]

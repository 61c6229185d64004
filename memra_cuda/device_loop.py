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
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple, Protocol

import numpy as np

from .driver.buffer import MappedBuffer
from .driver.event import Event
from .driver.graph import Graph, LoopBuilder, LoopUnsupported, check_loops, loops

if TYPE_CHECKING:
    from .bufs import StreamBufs
    from .driver.engine import Engine
    from .kernels import SpecKernels


class Rounds(Protocol):
    """What the loop takes of its RoundStream (stream.py imports this module, not the reverse)."""

    engine: Engine
    spec: SpecKernels
    bufs: StreamBufs
    pace: bool

    def round_steps(self, commit: Callable[[], None] | None = None) -> tuple[Callable[[], None], ...]: ...

    def scoped(self, issue: Callable[[int], Any]) -> Callable[[int], None]: ...

    def capture_scope(self) -> tuple[Callable[[], Any], Any]: ...


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
    """The mapped words the rounds publish into, one row per sequence: the rounds the loop has
    run, then each row's published count, its tokens and their stamps (u32[B][cap] each). The
    device writes tokens and stamps, then __threadfence_system(), then the count, so the host
    reads a count first and may then read every token below it."""

    def __init__(self, engine: Any, batch: int, cap: int):
        self.batch, self.cap = batch, cap
        self._memory = MappedBuffer(engine, np.uint32, 1 + batch * (1 + 2 * cap), label="token stream")
        words, device = self._memory.live, self._memory.device
        self.rounds_d = device.view(0, 1)
        self.count_d = device.view(1, batch)
        self.tokens_d = device.view(1 + batch, batch * cap)
        self.stamps_d = device.view(1 + batch + batch * cap, batch * cap)
        self._rounds = words[0:1]
        self._counts = words[1:1 + batch]
        self._tokens = words[1 + batch:1 + batch + batch * cap].reshape(batch, cap)
        self._stamps = words[1 + batch + batch * cap:].reshape(batch, cap)
        self.seen = np.zeros(batch, np.int64)  # what the host has taken of each row
        self._seen_bytes = np.zeros(batch, np.uint32).tobytes()

    def clear(self) -> None:
        """Zero the counts before a launch (the loop before it has finished)."""
        self._memory.live[:1 + self.batch] = 0
        self.seen[:] = 0
        self._seen_bytes = np.zeros(self.batch, np.uint32).tobytes()

    def take(self, running: bool) -> Landed | None:
        """The tokens published since the last take, or None if there are none."""
        counts = self._counts.copy()  # the counts first: every token below them is written
        if counts.tobytes() == self._seen_bytes:
            return None
        self._seen_bytes = counts.tobytes()
        seen_ns = time.perf_counter_ns()
        low, high = int(self.seen.min()), int(counts.max())  # one copy of the new columns for all rows
        tokens, stamps = self._tokens[:, low:high].copy(), self._stamps[:, low:high].copy()
        rows = [slice(int(a) - low, int(b) - low) for a, b in zip(self.seen, counts)]
        landed = Landed([tokens[b, r] for b, r in enumerate(rows)], [stamps[b, r] for b, r in enumerate(rows)],
                        seen_ns, running)
        self.seen = counts.astype(np.int64)
        return landed

    @property
    def rounds(self) -> int:
        """The rounds the last loop ran (read after it ended)."""
        return int(self._rounds[0])

    def free(self) -> None:
        self._memory.free()


class DeviceLoop:
    """The device mode of a RoundStream: its loop graph (captured once per stream size) and the
    host's side of the token stream. RoundStream.stream and generate_batch(mode="device") use
    it; it is not built by hand."""

    # The host sleeps between looks at the stream: until the next commit is due, less EARLY_S
    # for the sleep's own lateness, and at least MIN_SLEEP_S. With `spin` set it looks again at
    # once instead (yielding the GIL): the lowest delay, at a whole core (docs/round-stream.md).
    MIN_SLEEP_S = 50e-6
    EARLY_S = 15e-6

    def __init__(self, rounds: Rounds):
        check_loops(rounds.engine)
        self.rounds = rounds
        engine, bufs = rounds.engine, rounds.bufs
        self._decide = engine.load_ptx("device_loop").kernel("spec_loop_decide").prepare(
            ["ptr", "ptr", "ptr", "u32", "ptr", "ptr", "u64", "u32", "u32", "u32", "u32"], 1, 256)
        self.published_d = engine.zeros(np.uint32, bufs.batch, label="published tokens")
        self.loop_d = engine.zeros(np.uint32, 2, label="loop rounds and cap")
        self._stream: TokenStream | None = None
        self._graph: Graph | None = None
        self._event = Event(engine)
        self.captures = 0  # loop graphs captured (one per stream size)
        self.spin = False

    def prepare(self, cap: int) -> None:
        """Capture the loop for a token stream of `cap` tokens per row, unless one at least
        that large is captured already; the stream holds the next power of two, so a server's
        requests capture it a few times at most (call it up front with the largest budget to
        capture it once)."""
        if self._graph is not None and self._stream is not None and self._stream.cap >= cap:
            return
        if self._stream is not None:
            self._graph.free()
            self._stream.free()
        self._stream = TokenStream(self.rounds.engine, self.rounds.bufs.batch, 1 << (max(cap, 1) - 1).bit_length())
        self._graph = self._capture(self._stream)
        self.captures += 1

    def launch(self, max_rounds: int) -> None:
        """Clear the stream, set the round cap and launch the loop (prepare first)."""
        engine = self.rounds.engine
        self._stream.clear()
        engine.set_u32(self.loop_d, 1, max_rounds)
        self._graph.launch()
        self._event.record()

    def follow(self) -> Iterator[Landed]:
        """Each batch of tokens as the host finds them published, until the loop has ended and
        its last tokens are taken; the host sleeps between looks unless `spin` is set.

        When is the next commit due? Stamps are device time, the host's clock another: the
        smallest (seen - stamp) so far stands for the offset between them (low by the shortest
        delay seen), and one row's newest stamp against the one of the last look, over the
        rounds between (its distinct new stamps), for a round."""
        stream, event = self._stream, self._event
        round_ns, due_ns = 0, 0
        lag_ns: int | None = None
        row, newest_seen = 0, None  # the row whose stamps time the rounds, and its newest one
        with _fine_timer():
            while True:
                landed = stream.take(running=True)
                if landed is None:
                    if event.query():  # the loop ended: its last tokens were published before
                        landed = stream.take(running=False)
                        if landed is not None:
                            yield landed
                        return
                else:
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
                if self.spin:
                    time.sleep(0)
                    continue
                wait_s = 0.0 if lag_ns is None else _signed(due_ns - time.perf_counter_ns()) * 1e-9 - self.EARLY_S
                time.sleep(max(wait_s, self.MIN_SLEEP_S))

    def finish(self) -> tuple[np.ndarray, int]:
        """After follow(): the final readback's done flags, and the rounds the loop ran."""
        bufs = self.rounds.bufs
        received = bufs.receive(self.rounds.engine, 0, self._event)
        return received.done, self._stream.rounds

    def _capture(self, stream: TokenStream) -> Graph:
        rs, bufs, engine = self.rounds, self.rounds.bufs, self.rounds.engine
        publish = rs.spec.prepare_ring_commit_publish(bufs, self.published_d, stream.count_d, stream.tokens_d,
                                                      stream.stamps_d, stream.cap)
        round_steps = rs.round_steps(commit=publish)
        issue_rounds = rs.scoped(lambda n: [step() for _ in range(n) for step in round_steps])
        m = bufs.m_rounds
        decide = self._decide

        def decider(handle: int, ran: int, body: int, paced: bool, start: bool = False) -> Callable[[], None]:
            def issue() -> None:  # bound now, captured at once: the graph keeps these values
                decide.set(bufs.ctl_d, self.published_d, bufs.acc_d, bufs.batch, self.loop_d, stream.rounds_d,
                           handle, ran, body, int(paced), int(start))
                decide()
            return issue

        def rounds_then(n: int, decide_pass: Callable[[], None]) -> Callable[[], None]:
            def issue() -> None:
                issue_rounds(n)
                decide_pass()
            return issue

        def build(graph: LoopBuilder) -> None:
            graph.issue(lambda: engine.memset(self.published_d, 0))
            for i, body in enumerate(_pass_lengths(m, rs.pace)):
                handle, paced = graph.handle(), rs.pace and body > 1
                graph.issue(decider(handle, 0, body, paced, start=i == 0))
                graph.loop(handle, rounds_then(body, decider(handle, body, body, paced)))
            graph.issue(lambda: bufs.queue_readback(engine, 0))

        scope, keep = rs.capture_scope()
        with scope():
            return Graph(engine, lambda: None, capture=loops(build), keep=keep)

    def free(self) -> None:
        for handle in (self._graph, self._stream, self.published_d, self.loop_d, self._event):
            if handle is not None:
                handle.free()


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

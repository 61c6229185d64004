"""Device-resident generation: a RoundStream's rounds inside conditional WHILE graph nodes, so
one graph launch generates until every row is done, and the committed tokens streamed to the
host through mapped pinned memory while it runs (docs/device-mode.md).

The host launches once and then only watches: each round's tokens are published on a branch of
the graph beside the next round (spec_ring_publish), and a decider kernel after every pass
(spec_loop_decide) ends the loop when every row is done or the round cap is reached. Pacing moves to the device:
loops of M-round passes while some live row is expected to need M rounds more, then of
shorter ones (powers of four) and single rounds to the end, so the tail wastes few rounds and
the long middle pays the per-pass cost once per M rounds.
"""
from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import numpy as np

from ..buffers.layout import HEAD_ENDED, HEAD_SEQ, HEAD_STAMP, HEAD_WORDS
from ..buffers.geometry import as_batch
from ..buffers.stream_bufs import ROW_VALUE_MOST
from ..driver.buffer import MappedBuffer
from ..driver.errors import MemraError
from ..driver.event import Event
from ..driver.graph import Graph, LoopBuilder, LoopUnsupported, branch, check_loops, join
from ..driver.values import I32_MOST, as_flag, as_size
from ..kernels.signatures import load
from .pace import pass_lengths
from .round import Round, refuse_conditionals
from .schedule import Schedule

if TYPE_CHECKING:
    from ..driver.engine import Engine

Step = Callable[[], None]


RUNNING = ("a device-mode loop is still running on these buffers: read its tokens to the end (follow()) or "
           "close() them first")
FREED = "the token feed was freed: the loop that published into it was replaced or its buffers freed"
ROWS_OF = ("tokens", "stamps")  # what a token feed holds a row of (TokenFeed.rows)
# A feed's most tokens a row: the one DeviceLoop.prepare makes for a row's most budget (ROW_VALUE_MOST,
# an i32), the next power of two, 2**31, which the publish's u32 out_cap holds
FEED_CAP_MOST = 1 << ROW_VALUE_MOST.bit_length()


class RoundCapError(MemraError, RuntimeError):
    """The device loop reached its round cap with rows still live. `tokens` holds what each row
    generated before it; the buffers stay usable for the next request."""

    def __init__(self, message: str, tokens: list[np.ndarray]):
        super().__init__(message)
        self.tokens = tokens


class Landed:
    """Tokens the host found published since it last looked: row b's are `tokens[b]` (empty
    where none), with the device's %globaltimer (ns, low 32 bits) at their publishing, right
    after their commit, in `stamps[b]`; `counts[b]` of them, `total` in all. `seen_ns` is when
    the host took them (by its Schedule's clock: time.perf_counter_ns unless given another), and
    `running` whether the loop was still running then.

    A look only reads the counts: the tokens and stamps are copied out of the token feed when
    first asked for, so the host pays for what it reads, not per look. They stay there until the
    feed's next launch; asked for after it, a Landed raises instead of answering with another
    request's tokens."""

    __slots__ = ("start", "end", "seen_ns", "running", "_feed", "_launch", "_tokens", "_stamps")

    def __init__(self, feed: TokenFeed, start: list[int], end: list[int], seen_ns: int, running: bool):
        self.start, self.end = start, end  # each row's published count before and after
        self.seen_ns, self.running = seen_ns, running
        self._feed, self._launch = feed, feed.launches
        self._tokens: list[np.ndarray] | None = None
        self._stamps: list[np.ndarray] | None = None

    @property
    def total(self) -> int:
        return sum(self.end) - sum(self.start)

    @property
    def counts(self) -> np.ndarray:
        return np.subtract(self.end, self.start)

    @property
    def tokens(self) -> list[np.ndarray]:
        if self._tokens is None:
            self._tokens = self._feed.rows("tokens", self._launch, self.start, self.end)
        return self._tokens

    @property
    def stamps(self) -> list[np.ndarray]:
        if self._stamps is None:
            self._stamps = self._feed.rows("stamps", self._launch, self.start, self.end)
        return self._stamps

    def __repr__(self) -> str:
        return f"Landed({self.total} tokens over {len(self.start)} rows, running={self.running})"


class TokenFeed:
    """The mapped words the rounds publish into (ptx/layout.cuh's HEAD_*): a head, whose words
    say that the loop's last node has run, how many publishes there have been and the newest
    one's stamp; then one row per sequence: each row's published count, then its tokens and
    their stamps (u32[B][cap] each). The device writes tokens and stamps, then
    __threadfence_system(), then the count, so the host reads a count first and may then read
    every token below it. The host learns that the loop ended from the memory too, with no
    driver call per look; when to look is its Schedule's. `batch` (as_batch) and `cap`, the
    tokens a row (1 to FEED_CAP_MOST), are checked before the memory is mapped, naming them:
    `batch=True` was a feed of one row, a float was refused as the mapped words' `length`, naming
    neither, and a cap of 0 or less was mapped, a feed no token fits."""

    def __init__(self, engine: Engine, batch: int, cap: int):
        # the checked values size the memory too: a numpy uint8 batch wrapped in `rows` below
        self.batch, self.cap = batch, cap = as_batch(batch), as_size(cap, "cap", 1, FEED_CAP_MOST)
        self.looks = self.empty_looks = 0  # the last follow()'s looks, and those that found nothing
        rows = HEAD_WORDS + batch
        self._memory = MappedBuffer(engine, np.uint32, rows + 2 * batch * cap, label="token feed")
        device = self._memory.device
        self.head_d = device.view(0, HEAD_WORDS)
        self.count_d = device.view(HEAD_WORDS, batch)
        self.tokens_d = device.view(rows, batch * cap)
        self.stamps_d = device.view(rows + batch * cap, batch * cap)
        self._views(self._memory.live)
        self.launches = 0  # clear()s: which launch's tokens the feed holds
        self.clear()  # pinned memory comes uninitialised

    def _views(self, words: np.ndarray | None) -> None:
        """The host's views of the words (None once freed: no view outlives the memory)."""
        batch, cap, rows = self.batch, self.cap, HEAD_WORDS + self.batch
        self._head = None if words is None else words[:HEAD_WORDS]
        self._counts = None if words is None else words[HEAD_WORDS:rows]
        self._tokens = None if words is None else words[rows:rows + batch * cap].reshape(batch, cap)
        self._stamps = None if words is None else words[rows + batch * cap:].reshape(batch, cap)

    def clear(self) -> None:
        """Zero the head and the counts before a launch (the loop before it has finished)."""
        if self._head is None or self._counts is None:
            raise ValueError(FREED)
        self._head[:] = 0
        self._counts[:] = 0
        self.seen = [0] * self.batch
        self.launches += 1

    def head(self) -> list[int]:
        """The head's words, read in order (HEAD_ENDED, HEAD_SEQ, HEAD_STAMP): the loop had ended
        before the publishes were counted, which were counted before the stamp was read, and a
        count read after them all covers at least what they say."""
        if self._head is None:
            raise ValueError(FREED)
        return self._head.tolist()

    def take(self, seen_ns: int, running: bool) -> Landed | None:
        """What was published since the last take, or None if nothing was."""
        if self._counts is None:
            raise ValueError(FREED)
        end = self._counts.tolist()  # the counts first: every token below them is written
        start = self.seen
        if end == start:
            return None
        self.seen = end
        return Landed(self, start, end, seen_ns, running)

    def rows(self, what: str, launch: int, start: list[int], end: list[int]) -> list[np.ndarray]:
        """Copies of each row's `what` ("tokens" or "stamps") from start[b] to end[b], published
        by launch number `launch`: ValueError once the feed is cleared for another, and for any
        other `what`, naming the two ("token" read the stamps, silently)."""
        if what == "tokens":
            block = self._tokens
        elif what == "stamps":
            block = self._stamps
        else:
            raise ValueError(f"what must be one of {ROWS_OF} (a token feed's rows), not {what!r}")
        if launch != self.launches or block is None:
            raise ValueError(f"these {what} were published by an earlier launch of the device loop, whose token "
                             "feed has been reused (or freed) since: take them before the next request")
        return [block[b, a:e].copy() for b, (a, e) in enumerate(zip(start, end))]

    def follow(self, schedule: Schedule | None = None,
               check: Callable[[], object] | None = None) -> Generator[Landed, None, None]:
        """Each batch of tokens as the host finds them published, until the loop has ended (the
        head says so) and its last tokens are taken. The host looks when `schedule` (Schedule's
        defaults where None) says, sleeping between looks; a look reads the head and the counts
        alone. `check` (raising if the device faulted) is called whenever nothing has landed for
        Schedule.STALL_S: a loop that faulted never sets its last word."""
        schedule = Schedule() if schedule is None else schedule
        self.looks = self.empty_looks = 0
        schedule.begin()
        with schedule.slack():
            while True:
                head = self.head()  # the loop ended before this: all is published
                ended, seq, stamp = head[HEAD_ENDED], head[HEAD_SEQ], head[HEAD_STAMP]
                self.looks += 1
                if seq == schedule.publishes and not ended:  # early: again soon
                    self.empty_looks += 1
                    schedule.early(check)
                else:
                    now = schedule.clock()
                    landed = self.take(now, running=not ended)
                    if landed is not None:
                        yield landed
                    if ended:
                        return
                    schedule.found(seq, stamp, now)
                schedule.wait()

    def tokens(self) -> list[np.ndarray]:
        """Every row's tokens published since the launch (copies)."""
        if self._counts is None:
            raise ValueError(FREED)
        return self.rows("tokens", self.launches, [0] * self.batch, self._counts.tolist())

    def free(self) -> None:
        self._views(None)
        self._memory.free()


class DeviceLoop:
    """The device mode of a RoundStream: its loop graph (captured once per feed size and
    pacing) and the host's side of the token feed. RoundStream.follow and
    generate_batch(mode="device") use it; it is not built by hand.

    It takes its rounds from `round` (a Round: the steps before the commit, kernel 4's commit (a
    greedy round's tail: acceptance, commit and a rollback in one launch) and the steps after it,
    issued inside the round's scope and captured by its engine's framework's loop capture); it
    holds no reference to any RoundStream. From launch to finish it holds the round's buffers
    (StreamBufs.hold): no other loop, burst, reset or readback may use them meanwhile, whichever
    RoundStream asks.

    Each round's tokens are published by kernel 4' on a branch of the graph (driver.graph.branch)
    beside the next round's draft and verify, joined before that round's commit (which refills
    the ring it empties; a greedy tail's acceptance, in the same launch, waits for the publish
    too, and touches nothing of it): no round waits for writes to host memory, which take longer
    the deeper the host's cores sleep.
    """

    def __init__(self, round: Round):
        if not isinstance(round, Round):  # a RoundStream or its buffers met "no attribute 'pipelined'" or "'bufs'"
            raise TypeError(f"a device loop runs a Round's rounds (ChainRound, TreeRound: a RoundStream's .round), "
                            f"not {round!r}")
        engine, bufs = round.engine, round.bufs
        refuse_conditionals(round, "device mode", "use graph or overlap mode",
                            also="its tokens come through a host loop that the communicator's watchdog does not time, "
                            "and ")
        check_loops()  # before the decider's module, which an older driver cannot load
        self.engine, self.round, self.bufs = engine, round, bufs
        self._decide = load(engine, "device_loop").kernel("spec_loop_decide").prepare(grid=1, block=256)
        # The cap, the rounds run, the publishes, then each row's published tokens: one memset
        # zeroes all but the cap.
        self._state_d = engine.zeros(np.uint32, 3 + bufs.batch, label="device loop state")
        self._ran = engine.pinned(np.uint32, 1, label="device loop rounds")
        self._feed: TokenFeed | None = None
        self._graph: Graph | None = None
        self._paced: bool | None = None
        self._event = Event(engine)
        self.captures = 0  # loop graphs captured
        self.schedule = Schedule()  # when follow() looks at the feed (look_s, spin; the host's clock and sleep)

    @property
    def schedule(self) -> Schedule:
        """When follow() looks at the token feed: a Schedule (look_s, spin; the host's clock and
        sleep), checked where it is set (TypeError naming it), not as a follow begins: another
        object met an AttributeError in follow(), once the loop was launched."""
        return self._schedule

    @schedule.setter
    def schedule(self, schedule: Schedule) -> None:
        if not isinstance(schedule, Schedule):
            raise TypeError("a device loop's schedule must be a Schedule (memra_cuda.rounds.Schedule(look_s=..., "
                            f"spin=...)), not {schedule!r}")
        self._schedule = schedule

    def prepare(self, cap: int, paced: bool) -> None:
        """Capture the loop for a token feed of `cap` tokens per row and the given pacing,
        unless one that large with that pacing is captured already. The feed holds the next
        power of two, so a server's requests capture it a few times at most (call this up front
        with the largest budget to capture it once). A failed capture leaves the last loop; a
        running one is never replaced (BuffersHeld). The arguments are checked first (_loop_shape)."""
        cap, paced = _loop_shape(cap, paced)
        self.bufs.check_free()
        if self._serves(cap, paced):
            return
        cap = 1 << (cap - 1).bit_length()
        last_feed, last_graph = self._feed, self._graph
        feed = TokenFeed(self.engine, self.bufs.batch, max(cap, last_feed.cap if last_feed else 0))
        try:
            graph = self._capture(feed, paced)
        except BaseException:
            feed.free()
            raise
        if last_graph is not None:
            last_graph.free()
        if last_feed is not None:
            last_feed.free()
        self._feed, self._graph, self._paced = feed, graph, paced
        self.captures += 1

    def serves(self, cap: int, paced: bool) -> bool:
        """Whether the loop captured serves a generation of `cap` tokens a row with this pacing:
        prepare() would capture nothing. (Not whether it can run: ready() says that.) The
        arguments are checked as prepare() checks them (_loop_shape)."""
        return self._serves(*_loop_shape(cap, paced))

    def _serves(self, cap: int, paced: bool) -> bool:
        """serves() of arguments checked already."""
        feed = self._feed
        return self._graph is not None and feed is not None and feed.cap >= cap and self._paced == paced

    def ready(self) -> tuple[TokenFeed, Graph]:
        """The loop's feed and graph, or ValueError where launch() would refuse: nothing captured
        yet (prepare first), or the graph poisoned (a buffer it holds freed). A caller asks
        before it changes anything for the launch (RoundStream.follow sets the rows' stops)."""
        feed, graph = self._feed, self._graph
        if feed is None or graph is None:
            raise ValueError("the device loop is launched once prepare() has captured it")
        graph._usable()
        return feed, graph

    def launch(self, max_rounds: int) -> None:
        """Take the buffers, clear the feed, set the round cap and launch the loop (prepare
        first); its readback, at the end, covers every round it runs. Refused (ready), the
        buffers are never taken; a launch that raises gives them back: a refused launch held them
        for good, every later burst refused as if a loop still ran. `max_rounds` is an int from 1
        to I32_MOST (follow's round cap), checked first: a bool, a float or a negative one was
        refused by the cap word's write, once the feed was cleared (the last launch's tokens, and
        every Landed of it, gone), and 0 launched a loop that ran no round."""
        max_rounds = as_size(max_rounds, "max_rounds", 1, I32_MOST)
        feed, graph = self.ready()
        self.bufs.hold(self, RUNNING)
        try:
            feed.clear()
            self.engine.set_u32(self._state_d, 0, max_rounds)
            graph.launch()
        except BaseException:
            self.bufs.release(self)
            raise
        self._event.record()
        self.bufs.ledger.queued(0, readback=0)

    def skip(self) -> None:
        """A generation with nothing to generate launches nothing: the feed is cleared, so
        tokens() and every Landed of the last launch say so rather than repeat its tokens."""
        self.bufs.check_free()
        if self._feed is not None:
            self._feed.clear()

    def follow(self) -> Generator[Landed, None, None]:
        """Each batch of tokens as the host finds them published (TokenFeed.follow), looking when
        `schedule` says, until the loop has ended and its last tokens are taken; a faulted device
        raises instead of being waited for (the loop's event is asked when nothing has landed for
        a while)."""
        if self._feed is None:
            raise ValueError("the device loop is followed once prepare() has captured it and launch() launched it")
        return self._feed.follow(self.schedule, check=self._event.query)

    @property
    def looks(self) -> tuple[int, int]:
        """The last follow()'s looks at the token feed, and how many of them found nothing."""
        return (self._feed.looks, self._feed.empty_looks) if self._feed else (0, 0)

    def finish(self) -> tuple[np.ndarray, int]:
        """Wait for the loop: the final readback's done flags, and the rounds it ran. The
        buffers are free again even if the wait fails (a fault)."""
        self.bufs.release(self)
        received = self.bufs.receive(0, self._event)
        return received.done, int(self._ran.read()[0])

    def tokens(self) -> list[np.ndarray]:
        """Every row's tokens from the last launch (after finish); none after a skip()."""
        if self._feed is None:
            return [np.zeros(0, np.uint32) for _ in range(self.bufs.batch)]
        return self._feed.tokens()

    def _capture(self, feed: TokenFeed, paced: bool) -> Graph:
        engine, bufs, state, rounds = self.engine, self.bufs, self._state_d, self.round
        published = state.view(3, bufs.batch)
        publish = rounds.kernels.prepare_ring_publish(bufs, published, state.view(2, 1), feed.head_d, feed.count_d,
                                                      feed.tokens_d, feed.stamps_d, feed.cap)
        decide, commit, before, after = self._decide, rounds.commit, rounds.before_commit, rounds.after_commit

        def decider(handle: Any, ran: int, body: int) -> Step:
            def issue() -> None:  # bound now, captured at once: the graph keeps these values
                decide.set(ctl_d=bufs.ctl_d, pub_d=published, acc_d=bufs.acc_d, B=bufs.batch, loop_d=state,
                           handle=int(handle), ran=ran, body=body, paced=int(paced and body > 1))
                decide()
            return issue

        def rounds_then(n: int, decide_pass: Step) -> Step:
            def issue() -> None:
                published_last = None  # the branch publishing the round before
                with rounds.scope():
                    for _ in range(n):
                        for step in before:
                            step()
                        if published_last is not None:
                            join(engine, published_last)
                        commit()
                        published_last = branch(publish)
                        for step in after:
                            step()
                join(engine, published_last)  # the decider reads what was published
                decide_pass()
            return issue

        def read_back() -> None:  # the rows' done flags and positions, the rounds run, then "ended"
            bufs.queue_readback(0)
            engine.copy_dtoh_async(self._ran, state.view(1, 1))
            engine.set_u32(feed.head_d, HEAD_ENDED, 1)

        def build(graph: LoopBuilder) -> None:
            graph.issue(lambda: engine.memset(state.view(1, 2 + bufs.batch), 0))
            for body in pass_lengths(bufs.m_rounds, paced):
                handle = graph.handle()
                graph.issue(decider(handle, 0, body))
                graph.loop(handle, rounds_then(body, decider(handle, body, body)))
            graph.issue(read_back)

        return Graph(engine, lambda: None, capture=rounds.conditional_capture(build))


def _loop_shape(cap: object, paced: object) -> tuple[int, bool]:
    """A loop's `cap` and `paced` (DeviceLoop.prepare's, serves'), checked before anything is
    allocated or captured: cap an int from 1 to ROW_VALUE_MOST, the most tokens a row's budget
    asks for (its feed holds the next power of two, a u32 the kernels take), and paced a bool.
    True and -5 were caps of 1, silently, 2.5 met "'float' object has no attribute 'bit_length'",
    naming nothing, and 2**40 asked the driver for a feed of terabytes; a paced of 1 or "yes" was
    refused by the pass lengths inside the capture, once the feed was allocated."""
    return as_size(cap, "cap", 1, ROW_VALUE_MOST), as_flag(paced, "paced")


__all__ = ["DeviceLoop", "Landed", "LoopUnsupported", "RUNNING", "RoundCapError", "TokenFeed"]

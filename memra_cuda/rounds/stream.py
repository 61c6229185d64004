"""RoundStream: the modes that run a Round's rounds, and the generation loops over them.

What a round is lives in round.py, how far a burst may go in buffers/capacity.py, how long it
should be in pace.py, device mode's loop in device_loop.py; here the modes are chosen between,
bursts queued and read back (each entered in the buffers' ledger), and the tokens gathered per
row.
"""
from __future__ import annotations

import contextlib
import enum
import functools
import logging
import sys
from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..buffers.ledger import as_slot
from ..buffers.stream_bufs import ROW_VALUE_MOST, Readback, StreamBufs, per_row
from .device_loop import DeviceLoop, Landed, RoundCapError
from ..driver.errors import CaptureError
from ..driver.event import Event
from ..driver.graph import Capture, Graph
from ..driver.values import I32_MOST, as_flag, as_listed, as_size
from ..kernels.spec import SpecKernels
from .pace import Pace
from .round import ChainRound, Round, Stages, Step, as_kernels

if TYPE_CHECKING:
    from ..buffers.acceptance import Acceptance
    from ..buffers.lengths import DraftLengths
    from ..driver.module import Launch
    from ..buffers.tables import PointerTable, StateIndexTable, StateTable

log = logging.getLogger("memra_cuda")


class Mode(str, enum.Enum):
    """How a RoundStream runs its rounds (the strings are accepted wherever a Mode is).

    READBACK: one round, then read tokens and done flags back: the loop an engine would write
    without round-stream. EAGER: M rounds issued from Python, one readback. GRAPH: the M rounds
    and the readback captured once as a CUDA graph and replayed. OVERLAP: graph replays two
    deep, the next burst queued before the last one is read, so the GPU never waits for the host.
    DEVICE: one graph launch generates until every row is done, the rounds in conditional WHILE
    nodes, the tokens fed to the host as they commit (device_loop.py; CUDA 12.4+).
    """

    READBACK = "readback"
    EAGER = "eager"
    GRAPH = "graph"
    OVERLAP = "overlap"
    DEVICE = "device"


MODES = tuple(mode.value for mode in Mode)
_MODE_OF = {mode.value: mode for mode in Mode}  # a Mode is a str: it finds itself here too


def as_mode(mode: Mode | str) -> Mode:
    """`mode` as a Mode, ValueError naming the choices."""
    try:
        return _MODE_OF[mode]
    except (KeyError, TypeError):
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}") from None


class RoundStream:
    """Generates with one readback per burst of rounds, in five modes (Mode), from one Round.

    The round is the ChainRound built here from the model's callables and buffers (round.py;
    docs/round-stream.md, docs/model-side.md), or any Round given to RoundStream.of (a TreeRound:
    docs/trees.md). Everything is checked before anything is queued, and each burst against the
    caches' capacity from what the last readback said (one reduction in the common case).

    A done row sits the rounds out (its position frozen) while the others go on. A generation
    starts where the last bufs.reset / reset_row (or readback) left every row. `pace` cuts a
    generation's bursts to the rounds its rows are expected to need (Pace): right wherever a
    round costs more than a host readback (~0.1-0.2 ms: any real model); off for cheaper ones.
    `capture` says how graphs are captured (default: the engine's Framework's: the driver's
    stream capture, or torch's for an engine from memra_cuda.torch.engine()). `stages` (Stages) is for pipelines on
    several GPUs; `kernels` (SpecKernels) is built when not given. `lengths` (DraftLengths of
    `bufs`) has every round choose each row's draft length on the device first (docs/lengths.md);
    `narrower` adds bodies of narrower widths, one of which a burst graph runs each round, by the
    width chosen (ChainRound's); without them, `choose_beside` runs the chooser beside the draft
    and the verify in a graph, off the round's path (ChainRound's). `skip_done` has the burst
    graphs skip the draft and the verify of a round once every row is done (Round's; CUDA
    12.4+), and pacing size a burst to cover the rows' need (Pace's `skips`).
    """

    def __init__(self, bufs: StreamBufs, *, draft_chain: Step, verify_trunk: Step, draft_d: Any,
                 acceptance: Acceptance, rollback_tables: Sequence[PointerTable],
                 state_tables: Sequence[StateTable | StateIndexTable] = (), seed_gather: Launch | None = None,
                 lengths: DraftLengths | None = None, narrower: Mapping[int, tuple[Step, Step]] | None = None,
                 choose_beside: bool = False, skip_done: bool = False, capture: Capture | None = None,
                 pace: bool = True, stages: Stages | None = None, kernels: SpecKernels | None = None):
        if not isinstance(bufs, StreamBufs):  # an engine given for its buffers failed on an attribute
            raise TypeError(f"RoundStream's bufs must be a StreamBufs(engine, geometry), not {bufs!r}")
        kernels = as_kernels(kernels, "RoundStream", bufs)
        self._start(ChainRound(bufs, kernels, draft_chain=draft_chain,
                               verify_trunk=verify_trunk, draft_d=draft_d, acceptance=acceptance,
                               rollback_tables=rollback_tables, state_tables=state_tables, seed_gather=seed_gather,
                               lengths=lengths, narrower=narrower, choose_beside=choose_beside, skip_done=skip_done,
                               capture=capture, stages=stages), pace)

    @classmethod
    def of(cls, round: Round, *, pace: bool = True) -> RoundStream:
        """The modes over a Round built by hand: a TreeRound, say (docs/trees.md)."""
        (stream := cls.__new__(cls))._start(round, pace)
        return stream

    def _start(self, round: Round, pace: bool) -> None:
        pace = as_flag(pace, "pace")
        if not isinstance(round, Round):
            raise TypeError(f"RoundStream.of takes a Round (ChainRound, TreeRound), not {round!r}")
        self.round, self.bufs, self.engine, self.kernels = round, round.bufs, round.engine, round.kernels
        self.acceptance, self.pace = round.acceptance, pace
        self._graphs: dict[tuple[int, int], Graph] = {}  # (pinned readback slot, rounds) -> burst graph
        self.sealed = False  # capture_graphs(seal=True): a graph missing is refused, not captured mid-generation
        self._events: list[Event] = []
        self._device: DeviceLoop | None = None
        self.rounds = self.bursts = 0  # rounds sent to the GPU, host readbacks they waited for
        # tokens a round a row made in the last generation that measured one (Pace.observed: a paced
        # or overlapped one; an unpaced eager or graph burst runs M rounds whatever the rate): the
        # next generation's rate before its first readback, which sizes a burst queued ahead of it
        self.rate = 1.0
        # the last step()'s readback while it is waited for: (the ledger's events then, its rounds)
        self._cut: tuple[int, int] | None = None

    @property
    def capacity(self) -> int | None:
        """The fewest KV entries of any cache behind the round (None: unchecked)."""
        return self.round.capacity.entries

    # -- queueing ----------------------------------------------------------------------------
    def issue_round(self) -> None:
        """Queue one round (no readback), checked against the caches' capacity first."""
        self.issue_burst(1)

    def issue_burst(self, rounds: int | None = None) -> None:
        """Queue `rounds` rounds (1 to M, default M) and no readback, checked first against the
        rings (M rounds' tokens until a readback) and the caches (bufs' ledger)."""
        rounds = self._burst_rounds(rounds)
        self._check(rounds)
        self.round.issue(rounds)
        self.bufs.ledger.queued(rounds)
        self.rounds += rounds

    def _check(self, rounds: int) -> None:
        """Refuse a burst of `rounds` that the buffers, their rings or the caches cannot take."""
        bufs = self.bufs
        bufs.check_free(rounds)
        self.round.capacity.check_burst(bufs.positions, bufs.done, rounds, bufs.ledger.unseen_rounds)

    def _queue(self, mode: Mode, rounds: int, slot: int = 0) -> None:
        """Check a burst, then queue it and its readback into pinned `slot` (a graph's replay,
        but in readback and eager mode)."""
        self._check(rounds)
        if mode is Mode.READBACK or mode is Mode.EAGER:
            self.round.issue(rounds)
            self.bufs.ledger.queued(rounds)
            self.bufs.queue_readback(slot)
        else:  # the captured graph straight from the dict: graph_for validates again
            (self._graphs.get((slot, rounds)) or self.graph_for(slot, rounds)).launch()
            self.bufs.ledger.queued(rounds, readback=slot)
        self.rounds += rounds

    def _receive(self, slot: int, rounds: int, event: Event | None = None) -> Readback:
        """bufs.receive of a burst of `rounds` rounds, refusing one in which a row that was live
        throughout committed nothing: every live round commits a token, so such a row is one no
        kernel served, and a generation waiting for it would never end."""
        done_before = self.bufs.done
        readback = self.bufs.receive(slot, event)
        self.bursts += 1
        if 0 in readback.committed:
            stalled = np.flatnonzero(~done_before & ~readback.done & (np.array(readback.committed) == 0))
            if stalled.size:
                raise RuntimeError(f"{stalled.size} live row(s) of {self.bufs.batch} (row {stalled[0]} first) "
                                   f"committed no token in a burst of {rounds} round(s): their rounds did not run")
        return readback

    def _burst_rounds(self, rounds: int | None, most: int | None = None) -> int:
        most = self.bufs.m_rounds if most is None else most
        return most if rounds is None else as_size(rounds, "rounds", 1, most)

    # -- graphs ------------------------------------------------------------------------------
    @property
    def graph(self) -> Graph:
        """M rounds, the ring and ctl copies to pinned slot 0 and the ring reset, as one graph."""
        return self.graph_for(0)

    def graph_for(self, slot: int, rounds: int | None = None) -> Graph:
        """The burst graph of `rounds` rounds (default M) reading back into pinned slot `slot`
        (0 or 1), captured the first time it is asked for (once per length). The slot is checked
        first, before anything is captured: any other (-1, 2, a bool) is refused, naming it."""
        slot, rounds = as_slot(slot), self._burst_rounds(rounds)
        if (slot, rounds) not in self._graphs:
            if self.sealed:
                raise CaptureError(f"the burst graph of {rounds} rounds reading back into slot {slot} was not captured "
                                   "before the first request (capture_graphs sealed this stream): capture it there")
            self.bufs.check_free()  # a running loop's buffers are not captured over either
            built = self.round.burst_capture(rounds, functools.partial(self.bufs.queue_readback, slot))
            if built is not None:  # its rounds' bodies in conditional nodes, built node by node
                self._graphs[slot, rounds] = Graph(self.engine, lambda: None, capture=built)
            else:
                issue = functools.partial(self._burst_and_readback, slot, rounds)
                self._graphs[slot, rounds] = Graph(self.engine, issue, capture=self.round.capture,
                                                   joined=self.round.joined)
        return self._graphs[slot, rounds]

    def _burst_and_readback(self, slot: int, rounds: int) -> None:
        self.round.issue(rounds)
        self.bufs.queue_readback(slot)

    def capture_graphs(self, lengths: Sequence[int] | None = None, slots: Sequence[int] = (0,),
                       seal: bool = False) -> None:
        """Capture the burst graphs of `lengths` rounds (default: every length pacing may ask
        for, the powers of two below M and M) reading back into `slots` (0 for step and graph
        mode; 0 and 1 for overlap) now, before any request: a capture through a framework (torch
        synchronises the device and empties its cache for each) then never stalls a server
        mid-generation. With `seal`, any other graph asked for later is a CaptureError: what is
        served or timed captures nothing. `lengths` and `slots` are counted ones (a list, a tuple
        or a 1-D array: as_listed), each checked before anything is captured: an iterator of
        lengths was used up by the first slot, the second's graphs left uncaptured, silently, and
        a bad slot or length was refused once the graphs before it had been captured."""
        seal = as_flag(seal, "seal")
        slots = [as_slot(slot) for slot in as_listed(slots, "slots", "readback slots (0 or 1)")]
        lengths = Pace.lengths(self.bufs.m_rounds) if lengths is None else [
            self._burst_rounds(rounds) for rounds in as_listed(lengths, "lengths", "burst lengths (rounds)")]
        for slot in slots:
            for rounds in lengths:
                self.graph_for(slot, rounds)
        self.sealed = self.sealed or seal

    def capture_loop(self, tokens: int) -> None:
        """Capture device mode's loop now, for generations of up to `tokens` new tokens a row (its
        token feed holds the next power of two), with this stream's pacing: a sealed stream
        refuses device mode for a generation that the loop captured here cannot take, where an
        unsealed one captures it at that generation. LoopUnsupported where the driver has no
        conditional nodes, or for pipeline stages (DeviceLoop). `tokens` is an int from 1 to a row's
        most budget (ROW_VALUE_MOST), refused naming it before the loop is made."""
        self.device_loop.prepare(as_size(tokens, "tokens", 1, ROW_VALUE_MOST), self.pace)

    def require_loop(self, tokens: int) -> None:
        """CaptureError where this stream is sealed and the device loop captured before it cannot
        take a generation of `tokens` new tokens a row: follow() would capture one mid-generation.
        A decoder asks before it prefills its rows, so a refusal leaves them as they were.
        `tokens` is an int from 0 (no loop needed) to a row's most budget, refused naming it
        (the loop's check named its `cap`, which no caller of this passes)."""
        tokens = as_size(tokens, "tokens", 0, ROW_VALUE_MOST)
        if self.sealed and tokens and not self.device_loop.serves(tokens, self.pace):
            raise CaptureError(f"device mode's loop for {tokens} tokens a row was not captured before the first "
                               "request (capture_graphs sealed this stream): capture_loop() it there")

    def require_graphs(self, mode: Mode | str) -> None:
        """CaptureError where this stream is sealed and a burst graph `mode` may ask for was not
        captured before it: a readback slot of the mode's (0; overlap's 1 too) at a burst length
        pacing may choose. Met mid-generation, the refusal came after the first burst had run, its
        tokens lost. generate_batch asks before it queues anything, a decoder before it prefills."""
        mode = as_mode(mode)
        if not self.sealed or mode not in (Mode.GRAPH, Mode.OVERLAP):
            return
        rounds = self.rounds_per_step(mode)
        lengths = Pace.lengths(rounds) if self.pace and rounds > 1 else [rounds]
        missing = [(slot, n) for slot in ((0, 1) if mode is Mode.OVERLAP else (0,)) for n in lengths
                   if (slot, n) not in self._graphs]
        if missing:
            raise CaptureError(f"{mode.value} mode's burst graphs {missing} ((readback slot, rounds)) were not "
                               "captured before the first request (capture_graphs sealed this stream): capture them "
                               "there (overlap reads back into slots 0 and 1)")

    @property
    def graphs(self) -> tuple[tuple[int, int], ...]:
        """The (readback slot, rounds) of every burst graph captured so far."""
        return tuple(sorted(self._graphs))

    # -- generating --------------------------------------------------------------------------
    def rounds_per_step(self, mode: Mode | str) -> int:
        """The most rounds one step of `mode` runs: one for "readback", else M (device mode: a pass)."""
        return 1 if as_mode(mode) is Mode.READBACK else self.bufs.m_rounds

    def step(self, mode: Mode | str = Mode.GRAPH, rounds: int | None = None) -> Readback:
        """One burst (one round in "readback" mode) of every row, and its one readback: the unit
        of continuous batching (between steps, bufs.start_row starts a request in a slot:
        memra_cuda.rounds.Server). `rounds` (1 to M, default M) shortens a burst that would run past every
        row's stop: each length is its own graph, captured on first use (or capture_graphs). Where
        an interrupt cuts its wait short, recover() hands its readback out."""
        mode = as_mode(mode)
        if mode is Mode.OVERLAP:
            raise ValueError('"overlap" keeps two bursts in flight, which a step of one burst cannot: '
                             'use generate() (one row) or generate_batch(), or step in "graph"')
        if mode is Mode.DEVICE:
            raise ValueError('"device" generates until every row is done, in one launch: use generate() (one row), '
                             'generate_batch() or follow(), or step in "graph"')
        rounds = self._burst_rounds(rounds, self.rounds_per_step(mode))
        self._cut = None  # a step that queues nothing (refused) leaves nothing to recover either
        self._queue(mode, rounds)
        self._cut = self.bufs.ledger.events, rounds
        return self._received(rounds)

    def recover(self) -> Readback | None:
        """The readback of the last step() where its wait was cut short (an interrupt): that burst
        ran, and its tokens are in pinned slot 0 alone, which the next burst overwrites; received
        now. None where that step's readback was received, or the ledger has entered anything
        since (rounds or a readback queued, a row started, reset or stopped: the readback would
        describe rows that have moved on). A Server's next step asks for it
        (rounds.serving.Decoder.recover) before any row changes hands."""
        ledger = self.bufs.ledger
        if self._cut is None or self._cut[0] != ledger.events or not ledger.unreceived(0):
            return None
        return self._received(self._cut[1])

    def _received(self, rounds: int) -> Readback:
        """The readback of the step `_cut` names (a burst of `rounds`): kept for recover() where only
        an interrupt cut it, not an Exception (a fault, a refused readback: a second reading would
        repeat it)."""
        try:
            readback = self._receive(0, rounds)
        except Exception:
            self._cut = None
            raise
        self._cut = None
        return readback

    def generate(self, max_new_tokens: int, *, eos: int | None = None, mode: Mode | str = Mode.GRAPH) -> np.ndarray:
        """Generate one sequence (a batch of 1) until EOS or max_new_tokens (the device's token
        budget), from where the last bufs.reset (or readback) left it: generate_batch for a single row."""
        if self.bufs.batch != 1:
            raise ValueError(f"generate() serves a batch of 1; these buffers hold {self.bufs.batch}: "
                             f"use generate_batch")
        return self.generate_batch(max_new_tokens, eos=eos, mode=mode)[0]

    def generate_batch(self, max_new_tokens: int | Sequence[int], *, eos: int | None | Sequence[int | None] = None,
                       mode: Mode | str = Mode.GRAPH) -> list[np.ndarray]:
        """Generate every row of the batch until its EOS or its max_new_tokens (the device's
        token budget per row), from where the last reset (or readback) left each row; returns
        each row's tokens. `max_new_tokens` and `eos` are one value for all rows or one per row.

        Bursts go on while any row is live, each as long as Pace expects the live rows to need
        (at most M, where `pace` is on); each readback tells the host every row's position, so
        checking capacity costs no extra readback. Every argument is checked before anything is
        queued.
        """
        mode, bufs = as_mode(mode), self.bufs
        budgets = np.array(per_row(max_new_tokens, bufs.batch, "max_new_tokens", optional=False), np.int64)
        stops = per_row(eos, bufs.batch, "eos")
        if mode is Mode.DEVICE:
            for _ in self.follow(budgets.tolist(), eos=stops):
                pass  # the tokens stay in the token feed until the next launch
            return self._device.tokens() if self._device else [np.zeros(0, np.uint32) for _ in range(bufs.batch)]
        bufs.check_free()
        rounds = self.rounds_per_step(mode)
        if budgets.any():  # nothing to generate queues no burst, and needs no graph
            self.require_graphs(mode)
            self.round.capacity.check_burst(bufs.positions, budgets == 0, rounds, bufs.ledger.unseen_rounds)
        bufs.set_stop(stops, budgets.tolist())
        out: list[list[np.ndarray]] = [[] for _ in range(bufs.batch)]
        # a burst graph that skips rounds past every row's end (the round's skip_done) is sized to
        # cover the rows' need; rounds issued from the host (eager, readback) skip nothing
        skips = self.round.gate is not None and mode in (Mode.GRAPH, Mode.OVERLAP)
        pace = Pace(budgets, rounds, cut=self.pace and rounds > 1, rate=self.rate, skips=skips)
        if mode is Mode.OVERLAP:
            if not bufs.done.all():  # rows with nothing to generate need no burst
                self._generate_overlapped(pace, out)
        elif not bufs.done.all():
            live = ~bufs.done
            burst = pace.rounds(live)
            self._queue(mode, burst)
            while True:
                readback = self._receive(0, burst)
                if pace.cut:  # ~20 us of numpy: nothing to learn where every burst runs M rounds
                    pace.record(burst, np.array(bufs.committed), live & ~readback.done)
                more = not readback.done.all()
                if more:  # the next burst runs while this one's tokens are taken apart
                    live = ~readback.done
                    burst = pace.rounds(live)
                    self._queue(mode, burst)
                _append(readback, out)
                if not more:
                    break
        if (observed := pace.observed()) is not None:
            self.rate = max(observed, 1.0)
        return [np.concatenate(row) if row else np.zeros(0, np.uint32) for row in out]

    def _generate_overlapped(self, pace: Pace, out: list[list[np.ndarray]]) -> None:
        """Bursts two deep. The next burst is queued ahead only when it looks needed (Pace.needed:
        some live row may have budget left even if the one in flight commits as few tokens a
        round as that row's leanest burst, so a budget stop rarely leaves one queued for nothing)
        and the caches have room for it behind the one in flight; else the host reads first and
        checks the positions it now knows, which raises if even that burst does not fit."""
        if not self._events:
            self._events = [Event(self.engine), Event(self.engine)]
        bufs, room = self.bufs, self.round.capacity
        slot, flight = 0, pace.rounds(~bufs.done)
        self._queue(Mode.OVERLAP, flight, slot)
        self._events[slot].record()
        while True:
            live, queued = ~bufs.done, 0
            if pace.needed(live, flight):
                queued = pace.rounds(live, in_flight=flight)
                if room.burst_short(bufs.positions, bufs.done, queued, bufs.ledger.unseen_rounds).size:
                    queued = 0
                else:
                    self._queue(Mode.OVERLAP, queued, 1 - slot)
                    self._events[1 - slot].record()
            readback = self._receive(slot, flight, self._events[slot])
            _append(readback, out)
            pace.record(flight, np.array(bufs.committed), live & ~readback.done)
            if readback.done.all():
                return
            if not queued:
                queued = pace.rounds(~readback.done)
                self._queue(Mode.OVERLAP, queued, 1 - slot)
                self._events[1 - slot].record()
            slot, flight = 1 - slot, queued

    # -- device mode -------------------------------------------------------------------------
    @property
    def device_loop(self) -> DeviceLoop:
        """Device mode's loop graph and token feed, made on first use (LoopUnsupported where
        the driver has no conditional WHILE nodes, or for pipeline stages)."""
        if self._device is None:
            self._device = DeviceLoop(self.round)
        return self._device

    def follow(self, max_new_tokens: int | None | Sequence[int | None], *,
               eos: int | None | Sequence[int | None] = None, max_rounds: int | None = None) -> Iterator[Landed]:
        """Generate every row in device mode, from where the last reset left it; the returned
        iterator yields the tokens as they reach the host.

        One graph launch runs the rounds until every row is done (its EOS or its budget) or
        `max_rounds` rounds have run (default: the largest budget, which no row outlasts; needed
        where a row has no budget). Each Landed holds, per row, the tokens committed since the
        last; the host sleeps between looks and never synchronises until the loop ends. The
        arguments and the caches' room for the whole generation are checked before the launch. A
        loop the cap stopped with rows live raises RoundCapError (holding the tokens) after the
        last are yielded. Until the iterator is read to the end, closed or dropped, the loop holds
        the buffers: everything else on them is refused (BuffersHeld), from any RoundStream.
        """
        bufs = self.bufs
        bufs.check_free()
        budgets = per_row(max_new_tokens, bufs.batch, "max_new_tokens")
        stops = per_row(eos, bufs.batch, "eos")
        max_rounds, most = _loop_budget(budgets, max_rounds, bufs.k)
        done = most == 0
        self.round.capacity.check_loop(bufs.positions, most, done, bufs.ledger.unseen_rounds)
        if done.all():  # nothing to generate: nothing launches, nor needs a loop
            bufs.set_stop(stops, budgets)
            if self._device is not None:
                self._device.skip()
            return iter(())
        loop = self.device_loop
        self.require_loop(int(most.max()))
        loop.prepare(int(most.max()), self.pace)
        loop.ready()  # a refusal before the rows' stops change
        bufs.set_stop(stops, budgets)
        loop.launch(max_rounds)
        return _Following(self, loop, max_rounds)


class _Following(Iterator[Landed]):
    """follow()'s iterator: the loop's tokens as they land, then its end: the rounds it ran are
    counted, and a loop the cap stopped raises RoundCapError. Closed (or dropped) before the end,
    started or not, it waits for the loop, so the buffers are free again; dropped at interpreter
    exit, when the device's context is gone, it has nothing left to wait for."""

    def __init__(self, rounds: RoundStream, loop: DeviceLoop, max_rounds: int):
        self._rounds, self._loop, self._max_rounds = rounds, loop, max_rounds
        self._landed: Generator[Landed, None, None] | None = loop.follow()

    def __next__(self) -> Landed:
        if self._landed is None:
            raise StopIteration
        try:
            return next(self._landed)
        except StopIteration:
            self._end(check_cap=True)
            raise
        except BaseException:
            with contextlib.suppress(Exception):  # the loop's failure is the news, not the wait's
                self._end(check_cap=False)
            raise

    def close(self) -> None:
        if self._landed is not None:
            self._end(check_cap=False)

    def __del__(self) -> None:
        if sys.is_finalizing():
            return
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - a finaliser has nowhere to raise to
            log.warning("memra_cuda: a device loop's tokens dropped unread: waiting for the loop failed: %s", exc)

    def _end(self, check_cap: bool) -> None:
        landed, self._landed = self._landed, None
        if landed is not None:
            landed.close()  # a follow() still running restores the thread's timer slack
        done, ran = self._loop.finish()
        self._rounds.rounds += ran
        self._rounds.bursts += 1
        if check_cap and not done.all():
            live = np.flatnonzero(~done)
            raise RoundCapError(f"the device loop stopped at its cap of {self._max_rounds} rounds with {live.size} "
                                f"row(s) still live (row {live[0]} first): raise max_rounds or give every row a "
                                "budget", self._loop.tokens())


def _append(readback: Readback, out: list[list[np.ndarray]]) -> None:
    """Each row's tokens onto its list."""
    for row, tokens in zip(out, readback.tokens):
        row.append(tokens)


def _loop_budget(budgets: list[int | None], max_rounds: int | None, k: int) -> tuple[int, np.ndarray]:
    """A device loop's round cap, and the most tokens each row may commit under it."""
    if max_rounds is None:
        if None in budgets:
            raise ValueError("a row without a token budget needs a round cap: pass max_rounds")
        cap = max(n for n in budgets if n is not None)
    else:
        cap = as_size(max_rounds, "max_rounds", 1, I32_MOST)  # DeviceLoop.launch's bound
    most = [cap * (k + 1) if n is None else min(n, cap * (k + 1)) for n in budgets]
    return cap, np.array(most, np.int64)


"""RoundStream: the burst driver that issues rounds onto the engine's stream.

A round, in stream order: [seed_gather] → draft chain → assemble_verify → verify trunk →
accept → commit → rollback. The driver owns nothing model-specific: the caller hands it its
draft chain and verify trunk as callables that queue work on the engine's stream.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from .driver.buffer import as_index
from .driver.event import Event
from .driver.graph import Capture, Graph
from .driver.module import Launch
from .tables import PointerTable

if TYPE_CHECKING:
    from .bufs import StreamBufs
    from .kernels import SpecKernels

MODES = ("readback", "stream", "graph", "overlap")


class CapacityError(ValueError):
    """A KV cache cannot hold the entries the next burst may append."""


def chain(launches: Sequence[Callable[[], None]]) -> Callable[[], None]:
    """One callable issuing `launches` in order: a draft chain or verify trunk from its kernels."""
    steps = tuple(launches)

    def issue() -> None:
        for step in steps:
            step()
    return issue


def kv_capacity(prompt_len: int, max_new_tokens: int, k: int, m_rounds: int, overlap: bool = False) -> int:
    """KV entries a cache needs so generate() never raises CapacityError for this request:
    the prompt, the tokens, and one burst of room past them (two for "overlap" to run ahead)."""
    return prompt_len + max_new_tokens + (2 if overlap else 1) * m_rounds * (k + 1)


def _count(value: Any, what: str) -> int:
    """A non-negative i32 count or position, checked before anything is queued."""
    number = as_index(value, what)
    if not 0 <= number < 2**31:
        raise ValueError(f"{what} must be in [0, 2**31), not {value}")
    return number


class RoundStream:
    """Issues rounds onto the engine's stream and generates with one readback per burst.

    Four ways to run the same rounds, for comparison and for embedding:
    "readback" — one round, then read tokens and the done flag back: the loop an engine would
    write without round-stream; "stream" — M rounds issued from Python, one readback;
    "graph" — the M rounds and the readback captured once as a CUDA graph and replayed;
    "overlap" — graph replays two deep: the next burst is queued before the last one is read,
    so the GPU never waits for the host. A burst that runs after the stop has no effect.

    `rollback_tables` are PointerTables (kv_len_ptr_table and friends): one of them must hold
    `bufs.pos_ctr_d`, which is how the position advances, and together they say how many KV
    entries the caches hold, so every burst is checked against that capacity before it is
    issued. `capture` says how graphs are captured (default: the driver's stream capture).
    """

    def __init__(self, spec: SpecKernels, bufs: StreamBufs, *, draft_chain: Callable[[], None],
                 verify_trunk: Callable[[], None], draft_d: Any, pred_d: Any,
                 rollback_tables: Sequence[PointerTable], seed_gather: Launch | None = None,
                 capture: Capture | None = None):
        tables = list(rollback_tables)
        if not tables:
            raise ValueError("rollback needs at least one pointer table (one of them holding bufs.pos_ctr_d)")
        for table in tables:
            if not isinstance(table, PointerTable):
                raise TypeError(f"rollback tables must be PointerTables (kv_len_ptr_table builds them), not {table!r}")
        if not any(table.holds(bufs.pos_ctr_d) for table in tables):
            raise ValueError("no rollback table holds bufs.pos_ctr_d, so the position would never advance: "
                             "pass pos_ctr=bufs.pos_ctr_d to kv_len_ptr_table")
        capacities = [table.capacity for table in tables if table.capacity is not None]
        self.capacity: int | None = min(capacities) if capacities else None
        self.engine = spec.engine
        self.bufs = bufs
        self._capture = capture
        self._round: list[Callable[[], None]] = [
            *([seed_gather] if seed_gather is not None else []),
            draft_chain,
            spec.prepare_assemble_verify(bufs, draft_d),
            verify_trunk,
            spec.prepare_accept_greedy(bufs, pred_d),
            spec.prepare_ring_commit(bufs),
            *(spec.prepare_rollback(table, bufs) for table in tables),
        ]
        self._graphs: list[Graph | None] = [None, None]  # one per pinned readback slot
        self._events: list[Event] = []
        self.rounds = 0  # rounds step()/generate() sent to the GPU
        self.bursts = 0  # host readbacks they waited for

    def issue_round(self) -> None:
        for step in self._round:
            step()

    def issue_burst(self) -> None:
        for _ in range(self.bufs.m_rounds):
            self.issue_round()

    @property
    def graph(self) -> Graph:
        """M rounds, the ring and ctl copies to pinned slot 0 and the ring reset, as one graph."""
        return self.graph_for(0)

    def graph_for(self, slot: int) -> Graph:
        """The burst graph whose readback lands in pinned slot `slot` (0 or 1), captured once."""
        if self._graphs[slot] is None:
            self._graphs[slot] = Graph(self.engine, functools.partial(self._issue_burst_and_readback, slot),
                                       capture=self._capture)
        return self._graphs[slot]

    def _issue_burst_and_readback(self, slot: int) -> None:
        self.issue_burst()
        self.bufs.queue_readback(self.engine, slot)

    def fits(self, position: int, rounds: int) -> bool:
        """Whether every KV cache can take rounds·(k+1) more entries past `position`."""
        return self.capacity is None or position + rounds * (self.bufs.k + 1) <= self.capacity

    def check_capacity(self, position: int, rounds: int) -> None:
        """Raise CapacityError unless every KV cache can take rounds·(k+1) entries past position."""
        if not self.fits(position, rounds):
            raise CapacityError(
                f"KV cache of {self.capacity} entries cannot take the next burst: {rounds} rounds at "
                f"k={self.bufs.k} may write up to {position + rounds * (self.bufs.k + 1)} (position "
                f"{position}): use a larger cache, fewer rounds per burst or a token budget")

    def generate(self, start_pos: int, max_new_tokens: int, *, eos: int | None = None,
                 mode: str = "graph") -> np.ndarray:
        """Generate until EOS or max_new_tokens (the device's token budget).

        `start_pos` is pos_ctr after prefill (tokens whose KV is committed); the host tracks
        the position from the tokens it reads back, so checking capacity costs no readback.
        Every argument is checked before anything is queued.
        """
        rounds = self.rounds_per_step(mode)
        start_pos = _count(start_pos, "start_pos")
        max_new_tokens = _count(max_new_tokens, "max_new_tokens")
        if max_new_tokens:
            self.check_capacity(start_pos, rounds)
        self.bufs.set_stop(self.engine, eos, max_new_tokens)
        if max_new_tokens == 0:
            return np.zeros(0, np.uint32)
        if mode == "overlap":
            return self._generate_overlapped(start_pos, max_new_tokens)
        out: list[np.ndarray] = []
        generated, done = 0, False
        while not done:
            tokens, done = self.step(mode, start_pos + generated)
            out.append(tokens)
            generated += len(tokens)
        return np.concatenate(out)

    def _generate_overlapped(self, start_pos: int, max_new_tokens: int) -> np.ndarray:
        """Bursts two deep. The next burst is queued ahead only when it looks needed and the
        caches have room for it behind the one in flight, whose tokens the host has not seen.
        "Needed": the burst in flight would leave budget over if it committed as few tokens as
        the leanest burst so far (at least M: a round that does not stop commits one or more),
        so a budget stop rarely leaves a burst queued for nothing, and never one with effect.
        Otherwise the host reads first, then checks the position it now knows, which raises if
        even that burst does not fit."""
        if not self._events:
            self._events = [Event(self.engine), Event(self.engine)]
        m, burst = self.bufs.m_rounds, self.bufs.m_rounds * (self.bufs.k + 1)
        out: list[np.ndarray] = []
        generated, slot, leanest = 0, 0, m
        self._queue_graph(slot, start_pos)
        while True:
            ahead = generated + leanest < max_new_tokens and self.fits(start_pos + generated + burst, m)
            if ahead:
                self._queue_graph(1 - slot, start_pos + generated + burst)
            tokens, done = self.bufs.collect(self.engine, slot, self._events[slot])
            self.bursts += 1
            out.append(tokens)
            generated += len(tokens)
            if done:
                return np.concatenate(out)
            leanest = len(tokens) if len(out) == 1 else min(leanest, len(tokens))
            if not ahead:
                self._queue_graph(1 - slot, start_pos + generated)
            slot = 1 - slot

    def _queue_graph(self, slot: int, position: int) -> None:
        self.check_capacity(position, self.bufs.m_rounds)
        self.graph_for(slot).launch()
        self._events[slot].record()
        self.rounds += self.bufs.m_rounds

    def rounds_per_step(self, mode: str) -> int:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        return 1 if mode == "readback" else self.bufs.m_rounds

    def step(self, mode: str, position: int) -> tuple[np.ndarray, bool]:
        """One burst (one round in "readback" mode) from `position`, and its one readback:
        (committed tokens, done). Overlapped bursts only run inside generate()."""
        if mode == "overlap":
            raise ValueError('"overlap" keeps two bursts in flight: use generate()')
        rounds = self.rounds_per_step(mode)
        self.check_capacity(_count(position, "position"), rounds)
        if mode == "graph":
            self.graph.launch()
        elif mode == "stream":
            self.issue_burst()
            self.bufs.queue_readback(self.engine)
        else:
            self.issue_round()
            self.bufs.queue_readback(self.engine)
        self.rounds += rounds
        self.bursts += 1
        return self.bufs.collect(self.engine)

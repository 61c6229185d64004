"""Typed launchers of the spec_* kernels, and the burst driver that issues rounds with them.

A round, in stream order: [seed_gather] → draft chain → assemble_verify → verify trunk →
accept → commit → rollback. The driver owns nothing model-specific: the caller hands it its
draft chain and verify trunk as callables that queue work on the engine's stream.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .buffer import DeviceBuffer
from .cache import Cache
from .errors import CapacityError
from .event import Event
from .graph import Graph
from .module import Launch
from .round_stream import StreamBufs

if TYPE_CHECKING:
    from .engine import Engine

MODES = ("readback", "stream", "graph", "overlap")


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


class SpecKernels:
    """The five round-stream kernels of ptx/spec_stream.ptx (loaded once per engine).

    `prepare_*` validates the buffers and returns a prepared launch to keep and call every
    round; the plain methods launch once.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.module = engine.load_ptx("spec_stream")

    def _launch(self, name: str, types: list[str], *values: object, threads: int = 1) -> Launch:
        block = min(max(32, threads), 256)
        grid = min((threads + block - 1) // block, 1024)
        return self.module.kernel(name).prepare(types, grid, block).set(*values)

    def prepare_seed_gather(self, rows_d: DeviceBuffer, row_words: int, bufs: StreamBufs,
                            out_d: DeviceBuffer) -> Launch:
        _words("rows_d", rows_d)
        _words("out_d", out_d)
        if row_words < 1 or rows_d.len % row_words or out_d.len < row_words:
            raise ValueError(f"rows_d ({rows_d.len} words) must hold whole rows of {row_words} words "
                             f"and out_d ({out_d.len}) one row")
        return self._launch("spec_seed_gather", ["ptr", "u32", "u32", "ptr", "ptr"],
                            rows_d, rows_d.len // row_words, row_words, bufs.acc_d, out_d, threads=row_words)

    def prepare_assemble_verify(self, bufs: StreamBufs, draft_d: DeviceBuffer) -> Launch:
        _words("draft_d", draft_d, at_least=bufs.k)
        return self._launch("spec_assemble_verify", ["ptr", "ptr", "u32", "ptr", "ptr", "ptr"],
                            bufs.pend_d, draft_d, bufs.k, bufs.vtok_d, bufs.pos_ctr, bufs.pos_start_d,
                            threads=bufs.k + 1)

    def prepare_accept_greedy(self, bufs: StreamBufs, pred_d: DeviceBuffer) -> Launch:
        _words("pred_d", pred_d, at_least=bufs.k + 1)
        return self._launch("spec_accept_greedy_dc", ["ptr", "ptr", "u32", "ptr", "ptr", "ptr", "ptr"],
                            bufs.vtok_d, pred_d, bufs.k, bufs.brk_d, bufs.acc_d, bufs.last_pred_d, bufs.ctl_d)

    def prepare_ring_commit(self, bufs: StreamBufs) -> Launch:
        return self._launch("spec_ring_commit", ["ptr"] * 6 + ["u32", "u32"],
                            bufs.vtok_d, bufs.acc_d, bufs.last_pred_d, bufs.ctl_d, bufs.pend_d, bufs.ring_d,
                            bufs.ring_cap, bufs.k)

    def prepare_rollback(self, table_d: DeviceBuffer, bufs: StreamBufs) -> Launch:
        if table_d.dtype != np.uint64:
            raise ValueError(f"a pointer table is a u64 buffer, not {table_d!r}")
        return self._launch("spec_rollback_stream", ["ptr", "u32", "ptr", "ptr"],
                            table_d, table_d.len, bufs.pos_start_d, bufs.ctl_d, threads=table_d.len)

    def seed_gather(self, rows_d: DeviceBuffer, row_words: int, bufs: StreamBufs, out_d: DeviceBuffer) -> None:
        self.prepare_seed_gather(rows_d, row_words, bufs, out_d)()

    def assemble_verify(self, bufs: StreamBufs, draft_d: DeviceBuffer) -> None:
        self.prepare_assemble_verify(bufs, draft_d)()

    def accept_greedy(self, bufs: StreamBufs, pred_d: DeviceBuffer) -> None:
        self.prepare_accept_greedy(bufs, pred_d)()

    def ring_commit(self, bufs: StreamBufs) -> None:
        self.prepare_ring_commit(bufs)()

    def rollback(self, table_d: DeviceBuffer, bufs: StreamBufs) -> None:
        self.prepare_rollback(table_d, bufs)()


def _words(name: str, buf: DeviceBuffer, at_least: int = 1) -> None:
    if buf.dtype.itemsize != 4 or buf.len < at_least:
        raise ValueError(f"{name} must be a 32-bit buffer of at least {at_least} elements, not {buf!r}")


class RoundStream:
    """Issues rounds onto the engine's stream and generates with one readback per burst.

    Four ways to run the same rounds, for comparison and for embedding:
    "readback" — one round, then read tokens and the done flag back: the loop an engine would
    write without round-stream; "stream" — M rounds issued from Python, one readback;
    "graph" — the M rounds and the readback captured once as a CUDA graph and replayed;
    "overlap" — graph replays two deep: the next burst is queued before the last one is read,
    so the GPU never waits for the host. A burst that runs after the stop has no effect.
    """

    def __init__(self, spec: SpecKernels, bufs: StreamBufs, *, draft_chain: Callable[[], None],
                 verify_trunk: Callable[[], None], draft_d: DeviceBuffer, pred_d: DeviceBuffer,
                 rollback_tables: Sequence[DeviceBuffer], caches: Sequence[Cache],
                 seed_gather: Launch | None = None):
        if not rollback_tables:
            raise ValueError("rollback needs at least one pointer table (pos_ctr last in the last one)")
        self.engine = spec.engine
        self.bufs = bufs
        self.caches = list(caches)
        self._round: list[Callable[[], None]] = [
            *([seed_gather] if seed_gather is not None else []),
            draft_chain,
            spec.prepare_assemble_verify(bufs, draft_d),
            verify_trunk,
            spec.prepare_accept_greedy(bufs, pred_d),
            spec.prepare_ring_commit(bufs),
            *(spec.prepare_rollback(table, bufs) for table in rollback_tables),
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
            self._graphs[slot] = Graph(self.engine, functools.partial(self._issue_burst_and_readback, slot))
        return self._graphs[slot]

    def _issue_burst_and_readback(self, slot: int) -> None:
        self.issue_burst()
        self.bufs.queue_readback(self.engine, slot)

    def fits(self, position: int, rounds: int) -> bool:
        """Whether every KV cache can take rounds·(k+1) more entries past `position`."""
        need = position + rounds * (self.bufs.k + 1)
        return all(c.capacity is None or need <= c.capacity for c in self.caches)

    def check_capacity(self, position: int, rounds: int) -> None:
        """Raise CapacityError unless every KV cache can take rounds·(k+1) entries past position."""
        if not self.fits(position, rounds):
            capacity = min(c.capacity for c in self.caches if c.capacity is not None)
            raise CapacityError(
                f"KV cache of {capacity} entries cannot take the next burst: {rounds} rounds at "
                f"k={self.bufs.k} may write up to {position + rounds * (self.bufs.k + 1)} (position "
                f"{position}): use a larger cache, fewer rounds per burst or a token budget")

    def generate(self, start_pos: int, max_new_tokens: int, *, eos: int | None = None,
                 mode: str = "graph") -> np.ndarray:
        """Generate until EOS or max_new_tokens (the device's token budget).

        `start_pos` is pos_ctr after prefill (tokens whose KV is committed); the host tracks
        the position from the tokens it reads back, so checking capacity costs no readback.
        """
        self.rounds_per_step(mode)  # validates the mode before anything is queued
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
        self.check_capacity(position, rounds)
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

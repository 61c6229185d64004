"""RoundStream: the burst driver that issues rounds onto the engine's stream.

A round, in stream order: [seed_gather] → draft chain → assemble_verify → verify trunk →
accept → commit → rollback [→ state rollback], for every sequence of the batch at once. The
driver owns nothing model-specific: the caller hands it its draft chain and verify trunk as
callables that queue work on the engine's stream.
"""
from __future__ import annotations

import contextlib
import enum
import functools
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np

from .acceptance import Greedy, Sampling
from .bufs import Readback, Received, per_row
from .device_loop import RUNNING, DeviceLoop, Landed, RoundCapError
from .driver.buffer import DeviceBuffer
from .driver.event import Event
from .driver.graph import Capture, Graph, LoopUnsupported, loops
from .driver.module import Launch
from .tables import (UNCHECKED, AddressTable, PointerTable, StateIndexTable, StateTable, Unchecked, kv_entries,
                     state_targets_disjoint)

if TYPE_CHECKING:
    from .acceptance import Acceptance
    from .bufs import StreamBufs
    from .driver.engine import Engine
    from .kernels import SpecKernels


class Mode(str, enum.Enum):
    """How a RoundStream runs its rounds (the strings are accepted wherever a Mode is).

    READBACK: one round, then read tokens and done flags back: the loop an engine would write
    without round-stream. STREAM: M rounds issued from Python, one readback. GRAPH: the M rounds
    and the readback captured once as a CUDA graph and replayed. OVERLAP: graph replays two
    deep, the next burst queued before the last one is read, so the GPU never waits for the host.
    DEVICE: one graph launch generates until every row is done, the rounds in conditional WHILE
    nodes, the tokens streamed to the host as they commit (device_loop.py; CUDA 12.4+).
    """

    READBACK = "readback"
    STREAM = "stream"
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


@dataclass(frozen=True)
class Stages:
    """What a pipeline of stages on several engines (models/pipeline.py) adds to a round:
    `engines`, the other stages' engines, whose streams the callables fork to and join back
    from (their work joins the burst graph); `round_tail`, queued after this stage's rollback
    (the accept state sent back, the other stages' rollbacks); `capacity`, the fewest KV
    entries the other stages' caches hold."""

    engines: Sequence[Engine]
    round_tail: Callable[[], None] | None = None
    capacity: int | Unchecked | None = None

    def __post_init__(self) -> None:
        if (self.engines or self.round_tail is not None) and self.capacity is None:
            raise ValueError("Stages must say how many KV entries the other stages' caches hold (capacity=), "
                             "or capacity=UNCHECKED: their rollback runs in round_tail, out of the check's sight")
        object.__setattr__(self, "capacity", kv_entries(self.capacity))


class CapacityError(ValueError):
    """A KV cache cannot hold the entries the next burst may append."""


def chain(launches: Sequence[Callable[[], None]]) -> Callable[[], None]:
    """One callable issuing `launches` in order: a draft chain or verify trunk from its kernels."""
    steps = tuple(launches)

    def issue() -> None:
        for step in steps:
            step()
    return issue


class Pace:
    """How many rounds the next burst of a generation runs.

    A burst past every stop still runs all its rounds (to no effect), and a round of a real
    model costs far more than a readback, so the last burst of a request should be no longer
    than the request needs: each live row is expected to need its budget left over the tokens
    a round has committed for it so far (one, before its first readback: no round commits
    fewer), and the burst runs the most any row needs, rounded down to a power of two (so a
    stream captures at most log2(M) graphs more), at most M. A burst that falls short costs
    one short burst more; a row that stops at an EOS cannot be foreseen. With `cut` False
    every burst runs M rounds: where a round costs less than a readback, a short burst more
    costs more than the rounds a cut saves.
    """

    def __init__(self, budgets: np.ndarray, m_rounds: int, cut: bool = True):
        self.budgets = np.asarray(budgets, np.int64)
        self.m_rounds, self.cut = m_rounds, cut
        self.generated = np.zeros_like(self.budgets)
        self._rounds = np.zeros_like(self.budgets)  # rounds each row ran live, start to end
        self._leanest = np.ones(self.budgets.shape)  # fewest tokens per round one of its bursts gave

    @staticmethod
    def lengths(m_rounds: int) -> list[int]:
        """Every burst length rounds() may ask for: the powers of two below M, and M."""
        return [1 << i for i in range(m_rounds.bit_length()) if 1 << i < m_rounds] + [m_rounds]

    def rounds(self, live: np.ndarray, in_flight: int = 0) -> int:
        """Rounds for the next burst of the `live` rows, queued behind `in_flight` rounds whose
        tokens the host has not seen yet."""
        if not self.cut:
            return self.m_rounds
        rate = np.where(self._rounds > 0, self.generated / np.maximum(self._rounds, 1), 1.0)
        left = (self.budgets - self.generated - rate * in_flight)[live]
        # A row that has committed nothing in the rounds it ran gives no rate to divide by: it
        # may need any number of rounds, so it gets the whole M.
        need = np.divide(left, rate[live], out=np.full(left.shape, np.inf), where=rate[live] > 0).max(initial=1)
        if need >= self.m_rounds:
            return self.m_rounds
        return 1 << (max(int(np.ceil(need)), 1).bit_length() - 1)

    def needed(self, live: np.ndarray, in_flight: int) -> bool:
        """Whether some live row may have budget left after `in_flight` rounds, if they commit
        as few tokens a round as that row's leanest burst so far."""
        return bool(np.any(live & (self.generated + self._leanest * in_flight < self.budgets)))

    def record(self, rounds: int, got: np.ndarray, stayed_live: np.ndarray) -> None:
        """A burst of `rounds` rounds committed `got` tokens per row; `stayed_live` rows ran it
        whole (a row that stopped inside it says nothing of its rate)."""
        rate = got / rounds
        first = stayed_live & (self._rounds == 0)
        self._leanest = np.where(first, rate, np.where(stayed_live, np.minimum(self._leanest, rate), self._leanest))
        self.generated += got
        self._rounds[stayed_live] += rounds


def kv_capacity(prompt_len: int, max_new_tokens: int, k: int, m_rounds: int, overlap: bool = False,
                batch: int = 1) -> int:
    """KV entries a cache needs (per sequence) so generate() never raises CapacityError for
    this request: the prompt, the tokens, and one burst of room past them (two for "overlap"
    to run ahead); in a batch, one round more, for the rounds a finished row sits out."""
    return prompt_len + max_new_tokens + (2 if overlap else 1) * m_rounds * (k + 1) + (k + 1 if batch > 1 else 0)


class RoundStream:
    """Issues rounds onto the engine's stream and generates with one readback per burst.

    A round, in stream order: [seed_gather] → draft chain → assemble_verify → verify trunk →
    accept → commit → rollback [→ state rollback], for every row of the batch at once
    (docs/round-stream.md). The model's side is two callables that queue work on the engine's
    stream (`draft_chain`, `verify_trunk`, writing `draft_d` and what `acceptance` reads;
    docs/model-side.md).
    `acceptance` is the rule: Greedy(pred_d) or Sampling(p_d, q_d, seed_d, vocab).

    Five modes run the same rounds (Mode); a row that is done sits the rounds out (its
    position frozen) while the others go on, and a burst that runs after every stop has no
    effect. `rollback_tables` are PointerTables (kv_len_ptr_table and friends): one of them
    must hold `bufs.pos_ctr_d`, which is how the position advances, and every one that names
    KV lengths must know their capacity (or say capacity=UNCHECKED), so every burst is checked
    against it before it is issued: a live row needs room for the burst, and in a batch for one
    round more, which it may sit out done at its final position while other rows finish.
    `state_tables` roll back the recurrent state of a hybrid model's layers (and its draft's),
    each round after the KV lengths: a StateTable (state_copy_table) by copying the kept
    snapshot over the live state, a StateIndexTable (state_flip_table) by pointing the rows'
    slot indices at it (docs/model-side.md, "Recurrent state").
    `capture` says how graphs are captured (default: the driver's stream capture). `pace` cuts
    a generation's bursts to the rounds its rows are expected to need (Pace): right wherever a
    round costs more than a host readback (~0.1-0.2 ms: any real model); turn it off for
    rounds cheaper than that. `stages` (Stages) is for pipelines of stages on several GPUs.

    Torch-backed rounds (the engine borrows a torch stream, or draft_d or the acceptance
    buffers are tensors) are made safe without being told (memra_cuda.torch): the callables run
    with the engine's stream current in torch, and graphs are captured through torch.cuda.graph
    (unless `capture` says otherwise) and replayed through it. capture_graphs() captures every
    burst length up front.

    Everything is checked when the stream is built, and before each burst on the host from what
    the last readback said (one reduction in the common case): the rounds themselves are
    prepared launches and copies, issued at the cost of the bare bindings.
    """

    def __init__(self, spec: SpecKernels, bufs: StreamBufs, *, draft_chain: Callable[[], None],
                 verify_trunk: Callable[[], None], draft_d: Any, acceptance: Acceptance | None = None,
                 rollback_tables: Sequence[PointerTable], state_tables: Sequence[StateTable | StateIndexTable] = (),
                 seed_gather: Launch | None = None, capture: Capture | None = None, pace: bool = True,
                 stages: Stages | None = None, **deprecated: Any):
        acceptance, stages = _deprecated_arguments(acceptance, stages, deprecated)
        if not isinstance(acceptance, (Greedy, Sampling)):
            raise TypeError(f"acceptance must be Greedy(pred_d) or Sampling(p_d, q_d, seed_d, vocab), "
                            f"not {acceptance!r}")
        tables = list(rollback_tables)
        if not tables:
            raise ValueError("rollback needs at least one pointer table (one of them holding bufs.pos_ctr_d)")
        for table in tables:
            if not isinstance(table, PointerTable) or isinstance(table, StateIndexTable):
                raise TypeError(f"rollback tables must be PointerTables of KV lengths (kv_len_ptr_table builds them; "
                                f"state tables go in state_tables), not {table!r}")
            if table.capacity is None and any(t is not None and t is not bufs.pos_ctr_d for t in table.targets):
                raise ValueError(f"rollback table {table!r} names KV lengths but not their capacity, so no burst "
                                 "could be checked against it: build it with kv_len_ptr_table, or give "
                                 "PointerTable(..., capacity=entries), or capacity=UNCHECKED to go unchecked")
        if not any(table.holds(bufs.pos_ctr_d) for table in tables):
            raise ValueError("no rollback table holds bufs.pos_ctr_d, so the position would never advance: "
                             "pass pos_ctr=bufs.pos_ctr_d to kv_len_ptr_table")
        if isinstance(state_tables, AddressTable):
            raise TypeError(f"state_tables is a list of tables, not one table: [{state_tables!r}]")
        states = list(state_tables)
        for table in states:
            if not isinstance(table, (StateTable, StateIndexTable)):
                raise TypeError(f"state tables must be StateTables (state_copy_table) or StateIndexTables "
                                f"(state_flip_table), not {table!r}")
        state_targets_disjoint(states)
        stages = stages or Stages(())
        scope: Callable[[], Any] = contextlib.nullcontext
        loop_capture = loops
        if _torch_in_play(spec.engine, draft_d, *vars(acceptance).values(), *tables, *states):
            from . import torch as adapter  # only once torch objects are in play
            capture, scope = capture or adapter.capture, adapter.stream_scope(spec.engine)
            loop_capture = adapter.loop_capture
        capacities = [c for c in (stages.capacity, *(table.capacity for table in tables))
                      if c is not None and c is not UNCHECKED]
        self.capacity: int | None = min(capacities) if capacities else None
        self.engine = spec.engine
        self.spec = spec
        self.bufs = bufs
        self.acceptance = acceptance
        self.pace = pace
        self._capture, self._loop_capture = capture, loop_capture
        self._scope = scope  # a framework's "this stream is current" around the model's work
        # A round, in stream order: these steps, kernel 4, then the rollbacks, of KV lengths and
        # of recurrent state (device mode publishes each commit on a branch beside the next round).
        self._before_commit = (
            *([seed_gather] if seed_gather is not None else []),
            draft_chain,
            spec.prepare_assemble_verify(bufs, draft_d),
            verify_trunk,
            acceptance.prepare(spec, bufs),
        )
        self._after_commit = (
            *(spec.prepare_rollback(table, bufs) for table in tables),
            *(spec.prepare_state_copy(table, bufs) if isinstance(table, StateTable) else
              spec.prepare_state_flip(table, bufs) for table in states),
            *([stages.round_tail] if stages.round_tail is not None else []),
        )
        self._commit = spec.prepare_ring_commit(bufs)
        self._round = (*self._before_commit, self._commit, *self._after_commit)
        self._device: DeviceLoop | None = None
        self._stages = tuple(stages.engines)
        self._pipelined = bool(self._stages) or stages.round_tail is not None
        self._graphs: dict[tuple[int, int], Graph] = {}  # (pinned readback slot, rounds) -> burst graph
        self._events: list[Event] = []
        self.rounds = 0  # rounds step()/generate() sent to the GPU
        self.bursts = 0  # host readbacks they waited for
        self._idle_room = bufs.k + 1 if bufs.batch > 1 else 0
        # issue_burst's rounds since the host last learnt the positions / the rings were emptied
        self._unseen, self._unseen_mark = 0, bufs.epoch
        self._in_ring, self._ring_mark = 0, bufs.rings_emptied

    def issue_round(self) -> None:
        """Queue one round (no readback), checked against the caches' capacity first."""
        self.issue_burst(1)

    def issue_burst(self, rounds: int | None = None) -> None:
        """Queue `rounds` rounds (1 to M, default M; no readback): the ring holds M rounds'
        tokens, so more would drop tokens. Checked against the caches' capacity first, from the
        positions the last readback (or reset) gave, moved on by the rounds issued here since."""
        self._check_idle()
        rounds = self._burst_rounds(rounds)
        self._check_burst(rounds)
        self._issue(rounds)
        self._unseen += rounds
        self._in_ring += rounds

    def _check_burst(self, rounds: int) -> None:
        """check_capacity for a burst of `rounds` queued now, behind the rounds issue_burst
        queued since the host last learnt the positions (and the ring's room for it)."""
        self.check_capacity(rounds, ahead=self._unseen_rounds(rounds) * (self.bufs.k + 1))

    def _rings_read(self) -> None:
        """A burst and its readback are queued: after it every ring is empty, whether the
        readback was queued now or replays inside a graph (which bufs cannot see)."""
        self._in_ring, self._ring_mark = 0, self.bufs.rings_emptied

    def _unseen_rounds(self, rounds: int) -> int:
        """The rounds issue_burst queued since the host last learnt the positions (a readback
        or a reset): how far they may have moved. Checked first that the ring has room for
        `rounds` more beside those committed since it was last emptied (a readback queued,
        drain_ring, a reset): it holds M rounds' tokens, and a commit past it drops tokens
        while still spending the budget."""
        bufs = self.bufs
        if self._unseen_mark != bufs.epoch:
            self._unseen, self._unseen_mark = 0, bufs.epoch
        if self._ring_mark != bufs.rings_emptied:
            self._in_ring, self._ring_mark = 0, bufs.rings_emptied
        if self._in_ring + rounds > bufs.m_rounds:
            raise ValueError(f"{self._in_ring} round(s) were issued since the ring was last read: {rounds} more "
                             f"would overrun the ring, which holds M={bufs.m_rounds} rounds' tokens; read back first")
        return self._unseen

    def _issue(self, rounds: int) -> None:
        with self._scope():
            for _ in range(rounds):
                for step in self._round:
                    step()

    @property
    def graph(self) -> Graph:
        """M rounds, the ring and ctl copies to pinned slot 0 and the ring reset, as one graph."""
        return self.graph_for(0)

    def graph_for(self, slot: int, rounds: int | None = None) -> Graph:
        """The burst graph of `rounds` rounds (default M) whose readback lands in pinned slot
        `slot` (0 or 1), captured the first time it is asked for: a request's last, shorter
        burst costs one capture per length, once."""
        rounds = self._burst_rounds(rounds)
        if (slot, rounds) not in self._graphs:
            issue = functools.partial(self._issue_burst_and_readback, slot, rounds)
            self._graphs[slot, rounds] = Graph(self.engine, issue, capture=self._capture, joined=self._stages)
        return self._graphs[slot, rounds]

    def capture_graphs(self, lengths: Sequence[int] | None = None, slots: Sequence[int] = (0,)) -> None:
        """Capture the burst graphs of `lengths` rounds (default: every length pacing may ask
        for, the powers of two below M and M) reading back into `slots` (0 for step and graph
        mode; 0 and 1 for overlap) now, before any request: a capture through a framework (torch
        synchronises the device and empties its cache for each) then never stalls a server
        mid-generation."""
        if lengths is None:
            lengths = Pace.lengths(self.bufs.m_rounds)
        for slot in slots:
            if slot not in (0, 1):
                raise ValueError(f"a readback slot is 0 or 1, not {slot!r}")
            for rounds in lengths:
                self.graph_for(slot, rounds)

    @property
    def graphs(self) -> tuple[tuple[int, int], ...]:
        """The (readback slot, rounds) of every burst graph captured so far."""
        return tuple(sorted(self._graphs))

    def _issue_burst_and_readback(self, slot: int, rounds: int) -> None:
        self._issue(rounds)
        self.bufs.queue_readback(self.engine, slot)

    def fits(self, rounds: int, ahead: int = 0, positions: np.ndarray | None = None,
             done: np.ndarray | None = None) -> bool:
        """Whether the next `rounds` rounds fit every row's KV cache (see check_capacity)."""
        return not self._short_rows(rounds, ahead, positions, done).size

    def check_capacity(self, rounds: int, ahead: int = 0, positions: np.ndarray | None = None,
                       done: np.ndarray | None = None) -> None:
        """Raise CapacityError unless every KV cache can take the next `rounds` rounds: a live
        row's rounds·(k+1) entries past its position (plus the idle round of a batch), a done
        row's k+1 scratch entries at its frozen one. Positions and done flags default to the
        host's knowledge (bufs.positions, bufs.done); `ahead` bounds how far the bursts still
        in flight may have moved them."""
        short = self._short_rows(rounds, ahead, positions, done)
        if short.size:
            b = int(short[0])
            position = (self.bufs.positions if positions is None else positions)[b]
            raise CapacityError(
                f"KV cache of {self.capacity} entries cannot take the next burst: {rounds} rounds at "
                f"k={self.bufs.k} may write up to {self._reach(rounds, ahead, positions, done)[b]} (row {b} at "
                f"position {position}): use a larger cache, fewer rounds per burst or a token budget")

    def _reach(self, rounds: int, ahead: int, positions: np.ndarray | None, done: np.ndarray | None) -> np.ndarray:
        positions = self.bufs.positions if positions is None else positions
        done = self.bufs.done if done is None else done
        k1 = self.bufs.k + 1
        return positions + ahead + np.where(done, k1, rounds * k1 + self._idle_room)

    def _short_rows(self, rounds: int, ahead: int, positions: np.ndarray | None,
                    done: np.ndarray | None) -> np.ndarray:
        if self.capacity is None:
            return _NO_ROWS
        # No row reaches past the furthest position plus a live row's burst: one reduction
        # clears the common case, and only a burst near the limit looks at every row.
        furthest = int((self.bufs.positions if positions is None else positions).max())
        if furthest + ahead + rounds * (self.bufs.k + 1) + self._idle_room <= self.capacity:
            return _NO_ROWS
        return np.flatnonzero(self._reach(rounds, ahead, positions, done) > self.capacity)

    def generate(self, start_pos: int, max_new_tokens: int, *, eos: int | None = None,
                 mode: Mode | str = Mode.GRAPH) -> np.ndarray:
        """Generate one sequence (a batch of 1) until EOS or max_new_tokens (the device's token
        budget): generate_batch for a single row."""
        if self.bufs.batch != 1:
            raise ValueError(f"generate() serves a batch of 1; these buffers hold {self.bufs.batch}: "
                             f"use generate_batch")
        return self.generate_batch([start_pos], [max_new_tokens], eos=eos, mode=mode)[0]

    def generate_batch(self, start_pos: Sequence[int], max_new_tokens: int | Sequence[int], *,
                       eos: int | None | Sequence[int | None] = None,
                       mode: Mode | str = Mode.GRAPH) -> list[np.ndarray]:
        """Generate every row of the batch until its EOS or its max_new_tokens (the device's
        token budget per row); returns each row's tokens.

        `start_pos[b]` is row b's pos_ctr after its prefill (tokens whose KV is committed);
        `max_new_tokens` and `eos` are one value for all rows or one per row. Bursts go on while
        any row is live, each as long as Pace expects the live rows to need (at most M, where
        `pace` is on); each readback tells the host every row's position, so checking capacity
        costs no extra readback. Every argument is checked before anything is queued.
        """
        self._check_idle()
        batch = self.bufs.batch
        mode = as_mode(mode)
        rounds = self.rounds_per_step(mode)
        positions = self._start_positions(start_pos)
        budgets = np.array(per_row(max_new_tokens, batch, "max_new_tokens", optional=False), np.int64)
        stops = per_row(eos, batch, "eos")
        out: list[list[np.ndarray]] = [[] for _ in range(batch)]
        if mode is Mode.DEVICE:
            for _ in self.stream(positions, budgets.tolist(), eos=stops):
                pass  # the tokens stay in the token stream until the next launch
            return self.device_loop.tokens() if budgets.any() else [np.zeros(0, np.uint32) for _ in range(batch)]
        if budgets.any():
            self.check_capacity(rounds, positions=positions, done=budgets == 0)
        self.bufs.set_stop(self.engine, stops, budgets.tolist())
        self.bufs.set_positions(positions)
        if mode is Mode.OVERLAP:
            if not self.bufs.done.all():  # rows with nothing to generate need no burst
                self._generate_overlapped(Pace(budgets, rounds, cut=self.pace), out)
        elif self.pace and rounds > 1:
            pace = Pace(budgets, rounds)
            while not self.bufs.done.all():
                live = ~self.bufs.done
                burst = pace.rounds(live)
                readback = self.step(mode, burst)
                self._append(readback, out)
                pace.record(burst, np.array(self.bufs.committed), live & ~readback.done)
        elif not self.bufs.done.all():  # every burst as long as the mode runs: nothing to pace
            self._queue(mode, rounds)
            while True:
                received = self._receive(0, None, rounds)
                more = not received.done.all()
                if more:  # the next burst runs while this one's tokens are taken apart
                    self._queue(mode, rounds)
                self._append(self.bufs.readback(received), out)
                if not more:
                    break
        return [np.concatenate(row) if row else np.zeros(0, np.uint32) for row in out]

    def _start_positions(self, start_pos: Sequence[int]) -> np.ndarray:
        if not isinstance(start_pos, (list, tuple, np.ndarray)):
            raise TypeError(f"start_pos must hold one position per row, not {start_pos!r}")
        return np.array(per_row(list(start_pos), self.bufs.batch, "start_pos", optional=False), np.int64)

    @property
    def device_loop(self) -> DeviceLoop:
        """Device mode's loop graph and token stream, made on first use (LoopUnsupported where
        the driver has no conditional WHILE nodes, or for pipeline stages)."""
        if self._device is None:
            if self._pipelined:
                raise LoopUnsupported("device mode cannot run pipeline stages: a conditional node's body holds "
                                      "the work of one context, and the stages' streams join through events, "
                                      "which a body cannot hold; use graph or overlap mode")
            self._device = DeviceLoop(self.spec, self.bufs, self._before_commit, self._commit, self._after_commit,
                                      self._scope, self._loop_capture)
        return self._device

    def _check_idle(self) -> None:
        """ValueError while a device loop runs: it owns the buffers until its stream is read to
        the end (or closed)."""
        if self._device is not None and self._device.running:
            raise ValueError(RUNNING)

    def stream(self, start_pos: Sequence[int], max_new_tokens: int | None | Sequence[int | None], *,
               eos: int | None | Sequence[int | None] = None, max_rounds: int | None = None) -> Iterator[Landed]:
        """Generate every row in device mode; the returned iterator yields the tokens as they
        reach the host.

        One graph launch runs the rounds until every row is done (its EOS or its budget) or
        `max_rounds` rounds have run (default: the largest budget, which no row can outlast,
        since every live round commits a token; required where a row has no budget). Each
        Landed holds, per row, the tokens committed since the last one (device_loop.Landed);
        the host sleeps between looks and never synchronises the stream until the loop ends.
        Everything is checked here, before the launch: the arguments, and the KV caches' room
        for the whole generation. A loop stopped by the cap with rows still live raises
        RoundCapError (holding the tokens) after the last tokens are yielded; the buffers stay
        usable. Until the iterator is read to the end, closed or dropped, the buffers are the loop's:
        other generation on them is refused.
        """
        self._check_idle()
        batch, k1 = self.bufs.batch, self.bufs.k + 1
        positions = self._start_positions(start_pos)
        budgets = per_row(max_new_tokens, batch, "max_new_tokens")
        stops = per_row(eos, batch, "eos")
        if max_rounds is None:
            if None in budgets:
                raise ValueError("a row without a token budget needs a round cap: pass max_rounds")
            max_rounds = max(budgets)
        else:
            max_rounds = _count(max_rounds, "max_rounds", 2**31 - 1)
        most = np.array([max_rounds * k1 if n is None else min(n, max_rounds * k1) for n in budgets], np.int64)
        done = most == 0
        self._check_loop_capacity(positions, most, done)
        loop = self.device_loop
        if not done.all():
            loop.prepare(int(most.max()), self.pace)
        self.bufs.set_stop(self.engine, stops, budgets)
        self.bufs.set_positions(positions)
        if done.all():
            return iter(())
        loop.launch(max_rounds)
        self._rings_read()
        return _Following(self, loop, max_rounds)

    def _check_loop_capacity(self, positions: np.ndarray, most: np.ndarray, done: np.ndarray) -> None:
        """CapacityError unless every KV cache has room for the whole device loop: a row that
        commits `most` tokens starts its last round at most most - 1 past its position and
        writes k+1 entries there; where rows sit out rounds done (a batch, or passes of several
        rounds), the round that stopped it may have kept k+1, and k+1 scratch entries follow."""
        if self.capacity is None:
            return
        k1 = self.bufs.k + 1
        idle = k1 if self.bufs.batch > 1 or self.bufs.m_rounds > 1 else 0
        reach = positions + np.where(done, k1, most + k1 - 1 + idle)
        short = np.flatnonzero(reach > self.capacity)
        if short.size:
            b = int(short[0])
            raise CapacityError(f"KV cache of {self.capacity} entries cannot take the device loop: row {b} at "
                                f"position {positions[b]} may write up to {reach[b]} ({most[b]} tokens at k={k1 - 1}); "
                                "use a larger cache or a smaller budget or max_rounds")

    @staticmethod
    def _append(readback: Readback, out: list[list[np.ndarray]]) -> None:
        """Each row's tokens onto its list."""
        for row, tokens in zip(out, readback.tokens):
            row.append(tokens)

    def _generate_overlapped(self, pace: Pace, out: list[list[np.ndarray]]) -> None:
        """Bursts two deep. The next burst is queued ahead only when it looks needed and the
        caches have room for it behind the one in flight, whose tokens the host has not seen.
        "Needed" (Pace.needed): some live row may have budget left even if the burst in flight
        commits as few tokens a round as that row's leanest burst so far, so a budget stop
        rarely leaves a burst queued for nothing, and never one with effect. Otherwise the host
        reads first, then checks the positions it now knows, which raises if even that burst
        does not fit. Each burst is as long as Pace expects the rows to need."""
        if not self._events:
            self._events = [Event(self.engine), Event(self.engine)]
        k1 = self.bufs.k + 1
        slot, flight = 0, pace.rounds(~self.bufs.done)
        unseen = self._unseen_rounds(flight) * k1  # issue_burst's rounds before the first readback
        self._queue_graph(slot, flight, ahead=unseen)
        while True:
            live = ~self.bufs.done
            queued = 0
            if pace.needed(live, flight):
                queued = pace.rounds(live, in_flight=flight)
                if self.fits(queued, ahead=unseen + flight * k1):
                    self._queue_graph(1 - slot, queued, ahead=unseen + flight * k1)
                else:
                    queued = 0
            readback = self.bufs.readback(self._receive(slot, self._events[slot], flight))
            unseen = 0
            self.bursts += 1
            self._append(readback, out)
            pace.record(flight, np.array(self.bufs.committed), live & ~readback.done)
            if readback.done.all():
                return
            if not queued:
                queued = pace.rounds(~readback.done)
                self._queue_graph(1 - slot, queued, ahead=0)
            slot, flight = 1 - slot, queued

    def _queue_graph(self, slot: int, rounds: int, ahead: int) -> None:
        self.check_capacity(rounds, ahead)
        self.graph_for(slot, rounds).launch()
        self._rings_read()
        self._events[slot].record()
        self.rounds += rounds

    def rounds_per_step(self, mode: Mode | str) -> int:
        """The most rounds one step of `mode` runs: one for "readback", else M (a device loop
        runs its passes M rounds at a time)."""
        return 1 if as_mode(mode) is Mode.READBACK else self.bufs.m_rounds

    def _burst_rounds(self, rounds: int | None, most: int | None = None) -> int:
        most = self.bufs.m_rounds if most is None else most
        return most if rounds is None else _count(rounds, "rounds", most)

    def step(self, mode: Mode | str = Mode.GRAPH, rounds: int | None = None) -> Readback:
        """One burst (one round in "readback" mode) of every row, and its one readback.

        The unit of continuous batching: between steps, bufs.reset_row and set_stop_row start a
        new request in a slot, and the next step runs it with the others. `rounds` (1 to M,
        default M) shortens a burst that would otherwise run past every row's stop: each
        length is its own graph, captured on first use (or up front with graph_for). Capacity
        is checked from the positions the last readback (or reset) gave. Overlapped bursts
        only run inside generate()."""
        mode = as_mode(mode)
        if mode is Mode.OVERLAP:
            raise ValueError('"overlap" keeps two bursts in flight: use generate()')
        if mode is Mode.DEVICE:
            raise ValueError('"device" generates until every row is done, in one launch: use generate() or stream()')
        self._check_idle()
        rounds = self._burst_rounds(rounds, self.rounds_per_step(mode))
        self._queue(mode, rounds)
        return self.bufs.readback(self._receive(0, None, rounds))

    def _queue(self, mode: Mode, rounds: int) -> None:
        """Check a burst of `rounds` rounds against the caches, then queue it and its readback
        into pinned slot 0 (replay its graph, in graph mode)."""
        self._check_burst(rounds)
        if mode is Mode.GRAPH:  # the captured graph straight from the dict: graph_for validates again
            (self._graphs.get((0, rounds)) or self.graph_for(0, rounds)).launch()
        else:
            self._issue(rounds)
            self.bufs.queue_readback(self.engine)
        self._rings_read()
        self.rounds += rounds
        self.bursts += 1

    def _receive(self, slot: int, event: Event | None, rounds: int) -> Received:
        """bufs.receive of a burst of `rounds` rounds, refusing one in which a row that was live
        throughout committed nothing: every live round commits a token, so such a row is one no
        kernel served, and a generation waiting for it would never end."""
        done_before = self.bufs.done
        received = self.bufs.receive(self.engine, slot, event)
        if 0 in received.committed:
            committed = np.array(received.committed)
            stalled = np.flatnonzero(~done_before & ~received.done & (committed == 0))
            if stalled.size:
                raise RuntimeError(f"{stalled.size} live row(s) of {self.bufs.batch} (row {stalled[0]} first) "
                                   f"committed no token in a burst of {rounds} round(s): their rounds did not run")
        return received


class _Following(Iterator[Landed]):
    """stream()'s iterator: the loop's tokens as they land, then its end: the rounds it ran are
    counted, and a loop the cap stopped raises RoundCapError. Closed (or dropped) before the end,
    started or not, it waits for the loop, so the buffers are free again."""

    def __init__(self, rounds: RoundStream, loop: DeviceLoop, max_rounds: int):
        self._rounds, self._loop, self._max_rounds = rounds, loop, max_rounds
        self._landed: Iterator[Landed] | None = loop.follow()

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

    __del__ = close

    def _end(self, check_cap: bool) -> None:
        landed, self._landed = self._landed, None
        landed.close()  # a follow() still running restores the thread's timer slack
        done, ran = self._loop.finish()
        self._rounds.rounds += ran
        self._rounds.bursts += 1
        if check_cap and not done.all():
            live = np.flatnonzero(~done)
            raise RoundCapError(f"the device loop stopped at its cap of {self._max_rounds} rounds with {live.size} "
                                f"row(s) still live (row {live[0]} first): raise max_rounds or give every row a "
                                "budget", self._loop.tokens())


_NO_ROWS = np.zeros(0, np.int64)


def _count(value: Any, name: str, most: int) -> int:
    """`value` as an int from 1 to `most`, or ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= most:
        raise ValueError(f"{name} must be an int from 1 to {most}, not {value!r}")
    return int(value)


def _torch_in_play(engine: Engine, *objects: Any) -> bool:
    """Whether the engine borrows a torch stream, or a model buffer is a tensor or a buffer
    adopted from one (memra_torch.buffer), or a rollback or state table names such memory
    (checked by the objects' module, so that torch is imported only where it is already in use)."""
    found = [engine.stream_owner]
    for obj in objects:
        for buf in obj.targets if isinstance(obj, AddressTable) else (obj,):
            found += [buf, buf.foreign] if isinstance(buf, DeviceBuffer) else [buf]
    return any(type(obj).__module__.split(".")[0] == "torch" for obj in found)


def _deprecated_arguments(acceptance: Acceptance | None, stages: Stages | Sequence[Engine] | None,
                          given: dict[str, Any]) -> tuple[Acceptance | None, Stages | None]:
    """The acceptance rule and stages from the keywords of the first releases (pred_d=,
    sampling=; stages= a list of engines with round_tail= and capacity=), with a warning."""
    unknown = set(given) - {"pred_d", "sampling", "round_tail", "capacity"}
    if unknown:
        raise TypeError(f"RoundStream got unexpected keyword argument(s) {sorted(unknown)}")
    if not given and not isinstance(stages, (list, tuple)):
        return acceptance, stages
    warnings.warn("RoundStream(pred_d=..., sampling=..., round_tail=..., capacity=..., stages=[engines]) is "
                  "deprecated: pass acceptance=Greedy(pred_d) or Sampling(...), and stages=Stages(engines, "
                  "round_tail, capacity)", DeprecationWarning, stacklevel=3)
    pred_d, sampling = given.get("pred_d"), given.get("sampling")
    if (acceptance is not None) + (pred_d is not None) + (sampling is not None) != 1:
        raise ValueError("give one acceptance rule: acceptance=Greedy(pred_d) or acceptance=Sampling(...)")
    acceptance = acceptance or (Greedy(pred_d) if pred_d is not None else sampling)
    if isinstance(stages, Stages):
        return acceptance, stages
    return acceptance, Stages(tuple(stages or ()), given.get("round_tail"), given.get("capacity"))

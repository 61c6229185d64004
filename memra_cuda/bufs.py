"""The device buffers of a burst, and the one readback.

Every value that changes from round to round lives in these buffers, so the host can issue M
rounds without looking, and a graph captured over them replays unchanged.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import numpy as np

from .driver.buffer import DeviceBuffer
from .driver.values import as_index
from .layout import (ACC_TOTAL, ACC_WORDS, BRK_WORDS, CTL_BUDGET, CTL_DONE, CTL_EOS, CTL_WORDS, RING_COUNT,
                     RING_TOKENS)

if TYPE_CHECKING:
    from .driver.engine import Engine
    from .driver.event import Event

MAX_BATCH = 65535  # some kernels give each sequence a grid row (y), which CUDA caps at 65535


class Readback(NamedTuple):
    """One burst's readback, per row: the tokens committed, whether the row is done, and its
    position (pos_ctr) when the burst ended."""

    tokens: list[np.ndarray]
    done: np.ndarray
    positions: np.ndarray


class Received(NamedTuple):
    """What receive() took from a readback slot: the words (a copy), and per row the tokens its
    ring holds, its done flag and its position; readback() takes the tokens apart."""

    words: np.ndarray
    committed: list[int]
    done: np.ndarray
    positions: np.ndarray


class StreamBufs:
    """All device state of the round stream of `batch` sequences (docs/buffers.md), plus two
    pinned slots that the rings, ctl_d and pos_ctr_d are read back into, inside a graph too.

    Every field is row-major with one row per sequence (B = 1 is the single-sequence layout).
    Rows are independent: a row whose done flag is set is inert, so a vacant slot is a done
    row, and reset_row / set_stop_row start a new request in a slot between bursts without
    recapturing any graph. Every device buffer field ends in `_d`; `pos_ctr` is the docs' name
    for `pos_ctr_d`. The fields are windows of one allocation, the rings, ctl rows and
    positions side by side, so a burst's readback is one copy, prepared once with the memset
    that empties the rings after it. free() frees them all, and every graph captured over
    them then refuses to replay.

    `positions` and `done` are what the host knows of each row (read-only arrays): set by
    reset/set_stop, then by every readback (collect), so the driver checks capacity without
    an extra readback; `committed` how many tokens each row's ring held at the last readback;
    `epoch` counts the readbacks and whole resets, after which the host knows every row anew,
    and `rings_emptied` the readbacks queued and whole resets, after which every ring is empty.
    """

    def __init__(self, engine: Engine, k: int, m_rounds: int, batch: int = 1):
        k, m_rounds, batch = as_index(k, "k"), as_index(m_rounds, "m_rounds"), as_index(batch, "batch")
        if k < 0 or m_rounds < 1:
            raise ValueError(f"need k >= 0 draft tokens and m_rounds >= 1, not k={k}, m_rounds={m_rounds}")
        if not 1 <= batch <= MAX_BATCH:
            raise ValueError(f"batch must be 1 to {MAX_BATCH} sequences, not {batch}")
        self.k, self.m_rounds, self.batch = k, m_rounds, batch
        self.ring_cap = m_rounds * (k + 1)
        ring_row = RING_TOKENS + self.ring_cap
        fields = (("ring_d", np.uint32, ring_row), ("ctl_d", np.int32, CTL_WORDS), ("pos_ctr_d", np.int32, 1),
                  ("vtok_d", np.uint32, k + 1), ("brk_d", np.uint32, BRK_WORDS), ("pend_d", np.uint32, 1),
                  ("last_pred_d", np.uint32, 1), ("pos_start_d", np.int32, 1), ("acc_d", np.uint32, ACC_WORDS))
        self._arena = engine.zeros(np.uint32, batch * sum(row for _, _, row in fields), label="round-stream state")
        start = 0
        for name, dtype, row in fields:
            setattr(self, name, self._arena.view(start, batch * row, dtype, label=name))
            start += batch * row
        ctl = np.zeros((batch, CTL_WORDS), np.int32)
        ctl[:, [CTL_EOS, CTL_BUDGET]] = -1  # no EOS, no budget
        engine.copy_htod(self.ctl_d, ctl.reshape(-1))
        # Two slots, so one burst's readback can be read while the next burst writes the other.
        self._ring_row, self._rings_end = ring_row, self.ring_d.len
        self._ctl_end = self.ring_d.len + self.ctl_d.len
        self._words = self._ctl_end + self.pos_ctr_d.len  # rings, ctl rows, positions: side by side
        self._engine = engine
        self._host = [engine.pinned(np.uint32, self._words, label=f"readback slot {i}") for i in range(2)]
        self._readback_copies = [engine.prepare_dtoh(host, self._arena.view(0, self._words)) for host in self._host]
        self._empty_rings = engine.prepare_set_u32(self.ring_d, RING_COUNT, 0, every=ring_row)
        self.positions = _frozen(np.zeros(batch, np.int64))
        self.done = _frozen(np.zeros(batch, bool))
        self.committed: list[int] = [0] * batch
        self.epoch = 0  # how often the host learnt every row's position anew (readbacks, resets)
        self.rings_emptied = 0  # how often every ring was emptied (readbacks queued, resets)

    @property
    def pos_ctr(self) -> DeviceBuffer:
        return self.pos_ctr_d

    def reset(self, engine: Engine, pending: int | Sequence[int], position: int | Sequence[int]) -> None:
        """Start a new request on these buffers (in every row, for a batch): `pending` is the
        last prompt token (its KV not yet computed), `position` the KV entries already committed
        (the prompt but its last token), each one value for all rows or one per row. Ring,
        counters, done and keep are cleared and the stop rule is lifted (set_stop sets the next
        one); captured graphs stay valid. The model's KV lengths are the model's to set (to
        `position`)."""
        self._reset(engine, range(self.batch), pending, position)

    def set_positions(self, positions: np.ndarray) -> None:
        """What the host knows of every row's position, before a generation's first burst."""
        positions = np.array(positions, np.int64).reshape(-1)
        if positions.size != self.batch:
            raise ValueError(f"need one position per row ({self.batch}), not {positions.size}")
        self.positions = _frozen(positions)

    def reset_row(self, engine: Engine, row: int, pending: int, position: int) -> None:
        """reset() for the one sequence in slot `row`; the other rows are untouched, so a new
        request can join a running batch between bursts (continuous batching)."""
        self._reset(engine, self._rows(row), pending, position)

    def set_stop(self, engine: Engine, eos: int | None | Sequence[int | None] = None,
                 budget: int | None | Sequence[int | None] = None) -> None:
        """The stop rule of the next generation (None: no EOS / no budget), one for every row or
        a sequence of one per row; clears `done`, but where the budget is 0: nothing to
        generate, so that row is done at once."""
        self._set_stop(engine, range(self.batch), eos, budget)

    def set_stop_row(self, engine: Engine, row: int, eos: int | None = None, budget: int | None = None) -> None:
        """set_stop() for slot `row` alone. A budget of 0 parks the slot: a done row is inert."""
        self._set_stop(engine, self._rows(row), eos, budget)

    def _rows(self, row: int) -> range:
        row = as_index(row, "row")
        if not 0 <= row < self.batch:
            raise ValueError(f"row {row} is outside a batch of {self.batch}")
        return range(row, row + 1)

    def _reset(self, engine: Engine, rows: range, pending: Any, position: Any) -> None:
        n, first = len(rows), rows.start
        pending = np.array(per_row(pending, n, "pending", optional=False), np.int64)
        position = np.array(per_row(position, n, "position", optional=False), np.int64)
        engine.copy_htod(self.pend_d, pending, start=first)
        engine.copy_htod(self.pos_ctr_d, position, start=first)
        self._set_stop(engine, rows, None, None)  # no stop rule, not done, keep 0
        for buf, row in ((self.ring_d, self._ring_row), (self.brk_d, BRK_WORDS), (self.acc_d, ACC_WORDS)):
            engine.copy_htod(buf, np.zeros(n * row, np.uint32), start=row * first)
        self.positions = _frozen(_replaced(self.positions, rows, position))
        if len(rows) == self.batch:  # every row reset: positions known, rings empty
            self.epoch += 1
            self.rings_emptied += 1

    def _set_stop(self, engine: Engine, rows: range, eos: Any, budget: Any) -> None:
        eos, budget = per_row(eos, len(rows), "eos"), per_row(budget, len(rows), "budget")
        ctl = np.zeros((len(rows), CTL_WORDS), np.int64)
        ctl[:, CTL_EOS] = [-1 if e is None else e for e in eos]
        ctl[:, CTL_BUDGET] = [-1 if n is None else n for n in budget]
        ctl[:, CTL_DONE] = [n == 0 for n in budget]
        engine.copy_htod(self.ctl_d, ctl.reshape(-1), start=CTL_WORDS * rows.start)
        self.done = _frozen(_replaced(self.done, rows, ctl[:, CTL_DONE] != 0))

    def drain_ring(self, engine: Engine, row: int = 0) -> np.ndarray:
        """The tokens committed to row `row`'s ring, in order (one readback), and the row's ring
        emptied for the rounds to come (its count zeroed on the stream)."""
        self._rows(row)
        stride = self._ring_row
        tokens = _ring_tokens(engine.dtoh(self.ring_d.view(row * stride, stride)), self.ring_cap)
        engine.set_u32(self.ring_d, row * stride + RING_COUNT, 0)
        if self.batch == 1:
            self.rings_emptied += 1
        return tokens

    def queue_readback(self, engine: Engine, slot: int = 0) -> None:
        """Queue the rings, ctl rows and positions into pinned slot 0 or 1 (one copy), then
        zero every ring's count (one memset); both capturable, both checked when prepared."""
        self._check_engine(engine)
        self._readback_copies[slot]()
        self._empty_rings()
        if engine.capture_hold is None:  # queued now, not recorded into a graph for later
            self.rings_emptied += 1

    def collect(self, engine: Engine, slot: int = 0, event: Event | None = None) -> Readback:
        """Wait for queue_readback's copy into `slot` (one readback for all rows; only up to
        `event`, if given), and learn each row's done flag, position and tokens from it."""
        return self.readback(self.receive(engine, slot, event))

    def receive(self, engine: Engine, slot: int = 0, event: Event | None = None) -> Received:
        """collect()'s first half: wait, take the slot's words (a copy: the slot is free for the
        next burst at once), and learn `done`, `positions` and `committed` from them; the
        tokens are readback()'s. A driver decides its next burst from this and queues it
        before it takes the tokens apart."""
        self._check_engine(engine)
        engine.finish_readback(event)
        words = self._host[slot].read()
        self.committed = np.minimum(words[RING_COUNT:self._rings_end:self._ring_row], self.ring_cap).tolist()
        self.done = _frozen(words[self._rings_end + CTL_DONE:self._ctl_end:CTL_WORDS] != 0)
        self.positions = _frozen(words[self._ctl_end:].view(np.int32).astype(np.int64))
        self.epoch += 1
        return Received(words, self.committed, self.done, self.positions)

    def readback(self, received: Received) -> Readback:
        """The Readback of what receive() took: each row's tokens, done flag and position."""
        rings = received.words[:self._rings_end].reshape(self.batch, self._ring_row)
        tokens = [rings[b, RING_TOKENS:RING_TOKENS + n] for b, n in enumerate(received.committed)]
        return Readback(tokens, received.done, received.positions)

    def _check_engine(self, engine: Engine) -> None:
        if engine is not self._engine:
            raise ValueError(f"these buffers belong to {self._engine!r}, not {engine!r}")

    def drafts_accepted(self, engine: Engine, committed: int | Sequence[int]) -> tuple[int, int]:
        """(accepted, drafted) over every row since its request began, for `committed` tokens
        generated (per row, for a batch): one readback.

        Every round commits its accepted drafts plus one token, so the rounds that ran before
        the stop number committed - accepted, and each drafted k tokens.
        """
        committed = np.asarray(committed, np.int64).reshape(-1)
        if committed.size != self.batch:
            raise ValueError(f"need one committed count per row ({self.batch}), not {committed.size}")
        accepted = engine.dtoh(self.acc_d)[ACC_TOTAL::ACC_WORDS].astype(np.int64)
        return int(accepted.sum()), self.k * int((committed - accepted).sum())

    def buffers(self) -> dict[str, DeviceBuffer]:
        """The device fields by name (windows of one allocation)."""
        return {name: buf for name, buf in vars(self).items() if isinstance(buf, DeviceBuffer) and name[0] != "_"}

    def free(self) -> None:
        for buf in [*self.buffers().values(), self._arena, *self._host]:
            buf.free()


def per_row(values: Any, rows: int, what: str, optional: bool = True) -> list[int | None]:
    """`values` for each of `rows` rows: one value for all, or a sequence of one per row; each
    an int in [0, 2**31) (ids, counts, positions), or None where `optional`."""
    many = isinstance(values, (list, tuple, np.ndarray))
    if many and len(values) != rows:
        raise ValueError(f"{what} needs one value per row ({rows}), not {len(values)}")
    out = list(values) if many else [values] * rows
    for i, value in enumerate(out):
        if value is None and optional:
            continue
        if not 0 <= as_index(value, what) < 2**31:  # None where not optional: TypeError
            raise ValueError(f"{what} must be {'None or ' if optional else ''}in [0, 2**31), not {value}"
                             + (f" (row {i})" if many else ""))
    return out


def _ring_tokens(ring: np.ndarray, ring_cap: int) -> np.ndarray:
    return ring[RING_TOKENS:RING_TOKENS + min(int(ring[RING_COUNT]), ring_cap)].astype(np.uint32)


def _frozen(array: np.ndarray) -> np.ndarray:
    """`array`, read-only: the host's knowledge of the rows is handed out, never copied, so no
    caller may change it."""
    array.flags.writeable = False
    return array


def _replaced(array: np.ndarray, rows: range, value: Any) -> np.ndarray:
    """A copy of `array` with `rows` set to `value`."""
    out = array.copy()
    out[rows.start:rows.stop] = value
    return out


def drain_ring(bufs: StreamBufs, engine: Engine) -> np.ndarray:
    return bufs.drain_ring(engine)

"""The device buffers of a burst, and the one readback.

Every value that changes from round to round lives in these buffers, so the host can issue M
rounds without looking, and a graph captured over them replays unchanged.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import numpy as np

from .driver.buffer import DeviceBuffer, as_index
from .reference import DONE

if TYPE_CHECKING:
    from .driver.engine import Engine
    from .driver.event import Event

MAX_BATCH = 65535  # kernels give each sequence a grid row (y), which CUDA caps at 65535


class Readback(NamedTuple):
    """One burst's readback, per row: the tokens committed, whether the row is done, and its
    position (pos_ctr) when the burst ended."""

    tokens: list[np.ndarray]
    done: np.ndarray
    positions: np.ndarray


class StreamBufs:
    """All device state of the round stream of `batch` sequences (DESIGN.md's tables), plus a
    pinned mirror of the rings, ctl_d and pos_ctr_d for readbacks issued inside a graph.

    Every field is row-major with one row per sequence (B = 1 is the single-sequence layout).
    Rows are independent: a row whose done flag is set is inert, so a vacant slot is a done
    row, and reset_row / set_stop_row start a new request in a slot between bursts without
    recapturing any graph. Every device buffer field ends in `_d`; `pos_ctr` is DESIGN.md's
    name for `pos_ctr_d`. free() frees them all, and every graph captured over them then
    refuses to replay.

    `positions` and `done` are what the host knows of each row: set by reset/set_stop, then
    by every readback (collect), so the driver checks capacity without an extra readback.
    """

    def __init__(self, engine: Engine, k: int, m_rounds: int, batch: int = 1):
        k, m_rounds, batch = as_index(k, "k"), as_index(m_rounds, "m_rounds"), as_index(batch, "batch")
        if k < 0 or m_rounds < 1:
            raise ValueError(f"need k >= 0 draft tokens and m_rounds >= 1, not k={k}, m_rounds={m_rounds}")
        if not 1 <= batch <= MAX_BATCH:
            raise ValueError(f"batch must be 1 to {MAX_BATCH} sequences, not {batch}")
        self.k, self.m_rounds, self.batch = k, m_rounds, batch
        self.ring_cap = m_rounds * (k + 1)
        self.vtok_d = engine.alloc_u32_zeroed(batch * (k + 1), label="vtok_d")
        self.brk_d = engine.alloc_u32_zeroed(batch * 2, label="brk_d")
        self.pend_d = engine.alloc_u32_zeroed(batch, label="pend_d")
        self.last_pred_d = engine.alloc_u32_zeroed(batch, label="last_pred_d")
        self.pos_ctr_d = engine.alloc_i32_zeroed(batch, label="pos_ctr_d")
        self.pos_start_d = engine.alloc_i32_zeroed(batch, label="pos_start_d")
        self.ring_d = engine.alloc_u32_zeroed(batch * (self.ring_cap + 1), label="ring_d")
        self.acc_d = engine.alloc_u32_zeroed(batch * 2, label="acc_d")
        self.ctl_d = engine.htod(np.tile(np.int32([-1, -1, 0, 0]), batch), label="ctl_d")
        # Two slots, so one burst's readback can be read while the next burst writes the other.
        words = self.ring_d.len + self.ctl_d.len + self.pos_ctr_d.len
        self._host = [engine.pinned(np.uint32, words, label=f"readback slot {i}") for i in range(2)]
        self.positions = np.zeros(batch, np.int64)
        self.done = np.zeros(batch, bool)

    @property
    def pos_ctr(self) -> DeviceBuffer:
        return self.pos_ctr_d

    def reset(self, engine: Engine, pending: int, position: int) -> None:
        """Start a new request on these buffers (every row, for a batch): `pending` is the last
        prompt token (its KV not yet computed), `position` the KV entries already committed
        (the prompt but its last token). Ring, counters, done and keep are cleared and the stop
        rule is lifted (set_stop sets the next one); captured graphs stay valid. The model's KV
        lengths are the model's to set (to `position`)."""
        self._reset(engine, range(self.batch), pending, position)

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

    def _reset(self, engine: Engine, rows: range, pending: int, position: int) -> None:
        if not 0 <= as_index(pending, "pending") < 2**31:
            raise ValueError(f"pending must be a token id in [0, 2**31), not {pending}")
        if not 0 <= as_index(position, "position") < 2**31:
            raise ValueError(f"position must be in [0, 2**31), not {position}")
        n, first = len(rows), rows.start
        engine.copy_htod(self.pend_d, np.full(n, pending), start=first)
        engine.copy_htod(self.pos_ctr_d, np.full(n, position), start=first)
        self._set_stop(engine, rows, None, None)  # no stop rule, not done, keep 0
        for buf, row in ((self.ring_d, self.ring_cap + 1), (self.brk_d, 2), (self.acc_d, 2)):
            engine.copy_htod(buf, np.zeros(n * row, np.uint32), start=row * first)
        self.positions[rows.start:rows.stop] = position

    def _set_stop(self, engine: Engine, rows: range, eos: Any, budget: Any) -> None:
        eos, budget = per_row(eos, len(rows), "eos"), per_row(budget, len(rows), "budget")
        ctl = np.array([[-1 if e is None else e, -1 if n is None else n, int(n == 0), 0] for e, n in zip(eos, budget)])
        engine.copy_htod(self.ctl_d, ctl.reshape(-1), start=4 * rows.start)
        self.done[rows.start:rows.stop] = ctl[:, DONE] != 0

    def drain_ring(self, engine: Engine, row: int = 0) -> np.ndarray:
        """The tokens committed to row `row`'s ring, in order: one readback. The caller zeroes
        the row's count (its first word) after."""
        self._rows(row)
        stride = self.ring_cap + 1
        return _ring_tokens(engine.dtoh(self.ring_d.view(row * stride, stride)), self.ring_cap)

    def queue_readback(self, engine: Engine, slot: int = 0) -> None:
        """Queue the rings, ctl rows and positions into pinned slot 0 or 1, then zero every
        ring's count (all capturable)."""
        start = 0
        for buf in (self.ring_d, self.ctl_d, self.pos_ctr_d):
            engine.copy_dtoh_async(self._host[slot], buf, start=start)
            start += buf.len
        engine.set_u32(self.ring_d, 0, 0, every=self.ring_cap + 1)

    def collect(self, engine: Engine, slot: int = 0, event: Event | None = None) -> Readback:
        """Wait for queue_readback's copies into `slot` (one readback for all rows; only up
        to `event`, if given), and learn each row's done flag and position from them."""
        engine.finish_readback(event)
        host = self._host[slot].read()
        rings, ctl, positions = np.split(host, [self.ring_d.len, self.ring_d.len + self.ctl_d.len])
        stride = self.ring_cap + 1
        tokens = [_ring_tokens(rings[b * stride:(b + 1) * stride], self.ring_cap) for b in range(self.batch)]
        self.done = ctl.view(np.int32)[DONE::4] != 0
        self.positions = positions.view(np.int32).astype(np.int64)
        return Readback(tokens, self.done.copy(), self.positions.copy())

    def drafts_accepted(self, engine: Engine, committed: int | Sequence[int]) -> tuple[int, int]:
        """(accepted, drafted) over every row since its request began, for `committed` tokens
        generated (per row, for a batch): one readback.

        Every round commits its accepted drafts plus one token, so the rounds that ran before
        the stop number committed - accepted, and each drafted k tokens.
        """
        committed = np.asarray(committed, np.int64).reshape(-1)
        if committed.size != self.batch:
            raise ValueError(f"need one committed count per row ({self.batch}), not {committed.size}")
        accepted = engine.dtoh(self.acc_d)[1::2].astype(np.int64)
        return int(accepted.sum()), self.k * int((committed - accepted).sum())

    def buffers(self) -> dict[str, DeviceBuffer]:
        return {name: buf for name, buf in vars(self).items() if isinstance(buf, DeviceBuffer)}

    def free(self) -> None:
        for buf in [*self.buffers().values(), *self._host]:
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
    return ring[1:1 + min(int(ring[0]), ring_cap)].astype(np.uint32)


def drain_ring(bufs: StreamBufs, engine: Engine) -> np.ndarray:
    return bufs.drain_ring(engine)

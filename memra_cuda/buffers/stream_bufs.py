"""The device buffers of a burst, and the one readback.

Every value that changes from round to round lives in these buffers, so the host can issue M
rounds without looking, and a graph captured over them replays unchanged.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..driver.errors import MemraError
from ..driver.engine import as_engine
from ..driver.values import I32_MOST, TEXT_LIKE, as_index, as_size
from .arena import carve
from .geometry import Geometry, as_geometry
from .layout import ACC_TOTAL, ACC_WORDS, BRK_WORDS, CTL_BUDGET, CTL_DONE, CTL_EOS, CTL_WORDS, RING_COUNT, RING_TOKENS
from .ledger import Ledger, slot_index

if TYPE_CHECKING:
    from ..driver.buffer import DeviceBuffer, PinnedBuffer
    from ..driver.call import Prepared
    from ..driver.engine import Engine
    from ..driver.event import Event

class Readback:
    """One burst's readback, per row: `done`, its position (pos_ctr) when the burst ended,
    `committed`, how many tokens its ring held, `tokens`, those tokens, and `accepted`, the
    drafts its request has had accepted and committed since it began (acc_d's ACC_TOTAL, int64:
    its rounds are its tokens less these). The words are a copy of the pinned slot, so the slot
    is free for the next burst at once; the tokens are taken apart when first asked for, so a
    driver can decide its next burst from the flags and queue it first."""

    __slots__ = ("done", "positions", "committed", "accepted", "_words", "_ring_row", "_tokens")

    def __init__(self, words: np.ndarray, ring_row: int, committed: list[int], done: np.ndarray,
                 positions: np.ndarray, accepted: np.ndarray):
        self.done, self.positions, self.committed, self.accepted = done, positions, committed, accepted
        self._words, self._ring_row = words, ring_row
        self._tokens: list[np.ndarray] | None = None

    @property
    def tokens(self) -> list[np.ndarray]:
        if self._tokens is None:
            rings = self._words[:len(self.committed) * self._ring_row].reshape(len(self.committed), self._ring_row)
            self._tokens = [rings[b, RING_TOKENS:RING_TOKENS + n] for b, n in enumerate(self.committed)]
        return self._tokens

    def __repr__(self) -> str:
        return (f"Readback({sum(self.committed)} tokens over {len(self.committed)} rows, {int(self.done.sum())} "
                f"done, {int(self.accepted.sum())} drafts accepted)")


class BuffersHeld(MemraError, ValueError):
    """The buffers are held by work still running on them (a device loop): nothing else may
    queue on them, reset them or read them back until it lets go."""


class StreamBufs:
    """All device state of the round stream of rounds of `geometry` (a Geometry: k, M, B rows and
    the width a round verifies; docs/buffers.md), plus two pinned slots that the rings, ctl_d,
    pos_ctr_d and acc_d are read back into, inside a graph too. `geometry` travels with them
    (every round, table and decoder over them reads it there); k, m_rounds and batch are its.

    Every field is row-major with one row per sequence (B = 1 is the single-sequence layout).
    Rows are independent: a row whose done flag is set is inert, so a vacant slot is a done
    row, and start_row (reset_row and set_stop_row in one call) starts a new request in a slot
    between bursts without recapturing any graph. Every device buffer field ends in `_d` (the kernels' contracts call
    pos_ctr_d `pos_ctr`). The fields are windows of one allocation, the rings, ctl rows,
    positions and acceptance counts side by side, so a burst's readback is one copy, prepared
    once with the memset that empties the rings after it. free() frees them all, and every graph captured over
    them then refuses to replay. The buffers belong to `engine`, whose stream orders all work
    on them: no method takes another.

    What the host knows of the rows, kept here so that every driver over these buffers sees
    the same: `positions`, `done` and `accepted` (read-only arrays), set by reset/set_stop, then
    by every readback (receive); `committed`, how many tokens each ring held at the last readback; and
    `ledger`, what the host has not seen (Ledger: every driver enters the rounds it queues).
    `holder` is whoever holds the buffers (a running device loop), refusing everyone else.
    """

    # The device fields, [B][per row] each (docs/buffers.md, "Fields"; row words in layout.py):
    ring_d: DeviceBuffer  # u32[1 + M(k+1)]: the burst's committed tokens, RING_COUNT first
    ctl_d: DeviceBuffer  # i32[4]: the stop rule and the round's verdict (EOS, budget, done, keep)
    pos_ctr_d: DeviceBuffer  # i32[1]: the position, tokens whose KV is committed
    vtok_d: DeviceBuffer  # u32[k+1]: the verify's input, the pending token then the k drafts
    brk_d: DeviceBuffer  # u32[2]: this round's cap on acceptance (i + 1 before draft i, 0: none), caps counted
    pend_d: DeviceBuffer  # u32[1]: the pending token, committed, its KV not computed yet
    last_pred_d: DeviceBuffer  # u32[1]: the bonus, the target's token after the last accepted draft
    pos_start_d: DeviceBuffer  # i32[1]: the position at the round's start (rollback's anchor)
    acc_d: DeviceBuffer  # u32[2]: drafts accepted this round, and accepted and committed in all

    def __init__(self, engine: Engine, geometry: Geometry):
        self.geometry = geometry = as_geometry(geometry)
        self.engine = engine = as_engine(engine)
        self.k, self.m_rounds, self.batch = k, m_rounds, batch = geometry.k, geometry.m_rounds, geometry.batch
        self.ring_cap = m_rounds * (k + 1)
        ring_row = RING_TOKENS + self.ring_cap
        # The rings, ctl rows, positions and acceptance counts first, side by side: the readback
        # copies them at once.
        self._arena, self._fields = carve(engine, batch, {
            "ring_d": (np.uint32, ring_row), "ctl_d": (np.int32, CTL_WORDS), "pos_ctr_d": (np.int32, 1),
            "acc_d": (np.uint32, ACC_WORDS), "vtok_d": (np.uint32, k + 1), "brk_d": (np.uint32, BRK_WORDS),
            "pend_d": (np.uint32, 1), "last_pred_d": (np.uint32, 1), "pos_start_d": (np.int32, 1)},
            label="round-stream state")
        vars(self).update(self._fields)  # each the attribute the class declares
        ctl = np.zeros((batch, CTL_WORDS), np.int32)
        ctl[:, [CTL_EOS, CTL_BUDGET]] = -1  # no EOS, no budget
        engine.copy_htod(self.ctl_d, ctl.reshape(-1))
        # Two slots, so one burst's readback can be read while the next burst writes the other.
        self._ring_row, self._rings_end = ring_row, self.ring_d.len
        self._ctl_end = self.ring_d.len + self.ctl_d.len
        self._positions_end = self._ctl_end + self.pos_ctr_d.len
        self._words = self._positions_end + self.acc_d.len  # rings, ctl rows, positions, acceptance: side by side
        self._host: list[PinnedBuffer] = [engine.pinned(np.uint32, self._words, label=f"readback slot {i}")
                                          for i in range(2)]
        self._readback_copies: list[Prepared] = [engine.prepare_dtoh(host, self._arena.view(0, self._words))
                                                 for host in self._host]
        self._empty_rings = engine.prepare_set_u32(self.ring_d, RING_COUNT, 0, every=ring_row)
        self.positions = _frozen(np.zeros(batch, np.int64))
        self.done = _frozen(np.zeros(batch, bool))
        self.accepted = _frozen(np.zeros(batch, np.int64))
        self.committed: list[int] = [0] * batch
        self.ledger = Ledger()
        self.holder: object | None = None
        self._held_why = ""

    @property
    def arena(self) -> DeviceBuffer:
        """The one allocation every field is a window of (carve's), the rings first."""
        return self._arena

    # -- the holder ----------------------------------------------------------------------------
    def hold(self, holder: object, why: str) -> None:
        """Give the buffers to `holder` (a device loop, from its launch until it is finished):
        everything else on them is refused with BuffersHeld saying `why`, until release()."""
        if self.holder is not None and self.holder is not holder:
            raise BuffersHeld(self._held_why)
        self.holder, self._held_why = holder, why

    def release(self, holder: object) -> None:
        """Clear the holder that hold() set, so that everyone may use the buffers again; only
        `holder` itself releases them (anyone else's release does nothing)."""
        if self.holder is holder:
            self.holder = None

    def check_free(self, rounds: int = 0) -> None:
        """BuffersHeld while someone holds the buffers (see hold); ValueError if `rounds` more
        rounds would overrun the rings, which hold M rounds' tokens until a readback (a commit
        past them drops tokens while still spending the budget)."""
        if self.holder is not None:
            raise BuffersHeld(self._held_why)
        if self.ledger.ring_rounds + rounds > self.m_rounds:
            raise ValueError(f"{self.ledger.ring_rounds} round(s) were issued since the ring was last read: {rounds} "
                             f"more would overrun the ring, which holds M={self.m_rounds} rounds' tokens; read back "
                             "first")

    # -- requests ------------------------------------------------------------------------------
    def reset(self, pending: int | Sequence[int], position: int | Sequence[int]) -> None:
        """Start a new request on these buffers (in every row, for a batch): `pending` is the
        last prompt token (its KV not yet computed), `position` the KV entries already committed
        (the prompt but its last token), each one value for all rows or one per row. Ring,
        counters, done and keep are cleared and the stop rule is lifted (set_stop sets the next
        one); captured graphs stay valid. The model's KV lengths are the model's to set (to
        `position`). The next generation starts here."""
        self._reset(range(self.batch), pending, position)

    def reset_row(self, row: int, pending: int, position: int) -> None:
        """reset() for the one sequence in slot `row`; the other rows are untouched, so a new
        request can join a running batch between bursts (continuous batching)."""
        self._reset(self._rows(row), pending, position)

    def start_row(self, row: int, pending: int, position: int, *, budget: int | None, eos: int | None = None) -> None:
        """A new request in slot `row`, in one call: reset_row and set_stop_row together, so the
        row is never live without its stop rule (a server admits a request by this; a budget of
        0 leaves the row done). Every value is checked before anything is written."""
        self._reset(self._rows(row), pending, position, eos, budget)

    def set_stop(self, eos: int | None | Sequence[int | None] = None,
                 budget: int | None | Sequence[int | None] = None) -> None:
        """The stop rule of the next generation (None: no EOS / no budget), one for every row or
        a sequence of one per row; clears `done`, but where the budget is 0: nothing to
        generate, so that row is done at once."""
        self._set_stop(range(self.batch), eos, budget)

    def set_stop_row(self, row: int, eos: int | None = None, budget: int | None = None) -> None:
        """set_stop() for slot `row` alone. A budget of 0 parks the slot: a done row is inert."""
        self._set_stop(self._rows(row), eos, budget)

    def _rows(self, row: int) -> range:
        row = as_index(row, "row")
        if not 0 <= row < self.batch:
            raise ValueError(f"row {row} is outside a batch of {self.batch}")
        return range(row, row + 1)

    def _reset(self, rows: range, pending: int | Sequence[int], position: int | Sequence[int],
               eos: int | None = None, budget: int | None = None) -> None:
        self.check_free()
        n, first, engine = len(rows), rows.start, self.engine
        pendings = np.array(per_row(pending, n, "pending", optional=False), np.int64)
        positions = np.array(per_row(position, n, "position", optional=False), np.int64)
        ctl = self._stop_words(n, eos, budget)  # checked too before anything is written
        engine.copy_htod(self.pend_d, pendings, start=first)
        engine.copy_htod(self.pos_ctr_d, positions, start=first)
        self._write_stop(rows, ctl)  # the stop rule (none, by default), done where the budget is 0, keep 0
        for buf, row in ((self.ring_d, self._ring_row), (self.brk_d, BRK_WORDS), (self.acc_d, ACC_WORDS)):
            engine.copy_htod(buf, np.zeros(n * row, np.uint32), start=row * first)
        self.positions = _frozen(_replaced(self.positions, rows, positions))
        self.accepted = _frozen(_replaced(self.accepted, rows, np.zeros(n, np.int64)))
        if len(rows) == self.batch:  # every row reset: positions known, rings empty
            self.ledger.reset()

    def _set_stop(self, rows: range, eos: int | None | Sequence[int | None],
                  budget: int | None | Sequence[int | None]) -> None:
        self.check_free()
        self._write_stop(rows, self._stop_words(len(rows), eos, budget))

    @staticmethod
    def _stop_words(rows: int, eos: int | None | Sequence[int | None],
                    budget: int | None | Sequence[int | None]) -> np.ndarray:
        """The ctl words of `rows` rows' stop rule, [rows][CTL_WORDS]: EOS and budget (-1: none),
        done where the budget is 0, keep 0."""
        stops, budgets = per_row(eos, rows, "eos"), per_row(budget, rows, "budget")
        ctl = np.zeros((rows, CTL_WORDS), np.int64)
        ctl[:, CTL_EOS] = [-1 if e is None else e for e in stops]
        ctl[:, CTL_BUDGET] = [-1 if n is None else n for n in budgets]
        ctl[:, CTL_DONE] = [n == 0 for n in budgets]
        return ctl

    def _write_stop(self, rows: range, ctl: np.ndarray) -> None:
        self.engine.copy_htod(self.ctl_d, ctl.reshape(-1), start=CTL_WORDS * rows.start)
        self.done = _frozen(_replaced(self.done, rows, ctl[:, CTL_DONE] != 0))
        self.ledger.rows_written()  # every reset and stop comes here

    # -- reading back --------------------------------------------------------------------------
    def drain_ring(self, row: int = 0) -> np.ndarray:
        """The tokens committed to row `row`'s ring, in order (one readback), and the row's ring
        emptied for the rounds to come (its count zeroed on the stream)."""
        self._rows(row)
        self.check_free()
        stride, engine = self._ring_row, self.engine
        tokens = _ring_tokens(engine.dtoh(self.ring_d.view(row * stride, stride)), self.ring_cap)
        engine.set_u32(self.ring_d, row * stride + RING_COUNT, 0)
        if self.batch == 1:
            self.ledger.drained()
        return tokens

    def queue_readback(self, slot: int = 0) -> None:
        """Queue the rings, ctl rows, positions and acceptance counts into pinned slot 0 or 1 (one copy), then
        zero every ring's count (one memset); both capturable, both checked when prepared.
        Queued now (not recorded into a graph), it goes into the ledger at once."""
        self.check_free()
        slot = slot_index(slot)
        self._readback_copies[slot]()
        self._empty_rings()
        if self.engine.capture_hold is None:
            self.ledger.queued(0, readback=slot)

    def receive(self, slot: int = 0, event: Event | None = None) -> Readback:
        """Wait for the readback queued into `slot` (one readback for all rows; only up to
        `event`, if given), and learn each row's done flag, position, ring count and accepted
        drafts from it. The slot is found first: one that indexes neither (2, "0"), or a bool, is
        refused, naming it, before anything is waited for or counted as a readback (-1 indexes
        slot 1)."""
        self.check_free()
        slot = slot_index(slot)
        host = self._host[slot]
        self.engine.finish_readback(event)
        words = host.read()
        self.committed = np.minimum(words[RING_COUNT:self._rings_end:self._ring_row], self.ring_cap).tolist()
        self.done = _frozen(words[self._rings_end + CTL_DONE:self._ctl_end:CTL_WORDS] != 0)
        self.positions = _frozen(words[self._ctl_end:self._positions_end].view(np.int32).astype(np.int64))
        self.accepted = _frozen(words[self._positions_end + ACC_TOTAL::ACC_WORDS].astype(np.int64))
        self.ledger.received(slot)
        return Readback(words, self._ring_row, self.committed, self.done, self.positions, self.accepted)

    def drafts_accepted(self, committed: int | Sequence[int] | np.ndarray) -> tuple[int, int]:
        """(accepted, drafted) over every row since its request began, for `committed` tokens
        generated (per row, for a batch): `drafted` counts k a round of rounds_run's, the drafts a
        round of width k offers (a row capped below k, or a round of a narrower body, is counted
        so too). As of the last readback, no readback of its own."""
        tokens = self._committed(committed)
        rounds = self._rounds_run(tokens)
        return int((tokens - rounds).sum()), self.k * int(rounds.sum())

    def rounds_run(self, committed: int | Sequence[int] | np.ndarray) -> np.ndarray:
        """Per row, the rounds it ran since its request began (int64 [B]), for `committed` tokens
        generated (per row, for a batch): committed - accepted, as every round commits its
        accepted drafts plus one. A batch runs as many rounds as its slowest row; its rows' mean
        against that maximum is the share of the batch's rounds its rows used. As of the last
        readback (`accepted`, which every burst's readback brings), no readback of its own."""
        return self._rounds_run(self._committed(committed))

    def _rounds_run(self, tokens: np.ndarray) -> np.ndarray:
        """rounds_run of counts _committed has checked."""
        self.check_free()
        return tokens - self.accepted

    def tokens_per_round(self, committed: int | Sequence[int] | np.ndarray) -> float:
        """Tokens committed per round a row ran (tau), over every row since its request began, for
        `committed` tokens generated (per row, for a batch), rounds_run's: 1 where no round ran."""
        tokens = self._committed(committed)
        rounds = int(self._rounds_run(tokens).sum())
        return int(tokens.sum()) / rounds if rounds else 1.0

    def _committed(self, committed: int | Sequence[int] | np.ndarray) -> np.ndarray:
        """The rows' committed counts as int64 [B], one a row (a lone count for a batch of one),
        each checked as per_row checks a row's value: numpy's int64 cast truncated 3.9 to 3, read
        "5" as 5 and took -2, each a statistic silently wrong. Read once (row_values): an array's
        tolist() is a copy to the host, a tensor's a device sync."""
        given, one_a_row = row_values(committed, self.batch, "committed")
        return np.array(per_row(given if one_a_row else [committed], self.batch, "committed", optional=False),
                        np.int64)

    def buffers(self) -> dict[str, DeviceBuffer]:
        """The device fields by name (windows of one allocation), in their order in it."""
        return dict(self._fields)

    def free(self) -> None:
        """Free every buffer: the device fields (windows), their one allocation, and the pinned
        readback slots; every graph captured over them then refuses to replay. BuffersHeld, with
        nothing freed, while someone holds them (a device loop, which runs on them until it is
        finished: freed under it, its rounds wrote memory the allocator hands out again)."""
        self.check_free()
        for buf in [*self._fields.values(), self._arena, *self._host]:
            buf.free()


ROW_VALUE_MOST = I32_MOST  # a row's word holds an i32: a token id, a budget, a count, a position


def per_row(values: object, rows: int, what: str, optional: bool = True) -> list[int | None]:
    """`values` for each of `rows` rows: one value for all, or a sequence of one per row; each
    an int from 0 to ROW_VALUE_MOST (ids, counts, positions), or None where `optional`. A
    refusal (TypeError for the wrong kind, ValueError out of range) names `what` and, in a
    sequence, the row: one bad value among a batch's is found by its row, not by a search."""
    given, many = row_values(values, rows, what)
    out: list[int | None] = []
    for i, value in enumerate(given):
        if value is None and optional:
            out.append(None)
            continue
        try:  # None where not optional: TypeError
            out.append(as_size(value, what, 0, ROW_VALUE_MOST, also="None" if optional else ""))
        except (TypeError, ValueError) as exc:  # the wrong kind, or out of range: in a sequence, which row's
            if not many:
                raise
            raise type(exc)(f"{exc} (row {i})") from None
    return out


def row_values(values: object, rows: int, what: str) -> tuple[list[object], bool]:
    """`values` for each of `rows` rows, and whether they came one a row: a list, a tuple, a range
    or an array of one or more dimensions holds one a row (ValueError naming `what` unless it
    holds `rows`; a range was one value for every row, refused as row 0's, not an integer);
    anything else is one value for every row, a 0-d array too (np.array(5), an index as an int
    is: its len() raised a TypeError naming nothing). An array is any library's (_is_array: a
    tensor of a budget or an EOS a row was one value for every row, refused as no integer), its
    values read by its tolist(), one copy to the host."""
    if not (isinstance(values, (list, tuple, range)) or _is_array(values)):
        return [values] * rows, False
    given: Any = values  # a sequence, or an array: each has a len(), an array a tolist()
    if len(given) != rows:
        raise ValueError(f"{what} needs one value per row ({rows}), not {len(given)}")
    return (list(given) if isinstance(given, (list, tuple, range)) else given.tolist()), True


def _is_array(values: object) -> bool:
    """Whether `values` is an array of one or more dimensions, numpy's or another library's
    (torch's, CuPy's), told by its duck (an int `ndim` of at least 1 and a tolist()), so that
    buffers need not import them. A memoryview has both and is no array of values here: its
    bytes' ints would be read as rows' values (TEXT_LIKE's refusal, as elsewhere)."""
    ndim = getattr(values, "ndim", None)
    return (isinstance(ndim, int) and ndim >= 1 and callable(getattr(values, "tolist", None))
            and not isinstance(values, TEXT_LIKE))


def _ring_tokens(ring: np.ndarray, ring_cap: int) -> np.ndarray:
    return ring[RING_TOKENS:RING_TOKENS + min(int(ring[RING_COUNT]), ring_cap)].astype(np.uint32)


def _frozen(array: np.ndarray) -> np.ndarray:
    """`array`, read-only: the host's knowledge of the rows is handed out, never copied, so no
    caller may change it."""
    array.flags.writeable = False
    return array


def _replaced(array: np.ndarray, rows: range, value: np.ndarray) -> np.ndarray:
    """A copy of `array` with `rows` set to `value`."""
    out = array.copy()
    out[rows.start:rows.stop] = value
    return out


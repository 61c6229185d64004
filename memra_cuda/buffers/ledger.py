"""The ledger of rounds the host has not seen, a value each StreamBufs holds (bufs.ledger).

The host queues rounds without looking and learns where the rows are only from readbacks, so two
bounds must be kept from what was queued and what was received: how far the rows may have moved
past the positions the host knows (the capacity check adds it), and how many rounds' tokens the
rings hold (M at most: a commit past a full ring drops tokens while still spending the budget).
Every driver over the same buffers (RoundStream's modes, a device loop, a graph replayed by hand)
enters what it queues here, so each checks against the same ledger. Plain integers, no device:
its rules are tested on the CPU.
"""
from __future__ import annotations

from ..driver.values import as_size


def as_slot(slot: object) -> int:
    """`slot` as a pinned readback slot, 0 or 1 (TypeError or ValueError naming it), where a slot
    is chosen once: a burst graph's capture."""
    return as_size(slot, "a readback slot", 0, 1)


_SLOTS = (0, 1)


def slot_index(slot: object) -> int:
    """`slot` as the pinned readback slot it indexes, 0 or 1, for the per-burst paths
    (queue_readback, receive, and the ledger's queued, received and unreceived): a type test and
    an index, as a list of the two takes one (-1 is slot 1), before anything has changed; as_slot's
    refusal naming it where it indexes neither, or is a bool (True indexed slot 1). A range test
    would cost each burst more than the index. Never a round's path: queued() without a readback
    finds no slot."""
    try:
        if type(slot) is bool:
            raise TypeError
        return _SLOTS[slot]  # type: ignore[call-overload]
    except (IndexError, TypeError):
        as_slot(slot)  # raises, naming it
        raise AssertionError(f"slot {slot!r} failed to index the two slots") from None  # 0 and 1 never do


class Ledger:
    """Rounds queued on one StreamBufs, and what the host has seen of them. Its methods are the
    events (queued, received, reset, drained, rows_written); `unseen_rounds` is what they imply,
    and `ring_rounds` what no count of rounds gives (a drain empties the rings, not the unseen)."""

    __slots__ = ("rounds", "covers", "learnt", "ring_rounds", "events")

    def __init__(self) -> None:
        self.rounds = 0  # rounds queued in all
        # the events entered, received() apart: a step's readback, unreceived, is still the newest news
        # of the rows while none has followed it (RoundStream.recover)
        self.events = 0
        self.covers = [0, 0]  # per pinned readback slot: the rounds queued before its last readback
        self.learnt = 0  # the rounds the last received readback (or a reset) covers: the host knows the rows as of them
        self.ring_rounds = 0  # rounds committed into the rings since they were last emptied

    def queued(self, rounds: int, readback: int | None = None) -> None:
        """`rounds` rounds were queued, and after them (readback = a slot) a readback into that
        pinned slot, which empties the rings and covers every round queued so far once received.
        Whoever queues rounds says so here, a graph's replay too (its readback is not seen).
        `rounds` is an int of at least 0, checked first: -5 or 2.5 became the unseen rounds the
        capacity check adds. A plain int of at least 0, what every burst gives, passes at one type
        test (as_size's whole check cost a burst 0.26 us, as much again as the rest)."""
        if type(rounds) is not int or rounds < 0:
            rounds = as_size(rounds, "rounds", 0)
        total = self.rounds + rounds
        if readback is not None:
            self.covers[slot_index(readback)] = total  # first: a slot but 0 or 1 counted the rounds, then raised
            self.ring_rounds = 0
        else:
            self.ring_rounds += rounds
        self.rounds = total
        self.events += 1

    def received(self, slot: int) -> None:
        """The readback queued into `slot` was received: the rows are known as of the rounds it
        covers (a slot received again, or behind a newer one, teaches nothing new). The slot is
        found as queued finds it (slot_index: -1 is slot 1, as StreamBufs.receive, which
        calls this once it has read that slot, takes it)."""
        self.learnt = max(self.learnt, self._covered(slot))

    def unreceived(self, slot: int) -> bool:
        """A readback was queued into `slot` that would teach the host rounds it has not seen: not
        received, nor covered by one received since (a newer slot's, or a reset)."""
        return self._covered(slot) > self.learnt

    def _covered(self, slot: int) -> int:
        """The rounds the readback of `slot` covers; slot_index's refusal for a slot that indexes
        neither (2 was a bare IndexError, "a" a bare TypeError)."""
        return self.covers[slot_index(slot)]

    @property
    def unseen_rounds(self) -> int:
        """Rounds queued past the last ones a received readback (or a reset) covers: how far the
        rows may have moved past the positions the host knows."""
        return self.rounds - self.learnt

    def reset(self) -> None:
        """Every row was reset: their positions are the host's, their rings empty."""
        self.learnt, self.ring_rounds = self.rounds, 0
        self.events += 1

    def rows_written(self) -> None:
        """Rows' requests or stop rules were written (a row started, reset, stopped, parked): a
        readback queued before describes those rows as they were."""
        self.events += 1

    def drained(self) -> None:
        """The rings were emptied without a readback (drain_ring of the only row); the
        positions are no better known."""
        self.ring_rounds = 0
        self.events += 1

    def __repr__(self) -> str:
        return f"Ledger({self.rounds} rounds queued, {self.unseen_rounds} unseen, {self.ring_rounds} in the rings)"

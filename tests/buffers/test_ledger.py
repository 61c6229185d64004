"""The ledger of rounds the host has not seen (memra_cuda/buffers/ledger.py), on the CPU: a value
with no device behind it, checked against a simulated stream whose rows move one position a
round and whose readbacks copy the position into a pinned slot, in stream order."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memra_cuda.buffers import Ledger


def test_the_ledger_counts_rounds_until_a_readback_that_covers_them_is_received():
    ledger = Ledger()
    ledger.queued(2)  # issue_burst: no readback
    ledger.queued(1)
    assert ledger.unseen_rounds == 3 and ledger.ring_rounds == 3
    ledger.queued(0, readback=0)  # a readback queued after them empties the rings...
    assert ledger.ring_rounds == 0 and ledger.unseen_rounds == 3  # ...but the host sees them only once it is received
    ledger.queued(4, readback=1)  # overlap: the next burst in flight, its readback into the other slot
    assert ledger.unseen_rounds == 7
    ledger.received(0)
    assert ledger.unseen_rounds == 4, "the burst in flight behind the received one is still unseen"
    ledger.received(1)
    assert ledger.unseen_rounds == 0
    ledger.received(0)  # a slot received twice, or behind a newer one, teaches nothing new
    assert ledger.unseen_rounds == 0
    assert "7 rounds queued, 0 unseen, 0 in the rings" in repr(ledger)


def test_a_readback_queued_is_unreceived_until_it_or_a_newer_one_is_received_or_the_rows_reset():
    """What RoundStream.recover reads: a step whose wait an interrupt cut short left its slot's
    readback unreceived, and the count of events says whether anything came after it (rounds or a
    readback queued, a reset, a drain, rows written), receiving apart."""
    ledger = Ledger()
    assert not ledger.unreceived(0) and not ledger.unreceived(1) and ledger.events == 0
    ledger.queued(4, readback=0)
    assert ledger.unreceived(0) and not ledger.unreceived(1) and ledger.events == 1
    ledger.received(0)
    assert not ledger.unreceived(0) and ledger.events == 1, "receiving is no event"
    ledger.queued(4, readback=0)
    ledger.queued(4, readback=1)
    assert ledger.unreceived(0) and ledger.unreceived(1) and ledger.events == 3
    ledger.received(1)
    assert not ledger.unreceived(0), "a newer slot's readback, received, covers the older"
    ledger.queued(2)
    ledger.drained()
    ledger.rows_written()
    assert ledger.events == 6
    ledger.queued(0, readback=0)
    assert ledger.unreceived(0)
    ledger.reset()
    assert not ledger.unreceived(0) and ledger.events == 8


def test_a_reset_of_every_row_sees_everything_and_a_drain_empties_the_rings_alone():
    ledger = Ledger()
    ledger.queued(3)
    ledger.drained()  # drain_ring of the only row: its tokens read, its position not
    assert ledger.ring_rounds == 0 and ledger.unseen_rounds == 3
    ledger.queued(2)
    ledger.reset()
    assert ledger.ring_rounds == 0 and ledger.unseen_rounds == 0
    ledger.queued(1, readback=1)
    ledger.received(1)
    assert ledger.unseen_rounds == 0 and ledger.rounds == 6


# One step of a driver: ("rounds", r) queues r rounds; ("readback", r) r rounds and a readback
# into the free slot (if there is one: at most two in flight); ("receive", _) the oldest one in
# flight; ("reset", _) every row; ("drain", _) the only row's ring.
STEPS = st.lists(st.tuples(st.sampled_from(["rounds", "readback", "receive", "reset", "drain"]),
                           st.integers(0, 16)), max_size=60)


@settings(deadline=None)  # pure host work; a loaded CI machine once took past the 200 ms default
@given(STEPS)
def test_the_ledger_bounds_what_a_simulated_stream_did_past_what_the_host_learnt(steps):
    """unseen_rounds is how far the rows moved past the position the host last learnt (from a
    readback received, in the order they were queued, or a reset of every row), and ring_rounds
    the rounds committed into the rings since a readback or a drain emptied them."""
    ledger = Ledger()
    position = known = ring = 0  # the device's rows; what the host learnt; rounds in the rings
    slots, in_flight = [0, 0], []  # each pinned slot's copy of the position; slots in queue order
    for step, rounds in steps:
        if step == "rounds" or step == "readback":
            free = [slot for slot in (0, 1) if slot not in in_flight]
            position, ring = position + rounds, ring + rounds
            if step == "readback" and free:
                slots[free[0]], ring = position, 0
                in_flight.append(free[0])
                ledger.queued(rounds, readback=free[0])
            else:
                ledger.queued(rounds)
        elif step == "receive" and in_flight:
            slot = in_flight.pop(0)
            known = max(known, slots[slot])
            ledger.received(slot)
        elif step == "reset":
            known, ring = position, 0
            ledger.reset()
        elif step == "drain":
            ring = 0
            ledger.drained()
        assert ledger.unseen_rounds == position - known
        assert ledger.ring_rounds == ring
        assert ledger.rounds == position


def test_a_readback_slot_but_0_or_1_is_refused_before_the_ledger_counts_anything():
    """queued(rounds, readback=2) counted the rounds, then raised an IndexError naming nothing:
    a driver entering a hand-launched graph with a wrong slot left the ledger counting rounds
    no readback covers. Now refused first, naming the slot; -1 is slot 1, as in StreamBufs'
    per-burst paths alike (they test nothing, so it costs no burst anything)."""
    import pytest
    ledger = Ledger()
    for slot, error in ((2, ValueError), (-3, ValueError), ("1", TypeError), (1.0, TypeError)):
        with pytest.raises(error, match="^a readback slot must be an int"):
            ledger.queued(3, readback=slot)
        assert (ledger.rounds, ledger.ring_rounds, ledger.covers) == (0, 0, [0, 0])
    ledger.queued(3, readback=1)
    ledger.queued(2, readback=-1)
    assert (ledger.rounds, ledger.ring_rounds, ledger.covers) == (5, 0, [0, 5])


def test_a_bool_is_no_readback_slot_though_it_indexes_one():
    """queued(rounds, readback=True), received(True) and unreceived(True) took True as slot 1
    (False as slot 0), as a list indexes by a bool: a TypeError naming the slot now, before the
    ledger counts anything, as as_slot refuses one where a slot is chosen (graph_for). A round's
    own entry (queued without a readback) finds no slot and tests nothing more."""
    ledger = Ledger()
    for slot in (True, False):
        with pytest.raises(TypeError, match=rf"^a readback slot must be an integer, not {slot}$"):
            ledger.queued(3, readback=slot)
        assert (ledger.rounds, ledger.ring_rounds, ledger.covers, ledger.events) == (0, 0, [0, 0], 0)
        with pytest.raises(TypeError, match=rf"^a readback slot must be an integer, not {slot}$"):
            ledger.received(slot)
        with pytest.raises(TypeError, match=rf"^a readback slot must be an integer, not {slot}$"):
            ledger.unreceived(slot)
        assert ledger.learnt == 0
    ledger.queued(3, readback=1)
    ledger.received(np.int64(1))
    assert ledger.unseen_rounds == 0 and ledger.covers == [0, 3]


def test_rounds_and_a_received_slot_are_refused_naming_them_before_the_ledger_changes():
    """queued(-5) and queued(2.5) were taken, and unseen_rounds, the capacity check's margin,
    became -2 or 5.5; received(2) was a bare IndexError and unreceived("a") a bare TypeError,
    naming nothing. Found as queued finds its slot: -1 is slot 1 in each."""
    ledger = Ledger()
    ledger.queued(3, readback=0)
    for rounds, error in ((-1, ValueError), (-5, ValueError), (2.5, TypeError), ("1", TypeError), (True, TypeError),
                          (None, TypeError)):
        for readback in (None, 1):
            with pytest.raises(error, match=rf"^rounds must be an int.*, not {rounds!r}$"):
                ledger.queued(rounds, readback=readback)
        assert (ledger.rounds, ledger.ring_rounds, ledger.covers, ledger.events) == (3, 0, [3, 0], 1)
    for slot, error in ((2, ValueError), (-3, ValueError), ("a", TypeError), (1.0, TypeError), (None, TypeError)):
        with pytest.raises(error, match="^a readback slot must be an int"):
            ledger.received(slot)
        with pytest.raises(error, match="^a readback slot must be an int"):
            ledger.unreceived(slot)
        assert ledger.learnt == 0
    ledger.queued(0)  # the least: nothing queued, still an event
    ledger.queued(np.int64(2))
    assert ledger.rounds == 5 and type(ledger.rounds) is int and ledger.ring_rounds == 2
    assert not ledger.unreceived(1) and not ledger.unreceived(-1) and ledger.unreceived(np.int64(0))
    ledger.received(-1)  # slot 1: it covers nothing yet
    assert ledger.unseen_rounds == 5
    ledger.received(0)
    assert ledger.unseen_rounds == 2

"""The capacity rule (memra_cuda/buffers/capacity.py), on CPU: how far a burst, an overlapped burst
and a device loop may write into the KV caches, each at its exact limit and one entry past it;
the rule of a pipeline's stages; the fast path against every row; kv_capacity against the worst
position a live row can burst from."""
from __future__ import annotations

import itertools
import re
import reprlib

import numpy as np
import pytest

from memra_cuda import Geometry
from memra_cuda import Stages, UNCHECKED, kv_capacity
from memra_cuda.errors import CapacityError
from memra_cuda.buffers.capacity import Capacity, i32_kv_capacity, kv_entries
from memra_cuda.driver.values import I32_MOST

ONE, TWO = np.array([False]), np.array([False, False])


def at(*positions: int) -> np.ndarray:
    return np.array(positions, np.int64)


def test_a_burst_fits_to_the_last_entry_and_not_one_past():
    rule = Capacity(24, Geometry(4, 4, 1))
    rule.check_burst(at(9), ONE, rounds=3)  # 9 + 3 rounds of 5 = 24: the last entry
    assert rule.burst_reach(at(9), ONE, 3).tolist() == [24]
    with pytest.raises(CapacityError, match=r"24 entries.*up to 25 \(row 0 at position 10\)"):
        rule.check_burst(at(10), ONE, rounds=3)
    with pytest.raises(CapacityError, match="3 rounds"):
        rule.check_burst(at(10), ONE, rounds=3)
    rule.check_burst(at(19), ONE, rounds=1)
    with pytest.raises(CapacityError):
        rule.check_burst(at(20), ONE, rounds=1)


def test_a_batch_leaves_room_for_the_round_a_finished_row_sits_out():
    rule = Capacity(24, Geometry(4, 4, 2))
    rule.check_burst(at(4, 0), TWO, rounds=3)  # 4 + 15 + 5 = 24
    with pytest.raises(CapacityError, match=r"row 0 at position 5"):
        rule.check_burst(at(5, 0), TWO, rounds=3)
    # The second row is the one past the limit: the error names it.
    with pytest.raises(CapacityError, match=r"row 1 at position 5"):
        rule.check_burst(at(0, 5), TWO, rounds=3)


def test_a_done_row_needs_only_its_scratch_entries():
    rule = Capacity(24, Geometry(4, 4, 2))
    done = np.array([True, False])
    rule.check_burst(at(19, 0), done, rounds=3)  # done: 19 + 5 = 24, whatever the burst
    with pytest.raises(CapacityError, match="row 0 at position 20"):
        rule.check_burst(at(20, 0), done, rounds=3)


def test_an_overlapped_burst_counts_the_rounds_in_flight_before_it():
    """Overlap queues a burst behind one whose tokens the host has not seen: those rounds may
    have moved every row a whole burst on (ahead)."""
    rule = Capacity(64, Geometry(3, 8, 1))
    rule.check_burst(at(0), ONE, rounds=8, ahead=8)  # 0 + 8·4 + 8·4 = 64
    with pytest.raises(CapacityError, match="behind 8 unseen"):
        rule.check_burst(at(1), ONE, rounds=8, ahead=8)
    rule.check_burst(at(1), ONE, rounds=8, ahead=7)
    with pytest.raises(CapacityError):
        rule.check_burst(at(0), ONE, rounds=8, ahead=9)
    assert rule.burst_short(at(0), ONE, 8, ahead=8).size == 0
    assert rule.burst_short(at(1), ONE, 8, ahead=8).tolist() == [0]


def test_a_device_loop_is_checked_for_its_whole_budget():
    """A row that commits at most `most` tokens starts its last round at most most - 1 past its
    position and writes k + 1 entries there; with passes of several rounds (or a batch) the
    round that stopped it may have kept k + 1 more."""
    single = Capacity(40, Geometry(4, 1, 1))
    single.check_loop(at(16), at(20), ONE)  # 16 + 20 + 5 - 1 = 40
    with pytest.raises(CapacityError, match=r"device loop: row 0 at position 17 may write up to 41 \(20 tokens"):
        single.check_loop(at(17), at(20), ONE)
    passes = Capacity(45, Geometry(4, 16, 1))
    passes.check_loop(at(16), at(20), ONE)  # + 5 for the idle round
    with pytest.raises(CapacityError):
        passes.check_loop(at(17), at(20), ONE)
    batch = Capacity(45, Geometry(4, 1, 2))
    batch.check_loop(at(16, 40), at(20, 0), np.array([False, True]))  # the done row: 40 + 5
    with pytest.raises(CapacityError, match="row 1"):
        batch.check_loop(at(16, 41), at(20, 0), np.array([False, True]))
    with pytest.raises(CapacityError):  # rounds queued ahead of the loop move it on
        single.check_loop(at(16), at(20), ONE, ahead=1)


def test_pipeline_stages_bound_the_rule_with_their_caches():
    """The other stages roll back in round_tail, out of the tables' sight: their capacity joins
    the tables', and the fewest entries anywhere is the rule's."""
    stages = Stages((), round_tail=lambda: None, capacity=20)
    rule = Capacity.of((stages.capacity, 64, None), Geometry(4, 4))
    assert rule.entries == 20
    rule.check_burst(at(0), ONE, rounds=4)  # 20: the stage's last entry
    with pytest.raises(CapacityError, match="20 entries"):
        rule.check_burst(at(1), ONE, rounds=4)
    assert Capacity.of((Stages((), lambda: None, UNCHECKED).capacity, 64), Geometry(4, 4)).entries == 64
    unchecked = Capacity.of((UNCHECKED, None), Geometry(4, 4))
    assert unchecked.entries is None
    unchecked.check_burst(at(10**9), ONE, rounds=4)  # nothing to check against
    unchecked.check_loop(at(10**9), at(10**6), ONE)
    assert unchecked.burst_short(at(10**9), ONE, 4).size == 0


def test_a_stated_capacity_is_positive_none_or_unchecked_by_name():
    assert kv_entries(None) is None and kv_entries(UNCHECKED) is UNCHECKED
    assert kv_entries(np.int64(7)) == 7 and type(kv_entries(np.int64(7))) is int
    for bad in (0, -1):
        with pytest.raises(ValueError, match="capacity must be None, UNCHECKED or an int of at least 1"):
            kv_entries(bad)
    for bad in (2.5, True):
        with pytest.raises(TypeError, match="capacity"):
            kv_entries(bad)


def test_capacity_of_checks_each_capacity_naming_its_place():
    """Capacity.of([5, None, "x"]) raised min()'s "'<' not supported between instances of 'str'
    and 'int'", naming no capacity; each is checked as kv_entries checks one now, by its place."""
    for bad, error, message in (("x", TypeError, r"capacities\[2\] must be an integer, not 'x'"),
                                (True, TypeError, r"capacities\[2\] must be an integer, not True"),
                                (2.5, TypeError, r"capacities\[2\] must be an integer, not 2\.5"),
                                (0, ValueError, r"capacities\[2\] must be None, UNCHECKED or an int of at least 1, "
                                                r"not 0")):
        with pytest.raises(error, match=message):
            Capacity.of([5, None, bad], Geometry(1, 1))
    rule = Capacity.of((np.int64(9), UNCHECKED, None, 12), Geometry(1, 1))
    assert rule.entries == 9 and type(rule.entries) is int


# Capacity.of's refusal of what is no capacities (as_listed's), as a pattern
NOT_CAPACITIES = (r"capacities must be a list, a tuple or a 1-D array of KV capacities \(each a positive int, None or "
                  r"UNCHECKED\)")


def test_capacity_of_an_iterator_is_refused_unread_naming_capacities():
    """Capacity.of(itertools.repeat(5), geometry) never returned: the fewest is taken of them all,
    and an iterator was read to its end. What is no list, tuple or 1-D array is refused now, before
    it is read; a range is read as before."""
    read = []

    def capacities():
        read.append(1)
        yield 64

    # as_listed's refusal, which a set and a mapping's values (counted, with no order of their own) meet too
    for unsized in (iter([64, 32]), capacities(), itertools.repeat(5), itertools.count(1), {64, 32}, {0: 64}.values()):
        with pytest.raises(TypeError, match=f"{NOT_CAPACITIES}, not {re.escape(reprlib.repr(unsized))}$"):
            Capacity.of(unsized, Geometry(4, 8))
    assert read == [], "the generator was read before it was refused"
    assert Capacity.of(range(64, 16, -16), Geometry(4, 8)).entries == 32  # a range has a len()


def test_capacity_of_one_capacity_names_the_capacities_it_wants():
    """Capacity.of(10, geometry) raised "'int' object is not iterable", naming nothing; a string
    would have been read a character at a time, and a bytearray as its bytes' ints (capacities 64 and
    32, where bytes were refused); a mapping's keys were read as the capacities ({64: "draft"} was
    64), and a 0-d array's iteration raised a TypeError naming nothing."""
    for bad in (10, "512", None, UNCHECKED, bytearray(b"\x40\x20"), memoryview(b"\x40"), {64: "draft", 128: "target"},
                np.array(64)):
        with pytest.raises(TypeError, match=f"{NOT_CAPACITIES}, not {re.escape(reprlib.repr(bad))}$"):
            Capacity.of(bad, Geometry(4, 8))
    assert Capacity.of(np.array([64, 32]), Geometry(4, 8)).entries == 32  # an array is iterable


def test_the_one_reduction_fast_path_agrees_with_every_row():
    rng = np.random.default_rng(7)
    for _ in range(2000):
        batch, k, m_rounds = int(rng.integers(1, 6)), int(rng.integers(0, 6)), int(rng.integers(1, 9))
        rule = Capacity(int(rng.integers(1, 200)), Geometry(k, m_rounds, batch))
        positions = rng.integers(0, 200, batch)
        done = rng.random(batch) < 0.3
        rounds, ahead = int(rng.integers(1, m_rounds + 1)), int(rng.integers(0, 3))
        every_row = np.flatnonzero(rule.burst_reach(positions, done, rounds, ahead) > rule.entries)
        assert rule.burst_short(positions, done, rounds, ahead).tolist() == every_row.tolist()


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("overlap", [False, True])
def test_kv_capacity_holds_every_burst_a_live_row_can_start(batch, overlap):
    """A live row has committed fewer than max_new_tokens tokens, so it sits at most at
    prompt_len - 1 + max_new_tokens - 1 when a burst starts (behind one more in flight, in
    overlap): kv_capacity leaves room for it, and a cache of the rule's exact need leaves none
    for one entry more."""
    for prompt_len, new_tokens, k, m_rounds in ((1, 1, 0, 1), (16, 512, 4, 16), (5, 7, 2, 3), (100, 1, 8, 64)):
        geometry = Geometry(k, m_rounds, batch)
        rule = Capacity(kv_capacity(prompt_len, new_tokens, geometry, overlap=overlap), geometry)
        worst = prompt_len - 1 + new_tokens - 1
        positions, live = np.full(batch, worst, np.int64), np.zeros(batch, bool)
        ahead = m_rounds if overlap else 0
        rule.check_burst(positions, live, m_rounds, ahead)  # the worst a generation can ask
        need = int(rule.burst_reach(positions, live, m_rounds, ahead).max())
        assert need <= rule.entries
        tight = Capacity(need, geometry)
        tight.check_burst(positions, live, m_rounds, ahead)
        with pytest.raises(CapacityError):
            tight.check_burst(positions + 1, live, m_rounds, ahead)


@pytest.mark.parametrize("overlap", [False, True])
def test_i32_kv_capacity_is_kv_capacity_up_to_the_most_an_i32_position_reaches(overlap):
    """The demo's and own_kernels' check, one for both (each had its own copy and message): the
    most budget whose cache an i32 reaches is kv_capacity's size; one token more is refused by the
    budget's name, its cache's size and the rounds'."""
    geometry = Geometry(4, 16)
    most = I32_MOST - kv_capacity(5, 0, geometry, overlap=overlap)
    assert i32_kv_capacity(5, most, geometry, overlap=overlap) == kv_capacity(5, most, geometry, overlap=overlap)
    assert i32_kv_capacity(5, most, geometry, overlap=overlap) == I32_MOST
    with pytest.raises(CapacityError, match=re.escape(
            f"--tokens {most + 1} needs a KV cache of {I32_MOST + 1} entries in rounds of k=4, M=16"
            f"{' in overlap' if overlap else ''}, past the {I32_MOST} an i32 position reaches")):
        i32_kv_capacity(5, most + 1, geometry, overlap=overlap, what="--tokens")


@pytest.mark.parametrize("geometry, named", [(Geometry(4, 16), "k=4, M=16"), (Geometry(2, 8, 64), "k=2, M=8, B=64"),
                                             (Geometry(3, 4, 2, 9), "k=3, M=4, B=2, width=9")],
                         ids=["chain", "batch", "tree"])
def test_i32_kv_capacity_names_the_rounds_by_what_sizes_the_cache(geometry, named):
    """The refusal named its rounds by the Geometry's repr, Geometry(k=4, m_rounds=16, batch=1,
    width=5), in a command line's one-line error: now by k and M, and B and the width where they
    count (a batch's k + 1 more, a tree's slots), as docs/capacity.md's rule reads them."""
    with pytest.raises(CapacityError) as refused:
        i32_kv_capacity(5, I32_MOST, geometry)
    assert f" entries in rounds of {named}, past the {I32_MOST} an i32 position reaches" in str(refused.value)
    assert "Geometry(" not in str(refused.value)


def test_i32_kv_capacity_checks_the_budget_by_its_name():
    """A command line asks nothing else of its budget: a negative one, or one not an int, is
    refused naming the option (kv_capacity's own check named max_new_tokens)."""
    geometry = Geometry(4, 16)
    assert i32_kv_capacity(5, 0, geometry, what="--tokens") == kv_capacity(5, 0, geometry)
    with pytest.raises(ValueError, match="^--tokens .*-1"):
        i32_kv_capacity(5, -1, geometry, what="--tokens")
    with pytest.raises(TypeError, match="^--tokens"):
        i32_kv_capacity(5, 2.5, geometry, what="--tokens")

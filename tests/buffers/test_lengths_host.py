"""DraftLengths' host side, on CPU (docs/lengths.md): its fields in one allocation, what the host
writes where (costs, caps), and what it refuses, before anything is written. No device memory is
touched: the engine is a stand-in that hands out an address nobody reads and records the host
writes, and the StreamBufs is its host half."""
from __future__ import annotations

import numpy as np
import pytest

from memra_cuda import StreamBufs
from memra_cuda.buffers import DraftLengths, Ledger
from memra_cuda.buffers.layout import COST_DRAFT, COST_VERIFY, RATE_ACCEPTED, RATE_REJECTED, RATE_WORDS
from memra_cuda.driver.buffer import DeviceBuffer
from memra_cuda.errors import BuffersHeld


class Recorder:
    """What DraftLengths asks of an engine: zeroed memory, an address nobody reads, and host
    writes, recorded as (field, values, start)."""

    def __init__(self):
        self.writes: list[tuple[str | None, list, int]] = []

    def zeros(self, dtype, length, *, label):
        return DeviceBuffer.wrap(0x10000, dtype, length)

    def copy_htod(self, dst, values, start=0):
        self.writes.append((dst.label, np.asarray(values).tolist(), start))


def host_bufs(k: int = 3, batch: int = 4) -> StreamBufs:
    bufs = StreamBufs.__new__(StreamBufs)
    bufs.k, bufs.batch, bufs.m_rounds, bufs.engine = k, batch, 1, Recorder()
    bufs.ledger, bufs.holder, bufs._held_why = Ledger(), None, ""
    return bufs


def made(k: int = 3, batch: int = 4) -> tuple[DraftLengths, Recorder]:
    bufs = host_bufs(k, batch)
    lengths = DraftLengths(bufs, [1.0 + w / 4 for w in range(k + 1)], 0.125)
    bufs.engine.writes.clear()
    return lengths, bufs.engine


def test_the_fields_lie_in_one_allocation_in_their_order():
    lengths, _ = made(k=3, batch=4)
    fields = [lengths.rate_d, lengths.cap_d, lengths.cost_d, lengths.width_d]
    assert [(buf.label, buf.dtype, buf.len) for buf in fields] == [
        ("rate_d", np.float32, 4 * RATE_WORDS), ("cap_d", np.uint32, 4), ("cost_d", np.float32, COST_VERIFY + 4),
        ("width_d", np.uint32, 1)]
    starts = [(buf.ptr - lengths.rate_d.ptr) // 4 for buf in fields]
    assert starts == [0, 4 * RATE_WORDS, 4 * RATE_WORDS + 4, 4 * RATE_WORDS + 4 + COST_VERIFY + 4]


def test_the_costs_are_laid_out_draft_step_first_and_every_cap_starts_at_k():
    bufs = host_bufs(k=2, batch=3)
    DraftLengths(bufs, [1.0, 1.1, 1.2], 0.3)
    cost = [0.0] * (COST_VERIFY + 3)
    cost[COST_DRAFT], cost[COST_VERIFY:] = np.float32(0.3), np.float32([1.0, 1.1, 1.2]).tolist()
    assert bufs.engine.writes == [("rate_d", [0.5, 0.5] * 3, 0), ("cost_d", cost, 0), ("cap_d", [2, 2, 2], 0)]


def test_a_width_the_rounds_do_not_run_costs_none_written_as_nan_which_the_chooser_leaves_out():
    """NaN, not 0: the chooser weighs a width at its verify cost plus W draft steps, so a 0 with a
    draft cost would make the width look cheapest (the reference picks it), where NaN stays no cost."""
    from memra_cuda.testing.reference import width_values
    lengths, engine = made(k=3, batch=4)
    lengths.set_costs([1.0, None, None, 1.6], 0.2)
    ((field, cost, start),) = engine.writes
    assert (field, start) == ("cost_d", 0) and np.isnan(cost[COST_VERIFY + 1]) and np.isnan(cost[COST_VERIFY + 2])
    assert [cost[COST_DRAFT], cost[COST_VERIFY], cost[COST_VERIFY + 3]] == [np.float32(0.2), 1.0, np.float32(1.6)]
    values = width_values(np.full(4, 0.5), np.full(4, 3), np.float32(cost), 3)
    assert values[1] < 0 and values[2] < 0 and values[0] > 0 and values[3] > 0


def test_the_costs_are_a_list_a_tuple_or_an_array_in_width_order_never_a_mappings_keys():
    """A mapping was taken as its keys: {1: 9.0, 2: 9.5, 3: 9.9, 4: 10.0} wrote costs 1, 2, 3, 4.
    Refused (test above); a tuple or a 1-D array writes what the list of its values does."""
    lengths, engine = made(k=3, batch=4)
    for given in ([1.0, None, 1.5, 1.75], (1.0, None, 1.5, 1.75), np.array([1.0, None, 1.5, 1.75], dtype=object)):
        lengths.set_costs(given, 0.5)
    lengths.set_costs(np.array([1.0, 1.25, 1.5, 1.75]), np.float32(0.5))
    lengths.set_costs([1.0, 1.25, 1.5, 1.75], 0.5)
    written = [np.array(cost, np.float32).tobytes() for _, cost, _ in engine.writes]  # NaN as bits
    assert written[0] == written[1] == written[2] and written[3] == written[4] != written[0]
    with pytest.raises(TypeError, match="verify_costs must be a list"):
        lengths.set_costs({1: 9.0, 2: 9.5, 3: 9.9, 4: 10.0}, 0.0)
    assert len(engine.writes) == 5


def test_every_rows_statistics_start_at_the_prior():
    """Not zeros: a row already live when the lengths are made (keep >= 1) is never restarted at
    the prior, and zeros are an acceptance of 0, which chose width 0 for good (nothing learns at 0)."""
    bufs = host_bufs(k=2, batch=2)
    DraftLengths(bufs, [1.0, 1.1, 1.2], 0.3, prior=0.3)
    rate = np.zeros((2, RATE_WORDS), np.float32)
    rate[:, RATE_ACCEPTED], rate[:, RATE_REJECTED] = np.float32(0.3), np.float32(1) - np.float32(0.3)
    assert bufs.engine.writes[0] == ("rate_d", rate.reshape(-1).tolist(), 0)


def test_caps_are_written_for_every_row_or_one():
    lengths, engine = made(k=3, batch=4)
    lengths.set_caps(2)
    lengths.set_caps([0, 1, 2, 3])
    lengths.set_caps(np.array([3, 3, 0, 0]))
    lengths.set_cap_row(3, 1)
    lengths.set_caps(np.array(1))  # a 0-d array is one value, as an int is (its len() raised a TypeError)
    assert engine.writes == [("cap_d", [2, 2, 2, 2], 0), ("cap_d", [0, 1, 2, 3], 0), ("cap_d", [3, 3, 0, 0], 0),
                             ("cap_d", [1], 3), ("cap_d", [1, 1, 1, 1], 0)]


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda lengths: lengths.set_caps(4), ValueError, "the cap of row 0 must be an int from 0 to 3"),
    (lambda lengths: lengths.set_caps([0, 1, -1, 2]), ValueError, "the cap of row 2 must be an int from 0 to 3"),
    (lambda lengths: lengths.set_caps([0, 1]), ValueError, r"caps needs one value per row \(4\), not 2"),
    (lambda lengths: lengths.set_caps(2.0), TypeError, "the cap of row 0 must be an integer"),
    (lambda lengths: lengths.set_caps(True), TypeError, "the cap of row 0 must be an integer"),
    (lambda lengths: lengths.set_cap_row(4, 1), ValueError, "row must be an int from 0 to 3"),
    (lambda lengths: lengths.set_cap_row(1, 9), ValueError, "the cap of row 1 must be an int from 0 to 3"),
    (lambda lengths: lengths.set_costs([1.0, 1.0, 1.0], 0.0), ValueError, r"one cost per width 0..k \(4\), not 3"),
    (lambda lengths: lengths.set_costs([1.0, 0.0, 1.0, 1.0], 0.0), ValueError, r"verify_costs\[1\] must be positive"),
    (lambda lengths: lengths.set_costs([1.0, 1.0, 1e-50, 1.0], 0.0), ValueError, r"verify_costs\[2\] must be positive"),
    (lambda lengths: lengths.set_costs([1.0, 1.0, 1.0, 1e39], 0.0), ValueError, r"verify_costs\[3\] must be positive"),
    (lambda lengths: lengths.set_costs([float("nan"), 1.0, 1.0, 1.0], 0.0), ValueError, r"verify_costs\[0\]"),
    (lambda lengths: lengths.set_costs([None] * 4, 0.0), ValueError, "leaves every width out"),
    (lambda lengths: lengths.set_costs([1.0] * 4, -0.1), ValueError, "draft_cost must be at least 0"),
    (lambda lengths: lengths.set_costs([1.0] * 4, "0.1"), TypeError, "draft_cost must be a real number"),
    (lambda lengths: lengths.set_costs([1.0] * 4, True), TypeError, "draft_cost must be a real number"),
    (lambda lengths: lengths.set_costs({0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3}, 0.0), TypeError,
     "verify_costs must be a list, a tuple or a 1-D array"),
    (lambda lengths: lengths.set_costs({1.0, 1.1, 1.2, 1.3}, 0.0), TypeError, "verify_costs must be a list"),
    (lambda lengths: lengths.set_costs("1111", 0.0), TypeError, "verify_costs must be a list"),
    (lambda lengths: lengths.set_costs(np.ones((2, 2)), 0.0), TypeError, "verify_costs must be a list"),
    (lambda lengths: lengths.set_costs([10**400, 1.0, 1.0, 1.0], 0.0), ValueError,
     r"verify_costs\[0\] must be a finite number, not one past a float's range"),
    (lambda lengths: lengths.set_costs([1.0] * 4, -(10**400)), ValueError, "draft_cost must be a finite number"),
])
def test_a_wrong_cap_or_cost_is_refused_naming_it_before_anything_is_written(call, error, message):
    lengths, engine = made(k=3, batch=4)
    with pytest.raises(error, match=message):
        call(lengths)
    assert engine.writes == []


@pytest.mark.parametrize(("keyword", "value", "error"), [
    ("decay", 1.5, ValueError), ("decay", -0.1, ValueError), ("decay", float("nan"), ValueError),
    ("prior", 2, ValueError), ("prior", None, TypeError), ("prior", True, TypeError), ("decay", "0.9", TypeError),
    pytest.param("decay", 10**400, ValueError, id="decay-past-a-float"),
    # at the limits: a decay of 1 moves nothing in a round at length 0, a prior of 0 moves it toward no
    # acceptance, so a batch whose width fell to 0 stayed there, speculation off for good
    ("decay", 1.0, ValueError), ("decay", 1, ValueError), ("prior", 0.0, ValueError), ("prior", -0.0, ValueError),
    ("decay", 0.99999999, ValueError), ("prior", 1e-50, ValueError)])  # 1 and 0 as the chooser's f32
def test_a_decay_or_prior_that_could_hold_the_width_at_0_is_refused_before_anything_is_allocated(keyword, value,
                                                                                                 error):
    bufs = host_bufs()
    with pytest.raises(error, match=f"{keyword} must be a"):
        DraftLengths(bufs, [1.0] * 4, 0.0, **{keyword: value})
    assert bufs.engine.writes == []


def test_a_decay_just_below_1_and_a_prior_just_above_0_are_taken_and_1_is_a_prior():
    """The limits on the allowed side, as f32s: the statistics still move, or start somewhere."""
    one, zero = np.float32(1), np.float32(0)
    below_1, above_0 = float(np.nextafter(one, zero)), float(np.nextafter(zero, one))
    for decay, prior in ((below_1, 1.0), (0.0, above_0), (0.0, 1.0)):
        lengths = DraftLengths(host_bufs(), [1.0] * 4, 0.0, decay=decay, prior=prior)
        assert (lengths.decay, lengths.prior) == (decay, prior)


def test_only_round_stream_buffers_take_lengths():
    with pytest.raises(TypeError, match="DraftLengths are made for a StreamBufs, not None"):
        DraftLengths(None, [1.0], 0.0)  # type: ignore[arg-type]


def test_nothing_is_written_while_a_loop_holds_the_buffers():
    lengths, engine = made()
    lengths.bufs.hold(object(), "a device-mode loop is still running on these buffers")
    for write in (lambda: lengths.set_caps(1), lambda: lengths.set_costs([1.0] * 4, 0.0)):
        with pytest.raises(BuffersHeld, match="still running"):
            write()
    assert engine.writes == []

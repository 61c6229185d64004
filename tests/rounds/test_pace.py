"""Pace, the length of a generation's next burst: no longer than the live rows are expected to
need, so a request's last burst does not run rounds past every stop (on the host, no GPU)."""
from __future__ import annotations

import numpy as np
import pytest

from memra_cuda.buffers.geometry import MAX_RING, Geometry
from memra_cuda.rounds.pace import AHEAD, Pace, pass_lengths

LIVE = np.array([True])


def test_before_any_readback_a_burst_is_no_longer_than_the_budget():
    assert Pace(np.array([5]), 16).rounds(LIVE) == 4  # every round commits at least one token
    assert Pace(np.array([100]), 16).rounds(LIVE) == 16
    assert Pace(np.array([8, 3]), 16).rounds(np.array([True, True])) == 8


def test_the_last_burst_is_cut_to_a_power_of_two_of_the_rounds_still_needed():
    pace = Pace(np.array([100]), 16)
    pace.record(16, np.array([64]), LIVE)  # four tokens a round
    assert pace.rounds(LIVE) == 8  # 36 tokens left: nine rounds of four
    pace.record(8, np.array([30]), LIVE)  # a leaner burst: the mean falls to 94/24 a round
    assert pace.rounds(LIVE) == 2


def test_lengths_are_powers_of_two_or_m():
    assert [Pace(np.array([n]), 12).rounds(LIVE) for n in (1, 2, 3, 7, 8, 11, 12, 13)] == [1, 2, 2, 4, 8, 8, 12, 12]


def test_done_rows_are_not_waited_for():
    pace = Pace(np.array([1000, 10]), 16)
    assert pace.rounds(np.array([False, True])) == 8
    assert pace.rounds(np.array([True, False])) == 16


def test_without_cuts_every_burst_is_m_rounds():
    pace = Pace(np.array([5]), 16, cut=False)
    assert pace.rounds(LIVE) == 16
    pace.record(16, np.array([5]), LIVE)
    assert pace.rounds(LIVE, in_flight=3) == 16


def test_a_row_that_stopped_inside_a_burst_says_nothing_of_its_rate():
    pace = Pace(np.array([1000, 1000]), 16)
    pace.record(16, np.array([80, 3]), np.array([True, False]))  # row 1 hit its EOS at once
    assert pace.rounds(np.array([True, True])) == 16  # row 1's rate is still the guaranteed one
    assert pace.generated.tolist() == [80, 3]


def test_a_burst_queued_behind_one_in_flight_counts_that_ones_expected_tokens():
    pace = Pace(np.array([100]), 16)
    pace.record(16, np.array([64]), LIVE)
    assert pace.rounds(LIVE, in_flight=5) == 4  # 36 - 5 * 4 = 16 tokens left
    assert pace.rounds(LIVE, in_flight=16) == 1  # expected to finish: the shortest burst


def test_a_burst_queued_ahead_on_a_guessed_rate_runs_a_share_of_what_the_rows_then_need():
    """Before a row's first readback its rate is `rate`'s guess: a burst queued behind 16 rounds in
    flight at 6.5 a round runs a quarter of the rounds then needed (AHEAD), rounded down to a power
    of two, at least one (128 tokens: 24 left, 3.7 rounds: 1; 300: 30 rounds: 8), and a whole M
    where two bursts more are needed (400: 45 rounds). A row with a rate of its own, or a burst
    not queued ahead, gets the whole need; so does a batch whose live rows all have one."""
    assert AHEAD == 4
    for budget, ahead in ((128, 1), (300, 8), (400, 16)):
        assert Pace(np.array([budget]), 16, rate=6.5).rounds(LIVE, in_flight=16) == ahead, budget
    # the limit: 311 leaves 207 tokens, 31.8 rounds, under 2 M (a quarter: 8); 312 leaves 208, 2 M exactly
    assert Pace(np.array([311]), 16, rate=6.5).rounds(LIVE, in_flight=16) == 8
    assert Pace(np.array([312]), 16, rate=6.5).rounds(LIVE, in_flight=16) == 16
    assert Pace(np.array([300]), 16, rate=6.5).rounds(LIVE) == 16
    pace = Pace(np.array([300, 300]), 16, rate=6.5)
    pace.record(16, np.array([104, 104]), np.array([True, False]))  # row 1 stopped inside: no rate of its own
    # 92 tokens left a row after the 16 in flight, 14.2 rounds: a quarter while row 1's rate is the guess
    assert pace.rounds(np.array([True, True]), in_flight=16) == 4
    assert pace.rounds(np.array([True, False]), in_flight=16) == 8  # row 0 alone, on its own rate: the whole need


def test_a_burst_ahead_is_needed_while_the_leanest_rate_leaves_budget_over():
    pace = Pace(np.array([100]), 16)
    assert pace.needed(LIVE, in_flight=16)  # one token a round: 84 left over
    pace.record(16, np.array([64]), LIVE)
    pace.record(4, np.array([8]), LIVE)  # leanest burst: two tokens a round
    assert pace.needed(LIVE, in_flight=13)  # 72 + 26 < 100
    assert not pace.needed(LIVE, in_flight=14)
    assert not pace.needed(np.array([False]), in_flight=1)


def test_a_live_row_that_committed_nothing_may_need_the_whole_burst():
    """A rate of zero tokens a round gives nothing to divide by: the row may need any number
    of rounds, so the burst runs all M (it once raised OverflowError dividing by zero)."""
    pace = Pace(np.array([10, 10]), 8)
    pace.record(4, np.array([0, 8]), np.array([True, True]))
    assert pace.rounds(np.array([True, True])) == 8
    assert pace.rounds(np.array([False, True])) == 1  # row 1: 2 tokens a round, 2 left


def test_where_rounds_past_the_end_are_skipped_a_burst_covers_the_need():
    """With `skips` (a burst graph that skips a round's model work once every row is done) the
    need is rounded up to a power of two, at most M, and a burst queued ahead runs the whole need
    even on a guessed rate: a round past the end costs a few small kernels, a readback far more."""
    pace = Pace(np.array([100]), 16, skips=True)
    pace.record(16, np.array([64]), LIVE)  # four tokens a round
    assert pace.rounds(LIVE) == 16  # 36 tokens left: nine rounds, up to 16 (not down to 8)
    pace.record(8, np.array([30]), LIVE)  # 94 / 24 a round: 6 tokens are 1.5 rounds
    assert pace.rounds(LIVE) == 2
    assert [Pace(np.array([n]), 12, skips=True).rounds(LIVE) for n in (1, 2, 3, 5, 8, 9, 12, 13)] == \
        [1, 2, 4, 8, 8, 12, 12, 12]
    guessed = Pace(np.array([128]), 16, rate=6.5, skips=True)
    assert guessed.rounds(LIVE) == 16
    assert guessed.rounds(LIVE, in_flight=16) == 4  # 24 tokens left at 6.5: 3.7 rounds, no quarter of them
    stalled = Pace(np.array([10]), 8, skips=True)
    stalled.record(4, np.array([0]), LIVE)
    assert stalled.rounds(LIVE) == 8  # no rate to divide by: the whole M
    with pytest.raises(TypeError, match="^skips must be True or False"):
        Pace(np.array([5]), 4, skips=1)


def test_every_length_rounds_asks_for_is_one_capture_graphs_makes():
    """capture_graphs() captures Pace.lengths(M) up front: a burst of any other length would
    capture mid-request, which through torch synchronises the device."""
    rng = np.random.default_rng(0)
    for m_rounds in (1, 4, 5, 12, 16, 64):
        lengths = set(Pace.lengths(m_rounds))
        for _ in range(200):
            budgets = rng.integers(1, 300, 3)
            pace = Pace(budgets, m_rounds)
            pace.record(m_rounds, rng.integers(m_rounds, 5 * m_rounds, 3), np.array([True] * 3))
            live = rng.random(3) < 0.7
            assert pace.rounds(live, in_flight=int(rng.integers(0, m_rounds + 1))) in lengths
            assert Pace(budgets, m_rounds).rounds(live) in lengths
            assert Pace(budgets, m_rounds, skips=True).rounds(live) in lengths


def test_budgets_m_and_the_switches_are_refused_naming_them_where_they_are_given():
    """Pace([2.7], 4) paced a budget of 2 and Pace(["5"], 4) one of 5, Pace([[5, 6]], 4) two rows
    and Pace([-1], 4) a row needing one round (-1 is the device's "unlimited"); Pace(b, 0) ran
    bursts of 0 rounds, pass_lengths(0, True) a pass of 0; Pace.lengths(2.5) was an
    AttributeError (a float has no bit_length)."""
    for budgets, error, message in (([2.7], ValueError, "2.7 is not an integer"), (["5"], ValueError, "numbers only"),
                                    ([5, True], TypeError, "bools given"), (np.array([2.5]), ValueError, "float64"),
                                    ([[5, 6]], TypeError, "one a row"), (np.array([[5], [6]]), TypeError, "one a row"),
                                    (5, TypeError, "one a row"), (np.array(5), TypeError, "one a row"),
                                    ([5, -1], ValueError, "at least 0"), (np.array([-1]), ValueError, "at least 0")):
        with pytest.raises(error, match=f"^budgets: .*{message}"):
            Pace(budgets, 4)
    for m, error in ((0, ValueError), (-1, ValueError), (2.5, TypeError), ("4", TypeError), (True, TypeError)):
        with pytest.raises(error, match=rf"^m_rounds must be an int.*, not {m!r}$"):
            Pace(np.array([5]), m)
        with pytest.raises(error, match=rf"^m_rounds must be an int.*, not {m!r}$"):
            Pace.lengths(m)
        with pytest.raises(error, match=rf"^m_rounds must be an int.*, not {m!r}$"):
            pass_lengths(m, True)
    for flag in ("False", 0, None):
        with pytest.raises(TypeError, match="^cut must be True or False"):
            Pace(np.array([5]), 4, cut=flag)
        with pytest.raises(TypeError, match="^paced must be True or False"):
            pass_lengths(4, flag)
    pace = Pace([5, 2**40], np.int64(1), cut=np.bool_(True))  # M at its least
    assert pace.rounds(np.array([True, True])) == 1 and pace.budgets.tolist() == [5, 2**40]
    assert Pace([0], 4).budgets.tolist() == [0] and Pace([], 4).budgets.size == 0  # the least budget, and no rows
    assert Pace.lengths(1) == [1] and pass_lengths(1, True) == [1] and Pace.lengths(np.uint8(4)) == [1, 2, 4]


def test_m_past_what_any_geometry_takes_is_refused_naming_it():
    """Pace(b, 2**40) was taken (and Pace.lengths, pass_lengths too): M is at most the most any
    Geometry takes (MAX_RING, a ring row's M * (k + 1) tokens at k = 0), checked by the one check
    a Geometry's M has (as_rounds), its message too."""
    for m in (MAX_RING + 1, 2**40):
        refusal = (rf"^m_rounds must be at most {MAX_RING} \(a burst's M \* \(k \+ 1\) tokens fill a ring row "
                   rf".*, not {m}$")
        for check in (lambda: Pace(np.array([5]), m), lambda: Pace.lengths(m), lambda: pass_lengths(m, True),
                      lambda: Geometry(0, m)):
            with pytest.raises(ValueError, match=refusal):
                check()
    pace = Pace(np.array([5]), MAX_RING)  # at the most
    assert pace.m_rounds == Geometry(0, MAX_RING).m_rounds == MAX_RING and pace.rounds(LIVE) == 4
    assert Pace.lengths(MAX_RING)[-2:] == [2**31, MAX_RING] and pass_lengths(MAX_RING, False) == [MAX_RING, 1]


def test_a_known_rate_sizes_the_bursts_before_a_generations_first_readback():
    """`rate` (the tokens a round the decoder's last generation made) stands for a row's rate until
    its first readback: a 128-token request at 6.5 a round still opens with M, but the burst
    queued behind that one (overlap) is a quarter of the four rounds the rest needs, where one
    token a round queued a whole M more; a short request opens short. After a readback the row's own rate rules."""
    assert Pace(np.array([128]), 16, rate=6.5).rounds(LIVE) == 16
    assert Pace(np.array([128]), 16).rounds(LIVE, in_flight=16) == 16
    assert Pace(np.array([128]), 16, rate=6.5).rounds(LIVE, in_flight=16) == 1  # 24 left: 3.7 rounds, a quarter
    assert Pace(np.array([32]), 16, rate=6.5).rounds(LIVE) == 4
    assert Pace(np.array([32]), 16, rate=1).rounds(LIVE) == 16
    pace = Pace(np.array([128]), 16, rate=6.5)
    pace.record(16, np.array([32]), LIVE)  # two a round, this request's own
    assert pace.rounds(LIVE) == 16  # 96 left: 48 rounds at its own two
    assert pace.needed(LIVE, in_flight=16)  # whether a burst is queued ahead: the leanest rate, as before


def test_a_generation_observes_the_rate_of_the_bursts_its_rows_ran_whole():
    """observed(): tokens over rounds of the bursts each row was live throughout (the next
    generation's rate); a row's burst that it stopped inside, and a generation that ran none
    whole, say nothing (None)."""
    pace = Pace(np.array([1000, 1000]), 16)
    assert pace.observed() is None
    pace.record(16, np.array([80, 3]), np.array([True, False]))  # row 1 stopped inside
    assert pace.observed() == 5.0
    pace.record(8, np.array([16, 0]), np.array([True, False]))
    assert pace.observed() == 96 / 24


def test_a_rate_under_one_token_a_round_or_no_number_is_refused_naming_it():
    for rate, error in ((0.5, ValueError), (0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
                        (True, TypeError), ("2", TypeError), (None, TypeError)):
        with pytest.raises(error, match="rate"):
            Pace(np.array([5]), 4, rate=rate)
    assert Pace(np.array([5]), 4, rate=np.float32(1.0)).rate == 1.0 and Pace(np.array([5]), 4, rate=3).rate == 3.0

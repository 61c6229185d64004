"""TokenFeed.follow(), the host's side of device mode, against a simulated device on a fake
clock (on the host, no GPU): the host's waiting is tested on every CI, where a GPU run could only
show it through timings that vary with the machine (docs/device-mode.md, "How the host waits").
The fake clock and sleep are the Schedule's, given to it as a server would give its own.

The fake host clock moves only when the host sleeps: by what it asked for plus WAKE_NS, the
sleep's own lateness (~5 µs on the H200's host), so a look costs nothing else unless a test
makes clock reads cost time. The device's clock is the host's plus OFFSET, and its stamps are
the low 32 bits, which wrap 2 ms into each run. Round k commits at first_ns + k * round_ns and
publishes as kernel 4' (spec_ring_publish) does: every row's tokens and stamps, the counts,
then the head's stamp and publish count; HEAD_ENDED is set with the last publish (the loop's
last node). Rows commit 0 to 4 tokens a round each, drawn from a fixed seed.
"""
from __future__ import annotations

import contextlib
import re

import numpy as np
import pytest

from memra_cuda.buffers.layout import HEAD_ENDED, HEAD_SEQ, HEAD_STAMP, HEAD_WORDS
from memra_cuda.rounds import pace, schedule
from memra_cuda.rounds.device_loop import TokenFeed
from memra_cuda.rounds.schedule import MASK32, Schedule

BATCH = 3
ROUND_NS = 20_000  # the bare toy's rounds
WAKE_NS = 6_000  # how late a sleep wakes past what it asked for
OFFSET = 123_456_789  # device clock minus host clock
START = 1000 * 2**32 - OFFSET - 2_000_000  # host clock at the start: the device's stamps wrap 2 ms in
STALL_NS = int(Schedule.STALL_S * 1e9)
HORIZON_NS = 10**9  # a host still waiting this long after the last round would hang: fail instead


class Faulted(Exception):
    """What check() raises for a device that faulted."""


class Device:
    """A device loop of `rounds` rounds publishing into a TokenFeed over plain host memory,
    and the host's clock and sleep, which run it: each call moves the fake time on, then
    publishes every round that has committed by then. `looks` records when the host read the
    head, `sleeps` what it asked to sleep, `checks` when it asked whether the device faulted
    (`fault`: whether that raises). `ends=False`: the loop stops publishing and never ends."""

    def __init__(self, rounds: int, round_ns: int = ROUND_NS, first_ns: int = ROUND_NS, jitter_ns: int = 0,
                 read_ns: int = 0, ends: bool = True, fault: bool = False, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.per_round = rng.integers(0, 5, (rounds, BATCH))
        spans = round_ns + rng.integers(-jitter_ns, jitter_ns + 1, rounds - 1)
        self.commits = START + first_ns + np.concatenate([[0], np.cumsum(spans)])
        self.read_ns, self.ends, self.fault = read_ns, ends, fault
        self.now, self.published = START, 0
        self.looks: list[int] = []
        self.sleeps: list[float] = []
        self.checks: list[int] = []
        cap = int(self.per_round.sum(axis=0).max())
        rows = HEAD_WORDS + BATCH
        # Pinned memory comes uninitialised: whatever lies past a count must never be read.
        words = np.full(rows + 2 * BATCH * cap, 0xDEADBEEF, np.uint32)
        self.head, self.counts = words[:HEAD_WORDS], words[HEAD_WORDS:rows]
        self.tokens = words[rows:rows + BATCH * cap].reshape(BATCH, cap)
        self.stamps = words[rows + BATCH * cap:].reshape(BATCH, cap)
        self.feed = TokenFeed.__new__(TokenFeed)  # __init__ would map device memory
        self.feed.batch, self.feed.cap = BATCH, cap
        self.feed.looks = self.feed.empty_looks = self.feed.launches = 0
        self.feed._views(words)
        self.feed.clear()
        self._read_head, self.feed.head = self.feed.head, self._look

    def _look(self) -> list[int]:
        self.looks.append(self.now)
        return self._read_head()

    def clock(self) -> int:
        self.now += self.read_ns
        self._publish()
        return self.now

    def sleep(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("sleep length must be non-negative")  # as time.sleep
        self.sleeps.append(seconds)
        self.now += round(seconds * 1e9) + WAKE_NS
        assert self.now - self.commits[-1] < HORIZON_NS, "the host is still waiting a second after the last round"
        self._publish()

    def check(self) -> None:
        self.checks.append(self.now)
        if self.fault:
            raise Faulted

    def schedule(self, **kwargs) -> Schedule:
        """A Schedule on this device's clock and sleep that leaves the thread's timer slack
        alone (no prctl; kwargs: spin, look_s)."""
        return Schedule(self.clock, self.sleep, slack=contextlib.nullcontext, **kwargs)

    def follow(self, **kwargs):
        """The feed's follow() on this device's clock (kwargs: spin, look_s)."""
        return self.feed.follow(self.schedule(**kwargs), check=self.check)

    def _publish(self) -> None:
        while self.published < len(self.commits) and self.commits[self.published] <= self.now:
            stamp = (int(self.commits[self.published]) + OFFSET) & MASK32
            for b, n in enumerate(self.per_round[self.published].tolist()):
                start = int(self.counts[b])
                self.tokens[b, start:start + n] = token_ids(b, start, start + n)
                self.stamps[b, start:start + n] = stamp
                self.counts[b] = start + n
            self.head[HEAD_STAMP] = stamp
            self.head[HEAD_SEQ] += 1
            self.published += 1
            if self.ends and self.published == len(self.commits):
                self.head[HEAD_ENDED] = 1

    def published_rows(self) -> list[tuple[list[int], list[int]]]:
        """Each row's tokens as published, and their stamps (from the rounds, not the memory)."""
        stamps = (self.commits + OFFSET) & MASK32
        return [(token_ids(b, 0, int(self.per_round[:, b].sum())).tolist(),
                 np.repeat(stamps, self.per_round[:, b]).tolist()) for b in range(BATCH)]

    def delays(self, landed, after_round: int = 0) -> np.ndarray:
        """Each token's delay (ns) from its publish to the look that took it, for the tokens
        of the rounds from `after_round` on."""
        since = (int(self.commits[after_round]) + OFFSET) & MASK32
        found = []
        for piece in landed:
            stamps = np.concatenate(piece.stamps).astype(np.int64)
            stamps = stamps[(stamps - since) % 2**32 < 2**31]  # published at or after `since`
            found.append((piece.seen_ns + OFFSET - stamps) % 2**32)
        return np.concatenate(found)

    def steady_gap(self, after_round: int = 10) -> float:
        """The median time between looks once rounds flow (from round `after_round` on)."""
        looks = np.array(self.looks)
        return float(np.median(np.diff(looks[looks >= self.commits[after_round]])))


def token_ids(row: int, start: int, end: int) -> np.ndarray:
    return (row + 1) << 20 | np.arange(start, end)  # distinct in every row


def test_every_token_is_yielded_once_in_order_with_its_stamp():
    """Rounds of uneven lengths, and clock reads that cost a µs, so a publish can land between
    the host's read of the head and of the counts (counts ahead of the head): each row's tokens
    arrive whole, once and in order, stamped with their round's stamp (which wraps past 2^32
    here), no look yields an empty batch, and follow() returns at the look that finds the loop
    ended, with its last tokens, the only batch taken after the end."""
    device = Device(400, jitter_ns=5_000, read_ns=1_000)
    landed = list(device.follow())
    published = device.published_rows()
    for b, (tokens, stamps) in enumerate(published):
        assert np.concatenate([piece.tokens[b] for piece in landed]).tolist() == tokens
        assert np.concatenate([piece.stamps[b] for piece in landed]).tolist() == stamps
    assert published[0][1][-1] < published[0][1][0], "the stamps did not wrap"
    assert all(piece.total == piece.counts.sum() > 0 for piece in landed)
    assert all(piece.counts.tolist() == [len(row) for row in piece.tokens] for piece in landed)
    assert [piece.running for piece in landed] == [True] * (len(landed) - 1) + [False]
    assert device.looks[-2] < device.commits[-1] <= device.looks[-1]
    assert device.feed.looks == len(device.looks) and not device.checks
    assert [row.tolist() for row in device.feed.tokens()] == [tokens for tokens, _ in published]


def test_a_landed_answers_until_the_feed_is_cleared_for_the_next_launch():
    """A Landed copies its tokens out of the feed when first asked: after the feed's next
    launch it refuses rather than answer with another request's tokens, and what it copied
    before stays its own."""
    device = Device(20)
    landed = list(device.follow())
    kept = landed[0].tokens
    device.feed.clear()  # the next launch
    with pytest.raises(ValueError, match="earlier launch"):
        landed[-1].stamps
    assert landed[0].tokens is kept
    for row, (tokens, _) in zip(kept, device.published_rows()):
        assert row.tolist() == tokens[:row.size]


@pytest.mark.parametrize("what", ["token", "Tokens", "counts", None, 0])
def test_a_feeds_rows_are_its_tokens_or_its_stamps_and_nothing_else(what):
    """TokenFeed.rows(what, ...) read the stamps for any `what` but "tokens": "token" handed the
    stamps out as tokens, silently. Refused naming the two it holds; each of those is as published."""
    device = Device(20)
    list(device.follow())
    feed, ends = device.feed, device.feed.seen
    with pytest.raises(ValueError, match=rf"^what must be one of \('tokens', 'stamps'\) \(a token feed's rows\), "
                                         rf"not {re.escape(repr(what))}$"):
        feed.rows(what, feed.launches, [0] * BATCH, ends)
    for b, (tokens, stamps) in enumerate(device.published_rows()):
        assert feed.rows("tokens", feed.launches, [0] * BATCH, ends)[b].tolist() == tokens
        assert feed.rows("stamps", feed.launches, [0] * BATCH, ends)[b].tolist() == stamps


def test_rounds_of_20us_are_seen_within_a_round_plus_20us_looking_every_three_rounds():
    """The default look_s (60 µs) over rounds of 20 µs: a look every three rounds (once the
    rounds are timed, exactly look_s apart here), nearly all of them finding tokens, and the
    median token seen within one round plus 20 µs of its commit."""
    device = Device(300)
    landed = list(device.follow(look_s=60e-6))
    assert np.median(device.delays(landed)) <= ROUND_NS + 20_000
    assert 0.28 <= device.feed.looks / 300 <= 0.4
    assert 60_000 <= device.steady_gap() < 60_000 + ROUND_NS
    assert device.feed.empty_looks <= 0.1 * device.feed.looks
    assert not device.checks, "asked about a fault while rounds flowed"


def test_a_long_first_round_is_waited_for_with_backoff_and_later_rounds_are_seen_early():
    """A first round of 1 ms: the host backs off (a look every 10 µs would be ~60 looks), and
    once rounds flow, the late first sighting does not keep the later looks late: past the
    first 10 rounds the median token is seen within a round plus 20 µs. (At rounds this short
    the head's newest stamp is at most a round old when first seen; the millisecond rounds
    below are where the first publishes are seen hundreds of µs late.)"""
    device = Device(300, first_ns=1_000_000)
    landed = list(device.follow(look_s=60e-6))
    assert sum(look < device.commits[0] for look in device.looks) < 20
    assert np.median(device.delays(landed, after_round=10)) <= ROUND_NS + 20_000
    assert not device.checks


def test_after_a_first_publish_seen_late_looks_at_millisecond_rounds_converge_on_the_commits():
    """Rounds of 1 ms (a real model) after a first round of 5.7 ms: the host's backoff sees the
    first publish (and, before the rounds are timed, the second) hundreds of µs late, so its
    delay says little of the clocks' offset. The looks move earlier until one comes before a
    commit, and the one a retry after it sets the offset: then a look about once a round, each
    token seen within 20 µs (past the first 10 rounds)."""
    device = Device(100, round_ns=1_000_000, first_ns=5_700_000)
    landed = list(device.follow(look_s=60e-6))
    assert device.delays(landed).max() > 300_000, "the first publishes were not seen late"
    assert np.median(device.delays(landed, after_round=10)) <= 20_000
    assert device.steady_gap() == 1_000_000
    assert device.feed.looks <= 1.5 * 100


def test_after_a_long_first_round_the_looks_are_still_look_s_apart():
    """After a long first round the host sees the first publish from a backoff look, not from
    one a retry after an empty look, so it aims by the smallest delay seen less a creep that
    grows to half a round. Aimed early at a round two or more ahead, a look finds the round
    before it, not nothing: it must still count as early, or the host takes that round for its
    aim and looks every ahead - 1 rounds, more often than look_s (it did, before this test)."""
    device = Device(300, first_ns=1_000_000)
    list(device.follow(look_s=60e-6))
    assert device.steady_gap() >= 60_000


def test_a_longer_look_s_looks_less_often_and_sees_tokens_later():
    """look_s = 150 µs over rounds of 20 µs: a look every eight rounds (150 µs rounded up to
    whole rounds), and tokens wait longer than at the default, about half a look's span."""
    device = Device(300)
    landed = list(device.follow(look_s=150e-6))
    assert 150_000 <= device.steady_gap() < 150_000 + ROUND_NS
    assert 1 / 10 <= device.feed.looks / 300 <= 1 / 6
    assert ROUND_NS + 20_000 < np.median(device.delays(landed)) <= 75_000 + ROUND_NS + 20_000


def test_spin_looks_again_at_once():
    """spin=True never asks to sleep (each look costs only the sleep(0)'s own WAKE_NS here), so
    every token is seen at the first look after its publish."""
    device = Device(100)
    landed = list(device.follow(spin=True))
    assert set(device.sleeps) == {0}
    assert device.delays(landed).max() <= WAKE_NS


def test_a_device_that_stops_publishing_is_asked_about_and_its_fault_raises():
    """A loop that faults never sets HEAD_ENDED: after STALL_S with nothing published, check()
    is called, and what it raises ends follow() instead of the host waiting forever; every
    token published before the fault was yielded first."""
    device = Device(50, ends=False, fault=True)
    taken = []
    with pytest.raises(Faulted):
        for piece in device.follow():
            taken.append(piece)
    assert len(device.checks) == 1
    assert STALL_NS < device.checks[0] - taken[-1].seen_ns <= STALL_NS + 100_000
    for b, (tokens, _) in enumerate(device.published_rows()):
        assert np.concatenate([piece.tokens[b] for piece in taken]).tolist() == tokens


def test_a_slow_healthy_device_is_asked_about_every_stall_s_and_followed_to_the_end():
    """A first round of 25 ms on a device that did not fault: check() is called once per STALL_S
    without a publish (within the longest backoff, 1 ms, of it), and the tokens still arrive."""
    device = Device(20, first_ns=25_000_000)
    landed = list(device.follow())
    assert len(device.checks) == 2
    spans = np.diff([START, *device.checks])
    assert np.all((spans > STALL_NS) & (spans <= STALL_NS + 1_100_000))
    assert sum(piece.total for piece in landed) == device.per_round.sum()
    waits = np.diff([look for look in device.looks if look < device.commits[0]])
    assert waits.max() <= 1_000_000 + WAKE_NS, "the backoff is capped at 1 ms"


def test_the_timer_slack_is_fine_while_following_and_restored_after():
    """Linux sleeps the thread's timer slack (50 µs by default) past what was asked: while the
    host follows, 1 µs; after, what it was, also for a follow() closed before its end."""
    prctl = schedule._prctl()
    if prctl is None:
        pytest.skip("no prctl here (not Linux)")
    before = prctl(30, 0, 0, 0, 0)  # PR_GET_TIMERSLACK
    device = Device(20)
    following = device.feed.follow(Schedule(device.clock, device.sleep))  # the default slack: fine_timer
    next(following)
    assert prctl(30, 0, 0, 0, 0) == 1000
    following.close()
    assert prctl(30, 0, 0, 0, 0) == before


@pytest.mark.parametrize("m_rounds, paced, lengths", [
    (16, True, [16, 4, 1]), (64, True, [64, 16, 4, 1]), (16, False, [16, 1]), (2, True, [2, 1]),
    (1, True, [1]), (1, False, [1])])
def test_device_mode_passes_are_m_then_powers_of_four_then_one(m_rounds, paced, lengths):
    """The loops of one launch: M-round passes, then (paced) every power of four below M, then
    single rounds, which end a generation the cap cuts inside a longer pass."""
    assert pace.pass_lengths(m_rounds, paced) == lengths


def test_a_schedule_kept_across_follows_starts_each_anew():
    """A DeviceLoop keeps one Schedule for all its launches: what it learnt of one launch's
    rounds (their length, the clocks' offset, the publishes seen) must not steer the next, whose
    looks are those of a fresh Schedule."""
    first, again, fresh = Device(300, round_ns=50_000), Device(300), Device(300)
    kept = first.schedule()
    list(first.feed.follow(kept, check=first.check))
    kept.clock, kept.sleep = again.clock, again.sleep
    landed = list(again.feed.follow(kept, check=again.check))
    list(fresh.follow())
    assert again.looks == fresh.looks and again.sleeps == fresh.sleeps
    assert sum(piece.total for piece in landed) == again.per_round.sum()


def test_a_schedules_clock_sleep_and_slack_are_callables_checked_when_it_is_made():
    """Schedule(clock=None) was taken, and failed only as a follow began (begin() called it)."""
    for name in ("clock", "sleep", "slack"):
        for given in (None, 5, "time.sleep"):
            with pytest.raises(TypeError, match=rf"^a schedule's {name} must be callable, not {given!r}$"):
                Schedule(**{name: given})


def test_look_s_is_a_number_of_seconds_from_0_to_a_second_checked_as_it_is_set():
    """Schedule(look_s=...) and `schedule.look_s = ...` (as docs/device-mode.md sets it) take a
    number of seconds from 0 to LOOK_MOST_S, a second: a NaN met int() as a follow began, a
    string a multiplication's TypeError, and a negative value, or one past the 2.1 s that the
    device's 32-bit ns stamps time a wait by, looked every retry, silently. A refused value
    leaves the schedule as it was."""
    most = 1.0
    for look in (np.nextafter(0.0, -1.0), -60e-6, np.nextafter(most, 2.0), 2.2, float("nan"), float("inf"),
                 float("-inf")):
        with pytest.raises(ValueError, match=r"^look_s must be a number of seconds from 0 to 1\.0 .*, not "):
            Schedule(look_s=look)
    with pytest.raises(ValueError, match=r"^look_s must be a finite number"):
        Schedule(look_s=10**400)  # no float holds it
    kept = Schedule()
    for look in ("60e-6", None, True, np.bool_(False), 1j):
        with pytest.raises(TypeError, match=r"^look_s must be a real number, not "):
            Schedule(look_s=look)
        with pytest.raises(TypeError, match=r"^look_s must be a real number, not "):
            kept.look_s = look
    with pytest.raises(ValueError, match="look_s must be"):
        kept.look_s = -1.0
    assert kept.look_s == Schedule.LOOK_S
    assert Schedule.LOOK_MOST_S == most
    for look in (0, 0.0, most, np.float32(150e-6), 60e-6):
        assert Schedule(look_s=look).look_s == look
    device = Device(40)
    list(device.follow(look_s=most))  # at the limit, the look after the first rounds comes a second later
    assert np.diff(device.looks).max() >= most * 1e9

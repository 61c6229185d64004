"""When the host looks at a running device loop's token feed (docs/device-mode.md, "How the host
waits"): the schedule, an object given the host's clock and sleep.

The host sleeps between looks, at the moments rounds are due to commit. Given its clock and
sleep rather than reading the module's, the schedule runs as well on a fake clock beside a
simulated device (tests/rounds/test_follow.py), where a GPU run could only show it through
timings that vary with the machine; a server may give it its own.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
import time
from collections.abc import Callable, Iterator

from ..driver.values import as_flag, as_real

MASK32 = 2**32 - 1  # the device's stamps are the low 32 bits of its %globaltimer (ns)


def _signed(ns: int) -> int:
    """A difference of two low-32-bit nanosecond times, as the signed span it stands for."""
    return (ns + 2**31) % 2**32 - 2**31


@contextlib.contextmanager
def fine_timer() -> Iterator[None]:
    """Linux sleeps at least the thread's timer slack (50 µs by default) past what was asked:
    while the host follows a loop, 1 µs, then what it was."""
    prctl = _prctl()
    if prctl is None:
        yield
        return
    before = prctl(30, 0, 0, 0, 0)  # PR_GET_TIMERSLACK
    prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, ns
    try:
        yield
    finally:
        prctl(29, before, 0, 0, 0)


@functools.cache
def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.restype = ctypes.c_long
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return prctl


class Schedule:
    """When TokenFeed.follow looks at the feed next, learnt from what its looks found.

    The head's stamp is device time, the host's clock another: the delay a look sees (seen -
    stamp) is their offset plus the look's lateness; the stamps of two looks over the publishes
    between them give a round. The host sleeps until the first round due `look_s` or more after
    the last publish it saw, less EARLY_S, aiming by the delay of a look that came a retry after
    an early one (one that found nothing, or not yet the publish it was aimed at: late by at most
    a retry), and before one has, by the smallest delay seen less a growing margin. With `spin`
    it looks again at once (sleeping 0 s, which yields the GIL).

    `clock` gives the host's time in ns (its low 32 bits are compared with the stamps), `sleep`
    sleeps for seconds, and `slack` is entered while a follow runs (on Linux: the thread's timer
    slack lowered to 1 µs), each callable (TypeError naming it: None failed only at begin()).
    begin() starts each follow anew.

    `look_s` is checked where it is set (here, or `schedule.look_s = ...` later): a real number
    from 0 (a look a retry after each) to LOOK_MOST_S, TypeError or ValueError naming it.
    """

    # The host aims LOOK_S or more past the last publish it saw: on the H200's host a look costs
    # 6-15 µs of CPU (its sleep alone ~5 µs), so looks every three rounds of the bare toy hold the
    # delay near a round and cost a sixth to a third of a core; every 150 µs, a tenth to a fifth
    # (benchmarks/RESULTS.md, "Device mode's host"). It wakes EARLY_S before the commit for the sleep's own lateness; a
    # look that comes early looks again RETRY_S later (before the first round is timed, twice as
    # late each time, up to 1 ms).
    LOOK_S = 60e-6
    EARLY_S = 5e-6
    RETRY_S = 10e-6
    STALL_S = 10e-3  # nothing landed for this long: ask whether the device faulted
    # The looks are aimed by the device's stamps, the low 32 bits of its ns clock, so a wait is
    # a signed 32-bit span (2.1 s): a look_s past it wrapped to a look every retry.
    LOOK_MOST_S = 1.0

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns, sleep: Callable[[float], object] = time.sleep,
                 *, look_s: float = LOOK_S, spin: bool = False,
                 slack: Callable[[], contextlib.AbstractContextManager[object]] = fine_timer):
        for name, given in (("clock", clock), ("sleep", sleep), ("slack", slack)):
            if not callable(given):  # else a follow's first use of it failed, not the schedule's making
                raise TypeError(f"a schedule's {name} must be callable, not {given!r}")
        self.clock, self.sleep, self.slack = clock, sleep, slack
        self.look_s, self.spin = look_s, as_flag(spin, "spin")
        self._start(0)

    @property
    def look_s(self) -> float:
        """How long past the last publish seen the host looks next, at least (seconds)."""
        return self._look_s

    @look_s.setter
    def look_s(self, value: float) -> None:
        # Checked as it is set, not as a follow begins: a NaN or an infinity met int() there, a
        # string a multiplication's TypeError, and a negative value looked every retry.
        look_s = as_real(value, "look_s")
        if not 0 <= look_s <= self.LOOK_MOST_S:
            raise ValueError(f"look_s must be a number of seconds from 0 to {self.LOOK_MOST_S} (the device's "
                             f"32-bit ns stamps time a wait of at most 2.1 s), not {value!r}")
        self._look_s = look_s

    def begin(self) -> None:
        """A new follow: nothing seen yet, no round timed, the stall counted from now."""
        self._start(self.clock())

    def _start(self, now: int) -> None:
        self.publishes = 0  # the publishes seen (the head's count at the last look that found any)
        self._stamp = 0  # the newest publish's stamp seen
        self._round_ns = 0  # a round, from the stamps of two looks (0: not timed yet)
        self._lag_ns: int | None = None  # host time less stamp, to aim by
        self._retry_s = self.RETRY_S  # the wait after an empty look
        # prompt: the next look comes a short retry after one that came before the publish it
        # was aimed at (aimed: that publish's number); trusted: a prompt look has set the lag to
        # aim by; creep: how much earlier than that lag to aim until one has.
        self._prompt = self._trusted = False
        self._creep = self._aimed = 0
        self._landed_ns = now  # when a look last found a publish (or the follow began)
        self._wait_s = 0.0  # until the next look
        # In ns, as the looks compare them: read once a follow, as look_s was its argument.
        self._look_ns, self._early_ns = int(self.look_s * 1e9), int(self.EARLY_S * 1e9)
        self._stall_ns = int(self.STALL_S * 1e9)

    def early(self, check: Callable[[], object] | None = None) -> None:
        """A look found no new publish: look again soon (backing off while no round is timed);
        `check` (raising if the device faulted) is called whenever nothing has landed for
        STALL_S, as a loop that faulted never publishes again."""
        self._prompt = self._retry_s <= self.RETRY_S
        self._wait_s = self._retry_s
        self._retry_s = self.RETRY_S if self._round_ns else min(2 * self._retry_s, 1e-3)
        if check is not None and self.clock() - self._landed_ns > self._stall_ns:
            check()
            self._landed_ns = self.clock()

    def found(self, publishes: int, stamp: int, seen_ns: int) -> None:
        """A look at `seen_ns` (host time) found `publishes` publishes in all, the newest stamped
        `stamp`: time the rounds, learn the clocks' offset, and aim the next look."""
        self._retry_s = self.RETRY_S
        self._landed_ns = seen_ns
        lag = (seen_ns - stamp) & MASK32
        if self.publishes and publishes > self.publishes:
            self._round_ns = max(_signed(stamp - self._stamp) // (publishes - self.publishes), 0)
        self.publishes, self._stamp = publishes, stamp
        round_ns = self._round_ns
        # The delay a look sees is the offset of the clocks plus how late it came. A look a retry
        # after an early one came within a retry of the publish: its delay is the one to aim by.
        # Until one has, each look aims earlier (by a sixteenth of a round, doubling), so a first
        # publish seen late after a long backoff does not keep every later look as late.
        if self._prompt:
            lag_ns, self._trusted, self._creep = lag, True, 0
        else:
            lag_ns = lag if self._lag_ns is None or _signed(lag - self._lag_ns) < 0 else self._lag_ns
            if not self._trusted and round_ns:
                self._creep = min(max(2 * self._creep, round_ns // 16), round_ns // 2)
        self._lag_ns = lag_ns
        # A look that came before the publish it was aimed at (it found the one before) looks
        # again a retry later, and that look's delay is trusted: else a host aiming early would
        # take each early look's publish for its aim and look every ahead - 1 rounds, more often
        # than look_s.
        self._prompt = publishes < self._aimed
        if self._prompt:
            self._wait_s = self.RETRY_S
        else:
            ahead = -(-self._look_ns // round_ns) if round_ns else 1
            due = stamp + lag_ns - self._creep + ahead * round_ns - self._early_ns  # host time, low 32 bits
            self._wait_s, self._aimed = _signed(due - self.clock()) * 1e-9, publishes + ahead

    def wait(self) -> None:
        """Sleep until the next look (never less than a retry, unless spinning)."""
        self.sleep(0 if self.spin else max(self._wait_s, self.RETRY_S))

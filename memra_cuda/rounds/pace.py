"""Pacing: how many rounds the next burst runs, on the host and inside a device loop.

A burst past every stop still runs all its rounds (to no effect), and a round of a real model
costs far more than a readback, so the last burst of a request should be no longer than the
request needs; where a round costs less than a readback, a short burst more costs more than
the rounds a cut saves, and pacing is turned off.
"""
from __future__ import annotations

import math
import reprlib

import numpy as np

from ..buffers.geometry import as_rounds
from ..driver.values import as_flag, as_real, exact_array


# A burst queued behind one in flight, while some live row's rate is still `rate`'s guess (it has
# run no burst whole: a generation's first readback is not in), runs this share of the rounds the
# rows are expected to need after it (1 / AHEAD), unless they are expected to need two whole bursts
# more: the rounds it runs past a row's end are lost, while all it must do is keep the GPU busy as
# the host reads the one in flight back; the next is sized on what that one saw. A simulation of a
# B = 1 request (128 tokens at 3.9 and 6.5 a round with the guess right on average, rounds of 0.72
# and 0.98 ms, a turn-around of 0.3 to 1 ms) gave overlap 5-6% less wall than the whole need queued
# ahead (the headline's overlap rows measure it); once a row's rate is its own, the whole need.
AHEAD = 4


class Pace:
    """How many rounds the next burst of a generation runs.

    Each live row is expected to need its budget left over the tokens a round has committed
    for it so far (before its first readback, `rate`: the tokens a round its decoder's last
    generation made, RoundStream.rate, or one, fewer than which no round commits), and the burst
    runs the most any row needs, rounded down to a power of two (so a stream captures at most
    log2(M) graphs more), at most M. A burst that falls short costs one short burst more; a
    row that stops at an EOS cannot be foreseen. With `cut` False every burst runs M rounds.
    A burst queued behind one in flight (overlap mode) counts that one's expected tokens (so
    without `rate` it ran a whole M past a request that needed a few rounds more), and, while
    some live row's rate is still the guess, runs a share of what the rows then need (AHEAD),
    where that is under two whole bursts.

    With `skips` (a burst graph that skips the model's work of a round once every row is done:
    rounds.gate), a round past the end costs a few small kernels, far less than a readback, so
    a burst covers what the rows are expected to need: it runs the need rounded up to a power of
    two (at most M), and one queued ahead runs the whole need.

    Each argument is checked here (TypeError or ValueError naming it): budgets are ints (2.7
    was truncated to 2, "5" read as 5), one a row (a list or a 1-D array: [[5, 6]] was flattened
    into two rows, a bare 5 read as one) and none negative (the device's "unlimited", which paced
    a row as needing one round), M an int of at least 1 (0 made every burst 0 rounds) and at most
    the most any geometry takes (buffers.geometry.as_rounds: MAX_RING, a ring row's tokens at
    k = 0; 2**40 was taken, as no burst of a stream can be), `cut` and
    `skips` bools, `rate` a finite number of at least 1.
    """

    def __init__(self, budgets: np.ndarray, m_rounds: int, cut: bool = True, rate: float = 1.0,
                 skips: bool = False):
        try:  # exact_array's refusal names no argument
            self.budgets = exact_array(budgets, np.int64)
        except (TypeError, ValueError) as refusal:
            raise type(refusal)(f"budgets: {refusal}") from None
        if np.ndim(budgets) != 1:
            raise TypeError(f"budgets: one a row, a list or a 1-D array, not {reprlib.repr(budgets)}")
        if self.budgets.size and self.budgets.min() < 0:
            raise ValueError(f"budgets: a row's tokens to commit, at least 0, not {reprlib.repr(budgets)}")
        self.m_rounds, self.cut = as_rounds(m_rounds), as_flag(cut, "cut")
        self.skips = as_flag(skips, "skips")
        self.rate = as_real(rate, "rate")
        if not (math.isfinite(self.rate) and self.rate >= 1.0):
            raise ValueError(f"rate is the tokens a round commits, at least 1 and finite, not {rate!r}")
        self.generated = np.zeros_like(self.budgets)
        self._rounds = np.zeros_like(self.budgets)  # rounds each row ran live, start to end
        self._leanest = np.ones(self.budgets.shape)  # fewest tokens per round one of its bursts gave
        self._whole = 0  # tokens of the bursts the rows ran whole (live throughout), in all

    @staticmethod
    def lengths(m_rounds: int) -> list[int]:
        """Every burst length rounds() may ask for: the powers of two below M, and M (an int of
        at least 1 and at most a geometry's most, as_rounds' refusals naming it)."""
        m_rounds = as_rounds(m_rounds)
        return [1 << i for i in range(m_rounds.bit_length()) if 1 << i < m_rounds] + [m_rounds]

    def rounds(self, live: np.ndarray, in_flight: int = 0) -> int:
        """Rounds for the next burst of the `live` rows, queued behind `in_flight` rounds whose
        tokens the host has not seen yet (on a guessed rate, a share of the need: AHEAD)."""
        if not self.cut:
            return self.m_rounds
        rate = np.where(self._rounds > 0, self.generated / np.maximum(self._rounds, 1), self.rate)
        left = (self.budgets - self.generated - rate * in_flight)[live]
        # A row that has committed nothing in the rounds it ran gives no rate to divide by: it
        # may need any number of rounds, so it gets the whole M.
        need = np.divide(left, rate[live], out=np.full(left.shape, np.inf), where=rate[live] > 0).max(initial=1)
        if in_flight and not self.skips and need < 2 * self.m_rounds and bool((self._rounds[live] == 0).any()):
            need /= AHEAD  # queued ahead on a guessed rate: enough to cover the readback (AHEAD)
        if need >= self.m_rounds:
            return self.m_rounds
        rounds = max(int(np.ceil(need)), 1)
        if self.skips:  # rounds past the end cost little: cover the need
            return min(self.m_rounds, 1 << (rounds - 1).bit_length())
        return 1 << (rounds.bit_length() - 1)

    def needed(self, live: np.ndarray, in_flight: int) -> bool:
        """Whether some live row may have budget left after `in_flight` rounds, if they commit
        as few tokens a round as that row's leanest burst so far."""
        return bool(np.any(live & (self.generated + self._leanest * in_flight < self.budgets)))

    def record(self, rounds: int, got: np.ndarray, stayed_live: np.ndarray) -> None:
        """A burst of `rounds` rounds committed `got` tokens per row; `stayed_live` rows ran it
        whole (a row that stopped inside it says nothing of its rate)."""
        rate = got / rounds
        first = stayed_live & (self._rounds == 0)
        self._leanest = np.where(first, rate, np.where(stayed_live, np.minimum(self._leanest, rate), self._leanest))
        self.generated += got
        self._rounds[stayed_live] += rounds
        self._whole += int(np.sum(got, where=stayed_live))

    def observed(self) -> float | None:
        """Tokens a round a row committed over the bursts the rows ran whole (a row's last burst,
        which it stopped inside, says nothing of its rate); None before any: the next
        generation's `rate`."""
        rounds = int(self._rounds.sum())
        return self._whole / rounds if rounds else None


def pass_lengths(m_rounds: int, paced: bool) -> list[int]:
    """The rounds a device loop's pass runs, loop by loop: M while some live row is expected to
    need M rounds more, then (paced) every power of four below it, then one, which also ends a
    generation the round cap cuts inside a longer pass. The tail wastes few rounds, and the long
    middle pays the per-pass cost once per M rounds. M is an int from 1 to a geometry's most
    (as_rounds) and `paced` a bool (0 gave a pass of 0 rounds)."""
    m_rounds, paced = as_rounds(m_rounds), as_flag(paced, "paced")
    lengths = [m_rounds]
    if paced:
        lengths += [4**i for i in range((m_rounds - 1).bit_length() // 2, 0, -1) if 4**i < m_rounds]
    return lengths + [1] if m_rounds > 1 else lengths

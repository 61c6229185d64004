"""The capacity rule: how far the rounds a host queues may write into the KV caches.

A round writes k+1 entries past a row's position (a tree round its T+1 slots: the round's
`width`) before rollback takes back the rejected ones, and the host knows the positions only as
of its last readback, so every check is a bound: a live row may write a whole burst of rounds
past its known position, plus whatever the rounds still in flight may have added, and a row may
sit out rounds done at its final position while others finish, writing its scratch entries
there. The rule is written once, here, in numpy alone, for each way rounds are queued: a burst,
a burst behind another one in flight (overlap), and a device loop's whole budget; kv_capacity
sizes a cache by the same rule.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..driver.values import I32_MOST, as_flag, as_listed, as_size
from ..driver.errors import MemraError
from .geometry import Geometry, as_geometry


class CapacityError(MemraError, ValueError):
    """A KV cache cannot hold the entries the next burst (or device loop) may append."""


class Unchecked:
    """The capacity of a rollback table whose KV capacity the caller chose not to give: asked
    for by name (`capacity=UNCHECKED`), never by omission."""

    def __repr__(self) -> str:
        return "UNCHECKED"


UNCHECKED = Unchecked()


def kv_entries(capacity: Any, what: str = "capacity") -> int | Unchecked | None:
    """A stated KV capacity: a positive number of entries, None (no KV named) or UNCHECKED, else
    ValueError (TypeError for what is not a number) naming it as `what`; where a table or a
    pipeline's other stages say how far a burst may go."""
    if capacity is None or capacity is UNCHECKED:
        return capacity
    return as_size(capacity, what, also="None, UNCHECKED")


_NO_ROWS = np.zeros(0, np.int64)


@dataclass(frozen=True, init=False)
class Capacity:
    """The room of a round's caches: `entries`, the fewest KV entries any cache behind the
    round holds per row (None: nothing to check), for rounds of `geometry`: each advances a row
    at most k+1 positions and writes `width` entries past it (a chain: k+1; a tree: its T+1
    slots), over `batch` rows in bursts of at most `m_rounds`.

    A live row needs room for (rounds-1)·(k+1) + width entries past its position, plus k+1 more
    in a batch (a round it may sit out done at its final position while other rows finish); a
    done row needs the `width` scratch entries at its frozen position. `ahead` is how many rounds
    queued before this burst the host has not seen yet: they may have moved every row that far.
    """

    entries: int | None
    geometry: Geometry

    def __init__(self, entries: int | None, geometry: Geometry):
        """Each field checked (entries a positive number or None; a Geometry, checked as it was built)."""
        object.__setattr__(self, "entries", None if entries is None else as_size(entries, "entries"))
        object.__setattr__(self, "geometry", as_geometry(geometry))

    @classmethod
    def of(cls, capacities: Sequence[int | Unchecked | None], geometry: Geometry) -> Capacity:
        """The rule for caches of the given capacities (None and UNCHECKED say nothing). Each is
        checked as kv_entries checks one, the error naming its place ("capacities[2]"), before
        the fewest is taken (min() of a string and an int raised a TypeError naming neither). They
        are counted ones, a list, a tuple or a 1-D array (as_listed, else a TypeError naming
        `capacities`): one capacity where the many are asked for (iterating an int raised "'int'
        object is not iterable", and a string's characters would be read as numbers), a mapping,
        whose keys were read as the capacities ({64: "draft"} was 64), a 0-d array (its
        iteration's TypeError named nothing) and an iterator are refused: the fewest is taken of
        them all, so an iterator was read to its end, and one that never ends
        (itertools.repeat(5)) never returned; no count of caches bounds them (a round's are its
        tables' and stages', each a capacity), and a round gives them counted, as a tuple."""
        capacities = as_listed(capacities, "capacities", "KV capacities (each a positive int, None or UNCHECKED)")
        stated = [kv_entries(c, f"capacities[{i}]") for i, c in enumerate(capacities)]
        known = [c for c in stated if isinstance(c, int)]
        return cls(min(known) if known else None, geometry)

    @property
    def _live(self) -> int:
        """Past the furthest start of a burst's last round: its writes, and in a batch the k+1
        it may move more before sitting a round out there."""
        g = self.geometry
        return g.width + (g.k + 1 if g.batch > 1 else 0)

    def burst_reach(self, positions: np.ndarray, done: np.ndarray, rounds: int, ahead: int = 0) -> np.ndarray:
        """Per row, the furthest entry a burst of `rounds` rounds may write, behind `ahead`
        unseen rounds."""
        k1, width = self.geometry.k + 1, self.geometry.width
        return positions + ahead * k1 + np.where(done, width, (rounds - 1) * k1 + self._live)

    def burst_short(self, positions: np.ndarray, done: np.ndarray, rounds: int, ahead: int = 0) -> np.ndarray:
        """The rows a burst of `rounds` rounds (behind `ahead` unseen ones) would overrun. No row
        reaches past the furthest position plus a live row's burst: one reduction clears the
        common case, and only a burst near the limit looks at every row."""
        if self.entries is None:
            return _NO_ROWS
        if int(positions.max()) + (ahead + rounds - 1) * (self.geometry.k + 1) + self._live <= self.entries:
            return _NO_ROWS
        return np.flatnonzero(self.burst_reach(positions, done, rounds, ahead) > self.entries)

    def check_burst(self, positions: np.ndarray, done: np.ndarray, rounds: int, ahead: int = 0) -> None:
        """CapacityError naming the first row a burst of `rounds` rounds would overrun."""
        short = self.burst_short(positions, done, rounds, ahead)
        if short.size:
            b = int(short[0])
            reach = self.burst_reach(positions, done, rounds, ahead)[b]
            raise CapacityError(
                f"KV cache of {self.entries} entries cannot take the next burst: {rounds} rounds at k={self.geometry.k}"
                f"{f' behind {ahead} unseen' if ahead else ''} may write up to {reach} (row {b} at position "
                f"{positions[b]}): use a larger cache, fewer rounds per burst or a token budget")

    def loop_reach(self, positions: np.ndarray, most: np.ndarray, done: np.ndarray, ahead: int = 0) -> np.ndarray:
        """Per row, the furthest entry a device loop may write for a row that commits at most
        `most` tokens (behind `ahead` unseen rounds): its last round starts at most most - 1 past
        its position and writes `width` entries there; where rows sit out rounds done (a batch,
        or passes of several rounds), the round that stopped it may have kept k+1, and `width`
        scratch entries follow."""
        g = self.geometry
        k1 = g.k + 1
        idle = k1 if g.batch > 1 or g.m_rounds > 1 else 0
        return positions + ahead * k1 + np.where(done, g.width, most - 1 + g.width + idle)

    def check_loop(self, positions: np.ndarray, most: np.ndarray, done: np.ndarray, ahead: int = 0) -> None:
        """CapacityError unless every cache has room for the whole device loop."""
        if self.entries is None:
            return
        reach = self.loop_reach(positions, most, done, ahead)
        short = np.flatnonzero(reach > self.entries)
        if short.size:
            b = int(short[0])
            raise CapacityError(f"KV cache of {self.entries} entries cannot take the device loop: row {b} at "
                                f"position {positions[b]} may write up to {reach[b]} ({most[b]} tokens at "
                                f"k={self.geometry.k}); "
                                "use a larger cache or a smaller budget or max_rounds")


def kv_capacity(prompt_len: int, max_new_tokens: int, geometry: Geometry, *, overlap: bool = False) -> int:
    """KV entries a cache needs (per sequence) so generate() never raises CapacityError for
    this request in rounds of `geometry`: the rule's reach (Capacity.burst_reach) of a burst of M
    rounds, behind one more in flight for "overlap", from position prompt_len + max_new_tokens
    (two past the furthest a live row can start one from). Every size is checked (a prompt holds
    its pending token: at least one), and `overlap` must be a bool, so that a bad one is refused
    by name instead of sizing a cache wrongly."""
    geometry = as_geometry(geometry)
    overlap = as_flag(overlap, "overlap")
    prompt_len, max_new_tokens = as_size(prompt_len, "prompt_len"), as_size(max_new_tokens, "max_new_tokens", 0)
    rule = Capacity(None, geometry)
    m_rounds = rule.geometry.m_rounds
    # Python ints (an object array), not int64: a long prompt and budget cannot wrap to a negative size.
    reach = rule.burst_reach(np.array([prompt_len + max_new_tokens], dtype=object), np.zeros(1, bool), m_rounds,
                             m_rounds if overlap else 0)
    return int(reach[0])


def i32_kv_capacity(prompt_len: int, max_new_tokens: int, geometry: Geometry, *, overlap: bool = False,
                    what: str = "max_new_tokens") -> int:
    """kv_capacity for a cache whose positions are i32s (a KVLayer's length, the toy's): past
    I32_MOST, the most one reaches, a CapacityError naming the budget as `what`, said where the
    size is asked for. The demo's and examples/own_kernels.py's command lines ask it before any
    engine is made: the cache refused the size only once the engine had been made (own_kernels:
    its model compiled and tens of GB asked for). The budget is checked by that name too (an int
    of at least 0), so a command line asks nothing else of it."""
    capacity = kv_capacity(prompt_len, as_size(max_new_tokens, what, 0), geometry, overlap=overlap)
    if capacity > I32_MOST:
        raise CapacityError(f"{what} {max_new_tokens} needs a KV cache of {capacity} entries in rounds of "
                            f"{_rounds(geometry)}{' in overlap' if overlap else ''}, past the {I32_MOST} an i32 "
                            "position reaches")
    return capacity


def _rounds(geometry: Geometry) -> str:
    """`geometry` in a message, by what sizes a cache: k=4, M=16 (docs/capacity.md's rule), and
    B and the width where they count (a batch's k + 1 more; a tree's T + 1 slots, not a chain's
    k + 1), where its repr, Geometry(k=4, m_rounds=16, batch=1, width=5), named every field."""
    batch = f", B={geometry.batch}" if geometry.batch > 1 else ""
    width = "" if geometry.chain else f", width={geometry.width}"
    return f"k={geometry.k}, M={geometry.m_rounds}{batch}{width}"

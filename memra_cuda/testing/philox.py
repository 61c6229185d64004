"""Philox4x32-10 in numpy, and the uniform draw U of docs/sampling.md ("Random numbers").

The numpy twin of ptx/philox.cuh: the sampling reference draws exactly the numbers the kernels
draw, so a kernel's sampled token can be checked, not just its histogram. Philox is counter-based
(Salmon et al., SC'11; Random123, cuRAND): a draw is a pure function of (counter, key), so every
draw is addressed by what it is for (seed, absolute position, vocabulary index, purpose) and no
generator state exists to carry between rounds, bursts or batch slots.

Everything is vectorised: arguments broadcast like numpy arrays. Words are held in uint64 so the
product of two 32-bit words is exact, and masked back to 32 bits.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..driver.values import U64_MOST, hides_bools, host_array, past_int64

MULTIPLIERS = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
WEYL = (np.uint64(0x9E3779B9), np.uint64(0xBB67AE85))  # the key schedule's increments
ROUNDS = 10
_MASK = np.uint64(0xFFFFFFFF)
_32 = np.uint64(32)


WORD_LEAST = -2**63  # a 64-bit word's least int, signed (its most, unsigned, U64_MOST)


def words(values: Any) -> np.ndarray:
    """Integers as uint64, wrapping like a cast to an unsigned 64-bit word (-1 is 2**64 - 1).

    Floats and booleans are refused: a silently truncated float would be a different draw. A
    list or a tuple is looked through for bools too, nested ones as well: numpy reads
    [True, 5] as int64, True as 1. Ints numpy reads as floats or objects, a list's seeds past
    int64 ([2**64 - 1, 5] is float64) or beside a negative one, are read one by one, exactly (such
    a list was refused as "not float64", valid seeds); an int that is no 64-bit word, from -2**63
    to 2**64 - 1 (2**64, a seed one past the most), is a ValueError (it was "not object"), and so
    is a ragged list ([[1, 2], [3]]: numpy's "inhomogeneous shape", naming nothing)."""
    if hides_bools(values):
        raise TypeError(f"Philox counters, keys and seeds are integers, not bools ({values!r})")
    array = host_array(values, "Philox counters, keys and seeds are ints")
    if array.dtype.kind == "O" or (array.dtype.kind == "f" and not isinstance(values, np.ndarray)):
        array = _exact_words(values, array)
    if array.dtype.kind not in "iu":
        raise TypeError(f"Philox counters, keys and seeds are integers, not {array.dtype} ({values!r})")
    return array.astype(np.uint64)


def _exact_words(values: Any, array: np.ndarray) -> np.ndarray:
    """`values`, which numpy read as `array` of floats or objects, as the uint64 words of their
    ints where each is an int, no bool (values.past_int64 of the items: True in an object array,
    which hides_bools does not look into, was word 1); else `array` as numpy read it, for words()
    to refuse by its dtype. The range is checked here: values' exact_int and exact_array bound an
    int by one dtype's range, where a word is of either signedness ([2**63, -1] are two words,
    neither int64's nor uint64's), and refuse a float as a ValueError, where words' is a TypeError."""
    items = np.array(values, dtype=object)  # of one shape: words() refused a ragged list
    if not past_int64(list(items.flat)):
        return array
    outside = [int(v) for v in items.flat if not WORD_LEAST <= int(v) <= U64_MOST]
    if outside:
        raise ValueError(f"Philox counters, keys and seeds are 64-bit words, ints from -2**63 to 2**64 - 1: "
                         f"not {outside[0]}")
    return np.array([int(v) % 2**64 for v in items.flat], np.uint64).reshape(items.shape)


def philox4x32_10(counter: tuple[Any, Any, Any, Any], key: tuple[Any, Any]) -> tuple[np.ndarray, ...]:
    """The four uint32 output words of Philox4x32-10 for `counter` (4 words) under `key` (2 words).

    Each word may be an array; all broadcast together. Words are taken modulo 2**32.
    """
    c0, c1, c2, c3, k0, k1 = (w & _MASK for w in np.broadcast_arrays(*(words(w) for w in (*counter, *key))))
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + WEYL[0]) & _MASK, (k1 + WEYL[1]) & _MASK
        p0, p1 = c0 * MULTIPLIERS[0], c2 * MULTIPLIERS[1]
        c0, c1, c2, c3 = (p1 >> _32) ^ c1 ^ k0, p1 & _MASK, (p0 >> _32) ^ c3 ^ k1, p0 & _MASK
    return tuple(w.astype(np.uint32) for w in (c0, c1, c2, c3))


def uniform_of_word(x0: Any) -> np.ndarray:
    """U of a Philox word x0: ((x0 >> 9) + 0.5) * 2**-23 as float64, exact.

    23 bits, so that U is exact in float32 too and lies in [2**-24, 1 - 2**-24] there as in float64:
    with 24 bits the top cell's centre, 1 - 2**-25, rounds to 1.0 in float32, and a kernel that
    accepts a draft iff U * q < p in float32 would reject one with p = q."""
    return ((words(x0) >> np.uint64(9)).astype(np.float64) + 0.5) * 2.0**-23


def uniform(seed: Any, position: Any, j: Any, purpose: Any, node: Any = 0) -> np.ndarray:
    """U(seed, position, j, purpose, node) = uniform_of_word(x0), x0 the first word of counter
    (j, position, purpose, node) under key (seed & 0xffffffff, seed >> 32). `node` tells apart
    the draws of one position for different nodes of a tree; a chain's draws have node 0.

    U lies in [2**-24, 1 - 2**-24], so -ln U is finite and positive. Positions are taken modulo
    2**32, as the kernels' u32 arithmetic wraps them. Arguments broadcast.
    """
    seed = words(seed)
    return uniform_of_word(philox4x32_10((j, position, purpose, node), (seed & _MASK, seed >> _32))[0])

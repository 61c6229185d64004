"""memra_cuda.testing.philox against Random123's known-answer vectors, and U's formula and range.

The kernels' draws (ptx/philox.cuh) are checked against this module on the GPU, so this module is
pinned to the published generator here: Random123's kat_vectors for philox4x32_10.
"""
from __future__ import annotations

import numpy as np
import pytest

from memra_cuda.testing import philox
from memra_cuda.testing import reference as ref
from memra_cuda.testing.philox import philox4x32_10, uniform, uniform_of_word

# (counter, key, output) from Random123's kat_vectors, philox4x32_10.
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,output", KNOWN_ANSWERS, ids=["zeros", "ones", "pi"])
def test_known_answers(counter, key, output):
    words = philox4x32_10(counter, key)
    assert [w.dtype for w in words] == [np.dtype(np.uint32)] * 4
    assert [int(w) for w in words] == list(output)


def test_vectorised_over_broadcast_arrays_equals_one_call_per_element():
    """All three vectors in one call, each word an array, and a key that broadcasts."""
    counters = np.array([c for c, _, _ in KNOWN_ANSWERS], np.uint64).T
    keys = np.array([k for _, k, _ in KNOWN_ANSWERS], np.uint32).T
    words = philox4x32_10(tuple(counters), tuple(keys))
    assert np.array_equal(np.stack(words, axis=1), np.array([o for _, _, o in KNOWN_ANSWERS], np.uint32))
    lanes = philox4x32_10((np.arange(5), 7, 0, 0), (3, 4))
    assert all(w.shape == (5,) for w in lanes)
    assert [int(lanes[0][i]) for i in range(5)] == [int(philox4x32_10((i, 7, 0, 0), (3, 4))[0]) for i in range(5)]


def test_words_wrap_to_32_bits_and_floats_are_refused():
    assert philox4x32_10((-1, -1, -1, -1), (-1, -1))[0] == 0x408F276D
    assert philox4x32_10((2**32, 2**32, 0, 0), (0, 2**32))[0] == 0x6627E8D5
    with pytest.raises(TypeError):
        philox4x32_10((0.0, 0, 0, 0), (0, 0))


def test_a_bool_inside_a_list_is_refused_as_a_bool_alone_is():
    """words() refuses bools (True would be read as 1, a draw of another counter), inside a list
    or a tuple too, nested or a numpy bool: np.asarray([True, 5]) is int64, which let them
    through. A list of ints is taken as before."""
    for given in ([True, 5], (5, False), [[1, 2], [3, np.True_]], (np.array([1]), np.array([True])), True):
        with pytest.raises(TypeError, match="Philox counters, keys and seeds are integers"):
            philox.words(given)
    assert philox.words([1, -1]).tolist() == [1, 2**64 - 1]
    assert philox.words([[1], [np.uint32(2)]]).tolist() == [[1], [2]]


def test_uniform_is_the_first_word_in_23_bits_centred_in_its_cell():
    # key (0, 0), counter (0, 0, 0, 0): x0 = 0x6627e8d5
    assert uniform(0, 0, 0, 0) == ((0x6627E8D5 >> 9) + 0.5) * 2.0**-23
    # counter (j, position, purpose, 0) and key (seed lo, seed hi)
    seed, position, j, purpose = 0x299F31D0A4093822, 0x85A308D3, 0x243F6A88, 0x13198A2E
    x0 = int(philox4x32_10((j, position, purpose, 0), (seed & 0xFFFFFFFF, seed >> 32))[0])
    assert uniform(seed, position, j, purpose) == ((x0 >> 9) + 0.5) * 2.0**-23 == uniform_of_word(x0)


def test_the_largest_uniform_is_below_one_in_float32_too():
    """The top word gives 1 - 2**-24 exactly, which float32 holds, so U * q < p accepts a draft with
    p = q at every draw. With 24 bits U's top value was 1 - 2**-25, which float32 rounds to 1.0: such
    a draft was rejected (test_reference_sample.TOP_CELL_DRAWS)."""
    top = uniform_of_word(np.uint32(0xFFFFFFFF))
    assert top == 1 - 2.0**-24
    assert np.float32(top) == top and np.float32(top) < 1
    assert uniform_of_word(0) == 2.0**-24


def test_uniform_takes_seed_as_64_bits_and_position_as_32():
    assert uniform(2**64 - 1, 5, 1, 2) == uniform(-1, 5, 1, 2)
    assert uniform(2**63, 5, 1, 2) != uniform(0, 5, 1, 2)
    assert uniform(1 << 32, 5, 1, 2) != uniform(1, 5, 1, 2), "the seed's high word is the key's second word"
    assert uniform(9, -1, 1, 2) == uniform(9, 2**32 - 1, 1, 2)
    assert uniform(9, 2**32 + 3, 1, 2) == uniform(9, 3, 1, 2)


def test_uniform_range_and_cells():
    """Strictly inside (0, 1), so -ln U is finite and positive: float64 on the 2**-23 grid offset by
    half a cell, exact in float32 (the kernels' U), about uniform over 250 000 draws."""
    u = uniform(np.uint64(0x123456789ABCDEF), np.arange(500)[:, None], np.arange(500), 1)
    assert u.dtype == np.float64 and u.shape == (500, 500)
    assert (u >= 2.0**-24).all() and (u <= 1 - 2.0**-24).all()
    cells = u * 2**23 - 0.5
    assert np.array_equal(cells, np.round(cells))
    assert np.array_equal(u.astype(np.float32), u)
    assert abs(u.mean() - 0.5) < 0.003
    assert np.allclose(np.histogram(u, bins=10, range=(0, 1))[0], 25_000, rtol=0.03)


def test_a_list_of_64_bit_seeds_is_read_exactly_and_one_past_them_is_refused():
    """numpy reads [2**64 - 1, 5] (and [2**63, -1]) as float64 and 2**64 as an object: valid seeds
    were refused as "not float64", and a seed one past 2**64 - 1 as "not object", a TypeError. Now
    a list of ints is read one by one, exactly, as each alone is, and an int that is no 64-bit word
    (from -2**63 to 2**64 - 1) is a ValueError saying so; floats and bools are refused as before."""
    assert philox.words([2**64 - 1, 5]).tolist() == [2**64 - 1, 5]
    assert philox.words([[2**63], [-1]]).tolist() == [[2**63], [2**64 - 1]]
    assert uniform([2**64 - 1, 5], 3, 1, 2).tolist() == [uniform(-1, 3, 1, 2), uniform(5, 3, 1, 2)]
    rows = ref.race_scores(np.ones(8), [2**64 - 1, 5], 3, 1)  # a row a seed
    assert np.array_equal(rows, [ref.race_scores(np.ones(8), -1, 3, 1), ref.race_scores(np.ones(8), 5, 3, 1)])
    for past in (2**64, [5, 2**64], -2**63 - 1, [[2**70]]):
        with pytest.raises(ValueError, match="64-bit words, ints from -2\\*\\*63 to 2\\*\\*64 - 1: not "):
            philox.words(past)
    for bad in ([1.5, 2**64], [True, 2**64], [2**64 - 1, 2.0]):
        with pytest.raises(TypeError, match="Philox counters, keys and seeds are integers"):
            philox.words(bad)


def test_a_ragged_list_of_words_is_refused_naming_them():
    """A ragged list of counters, keys or seeds met numpy's own ValueError ("setting an array
    element with a sequence ... inhomogeneous shape"), naming nothing (from uniform and
    race_scores too): a ValueError saying what words are, and that the list is ragged."""
    for ragged in ([[1, 2], [3]], [1, [2]], ([5], [2**64 - 1, 5]), [np.array([1, 2]), np.array([3])]):
        with pytest.raises(ValueError, match=r"^Philox counters, keys and seeds are ints, or lists of them of one "
                                             r"shape \(each row as long as the others\): not a ragged list, "):
            philox.words(ragged)
    with pytest.raises(ValueError, match="not a ragged list"):
        uniform([[1, 2], [3]], 5, 1, 2)
    with pytest.raises(ValueError, match="not a ragged list"):
        ref.race_scores(np.ones(4), 7, [[1], [2, 3]], 1)


def test_a_bool_in_an_array_of_objects_is_refused_as_one_in_a_list_is():
    """An object array's ints are read one by one (values.past_int64, as a list's past int64 are):
    True among them was word 1, as hides_bools looks into lists and tuples, not into an array of
    objects. Its ints alone are read as before."""
    for given in (np.array([True, 5], dtype=object), [np.array([False], dtype=object)]):
        with pytest.raises(TypeError, match="Philox counters, keys and seeds are integers, not object"):
            philox.words(given)
    assert philox.words(np.array([5, 2**64 - 1, -1], dtype=object)).tolist() == [5, 2**64 - 1, 2**64 - 1]
    assert philox.words([np.array([2**63], dtype=object), [np.uint8(3)]]).tolist() == [[2**63], [3]]

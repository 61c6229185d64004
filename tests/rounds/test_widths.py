"""Widths on CPU (memra_cuda.rounds.switch): the widths a round has bodies of, each width's body
(its own or the narrowest wider one), and the costs the chooser is given (None where a width has
no body, so it is never picked)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from memra_cuda.rounds.switch import Widths


def test_each_width_runs_its_own_body_or_the_narrowest_wider_one():
    widths = Widths(6, (4, 0, 6, 1, 4))
    assert widths.widths == (0, 1, 4, 6)
    assert widths.body_of == (0, 1, 2, 2, 2, 3, 3)
    assert Widths(3, (3,)).body_of == (0, 0, 0, 0) and Widths(0, (0,)).body_of == (0,)


def test_the_chooser_is_given_the_costs_of_the_widths_with_bodies_only():
    widths = Widths(4, (0, 2, 4))
    assert widths.costs({0: 1.0, 1: 9.0, 2: 1.3, 4: 1.7}) == [1.0, None, 1.3, None, 1.7]
    with pytest.raises(ValueError, match=r"no measured cost for the width\(s\) \[2\]"):
        widths.costs({0: 1.0, 4: 1.7})


def test_the_measured_costs_map_widths_to_costs_a_list_of_them_refused_by_name():
    """A list or an array of costs (one a width, in order) was read as a mapping: its widths
    looked for among its values, then its costs taken by index, so [1.0, 1.3, 1.6, 1.9] was
    refused as missing width 3's cost, and a set met "'set' object is not subscriptable"."""
    widths = Widths(3, (1, 3))
    for measured in ([1.0, 1.3, 1.6, 1.9], [0.0, 1.0, 2.0, 3.0], np.array([1.0, 1.3, 1.6, 1.9]), {1, 3}):
        with pytest.raises(TypeError, match=r"^measured must map each width to its cost"):
            widths.costs(measured)


@pytest.mark.parametrize(("k", "widths", "error", "message"), [
    (4, (0, 2), ValueError, "must include k = 4"),
    (4, (0, 5), ValueError, "a width must be an int from 0 to 4"),
    (4, (-1, 4), ValueError, "a width must be an int from 0 to 4"),
    (4, (2.0, 4), TypeError, "a width must be an integer"),
    (-1, (0,), ValueError, "k must be an int of at least 0"),
    (2, 2, TypeError, "widths must be a collection of ints from 0 to k"),
    (2, "2", TypeError, "widths must be a collection of ints from 0 to k"),
    (2, bytearray(b"\x00\x02"), TypeError, "widths must be a collection of ints from 0 to k"),
    (2, {0: 1.0, 2: 1.3}, TypeError, "widths must be a collection of ints from 0 to k"),
    (2, (True, 2), TypeError, "a width must be an integer"),
    (2, np.array(2), TypeError, "widths must be a collection of ints from 0 to k"),  # its iteration named nothing
])
def test_widths_outside_0_to_k_or_without_k_are_refused(k, widths, error, message):
    with pytest.raises(error, match=message):
        Widths(k, widths)


def test_widths_are_read_up_to_k_plus_2_so_an_endless_iterator_is_refused_at_the_limit():
    """Widths(3, itertools.repeat(1)) was read for ever, and Widths.beside (SpeculativeLlama's
    widths=) unpacked it for ever, Ctrl-C unheard: at most k + 2 are read now (each of 0..k once,
    and k again, a decoder's k beside its caller's), the most taken, and one more refused."""
    assert Widths(3, (0, 1, 2, 3, 3)).widths == (0, 1, 2, 3)
    assert Widths.beside(3, (0, 1, 2, 3)).widths == (0, 1, 2, 3)
    for make in (lambda: Widths(3, (0, 1, 2, 3, 3, 3)), lambda: Widths.beside(3, (0, 1, 2, 3, 3)),
                 lambda: Widths(3, itertools.repeat(1)), lambda: Widths.beside(3, itertools.repeat(1))):
        with pytest.raises(ValueError, match=r"widths name at most k \+ 2 = 5 widths"):
            make()
    with pytest.raises(TypeError, match="k must be an integer"):
        Widths.beside(3.0, (1,))


@pytest.mark.parametrize("narrower", [3, None, {2: 1.3}, "02", b"\x00", bytearray(b"\x00\x02"),
                                      memoryview(b"\x01")])
def test_a_decoders_narrower_widths_are_checked_as_a_collection_before_k_joins_them(narrower):
    """SpeculativeLlama(widths=...) gives Widths.beside its caller's widths: they were unpacked
    beside k first, so a dict's keys became widths without a word and an int's TypeError named
    no argument ("Value after * must be an iterable")."""
    with pytest.raises(TypeError, match=r"widths must be a collection of ints from 0 to k \(k is added\), not "):
        Widths.beside(4, narrower)


def test_a_decoders_widths_are_its_callers_and_k():
    assert Widths.beside(4, ()).widths == (4,)
    assert Widths.beside(4, (2, 0, 2)).widths == (0, 2, 4)
    assert Widths.beside(4, iter([4, 1])).widths == (1, 4)
    with pytest.raises(ValueError, match="a width must be an int from 0 to 4"):
        Widths.beside(4, (5,))


@pytest.mark.parametrize("kind", [np.uint8, np.uint16, np.uint32, np.int64])
def test_numpy_widths_make_the_same_bodies_as_plain_ints(kind):
    """k was kept as given: Widths(np.uint8(255), (np.uint8(255),)).body_of was () (range(255 + 1)
    in uint8 is empty), where the selector on the device reads one body for each width 0..k."""
    for k, widths in ((255, (255,)), (6, (4, 0, 6, 1)), (0, (0,))):
        given, plain = Widths(kind(k), tuple(kind(width) for width in widths)), Widths(k, widths)
        assert given == plain and type(given.k) is int and {type(width) for width in given.widths} == {int}
        assert given.body_of == plain.body_of and len(given.body_of) == k + 1
    assert Widths(kind(3), np.array([3, 1], kind)).widths == (1, 3)

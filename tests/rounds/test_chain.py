"""memra_cuda.chain, a round's draft chain or verify trunk made of launches: what it is given is
checked when it is made (no driver needed), its launches issued in order."""
from __future__ import annotations

import pytest

from memra_cuda import chain


def test_a_chain_issues_its_launches_in_order():
    issued: list[int] = []
    step = chain([lambda: issued.append(0), lambda: issued.append(1)])
    step()
    step()
    assert issued == [0, 1, 0, 1]


@pytest.mark.parametrize(("given", "message"), [
    (print, "chain takes a list of launches .callables., not <built-in function print>: chain\\(\\[launch\\]\\)"),
    (5, "chain takes a list of launches"),
    ("ab", "chain takes a list of launches"),
    ([print, 5], "chain's launch 1 is not callable: 5"),
])
def test_a_chain_of_what_is_no_list_of_launches_is_refused_when_it_is_made(given, message):
    """chain(fn), one callable where a list is asked, met "'function' object is not iterable";
    a launch that is no callable raised only when the round first issued it."""
    with pytest.raises(TypeError, match=message):
        chain(given)

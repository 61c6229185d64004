"""A round's Geometry (memra_cuda/buffers/geometry.py), on CPU: one value for k, M, B and the width a
round verifies, checked once where it is built, which the buffers, the capacity rule and a tree's
buffers read from it; loose integers where a Geometry is asked for are refused by name."""
from __future__ import annotations

import pytest

from memra_cuda import DynamicTree, Geometry, StreamBufs, TreeShape, kv_capacity
from memra_cuda.buffers import Capacity

NO_ENGINE = object()  # refused only after the geometry is: nothing here reaches an engine


def test_a_chain_verifies_k_plus_one_tokens_and_a_tree_its_nodes():
    chain = Geometry(4, 16, 8)
    assert (chain.k, chain.m_rounds, chain.batch, chain.width) == (4, 16, 8, 5) and chain.chain
    tree = TreeShape.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    shaped = Geometry.of_tree(tree, 8, 2)
    assert (shaped.k, shaped.m_rounds, shaped.batch, shaped.width) == (3, 8, 2, 7) and not shaped.chain
    dynamic = Geometry.of_tree(DynamicTree(depth=2, width=4, branch=2), 4)
    assert (dynamic.k, dynamic.width) == (2, 9)
    assert Geometry(0, 1).width == 1, "k = 0: a round of the pending token alone"
    assert chain.with_rounds(1) == Geometry(4, 1, 8) and chain.with_rounds(16) is not chain


def test_a_geometry_is_one_frozen_value():
    geometry = Geometry(2, 4)
    with pytest.raises(AttributeError):
        geometry.k = 3  # type: ignore[misc]
    assert geometry == Geometry(2, 4, 1, 3) and hash(geometry) == hash(Geometry(2, 4, 1, 3))
    with pytest.raises(ValueError, match="width must be an int of at least 3, not 2"):
        Geometry(2, 4, width=2)  # a round writes at least the k + 1 tokens it may keep
    with pytest.raises(ValueError, match="m_rounds must be an int of at least 1, not 0"):
        chain_of_one_token = Geometry(2, 4)
        chain_of_one_token.with_rounds(0)


def test_loose_integers_where_a_geometry_is_asked_for_are_refused_naming_it():
    """The integers a Geometry replaces, given where one is asked for: refused before anything
    is sized or allocated (a swapped k and M would otherwise size the buffers wrongly)."""
    for make in (lambda: StreamBufs(NO_ENGINE, 4, 16),  # type: ignore[call-arg]
                 lambda: StreamBufs(NO_ENGINE, 4),  # type: ignore[arg-type]
                 lambda: kv_capacity(5, 256, 4, 16),  # type: ignore[arg-type]
                 lambda: Capacity(64, 4)):  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"a round's shape is one memra_cuda\.Geometry\(k, m_rounds, batch=1, "
                                            r"width=None\), not 4 \(0\.3\.0's loose k, M and B are one Geometry|"
                                            r"takes 3 positional arguments but 4 were given"):
            make()
    with pytest.raises(TypeError, match=r"a tree is a TreeShape or a DynamicTree \(memra_cuda\), not \[\[0\]\]"):
        Geometry.of_tree([[0]], 8)  # type: ignore[arg-type]  # a tree's choices, not the tree they make


def test_the_capacity_rule_reads_the_width_from_the_geometry():
    """A tree's round writes its T + 1 slots past the position: the geometry of the tree needs
    more room than a chain of its depth."""
    tree = TreeShape.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    assert kv_capacity(5, 100, Geometry.of_tree(tree, 4)) == kv_capacity(5, 100, Geometry(3, 4)) + 7 - 4
    assert Capacity(64, Geometry.of_tree(tree, 4)).geometry.width == 7

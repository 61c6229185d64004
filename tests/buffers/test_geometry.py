"""A round's Geometry (memra_cuda/buffers/geometry.py), on CPU: one value for k, M, B and the width a
round verifies, checked once where it is built, which the buffers, the capacity rule and a tree's
buffers read from it; loose integers where a Geometry is asked for are refused by name."""
from __future__ import annotations

import pytest

from memra_cuda import DynamicTree, Geometry, StreamBufs, TreeShape, kv_capacity
from memra_cuda.buffers import Capacity
from memra_cuda.buffers.geometry import MAX_K, MAX_RING
from memra_cuda.buffers.layout import MAX_TREE_NODES, RING_TOKENS

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


def test_k_m_and_the_width_are_bounded_by_the_ring_and_the_tree_kernels_at_the_limit_and_one_past():
    """The kernels take k + 1 as an i32 count (and step a warp over k drafts in u32: at k of
    MAX_RING - 1, allowed before, the step wrapped and the kernel never ended), M·(k + 1) (the
    ring's row, RING_TOKENS more words in u32) and a tree's nodes as u32s and shared arrays:
    Geometry(2**61, 4) was built, and kv_capacity of it came back negative (int64 wrapped). Each
    bound holds at its limit and refuses one past it, naming it."""
    assert MAX_RING == 2**32 - 1 - RING_TOKENS and MAX_K == 2**31 - 2
    assert Geometry(MAX_K, 1).width == 2**31 - 1, "k + 1 tokens are an i32 count exactly"
    with pytest.raises(ValueError, match=f"k must be at most {MAX_K} \\(a round's k \\+ 1 tokens are an i32 count on "
                                         f"the device\\), not {MAX_K + 1}"):
        Geometry(MAX_K + 1, 1)
    with pytest.raises(ValueError, match="k must be at most"):  # the warp's u32 step over the drafts wrapped: a hang
        Geometry(MAX_RING - 1, 1)
    with pytest.raises(ValueError, match="k must be at most"):
        Geometry(2**61, 4)
    for k in (0, 3, 1000):
        most = MAX_RING // (k + 1)
        assert Geometry(k, most).m_rounds * (k + 1) <= MAX_RING
        with pytest.raises(ValueError, match=f"m_rounds must be at most {most} \\(a burst's M \\* \\(k \\+ 1\\) "
                                             f"tokens fill a ring row of at most {MAX_RING}\\), not {most + 1}"):
            Geometry(k, most + 1)
        with pytest.raises(ValueError, match=f"m_rounds must be at most {most}"):
            Geometry(k, 4).with_rounds(most + 1)
    assert Geometry(3, 4, 1, MAX_TREE_NODES).width == MAX_TREE_NODES
    with pytest.raises(ValueError, match=f"width must be at most {MAX_TREE_NODES} \\(past a chain's k \\+ 1 it is a "
                                         f"tree's nodes, at most {MAX_TREE_NODES}\\), not {MAX_TREE_NODES + 1}"):
        Geometry(3, 4, 1, MAX_TREE_NODES + 1)
    assert Geometry(999, 2, 1, 1000) == Geometry(999, 2), "a chain longer than any tree keeps its k + 1"
    with pytest.raises(ValueError, match="width must be at most 1000"):
        Geometry(999, 2, 1, 1001)


def test_kv_capacity_is_never_negative_or_wrapped():
    """kv_capacity computes in Python ints: at the largest geometry and a prompt past int64 it
    is the exact sum, never an int64 wrapped negative."""
    k, m = 1, MAX_RING // 2  # a live row at position 1 (prompt and budget) may write M rounds of k + 1 past it
    assert kv_capacity(1, 0, Geometry(k, m)) == 1 + m * (k + 1) == 2**32 - 1
    assert kv_capacity(1, 0, Geometry(MAX_K, 1)) == 2**31
    assert kv_capacity(1, 0, Geometry(k, m, 2), overlap=True) == 1 + 2 * m * (k + 1) + k + 1 > 2**32
    assert kv_capacity(2**63 - 2, 1, Geometry(4, 4)) == 2**63 - 1 + 4 * 5, "past int64: wrapped negative"
    long = kv_capacity(2**70, 5, Geometry(4, 4), overlap=True)  # 4 rounds in flight, 4 more, of 5 tokens each
    assert type(long) is int and long == 2**70 + 5 + (4 + 4) * 5

"""A round's geometry: one value for the shape every piece of round-stream is sized by.

The buffers (StreamBufs), the capacity rule (Capacity, kv_capacity), a tree's buffers (TreeBufs),
a decoder and the cache it needs (memra_cuda.torch's capacity_for) all read the same four
numbers. Built and checked once here, they travel as one value (`bufs.geometry`), so a piece
down the line cannot be handed a k or an M of its own.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from ..driver.values import I32_MOST, as_size
from .layout import MAX_TREE_NODES, RING_TOKENS


class TreeLike(Protocol):
    """What a geometry reads of a tree (a TreeShape or a DynamicTree: memra_cuda.buffers.tree)."""

    @property
    def depth(self) -> int: ...

    @property
    def nodes(self) -> int: ...

MAX_BATCH = 65535  # some kernels give each sequence a grid row (y), which CUDA caps at 65535
# A row of the ring (ring_d, u32[B][RING_TOKENS + ring_cap], ptx/layout.cuh) holds a burst's
# ring_cap = M·(k + 1) tokens; the kernels take ring_cap as a u32 and add RING_TOKENS to it in
# u32 (spec_ring_commit, spec_ring_publish), so M·(k + 1) is at most MAX_RING, and k + 1 (M = 1)
# too: the kernels' own k + 1 cannot wrap either.
MAX_RING = 2**32 - 1 - RING_TOKENS
# A round's k + 1 tokens are an i32 count on the device (ctl's keep: a round's committed tokens),
# and the greedy and sampled acceptance and the ring's commit step a warp over a row's drafts 32 at
# a time in u32 up to k: at k of 2**32 - 32 or more that step wrapped to 0 below its limit and the
# kernel ran for ever (a round whose rollback table names no cache, and so no capacity, reached
# it). So k + 1 is at most I32_MOST: a step then ends below 2**31 + 32.
MAX_K = I32_MOST - 1


def as_batch(batch: object) -> int:
    """`batch` as a batch size, 1 to MAX_BATCH rows (as_size's refusals, naming it)."""
    return as_size(batch, "batch", 1, MAX_BATCH)


@dataclass(frozen=True, init=False)
class Geometry:
    """A round's shape: `k`, the most drafts a round keeps a row (a chain's drafts, a tree's
    depth D: a round commits up to k + 1 tokens); `m_rounds`, M, the most rounds a burst (a
    readback each); `batch`, B rows; `width`, the tokens a round verifies a row and writes past
    its position (a chain's k + 1, the default; a tree's T + 1 nodes, Geometry.of_tree).

    Each is checked as it is built (an int, k at least 0, M and B at least 1 and B at most
    MAX_BATCH, width at least k + 1), ValueError or TypeError naming it; and bounded by what the
    kernels hold, so no size or count computed from them can wrap: k at most MAX_K (k + 1 an
    i32, a round's count of tokens on the device); M·(k + 1), a burst's tokens a row, at most the
    ring's MAX_RING (a u32: M at most MAX_RING // (k + 1)); a width past a chain's k + 1 is a
    tree's nodes, at most MAX_TREE_NODES (the tree kernels' shared arrays and a node's ancestor
    mask words)."""

    k: int
    m_rounds: int
    batch: int
    width: int

    def __init__(self, k: int, m_rounds: int, batch: int = 1, width: int | None = None):
        """`width` None: a chain's k + 1, a default computed from another field, which a
        dataclass field cannot have; so the frozen fields are set here."""
        k = _at_most(as_size(k, "k", 0), "k", MAX_K, "a round's k + 1 tokens are an i32 count on the device")
        m_rounds = as_rounds(m_rounds, k)
        if width is not None:
            width = _at_most(as_size(width, "width", k + 1), "width", max(k + 1, MAX_TREE_NODES),
                             f"past a chain's k + 1 it is a tree's nodes, at most {MAX_TREE_NODES}")
        for name, value in (("k", k), ("m_rounds", m_rounds), ("batch", as_batch(batch)),
                            ("width", k + 1 if width is None else width)):
            object.__setattr__(self, name, value)

    @classmethod
    def of_tree(cls, tree: TreeLike, m_rounds: int, batch: int = 1) -> Geometry:
        """The geometry of rounds verifying `tree` (a TreeShape or a DynamicTree): k its depth,
        width its T + 1 nodes."""
        if not all(hasattr(tree, name) for name in ("depth", "nodes")):
            raise TypeError(f"a tree is a TreeShape or a DynamicTree (memra_cuda), not {tree!r}")
        return cls(tree.depth, m_rounds, batch, tree.nodes)

    def with_rounds(self, m_rounds: int) -> Geometry:
        """The same rounds, `m_rounds` a burst (a mode that queues another number of rounds at
        once: capacity is checked by what is queued)."""
        return replace(self, m_rounds=m_rounds)  # checked again, as every Geometry is built

    @property
    def chain(self) -> bool:
        """Whether a round verifies a chain (width k + 1), not a tree."""
        return self.width == self.k + 1


def as_rounds(m_rounds: object, k: int = 0) -> int:
    """`m_rounds` as M, a burst's rounds, for rounds of k drafts (k checked already): an int of at
    least 1 (as_size's refusals, naming it) and at most MAX_RING // (k + 1), a burst's M·(k + 1)
    tokens filling a ring row of at most MAX_RING. The one check of an M: a geometry's, and, at
    k = 0 (the most any geometry takes), a Pace's and a device loop's passes', which are told no k
    (Pace(b, 2**40) was taken, every burst paced as 2**40 rounds)."""
    return _at_most(as_size(m_rounds, "m_rounds"), "m_rounds", MAX_RING // (k + 1),
                    f"a burst's M * (k + 1) tokens fill a ring row of at most {MAX_RING}")


def _at_most(value: int, what: str, most: int, why: str) -> int:
    """`value` (checked by as_size already) if it is at most `most`, else ValueError naming
    `what` and `why` the bound is there."""
    if value > most:
        raise ValueError(f"{what} must be at most {most} ({why}), not {value}")
    return value


def as_geometry(geometry: object) -> Geometry:
    """`geometry` if it is a Geometry, else TypeError naming what was given (the loose integers
    it replaces among them)."""
    if not isinstance(geometry, Geometry):
        raise TypeError(f"a round's shape is one memra_cuda.Geometry(k, m_rounds, batch=1, width=None), not "
                        f"{geometry!r} (0.3.0's loose k, M and B are one Geometry now)")
    return geometry

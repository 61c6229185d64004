"""Draft trees: their shapes on the host, and their nodes on the device (docs/trees.md).

A tree round verifies T + 1 nodes at once, node 0 the pending token. Nodes are kept in level
order (every node of depth d before any of depth d + 1), so each level is one fixed range of
node indices: a model's draft processes a level as one batch of tokens of a fixed shape every
round, which a captured graph needs. A static tree (TreeShape) fixes the topology; a dynamic
one (DynamicTree) fixes only the levels' widths, and the layer's kernels choose each round,
per row, which candidates fill them.
"""
from __future__ import annotations

import heapq
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..driver.values import as_index, as_listed, as_real, as_size
from .arena import carve
from .layout import MAX_TREE_DRAWS, MAX_TREE_NODES, MAX_TREE_OFFERS, ROOT_PARENT

if TYPE_CHECKING:
    from ..driver.buffer import DeviceBuffer
    from .stream_bufs import StreamBufs

# The most candidates a node offers its children: the K of the grow kernel's candidates
# (TreeKernels refuses more), so a rank (a node's place among its parent's candidates) is below it.
MAX_TREE_CANDIDATES = 32
_NODE_INTS = "ints, one a node"  # what a tree's parent and rank hold, for as_listed's refusal


@dataclass(frozen=True)
class TreeShape:
    """A static tree: `parent` and `rank` of every node in level order (node 0 the root, its
    parent -1 and its rank 0), built by from_choices or from_parents, which check it. A node of
    rank r holds its parent's r-th best candidate (greedy) or r-th draw (sampling)."""

    parent: tuple[int, ...]
    rank: tuple[int, ...]

    def __post_init__(self) -> None:
        """Every field becomes a tuple of plain ints before it is checked: a float rank would be
        uploaded truncated, a bool read as 0 or 1, a list leave the tree unhashable and a rank
        past a u32 overflow only when TreeBufs packs it; each is refused here, by node."""
        parents, ranks = (as_listed(values, name, _NODE_INTS, MAX_TREE_NODES)
                          for values, name in ((self.parent, "parent"), (self.rank, "rank")))
        if len(parents) != len(ranks):
            raise ValueError("a tree's parent and rank name every node, node 0 (the root, parent -1) first")
        if not 2 <= len(parents) <= MAX_TREE_NODES:
            raise ValueError(f"a tree has 2 to {MAX_TREE_NODES} nodes (the ancestor mask's width), not "
                             f"{len(parents)}")
        parent = tuple(as_index(p, f"node {i}'s parent") for i, p in enumerate(parents))
        rank = tuple(_rank(r, f"node {i}'s rank") for i, r in enumerate(ranks))
        object.__setattr__(self, "parent", parent)
        object.__setattr__(self, "rank", rank)
        if parent[0] != -1:
            raise ValueError("a tree's parent and rank name every node, node 0 (the root, parent -1) first")
        if rank[0] != 0:  # the root is no parent's candidate: spec_tree_begin writes its rank 0, whatever is given
            raise ValueError(f"node 0's rank must be 0 (the root is no parent's candidate), not {rank[0]}")
        depth = [0]
        for i, p in enumerate(parent[1:], 1):
            if not 0 <= p < i:
                raise ValueError(f"node {i}'s parent {p} is not before it: a parent must come before its child")
            if depth[p] + 1 < depth[-1]:
                raise ValueError(f"node {i} (depth {depth[p] + 1}) comes after a deeper node: nodes are in level order")
            depth.append(depth[p] + 1)
        siblings = list(zip(parent[1:], rank[1:]))
        if len(set(siblings)) != len(siblings):
            raise ValueError("sibling ranks must be distinct")
        object.__setattr__(self, "_depths", tuple(depth))

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]]) -> TreeShape:
        """EAGLE-style choices: each node the path of sibling ranks from the root ([1, 0]: the
        best child of the root's second-best child), every prefix of a path a node too."""
        given = enumerate(as_listed(choices, "choices", "paths of ranks", MAX_TREE_NODES - 1))  # the root no path
        paths = [tuple(_rank(r, f"choices[{i}][{j}]")
                       for j, r in enumerate(as_listed(path, f"choices[{i}]", "ranks", MAX_TREE_NODES - 1)))
                 for i, path in given]
        if any(not path for path in paths) or len(set(paths)) != len(paths):
            raise ValueError("choices are distinct, non-empty paths of sibling ranks")
        known = set(paths)
        for path in paths:
            if len(path) > 1 and path[:-1] not in known:
                raise ValueError(f"choice {list(path)}: its prefix {list(path[:-1])} is not a node")
        order = sorted(paths, key=lambda path: (len(path), path))
        index = {(): 0, **{path: i + 1 for i, path in enumerate(order)}}
        return cls((-1, *(index[path[:-1]] for path in order)), (0, *(path[-1] for path in order)))

    @classmethod
    def from_parents(cls, parents: Sequence[int]) -> TreeShape:
        """Each node's parent (node 0's -1), a parent before its child; siblings ranked in their
        given order. Reordered into level order (by depth, then parent, then rank). Each parent
        an int (a float, a string or a bool refused, not converted), at most MAX_TREE_NODES of
        them (refused before the reordering, which takes their square), a node's children at
        most MAX_TREE_CANDIDATES (refused naming the index given)."""
        given = as_listed(parents, "parents", _NODE_INTS, MAX_TREE_NODES)
        parents = [as_index(p, f"parents[{i}]") for i, p in enumerate(given)]
        if not parents or parents[0] != -1:
            raise ValueError("parents[0] must be -1: node 0 is the root")
        depth, rank = [0], [0]
        seen: dict[int, int] = {}  # children each parent has so far
        for i, p in enumerate(parents[1:], 1):
            if not 0 <= p < i:
                raise ValueError(f"node {i}'s parent {p} is not before it: a parent must come before its child")
            depth.append(depth[p] + 1)
            # checked here, by the index given: past the reordering it was another node's rank ("node 35's")
            rank.append(_rank(seen.get(p, 0),
                              f"parents[{i}]'s rank among node {p}'s children (at most {MAX_TREE_CANDIDATES} a node)"))
            seen[p] = rank[-1] + 1
        order = [0]
        for d in range(1, max(depth) + 1):
            order += sorted((i for i in range(len(parents)) if depth[i] == d),
                            key=lambda i: (order.index(parents[i]), rank[i]))
        where = {old: new for new, old in enumerate(order)}
        return cls((-1, *(where[parents[i]] for i in order[1:])), tuple(rank[i] for i in order))

    @classmethod
    def chain(cls, k: int) -> TreeShape:
        """k drafts in a line: the tree a chain round verifies (its size checked before its nodes
        are listed)."""
        k = as_size(k, "k")
        if k + 1 > MAX_TREE_NODES:
            raise ValueError(f"a tree has at most {MAX_TREE_NODES} nodes (the ancestor mask's width): a chain of "
                             f"k {k} has {k + 1}")
        return cls((-1, *range(k)), (0,) * (k + 1))

    @classmethod
    def chain_with_leaves(cls, k: int, leaves: int) -> TreeShape:
        """k drafts in a line, each beside its parent's next `leaves` candidates as leaves: a
        draft that leaves out what it need not expand (`expanded`) runs a chain's levels of one
        node for it, and the verify takes k (leaves + 1) + 1 tokens. Where a verify of those costs
        about what one of k + 1 does, it catches the draft's second choices at a chain's draft
        cost. Its size is checked before its paths are listed (k^2 of them: a k of 10 000 took
        half a minute and a gigabyte before from_choices refused it)."""
        k, leaves = as_size(k, "k"), as_size(leaves, "leaves", 0, MAX_TREE_CANDIDATES - 1)
        if k * (leaves + 1) + 1 > MAX_TREE_NODES:
            raise ValueError(f"a tree has at most {MAX_TREE_NODES} nodes (the ancestor mask's width): k {k} x "
                             f"(leaves {leaves} + 1) + 1 is {k * (leaves + 1) + 1}")
        return cls.from_choices([[0] * (d - 1) + [r] for d in range(1, k + 1) for r in range(leaves + 1)])

    @classmethod
    def likeliest(cls, size: int, *, depth: int = 8, right: float = 0.6, fall: float = 0.5,
                  ranks: int = MAX_TREE_DRAWS) -> TreeShape:
        """The `size` draft nodes most likely on the accepted path when a node of rank r is
        right with probability right * fall**r given its parent (a child's chance is below its
        parent's, so the likeliest nodes form a tree), at most `depth` deep and `ranks` wide:
        a static tree for a draft whose rank-r candidates are accepted at about those rates.
        `ranks` is at most MAX_TREE_CANDIDATES (a node has no more candidates to rank): the
        search holds `ranks` paths a node chosen, so an unbounded one would exhaust memory. Any
        right and fall in (0, 1] give the likeliest nodes: chances a float's product underflows
        (right=1e-300 two deep) are compared by their logarithms."""
        size, depth = as_size(size, "size"), as_size(depth, "depth")
        ranks = as_size(ranks, "ranks", 1, MAX_TREE_CANDIDATES)
        right, fall = _chance(right, "right"), _chance(fall, "fall")
        if not (0 < right <= 1 and 0 < fall <= 1):
            raise ValueError(f"a likeliest tree needs right and fall in (0, 1], not right={right}, fall={fall}")
        if size >= MAX_TREE_NODES:
            raise ValueError(f"a tree has 2 to {MAX_TREE_NODES} nodes (the ancestor mask's width): a likeliest "
                             f"tree of {size} drafts has {size + 1}")
        most = sum(ranks**d for d in range(1, min(depth, size) + 1))  # every node a tree this deep and wide has
        if size > most:
            raise ValueError(f"a likeliest tree at most {depth} deep and {ranks} wide has at most {most} nodes, "
                             f"not {size}")
        # A node's chance is a product of floats: below a float's least normal it has lost its order
        # (right=1e-300 two deep is 0.0), and such nodes were ordered by their paths, a line of first
        # candidates, not the likeliest nodes. They come after every other, ordered by their log
        # chance, which no product underflows; the rest by their products, as before (so the tree of
        # any ordinary rates, a benchmark's by its name, is the one it was).
        least, log_right, log_fall = sys.float_info.min, math.log(right), math.log(fall)

        def entry(chance: float, path: tuple[int, ...]) -> tuple[float, float, tuple[int, ...]]:
            if chance >= least:
                return -chance, 0.0, path
            return 0.0, -(len(path) * log_right + sum(path) * log_fall), path

        chosen: list[tuple[int, ...]] = []
        frontier = [entry(right * fall**r, (r,)) for r in range(ranks)]
        heapq.heapify(frontier)
        while len(chosen) < size:
            chance, _, path = heapq.heappop(frontier)
            chosen.append(path)
            if len(path) < depth:
                for r in range(ranks):
                    heapq.heappush(frontier, entry(-chance * right * fall**r, (*path, r)))
        return cls.from_choices(chosen)

    @property
    def nodes(self) -> int:
        """The tree's nodes, the root included: T + 1."""
        return len(self.parent)

    @property
    def depths(self) -> tuple[int, ...]:
        """Each node's depth, in level order: the root's 0."""
        return self._depths  # type: ignore[attr-defined]

    @property
    def depth(self) -> int:
        """The deepest node's depth: the most drafts a round can accept a row."""
        return self.depths[-1]

    @property
    def levels(self) -> tuple[tuple[int, int], ...]:
        """(start, stop) of each depth's nodes, depth 0 (the root) first."""
        bounds = np.searchsorted(np.array(self.depths), np.arange(self.depth + 2))
        return tuple((int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]))

    @property
    def expanded(self) -> tuple[tuple[int, int], ...]:
        """(start, stop) of each depth's nodes up to its last with a child (the deepest level's:
        none): the nodes whose children the layer makes, so the only ones whose candidates or q
        it reads. Those past it are leaves: a draft that folds its last step into the next
        round's first (docs/model-side.md), and so never needs the K/V of a leaf it drafted,
        can leave them out of the level's forward."""
        last: dict[int, int] = {}
        for p in self.parent[1:]:
            last[self.depths[p]] = max(last.get(self.depths[p], p), p)
        return tuple((start, last[d] + 1 if d in last else start) for d, (start, _) in enumerate(self.levels))

    @property
    def draws(self) -> int:
        """Candidates a node must offer: the highest rank asked for, plus one."""
        return max(self.rank[1:]) + 1

    def fixed_fields(self) -> dict[str, np.ndarray]:
        """The fields of a row's nodes that are the same every round, as TreeBufs holds them (u32):
        `parent` (node 0's ROOT_PARENT), `depth`, `rank` ([T+1] each) and `mask` ([T+1][W], node
        j at bit j % 32 of word j // 32: the node and its ancestors). Kernel 10 writes node 0's so,
        and kernel 11 every other node's wherever its candidate is live (a finite log-probability
        of a rank below K under a live parent: always, for a greedy draft's ranks alone); only
        the tokens and positions change from round to round."""
        n, words = self.nodes, -(-self.nodes // 32)
        mask = np.zeros((n, words), np.uint32)
        for i, p in enumerate(self.parent):
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i // 32] |= np.uint32(1 << i % 32)
        return {"parent": np.array([ROOT_PARENT, *self.parent[1:]], np.uint32),
                "depth": np.array(self.depths, np.uint32), "rank": np.array(self.rank, np.uint32), "mask": mask}

    def check_sampled(self) -> None:
        """A sampled tree's children are their parent's first draws, at most MAX_TREE_DRAWS."""
        children: dict[int, list[int]] = {}
        for p, r in zip(self.parent[1:], self.rank[1:]):
            children.setdefault(p, []).append(r)
        for p, ranks in children.items():
            if sorted(ranks) != list(range(len(ranks))):
                raise ValueError(f"node {p}'s children have ranks {sorted(ranks)}: a sampled tree's children are "
                                 "their parent's first draws, ranks 0..r-1 without gaps")
        if self.draws > MAX_TREE_DRAWS:
            raise ValueError(f"a sampled node draws at most {MAX_TREE_DRAWS} children, not {self.draws}")


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's dynamic tree: `depth` levels of `width` nodes each; every round and row, the
    nodes of a level each offer their `branch` best candidates (by cumulative draft
    log-probability) and the `width` best offers become the next level (docs/trees.md)."""

    depth: int
    width: int
    branch: int

    def __post_init__(self) -> None:
        """The checked plain ints are kept, not the values given: numpy integers' arithmetic
        wraps (uint8 depth 3 x width 100 + 1 is 45, not 301, under the mask's limit), and the
        nodes, levels and mask words (TreeBufs) of a wrapped count disagree with one another,
        which the kernels would trust. A node offers at most MAX_TREE_CANDIDATES (a draft's
        candidates a node, TreeKernels' K)."""
        for name in ("depth", "width", "branch"):
            object.__setattr__(self, name, as_size(getattr(self, name), name,
                                                   most=MAX_TREE_CANDIDATES if name == "branch" else None))
        if self.nodes > MAX_TREE_NODES:
            raise ValueError(f"a tree has at most {MAX_TREE_NODES} nodes (the ancestor mask's width): depth "
                             f"{self.depth} x width {self.width} + 1 is {self.nodes}")
        if self.depth > 1 and self.width * self.branch > MAX_TREE_OFFERS:
            raise ValueError(f"a dynamic level weighs at most {MAX_TREE_OFFERS} offers (the grow kernel's shared "
                             f"memory): width {self.width} x branch {self.branch} is {self.width * self.branch}")

    @property
    def nodes(self) -> int:
        """The tree's nodes, the root included: depth x width + 1."""
        return self.depth * self.width + 1

    @property
    def levels(self) -> tuple[tuple[int, int], ...]:
        """(start, stop) of each depth's nodes, depth 0 (the root) first, then `width` a level."""
        return ((0, 1), *((1 + d * self.width, 1 + (d + 1) * self.width) for d in range(self.depth)))

    @property
    def expanded(self) -> tuple[tuple[int, int], ...]:
        """TreeShape.expanded: every level but the deepest whole (which of its nodes get
        children is chosen on the device)."""
        *inner, (start, _) = self.levels
        return (*inner, (start, start))

    @property
    def draws(self) -> int:
        """Candidates a node must offer: `branch`."""
        return self.branch

    def check_sampled(self) -> None:
        """A sampled node draws its `branch` children, at most MAX_TREE_DRAWS."""
        if self.branch > MAX_TREE_DRAWS:
            raise ValueError(f"a sampled node draws at most {MAX_TREE_DRAWS} children: branch {self.branch}")


Tree = TreeShape | DynamicTree


def _rank(value: object, what: str) -> int:
    """A rank as a plain int from 0 to MAX_TREE_CANDIDATES - 1, the candidates a node can offer
    (a rank past them could never be filled, and one past a u32 could not be uploaded)."""
    return as_size(value, what, 0, MAX_TREE_CANDIDATES - 1)


def _chance(value: Any, what: str) -> float:
    """A probability of TreeShape.likeliest as a float (as_real's refusals, naming it)."""
    return as_real(value, f"a likeliest tree's {what}")


@dataclass(frozen=True)
class Candidates:
    """A greedy tree draft's output at each node it processes: its K best candidate tokens
    (`tok_d`, [B][T+1][K], 32- or 64-bit ids) and their log-probabilities (`logp_d`, f32
    [B][T+1][K]), best first, -inf past the last. The layer fills the next level from them."""

    tok_d: Any
    logp_d: Any


class TreeBufs:
    """The tree's nodes on the device for every row of `bufs` (docs/trees.md, "TreeBufs"): what
    the model's draft and verify read (tokens, parents, depths, ranks, positions, ancestor masks,
    cumulative scores) and the accepted path. One allocation, written by the layer's kernels
    every round, which find each field from its address in this order (T1, W, D, B give the
    sizes); a static tree's topology (shape_d: parents, ranks, child counts) is uploaded once,
    and so are its nodes' fixed fields (TreeShape.fixed_fields: parent, depth, rank, mask; score,
    where no grow writes it, stays the zeroed allocation's 0, what a greedy grow of ranks writes)."""

    # The nodes, [B][per row] each, u32 unless said (T + 1 nodes, W mask words, depth D):
    tok_d: DeviceBuffer  # [T+1]: node i's token (node 0: the pending token)
    parent_d: DeviceBuffer  # [T+1]: node i's parent; node 0's is ROOT_PARENT
    depth_d: DeviceBuffer  # [T+1]: node i's depth
    rank_d: DeviceBuffer  # [T+1]: node i's place among its siblings, or VOID_RANK
    pos_d: DeviceBuffer  # i32[T+1]: node i's position, pos_start + depth
    mask_d: DeviceBuffer  # [T+1][W]: the ancestor mask, bit j of node i set iff j is i or its ancestor
    score_d: DeviceBuffer  # f32[T+1]: node i's cumulative draft log-probability
    path_d: DeviceBuffer  # [D+1]: the accepted path, entry d the node at depth d
    shape_d: DeviceBuffer | None  # u32[3][T+1], a static tree's parents, ranks and child counts; None: dynamic

    def __init__(self, bufs: StreamBufs, tree: Tree):
        if not isinstance(tree, (TreeShape, DynamicTree)):
            raise TypeError(f"a tree is a TreeShape or a DynamicTree, not {tree!r}")
        if (tree.depth, tree.nodes) != (bufs.k, bufs.geometry.width):
            raise ValueError(f"a tree of depth {tree.depth} and {tree.nodes} nodes runs on buffers of "
                             f"Geometry.of_tree(tree, ...) (k = {tree.depth}, width {tree.nodes}), not k = {bufs.k}, "
                             f"width {bufs.geometry.width}")
        engine, batch = bufs.engine, bufs.batch
        self.bufs, self.tree, self.engine = bufs, tree, engine
        self.nodes, self.depth, self.levels = tree.nodes, tree.depth, tree.levels
        self.words = -(-self.nodes // 32)
        n = self.nodes
        self._arena, self._fields = carve(engine, batch, {
            "tok_d": (np.uint32, n), "parent_d": (np.uint32, n), "depth_d": (np.uint32, n), "rank_d": (np.uint32, n),
            "pos_d": (np.int32, n), "mask_d": (np.uint32, n * self.words), "score_d": (np.float32, n),
            "path_d": (np.uint32, self.depth + 1)}, label="tree nodes")
        vars(self).update(self._fields)  # each the attribute the class declares
        self.shape_d = None
        if isinstance(tree, TreeShape):
            fixed = tree.fixed_fields()
            children = np.bincount(tree.parent[1:], minlength=n)
            shape = np.array([fixed["parent"], fixed["rank"], children], np.uint32)
            self.shape_d = engine.alloc(np.uint32, 3 * n, label="tree shape")
            engine.copy_htod(self.shape_d, shape.reshape(-1))
            # every row's fixed fields now, once: a draft that places its children itself (TreeRound's
            # draft_places) runs no grow to write them; the grows a round runs otherwise write them alike
            for name, values in fixed.items():
                engine.copy_htod(self._fields[f"{name}_d"], np.tile(values.reshape(-1), batch))

    @property
    def batch(self) -> int:
        """The rows, B: those of `bufs`."""
        return self.bufs.batch

    @property
    def arena(self) -> DeviceBuffer:
        """The one allocation every field is a window of (carve's): the tree kernels find each
        field from its address."""
        return self._arena

    def read(self) -> dict[str, np.ndarray]:
        """Every field of every row, read back, [B][...] (for tests and debugging), named
        without its `_d`."""
        return {name[:-2]: self.engine.dtoh(buf).reshape(self.batch, -1) for name, buf in self._fields.items()}

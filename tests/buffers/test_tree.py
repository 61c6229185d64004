"""Tree shapes on the host (memra_cuda/buffers/tree.py) and the capacity rule for trees: what is
refused before anything is queued, and the level order every tree kernel and model relies on;
and the tree kernels' launchers' check that a tree's counts agree (memra_cuda/kernels/tree.py),
made before a kernel is asked for. CPU only: TreeBufs over an address nobody reads."""
from __future__ import annotations

import itertools
import math
import time
from collections import UserString

import numpy as np
import pytest

from memra_cuda import Geometry
from memra_cuda import DeviceBuffer, DynamicTree, StreamBufs, TreeBufs, TreeShape, kv_capacity
from memra_cuda.buffers.capacity import Capacity
from memra_cuda.buffers.layout import MAX_TREE_DRAWS, MAX_TREE_NODES, MAX_TREE_OFFERS, ROOT_PARENT
from memra_cuda.buffers.tree import MAX_TREE_CANDIDATES
from memra_cuda.kernels.tree import TreeKernels
from memra_cuda.testing import reference_tree as rt

FAKE_PTR = 0x7F0000000000  # a device address no buffer of these tests is ever read at
NUMPY_INTS = (np.uint8, np.uint16, np.uint32, np.int64)


class AddressOnly:
    """What TreeBufs asks of an engine: zeroed memory and a static tree's shape at an address
    nobody reads, and the shape's upload, recorded."""

    def __init__(self) -> None:
        self.writes: list[list[int]] = []
        self.where: list[int] = []  # each write's address

    def zeros(self, dtype, length, *, label=None):
        return DeviceBuffer.wrap(FAKE_PTR, dtype, length)

    def alloc(self, dtype, length, *, label=None, zeroed=False):
        return DeviceBuffer.wrap(FAKE_PTR, dtype, length)

    def copy_htod(self, dst, values, start=0):
        self.writes.append(np.asarray(values).tolist())
        self.where.append(dst.ptr)


def tree_bufs(tree: TreeShape | DynamicTree, batch: int = 2) -> TreeBufs:
    """TreeBufs of `tree` over the host half of a StreamBufs (what TreeBufs reads of it)."""
    bufs = StreamBufs.__new__(StreamBufs)
    bufs.geometry = Geometry.of_tree(tree, 1, batch)
    bufs.k, bufs.batch, bufs.engine = bufs.geometry.k, batch, AddressOnly()
    return TreeBufs(bufs, tree)


def test_choices_become_level_order_with_parents_before_children():
    tree = TreeShape.from_choices([[1, 0], [0], [1], [0, 0], [0, 1], [0, 0, 0]])
    assert tree.parent == (-1, 0, 0, 1, 1, 2, 3)
    assert tree.rank == (0, 0, 1, 0, 1, 0, 0)
    assert tree.depths == (0, 1, 1, 2, 2, 2, 3)
    assert tree.levels == ((0, 1), (1, 3), (3, 6), (6, 7))
    assert (tree.nodes, tree.depth, tree.draws) == (7, 3, 2)


def test_parents_in_any_topological_order_are_reordered_by_level():
    tree = TreeShape.from_parents([-1, 0, 1, 0, 2, 3])  # 0 -> 1 -> 2 -> 4, 0 -> 3 -> 5
    assert tree.parent == (-1, 0, 0, 1, 2, 3)  # old nodes 0, 1, 3, 2, 5, 4
    assert tree.rank == (0, 0, 1, 0, 0, 0)
    assert tree.depths == (0, 1, 1, 2, 2, 3)


def test_a_level_is_expanded_up_to_its_last_node_with_a_child():
    """Leaves past a level's last parent are left out ([2]; [0, 0, 1] and [1, 0, 0]); a leaf
    before it is kept ([0, 1]); the deepest level, all leaves, is empty. A dynamic tree's levels
    are whole but the deepest: which of their nodes get children is chosen on the device."""
    tree = TreeShape.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [1, 0, 0],
                                   [0, 0, 0, 0]])
    assert tree.levels == ((0, 1), (1, 4), (4, 7), (7, 10), (10, 11))
    assert tree.expanded == ((0, 1), (1, 3), (4, 7), (7, 8), (10, 10))
    assert TreeShape.chain(3).expanded == ((0, 1), (1, 2), (2, 3), (3, 3))
    assert DynamicTree(3, 2, 2).expanded == ((0, 1), (1, 3), (3, 5), (5, 5))


def test_a_static_trees_fixed_fields_are_what_its_grows_write():
    """TreeShape.fixed_fields, which TreeBufs uploads once for a draft that places its own
    children, are the parent, depth, rank and mask that kernel 10 and kernel 11 (the numpy
    reference) write every round for candidates of finite log-probability: for a chain with
    leaves, a tree of rank gaps, and a likeliest tree of two mask words (bit 31 and past it),
    over candidates of random tokens; score 0 both ways."""
    for tree in (TreeShape.chain_with_leaves(8, 1), TreeShape.from_choices([[0], [2], [0, 1], [2, 3]]),
                 TreeShape.likeliest(40, depth=6, ranks=4)):
        batch, K, n = 2, tree.draws + 1, tree.nodes
        t = rt.TreeArrays.zeros(n, tree.depth, batch)
        t.tok[:], t.parent[:], t.depth[:], t.rank[:], t.mask[:] = 7, 9, 9, 9, 0xFFFF  # none of it left as it was
        t.score[:] = np.nan  # so a score the kernels never wrote is no 0
        pos = np.array([3, 30], np.int32)
        rt.spec_tree_begin(t, np.array([1, 2], np.uint32), pos, np.zeros(batch, np.int32),
                           np.zeros(batch * (tree.depth + 1), np.uint32), tree.depth, batch)
        tokens = np.random.default_rng(n).integers(0, 1000, batch * n * K).astype(np.uint32)
        logq = np.zeros(batch * n * K, np.float32)
        for level in range(1, tree.depth + 1):
            rt.spec_tree_grow(t, level, tree.levels, tokens, logq, logq, K, pos,
                              shape_parent=np.array([ROOT_PARENT, *tree.parent[1:]], np.uint32),
                              shape_rank=np.array(tree.rank, np.uint32), batch=batch)
        fixed = tree.fixed_fields()
        assert fixed["mask"].shape == (n, -(-n // 32)) and all(values.dtype == np.uint32 for values in fixed.values())
        for name, values in fixed.items():
            assert np.array_equal(np.tile(values.reshape(-1), batch), getattr(t, name)), name
        assert not t.score.any()


def test_a_static_trees_fixed_fields_are_uploaded_with_its_shape_a_dynamic_trees_never():
    """TreeBufs of a static tree writes the shape, then every row's parent, depth, rank and mask
    (TreeShape.fixed_fields), each into its own field; a dynamic tree's writes nothing."""
    tree = TreeShape.likeliest(40, depth=6, ranks=4)
    made = tree_bufs(tree, batch=3)
    engine, fixed = made.engine, tree.fixed_fields()
    names = ("parent", "depth", "rank", "mask")
    assert engine.where == [made.shape_d.ptr, *(getattr(made, f"{name}_d").ptr for name in names)]
    assert engine.writes[1:] == [np.tile(fixed[name].reshape(-1), 3).tolist() for name in names]
    assert fixed["parent"][:3].tolist() == [ROOT_PARENT, 0, 0] and fixed["mask"][0].tolist() == [1, 0]
    assert tree_bufs(DynamicTree(3, 2, 2)).engine.writes == []


def test_a_chain_with_leaves_expands_its_line_alone():
    tree = TreeShape.chain_with_leaves(3, 2)
    assert tree.parent == (-1, 0, 0, 0, 1, 1, 1, 4, 4, 4) and tree.rank == (0,) + (0, 1, 2) * 3
    assert tree.expanded == ((0, 1), (1, 2), (4, 5), (7, 7))  # one node a level: a chain's draft
    assert (tree.nodes, tree.depth, tree.draws) == (10, 3, 3)
    assert TreeShape.chain_with_leaves(4, 0) == TreeShape.chain(4)
    for k, leaves, named in ((0, 1, "k must be an int of at least 1"), (2, -1, "leaves must be an int from 0"),
                             (2, MAX_TREE_CANDIDATES, f"leaves must be an int from 0 to {MAX_TREE_CANDIDATES - 1}")):
        with pytest.raises(ValueError, match=named):
            TreeShape.chain_with_leaves(k, leaves)


def test_a_chain_with_leaves_is_refused_past_the_mask_at_once():
    """Its size is known from k and leaves: refused before its k^2 paths are listed (a k of
    10 000 took half a minute and a gigabyte before), at the limit served."""
    assert TreeShape.chain_with_leaves(85, 2).nodes == MAX_TREE_NODES  # 85 x 3 + 1
    assert TreeShape.chain_with_leaves(1, MAX_TREE_CANDIDATES - 1).nodes == MAX_TREE_CANDIDATES + 1
    started = time.perf_counter()
    for k, leaves in ((86, 2), (10**9, 0), (10**18, 31)):
        with pytest.raises(ValueError, match=f"at most {MAX_TREE_NODES} nodes"):
            TreeShape.chain_with_leaves(k, leaves)
    with pytest.raises(ValueError, match=f"at most {MAX_TREE_NODES} nodes"):
        TreeShape.chain(10**9)
    assert time.perf_counter() - started < 1


def test_a_chain_is_a_tree_of_one_branch():
    tree = TreeShape.chain(4)
    assert tree.parent == (-1, 0, 1, 2, 3) and tree.rank == (0,) * 5 and tree.depth == 4
    assert tree.levels == tuple((d, d + 1) for d in range(5))


@pytest.mark.parametrize("parents,why", [
    ([-1, 1], "not before it"), ([-1, 0, 3, 0], "not before it"), ([0, 0], "root"), ([-1, -2], "not before it")])
def test_a_parent_not_before_its_child_is_refused(parents, why):
    with pytest.raises(ValueError, match=why):
        TreeShape.from_parents(parents)


def test_out_of_level_order_and_duplicate_ranks_are_refused_when_given_directly():
    with pytest.raises(ValueError, match="level order"):
        TreeShape((-1, 0, 1, 0), (0, 0, 0, 1))
    with pytest.raises(ValueError, match="distinct"):
        TreeShape((-1, 0, 0), (0, 1, 1))


def test_the_roots_rank_is_0_as_every_constructor_makes_it():
    """TreeShape((-1, 0), (5, 0)) took a root of rank 5, which nothing reads (spec_tree_begin
    writes rank 0), so it compared and hashed unequal to the same tree of root rank 0."""
    for root in (1, 5, MAX_TREE_CANDIDATES - 1):
        with pytest.raises(ValueError, match=rf"^node 0's rank must be 0 \(the root is no parent's candidate\), "
                                             rf"not {root}$"):
            TreeShape((-1, 0), (root, 0))
    assert TreeShape((-1, 0), (np.int64(0), 0)) == TreeShape.chain(1) == TreeShape.from_parents([-1, 0])


@pytest.mark.parametrize("choices,why", [([[0, 0]], "prefix"), ([[0], [0]], "distinct"), ([[]], "non-empty")])
def test_bad_choices_are_refused(choices, why):
    with pytest.raises(ValueError, match=why):
        TreeShape.from_choices(choices)


def test_the_mask_width_is_the_limit_at_the_limit_and_past_it():
    assert TreeShape.chain(MAX_TREE_NODES - 1).nodes == MAX_TREE_NODES
    with pytest.raises(ValueError, match="mask"):
        TreeShape.chain(MAX_TREE_NODES)
    assert DynamicTree(depth=5, width=51, branch=2).nodes == MAX_TREE_NODES
    with pytest.raises(ValueError, match="mask"):
        DynamicTree(depth=5, width=52, branch=2)
    assert DynamicTree(depth=1, width=4, branch=MAX_TREE_CANDIDATES).branch == MAX_TREE_CANDIDATES
    with pytest.raises(ValueError, match=f"branch must be an int from 1 to {MAX_TREE_CANDIDATES}, not 33"):
        DynamicTree(depth=1, width=4, branch=MAX_TREE_CANDIDATES + 1)  # a node has no 33rd candidate


def test_a_sampled_tree_uses_its_first_draws():
    TreeShape.from_choices([[0], [1], [0, 0]]).check_sampled()
    with pytest.raises(ValueError, match="without gaps"):
        TreeShape.from_choices([[0], [2]]).check_sampled()
    TreeShape.from_choices([[r] for r in range(MAX_TREE_DRAWS)]).check_sampled()
    with pytest.raises(ValueError, match="at most"):
        TreeShape.from_choices([[r] for r in range(MAX_TREE_DRAWS + 1)]).check_sampled()
    DynamicTree(2, 4, MAX_TREE_DRAWS).check_sampled()
    with pytest.raises(ValueError, match="at most"):
        DynamicTree(2, 4, MAX_TREE_DRAWS + 1).check_sampled()


def test_a_dynamic_level_weighs_at_most_the_grow_kernels_offers_at_the_limit():
    """width x branch offers from the second level on (the root offers only its own), refused
    when the tree is made, not at the level whose grow would meet them."""
    assert DynamicTree(depth=2, width=64, branch=MAX_TREE_OFFERS // 64).nodes == 129
    with pytest.raises(ValueError, match="offers"):
        DynamicTree(depth=2, width=64, branch=MAX_TREE_OFFERS // 64 + 1)
    assert DynamicTree(depth=1, width=255, branch=MAX_TREE_CANDIDATES).nodes == MAX_TREE_NODES  # the root offers alone


def test_a_dynamic_tree_has_levels_of_its_width():
    tree = DynamicTree(depth=3, width=4, branch=2)
    assert tree.nodes == 13 and tree.levels == ((0, 1), (1, 5), (5, 9), (9, 13))
    for name in ("depth", "width", "branch"):
        with pytest.raises(ValueError, match=name):
            DynamicTree(**{"depth": 1, "width": 1, "branch": 1, name: 0})


def test_a_tree_round_needs_room_for_its_slots_past_the_position_at_the_limit():
    """A tree of depth D writes T + 1 slots past a row's position and moves it D + 1 at most:
    a burst of R rounds reaches position + (R - 1)(D + 1) + T + 1 (a batch: D + 1 more)."""
    D, T1, M = 3, 17, 4
    for batch in (1, 4):
        rule = Capacity(None, Geometry(D, M, batch, T1))
        reach = 100 + (M - 1) * (D + 1) + T1 + (D + 1 if batch > 1 else 0)
        positions, done = np.full(batch, 100), np.zeros(batch, bool)
        assert int(rule.burst_reach(positions, done, M).max()) == reach
        Capacity(reach, Geometry(D, M, batch, T1)).check_burst(positions, done, M)
        with pytest.raises(ValueError, match="cannot take"):
            Capacity(reach - 1, Geometry(D, M, batch, T1)).check_burst(positions, done, M)
        done[:] = True
        assert int(rule.burst_reach(positions, done, M).max()) == 100 + T1
    assert Capacity(10, Geometry(4, 2, 1)).geometry.width == 5  # a chain writes k + 1


def test_kv_capacity_of_a_tree_covers_a_generation():
    D, T1, M, prompt, new = 4, 33, 8, 20, 100
    for batch, overlap in ((1, False), (8, True)):
        entries = kv_capacity(prompt, new, Geometry(D, M, batch, T1), overlap=overlap)
        rule = Capacity(entries, Geometry(D, M, batch, T1))
        # the worst burst: from the furthest position a live row can be at, behind a burst in flight
        positions = np.full(batch, prompt - 1 + new - 1)
        rule.check_burst(positions, np.zeros(batch, bool), M, ahead=M if overlap else 0)
    assert kv_capacity(prompt, new, Geometry(D, M)) == kv_capacity(prompt, new, Geometry(D, M, 1, D + 1))


def test_kv_data_refuses_what_the_compaction_cannot_move():
    """Entries move as 32-bit words, each (row, position) in bytes of its own: checked when the
    layout is described, with no driver (DeviceBuffer.wrap names memory without touching it)."""
    from memra_cuda import DeviceBuffer
    from memra_cuda.buffers import KVData

    buf = DeviceBuffer.wrap(FAKE_PTR, np.uint8, 2 * 10 * 16)
    KVData(buf, row_stride=160, pos_stride=16, nbytes=16, capacity=10, batch=2)  # [B][capacity][16 bytes]
    KVData(buf, row_stride=16, pos_stride=32, nbytes=16, capacity=10, batch=2)  # [capacity][B][16 bytes]
    for bad, match in ((dict(nbytes=6, pos_stride=8, row_stride=80), "multiples of 4"),
                       (dict(pos_stride=8), "cannot hold"),
                       (dict(row_stride=80), "overlap"),
                       (dict(row_stride=0), "overlap"),
                       (dict(row_stride=176, capacity=11), "reach")):
        with pytest.raises(ValueError, match=match):
            KVData(buf, **{**dict(row_stride=160, pos_stride=16, nbytes=16, capacity=10, batch=2), **bad})
    with pytest.raises(ValueError, match="aligned"):
        KVData(DeviceBuffer.wrap(FAKE_PTR + 2, np.uint8, 400), row_stride=160, pos_stride=16, nbytes=16, capacity=10,
               batch=2)


def test_the_likeliest_tree_holds_the_nodes_of_highest_chance():
    """Every node's chance is the product of right * fall**rank along its path; the tree holds the
    `size` highest (ties aside), each chosen node's parent is chosen, and the limits hold."""
    tree = TreeShape.likeliest(20, depth=5, right=0.7, fall=0.4, ranks=3)
    assert tree.nodes == 21 and tree.depth <= 5 and max(tree.rank) < 3

    def chance(i: int) -> float:
        p, c = i, 1.0
        while tree.parent[p] >= 0:
            c, p = c * 0.7 * 0.4 ** tree.rank[p], tree.parent[p]
        return c
    chosen = sorted(chance(i) for i in range(1, tree.nodes))
    # the best node left out: a child of a chosen node (or of the root) that is not in the tree
    taken = {(tree.parent[i], tree.rank[i]) for i in range(1, tree.nodes)}
    left = [chance(p) * 0.7 * 0.4 ** r for p in range(tree.nodes) for r in range(3)
            if (p, r) not in taken and tree.depths[p] < 5]
    assert max(left) <= chosen[0] + 1e-12
    assert TreeShape.likeliest(6, right=0.8, fall=0.3).parent == tuple(range(-1, 6)), "a sure draft's tree is a line"
    assert TreeShape.likeliest(3, right=1.0, fall=1.0, ranks=3, depth=1).parent == (-1, 0, 0, 0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(size=0), "size must be"), (dict(size=4, depth=0), "depth must be"), (dict(size=4, ranks=0), "ranks must be"),
    (dict(size=4, right=0.0), "likeliest tree"), (dict(size=4, fall=1.5), "likeliest tree"),
    (dict(size=4, depth=1, ranks=3), "likeliest tree"), (dict(size=7, depth=2, ranks=2), "likeliest tree")])
def test_the_likeliest_tree_refuses_what_makes_no_tree(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TreeShape.likeliest(**kwargs)


def test_the_likeliest_tree_of_chances_past_a_floats_range_is_still_the_likeliest():
    """A node's chance, right**depth * fall**(its ranks' sum), underflowed to 0.0 for an absurd
    right or fall (1e-300, or the least float): such nodes were ordered by their paths, a line of
    first candidates, so likeliest(20, depth=8, right=1e-300, ranks=4) was 8 deep where its 20 most
    likely nodes are the 4 + 16 of depths 1 and 2. They are ordered by their log chances: the
    tree's nodes are as likely as the `size` best paths (by brute force), at the limits too."""
    def logs(right, fall, nodes):  # each (depth, ranks' sum)'s log chance, in order
        return sorted(d * math.log(right) + s * math.log(fall) for d, s in nodes)

    assert TreeShape.likeliest(20, depth=8, right=1e-300, ranks=4).levels == ((0, 1), (1, 5), (5, 21))
    least = 5e-324  # the least float above 0
    for size, depth, right, fall, ranks in (
            (20, 8, 1e-300, 0.5, 4), (20, 6, 0.6, 1e-300, 3), (20, 6, 1e-300, 1e-300, 3), (30, 5, least, 1.0, 3),
            (30, 5, 0.9, least, 3), (12, 6, least, least, 2), (40, 4, 1e-160, 0.999, 4), (25, 4, 1.0, 1e-200, 4)):
        tree = TreeShape.likeliest(size, depth=depth, right=right, fall=fall, ranks=ranks)
        sums = [0]  # each node's ranks' sum along its path
        for p, r in zip(tree.parent[1:], tree.rank[1:]):
            sums.append(sums[p] + r)
        every = [(d, sum(path)) for d in range(1, depth + 1) for path in itertools.product(range(ranks), repeat=d)]
        assert logs(right, fall, zip(tree.depths[1:], sums[1:])) == pytest.approx(
            logs(right, fall, every)[-size:], rel=1e-12), (size, depth, right, fall, ranks)


def test_the_likeliest_tree_is_bounded_by_the_mask():
    assert TreeShape.likeliest(MAX_TREE_NODES - 1).nodes == MAX_TREE_NODES
    with pytest.raises(ValueError, match="2 to"):
        TreeShape.likeliest(MAX_TREE_NODES)


def test_kv_data_of_a_layer_and_a_table_refuse_what_kernel_15_cannot_read():
    """KVData.from_layer wants the layer's data_d laid out [B][capacity][width]; a KVDataTable at
    least one entry, KVData or None, all of one batch: each refused before the table is made
    (no driver: the table's engine is never reached)."""
    from memra_cuda import DeviceBuffer, KVLayer
    from memra_cuda.buffers import KVData, KVDataTable

    lengths = DeviceBuffer.wrap(FAKE_PTR, np.int32, 2)
    with pytest.raises(ValueError, match="has no data_d to compact"):
        KVData.from_layer(KVLayer(lengths, 10))
    with pytest.raises(ValueError, match=r"is not \[2\]\[10\]\[width\]"):
        KVData.from_layer(KVLayer(lengths, 10, DeviceBuffer.wrap(FAKE_PTR, np.uint32, 2 * 10 * 4 + 1)))
    # a data_d smaller than its capacity for each row, whose bursts would run past it, at the limit
    with pytest.raises(ValueError, match="data_d of 19 elements cannot hold a capacity of 10 for each of 2 seq"):
        KVLayer(lengths, 10, DeviceBuffer.wrap(FAKE_PTR, np.uint32, 2 * 10 - 1))
    assert KVLayer(lengths, 10, DeviceBuffer.wrap(FAKE_PTR, np.uint32, 2 * 10)).capacity == 10
    # the lengths are i32: a capacity past 2**31 - 1 let them wrap; at the limit it is taken
    assert KVLayer(lengths, 2**31 - 1).capacity == 2**31 - 1
    with pytest.raises(ValueError, match=r"capacity must be an int from 1 to 2147483647, not 2147483648"):
        KVLayer(lengths, 2**31)
    two = KVData.from_layer(KVLayer(lengths, 10, DeviceBuffer.wrap(FAKE_PTR, np.uint32, 2 * 10 * 4)))
    assert (two.batch, two.row_stride, two.pos_stride, two.nbytes) == (2, 160, 16, 16)
    one = KVData(DeviceBuffer.wrap(FAKE_PTR, np.uint8, 160), row_stride=160, pos_stride=16, nbytes=16, capacity=10,
                 batch=1)
    # one row's stride bounds nothing, but is a u64 of the record: 2**64 met the packing's bare OverflowError
    assert KVData(one.k_d, row_stride=2**64 - 4, pos_stride=16, nbytes=16, capacity=10, batch=1).row_stride == 2**64 - 4
    with pytest.raises(ValueError, match=r"^row_stride must be an int from 0 to 18446744073709551615, "
                                         r"not 18446744073709551616$"):
        KVData(one.k_d, row_stride=2**64, pos_stride=16, nbytes=16, capacity=10, batch=1)
    with pytest.raises(ValueError, match="at least one entry"):
        KVDataTable(None, [])
    with pytest.raises(TypeError, match="entry 1 must be a KVData"):
        KVDataTable(None, [two, "k"])
    with pytest.raises(ValueError, match=r"the same batch B, not \[1, 2\]"):
        KVDataTable(None, [two, None, one])
    # one memory named twice: kernel 15's blocks (one a record's K or V) would race over it, depth by depth
    with pytest.raises(ValueError, match="layer 2's K is at the address of layer 0's K"):
        KVDataTable(None, [two, None, two])
    with pytest.raises(ValueError, match="layer 0's V is at the address of layer 0's K"):
        KVDataTable(None, [KVData(two.k_d, two.k_d, row_stride=160, pos_stride=16, nbytes=16, capacity=10, batch=2)])


@pytest.mark.parametrize("kind", NUMPY_INTS)
def test_numpy_counts_make_the_same_dynamic_tree_as_plain_ints(kind):
    """The checked plain ints are kept, not the numpy values given, whose arithmetic wraps:
    DynamicTree(np.uint8(3), np.uint8(4), np.uint8(2)) had 13 nodes but 249 mask words
    (-(-13 // 32) in uint8), and a uint8 depth 3 x width 100 passed the mask's limit as 45 nodes."""
    for depth, width, branch in ((3, 4, 2), (1, 1, 1), (8, 31, 2), (5, 51, 2), (2, 64, MAX_TREE_OFFERS // 64)):
        plain, given = DynamicTree(depth, width, branch), DynamicTree(kind(depth), kind(width), kind(branch))
        assert [type(getattr(given, name)) for name in ("depth", "width", "branch")] == [int] * 3
        assert (given.nodes, given.levels, given.expanded) == (plain.nodes, plain.levels, plain.expanded)
        assert type(given.nodes) is int and Geometry.of_tree(given, 4, 2) == Geometry.of_tree(plain, 4, 2)
        assert tree_bufs(given).words == tree_bufs(plain).words == -(-plain.nodes // 32)
    with pytest.raises(ValueError, match="at most 256 nodes"):
        DynamicTree(kind(3), kind(100), kind(2))
    with pytest.raises(ValueError, match="offers"):
        DynamicTree(kind(2), kind(64), kind(MAX_TREE_OFFERS // 64 + 1))


def test_a_tree_given_directly_keeps_tuples_of_plain_ints_whatever_it_was_given():
    """Lists, numpy arrays and numpy integers become the tuples of ints a frozen, hashable tree
    holds (a list left it unhashable, an array met numpy's "truth value is ambiguous")."""
    expected = TreeShape((-1, 0, 0), (0, 0, 1))
    for parent, rank in (([-1, 0, 0], [0, 0, 1]), (np.array([-1, 0, 0]), np.array([0, 0, 1], np.uint8)),
                         ((np.int64(-1), np.int32(0), np.uint16(0)), (0, np.uint32(0), 1))):
        tree = TreeShape(parent, rank)
        assert tree == expected and hash(tree) == hash(expected)
        assert type(tree.parent) is tuple and type(tree.rank) is tuple
        assert {type(value) for value in tree.parent + tree.rank} == {int}
    assert TreeShape((-1, 0), (0, MAX_TREE_CANDIDATES - 1)).draws == MAX_TREE_CANDIDATES


@pytest.mark.parametrize(("parent", "rank", "error", "message"), [
    ((-1, 0, 0), (0, 0, 1.9), TypeError, "node 2's rank must be an integer, not 1.9"),
    ((-1, 0, 0), (0, 0, "1"), TypeError, "node 2's rank must be an integer, not '1'"),
    ((-1, True), (0, 0), TypeError, "node 1's parent must be an integer, not True"),
    ((-1, 0), (0, np.bool_(True)), TypeError, "node 1's rank must be an integer, not "),
    ((-1, 0.0), (0, 0), TypeError, "node 1's parent must be an integer, not 0.0"),
    ((-1, 0), (0, 2**40), ValueError, f"node 1's rank must be an int from 0 to {MAX_TREE_CANDIDATES - 1}, not "
                                      f"{2**40}"),
    ((-1, 0), (0, MAX_TREE_CANDIDATES), ValueError,
     f"node 1's rank must be an int from 0 to {MAX_TREE_CANDIDATES - 1}, not {MAX_TREE_CANDIDATES}"),
    ((-1, 0), (0, -1), ValueError, "node 1's rank must be an int from 0"),
    ((-1, 0), {0: 0, 1: 0}, TypeError, "rank must be a list, a tuple or a 1-D array"),
    # bytes in a bytearray or a memoryview were listed as their ints where bytes were refused
    ((-1, 0), bytearray(2), TypeError, "rank must be a list, a tuple or a 1-D array of ints, one a node, not "
                                       "bytearray"),
    ((-1, 0), memoryview(bytes(2)), TypeError, "rank must be a list, a tuple or a 1-D array"),
    ((-1, 0), b"\x00\x00", TypeError, "rank must be a list, a tuple or a 1-D array"),
    ("-10", (0, 0, 0), TypeError, "parent must be a list, a tuple or a 1-D array"),
    (np.array([[-1, 0]]), (0, 0), TypeError, "parent must be a list, a tuple or a 1-D array"),
])
def test_a_tree_given_directly_refuses_what_is_no_int_naming_the_field_and_the_node(parent, rank, error, message):
    """A float rank was uploaded truncated (1.9 as 1), a bool parent read as 0 or 1, a rank past
    a u32 met an OverflowError only when TreeBufs packed it: each refused when the tree is made."""
    with pytest.raises(error, match=f"^{message}"):
        TreeShape(parent, rank)


@pytest.mark.parametrize(("make", "error", "message"), [
    (lambda: TreeShape.from_parents([-1, 0.7]), TypeError, r"parents\[1\] must be an integer, not 0.7"),
    (lambda: TreeShape.from_parents([-1, "0"]), TypeError, r"parents\[1\] must be an integer, not '0'"),
    (lambda: TreeShape.from_parents([-1, 0, True]), TypeError, r"parents\[2\] must be an integer, not True"),
    (lambda: TreeShape.from_parents({-1: 0}), TypeError, "parents must be a list, a tuple or a 1-D array"),
    (lambda: TreeShape.from_parents([-1] + [0] * MAX_TREE_NODES), ValueError,
     f"parents holds at most {MAX_TREE_NODES} ints, one a node, not {MAX_TREE_NODES + 1}"),
    # counted before they are listed: range(10**8) was listed (9 s, 4 GB) before it was refused
    (lambda: TreeShape.from_parents(range(10**8)), ValueError, f"parents holds at most {MAX_TREE_NODES} ints"),
    (lambda: TreeShape(range(10**8), range(10**8)), ValueError, f"parent holds at most {MAX_TREE_NODES} ints"),
    # a len() past sys.maxsize met OverflowError: "Python int too large to convert to C ssize_t", naming nothing
    (lambda: TreeShape.from_parents(range(10**20)), ValueError,
     rf"parents holds at most {MAX_TREE_NODES} ints, one a node, not more than \d+"),
    (lambda: TreeShape.from_choices([[0]] * MAX_TREE_NODES), ValueError,
     f"choices holds at most {MAX_TREE_NODES - 1} paths of ranks, not {MAX_TREE_NODES}"),
    (lambda: TreeShape.from_choices([range(10**8)]), ValueError, rf"choices\[0\] holds at most {MAX_TREE_NODES - 1}"),
    (lambda: TreeShape.from_choices([[True]]), TypeError, r"choices\[0\]\[0\] must be an integer, not True"),
    (lambda: TreeShape.from_choices([[0], [0.0, 1]]), TypeError, r"choices\[1\]\[0\] must be an integer"),
    (lambda: TreeShape.from_choices([[0], [MAX_TREE_CANDIDATES]]), ValueError,
     rf"choices\[1\]\[0\] must be an int from 0 to {MAX_TREE_CANDIDATES - 1}"),
    (lambda: TreeShape.from_choices("01"), TypeError, "choices must be a list, a tuple or a 1-D array of paths"),
    (lambda: TreeShape.from_choices([[0], "1"]), TypeError, r"choices\[1\] must be a list, a tuple or a 1-D array"),
    # text and bytes alike: a bytearray path was read as ranks, a UserString's characters as what is no rank
    (lambda: TreeShape.from_choices([[0], bytearray(b"\x00\x01")]), TypeError,
     r"choices\[1\] must be a list, a tuple or a 1-D array of ranks, not bytearray"),
    (lambda: TreeShape.from_choices([[0], memoryview(b"\x00")]), TypeError, r"choices\[1\] must be a list, a tuple"),
    (lambda: TreeShape.from_choices([[0], UserString("1")]), TypeError, r"choices\[1\] must be a list, a tuple"),
    (lambda: TreeShape.from_choices(UserString("01")), TypeError, "choices must be a list, a tuple or a 1-D array"),
])
def test_parents_and_choices_refuse_floats_strings_and_bools_naming_them(make, error, message):
    """int(p) made [-1, 0.7] a tree of parent 0 and parsed [-1, "0"]; a choice of True was rank 1."""
    with pytest.raises(error, match=message):
        make()


def test_from_parents_refuses_a_node_of_too_many_children_naming_the_index_given():
    """A node's 33rd child has no candidate to hold (ranks are below MAX_TREE_CANDIDATES): it was
    refused as the reordered tree's "node 35's rank", another node of the parents given (35: a
    child of the root of rank 1). Named by its index in `parents` now; 32 children are taken."""
    most = [-1, 0] + [1] * MAX_TREE_CANDIDATES + [0]  # node 1's 32 children, then the root's second
    tree = TreeShape.from_parents(most)
    assert tree.nodes == MAX_TREE_CANDIDATES + 3 and tree.draws == MAX_TREE_CANDIDATES
    assert tree.rank[-1] == MAX_TREE_CANDIDATES - 1 and tree.parent[-1] == 1
    with pytest.raises(ValueError, match=rf"^parents\[{MAX_TREE_CANDIDATES + 2}\]'s rank among node 1's children "
                                         rf"\(at most {MAX_TREE_CANDIDATES} a node\) must be an int from 0 to "
                                         rf"{MAX_TREE_CANDIDATES - 1}, not {MAX_TREE_CANDIDATES}$"):
        TreeShape.from_parents([-1, 0] + [1] * (MAX_TREE_CANDIDATES + 1) + [0])
    with pytest.raises(ValueError, match=rf"^parents\[{MAX_TREE_CANDIDATES + 1}\]'s rank among node 0's"):
        TreeShape.from_parents([-1] + [0] * (MAX_TREE_CANDIDATES + 1))


def test_parents_and_choices_of_numpy_ints_are_the_trees_of_plain_ones():
    assert TreeShape.from_parents(np.array([-1, 0, 1, 0])) == TreeShape.from_parents([-1, 0, 1, 0])
    assert TreeShape.from_choices([np.array([0]), (np.uint8(1),)]) == TreeShape.from_choices([[0], [1]])
    assert TreeShape.from_choices([[0], [MAX_TREE_CANDIDATES - 1]]).draws == MAX_TREE_CANDIDATES


def test_the_likeliest_tree_is_at_most_a_nodes_candidates_wide_and_takes_chances_as_numbers():
    """ranks=10**9 filled the search's frontier with a path per rank (13 GB, and never returned);
    right="a" met "'<' not supported" inside it. Each is refused by name, before the search."""
    assert TreeShape.likeliest(20, depth=2, ranks=MAX_TREE_CANDIDATES).nodes == 21
    with pytest.raises(ValueError, match=f"^ranks must be an int from 1 to {MAX_TREE_CANDIDATES}, not 1000000000$"):
        TreeShape.likeliest(200, depth=2, ranks=10**9)
    for name, value in (("right", "a"), ("fall", None), ("right", True), ("fall", [0.5])):
        with pytest.raises(TypeError, match=f"^a likeliest tree's {name} must be a real number, not "):
            TreeShape.likeliest(5, **{name: value})
    with pytest.raises(ValueError, match="^a likeliest tree's fall must be a finite number"):
        TreeShape.likeliest(5, fall=10**400)
    assert TreeShape.likeliest(5, right=np.float32(0.5), fall=np.float64(0.25)) == \
        TreeShape.likeliest(5, right=0.5, fall=0.25)


@pytest.mark.parametrize("tree", [DynamicTree(3, 11, 2), TreeShape.likeliest(40, depth=6, ranks=4)],
                         ids=["dynamic", "static"])
def test_the_tree_kernels_refuse_counts_that_disagree_when_a_launch_is_prepared(tree):
    """The kernels find every field of a tree's allocation from T1, W, D and B alone and write the
    levels' ranges: a TreeBufs whose counts disagree (changed after it was made, or made of a tree
    whose numpy counts wrapped) is refused by name when a launch is prepared, not trusted."""
    kernels = TreeKernels.__new__(TreeKernels)  # no module: every refusal comes before a kernel is asked for
    kernels.module = None
    bufs = tree_bufs(tree)
    assert kernels._tree(bufs.bufs, bufs) == dict(tree=bufs._arena, T1=tree.nodes, W=2, D=tree.depth, B=2)
    (start, stop), depth = bufs.levels[-1], tree.depth
    for name, value, message in (
            ("words", 3, "mask words W = 3 disagree with its T1"), ("words", 1, "mask words W = 1 disagree"),
            ("nodes", tree.nodes + 1, rf"T1 = {tree.nodes + 1} and D = {depth} disagree with its buffers' width"),
            ("nodes", np.uint16(tree.nodes - 1), rf"T1 = {tree.nodes - 1} and D = {depth} disagree"),
            ("nodes", MAX_TREE_NODES + 1, f"T1 must be an int from 2 to {MAX_TREE_NODES}"),
            ("depth", depth + 1, f"D = {depth + 1} disagree"), ("depth", tree.nodes, "D must be an int from 1"),
            ("levels", (*bufs.levels[:-1], (start, stop + 1)), f"level {depth}, .* disagrees"),
            ("levels", (*bufs.levels[:-2], (bufs.levels[-2][0], start + 1), (start + 1, stop)),
             "levels .* disagree with those of the tree its buffers were made for"),
            ("levels", ((0, 2), *bufs.levels[1:]), "level 0"),
            ("levels", bufs.levels[:-1], rf"D \+ 1 = {depth + 1} ranges, not {depth}"),
            ("_arena", bufs._arena.view(0, bufs._arena.len - 1), "allocation holds")):
        good = getattr(bufs, name)
        setattr(bufs, name, value)
        with pytest.raises(ValueError, match=message):
            kernels.prepare_begin(bufs.bufs, bufs)
        setattr(bufs, name, good)

"""The trees' host side, on the CPU (torch and transformers, no GPU): the ancestor mask (TreeMask,
whole from a static tree's parents or a level at a time from mask_d's words), a level's best
candidates, the BLAS library a forward's rows take, the tree the benchmark picked at each batch
size (benchmarks/picks.py), a tree named in a line (parse_tree), and the trees the bench's trees
section measures and how it names them. The examples' command line: tests/examples."""
from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

from memra_cuda import DynamicTree, TreeShape
from memra_cuda.buffers.layout import ROOT_PARENT

torch = pytest.importorskip("torch", reason="needs PyTorch (pip install '.[torch]' in the checkout)")
pytest.importorskip("transformers", reason="memra_cuda.torch.testing needs transformers")
from memra_cuda.torch.testing import parse_tree, static_tree  # noqa: E402
from memra_cuda.testing import reference_tree as rt  # noqa: E402
from memra_cuda.torch import TreeMask, best_ranks  # noqa: E402
from memra_cuda.torch.tree import ChildPlacement, top_ranks, tree_start  # noqa: E402
from memra_cuda.torch.stack import blas_for  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.mark.parametrize("static", [True, False], ids=["static", "from-words"])
def test_the_mask_is_each_nodes_ancestors_and_the_prefix(static):
    """TreeMask, made whole from a static tree's parents or a level at a time from mask_d's
    words, attends (0) to the prefix and to each node's ancestors and nowhere else (-inf)."""
    tree = TreeShape.likeliest(40, depth=6, ranks=4)  # 41 nodes: two mask words, bit 31 among them
    n, words = tree.nodes, -(-tree.nodes // 32)
    ancestors = []
    for i in range(n):
        mine, p = {i}, tree.parent[i]
        while p >= 0:
            mine.add(p)
            p = tree.parent[p]
        ancestors.append(mine)
    bits = np.zeros((2, n, words), np.uint32)
    for i, mine in enumerate(ancestors):
        for j in mine:
            bits[:, i, j // 32] |= np.uint32(1 << j % 32)
    start = torch.tensor([[3], [20]])
    mask = TreeMask(torch.from_numpy(bits.view(np.int32)), 80, torch.bfloat16, tree if static else None).at(start)
    got = torch.cat([mask.rows(a, b) for a, b in tree.levels], 2)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 1, n, 80) and mask.rows(0, n).is_contiguous()
    for b, at in enumerate((3, 20)):
        for i in range(n):
            want = [0.0 if s < at or (s - at in ancestors[i]) else -np.inf for s in range(80)]
            assert got[b, 0, i].float().tolist() == want, f"row {b}, node {i}"


def test_a_mask_refuses_a_capacity_a_tree_and_words_it_cannot_serve():
    """A capacity of 2.5 made 3 slots and True 1; a tree of more nodes than the words' 32W bits,
    and words not [B][T+1][W], met a bare IndexError. Each is refused by name, a tree of 32 nodes
    on one word and the capacities from 1 to MOST_SLOTS taken."""
    from memra_cuda.torch.attention import MOST_SLOTS
    one = torch.zeros(1, 33, 1, dtype=torch.int32)
    for capacity, error, message in ((2.5, TypeError, "capacity must be an integer, not 2.5"),
                                     (True, TypeError, "capacity must be an integer, not True"),
                                     (0, ValueError, f"capacity must be an int from 1 to {MOST_SLOTS}, not 0"),
                                     (MOST_SLOTS + 1, ValueError, f"capacity must be an int from 1 to {MOST_SLOTS}")):
        with pytest.raises(error, match=message):
            TreeMask(one, capacity, torch.float32)
    assert TreeMask(one, 1, torch.float32).slots.tolist() == [0]
    with pytest.raises(ValueError, match="a tree of 33 nodes takes 2 mask words a node, not the 1 TreeMask's words"):
        TreeMask(one, 64, torch.float32, TreeShape.chain(32))
    whole = TreeMask(one, 64, torch.float32, TreeShape.chain(31)).at(torch.tensor([[0]])).rows(0, 32)
    assert whole.shape == (1, 1, 32, 64) and (whole[0, 0, 31, :32] == 0).all()  # the last node sees every node
    with pytest.raises(ValueError, match=re.escape("TreeMask's words are [B][T+1][W], not [33, 1]")):
        TreeMask(one[0], 64, torch.float32)
    for words, named in ((one.long(), "torch.int64"), (one.numpy(), "ndarray"), ([[[0]]], "list")):
        with pytest.raises(TypeError, match=f"TreeMask's words are mask_d's 32-bit words, an int32 tensor, "
                                            f"not {named}$"):
            TreeMask(words, 64, torch.float32)
    # an int dtype met torch's "value cannot be converted to type int without overflow" (-inf), a name its
    # "zeros(): argument 'dtype'", and a bool or float8 one was taken: a bool mask that never is True, attending
    # everywhere, and no -inf in float8_e4m3fn; a tree that is none met "'str' object has no attribute 'nodes'"
    for dtype in (torch.int32, torch.bool, torch.float8_e4m3fn, "float32"):
        with pytest.raises(TypeError, match=re.escape(f"TreeMask's dtype is a floating-point torch.dtype of 2 bytes "
                                                      f"or more (the model's: its 0 and -inf), not {dtype!r}")):
            TreeMask(one, 64, dtype)
    with pytest.raises(TypeError, match="TreeMask's tree is a TreeShape, a DynamicTree or None, not 'chain'"):
        TreeMask(one, 64, torch.float32, "chain")
    assert TreeMask(one, 64, torch.float16).never.dtype == torch.float16  # 2 bytes: taken


def test_a_levels_best_candidates_are_torch_topks_best_first_ties_to_the_lower_index():
    logits = torch.randn(3, 5, 1000, generator=torch.Generator().manual_seed(0))
    for k in (1, 2, 4, 9):  # 9: past ARGMAX_RANKS, torch.topk's
        cand_tok = torch.full((3, 7, k), -1)
        best_ranks(logits.clone(), cand_tok[:, 1:6])  # a level's rows, strided
        assert torch.equal(cand_tok[:, 1:6], logits.topk(k, dim=-1).indices)
        assert (cand_tok[:, [0, 6]] == -1).all()  # the other levels' rows untouched
    tied = torch.zeros(1, 1, 8)
    tied[0, 0, [2, 6]] = 1.0
    assert best_ranks(tied, torch.empty(1, 1, 3, dtype=torch.long)).tolist() == [[[2, 6, 0]]]


def tied_logits(*shape: int, seed: int) -> torch.Tensor:
    """Logits with ties everywhere: rows of a few integer values (the best value many times),
    rows of a few values and -inf (fewer finite values than ranks, some), and plain normal rows."""
    gen = torch.Generator().manual_seed(seed)
    coarse = torch.randint(0, 3, shape, generator=gen).float()
    sparse = torch.where(torch.rand(shape, generator=gen) < 0.998, -torch.inf, coarse)
    kind = torch.randint(0, 3, (*shape[:-1], 1), generator=gen)
    return torch.where(kind == 0, coarse, torch.where(kind == 1, sparse, torch.randn(shape, generator=gen)))


def test_a_levels_ranks_out_of_place_are_best_ranks_ties_and_all():
    """top_ranks, which a compiled level places its children by, masks a rank out of place (by
    torch.where) where best_ranks scatters -inf into the level's logits: the same ranks, ties to
    the lower index (a row of fewer finite values than ranks repeats its last index, as the
    scatter does), and the logits left as they were."""
    logits = tied_logits(3, 5, 1000, seed=1)
    kept = logits.clone()
    for k in (1, 2, 3, 4, 6):  # 6: past ARGMAX_RANKS, torch.topk's on both sides
        want = best_ranks(logits.clone(), torch.full((3, 5, k), -1))
        assert torch.equal(top_ranks(logits, k), want), f"k = {k}"
    assert torch.equal(logits, kept) and torch.isinf(logits).any(), "a level's logits are read, not written"
    tied = torch.zeros(1, 1, 8)
    tied[0, 0, [2, 6]] = 1.0
    assert top_ranks(tied, 3).tolist() == [[[2, 6, 0]]]


def grown_tree(tree: TreeShape, candidates: int, logits: list, pend: np.ndarray,
               pos_start: np.ndarray) -> rt.TreeArrays:
    """A round's nodes as the grow kernel's rounds made them (the numpy reference's kernels 10
    and 11): begin, then for each level its candidates by best_ranks over its logits (log-
    probabilities 0: ranks alone) and the next level grown from them. Every score starts NaN, so
    one the kernels never wrote is no 0."""
    batch = len(pend)
    t = rt.TreeArrays.zeros(tree.nodes, tree.depth, batch)
    t.score[:] = np.nan
    rt.spec_tree_begin(t, pend.astype(np.uint32), pos_start.astype(np.int32), np.zeros(batch, np.int32),
                       np.zeros(batch * (tree.depth + 1), np.uint32), tree.depth, batch)
    cand_tok = torch.zeros(batch, tree.nodes, candidates, dtype=torch.long)
    zero = np.zeros(batch * tree.nodes * candidates, np.float32)
    for level, (start, stop) in enumerate(tree.expanded[:-1]):
        best_ranks(logits[level].clone(), cand_tok[:, start:stop])
        rt.spec_tree_grow(t, level + 1, tree.levels, cand_tok.numpy().reshape(-1), zero, zero, candidates, pos_start,
                          shape_parent=np.array([ROOT_PARENT, *tree.parent[1:]], np.uint32),
                          shape_rank=np.array(tree.rank, np.uint32), batch=batch)
    return t


PLACED_TREES = {"chain8,1": (TreeShape.chain_with_leaves(8, 1), 2), "leaves": (TreeShape.from_choices(
    [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [1, 0, 0], [0, 0, 0, 0]]), 3),
    "gapped": (TreeShape.from_choices([[0], [2], [0, 1], [2, 3]]), 4),
    "more-candidates": (TreeShape.likeliest(24, depth=5, ranks=3), 4),
    "topk": (TreeShape.likeliest(24, depth=5, ranks=3), 6)}


PLACED_CASES = [(name, False) for name in PLACED_TREES] + [("chain8,1", True), ("gapped", True)]


@pytest.mark.parametrize("name, compiled", PLACED_CASES,
                         ids=[f"{name}{'-compiled' if compiled else ''}" for name, compiled in PLACED_CASES])
def test_a_static_levels_placed_children_are_the_grown_trees(name, compiled):
    """ChildPlacement, the levels of a greedy static tree placing their children with no grow
    kernel: over logits with ties, every node's token is what the grown rounds' candidates and
    kernel 11 made it, tree_start's positions theirs too, and TreeShape.fixed_fields (TreeBufs'
    upload) their parent, depth, rank and mask; score 0 both ways. Three rows at other roots;
    op by op, and compiled as a decoder's draft compiles them (the CPU's inductor)."""
    tree, candidates = PLACED_TREES[name]
    compile_ = (lambda fn: torch.compile(fn, fullgraph=True, dynamic=False)) if compiled else (lambda fn: fn)
    batch, vocab, nodes = 3, 500, tree.nodes
    pend, pos_start = np.array([7, 11, 13]), np.array([5, 40, 1])
    logits = [tied_logits(batch, stop - start, vocab, seed=level) for level, (start, stop)
              in enumerate(tree.expanded[:-1])]
    want = grown_tree(tree, candidates, logits, pend, pos_start)
    made = SimpleNamespace(tok=torch.full((batch, nodes), -5, dtype=torch.int32),
                           pos=torch.full((batch, nodes), -5, dtype=torch.int32))
    made.tok[:, 0] = torch.from_numpy(pend)  # kernel 10's
    placement = ChildPlacement(tree, candidates, made, compile_)
    start = torch.from_numpy(pos_start).int()[:, None]
    zero = torch.zeros(batch, 1, dtype=torch.int32)
    compile_(tree_start)(made.tok[:, :1], start, zero, zero, torch.zeros(batch, tree.depth + 1, dtype=torch.int32),
                         torch.arange(nodes), placement.pos, placement.depths)
    for level, level_logits in enumerate(logits):
        kept = level_logits.clone()
        placement(level, level_logits)
        assert torch.equal(level_logits, kept)
    assert made.tok.numpy().astype(np.uint32).reshape(-1).tolist() == want.tok.tolist()
    assert made.pos.numpy().reshape(-1).tolist() == want.pos.tolist()
    for field, values in tree.fixed_fields().items():
        assert np.tile(values.reshape(-1), batch).tolist() == getattr(want, field).tolist(), field
    assert not want.score.any()
    assert want.tok.reshape(batch, nodes)[:, 1:].any(), "the tokens placed must not all be 0"


def test_a_forwards_rows_take_cublaslt_from_two_rows_up_to_LT_ROWS():
    fp32 = [blas_for(torch.float32, rows) for rows in (1, 2, 16, 17, 65)]
    assert fp32 == ["cublas", "cublaslt", "cublaslt", "cublas", "cublas"]
    assert [blas_for(torch.bfloat16, rows) for rows in (1, 2, 65, 4096)] == ["cublas"] + ["cublaslt"] * 3
    assert blas_for(torch.float16, 8) == "cublas"  # not measured: torch's default


def test_the_measured_tree_of_the_largest_batch_measured_below_is_picked():
    from benchmarks.picks import tree_for_batch
    assert tree_for_batch("large", 1) == static_tree(64, 10)
    assert tree_for_batch("large", 4) == static_tree(64, 10)  # B = 1's, the largest measured below
    assert tree_for_batch("large", 16) == static_tree(32, 8)
    assert tree_for_batch("large", 4096) == static_tree(6, 4)
    assert tree_for_batch("large", 1, sampled=True) is None and tree_for_batch("small", 8) is None
    assert tree_for_batch("small", 1) == TreeShape.chain_with_leaves(10, 2)
    assert tree_for_batch("small", 200) == static_tree(6, 4)


def test_the_tree_picked_for_a_batch_refuses_what_names_no_batch_size_or_mode():
    """tree_for_batch read True as a batch of 1, 0 and -5 as the smallest measured, 2.5 as B = 1;
    a size of none measured was a bare KeyError, and sampled= was read by its truth ("no": the
    chain), before the size was looked at. Each refused by name; the most rows a decoder takes
    pass (MAX_BATCH), one more is refused."""
    from benchmarks.picks import tree_for_batch
    from memra_cuda.buffers.geometry import MAX_BATCH
    assert tree_for_batch("large", MAX_BATCH) == tree_for_batch("large", np.int64(200)) == static_tree(6, 4)
    for batch, error, message in ((True, TypeError, "batch must be an integer, not True"),
                                  (2.5, TypeError, "batch must be an integer, not 2.5"),
                                  (0, ValueError, f"batch must be an int from 1 to {MAX_BATCH}, not 0"),
                                  (-5, ValueError, "batch must be an int from 1"),
                                  (MAX_BATCH + 1, ValueError, f"batch must be an int from 1 to {MAX_BATCH}, not")):
        with pytest.raises(error, match=f"^{message}"):
            tree_for_batch("large", batch)
    for size in ("medium", None, ["large"]):
        with pytest.raises(ValueError, match=re.escape("size is one of 'small', 'large': the models measured, not ")):
            tree_for_batch(size, 1, sampled=True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="^sampled must be True or False, not 'no'"):
        tree_for_batch("large", 1, sampled="no")  # type: ignore[arg-type]


def test_a_tree_on_the_command_line_is_static_or_dynamic_or_refused():
    assert parse_tree("static:16") == static_tree(16)
    assert parse_tree("static:16,4") == static_tree(16, 4) != static_tree(16)
    assert parse_tree("dynamic:4,3,3") == DynamicTree(4, 3, 3)
    assert parse_tree("chain:10,2") == TreeShape.chain_with_leaves(10, 2)
    for text in ("static", "static:a", "static:1,2,3", "dynamic:4,3", "tree:3", "chain:10"):
        with pytest.raises(ValueError, match="a tree is"):
            parse_tree(text)
    for given in (5, None, b"static:16"):  # 5 met "'int' object has no attribute 'partition'"
        with pytest.raises(TypeError, match=r'^a tree is "static:N\[,DEPTH\]", .* \(a str\), not '):
            parse_tree(given)  # type: ignore[arg-type]


def test_the_bench_measures_each_pick_once_among_its_kind():
    from benchmarks.torch_engine import _tree_candidates
    listed, extra = static_tree(32, 8), static_tree(20, 5)  # STATIC_TREES[8] lists the first only
    candidates = _tree_candidates([listed, extra], 8, quick=False)
    statics = [config for kind, config in candidates if kind == "static"]
    assert statics.count(listed) == 1 and statics[-1] == extra
    assert statics[-2] == TreeShape.chain_with_leaves(8, 1)  # the section's own, "chain:8,1"
    assert [config for kind, config in candidates if kind == "chain"] == [6, 8, 10]


def test_the_bench_names_a_chain_with_leaves_apart_from_a_likeliest_tree():
    from benchmarks.torch_common import tree_label
    assert tree_label(TreeShape.chain_with_leaves(10, 2)) == "k=10, 2 leaves"
    assert tree_label(TreeShape.chain_with_leaves(8, 1)) == "k=8, 1 leaf"
    assert tree_label(TreeShape.chain(4)) == "T=4, depth 4"
    assert tree_label(static_tree(32, 8)) == "T=32, depth 8"
    assert tree_label(DynamicTree(4, 3, 2)) == "4x3, branch 2"


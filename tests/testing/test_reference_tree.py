"""memra_cuda.testing.reference_tree, the numpy statement of the tree kernels (docs/trees.md), and the
theorem sampled trees exist for: committed tokens are distributed as the target's own sampling.

The reference is the oracle of the tree kernels' GPU tests, so its behaviour is pinned here: a tree
of one branch computes exactly what the chain's reference computes (greedy and sampled, draws
included); greedy acceptance agrees with a brute force over random trees of garbage; the sampled
rule is exact by exact enumeration (no Monte Carlo), and each rule docs/sampling.md names as
breaking exactness is measured to break it; and the Philox-keyed code path itself passes a
chi-square against the target. Runs on CPU.
"""
from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from memra_cuda.buffers.layout import (ACC_ROUND, BRK_COUNT, BRK_MARK, BRK_WORDS, CTL_DONE, CTL_KEEP, CTL_WORDS,
                                      ROOT_PARENT, VOID_RANK)
from memra_cuda.testing import reference as ref
from memra_cuda.testing import reference_tree as rt
from memra_cuda.testing.philox import uniform

from laws import CHI2_999, CLOSE, FAR, TARGET, assert_distributed_as, chi_square

NAN = float("nan")
SENTINEL = 0xDEAD


def u32(*words: int) -> np.ndarray:
    return np.array(words, np.uint32)


def levels_of(parents: list[int]) -> list[tuple[int, int]]:
    """The level ranges of a level-ordered tree given by its parents (node 0's is -1)."""
    depth = [0]
    for c in range(1, len(parents)):
        depth.append(depth[parents[c]] + 1)
    assert depth == sorted(depth), "level order"
    return [(depth.index(d), len(depth) - depth[::-1].index(d)) for d in range(max(depth) + 1)]


def round_state(batch: int, k: int, rng: np.random.Generator, done=(), marks: int = 0) -> dict[str, np.ndarray]:
    """Fresh round-stream buffers: vtok of sentinels, a break counter, random totals, done flags;
    with `marks`, each row's mark drawn from 0 to `marks` - 1 (0 in about half the rows: no cap;
    i + 1 caps the row at i drafts, as the length chooser writes it)."""
    ctl = np.tile(np.array([-1, -1, 0, 9], np.int32), batch)
    for b in done:
        ctl[CTL_WORDS * b + CTL_DONE] = 1
    brk = np.tile(u32(0, 5), batch)
    if marks:
        brk[BRK_MARK::BRK_WORDS] = np.where(rng.random(batch) < 0.5, 0, rng.integers(0, marks, batch))
    return dict(vtok=np.full(batch * (k + 1), SENTINEL, np.uint32),
                brk=brk, acc=rng.integers(0, 2**32, 2 * batch).astype(np.uint32),
                last_pred=np.full(batch, 77, np.uint32), ctl=ctl)


def static_tree(parents: list[int], ranks: list[int], cand_tok: np.ndarray, cand_logq: np.ndarray,
                pend: np.ndarray, pos_ctr: np.ndarray, vtok: np.ndarray, k: int, batch: int) -> rt.TreeArrays:
    """A static tree built by the kernels' own sequence: begin, then grow level by level from the
    given candidates ([B][T1][K])."""
    levels = levels_of(parents)
    t = rt.TreeArrays.zeros(len(parents), len(levels) - 1, batch)
    pos_start = np.zeros(batch, np.int32)
    rt.spec_tree_begin(t, pend, pos_ctr, pos_start, vtok, k, batch)
    shape_parent = np.array([p % 2**32 for p in parents], np.uint32)
    for level in range(1, len(levels)):
        rt.spec_tree_grow(t, level, levels, cand_tok.reshape(-1), cand_logq.reshape(-1), cand_logq.reshape(-1),
                          cand_tok.shape[-1], pos_start, shape_parent=shape_parent,
                          shape_rank=np.array(ranks, np.uint32), batch=batch)
    return t


def chain(k: int) -> tuple[list[int], list[int]]:
    """A one-branch tree of depth k: node i's parent i - 1, rank 0."""
    return [-1] + list(range(k)), [0] * (k + 1)


def law(rng: np.random.Generator, V: int, zeros: float = 0.2) -> np.ndarray:
    w = rng.random(V) ** 3
    w[rng.random(V) < zeros] = 0
    w[rng.integers(V)] += 0.1
    return w / w.sum()


# -- 1. a tree of one branch is the chain ----------------------------------------------------

@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("k", [0, 1, 4])
def test_one_branch_greedy_equals_the_chain(k, batch):
    rng = np.random.default_rng(10 * k + batch)
    for case in range(30):
        done = [b for b in range(batch) if rng.random() < 0.2]
        drafts = rng.integers(0, 3, (batch, max(k, 1))).astype(np.uint32)
        pred = rng.integers(0, 3, (batch, k + 1)).astype(np.int64)
        agree = rng.random((batch, k)) < 0.7
        pred[:, :k] = np.where(agree, drafts[:, :k], pred[:, :k])
        pend, pos_ctr = rng.integers(0, 100, batch).astype(np.uint32), rng.integers(0, 2**31, batch).astype(np.int32)
        chain_state = round_state(batch, k, rng, done, marks=k + 2)
        tree_state = {name: words.copy() for name, words in chain_state.items()}
        chain_state["vtok"] = np.concatenate([pend[:, None], drafts[:, :k]], axis=1).astype(np.uint32).reshape(-1)
        ref.spec_accept_greedy_dc(chain_state["vtok"], pred.reshape(-1), k, chain_state["brk"], chain_state["acc"],
                                  chain_state["last_pred"], chain_state["ctl"], batch)

        parents, ranks = chain(k)
        cand = np.zeros((batch, k + 1, 1), np.int64)
        cand[:, :k, 0] = drafts[:, :k]
        t = static_tree(parents, ranks, cand, np.zeros(cand.shape, np.float32), pend, pos_ctr, tree_state["vtok"], k,
                        batch)
        rt.spec_tree_accept_greedy(t, pred.reshape(-1), k, tree_state["vtok"], tree_state["brk"], tree_state["acc"],
                                   tree_state["last_pred"], tree_state["ctl"], batch)
        for name in ("brk", "acc", "last_pred", "ctl"):
            assert tree_state[name].tolist() == chain_state[name].tolist(), f"case {case}: {name}"
        for b in range(batch):
            a = int(tree_state["acc"][2 * b])
            vtok = tree_state["vtok"].reshape(batch, k + 1)[b]
            assert vtok[:1 + a].tolist() == chain_state["vtok"].reshape(batch, k + 1)[b, :1 + a].tolist()
            assert (vtok[1 + a:] == SENTINEL).all(), "vtok past the accepted drafts is untouched"
            assert t.row(b).path[:a + 1].tolist() == list(range(a + 1))


def sampled_chain_case(rng: np.random.Generator, k: int, batch: int, V: int) -> dict:
    """Random laws (zeros, NaNs, p == q rows, far rows) and drafts raced from q at their positions
    (some replaced by ids past V), for a chain of k drafts."""
    p = np.stack([[law(rng, V) for _ in range(k + 1)] for _ in range(batch)]).astype(np.float32)
    q = np.stack([[law(rng, V) for _ in range(max(k, 1))] for _ in range(batch)]).astype(np.float32)
    same = rng.random((batch, k)) < 0.3
    q[:, :k][same] = p[:, :k][same]
    p[rng.random(p.shape) < 0.03] = NAN
    q[rng.random(q.shape) < 0.03] = -1
    seed = rng.integers(0, 2**64, batch, dtype=np.uint64)
    pos = rng.integers(-2**31, 2**31, batch).astype(np.int32)
    drafts = np.zeros((batch, max(k, 1)), np.uint32)
    for b in range(batch):
        for i in range(k):
            drafts[b, i] = max(ref.sample_race(ref.probabilities(q[b, i]), seed[b], int(pos[b]) + 1 + i,
                                               ref.PURPOSE_DRAFT), 0)
    drafts[rng.random(drafts.shape) < 0.1] = V + 1
    return dict(p=p, q=q, seed=seed, pos=pos, drafts=drafts)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("k", [0, 1, 4])
def test_one_branch_sampled_accept_equals_the_chain(k, batch):
    rng, V = np.random.default_rng(100 + 10 * k + batch), 6
    accepted = []
    for case in range(40):
        c = sampled_chain_case(rng, k, batch, V)
        done = [b for b in range(batch) if rng.random() < 0.15]
        chain_state = round_state(batch, k, rng, done, marks=k + 2)
        tree_state = {name: words.copy() for name, words in chain_state.items()}
        pend = np.full(batch, 3, np.uint32)
        chain_state["vtok"] = np.concatenate([pend[:, None], c["drafts"][:, :k]], axis=1).astype(np.uint32).reshape(-1)
        ref.spec_accept_sample(chain_state["vtok"], c["p"].reshape(-1), c["q"].reshape(-1), V, k, chain_state["brk"],
                               chain_state["acc"], chain_state["last_pred"], chain_state["ctl"], c["pos"], c["seed"],
                               batch)

        parents, ranks = chain(k)
        cand = np.zeros((batch, k + 1, 1), np.uint32)
        cand[:, :k, 0] = c["drafts"][:, :k]
        t = static_tree(parents, ranks, cand, np.zeros(cand.shape, np.float32), pend, c["pos"], tree_state["vtok"], k,
                        batch)
        q_tree = np.full((batch, k + 1, V), NAN, np.float32)  # the leaf's q is never read
        q_tree[:, :k] = c["q"][:, :k]
        rt.spec_tree_accept_sample(t, c["p"].reshape(-1), q_tree.reshape(-1), V, k, tree_state["vtok"],
                                   tree_state["brk"], tree_state["acc"], tree_state["last_pred"], tree_state["ctl"],
                                   c["pos"], c["seed"], batch)
        for name in ("brk", "acc", "last_pred", "ctl"):
            assert tree_state[name].tolist() == chain_state[name].tolist(), f"case {case}: {name}"
        for b in range(batch):
            a = int(tree_state["acc"][2 * b])
            assert tree_state["vtok"][b * (k + 1):b * (k + 1) + 1 + a].tolist() == \
                chain_state["vtok"][b * (k + 1):b * (k + 1) + 1 + a].tolist()
            if b not in done:
                accepted.append(a)
    if k:
        assert 0 in accepted and max(accepted) >= 1, "both verdicts occur"


def test_one_branch_draws_are_the_chains_draws():
    """spec_tree_draw's first draw at node i of a chain (node word 0) at pos_start + i + 1 is
    spec_draft_sample's draft i; grown into the tree, the nodes' tokens are the chain's drafts."""
    rng, k, V, batch = np.random.default_rng(3), 4, 40, 3
    q = rng.random((batch, k + 1, V)).astype(np.float32)
    q[rng.random(q.shape) < 0.3] = 0
    pos, seed = rng.integers(-2**31, 2**31, batch).astype(np.int32), rng.integers(0, 2**64, batch, dtype=np.uint64)
    drafts = np.zeros(batch * k, np.uint32)
    for step in range(k):
        ref.spec_draft_sample(step, k, V, q[:, :k].reshape(-1).copy(), pos, seed, drafts, batch)
    parents, ranks = chain(k)
    levels = levels_of(parents)
    t = rt.TreeArrays.zeros(k + 1, k, batch)
    pos_start, vtok = np.zeros(batch, np.int32), np.zeros(batch * (k + 1), np.uint32)
    rt.spec_tree_begin(t, np.full(batch, 9, np.uint32), pos, pos_start, vtok, k, batch)
    draws = 2
    cand_tok, cand_logq, cand_sel = (np.zeros(batch * (k + 1) * draws, dt) for dt in (np.uint32, np.float32,
                                                                                      np.float32))
    for level in range(1, k + 1):
        rt.spec_tree_draw(t, level, levels, q.reshape(-1), V, seed, pos_start, draws, cand_tok, cand_logq, cand_sel,
                          batch)
        rt.spec_tree_grow(t, level, levels, cand_tok, cand_logq, cand_sel, draws, pos_start,
                          shape_parent=np.array([p % 2**32 for p in parents], np.uint32),
                          shape_rank=np.array(ranks, np.uint32), batch=batch)
    assert t.tok.reshape(batch, k + 1)[:, 1:].tolist() == drafts.reshape(batch, k).tolist()
    assert t.pos.reshape(batch, k + 1).tolist() == [[int(p) + i for i in range(k + 1)] for p in pos]


# -- 2. greedy accept against brute force -----------------------------------------------------

def random_tree(rng: np.random.Generator, nodes: int, depth: int, garbage: bool) -> tuple[list[int], list[int]]:
    """(parents, ranks) of a level-ordered tree with random level sizes and void nodes; with
    `garbage`, some parents are not before their child."""
    sizes = [1] + list(rng.multinomial(nodes - 1, np.ones(depth) / depth) if depth else [])
    sizes = [s for s in sizes if s] if depth else [1]
    parents, ranks, start = [-1], [0], 0
    for d in range(1, len(sizes)):
        prev = range(start, start + sizes[d - 1])
        start += sizes[d - 1]
        for _ in range(sizes[d]):
            parents.append(int(rng.choice(prev)))
            ranks.append(VOID_RANK if rng.random() < 0.15 else int(rng.integers(0, 3)))
    if garbage:
        for c in range(1, len(parents)):
            if rng.random() < 0.1:
                parents[c] = int(rng.choice([c, c + 1, 2**32 - 1, len(parents) + 5]))
    return parents, ranks


def brute_greedy(tok, parents, ranks, pred, cap) -> int:
    """The deepest node whose every root-path node agrees, ties to the smaller index, by walking each
    node's parents."""
    best, best_depth = 0, 0
    for n in range(1, len(tok)):
        node, hops, good = n, 0, True
        while node != 0 and good:
            p = parents[node]
            good = 0 <= p < node and ranks[node] != VOID_RANK and tok[node] == pred[p]
            node, hops = p, hops + 1
        if good and hops <= cap and hops > best_depth:
            best, best_depth = n, hops
    return best


@pytest.mark.parametrize("garbage", [False, True])
def test_greedy_accepts_the_deepest_agreeing_node(garbage):
    rng = np.random.default_rng(11 + garbage)
    seen_depths = set()
    for case in range(300):
        nodes, depth = int(rng.integers(1, 40)), int(rng.integers(0, 5))
        parents, ranks = random_tree(rng, nodes, min(depth, nodes - 1), garbage)
        T1, D = len(parents), int(rng.integers(1, 6))
        k = int(rng.integers(0, D + 1))
        batch = 2
        t = rt.TreeArrays.zeros(T1, D, batch)
        tok = rng.integers(0, 3, (batch, T1))
        pred = rng.integers(0, 3, (batch, T1)).astype(np.int64) + (rng.integers(0, 2, (batch, T1)) << 32)
        t.tok[:] = tok.reshape(-1)
        t.parent[:] = np.tile([p % 2**32 for p in parents], batch)
        t.rank[:] = np.tile(ranks, batch)
        t.depth[:] = rng.integers(0, 2**32, batch * T1)  # garbage: not read
        t.path[:] = SENTINEL
        done = [1] if rng.random() < 0.2 else []
        s = round_state(batch, k, rng, done, marks=D + 2)
        before, marks = s["acc"].copy(), s["brk"][BRK_MARK::BRK_WORDS].copy()
        rt.spec_tree_accept_greedy(t, pred.reshape(-1), k, s["vtok"], s["brk"], s["acc"], s["last_pred"], s["ctl"],
                                   batch)
        for b in range(batch):
            r = t.row(b)
            if b in done:
                assert s["acc"][2 * b] == 0 and s["ctl"][4 * b + CTL_KEEP] == 0 and r.path[0] == 0
                assert s["acc"][2 * b + 1] == before[2 * b + 1] and s["last_pred"][b] == 77
                continue
            par = [p if p < 2**31 else -1 for p in parents]
            cap = min(k, D, marks[b] - 1) if marks[b] else min(k, D)  # the length chosen caps the depth
            n = brute_greedy(tok[b].tolist(), par, ranks, (pred[b] % 2**32).tolist(), cap)
            path = [n]
            while path[-1]:
                path.append(par[path[-1]])
            path = path[::-1]
            a = len(path) - 1
            seen_depths.add(a)
            assert r.path[:a + 1].tolist() == path, f"case {case} row {b}"
            assert (r.path[a + 1:] == SENTINEL).all()
            assert s["acc"][2 * b] == a and s["acc"][2 * b + 1] == (int(before[2 * b + 1]) + a) % 2**32
            assert s["last_pred"][b] == pred[b, n] % 2**32 and s["ctl"][4 * b + CTL_KEEP] == a + 1
            vtok = s["vtok"][b * (k + 1):(b + 1) * (k + 1)]
            assert vtok[1:1 + a].tolist() == [tok[b, c] for c in path[1:]] and (vtok[1 + a:] == SENTINEL).all()
        capped = [b not in done and marks[b] != 0 for b in range(batch)]
        assert s["brk"].tolist() == [w for c in capped for w in (0, 5 + c)], "mark cleared, a capped round counted"
    assert {0, 1, 2, 3} <= seen_depths


def test_greedy_ties_between_equal_siblings_go_to_the_smaller_index():
    # root with children 1, 2 (both token 5 = pred[0]); 3 under 1 (token 6 = pred[1]) and 4 under 2 (token 6 = pred[2])
    parents, toks = [ROOT_PARENT, 0, 0, 1, 2], [50, 5, 5, 6, 6]
    t = rt.TreeArrays.zeros(5, 2)
    t.parent[:], t.tok[:], t.rank[:] = parents, toks, [0, 0, 1, 0, 0]
    s = round_state(1, 2, np.random.default_rng(0))
    pred = np.array([5, 6, 6, 8, 9], np.uint32)
    rt.spec_tree_accept_greedy(t, pred, 2, s["vtok"], s["brk"], s["acc"], s["last_pred"], s["ctl"])
    assert t.path.tolist() == [0, 1, 3] and s["last_pred"][0] == 8 and s["vtok"][1:].tolist() == [5, 6]
    t.rank[3] = VOID_RANK  # 3 void: 4 is the deepest
    rt.spec_tree_accept_greedy(t, pred, 2, s["vtok"], s["brk"], s["acc"], s["last_pred"], s["ctl"])
    assert t.path.tolist() == [0, 2, 4] and s["last_pred"][0] == 9
    rt.spec_tree_accept_greedy(t, pred, 1, s["vtok"][:2], s["brk"], s["acc"], s["last_pred"], s["ctl"])
    assert t.path[:2].tolist() == [0, 1] and s["acc"][ACC_ROUND] == 1, "k = 1 caps the depth"


# -- 3. exactness of the sampled rule, by exact enumeration -----------------------------------

def draw_sequences(q: np.ndarray, r: int):
    """Every ordered draw of min(r, |support|) tokens without replacement from q, with its probability."""
    support = [v for v in range(len(q)) if q[v] > 0]
    for seq in itertools.permutations(support, min(r, len(support))):
        prob, left = 1.0, sum(q[v] for v in support)
        for x in seq:
            prob *= q[x] / left
            left = sum(q[v] for v in support if v not in seq[:seq.index(x) + 1])
        yield seq, prob


def residual(f: np.ndarray, g: np.ndarray) -> np.ndarray:
    w = np.maximum(f - g, 0)
    return w / w.sum() if w.sum() > 0 else f


def without(q: np.ndarray, removed: list[int]) -> np.ndarray:
    g = q.copy()
    g[removed] = 0
    return g / g.sum() if g.sum() > 0 else g


def walk(p: np.ndarray, q: np.ndarray, seq, rule: str = "exact") -> tuple[np.ndarray, np.ndarray]:
    """One node's children `seq` (drawn in this order) judged by recursive rejection: the
    probability that child i is accepted with its token ([i][V]) and the law of the bonus (times
    the probability that every child is rejected). `rule` names a variant: q_order (tried by
    decreasing q), remove_first (x leaves q before the residual), no_removal (q never changes)."""
    f, g, removed = np.asarray(p, np.float64), np.asarray(q, np.float64), []
    order = sorted(seq, key=lambda x: (-q[x], x)) if rule == "q_order" else seq
    accepted, reach = np.zeros((len(order), len(p))), 1.0
    for i, x in enumerate(order):
        a = min(1.0, f[x] / g[x]) if g[x] > 0 else float(f[x] > 0)
        accepted[i, x] = reach * a
        reach *= 1 - a
        if rule == "remove_first":
            removed.append(x)
            g = without(q, removed)
            f = residual(f, g)
        else:
            f = residual(f, g)
            if rule != "no_removal":
                removed.append(x)
                g = without(q, removed)
    return accepted, reach * f


def node_outcomes(p: np.ndarray, q: np.ndarray, r: int, rule: str = "exact", stop=None):
    """([rank][V] the law of accepting the rank-th child with each token, [V] the bonus's law), exactly.
    rule "rerank": draw 2, keep only the one of larger q (its own score), judge it alone. `stop(seq)`:
    how many of the draws to try, decided from the draws (a stopping rule)."""
    ranks, bonus = np.zeros((max(r, 1), len(p))), np.zeros(len(p))
    for seq, prob in draw_sequences(q, 2 if rule == "rerank" else r):
        if rule == "rerank":
            seq = (max(seq, key=lambda x: (q[x], -x)),)
        if stop is not None:
            seq = seq[:stop(seq)]
        acc, rest = walk(p, q, seq, "exact" if rule == "rerank" else rule)
        ranks[:len(seq)] += prob * acc
        bonus += prob * rest
    return ranks, bonus


def first_law(p, q, r, rule="exact", stop=None) -> np.ndarray:
    ranks, bonus = node_outcomes(p, q, r, rule, stop)
    return ranks.sum(0) + bonus


def tv(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(np.asarray(a) - np.asarray(b)).sum())


def random_law(rng, V, zeros=0.0):
    return law(rng, V, zeros).astype(np.float64)


@pytest.mark.parametrize("r", [1, 2, 3, 4])
def test_recursive_rejection_commits_the_target_law_exactly(r):
    rng = np.random.default_rng(r)
    for case in range(25):
        V = int(rng.integers(3, 7))
        p = random_law(rng, V, zeros=0.2)
        q = [random_law(rng, V, zeros=0.3), 0.9 * p + 0.1 * random_law(rng, V), np.roll(p, 1)][case % 3]
        assert abs(first_law(p, q, r) - p).max() < 1e-12, f"case {case}"


def test_two_committed_tokens_are_the_targets_two_steps_exactly():
    """A depth-2 tree: root with r children; the child of rank i gets kids[i] children (so the count
    below depends on which draw was accepted), drawn from q2(. | x1); p2(. | x1) at the child. The
    first two committed tokens: an accepted child x1 then the child's own first commit, or the
    root's bonus x1 then (the next round's first commit, exact by the one-level theorem) p2(. | x1)."""
    rng = np.random.default_rng(21)
    for kids in ([2, 1, 0], [3, 3], [0, 2], [1]):
        V = 5
        p1, q1 = random_law(rng, V, 0.2), random_law(rng, V, 0.2)
        p2 = np.stack([random_law(rng, V, 0.2) for _ in range(V)])
        q2 = np.stack([random_law(rng, V, 0.3) if x % 2 else 0.5 * (p2[x] + random_law(rng, V)) for x in range(V)])
        ranks, bonus = node_outcomes(p1, q1, len(kids))
        joint = bonus[:, None] * p2
        for i, count in enumerate(kids):
            for x1 in range(V):
                joint[x1] += ranks[i, x1] * first_law(p2[x1], q2[x1], count)
        assert abs(joint - p1[:, None] * p2).max() < 1e-12, f"kids {kids}"


@pytest.mark.parametrize("rule", ["q_order", "remove_first", "no_removal", "rerank"])
@pytest.mark.parametrize("r", [2, 3])
def test_each_rule_that_breaks_exactness_is_measurably_biased(rule, r):
    """Against the far draft: trying children in q order, removing x before the residual, never
    removing rejected siblings, keeping the better-scored of 2 draws (EAGLE-2's rerank)."""
    p, q = TARGET.astype(np.float64), FAR.astype(np.float64)
    p, q = p / p.sum(), q / q.sum()
    assert tv(first_law(p, q, r), p) < 1e-12
    assert tv(first_law(p, q, r, rule), p) > 1e-2, rule


def test_a_forgotten_removal_hides_behind_a_close_draft():
    """Why the Monte Carlo runs a far draft: a close one leaves a forgotten removal under 0.5%."""
    p, q = TARGET.astype(np.float64), CLOSE.astype(np.float64)
    p, q = p / p.sum(), q / q.sum()
    assert 1e-4 < tv(first_law(p, q, 2, "no_removal"), p) < 5e-3


def test_what_stays_exact():
    """A child count decided from q, and whether to try the next draw decided from the draws before it."""
    rng = np.random.default_rng(5)
    for case in range(20):
        V = 6
        p = random_law(rng, V, 0.2)
        q = random_law(rng, V, 0.2) ** (1 + 3 * (case % 2))
        q /= q.sum()
        count = 1 if q.max() > 0.5 else 3
        assert abs(first_law(p, q, count) - p).max() < 1e-12
        assert abs(first_law(p, q, 3, stop=lambda seq: 3 if seq[0] % 2 == 0 else 1) - p).max() < 1e-12
        assert abs(first_law(p, q, 4, stop=lambda seq: leading(seq, q)) - p).max() < 1e-12


def leading(seq, q, least: float = 0.1) -> int:
    """A stopping rule: draw i + 1 is tried iff draws 1..i all have q > least (never its own q)."""
    n = 1
    while n < len(seq) and q[seq[n - 1]] > least:
        n += 1
    return min(n, len(seq))


def test_a_child_kept_for_its_own_draw_breaks_exactness():
    """The same rule, but draw i + 1 tried iff its own q is above the threshold: biased."""
    p, q = TARGET.astype(np.float64), FAR.astype(np.float64)
    p, q = p / p.sum(), q / q.sum()
    own = lambda seq: 1 + sum(1 for _ in itertools.takewhile(lambda x: q[x] > 0.1, seq[1:]))  # noqa: E731
    assert tv(first_law(p, q, 3, stop=lambda seq: leading(seq, q)), p) < 1e-12
    assert tv(first_law(p, q, 3, stop=own), p) > 1e-2


def test_rejection_with_q_accepts_more_than_a_target_only_walk():
    """One child: recursive rejection accepts with probability sum min(p, q), a walk that accepts
    the child only when a draw from p hits it with probability sum p q, which is less."""
    rng = np.random.default_rng(8)
    laws = [(TARGET, FAR), (TARGET, CLOSE)] + [(random_law(rng, 5, 0.2), random_law(rng, 5, 0.2)) for _ in range(5)]
    for p, q in laws:
        p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
        p, q = p / p.sum(), q / q.sum()
        ranks, _ = node_outcomes(p, q, 1)
        assert abs(ranks.sum() - np.minimum(p, q).sum()) < 1e-12
        assert ranks.sum() > np.sum(p * q) + 0.05


# -- 4. the Philox-keyed code path, by Monte Carlo -------------------------------------------

# A root with 3 children, each with 2 (T1 = 10, D = 2), V = 8.
MC_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]
MC_RANKS = [0, 0, 1, 2, 0, 1, 0, 1, 0, 1]
TARGET8 = np.array([0.04, 0.06, 0.08, 0.10, 0.12, 0.16, 0.20, 0.24], np.float32)
TARGET8_2 = np.array([0.20, 0.05, 0.15, 0.10, 0.05, 0.25, 0.15, 0.05], np.float32)
FAR8 = np.array([0.30, 0.25, 0.15, 0.10, 0.08, 0.06, 0.04, 0.02], np.float32)
CLOSE8 = np.array([0.045, 0.055, 0.085, 0.095, 0.125, 0.155, 0.205, 0.235], np.float32)
MC_ROWS = 8000


def sampled_round(q_law: np.ndarray, rows: int, rng: np.random.Generator,
                  marks: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, dict]:
    """One sampled round of the MC tree on `rows` rows: begin, draw and grow each level from q_law at
    every node, accept with p = TARGET8 at the root and TARGET8_2 below it, each row's mark
    `marks` (default 0: no cap). Returns the tree, the round-stream buffers and the first-draw
    tokens of the root (what the tree offered first)."""
    V, T1, levels, draws = len(q_law), len(MC_PARENTS), levels_of(MC_PARENTS), 3
    t = rt.TreeArrays.zeros(T1, len(levels) - 1, rows)
    s = round_state(rows, 2, rng)
    if marks is not None:
        s["brk"][BRK_MARK::BRK_WORDS] = marks
    seed = rng.integers(0, 2**64, rows, dtype=np.uint64)
    pos_ctr, pos_start = rng.integers(0, 2**31 - 8, rows).astype(np.int32), np.zeros(rows, np.int32)
    rt.spec_tree_begin(t, np.full(rows, 1, np.uint32), pos_ctr, pos_start, s["vtok"], 2, rows)
    q = np.tile(q_law, rows * T1)
    p = np.tile(np.concatenate([TARGET8] + [TARGET8_2] * (T1 - 1)), rows)
    cand = [np.zeros(rows * T1 * draws, dt) for dt in (np.uint32, np.float32, np.float32)]
    for level in (1, 2):
        rt.spec_tree_draw(t, level, levels, q, V, seed, pos_start, draws, *cand, rows)
        rt.spec_tree_grow(t, level, levels, *cand, draws, pos_start,
                          shape_parent=np.array([x % 2**32 for x in MC_PARENTS], np.uint32),
                          shape_rank=np.array(MC_RANKS, np.uint32), batch=rows)
    offered = t.tok.reshape(rows, T1)[:, 1].copy()
    rt.spec_tree_accept_sample(t, p, q, V, 2, s["vtok"], s["brk"], s["acc"], s["last_pred"], s["ctl"], pos_start, seed,
                               rows)
    return t, offered, s


@pytest.mark.parametrize("q_law", [FAR8, CLOSE8], ids=["far", "close"])
def test_sampled_tree_commits_the_target_law(q_law):
    rows = MC_ROWS
    t, offered, s = sampled_round(q_law, rows, np.random.default_rng(7 + int(q_law[0] * 100)))
    a = s["acc"][0::2].astype(np.int64)
    vtok = s["vtok"].reshape(rows, 3)
    first = np.where(a >= 1, vtok[:, 1], s["last_pred"])
    assert_distributed_as(first.astype(np.int64), TARGET8, "first committed token")
    deep = a >= 1
    second = np.where(a[deep] >= 2, vtok[deep, 2], s["last_pred"][deep])
    assert_distributed_as(second.astype(np.int64), TARGET8_2, "second committed token")
    assert (a == 2).mean() > 0.2 and (a == 0).any()
    if q_law is FAR8:
        assert chi_square(offered.astype(np.int64), TARGET8) > 10 * CHI2_999[5], "the test sees the draft's law"
    for b in range(0, rows, 997):  # the path is a root path of non-void nodes with the committed tokens
        r = t.row(b)
        path = r.path[:a[b] + 1].tolist()
        assert path[0] == 0 and all(int(r.parent[c]) == pc for pc, c in zip(path, path[1:]))
        assert vtok[b, 1:1 + a[b]].tolist() == r.tok[path[1:]].tolist()


def test_a_sampled_tree_capped_below_its_depth_commits_the_target_law():
    """Rows capped at 0 and 1 drafts (marks 1 and 2) beside uncapped ones, the far draft: no row
    keeps more than its cap, and the tokens committed are the target's law at every depth, the
    capped rows' bonus drawn from p itself where the walk stops at the cap (its children's
    verdicts left unread)."""
    rows = MC_ROWS
    marks = np.arange(rows, dtype=np.uint32) % 3  # 0: no cap, 1: cap 0, 2: cap 1
    t, _, s = sampled_round(FAR8, rows, np.random.default_rng(71), marks)
    a, vtok = s["acc"][0::2].astype(np.int64), s["vtok"].reshape(rows, 3)
    caps = np.where(marks == 0, 2, marks.astype(np.int64) - 1)
    assert (a <= caps).all() and (a[caps == 1] == 1).any() and (a[marks == 0] == 2).any()
    first = np.where(a >= 1, vtok[:, 1], s["last_pred"])
    assert_distributed_as(first.astype(np.int64), TARGET8, "first committed token, capped rows among them")
    assert_distributed_as(s["last_pred"][caps == 0].astype(np.int64), TARGET8, "the bonus at cap 0: p[0] itself")
    at_cap = (caps == 1) & (a == 1)
    assert_distributed_as(s["last_pred"][at_cap].astype(np.int64), TARGET8_2, "the bonus at the cap: p[n] itself")
    assert s["brk"][BRK_COUNT::BRK_WORDS].tolist() == [5 + (m != 0) for m in marks], "capped rounds counted"


def test_sampled_accept_uses_the_documented_draws():
    """Hand-checked walk: root with two children x = 1 then 2 (ranks 0, 1). p[0] puts no mass on 1:
    child 1 is rejected; the residual max(p - q, 0) then the q without token 1 decide child 2
    against U at its own node word; the bonus is raced over the final f."""
    V = 4
    t = rt.TreeArrays.zeros(3, 1)
    t.parent[:], t.tok[:], t.rank[:] = [ROOT_PARENT, 0, 0], [9, 1, 2], [0, 0, 1]
    p0, q0 = np.array([0.1, 0.0, 0.5, 0.4], np.float32), np.array([0.1, 0.5, 0.3, 0.1], np.float32)
    p = np.concatenate([p0, np.full(8, 0.25, np.float32)])
    q = np.concatenate([q0, np.full(8, 0.25, np.float32)])
    outcomes = set()
    for seed in range(40):
        s = round_state(1, 1, np.random.default_rng(seed))
        pos = np.array([100], np.int32)
        rt.spec_tree_accept_sample(t, p, q, V, 1, s["vtok"], s["brk"], s["acc"], s["last_pred"], s["ctl"], pos,
                                   np.array([seed], np.uint64))
        res = np.maximum(p0 - q0, 0)
        f = (res / np.float32(res.sum(dtype=np.float64))).astype(np.float32)
        g = np.where(np.arange(V) == 1, 0, q0 / np.float32(1 - 0.5)).astype(np.float32)
        u = np.float32(uniform(seed, 101, 0, ref.PURPOSE_ACCEPT, 1))  # child 2: node word 2 - 1
        if u * g[2] < f[2]:
            assert t.path.tolist() == [0, 2] and s["acc"][0] == 1
            assert s["last_pred"][0] == ref.sample_race(p[4:8], seed, 102, ref.PURPOSE_SAMPLE, 1)
            outcomes.add("child 2")
        else:
            res2 = np.maximum(f - g, 0)
            f2 = res2 / np.float32(res2.sum(dtype=np.float64))
            assert s["acc"][0] == 0 and s["last_pred"][0] == ref.sample_race(f2, seed, 101, ref.PURPOSE_SAMPLE, 0)
            outcomes.add("bonus")
        weights, position, node = rt.bonus_race(t, 0, p, q, V, 1, 100, np.uint64(seed))
        assert (position, node) == ((102, 1) if s["acc"][0] else (101, 0))
        assert weights.dtype == np.float32 and np.allclose(weights, p[4:8] if s["acc"][0] else f2, rtol=1e-6)
    assert outcomes == {"child 2", "bonus"}


def test_sampled_accept_without_mass_commits_token_zero_and_skips_void_and_late_children():
    V = 3
    t = rt.TreeArrays.zeros(4, 1)
    # child 1 void, child 2's parent is 3 (not before it): neither is tried; child 3 token past V is rejected
    t.parent[:], t.tok[:], t.rank[:] = [ROOT_PARENT, 0, 3, 0], [9, 0, 0, 7], [0, VOID_RANK, 0, 0]
    p = np.zeros(4 * V, np.float32)
    p[:V] = [NAN, -1, 0]
    q = np.full(4 * V, 1 / 3, np.float32)
    s = round_state(1, 1, np.random.default_rng(0))
    rt.spec_tree_accept_sample(t, p, q, V, 1, s["vtok"], s["brk"], s["acc"], s["last_pred"], s["ctl"],
                               np.array([0], np.int32), np.array([1], np.uint64))
    assert s["acc"][0] == 0 and s["last_pred"][0] == ref.NO_MASS_TOKEN and s["ctl"][CTL_KEEP] == 1
    p[:V] = [0, 1, 0]  # child 0 (void) would have been accepted
    rt.spec_tree_accept_sample(t, p, q, V, 1, s["vtok"], s["brk"], s["acc"], s["last_pred"], s["ctl"],
                               np.array([0], np.int32), np.array([1], np.uint64))
    assert s["acc"][0] == 0 and s["last_pred"][0] == 1 and t.path[0] == 0


def test_sampled_accept_tries_at_most_eight_children_in_rank_order():
    """Ten children of token 0..9 with ranks 9..0: the first MAX_TREE_DRAWS by rank are nodes 10..3;
    p puts all its mass on tokens 0 and 1 (nodes 1 and 2, ranks 9 and 8), so every child tried is
    rejected and the bonus is raced over what is left."""
    V, T1 = 10, 11
    t = rt.TreeArrays.zeros(T1, 1)
    t.parent[:], t.tok[:], t.rank[:] = [ROOT_PARENT] + [0] * 10, [5] + list(range(10)), [0] + list(range(9, -1, -1))
    assert rt.tree_children(t.row(0), 0) == list(range(10, 2, -1))
    p = np.zeros(T1 * V, np.float32)
    p[:2] = 0.5
    q = np.full(T1 * V, 0.1, np.float32)
    for seed in range(8):
        s = round_state(1, 1, np.random.default_rng(seed))
        rt.spec_tree_accept_sample(t, p, q, V, 1, s["vtok"], s["brk"], s["acc"], s["last_pred"], s["ctl"],
                                   np.array([0], np.int32), np.array([seed], np.uint64))
        assert s["acc"][0] == 0 and s["last_pred"][0] in (0, 1)


# -- 5. grow and draw ------------------------------------------------------------------------

def ancestors(parents, c: int) -> set[int]:
    out = {c}
    while c != 0:
        c = int(parents[c])
        out.add(c)
    return out


def test_static_grow_places_tokens_scores_and_voids():
    """Choices [[0], [1], [0, 0], [0, 1], [1, 0], [0, 2]] with K = 2: node 2 (rank 1 at the root) is void
    (logq -inf), so 5 under it is void too; 6 (rank 2 >= K) is void; 3 and 4 get node 1's candidates."""
    parents, ranks = [-1, 0, 0, 1, 1, 2, 1], [0, 0, 1, 0, 1, 0, 2]
    levels = levels_of(parents)
    T1, K = 7, 2
    cand_tok = np.zeros((T1, K), np.int64)
    cand_logq = np.full((T1, K), -np.inf, np.float32)
    cand_tok[0], cand_logq[0] = [10, 11], [-0.5, -np.inf]
    cand_tok[1], cand_logq[1] = [20 + 2**32, 21], [-1.0, -2.0]
    t = static_tree(parents, ranks, cand_tok[None], cand_logq[None], u32(7), np.array([40], np.int32),
                    np.zeros(3, np.uint32), 2, 1)
    assert t.tok.tolist() == [7, 10, 0, 20, 21, 0, 0]
    assert t.rank.tolist() == [0, 0, VOID_RANK, 0, 1, VOID_RANK, VOID_RANK]
    assert t.parent.tolist() == [ROOT_PARENT, 0, 0, 1, 1, 2, 1]
    assert t.score.tolist() == [0, -0.5, -np.inf, -1.5, -2.5, -np.inf, -np.inf]
    assert t.depth.tolist() == [0, 1, 1, 2, 2, 2, 2] and t.pos.tolist() == [40, 41, 41, 42, 42, 42, 42]
    assert [rt.mask_bits(t.row(0).mask[c]) for c in range(T1)] == [{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 1, 4},
                                                                    {0, 2, 5}, {0, 1, 6}]
    assert levels == [(0, 1), (1, 3), (3, 7)]


def dynamic_tree(cands: list, width: int, branch: int, depth: int, K: int, pos: int = 0):
    """A dynamic tree grown from per-level candidate tables: cands[d] = (tok, logq, sel), each [T1][K]."""
    T1 = 1 + depth * width
    levels = [(0, 1)] + [(1 + d * width, 1 + (d + 1) * width) for d in range(depth)]
    t = rt.TreeArrays.zeros(T1, depth)
    pos_start = np.zeros(1, np.int32)
    rt.spec_tree_begin(t, u32(1), np.array([pos], np.int32), pos_start, np.zeros(depth + 1, np.uint32), depth)
    for level in range(1, depth + 1):
        tok, logq, sel = cands[level - 1]
        rt.spec_tree_grow(t, level, levels, tok.reshape(-1), logq.reshape(-1), sel.reshape(-1), K, pos_start,
                          width=width, branch=branch)
    return t, levels


def test_dynamic_grow_keeps_the_best_offers_in_parent_rank_order_with_ties_to_the_lower_parent():
    T1, K = 7, 4
    tok = np.arange(T1 * K, dtype=np.uint32).reshape(T1, K) + 100
    logq = np.full((T1, K), -7.0, np.float32)
    sel = np.full((T1, K), -np.inf, np.float32)
    # level 1 from the root: offers j < branch = 3 with sel finite: j = 0, 1 (j = 3 is past branch); width 3 -> a void
    sel[0], logq[0] = [-0.1, -0.2, -np.inf, -0.05], [-0.5, -1.0, -3.0, -4.0]
    # level 2: node 1 (score -0.5) and node 2 (score -1.0); offer scores -1.0 (1,0), -1.5 (1,1), -2.5 (1,2),
    # -1.0 (2,0), -1.5 (2,1), -4.0 (2,2): the best 3 are (1,0), (2,0) and (1,1) (a tie with (2,1): lower parent)
    sel[1], sel[2] = [-0.5, -1.0, -2.0, 5.0], [0.0, -0.5, -3.0, 5.0]
    logq[1], logq[2] = [-0.25, -0.75, -1.0, -1.0], [-0.125, -2.0, -1.0, -1.0]
    t, levels = dynamic_tree([(tok, logq, sel)] * 2, width=3, branch=3, depth=2, K=K, pos=5)
    assert t.parent.tolist() == [ROOT_PARENT, 0, 0, 0, 1, 1, 2]
    assert t.rank.tolist() == [0, 0, 1, VOID_RANK, 0, 1, 0]
    assert t.tok.tolist() == [1, 100, 101, 0, 104, 105, 108]
    assert t.score.tolist() == [0, -0.5, -1.0, -np.inf, -0.75, -1.25, -1.125]
    assert [rt.mask_bits(t.row(0).mask[c]) for c in range(T1)] == [{0}, {0, 1}, {0, 2}, {0, 3}, {0, 1, 4},
                                                                    {0, 1, 5}, {0, 2, 6}]
    assert t.pos.tolist() == [5, 6, 6, 6, 7, 7, 7] and t.depth.tolist() == [0, 1, 1, 1, 2, 2, 2]


def test_dynamic_grow_against_brute_force_on_wide_random_trees():
    """Width 20, depth 3 (61 nodes, 2 mask words), scores on a coarse grid so that ties happen: an
    offer is kept iff fewer than `width` offers beat it (higher score, or equal and lower (p, j))."""
    rng = np.random.default_rng(4)
    width, depth, K, branch = 20, 3, 5, 4
    T1 = 1 + width * depth
    for case in range(6):
        cands = []
        for _ in range(depth):
            sel = -rng.integers(0, 6, (T1, K)).astype(np.float32) / 4
            sel[rng.random(sel.shape) < 0.2] = -np.inf
            logq = -rng.integers(0, 6, (T1, K)).astype(np.float32) / 8
            cands.append((rng.integers(0, 2**31, (T1, K)).astype(np.int64), logq, sel))
        t, levels = dynamic_tree(cands, width, branch, depth, K)
        r = t.row(0)
        for level in range(1, depth + 1):
            tok, logq, sel = cands[level - 1]
            offers = [(float(r.score[p] + sel[p, j]), p, j) for p in range(*levels[level - 1])
                      if r.rank[p] != VOID_RANK for j in range(min(branch, K)) if np.isfinite(sel[p, j])]
            kept = [o for o in offers
                    if sum(1 for x in offers if x[0] > o[0] or (x[0] == o[0] and x[1:] < o[1:])) < width]
            start, stop = levels[level]
            got = [(int(r.parent[c]), int(r.rank[c])) for c in range(start, stop) if r.rank[c] != VOID_RANK]
            assert got == [(p, j) for _, p, j in kept], f"case {case} level {level}"
            for c in range(start, stop):
                bits = rt.mask_bits(r.mask[c])
                if r.rank[c] == VOID_RANK:
                    assert r.parent[c] == 0 and bits == {0, c} and r.tok[c] == 0 and r.score[c] == -np.inf
                else:
                    p, j = int(r.parent[c]), int(r.rank[c])
                    assert bits == ancestors(r.parent, c) and r.tok[c] == tok[p, j]
                    assert r.score[c] == np.float32(r.score[p]) + logq[p, j]
                assert r.depth[c] == level and r.pos[c] == level
        assert any(c >= 32 for c in rt.mask_bits(r.mask[T1 - 1])), "the second mask word is used"


def test_draw_is_the_race_without_replacement_at_the_nodes_own_keys():
    rng = np.random.default_rng(9)
    parents = [-1, 0, 0, 0, 1, 1, 2, 3]
    levels = levels_of(parents)
    T1, V, draws, batch = 8, 12, 4, 2
    t = rt.TreeArrays.zeros(T1, 2, batch)
    t.rank.reshape(batch, T1)[1, 2] = VOID_RANK  # row 1's node 2 is void: its candidates are left alone
    q = rng.random((batch, T1, V)).astype(np.float32)
    q[rng.random(q.shape) < 0.4] = 0
    q[0, 1, 3:] = 0  # node 1 of row 0 has at most 3 tokens with q > 0: fewer than the draws
    q[0, 1, 0] = NAN
    seed, pos_start = rng.integers(0, 2**64, batch, dtype=np.uint64), np.array([-3, 2**31 - 2], np.int32)
    cand_tok = np.full(batch * T1 * draws, SENTINEL, np.uint32)
    cand_logq, cand_sel = (np.full(batch * T1 * draws, 7, np.float32) for _ in range(2))
    rt.spec_tree_draw(t, 2, levels, q.reshape(-1), V, seed, pos_start, draws, cand_tok, cand_logq, cand_sel, batch)
    toks, logqs, sels = (a.reshape(batch, T1, draws) for a in (cand_tok, cand_logq, cand_sel))
    for b in range(batch):
        for node in range(T1):
            if not (1 <= node < 4) or (b == 1 and node == 2):
                assert (toks[b, node] == SENTINEL).all() and (logqs[b, node] == 7).all(), "not a parent of level 2"
                continue
            w = ref.probabilities(q[b, node])
            position = int(pos_start[b]) + 2
            e = -np.log(uniform(seed[b], position, np.arange(V), ref.PURPOSE_DRAFT, node - 1))
            scores = np.where(w > 0, w / e, -np.inf)
            positive = int((w > 0).sum())
            n = min(draws, positive)
            drawn = toks[b, node, :n].tolist()
            assert len(set(drawn)) == n and all(w[v] > 0 for v in drawn)
            assert all(scores[x] > scores[y] for x, y in zip(drawn, drawn[1:]))
            assert all(scores[v] <= scores[drawn[-1]] for v in range(V) if v not in drawn)
            assert drawn[0] == ref.sample_race(w, seed[b], position, ref.PURPOSE_DRAFT, node - 1)
            assert (toks[b, node, n:] == 0).all() and (logqs[b, node, n:] == -np.inf).all()
            assert logqs[b, node, :n].tolist() == np.log(w[drawn]).tolist()
            largest = np.sort(w)[::-1][:draws]
            with np.errstate(divide="ignore"):
                assert sels[b, node].tolist() == np.where(largest > 0, np.log(largest), -np.inf).tolist()
    assert min(3, int((ref.probabilities(q[0, 1]) > 0).sum())) < draws


def test_draw_keys_tell_apart_the_nodes_of_one_depth():
    """Two siblings with one q draw different sequences (node words 0 and 1), whatever the batch slot."""
    parents = [-1, 0, 0]
    t = rt.TreeArrays.zeros(3, 2, 2)
    V, draws = 50, 3
    q = np.full(2 * 3 * V, 1 / V, np.float32)
    seed, pos = np.array([5, 5], np.uint64), np.array([10, 10], np.int32)
    cand = [np.zeros(2 * 3 * draws, dt) for dt in (np.uint32, np.float32, np.float32)]
    t.rank[:] = 0
    rt.spec_tree_draw(t, 2, levels_of(parents) + [(3, 3)], q, V, seed, pos, draws, *cand, 2)
    toks = cand[0].reshape(2, 3, draws)
    assert toks[0, 1].tolist() != toks[0, 2].tolist() and toks[0].tolist() == toks[1].tolist()


# -- 6. compaction and recurrent state -------------------------------------------------------

def kv(batch: int, capacity: int, words: int, rng) -> np.ndarray:
    return rng.integers(0, 2**32, batch * capacity * words, dtype=np.uint64).astype(np.uint32)


def gathered(buf: np.ndarray, batch: int, capacity: int, words: int, moves: dict) -> np.ndarray:
    """The compaction's meaning: every source read before anything is written; moves[b] = [(src, dst)]."""
    out = buf.reshape(batch, capacity, words).copy()
    src = buf.reshape(batch, capacity, words)
    for b, pairs in moves.items():
        for s, d in pairs:
            out[b, d] = src[b, s]
    return out.reshape(-1)


def test_compact_moves_the_design_example_as_a_gather():
    """choices [[0], [1], [1, 0]] with path 0 -> 2 -> 3: depth 1's source (slot pos + 2) is depth 2's
    destination, so moving in increasing d gives what gathering every source first gives."""
    rng, words, capacity, pos = np.random.default_rng(0), 3, 16, 5
    t = rt.TreeArrays.zeros(4, 2)
    t.path[:] = [0, 2, 3]
    k_words, v_words = kv(1, capacity, words, rng), kv(1, capacity, words, rng)
    expect_k = gathered(k_words, 1, capacity, words, {0: [(pos + 2, pos + 1), (pos + 3, pos + 2)]})
    expect_v = gathered(v_words, 1, capacity, words, {0: [(pos + 2, pos + 1), (pos + 3, pos + 2)]})
    table = [None, (k_words, v_words, capacity * words, words, words, capacity)]
    rt.spec_tree_compact(table, t, u32(2, 0), np.array([pos], np.int32), np.array([-1, -1, 0, 3], np.int32), 2)
    assert k_words.tolist() == expect_k.tolist() and v_words.tolist() == expect_v.tolist()


def test_compact_random_paths_clamps_and_done_rows():
    rng = np.random.default_rng(1)
    for case in range(40):
        batch, D, T1 = 3, int(rng.integers(1, 5)), int(rng.integers(5, 12))
        k = D
        t = rt.TreeArrays.zeros(T1, D, batch)
        acc, ctl = np.zeros(2 * batch, np.uint32), np.tile(np.array([-1, -1, 0, 0], np.int32), batch)
        pos_start = rng.integers(-2, 8, batch).astype(np.int32)
        layers = []
        for _ in range(2):
            words, pos_stride = int(rng.integers(1, 4)), 0
            pos_stride = words + int(rng.integers(0, 2))
            capacity = int(rng.integers(6, 16))
            row_stride = capacity * pos_stride
            k_words = kv(batch, capacity, pos_stride, rng)
            v_words = kv(batch, capacity, pos_stride, rng) if rng.random() < 0.7 else None
            layers.append((k_words, v_words, row_stride, pos_stride, words, capacity))
        moves = {}
        for b in range(batch):
            a = int(rng.integers(0, D + 1))
            path = [0] + sorted(rng.choice(np.arange(1, T1), a, replace=False).tolist())  # increasing, n_d >= d
            if rng.random() < 0.2 and a:
                path[-1] = T1 + 3  # past the tree: skipped
            t.path[b * (D + 1):b * (D + 1) + a + 1] = path
            acc[2 * b] = a + (7 if rng.random() < 0.2 else 0)  # garbage acc: clamped to k
            keep = 0 if rng.random() < 0.2 else a + 1
            ctl[4 * b + CTL_KEEP] = keep
            if keep:
                row = t.path[b * (D + 1):(b + 1) * (D + 1)].tolist()  # past a: zeros, read where acc says so
                moves[b] = [(int(pos_start[b]) + n, int(pos_start[b]) + d) for d, n in enumerate(row)
                            if 0 < d <= min(int(acc[2 * b]), k) and n < T1]
        expected = []
        for k_words, v_words, row_stride, pos_stride, words, capacity in layers:
            pairs = {b: [(s, d) for s, d in m if 0 <= s < capacity and 0 <= d < capacity] for b, m in moves.items()}
            exp = []
            for buf in (k_words, v_words):
                if buf is None:
                    exp.append(None)
                    continue
                full = gathered(buf, batch, capacity, pos_stride, pairs).reshape(batch, capacity, pos_stride)
                full[:, :, words:] = buf.reshape(batch, capacity, pos_stride)[:, :, words:]  # padding not moved
                exp.append(full.reshape(-1))
            expected.append(exp)
        rt.spec_tree_compact(layers + [None], t, acc, pos_start, ctl, k, batch)
        for (k_words, v_words, *_), (ek, ev) in zip(layers, expected):
            assert k_words.tolist() == ek.tolist(), f"case {case}"
            assert v_words is None or v_words.tolist() == ev.tolist(), f"case {case}"


def test_state_copy_and_flip_take_the_paths_last_node():
    rng = np.random.default_rng(2)
    batch, T1, D, row_words = 4, 6, 3, 2
    t = rt.TreeArrays.zeros(T1, D, batch)
    t.path[:] = np.array([[0, 2, 4, 5], [0, 1, 9, 9], [0, 3, 3, 3], [0, 2, 5, 5]]).reshape(-1)
    ctl = np.tile(np.array([-1, -1, 0, 0], np.int32), batch)
    ctl[CTL_KEEP::4] = [3, 3, 0, -2**31 + 7]  # row 1's path[2] = 9 clamps to slot 5; row 2 done; row 3 keep clamps
    slots = rng.integers(0, 2**32, batch * T1 * row_words, dtype=np.uint64).astype(np.uint32)
    live = np.zeros(batch * row_words, np.uint32)
    before = live.copy()
    rt.spec_tree_state_copy([None, (live, slots, row_words)], T1, t, ctl, D, batch)
    s = slots.reshape(batch, T1, row_words)
    lv = live.reshape(batch, row_words)
    assert lv[0].tolist() == s[0, 4].tolist() and lv[1].tolist() == s[1, 5].tolist()
    assert lv[2].tolist() == before.reshape(batch, row_words)[2].tolist() and lv[3].tolist() == s[3, 5].tolist()
    idx = np.array([0, T1 + 2, 3, 2**32 - 1], np.uint32)
    rt.spec_tree_state_flip([idx, None], T1, t, ctl, D, batch)
    assert idx.tolist() == [T1 + 4, 5, 3, 5]


def test_begin_places_the_pending_token_at_the_round_start():
    t = rt.TreeArrays.zeros(40, 3, 2)
    t.mask[:] = 0xFFFFFFFF
    t.score[:] = 5
    vtok, pos_start = np.zeros(8, np.uint32), np.zeros(2, np.int32)
    rt.spec_tree_begin(t, u32(11, 12), np.array([7, -5], np.int32), pos_start, vtok, 3, 2)
    assert vtok.tolist() == [11, 0, 0, 0, 12, 0, 0, 0] and pos_start.tolist() == [7, -5]
    for b, (tok, pos) in enumerate([(11, 7), (12, -5)]):
        r = t.row(b)
        assert (r.tok[0], r.parent[0], r.depth[0], r.rank[0], r.pos[0], r.score[0]) == (tok, ROOT_PARENT, 0, 0, pos, 0)
        assert r.mask[0].tolist() == [1, 0] and rt.mask_bits(r.mask[1]) == set(range(64))



# -- 13 + 4 + 5: the greedy round tail, then compaction ---------------------------------------

TREE_FIELDS = ("tok", "parent", "depth", "rank", "pos", "mask", "score", "path")


def test_the_greedy_tail_then_compaction_is_accept_compact_commit_rollback():
    """The tail (13, 4 and 5 in one launch, spec_tree_round_tail_greedy) followed by kernel 15
    leaves every buffer as the round's order without it (13, 15, 4, 5): the commit and the
    rollback write nothing the compaction reads (keep, the accepted count, the path,
    pos_start), and read nothing it writes (KV entries). Random static trees of tiny
    vocabularies (deep accepts), EOS ids among the tokens (a stop inside the path), budgets of 0,
    full rings, marks, done rows, slots past the capacity; a table with pos_ctr and a repeat."""
    rng = np.random.default_rng(13)
    batch, K = 3, 3
    moved = 0
    for case in range(200):
        parents, ranks = random_tree(rng, int(rng.integers(2, 20)), int(rng.integers(1, 5)), False)
        ranks = [r if r == VOID_RANK else min(r, K - 1) for r in ranks]
        T1, D = len(parents), len(levels_of(parents)) - 1
        cand = rng.integers(0, 3, (batch, T1, K))
        pend, pos_ctr = rng.integers(0, 3, batch).astype(np.uint32), rng.integers(0, 12, batch).astype(np.int32)
        s = round_state(batch, D, rng, [b for b in range(batch) if rng.random() < 0.2], marks=D + 2)
        t = static_tree(parents, ranks, cand, np.zeros(cand.shape, np.float32), pend, pos_ctr, s["vtok"], D, batch)
        ring_cap = int(rng.integers(1, 2 * (D + 1)))
        ring = rng.integers(0, 2**32, batch * (1 + ring_cap), dtype=np.uint64).astype(np.uint32)
        ring[::1 + ring_cap] = rng.choice([0, 1, ring_cap, ring_cap + 1], batch)
        s["ctl"][0::CTL_WORDS] = np.where(rng.random(batch) < 0.6, rng.integers(0, 3, batch), -1)  # EOS
        s["ctl"][1::CTL_WORDS] = rng.choice([0, 1, 2, -1, 2**31 - 1], batch)  # budget
        before = dict(s, pred=rng.integers(0, 3, batch * T1).astype(np.int64), pend=pend, ring=ring,
                      pos_ctr=pos_ctr, pos_start=pos_ctr.copy(), lens=np.zeros(2 * batch, np.int32),
                      k0=kv(batch, 16, 2, rng), v0=kv(batch, 16, 2, rng), k2=kv(batch, 14, 1, rng),
                      **{name: getattr(t, name) for name in TREE_FIELDS})
        runs = []
        for fused in (False, True):
            x = {name: words.copy() for name, words in before.items()}
            tree = rt.TreeArrays(T1, D, batch, **{name: x[name] for name in TREE_FIELDS})
            table = [(x["k0"], x["v0"], 32, 2, 2, 16), None, (x["k2"], None, 14, 1, 1, 14)]
            lengths = [x["lens"][:batch], None, x["pos_ctr"], x["lens"][batch:], x["lens"][:batch]]
            state = (x["vtok"], x["brk"], x["acc"], x["last_pred"], x["ctl"])
            if fused:
                rt.spec_tree_round_tail_greedy(tree, x["pred"], D, *state, x["pend"], x["ring"], ring_cap, lengths,
                                               x["pos_start"], batch)
                rt.spec_tree_compact(table, tree, x["acc"], x["pos_start"], x["ctl"], D, batch)
            else:
                rt.spec_tree_accept_greedy(tree, x["pred"], D, *state, batch)
                rt.spec_tree_compact(table, tree, x["acc"], x["pos_start"], x["ctl"], D, batch)
                ref.spec_ring_commit(x["vtok"], x["acc"], x["last_pred"], x["ctl"], x["pend"], x["ring"], ring_cap, D,
                                     batch)
                ref.spec_rollback_stream(lengths, x["pos_start"], x["ctl"], batch)
            runs.append(x)
        for name in before:
            assert runs[0][name].tobytes() == runs[1][name].tobytes(), f"case {case}: {name}"
        moved += not np.array_equal(runs[1]["k0"], before["k0"])
    assert moved > 20, "compaction moved KV in too few cases to tell the orders apart"


def test_a_trees_k_is_a_count_of_drafts_refused_naming_it_before_anything_is_written():
    """The tree's begin and acceptances read their vtok rows by k + 1 words (row_views): a negative
    k made them empty or cut by numpy's negative bounds, so spec_tree_begin wrote node 0's token
    and then met an index error, naming nothing, and spec_tree_accept_greedy accepted no draft in
    any row (its cap min(k, D) below 0), silently. Refused naming k (sizes), before the tree's
    arrays or any buffer are written."""
    batch, k = 2, 2

    def arrays() -> tuple[rt.TreeArrays, dict[str, np.ndarray]]:
        t = rt.TreeArrays.zeros(k + 1, k, batch)
        t.tok[:] = 5
        state = dict(pend=np.full(batch, 9, np.uint32), pos_ctr=np.full(batch, 4, np.int32),
                     pos_start=np.zeros(batch, np.int32), vtok=np.zeros(batch * (k + 1), np.uint32),
                     pred=np.zeros(batch * (k + 1), np.uint32), brk=np.zeros(batch * BRK_WORDS, np.uint32),
                     acc=np.zeros(batch * ref.ACC_WORDS, np.uint32), last_pred=np.zeros(batch, np.uint32),
                     ctl=np.zeros(batch * CTL_WORDS, np.int32))
        return t, state

    calls = {
        "begin": lambda t, s, k: rt.spec_tree_begin(t, s["pend"], s["pos_ctr"], s["pos_start"], s["vtok"], k, batch),
        "accept": lambda t, s, k: rt.spec_tree_accept_greedy(t, s["pred"], k, s["vtok"], s["brk"], s["acc"],
                                                             s["last_pred"], s["ctl"], batch),
    }
    for name, call in calls.items():
        call(*arrays(), k)
        for bad, error in ((-1, ValueError), (-3, ValueError), (True, TypeError)):
            t, state = arrays()
            before = {n: words.copy() for n, words in (*state.items(), *vars(t).items())
                      if isinstance(words, np.ndarray)}
            with pytest.raises(error, match="^k must be an int"):
                call(t, state, bad)
            after = {**state, **{n: w for n, w in vars(t).items() if isinstance(w, np.ndarray)}}
            assert all(np.array_equal(after[n], before[n]) for n in before), f"{name} wrote before k's refusal"


def test_the_trees_buffers_are_read_and_written_through_views_or_refused_naming_them():
    """The tree's draws, levels and sampled acceptance saw their flat buffers through a reshape of
    the whole buffer (its _rows, now the chain's rows_of): a buffer with words past its rows (a
    test's guard words) met numpy's "cannot reshape", one short of them too, naming nothing, and a
    list met "'list' object has no attribute 'reshape'". The rows are read and written through a
    view of the buffer's first words, as the chain's are, and what holds too few or no view reaches
    is refused naming it, before the tree or any buffer is written."""
    t, V, draws, batch, T1 = rt.TreeArrays.zeros(3, 2, 2), 50, 3, 2, 3
    levels = levels_of([-1, 0, 0]) + [(3, 3)]
    q = np.full(batch * T1 * V, 1 / V, np.float32)
    seed, pos = np.array([5, 5], np.uint64), np.array([10, 10], np.int32)

    def cand(extra: int = 0) -> list[np.ndarray]:
        return [np.full(batch * T1 * draws + extra, 9, dt) for dt in (np.uint32, np.float32, np.float32)]

    want = cand()
    rt.spec_tree_draw(t, 2, levels, q, V, seed, pos, draws, *want, batch)
    guarded = cand(2)
    rt.spec_tree_draw(t, 2, levels, np.append(q, q[:5]), V, seed, pos, draws, *guarded, batch)
    assert all(g[:-2].tolist() == w.tolist() and g[-2:].tolist() == [9, 9] for g, w in zip(guarded, want))
    for i, name in enumerate(("cand_tok", "cand_logq", "cand_sel")):
        for bad, message in ((lambda c: c[:-1], f"^{name} must be a flat array of at least 18 values "
                                                r"\(2 rows of 9\)"),
                             (lambda c: c.tolist(), f"^{name} must be a numpy array, which the reference writes")):
            given = cand()
            given[i] = bad(given[i])
            before = [np.array(c).copy() for c in given]
            with pytest.raises(ValueError, match=message):
                rt.spec_tree_draw(t, 2, levels, q, V, seed, pos, draws, *given, batch)
            assert all(np.array_equal(np.array(c), b) for c, b in zip(given, before)), f"wrote before {name}'s refusal"
    with pytest.raises(ValueError, match=r"^q must be a flat array of at least 300 values \(2 rows of 150\)"):
        rt.spec_tree_draw(t, 2, levels, q[:-1], V, seed, pos, draws, *cand(), batch)


def test_the_trees_round_tail_checks_every_steps_buffers_before_its_acceptance_writes_any():
    """spec_tree_round_tail_greedy is kernel 13's acceptance, the chain's commit and rollback in
    turn, each checking its own buffers: a ring or a length array the sizes do not fit was refused
    by the commit or the rollback after the acceptance had written acc, ctl, vtok, last_pred and
    the path. All three steps' buffers are checked first."""
    batch, D, ring_cap = 2, 2, 4
    parents, ranks = chain(D)

    def case() -> tuple[rt.TreeArrays, dict[str, np.ndarray]]:
        s = round_state(batch, D, np.random.default_rng(3))
        pend, pos_ctr = u32(1, 2), np.array([4, 6], np.int32)
        t = static_tree(parents, ranks, np.zeros((batch, D + 1, 1)), np.zeros((batch, D + 1, 1), np.float32), pend,
                        pos_ctr, s["vtok"], D, batch)
        return t, dict(s, pred=np.zeros(batch * (D + 1), np.uint32), pend=pend, pos_start=pos_ctr.copy(),
                       ring=np.zeros(batch * (1 + ring_cap), np.uint32), length=np.zeros(batch, np.int32))

    def tail(t: rt.TreeArrays, a: dict[str, np.ndarray]) -> None:
        rt.spec_tree_round_tail_greedy(t, a["pred"], D, a["vtok"], a["brk"], a["acc"], a["last_pred"], a["ctl"],
                                       a["pend"], a["ring"], ring_cap, [a["length"], None], a["pos_start"], batch)

    t, given = case()
    tail(t, given)
    assert given["ctl"][CTL_KEEP::CTL_WORDS].tolist() == [D + 1] * batch, "the acceptance writes keep"
    for key, name in (("length", "len_ptrs[0]"), ("ring", "ring"), ("pos_start", "pos_start")):
        t, given = case()
        given[key] = given[key][:-1]
        before = {n: words.copy() for n, words in (*given.items(), *vars(t).items()) if isinstance(words, np.ndarray)}
        with pytest.raises(ValueError, match=f"^{re.escape(name)} must be a flat array of at least "):
            tail(t, given)
        after = {**given, **{n: w for n, w in vars(t).items() if isinstance(w, np.ndarray)}}
        assert all(np.array_equal(after[n], before[n]) for n in before), f"the tail wrote before {name}'s refusal"

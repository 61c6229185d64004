"""The executable specification of the tree kernels (docs/trees.md, kernels 10 to 17), in numpy.

The tree round's twin of testing.reference, and for the same reason: the GPU tests compare the
kernels against it word for word, so it computes what they compute, in their arithmetic (f32
where a kernel holds f32, f64 sums rounded to f32 where the contract says so) and with their
clamps, and it is the plainest statement of the contracts. One function per kernel, named after
it, updating numpy arrays that stand for the device buffers in place; each takes `batch` (B) and
treats row b alone, as the kernels do. The tree's own buffers (TreeBufs's fields) travel together
as a TreeArrays; the round-stream buffers (vtok, acc, ctl, ...) are flat arrays as in the chain's
reference, which this module reuses for everything a tree shares with a chain (ids, probabilities,
the exponential race, the Philox keys), so that a one-branch tree computes exactly what the chain
computes.

A tree of garbage (a parent not before its child, a rank or token past its buffer, a path entry
past the tree) is read defensively, as the kernels read it: nothing is indexed out of range, and
a node whose parent is not before it is never a child, never accepted.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..buffers.layout import (ACC_ROUND, ACC_TOTAL, ACC_WORDS, BRK_COUNT, BRK_MARK, BRK_WORDS, CTL_DONE, CTL_KEEP,
                              CTL_WORDS, MAX_TREE_DRAWS, ROOT_PARENT, VOID_RANK)
from .philox import uniform
from .reference import (NO_MASS_TOKEN, PURPOSE_ACCEPT, PURPOSE_DRAFT, PURPOSE_SAMPLE, commit_rows, ids, kept_states,
                        marked_limit, race_scores, rollback_rows, row_views, rows_of, sample_race, spec_ring_commit,
                        spec_rollback_stream, spec_state_copy, spec_state_flip)
from .reference import probabilities as chain_probabilities

_U32 = 0xFFFFFFFF
_NEG_INF = np.float32(-np.inf)
Levels = Sequence[tuple[int, int]]  # each depth's nodes [start, stop), as TreeShape.levels has them


def probabilities(x: np.ndarray) -> np.ndarray:
    """x as float32 with NaN, negative and infinite entries 0: how the tree kernels read a
    probability (the chain's keep +inf; a tree's residual would make NaN of it)."""
    x = chain_probabilities(x)
    return np.where(np.isinf(x), np.float32(0), x)


def _i32(value: int) -> int:
    """value wrapped to a signed 32-bit word, as the kernels' i32 arithmetic wraps it."""
    return (int(value) + 2**31) % 2**32 - 2**31


# -- the tree's buffers ----------------------------------------------------------------------

@dataclass
class TreeArrays:
    """TreeBufs's fields for B rows as the kernels see them: flat, row-major numpy arrays (u32
    unless said) of T1 = T + 1 nodes a row, W = ceil(T1 / 32) mask words a node, D + 1 path
    entries a row."""

    nodes: int  # T1
    depth_max: int  # D
    batch: int
    tok: np.ndarray  # u32[B*T1]
    parent: np.ndarray  # u32[B*T1]
    depth: np.ndarray  # u32[B*T1]
    rank: np.ndarray  # u32[B*T1]
    pos: np.ndarray  # i32[B*T1]
    mask: np.ndarray  # u32[B*T1*W]
    score: np.ndarray  # f32[B*T1]
    path: np.ndarray  # u32[B*(D+1)]

    @property
    def words(self) -> int:
        return (self.nodes + 31) // 32

    @classmethod
    def zeros(cls, nodes: int, depth_max: int, batch: int = 1) -> TreeArrays:
        n, words = batch * nodes, (nodes + 31) // 32
        return cls(nodes, depth_max, batch, tok=np.zeros(n, np.uint32), parent=np.zeros(n, np.uint32),
                   depth=np.zeros(n, np.uint32), rank=np.zeros(n, np.uint32), pos=np.zeros(n, np.int32),
                   mask=np.zeros(n * words, np.uint32), score=np.zeros(n, np.float32),
                   path=np.zeros(batch * (depth_max + 1), np.uint32))

    def row(self, b: int) -> TreeRow:
        """Views of row b, which the kernels' functions update in place."""
        t1, w, p = self.nodes, self.words, self.depth_max + 1
        return TreeRow(tok=self.tok[b * t1:(b + 1) * t1], parent=self.parent[b * t1:(b + 1) * t1],
                       depth=self.depth[b * t1:(b + 1) * t1], rank=self.rank[b * t1:(b + 1) * t1],
                       pos=self.pos[b * t1:(b + 1) * t1], score=self.score[b * t1:(b + 1) * t1],
                       mask=rows_of(self.mask[b * t1 * w:(b + 1) * t1 * w], t1, w, "mask"),
                       path=self.path[b * p:(b + 1) * p])


@dataclass(frozen=True)
class TreeRow:
    """One row of a TreeArrays, as views into it: tok, parent, depth, rank, pos, score [T1],
    mask [T1][W], path [D+1]."""

    tok: np.ndarray
    parent: np.ndarray
    depth: np.ndarray
    rank: np.ndarray
    pos: np.ndarray
    score: np.ndarray
    mask: np.ndarray
    path: np.ndarray


def mask_bits(mask_row: np.ndarray) -> set[int]:
    """The node indices whose bits are set in one node's W mask words (bit j: word j // 32, bit j % 32)."""
    return {32 * w + j for w, word in enumerate(mask_row.tolist()) for j in range(32) if word >> j & 1}


def _own_bit(mask: np.ndarray, c: int, base: np.ndarray) -> None:
    """mask[c] = base | {c}."""
    mask[c] = base
    mask[c, c // 32] |= np.uint32(1 << (c % 32))


# -- 10. spec_tree_begin ---------------------------------------------------------------------

def spec_tree_begin(t: TreeArrays, pend: np.ndarray, pos_ctr: np.ndarray, pos_start: np.ndarray, vtok: np.ndarray,
                    k: int, batch: int = 1) -> None:
    """Node 0 is the pending token at pos_start = pos_ctr: tok[0] = vtok[0] = pend, parent ROOT_PARENT,
    depth 0, rank 0, pos pos_ctr, mask {0}, score 0. The other nodes are left to the levels."""
    for b, (pend_b, pos_ctr_b, pos_start_b, vtok_b) in enumerate(
            row_views(batch, k=k, pend=(pend, 1), pos_ctr=(pos_ctr, 1), pos_start=(pos_start, 1),
                      vtok=(vtok, k + 1))):
        r = t.row(b)
        r.tok[0] = vtok_b[0] = pend_b[0]
        r.parent[0], r.depth[0], r.rank[0] = ROOT_PARENT, 0, 0
        r.pos[0] = pos_start_b[0] = pos_ctr_b[0]
        r.mask[0] = 0
        r.mask[0, 0] = 1
        r.score[0] = 0


# -- 12. spec_tree_draw (sampling) -----------------------------------------------------------

def spec_tree_draw(t: TreeArrays, level: int, levels: Levels, q: np.ndarray, V: int, seed: np.ndarray,
                   pos_start: np.ndarray, draws: int, cand_tok: np.ndarray, cand_logq: np.ndarray,
                   cand_sel: np.ndarray, batch: int = 1) -> None:
    """The draws that make `level` (d + 1): each non-void node p of level d = level - 1
    (levels[d] = (start, stop)) draws `draws` tokens without replacement from q[b][p]
    (f32 [B][T1][V], read by probabilities): the `draws` largest race scores q(v) / E_v over
    q(v) > 0, E_v = -ln U(seed, pos_start + level, v, PURPOSE_DRAFT, node word p - d), in
    decreasing order (ties to the smaller v). Into cand_*[b][p][j] ([B][T1][draws]): the j-th
    draw's token (0 past the draws), its f32 ln q (-inf past), and sel = f32 ln of the j-th largest
    q value (-inf past the positive values). Rows of void or other nodes are not touched."""
    d = level - 1
    start, stop = levels[d]
    T1 = t.nodes
    # [B][T1][draws] views, which the level's rows are written through (rows_of)
    toks, logqs, sels = (rows_of(a, batch, T1 * draws, name).reshape(batch, T1, draws) for name, a in (
        ("cand_tok", cand_tok), ("cand_logq", cand_logq), ("cand_sel", cand_sel)))
    qp = probabilities(rows_of(q, batch, T1 * V, "q").reshape(batch, T1, V)[:, start:stop])  # [B][P][V], P: the level
    positions = np.asarray(pos_start).astype(np.int64)[:, None] + level
    scores = race_scores(qp, np.asarray(seed)[:, None], positions, PURPOSE_DRAFT, np.arange(start, stop)[None, :] - d)
    n = np.minimum(np.count_nonzero(scores > -np.inf, axis=-1), draws)[..., None]  # [B][P][1] draws made
    width = min(draws, V)
    drawn = np.zeros(qp.shape[:2] + (draws,), np.int64)
    drawn[..., :width] = np.argsort(-scores, axis=-1, kind="stable")[..., :width]  # ties: the smaller v
    largest = np.zeros(qp.shape[:2] + (draws,), np.float32)
    largest[..., :width] = -np.sort(-qp, axis=-1)[..., :width]
    made = np.arange(draws) < n
    with np.errstate(divide="ignore"):
        logq = np.where(made, np.log(np.take_along_axis(qp, np.minimum(drawn, V - 1), axis=-1)), _NEG_INF)
        sel = np.where(largest > 0, np.log(largest), _NEG_INF)
    live = t.rank.reshape(batch, T1)[:, start:stop] != VOID_RANK  # void parents' rows are not touched
    for out, values in ((toks, np.where(made, drawn, 0)), (logqs, logq), (sels, sel)):
        level_rows = out[:, start:stop]
        level_rows[live] = values[live]


# -- 11. spec_tree_grow ----------------------------------------------------------------------

def spec_tree_grow(t: TreeArrays, level: int, levels: Levels, cand_tok: np.ndarray, cand_logq: np.ndarray,
                   cand_sel: np.ndarray, K: int, pos_start: np.ndarray, *, shape_parent: np.ndarray | None = None,
                   shape_rank: np.ndarray | None = None, width: int | None = None, branch: int | None = None,
                   batch: int = 1) -> None:
    """Place the nodes of `level` (levels[level] = (start, stop)) from the candidates of level - 1's
    nodes: cand_tok ([B][T1][K], 32 or 64 bit, ids read), cand_logq and cand_sel (f32 [B][T1][K]).

    Static (shape_parent, shape_rank, u32[T1]: the topology): node c with parent p, rank r gets
    tok[p][r], rank r, score f32(score[p] + logq[p][r]); it is void (tok 0, rank VOID_RANK, score
    -inf, parent still p) if p is void, r >= K or logq[p][r] is not finite. A parent not before the
    level (p >= start: garbage, or a node the same launch writes) makes c void with parent p as
    given and mask {c}.

    Dynamic (width, branch): the offers (p, j) of level - 1's non-void nodes, j < min(branch, K),
    sel[p][j] finite, scored f32(score[p] + sel[p][j]) (a NaN score ranks as -inf); the
    min(width, stop - start) best (ties: lower p, then lower j) become the first nodes of the level
    in (p, j) order, rank j, tok[p][j], score f32(score[p] + logq[p][j]); the rest are void with
    parent 0 (width defaults to the level's size, branch to K). Every node gets depth level, pos
    pos_start + level and mask mask[parent] | {c}."""
    if (shape_parent is None) != (shape_rank is None):
        raise ValueError("a static tree's level takes both shape_parent and shape_rank, a dynamic one neither")
    start, stop = levels[level]
    T1 = t.nodes
    toks = ids(rows_of(cand_tok, batch, T1 * K, "cand_tok").reshape(batch, T1, K))
    logqs, sels = (rows_of(np.asarray(x, np.float32), batch, T1 * K, name).reshape(batch, T1, K)
                   for name, x in (("cand_logq", cand_logq), ("cand_sel", cand_sel)))
    for b in range(batch):
        r = t.row(b)
        if shape_parent is not None and shape_rank is not None:
            placed = _static_level(r, start, stop, shape_parent, shape_rank, K, logqs[b])
        else:
            placed = _dynamic_level(r, levels[level - 1], start, stop, stop - start if width is None else width,
                                    K if branch is None else branch, K, sels[b])
        position = _i32(int(pos_start[b]) + level)
        for c, (p, j, void) in zip(range(start, stop), placed):
            r.parent[c], r.depth[c], r.pos[c] = p, level, position
            if void:
                r.tok[c], r.rank[c], r.score[c] = 0, VOID_RANK, _NEG_INF
            else:
                r.tok[c], r.rank[c] = toks[b, p, j], j
                r.score[c] = np.float32(r.score[p]) + logqs[b, p, j]
            _own_bit(r.mask, c, r.mask[p] if p < start else np.zeros(t.words, np.uint32))


def _static_level(r: TreeRow, start: int, stop: int, shape_parent: np.ndarray, shape_rank: np.ndarray, K: int,
                  logq: np.ndarray) -> list[tuple[int, int, bool]]:
    """(parent, rank, void) of each node of a static level."""
    placed = []
    for c in range(start, stop):
        p, j = int(shape_parent[c]), int(shape_rank[c])
        void = p >= start or int(r.rank[p]) == VOID_RANK or j >= K or not np.isfinite(logq[p, j])
        placed.append((p, j, void))
    return placed


def _dynamic_level(r: TreeRow, parents: tuple[int, int], start: int, stop: int, width: int, branch: int, K: int,
                   sel: np.ndarray) -> list[tuple[int, int, bool]]:
    """(parent, rank, void) of each node of a dynamic level: the best offers in (p, j) order, then voids."""
    offers = []
    for p in range(*parents):
        if int(r.rank[p]) == VOID_RANK:
            continue
        for j in range(min(branch, K)):
            if np.isfinite(sel[p, j]):
                score = np.float32(r.score[p]) + sel[p, j]
                offers.append((-np.inf if np.isnan(score) else float(score), p, j))
    best = sorted(offers, key=lambda o: (-o[0], o[1], o[2]))[:min(width, stop - start)]
    placed = [(p, j, False) for _, p, j in sorted(best, key=lambda o: (o[1], o[2]))]
    return placed + [(0, VOID_RANK, True)] * (stop - start - len(placed))


# -- 13, 14. the accepts ---------------------------------------------------------------------

def _settle(r: TreeRow, path: list[int], token: int, vtok: np.ndarray, brk: np.ndarray, acc: np.ndarray,
            last_pred: np.ndarray, ctl: np.ndarray) -> None:
    """A live row's verdict: path[0..a] (a = len(path) - 1), vtok[1 + d] = tok[path[1 + d]],
    acc[ACC_ROUND] = a, acc[ACC_TOTAL] += a (wrapping), last_pred = token, keep = a + 1; a round
    capped by its mark counted in BRK_COUNT (wrapping), as a chain's is; the mark cleared."""
    a = len(path) - 1
    if brk[BRK_MARK]:
        brk[BRK_COUNT] = (int(brk[BRK_COUNT]) + 1) & _U32
    r.path[:a + 1] = path
    vtok[1:1 + a] = r.tok[path[1:]]
    acc[ACC_ROUND] = a
    acc[ACC_TOTAL] = (int(acc[ACC_TOTAL]) + a) & _U32
    last_pred[0] = token
    ctl[CTL_KEEP] = a + 1
    brk[BRK_MARK] = 0


def _settle_done(r: TreeRow, brk: np.ndarray, acc: np.ndarray, ctl: np.ndarray) -> None:
    """A done row: nothing accepted, nothing kept, path [0]; last_pred and BRK_COUNT untouched."""
    acc[ACC_ROUND] = 0
    ctl[CTL_KEEP] = 0
    r.path[0] = 0
    brk[BRK_MARK] = 0


def _root_path(r: TreeRow, n: int) -> list[int]:
    path = [n]
    while path[-1] != 0:
        path.append(int(r.parent[path[-1]]))
    return path[::-1]


def _accept_rows(t: TreeArrays, k: int, batch: int, vtok: np.ndarray, brk: np.ndarray, acc: np.ndarray,
                 last_pred: np.ndarray, ctl: np.ndarray
                 ) -> Iterator[tuple[int, TreeRow, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """(b, row views, cap, vtok, brk, acc, last_pred, ctl) of each row; cap, the deepest a path may
    go: min(k, D) (the vtok row has k + 1 words, the path row D + 1), lowered by the row's mark
    (marked_limit: the draft length chosen for it, docs/lengths.md). The buffers are checked
    (row_views) when this is called, before a row is read: a round's tail checks them so."""
    rows = row_views(batch, k=k, vtok=(vtok, k + 1), brk=(brk, BRK_WORDS), acc=(acc, ACC_WORDS),
                     last_pred=(last_pred, 1), ctl=(ctl, CTL_WORDS))
    return ((b, t.row(b), marked_limit(int(brk_b[BRK_MARK]), min(k, t.depth_max)), vtok_b, brk_b, acc_b, last_pred_b,
             ctl_b) for b, (vtok_b, brk_b, acc_b, last_pred_b, ctl_b) in enumerate(rows))


def spec_tree_accept_greedy(t: TreeArrays, pred: np.ndarray, k: int, vtok: np.ndarray, brk: np.ndarray,
                            acc: np.ndarray, last_pred: np.ndarray, ctl: np.ndarray, batch: int = 1) -> None:
    """Kernel 13. Node i >= 1 is good iff it is not void, its parent p is before it (p < i), p is
    good, p's depth (its parent hops from node 0) is below min(k, D), and tok[i] == ids(pred[p])
    (pred [B][T1], 32 or 64 bit); node 0 is good. The accepted node n is the good node of most hops,
    ties to the smaller index; the stored depth is not read. Then path[0..a] = n's root path
    (a its hops), vtok[1 + d] = tok[path[1 + d]] for d < a, acc[ACC_ROUND] = a, acc[ACC_TOTAL] += a,
    last_pred = ids(pred[n]), keep = a + 1. A done row: acc[ACC_ROUND] = 0, keep 0, path[0] = 0.
    brk[BRK_MARK] = 0 in every row; a live row whose mark was set counts a capped round in BRK_COUNT."""
    T1 = t.nodes
    preds = ids(np.asarray(pred).reshape(batch, T1))
    for b, r, cap, vtok_b, brk_b, acc_b, last_pred_b, ctl_b in _accept_rows(t, k, batch, vtok, brk, acc,
                                                                            last_pred, ctl):
        if ctl_b[CTL_DONE] != 0:
            _settle_done(r, brk_b, acc_b, ctl_b)
            continue
        hops = [0] + [-1] * (T1 - 1)  # -1: not good
        for i in range(1, T1):
            p = int(r.parent[i])
            if p < i and hops[p] >= 0 and hops[p] < cap and int(r.rank[i]) != VOID_RANK and r.tok[i] == preds[b, p]:
                hops[i] = hops[p] + 1
        n = max(range(T1), key=lambda i: (hops[i], -i))
        _settle(r, _root_path(r, n), int(preds[b, n]), vtok_b, brk_b, acc_b, last_pred_b, ctl_b)


def spec_tree_round_tail_greedy(t: TreeArrays, pred: np.ndarray, k: int, vtok: np.ndarray, brk: np.ndarray,
                                acc: np.ndarray, last_pred: np.ndarray, ctl: np.ndarray, pend: np.ndarray,
                                ring: np.ndarray, ring_cap: int, len_ptrs: list, pos_start: np.ndarray,
                                batch: int = 1) -> None:
    """Kernels 13, 4 and 5 in one launch (a greedy tree round's tail): exactly
    spec_tree_accept_greedy, then the chain's spec_ring_commit (vtok rows of k + 1 = D + 1
    words), then spec_rollback_stream over `len_ptrs`. What kernel 15 reads after it (keep,
    acc[ACC_ROUND], the path, pos_start) is what the acceptance left. The buffers of all three are
    checked before the first writes any (a ring or a length array the sizes do not fit was refused
    by the second or the third, after the acceptance had written acc, ctl, vtok and the path)."""
    _accept_rows(t, k, batch, vtok, brk, acc, last_pred, ctl)
    commit_rows(vtok, acc, last_pred, ctl, pend, ring, ring_cap, k, batch)
    rollback_rows(len_ptrs, pos_start, ctl, batch)
    spec_tree_accept_greedy(t, pred, k, vtok, brk, acc, last_pred, ctl, batch)
    spec_ring_commit(vtok, acc, last_pred, ctl, pend, ring, ring_cap, k, batch)
    spec_rollback_stream(len_ptrs, pos_start, ctl, batch)


def tree_children(r: TreeRow, n: int) -> list[int]:
    """The children kernel 14 tries at node n: the non-void nodes c > n with parent n, in rank
    order (ties to the smaller index), the first MAX_TREE_DRAWS of them."""
    T1 = len(r.tok)
    kids = [c for c in range(n + 1, T1) if int(r.parent[c]) == n and int(r.rank[c]) != VOID_RANK]
    return sorted(kids, key=lambda c: (int(r.rank[c]), c))[:MAX_TREE_DRAWS]


def spec_tree_accept_sample(t: TreeArrays, p: np.ndarray, q: np.ndarray, V: int, k: int, vtok: np.ndarray,
                            brk: np.ndarray, acc: np.ndarray, last_pred: np.ndarray, ctl: np.ndarray,
                            pos_start: np.ndarray, seed: np.ndarray, batch: int = 1) -> None:
    """Kernel 14: recursive rejection sampling without replacement down the tree, from node 0.

    p, q: f32 [B][T1][V] (the target's and the draft's law at each node), seed u64 [B]. At node n
    of depth h (hops from node 0), while h is below the row's cap (kernel 13's), its children
    (tree_children) are tried in order with f = probabilities(p[n]), g = g0 = probabilities(q[n]),
    all f32: child c of token x (x >= V: f(x) = g(x) = 0, never indexed) is accepted iff f32(U) * g(x) < f(x), U =
    U(seed, pos_start + h + 1, 0, PURPOSE_ACCEPT, node word c - h - 1), and the walk goes on at c.
    On rejection: residual = max(f - g, 0) (NaN counts 0), Z = f32(f64 sum of it), f = residual / Z
    if Z > 0 (else f is kept); then x joins the removed tokens (its g0(x) added, once, to the removed
    mass m, f64), and g = g0 / f32(1 - m) with the removed tokens 0, or all 0 if f32(1 - m) <= 0.
    Where every child is rejected, or there is none, or the walk is at the cap (f is p[n] itself),
    the bonus is raced over f (PURPOSE_SAMPLE,
    position pos_start + h + 1, node word n - h); NO_MASS_TOKEN if f has no positive weight. The
    verdict is settled as kernel 13's, done rows too."""
    T1 = t.nodes
    ps, qs = (rows_of(np.asarray(x, np.float32), batch, T1 * V, name).reshape(batch, T1, V)
              for name, x in (("p", p), ("q", q)))
    for b, r, cap, vtok_b, brk_b, acc_b, last_pred_b, ctl_b in _accept_rows(t, k, batch, vtok, brk, acc,
                                                                            last_pred, ctl):
        if ctl_b[CTL_DONE] != 0:
            _settle_done(r, brk_b, acc_b, ctl_b)
            continue
        path, weights, position, node = _sample_walk(r, ps[b], qs[b], V, cap, int(pos_start[b]), seed[b])
        token = sample_race(weights, seed[b], position, PURPOSE_SAMPLE, node)
        _settle(r, path, NO_MASS_TOKEN if token < 0 else token, vtok_b, brk_b, acc_b, last_pred_b, ctl_b)


def bonus_race(t: TreeArrays, b: int, p: np.ndarray, q: np.ndarray, V: int, k: int, pos_start: int,
               seed: npt.ArrayLike, mark: int = 0) -> tuple[np.ndarray, int, int]:
    """(weights, position, node word) of the race that gives row b's bonus in kernel 14, the row taken
    as live: the f32 weights f at the node where the walk stops, pos_start + h + 1 and n - h. For a
    GPU test that allows the kernel's race a near tie; `seed` is row b's (the walk depends on it),
    `mark` its brk[BRK_MARK] word before the accept."""
    T1 = t.nodes
    ps, qs = (np.asarray(x, np.float32).reshape(t.batch, T1, V)[b] for x in (p, q))
    cap = marked_limit(mark, min(k, t.depth_max))
    _, weights, position, node = _sample_walk(t.row(b), ps, qs, V, cap, int(pos_start), seed)
    return weights, position, node


def _sample_walk(r: TreeRow, p: np.ndarray, q: np.ndarray, V: int, cap: int, pos_start: int,
                 seed: npt.ArrayLike) -> tuple[list[int], np.ndarray, int, int]:
    """(the accepted root path, and the bonus race's f32 weights, position and node word) of one live row."""
    path = [0]
    while True:
        n, h = path[-1], len(path) - 1
        f, g0 = probabilities(p[n]), probabilities(q[n])
        g, removed, mass = g0, np.zeros(V, bool), 0.0
        accepted = None
        for c in (tree_children(r, n) if h < cap else []):
            x = int(r.tok[c])
            f_x, g_x = (f[x], g[x]) if x < V else (np.float32(0), np.float32(0))
            u = np.float32(uniform(seed, pos_start + h + 1, 0, PURPOSE_ACCEPT, c - h - 1))
            if u * g_x < f_x:
                accepted = c
                break
            with np.errstate(invalid="ignore"):
                residual = probabilities(f - g)
            z = np.float32(np.sum(residual, dtype=np.float64))
            if z > 0:
                f = residual / z
            if x < V and not removed[x]:
                removed[x] = True
                mass += float(g0[x])
            rest = np.float32(1.0 - mass)
            with np.errstate(invalid="ignore", over="ignore"):
                g = np.where(removed, np.float32(0), g0 / rest) if rest > 0 else np.zeros(V, np.float32)
        if accepted is None:
            return path, f, pos_start + h + 1, n - h
        path.append(accepted)


# -- 15. spec_tree_compact -------------------------------------------------------------------

def spec_tree_compact(table: list, t: TreeArrays, acc: np.ndarray, pos_start: np.ndarray, ctl: np.ndarray, k: int,
                      batch: int = 1) -> None:
    """Move the accepted path's KV entries to their depths' slots.

    The table holds per layer (k_words, v_words or None, row_stride, pos_stride, words_per_pos,
    capacity), or None: the flat uint32 arrays stand for the K and V memory, strides in 32-bit
    words. For each row with keep = min(u32 ctl keep, k + 1) > 0, a = min(acc[ACC_ROUND], k, D),
    and d = 1..a in increasing d: src = pos_start + path[d], dst = pos_start + d; skipped where
    path[d] >= T1, src == dst, or either is negative or >= capacity; else words_per_pos words at
    row * row_stride + src * pos_stride go to row * row_stride + dst * pos_stride, in K then V."""
    for b, _ in kept_states(ctl, k, batch):
        r = t.row(b)
        a = min(int(acc[ACC_WORDS * b + ACC_ROUND]), k, t.depth_max)
        for d in range(1, a + 1):
            node = int(r.path[d])
            if node >= t.nodes:
                continue
            src, dst = int(pos_start[b]) + node, int(pos_start[b]) + d
            for kw, vw, row_stride, pos_stride, words, capacity in filter(None, table):
                if src == dst or not (0 <= src < capacity and 0 <= dst < capacity):
                    continue
                for buf in (kw, vw):
                    if buf is not None:
                        s, e = b * row_stride + src * pos_stride, b * row_stride + dst * pos_stride
                        buf[e:e + words] = buf[s:s + words]


# -- 16, 17. spec_tree_state_copy, spec_tree_state_flip: recurrent state ---------------------

def kept_slot(t: TreeArrays, nodes: int, b: int, keep: int) -> int:
    """The slot the live state becomes: path[keep - 1] (keep clamped to D + 1, the path row),
    clamped to the last of the `nodes` slots."""
    return min(int(t.path[b * (t.depth_max + 1) + min(keep, t.depth_max + 1) - 1]), nodes - 1)


def spec_tree_state_copy(table: list, nodes: int, t: TreeArrays, ctl: np.ndarray, k: int, batch: int = 1) -> None:
    """Kernel 16: as spec_state_copy, with `nodes` (T1) slots a row and the kept slot
    kept_slot(path, keep): row b of live ([B][row_words]) becomes slots[b][slot] ([B][T1][row_words]).
    The table holds per layer (live, slots, row_words), or None."""
    spec_state_copy(table, k, ctl, batch, slots=nodes, slot_of=lambda b, keep: kept_slot(t, nodes, b, keep))


def spec_tree_state_flip(idx_ptrs: list, nodes: int, t: TreeArrays, ctl: np.ndarray, k: int, batch: int = 1) -> None:
    """Kernel 17: as spec_state_flip with banks of `nodes` (T1) slots: idx = (1 - bank) * T1 + slot,
    bank = min(idx // T1, 1), slot = kept_slot(path, keep); keep 0 leaves idx as it is."""
    spec_state_flip(idx_ptrs, k, ctl, batch, slots=nodes, slot_of=lambda b, keep: kept_slot(t, nodes, b, keep))

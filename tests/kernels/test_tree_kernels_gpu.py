"""The tree kernels (ptx/spec_tree.cu) on the GPU, against memra_cuda.testing.reference_tree.

A tree round's layer kernels run one at a time, each from the same state on both sides: every
buffer the round touches (the tree's nodes, the round-stream rows, the candidates, the laws, a
KV table's layers and recurrent state) is written, one kernel launched, everything read back and
compared with the reference run on host copies, so a stray write shows up as a difference. The
next kernel starts from what the GPU left. Trees are random static shapes (random parents,
choices with rank gaps) and dynamic ones, B in {1, 3, 32}, greedy and sampled, with done rows,
rows capped by their marks (a draft length chosen: 0 to past the depth), positions near the KV
capacity, tiny vocabularies (drafts agree with the target, accepts run deep) and a real one
(152 000). Races are run in f32 on the GPU and in f64 by the reference: a drawn token may differ
only where its f64 score is within NEAR_TIE of the reference's.

MEMRA_CASES (default 2000) scales the cases, MEMRA_SEED varies them.
"""
from __future__ import annotations

import functools
import os
import zlib
from itertools import islice

import numpy as np
import pytest

from memra_cuda import Geometry
from memra_cuda import DynamicTree, StateLayer, StreamBufs, TreeBufs, TreeShape, kv_data_table, state_copy_table
from memra_cuda.buffers import KVData, PointerTable, state_flip_table
from memra_cuda.kernels import SpecKernels, TreeKernels
from memra_cuda.testing import reference as ref
from memra_cuda.testing import reference_tree as rt
from memra_cuda.buffers.layout import (ACC_ROUND, ACC_WORDS, BRK_MARK, BRK_WORDS, CTL_BUDGET, CTL_DONE, CTL_EOS,
                                       CTL_WORDS, RING_COUNT, VOID_RANK)
from memra_cuda.kernels.tree import SampledCandidates

pytestmark = pytest.mark.gpu

CASES = int(os.environ.get("MEMRA_CASES", "2000"))
SEED = int(os.environ.get("MEMRA_SEED", "0"))
NEAR_TIE = 1e-5
CAPACITY = 300  # KV positions a row; pos_ctr is drawn so T + 1 slots past it sometimes overrun it
KV_WORDS = 3  # words an entry of the two-buffer layer holds
STATE_WORDS = 2


def random_shape(rng: np.random.Generator, nodes: int, depth_cap: int) -> TreeShape:
    """A random static tree of `nodes` nodes and depth at most depth_cap."""
    parents, depth = [-1], [0]
    for i in range(1, nodes):
        choices = [p for p in range(i) if depth[p] < depth_cap]
        p = int(choices[int(rng.integers(len(choices)))])
        parents.append(p)
        depth.append(depth[p] + 1)
    return TreeShape.from_parents(parents)


TREES = [("chain4", TreeShape.chain(4)), ("choices", TreeShape.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0],
                                                                             [0, 0, 0], [0, 0, 1], [2, 0]])),
         ("gapped", TreeShape.from_choices([[0], [2], [0, 1], [2, 3]])),
         ("random16", random_shape(np.random.default_rng(16), 16, 5)),
         ("random64", random_shape(np.random.default_rng(64), 64, 8)),
         ("dynamic", DynamicTree(depth=4, width=4, branch=3)), ("dynamic64", DynamicTree(depth=7, width=9, branch=4))]
SAMPLED = [(name, tree) for name, tree in TREES if name != "gapped"]


class Rig:
    """One configuration's device buffers, prepared launches, and host copies of them."""

    def __init__(self, engine, tree, batch: int, vocab: int, sampling: bool, K: int = 6):
        self.engine, self.tree, self.B, self.V, self.sampling = engine, tree, batch, vocab, sampling
        self.bufs = StreamBufs(engine, Geometry.of_tree(tree, 1, batch))
        self.tb = TreeBufs(self.bufs, tree)
        kernels = TreeKernels(engine)
        T1 = self.T1 = tree.nodes
        self.K = tree.draws if sampling else max(K, tree.draws)
        f32, u32 = np.float32, np.uint32
        if sampling:
            drawn = SampledCandidates(engine, batch, T1, tree.draws)
            cand = {"cand_tok": drawn.tok_d, "cand_logq": drawn.logq_d, "cand_sel": drawn.sel_d}
        else:
            logp = engine.alloc(f32, batch * T1 * self.K)
            cand = {"cand_tok": engine.alloc(u32, batch * T1 * self.K), "cand_logq": logp, "cand_sel": logp}
        self.dev = {name: getattr(self.tb, f"{name}_d") for name in
                    ("tok", "parent", "depth", "rank", "pos", "mask", "score", "path")}
        self.dev |= {name: getattr(self.bufs, f"{name}_d") for name in
                     ("pend", "pos_ctr", "pos_start", "vtok", "brk", "acc", "last_pred", "ctl")}
        law = batch * T1 * vocab if sampling else 1
        self.dev |= {**cand, "p": engine.alloc(f32, law), "q": engine.alloc(f32, law),
                     "pred": engine.alloc(u32, batch * T1), "seed": engine.alloc(np.uint64, batch),
                     "kv_k": engine.alloc(u32, batch * CAPACITY * KV_WORDS),
                     "kv_v": engine.alloc(u32, batch * CAPACITY * KV_WORDS),
                     "kv_1": engine.alloc(u32, batch * CAPACITY), "live": engine.alloc(u32, batch * STATE_WORDS),
                     "slots": engine.alloc(u32, batch * T1 * STATE_WORDS), "idx": engine.alloc(u32, batch)}
        d = self.dev
        bytes_ = 4 * KV_WORDS
        kv = kv_data_table(engine, [KVData(d["kv_k"], d["kv_v"], row_stride=CAPACITY * bytes_, pos_stride=bytes_,
                                           nbytes=bytes_, capacity=CAPACITY, batch=batch), None,
                                    KVData(d["kv_1"], row_stride=4 * CAPACITY, pos_stride=4, nbytes=4,
                                           capacity=CAPACITY - 7, batch=batch)])
        states = state_copy_table(engine, [StateLayer(d["live"], d["slots"], STATE_WORDS, T1 - 1)])
        flips = state_flip_table(engine, [d["idx"]])
        self.begin = kernels.prepare_begin(self.bufs, self.tb)
        self.grow = {lv: kernels.prepare_grow(self.bufs, self.tb, lv, cand["cand_tok"], cand["cand_logq"],
                                              cand["cand_sel"]) for lv in range(1, tree.depth + 1)}
        if sampling:
            self.draw = {lv: kernels.prepare_draw(self.bufs, self.tb, lv, d["q"], d["seed"], vocab, drawn)
                         for lv in range(1, tree.depth + 1)}
            self.accept = kernels.prepare_accept_sample(self.bufs, self.tb, d["p"], d["q"], d["seed"], vocab)
        else:
            self.accept = kernels.prepare_accept_greedy(self.bufs, self.tb, d["pred"])
        self.compact = kernels.prepare_compact(self.bufs, self.tb, kv)
        self.copy = kernels.prepare_state_copy(self.bufs, self.tb, states)
        self.flip = kernels.prepare_state_flip(self.bufs, self.tb, flips)
        self.levels = list(tree.levels)

    # -- state -------------------------------------------------------------------------------
    def put(self, state: dict) -> None:
        for name, buf in self.dev.items():
            if name != "cand_sel" or self.sampling:
                self.engine.copy_htod(buf, state[name])

    def get(self) -> dict:
        got = {name: self.engine.dtoh(buf) for name, buf in self.dev.items()}
        if not self.sampling:
            got["cand_sel"] = got["cand_logq"]
        return got

    def arrays(self, state: dict) -> rt.TreeArrays:
        return rt.TreeArrays(self.T1, self.tree.depth, self.B, **{name: state[name] for name in
                                                                  ("tok", "parent", "depth", "rank", "pos", "mask",
                                                                   "score", "path")})

    def random_state(self, rng: np.random.Generator, tokens: int) -> dict:
        """Every buffer: the round-stream rows and the model's outputs random, garbage elsewhere."""
        state = {name: _garbage(rng, buf) for name, buf in self.dev.items()}
        B, T1 = self.B, self.T1
        state["pend"] = rng.integers(0, tokens, B).astype(np.uint32)
        state["pos_ctr"] = rng.integers(0, CAPACITY - 2, B).astype(np.int32)
        ctl = state["ctl"].reshape(B, CTL_WORDS)
        ctl[:, CTL_DONE] = np.where(rng.random(B) < 0.2, rng.integers(1, 5, B), 0)
        brk = state["brk"].reshape(B, BRK_WORDS)  # marks: none, caps 0 to past the depth, or garbage
        brk[:, BRK_MARK] = np.where(rng.random(B) < 0.4, 0, np.where(rng.random(B) < 0.8,
                                    rng.integers(1, self.tree.depth + 3, B), brk[:, BRK_MARK]))
        state["pred"] = rng.integers(0, tokens, B * T1).astype(np.uint32)
        state["seed"] = rng.integers(0, 2**63, B, dtype=np.uint64)
        state["idx"] = rng.integers(0, 3 * T1, B).astype(np.uint32)
        if self.sampling:
            state["p"], state["q"] = (_laws(rng, B * T1, self.V) for _ in range(2))
        else:
            toks = rng.integers(0, tokens, (B, T1, self.K)).astype(np.uint32)
            logp = -np.sort(rng.exponential(1.0, (B, T1, self.K)), axis=-1).astype(np.float32)
            cut = rng.integers(1, self.K + 1, (B, T1, 1))
            logp[np.arange(self.K) >= cut] = -np.inf
            state["cand_tok"], state["cand_logq"] = toks.reshape(-1), logp.reshape(-1)
            state["cand_sel"] = state["cand_logq"]
        return state


def _garbage(rng, buf) -> np.ndarray:
    dtype = buf.dtype
    if dtype.kind == "f":
        return rng.standard_normal(buf.len).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, buf.len, dtype=dtype, endpoint=True)


def _laws(rng, rows: int, V: int) -> np.ndarray:
    """Rows of probabilities: peaked or flat, some cut to a few tokens."""
    w = rng.exponential(1.0, (rows, V)) ** rng.choice([1.0, 4.0], (rows, 1))
    w[rng.random((rows, V)) < rng.choice([0.0, 0.5], (rows, 1))] = 0
    w[:, 0] += 1e-3  # every row has mass
    return (w / w.sum(axis=1, keepdims=True)).astype(np.float32).reshape(-1)


# -- the comparison ----------------------------------------------------------------------------

def compare(got: dict, want: dict, what: str, close: tuple[str, ...] = ()) -> None:
    for name, expect in want.items():
        seen = got[name]
        if name in close:
            ok = np.allclose(seen, expect, rtol=1e-6, atol=0, equal_nan=True) and \
                np.array_equal(np.isinf(seen), np.isinf(expect))
        else:
            ok = np.array_equal(seen.view(np.uint8), np.asarray(expect).view(np.uint8))
        if not ok:
            where = np.flatnonzero(~np.isclose(seen, expect, equal_nan=True) if name in close else
                                   seen.view(np.uint32 if seen.dtype.itemsize == 4 else np.uint64) !=
                                   np.asarray(expect).view(np.uint32 if seen.dtype.itemsize == 4 else np.uint64))
            raise AssertionError(f"{what}: {name} differs at {where[:8].tolist()}: GPU {seen[where[:8]].tolist()}, "
                                 f"reference {np.asarray(expect)[where[:8]].tolist()}")


def step(rig: Rig, state: dict, launch, reference, what: str, close: tuple[str, ...] = ()) -> dict:
    """Run `launch` on the GPU and `reference` on a copy, from `state`; compare; the GPU's state."""
    want = {name: value.copy() for name, value in state.items()}
    reference(want)
    rig.put(state)
    launch()
    got = rig.get()
    compare(got, want, what, close)
    return got


def draw_step(rig: Rig, state: dict, level: int, what: str) -> dict:
    """Kernel 12, where the f32 race may pick another token at a near tie of the f64 scores."""
    want = {name: value.copy() for name, value in state.items()}
    rt.spec_tree_draw(rig.arrays(want), level, rig.levels, want["q"], rig.V, want["seed"], want["pos_start"],
                      rig.K, want["cand_tok"], want["cand_logq"], want["cand_sel"], batch=rig.B)
    rig.put(state)
    rig.draw[level]()
    got = rig.get()
    T1, K, V = rig.T1, rig.K, rig.V
    drawn = ("cand_tok", "cand_logq", "cand_sel")
    compare({n: v for n, v in got.items() if n not in drawn}, {n: v for n, v in state.items() if n not in drawn}, what)
    parents = range(*rig.levels[level - 1])
    children = _children(rig.tree)
    for name in ("cand_tok", "cand_logq", "cand_sel"):  # only the rows of parents with children
        g, w, s = (x[name].reshape(rig.B, T1, K) for x in (got, want, state))
        for b in range(rig.B):
            for p in range(T1):
                if p not in parents or not children(p) or int(state["rank"].reshape(rig.B, T1)[b, p]) == VOID_RANK:
                    assert np.array_equal(g[b, p].view(np.uint32), s[b, p].view(np.uint32)), \
                        f"{what}: {name} row ({b}, {p}) of a node that draws nothing was written"
    tok_g, tok_w = (x["cand_tok"].reshape(rig.B, T1, K) for x in (got, want))
    for b in range(rig.B):
        for p in parents:
            if not children(p) or int(state["rank"].reshape(rig.B, T1)[b, p]) == VOID_RANK:
                continue
            if not np.array_equal(tok_g[b, p], tok_w[b, p]):
                q = ref.probabilities(state["q"].reshape(rig.B, T1, V)[b, p])
                scores = ref.race_scores(q, state["seed"][b], int(state["pos_start"][b]) + level, ref.PURPOSE_DRAFT,
                                         p - (level - 1))
                best = np.sort(scores)[::-1][:K]
                mine = scores[tok_g[b, p]]
                finite = np.isfinite(best)
                assert np.allclose(mine[finite], best[finite], rtol=NEAR_TIE), \
                    f"{what}: row {b} node {p} drew {tok_g[b, p].tolist()}, the reference {tok_w[b, p].tolist()}"
            for name in ("cand_logq", "cand_sel"):
                x, y = got[name].reshape(rig.B, T1, K)[b, p], want[name].reshape(rig.B, T1, K)[b, p]
                if name == "cand_logq" and not np.array_equal(tok_g[b, p], tok_w[b, p]):
                    continue
                assert np.allclose(x, y, rtol=1e-6, equal_nan=True) and np.array_equal(np.isinf(x), np.isinf(y)), \
                    f"{what}: {name} of row {b} node {p}: GPU {x.tolist()}, reference {y.tolist()}"
    return got


def _children(tree):
    if isinstance(tree, DynamicTree):
        return lambda p: True
    counts = np.bincount(tree.parent[1:], minlength=tree.nodes)
    return lambda p: counts[p] > 0


def accept_sample_step(rig: Rig, state: dict, what: str) -> dict:
    """Kernel 14: the path must be the reference's; the bonus, its token or a near tie."""
    want = {name: value.copy() for name, value in state.items()}
    rt.spec_tree_accept_sample(rig.arrays(want), want["p"], want["q"], rig.V, rig.tree.depth, want["vtok"],
                               want["brk"], want["acc"], want["last_pred"], want["ctl"], want["pos_start"],
                               want["seed"], batch=rig.B)
    rig.put(state)
    rig.accept()
    got = rig.get()
    bonus_g, bonus_w = got["last_pred"], want["last_pred"]
    for b in np.flatnonzero(bonus_g != bonus_w):
        weights, position, node = rt.bonus_race(rig.arrays(state), b, state["p"], state["q"], rig.V, rig.tree.depth,
                                                int(state["pos_start"][b]), state["seed"][b],
                                                int(state["brk"][BRK_WORDS * b + BRK_MARK]))
        scores = ref.race_scores(weights, state["seed"][b], position, ref.PURPOSE_SAMPLE, node)
        assert scores[bonus_g[b]] >= scores.max() * (1 - NEAR_TIE), \
            f"{what}: row {b} bonus {bonus_g[b]} (score {scores[bonus_g[b]]}), the reference's {bonus_w[b]} " \
            f"({scores.max()})"
        want["last_pred"][b] = bonus_g[b]
    compare(got, want, what)
    return got


# -- the tests ---------------------------------------------------------------------------------

def kv_host(rig: Rig, state: dict) -> list:
    bytes_ = KV_WORDS
    return [(state["kv_k"], state["kv_v"], CAPACITY * bytes_, bytes_, bytes_, CAPACITY), None,
            (state["kv_1"], None, CAPACITY, 1, 1, CAPACITY - 7)]


def run_round(rig: Rig, rng: np.random.Generator, tokens: int, what: str) -> None:
    """One tree round's layer kernels, each against the reference."""
    state = grown(rig, rig.random_state(rng, tokens), what)
    B, D, T1 = rig.B, rig.tree.depth, rig.T1
    if rig.sampling:
        state = accept_sample_step(rig, state, f"{what} accept")
    else:
        def accept(s):
            rt.spec_tree_accept_greedy(rig.arrays(s), s["pred"], D, s["vtok"], s["brk"], s["acc"], s["last_pred"],
                                       s["ctl"], batch=B)
        state = step(rig, state, rig.accept, accept, f"{what} accept")

    def compact(s):
        rt.spec_tree_compact(kv_host(rig, s), rig.arrays(s), s["acc"], s["pos_start"], s["ctl"], D, batch=B)
    state = step(rig, state, rig.compact, compact, f"{what} compact")

    def copy(s):
        rt.spec_tree_state_copy([(s["live"], s["slots"], STATE_WORDS)], T1, rig.arrays(s), s["ctl"], D, batch=B)
    state = step(rig, state, rig.copy, copy, f"{what} state copy")

    def flip(s):
        rt.spec_tree_state_flip([s["idx"]], T1, rig.arrays(s), s["ctl"], D, batch=B)
    step(rig, state, rig.flip, flip, f"{what} state flip")


def grown(rig: Rig, state: dict, what: str) -> dict:
    """From `state`, kernel 10 and each level's kernels 12 (sampled) and 11, each against the
    reference: the GPU's state once the tree is placed, ready to be verified and accepted."""
    B, D = rig.B, rig.tree.depth
    tree = rig.tree

    def begin(s):
        rt.spec_tree_begin(rig.arrays(s), s["pend"], s["pos_ctr"], s["pos_start"], s["vtok"], D, batch=B)
    state = step(rig, state, rig.begin, begin, f"{what} begin")
    for level in range(1, D + 1):
        if rig.sampling:
            state = draw_step(rig, state, level, f"{what} draw {level}")

        def grow(s, level=level):
            shape = {} if isinstance(tree, DynamicTree) else dict(
                shape_parent=np.array([0, *tree.parent[1:]], np.uint32), shape_rank=np.array(tree.rank, np.uint32))
            dyn = dict(width=tree.width, branch=tree.branch) if isinstance(tree, DynamicTree) else {}
            rt.spec_tree_grow(rig.arrays(s), level, rig.levels, s["cand_tok"], s["cand_logq"], s["cand_sel"], rig.K,
                              s["pos_start"], **shape, **dyn, batch=B)
        state = step(rig, state, rig.grow[level], grow, f"{what} grow {level}")
    return state


def cases(name: str, config: tuple, share: int):
    for case in range(max(1, CASES // share)):
        seed = (SEED, zlib.crc32(f"{name} {config}".encode()), case)
        yield np.random.default_rng(seed), f"{name} {config} case {case} (seed {seed})"


@pytest.mark.parametrize("B", [1, 3, 32])
@pytest.mark.parametrize("name,tree", TREES, ids=[name for name, _ in TREES])
def test_greedy_tree_round_matches_the_reference(engine, name, tree, B):
    rig = Rig(engine, tree, B, 1, sampling=False)
    for rng, what in cases("greedy", (name, B), 40):
        run_round(rig, rng, int(rng.choice([2, 3, 50])), what)


@pytest.mark.parametrize("B,V", [(1, 7), (3, 1000), (32, 50), (1, 152_000)])
@pytest.mark.parametrize("name,tree", SAMPLED, ids=[name for name, _ in SAMPLED])
def test_sampled_tree_round_matches_the_reference(engine, name, tree, B, V):
    if V > 100_000 and tree.nodes > 20:
        pytest.skip("a real vocabulary on the small trees only: the reference's f64 races are slow")
    rig = Rig(engine, tree, B, V, sampling=True)
    for rng, what in cases("sampled", (name, B, V), 200 if V < 100_000 else 1000):
        run_round(rig, rng, min(V, 3), what)


def test_a_draw_never_takes_a_scratch_key_naming_no_token(engine):
    """Kernel 12's last block of a parent merges every slice's keys from its scratch, and a key's
    token indexes q. Scratch garbage (a parent's count left at slices - 1, so its first block
    merges; every other slice's keys naming tokens V, V + 1 and 2**32 - 1, each ranked above any
    draw) is never drawn: each row's draws are R distinct tokens below V with ln q of their own
    (token 2**32 - 1 read 16 GiB past q). Only slice 0 of the parent is launched: no other slice's
    block writes its keys over the garbage before the merge reads them (all four launched, they
    finish together, and the test could pass without the clamp)."""
    tree = TreeShape.from_choices([[0], [1], [2]])
    B, V, slices = 2, 4096, 4  # four slices of 1024 tokens, each with R draws of its own
    R, T1 = tree.draws, tree.nodes
    bufs = StreamBufs(engine, Geometry.of_tree(tree, 1, B))
    tb = TreeBufs(bufs, tree)
    kernels = TreeKernels(engine)
    engine.copy_htod(bufs.pos_ctr_d, np.array([5, 9], np.int32))
    kernels.prepare_begin(bufs, tb)()  # node 0 of each row: not void, at pos_start = pos_ctr
    rng = np.random.default_rng(12)
    q = rng.exponential(1.0, (B, T1, V)).astype(np.float32)
    q /= q.sum(axis=-1, keepdims=True)
    hostile = [0xFFFFFFFF << 32 | (~token & 0xFFFFFFFF) for token in (V, V + 1, 2**32 - 1)]
    keys = engine.htod(np.resize(np.array(hostile, np.uint64), B * T1 * slices * 2 * R), np.uint64)
    counts = engine.htod(np.full(B * T1, slices - 1), np.uint32)
    out = SampledCandidates(engine, B, T1, R)
    prev_start, prev_stop = tb.levels[0]
    assert prev_stop - prev_start == 1  # one parent, node 0
    draw = kernels.module.kernel("spec_tree_draw").prepare(grid=(1, B), block=256)  # its slice 0 alone
    draw.set(tree=tb.arena, T1=T1, W=tb.words, D=tb.depth, B=B, level=1, prev_start=prev_start, prev_stop=prev_stop,
             shape=tb.shape_d, q_d=engine.htod(q.reshape(-1), np.float32), V=V,
             seed_d=engine.htod([3, 4], np.uint64), pos_start_d=bufs.pos_start_d, R=R, slices=slices,
             cand_tok=out.tok_d, cand_logq=out.logq_d, cand_sel=out.sel_d, keys=keys, counts=counts)()
    engine.synchronize()
    tok, logq, sel = (engine.dtoh(buf).reshape(B, T1, R)[:, 0] for buf in (out.tok_d, out.logq_d, out.sel_d))
    for b in range(B):
        assert (tok[b] < V).all() and len(set(tok[b].tolist())) == R, f"row {b} drew {tok[b].tolist()}"
        assert np.allclose(logq[b], np.log(q[b, 0, tok[b]]), rtol=1e-6), f"row {b}: ln q {logq[b].tolist()}"
        assert np.isfinite(sel[b]).all() and (np.diff(sel[b]) <= 0).all(), f"row {b}: sel {sel[b].tolist()}"
        assert all(np.isclose(np.exp(x), q[b, 0], rtol=1e-5).any() for x in sel[b]), f"row {b}: sel {sel[b].tolist()}"


# -- 13 + 4 + 5: the greedy round tail, then compaction ----------------------------------------

LENS = 4  # i32[B] length arrays the tail's rollback table names (with pos_ctr_d and null entries)


class TailRig(Rig):
    """A greedy Rig plus what the round's tail touches past the acceptance: the ring, KV lengths
    in a rollback table (nulls, windows of `lens`, a repeat, pos_ctr_d last), and the launches
    the tail replaces: kernel 13 (at the predictions' width), kernel 4 and kernel 5."""

    def __init__(self, engine, tree, batch: int, width: int):
        super().__init__(engine, tree, batch, 1, sampling=False)
        kernels, spec = TreeKernels(engine), SpecKernels(engine)
        if width == 64:
            self.dev["pred"] = engine.alloc(np.int64, batch * self.T1, zeroed=True)
            self.accept = kernels.prepare_accept_greedy(self.bufs, self.tb, self.dev["pred"])
        self.dev["ring"] = self.bufs.ring_d
        self.dev["lens"] = engine.zeros(np.int32, LENS * batch)
        self.entries = [None, 0, 2, None, 0, 3, "pos_ctr"]  # a window's index, or pos_ctr_d
        self.table = PointerTable(engine, [None if e is None else self.bufs.pos_ctr_d if e == "pos_ctr" else
                                           self.dev["lens"].view(e * batch, batch) for e in self.entries])
        self.commit = spec.prepare_ring_commit(self.bufs)
        self.rollback = spec.prepare_rollback(self.bufs, self.table)
        self.tail = kernels.prepare_round_tail_greedy(self.bufs, self.tb, self.dev["pred"], self.table)
        assert self.tail.kernel.name == "spec_tree_round_tail_greedy" + ("_t64" if width == 64 else "")

    def random_state(self, rng: np.random.Generator, tokens: int) -> dict:
        """Rig's, and rings at or past every edge (a full one too), an EOS that is often a token of
        the tiny vocabulary (so a stop inside the accepted path), budgets 0, 1, 2 or unlimited;
        64-bit predictions carry garbage above their 32 bits."""
        state = super().random_state(rng, tokens)
        cap, B = self.bufs.ring_cap, self.B
        ring, ctl = state["ring"].reshape(B, 1 + cap), state["ctl"].reshape(B, CTL_WORDS)
        ring[:, 0] = rng.choice([0, 1, cap - 1, cap, cap + 1, 2**32 - 1], B)
        ctl[:, CTL_EOS] = np.where(rng.random(B) < 0.6, rng.integers(0, tokens, B), rng.choice([-1, -7, 10**6], B))
        ctl[:, CTL_BUDGET] = rng.choice([0, 0, 1, 2, 3, -1, -1, 2**31 - 1], B)
        if self.dev["pred"].dtype == np.int64:
            high = np.where(rng.random(B * self.T1) < 0.3, rng.integers(1, 2**31, B * self.T1), 0)
            state["pred"] = state["pred"].astype(np.int64) + (high << 32)
        return state

    def lengths(self, s: dict) -> list:
        """The table's entries as the reference takes them: the arrays themselves."""
        B = self.B
        return [None if e is None else s["pos_ctr"] if e == "pos_ctr" else s["lens"][e * B:(e + 1) * B]
                for e in self.entries]


TAIL_CONFIGS = [(name, tree, B, width) for name, tree in TREES for B in (1, 3, 32) for width in (32, 64)]


@pytest.mark.parametrize("name,tree,B,width", TAIL_CONFIGS,
                         ids=[f"{name}-B{B}-t{width}" for name, _, B, width in TAIL_CONFIGS])
def test_greedy_tree_round_tail_then_compaction_is_the_rounds_order(engine, name, tree, B, width):
    """The tail (13, 4 and 5 in one launch) and then kernel 15, from a grown tree, leave every
    buffer (the tree, the round-stream rows, the ring, the lengths and pos_ctr, the KV entries)
    as the round's order without it does, on the GPU (13, 15, 4, 5 as four launches) and in the
    reference; and the tail alone is the reference's 13, 4 and 5. So compaction may follow the
    tail: it reads keep, the accepted count, the path and pos_start, which the commit and the
    rollback leave alone, and they read nothing it moves."""
    check_tree_tail(TailRig(engine, tree, B, width), cases("tree tail", (name, B, width), len(TAIL_CONFIGS) * 4))


@pytest.mark.parametrize("width", [32, 64])
def test_greedy_tree_round_tail_serves_every_row_past_one_grid(engine, width):
    """More rows than the launch has blocks (4096, a row each): the blocks stride on, so a row
    none served (the last) would differ from the reference and the separate launches."""
    B = 4096 + 1
    runs = islice(cases("tree tail", ("chain4", B, width), 1), 1)
    check_tree_tail(TailRig(engine, TreeShape.chain(4), B, width), runs, last_live=True)


@pytest.mark.parametrize("width", [32, 64])
def test_greedy_tree_round_tail_commits_a_path_deeper_than_a_warp(engine, width):
    """A line of 40 drafts with a leaf beside each (81 nodes, three mask words) where every draft
    agrees (a vocabulary of one token): the last row, live, uncapped and unstopped, accepts the
    whole line and commits 41 tokens, past the 32 its warp's lanes load at once; the path's nodes
    past depth 1 are not their depths, so the compaction after the tail moves their entries (those
    inside the capacity)."""
    tree = TreeShape.chain_with_leaves(40, 1)
    B, D = 32, tree.depth
    rig = TailRig(engine, tree, B, width)
    got = check_tree_tail(rig, cases("tree tail", ("chain40,1", B, width), len(TAIL_CONFIGS) * 4), agreeing=True)
    assert got["acc"].reshape(B, ACC_WORDS)[-1, ACC_ROUND] == D
    assert got["ring"].reshape(B, -1)[-1, RING_COUNT] == D + 1
    line = [node for node in range(tree.nodes) if tree.rank[node] == 0]  # the root and the line's drafts
    assert got["path"].reshape(B, D + 1)[-1].tolist() == line


def check_tree_tail(rig: TailRig, runs, last_live: bool = False, agreeing: bool = False) -> dict:
    """For each (rng, what) of `runs`: the tail then kernel 15 against 13, 15, 4 and 5 launched
    apart and against the reference's, and the tail alone against the reference's (`last_live`:
    the last row live in every state; `agreeing`: a vocabulary of one token, so every draft
    agrees, and the last row live, uncapped, with no EOS or budget and an empty ring, so it
    commits all it accepts). Returns the GPU's state after the last run's tail."""
    tree, B = rig.tree, rig.B
    D, ring_cap = tree.depth, rig.bufs.ring_cap

    def tail(s):
        rt.spec_tree_round_tail_greedy(rig.arrays(s), s["pred"], D, s["vtok"], s["brk"], s["acc"], s["last_pred"],
                                       s["ctl"], s["pend"], s["ring"], ring_cap, rig.lengths(s), s["pos_start"],
                                       batch=B)

    def in_order(s):  # the round's order before the tail: accept, compact, commit, rollback
        rt.spec_tree_accept_greedy(rig.arrays(s), s["pred"], D, s["vtok"], s["brk"], s["acc"], s["last_pred"],
                                   s["ctl"], batch=B)
        rt.spec_tree_compact(kv_host(rig, s), rig.arrays(s), s["acc"], s["pos_start"], s["ctl"], D, batch=B)
        ref.spec_ring_commit(s["vtok"], s["acc"], s["last_pred"], s["ctl"], s["pend"], s["ring"], ring_cap, D, B)
        ref.spec_rollback_stream(rig.lengths(s), s["pos_start"], s["ctl"], B)

    def tail_then_compact():
        rig.tail()
        rig.compact()

    got: dict = {}
    for rng, what in runs:
        state = rig.random_state(rng, 1 if agreeing else int(rng.choice([2, 3, 50])))
        if last_live or agreeing:
            state["ctl"].reshape(B, CTL_WORDS)[-1, CTL_DONE] = 0
        if agreeing:
            state["ctl"].reshape(B, CTL_WORDS)[-1, [CTL_EOS, CTL_BUDGET]] = -1
            state["brk"].reshape(B, BRK_WORDS)[-1, BRK_MARK] = 0
            state["ring"].reshape(B, -1)[-1, RING_COUNT] = 0
        state = grown(rig, state, what)
        rig.put(state)
        for launch in (rig.accept, rig.compact, rig.commit, rig.rollback):
            launch()
        separate = rig.get()

        def as_separate(s, separate=separate):
            for key, value in separate.items():
                s[key][...] = value
        step(rig, state, tail_then_compact, as_separate, f"{what}: tail, compact against 13, 15, 4, 5 on the GPU")
        step(rig, state, tail_then_compact, in_order, f"{what}: tail, compact against the reference's 13, 15, 4, 5")
        got = step(rig, state, rig.tail, tail, f"{what}: tail against the reference's")
    return got


def test_greedy_tree_round_tail_refuses_a_table_naming_pos_start(engine):
    """Compaction runs after the tail and reads pos_start_d (and ctl, acc, the path): a rollback
    table that names any of their memory, as itself or through a view of it, would move the
    compaction's anchor, so the tail refuses it. Kernel 5, alone or in a chain's tail, refuses
    pos_start_d and ctl_d, which it reads as it writes each length (a (length, row) a thread),
    and a tail, a warp a row, also the words the other rows accept and commit from (vtok, the
    ring, pred_d, ...). Memory right beside theirs is the table's to name: pos_ctr_d, between
    ctl_d and acc_d in the buffers' arena (the check is by bytes)."""
    bufs = StreamBufs(engine, Geometry.of_tree(TREES[0][1], 1, 2))
    tb = TreeBufs(bufs, TREES[0][1])
    pred = engine.zeros(np.uint32, 2 * tb.nodes)
    kernels = TreeKernels(engine)
    for name, target in (("bufs.pos_start_d", bufs.pos_start_d), ("bufs.pos_start_d", bufs.pos_start_d.view(0, 2)),
                         ("bufs.ctl_d", bufs.ctl_d.view(0, 2, np.int32)),
                         ("bufs.acc_d", bufs.acc_d.view(2, 2, np.int32)),  # row 1's words, as i32
                         ("the tree's buffers", tb.path_d.view(tb.path_d.len - 2, 2, np.int32)),  # the path's end
                         ("bufs.vtok_d", bufs.vtok_d.view(0, 2, np.int32)), ("pred_d", pred.view(0, 2, np.int32))):
        with pytest.raises(ValueError, match=f"may not name memory of {name}"):
            kernels.prepare_round_tail_greedy(bufs, tb, pred, PointerTable(engine, [target]))
    spec, chain = SpecKernels(engine), StreamBufs(engine, Geometry(2, 1, 2))
    chain_pred = engine.zeros(np.uint32, 2 * 3)
    rollback, tail = (functools.partial(spec.prepare_rollback, chain),
                      functools.partial(spec.prepare_round_tail_greedy, chain, chain_pred))
    for name, target, refusing in (("bufs.pos_start_d", chain.pos_start_d, (rollback, tail)),
                                   ("bufs.ctl_d", chain.ctl_d.view(2, 2), (rollback, tail)),
                                   ("bufs.vtok_d", chain.vtok_d.view(0, 2, np.int32), (tail,)),  # other rows' words
                                   ("bufs.ring_d", chain.ring_d.view(0, 2, np.int32), (tail,)),
                                   ("pred_d", chain_pred.view(4, 2, np.int32), (tail,))):
        for prepare in refusing:
            with pytest.raises(ValueError, match=f"may not name memory of {name}"):
                prepare(PointerTable(engine, [chain.pos_ctr_d, target]))
    for prepare in (rollback, tail):
        prepare(PointerTable(engine, [chain.pos_ctr_d]))
    assert bufs.ctl_d.ptr + bufs.ctl_d.nbytes == bufs.pos_ctr_d.ptr
    assert bufs.pos_ctr_d.ptr + bufs.pos_ctr_d.nbytes == bufs.acc_d.ptr
    lengths = engine.zeros(np.int32, 2)
    tail = kernels.prepare_round_tail_greedy(bufs, tb, pred, PointerTable(engine, [None, lengths, bufs.pos_ctr_d]))
    assert tail.kernel.name == "spec_tree_round_tail_greedy"

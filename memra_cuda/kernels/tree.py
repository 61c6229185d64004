"""TreeKernels: typed launchers of the tree round's kernels (ptx/spec_tree.cu, docs/trees.md).

As SpecKernels' launchers do, each checks everything the host knows (the buffers' types and
exact sizes for the batch and the tree, the engine they belong to, what the tree asks of the
draft) before anything is queued, and returns a prepared launch to keep and call every round.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..buffers.layout import MAX_TREE_DRAWS, MAX_TREE_NODES
from ..buffers.tables import KVDataTable, PointerTable, StateIndexTable, StateTable
from ..buffers.tree import MAX_TREE_CANDIDATES, DynamicTree, TreeBufs
from ..driver.buffer import BufferLike, DeviceBuffer
from ..driver.module import Launch
from ..driver.values import as_index, as_size
from .sampling import _exact
from .signatures import load
from .spec import (TAIL_READS, batch_rows, check_flip_table, rollback_table, spread, state_copy_grid, tail_reads,
                   token_buffer, width_kernel)

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..buffers.stream_bufs import StreamBufs
    from ..driver.engine import Engine

THREADS = 256  # spec_tree.cu's TREE_THREADS: the block of the draw, judge and race kernels
JUDGED_WORDS = 40  # spec_tree.cu's JUDGED_WORDS: one node's verdict in the judges' scratch
PASS_PER_THREAD = 4  # spec_tree.cu's PASS_PER_THREAD: entries of V a thread of a judge pass loads at once


class TreeKernels:
    """The tree round's kernels (10 to 17, and the greedy round tail: 13, 4 and 5 in one launch),
    loaded once per engine."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.module = load(engine, "spec_tree")

    def _tree(self, bufs: StreamBufs, tree: TreeBufs) -> dict[str, object]:
        """The arguments every tree kernel takes first (tree, T1, W, D, B), by name, checked
        against one another (_tree_counts) when a launch is prepared, never a round."""
        if not isinstance(tree, TreeBufs) or tree.bufs is not bufs:
            raise ValueError(f"the tree's buffers must be TreeBufs made over these StreamBufs, not {tree!r}")
        nodes, words, depth = _tree_counts(bufs, tree)
        return dict(tree=tree.arena, T1=nodes, W=words, D=depth, B=bufs.batch)

    def prepare_begin(self, bufs: StreamBufs, tree: TreeBufs) -> Launch:
        """Kernel 10: node 0 is the pending token at pos_start = pos_ctr."""
        return spread(self.module, "spec_tree_begin",
                      dict(**self._tree(bufs, tree), pend_d=bufs.pend_d, pos_ctr=bufs.pos_ctr_d,
                           pos_start_d=bufs.pos_start_d, vtok_d=bufs.vtok_d),
                      threads=bufs.batch)

    def prepare_grow(self, bufs: StreamBufs, tree: TreeBufs, level: int, tok_d: BufferLike, logq_d: BufferLike,
                     sel_d: BufferLike | None = None) -> Launch:
        """Kernel 11: level `level` (1..D) placed from the candidates of the level before it,
        [B][T+1][K] tokens (32 or 64 bit), log-probabilities and selection scores (f32; the
        log-probabilities themselves where `sel_d` is None, as for a greedy draft)."""
        args = self._tree(bufs, tree)
        level = _level(tree, level)
        tok_d, logq_d, sel_d, K = self._candidates(bufs, tree, tok_d, logq_d, logq_d if sel_d is None else sel_d)
        (prev_start, prev_stop), (start, stop) = tree.levels[level - 1], tree.levels[level]
        shape, branch = tree.tree, 0
        if isinstance(shape, DynamicTree):
            branch = shape.branch
            if branch > K:
                raise ValueError(f"a dynamic tree of branch {branch} needs {branch} candidates a node, not K = {K}")
        elif shape.draws > K:
            raise ValueError(f"the tree asks for candidates up to rank {shape.draws - 1}, but the draft offers K = {K}")
        return self.module.kernel(width_kernel("spec_tree_grow", tok_d)).prepare(
            grid=min(bufs.batch, 1024), block=THREADS).set(
            **args, level=level, prev_start=prev_start, prev_stop=prev_stop, start=start, stop=stop, cand_tok=tok_d,
            cand_logq=logq_d, cand_sel=sel_d, K=K, shape=0 if tree.shape_d is None else tree.shape_d, branch=branch,
            pos_start_d=bufs.pos_start_d)

    def prepare_draw(self, bufs: StreamBufs, tree: TreeBufs, level: int, q_d: BufferLike, seed_d: BufferLike,
                     vocab: int, out: SampledCandidates) -> Launch:
        """Kernel 12: level `level`'s children drawn from q_d (f32 [B][T+1][V]) into `out`."""
        args = self._tree(bufs, tree)
        level = _level(tree, level)
        tree.tree.check_sampled()
        q_d, seed_d, vocab = self._laws(bufs, tree, q_d, seed_d, vocab)
        if not isinstance(out, SampledCandidates) or out.tok_d.engine is not self.engine or \
                out.rows != bufs.batch * tree.nodes or out.draws < tree.tree.draws:
            raise ValueError(f"out must be SampledCandidates(engine, {bufs.batch}, {tree.nodes}, draws) of this engine "
                             f"with draws >= {tree.tree.draws}, not {out!r}")
        prev_start, prev_stop = tree.levels[level - 1]
        parents = prev_stop - prev_start
        slices = max(1, min(-(-vocab // (4 * THREADS)), 16 * self.engine.multiprocessors // (bufs.batch * parents), 64))
        keys = self.engine.alloc(np.uint64, bufs.batch * tree.nodes * slices * 2 * out.draws, label="tree draw keys")
        counts = self.engine.zeros(np.uint32, bufs.batch * tree.nodes, label="tree draw counts")
        return self.module.kernel("spec_tree_draw").prepare(grid=(slices * parents, bufs.batch), block=THREADS).set(
            **args, level=level, prev_start=prev_start, prev_stop=prev_stop,
            shape=0 if tree.shape_d is None else tree.shape_d, q_d=q_d, V=vocab, seed_d=seed_d,
            pos_start_d=bufs.pos_start_d, R=out.draws, slices=slices, cand_tok=out.tok_d, cand_logq=out.logq_d,
            cand_sel=out.sel_d, keys=keys, counts=counts)

    def prepare_accept_greedy(self, bufs: StreamBufs, tree: TreeBufs, pred_d: BufferLike) -> Launch:
        """Kernel 13: the deepest path the target's predictions (pred_d, [B][T+1]) agree with."""
        args = self._tree(bufs, tree)
        pred_d = batch_rows("pred_d", token_buffer(self.engine, "pred_d", pred_d), bufs.batch, tree.nodes)
        return self.module.kernel(width_kernel("spec_tree_accept_greedy", pred_d)).prepare(
            grid=min(bufs.batch, 4096), block=32).set(
            **args, pred_d=pred_d, vtok_d=bufs.vtok_d, brk_d=bufs.brk_d, acc_d=bufs.acc_d,
            last_pred_d=bufs.last_pred_d, ctl_d=bufs.ctl_d)

    def prepare_round_tail_greedy(self, bufs: StreamBufs, tree: TreeBufs, pred_d: BufferLike,
                                  table_d: PointerTable) -> Launch:
        """Kernels 13, 4 and 5 in one launch, a greedy tree round's tail: each row's path the
        predictions agree with (prepare_accept_greedy's), its commit, then the rollback of the
        lengths `table_d` names (SpecKernels' prepare_ring_commit and prepare_rollback), a block
        of one warp a row. Kernel 15's compaction may run after it (it reads keep, the accepted
        count, the path and pos_start, which the commit and the rollback leave as they are), so
        the table may name none of their memory: the rollback would move the compaction's anchor."""
        args = self._tree(bufs, tree)
        pred_d = batch_rows("pred_d", token_buffer(self.engine, "pred_d", pred_d), bufs.batch, tree.nodes)
        table_d = rollback_table(bufs, table_d, {**tail_reads(bufs, pred_d), "the tree's buffers": tree.arena},
                                 f"{TAIL_READS}, and the compaction after it reads it as the acceptance left it")
        return self.module.kernel(width_kernel("spec_tree_round_tail_greedy", pred_d)).prepare(
            grid=min(bufs.batch, 4096), block=32).set(
            **args, pred_d=pred_d, vtok_d=bufs.vtok_d, brk_d=bufs.brk_d, acc_d=bufs.acc_d,
            last_pred_d=bufs.last_pred_d, ctl_d=bufs.ctl_d, pend_d=bufs.pend_d, ring_d=bufs.ring_d,
            ring_cap=bufs.ring_cap, len_ptrs=table_d, n_ptrs=table_d.len, pos_start_d=bufs.pos_start_d)

    def prepare_accept_sample(self, bufs: StreamBufs, tree: TreeBufs, p_d: BufferLike, q_d: BufferLike,
                              seed_d: BufferLike, vocab: int) -> Callable[[], None]:
        """Kernel 14 (a launch per child a node may try, and the race): every node tests its
        first child, then each rejection's residual mass is summed over many blocks a node and
        the next child tested; each row walks to its stop node and races the bonus there."""
        args = self._tree(bufs, tree)
        tree.tree.check_sampled()
        p_d, _, _ = self._laws(bufs, tree, p_d, seed_d, vocab, "p_d")
        q_d, seed_d, vocab = self._laws(bufs, tree, q_d, seed_d, vocab)
        engine, batch, nodes = self.engine, bufs.batch, tree.nodes
        judged = engine.zeros(np.uint32, batch * nodes * JUDGED_WORDS, label="tree verdicts")
        judge = self.module.kernel("spec_tree_judge").prepare(grid=(nodes, batch), block=64).set(
            **args, p_d=p_d, q_d=q_d, V=vocab, seed_d=seed_d, pos_start_d=bufs.pos_start_d, ctl_d=bufs.ctl_d,
            judged=judged)
        slices = max(1, min(-(-vocab // (PASS_PER_THREAD * THREADS)), 16 * engine.multiprocessors // (batch * nodes)))
        partial = engine.alloc(np.float64, batch * nodes * slices, zeroed=True, label="tree residual sums")
        counts = engine.zeros(np.uint32, batch * nodes, label="tree residual counts")
        passes = [self.module.kernel("spec_tree_judge_pass").prepare(grid=(slices * nodes, batch), block=THREADS).set(
            **args, p_d=p_d, q_d=q_d, V=vocab, seed_d=seed_d, pos_start_d=bufs.pos_start_d, judged=judged, j=j,
            slices=slices, partial=partial, counts=counts)
            for j in range(1, min(tree.tree.draws, MAX_TREE_DRAWS))]
        blocks = max(1, min(-(-vocab // (2 * THREADS)), 16 * engine.multiprocessors // batch))
        scratch = engine.alloc(np.uint64, 2 * batch, zeroed=True, label="tree race scratch")
        race = self.module.kernel("spec_tree_race").prepare(grid=(blocks, batch), block=THREADS).set(
            **args, p_d=p_d, q_d=q_d, V=vocab, seed_d=seed_d, pos_start_d=bufs.pos_start_d, judged=judged,
            vtok_d=bufs.vtok_d, brk_d=bufs.brk_d, acc_d=bufs.acc_d, last_pred_d=bufs.last_pred_d, ctl_d=bufs.ctl_d,
            scratch=scratch)

        def accept() -> None:
            judge()
            for judge_pass in passes:
                judge_pass()
            race()
        return accept

    def prepare_compact(self, bufs: StreamBufs, tree: TreeBufs, table: KVDataTable) -> Launch:
        """Kernel 15: the accepted path's KV moved to consecutive slots in every layer of `table`."""
        args = self._tree(bufs, tree)
        if not isinstance(table, KVDataTable):
            raise TypeError(f"KV compaction takes a KVDataTable (kv_data_table builds one), not {table!r}")
        if table.batch not in (None, bufs.batch):
            raise ValueError(f"{table.label}: its layers hold B={table.batch} rows, the round has B={bufs.batch}")
        words = max((layer.nbytes // 4 for layer in table.layers if layer is not None), default=1)
        jobs = len(table.layers) * 2 * bufs.batch
        return self.module.kernel("spec_tree_compact").prepare(
            grid=min(jobs, 4096), block=min(-(-words // 32) * 32, 256)).set(
            table=table, n_layers=len(table.layers), **args, acc_d=bufs.acc_d, pos_start_d=bufs.pos_start_d,
            ctl_d=bufs.ctl_d)

    def prepare_state_copy(self, bufs: StreamBufs, tree: TreeBufs, table: StateTable) -> Launch:
        """Kernel 16: each row's live state becomes the slot of its path's last node (T+1 slots)."""
        args = self._tree(bufs, tree)
        if not isinstance(table, StateTable):
            raise TypeError(f"a state copy table must be a StateTable (state_copy_table builds one), not {table!r}")
        if table.k is not None and (table.batch, table.k) != (bufs.batch, tree.nodes - 1):  # None: no layer
            raise ValueError(f"{table.label}: its layers hold B={table.batch} rows of k+1={table.k + 1} slots, but "
                             f"the tree round has B={bufs.batch} and a slot for each of its {tree.nodes} nodes "
                             f"(StateLayer(..., k={tree.nodes - 1}))")
        grid, block = state_copy_grid(table, bufs.batch)
        return self.module.kernel("spec_tree_state_copy").prepare(grid=grid, block=block).set(
            table=table, n_entries=len(table.layers), **args, ctl_d=bufs.ctl_d)

    def prepare_state_flip(self, bufs: StreamBufs, tree: TreeBufs, table: StateIndexTable) -> Launch:
        """Kernel 17: each row's state index moves to its path's last node in the bank the
        verify wrote (2(T+1) slots a row)."""
        args = self._tree(bufs, tree)
        check_flip_table(table, bufs.batch)
        return spread(self.module, "spec_tree_state_flip",
                      dict(idx_ptrs=table, n_ptrs=table.len, **args, ctl_d=bufs.ctl_d), threads=table.len * bufs.batch)

    def _candidates(self, bufs: StreamBufs, tree: TreeBufs, tok_d: BufferLike, logq_d: BufferLike,
                    sel_d: BufferLike) -> tuple[DeviceBuffer, DeviceBuffer, DeviceBuffer, int]:
        """Candidates [B][T+1][K]: K from the log-probabilities, the others checked against it."""
        rows = bufs.batch * tree.nodes
        logq = self.engine.buffer(logq_d, "candidates' logp_d")
        if logq.len % rows or not 1 <= logq.len // rows <= MAX_TREE_CANDIDATES:
            raise ValueError(f"candidates' logp_d must be f32[{bufs.batch}][{tree.nodes}][K], K from 1 to "
                             f"{MAX_TREE_CANDIDATES}, not {logq!r}")
        K = logq.len // rows
        logq = _exact(logq, "candidates' logp_d", ("f32",), (bufs.batch, tree.nodes, K))
        sel = _exact(self.engine.buffer(sel_d, "sel_d"), "sel_d", ("f32",), (bufs.batch, tree.nodes, K))
        tok = token_buffer(self.engine, "candidates' tok_d", tok_d)
        if tok.len != rows * K:
            raise ValueError(f"candidates' tok_d must hold [{bufs.batch}][{tree.nodes}][{K}] tokens, as logp_d does, "
                             f"not {tok!r}")
        return tok, logq, sel, K

    def _laws(self, bufs: StreamBufs, tree: TreeBufs, law_d: BufferLike, seed_d: BufferLike, vocab: int,
              name: str = "q_d") -> tuple[DeviceBuffer, DeviceBuffer, int]:
        """A law per node, f32 [B][T+1][V], and the rows' seeds, u64 (or i64) [B]."""
        vocab = as_size(vocab, "vocab", 1, 2**31 - 1)
        law = _exact(self.engine.buffer(law_d, name), name, ("f32",), (bufs.batch, tree.nodes, vocab))
        seed = _exact(self.engine.buffer(seed_d, "seed_d"), "seed_d", ("u64", "i64"), (bufs.batch,))
        return law, seed, vocab


class SampledCandidates:
    """The layer's own candidates of a sampled tree: `draws` per node, drawn by kernel 12 and
    placed by kernel 11 (tokens, their log q, and the log of the j-th largest q)."""

    def __init__(self, engine: Engine, batch: int, nodes: int, draws: int):
        draws = as_size(draws, "a sampled node's draws (children)", 1, MAX_TREE_DRAWS)  # True was 1 draw
        n = batch * nodes * draws
        self.rows, self.draws = batch * nodes, draws
        self.tok_d = engine.zeros(np.uint32, n, label="tree draws")
        self.logq_d = engine.alloc(np.float32, n, zeroed=True, label="tree draws' log q")
        self.sel_d = engine.alloc(np.float32, n, zeroed=True, label="tree draws' selection")

    def __repr__(self) -> str:
        return f"SampledCandidates({self.rows} rows of {self.draws} draws)"


def _tree_counts(bufs: StreamBufs, tree: TreeBufs) -> tuple[int, int, int]:
    """T1, W and D of `tree` as plain ints, once they are found to agree: the kernels find every
    field of the allocation from (T1, W, D, B) alone (spec_tree.cu's tree_rows) and index the
    ranges of tree.levels, so counts that disagree (a TreeBufs whose attributes were changed, or
    made of a tree whose numpy counts wrapped) would have them write past it. 2 <= T1 <=
    MAX_TREE_NODES, W = ceil(T1 / 32), 1 <= D < T1, T1 and D the buffers' width and k, D + 1
    levels tiling 0..T1 in order (level 0 the root alone), all three its tree's, the allocation
    B (T1 (6 + W) + D + 1) words and a static tree's shape 3 T1. ValueError naming what
    disagrees."""
    nodes = as_size(tree.nodes, "the tree's node count T1", 2, MAX_TREE_NODES)
    words = as_size(tree.words, "the tree's mask words W", 1)
    if words != -(-nodes // 32):
        raise ValueError(f"the tree's mask words W = {words} disagree with its T1 = {nodes} nodes: W is "
                         f"ceil(T1 / 32) = {-(-nodes // 32)}")
    depth = as_size(tree.depth, "the tree's depth D", 1, nodes - 1)
    if (nodes, depth) != (bufs.geometry.width, bufs.k):
        raise ValueError(f"the tree's T1 = {nodes} and D = {depth} disagree with its buffers' width "
                         f"{bufs.geometry.width} and k = {bufs.k}")
    levels = tuple(tree.levels)
    if len(levels) != depth + 1:
        raise ValueError(f"the tree's levels must be D + 1 = {depth + 1} ranges, not {len(levels)}")
    end = 0  # where the level before stops
    for d, (start, stop) in enumerate(levels):
        if start != end or not start <= stop <= nodes or (d == 0 and stop != 1):
            raise ValueError(f"the tree's level {d}, {(start, stop)}, disagrees with its T1 = {nodes} nodes: the "
                             "levels tile 0..T1 in order (start <= stop <= T1, each starting where the one before "
                             "stops, level 0 the root alone)")
        end = stop
    if end != nodes:
        raise ValueError(f"the tree's levels end at node {end}, not at its T1 = {nodes}")
    shape = tree.tree
    if (nodes, depth, levels) != (shape.nodes, shape.depth, tuple(shape.levels)):
        raise ValueError(f"the tree's T1 = {nodes}, D = {depth} and levels {levels} disagree with those of the tree "
                         f"its buffers were made for, {shape!r}")
    words_held = bufs.batch * (nodes * (6 + words) + depth + 1)
    if tree.arena.len != words_held:
        raise ValueError(f"the tree's allocation holds {tree.arena.len} words, not the {words_held} of B = "
                         f"{bufs.batch} rows of T1 = {nodes}, W = {words}, D = {depth}")
    if tree.shape_d is not None and tree.shape_d.len != 3 * nodes:
        raise ValueError(f"the tree's shape holds {tree.shape_d.len} words, not 3 T1 = {3 * nodes}")
    return nodes, words, depth


def _level(tree: TreeBufs, level: int) -> int:
    level = as_index(level, "level")
    if not 1 <= level <= tree.depth:
        raise ValueError(f"a tree of depth {tree.depth} grows levels 1 to {tree.depth}, not {level}")
    return level


__all__ = ["SampledCandidates", "TreeKernels"]

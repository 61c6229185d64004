"""TreeRound: a round that verifies a tree of drafts (docs/trees.md), the second kind of Round.

Between the draft's levels the layer grows the tree (kernels 11, 12), unless the draft places a
greedy static tree's children itself (draft_places); after the verify it accepts the deepest
agreeing path (13, 14) and moves that path's KV to consecutive slots (15, or the model's own
compaction), so the commit and rollbacks after it are a chain's. A greedy tree that kernel 15
compacts accepts, commits and rolls back in one launch, then compacts.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..buffers.acceptance import Greedy, Sampling
from ..buffers.tables import KVDataTable, StateIndexTable, StateTable
from ..buffers.tree import Candidates, TreeBufs, TreeShape
from ..driver.graph import Capture
from ..driver.values import as_flag, as_listed
from ..kernels.spec import SpecKernels
from ..kernels.tree import SampledCandidates, TreeKernels
from .round import Parts, Round, Stages, Step, as_kernels, length_chooser

if TYPE_CHECKING:
    from ..buffers.acceptance import Acceptance
    from ..buffers.lengths import DraftLengths
    from ..buffers.stream_bufs import StreamBufs
    from ..buffers.tables import PointerTable
    from ..driver.module import Launch


class TreeRound(Round):
    """A round that verifies a tree of drafts (docs/trees.md): `tree_bufs` (TreeBufs over these
    StreamBufs, whose k is the tree's depth D) holds the nodes. The model gives `draft_levels`,
    D + 1 steps, step d processing the nodes of level d (steps 0..D-1 also write what their
    children are made of: greedy, `candidates`, the K best tokens and log-probabilities of each
    node; sampling, Sampling's q_d, [B][T+1][V]; with `draft_places`, a greedy static tree's
    step d writes level d + 1's tokens itself, step 0 every position), and `verify_tree`, which scores all T + 1 nodes
    under the ancestor mask into Greedy's pred_d ([B][T+1]) or Sampling's p_d ([B][T+1][V]).
    Between the levels the layer grows the tree (kernels 11, 12); after the verify it accepts
    (13 or 14) and moves the accepted path's KV to consecutive slots: in the layers of `kv_data`
    (a KVDataTable, kernel 15) and by `compact`, the model's own callable for a cache the table
    cannot describe (paged), which reads tree_bufs.path_d and bufs.acc_d. Recurrent state keeps
    a slot per node (StateLayer(..., k=T)); the path's last node's slot becomes the live one.
    `lengths` (DraftLengths of these bufs, its k the depth), when given, opens each round with the
    length chooser: each row's acceptance stops at its length, min(width, its request's cap), as
    deep as the tree goes (docs/lengths.md). The tree is drafted and verified whole whatever the
    lengths, so give it flat costs: each row then runs at its own cap (docs/lengths.md#trees).
    With `choose_beside` the chooser runs beside the draft's levels and the verify where a graph
    is captured, off the round's path (ChainRound's, Beside). With `skip_done` its burst graphs
    skip the draft's levels and the verify of a round once every row is done (Round's).
    With `draft_places` (a greedy static tree), the draft's levels place the children themselves
    and no grow runs: step d writes tok of level d + 1's nodes (its parents' candidates of their
    ranks, what kernel 11 would place) and step 0 every node's pos (pos_start + depth); the other
    fields are the ones TreeBufs wrote when it was made (TreeShape.fixed_fields), and no
    candidates are given.
    """

    def __init__(self, bufs: StreamBufs, tree_bufs: TreeBufs, kernels: SpecKernels | None = None, *,
                 draft_levels: Sequence[Step], verify_tree: Step, acceptance: Acceptance,
                 candidates: Candidates | None = None, rollback_tables: Sequence[PointerTable],
                 kv_data: KVDataTable | None = None, compact: Step | None = None,
                 state_tables: Sequence[StateTable | StateIndexTable] = (), lengths: DraftLengths | None = None,
                 draft_places: bool = False, choose_beside: bool = False, skip_done: bool = False,
                 capture: Capture | None = None, stages: Stages | None = None):
        if not isinstance(tree_bufs, TreeBufs) or tree_bufs.bufs is not bufs:
            raise ValueError(f"tree_bufs must be TreeBufs(bufs, tree) over these StreamBufs, not {tree_bufs!r}")
        tree = tree_bufs.tree
        # in their order, level 0 first: a set's is its members' hashes' (as_listed, as chain() refuses one)
        levels = as_listed(draft_levels, "draft_levels", "callables, one a level (level 0 the root)")
        if len(levels) != tree.depth + 1:
            raise ValueError(f"a tree of depth {tree.depth} takes {tree.depth + 1} draft levels (callables, level 0 "
                             f"the root), not {len(levels)}")
        for depth, step in enumerate(levels):
            if not callable(step):
                raise TypeError(f"draft level {depth} must be a callable that queues the model's work, not {step!r}")
        if not callable(verify_tree):  # None too: every round's verify
            raise TypeError(f"verify_tree must be a callable that queues the model's work, not {verify_tree!r}")
        if compact is not None and not callable(compact):  # None: no compaction of the model's own
            raise TypeError(f"compact must be a callable that queues the model's work, not {compact!r}")
        draft_places = as_flag(draft_places, "draft_places")
        if draft_places and not (isinstance(acceptance, Greedy) and isinstance(tree, TreeShape)):
            raise ValueError("only a greedy static tree's draft places its own children (draft_places): a dynamic "
                             "tree's are weighed and a sampled tree's drawn by the layer's kernels")
        if isinstance(acceptance, Greedy):
            if draft_places:
                if candidates is not None:
                    raise ValueError("a draft that places its own children offers no candidates: candidates= is "
                                     "for the grow kernel")
            elif not isinstance(candidates, Candidates):
                raise TypeError("a greedy tree round needs the draft's candidates=Candidates(tok_d, logp_d)")
            offered = candidates
        elif isinstance(acceptance, Sampling):
            if candidates is not None:
                raise ValueError("a sampled tree draws its own children from q_d: candidates= is for greedy trees")
            tree.check_sampled()
        else:
            raise TypeError(f"acceptance must be Greedy(pred_d) or Sampling(p_d, q_d, seed_d, vocab), not "
                            f"{acceptance!r}")
        if kv_data is None and compact is None:
            raise ValueError("a tree round must move the accepted path's KV: give kv_data=kv_data_table(...) or "
                             "compact= (a model without KV: compact=lambda: None)")
        kernels = as_kernels(kernels, "TreeRound", bufs)
        trees = TreeKernels(bufs.engine)
        self.acceptance, self.tree_bufs, self.tree_kernels, self.lengths = acceptance, tree_bufs, trees, lengths
        choose, chosen = length_chooser(kernels, bufs, lengths, choose_beside)

        # A greedy tree whose KV the layer compacts (kernel 15) accepts, commits and rolls back in
        # one launch (the greedy round tail), and compacts after it: kernel 15 reads keep, the
        # accepted count, the path and pos_start, which the commit and the rollback leave as the
        # acceptance wrote them. A model's own `compact` may read what they move (a length, the
        # position), so with one the acceptance stays a launch of its own before it.
        fused_tail = None
        if isinstance(acceptance, Greedy) and compact is None and kv_data is not None:
            pred_d, data = acceptance.pred_d, kv_data

            def fused_tail(table: PointerTable) -> tuple[Launch, Sequence[Step]]:
                return (trees.prepare_round_tail_greedy(bufs, tree_bufs, pred_d, table),
                        (trees.prepare_compact(bufs, tree_bufs, data),))

        def before_commit() -> Parts:
            opening: list[Step] = [*choose, trees.prepare_begin(bufs, tree_bufs)]
            steps: list[Step] = []
            if isinstance(acceptance, Sampling):
                drawn = SampledCandidates(bufs.engine, bufs.batch, tree_bufs.nodes, tree.draws)
                vocab = _vocab(acceptance, bufs, tree_bufs)
                for level in range(1, tree.depth + 1):
                    steps += [levels[level - 1],
                              trees.prepare_draw(bufs, tree_bufs, level, acceptance.q_d, acceptance.seed_d, vocab,
                                                 drawn),
                              trees.prepare_grow(bufs, tree_bufs, level, drawn.tok_d, drawn.logq_d, drawn.sel_d)]
                accept = trees.prepare_accept_sample(bufs, tree_bufs, acceptance.p_d, acceptance.q_d,
                                                     acceptance.seed_d, vocab)
            else:
                if draft_places:  # each level writes its children's tokens, TreeBufs wrote the rest once
                    steps += levels[:-1]
                else:
                    assert offered is not None
                    for level in range(1, tree.depth + 1):
                        steps += [levels[level - 1],
                                  trees.prepare_grow(bufs, tree_bufs, level, offered.tok_d, offered.logp_d)]
                if fused_tail is not None:  # the acceptance and the compaction are the tail's
                    return opening, [*steps, levels[-1], verify_tree], chosen
                accept = trees.prepare_accept_greedy(bufs, tree_bufs, acceptance.pred_d)
            closing = [*chosen, accept]
            if kv_data is not None:
                closing.append(trees.prepare_compact(bufs, tree_bufs, kv_data))
            return opening, [*steps, levels[-1], verify_tree], [*closing, *([compact] if compact is not None else [])]
        super().__init__(bufs, kernels, before_commit, rollback_tables=rollback_tables,
                         state_tables=state_tables, capture=capture, stages=stages,
                         capacities=(kv_data.capacity if kv_data is not None else None,), fused_tail=fused_tail,
                         skip_done=skip_done)

    def _roll_back_state(self, table: StateTable | StateIndexTable) -> Step:
        """The live state after the path's last node: its slot of T + 1 (kernels 16, 17)."""
        if isinstance(table, StateTable):
            return self.tree_kernels.prepare_state_copy(self.bufs, self.tree_bufs, table)
        return self.tree_kernels.prepare_state_flip(self.bufs, self.tree_bufs, table)


def _vocab(rule: Sampling, bufs: StreamBufs, tree_bufs: TreeBufs) -> int:
    """Sampling's vocabulary, or the one its p_d holds for a row of T + 1 nodes."""
    if rule.vocab is not None:
        return rule.vocab
    return bufs.engine.buffer(rule.p_d, "p_d").len // (bufs.batch * tree_bufs.nodes)

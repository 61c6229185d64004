"""Speculative decoding by trees: the draft grows a tree of candidates through the layer (static
or dynamic, docs/trees.md), the target verifies all of its T + 1 nodes in one forward under the
ancestor mask, and the layer commits the path the target accepts and moves that path's K/V to
consecutive slots in both models' caches (kernel 15, or the model's own callable for a paged
cache), greedy or sampled, in every mode.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from ..buffers.acceptance import Greedy, Sampling
from ..buffers.geometry import Geometry
from ..buffers.lengths import DraftLengths
from ..buffers.tables import kv_data_table, kv_len_ptr_table
from ..buffers.tree import MAX_TREE_CANDIDATES, Candidates, DynamicTree, Tree, TreeBufs, TreeShape
from ..driver.values import as_size
from ..rounds.stream import RoundStream
from ..rounds.tree_round import TreeRound
from .decoder import RoundDecoder, fold, refuse
from .kv import CacheLayout, PagedKV, Room, StaticKV, cache_slots
from .mask import TreeMask
from .sampling import SamplingParams
from .stack import Compile, op_by_op
from .uploads import uploaded
from .views import TreeViews

ARGMAX_RANKS = 4  # the most candidates a node takes by argmaxes (best_ranks); past it, torch.topk


def best_ranks(logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out` ([..., k] int64, any strides: a level's rows of cand_tok) = the indices of the k
    largest of each row of `logits` (its last dim), best first: for the few a static tree asks
    (at most ARGMAX_RANKS), by k argmaxes written straight into it, each after the one before is
    masked out of `logits` in place (a level's own logits, read by nothing else), a tie to the
    lower index; torch.topk's radix select is a dozen kernels, which cost a small model's tree
    level twice what two argmaxes do (benchmarks/RESULTS.md, "The PyTorch engine's kernels").
    More, by torch.topk. top_ranks takes the same ranks out of place, for a compiled level."""
    k = out.shape[-1]
    if k > ARGMAX_RANKS:
        return out.copy_(logits.topk(k, dim=-1).indices)
    for rank in range(k):
        torch.argmax(logits, -1, out=out[..., rank])
        if rank + 1 < k:
            logits.scatter_(-1, out[..., rank:rank + 1], -torch.inf)
    return out


def top_ranks(logits: torch.Tensor, k: int) -> torch.Tensor:
    """best_ranks' ranks ([..., k] int64: the indices of the k largest of each row of `logits`,
    best first, a tie to the lower index), out of place: each argmax over the logits with the
    ones before it masked to -inf by torch.where, which a compiled level fuses into the next
    argmax (no scatter into the logits, which are left as they are). Past ARGMAX_RANKS, torch.topk's."""
    if k > ARGMAX_RANKS:
        return logits.topk(k, dim=-1).indices
    every = torch.arange(logits.shape[-1], device=logits.device)
    ranks = []
    for rank in range(k):
        ranks.append(torch.argmax(logits, -1, keepdim=True))
        if rank + 1 < k:
            logits = torch.where(every == ranks[-1], -torch.inf, logits)
    return torch.cat(ranks, -1)


def place_children(logits: torch.Tensor, tok: torch.Tensor, taken: torch.Tensor, children: torch.Tensor,
                   k: int) -> None:
    """A static greedy tree's level places its children: `tok` ([B][T+1], TreeViews.tok) at the
    nodes `children` (int64 [C]) = their parents' candidates of their ranks, entries `taken`
    (int64 [C]: (parent - level's first node) * k + rank) of the level's top_ranks(logits, k)
    ([B][n][k], flattened), as int32 ids: what the grow kernel (11) placed from best_ranks'
    candidates, a token straight into the node, with no candidates between. Compiled with the
    draft's step (ChildPlacement)."""
    tok[:, children] = top_ranks(logits, k).flatten(1)[:, taken].to(tok.dtype)


def tree_start(root: torch.Tensor, pos_start: torch.Tensor, accepted: torch.Tensor, done: torch.Tensor,
               vtok: torch.Tensor, node_index: torch.Tensor, pos: torch.Tensor | None = None,
               depths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tree round's inputs from its buffers, at level 0: the root's tokens and positions ([B][2]
    each, fold's), none appended where the last round accepted no draft (that entry is there
    already), and every node's slot ([B][T+1]: the root's plus the node's index), which each
    level and the verify slice. With `pos` (TreeViews.pos, [B][T+1] int32) and `depths` (int64
    [T+1]), every node's position too, the root's plus its depth, as the grows would write a level
    at a time (a static tree whose draft places its children runs none: ChildPlacement).
    Compiled with the draft's step (LayerStack.compiled)."""
    start = pos_start.long()
    lone = (accepted == 0) | (done != 0) | (start == 0)
    if pos is not None:  # `depths` with it: None there is an error, not a level left unwritten
        pos.copy_(start + depths)
    return (*fold(root, start, lone, vtok, accepted), start + node_index)


class ChildPlacement:
    """How a static greedy tree's draft levels place its children themselves, with no grow
    kernel between them (TreeRound's draft_places): a child holds its parent's candidate of its
    rank, and everything else about it is fixed (TreeBufs writes parent, depth, rank and mask
    once, TreeShape.fixed_fields), so level d's top ranks go straight into level d + 1's tokens
    (place_children, compiled with the draft's step: `compiled`), and the round's level 0 writes
    every node's position (tree_start, with `pos` and `depths`). A level takes the ranks its
    children ask (argmaxes up to the highest: a rank's argmax is the same however many follow it),
    or torch.topk's `candidates` past ARGMAX_RANKS, as best_ranks took them.

    `tok` and `pos` are views of TreeViews' of their own: a compiled forward marks the dims of
    the tensors it is given (the verify's, TreeViews' own), which a compiled level's guards, made
    before, would then fail at the next round: a compilation inside the capture."""

    def __init__(self, tree: TreeShape, candidates: int, nodes: TreeViews, compiled: Compile = op_by_op):
        self.tok, self.pos = nodes.tok[:], nodes.pos[:]
        device = self.tok.device
        self.depths = uploaded(tree.depths, torch.long, device)
        self.levels: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # each parent level's (taken, children, k)
        for level, (start, _) in enumerate(tree.expanded[:-1]):
            children = range(*tree.levels[level + 1])
            k = candidates if candidates > ARGMAX_RANKS else max(tree.rank[c] for c in children) + 1
            taken = [(tree.parent[c] - start) * k + tree.rank[c] for c in children]  # parents: level's expanded
            self.levels.append((uploaded(taken, torch.long, device), uploaded(list(children), torch.long, device), k))
        self._place = compiled(place_children)

    def __call__(self, level: int, logits: torch.Tensor) -> None:
        """Level `level + 1`'s tokens from level `level`'s logits ([B][n][V], n its expanded nodes)."""
        taken, children, k = self.levels[level]
        self._place(logits, self.tok, taken, children, k)


class TreeLlama(RoundDecoder):
    """A target and a draft model of `batch` rows verifying `tree` each round (TreeRound on one
    torch stream; see RoundDecoder for the models, generate_batch and serve): greedy, the draft's
    `candidates` best tokens a node (default the most the tree asks for) and the target's argmax
    at each node; with `sampling`, the draft's distribution q and the target's p at each node
    ([B][T+1][V] f32 each), the children drawn and accepted by the layer's exact rejection
    sampling without replacement, keyed by the rows' seeds. A request's most draft length
    (Request.max_draft; 0: speculation off) caps how deep its row's accepted path goes, on the
    device (docs/lengths.md); the tree is drafted and verified whole all the same.

    Both caches are compacted by the layer (kv_data_table over StaticKV.data(): a record per layer
    and head), or, with `paged` (positions a page), laid out in pages (PagedKV) and compacted by
    the model's own callable (TreeRound's compact=). A hybrid target keeps T + 1 state slots.

    `skip_done` has the burst graphs skip a round's draft and verify once every row is done, and
    size a burst to cover the rows' need (TreeRound's; CUDA 12.4+; no hybrid target).

    The model's side is two callables, each queuing torch work on the engine's stream:
    draft_level(d), the draft over level d's nodes up to its last with children, and
    verify_tree(), the target over every node."""

    node_slots: torch.Tensor  # every node's slot this round, [B][T+1] (draft_level(0) makes it)

    def __init__(self, model: Any, draft: Any, tree: Tree, *, candidates: int | None = None, m_rounds: int = 16,
                 capacity: int | Room = 1024, batch: int = 1, sampling: SamplingParams | None = None,
                 draft_sampling: SamplingParams | None = None, state_rollback: str = "copy",
                 paged: int | None = None, compiled: bool | None = None, skip_done: bool = False):
        refuse(model, draft, state_rollback)  # before the candidates read the model's vocabulary
        if not isinstance(tree, (TreeShape, DynamicTree)):
            raise TypeError(f"a tree is a TreeShape or a DynamicTree, not {tree!r}")
        if sampling is not None and candidates is not None:
            raise ValueError("a sampled tree draws its children from the draft's q: candidates= is for greedy trees")
        # a node's candidates: at least the tree's draws, at most the grow kernel's K (and the vocabulary)
        most = min(MAX_TREE_CANDIDATES, model.config.vocab_size)
        if sampling is None and tree.draws > most:  # the default too: topk met it past the stacks, argmax gave 0 twice
            raise ValueError(f"a greedy tree asks a node for {tree.draws} candidates (its highest rank + 1, a dynamic "
                             f"tree's branch), more than the vocabulary's {model.config.vocab_size} tokens")
        self.candidates = tree.draws if candidates is None else as_size(
            candidates, f"candidates (the tree draws {tree.draws} a node; the kernels rank at most {most})",
            tree.draws, most)
        if sampling is not None:
            tree.check_sampled()  # before any model or buffer is made (TreeRound checks it again, for its own callers)
        self.tree = tree
        geometry = Geometry.of_tree(tree, m_rounds, batch)
        # the page checked here, not where the caches are made after the stream and both models' stacks: at most
        # the slots a row each cache gets (cache_slots, as RoundDecoder sizes them; a longer page was allocated whole)
        cache: CacheLayout = StaticKV if paged is None else functools.partial(
            PagedKV, page=as_size(paged, "paged", 1, cache_slots(capacity, geometry)))
        super().__init__(model, draft, geometry,
                         capacity=capacity, sampling=sampling, draft_sampling=draft_sampling,
                         state_rollback=state_rollback, cache=cache, compiled=compiled, skip_done=skip_done)
        batch = self.batch
        nodes = tree.nodes
        with torch.cuda.stream(self.stream):
            self.tree_bufs = tree_bufs = TreeBufs(self.bufs, tree)
            self.tree_views = TreeViews(tree_bufs)
            # SDPA takes a mask of the query's dtype: one a model's dtype (the same where they agree)
            masks = {dtype: TreeMask(self.tree_views.words, self.target.kv.capacity, dtype, tree,
                                     compiled=self.draft.compiled)
                     for dtype in {model.dtype, draft.dtype}}
            self.target_mask, self.draft_mask = masks[model.dtype], masks[draft.dtype]
            self.masks = list(masks.values())  # each made for the round once, at level 0
            self.node_index = self.target.slots[:nodes]
            self.start = self.draft.compiled(tree_start)
            vocab = model.config.vocab_size
            # A greedy static tree places a child by its rank alone, so its draft's levels place the
            # children themselves (no grow kernel, no candidates, no softmax); a dynamic tree's offers
            # are weighed by the layer.
            self.placement = ChildPlacement(tree, self.candidates, self.tree_views, self.draft.compiled) \
                if sampling is None and isinstance(tree, TreeShape) else None
            if sampling is None:
                self.pred_d = torch.zeros(batch, nodes, dtype=torch.long, device="cuda")
                rule: dict[str, Any] = dict(acceptance=Greedy(self.pred_d))
                if self.placement is None:
                    self.cand_tok = torch.zeros(batch, nodes, self.candidates, dtype=torch.long, device="cuda")
                    self.cand_logp = torch.full((batch, nodes, self.candidates), -torch.inf, device="cuda")
                    rule["candidates"] = Candidates(self.cand_tok, self.cand_logp)
            else:
                self.p_d = torch.zeros(batch, nodes, vocab, device="cuda")
                self.q_d = torch.zeros(batch, nodes, vocab, device="cuda")
                rule = dict(acceptance=Sampling(self.p_d, self.q_d, self.seed_d, vocab))
            layers = self.target.kv.cache() + self.draft.kv.cache()
            # each request's most draft length (Request.max_draft) caps its row's accepted depth, on
            # the device; the tree is drafted and verified whole, so every width costs alike
            self.lengths = DraftLengths(self.bufs, [1.0] * (tree.depth + 1), 0.0)
            round_ = TreeRound(self.bufs, tree_bufs, draft_levels=[functools.partial(self.draft_level, d)
                                                                  for d in range(tree.depth + 1)],
                               verify_tree=self.verify_tree,
                               rollback_tables=[kv_len_ptr_table(self.engine, layers, pos_ctr=self.bufs.pos_ctr_d)],
                               state_tables=self.state_tables(), lengths=self.lengths, **rule,
                               draft_places=self.draft_places, choose_beside=True, skip_done=self.skip_done,
                               **self._compaction(paged))
            self.rounds = RoundStream.of(round_)
            self._warm_up()

    @property
    def draft_places(self) -> bool:
        """Whether the draft's levels place the tree's children themselves (a greedy static tree:
        ChildPlacement), so the round runs no grow kernel between them (TreeRound's draft_places)."""
        return self.placement is not None

    def _compaction(self, paged: int | None) -> dict[str, Any]:
        """TreeRound's way to move the accepted path: the layer's kernel over both static caches,
        or compact_paged for paged ones."""
        if paged is None:
            return dict(kv_data=kv_data_table(self.engine, self.target.kv.data() + self.draft.kv.data()))
        self.paged = [kv for kv in (self.target.kv, self.draft.kv) if isinstance(kv, PagedKV)]  # both, made so
        return dict(compact=self.compact_paged)

    def compact_paged(self) -> None:
        """The accepted path's entries to consecutive slots in both paged caches (after the accept,
        which wrote path_d and acc_d)."""
        for kv in self.paged:
            kv.compact(self.tree_views.path, self.views.accepted, self.views.pos_start)

    def _nodes(self, start: int, stop: int, mask: TreeMask) -> dict[str, torch.Tensor]:
        """Stack.append's keywords for nodes start..stop: their slots (level 0's, this round) and
        mask."""
        return dict(slots=self.node_slots[:, start:stop], mask=mask.rows(start, stop))

    def draft_level(self, level: int) -> None:
        """The draft over level `level`'s nodes up to its last with children (tree.expanded):
        what their children are made of (greedy: the best candidates and their log-probabilities;
        sampling: q), and their K/V.

        The leaves past that node run nothing, so the deepest level runs nothing, nor does a static
        tree's level past its last node with children: no node attends to a leaf, the layer reads no leaf's
        candidates or q, and a leaf's K/V matter only where the round accepts it last, when the
        next round's level 0 appends its token along with the root (the chain's fold,
        docs/model-side.md): vtok_d[a] at pos_start - 1, a the drafts last accepted; where a is 0
        (or the row is done, or at position 0) that entry is there already, and the root fills
        both columns."""
        start, stop = self.tree.expanded[level]
        if start == stop:
            return
        views, nodes = self.views, self.tree_views
        if level == 0:
            for mask in self.masks:
                mask.at(views.pos_start)
            positions = () if self.placement is None else (self.placement.pos, self.placement.depths)
            tokens, first, self.node_slots = self.start(nodes.tok[:, :1], views.pos_start, views.accepted,
                                                        views.done, views.vtok, self.node_index, *positions)
            logits = self.draft.logits(tokens, first, last=True)  # [B][1][V]
        else:  # [B][stop - start][V]
            logits = self.draft.logits(nodes.tok[:, start:stop], nodes.pos[:, start:stop],
                                       **self._nodes(start, stop, self.draft_mask))
        if self.draft_law is not None:
            self.draft_law(self.q_d[:, start:stop], logits)
        elif self.placement is not None:
            self.placement(level, logits)
        else:
            best = logits.float().log_softmax(-1).topk(self.candidates, dim=-1)
            self.cand_tok[:, start:stop] = best.indices
            self.cand_logp[:, start:stop] = best.values

    def verify_tree(self) -> None:
        """The target over all T + 1 nodes under the ancestor mask, in one forward: it reads the
        node slots and the mask its round's draft_level(0) made, so it runs after that, as the
        round does (alone, after the draft has run, to time it)."""
        nodes = self.tree_views
        self._verdict(self.target.logits(nodes.tok, nodes.pos, parents=nodes.parents,
                                         **self._nodes(0, self.tree.nodes, self.target_mask)))  # [B][T+1][V]

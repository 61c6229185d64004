"""Trees on the Llama of examples/torch_llama.py: the same target and self-speculative draft,
but each round the draft grows a tree of candidates through the layer (static or dynamic,
docs/trees.md), the target verifies all of its T + 1 nodes in one forward under the ancestor
mask, and the layer commits the path the target accepts and moves that path's K/V to
consecutive slots in both models' static caches (kernel 15), greedy or sampled, in every mode.

The model's two duties are two methods, each queued on the engine's torch stream:

- `draft_level(d)`: the draft over level d's nodes up to its last with children (tree_bufs'
  tokens at their positions, K/V at slot pos_start + node, attending to the committed prefix and
  to each node's ancestors), then each node's K best candidates (greedy) or its distribution q
  (sampling); the leaves past it, every node of the last level among them, run nothing: where a
  round accepts one last, the next round's first level appends it (as the chain's last step).
- `verify_tree()`: the target over every node likewise, its prediction (greedy) or its
  distribution p (sampling) at each node.

The ancestor mask is tree_bufs' bit mask turned into SDPA's additive one by `TreeMask`. A
hybrid target (recurrent layers) steps each node from its parent's state and leaves a slot a
node (T + 1), for the layer to keep the path's last one.

`tree_for_batch(size, batch, sampled)` is what the example picks at a batch size, measured on
an H200 by `make bench-torch` (its "trees" section), or None where the chain (torch_llama.py) is
faster: greedy on the large model a static tree at every B measured (1.02-1.19x the best
chain), on the small model at B = 1 and 128 (1.005-1.04x); elsewhere the chain (docs/torch.md,
"Trees").

    PYTHONPATH=. python examples/torch_tree.py [--size small|large] [--batch B] [--tokens 256]
        [--tree auto|static:N[,DEPTH]|chain:K,LEAVES|dynamic:D,W,B] [--mode graph] [--temperature T ...]
        [--hybrid]
"""
from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch_llama import (HYBRID, PROMPT, Request, RoundDecoder, SamplingParams, StaticKV, build_model, capacity_for,
                         check_greedy, decoding_arguments, head_size, parse_rounds, prompts, round_arguments)
from transformers import LlamaForCausalLM

from memra_cuda import (Candidates, DynamicTree, Greedy, RoundStream, Sampling, StreamBufs, TreeBufs, TreeRound,
                        TreeShape, kv_data_table, kv_len_ptr_table)
from memra_cuda.torch import adapter as memra_torch
from memra_cuda.buffers.tree import Tree


RANKS = 4  # the most candidates a node of static_tree has


def static_tree(size: int, depth: int = 10) -> TreeShape:
    """The example's static tree of `size` drafts, at most `depth` deep: the likeliest nodes for
    a draft whose best candidate is right 87% of the time and its second best 13% (0.15 times as
    often), the self-speculative draft's rates on CPU (docs/torch.md, "Trees")."""
    return TreeShape.likeliest(size, depth=depth, right=0.87, fall=0.15, ranks=RANKS)


# The tree per model size, decoding and batch size (None: the chain, SpeculativeLlama), from `make
# bench-torch`'s trees section on an H200 (docs/torch.md, "Trees"): at each B, the fastest measured
# configuration, where a tree was faster than every chain measured in two runs of the section.
# Greedy, the large model's trees: static_tree(64, 10) 1.18-1.19x the best chain at B = 1, (32, 8)
# 1.12-1.18x at 8, (12, 6) 1.02-1.06x at 32, (6, 4) 1.09-1.10x at 128; the small model's, since a level
# leaves out its leaves (tree.expanded): chain_with_leaves(10, 2) 1.005-1.009x at B = 1, (6, 4)
# 1.03-1.04x at 128 (at 8 and 32 a tree was ahead in one run only: the chain). Sampled, the chain
# at every B (the best tree 0.88-1.01x): tree_for_batch gives None.
PICKED: dict[str, dict[int, Tree | None]] = {
    "small": {1: TreeShape.chain_with_leaves(10, 2), 8: None, 32: None, 128: static_tree(6, 4)},
    "large": {1: static_tree(64, 10), 8: static_tree(32, 8), 32: static_tree(12, 6), 128: static_tree(6, 4)},
}


def tree_for_batch(size: str, batch: int, sampled: bool = False) -> Tree | None:
    """The tree the example verifies at `batch` rows of the `size` model, greedy or `sampled`, or
    None where the chain is faster: the measured pick of the largest batch size measured not above
    `batch`; sampled, always None (no tree was ahead of the chain in two runs at any B)."""
    if sampled:
        return None
    picks = PICKED[size]
    below = [b for b in picks if b <= batch]
    return picks[max(below)] if below else picks[min(picks)]


def parse_tree(text: str) -> Tree:
    """"static:N" or "static:N,DEPTH" (static_tree of N drafts), "chain:K,LEAVES"
    (TreeShape.chain_with_leaves) or "dynamic:D,W,B" (DynamicTree)."""
    kind, _, spec = text.partition(":")
    try:
        numbers = [int(x) for x in spec.split(",")]
    except ValueError:
        numbers = []
    if kind == "static" and len(numbers) in (1, 2):
        return static_tree(*numbers)
    if kind == "chain" and len(numbers) == 2:
        return TreeShape.chain_with_leaves(*numbers)
    if kind == "dynamic" and len(numbers) == 3:
        return DynamicTree(*numbers)
    raise ValueError(f'a tree is "static:N[,DEPTH]", "chain:K,LEAVES" or "dynamic:DEPTH,WIDTH,BRANCH", not {text!r}')


def best_ranks(logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out` ([..., k] int64, any strides: a level's rows of cand_tok) = the indices of the k
    largest of each row of `logits` (its last dim), best first: for the few a static tree asks
    (at most RANKS), by k argmaxes written straight into it, each after the one before is masked
    out of `logits` in place (a level's own logits, read by nothing else), a tie to the lower
    index; torch.topk's radix select is a dozen kernels, which cost a small-model tree level
    0.056 target steps at one node against 0.025 for two argmaxes (H200). More, by torch.topk."""
    k = out.shape[-1]
    if k > RANKS:
        return out.copy_(logits.topk(k, dim=-1).indices)
    for rank in range(k):
        torch.argmax(logits, -1, out=out[..., rank])
        if rank + 1 < k:
            logits.scatter_(-1, out[..., rank:rank + 1], -torch.inf)
    return out


class TreeMask:
    """The attention mask of a tree's nodes for SDPA, [B][1][n][capacity] additive (0 where a node
    attends, -inf elsewhere, in the model's dtype: SDPA would turn a boolean mask into this at
    every layer): node i attends to every slot before the root (the committed prefix) and to slot
    pos_start + j for each j in its ancestor mask (itself included).

    A round pays for it once where it can. `at(pos_start)`, at the round's first draft level,
    works out which slots lie before the root and which node each slot past it holds. A static
    tree's ancestors are the same every round (the layer grows the same mask_d), so its whole mask
    is made then, for the draft's levels and the verify alike; a dynamic tree's are known a level
    at a time, from TreeBufs.mask_d's words (`words`, [B][T+1][W] int32: node j at bit j % 32 of
    word j // 32), read as each level's mask is asked for."""

    def __init__(self, words: torch.Tensor, capacity: int, dtype: torch.dtype, tree: Tree | None = None):
        self.words, self.capacity = words, capacity
        self.nodes = 32 * words.shape[2]
        every = torch.arange(self.nodes, device=words.device)
        self.word, self.bit = every // 32, (every % 32).to(torch.int32)
        self.slots = torch.arange(capacity, device=words.device)
        self.zero = torch.zeros((), dtype=dtype, device=words.device)
        self.never = torch.full((), -torch.inf, dtype=dtype, device=words.device)
        self.ancestors = None
        if isinstance(tree, TreeShape):  # [T+1][32W], mask_d's bits as bools: row i node i's ancestors
            ancestors = torch.zeros(tree.nodes, self.nodes, dtype=torch.bool)
            for i, p in enumerate(tree.parent):
                if p >= 0:
                    ancestors[i] = ancestors[p]
                ancestors[i, i] = True
            self.ancestors = ancestors[None].to(words.device)

    def at(self, pos_start: torch.Tensor) -> TreeMask:
        """The round's part, for roots at slot `pos_start` ([B][1])."""
        relative = self.slots - pos_start  # [B][capacity]
        self.prefix = (relative < 0)[:, None, :]
        self.inside = ((relative >= 0) & (relative < self.nodes))[:, None, :]
        self.node = relative.clamp(0, self.nodes - 1)
        if self.ancestors is not None:
            self.whole = self._mask(self.ancestors.expand(len(pos_start), -1, -1))
        return self

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """The mask of nodes start..stop (after at() this round)."""
        if self.ancestors is not None:
            return self.whole[:, :, start:stop]
        words = self.words[:, start:stop]
        return self._mask(((words[..., self.word] >> self.bit) & 1).bool())

    def _mask(self, bits: torch.Tensor) -> torch.Tensor:
        """The mask of n nodes whose ancestors are `bits` ([B][n][32W]), contiguous: SDPA's fused
        kernels refuse a mask whose rows are not, and would leave the math path alone."""
        tree = bits.gather(2, self.node[:, None, :].expand(-1, bits.shape[1], -1))  # [B][n][capacity]
        return torch.where(self.prefix | (tree & self.inside), self.zero, self.never)[:, None]


class PagedKV(StaticKV):
    """StaticKV's cache laid out in pages of `page` positions, as a paged engine keeps it: one pool
    of pages a layer ([layers][pages][heads][page][d]), a row's logical page j at physical page
    `table[row, j]`, the pages of every row shuffled through the pool. The layer's compaction
    kernel cannot describe it (its entries are not one stride apart), so a tree round moves the
    accepted path by the model's own callable: compact(), a few torch ops a depth."""

    def __init__(self, config: Any, n_layers: int, batch: int, capacity: int, dtype: torch.dtype, page: int = 16):
        if page < 1:
            raise ValueError(f"a page holds at least one position, not {page}")
        per_row = -(-capacity // page)
        dim, heads = head_size(config), config.num_key_value_heads
        self.k = torch.zeros(n_layers, batch * per_row, heads, page, dim, dtype=dtype, device="cuda")
        self.v = torch.zeros_like(self.k)
        shuffle = torch.randperm(batch * per_row, generator=torch.Generator().manual_seed(per_row))
        self.table = shuffle.view(batch, per_row).cuda()  # the same for every cache of this shape
        self.page, self.capacity = page, capacity
        self.lengths = torch.zeros(n_layers, batch, dtype=torch.int32, device="cuda")
        self.rows: torch.Tensor | None = None
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
        self._every_row = torch.arange(batch, device="cuda")[:, None]

    def _at(self, rows: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The physical page and the offset in it of each of `slots` of `rows` (broadcast)."""
        return self.table[rows, slots // self.page], slots % self.page

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int, *args, **kwargs):
        rows = self._every_row if self.rows is None else self.rows[:, None]
        page, offset = self._at(rows, self.positions)
        self.k[layer][page, :, offset] = key.transpose(1, 2)
        self.v[layer][page, :, offset] = value.transpose(1, 2)
        return self.gather(layer, rows[:, 0])

    def gather(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `rows` in logical order, [rows][heads][capacity][d], for the attention."""
        pages = self.table[rows]  # [rows][per_row]
        return tuple(kv[layer][pages].permute(0, 2, 1, 3, 4).flatten(2, 3)[:, :, :self.capacity]
                     for kv in (self.k, self.v))

    def compact(self, path: torch.Tensor, accepted: torch.Tensor, start: torch.Tensor) -> None:
        """The layer's kernel 15 in torch: for d = 1..D in increasing d (a deeper depth's source
        can be a shallower one's destination), each row with at least d drafts accepted moves the
        entries at slot start + path[d] to start + d, in every layer; slots past the capacity
        are skipped. `path` [B][D+1], `accepted` and `start` [B][1]."""
        rows = self._every_row[:, 0]
        path, accepted, start = path.long(), accepted.long()[:, 0], start.long()[:, 0]
        for d in range(1, path.shape[1]):
            source, target = start + path[:, d], start + d
            move = (accepted >= d) & (source != target) & (source < self.capacity) & (target < self.capacity)
            (sp, so), (tp, to) = (self._at(rows, slot.clamp(0, self.capacity - 1)) for slot in (source, target))
            for kv in (self.k, self.v):
                kv[:, tp, :, to] = torch.where(move[:, None, None, None], kv[:, sp, :, so], kv[:, tp, :, to])

    def copy_rows(self, other: StaticKV, rows: torch.Tensor) -> None:
        pages = self.table[rows].flatten()
        n = len(self.lengths)
        for mine, theirs in ((self.k, other.k), (self.v, other.v)):
            mine.index_copy_(1, pages, theirs[:n].index_select(1, pages))
        self.lengths.index_copy_(1, rows, other.lengths[:n].index_select(1, rows))

    def data(self) -> list:
        raise TypeError("a paged cache is not one stride a position: the layer's compaction cannot move it "
                        "(TreeLlama(paged=...) gives the round compact= instead)")


class TreeLlama(RoundDecoder):
    """Target and draft Stacks of `batch` rows verifying `tree` each round (TreeRound on one
    torch stream): greedy, the draft's `candidates` best tokens a node (default the most the tree
    asks for) and the target's argmax at each node; with `sampling`, the draft's distribution q
    and the target's p at each node ([B][T+1][V] f32 each), the children drawn and accepted by the
    layer's exact rejection sampling without replacement, keyed by the rows' seeds.

    Both caches are compacted by the layer (kv_data_table over StaticKV.data(): a record per layer
    and head), or, with `paged` (positions a page), laid out in pages (PagedKV) and compacted by
    the model's own callable (TreeRound's compact=). A hybrid target keeps T + 1 state slots
    (`state_rollback` "copy" or "flip")."""

    def __init__(self, model: LlamaForCausalLM, tree: Tree, *, candidates: int | None = None, m_rounds: int = 16,
                 capacity: int = 1024, batch: int = 1, draft_layers: int = 1, sampling: SamplingParams | None = None,
                 draft_sampling: SamplingParams | None = None, state_rollback: str = "copy",
                 paged: int | None = None):
        if not isinstance(tree, (TreeShape, DynamicTree)):
            raise TypeError(f"a tree is a TreeShape or a DynamicTree, not {tree!r}")
        self._check(model, draft_layers, state_rollback)
        self.model, self.tree, self.batch = model, tree, batch
        self.k, self.width = tree.depth, tree.nodes
        if sampling is not None and candidates is not None:
            raise ValueError("a sampled tree draws its children from the draft's q: candidates= is for greedy trees")
        self.candidates = tree.draws if candidates is None else int(candidates)
        if not tree.draws <= self.candidates <= model.config.vocab_size:
            raise ValueError(f"the tree asks for {tree.draws} candidates a node: candidates must be from that to the "
                             f"vocabulary's {model.config.vocab_size}, not {candidates}")
        self.sampling, self.draft_sampling = sampling, draft_sampling or sampling
        nodes = tree.nodes
        self.stream = torch.cuda.Stream()
        with torch.cuda.stream(self.stream):
            self.engine = engine = memra_torch.engine()
            cache = StaticKV if paged is None else functools.partial(PagedKV, page=paged)
            self._stacks(capacity, draft_layers, state_rollback, nodes - 1, cache)
            self.bufs = bufs = StreamBufs(engine, tree.depth, m_rounds, batch)
            self.tree_bufs = tb = TreeBufs(bufs, tree)
            self.tok = memra_torch.tensor(tb.tok_d, torch.int32).view(batch, nodes)
            self.pos = memra_torch.tensor(tb.pos_d).view(batch, nodes)
            self.parents = memra_torch.tensor(tb.parent_d, torch.int32).view(batch, nodes)
            self.words = memra_torch.tensor(tb.mask_d, torch.int32).view(batch, nodes, tb.words)
            self.pos_start = memra_torch.tensor(bufs.pos_start_d)[:, None]
            self.path = memra_torch.tensor(tb.path_d, torch.int32).view(batch, tree.depth + 1)
            self._round_views()  # accepted: this round's drafts accepted (the last's, at level 0)
            self.mask = TreeMask(self.words, capacity, model.dtype, tree)
            self.node_index = self.target.slots[:nodes]
            vocab = model.config.vocab_size
            if sampling is None:
                self.cand_tok = torch.zeros(batch, nodes, self.candidates, dtype=torch.long, device="cuda")
                # A static tree places a child by its rank alone: the layer only asks its candidate's
                # log-probability to be finite (and adds it into score_d, which the example does not
                # read), so the draft's levels leave them 0 and skip the softmax.
                self.ranks_only = isinstance(tree, TreeShape)
                self.cand_logp = torch.full((batch, nodes, self.candidates), 0.0 if self.ranks_only else -torch.inf,
                                            device="cuda")
                self.pred_d = torch.zeros(batch, nodes, dtype=torch.long, device="cuda")
                rule = dict(acceptance=Greedy(self.pred_d), candidates=Candidates(self.cand_tok, self.cand_logp))
            else:
                self.p_d = torch.zeros(batch, nodes, vocab, device="cuda")
                self.q_d = torch.zeros(batch, nodes, vocab, device="cuda")
                self.seed_d = torch.zeros(batch, dtype=torch.int64, device="cuda")
                rule = dict(acceptance=Sampling(self.p_d, self.q_d, self.seed_d, vocab))
            layers = self.target.kv.cache() + self.draft.kv.cache()
            round_ = TreeRound(bufs, tb, draft_levels=[functools.partial(self.draft_level, d)
                                                       for d in range(tree.depth + 1)],
                               verify_tree=self.verify_tree,
                               rollback_tables=[kv_len_ptr_table(engine, layers, pos_ctr=bufs.pos_ctr_d)],
                               state_tables=self.state_tables(), **rule, **self._compaction(paged))
            self.rounds = RoundStream.of(round_)
            self._warm_up()

    def _compaction(self, paged: int | None) -> dict[str, Any]:
        """TreeRound's way to move the accepted path: the layer's kernel over both static caches,
        or compact_paged for paged ones."""
        if paged is None:
            return dict(kv_data=kv_data_table(self.engine, self.target.kv.data() + self.draft.kv.data()))
        return dict(compact=self.compact_paged)

    def compact_paged(self) -> None:
        """The accepted path's entries to consecutive slots in both paged caches (after the accept,
        which wrote path_d and acc_d)."""
        for stack in (self.target, self.draft):
            stack.kv.compact(self.path, self.accepted, self.pos_start)

    def _nodes(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        """append's keywords for nodes start..stop: their slots and mask."""
        return dict(slots=self.pos_start + self.node_index[start:stop], mask=self.mask.rows(start, stop))

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
        if level == 0:
            self.mask.at(self.pos_start)
            lone = (self.accepted == 0) | (self.done != 0) | (self.pos_start == 0)
            logits = self._folded_logits(self.tok[:, :1], self.pos_start.long(), lone)
        else:
            logits = self.draft.logits(self.tok[:, start:stop], self.pos[:, start:stop], **self._nodes(start, stop))
        if self.sampling is None and self.ranks_only:
            best_ranks(logits, self.cand_tok[:, start:stop])
        elif self.sampling is None:
            best = logits.float().log_softmax(-1).topk(self.candidates, dim=-1)
            self.cand_tok[:, start:stop] = best.indices
            self.cand_logp[:, start:stop] = best.values
        else:
            self.q_d[:, start:stop] = self.draft_sampling.probs(logits)

    def verify_tree(self) -> None:
        """The target over all T + 1 nodes under the ancestor mask, in one forward."""
        logits = self.target.logits(self.tok, self.pos, parents=self.parents, **self._nodes(0, self.tree.nodes))
        if self.sampling is None:
            torch.argmax(logits, -1, out=self.pred_d)
        else:
            self.p_d.copy_(self.sampling.probs(logits))


def main(argv: list[str] | None = None) -> int:
    parser = decoding_arguments(__doc__.split("\n")[0], k=False)
    parser.add_argument("--tree", default="static:16",
                        help='"static:N[,DEPTH]" (static_tree), "chain:K,LEAVES" (TreeShape.chain_with_leaves), '
                        '"dynamic:D,W,B" (DynamicTree) or "auto" (tree_for_batch)')
    round_arguments(parser)
    args, sampling = parse_rounds(parser, argv)
    try:
        tree = (tree_for_batch(args.size, args.batch, sampling is not None) if args.tree == "auto" else
                parse_tree(args.tree))
    except ValueError as exc:
        parser.error(str(exc))
    if tree is None:
        decoding = "greedy" if sampling is None else "sampled"
        parser.error(f"at B={args.batch} the {args.size} model decodes {decoding} faster by the chain: "
                     "examples/torch_llama.py, or name a --tree")
    model = build_model(args.size, recurrent_layers=HYBRID if args.hybrid else ())
    batch = [PROMPT] if args.batch == 1 else prompts(args.batch)
    requests = [Request(prompt, args.tokens, None, seed) for seed, prompt in enumerate(batch)]
    capacity = capacity_for(max(map(len, batch)), args.tokens, tree.depth, args.m_rounds, args.batch, tree.nodes)
    spec = TreeLlama(model, tree, m_rounds=args.m_rounds, capacity=capacity, batch=args.batch, sampling=sampling,
                     state_rollback=args.state_rollback)
    got = spec.generate_batch(requests, args.mode)
    print(f"{args.size} model, B={args.batch}, {tree}, {args.mode}, {'greedy' if sampling is None else sampling}: "
          f"{sum(map(len, got))} tokens, {spec.bufs.tokens_per_round([len(row) for row in got]):.2f} tokens a round")
    if model.dtype == torch.float32 and sampling is None:
        return check_greedy(model, requests, got, capacity, args.hybrid)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Trees in memra_cuda.torch (TreeLlama, issue 29) on the small random-weight Llama and its
self-speculative draft: the draft grows a static or dynamic tree through the layer, the target
verifies every node in one forward under the ancestor mask, and the layer compacts the accepted
path in both models' static caches. Greedy tree decoding equals Hugging Face's own greedy over
256 tokens (fp32) in every mode, B 1 and 8; served continuously, each request its own; after a
batch every row's KV is a fresh prefill of its committed tokens, also in a cache laid out in
pages that the model's own callable compacts; sampled, a request's tokens are the same in every
mode and the first token is distributed as the target's softmax; the hybrid with trees equals
its own plain greedy by copy and by flip. Skipped with the reason where torch or transformers is
missing.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest

from memra_cuda import Geometry
from memra_cuda import DynamicTree, TreeShape, kv_capacity
from memra_cuda.rounds import MODES
from laws import ROWS, assert_distributed_as, cells

torch = pytest.importorskip("torch", reason="needs PyTorch (pip install '.[torch]' in the checkout)")
pytest.importorskip("transformers", reason="memra_cuda.torch.testing needs transformers")
from memra_cuda.torch.testing import PROMPT, prompts  # noqa: E402
from memra_cuda.torch import (GraphedGreedy, PagedKV, Request, SamplingParams, Stack, TreeLlama,  # noqa: E402
                              best_ranks, capacity_for, hf_greedy, self_draft)
from test_torch_batch_gpu import DRAW_BATCH, draws_in_batches, first_difference  # noqa: E402  (imports torch)
from test_torch_hybrid_gpu import BUDGETS, EOS_ROWS, TOKENS, generate  # noqa: E402  (the same budgets and stops)

pytestmark = [pytest.mark.gpu, pytest.mark.torch]

M = 8
# The static tree has leaves the draft skips (tree.expanded): [2] at depth 1, and [0, 0, 1] and
# [1, 0, 0] past depth 3's last node with a child, accepted last (for the small model's draft)
# in about one round in eight, whose next round's first level must append them. [0, 1] is a leaf the draft
# runs, before depth 2's last node with a child.
LEAVES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [1, 0, 0], [0, 0, 0, 0]]
TREES = {"static": TreeShape.from_choices(LEAVES), "dynamic": DynamicTree(4, 3, 3)}


def greedy_requests(small) -> dict:
    """B -> (requests, Hugging Face's greedy of each alone, the longest prompt): one request of
    PROMPT; eight prompts of 2 to 40 tokens (one of one token), budgets of 64 to 256, two rows
    stopped by an EOS from their own output."""
    out = {}
    for batch, budgets in BUDGETS.items():
        rows = [PROMPT] if batch == 1 else [[1], *prompts(batch - 1, seed=3)]
        alone = [hf_greedy(small, prompt, n) for prompt, n in zip(rows, budgets)]
        stops = [alone[row][EOS_ROWS[batch][row]] if row in EOS_ROWS[batch] else None for row in range(batch)]
        requests = [Request(p, n, eos) for p, n, eos in zip(rows, budgets, stops)]
        want = [row[:row.index(eos) + 1] if eos in row else row for row, eos in zip(alone, stops)]
        out[batch] = requests, want, max(map(len, rows))
    return out


@pytest.fixture(scope="module")
def greedy_batches(small):
    return greedy_requests(small)


def tree_decoder(model, tree, longest: int, tokens: int, batch: int, draft=None, **kwargs) -> TreeLlama:
    """A TreeLlama of `model` and `draft` (default its self-speculative one) over `tree`, M = M,
    caches for prompts of `longest` tokens and budgets of `tokens`."""
    capacity = capacity_for(longest, tokens, Geometry.of_tree(tree, M, batch))
    return TreeLlama(model, self_draft(model) if draft is None else draft, tree, m_rounds=M, capacity=capacity,
                     batch=batch, **kwargs)


@pytest.fixture(scope="module")
def decoders(small, greedy_batches):
    """(tree name, B) -> a greedy TreeLlama of the small model, made once for the module."""
    made = {}

    def get(name: str, batch: int):
        if (name, batch) not in made:
            made[name, batch] = tree_decoder(small, TREES[name], greedy_batches[batch][2], TOKENS, batch)
        return made[name, batch]
    return get


CASES = [(name, batch, mode) for name in TREES for batch in BUDGETS for mode in MODES]


@pytest.mark.parametrize("name, batch, mode", CASES, ids=[f"{n}-B{b}-{m}" for n, b, m in CASES])
def test_tree_decoding_equals_hugging_face_greedy(decoders, greedy_batches, name, batch, mode):
    spec = decoders(name, batch)
    requests, want, _ = greedy_batches[batch]
    got = generate(spec, requests, mode)
    for row, (mine, theirs) in enumerate(zip(got, want)):
        assert mine == theirs, f"{name}, {mode}, row {row}: first difference at token {first_difference(mine, theirs)}"
    tau = spec.bufs.tokens_per_round([len(row) for row in got])
    assert 1.5 < tau < spec.k + 1, f"{tau:.2f} tokens a round: the tree must accept some drafts and reject others"


@pytest.mark.parametrize("mode", ["graph", "overlap"])
def test_a_decoder_that_skips_rounds_past_the_end_gives_the_same_tokens(small, decoders, greedy_batches, mode,
                                                                       conditionals):
    """A decoder told to skip the draft and verify of its rounds past every row's end
    (skip_done=True: its burst graphs built node by node, torch's work in IF nodes) gives
    Hugging Face's greedy tokens at B = 1 and 8, as this module's decoders, which skip nothing
    (the default), do; and after the batch of 8 (rows done at different rounds, the last ones'
    rounds skipped) every row's KV is a fresh prefill of its tokens. (Its refusals:
    test_torch_stack.py, on the CPU.)"""
    assert decoders("static", 1).rounds.round.gate is None
    for batch in (1, 8):
        requests, want, longest = greedy_batches[batch]
        skipping = tree_decoder(small, TREES["static"], longest, TOKENS, batch, skip_done=True)
        assert skipping.rounds.round.gate is not None
        got = generate(skipping, requests, mode)
        for row, (mine, theirs) in enumerate(zip(got, want)):
            assert mine == theirs, f"B = {batch}, row {row}: first difference at token {first_difference(mine, theirs)}"
        if batch == 8:
            assert_kv_is_a_fresh_prefill(skipping, requests, got)
        del skipping
        gc.collect()


def assert_kv_is_a_fresh_prefill(spec, requests, got) -> None:
    """Each row's entries of both models at every position below its pos_ctr equal a fresh
    prefill of the row's committed tokens by the same model (in logical order, for a paged
    cache); the draft's but the last: the next round's first level would append it
    (TreeLlama.draft_level). fp32 models: an entry of another token differs by far more."""
    batch = len(requests)
    full = [list(r.prompt) + tokens for r, tokens in zip(requests, got)]
    committed = [min(int(n), len(tokens) - 1) for n, tokens in zip(spec.bufs.positions, full)]
    every = torch.arange(batch, device="cuda")
    for stack in (spec.target, spec.draft):
        fresh = Stack(stack.model, stack.kv.capacity, batch=batch)
        fresh.prefill(range(batch), [tokens[:n] for tokens, n in zip(full, committed)])
        folded = 1 if stack is spec.draft else 0
        for layer in range(len(stack.layers)):
            mine = stack.kv.gather(layer, every) if isinstance(stack.kv, PagedKV) else \
                (stack.kv.k[layer], stack.kv.v[layer])
            for row, n in enumerate(n - folded for n in committed):
                for side, theirs in zip(mine, (fresh.kv.k[layer], fresh.kv.v[layer])):
                    torch.testing.assert_close(side[row, :, :n], theirs[row, :, :n], atol=1e-4, rtol=1e-4,
                                               msg=lambda m, row=row, layer=layer: f"layer {layer}, row {row}: {m}")


@pytest.mark.parametrize("name", TREES)
def test_after_a_batch_every_rows_kv_is_a_fresh_prefill_of_its_tokens(decoders, greedy_batches, name):
    """The compaction itself: after a batch (rows done at different rounds, two by EOS), each
    row's entries are a fresh prefill's. An accepted path left at its tree slots, or a rejected
    node's entry, differs by far more than the tolerance; so does, in the static tree, a leaf
    accepted last whose draft entry the next round did not append."""
    spec = decoders(name, 8)
    requests, _, _ = greedy_batches[8]
    assert_kv_is_a_fresh_prefill(spec, requests, generate(spec, requests, "graph"))


@pytest.mark.parametrize("mode", ["graph", "device"])
def test_a_paged_cache_compacted_by_the_models_own_callable(small, greedy_batches, mode):
    """The paged route, TreeRound's compact=: both caches in pages of 16 positions shuffled through
    one pool (PagedKV), the accepted path moved by the model's torch callable, not kernel 15.
    Every row equals Hugging Face's greedy, and its entries are a fresh prefill's."""
    requests, want, longest = greedy_batches[8]
    spec = tree_decoder(small, TREES["dynamic"], longest, TOKENS, 8, paged=16)
    assert isinstance(spec.target.kv, PagedKV) and isinstance(spec.draft.kv, PagedKV)
    got = generate(spec, requests, mode)
    for row, (mine, theirs) in enumerate(zip(got, want)):
        assert mine == theirs, f"paged, {mode}, row {row}: first difference at token {first_difference(mine, theirs)}"
    assert_kv_is_a_fresh_prefill(spec, requests, got)


def test_served_tree_requests_equal_hugging_face_each_alone(small):
    """Continuous batching: 10 requests through 3 slots, each row prefilled anew while the others
    are mid-request; every request's tokens are Hugging Face's for it alone."""
    budgets = [40, 96, 17, 64, 80, 33, 96, 50, 71, 24]
    requests = [Request(p, n) for p, n in zip(prompts(10, seed=11), budgets)]
    spec = tree_decoder(small, TREES["dynamic"], 40, 96, 3)
    served = spec.serve(requests)
    for i, (request, out) in enumerate(zip(requests, served)):
        want = hf_greedy(small, request.prompt, request.max_new_tokens)
        assert out.tokens == want, f"request {i}: first difference at token {first_difference(out.tokens, want)}"


# -- a static tree's children, placed by its draft ----------------------------------------------

PLACED = {"chain8,1": (TreeShape.chain_with_leaves(8, 1), None), "static": (TREES["static"], None),
          "gapped": (TreeShape.from_choices([[0], [2], [0, 1], [2, 3]]), None),
          "topk": (TreeShape.likeliest(16, depth=4, ranks=3), 6)}  # 6 candidates: torch.topk's on both sides
FIELDS = ("tok", "pos", "parent", "depth", "rank", "mask", "score")


@pytest.mark.parametrize("name", PLACED)
def test_a_static_trees_placed_nodes_are_what_the_layers_grows_make(small, monkeypatch, name):
    """After one round of a greedy static tree, whose draft's levels place the children with no
    grow kernel (TreeLlama.draft_places), TreeBufs' tok, pos, parent, depth, rank, mask and score
    are what the layer's grows make of the same round: every node past the root scribbled over,
    then grown a level at a time by kernel 11 from the candidates the grown rounds took
    (best_ranks: argmaxes and an in-place scatter, ties to the lower index) of the draft's logits
    that round, which a stand-in swaps for logits with ties everywhere (after the real forward,
    so the KV is written as ever). Three rows at other positions, compiled as every decoder is;
    a child placed from the wrong rank, parent or row, or a tie broken the other way, differs."""
    from memra_cuda.kernels import TreeKernels
    from test_torch_tree import tied_logits
    tree, candidates = PLACED[name]
    batch, rows = 3, prompts(3, seed=21)
    spec = tree_decoder(small, tree, max(map(len, rows)), 8, batch, candidates=candidates)
    assert spec.draft_places and spec.placement is not None
    forward, seen = spec.draft.logits, []

    def tied(tokens, positions, **kwargs):
        real = forward(tokens, positions, **kwargs)
        logits = tied_logits(*real.shape, seed=len(seen)).to(real.device, real.dtype)
        seen.append(logits.clone())
        return logits
    monkeypatch.setattr(spec.draft, "logits", tied)
    spec.prefill(range(batch), rows)
    spec.rounds.step("readback")
    assert len(seen) == tree.depth, "a draft level a parent level"
    placed, nodes, words = spec.tree_bufs.read(), tree.nodes, spec.tree_bufs.words
    cand_tok = torch.zeros(batch, nodes, spec.candidates, dtype=torch.long, device="cuda")
    for level, (start, stop) in enumerate(tree.expanded[:-1]):
        best_ranks(seen[level].clone(), cand_tok[:, start:stop])
    cand_logp = torch.zeros(batch, nodes, spec.candidates, device="cuda")  # ranks alone, as the grown rounds' were
    torch.cuda.synchronize()
    rng = np.random.default_rng(5)
    for field in FIELDS:  # every node past the root scribbled over (its mask words past node 0's)
        values = placed[field].copy()
        past_root = words if field == "mask" else 1
        values[:, past_root:] = rng.integers(0, 2**32, values[:, past_root:].shape, dtype=np.uint32).view(values.dtype)
        spec.engine.copy_htod(getattr(spec.tree_bufs, f"{field}_d"), values.reshape(-1))
    kernels = TreeKernels(spec.engine)
    for level in range(1, tree.depth + 1):
        kernels.prepare_grow(spec.bufs, spec.tree_bufs, level, cand_tok, cand_logp)()
    grown = spec.tree_bufs.read()
    for field in FIELDS:
        assert np.array_equal(placed[field].view(np.uint32), grown[field].view(np.uint32)), \
            f"{name}: {field} differs at (row, word) {np.argwhere(placed[field] != grown[field])[:8].tolist()}"
    assert placed["tok"][:, 1:].any(), "the tokens placed must not all be 0"


# -- sampling -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TREES)
def test_sampled_tree_tokens_are_the_same_in_every_mode_for_a_seed(peaked, name):
    params = SamplingParams(temperature=1.0, top_k=200, top_p=0.95)
    requests = [Request(p, 48, None, 100 + i) for i, p in enumerate(prompts(3, seed=5))]
    spec = tree_decoder(peaked, TREES[name], 40, 48, 3, sampling=params)
    runs = {mode: generate(spec, requests, mode) for mode in MODES}
    first = runs["graph"]
    for mode, run in runs.items():
        for i, (mine, theirs) in enumerate(zip(run, first)):
            assert mine == theirs, f"{name}, request {i}: {mode} differs from graph at token " \
                                   f"{first_difference(mine, theirs)}"
    assert len({tuple(row) for row in first}) == 3, "different seeds, same tokens"
    reversed_ = generate(spec, requests[::-1], "graph")[::-1]
    assert reversed_ == first, "a request's tokens depend on its slot"


def assert_first_sampled_tree_token_is_the_targets_softmax(peaked, draft_model) -> None:
    """The theorem on the real model: ROWS rows of one prompt, each its own seed, one round of
    a tree of two children at the root (two draws without replacement from `draft_model` at
    temperature 0.5, so its law differs from the target's): the first committed token is
    distributed as the target's softmax after the prompt (chi-square)."""
    gc.collect()  # the decoders earlier tests left in cycles (a RoundStream holds its decoder's methods)
    tree = TreeShape.from_choices([[0], [1]])
    spec = TreeLlama(peaked, draft_model, tree, m_rounds=1, batch=DRAW_BATCH, sampling=SamplingParams(1.0),
                     draft_sampling=SamplingParams(0.5),
                     capacity=capacity_for(len(PROMPT), 1, Geometry(1, 1, DRAW_BATCH, tree.nodes)))
    first, drawn = draws_in_batches(spec, lambda: spec.tree_views.tok[:, 1:3])
    with torch.no_grad():
        logits = peaked(torch.tensor([PROMPT], device="cuda")).logits[0, -1].double()
    law = logits.softmax(-1).cpu().numpy()
    p, q = (probs[0, 0].double().cpu().numpy() for probs in (spec.p_d, spec.q_d))
    assert 0.5 * np.abs(p - q).sum() > 0.1, "the draft's law must differ from the target's"
    assert (drawn[:, 0] != drawn[:, 1]).all(), "two draws without replacement"
    accepted = float(np.mean((first[:, None] == drawn).any(1)))
    assert accepted > np.minimum(p, q).sum() + 0.02, "a second child must accept more than one"
    index = cells(law, ROWS)
    assert_distributed_as(index[first], np.bincount(index, weights=law), "the first sampled tree token")


@pytest.mark.alone
def test_first_sampled_tree_token_is_distributed_as_the_targets_softmax(peaked):
    assert_first_sampled_tree_token_is_the_targets_softmax(peaked, self_draft(peaked))


# -- hybrid -------------------------------------------------------------------------------------

HYBRID_CASES = [(state, batch, mode) for state in ("copy", "flip") for batch in (1, 8)
                for mode in ("graph", "overlap")]


@pytest.mark.parametrize("state, batch, mode", HYBRID_CASES, ids=[f"{s}-B{b}-{m}" for s, b, m in HYBRID_CASES])
def test_hybrid_tree_equals_its_own_plain_greedy(hybrid, state, batch, mode):
    rows = [PROMPT] if batch == 1 else [[1], *prompts(batch - 1, seed=7)]
    requests = [Request(p, n) for p, n in zip(rows, BUDGETS[batch])]
    tree = TREES["dynamic"]
    spec = tree_decoder(hybrid, tree, max(map(len, rows)), TOKENS, batch, state_rollback=state)
    want = GraphedGreedy(hybrid, spec.target.kv.capacity, batch).generate_batch(requests)
    assert spec.target.state.slots.shape[2] == (1 if state == "copy" else 2) * tree.nodes, "a slot a node"
    got = generate(spec, requests, mode)
    for row, (mine, theirs) in enumerate(zip(got, want)):
        assert mine == theirs, f"{state}, {mode}, row {row}: first difference at token {first_difference(mine, theirs)}"
    tau = spec.bufs.tokens_per_round([len(row) for row in got])
    assert 1.5 < tau < spec.k + 1, f"{tau:.2f} tokens a round: states must be kept at nodes deeper than the root"


# -- refusals -----------------------------------------------------------------------------------

def test_a_tree_llama_refuses_what_it_cannot_serve(small, hybrid):
    draft = self_draft(small)
    with pytest.raises(ValueError, match="candidates"):
        TreeLlama(small, draft, TREES["dynamic"], candidates=2, capacity=64)
    with pytest.raises(ValueError, match="attention"):
        TreeLlama(hybrid, self_draft(hybrid, 3), TREES["dynamic"], capacity=64)
    with pytest.raises(TypeError, match="TreeShape or a DynamicTree"):
        TreeLlama(small, draft, [[0], [1]], capacity=64)
    with pytest.raises(TypeError, match="paged cache"):
        PagedKV(small.config, 1, 1, 64, torch.float32).data()
    with pytest.raises(ValueError, match="candidates= is for greedy"):
        TreeLlama(small, draft, TREES["dynamic"], candidates=3, capacity=64, sampling=SamplingParams())
    # a request that fits a chain's k + 1 slots past its position, but not the tree's T + 1, in a
    # cache of one whole block (a decoder's capacity is rounded up to whole blocks of 128)
    tree, prompt, capacity = TREES["dynamic"], PROMPT, 128
    new = next(n for n in range(capacity) if kv_capacity(len(prompt), n, Geometry.of_tree(tree, M)) > capacity)
    assert kv_capacity(len(prompt), new, Geometry(tree.depth, M)) <= capacity
    spec = TreeLlama(small, draft, tree, m_rounds=M, capacity=capacity)
    assert spec.target.kv.capacity == capacity and spec.rounds.rounds_per_step("graph") == M
    (served,) = spec.serve([Request(prompt, new)])
    assert served.refused is not None and "need a KV cache" in served.refused

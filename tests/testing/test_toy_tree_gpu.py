"""The toy's tree rounds on the GPU (ToyLM.tree_round_stream; docs/trees.md, docs/toy-model.md
"Trees"): every row's tokens equal its own target greedy output in every mode, B in {1, 8},
static and dynamic trees of 4, 16 and 64 nodes, rows stopping at different rounds by EOS and by
budget; a second request on the same buffers; a one-branch tree is the chain (tokens, drafts
accepted, positions); after a batch every row's committed KV, the target's and the draft's, is a
fresh prefill of its tokens, and its recurrent states (copy and flip) the recurrence over them;
sampled trees give the same tokens in every mode for a seed, and the target's greedy ones at
temperature 0; rows at mixed draft lengths (0 to the depth, chosen on the device) each give their
own greedy output in every mode; what the toy's trees cannot run is refused."""
from __future__ import annotations

from dataclasses import replace

import pytest

from memra_cuda import Geometry
from memra_cuda import StreamBufs, kv_capacity
from memra_cuda.errors import LoopUnsupported
from memra_cuda.kernels import SpecKernels
from memra_cuda.rounds import MODES
from memra_cuda.buffers import DraftLengths
from memra_cuda.buffers.layout import ACC_TOTAL, ACC_WORDS, BRK_COUNT, BRK_WORDS
from memra_cuda.testing.toy import lm as toy
from memra_cuda.buffers.tree import DynamicTree, TreeShape
from test_toy import HYBRID
from test_toy_state_gpu import assert_greedy
from test_toy_tree import TREES
from toy_requests import requests as toy_requests

pytestmark = pytest.mark.gpu

MODEL = toy.ToyModel(seed=21, vocab=50, kv_mask=(True, False, True), noise_ppm=200_000)
HYBRID_TREE = replace(HYBRID, noise_ppm=200_000, p_min=0.0)
MAX_PROMPT = 30
SAMPLED = {"static": TreeShape.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
           "dynamic": DynamicTree(depth=3, width=4, branch=3)}


@pytest.fixture(scope="module")
def spec(engine):
    return SpecKernels(engine)


def requests(model: toy.ToyModel, batch: int, seed: int, max_budget: int = 80):
    """The shared toy requests (tests/toy_requests.py) of `model`: prompts of 1 to MAX_PROMPT tokens."""
    return toy_requests(model, batch, seed, max_budget, max_prompt=MAX_PROMPT)


class Trees:
    """A ToyLM of `model` with its StreamBufs (k = the tree's depth) and tree RoundStream."""

    def __init__(self, engine, spec, model, tree, batch, m_rounds=4, budget=80, mode="graph", state="copy",
                 sampling=None, lengths=None):
        capacity = kv_capacity(MAX_PROMPT, budget, Geometry.of_tree(tree, m_rounds, batch), overlap=mode == "overlap")
        self.engine, self.model, self.tree, self.capacity = engine, model, tree, capacity
        self.lm = toy.ToyLM(engine, model, capacity, batch=batch, state_rollback=state, sampling=sampling)
        self.bufs = StreamBufs(engine, Geometry.of_tree(tree, m_rounds, batch))
        self.lengths = None if lengths is None else lengths(self.bufs)  # DraftLengths of these buffers
        self.stream = self.lm.tree_round_stream(self.bufs, tree, kernels=spec, lengths=self.lengths)

    def generate(self, prompts, budgets, eos, mode="graph", seeds=None) -> list[list[int]]:
        for b, prompt in enumerate(prompts):
            self.lm.prefill_row(self.bufs, b, prompt, seed=0 if seeds is None else seeds[b])
        return run(self.stream, budgets, eos, mode)

    def positions(self) -> list[int]:
        return self.engine.dtoh(self.bufs.pos_ctr_d).tolist()

    def accepted(self) -> list[int]:
        return self.engine.dtoh(self.bufs.acc_d).reshape(-1, ACC_WORDS)[:, ACC_TOTAL].tolist()


def run(stream, budgets, eos, mode) -> list[list[int]]:
    try:
        got = stream.generate_batch(budgets, eos=eos, mode=mode)
    except LoopUnsupported as exc:  # device mode on a driver without conditional WHILE nodes
        pytest.skip(str(exc))
    return [tokens.tolist() for tokens in got]


def kept_tokens(model, prompt, budget, depth, position) -> list[int]:
    """The tokens at positions [0, position) a row's caches hold: its prompt, then the target's
    greedy tokens (past a stop too: a stop inside the accepted drafts keeps the drafts after it)."""
    return (prompt + toy.target_greedy(model, prompt, budget + depth + 1))[:position]


def assert_caches_are_a_prefill(trees: Trees, prompts, budgets):
    """Every row's target and draft KV at [0, position) equal a fresh prefill of its kept tokens,
    and (with recurrent layers) both models' live states the recurrence over them."""
    model, engine, cap = trees.model, trees.engine, trees.capacity
    batch = len(prompts)
    target = [None if kv is None else engine.dtoh(kv.data_d).reshape(batch, cap) for kv in trees.lm.target.kv]
    draft = engine.dtoh(trees.lm.draft.kv[0].data_d).reshape(batch, cap)
    live = trees.lm.live_states() if model.rec_layers else None
    for b, (prompt, budget, pos) in enumerate(zip(prompts, budgets, trees.positions())):
        kept = kept_tokens(model, prompt, budget, trees.tree.depth, pos)
        entries = [model.embed(t, j) for j, t in enumerate(kept)]
        assert draft[b, :pos].tolist() == entries, f"row {b}: draft KV"
        for layer, data in enumerate(target):
            if data is not None:
                want = [toy.fmix(e ^ toy.salt(layer)) for e in entries]
                assert data[b, :pos].tolist() == want, f"row {b}: target layer {layer} KV"
        if live is not None:
            want = model.rec_states(kept).tolist()
            assert live[0][b].tolist() == want and live[1][b].tolist() == want, f"row {b}: live states"


@pytest.mark.parametrize("tree", TREES.values(), ids=TREES.keys())
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("mode", MODES)
def test_every_row_equals_its_own_greedy_output(engine, spec, mode, batch, tree):
    prompts, budgets, eos = requests(MODEL, batch, seed=10 * batch + tree.nodes)
    trees = Trees(engine, spec, MODEL, tree, batch, mode=mode)
    assert_greedy(MODEL, trees.generate(prompts, budgets, eos, mode), prompts, budgets, eos, f"{mode}, B={batch}")


@pytest.mark.parametrize("costs", ["flat", "dear"])
@pytest.mark.parametrize("tree", ["static16", "dynamic64"])
@pytest.mark.parametrize("mode", MODES)
def test_rows_at_mixed_lengths_each_give_their_own_greedy_output(engine, spec, mode, tree, costs):
    """Ten rows of a tree round, their caps 0 to the depth in turn (TreeRound's lengths=): every
    row's tokens are its own greedy output; a row at 0 had every round capped and kept no draft,
    and no row kept more drafts a round than its cap. At flat costs each row runs at its cap; at
    dear ones (a draft dearer than it can pay) the width falls to 0 and every row decodes plainly."""
    shape, batch = TREES[tree], 10
    depth = shape.depth
    caps = [b % (depth + 1) for b in range(batch)]
    verify = [1.0] * (depth + 1) if costs == "flat" else [1.0 + 1.5 * w for w in range(depth + 1)]

    def lengths(bufs):
        chosen = DraftLengths(bufs, verify, 0.0 if costs == "flat" else 0.5)
        chosen.set_caps(caps)
        return chosen
    prompts, budgets, eos = requests(MODEL, batch, seed=77 + depth)
    trees = Trees(engine, spec, MODEL, shape, batch, mode=mode, lengths=lengths)
    got = trees.generate(prompts, budgets, eos, mode)
    assert_greedy(MODEL, got, prompts, budgets, eos, f"{mode}, {tree}, caps {caps}, {costs} costs")
    capped = trees.engine.dtoh(trees.bufs.brk_d).reshape(batch, BRK_WORDS)[:, BRK_COUNT]
    for b in range(batch):
        if caps[b] == 0 or costs == "dear":  # a round a token, each capped, no draft kept
            assert capped[b] == len(got[b]) and trees.bufs.accepted[b] == 0, f"row {b} at length 0 ({costs})"
    rounds = trees.bufs.rounds_run([len(tokens) for tokens in got])
    assert all(trees.bufs.accepted[b] <= caps[b] * rounds[b] for b in range(batch)), "a row kept more than its cap"
    if costs == "flat":
        assert any(trees.bufs.accepted[b] > rounds[b] for b in range(batch) if caps[b] >= 2), \
            "rows of cap 2 or more should keep more than a draft a round somewhere (else this test proves little)"


@pytest.mark.parametrize("tree", ["static16", "dynamic64"])
def test_a_second_request_on_the_same_buffers(engine, spec, tree):
    """prefill_row (bufs.reset_row) and generate again, on the same buffers and captured graphs."""
    trees = Trees(engine, spec, MODEL, TREES[tree], 8)
    for request in range(2):
        prompts, budgets, eos = requests(MODEL, 8, seed=500 + request)
        assert_greedy(MODEL, trees.generate(prompts, budgets, eos), prompts, budgets, eos, f"request {request}")
        assert_caches_are_a_prefill(trees, prompts, budgets)
    trees.bufs.reset(MODEL.vocab - 1, 0)  # a batch of one prompt token each, through bufs.reset's path
    prompts = [[MODEL.vocab - 1]] * 8
    for b in range(8):
        trees.lm.prefill_row(trees.bufs, b, prompts[b])
    assert_greedy(MODEL, run(trees.stream, 30, None, "graph"), prompts, [30] * 8, [None] * 8, "after reset")


@pytest.mark.parametrize("state", toy.STATE_ROLLBACKS)
@pytest.mark.parametrize("model", [MODEL, HYBRID_TREE], ids=["plain", "hybrid"])
@pytest.mark.parametrize("mode", MODES)
def test_a_one_branch_tree_is_the_chain(engine, spec, mode, model, state):
    """TreeShape.chain(4) against ToyLM.round_stream at k = 4 (p_min 0: a tree never breaks): the
    same tokens, drafts accepted (acc_d totals) and positions for every row."""
    if state == "flip" and not model.rec_layers:
        pytest.skip("no recurrent layers to flip")
    k, batch = 4, 8
    prompts, budgets, eos = requests(model, batch, seed=77)
    capacity = kv_capacity(MAX_PROMPT, 80, Geometry(k, 4, batch), overlap=mode == "overlap")
    chain_lm = toy.ToyLM(engine, model, capacity, batch=batch, state_rollback=state)
    chain_bufs = StreamBufs(engine, Geometry(k, 4, batch))
    chain = chain_lm.round_stream(chain_bufs, kernels=spec)
    for b, prompt in enumerate(prompts):
        chain_lm.prefill_row(chain_bufs, b, prompt)
    want = run(chain, budgets, eos, mode)
    trees = Trees(engine, spec, model, TreeShape.chain(k), batch, mode=mode, state=state)
    got = trees.generate(prompts, budgets, eos, mode)
    assert got == want
    assert_greedy(model, got, prompts, budgets, eos, f"{mode}, {state}")
    assert trees.accepted() == engine.dtoh(chain_bufs.acc_d).reshape(-1, ACC_WORDS)[:, ACC_TOTAL].tolist()
    assert trees.positions() == engine.dtoh(chain_bufs.pos_ctr_d).tolist()
    if mode in ("readback", "graph"):
        assert trees.stream.rounds == chain.rounds


@pytest.mark.parametrize("tree", ["static4", "dynamic16", "static64", "dynamic64"])
def test_caches_after_a_batch_are_a_fresh_prefill(engine, spec, tree):
    """The compaction moved every accepted path's entries to consecutive slots, in the target's
    layers and the draft's: each row's KV [0, position) is a prefill of its kept tokens."""
    prompts, budgets, eos = requests(MODEL, 8, seed=31)
    trees = Trees(engine, spec, MODEL, TREES[tree], 8)
    assert_greedy(MODEL, trees.generate(prompts, budgets, eos), prompts, budgets, eos, tree)
    assert_caches_are_a_prefill(trees, prompts, budgets)


@pytest.mark.parametrize("state", toy.STATE_ROLLBACKS)
@pytest.mark.parametrize("tree", ["static16", "dynamic16", "dynamic64"])
@pytest.mark.parametrize("mode", ["readback", "graph", "device"])
def test_hybrid_trees_roll_their_states_back(engine, spec, mode, tree, state):
    """Recurrent layers with a slot a node (T + 1 a bank), rolled back by copy (kernel 16) or flip
    (kernel 17) to the accepted path's last node: the target's tokens, and both models' live
    states the recurrence over exactly the kept tokens; a second request starts from its own."""
    trees = Trees(engine, spec, HYBRID_TREE, TREES[tree], 8, mode=mode, state=state)
    for request in range(2):
        prompts, budgets, eos = requests(HYBRID_TREE, 8, seed=40 + request)
        got = trees.generate(prompts, budgets, eos, mode)
        assert_greedy(HYBRID_TREE, got, prompts, budgets, eos, f"{mode}, {state}, request {request}")
        assert_caches_are_a_prefill(trees, prompts, budgets)


def test_a_bushy_tree_accepts_more_than_the_chain(engine, spec):
    """The same requests: more drafts accepted with a 64-node dynamic tree than with the chain of
    its depth, on a noisy draft."""
    prompts, budgets, eos = requests(MODEL, 8, seed=5)
    tree = TREES["dynamic64"]
    bushy = Trees(engine, spec, MODEL, tree, 8)
    chain = Trees(engine, spec, MODEL, TreeShape.chain(tree.depth), 8)
    assert bushy.generate(prompts, budgets, eos) == chain.generate(prompts, budgets, eos)
    assert sum(bushy.accepted()) > sum(chain.accepted())
    assert bushy.stream.rounds < chain.stream.rounds


@pytest.mark.parametrize("model", [MODEL, HYBRID_TREE], ids=["plain", "hybrid"])
@pytest.mark.parametrize("tree", SAMPLED.values(), ids=SAMPLED.keys())
def test_sampled_trees_give_the_same_tokens_in_every_mode(engine, spec, tree, model):
    """Sampling mode (the draft's q rows per level, the layer's draws, kernel 14): for the same
    seeds, every mode commits the same tokens, with budgets and EOS as the rows ask."""
    sampling = toy.ToySampling(temperature=0.8, floor=0.1, draft_temperature=1.3, draft_floor=0.2)
    prompts, budgets, _ = requests(model, 8, seed=9, max_budget=60)
    seeds = [1000 + b for b in range(8)]
    first = None
    for mode in MODES:
        trees = Trees(engine, spec, model, tree, 8, budget=60, mode=mode, sampling=sampling)
        got = trees.generate(prompts, budgets, [None] * 8, mode, seeds=seeds)
        assert [len(tokens) for tokens in got] == budgets, mode
        first = first or got
        assert got == first, f"{mode} differs from {MODES[0]}"
    eos = [tokens[len(tokens) // 2] if tokens and b % 2 else None for b, tokens in enumerate(first)]
    trees = Trees(engine, spec, model, tree, 8, budget=60, sampling=sampling)
    got = trees.generate(prompts, budgets, eos, seeds=seeds)
    for b, (tokens, stop) in enumerate(zip(first, eos)):
        want = tokens if stop is None else tokens[:tokens.index(stop) + 1]
        assert got[b] == want, f"row {b}, eos {stop}"


@pytest.mark.parametrize("tree", SAMPLED.values(), ids=SAMPLED.keys())
def test_sampled_trees_at_temperature_zero_are_greedy(engine, spec, tree):
    """A target of temperature 0 and floor 0 puts all its mass on its greedy token: the sampled
    tree commits the target's greedy output (with recurrent layers, by copy and by flip)."""
    sampling = toy.ToySampling(temperature=0.0, floor=0.0, draft_temperature=1.5, draft_floor=0.2)
    for model, state in [(MODEL, "copy"), (HYBRID_TREE, "copy"), (HYBRID_TREE, "flip")]:
        prompts, budgets, eos = requests(model, 8, seed=13)
        trees = Trees(engine, spec, model, tree, 8, state=state, sampling=sampling)
        got = trees.generate(prompts, budgets, eos, seeds=list(range(8)))
        assert_greedy(model, got, prompts, budgets, eos, f"sampled, {state}")


def test_what_the_toys_trees_cannot_run_is_refused(engine, spec):
    tree = TREES["static16"]
    lm = toy.ToyLM(engine, MODEL, 256)
    with pytest.raises(ValueError, match="k = "):
        lm.tree_round_stream(StreamBufs(engine, Geometry(tree.depth + 1, 2)), tree, kernels=spec)
    with pytest.raises(ValueError, match="candidates"):
        gapped = TreeShape.from_choices([[0], [5]])
        lm.tree_round_stream(StreamBufs(engine, Geometry.of_tree(gapped, 2)), gapped, candidates=4,
                             kernels=spec)
    with pytest.raises(ValueError, match="pipeline stage"):
        toy.ToyLM(engine, MODEL, 256, layers=range(0, 2)).tree_round_stream(
            StreamBufs(engine, Geometry.of_tree(tree, 2)), tree)
    hybrid = toy.ToyLM(engine, HYBRID_TREE, 256)
    hybrid.round_stream(StreamBufs(engine, Geometry(tree.depth, 2)), kernels=spec)  # states laid out for the chain
    with pytest.raises(ValueError, match="a chain's round verifies k \\+ 1 = 3 tokens a row"):
        hybrid.round_stream(StreamBufs(engine, Geometry.of_tree(tree, 2)), kernels=spec)  # a tree's geometry
    with pytest.raises(ValueError, match="slots"):
        hybrid.tree_round_stream(StreamBufs(engine, Geometry.of_tree(tree, 2)), tree, kernels=spec)

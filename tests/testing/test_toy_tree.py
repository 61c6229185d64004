"""The toy's tree round in numpy (docs/toy-model.md, "Trees"; docs/trees.md): the draft's
candidates, and NumpyTreeRoundStream (the toy's tree draft and verify around the layer's tree
kernels in memra_cuda.testing.reference_tree). A one-branch tree is exactly the chain, round for round;
static and dynamic bushy trees reproduce the target's greedy output whatever the model
(recurrent layers rolled back by copy or by flip), prompt, noise, budget and EOS; and a bushy
tree accepts more per round than the chain of its depth on a noisy draft."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memra_cuda import Geometry
from memra_cuda.buffers.capacity import kv_capacity
from memra_cuda.buffers.layout import ACC_TOTAL
from memra_cuda.testing.toy import lm as toy, numpy_loop
from memra_cuda.buffers.tree import DynamicTree, TreeShape
from test_toy import HYBRID, PROMPTS

PLAIN = toy.ToyModel(seed=21, vocab=50, kv_mask=(True, False, True), noise_ppm=150_000)
MODELS = {"plain": PLAIN, "hybrid": replace(HYBRID, p_min=0.0)}


def bushy(nodes: int, fan: tuple[int, ...] = (4, 3, 2, 2, 2, 1, 1, 1)) -> TreeShape:
    """A static tree of `nodes` nodes: the first nodes - 1 paths in level order of a tree whose
    depth-d nodes have fan[d] children (every prefix of a path comes before it)."""
    paths, frontier = [], [()]
    for f in fan:
        frontier = [path + (r,) for path in frontier for r in range(f)]
        paths += frontier
    return TreeShape.from_choices([list(path) for path in paths[:nodes - 1]])


TREES = {
    "static4": TreeShape.from_choices([[0], [1], [0, 0]]),
    "dynamic4": DynamicTree(depth=3, width=1, branch=2),
    "static16": bushy(16),
    "dynamic16": DynamicTree(depth=5, width=3, branch=3),
    "static64": bushy(64),
    "dynamic64": DynamicTree(depth=7, width=9, branch=4),
}


def tree_stream(model, tree, m_rounds=4, prompt_len=12, budget=80, state="copy", candidates=8):
    capacity = kv_capacity(prompt_len, budget, Geometry.of_tree(tree, m_rounds))
    return numpy_loop.NumpyTreeRoundStream(model, tree, m_rounds, capacity, candidates, state)


def per_round(stream) -> float:
    return sum(stream.accepted) / len(stream.accepted)


# -- the draft's candidates --------------------------------------------------------------------

def test_candidates_put_the_targets_token_first_or_at_rank_rho():
    """Rank 0 is the chain's draft (the target's token pred, or pred + 1 at a noisy position);
    at a noisy position pred sits at rank 1..tree_spread; the other ranks are decoys, never pred;
    log-probabilities fall from 0 by a node's gap in [0.5, 2.5) a rank."""
    for spread in (1, 3, 5):
        model = replace(PLAIN, noise_ppm=400_000, tree_spread=spread)
        seen = set()
        for pos in range(200):
            total = toy.fmix(pos * 7 + 3)
            pred = toy.fmix(model.seed ^ total) % model.vocab
            tokens, logp = model.tree_candidates(total, pos, 8)
            assert tokens.dtype == np.uint32 and logp.dtype == np.float32
            noisy = model.draft_noisy(pos)
            assert int(tokens[0]) == ((pred + 1) % model.vocab if noisy else pred)
            ranks = [j for j in range(8) if tokens[j] == pred]
            if noisy:
                rho = 1 + toy.fmix(total ^ 0x1B873593) % spread
                assert ranks == [rho] and 1 <= rho <= spread
                seen.add(rho)
            else:
                assert ranks == [0]
            gap = logp[0] - logp[1]
            assert logp[0] == 0 and 0.5 <= gap < 2.5 and (np.diff(logp) < 0).all()
            assert logp.tolist() == [float(np.float32(-float(j * round(float(gap) * 1000))) / np.float32(1000))
                                     for j in range(8)]
        assert seen == set(range(1, spread + 1))
    tokens, _ = replace(PLAIN, noise_ppm=1_000_000, tree_spread=5).tree_candidates(12345, 3, 2)
    assert len(tokens) == 2  # rho past K: the target's token is not among the candidates at all


def test_tree_spread_is_checked():
    with pytest.raises(ValueError, match="tree_spread"):
        toy.ToyModel(tree_spread=0)


# -- the tree round ----------------------------------------------------------------------------

@pytest.mark.parametrize("state", toy.STATE_ROLLBACKS)
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("noise_ppm", [0, 150_000, 1_000_000])
@pytest.mark.parametrize("name", MODELS)
def test_a_one_branch_tree_is_the_chain(name, noise_ppm, k, state):
    """TreeShape.chain(k) round for round as NumpyRoundStream (p_min 0: a tree never breaks):
    the same tokens, rounds, accepted drafts, position, committed KV of target and draft, and
    live states."""
    model = replace(MODELS[name], noise_ppm=noise_ppm)
    for prompt in PROMPTS:
        full = toy.target_greedy(model, prompt, 60)
        for eos in (None, full[len(full) // 2]):
            capacity = kv_capacity(len(prompt), 60, Geometry(k, 3))
            chain = numpy_loop.NumpyRoundStream(model, k, 3, capacity, state)
            tree = numpy_loop.NumpyTreeRoundStream(model, TreeShape.chain(k), 3, capacity, 8, state)
            want = chain.generate(prompt, 60, eos)
            assert tree.generate(prompt, 60, eos) == want == toy.target_greedy(model, prompt, 60, eos)
            assert (tree.rounds, int(tree.acc[ACC_TOTAL]), int(tree.pos_ctr[0])) == \
                   (chain.rounds, int(chain.acc[ACC_TOTAL]), int(chain.pos_ctr[0]))
            pos = int(chain.pos_ctr[0])
            assert (tree.draft_kv[:pos] == chain.draft_kv[:pos]).all()
            for mine, theirs in zip(tree.tgt, chain.tgt):
                assert mine is None or (mine[:pos] == theirs[:pos]).all()
            assert (tree.tgt_states.live() == chain.tgt_states.live()).all()
            assert (tree.draft_states.live() == chain.draft_states.live()).all()


@pytest.mark.parametrize("state", toy.STATE_ROLLBACKS)
@pytest.mark.parametrize("tree", TREES.values(), ids=TREES.keys())
def test_bushy_trees_equal_target_greedy(tree, state):
    """Static and dynamic trees of 4, 16 and 64 nodes, two models (one hybrid), three noise
    levels, three prompts, EOS stops and budgets 0 to 80: the target's own greedy tokens, the
    committed KV (target's and draft's) that of a prefill of them, the live states theirs."""
    for name, model in MODELS.items():
        for noise_ppm in (0, 200_000, 1_000_000):
            model = replace(model, noise_ppm=noise_ppm)
            for prompt, budget in zip(PROMPTS, (0, 37, 80)):
                full = toy.target_greedy(model, prompt, budget)
                for eos in (None, full[len(full) // 2] if full else 0):
                    stream = tree_stream(model, tree, 3, len(prompt), budget, state)
                    got = stream.generate(prompt, budget, eos)
                    where = f"{name}, noise {noise_ppm}, prompt {prompt}, budget {budget}, eos {eos}"
                    assert got == toy.target_greedy(model, prompt, budget, eos), where
                    pos = int(stream.pos_ctr[0])
                    kept = (prompt + toy.target_greedy(model, prompt, budget + tree.depth + 1))[:pos]
                    fresh = numpy_loop.NumpyRoundStream(model, tree.depth, 3, stream.capacity)
                    fresh.prefill(kept + [0])
                    assert (stream.draft_kv[:pos] == fresh.draft_kv[:pos]).all(), where
                    for mine, theirs in zip(stream.tgt, fresh.tgt):
                        assert mine is None or (mine[:pos] == theirs[:pos]).all(), where
                    want = model.rec_states(kept)
                    assert (stream.tgt_states.live() == want).all(), where
                    assert (stream.draft_states.live() == want).all(), where


def test_a_tree_stream_refuses_a_cache_that_holds_a_chains_bursts_but_not_its_t_plus_1_slots():
    tree, prompt, budget = TREES["static16"], PROMPTS[1], 40
    chains = kv_capacity(len(prompt), budget, Geometry(tree.depth, 3))
    assert chains < kv_capacity(len(prompt), budget, Geometry.of_tree(tree, 3))
    with pytest.raises(ValueError, match="cache too small for the next burst"):
        numpy_loop.NumpyTreeRoundStream(PLAIN, tree, 3, chains).generate(prompt, budget)
    assert len(tree_stream(PLAIN, tree, 3, len(prompt), budget).generate(prompt, budget)) == budget


def test_a_tree_stream_runs_its_trees_own_geometry():
    """NumpyTreeRoundStream built Geometry.of_tree(tree, M) only to check the tree, threw it away
    and built another of the tree's depth and nodes; it keeps the tree's own now, its rounds'
    shape (k the depth, width the T + 1 nodes), and its room checks each burst by that very one.
    A chain's stream keeps its own alike."""
    for tree in TREES.values():
        stream = tree_stream(PLAIN, tree, m_rounds=3)
        assert stream.geometry == Geometry.of_tree(tree, 3) and stream.room.geometry is stream.geometry
        assert (stream.k, stream.m, stream.T1) == (tree.depth, 3, tree.nodes)
    chain = numpy_loop.NumpyRoundStream(PLAIN, 4, 2, 64)
    assert chain.geometry == Geometry(4, 2) and chain.room.geometry is chain.geometry


@pytest.mark.parametrize("tree", ["static16", "dynamic16", "static64", "dynamic64"])
def test_a_bushy_tree_accepts_more_a_round_than_the_chain(tree):
    """On a noisy draft the chain stops at the first noisy position; a bushy tree holds the
    target's token at a lower rank there, so it goes on: more drafts accepted per round than
    the chain of the same depth, and fewer rounds for the same tokens."""
    tree = TREES[tree]
    for name, model in MODELS.items():
        model = replace(model, noise_ppm=300_000)
        for prompt in PROMPTS:
            capacity = kv_capacity(len(prompt), 120, Geometry.of_tree(tree, 4))
            chain = numpy_loop.NumpyTreeRoundStream(model, TreeShape.chain(tree.depth), 4, capacity)
            bushy_ = numpy_loop.NumpyTreeRoundStream(model, tree, 4, capacity)
            assert bushy_.generate(prompt, 120) == chain.generate(prompt, 120)
            assert per_round(bushy_) > per_round(chain), f"{name}, prompt {prompt}"
            assert len(bushy_.accepted) < len(chain.accepted)


def test_the_second_best_path_accepts_everything_where_every_draft_is_wrong():
    """noise 1e6 and tree_spread 1: the draft's best guess is always wrong and its second always
    right, so the chain accepts nothing and the tree of second-best paths accepts D a round."""
    model = replace(PLAIN, noise_ppm=1_000_000, tree_spread=1)
    second = TreeShape.from_choices([[1], [0], [1, 1], [1, 1, 1], [1, 1, 1, 1]])
    for prompt in PROMPTS:
        chain = tree_stream(model, TreeShape.chain(4), prompt_len=len(prompt))
        tree = tree_stream(model, second, prompt_len=len(prompt))
        assert tree.generate(prompt, 80) == chain.generate(prompt, 80) == toy.target_greedy(model, prompt, 80)
        assert set(chain.accepted) == {0} and set(tree.accepted[:-1]) == {4}


def test_too_few_candidates_loses_the_targets_token():
    """With K = 2 and tree_spread 3, rho >= K hides the target's token at some noisy nodes: still
    the target's tokens, with fewer drafts accepted than with K = 4."""
    model = replace(PLAIN, noise_ppm=400_000, tree_spread=3)
    tree = DynamicTree(depth=4, width=4, branch=2)
    few = tree_stream(model, tree, candidates=2)
    many = tree_stream(model, DynamicTree(depth=4, width=4, branch=4), candidates=4)
    prompt = PROMPTS[1]
    assert few.generate(prompt, 80) == many.generate(prompt, 80) == toy.target_greedy(model, prompt, 80)
    assert per_round(few) < per_round(many)


def test_tree_speculative_generate():
    model = replace(MODELS["hybrid"], noise_ppm=250_000)
    for state in toy.STATE_ROLLBACKS:
        for tree in (TREES["static16"], TREES["dynamic16"]):
            got = numpy_loop.tree_speculative_generate(model, PROMPTS[2], tree, 50, m_rounds=2,
                                                          state_rollback=state)
            assert got == toy.target_greedy(model, PROMPTS[2], 50)


def random_trees(draw) -> TreeShape | DynamicTree:
    if draw(st.booleans()):
        return DynamicTree(draw(st.integers(1, 6)), draw(st.integers(1, 6)), draw(st.integers(1, 4)))
    n = draw(st.integers(2, 24))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    return TreeShape.from_parents(parents)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**32 - 1), vocab=st.sampled_from([2, 3, 17, 32000]),
       noise_ppm=st.sampled_from([0, 100_000, 500_000, 1_000_000]), spread=st.integers(1, 4),
       hybrid=st.booleans(), m_rounds=st.integers(1, 4), max_new=st.integers(0, 50),
       state=st.sampled_from(toy.STATE_ROLLBACKS))
def test_any_tree_equals_target_greedy(data, seed, vocab, noise_ppm, spread, hybrid, m_rounds, max_new, state):
    tree = random_trees(data.draw)
    base = MODELS["hybrid" if hybrid else "plain"]
    model = replace(base, seed=seed, vocab=vocab, noise_ppm=noise_ppm, tree_spread=spread)
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12), label="prompt")
    want = toy.target_greedy(model, prompt, max_new)
    eos = data.draw(st.one_of(st.none(), st.sampled_from(want or [0])), label="eos")
    got = numpy_loop.tree_speculative_generate(model, prompt, tree, max_new, eos, m_rounds, max(4, tree.draws),
                                                  state)
    assert got == toy.target_greedy(model, prompt, max_new, eos)


def test_the_tree_oracles_candidates_a_node_are_a_size_of_the_toys_draft():
    """NumpyTreeRoundStream took int(candidates): 2.7 as 2, True as 1, "8" as 8, and 0 met an
    AssertionError inside the grow reference; ToyLM.tree_round, the same knob on the GPU, refused
    only the range. One check for both now, naming it."""
    tree, model = TreeShape.from_choices([[0], [1], [0, 0]]), toy.ToyModel()
    assert numpy_loop.NumpyTreeRoundStream(model, tree, 2, 256, candidates=np.uint8(4)).K == 4
    for bad, error in ((0, ValueError), (toy.MAX_CANDIDATES + 1, ValueError), (2.7, TypeError), (True, TypeError),
                       ("8", TypeError)):
        with pytest.raises(error, match="the toy's tree draft's candidates a node must be"):
            numpy_loop.NumpyTreeRoundStream(model, tree, 2, 256, candidates=bad)

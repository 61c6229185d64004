"""TreeRound refuses what it cannot serve before anything is queued (docs/trees.md, "What is
refused"), and a void child is never accepted, even where its token is the target's."""
from __future__ import annotations

import numpy as np
import pytest

from memra_cuda import Geometry
from memra_cuda import (Candidates, Greedy, RoundStream, Sampling, StateLayer, StreamBufs, TreeBufs, TreeRound,
                        TreeShape, kv_data_table, kv_len_ptr_table, state_copy_table)
from memra_cuda.buffers import KVData
from memra_cuda.errors import CapacityError
from memra_cuda.kernels import SpecKernels, TreeKernels
from memra_cuda.buffers.layout import ACC_ROUND, ACC_WORDS
from memra_cuda.testing.toy import lm as toy
from memra_cuda.buffers.tables import Cache
from memra_cuda.kernels.tree import SampledCandidates

pytestmark = pytest.mark.gpu

TREE = TreeShape.from_choices([[0], [1], [0, 0], [1, 0]])  # 5 nodes, depth 2
GAPPED = TreeShape.from_choices([[0], [2], [0, 0]])
B, V, K = 2, 11, 3


@pytest.fixture(scope="module")
def spec(engine):
    return SpecKernels(engine)


class Model:
    """Buffers of a model that does nothing: enough for TreeRound to check and prepare."""

    def __init__(self, engine, tree=TREE, k=None):
        self.engine = engine
        self.bufs = StreamBufs(engine, Geometry.of_tree(tree, 2, B) if k is None else Geometry(k, 2, B))
        self.cache = Cache.allocate(engine, [True], 64, batch=B)
        self.table = kv_len_ptr_table(engine, self.cache, pos_ctr=self.bufs.pos_ctr_d)
        self.kv = kv_data_table(engine, [KVData.from_layer(self.cache.kv[0])])
        n = tree.nodes
        self.pred_d = engine.zeros(np.uint32, B * n)
        self.cand = Candidates(engine.zeros(np.uint32, B * n * K), engine.alloc(np.float32, B * n * K, zeroed=True))
        self.p_d, self.q_d = (engine.alloc(np.float32, B * n * V, zeroed=True) for _ in range(2))
        self.seed_d = engine.zeros(np.uint64, B)

    def round(self, tree=TREE, spec=None, **change):
        nodes = change.pop("tree_bufs", None) or TreeBufs(self.bufs, tree)
        args = dict(draft_levels=[lambda: None] * (tree.depth + 1), verify_tree=lambda: None,
                    acceptance=Greedy(self.pred_d), candidates=self.cand, rollback_tables=[self.table],
                    kv_data=self.kv)
        args.update(change)
        return TreeRound(self.bufs, nodes, spec, **args)


def test_a_valid_round_prepares(engine, spec):
    model = Model(engine)
    assert isinstance(RoundStream.of(model.round(spec=spec)), RoundStream)
    sampled = model.round(spec=spec, acceptance=Sampling(model.p_d, model.q_d, model.seed_d, V), candidates=None)
    assert sampled.capacity.geometry.width == TREE.nodes


@pytest.mark.parametrize("change,error,match", [
    (dict(draft_levels=[lambda: None] * 2), ValueError, "draft levels"),
    (dict(candidates=None), TypeError, "candidates"),
    (dict(kv_data=None), ValueError, "compact"),
    (dict(acceptance="greedy"), TypeError, "acceptance"),
    (dict(rollback_tables=[]), ValueError, "rollback"),
    (dict(verify_tree="verify"), TypeError, "verify_tree"),
    (dict(compact=42), TypeError, "compact"),
])
def test_a_round_missing_what_it_needs_is_refused(engine, spec, change, error, match):
    with pytest.raises(error, match=match):
        Model(engine).round(spec=spec, **change)


def test_the_compacted_caches_bound_the_rounds_too(engine, spec):
    """A KV data layer smaller than the caches the rollback table names bounds every burst: its
    moves past its capacity would be skipped, leaving stale entries."""
    model = Model(engine)
    assert model.round(spec=spec).capacity.entries == 64
    small = Cache.allocate(engine, [True], 40, batch=B)
    kv = kv_data_table(engine, [KVData.from_layer(model.cache.kv[0]), KVData.from_layer(small.kv[0])])
    assert model.round(spec=spec, kv_data=kv).capacity.entries == 40


def test_the_draw_refuses_candidates_of_another_tree(engine):
    model = Model(engine)
    nodes, kernels = TreeBufs(model.bufs, TREE), TreeKernels(engine)
    for wrong in (SampledCandidates(engine, B, TREE.nodes + 1, TREE.draws),
                  SampledCandidates(engine, B, TREE.nodes, TREE.draws - 1), "candidates"):
        with pytest.raises(ValueError, match="SampledCandidates"):
            kernels.prepare_draw(model.bufs, nodes, 1, model.q_d, model.seed_d, V, wrong)
    gapped = StreamBufs(engine, Geometry.of_tree(GAPPED, 2, B))
    with pytest.raises(ValueError, match="without gaps"):
        kernels.prepare_draw(gapped, TreeBufs(gapped, GAPPED), 1, model.q_d, model.seed_d, V, None)


def test_buffers_that_do_not_fit_the_tree_are_refused(engine, spec):
    model = Model(engine)
    with pytest.raises(ValueError, match="pred_d"):  # [B][k+1], a chain's: not a prediction per node
        model.round(spec=spec, acceptance=Greedy(engine.zeros(np.uint32, B * (TREE.depth + 1))))
    with pytest.raises(ValueError, match="tok_d"):
        model.round(spec=spec, candidates=Candidates(engine.zeros(np.uint32, B * TREE.nodes * (K + 1)),
                                                     model.cand.logp_d))
    with pytest.raises(ValueError, match="rank"):  # the tree asks for the second candidate; K = 1 has one
        model.round(spec=spec, candidates=Candidates(engine.zeros(np.uint32, B * TREE.nodes),
                                                     engine.alloc(np.float32, B * TREE.nodes)))
    with pytest.raises(ValueError, match="q_d"):
        model.round(spec=spec, acceptance=Sampling(model.p_d, engine.alloc(np.float32, B * 3 * V), model.seed_d, V),
                    candidates=None)
    with pytest.raises(ValueError, match="k = "):  # a tree of depth 2 on buffers of k = 3
        TreeBufs(StreamBufs(engine, Geometry(TREE.depth + 1, 2, B)), TREE)
    chain_state = StateLayer(engine.zeros(np.uint32, B), engine.zeros(np.uint32, B * (TREE.depth + 1)), 1,
                             TREE.depth)
    with pytest.raises(ValueError, match="slot for each"):
        model.round(spec=spec, state_tables=[state_copy_table(engine, [chain_state])])


def test_a_sampled_tree_with_rank_gaps_is_refused(engine, spec):
    model = Model(engine, GAPPED)
    with pytest.raises(ValueError, match="without gaps"):
        model.round(GAPPED, spec=spec, acceptance=Sampling(model.p_d, model.q_d, model.seed_d, V), candidates=None)


def test_a_cache_without_room_for_the_trees_slots_is_refused_before_anything_is_queued(engine, spec):
    """A burst of R rounds from position P writes up to P + (R - 1)(D + 1) + T + 1: at that
    capacity it runs, one entry short it is refused and nothing is queued (a chain of the tree's
    depth would need only P + R(D + 1))."""
    tree = TreeShape.from_choices([[r] for r in range(6)] + [[0, 0]])  # T + 1 = 8, depth 2
    model = toy.ToyModel(seed=3, vocab=50, kv_mask=(True,))
    m_rounds, prompt, budget = 2, [1, 2, 3], 2
    limit = len(prompt) - 1 + (m_rounds - 1) * (tree.depth + 1) + tree.nodes
    for capacity in (limit, limit - 1):
        lm = toy.ToyLM(engine, model, capacity)
        bufs = StreamBufs(engine, Geometry.of_tree(tree, m_rounds))
        stream = lm.tree_round_stream(bufs, tree, kernels=spec)
        lm.prefill(bufs, prompt)
        if capacity == limit:
            assert stream.generate(budget).tolist() == toy.target_greedy(model, prompt, budget)
        else:
            with pytest.raises(CapacityError, match="cannot take"):
                stream.generate(budget)
            assert stream.rounds == 0


def test_a_void_child_is_never_accepted(engine):
    """The root's second child is void (its candidate's log-probability -inf, so its token is 0);
    the target predicts 0 there: greedy accept still takes nothing, and the bonus is that 0."""
    bufs = StreamBufs(engine, Geometry.of_tree(TREE, 1, 1))
    nodes, kernels = TreeBufs(bufs, TREE), TreeKernels(engine)
    tok = np.zeros((TREE.nodes, K), np.uint32)
    tok[0] = [5, 7, 9]
    logp = np.full((TREE.nodes, K), -np.inf, np.float32)
    logp[0, 0] = 0.0
    engine.copy_htod(bufs.pend_d, [4])
    kernels.prepare_begin(bufs, nodes)()
    for level in (1, 2):
        kernels.prepare_grow(bufs, nodes, level, engine.htod(tok.reshape(-1)), engine.htod(logp.reshape(-1)))()
    read = nodes.read()
    assert read["rank"][0, 2] == 0xFFFFFFFF and read["tok"][0, 2] == 0, "node 2 (rank 1) is void"
    kernels.prepare_accept_greedy(bufs, nodes, engine.htod(np.zeros(TREE.nodes, np.uint32)))()
    assert engine.dtoh(bufs.acc_d).reshape(-1, ACC_WORDS)[0, ACC_ROUND] == 0
    assert engine.dtoh(bufs.last_pred_d)[0] == 0

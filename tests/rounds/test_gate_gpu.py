"""Rounds past every row's end skipped (memra_cuda.rounds.gate; docs/capacity.md, "Rounds past
the end"): the IF node runs a round's model work while some row is live and skips it once every
row is done; a burst graph of such rounds gives every row its own greedy output in graph and
overlap mode, a chain's and a tree's, and runs the model's work of exactly the rounds in which
some row was live; what cannot sit in a conditional node is refused. Skipped, with the reason,
where the driver has no conditional nodes (CUDA 12.4+)."""
from __future__ import annotations

import numpy as np
import pytest

from memra_cuda import Geometry, Greedy, RoundStream, StreamBufs, chain, kv_capacity, kv_len_ptr_table
from memra_cuda.buffers import DraftLengths
from memra_cuda.buffers.capacity import UNCHECKED
from memra_cuda.buffers.tree import TreeShape
from memra_cuda.driver.graph import Graph, LoopUnsupported, loops, stream_capture
from memra_cuda.kernels import SpecKernels
from memra_cuda.rounds import Stages
from memra_cuda.rounds.gate import LiveGate
from memra_cuda.testing.toy import lm as toy
from toy_requests import requests

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("conditionals")]

MODEL = toy.ToyModel(seed=33, vocab=50, kv_mask=(True, False, True), noise_ppm=150_000, p_min=0.1)
K, M = 3, 16


@pytest.fixture(scope="module")
def spec(engine):
    return SpecKernels(engine)


def test_the_gate_runs_the_work_while_some_row_is_live_and_skips_it_once_all_are_done(engine):
    bufs = StreamBufs(engine, Geometry(2, 1, 3))
    gate = LiveGate(bufs)
    ran = engine.zeros(np.uint32, 3, label="the work, the opening, and a word after the node")

    def build(builder):
        gate.add(builder, engine.prepare_set_u32(ran, 1, 7), engine.prepare_set_u32(ran, 0, 100))
        builder.issue(engine.prepare_set_u32(ran, 2, 55))

    graph = Graph(engine, lambda: None, capture=loops(build))
    for budgets, work in [([0, 0, 5], 100), ([4, 0, 0], 100), ([0, 0, 0], 0), ([1, 2, 3], 100)]:
        bufs.set_stop(budget=budgets)  # a budget of 0: that row is done at once
        engine.memset(ran, 0)
        graph.launch()
        assert engine.dtoh(ran).tolist() == [work, 7, 55], f"budgets {budgets}"


def counted_stream(engine, spec, lm, bufs, skip_done, counter):
    """The toy's chain round, its draft led by a kernel that adds one to `counter` a round it runs."""
    draft_d = engine.zeros(np.uint32, bufs.batch * K, label="draft_d")
    pred_d = engine.zeros(np.uint32, bufs.batch * (K + 1), label="pred_d")
    count = engine.load_ptx("probe").kernel("probe_increment").prepare(["ptr", "u32"], grid=1, block=32).set(counter, 1)
    return RoundStream(bufs, kernels=spec, draft_chain=chain([count, *lm.draft_steps(bufs, draft_d)]),
                       verify_trunk=chain(lm.verify_steps(bufs, pred_d)), draft_d=draft_d, acceptance=Greedy(pred_d),
                       rollback_tables=[kv_len_ptr_table(engine, lm.target + lm.draft, pos_ctr=bufs.pos_ctr_d)],
                       skip_done=skip_done)


@pytest.mark.parametrize("skip_done", [True, False])
def test_a_burst_runs_the_model_work_of_the_rounds_some_row_was_live_in_alone(engine, spec, skip_done):
    """Three rows whose last ends in the burst's fourth round or so, a burst of M = 16: with the
    gate the work ran in exactly the rounds the slowest row ran (StreamBufs.rounds_run), without
    it in all 16; the tokens are every row's own greedy output either way."""
    prompts, budgets = [[3, 1, 4], [1, 5], [9, 2, 6, 5]], [5, 9, 12]
    lm = toy.ToyLM(engine, MODEL, kv_capacity(4, max(budgets), Geometry(K, M, 3)), batch=3)
    bufs = StreamBufs(engine, Geometry(K, M, 3))
    counter = engine.zeros(np.uint32, 1, label="rounds whose work ran")
    stream = counted_stream(engine, spec, lm, bufs, skip_done, counter)
    assert (stream.round.gate is not None) == skip_done
    for b, prompt in enumerate(prompts):
        lm.prefill_row(bufs, b, prompt)
    bufs.set_stop(budget=budgets)
    readback = stream.step("graph")
    assert readback.done.all(), "a burst of 16 rounds outlasts every row (each round commits a token)"
    got = [tokens.tolist() for tokens in readback.tokens]
    assert got == [toy.target_greedy(MODEL, p, n) for p, n in zip(prompts, budgets)]
    ran = int(np.max(bufs.rounds_run([len(row) for row in got])))
    assert ran < M
    assert engine.dtoh(counter).tolist() == [ran if skip_done else M]


@pytest.mark.parametrize("mode", ["graph", "overlap"])
@pytest.mark.parametrize("batch", [1, 5])
def test_skipping_chains_give_every_row_its_own_greedy_output(engine, spec, mode, batch):
    prompts, budgets, eos = requests(MODEL, batch, seed=40 + batch)
    capacity = kv_capacity(40, max(budgets), Geometry(K, M, batch), overlap=mode == "overlap")
    lm = toy.ToyLM(engine, MODEL, capacity, batch=batch)
    bufs = StreamBufs(engine, Geometry(K, M, batch))
    stream = lm.round_stream(bufs, kernels=spec, skip_done=True)
    for b, prompt in enumerate(prompts):
        lm.prefill_row(bufs, b, prompt)
    got = stream.generate_batch(budgets, eos=eos, mode=mode)
    for b, (prompt, budget, stop) in enumerate(zip(prompts, budgets, eos)):
        assert got[b].tolist() == toy.target_greedy(MODEL, prompt, budget, stop), f"row {b} of {batch}, {mode}"


@pytest.mark.parametrize("mode", ["graph", "overlap"])
def test_skipping_trees_give_every_row_its_own_greedy_output(engine, spec, mode):
    tree, batch = TreeShape.chain_with_leaves(3, 1), 3
    prompts, budgets, eos = requests(MODEL, batch, seed=61)
    geometry = Geometry.of_tree(tree, M, batch)
    lm = toy.ToyLM(engine, MODEL, kv_capacity(40, max(budgets), geometry, overlap=mode == "overlap"), batch=batch)
    bufs = StreamBufs(engine, geometry)
    stream = lm.tree_round_stream(bufs, tree, kernels=spec, skip_done=True)
    for b, prompt in enumerate(prompts):
        lm.prefill_row(bufs, b, prompt)
    got = stream.generate_batch(budgets, eos=eos, mode=mode)
    for b, (prompt, budget, stop) in enumerate(zip(prompts, budgets, eos)):
        assert got[b].tolist() == toy.target_greedy(MODEL, prompt, budget, stop), f"row {b}, {mode}"


def test_a_round_that_cannot_sit_in_a_conditional_node_is_refused(engine, spec):
    lm = toy.ToyLM(engine, MODEL, kv_capacity(8, 20, Geometry(K, M)))
    bufs = StreamBufs(engine, Geometry(K, M))
    draft_d, pred_d = engine.zeros(np.uint32, K), engine.zeros(np.uint32, K + 1)
    draft, verify = chain(lm.draft_steps(bufs, draft_d)), chain(lm.verify_steps(bufs, pred_d))
    given = dict(draft_chain=draft, verify_trunk=verify, draft_d=draft_d, acceptance=Greedy(pred_d), kernels=spec,
                 rollback_tables=[kv_len_ptr_table(engine, lm.target + lm.draft, pos_ctr=bufs.pos_ctr_d)])
    with pytest.raises(ValueError, match="no capture="):
        RoundStream(bufs, **given, skip_done=True, capture=stream_capture)
    with pytest.raises(LoopUnsupported, match=r"skipping rounds past the end \(skip_done\) cannot run pipeline stages"):
        RoundStream(bufs, **given, skip_done=True, stages=Stages((), round_tail=lambda: None, capacity=UNCHECKED))
    with pytest.raises(ValueError, match="skip_done takes no narrower bodies"):
        RoundStream(bufs, **given, lengths=DraftLengths(bufs, [1.0] * (K + 1), 0.0),
                    narrower={1: (chain(lm.draft_steps(bufs, draft_d, width=1)), verify)}, skip_done=True)
    with pytest.raises(TypeError, match="skip_done"):
        RoundStream(bufs, **given, skip_done="yes")
    lm.prefill(bufs, [1, 2, 3])
    stream = RoundStream(bufs, **given, skip_done=True)
    assert stream.generate(20, mode="eager").tolist() == toy.target_greedy(MODEL, [1, 2, 3], 20), \
        "rounds issued from the host run as ever"

"""Device mode on the GPU: one graph launch generates until every row is done, its tokens equal
graph mode's (greedy and sampling, B in {1, 8}, rows stopping at different rounds by EOS and by
budget), a second request reuses the loop without recapture, the streamed tokens are the final
ones in order and reach the host while the loop still runs, the round cap stops a loop that
would not end with a clear error and usable buffers, and what device mode cannot serve is
refused before anything is queued. (Every test parametrised over MODES runs device mode too.)"""
from __future__ import annotations

import numpy as np
import pytest

from memra_cuda import (UNCHECKED, CapacityError, Greedy, LoopUnsupported, RoundCapError, RoundStream, SpecKernels,
                        Stages, StreamBufs, chain, kv_capacity, kv_len_ptr_table)
from memra_cuda.driver import graph as driver_graph
from memra_cuda.models import toy

pytestmark = pytest.mark.gpu

MODEL = toy.ToyModel(seed=33, vocab=60, kv_mask=(True, False, True), noise_ppm=150_000, p_min=0.1)
SAMPLING = toy.ToySampling(temperature=0.8, floor=0.1, draft_temperature=1.4, draft_floor=0.2)


@pytest.fixture(scope="module")
def spec(engine):
    return SpecKernels(engine)


def requests(batch: int, seed: int):
    """Prompts of 1 to 30 tokens, budgets of 5 to 120 (120 in row 0: the same largest budget
    in every request), an EOS from the middle of every third row's own greedy output (row 0's
    too): rows stop at different rounds, by EOS and by budget."""
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(0, MODEL.vocab, int(rng.integers(1, 31)))] for _ in range(batch)]
    budgets = [120] + [int(rng.integers(5, 121)) for _ in range(batch - 1)]
    eos = []
    for b, (prompt, budget) in enumerate(zip(prompts, budgets)):
        full = toy.target_greedy(MODEL, prompt, budget)
        eos.append(full[len(full) // 2] if b % 3 == 0 else None)
    return prompts, budgets, eos


def setup(engine, spec, batch, k=4, m_rounds=8, budget=120, sampling=None, cost=toy.ToyCost()):
    lm = toy.ToyLM(engine, MODEL, kv_capacity(30, budget, k, m_rounds, batch=batch), cost, batch=batch,
                   sampling=sampling)
    bufs = StreamBufs(engine, k, m_rounds, batch)
    return lm, bufs, lm.round_stream(spec, bufs)


def prefill(lm, bufs, prompts, seeds=None):
    return [lm.prefill_row(bufs, b, prompt, 0 if seeds is None else seeds[b]) for b, prompt in enumerate(prompts)]


@pytest.mark.parametrize("pace", [False, True], ids=["unpaced", "paced"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampling"])
@pytest.mark.parametrize("batch", [1, 8])
def test_device_mode_equals_graph_mode_and_reuses_its_loop(engine, spec, batch, sampled, pace):
    """Paced, the loop runs passes of 8, 4 and 1 rounds, each decided on the device."""
    sampling = SAMPLING if sampled else None
    lm, bufs, stream = setup(engine, spec, batch, sampling=sampling)
    stream.pace = pace
    for request in range(2):  # the second request on the same buffers, without recapture
        prompts, budgets, eos = requests(batch, seed=10 * batch + request)
        seeds = [1000 * request + b for b in range(batch)]
        want = stream.generate_batch(prefill(lm, bufs, prompts, seeds), budgets, eos=eos, mode="graph")
        if not sampled:
            for b in range(batch):
                assert want[b].tolist() == toy.target_greedy(MODEL, prompts[b], budgets[b], eos[b]), f"row {b}"
        bursts = stream.bursts
        got = stream.generate_batch(prefill(lm, bufs, prompts, seeds), budgets, eos=eos, mode="device")
        for b in range(batch):
            assert got[b].tolist() == want[b].tolist(), f"request {request}, row {b} of {batch}"
        assert stream.bursts == bursts + 1, "one launch, one readback"
        assert stream.device_loop.captures == 1, "the second request recaptured the loop"
        assert bufs.done.all()


def test_streamed_tokens_are_the_final_tokens_in_order(engine, spec):
    batch = 8
    prompts, budgets, eos = requests(batch, seed=3)
    lm, bufs, stream = setup(engine, spec, batch)
    want = stream.generate_batch(prefill(lm, bufs, prompts), budgets, eos=eos, mode="graph")
    pieces = [[] for _ in range(batch)]
    for landed in stream.stream(prefill(lm, bufs, prompts), budgets, eos=eos):
        for b in range(batch):
            assert landed.tokens[b].size == landed.stamps[b].size
            pieces[b].extend(landed.tokens[b].tolist())
    for b in range(batch):
        assert pieces[b] == want[b].tolist(), f"row {b}"


@pytest.mark.large
def test_tokens_reach_the_host_while_a_slow_loop_runs(engine, spec):
    """The 8B/0.5B stand-in (a round of milliseconds): the host sees most tokens before the
    loop ends, in several looks, each a round or so after the last."""
    lm, bufs, stream = setup(engine, spec, 1, cost=toy.COST_8B_05B, budget=60)
    prompt = [3, 1, 4, 1, 5]
    landed = list(stream.stream(prefill(lm, bufs, [prompt]), [60]))
    early = [piece for piece in landed if piece.running]
    assert len(early) >= 3, f"{len(early)} of {len(landed)} looks found tokens before the loop ended"
    seen_early = sum(piece.tokens[0].size for piece in early)
    assert seen_early >= 30, f"only {seen_early} of 60 tokens reached the host before the loop ended"
    assert np.concatenate([piece.tokens[0] for piece in landed]).tolist() == toy.target_greedy(MODEL, prompt, 60)


def test_the_round_cap_stops_a_loop_that_would_not_end(engine, spec):
    """A row with no budget and no EOS never finishes: the cap stops it, the error says so and
    holds the tokens so far (graph mode's first tokens), and the buffers serve the next request."""
    lm, bufs, stream = setup(engine, spec, 2, k=3, m_rounds=4)
    prompts = [[5, 6, 7], [9]]
    want = [toy.target_greedy(MODEL, prompt, 100) for prompt in prompts]
    with pytest.raises(RoundCapError, match="cap of 7 rounds with 1 row") as caught:
        list(stream.stream(prefill(lm, bufs, prompts), [None, 4], max_rounds=7))
    assert 7 <= len(caught.value.tokens[0]) <= 7 * 4
    assert caught.value.tokens[0].tolist() == want[0][:len(caught.value.tokens[0])]
    assert caught.value.tokens[1].tolist() == want[1][:4]
    got = stream.generate_batch(prefill(lm, bufs, prompts), [50, 20], mode="device")
    assert [row.tolist() for row in got] == [want[0][:50], want[1][:20]]
    got = stream.generate_batch(prefill(lm, bufs, prompts), [30, 10], mode="graph")
    assert [row.tolist() for row in got] == [want[0][:30], want[1][:10]]


def test_a_change_of_pace_recaptures_the_loop(engine, spec):
    """Pacing is in the loop graph's shape: a stream whose pace changes gets the loop it asks for."""
    lm, bufs, stream = setup(engine, spec, 1, k=2, m_rounds=16)
    prompt, budget = [2, 7, 1, 8], 100
    want = toy.target_greedy(MODEL, prompt, budget)
    before = stream.rounds
    assert stream.generate(prefill(lm, bufs, [prompt])[0], budget, mode="readback").tolist() == want
    needed = stream.rounds - before  # the readback loop runs exactly the rounds the request needs
    rounds = []
    for pace in (False, True, False):
        stream.pace = pace
        before = stream.rounds
        assert stream.generate(prefill(lm, bufs, [prompt])[0], budget, mode="device").tolist() == want
        rounds.append(stream.rounds - before)
    assert stream.device_loop.captures == 3
    whole = -(-needed // 16) * 16  # unpaced: passes of M rounds, but the cap (the budget) cut in singles
    assert rounds[0] == rounds[2] == (whole if whole <= budget - budget % 16 else needed)
    assert needed <= rounds[1] <= rounds[0], "paced: the tail in shorter passes"


def test_the_buffers_are_the_loops_until_its_stream_is_read_or_closed(engine, spec):
    lm, bufs, stream = setup(engine, spec, 2, k=3, m_rounds=4)
    prompts = [[5, 6, 7], [9]]
    following = stream.stream(prefill(lm, bufs, prompts), [40, 30])
    first = next(following)
    with pytest.raises(ValueError, match="device-mode loop is still running"):
        stream.generate_batch([3, 1], [5, 5], mode="graph")
    with pytest.raises(ValueError, match="device-mode loop is still running"):
        stream.stream([3, 1], [5, 5])
    following.close()  # waits for the loop
    assert bufs.done.all() and len(first.tokens) == 2
    got = stream.generate_batch(prefill(lm, bufs, prompts), [40, 30], mode="device")
    assert [row.tolist() for row in got] == [toy.target_greedy(MODEL, p, n) for p, n in zip(prompts, [40, 30])]


def test_device_mode_refuses_what_it_cannot_serve_before_queuing(engine, spec):
    lm, bufs, stream = setup(engine, spec, 2, k=4, m_rounds=4, budget=20)
    starts = prefill(lm, bufs, [[1, 2], [3]])
    readbacks = engine.readbacks
    with pytest.raises(ValueError, match="needs a round cap"):
        stream.stream(starts, [None, 5])  # refused at the call, not at the first token
    with pytest.raises(ValueError, match="max_rounds must be an int"):
        stream.stream(starts, [5, 5], max_rounds=0)
    with pytest.raises(CapacityError, match="cannot take the device loop"):
        stream.generate_batch(starts, [20, 200], mode="device")
    with pytest.raises(ValueError, match='"device" generates until every row is done'):
        stream.step("device")
    assert stream.rounds == stream.bursts == 0 and engine.readbacks == readbacks, "a refused request queued rounds"
    assert stream.device_loop.captures == 0, "a refused request captured a loop"
    got = stream.generate_batch(starts, [20, 0], mode="device")
    assert got[0].tolist() == toy.target_greedy(MODEL, [1, 2], 20) and got[1].size == 0


def test_a_driver_without_while_nodes_is_named_and_the_other_modes_run(engine, spec, monkeypatch):
    """A binding without conditional nodes (as before CUDA 12.4): one clear error, nothing queued,
    and graph mode on the same stream unaffected."""
    real = driver_graph.driver()

    class Older:
        def __getattr__(self, name):
            if name == "cuGraphConditionalHandleCreate":
                raise AttributeError(name)
            return getattr(real, name)

    lm, bufs, stream = setup(engine, spec, 1, budget=30)
    start = prefill(lm, bufs, [[4, 4, 2]])[0]
    monkeypatch.setattr(driver_graph, "driver", Older)
    with pytest.raises(LoopUnsupported, match="CUDA 12.4"):
        stream.generate(start, 30, mode="device")
    monkeypatch.undo()
    assert stream.rounds == 0
    assert stream.generate(start, 30, mode="graph").tolist() == toy.target_greedy(MODEL, [4, 4, 2], 30)


def test_pipeline_stages_are_refused(engine, spec):
    """A round that ends in another stage's work (Stages.round_tail) cannot sit in a loop body."""
    k, m_rounds = 2, 4
    lm = toy.ToyLM(engine, MODEL, kv_capacity(8, 20, k, m_rounds))
    bufs = StreamBufs(engine, k, m_rounds)
    draft_d, pred_d = engine.zeros(np.uint32, k), engine.zeros(np.uint32, k + 1)
    rounds = RoundStream(spec, bufs, draft_chain=chain(lm.draft_steps(bufs, draft_d)),
                         verify_trunk=chain(lm.verify_steps(bufs, pred_d)), draft_d=draft_d, acceptance=Greedy(pred_d),
                         rollback_tables=[kv_len_ptr_table(engine, lm.target + lm.draft, pos_ctr=bufs.pos_ctr_d)],
                         stages=Stages((), round_tail=lambda: None, capacity=UNCHECKED))
    start = lm.prefill(bufs, [1, 2, 3])
    with pytest.raises(LoopUnsupported, match="pipeline stages"):
        rounds.generate(start, 20, mode="device")
    assert rounds.generate(start, 20, mode="graph").tolist() == toy.target_greedy(MODEL, [1, 2, 3], 20)

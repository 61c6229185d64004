"""Device mode on the GPU: one graph launch generates until every row is done, its tokens equal
graph mode's (greedy and sampling, B in {1, 8}, rows stopping at different rounds by EOS and by
budget), a second request reuses the loop without recapture, the streamed tokens are the final
ones in order and reach the host while the loop still runs, the round cap stops a loop that
would not end with a clear error and usable buffers, and what device mode cannot serve is
refused before anything is queued. (Every test parametrised over MODES runs device mode too.)"""
from __future__ import annotations

import numpy as np
import pytest

from memra_cuda import Geometry
from memra_cuda import Greedy, RoundStream, Stages, StreamBufs, UNCHECKED, chain, kv_capacity, kv_len_ptr_table
from memra_cuda.errors import BuffersHeld, CapacityError, LoopUnsupported, RoundCapError
from memra_cuda.kernels import SpecKernels
from memra_cuda.driver import graph as driver_graph
from memra_cuda.testing.toy import lm as toy
from run_python import run_script

pytestmark = pytest.mark.gpu

MODEL = toy.ToyModel(seed=33, vocab=60, kv_mask=(True, False, True), noise_ppm=150_000, p_min=0.1)
SAMPLING = toy.ToySampling(temperature=0.8, floor=0.1, draft_temperature=1.4, draft_floor=0.2)


def deciding(decide, **words):
    """decider(handle, ran): the loop's decider over `words` (its buffers and B), a body of one
    round, unpaced, as issued before the loop (ran 0) and at each body's end (ran 1)."""
    def decider(handle, ran):
        def issue():
            decide.set(**words, handle=int(handle), ran=ran, body=1, paced=0)
            decide()
        return issue
    return decider


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
    lm = toy.ToyLM(engine, MODEL, kv_capacity(30, budget, Geometry(k, m_rounds, batch)), cost, batch=batch,
                   sampling=sampling)
    bufs = StreamBufs(engine, Geometry(k, m_rounds, batch))
    return lm, bufs, lm.round_stream(bufs, kernels=spec)


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
        prefill(lm, bufs, prompts, seeds)
        want = stream.generate_batch(budgets, eos=eos, mode="graph")
        if not sampled:
            for b in range(batch):
                assert want[b].tolist() == toy.target_greedy(MODEL, prompts[b], budgets[b], eos[b]), f"row {b}"
        bursts = stream.bursts
        prefill(lm, bufs, prompts, seeds)
        got = stream.generate_batch(budgets, eos=eos, mode="device")
        for b in range(batch):
            assert got[b].tolist() == want[b].tolist(), f"request {request}, row {b} of {batch}"
        assert stream.bursts == bursts + 1, "one launch, one readback"
        assert stream.device_loop.captures == 1, "the second request recaptured the loop"
        assert bufs.done.all()


def test_streamed_tokens_are_the_final_tokens_in_order(engine, spec):
    batch = 8
    prompts, budgets, eos = requests(batch, seed=3)
    lm, bufs, stream = setup(engine, spec, batch)
    prefill(lm, bufs, prompts)
    want = stream.generate_batch(budgets, eos=eos, mode="graph")
    pieces = [[] for _ in range(batch)]
    prefill(lm, bufs, prompts)
    for landed in stream.follow(budgets, eos=eos):
        for b in range(batch):
            assert landed.tokens[b].size == landed.stamps[b].size
            pieces[b].extend(landed.tokens[b].tolist())
    for b in range(batch):
        assert pieces[b] == want[b].tolist(), f"row {b}"


@pytest.mark.large
@pytest.mark.alone
def test_tokens_reach_the_host_while_a_slow_loop_runs(engine, spec):
    """The 8B/0.5B stand-in (a round of milliseconds): the host sees most tokens before the
    loop ends, in several looks, each a round or so after the last."""
    lm, bufs, stream = setup(engine, spec, 1, cost=toy.COST_8B_05B, budget=60)
    prompt = [3, 1, 4, 1, 5]
    prefill(lm, bufs, [prompt])
    landed = list(stream.follow([60]))
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
    prefill(lm, bufs, prompts)
    with pytest.raises(RoundCapError, match="cap of 7 rounds with 1 row") as caught:
        list(stream.follow([None, 4], max_rounds=7))
    assert 7 <= len(caught.value.tokens[0]) <= 7 * 4
    assert caught.value.tokens[0].tolist() == want[0][:len(caught.value.tokens[0])]
    assert caught.value.tokens[1].tolist() == want[1][:4]
    prefill(lm, bufs, prompts)
    got = stream.generate_batch([50, 20], mode="device")
    assert [row.tolist() for row in got] == [want[0][:50], want[1][:20]]
    prefill(lm, bufs, prompts)
    got = stream.generate_batch([30, 10], mode="graph")
    assert [row.tolist() for row in got] == [want[0][:30], want[1][:10]]


def test_a_change_of_pace_recaptures_the_loop(engine, spec):
    """Pacing is in the loop graph's shape: a stream whose pace changes gets the loop it asks for."""
    lm, bufs, stream = setup(engine, spec, 1, k=2, m_rounds=16)
    prompt, budget = [2, 7, 1, 8], 100
    want = toy.target_greedy(MODEL, prompt, budget)
    before = stream.rounds
    prefill(lm, bufs, [prompt])
    assert stream.generate(budget, mode="readback").tolist() == want
    needed = stream.rounds - before  # the readback loop runs exactly the rounds the request needs
    rounds = []
    for pace in (False, True, False):
        stream.pace = pace
        before = stream.rounds
        prefill(lm, bufs, [prompt])
        assert stream.generate(budget, mode="device").tolist() == want
        rounds.append(stream.rounds - before)
    assert stream.device_loop.captures == 3
    whole = -(-needed // 16) * 16  # unpaced: passes of M rounds, but the cap (the budget) cut in singles
    assert rounds[0] == rounds[2] == (whole if whole <= budget - budget % 16 else needed)
    assert needed <= rounds[1] <= rounds[0], "paced: the tail in shorter passes"


def test_the_buffers_are_the_loops_until_its_stream_is_read_or_closed(engine, spec):
    lm, bufs, stream = setup(engine, spec, 2, k=3, m_rounds=4)
    prompts = [[5, 6, 7], [9]]
    prefill(lm, bufs, prompts)
    following = stream.follow([40, 30])
    first = next(following)
    with pytest.raises(BuffersHeld, match="device-mode loop is still running"):
        stream.generate_batch([5, 5], mode="graph")
    with pytest.raises(BuffersHeld, match="device-mode loop is still running"):
        stream.follow([5, 5])
    following.close()  # waits for the loop
    assert bufs.done.all() and len(first.tokens) == 2
    prefill(lm, bufs, prompts)
    got = stream.generate_batch([40, 30], mode="device")
    assert [row.tolist() for row in got] == [toy.target_greedy(MODEL, p, n) for p, n in zip(prompts, [40, 30])]


def test_a_loop_refused_at_its_launch_leaves_the_buffers_to_the_other_modes(engine, spec):
    """A device loop whose graph refuses to run (a buffer it holds was freed) was refused after
    the buffers were given to it, and nothing gave them back: every later burst raised
    BuffersHeld saying a loop still ran, with nothing to close. The refusal comes before the
    buffers are taken (and before the rows' stops change), and graph mode runs on them."""
    lm, bufs, stream = setup(engine, spec, 2, k=3, m_rounds=4)
    prompts = [[5, 6, 7], [9]]
    prefill(lm, bufs, prompts)
    assert len(stream.generate_batch([10, 10], mode="device")) == 2  # the loop captured
    stream.device_loop._state_d.free()  # a buffer the loop's graph holds
    prefill(lm, bufs, prompts)
    with pytest.raises(ValueError, match="refuses to run|after free"):
        stream.generate_batch([10, 10], mode="device")  # the budgets the loop was captured for: no recapture
    bufs.check_free()
    got = stream.generate_batch([40, 30], mode="graph")
    assert [row.tolist() for row in got] == [toy.target_greedy(MODEL, p, n) for p, n in zip(prompts, [40, 30])]


def test_a_stream_closed_or_dropped_before_its_first_token_frees_the_buffers(engine, spec):
    """The loop is launched at the call, so an iterator never read still owns the buffers until
    it is closed or dropped, which waits for the loop; and the loop is never recaptured under a
    running stream."""
    lm, bufs, stream = setup(engine, spec, 2, k=3, m_rounds=4)
    prompts = [[5, 6, 7], [9]]
    want = [toy.target_greedy(MODEL, p, n) for p, n in zip(prompts, [40, 30])]
    prefill(lm, bufs, prompts)
    following = stream.follow([40, 30])
    with pytest.raises(BuffersHeld, match="device-mode loop is still running"):
        stream.device_loop.prepare(4096, True)
    rounds = stream.rounds
    following.close()
    assert stream.rounds > rounds, "closing waited for the loop and counted its rounds"
    assert [t.tolist() for t in stream.device_loop.tokens()] == want
    prefill(lm, bufs, prompts)
    following = stream.follow([40, 30])
    del following
    prefill(lm, bufs, prompts)
    got = stream.generate_batch([40, 30], mode="device")
    assert [row.tolist() for row in got] == want


FAULT_IN_LOOP = """
import numpy as np
from memra_cuda import Engine, Geometry, Greedy, RoundStream, StreamBufs, chain, kv_capacity
from memra_cuda.errors import CudaFault
from memra_cuda.kernels import SpecKernels
from memra_cuda import kv_len_ptr_table
from memra_cuda.testing.toy import lm as toy
engine = Engine()
spec = SpecKernels(engine)
k, m_rounds = 2, 4
geometry = Geometry(k, m_rounds)
lm = toy.ToyLM(engine, toy.ToyModel(seed=33, vocab=60), kv_capacity(8, 40, geometry))
bufs = StreamBufs(engine, geometry)
draft_d, pred_d = engine.zeros(np.uint32, k), engine.zeros(np.uint32, k + 1)
fault = engine.load_ptx("probe").kernel("probe_increment").prepare(["ptr", "u32"], grid=1, block=32).set(0x10, 1)
rounds = RoundStream(bufs, kernels=spec, draft_chain=chain([*lm.draft_steps(bufs, draft_d), fault]),
                     verify_trunk=chain(lm.verify_steps(bufs, pred_d)), draft_d=draft_d, acceptance=Greedy(pred_d),
                     rollback_tables=[kv_len_ptr_table(engine, lm.target + lm.draft, pos_ctr=bufs.pos_ctr_d)])
lm.prefill(bufs, [1, 2, 3])
try:
    list(rounds.follow([40]))
except CudaFault as exc:
    print("raised", exc.name)
"""


def test_a_fault_inside_the_loop_raises_instead_of_hanging_the_host(engine):
    """A loop that faults never sets its last word: the host, finding nothing for a while, asks
    the driver and raises the fault (in a fresh interpreter: the fault is sticky)."""
    run = run_script(FAULT_IN_LOOP, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "raised CUDA_ERROR_ILLEGAL_ADDRESS", run.stdout + run.stderr


def test_device_mode_refuses_what_it_cannot_serve_before_queuing(engine, spec):
    lm, bufs, stream = setup(engine, spec, 2, k=4, m_rounds=4, budget=20)
    prefill(lm, bufs, [[1, 2], [3]])
    readbacks = engine.readbacks
    with pytest.raises(ValueError, match="needs a round cap"):
        stream.follow([None, 5])  # refused at the call, not at the first token
    with pytest.raises(ValueError, match="max_rounds must be an int"):
        stream.follow([5, 5], max_rounds=0)
    with pytest.raises(CapacityError, match="cannot take the device loop"):
        stream.generate_batch([20, 200], mode="device")
    with pytest.raises(ValueError, match='"device" generates until every row is done'):
        stream.step("device")
    assert stream.rounds == stream.bursts == 0 and engine.readbacks == readbacks, "a refused request queued rounds"
    assert stream.device_loop.captures == 0, "a refused request captured a loop"
    got = stream.generate_batch([20, 0], mode="device")
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
    prefill(lm, bufs, [[4, 4, 2]])
    monkeypatch.setattr(driver_graph, "driver", Older)
    with pytest.raises(LoopUnsupported, match="CUDA 12.4"):
        stream.generate(30, mode="device")
    monkeypatch.undo()
    assert stream.rounds == 0
    assert stream.generate(30, mode="graph").tolist() == toy.target_greedy(MODEL, [4, 4, 2], 30)


def test_pipeline_stages_are_refused(engine, spec):
    """A round that ends in another stage's work (Stages.round_tail) cannot sit in a loop body."""
    k, m_rounds = 2, 4
    lm = toy.ToyLM(engine, MODEL, kv_capacity(8, 20, Geometry(k, m_rounds)))
    bufs = StreamBufs(engine, Geometry(k, m_rounds))
    draft_d, pred_d = engine.zeros(np.uint32, k), engine.zeros(np.uint32, k + 1)
    rounds = RoundStream(bufs, kernels=spec, draft_chain=chain(lm.draft_steps(bufs, draft_d)),
                         verify_trunk=chain(lm.verify_steps(bufs, pred_d)), draft_d=draft_d, acceptance=Greedy(pred_d),
                         rollback_tables=[kv_len_ptr_table(engine, lm.target + lm.draft, pos_ctr=bufs.pos_ctr_d)],
                         stages=Stages((), round_tail=lambda: None, capacity=UNCHECKED))
    lm.prefill(bufs, [1, 2, 3])
    with pytest.raises(LoopUnsupported, match="pipeline stages"):
        rounds.generate(20, mode="device")
    assert rounds.generate(20, mode="graph").tolist() == toy.target_greedy(MODEL, [1, 2, 3], 20)


def test_publish_appends_each_ring_to_its_row_and_empties_it(engine, spec):
    """Kernel 4' alone: every row's ring goes after what the row published before, stamped with
    one time per publish; the counts move on, the rings are emptied, the head counts the
    publishes; a row whose feed is full keeps only what fits (nothing past out_cap)."""
    from memra_cuda.rounds.device_loop import TokenFeed
    from memra_cuda.buffers.layout import RING_COUNT, RING_TOKENS

    batch, cap = 3, 8
    bufs = StreamBufs(engine, Geometry(3, 2, batch))
    out = TokenFeed(engine, batch, cap)
    state = engine.zeros(np.uint32, 1 + batch)
    publish = spec.prepare_ring_publish(bufs, state.view(1, batch), state.view(0, 1), out.head_d, out.count_d,
                                        out.tokens_d, out.stamps_d, cap)
    width = RING_TOKENS + bufs.ring_cap

    def fill(rows):
        ring = np.zeros((batch, width), np.uint32)
        for b, tokens in enumerate(rows):
            ring[b, RING_COUNT], ring[b, RING_TOKENS:RING_TOKENS + len(tokens)] = len(tokens), tokens
        engine.copy_htod(bufs.ring_d, ring.ravel())

    fill([[11, 12, 13], [], [31, 32, 33, 34, 35]])
    publish()
    engine.synchronize()
    first = out.take(0, running=False)
    assert [t.tolist() for t in first.tokens] == [[11, 12, 13], [], [31, 32, 33, 34, 35]]
    ended, publishes, stamp, _ = out.head()
    assert first.counts.tolist() == [3, 0, 5] and first.total == 8 and (ended, publishes) == (0, 1)
    assert set(np.concatenate(first.stamps).tolist()) == {stamp}
    fill([[14], [21, 22], [36, 37, 38, 39]])  # row 2 has room for three more
    publish()
    engine.synchronize()
    second = out.take(0, running=False)
    assert [t.tolist() for t in second.tokens] == [[14], [21, 22], [36, 37, 38]]
    assert [t.tolist() for t in out.tokens()] == [[11, 12, 13, 14], [21, 22], [31, 32, 33, 34, 35, 36, 37, 38]]
    assert out.head()[1] == 2 and second.stamps[2][0] == out.head()[2] != stamp
    assert engine.dtoh(bufs.ring_d).reshape(batch, width)[:, RING_COUNT].tolist() == [0, 0, 0]
    assert engine.dtoh(state).tolist() == [2, 4, 2, 8]
    assert out.take(0, running=False) is None, "nothing new: nothing taken"
    out.free()


def test_a_branch_is_only_added_to_a_capture(engine, spec):
    bufs = StreamBufs(engine, Geometry(2, 2))
    with pytest.raises(driver_graph.CaptureError, match="not capturing"):
        driver_graph.branch(spec.prepare_ring_commit(bufs))


@pytest.mark.alone
def test_the_ring_protocol_streams_every_publish_of_a_loop_in_order(engine, spec):
    """The token feed's protocol alone, as `make racecheck` checks it: inside a WHILE loop the
    rings are filled (by memsets, standing in for a commit) and published by kernel 4' on a
    branch joined before the next fill, the decider ends the loop after `passes`, and the host
    follows the mapped feed while it runs: every pass's tokens arrive, in order, with stamps
    that never go back, and the head counts every publish."""
    from memra_cuda.rounds.device_loop import TokenFeed
    from memra_cuda.driver.graph import Graph, branch, join, loops
    from memra_cuda.buffers.layout import CTL_BUDGET, CTL_EOS, CTL_WORDS, HEAD_ENDED, RING_COUNT, RING_TOKENS
    from memra_cuda.kernels.signatures import load

    batch, passes = 2, 64
    bufs = StreamBufs(engine, Geometry(3, 1, batch))
    out = TokenFeed(engine, batch, 2 * passes)
    state = engine.zeros(np.uint32, 1 + batch)  # publishes, then each row's published tokens
    loop_d = engine.htod([passes, 0], np.uint32)
    row = np.zeros(CTL_WORDS, np.int32)
    row[CTL_EOS] = row[CTL_BUDGET] = -1  # live rows without an EOS or a budget
    ctl = engine.htod(np.tile(row, batch), np.int32)
    acc = engine.zeros(np.uint32, 2 * batch)
    decide = load(engine, "device_loop").kernel("spec_loop_decide").prepare(grid=1, block=256)
    publish = spec.prepare_ring_publish(bufs, state.view(1, batch), state.view(0, 1), out.head_d, out.count_d,
                                        out.tokens_d, out.stamps_d, out.cap)
    width = RING_TOKENS + bufs.ring_cap
    beside = engine.zeros(np.uint32, 1)

    decider = deciding(decide, ctl_d=ctl, pub_d=state.view(1, batch), acc_d=acc, B=batch, loop_d=loop_d)

    def build(graph):
        handle = graph.handle()
        graph.issue(decider(handle, 0))

        def body():
            for b in range(batch):  # row b commits b + 1 tokens a round, each 10 * (b + 1)
                engine.set_u32(bufs.ring_d, b * width + RING_COUNT, b + 1)
                for i in range(b + 1):
                    engine.set_u32(bufs.ring_d, b * width + RING_TOKENS + i, 10 * (b + 1))
            published = branch(publish)
            engine.set_u32(beside, 0, 1)  # the next round's work, on the stream's path beside the branch
            join(engine, published)
            decider(handle, 1)()
        graph.loop(handle, body)
        graph.issue(lambda: engine.set_u32(out.head_d, HEAD_ENDED, 1))

    loop = Graph(engine, lambda: None, capture=loops(build))
    out.clear()
    loop.launch()
    landed = list(out.follow())
    engine.synchronize()
    assert out.head()[:2] == [1, passes]
    for b in range(batch):
        assert np.concatenate([piece.tokens[b] for piece in landed]).tolist() == [10 * (b + 1)] * (b + 1) * passes
        stamps = np.concatenate([piece.stamps[b] for piece in landed]).astype(np.int64)
        assert np.all((np.diff(stamps) % 2**32) < 2**31), "a stamp went back"
    assert len(landed) >= 2 and landed[0].running, "the host saw nothing while the loop ran"
    loop.free()
    out.free()


@pytest.mark.parametrize("cap,count,passes", [(7, 0, 7), (2**32 - 1, 2**32 - 16, 15), (100, 2**32 - 1, 0)],
                         ids=["cap", "cap-word-at-the-top", "count-word-at-the-top"])
def test_the_decider_ends_a_loop_at_its_cap_whatever_its_words_hold(engine, spec, cap, count, passes):
    """The decider counts the rounds in 64 bits, saturating at 2**32 - 1, so a loop ends where its
    words say whatever they hold: from `count`, passes of one round run while count + 1 fits
    under `cap`, and the count stops at the top. Rows live with a budget of 40, a token a pass
    (kernel 4 at k = 0), so the budget spent is the passes run: in u32, both words at the top
    wrapped the test, and the loop ran on to the budget (rows without one, for ever)."""
    from memra_cuda.driver.graph import Graph, loops
    from memra_cuda.buffers.layout import CTL_BUDGET, CTL_WORDS
    from memra_cuda.kernels.signatures import load

    batch, budget = 2, 40
    bufs = StreamBufs(engine, Geometry(0, 64, batch))
    bufs.set_stop(budget=budget)
    loop_d = engine.htod([cap, count], np.uint32)  # as the host leaves it, but for the hostile words
    published = engine.zeros(np.uint32, batch)
    decide = load(engine, "device_loop").kernel("spec_loop_decide").prepare(grid=1, block=256)
    commit = spec.prepare_ring_commit(bufs)

    decider = deciding(decide, ctl_d=bufs.ctl_d, pub_d=published, acc_d=bufs.acc_d, B=batch, loop_d=loop_d)

    def build(graph):
        handle = graph.handle()
        graph.issue(decider(handle, 0))

        def body():
            commit()
            decider(handle, 1)()
        graph.loop(handle, body)

    loop = Graph(engine, lambda: None, capture=loops(build))
    loop.launch()
    engine.synchronize()
    assert engine.dtoh(bufs.ctl_d).reshape(batch, CTL_WORDS)[:, CTL_BUDGET].tolist() == [budget - passes] * batch
    assert engine.dtoh(loop_d).tolist() == [cap, min(count + passes, 2**32 - 1)]
    loop.free()


def test_tokens_are_taken_from_the_stream_until_its_next_launch(engine, spec):
    """A Landed copies its tokens when first asked; asked after the next device launch on the
    same buffers, it refuses rather than answer with the next request's tokens."""
    lm, bufs, stream = setup(engine, spec, 1, budget=40)
    prompt = [6, 2, 8]
    prefill(lm, bufs, [prompt])
    landed = list(stream.follow([40]))
    read, unread = landed[0], landed[-1]
    assert read.tokens[0].size == read.total and sum(piece.total for piece in landed) == 40
    prefill(lm, bufs, [prompt])
    stream.generate(40, mode="device")
    assert read.tokens[0].size == read.total, "a Landed read before keeps its copy"
    with pytest.raises(ValueError, match="earlier launch"):
        unread.stamps

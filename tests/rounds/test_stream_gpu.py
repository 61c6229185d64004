"""End to end on the GPU: the toy model decoded speculatively by RoundStream, in all three
modes, equals the target's own greedy output; the host reads back once per burst; a stop in
the middle of a burst leaves the burst's later rounds without effect."""
from __future__ import annotations

import math

import numpy as np
import pytest

from memra_cuda import Geometry
from memra_cuda import Greedy, RoundStream, StreamBufs, chain, kv_capacity, kv_len_ptr_table
from memra_cuda.errors import CapacityError
from memra_cuda.kernels import SpecKernels
from memra_cuda.rounds import MODES
from memra_cuda.testing.toy import lm as toy, numpy_loop as toy_reference

from interrupt import interrupt_once

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def spec(engine):
    return SpecKernels(engine)


def setup(engine, spec, model, prompt, k, m_rounds, capacity):
    lm = toy.ToyLM(engine, model, capacity)
    bufs = StreamBufs(engine, Geometry(k, m_rounds))
    stream = lm.round_stream(bufs, kernels=spec)
    return lm, bufs, stream, lm.prefill(bufs, prompt)


def generate(engine, spec, model, prompt, k, m_rounds, max_new, eos=None, mode="graph"):
    capacity = kv_capacity(len(prompt), max_new, Geometry(k, m_rounds))  # overlap then also runs without room ahead
    lm, bufs, stream, start = setup(engine, spec, model, prompt, k, m_rounds, capacity)
    return stream.generate(max_new, eos=eos, mode=mode).tolist(), stream


def random_cases(count, seed):
    rng = np.random.default_rng(seed)
    for case in range(count):
        layers = int(rng.integers(1, 6))
        model = toy.ToyModel(seed=int(rng.integers(2**32)), vocab=int(rng.choice([2, 7, 32000])),
                             kv_mask=tuple(bool(b) for b in rng.random(layers) < 0.7),
                             noise_ppm=int(rng.choice([0, 50_000, 300_000, 1_000_000])),
                             p_min=float(rng.choice([0.0, 0.1, 0.5])))
        prompt = [int(t) for t in rng.integers(0, model.vocab, int(rng.integers(1, 40)))]
        k, m_rounds = int(rng.choice([0, 1, 2, 4, 8])), int(rng.choice([1, 3, 16]))
        yield case, model, prompt, k, m_rounds, int(rng.integers(1, 120))


@pytest.mark.parametrize("mode", MODES)
def test_speculative_output_equals_target_greedy(engine, spec, mode):
    for case, model, prompt, k, m_rounds, max_new in random_cases(20, seed=7):
        want = toy.target_greedy(model, prompt, max_new)
        eos = want[len(want) // 2] if case % 3 == 0 else None
        want = toy.target_greedy(model, prompt, max_new, eos)
        got, _ = generate(engine, spec, model, prompt, k, m_rounds, max_new, eos, mode)
        assert got == want, f"case {case}: {model}, k={k}, M={m_rounds}, eos={eos}, mode={mode}"


@pytest.mark.parametrize("kv_mask", [(False,), (True,), (False, True, False), (True, False, False, True)])
def test_layers_without_kv(engine, spec, kv_mask):
    model = toy.ToyModel(seed=3, kv_mask=kv_mask, noise_ppm=200_000, p_min=0.1)
    got, _ = generate(engine, spec, model, [5, 6, 7], k=4, m_rounds=4, max_new=90)
    assert got == toy.target_greedy(model, [5, 6, 7], 90)


@pytest.mark.parametrize("mode", ["eager", "graph", "overlap"])
def test_one_readback_per_burst(engine, spec, mode):
    model = toy.ToyModel(seed=11, noise_ppm=150_000, p_min=0.05)
    k, m_rounds, max_new = 4, 8, 300
    capacity = kv_capacity(3, max_new, Geometry(k, m_rounds))
    lm, bufs, stream, start = setup(engine, spec, model, [1, 2, 3], k, m_rounds, capacity)
    before = engine.readbacks
    got = stream.generate(max_new, mode=mode).tolist()
    assert got == toy.target_greedy(model, [1, 2, 3], max_new)
    assert engine.readbacks - before == stream.bursts
    assert 1 <= stream.bursts <= math.ceil(max_new / m_rounds)  # every round commits >= 1 token


@pytest.mark.parametrize("pace", [False, True])
@pytest.mark.parametrize("mode", ["eager", "graph", "overlap"])
def test_perfect_draft_bursts_and_rounds_are_exactly_counted(engine, spec, mode, pace):
    """With a draft that is always right each round commits k+1 tokens, so the counts are known
    in advance. Unpaced: N / (M (k+1)) bursts of M rounds, rounded up. Paced: N / (k+1) rounds,
    the last 10 as bursts of 8 and 2 (powers of two), not one burst of 16."""
    model = toy.ToyModel(seed=5, noise_ppm=0, p_min=0.0)
    k, m_rounds, max_new = 3, 16, 1000
    capacity = kv_capacity(1, max_new, Geometry(k, m_rounds))
    lm, bufs, stream, start = setup(engine, spec, model, [9], k, m_rounds, capacity)
    stream.pace = pace
    before = engine.readbacks
    assert stream.rate == 1.0, "before any generation: one token a round, fewer than which none commits"
    assert stream.generate(max_new, mode=mode).tolist() == toy.target_greedy(model, [9], max_new)
    # a paced or overlapped generation measures its rows' rate (the next one's first guess); an unpaced
    # eager or graph one runs every burst M rounds whatever the rate, measures none and keeps the last
    learnt = pace or mode == "overlap"
    assert stream.rate == (k + 1 if learnt else 1.0), f"rate {stream.rate} after a {mode} generation, pace={pace}"
    full, tail = divmod(max_new, m_rounds * (k + 1))
    if pace:
        assert stream.rounds == max_new // (k + 1) == full * m_rounds + 8 + 2
        assert stream.bursts == engine.readbacks - before == full + 2
    else:
        assert stream.rounds == (full + 1) * m_rounds
        assert stream.bursts == engine.readbacks - before == full + 1


def test_step_rounds_are_checked_and_each_length_is_its_own_graph(engine, spec):
    model = toy.ToyModel(seed=8, noise_ppm=100_000)
    lm, bufs, stream, start = setup(engine, spec, model, [3, 1, 4], k=2, m_rounds=4, capacity=512)
    for mode, rounds in (("graph", 0), ("graph", 5), ("readback", 2)):
        with pytest.raises(ValueError, match="rounds must be an int from 1 to"):
            stream.step(mode, rounds)
    for mode, rounds in (("eager", True), ("graph", 2.0)):  # not an int: the wrong kind of thing
        with pytest.raises(TypeError, match="rounds must be an integer"):
            stream.step(mode, rounds)
    assert stream.rounds == stream.bursts == 0
    bufs.set_stop(budget=40)
    got = list(stream.step("graph", 3).tokens[0])
    assert stream.rounds == 3 and stream.graph_for(0, 3) is not stream.graph
    while not bufs.done.all():
        got += list(stream.step("graph").tokens[0])
    assert got == toy.target_greedy(model, [3, 1, 4], 40)


@pytest.mark.parametrize("mode", ["graph", "readback", "eager"])
def test_a_step_whose_wait_an_interrupt_cut_short_is_recovered_once(engine, spec, mode, monkeypatch):
    """A step interrupted as the wait for its readback ended (KeyboardInterrupt), before the slot
    was read: its burst ran, its tokens in the pinned slot alone. recover() receives that readback,
    once, and every step's tokens with it are the target's greedy output; before any step, and
    after the readback was received, there is nothing to recover."""
    model = toy.ToyModel(seed=9, noise_ppm=100_000)
    lm, bufs, stream, start = setup(engine, spec, model, [3, 1, 4], k=2, m_rounds=4, capacity=512)
    bufs.set_stop(budget=40)
    assert stream.recover() is None
    got = list(stream.step(mode).tokens[0])
    assert stream.recover() is None, "a step's readback that was received was recovered"
    interrupt_once(monkeypatch, engine, "finish_readback")
    with pytest.raises(KeyboardInterrupt):
        stream.step(mode)
    recovered = stream.recover()
    assert recovered is not None and stream.recover() is None, "a readback recovered twice, or never"
    got += list(recovered.tokens[0])
    while not bufs.done.all():
        got += list(stream.step(mode).tokens[0])
    assert got == toy.target_greedy(model, [3, 1, 4], 40)


@pytest.mark.parametrize("touch", ["stop", "reset", "step"])
def test_a_cut_steps_readback_is_not_recovered_once_the_rows_were_touched(engine, spec, touch, monkeypatch):
    """The readback of a step an interrupt cut short describes the rows as that burst left them:
    once a row's stop was written, every row reset, or another step run, recover() gives None (a
    server would otherwise read those rows' positions and done flags back as they were)."""
    model = toy.ToyModel(seed=10, noise_ppm=100_000)
    lm, bufs, stream, start = setup(engine, spec, model, [2, 7], k=2, m_rounds=4, capacity=512)
    bufs.set_stop(budget=30)
    interrupt_once(monkeypatch, engine, "finish_readback")
    with pytest.raises(KeyboardInterrupt):
        stream.step("graph")
    if touch == "stop":
        bufs.set_stop_row(0, budget=0)
    elif touch == "reset":
        bufs.reset(2, 1)
    else:
        stream.step("graph")
    assert stream.recover() is None


def _device_state(engine, lm, bufs):
    state = {name: engine.dtoh(getattr(bufs, name)).tolist()
             for name in ("pos_ctr_d", "pend_d", "last_pred_d", "brk_d")}
    state["acc_d[1]"] = int(engine.dtoh(bufs.acc_d)[1])  # acc_d[0] is this round's count: 0 once done
    state["ctl_d[:3]"] = engine.dtoh(bufs.ctl_d)[:3].tolist()  # ctl_d[3], this round's keep: 0 once done
    lengths = lm.target.lengths(engine) + lm.draft.lengths(engine)
    state["kv_len"] = lengths
    layers = [kv for kv in lm.target.kv + lm.draft.kv]
    state["kv"] = [None if kv is None else engine.dtoh(kv.data_d)[:n].tolist() for kv, n in zip(layers, lengths)]
    return state


def _numpy_state(stream):
    lengths = [None if n is None else int(n[0]) for n in stream.tgt_len] + [int(stream.draft_len[0])]
    layers = stream.tgt + [stream.draft_kv]
    return {"pos_ctr_d": stream.pos_ctr.tolist(), "pend_d": stream.pend.tolist(),
            "last_pred_d": stream.last_pred.tolist(), "acc_d[1]": int(stream.acc[1]), "brk_d": stream.brk.tolist(),
            "ctl_d[:3]": stream.ctl[:3].tolist(), "kv_len": lengths,
            "kv": [None if kv is None else kv[:n].tolist() for kv, n in zip(layers, lengths)]}


@pytest.mark.parametrize("stop", ["eos", "budget"])
@pytest.mark.parametrize("mode", MODES)
def test_stop_mid_burst_leaves_later_rounds_without_effect(engine, spec, stop, mode):
    """The device runs a whole burst of 16 rounds; numpy, one round at a time, stops at the
    round that hit EOS or the budget. Ring output, pending token, KV lengths and contents,
    position and counters must agree: the rounds after the stop changed nothing."""
    model = toy.ToyModel(seed=21, kv_mask=(True, False, True), noise_ppm=250_000, p_min=0.2)
    prompt, k, m_rounds = [4, 8, 15, 16, 23, 42], 3, 16
    full = toy.target_greedy(model, prompt, 200)
    eos, budget = (full[25], 200) if stop == "eos" else (None, 27)
    mirror = toy_reference.NumpyRoundStream(model, k, 1, capacity=512)
    want = mirror.generate(prompt, budget, eos)
    lm, bufs, stream, start = setup(engine, spec, model, prompt, k, m_rounds, capacity=512)
    got = stream.generate(budget, eos=eos, mode=mode).tolist()
    assert got == want == toy.target_greedy(model, prompt, budget, eos)
    if mode == "readback":
        assert stream.rounds == mirror.rounds
    else:
        assert stream.rounds > mirror.rounds, "the stop should land before the end of the device's burst"
    assert _device_state(engine, lm, bufs) == _numpy_state(mirror)


def test_budget_zero_generates_nothing(engine, spec):
    got, stream = generate(engine, spec, toy.ToyModel(), [1, 2], k=2, m_rounds=4, max_new=0)
    assert got == [] and stream.bursts == 0


def test_graph_replays_for_a_second_generation(engine, spec):
    """The graph is captured once; a new prefill and stop rule are all a new request needs."""
    model = toy.ToyModel(seed=8, noise_ppm=100_000)
    lm, bufs, stream, start = setup(engine, spec, model, [3, 1, 4], k=4, m_rounds=4, capacity=512)
    first = stream.generate(60).tolist()
    graph = stream.graph
    lm.prefill(bufs, [2, 7, 1, 8, 2, 8])
    second = stream.generate(70).tolist()
    assert stream.graph is graph
    assert first == toy.target_greedy(model, [3, 1, 4], 60)
    assert second == toy.target_greedy(model, [2, 7, 1, 8, 2, 8], 70)


def test_capacity_error_before_the_burst_is_issued(engine, spec):
    model = toy.ToyModel()
    lm, bufs, stream, start = setup(engine, spec, model, list(range(10)), k=4, m_rounds=8, capacity=40)
    readbacks, rounds = engine.readbacks, stream.rounds
    with pytest.raises(CapacityError, match="KV cache"):
        stream.generate(1000)
    assert (engine.readbacks, stream.rounds) == (readbacks, rounds)


def test_prompt_longer_than_the_cache_is_refused(engine, spec):
    lm = toy.ToyLM(engine, toy.ToyModel(), capacity=8)
    with pytest.raises(ValueError, match="does not fit"):
        lm.prefill(StreamBufs(engine, Geometry(2, 2)), list(range(20)))


def test_seed_gather_hands_the_draft_the_row_behind_the_bonus(engine, spec):
    """Wired by hand as an engine would (the toy's launches, our tables), with seed_gather
    reading rows of pred_d: each round's gather must deliver the verify row that produced
    the token now pending, i.e. the pending token itself."""
    model = toy.ToyModel(seed=13, noise_ppm=300_000)
    lm = toy.ToyLM(engine, model, capacity=256)
    bufs = StreamBufs(engine, Geometry(3, 1))
    draft_d, pred_d, seed_d = (engine.zeros(np.uint32, n) for n in (3, 4, 1))
    drafts, verifies = lm.draft_steps(bufs, draft_d), lm.verify_steps(bufs, pred_d)
    stream = RoundStream(
        bufs, kernels=spec, draft_chain=chain(drafts), verify_trunk=chain(verifies), draft_d=draft_d,
        acceptance=Greedy(pred_d),
        rollback_tables=[kv_len_ptr_table(engine, lm.target + lm.draft, pos_ctr=bufs.pos_ctr_d)],
        seed_gather=spec.prepare_seed_gather(bufs, pred_d, 1, seed_d))
    lm.prefill(bufs, [1, 2, 3])
    bufs.set_stop()
    committed: list[int] = []

    def round_and_drain() -> None:
        stream.issue_round()
        committed.extend(bufs.drain_ring().tolist())
        engine.set_u32(bufs.ring_d, 0, 0)

    round_and_drain()  # nothing verified yet for the first gather to read
    for round_ in range(20):
        pending = int(engine.dtoh(bufs.pend_d)[0])
        round_and_drain()
        assert int(engine.dtoh(seed_d)[0]) == pending, f"round {round_}"
    assert committed == toy.target_greedy(model, [1, 2, 3], len(committed))

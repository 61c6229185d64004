"""The round as an object, on the GPU (issue 27): the buffers use their own engine and know who
holds them, a generation starts where the last reset left the rows, RoundStream builds its
kernels; and the findings of the tests
written without this code in view, each with the test that failed before: a second stream's
loop over buffers another loop holds, a generation with nothing to generate answering with the
last one's tokens, an unread device-mode stream at interpreter exit, a stream speaking the CUDA
stream protocol."""
from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

from memra_cuda import Geometry
from memra_cuda import Engine, Greedy, RoundStream, StreamBufs, chain, kv_capacity, kv_len_ptr_table
from memra_cuda.errors import BuffersHeld, CaptureError
from memra_cuda.kernels import SpecKernels
from memra_cuda.driver.errors import driver
from memra_cuda.testing.toy import lm as toy
from run_python import run_script

pytestmark = pytest.mark.gpu

MODEL = toy.ToyModel(seed=41, vocab=80, kv_mask=(True, True, False), noise_ppm=200_000, p_min=0.1)


def toy_stream(engine, batch=1, k=3, m_rounds=4, budget=64):
    lm = toy.ToyLM(engine, MODEL, kv_capacity(12, budget, Geometry(k, m_rounds, batch), overlap=True), batch=batch)
    bufs = StreamBufs(engine, Geometry(k, m_rounds, batch))
    return lm, bufs, lm.round_stream(bufs)


def wiring(engine, lm, bufs):
    """What a user gives RoundStream for the toy, by hand."""
    draft_d = engine.zeros(np.uint32, bufs.batch * max(bufs.k, 1))
    pred_d = engine.zeros(np.uint32, bufs.batch * (bufs.k + 1))
    return dict(draft_chain=chain(lm.draft_steps(bufs, draft_d)), verify_trunk=chain(lm.verify_steps(bufs, pred_d)),
                draft_d=draft_d, acceptance=Greedy(pred_d),
                rollback_tables=[kv_len_ptr_table(engine, lm.target + lm.draft, pos_ctr=bufs.pos_ctr_d)])


def test_a_generation_starts_where_the_last_reset_left_the_rows(engine):
    lm, bufs, rounds = toy_stream(engine)
    prompt = [5, 6, 7, 8]
    want = toy.target_greedy(MODEL, prompt, 40)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new forms warn of nothing
        start = lm.prefill(bufs, prompt)
        assert bufs.positions.tolist() == [start] == [len(prompt) - 1]
        assert rounds.generate(40, mode="graph").tolist() == want
    lm.prefill(bufs, prompt)
    queued, readbacks = rounds.rounds, engine.readbacks
    with pytest.raises(TypeError):
        rounds.generate(start, 40)  # the first releases' start_pos is gone: refused before anything is queued
    assert rounds.rounds == queued and engine.readbacks == readbacks, "a refused call queued work"
    assert rounds.generate(40, mode="eager").tolist() == want, "the refusal changed the buffers"


def test_a_batch_starts_at_each_rows_own_reset(engine):
    lm, bufs, rounds = toy_stream(engine, batch=3)
    prompts = [[1], [2, 3, 4, 5, 6], [7, 8]]
    for row, prompt in enumerate(prompts):
        lm.prefill_row(bufs, row, prompt)
    got = rounds.generate_batch([30, 5, 17], mode="overlap")
    for row, prompt in enumerate(prompts):
        assert got[row].tolist() == toy.target_greedy(MODEL, prompt, [30, 5, 17][row]), f"row {row}"


def test_the_buffers_use_their_own_engine_and_refuse_another(engine):
    lm, bufs, rounds = toy_stream(engine)
    lm.prefill(bufs, [3, 1, 4])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bufs.set_stop(budget=12)
        rounds.step("graph")
        accepted, drafted = bufs.drafts_accepted(12)
    assert 0 < accepted < drafted
    bufs.reset_row(0, 9, 2)
    assert bufs.positions.tolist() == [2]
    with pytest.raises(TypeError):
        bufs.reset_row(engine, 0, 9, 2)  # the first releases' engine first is gone: the buffers have theirs


def test_round_stream_builds_its_kernels(engine):
    lm, bufs, _ = toy_stream(engine)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        built = RoundStream(bufs, **wiring(engine, lm, bufs))
    assert isinstance(built.kernels, SpecKernels) and built.kernels.engine is engine
    given = RoundStream(bufs, **wiring(engine, lm, bufs), kernels=SpecKernels(engine))
    for rounds in (built, given, lm.round_stream(bufs)):
        lm.prefill(bufs, [2, 7])
        assert rounds.generate(25).tolist() == toy.target_greedy(MODEL, [2, 7], 25)
    with pytest.raises(TypeError, match="acceptance"):
        RoundStream(bufs, **{**wiring(engine, lm, bufs), "acceptance": None})


def test_launchers_take_the_buffers_first(engine):
    lm, bufs, _ = toy_stream(engine)
    table = kv_len_ptr_table(engine, lm.target + lm.draft, pos_ctr=bufs.pos_ctr_d)
    spec = SpecKernels(engine)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec.prepare_rollback(bufs, table)
    with pytest.raises(TypeError, match="PointerTable"):
        spec.prepare_rollback(bufs, bufs.pos_ctr_d)


def test_a_second_stream_cannot_use_buffers_another_streams_loop_holds(engine):
    """Finding 3: the buffers' holder was kept per RoundStream, so a second one over the same
    buffers started its loop, or its bursts, while the first one's loop ran."""
    lm, bufs, first = toy_stream(engine, budget=200)
    second = lm.round_stream(bufs)
    prompt = [9, 9, 8]
    lm.prefill(bufs, prompt)
    running = first.follow(200)
    queued = second.rounds
    for refused in (lambda: second.follow(10), lambda: second.step("graph"), lambda: second.generate(10),
                    lambda: second.issue_burst(1), lambda: bufs.reset(1, 2), lambda: bufs.set_stop(budget=1),
                    lambda: bufs.drain_ring(), lambda: bufs.receive(), lambda: bufs.drafts_accepted(1),
                    lambda: first.generate(10, mode="graph"), lambda: second.graph_for(0),
                    lambda: second.capture_graphs()):
        with pytest.raises(BuffersHeld, match="device-mode loop is still running"):
            refused()
    assert second.rounds == queued and bufs.holder is first.device_loop
    got = [t for landed in running for t in landed.tokens[0].tolist()]
    assert got == toy.target_greedy(MODEL, prompt, 200) and bufs.holder is None
    lm.prefill(bufs, prompt)
    assert second.generate(40, mode="device").tolist() == got[:40], "the buffers were not free after the loop"


def test_a_generation_with_nothing_to_generate_has_no_tokens(engine):
    """Finding 4: with every budget 0 nothing launches, and the loop's tokens() answered with the
    launch before's tokens."""
    lm, bufs, rounds = toy_stream(engine, batch=2)
    for row in range(2):
        lm.prefill_row(bufs, row, [row + 1, 4])
    landed = list(rounds.follow([20, 30]))
    assert [t.size for t in rounds.device_loop.tokens()] == [20, 30]
    for row in range(2):
        lm.prefill_row(bufs, row, [row + 1, 4])
    assert list(rounds.follow([0, 0])) == []
    assert [t.size for t in rounds.device_loop.tokens()] == [0, 0]
    with pytest.raises(ValueError, match="earlier launch"):
        landed[0].tokens  # noqa: B018 - the last launch's tokens are gone, and say so
    assert [t.size for t in rounds.generate_batch([0, 0], mode="device")] == [0, 0]
    fresh_lm, fresh_bufs, fresh = toy_stream(engine)  # a loop never launched
    fresh_lm.prefill(fresh_bufs, [1, 2])
    assert fresh.generate(0, mode="device").size == 0


UNREAD_AT_EXIT = """
from memra_cuda import Engine, Geometry, StreamBufs, kv_capacity
from memra_cuda.testing.toy import lm as toy
engine = Engine()
geometry = Geometry(2, 4)
capacity = kv_capacity(4, 4000, geometry)
lm = toy.ToyLM(engine, toy.ToyModel(seed=3, vocab=50), capacity, toy.ToyCost(verify_bytes=1 << 26))
bufs = StreamBufs(engine, geometry)
rounds = lm.round_stream(bufs)
lm.prefill(bufs, [1, 2, 3])
following = rounds.follow(4000)
print("first", next(following).total > 0, flush=True)
"""


def test_an_unread_device_stream_at_interpreter_exit_says_nothing(engine):
    """Finding 2: a device-mode stream left unread when the interpreter exits printed "Exception
    ignored in _Following.close" with CUDA_ERROR_CONTEXT_IS_DESTROYED (in a fresh interpreter,
    its loop still running at exit)."""
    run = run_script(UNREAD_AT_EXIT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "first True"
    for noise in ("Exception ignored", "Traceback", "CUDA_ERROR"):
        assert noise not in run.stderr, run.stderr


class ProtocolStream:
    """A stream of another library, speaking only the CUDA stream protocol (cuda.core, CuPy)."""

    def __init__(self, handle: int, version: int = 0):
        self.handle, self.version = handle, version

    def __cuda_stream__(self):
        return self.version, self.handle


def test_an_engine_borrows_a_stream_speaking_the_cuda_stream_protocol(engine):
    """Finding 5: Engine(stream=) took an int, a CUstream or `.cuda_stream`, not __cuda_stream__."""
    drv = driver()
    handle = engine.ctx.call("cuStreamCreate", int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING))
    try:
        theirs = ProtocolStream(int(handle))
        borrowed = Engine(0, stream=theirs)
        assert borrowed.stream_handle == int(handle) and borrowed.borrowed and borrowed.stream_owner is theirs
        buf = borrowed.htod(np.arange(5, dtype=np.uint32))
        assert borrowed.dtoh(buf).tolist() == [0, 1, 2, 3, 4]
        borrowed.wait(ProtocolStream(int(engine.stream_handle)))  # the protocol wherever a stream is taken
        buf.free()
        borrowed.close()
        assert engine.ctx.call("cuStreamQuery", handle) is None, "closing the engine destroyed a borrowed stream"
        with pytest.raises(TypeError, match=r"must return \(0, handle\)"):
            Engine(0, stream=ProtocolStream(int(handle), version=7))
    finally:
        engine.ctx.call("cuStreamDestroy", handle)


def test_a_sealed_stream_generates_on_the_graphs_captured_before_and_refuses_any_other(engine):
    """Issue 47: the headline's timed runs captured burst graphs (Pace asks for a shorter burst
    where the rows need fewer rounds, each length captured on first use: a device-wide sync through
    torch). capture_graphs(seal=True) captures every length Pace may ask for; generations of any
    budget then capture nothing, and a graph not captured before is a CaptureError, not a capture."""
    lm, bufs, rounds = toy_stream(engine, m_rounds=8, budget=200)
    rounds.capture_graphs(seal=True)
    captured = rounds.graphs
    assert captured == tuple((0, n) for n in (1, 2, 4, 8))
    prompt = [3, 1, 4, 1, 5]
    for budget in (1, 5, 17, 64, 200):  # bursts of every length pacing asks for
        lm.prefill(bufs, prompt)
        assert rounds.generate(budget, mode="graph").tolist() == toy.target_greedy(MODEL, prompt, budget)
    assert rounds.graphs == captured, "a sealed stream captured mid-generation"
    with pytest.raises(CaptureError, match="not captured before the first request"):
        rounds.graph_for(1)  # overlap's second readback slot: never captured
    assert rounds.graphs == captured


def test_a_sealed_stream_refuses_overlap_mode_without_its_second_slot_before_anything_is_queued(engine):
    """Sealed with graph mode's graphs alone (readback slot 0), an overlap generation ran its first
    burst, then met the CaptureError of slot 1's graph: that burst's tokens lost, the rows moved on.
    It is refused before anything is queued, naming the graphs; the rows then generate in graph
    mode as before, and overlap runs once its slot is captured."""
    lm, bufs, rounds = toy_stream(engine, m_rounds=8, budget=200)
    rounds.capture_graphs(seal=True)
    prompt = [3, 1, 4, 1, 5]
    lm.prefill(bufs, prompt)
    positions = bufs.positions.copy()
    missing = [(1, n) for n in ((1, 2, 4, 8) if rounds.pace else (8,))]  # the lengths pacing may ask for
    with pytest.raises(CaptureError, match=re.escape(f"overlap mode's burst graphs {missing} ((readback slot, "
                                                     "rounds)) were not captured")):
        rounds.generate(40, mode="overlap")
    assert (bufs.positions == positions).all() and rounds.rounds == 0, "the refused generation ran a burst"
    assert rounds.generate(40, mode="graph").tolist() == toy.target_greedy(MODEL, prompt, 40)
    rounds.sealed = False
    rounds.capture_graphs(slots=(1,), seal=True)
    lm.prefill(bufs, prompt)
    assert rounds.generate(40, mode="overlap").tolist() == toy.target_greedy(MODEL, prompt, 40)


def test_a_sealed_stream_runs_device_mode_on_the_loop_captured_before_and_refuses_a_longer_one(engine):
    """Device mode under the seal (issue 47: nothing captured inside a timed generation): without
    capture_loop its first generation is a CaptureError, not the loop's capture; capture_loop(N)
    captures the loop once, for a token feed of the power of two at least N; generations of up to
    that many tokens a row then capture nothing, and a longer one is refused, naming its tokens."""
    lm, bufs, rounds = toy_stream(engine, m_rounds=8, budget=200)
    rounds.capture_graphs(seal=True)
    prompt = [3, 1, 4, 1, 5]
    lm.prefill(bufs, prompt)
    with pytest.raises(CaptureError, match="capture_loop"):
        rounds.generate(40, mode="device")
    with pytest.raises(ValueError, match="tokens must be an int"):
        rounds.capture_loop(0)
    rounds.capture_loop(100)  # a feed of 128 tokens a row
    loop = rounds.device_loop
    assert loop.captures == 1
    for budget in (1, 40, 128):
        lm.prefill(bufs, prompt)
        assert rounds.generate(budget, mode="device").tolist() == toy.target_greedy(MODEL, prompt, budget)
    assert loop.captures == 1, "a sealed stream captured device mode's loop mid-generation"
    lm.prefill(bufs, prompt)
    with pytest.raises(CaptureError, match="129 tokens a row"):
        rounds.generate(129, mode="device")
    assert loop.captures == 1
    lm.prefill(bufs, prompt)  # the refusal queued nothing: the stream goes on
    assert rounds.generate(40, mode="graph").tolist() == toy.target_greedy(MODEL, prompt, 40)

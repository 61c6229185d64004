"""No silent failure by omission, under threads, or across the life of a process: each test
here reproduces a case that once went wrong without an error (see the numbered comments)."""
from __future__ import annotations

import gc
import logging
import sys
import threading
import types
import weakref

import numpy as np
import pytest

from memra_cuda import Geometry
from memra_cuda import (DeviceBuffer, Engine, Greedy, RoundStream, Stages, StreamBufs, UNCHECKED, chain,
                        kv_len_ptr_table)
from memra_cuda.buffers import PointerTable
from memra_cuda.errors import CapacityError, CaptureError
from memra_cuda.kernels import SpecKernels
from memra_cuda.driver.errors import driver
from memra_cuda.testing.toy import lm as toy
from gate import Gate
from run_python import run_script

pytestmark = pytest.mark.gpu

SPIN_CYCLES = 400_000_000  # ~0.2 s of a ~2 GHz clock: still running when the host looks


@pytest.fixture(scope="module")
def spec(engine):
    return SpecKernels(engine)


def spin(engine: Engine, target):
    """probe_spin on `engine`'s stream: busy for SPIN_CYCLES, then target[0] += 1."""
    return engine.load_ptx("probe").kernel("probe_spin").prepare(["ptr", "u64"]).set(target, SPIN_CYCLES)


def stream_busy(engine: Engine) -> bool:
    (err,) = driver().cuStreamQuery(engine.stream)
    if err == driver().CUresult.CUDA_ERROR_NOT_READY:
        return True
    assert err == driver().CUresult.CUDA_SUCCESS, err
    return False


# -- 1. capacity: an unchecked rollback table is asked for by name, never by omission -------

def test_hand_built_rollback_table_must_name_its_capacity(engine, spec):
    lm = toy.ToyLM(engine, toy.ToyModel(seed=5), capacity=24)
    bufs = StreamBufs(engine, Geometry(4, 4))
    lengths = [kv.len_d for kv in (lm.target + lm.draft).kv if kv is not None] + [bufs.pos_ctr_d]
    draft_d, pred_d = engine.zeros(np.uint32, 4), engine.zeros(np.uint32, 5)
    wiring = dict(draft_chain=chain(lm.draft_steps(bufs, draft_d)),
                  verify_trunk=chain(lm.verify_steps(bufs, pred_d)), draft_d=draft_d, acceptance=Greedy(pred_d))
    with pytest.raises(ValueError, match="capacity"):
        RoundStream(bufs, kernels=spec, rollback_tables=[PointerTable(engine, lengths)], **wiring)
    with pytest.raises(ValueError, match="capacity"):
        PointerTable(engine, lengths, capacity=0)
    assert RoundStream(bufs, kernels=spec, rollback_tables=[PointerTable(engine, lengths, capacity=UNCHECKED)],
                       **wiring).capacity is None
    checked = RoundStream(bufs, kernels=spec, rollback_tables=[PointerTable(engine, lengths, capacity=24)],
                          **wiring)
    lm.prefill(bufs, list(range(10)))
    with pytest.raises(CapacityError, match="24 entries"):
        checked.generate(100)  # 9 + one burst of 20 > 24


# -- 5. the public issue_round / issue_burst check capacity and the ring's M rounds ---------

def test_issue_burst_refuses_more_than_m_rounds_and_a_burst_that_does_not_fit(engine, spec):
    lm = toy.ToyLM(engine, toy.ToyModel(seed=6), capacity=24)
    bufs = StreamBufs(engine, Geometry(4, 4))
    stream = lm.round_stream(bufs, kernels=spec)
    lm.prefill(bufs, list(range(10)))  # position 9
    with pytest.raises(ValueError, match="rounds must be an int from 1 to 4"):
        stream.issue_burst(8)  # twice the ring: its commits would drop tokens
    with pytest.raises(CapacityError, match="24 entries"):
        stream.issue_burst(4)  # 9 + 4 rounds of 5 > 24
    stream.issue_burst(2)  # 9 + 10 fits
    stream.issue_round()  # 9 + 10 + 5 fits, just
    with pytest.raises(CapacityError, match="24 entries"):
        stream.issue_round()  # the rounds issued since the readback count: 9 + 15 + 5 > 24
    bufs.queue_readback()
    got = np.concatenate(bufs.receive().tokens)
    assert got.tolist() == toy.target_greedy(lm.model, list(range(10)), len(got))


def test_rounds_issued_since_a_readback_never_overrun_the_ring(engine, spec):
    """The ring holds M rounds' tokens: two bursts of M without a readback, or a burst and
    then a step, would drop tokens while the budget is spent, whatever the caches' room."""
    lm = toy.ToyLM(engine, toy.ToyModel(seed=8), capacity=4096)
    bufs = StreamBufs(engine, Geometry(2, 4))
    stream = lm.round_stream(bufs, kernels=spec)
    lm.prefill(bufs, [1, 2, 3])
    stream.issue_burst(4)
    with pytest.raises(ValueError, match="overrun the ring"):
        stream.issue_burst(4)
    with pytest.raises(ValueError, match="overrun the ring"):
        stream.issue_round()
    for mode in ("readback", "graph"):
        with pytest.raises(ValueError, match="overrun the ring"):
            stream.step(mode)
    bufs.queue_readback()
    first = np.concatenate(bufs.receive().tokens).tolist()  # the readback makes room again
    stream.issue_burst(4)
    bufs.queue_readback()
    second = np.concatenate(bufs.receive().tokens).tolist()
    assert first + second == toy.target_greedy(lm.model, [1, 2, 3], len(first) + len(second))


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_a_burst_with_its_readback_leaves_the_ring_empty_for_the_next(engine, spec, mode):
    """After issue_burst's rounds, a step's own readback (replayed inside its graph, where bufs
    cannot count it) empties the ring: the next whole burst fits, and every token arrives."""
    lm = toy.ToyLM(engine, toy.ToyModel(seed=8), capacity=4096)
    bufs = StreamBufs(engine, Geometry(2, 4))
    stream = lm.round_stream(bufs, kernels=spec)
    lm.prefill(bufs, [1, 2, 3])
    stream.issue_burst(1)
    tokens = np.concatenate(stream.step(mode, 1).tokens).tolist()
    tokens += np.concatenate(stream.step(mode).tokens).tolist()
    assert tokens == toy.target_greedy(lm.model, [1, 2, 3], len(tokens))


# -- 7. concurrent waits each wait on their own record --------------------------------------

def test_concurrent_waits_never_wait_on_each_others_record(engine, monkeypatch):
    """Thread 1 joins a busy stream, thread 2 an idle one; thread 2's record lands between
    thread 1's record and its wait. With one shared join event, thread 1 waited on thread 2's
    (idle) record and the engine ran ahead of the busy stream."""
    busy, idle, target = Engine(engine.device), Engine(engine.device), Engine(engine.device)
    flag = busy.zeros(np.uint32, 1)
    drv = driver()
    real_record = drv.cuEventRecord
    first_recorded, second_done = threading.Event(), threading.Event()

    def record(event, stream):
        result = real_record(event, stream)
        if int(stream) == busy.stream_handle:
            first_recorded.set()
            second_done.wait(1.0)  # the race, made certain: thread 2 records here
        return result

    monkeypatch.setattr(drv, "cuEventRecord", record)
    try:
        spin(busy, flag)()
        first = threading.Thread(target=target.wait, args=(busy.stream_handle,))
        first.start()
        assert first_recorded.wait(5.0)
        second = threading.Thread(target=lambda: (target.wait(idle.stream_handle), second_done.set()))
        second.start()
        first.join(5.0)
        second.join(5.0)
        assert stream_busy(target), "the engine's stream does not wait for the busy stream"
        target.synchronize()
        assert busy.dtoh(flag)[0] == 1
    finally:
        for e in (busy, idle, target):
            e.close()


# -- 9. no allocation under anyone's capture -------------------------------------------------

def test_allocation_is_refused_under_a_capture_that_is_not_memras(engine):
    """A framework's capture (torch.cuda.graph) begins on the stream without memra's Graph:
    in relaxed mode the driver allows cuMemAlloc, which the graph would then address."""
    drv = driver()
    ctx = engine.activate()
    ctx.call("cuStreamBeginCapture", engine.stream, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    try:
        with pytest.raises(CaptureError, match="allocated inside a graph capture"):
            engine.alloc(np.uint32, 4)
        with pytest.raises(CaptureError, match="allocated inside a graph capture"):
            engine.pinned(np.uint32, 4)
        with pytest.raises(CaptureError, match="host wait"):
            engine.finish_readback()  # the driver refuses it (and ends the capture's use)
    finally:
        engine.ctx.make_current()
        err, graph = drv.cuStreamEndCapture(engine.stream)  # invalidated by the refused wait
        if not err and graph is not None and int(graph):
            drv.cuGraphDestroy(graph)
    engine.synchronize()


# -- 11. a borrowed stream's owner and a borrowed buffer's memory outlive memra's use --------

class OwnedStream:
    """A stream whose owner destroys it when collected, as a framework's stream object would."""

    def __init__(self, engine: Engine):
        self.ctx = engine.activate()
        self.cuda_stream = int(self.ctx.call("cuStreamCreate", 0))

    def __del__(self):
        self.ctx.finalize("cuStreamDestroy", driver().CUstream(self.cuda_stream))


def test_engine_keeps_a_borrowed_streams_owner_alive(engine):
    owner = OwnedStream(engine)
    alive = weakref.ref(owner)
    borrowed = Engine(engine.device, stream=owner)
    del owner
    gc.collect()
    assert alive() is not None, "the stream's owner was collected while the engine uses its stream"
    buf = borrowed.htod([1, 2, 3], np.uint32)
    assert borrowed.dtoh(buf).tolist() == [1, 2, 3]
    borrowed.close()
    gc.collect()
    assert alive() is None, "closing the engine lets the owner go"


class OfferedMemory:
    """Device memory owned elsewhere, offered through __cuda_array_interface__, with no finaliser:
    the caller frees `ptr` (ctx.finalize("cuMemFree", ptr)) once nothing may use it."""

    def __init__(self, engine: Engine, n: int):
        self.ctx = engine.activate()
        self.ptr = int(self.ctx.call("cuMemAlloc", 4 * n))
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<u4", "data": (self.ptr, False),
                                         "strides": None, "version": 2}


class ForeignMemory(OfferedMemory):
    """OfferedMemory that frees itself as it goes (a __del__, as an owner of Python's own would)."""

    def __del__(self):
        self.ctx.finalize("cuMemFree", self.ptr)


def test_freeing_a_borrowed_buffer_waits_for_the_work_queued_on_it(engine):
    foreign = ForeignMemory(engine, 4)
    buf = DeviceBuffer.from_cuda_array(foreign)
    del foreign
    engine.memset(buf, 0)
    spin(engine, buf)()
    assert stream_busy(engine)
    buf.free()  # the owner may hand the memory out at once: nothing queued may still use it
    assert not stream_busy(engine), "free() dropped the borrow while a kernel still used the memory"

    flag, foreign = engine.zeros(np.uint32, 1), ForeignMemory(engine, 4)
    buf = DeviceBuffer.from_cuda_array(foreign)
    spin(engine, flag)()
    engine.memset(buf, 0)  # no launch names it: a memset queued behind the spin
    assert stream_busy(engine)
    buf.free()
    assert not stream_busy(engine), "free() dropped the borrow while a memset on it was still queued"


@pytest.mark.parametrize("queued", ["memset", "launch"])
def test_a_borrowed_buffer_collected_keeps_the_memorys_owner_until_the_work_queued_on_it_ran(engine, queued):
    """Memory passed in for one call (engine.memset(array, 0), a launch prepared on it, run and
    dropped) is adopted by a buffer collected as the call returns: it dropped the array at once,
    its memory's work still queued, and an array's last reference gone then, its allocator could
    hand the memory out under that work. The buffer's collection now keeps the owner until the
    stream has run the work (release_after): alive while the stream spins, gone at synchronize()."""
    foreign = ForeignMemory(engine, 4)
    owner = weakref.ref(foreign)
    touch = engine.load_ptx("probe").kernel("probe_touch").prepare(["ptr"])
    with Gate(engine):  # the stream runs nothing queued here until the block ends (tests/gate.py)
        if queued == "memset":
            engine.memset(foreign, 0)
        else:
            touch.set(DeviceBuffer.from_cuda_array(foreign))()  # adopted for the launch alone
            touch.set(engine.zeros(np.uint32, 1))  # the launch lets go of the adopted buffer
        del foreign
        gc.collect()
        assert owner() is not None, "the memory's owner went with its buffer, the work on the memory still queued"
        assert stream_busy(engine)
    assert owner() is None, "the stream ran the work: the owner goes at its synchronize()"


@pytest.mark.parametrize("queued_on", ["its engine", "an engine borrowing its stream"])
def test_a_borrowed_buffer_collected_with_its_engine_in_a_cycle_keeps_the_owner_until_that_engines_work_ran(
        engine, caplog, queued_on):
    """An engine collected unclosed in one garbage cycle with a borrowed buffer that queued work on
    it (an object holding both, in a cycle): the collector ran the engine's finaliser (its
    cuStreamDestroy) before the buffer's release, which then asked the destroyed stream for a mark,
    was refused at every drain and kept the owner for good. The finaliser now marks the stream's
    end as it destroys it, and the release waits for that mark: the owner is kept while the work
    is held (behind a gate on `engine`, which the engine collected waits for), and goes once it ran.
    An engine borrowing that engine's stream (Engine(stream=other)) shares its mark: the owner's
    finaliser destroys the stream before the borrower's release, as it did before.

    The owner is watched by the references to a token it holds, not by a weakref: the collector
    clears every weakref to what it found unreachable before any __del__ runs, the release's too,
    so a weakref to an owner that release keeps reads dead all the same (stop 92's H100 run of the
    weakref form: both cases failed there). For the same reason the owner has no finaliser of its
    own (OfferedMemory): the collector finalises every object of the garbage, one a release then
    keeps too (PEP 442), as docs/graphs-and-ownership.md says; a tensor frees at its deallocation."""
    from memra_cuda.driver import release

    other = Engine(engine.device)
    token = object()
    foreign = OfferedMemory(engine, 4)
    foreign.token, ptr = token, foreign.ptr
    held = sys.getrefcount(token)  # the owner's reference among them
    try:
        with caplog.at_level(logging.WARNING, logger="memra_cuda"):
            with Gate(engine):  # `other` waits for engine's stream: its memset is queued behind the gate
                other.wait(engine.stream)  # its CUstream: the fixture's stream is not handed out (__cuda_stream__)
                buf = DeviceBuffer.from_cuda_array(foreign)
                user = other if queued_on == "its engine" else Engine(engine.device, stream=other)
                user.memset(buf, 0)
                holder = types.SimpleNamespace(engine=other, user=user, buf=buf)
                holder.itself = holder  # the cycle: collected by the collector alone, engine and buffer at once
                del foreign, buf, other, user, holder
                gc.collect()
                assert sys.getrefcount(token) == held, "the owner went with its buffer, the work on its memory queued"
            engine.ctx.call("cuCtxSynchronize")  # the collected engine's stream ran its work
            release.drain()
            gc.collect()  # the cycle the release kept whole, garbage again: the buffer held the owner too
        assert sys.getrefcount(token) == held - 1, "the collected engine's work ran: the owner goes"
        assert not [r for r in caplog.records if r.name == "memra_cuda"], [r.getMessage() for r in caplog.records]
    finally:
        engine.ctx.call("cuCtxSynchronize")  # every stream's work on the memory run, the test's asserts failed or not
        engine.ctx.finalize("cuMemFree", ptr)


# -- 8 and 10. a fault refuses before the driver, and is remembered for the process ---------

FAULT_SCRIPT = """
import gc
import numpy as np
from cuda.bindings import driver as drv
from memra_cuda import Engine
from memra_cuda.errors import CudaFault
from memra_cuda.driver.context import PrimaryContext

engine = Engine()
buf = engine.zeros(np.uint32, 4)
launch = engine.load_ptx("probe").kernel("probe_increment").prepare(["ptr", "u32"], grid=1, block=32).set(buf, 4)

# 8a. A binding that raises still leaves the caller's context as it was.
(err,) = drv.cuCtxSetCurrent(drv.CUcontext(0))
real = launch._fn
def boom(*args):
    raise RuntimeError("the binding failed")
launch._fn = boom
try:
    launch()
except RuntimeError:
    pass
else:
    raise AssertionError("the binding's exception did not come through")
err, current = drv.cuCtxGetCurrent()
assert int(current) == 0, "a failed launch left its context pushed"
launch._fn = real
engine.ctx.make_current()

# 8b. After a fault, a prepared launch refuses without reaching the driver.
launch(0x10, 1)  # an address nothing owns: the kernel faults
try:
    engine.synchronize()
except CudaFault:
    pass
calls = []
launch._fn = lambda *args: calls.append(args) or real(*args)
try:
    launch(buf, 4)
except CudaFault as exc:
    assert "faulted earlier" in str(exc), exc
else:
    raise AssertionError("a launch after the fault went through")
assert calls == [], "the launch reached the driver after the fault"

# 10. With every engine and buffer gone, a new engine still knows the device faulted.
device = engine.device
engine.close()
del engine, buf, launch
gc.collect()
assert PrimaryContext.of(device).fault is not None, "the fault was forgotten"
try:
    Engine(device)
except CudaFault as exc:
    assert "faulted earlier" in str(exc), exc
else:
    raise AssertionError("a new engine on the faulted device went through")
print("remembered")
"""


def test_fault_refuses_before_the_driver_and_is_remembered_after_every_engine_is_gone(engine):
    run = run_script(FAULT_SCRIPT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "remembered"


# -- a row no kernel served is an error, not a generation that never ends --------------------

def test_a_live_row_that_commits_nothing_in_a_burst_raises_instead_of_hanging(engine, spec):
    """Rows a kernel never reaches (as rows past 8192 once were) stay live and commit nothing;
    generate would wait for them forever. Emptying the ring after each commit stands in for that."""
    lm = toy.ToyLM(engine, toy.ToyModel(seed=7), capacity=256)
    bufs = StreamBufs(engine, Geometry(2, 4))
    draft_d, pred_d = engine.zeros(np.uint32, 2), engine.zeros(np.uint32, 3)
    table = kv_len_ptr_table(engine, lm.target + lm.draft, pos_ctr=bufs.pos_ctr_d)
    stream = RoundStream(bufs, kernels=spec, draft_chain=chain(lm.draft_steps(bufs, draft_d)),
                         verify_trunk=chain(lm.verify_steps(bufs, pred_d)), draft_d=draft_d,
                         acceptance=Greedy(pred_d), rollback_tables=[table],
                         stages=Stages((), engine.prepare_set_u32(bufs.ring_d, 0, 0), UNCHECKED))
    for mode in ("readback", "graph"):
        lm.prefill(bufs, [1, 2, 3])
        with pytest.raises(RuntimeError, match="committed no token"):
            stream.generate(50, mode=mode)

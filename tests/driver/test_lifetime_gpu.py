"""Nothing outlives what it names: each numbered reproduction of issue 7, now a clear Python
exception (or correct behaviour), plus the rules behind them — dependents poisoned on free,
captures that refuse pageable memory, bad input refused before anything is queued, a fault
that is remembered and named, and threads sharing one engine.

Every test that would once have written into reused memory asserts that the memory around it
is untouched as well as that the call raised.
"""
from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest

from memra_cuda import Geometry
from memra_cuda import (DeviceBuffer, Engine, Event, Graph, Greedy, RoundStream, StreamBufs, kv_capacity,
                        kv_len_ptr_table)
from memra_cuda.buffers import PointerTable
from memra_cuda.driver.module import KernelArgs
from memra_cuda.driver.errors import driver
from memra_cuda.errors import CapacityError, CaptureError
from memra_cuda.kernels import SpecKernels
from memra_cuda.testing.toy import lm as toy, numpy_loop as toy_reference
from memra_cuda.buffers.tables import Cache
from run_python import run_script

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def spec(engine):
    return SpecKernels(engine)


def increment(engine, n: int):
    """probe_increment (x[i] += 1 for i < n), prepared for n elements."""
    return engine.load_ptx("probe").kernel("probe_increment").prepare(["ptr", "u32"], grid=-(-n // 128), block=128)


# -- 1. launches and graphs hold the buffers they captured ---------------------------------

def test_graph_keeps_the_buffer_it_captured_after_the_launch_is_rebound(engine):
    old = engine.htod([10, 20, 30, 40], np.uint32)
    launch = increment(engine, 4).set(old, 4)
    graph = Graph(engine, launch)
    new = engine.htod([1, 2, 3, 4], np.uint32)
    launch.set(new, 4)
    old_alive = weakref.ref(old)
    del old
    gc.collect()
    assert old_alive() is not None, "the graph must hold the buffer it captured"
    bystander = engine.htod(np.full(4, 7, np.uint32), np.uint32)  # may take the address a freed buffer had
    graph.launch()
    assert engine.dtoh(old_alive(), np.uint32).tolist() == [11, 21, 31, 41]
    assert engine.dtoh(new, np.uint32).tolist() == [1, 2, 3, 4]
    assert engine.dtoh(bystander, np.uint32).tolist() == [7] * 4

    old_alive().free()
    with pytest.raises(ValueError, match=r"Graph refuses to run.*u32\[4\].*which was freed"):
        graph.launch()
    launch()  # the launch itself is bound to `new`, which is alive
    assert engine.dtoh(new, np.uint32).tolist() == [2, 3, 4, 5]


def test_a_wait_joining_a_capture_that_does_not_hold_its_engines_work_is_refused(engine):
    """An engine left out of a capture's joined engines that waited on an event recorded inside
    the capture joined it: its launches' buffers were not held by the graph, which then replayed
    them after they were freed. The wait is refused before it is queued, naming joined=; an
    engine the capture joins waits, and its buffers are held, as before."""
    other = Engine(engine.device)
    try:
        buf = other.zeros(np.uint32, 4, label="other's")
        launch = increment(other, 4).set(buf, 4)
        fork, back = Event(engine, timing=False), Event(other, timing=False)
        other.synchronize()  # its buffer's zeros are written before the graph runs on the other stream

        def unjoined():
            fork.record()
            other.wait(fork)

        with pytest.raises(CaptureError, match=r"would wait on a graph being captured .* joined=\[\.\.\.\]"):
            Graph(engine, unjoined)

        def forked():
            fork.record()
            other.wait(fork)
            launch()
            back.record()
            engine.wait(back)

        graph = Graph(engine, forked, joined=[other])
        graph.launch()
        engine.synchronize()
        assert other.dtoh(buf, np.uint32).tolist() == [1] * 4
        buf.free()
        with pytest.raises(ValueError, match=r"Graph refuses to run.*other's"):
            graph.launch()
    finally:
        other.close()


class Produced:
    """An array of `buf`'s memory whose interface names `stream` as its producer's (v3), as a
    CuPy array's does (read by hand: reading the buffer's own would export it)."""

    def __init__(self, buf: DeviceBuffer, stream: int):
        self.__cuda_array_interface__ = {"shape": (buf.len,), "typestr": "<u4", "data": (buf.ptr, False),
                                         "version": 3, "stream": stream}


def test_an_adoption_whose_wait_would_cross_a_capture_is_refused_before_it_is_queued(engine):
    """from_cuda_array(obj, engine) waits on the producer's stream the interface names: inside a
    capture of the engine's stream, a wait on a stream not of the capture was made (CUDA refuses
    it and invalidates the capture), and inside a capture of the producer's stream the wait
    pulled the engine's stream into it. A CaptureError now, before anything is queued, each
    capture abandoned cleanly; adopted before capturing, the array serves the graph, and a wait
    on a stream forked into the engine's capture joins it back, as CUDA allows."""
    other = Engine(engine.device)
    try:
        buf = engine.zeros(np.uint32, 4)
        launch = increment(engine, 4)
        for stream, named in ((other.stream_handle, "stream 0x"), (1, "the legacy default stream")):
            with pytest.raises(CaptureError, match=f"Produced's __cuda_array_interface__ names {named}.*adopt the "
                                                   "array before capturing"):
                Graph(engine, lambda stream=stream: DeviceBuffer.from_cuda_array(Produced(buf, stream), engine))
            assert not engine.capturing
        with pytest.raises(CaptureError, match="which is being captured and .* the wait would pull this stream into"):
            Graph(other, lambda: DeviceBuffer.from_cuda_array(Produced(buf, other.stream_handle), engine))
        assert not engine.capturing and not other.capturing

        adopted = DeviceBuffer.from_cuda_array(Produced(buf, other.stream_handle), engine)  # before: waits eagerly
        graph = Graph(engine, lambda: launch(adopted, 4))
        graph.launch()
        assert engine.dtoh(buf, np.uint32).tolist() == [1] * 4

        fork = Event(engine, timing=False)

        def forked():
            fork.record()
            other.wait(fork)  # other's stream in the capture from here
            DeviceBuffer.from_cuda_array(Produced(buf, other.stream_handle), engine)  # its wait joins other back
            launch(adopted, 4)

        graph = Graph(engine, forked, joined=[other])
        graph.launch()
        assert engine.dtoh(buf, np.uint32).tolist() == [2] * 4
    finally:
        other.close()


def test_launch_refuses_after_its_buffer_is_freed_until_rebound(engine):
    buf = engine.zeros(np.uint32, 4, label="victim")
    launch = increment(engine, 4).set(buf, 4)
    launch()
    buf.free()
    bystander = engine.htod(np.full(4, 9, np.uint32), np.uint32)
    with pytest.raises(ValueError, match="victim"):
        launch()
    assert engine.dtoh(bystander, np.uint32).tolist() == [9] * 4
    fresh = engine.zeros(np.uint32, 4)
    launch(fresh, 4)
    assert engine.dtoh(fresh, np.uint32).tolist() == [1] * 4


def test_launches_of_a_closed_engine_refuse_to_run(engine):
    """A closed engine's stream is destroyed, and the driver may hand its handle to the next
    stream: a launch prepared on it must not reach the driver."""
    with Engine() as closing:
        buf = closing.zeros(np.uint32, 4)
        launch = increment(closing, 4).set(buf, 4)
        launch()
    with pytest.raises(ValueError, match="Engine"):
        launch()
    with pytest.raises(ValueError, match="Engine"):
        launch(buf, 4)


def test_a_handed_out_stream_or_memory_outlives_close_and_free_while_its_reader_lives(engine):
    """An Engine borrowing another's stream keeps that engine: the owner's close() finishes its work
    and refuses its own use, but destroyed the stream at once, under the borrower's next work; now
    the stream goes once the borrower lets go. Likewise memory whose __cuda_array_interface__ was
    read (here by an adoption, which keeps the buffer as torch.as_tensor does): free() refuses
    memra's use of the buffer, and the memory stays the reader's, not handed to the next
    allocation."""
    owner = Engine(engine.device)
    borrower = Engine(engine.device, stream=owner)
    owner.close()
    with pytest.raises(ValueError, match="closed"):
        owner.zeros(np.uint32, 4)
    buf = borrower.zeros(np.uint32, 4)
    increment(borrower, 4)(buf, 4)
    assert borrower.dtoh(buf).tolist() == [1] * 4
    borrower.close()
    exported = engine.htod(np.full(4, 5, np.uint32), label="exported")
    reader = DeviceBuffer.from_cuda_array(exported)
    exported.free()
    with pytest.raises(ValueError, match="used after free"):
        exported.ptr
    fresh = engine.htod(np.full(4, 9, np.uint32))
    assert fresh.ptr != reader.ptr and engine.dtoh(reader).tolist() == [5] * 4


def test_launch_before_any_arguments_is_refused(engine):
    with pytest.raises(ValueError, match="no arguments yet"):
        increment(engine, 4)()


def test_freeing_a_view_or_its_parent_poisons_a_launch_bound_to_the_view(engine):
    parent = engine.zeros(np.uint32, 8, label="parent")
    launch = increment(engine, 2).set(parent.view(2, 2), 2)
    launch()
    parent.free()
    with pytest.raises(ValueError, match="parent"):
        launch()


def test_unloaded_module_refuses_its_launches_and_graphs_and_is_reloaded(engine):
    module = engine.load_ptx("probe")
    buf = engine.zeros(np.uint32, 4)
    launch = module.kernel("probe_increment").prepare(["ptr", "u32"], grid=1, block=32).set(buf, 4)
    graph = Graph(engine, launch)
    module.free()
    with pytest.raises(ValueError, match="Module"):
        launch()
    with pytest.raises(ValueError, match="Module"):
        graph.launch()
    with pytest.raises(ValueError, match="after free"):
        module.kernel("probe_increment")
    reloaded = engine.load_ptx("probe")
    assert reloaded is not module
    increment(engine, 4)(buf, 4)
    assert engine.dtoh(buf, np.uint32).tolist() == [1] * 4


# -- 2. pointer tables hold what they point at ---------------------------------------------

def test_pointer_table_outlives_its_cache_and_refuses_once_a_length_is_freed(engine, spec):
    cache = Cache.allocate(engine, [True, False, True], capacity=16)
    bufs = StreamBufs(engine, Geometry(2, 1))
    table = kv_len_ptr_table(engine, cache, bufs.pos_ctr_d)
    lengths = [kv.len_d for kv in cache.kv if kv is not None]
    alive = [weakref.ref(buf) for buf in lengths]
    del cache, lengths
    gc.collect()
    assert all(ref() is not None for ref in alive), "the table must hold the lengths it names"
    bystanders = [engine.htod([1234], np.int32) for _ in range(8)]
    engine.copy_htod(bufs.pos_start_d, [5])
    engine.copy_htod(bufs.ctl_d, [-1, -1, 0, 2])
    spec.rollback(bufs, table)
    assert [int(engine.dtoh(ref())[0]) for ref in alive] == [7, 7]
    assert [int(engine.dtoh(b)[0]) for b in bystanders] == [1234] * 8

    launch = spec.prepare_rollback(bufs, table)
    alive[0]().free()
    for use in (lambda: spec.rollback(bufs, table), launch, lambda: table.ptr):
        with pytest.raises(ValueError, match="len_d"):
            use()
    assert [int(engine.dtoh(b)[0]) for b in bystanders] == [1234] * 8


def test_rollback_refuses_a_bare_u64_buffer(engine, spec):
    bufs = StreamBufs(engine, Geometry(2, 1))
    with pytest.raises(TypeError, match="PointerTable"):
        spec.rollback(bufs, engine.htod([bufs.pos_ctr_d.ptr], np.uint64))


def test_toy_tables_hold_the_layers(engine):
    lm = toy.ToyLM(engine, toy.ToyModel(kv_mask=(True, False)), capacity=8)
    assert isinstance(lm.data_ptrs_d, PointerTable) and isinstance(lm.len_ptrs_d, PointerTable)
    assert lm.data_ptrs_d.targets[0] is lm.target.kv[0].data_d and lm.data_ptrs_d.targets[1] is None


# -- 3. pinned buffers and freed burst buffers ---------------------------------------------

def test_copy_into_freed_pinned_memory_is_refused(engine):
    pinned = engine.pinned(np.uint32, 4)
    src = engine.htod([1, 2, 3, 4], np.uint32)
    pinned.free()
    with pytest.raises(ValueError, match="after free"):
        engine.copy_dtoh_async(pinned, src)
    with pytest.raises(ValueError, match="after free"):
        pinned.ptr
    with pytest.raises(ValueError, match="after free"):
        pinned.read()


def test_a_mapped_buffers_views_hold_its_memory_and_reads_copy_a_range(engine):
    """What the device wrote into mapped memory, read back as a copy of any range (bounds outside
    the buffer refused by name) and seen through live; a view (a slice of one too) holds the
    buffer, so free() refuses while one is held (a numpy view cannot refuse to run), and every
    read and view is refused after it."""
    from memra_cuda.driver import MappedBuffer
    mapped = MappedBuffer(engine, np.uint32, 6)
    engine.copy_htod(mapped.device, [10, 11, 12, 13, 14, 15])
    engine.synchronize()
    assert mapped.read().tolist() == [10, 11, 12, 13, 14, 15]
    assert mapped.read(2, 5).tolist() == [12, 13, 14] and mapped.read(6).tolist() == []
    got = mapped.read(1, 3)
    got[:] = 0  # a copy: the memory is untouched
    assert mapped.read(1, 3).tolist() == [11, 12]
    for start, stop, what in ((7, None, "start"), (0, 7, "stop"), (4, 3, "stop"), (-1, None, "start")):
        with pytest.raises(ValueError, match=f"read's {what}"):
            mapped.read(start, stop)
    view = mapped.live
    assert view.tolist() == [10, 11, 12, 13, 14, 15]
    view[0] = 99  # the memory itself
    assert mapped.read(0, 1).tolist() == [99]
    kept = view[4:]
    del view
    with pytest.raises(ValueError, match="still viewed"):
        mapped.free()
    del kept
    mapped.free()
    for use in (lambda: mapped.read(0, 1), lambda: mapped.live):
        with pytest.raises(ValueError, match="after free"):
            use()


@pytest.mark.parametrize("mode", ["graph", "overlap"])
def test_burst_graph_refuses_to_replay_after_its_buffers_are_freed(engine, spec, mode):
    model = toy.ToyModel(seed=3)
    lm = toy.ToyLM(engine, model, kv_capacity(3, 40, Geometry(2, 4), overlap=True))
    bufs = StreamBufs(engine, Geometry(2, 4))
    stream = lm.round_stream(bufs, kernels=spec)
    lm.prefill(bufs, [1, 2, 3])
    got = stream.generate(20, mode=mode).tolist()
    assert got == toy.target_greedy(model, [1, 2, 3], 20)
    lm.prefill(bufs, [1, 2, 3])
    engine.synchronize()
    bufs.free()
    with pytest.raises(ValueError, match="which was freed|after free"):
        stream.generate(20, mode=mode)
    with pytest.raises(ValueError, match="ring_d|readback slot|vtok_d|pend_d|brk_d|acc_d|ctl_d|pos_"):
        stream.graph.launch()


# -- 4. captures never see pageable host memory ---------------------------------------------

@pytest.mark.parametrize("what", ["copy_htod", "htod", "set_stop", "reset", "pointer table"])
def test_host_to_device_copy_inside_a_capture_is_refused(engine, what):
    buf = engine.htod([5, 6, 7], np.uint32)
    bufs = StreamBufs(engine, Geometry(1, 1))
    uploads = {"copy_htod": lambda: engine.copy_htod(buf, [1, 2, 3]),
               "htod": lambda: engine.htod([1, 2, 3], np.uint32),
               "set_stop": lambda: bufs.set_stop(eos=3, budget=9),
               "reset": lambda: bufs.reset(1, 2),
               "pointer table": lambda: PointerTable(engine, [buf])}
    with pytest.raises(CaptureError, match="pageable host memory|cannot be allocated inside a graph capture"):
        Graph(engine, uploads[what])
    assert not engine.capturing
    engine.copy_htod(buf, [1, 2, 3])  # the engine still works, outside the capture
    assert engine.dtoh(buf, np.uint32).tolist() == [1, 2, 3]


def test_set_u32_and_readback_copies_are_captured(engine):
    buf = engine.zeros(np.uint32, 2)
    pinned = engine.pinned(np.uint32, 2)
    graph = Graph(engine, lambda: (engine.set_u32(buf, 1, 77), engine.copy_dtoh_async(pinned, buf)))
    graph.launch()
    engine.finish_readback()
    assert pinned.read().tolist() == [0, 77]


# -- 5. events -------------------------------------------------------------------------------

def test_destroyed_event_is_refused_and_leaves_the_next_event_alone(engine):
    dead = Event(engine)
    dead.free()
    live = Event(engine)
    for use in (dead.record, dead.synchronize, lambda: engine.wait(dead), lambda: live.elapsed_ms(dead)):
        with pytest.raises(ValueError, match="after free"):
            use()
    live.record()
    live.synchronize()


@pytest.mark.parametrize("mode", ["GLOBAL", "THREAD_LOCAL", "RELAXED"])
def test_memory_freed_inside_someone_elses_capture_leaves_that_capture_whole(engine, mode, caplog):
    """The collector frees memra's memory whenever Python allocates, inside another library's
    stream capture too (torch.cuda.graph's default mode is global): the free must neither fail
    nor invalidate that capture, in any mode (a broken capture fails its next call, a GEMM's
    "operation failed due to a previous error during capture")."""
    drv = driver()
    ctx, counter = engine.ctx, engine.zeros(np.uint32, 1)
    doomed = [engine.zeros(np.uint8, 1 << 20), engine.pinned(np.uint8, 4096), Event(engine)]
    gone = [weakref.finalize(handle, lambda: None) for handle in doomed]
    engine.synchronize()
    theirs = ctx.call("cuStreamCreate", 1)  # non-blocking: someone else's stream
    try:
        ctx.call("cuStreamBeginCapture", theirs, getattr(drv.CUstreamCaptureMode, f"CU_STREAM_CAPTURE_MODE_{mode}"))
        ctx.call("cuMemsetD32Async", counter.ptr, 7, 1, theirs)
        del doomed
        gc.collect()
        ctx.call("cuMemsetD32Async", counter.ptr, 9, 1, theirs)  # the capture still takes work
        graph = ctx.call("cuStreamEndCapture", theirs)
        run = ctx.call("cuGraphInstantiate", graph, 0)
        ctx.call("cuGraphLaunch", run, theirs)
        ctx.call("cuStreamSynchronize", theirs)
        ctx.call("cuGraphExecDestroy", run)
        ctx.call("cuGraphDestroy", graph)
    finally:
        ctx.call("cuStreamDestroy", theirs)
    assert not any(g.alive for g in gone), "a handle outlived its last reference"
    assert engine.dtoh(counter).tolist() == [9]
    assert not [r.message for r in caplog.records if "cleanup failed" in r.message]


# -- 6. the capacity check cannot be switched off by omission -------------------------------

def test_capacity_comes_from_the_rollback_tables(engine, spec):
    """No `caches` argument to forget: a burst that could write past the tables' capacity is
    refused before it is issued, whether at the start or after some bursts."""
    model = toy.ToyModel(seed=9)
    lm = toy.ToyLM(engine, model, capacity=24)
    bufs = StreamBufs(engine, Geometry(4, 4))
    stream = lm.round_stream(bufs, kernels=spec)
    assert stream.capacity == 24
    rounds, readbacks = stream.rounds, engine.readbacks
    lm.prefill(bufs, list(range(10)))
    with pytest.raises(CapacityError, match="24 entries"):
        stream.generate(100)  # 9 + one burst of 20 > 24
    assert (stream.rounds, engine.readbacks) == (rounds, readbacks)
    lm.prefill(bufs, [1, 2, 3])
    with pytest.raises(CapacityError, match="24 entries"):
        stream.generate(100)  # the first burst fits, a later one not
    lengths = lm.target.lengths(engine) + lm.draft.lengths(engine)
    assert all(n is None or n <= 24 for n in lengths), lengths


def test_round_stream_refuses_tables_without_the_position_and_bare_tables(engine, spec):
    lm = toy.ToyLM(engine, toy.ToyModel(), capacity=64)
    bufs = StreamBufs(engine, Geometry(2, 2))
    draft_d, pred_d = engine.zeros(np.uint32, 2), engine.zeros(np.uint32, 3)
    wiring = dict(kernels=spec, draft_chain=lambda: None, verify_trunk=lambda: None, draft_d=draft_d,
                  acceptance=Greedy(pred_d))
    with pytest.raises(ValueError, match="pos_ctr_d"):
        RoundStream(bufs, rollback_tables=[kv_len_ptr_table(engine, lm.target)], **wiring)
    with pytest.raises(TypeError, match="PointerTable"):
        RoundStream(bufs, rollback_tables=[engine.htod([bufs.pos_ctr_d.ptr], np.uint64)], **wiring)
    with pytest.raises(TypeError):
        RoundStream(bufs, rollback_tables=[kv_len_ptr_table(engine, lm.target, bufs.pos_ctr_d)], caches=[],
                    **wiring)


# -- 7. bad input: a clear exception before anything is queued ------------------------------

BAD_INPUT = {
    "htod object": (ValueError, lambda e: e.htod(np.array([1, "x"], dtype=object))),
    "htod unicode": (ValueError, lambda e: e.htod(np.array(["12"]))),
    "htod complex": (ValueError, lambda e: e.htod(np.array([1 + 2j]))),
    "alloc object": (ValueError, lambda e: e.alloc(object, 4)),
    "copy complex into f32": (ValueError, lambda e: e.copy_htod(e.alloc(np.float32, 1), np.array([1j]))),
    "view 1.5": (TypeError, lambda e: e.zeros(np.uint32, 4).view(1.5, 2)),
    "negative length": (ValueError, lambda e: DeviceBuffer(0, np.uint32, -5)),
    "negative length at an address": (ValueError, lambda e: DeviceBuffer(0x1000, np.uint32, -5)),
    "f32 argument from a string": (TypeError, lambda e: KernelArgs(["f32"]).set("1.5")),
    "f32 argument out of range": (ValueError, lambda e: KernelArgs(["f32"]).set(1e39)),
    "declared sizes differ from the kernel's": (
        ValueError, lambda e: e.load_ptx("probe").kernel("probe_increment").prepare(["ptr"])),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_a_clear_exception(engine, case):
    kind, call = BAD_INPUT[case]
    before = engine.readbacks, engine.syncs
    with pytest.raises(kind):
        call(engine)
    assert (engine.readbacks, engine.syncs) == before


def test_float_buffers_are_not_token_buffers(engine, spec):
    bufs = StreamBufs(engine, Geometry(2, 1))
    with pytest.raises(ValueError, match="integer"):
        spec.prepare_accept_greedy(bufs, engine.alloc(np.float32, 3))
    with pytest.raises(ValueError, match="integer"):
        spec.prepare_assemble_verify(bufs, engine.alloc(np.float32, 2))


def test_buffers_of_another_engine_are_refused(engine, spec):
    with Engine(engine.device) as other:
        foreign = other.zeros(np.uint32, 4, label="other's")
        mine = engine.zeros(np.uint32, 4)
        for use in (lambda: increment(engine, 4)(foreign, 4),
                    lambda: engine.dtoh(foreign),
                    lambda: engine.copy_htod(foreign, [1]),
                    lambda: engine.set_u32(foreign, 0, 1),
                    lambda: engine.copy_dtoh_async(other.pinned(np.uint32, 4), mine),
                    lambda: PointerTable(engine, [foreign]),
                    lambda: spec.prepare_accept_greedy(StreamBufs(other, Geometry(2, 1)), mine)):
            with pytest.raises(ValueError, match="belongs to|pinned memory of"):
                use()
        assert other.dtoh(foreign, np.uint32).tolist() == [0] * 4


@pytest.mark.parametrize("kwargs, kind", [
    (dict(max_new_tokens=None), TypeError), (dict(max_new_tokens=-1), ValueError),
    (dict(max_new_tokens=2**31), ValueError), (dict(max_new_tokens=1.5), TypeError),
    (dict(max_new_tokens=5, start_pos=-1), ValueError), (dict(max_new_tokens=5, eos=-3), ValueError),
    (dict(max_new_tokens=5, mode="fast"), ValueError)])
def test_generate_checks_its_arguments_before_queueing(engine, spec, kwargs, kind):
    """The start position is the reset's now (generate starts where bufs.reset left the row):
    a bad one is refused there, before generate is reached."""
    lm = toy.ToyLM(engine, toy.ToyModel(), capacity=128)
    bufs = StreamBufs(engine, Geometry(2, 2))
    stream = lm.round_stream(bufs, kernels=spec)
    lm.prefill(bufs, [1, 2])
    engine.synchronize()
    args = dict(kwargs)
    start = args.pop("start_pos", None)
    before = stream.rounds, engine.readbacks
    with pytest.raises(kind):
        if start is not None:
            bufs.reset(2, start)
        stream.generate(args.pop("max_new_tokens"), **args)
    assert (stream.rounds, engine.readbacks) == before


# -- 8. a fault is remembered, named, and cleanup still works -------------------------------

FAULT_SCRIPT = """
import logging, numpy as np
from memra_cuda import Engine
from memra_cuda.errors import CudaFault
engine = Engine()
buf = engine.htod([1, 2, 3], np.uint32)
view = buf.view(1, 1)
pinned = engine.pinned(np.uint32, 3)
launch = engine.load_ptx("probe").kernel("probe_increment").prepare(["ptr", "u32"], grid=1, block=32)
launch(0x10, 1)  # an address nothing owns: the kernel faults
try:
    engine.synchronize()
except CudaFault as exc:
    first = exc
assert first.name == "CUDA_ERROR_ILLEGAL_ADDRESS", first
assert "unusable until the process restarts" in str(first), first
for call in (lambda: engine.htod([1], np.uint32), lambda: engine.dtoh(buf), lambda: launch(buf, 3),
             lambda: Engine(engine.device).zeros(np.uint32, 1)):
    try:
        call()
    except CudaFault as exc:
        assert exc.name == "CUDA_ERROR_ILLEGAL_ADDRESS" and "faulted earlier" in str(exc), exc
    else:
        raise AssertionError("a call after the fault went through")
engine.close()
engine.close()
buf.free()
pinned.free()
print("handled", first.name)
"""


def test_fault_is_named_remembered_and_cleanup_never_raises(engine):
    """In a fresh interpreter: the main test process must keep a healthy context."""
    run = run_script(FAULT_SCRIPT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "handled CUDA_ERROR_ILLEGAL_ADDRESS"
    stray = [line for line in run.stderr.splitlines() if not line.startswith("memra_cuda:")]
    assert stray == [], run.stderr


# -- 9. the toy's prefill keeps its prompt on the device ------------------------------------

def test_prefill_back_to_back_without_waiting(engine):
    """Prompts uploaded and prefilled one after another with nothing waited for: the prompt
    buffer the kernel reads is the model's own, so each prefill reads its own tokens (under
    `make sanitize`, memcheck sees no access to freed memory)."""
    model = toy.ToyModel(seed=17, kv_mask=(True, False, True))
    lm = toy.ToyLM(engine, model, capacity=4096)
    bufs = StreamBufs(engine, Geometry(2, 2))
    rng = np.random.default_rng(9)
    prompts = [[int(t) for t in rng.integers(0, model.vocab, n)] for n in (3000, 1, 700, 2049)]
    for prompt in prompts:
        lm.prefill(bufs, prompt)
    mirror = toy_reference.NumpyRoundStream(model, 2, 2, capacity=4096)
    n = mirror.prefill(prompts[-1])
    for layer, (kv, want) in enumerate(zip(lm.target.kv, mirror.tgt)):
        if kv is not None:
            assert engine.dtoh(kv.data_d)[:n].tolist() == want[:n].tolist(), f"layer {layer}"
    assert engine.dtoh(lm.draft.kv[0].data_d)[:n].tolist() == mirror.draft_kv[:n].tolist()
    assert lm.target.lengths(engine) == [n, None, n]


# -- threads ---------------------------------------------------------------------------------

def test_eight_threads_allocate_copy_and_free_on_one_engine(engine):
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(200):
                values = rng.integers(0, 2**32, int(rng.integers(1, 5000)), dtype=np.uint32)
                with engine.htod(values, np.uint32) as buf:
                    assert np.array_equal(engine.dtoh(buf, np.uint32), values)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []

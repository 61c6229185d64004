"""The driver layer against a real GPU: copies, buffer lifetimes, kernels, graphs, engines.

Every test takes the session `engine` fixture, so without a GPU they all skip with the reason.
Tests that compare device free memory call gc.collect() first, so buffers other tests left as
cyclic garbage are not freed in the middle of a measurement.
"""
from __future__ import annotations

import gc
import logging
import weakref

import numpy as np
import pytest

from memra_cuda import DeviceBuffer, Engine, Graph
from memra_cuda.errors import CudaError
from memra_cuda.driver.buffer import _device_of
from memra_cuda.driver.errors import call
from memra_cuda.driver.module import Module
from memra_cuda.driver.signature import Signature
from memra_cuda.kernels.signatures import SIGNATURES, load
from run_python import run_script

pytestmark = pytest.mark.gpu

BLOCK = 128
MiB = 1 << 20
# cuMemAlloc carves small requests out of 2 MiB pages that the driver may keep mapped after
# the last allocation in them is freed, so free memory is compared with this slack (one page)
# rather than exactly: these tests were written before they could be run on a GPU, and a
# granularity artefact must not read as a leak. A leak that matters still shows: the cycle
# test frees about a thousand 1 MiB buffers each way of letting go, and checks every one was
# collected.
PAGE_SLACK = 2 * MiB

ALL_DTYPES = [np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64, np.int64,
              np.float16, np.float32, np.float64]


def free_memory(engine: Engine) -> int:
    gc.collect()
    return engine.mem_info()[0]


def counters(engine: Engine) -> tuple[int, int]:
    return engine.readbacks, engine.syncs


def random_bits(rng: np.random.Generator, dtype, n: int) -> np.ndarray:
    """n random elements of any dtype, every bit pattern allowed (NaNs and infinities too)."""
    return rng.integers(0, 256, n * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype)


def random_u32(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random u32 values with 0xFFFFFFFF sprinkled in, so an increment must wrap to 0."""
    values = rng.integers(0, 2**32, n, dtype=np.uint32)
    values[::97] = 0xFFFFFFFF
    return values


def increment(engine: Engine, n: int):
    """probe_increment (x[i] += 1 for i < n) prepared with enough blocks for n elements."""
    kernel = engine.load_ptx("probe").kernel("probe_increment")
    return kernel.prepare(["ptr", "u32"], grid=-(-n // BLOCK), block=BLOCK)


def plus(values: np.ndarray, k: int) -> np.ndarray:
    """values + k with u32 wrap-around, as the kernel computes it."""
    return values + np.uint32(k)


def assert_same(actual: np.ndarray, expected: np.ndarray) -> None:
    """Equal dtype, shape and bits (so NaN payloads and -0.0 count)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert actual.tobytes() == expected.tobytes()


def no_cleanup_warnings(caplog) -> None:
    """Finalisers log instead of raising, so a failed cuMemFree only shows up in the log."""
    assert [r.getMessage() for r in caplog.records if r.name == "memra_cuda"] == []


# -- copies -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 1001])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_round_trip_every_dtype(engine, dtype, n):
    host = random_bits(np.random.default_rng(n), dtype, n)
    buf = engine.htod(host)
    assert (buf.dtype, buf.len, buf.nbytes) == (np.dtype(dtype), n, host.nbytes)
    assert_same(engine.dtoh(buf), host)


TYPED = {  # name: (dtype, smallest, largest, a plain list that must convert exactly)
    "u32": (np.uint32, 0, 2**32 - 1, [0, 2**32 - 1, 1000]),
    "i32": (np.int32, -(2**31), 2**31 - 1, [-(2**31), 2**31 - 1, 0]),
    "u64": (np.uint64, 0, 2**64 - 1, [0, 2**63 - 1, 1000]),
}


def typed_copies(engine: Engine, name: str):
    dtype = TYPED[name][0]
    return (lambda values: engine.htod(values, dtype)), (lambda buf: engine.dtoh(buf, dtype))


@pytest.mark.parametrize("name", list(TYPED))
def test_typed_round_trip(engine, name):
    dtype, lo, hi, plain = TYPED[name]
    htod, dtoh = typed_copies(engine, name)
    values = np.random.default_rng(3).integers(lo, hi, 500, dtype=dtype, endpoint=True)
    values[:2] = lo, hi
    assert_same(dtoh(htod(values)), values)
    assert_same(dtoh(htod(plain)), np.array(plain, dtype))


def test_htod_u64_python_list_spanning_the_int64_boundary(engine):
    values = [1, 2**63, 2**64 - 1]
    assert_same(engine.dtoh(engine.htod(values, np.uint64), np.uint64), np.array(values, np.uint64))


@pytest.mark.parametrize(
    "name, values",
    [("u32", [-1]), ("u32", [2**32]), ("u32", [1.5]), ("i32", [2**31]), ("i32", [-(2**31) - 1]),
     ("u64", [-1])],
)
def test_typed_htod_refuses_values_that_do_not_fit(engine, name, values):
    with pytest.raises(ValueError):
        typed_copies(engine, name)[0](values)


def test_copy_htod_at_offset(engine):
    buf = engine.zeros(np.uint32, 10)
    engine.copy_htod(buf, [7, 8, 9], start=4)
    engine.copy_htod(buf, [5, 6, 7], start=7)  # exactly up to the end
    assert_same(engine.dtoh(buf, np.uint32), np.array([0, 0, 0, 0, 7, 8, 9, 5, 6, 7], np.uint32))


@pytest.mark.parametrize("start, count", [(8, 3), (0, 11), (-1, 1)])
def test_copy_htod_overrun(engine, start, count):
    buf = engine.zeros(np.uint32, 10)
    with pytest.raises(ValueError):
        engine.copy_htod(buf, np.ones(count, np.uint32), start=start)
    assert_same(engine.dtoh(buf, np.uint32), np.zeros(10, np.uint32))


# -- zeroed allocations, set_u32, memset ----------------------------------------------------


@pytest.mark.parametrize("dtype", [np.uint32, np.int32])
def test_zeroed_allocations(engine, dtype):
    n = 4099
    # Dirty memory of the same size first: the allocator is likely to hand it back.
    engine.htod(np.full(n, 0xFFFFFFFF, np.uint32)).free()
    buf = engine.zeros(dtype, n)
    assert_same(engine.dtoh(buf), np.zeros(n, dtype))


def test_set_u32(engine):
    buf = engine.zeros(np.uint32, 8)
    engine.set_u32(buf, 3, 0xDEADBEEF)
    engine.set_u32(buf, 7, 0xFFFFFFFF)
    assert_same(engine.dtoh(buf, np.uint32), np.array([0, 0, 0, 0xDEADBEEF, 0, 0, 0, 0xFFFFFFFF], np.uint32))
    signed = engine.zeros(np.int32, 2)
    engine.set_u32(signed, 1, -5)
    assert_same(engine.dtoh(signed, np.int32), np.array([0, -5], np.int32))


@pytest.mark.parametrize(
    "dtype, index, value",
    [(np.uint32, 8, 1), (np.uint32, -1, 1), (np.uint32, 0, 2**32), (np.uint32, 0, -1),
     (np.uint64, 0, 1), (np.uint16, 0, 1)],
    ids=["index-past-end", "negative-index", "value-too-big", "negative-into-u32", "u64-buffer", "u16-buffer"],
)
def test_set_u32_refuses(engine, dtype, index, value):
    buf = engine.alloc(dtype, 8, zeroed=True)
    with pytest.raises(ValueError):
        engine.set_u32(buf, index, value)
    assert_same(engine.dtoh(buf), np.zeros(8, dtype))


@pytest.mark.parametrize(
    "dtype, value",
    [(np.uint8, 0xAB), (np.int8, -3), (np.uint16, 0xBEEF), (np.uint32, 0xDEADBEEF), (np.int32, -2),
     (np.float32, 0), (np.uint64, 0), (np.float64, 0)],
)
def test_memset(engine, dtype, value):
    n = 1001
    buf = engine.htod(random_bits(np.random.default_rng(5), dtype, n))
    engine.memset(buf, value)
    assert_same(engine.dtoh(buf), np.full(n, value, dtype))


@pytest.mark.parametrize("dtype", [np.uint64, np.float64])
def test_memset_of_wide_elements_only_zero(engine, dtype):
    with pytest.raises(ValueError):
        engine.memset(engine.alloc(dtype, 4), 1)


# -- views and foreign pointers -----------------------------------------------------------


def test_views_read_and_write_the_parent(engine):
    expected = np.arange(16, dtype=np.uint32)
    parent = engine.htod(expected, np.uint32)
    view = parent.view(4, 8)
    engine.copy_htod(view, [100, 101, 102, 103], start=2)
    expected[6:10] = [100, 101, 102, 103]
    engine.set_u32(view, 0, 7)
    expected[4] = 7
    assert_same(engine.dtoh(parent, np.uint32), expected)
    assert_same(engine.dtoh(view, np.uint32), expected[4:12])
    assert_same(engine.dtoh(view.view(1, 3), np.uint32), expected[5:8])
    with pytest.raises(ValueError):  # bounded by the view, not by the parent
        engine.copy_htod(view, np.zeros(9, np.uint32))


def test_foreign_pointer_borrows_without_freeing(engine):
    original = np.random.default_rng(11).integers(0, 2**32, 64, dtype=np.uint32)
    owner = engine.htod(original, np.uint32)
    owner_alive = weakref.ref(owner)
    foreign = DeviceBuffer.wrap(owner.ptr, np.uint32, len(owner), engine=engine, keepalive=owner)
    assert not foreign.owns_memory and owner.owns_memory
    del owner
    gc.collect()
    assert owner_alive() is not None, "keepalive must hold the memory's owner"

    assert_same(engine.dtoh(foreign, np.uint32), original)
    engine.copy_htod(foreign, [1, 2, 3], start=10)
    expected = original.copy()
    expected[10:13] = [1, 2, 3]
    owner = owner_alive()  # taken back before the wrapper goes, whatever free() releases
    foreign.free()
    foreign.free()
    with pytest.raises(ValueError):
        foreign.ptr
    assert not owner.freed
    assert_same(engine.dtoh(owner, np.uint32), expected)  # the memory outlived the wrapper


# -- use after free, double free, alloc/free cycles ----------------------------------------

USES_AFTER_FREE = {
    "dtoh": lambda engine, buf: engine.dtoh(buf),
    "copy_htod": lambda engine, buf: engine.copy_htod(buf, [1]),
    "set_u32": lambda engine, buf: engine.set_u32(buf, 0, 1),
    "memset": lambda engine, buf: engine.memset(buf, 0),
    "view": lambda engine, buf: buf.view(0, 1),
    "launch": lambda engine, buf: increment(engine, len(buf))(buf, len(buf)),
}


@pytest.mark.parametrize("use", list(USES_AFTER_FREE))
def test_use_after_free_is_value_error(engine, use):
    buf = engine.alloc(np.uint32, 4)
    buf.free()
    before = counters(engine)
    with pytest.raises(ValueError, match="after free"):
        USES_AFTER_FREE[use](engine, buf)
    assert counters(engine) == before


@pytest.mark.alone
def test_double_free_frees_once(engine):
    size = 256 * MiB  # large, so that freeing it is plainly visible in the driver's numbers
    before = free_memory(engine)
    big = engine.alloc(np.uint8, size)
    allocated = free_memory(engine)
    big.free()
    once = free_memory(engine)
    big.free()
    twice = free_memory(engine)
    assert before - allocated >= size
    assert twice == once
    assert abs(once - before) <= PAGE_SLACK


COLLECT_EVERY = 256  # gc.collect() costs tens of ms in a full test process

# (dtype, length) pairs cycled through: one element, odd sizes, and 1 MiB.
CYCLE_SIZES = [(np.uint32, 1), (np.uint8, 1), (np.float64, 12345), (np.uint8, MiB), (np.uint32, MiB // 4)]


def drop_buffer(engine: Engine, i: int) -> weakref.ref:
    """Allocate buffer i and let go of it in one of four ways; return a weak reference to it."""
    dtype, length = CYCLE_SIZES[(i // 4) % len(CYCLE_SIZES)]
    how = i % 4
    if how == 0:
        with engine.alloc(dtype, length) as buf:
            pass
    elif how == 1:
        buf = engine.alloc(dtype, length)
        buf.free()
    elif how == 2:
        buf = engine.alloc(dtype, length)  # freed by its finaliser when the name goes
    else:
        buf = engine.alloc(dtype, length)
        cycle = [buf]
        cycle.append(cycle)  # only the cyclic collector can free this one
    return weakref.ref(buf)


def churn(engine: Engine, count: int) -> list[weakref.ref]:
    """count alloc/free cycles, running the cyclic collector every COLLECT_EVERY."""
    refs = []
    for i in range(count):
        refs.append(drop_buffer(engine, i))
        if i % COLLECT_EVERY == COLLECT_EVERY - 1:
            gc.collect()
    return refs


@pytest.mark.alone
def test_alloc_free_cycles_return_all_memory(engine, caplog):
    # A warm-up at the same peak (up to COLLECT_EVERY / 4 cyclic buffers awaiting collection),
    # so pages the driver keeps for small allocations are mapped before the baseline.
    churn(engine, 2 * COLLECT_EVERY)
    before = free_memory(engine)
    with caplog.at_level(logging.WARNING, logger="memra_cuda"):
        refs = churn(engine, 10_000)
        after = free_memory(engine)
    no_cleanup_warnings(caplog)
    assert sum(ref() is not None for ref in refs) == 0, "some buffers were never collected"
    assert abs(after - before) <= PAGE_SLACK, f"free memory drifted by {before - after} bytes"


# -- counters -----------------------------------------------------------------------------


def test_readbacks_and_syncs_are_counted_exactly(engine):
    start = counters(engine)
    buf = engine.htod([1, 2, 3], np.uint32)
    engine.copy_htod(buf, [4], start=0)
    increment(engine, 3)(buf, 3)
    assert counters(engine) == start, "uploads and launches must not count as waits"
    engine.dtoh(buf)
    assert counters(engine) == (start[0] + 1, start[1])
    engine.dtoh(buf, np.uint32)
    assert counters(engine) == (start[0] + 2, start[1])
    engine.synchronize()
    assert counters(engine) == (start[0] + 2, start[1] + 1)
    engine.finish_readback()
    assert counters(engine) == (start[0] + 3, start[1] + 1)


# -- kernels ------------------------------------------------------------------------------


def test_probe_increment_kernel(engine):
    rng = np.random.default_rng(7)
    n = 1000
    launch = increment(engine, n)
    first = random_u32(rng, n)
    buf = engine.htod(first, np.uint32)
    launch(buf, n)
    assert_same(engine.dtoh(buf, np.uint32), plus(first, 1))

    second = random_u32(rng, n)
    other = engine.htod(second, np.uint32)
    launch(other, n)  # new values in the same prepared storage
    assert launch.args.buffers[0] is other
    assert_same(engine.dtoh(other, np.uint32), plus(second, 1))
    assert_same(engine.dtoh(buf, np.uint32), plus(first, 1))

    launch(buf, 500)  # n bounds the work, whatever the grid
    expected = plus(first, 1)
    expected[:500] = plus(expected[:500], 1)
    assert_same(engine.dtoh(buf, np.uint32), expected)

    engine.copy_htod(buf, second)
    launch.set(buf, n)()  # set once, launch with what is stored
    assert_same(engine.dtoh(buf, np.uint32), plus(second, 1))


def test_modules_and_kernels_are_loaded_once(engine):
    module = engine.load_ptx("probe")
    assert engine.load_ptx("probe") is module
    assert module.kernel("probe_increment") is module.kernel("probe_increment")
    with pytest.raises(ValueError, match="nope"):
        module.kernel("nope")


def test_a_module_with_signatures_refuses_a_type_swap_that_sizes_let_through(engine):
    """probe_increment(unsigned* x, unsigned n): an f32 for n has n's size, so a module loaded
    without a signature table takes it (the driver can tell sizes only); given the package's table
    (memra_cuda.kernels.signatures.load, the same cached module), prepare refuses it naming n, and
    takes the table's types where none are given. Its own engine, so the session's probe module
    stays without a table for the other tests."""
    with Engine(engine.device) as own:
        module = own.load_ptx("probe")
        kernel = module.kernel("probe_increment")
        kernel.prepare(["ptr", "f32"], grid=1, block=BLOCK)
        assert load(own, "probe") is module and module.signatures is SIGNATURES
        with pytest.raises(TypeError, match="probe_increment: parameter 'n' is u32, not f32"):
            kernel.prepare(["ptr", "f32"], grid=1, block=BLOCK)
        with pytest.raises(TypeError, match=r"probe_increment takes 2 parameter\(s\) \(ptr x, u32 n\)"):
            kernel.prepare(["ptr"], grid=1, block=BLOCK)
        buf = own.htod([1, 2, 3], np.uint32)
        kernel.prepare(grid=1, block=BLOCK).set(x=buf, n=2)()
        assert own.dtoh(buf).tolist() == [2, 3, 3]
        with pytest.raises(ValueError, match="another signature table"):
            own.load_ptx("probe", {"probe_increment": Signature.of(x="ptr", n="i32")})


def test_an_engine_speaks_the_cuda_stream_protocol_and_another_borrows_its_stream(engine):
    """__cuda_stream__() is (0, the raw handle), what cuda.core and CuPy take; an Engine given an
    Engine as its stream works on that very stream, keeps it alive and never destroys it."""
    assert engine.__cuda_stream__() == (0, engine.stream_handle)
    borrower = Engine(engine.device, stream=engine)
    assert borrower.__cuda_stream__() == (0, engine.stream_handle) and borrower.stream_handle == engine.stream_handle
    assert borrower.borrowed and borrower.stream_owner is engine
    buf = borrower.htod([5, 6], np.uint32)
    increment(borrower, 2)(buf, 2)
    assert_same(borrower.dtoh(buf, np.uint32), np.array([6, 7], np.uint32))
    borrower.close()
    assert not engine.closed  # and its stream, which the borrower did not destroy, runs on:
    assert_same(engine.dtoh(engine.htod([1], np.uint32)), np.array([1], np.uint32))


def test_launch_refuses_bad_shapes_and_arity(engine):
    kernel = engine.load_ptx("probe").kernel("probe_increment")
    with pytest.raises(ValueError):
        kernel.prepare(["ptr", "u32"], grid=0, block=BLOCK)
    with pytest.raises(ValueError):
        kernel.prepare(["ptr", "u32"], grid=(1, 1, 1, 1), block=BLOCK)
    buf = engine.zeros(np.uint32, 4)
    with pytest.raises(TypeError):
        increment(engine, 4)(buf)
    assert_same(engine.dtoh(buf, np.uint32), np.zeros(4, np.uint32))


# -- graphs -------------------------------------------------------------------------------


def test_graph_replays_captured_launches(engine):
    n = 1000
    values = random_u32(np.random.default_rng(13), n)
    buf = engine.htod(values, np.uint32)
    launch = increment(engine, n).set(buf, n)

    def issue():
        for _ in range(3):
            launch()

    graph = Graph(engine, issue)
    engine.synchronize()
    assert_same(engine.dtoh(buf, np.uint32), values)  # capture records, it does not run
    graph.launch()
    graph.launch()
    assert_same(engine.dtoh(buf, np.uint32), plus(values, 6))

    # Kernels read memory when replayed, not when captured.
    engine.copy_htod(buf, values)
    graph.launch()
    assert_same(engine.dtoh(buf, np.uint32), plus(values, 3))

    graph.free()
    graph.free()
    with pytest.raises(ValueError):
        graph.launch()


def test_garbage_collected_during_capture_is_freed_after_it(engine, caplog):
    """A collection inside a capture would free device memory there, which CUDA refuses and
    which breaks the capture: the collector waits until the graph is captured."""
    n = 64
    buf = engine.htod(np.zeros(n, np.uint32), np.uint32)
    launch = increment(engine, n).set(buf, n)
    spare = [engine.zeros(np.uint32, n) for _ in range(3)]
    freed = [weakref.ref(b) for b in spare]

    def issue():
        launch()
        cycle = [spare.pop()]
        cycle.append(cycle)  # garbage now, with device memory only the collector frees
        del cycle
        [[] for _ in range(1000)]  # allocations: with threshold 1, collections
        launch()

    threshold = gc.get_threshold()
    gc.collect()
    gc.set_threshold(1)
    try:
        graphs = [Graph(engine, issue) for _ in range(3)]
    finally:
        gc.set_threshold(*threshold)
    gc.collect()
    assert [ref() for ref in freed] == [None] * 3, "collected once the capture was over"
    for graph in graphs:
        graph.launch()
    assert_same(engine.dtoh(buf, np.uint32), np.full(n, 6, np.uint32))
    no_cleanup_warnings(caplog)


HOST_WAITS = {
    "dtoh": lambda engine, buf: engine.dtoh(buf),
    "dtoh_u32": lambda engine, buf: engine.dtoh(buf, np.uint32),
    "synchronize": lambda engine, buf: engine.synchronize(),
    "finish_readback": lambda engine, buf: engine.finish_readback(),
}


@pytest.mark.parametrize("wait", list(HOST_WAITS))
def test_host_wait_inside_capture_is_refused_and_capture_abandoned(engine, wait):
    n = 256
    values = random_u32(np.random.default_rng(17), n)
    buf = engine.htod(values, np.uint32)
    launch = increment(engine, n)
    start = counters(engine)

    def issue():
        launch(buf, n)
        HOST_WAITS[wait](engine, buf)

    with pytest.raises(RuntimeError, match="graph capture"):
        Graph(engine, issue)
    assert counters(engine) == start
    assert not engine.capturing
    # The captured launch was thrown away with the graph: it never ran. The engine still works.
    assert_same(engine.dtoh(buf, np.uint32), values)
    launch(buf, n)
    assert_same(engine.dtoh(buf, np.uint32), plus(values, 1))


# -- modules ------------------------------------------------------------------------------

PTX_HEADER = ".version 8.0\n.target sm_80\n.address_size 64\n"


def test_module_jit_failure_carries_the_jit_log(engine):
    with pytest.raises(CudaError) as caught:
        Module(engine, PTX_HEADER + "this is not ptx")
    err = caught.value
    assert err.call == "cuModuleLoadDataEx"
    assert err.name == "CUDA_ERROR_INVALID_PTX"
    assert "JIT log:\n" in str(err)
    assert str(err).split("JIT log:\n", 1)[1].strip(), "the JIT log is empty"


@pytest.mark.parametrize("image", [PTX_HEADER + "\0// junk", (PTX_HEADER + "\0// junk").encode()],
                         ids=["str", "bytes"])
def test_module_refuses_interior_nul(engine, image):
    with pytest.raises(ValueError, match="NUL"):
        Module(engine, image)


# -- several engines ----------------------------------------------------------------------


def device_of(buf: DeviceBuffer) -> int:
    """The device whose context owns the memory (see buffer._device_of)."""
    return _device_of(buf.ptr)


def test_calls_on_another_device_leave_the_current_context_alone(engine):
    """A thread on device 0 (PyTorch's current device, say) uses an engine on device 1: its
    memory, copies and launches land on device 1, and device 0 stays current throughout."""
    if call("cuDeviceGetCount") < 2:
        pytest.skip("needs 2 CUDA devices")
    other = Engine(1)
    try:
        engine.ctx.make_current()
        buf = other.htod([1, 2, 3], np.uint32)
        increment(other, 3)(buf, 3)
        assert other.dtoh(buf, np.uint32).tolist() == [2, 3, 4]
        assert device_of(buf) == 1
        assert int(call("cuCtxGetCurrent")) == engine.ctx.address
    finally:
        other.close()


@pytest.mark.parametrize("devices", [(0, 0), (0, 1)], ids=["same-device", "two-devices"])
def test_engines_share_one_thread(engine, caplog, devices):
    if max(devices) >= call("cuDeviceGetCount"):
        pytest.skip(f"needs {max(devices) + 1} CUDA devices")
    n = 700
    rng = np.random.default_rng(19)
    engines = [Engine(d) for d in devices]
    try:
        values = [random_u32(rng, n) for _ in engines]
        bufs = [e.htod(v, np.uint32) for e, v in zip(engines, values)]
        launches = [increment(e, n) for e in engines]
        for _ in range(3):  # alternate: every call must switch to its own engine's context
            for launch, buf in zip(launches, bufs):
                launch(buf, n)
        for e, buf, v in zip(engines, bufs, values):
            assert device_of(buf) == e.device
            assert_same(e.dtoh(buf, np.uint32), plus(v, 3))

        first, second = engines
        first.close()
        assert first.closed
        with pytest.raises(ValueError, match="closed"):
            first.dtoh(bufs[0], np.uint32)
        launches[1](bufs[1], n)
        assert_same(second.dtoh(bufs[1], np.uint32), plus(values[1], 4))
        assert_same(engine.dtoh(engine.htod([5, 6], np.uint32), np.uint32), np.array([5, 6], np.uint32))

        # The closed engine's buffer still holds its context, so freeing it must succeed.
        with caplog.at_level(logging.WARNING, logger="memra_cuda"):
            bufs[0].free()
        no_cleanup_warnings(caplog)
        assert bufs[0].freed
    finally:
        for e in engines:
            e.close()


def test_engine_on_missing_device(engine):
    with pytest.raises(ValueError, match="999"):
        Engine(999)


def test_engine_as_context_manager(engine):
    with Engine(engine.device) as e:
        assert not e.closed
        assert_same(e.dtoh(e.htod([1, 2, 3], np.uint32), np.uint32), np.array([1, 2, 3], np.uint32))
    assert e.closed
    with pytest.raises(ValueError, match="closed"):
        e.alloc(np.uint32, 1)
    e.close()  # idempotent


def test_cuda_array_interface_names_the_engine_stream(engine):
    buf = engine.alloc(np.float32, 6)
    assert isinstance(engine.stream_handle, int) and engine.stream_handle not in (0, 1, 2)
    assert buf.__cuda_array_interface__ == {
        "shape": (6,), "typestr": "<f4", "data": (buf.ptr, False), "strides": None, "version": 3,
        "stream": engine.stream_handle}
    assert buf.view(2, 3).__cuda_array_interface__["stream"] == engine.stream_handle


SHUTDOWN_SCRIPT = """
import numpy as np
from memra_cuda import Engine, Graph
engine = Engine()
buf = engine.htod(range(10), np.uint32)
window = buf.view(2, 3)
launch = engine.load_ptx("probe").kernel("probe_increment").prepare(["ptr", "u32"], grid=1, block=32).set(buf, 10)
graph = Graph(engine, launch)
graph.launch()
other = Engine()
outlives = other.zeros(np.uint32, 4)  # a buffer whose engine is closed before exit
other.close()
cycle = [buf, graph]
cycle.append(cycle)  # left for the collector to meet at interpreter exit
"""


def test_interpreter_exit_with_live_objects_is_clean(engine):
    """Buffers, a view, a graph, a module and a closed engine's buffer all alive at exit: the
    finalisers run in a safe order and none fails (a failing one would log to stderr)."""
    run = run_script(SHUTDOWN_SCRIPT)
    assert (run.returncode, run.stderr) == (0, "")


def test_the_first_releases_typed_copies_are_gone(engine):
    """0.3.0 dropped the typed copies (htod_u32, dtoh_i32, alloc_u32_zeroed, ...): the generic ones
    take a dtype, and a misspelt method is an AttributeError, not a lookup in a table of aliases."""
    for name in ("htod_u32", "dtoh_i32", "alloc_i32_zeroed", "htod_f32"):
        with pytest.raises(AttributeError, match=name):
            getattr(engine, name)


def test_the_drivers_release_is_one_memra_cuda_runs_on(engine):
    from memra_cuda.driver import compiler
    from memra_cuda.driver.errors import driver_version
    assert driver_version() >= (12, 0) and compiler._driver_version() == driver_version()

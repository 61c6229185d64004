"""The driver layer's host-side logic, which must hold on every CI machine, GPU or not.

Nothing here reaches the driver: check() is fed hand-made result tuples, KernelArgs packs into
host memory, and DeviceBuffers wrap made-up foreign pointers (never dereferenced) so their
lifetime rules can be exercised without a device.
"""
from __future__ import annotations

import gc
import re
import types
import weakref
from pathlib import Path

import numpy as np
import pytest
from cuda.bindings.driver import CUresult

from memra_cuda import DeviceBuffer, Engine
from memra_cuda.driver.module import KernelArgs
from memra_cuda.errors import CudaError, CudaUnavailable
from memra_cuda.driver import Handle
from memra_cuda.driver.buffer import as_buffer
from memra_cuda.driver.values import as_seed, exact_array, exact_int, seed_bits
from memra_cuda.driver.engine import LEAST_CAPABILITY, capability_refusal
from memra_cuda.driver.errors import bindings_refusal, check
from memra_cuda.driver.module import _PTX_DIRS, packaged_ptx
from memra_cuda.driver.stream import Stream, handle_of

# A made-up device address: wrap() only stores it, so it never has to be valid.
FAKE_PTR = 0x1000


def fake_buffer(length: int = 100, dtype=np.uint32) -> DeviceBuffer:
    return DeviceBuffer.wrap(FAKE_PTR, dtype, length)


# -- check() ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "result, expected",
    [((CUresult.CUDA_SUCCESS,), None),
     ((CUresult.CUDA_SUCCESS, 5), 5),
     ((CUresult.CUDA_SUCCESS, 1, "two"), (1, "two"))],
    ids=["no-value", "one-value", "two-values"],
)
def test_check_unwraps_success(result, expected):
    assert check(result, "cuSomething") == expected


def test_check_raises_cuda_error_naming_code_and_call():
    with pytest.raises(CudaError) as caught:
        check((CUresult.CUDA_ERROR_INVALID_VALUE, 7), "cuMemAlloc")
    err = caught.value
    assert err.name == "CUDA_ERROR_INVALID_VALUE"
    assert err.code == int(CUresult.CUDA_ERROR_INVALID_VALUE)
    assert err.call == "cuMemAlloc"
    assert "CUDA_ERROR_INVALID_VALUE" in str(err) and "cuMemAlloc" in str(err)
    # Callers that only know "something went wrong at run time" still catch it.
    assert isinstance(err, RuntimeError)


# -- no driver ----------------------------------------------------------------------------


def test_engine_without_driver_raises_one_clear_line():
    try:
        eng = Engine()
    except CudaUnavailable as exc:
        err = exc
    else:
        eng.close()
        pytest.skip("a CUDA driver and GPU are present here, so Engine() succeeds")
    message = str(err)
    assert "\n" not in message, "CudaUnavailable must be one sentence, not a loader traceback"
    assert "driver" in message.lower()
    assert isinstance(err, CudaError) and err.name == "CUDA_UNAVAILABLE"


def test_without_cuda_python_the_refusal_names_the_release_for_each_driver(monkeypatch):
    """Without cuda-python the message said `pip install cuda-python`, which installs the CUDA 13
    bindings whatever the driver: on a CUDA 12 driver the next error was the bindings' mismatch.
    It names both releases' pins now, and where to read the driver's CUDA, in one line."""
    import sys

    from memra_cuda.driver import errors
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # its import fails as where it is missing
    monkeypatch.setattr(errors, "_driver", None)
    with pytest.raises(CudaUnavailable) as refused:
        errors.driver()
    message = str(refused.value)
    assert "\n" not in message and "cuda-python is not installed" in message
    assert "'cuda-python>=12.6.2.post1,<13' for a CUDA 12 driver" in message and "'cuda-python>=13,<14'" in message


def test_an_engine_of_a_negative_device_is_refused_before_the_driver():
    """Engine(-1) on a machine without a driver said the driver was missing, and on one with a
    driver that device -1 does not exist: an index below 0 names no device anywhere, so it is a
    ValueError naming the device before the driver is asked; a bool or a string is a TypeError."""
    for device, message in ((-1, "an int of at least 0, not -1"), (-2**40, "an int of at least 0")):
        with pytest.raises(ValueError, match=f"^device must be {message}"):
            Engine(device)
    for device in (True, "0", 0.0):
        with pytest.raises(TypeError, match="^device must be an integer"):
            Engine(device)


@pytest.mark.parametrize("bindings, driver", [("13.0.0", (13, 0)), ("13.3.0", (13, 2)), ("12.9.4", (13, 0)),
                                             ("12.6.2.post1", (12, 4)), ("", (12, 9)), ("dev", (12, 9))])
def test_bindings_of_the_drivers_release_or_older_are_served(bindings, driver):
    """At the limit: bindings of the driver's own major release pass, whatever the minor; a
    version the bindings do not state is not refused for it."""
    assert bindings_refusal(bindings, driver) is None


def test_bindings_newer_than_the_driver_are_refused_naming_both_and_the_fix():
    message = bindings_refusal("13.3.0", (12, 9))
    assert message is not None and "\n" not in message
    assert "13.3.0" in message and "CUDA 12.9" in message and "'cuda-python>=12.6.2.post1,<13'" in message
    older = bindings_refusal("12.9.4", (11, 8))  # below the package's floor: a newer driver, no bindings to name
    assert older is not None and "a driver of CUDA 12 or later" in older and "pip" not in older


@pytest.mark.parametrize("major, minor, served", [(8, 0, True), (9, 0, True), (12, 0, True), (7, 5, False),
                                                  (7, 0, False), (6, 1, False)])
def test_a_gpu_below_compute_capability_8_0_is_refused_as_memras_kernels_load(major, minor, served):
    message = capability_refusal(3, major, minor)
    assert (message is None) == served
    if not served:
        assert f"device 3 is of compute capability {major}.{minor}" in message and "8.0" in message
    assert LEAST_CAPABILITY == (8, 0)
    shipped = [path for folder in _PTX_DIRS for path in folder.glob("*.ptx")]
    assert shipped and all(".target sm_80\n" in path.read_text() for path in shipped)  # what the bound stands for


# -- KernelArgs ---------------------------------------------------------------------------

# The kernel ABI: each argument is stored little-endian in its C type, one 8-byte slot each.
# Spelled out here (not read from the module) so a wrong mapping there cannot go unnoticed.
ABI = {"ptr": "<u8", "u32": "<u4", "i32": "<i4", "u64": "<u8", "i64": "<i8", "f32": "<f4", "f64": "<f8"}


def slot_bytes(args: KernelArgs, i: int) -> bytes:
    return args.storage.view(np.uint8)[8 * i: 8 * i + 8].tobytes()


def expected_slot(kind: str, value) -> bytes:
    """What the driver must read for `value`: its bytes, zero-padded to the 8-byte slot."""
    if isinstance(value, DeviceBuffer):
        value = value.ptr
    return np.array(value, dtype=ABI[kind]).tobytes().ljust(8, b"\0")


def assert_packed(args: KernelArgs, values) -> None:
    base = args.storage.ctypes.data
    for i, (kind, value) in enumerate(zip(args.types, values)):
        assert int(args.table[i]) == base + 8 * i, f"table entry {i} does not point at slot {i}"
        assert slot_bytes(args, i) == expected_slot(kind, value), f"slot {i} ({kind})"
    assert args.pointer == args.table.ctypes.data


def test_kernel_args_pack_each_type_little_endian():
    types = ["ptr", "u32", "i32", "u64", "f32", "i64", "f64"]
    args = KernelArgs(types)
    buf = DeviceBuffer.wrap(FAKE_PTR, np.uint32, 4)
    first = (buf, 0xDEADBEEF, -5, 2**64 - 1, 1.5, -(2**63), -0.25)
    args.set(*first)
    assert_packed(args, first)
    assert args.buffers[0] is buf and args.buffers[1:] == [None] * (len(types) - 1)

    # Values are updated in place: the table (what the driver was given) must not move.
    table_before = args.table.copy()
    second = (0x2000, 0, 2**31 - 1, 0, -3.0e38, 2**63 - 1, 1e300)
    args.set(*second)
    assert_packed(args, second)
    assert np.array_equal(args.table, table_before)
    assert args.buffers[0] is None, "an int pointer must release the previous buffer"


def test_kernel_args_keep_buffer_arguments_alive():
    args = KernelArgs(["ptr"])
    buf = DeviceBuffer.wrap(FAKE_PTR, np.uint32, 4)
    alive = weakref.ref(buf)
    args.set(buf)
    del buf
    gc.collect()
    assert alive() is args.buffers[0] is not None


def test_kernel_args_accept_numpy_integer_pointer():
    args = KernelArgs(["ptr"])
    args.set(np.uint64(0xABCDEF))
    assert slot_bytes(args, 0) == expected_slot("ptr", 0xABCDEF)


def test_kernel_args_wrong_arity_is_type_error():
    args = KernelArgs(["ptr", "u32"])
    with pytest.raises(TypeError):
        args.set(FAKE_PTR)
    with pytest.raises(TypeError):
        args.set(FAKE_PTR, 1, 2)


@pytest.mark.parametrize(
    "kind, value",
    [("u32", -1), ("u32", 2**32), ("i32", 2**31), ("i32", -(2**31) - 1), ("u64", -1), ("u64", 2**64),
     ("ptr", -1)],
)
def test_kernel_args_out_of_range_is_value_error_naming_the_index(kind, value):
    # The bad value sits at index 1, after a valid one, so the message must name the right slot.
    args = KernelArgs(["u32", kind])
    with pytest.raises(ValueError, match="argument 1"):
        args.set(0, value)


@pytest.mark.parametrize(
    "kind, value",
    [("u32", np.uint64(2**40)), ("ptr", np.int64(-1)), ("u32", 2.5)],
    ids=["numpy-u64-into-u32", "numpy-negative-ptr", "float-into-u32"],
)
def test_kernel_args_refuse_numpy_scalars_and_floats_that_do_not_fit(kind, value):
    args = KernelArgs([kind])
    try:
        args.set(value)
    except ValueError:
        return
    raise AssertionError(f"{value!r} was stored as {slot_bytes(args, 0).hex()} in a {kind} slot")


def test_kernel_args_unknown_type_name():
    with pytest.raises(ValueError, match="u8"):
        KernelArgs(["ptr", "u8"])


@pytest.mark.parametrize("kind", [["u32"], {"u32": 4}, {"u32"}, None, 4, b"u32"],
                         ids=["list", "dict", "set", "none", "int", "bytes"])
def test_a_launchs_type_that_is_no_name_is_refused_naming_it_as_a_params_is(kind):
    """kernel.prepare(types=[...]) of a kernel without a signature (KernelArgs) given a list, a
    dict or a set among its types met `in ARG_TYPES`'s bare "unhashable type", naming nothing, as
    a Param's type did: it is the ValueError every unknown type is, naming the kernel where it is
    known, by the check Param's is (signature.is_arg_type). (No driver: a stand-in module.)"""
    from types import SimpleNamespace

    from memra_cuda.driver.module import Kernel
    unknown = rf"unknown argument type\(s\) \[{re.escape(repr(kind))}\]; use one of \['f32'"
    with pytest.raises(ValueError, match=f"^{unknown}"):
        KernelArgs(["ptr", kind])
    kernel = object.__new__(Kernel)
    kernel.module = SimpleNamespace(signatures={}, _usable=lambda: None, engine=None)
    kernel.name, kernel.handle = "my_kernel", None
    with pytest.raises(ValueError, match=f"^my_kernel: {unknown}"):
        kernel.prepare(types=["ptr", kind])


@pytest.mark.parametrize("value", ["0x1000", 1.0, None, True, np.True_],
                         ids=["str", "float", "none", "bool", "np.bool"])
def test_kernel_args_pointer_must_be_buffer_or_int(value):
    with pytest.raises(TypeError, match="argument 0"):
        KernelArgs(["ptr"]).set(value)


@pytest.mark.parametrize("kind", ["u32", "i32", "u64", "i64", "ptr"])
@pytest.mark.parametrize("value", [True, False, np.True_, np.False_], ids=["True", "False", "np.True_", "np.False_"])
def test_a_bool_is_refused_for_every_integer_and_pointer_argument(kind, value):
    """True was stored as 1 in a u32 and as address 1 in a pointer, while np.True_ was refused
    and a bool was refused for an f32: a bool is no integer argument of any type now (as_size's
    rule), TypeError naming the slot, and the previous arguments stand."""
    args = KernelArgs(["u32", kind])
    args.set(7, 0x1000)
    with pytest.raises(TypeError, match=f"argument 1 \\({kind}\\)"):
        args.set(7, value)
    assert slot_bytes(args, 1) == expected_slot(kind, 0x1000)
    with pytest.raises(TypeError, match="is a bool, not an integer"):
        exact_int(value, np.uint32)  # what memset and set_u32 take their values through


class ArrayBool:
    """An array library's bool scalar as numpy does not know it (torch.tensor(True)): a bool
    dtype, and an __index__ that gives 1."""

    dtype = "torch.bool"

    def __index__(self) -> int:
        return 1

    def __repr__(self) -> str:
        return "tensor(True)"


def test_an_array_librarys_bool_is_no_integer_either():
    """torch.tensor(True) passed every bool check (Python's and numpy's), and __index__ read it
    as 1: a request's budget, seed or EOS, a prompt's token, a request id to cancel, a row, a
    top_k of 1. One check (is_bool) refuses it wherever True is."""
    from memra_cuda.driver.values import as_index, hides_bools, is_bool
    assert is_bool(ArrayBool()) and is_bool(np.array([True])) and not is_bool(np.array([1])) and not is_bool(1)
    with pytest.raises(TypeError, match="a row must be an integer, not tensor\\(True\\)"):
        as_index(ArrayBool(), "a row")
    with pytest.raises(TypeError, match="is a bool, not an integer"):
        exact_int(ArrayBool(), np.uint32)
    assert hides_bools([ArrayBool(), 5]) and hides_bools([[5, ArrayBool()]]) and not hides_bools([5, 6])
    # a prompt's plain ints (and floats) are answered by their types; a bool or anything else among them is looked at
    prompt = list(range(1, 129))
    assert not hides_bools(prompt) and not hides_bools((*prompt, 2.5)) and hides_bools([*prompt, True])
    assert hides_bools((True, *prompt)) and hides_bools([*prompt, np.bool_(False)]) and hides_bools([*prompt, [True]])
    assert hides_bools([*prompt, ArrayBool()]) and not hides_bools([*prompt, np.int64(3)])
    assert not hides_bools(list(np.arange(5, dtype=np.uint16))) and hides_bools([*np.arange(5), np.True_])
    assert as_index(np.int64(3), "a row") == 3
    # pandas' nullable bool and TensorFlow's dtypes name themselves otherwise (was read as 1)
    for name in ("boolean", "<dtype: 'bool'>"):
        with pytest.raises(TypeError, match="a row must be an integer"):
            as_index(type("Scalar", (ArrayBool,), {"dtype": name})(), "a row")
    assert not is_bool(type("Scalar", (ArrayBool,), {"dtype": "int64"})())


class ArrayOfOne:
    """An array library's array of one integer as numpy does not refuse it (torch.tensor([3])):
    an int dtype, one dimension, and an __index__ that gives its element."""

    dtype, ndim = "torch.int64", 1

    def __index__(self) -> int:
        return 3


def test_an_array_of_one_integer_is_no_integer():
    """torch.tensor([3]) gave 3 to operator.index, so a row, an id or a budget read it as 3,
    where numpy's array([3]) was refused: both are TypeErrors naming what was wrong; a 0-d
    array is the integer it holds."""
    from memra_cuda.driver.values import as_index, as_size
    for value in (ArrayOfOne(), np.array([3])):
        with pytest.raises(TypeError, match="a row must be an integer"):
            as_index(value, "a row")
    with pytest.raises(TypeError, match="not an array of one"):
        as_size(ArrayOfOne(), "a budget", 0)
    assert as_index(np.array(3), "a row") == 3 and as_index(np.int32(3), "a row") == 3


def test_kernel_args_refuse_a_freed_buffer():
    buf = fake_buffer()
    buf.free()
    with pytest.raises(ValueError, match="after free"):
        KernelArgs(["ptr"]).set(buf)


# -- DeviceBuffer lifetime (foreign pointers, no driver) ----------------------------------


def test_wrapped_buffer_basics():
    buf = DeviceBuffer.wrap(FAKE_PTR, np.float64, 10)
    assert (buf.ptr, buf.len, len(buf), buf.nbytes, buf.dtype) == (FAKE_PTR, 10, 10, 80, np.float64)
    assert not buf.owns_memory and not buf.freed
    assert buf.engine is None


@pytest.mark.parametrize("ptr, length", [(0, 4), (FAKE_PTR, 0), (FAKE_PTR, -1)],
                         ids=["null", "empty", "negative"])
def test_wrap_refuses_null_and_empty(ptr, length):
    with pytest.raises(ValueError):
        DeviceBuffer.wrap(ptr, np.uint32, length)


@pytest.mark.parametrize("start, count", [(0, 100), (99, 1), (0, 1), (37, 20)])
def test_view_pointer_arithmetic(start, count):
    view = fake_buffer(100).view(start, count)
    assert view.ptr == FAKE_PTR + 4 * start
    assert (view.len, view.nbytes, view.dtype) == (count, 4 * count, np.uint32)
    assert not view.owns_memory


@pytest.mark.parametrize("start, count", [(-1, 2), (0, 0), (0, 101), (100, 1), (97, 4)])
def test_view_bounds(start, count):
    with pytest.raises(ValueError):
        fake_buffer(100).view(start, count)


def test_view_of_view_is_relative_to_the_first_view():
    outer = fake_buffer(100, np.uint16).view(10, 50)
    inner = outer.view(5, 10)
    assert inner.ptr == FAKE_PTR + 2 * (10 + 5)
    inner.view(9, 1)
    with pytest.raises(ValueError):
        outer.view(45, 6)  # inside the parent, but past the end of the view


def assert_unusable(buf: DeviceBuffer) -> None:
    assert buf.freed
    with pytest.raises(ValueError, match="after free"):
        buf.ptr
    with pytest.raises(ValueError, match="after free"):
        buf.__cuda_array_interface__
    assert "freed" in repr(buf)


def test_free_makes_buffer_and_its_views_unusable():
    parent = fake_buffer()
    view = parent.view(2, 3)
    inner = view.view(1, 1)
    parent.free()
    for buf in (parent, view, inner):
        assert_unusable(buf)
    with pytest.raises(ValueError):
        parent.view(0, 1)
    parent.free()  # idempotent


def test_freeing_a_view_leaves_the_parent_alone():
    parent = fake_buffer()
    view = parent.view(2, 3)
    view.free()
    view.free()
    assert_unusable(view)
    assert parent.ptr == FAKE_PTR and not parent.freed


def test_with_block_frees():
    with fake_buffer() as buf:
        assert buf.ptr == FAKE_PTR
    assert_unusable(buf)


def test_cuda_array_interface_without_engine():
    buf = fake_buffer(7)
    assert buf.__cuda_array_interface__ == {
        "shape": (7,), "typestr": "<u4", "data": (FAKE_PTR, False), "strides": None, "version": 3}
    assert "stream" not in buf.view(1, 2).__cuda_array_interface__
    assert DeviceBuffer.wrap(FAKE_PTR, np.float16, 1).__cuda_array_interface__["typestr"] == "<f2"


def stream_stand_in(**attributes: object) -> Stream:
    """A Stream without a driver (no context, no stream): its device 0, its stream handle 0, no
    capture under way, and `attributes` set on it (an `activate` that records, say)."""
    stream = Stream.__new__(Stream)
    stream.ctx, stream._stream_handle, stream.capture_hold = types.SimpleNamespace(device=0), 0, None
    for name, value in attributes.items():
        setattr(stream, name, value)
    return stream


def test_cuda_array_interface_names_its_engines_stream_until_the_engine_closes():
    engine = stream_stand_in()  # what the interface reads of one: its handle, whether it is closed
    buf = DeviceBuffer.wrap(FAKE_PTR, np.uint32, 2, engine=engine)
    assert buf.__cuda_array_interface__["stream"] == 1, "the legacy stream: the protocol does not allow 0"
    engine._stream_handle = 0x5000
    assert buf.__cuda_array_interface__["stream"] == 0x5000
    engine._freed = True  # closed: its work finished and its stream destroyed, nothing to wait on, no handle to name
    assert "stream" not in buf.__cuda_array_interface__


def closed_stream_stand_in(handle: int) -> Stream:
    """A Stream in the state close() leaves, without a driver: its stream borrowed (nothing to
    destroy), its last work taken as finished."""
    stream = Stream.__new__(Stream)
    stream.ctx = types.SimpleNamespace(device=0, fault=None)
    stream._stream_handle, stream.synchronize = handle, lambda: None
    assert stream.__cuda_stream__() == (0, handle)
    stream.close()
    return stream


def owned_stream(handle: int, cu_stream: object = None) -> tuple[Stream, Releases]:
    """A Stream owning its stream, without a driver: `cu_stream` its CUstream (`handle` where not
    given), whose destroy is recorded (Releases); its last work taken as finished."""
    stream, released = Stream.__new__(Stream), Releases()
    stream.ctx = types.SimpleNamespace(device=0, fault=None)
    stream._stream = handle if cu_stream is None else cu_stream
    stream._stream_handle, stream.synchronize = handle, lambda: None
    stream._stream_owner = None
    stream._own(released, "cuStreamDestroy", stream._stream)
    return stream, released


@pytest.mark.parametrize("given", [None, "engine", 0, types.SimpleNamespace(type="cuda", index=0)],
                         ids=["none", "str", "int", "device-like"])
def test_what_queues_on_an_engine_refuses_anything_else_naming_it(given):
    """Event(engine), Graph(engine, issue) and each of its joined engines, LoopBuilder(engine) and
    DeviceBuffer.wrap(..., engine=) took any object, which met an AttributeError later ('activate',
    'capture_hold', 'device'), naming nothing. A TypeError naming the argument, before anything is
    made or asked of the driver (stream.as_engine_stream, Module's check: a Stream is all any of
    them needs of an engine, and one is taken; wrap's engine may still be None)."""
    from memra_cuda.driver.event import Event
    from memra_cuda.driver.graph import Graph, LoopBuilder

    named = f"must be an Engine, not {re.escape(repr(given))}$"
    issued: list[str] = []
    for make in (lambda: Event(given), lambda: Event(given, timing=False), lambda: LoopBuilder(given),
                 lambda: Graph(given, lambda: issued.append("issued"))):
        with pytest.raises(TypeError, match=f"^engine {named}"):
            make()
    activated: list[str] = []
    with pytest.raises(TypeError, match=f"^each of joined {named}"):
        Graph(stream_stand_in(activate=lambda: activated.append("activate")), lambda: issued.append("issued"),
              joined=[stream_stand_in(), given])
    assert issued == activated == []
    if given is not None:
        with pytest.raises(TypeError, match=f"^engine {named}"):
            DeviceBuffer.wrap(FAKE_PTR, np.uint32, 4, engine=given)
    made = []
    stream = stream_stand_in(ctx=types.SimpleNamespace(device=0, call=lambda name, flags: made.append(name) or 0xE0,
                                                       finalize=lambda name, handle: None))
    assert Event(stream).engine is stream and made == ["cuEventCreate"]  # a Stream: taken
    assert DeviceBuffer.wrap(FAKE_PTR, np.uint32, 4, engine=stream).engine is stream


def test_a_closed_stream_hands_out_no_handle():
    """A closed stream's handle is destroyed, and the driver may give it to the next stream made:
    __cuda_stream__() handed it out still, so another engine's wait on the closed one (which
    reads the protocol) recorded an event onto whatever stream it named by then."""
    stream = closed_stream_stand_in(0x5000)
    with pytest.raises(ValueError, match=r"Stream\(device=0, closed\) is closed"):
        stream.__cuda_stream__()
    with pytest.raises(ValueError, match="is closed"):
        handle_of(stream)  # what Engine.wait and wait_stream read a stream by


def test_a_closed_stream_or_a_freed_event_refuses_its_raw_handle_and_is_released_all_the_same():
    """`stream`, `stream_handle` and an Event's `handle` stayed readable after close() or free():
    the driver may give the destroyed handle to the next stream or event made, so whatever took it
    then queued work on, or waited for, another one. Each refuses now (ValueError), as a freed
    buffer's `ptr` does; the release, which holds its own copy, destroys it all the same. (No
    driver: stand-ins whose release is recorded.)"""
    from memra_cuda.driver.event import Event

    stream, released = owned_stream(0x5000, "CUstream 0x5000")
    assert (stream.stream, stream.stream_handle) == ("CUstream 0x5000", 0x5000)
    stream.close()
    assert released.calls == [("cuStreamDestroy", "CUstream 0x5000")]
    for name in ("stream", "stream_handle"):
        with pytest.raises(ValueError, match=r"^Stream\(device=0, closed\) is closed$"):  # activate()'s words
            getattr(stream, name)

    event, released = Event.__new__(Event), Releases()
    event.engine, event._handle = stream, 0xE0
    event._own(released, "cuEventDestroy", event._handle)
    assert event.handle == 0xE0 and repr(event) == "Event(224)"
    event.free()
    assert released.calls == [("cuEventDestroy", 0xE0)] and repr(event) == "Event(freed)"
    with pytest.raises(ValueError, match="^Event used after free$"):
        event.handle


@pytest.mark.parametrize("start", [None, 0.5, "start", types.SimpleNamespace(_handle=0xE1)],
                         ids=["none", "float", "str", "stand-in"])
def test_an_events_elapsed_time_is_from_an_event(start):
    """Event.elapsed_ms(start) given anything but an Event met AttributeError '_usable', naming
    nothing. A TypeError naming start, before this event is waited for. (No driver: a stand-in
    event whose wait would raise.)"""
    from memra_cuda.driver.event import Event

    event = Event.__new__(Event)
    event.engine, event._handle = None, 0xE0  # no engine: a wait would raise AttributeError
    with pytest.raises(TypeError, match=f"^start must be an Event, not {re.escape(repr(start))}$"):
        event.elapsed_ms(start)


def test_a_stream_whose_handle_was_handed_out_is_destroyed_only_once_collected(monkeypatch):
    """close() destroyed an owned stream at once, though a consumer of __cuda_stream__ (a cuda.core
    or CuPy stream made from the engine, or an Engine borrowing it, which keeps it as its stream's
    owner) went on queueing work on the handle, which the driver hands the next stream made. Now a
    handed-out stream is closed to memra at once and destroyed when the object is collected, which
    the consumer's reference prevents; one only read for a wait (handle_of) is destroyed at close()
    as before. (No driver: stand-in contexts, the destroy counted.)"""
    import memra_cuda.driver.stream as stream_module

    stream, released = owned_stream(0x5000)
    assert handle_of(stream) == 0x5000
    stream.close()
    assert released.calls == [("cuStreamDestroy", 0x5000)], "read for a wait only: destroyed at close()"
    stream, released = owned_stream(0x6000)
    consumer = [stream]  # what cuda.core's Stream keeps of the object it read the protocol of
    assert stream.__cuda_stream__() == (0, 0x6000)
    launch = Holder()
    stream.depend(launch)
    stream.close()
    assert stream.closed and released.calls == [], "the consumer still queues work on the handle"
    with pytest.raises(ValueError, match="is closed"):
        stream.__cuda_stream__()
    with pytest.raises(ValueError, match="which was freed"):
        launch._usable()
    del stream
    gc.collect()
    assert released.calls == []
    consumer.clear()
    gc.collect()
    assert released.calls == [("cuStreamDestroy", 0x6000)]
    # an Engine borrowing the stream keeps it as its owner: the owner's close() leaves the stream to it
    owner, released = owned_stream(0x7000)
    monkeypatch.setattr(stream_module.PrimaryContext, "of", classmethod(lambda cls, device: types.SimpleNamespace(
        device=0, fault=None, handle=1, adopt_thread=lambda: None, call=lambda name, *args: 1)))
    from cuda.bindings import driver as bindings
    monkeypatch.setattr(stream_module, "driver", lambda: bindings)  # its types, no cuInit
    borrower = Stream(0, stream=owner)
    assert borrower.stream_handle == 0x7000 and borrower.stream_owner is owner
    owner.close()
    del owner
    gc.collect()
    assert released.calls == [], "the borrower's stream was destroyed under it"
    borrower.synchronize = lambda: None  # type: ignore[method-assign]
    borrower.close()
    del borrower
    gc.collect()
    assert released.calls == [("cuStreamDestroy", 0x7000)]


# -- packaged PTX -------------------------------------------------------------------------


def test_packaged_ptx_is_the_committed_text():
    text = packaged_ptx("probe")
    assert text.startswith("//")  # the NVVM header comments come first
    assert ".version" in text and ".entry probe_increment" in text


def test_packaged_ptx_unknown_name():
    with pytest.raises(FileNotFoundError, match="no_such_module"):
        packaged_ptx("no_such_module")


@pytest.mark.parametrize("name, error", [(["probe"], TypeError), (Path("probe"), TypeError), (b"probe", TypeError),
                                         (None, TypeError), ("../ptx/probe", ValueError), ("ptx/probe", ValueError),
                                         (str(Path(__file__).parents[2] / "ptx" / "probe"), ValueError),
                                         ("probe.ptx", ValueError), ("", ValueError), ("probe\0", ValueError)],
                         ids=["list", "path", "bytes", "none", "up", "folder", "absolute", "suffix", "empty", "nul"])
def test_a_packaged_modules_name_is_a_stem_of_ptx_refused_before_the_cache_or_a_file(name, error):
    """engine.load_ptx(["probe"]) met the module cache's bare "unhashable type", and a name with
    "../" or a path separator reached outside the package's ptx/ folder, to any file ending .ptx
    (an absolute path's stem, read as given; "../ptx/probe", ptx/../ptx/probe.ptx, was taken). A str
    that is an identifier, as every stem of ptx/ is (ptx_name): refused naming it, before the
    cache, the device or a file is looked at (a stand-in engine with none of them but its cache)."""
    from types import SimpleNamespace

    message = ("a packaged module's name must be a str" if error is TypeError
               else "a packaged module's name is the stem of a file in ptx/")
    with pytest.raises(error, match=f"^{re.escape(message)}"):
        packaged_ptx(name)
    engine = SimpleNamespace(_modules={})
    with pytest.raises(error, match=f"^{re.escape(message)}"):
        Engine.load_ptx(engine, name)  # type: ignore[arg-type]
    assert engine._modules == {}
    loaded = SimpleNamespace(freed=False)
    assert Engine.load_ptx(SimpleNamespace(_modules={"probe": loaded}), "probe") is loaded  # type: ignore[arg-type]


@pytest.mark.parametrize("ptx", [Path("k.ptx"), 5, [46, 118], None], ids=["path", "int", "ints", "none"])
def test_a_module_takes_ptx_text_not_a_path_nor_what_bytes_makes_of_anything(ptx):
    """Module(engine, ptx) read ptx as bytes(ptx): a Path was its name's bytes, loaded as PTX (the
    JIT's log, not a file's name, said what was wrong), 5 five NUL bytes ("a NUL byte before its
    end") and a list of ints its bytes. A TypeError naming ptx, before any engine is asked (none
    here); text and bytes of every kind go on to the engine's check."""
    from memra_cuda.driver import Module

    with pytest.raises(TypeError, match=r"^ptx must be the PTX text \(a str or bytes: a file's Path\(\.\.\.\)\."):
        Module(None, ptx)  # type: ignore[arg-type]
    for text in (".version 8.0\n", b".version 8.0\n", bytearray(b".version 8.0"), memoryview(b".version 8.0")):
        with pytest.raises(TypeError, match="^engine must be an Engine, not None$"):
            Module(None, text)  # type: ignore[arg-type]


@pytest.mark.parametrize("name, error", [(5, TypeError), (["scale"], TypeError), (b"scale", TypeError),
                                         (None, TypeError), ("scale\0x", ValueError)],
                         ids=["int", "list", "bytes", "none", "nul"])
def test_a_kernels_name_is_a_str_without_a_nul_refused_before_the_driver(name, error):
    """module.kernel(5) met "'int' object has no attribute 'encode'" and module.kernel(["scale"])
    the kernel cache's bare "unhashable type", naming nothing; a NUL ended the C string the driver
    looks the name up by ("scale\\0x" is "scale" to it). Refused naming the kernel's name, before
    the cache or the driver (neither is here)."""
    from types import SimpleNamespace

    from memra_cuda.driver.module import Kernel, Module
    stand_in = SimpleNamespace(_usable=lambda: None, _kernels={})
    message = "a kernel's name must be a str" if error is TypeError else "a kernel's name holds a NUL character"
    with pytest.raises(error, match=f"^{message}"):
        Module.kernel(stand_in, name)  # type: ignore[arg-type]
    with pytest.raises(error, match=f"^{message}"):
        Kernel(SimpleNamespace(), name)  # type: ignore[arg-type]
    assert stand_in._kernels == {}


# -- what device memory can hold, and constructor arguments --------------------------------


@pytest.mark.parametrize("dtype", [object, "U4", "S4", np.complex64, np.complex128, ">u4", np.longdouble, "V8"])
def test_device_buffers_refuse_element_types_the_device_cannot_hold(dtype):
    with pytest.raises(ValueError, match="element type"):
        DeviceBuffer.wrap(FAKE_PTR, dtype, 4)


@pytest.mark.parametrize("values", [np.array([1, "x"], dtype=object), np.array(["12"]), np.array([1 + 2j]), ["1"]],
                         ids=["object", "unicode", "complex", "str-list"])
@pytest.mark.parametrize("dtype", [np.uint32, np.float32])
def test_exact_array_refuses_what_is_not_numbers(values, dtype):
    with pytest.raises((ValueError, TypeError)):
        exact_array(values, dtype)


@pytest.mark.parametrize("values", [[True, 5], (5, np.True_), [True, False], np.array([True, False]), [[5, True]],
                                    [(1, 2), [3, np.True_]], (np.array([1]), np.array([True]))],
                         ids=["list", "tuple", "bools", "bool-array", "nested", "nested-tuple", "arrays"])
def test_exact_array_refuses_bools_for_an_integer_buffer(values):
    """A bool is no token, position or row: [True, 5] was uploaded as token 1 (numpy reads the
    list as int64); a float buffer takes them as 0 and 1, as numpy would."""
    with pytest.raises(TypeError, match="bools given for a uint32 buffer"):
        exact_array(values, np.uint32)
    assert exact_array([True, 5], np.float32).tolist() == [1.0, 5.0]
    assert exact_array(np.array([True]), np.bool_).tolist() == [True]


def test_exact_array_refuses_a_masked_array_with_values_masked():
    """numpy's masked array is an ndarray whose masked values still hold data: a copy to the device
    read that data (token 0, or whatever the array held), as if nothing were masked. One with
    nothing masked is its values."""
    masked = np.ma.array([7, 8, 9], mask=[False, True, False])
    for dtype in (np.uint32, np.float32, np.int64):
        with pytest.raises(ValueError, match=r"^a masked array with 1 masked values: fill them"):
            exact_array(masked, dtype)
    assert exact_array(np.ma.array([7, 8, 9], mask=False), np.uint32).tolist() == [7, 8, 9]
    assert exact_array(masked.compressed(), np.uint32).tolist() == [7, 9]


def test_a_float_or_bool_buffer_takes_a_value_only_as_given_or_rounded():
    """A float rounded to the buffer's precision is taken; a finite value that would overflow to
    inf, an int the float cannot hold exactly and a bool buffer's 0.5 or -1 are refused (they were
    stored as inf, 16777216 and True). Each at its limit."""
    assert exact_array([2**24, 0.1, float("inf"), -3.4028235e38], np.float32)[[0, 2, 3]].tolist() == [
        2**24, float("inf"), -3.4028234663852886e38]
    assert np.isnan(exact_array([float("nan")], np.float32)).all()
    assert exact_array([65504.0], np.float16).tolist() == [65504.0]
    assert exact_array([1, 0, True], np.bool_).tolist() == [True, False, True]
    for values, dtype in (([2**24 + 1], np.float32), ([1e39], np.float32), ([65520.0], np.float16),
                          ([2], np.bool_), ([-1], np.bool_), ([0.5], np.bool_)):
        with pytest.raises(ValueError, match=f"{np.dtype(dtype).name} cannot hold"):
            exact_array(values, dtype)


def test_exact_array_converts_big_python_ints_exactly():
    assert exact_array([1, 2**63, 2**64 - 1], np.uint64).tolist() == [1, 2**63, 2**64 - 1]
    with pytest.raises(ValueError):
        exact_array([1.5], np.uint32)


def test_a_seed_is_an_int_from_0_to_2_64_less_1_and_its_bits_an_int64():
    """as_seed, the one check of a request's seed (a Server's submit, a decoder's prefill and
    admission, the toy's prefill): the 64-bit Philox key, unsigned (docs/sampling.md), named by
    `what`; seed_bits, the int64 of its bits that a torch decoder's seed tensor holds."""
    for seed in (0, 1, 2**63 - 1, 2**63, 2**64 - 1, np.uint64(2**64 - 1), np.int64(5)):
        assert as_seed(seed) == int(seed) and type(as_seed(seed)) is int
    for seed in (-1, -(2**63), 2**64, 2**80):
        with pytest.raises(ValueError, match=rf"^seed must be an int from 0 to 2\*\*64 - 1 \(a 64-bit key\), "
                                             rf"not {seed}$"):
            as_seed(seed)
    for seed in (True, np.True_, 1.0, "1", None):
        with pytest.raises(TypeError, match=f"^its seed must be an integer, not {seed!r}$"):
            as_seed(seed, "its seed")
    assert [seed_bits(s) for s in (0, 2**63 - 1, 2**63, 2**64 - 1)] == [0, 2**63 - 1, -(2**63), -1]
    for seed in (0, 5, 2**63 - 1, 2**63, 2**64 - 1):
        assert np.array([seed_bits(seed)], np.int64).view(np.uint64)[0] == seed, "the same 64 bits"


@pytest.mark.parametrize("ptr, length, kind", [(0, 4, ValueError), (FAKE_PTR, -5, ValueError), (0, -5, ValueError),
                                               (1.5, 4, TypeError), (FAKE_PTR, 2.0, TypeError),
                                               (2**64 - 8, 4, ValueError)],
                         ids=["null", "negative", "null-negative", "float-ptr", "float-length", "past-2**64"])
def test_device_buffer_constructor_validates(ptr, length, kind):
    with pytest.raises(kind):
        DeviceBuffer(ptr, np.uint32, length)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint32, np.uint64])
def test_an_allocation_past_a_size_t_of_bytes_is_refused_naming_its_length(dtype):
    """engine.alloc(np.uint64, 2**61) and engine.pinned(...) handed cuMemAlloc (cuMemHostAlloc) a
    byte count past a size_t, and the binding raised OverflowError ("Python int too large to
    convert to C unsigned long"), naming nothing. The length is as_size's, at most what a size_t
    of bytes holds, refused before the engine is asked (none here); at the limit, taken."""
    from types import SimpleNamespace

    from memra_cuda.driver.buffer import PinnedBuffer
    most = (2**64 - 1) // np.dtype(dtype).itemsize
    for length in (most + 1, 2**64, 2**100):
        for make in (DeviceBuffer.allocate, PinnedBuffer):
            with pytest.raises(ValueError, match=f"^length must be an int from 1 to {most}, not {length}$"):
                make(None, dtype, length)  # type: ignore[arg-type]
    engine = SimpleNamespace(capture_hold=None)  # past the length's check, the stand-in's missing `capturing`
    for make in (DeviceBuffer.allocate, PinnedBuffer):
        with pytest.raises(AttributeError, match="capturing"):
            make(engine, dtype, most)  # type: ignore[arg-type]


@pytest.mark.parametrize("start, count", [(1.5, 2), (1, 2.0), ("1", 2)])
def test_view_refuses_non_integers(start, count):
    with pytest.raises(TypeError):
        fake_buffer(10).view(start, count)
    assert fake_buffer(10).view(np.int64(1), np.uint8(2)).ptr == FAKE_PTR + 4


@pytest.mark.parametrize("value, kind", [("1.5", TypeError), (None, TypeError), (True, TypeError),
                                         (1e39, ValueError), (-1e39, ValueError), (10**400, ValueError),
                                         (-(10**400), ValueError)],
                         ids=["str", "none", "bool", "1e39", "-1e39", "10**400", "-10**400"])
def test_float_arguments_take_numbers_in_range(value, kind):
    with pytest.raises(kind, match="argument 0"):
        KernelArgs(["f32"]).set(value)


@pytest.mark.parametrize("value", [np.longdouble("1e400"), np.longdouble("-1e400"), 10**400, 2**1024],
                         ids=["longdouble", "-longdouble", "10**400", "2**1024"])
def test_an_f64_argument_refuses_a_finite_number_past_float64_naming_it(value):
    """np.longdouble('1e400') was stored as inf without a word, and an int past every float
    raised a raw OverflowError: a finite number the type cannot hold is a ValueError naming the
    argument, and the slot keeps its value."""
    if np.isinf(np.longdouble(value)) and isinstance(value, np.floating):
        pytest.skip("this machine's longdouble is float64: 1e400 is an infinity as given")
    args = KernelArgs(["f64"])
    args.set(2.5)
    with pytest.raises(ValueError, match="argument 0 \\(f64\\): .* is outside the range of float64"):
        args.set(value)
    assert slot_bytes(args, 0) == expected_slot("f64", 2.5)
    args.set(np.longdouble("inf"))  # an infinity given as one is taken
    assert slot_bytes(args, 0) == expected_slot("f64", np.inf)


@pytest.mark.parametrize("value", [1.5, 3, np.float64(2.5), np.int32(-4), float("inf"), float("nan")])
def test_float_arguments_accept_numbers(value):
    args = KernelArgs(["f32"])
    args.set(value)
    assert slot_bytes(args, 0)[:4] == np.array(value, np.float32).tobytes()


# -- dependents: freeing a handle poisons what holds its address ---------------------------


class Holder(Handle):
    """A stand-in for a launch, graph or table: something that copied an address."""

    def __repr__(self) -> str:
        return "Holder"


def test_free_poisons_dependents_with_the_freed_buffers_name():
    buf = DeviceBuffer.wrap(FAKE_PTR, np.uint32, 4)
    buf.label = "ring_d"
    holder = Holder()
    buf.depend(holder)
    holder._usable()
    buf.free()
    with pytest.raises(ValueError, match=r"Holder refuses to run: it uses DeviceBuffer\(ring_d u32\[4\]"):
        holder._usable()


def test_freeing_a_parent_poisons_dependents_of_its_views_and_chains_on():
    parent = fake_buffer()
    view = parent.view(3, 2)
    first, second = Holder(), Holder()
    view.depend(first)
    first.depend(second)  # a table bound into a launch, say
    parent.free()
    for holder in (first, second):
        with pytest.raises(ValueError, match="which was freed"):
            holder._usable()


def test_dependents_are_held_weakly_and_notified_once():
    buf = fake_buffer()
    holder = Holder()
    alive = weakref.ref(holder)
    buf.depend(holder)
    del holder
    gc.collect()
    assert alive() is None, "a buffer must not keep what depends on it alive"
    buf.free()
    buf.free()


def test_freeing_a_view_leaves_dependents_of_the_parent_alone():
    parent = fake_buffer()
    holder = Holder()
    parent.depend(holder)
    parent.view(0, 1).free()
    holder._usable()



class Releases:
    """A stand-in context for an owning buffer's release (Handle._own): it records each call."""

    def __init__(self):
        self.calls = []

    def finalize(self, name, *args):
        self.calls.append((name, *args))


def test_memory_another_framework_holds_goes_back_only_once_its_holders_are_gone():
    """A torch tensor on a buffer (memra_cuda.torch.tensor) holds the memory: free() refuses
    memra's use of the buffer and its views at once, but the release waits until the buffer is
    collected, which its holders prevent (a holder keeps the buffer); without holders, free()
    releases at once."""
    released = Releases()
    buf = DeviceBuffer(FAKE_PTR, np.uint32, 8)
    buf._own(released, "cuMemFree", FAKE_PTR)
    view, holder = buf.view(2, 4), Holder()
    view.hold(holder)  # held on the owner, whichever window it was made from
    launch = Holder()
    buf.depend(launch)
    buf.free()
    assert buf.freed and view.freed and released.calls == [], "a tensor still reads it"
    with pytest.raises(ValueError, match="used after free"):
        buf.ptr
    with pytest.raises(ValueError, match="used after free"):
        view.ptr
    with pytest.raises(ValueError, match="which was freed"):
        launch._usable()
    buf.free()  # idempotent, still held
    del holder
    gc.collect()
    assert released.calls == [], "the buffer itself is still referenced here"
    del buf, view
    gc.collect()
    assert released.calls == [("cuMemFree", FAKE_PTR)]
    alone = Releases()
    buf = DeviceBuffer(FAKE_PTR, np.uint32, 8)
    buf._own(alone, "cuMemFree", FAKE_PTR)
    gone = Holder()
    buf.hold(gone)
    del gone
    gc.collect()
    buf.free()
    assert alone.calls == [("cuMemFree", FAKE_PTR)], "no holder left: released at free()"
    tensor = Holder()  # borrowed memory's owner (a tensor), back to its allocator when the borrow is dropped
    borrowed = DeviceBuffer.wrap(FAKE_PTR, np.uint32, 4, keepalive=tensor)
    kept, held = weakref.ref(tensor), Holder()
    borrowed.hold(held)
    del tensor
    borrowed.free()
    borrowed.free()  # a second free drops nothing either
    gc.collect()
    assert kept() is not None, "the owner of memory a holder reads was dropped"
    del held, borrowed
    gc.collect()
    assert kept() is None


def test_memory_whose_address_the_array_interface_handed_out_goes_back_only_once_the_buffer_is_collected():
    """torch.as_tensor(buf) or cupy.asarray(buf) read __cuda_array_interface__ and keep the buffer
    object, not a holder: free() released the memory under the array, whose reads and writes then
    landed in whatever the allocator handed it to next. Now reading the interface (of the buffer or
    a view of it) exports the memory: free() refuses memra's use at once, as always, and the
    release waits for the buffer's collection, which the array's reference prevents. A buffer whose
    interface was never read, and memra_cuda.torch.tensor's reading (_interface, which holds the
    memory its own way), release at free() as before."""
    for exported in (lambda buf: buf, lambda buf: buf.view(1, 2)):
        released = Releases()
        buf = DeviceBuffer(FAKE_PTR, np.uint32, 8)
        buf._own(released, "cuMemFree", FAKE_PTR)
        consumer = [exported(buf)]  # what an array made from the interface keeps
        consumer[0].__cuda_array_interface__
        launch = Holder()
        buf.depend(launch)
        buf.free()
        assert buf.freed and released.calls == [], "the consumer's array still reads the memory"
        with pytest.raises(ValueError, match="used after free"):
            buf.ptr
        with pytest.raises(ValueError, match="which was freed"):
            launch._usable()
        del buf
        gc.collect()
        assert released.calls == [], "the consumer keeps the buffer, and so the memory"
        consumer.clear()
        gc.collect()
        assert released.calls == [("cuMemFree", FAKE_PTR)]
    released = Releases()
    buf = DeviceBuffer(FAKE_PTR, np.uint32, 8)
    buf._own(released, "cuMemFree", FAKE_PTR)
    buf._interface()
    kept = buf
    buf.free()
    assert kept is buf and released.calls == [("cuMemFree", FAKE_PTR)], "nothing exported: released at free()"


def test_freeing_borrowed_memory_waits_for_the_stream_of_a_call_or_graph_dropped_since():
    """Borrowed memory (a tensor's) goes back to its owner's allocator at free(), so free() waits
    for the streams that queued work on it: it found them among its dependents, and a launch made,
    run and dropped in one line (kernel.prepare().set(x=buf)()), or a graph dropped while its
    replay was queued, was no dependent any more: the memory went back with the kernel still
    queued on it. A prepared call or a graph now tells the memory its stream as it binds it, as
    the engine's copies do. (No driver: a stand-in stream, whose waits are counted.)"""
    from memra_cuda.driver.call import Prepared
    from memra_cuda.driver.graph import Graph

    for made in ("call", "graph"):
        stream, tensor = StandInStream(), Holder()
        borrowed = DeviceBuffer.wrap(FAKE_PTR, np.uint32, 4, keepalive=tensor)
        if made == "call":
            Prepared(stream, lambda: (0,), "a launch", (), (borrowed.view(1, 2),))()
        else:
            graph = Graph.__new__(Graph)
            graph.engine, graph._held = stream, {}
            graph.hold(borrowed)
            del graph
        gc.collect()
        borrowed.free()
        assert stream.waits == 1, f"the {made}'s stream was not waited for before the memory went back"


class StandInStream(Stream):
    """A Stream with no driver under it: its host waits are counted (`waits`), the events a
    deferred release records on it are numbered (`marks`), the device reaches them only as the
    stream is waited for, and their destruction is recorded (`destroyed`); `capturing` may be set
    (a framework's capture, torch.cuda.graph, on it). The Stream's own synchronize, close, _mark's
    refusal during a capture and the release's bookkeeping (release.py) run as they are."""

    capturing = False  # type: ignore[assignment]  # a property of Stream's: asks the driver

    def __init__(self) -> None:  # no Stream.__init__: no context, no stream
        self.waits, self.marks, self.reached, self.destroyed = 0, [], set(), []
        self.capture_hold, self.guards, self.syncs, self._stream = None, [], 0, None
        self.ctx = types.SimpleNamespace(device=0, fault=None, run=lambda fn, name, argv: fn(*argv),
                                         reached=lambda event: event in self.reached,
                                         finalize=lambda name, *args: self.destroyed.append((name, *args)))

        def wait(stream: object) -> tuple:  # cuStreamSynchronize: the device reaches every mark
            self.waits += 1
            self.reached.update(self.marks)
            return (0,)
        self._synchronize = wait

    def _mark(self) -> int | None:
        if self.capture_hold is not None or self.capturing:
            return None
        self.marks.append(len(self.marks) + 1)
        return self.marks[-1]


def test_a_collected_borrowed_buffer_keeps_its_owner_until_the_streams_ran_its_work():
    """A buffer on a tensor's memory (from_cuda_array: engine.memset(tensor, 0) adopts it for the
    call alone) dropped its keepalive when collected, work queued on the memory or not: with the
    caller's last reference to the tensor gone, torch's allocator gave the block to the next tensor
    while memra's memset or kernel still wrote it. The collected buffer now hands the tensor to
    release_after, which holds it until each stream that queued work on the memory has reached an
    event recorded as the buffer went, and lets go at the next release or a stream's synchronize()
    or close(), never waiting; a closed stream's work is done, a faulted context's memory lost, and
    a buffer no work was queued on holds nothing. (No driver: stand-in streams, release.py as it is.)"""
    from memra_cuda.driver import release

    before = release.pending()
    stream, other, tensor = StandInStream(), StandInStream(), Holder()
    buf = DeviceBuffer.wrap(FAKE_PTR, np.uint32, 4, keepalive=tensor)
    buf.view(1, 2).queued_on(stream)  # a copy into a view: the memory's owner learns the stream
    buf.queued_on(other)
    kept = weakref.ref(tensor)
    del tensor, buf
    gc.collect()
    assert kept() is not None, "the tensor went back with the buffer, its memory's work still queued"
    assert (stream.marks, other.marks, release.pending()) == ([1], [1], before + 2)
    release.drain()
    assert kept() is not None, "released before the streams reached the work"
    stream.synchronize()
    assert kept() is not None and release.pending() == before + 1, "one stream has run its work, not both"
    assert stream.destroyed == [("cuEventDestroy", 1)], "the reached event is destroyed"
    other.close()
    assert kept() is None and release.pending() == before, "the last stream ran its work: the tensor goes"
    assert other.destroyed == [("cuEventDestroy", 1)]

    for ended in ("closed", "faulted", "no work"):
        stream, tensor = StandInStream(), Holder()
        buf, kept = DeviceBuffer.wrap(FAKE_PTR, np.uint32, 4, keepalive=tensor), weakref.ref(tensor)
        if ended != "no work":
            buf.queued_on(stream)
        if ended == "closed":
            stream.close()
        elif ended == "faulted":
            stream.ctx.fault = CudaError(700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal address", "cuLaunchKernel")
        del tensor, buf
        gc.collect()
        assert kept() is None and stream.marks == [] and release.pending() == before, ended


def test_an_interrupt_in_a_drain_keeps_what_waits():
    """A KeyboardInterrupt (or a signal handler's exception) arriving in a release's query of its
    event went through settled(), which catches only Exception, between drain()'s pop of the entry
    and its append: the entry was lost, and the tensor with it, its memory back in torch's pool
    while memra's stream could still write it (a notebook's interrupted synchronize() goes on).
    The entry is kept, the interrupt goes on to the caller, and a later drain lets it go."""
    from memra_cuda.driver import release

    before = release.pending()
    stream, tensor = StandInStream(), Holder()
    buf = DeviceBuffer.wrap(FAKE_PTR, np.uint32, 4, keepalive=tensor)
    buf.queued_on(stream)
    kept = weakref.ref(tensor)
    del tensor, buf
    gc.collect()
    assert kept() is not None and release.pending() == before + 1
    reached = stream.ctx.reached

    def interrupted(event: object) -> bool:
        raise KeyboardInterrupt

    stream.ctx.reached = interrupted
    with pytest.raises(KeyboardInterrupt):
        release.drain()
    assert kept() is not None and release.pending() == before + 1, "an interrupted drain let the tensor go"
    stream.ctx.reached = reached
    stream.synchronize()
    assert kept() is None and release.pending() == before, "the next drain, the work run, lets it go"


def test_borrowed_memory_freed_while_a_stream_is_captured_is_kept_until_that_stream_ran_its_work():
    """free() waits on the host for the streams that queued work on borrowed memory, but no host
    may wait for a stream being captured (memra's Graph, or torch.cuda.graph on it): the borrow was
    dropped at once under memra's capture, and under a framework's the wait failed and invalidated
    that capture. Such a stream now keeps the borrow (release_after): no event can mark its queued
    work while the capture lasts, so one is recorded at the first release or synchronize() after
    it, and the borrow goes once it is reached, or once the stream is closed. A stream not captured
    is waited for as before, and what free() released its collection does not release again."""
    from memra_cuda.driver import release

    before = release.pending()
    for capture in ("memra", "framework"):
        stream, tensor = StandInStream(), Holder()
        buf, kept = DeviceBuffer.wrap(FAKE_PTR, np.uint32, 4, keepalive=tensor), weakref.ref(tensor)
        buf.queued_on(stream)
        if capture == "memra":
            stream.capture_hold = lambda *held: None
        else:
            stream.capturing = True
        del tensor
        buf.free()
        assert stream.waits == 0 and kept() is not None and stream.marks == [], capture
        release.drain()
        assert kept() is not None and stream.marks == [], f"{capture}: marked inside the capture"
        stream.capture_hold, stream.capturing = None, False
        release.drain()
        assert kept() is not None and stream.marks == [1], f"{capture}: the capture over, the work is marked"
        stream.synchronize()
        assert kept() is None and release.pending() == before, capture
        del buf
        gc.collect()
        assert stream.marks == [1], "a buffer freed is released again at its collection"

    stream, tensor = StandInStream(), Holder()
    buf, kept = DeviceBuffer.wrap(FAKE_PTR, np.uint32, 4, keepalive=tensor), weakref.ref(tensor)
    buf.queued_on(stream)
    stream.capturing = True
    del tensor, buf
    gc.collect()
    assert kept() is not None and stream.marks == []
    stream.close()  # close() waits for the stream's work (its capture ended first, here by hand)
    assert kept() is None and release.pending() == before, "a closed stream ran its work"

    stream, tensor = StandInStream(), Holder()
    buf, kept = DeviceBuffer.wrap(FAKE_PTR, np.uint32, 4, keepalive=tensor), weakref.ref(tensor)
    buf.queued_on(stream)
    del tensor
    buf.free()
    assert stream.waits == 1 and kept() is None, "a stream not captured is waited for, the borrow dropped"
    del buf
    gc.collect()
    assert stream.marks == [] and release.pending() == before


def test_a_borrowed_buffer_that_its_owner_keeps_is_collected_once_the_streams_ran_its_work():
    """What a collected borrowed buffer keeps goes to release_after as the buffer goes. A
    weakref.finalize on the buffer did it, whose arguments (the tensor) its registry held: a tensor
    keeping its own adoption (an attribute, a cache of it), or a stream's owner holding the buffer,
    made the buffer reachable from that registry, and once any work was queued on its memory the
    buffer, the tensor and the streams were never collected. The cycle is collected now, after the
    streams have run its work: until then the release holds it. (The collector clears weak
    references into a cycle it resurrects, so the objects are looked for among its own.)"""
    from memra_cuda.driver import release

    def alive(label: str) -> bool:
        return any(isinstance(o, DeviceBuffer) and o.label == label for o in gc.get_objects())

    before = release.pending()
    for reached_back in ("tensor", "stream's owner"):
        stream, tensor = StandInStream(), Holder()
        marks, reached, destroyed, label = stream.marks, stream.reached, stream.destroyed, f"kept by its {reached_back}"
        buf = DeviceBuffer(FAKE_PTR, np.uint32, 4, keepalive=tensor, label=label)  # wrap(), labelled
        if reached_back == "tensor":
            tensor.adopted = buf  # type: ignore[attr-defined]
        else:
            stream._stream_owner = types.SimpleNamespace(buffer=buf)
        buf.view(0, 2).queued_on(stream)
        del tensor, buf, stream
        gc.collect()
        release.drain()
        assert release.pending() == before + 1 and marks == [1], \
            f"a buffer its {reached_back} reaches was never collected: nothing went to the release"
        assert alive(label), "the work queued on the memory not yet run: the release holds the buffer and its owner"
        reached.update(marks)  # the device ran the stream's work
        release.drain()
        gc.collect()
        assert release.pending() == before and not alive(label), f"{reached_back}: the work ran, the cycle is let go"
        assert destroyed == [("cuEventDestroy", 1)]


def test_a_borrowed_buffer_collected_with_its_owned_stream_waits_for_the_streams_end_marked_as_it_went(monkeypatch):
    """An owned stream in one garbage cycle with a borrowed buffer that queued work on it (an object
    holding the engine and an adoption, in a cycle): the collector runs weakref.finalize callbacks
    before any __del__, so the stream's finaliser destroyed it before the buffer's release asked for
    its mark, which then named a destroyed stream (cuStreamIsCapturing and cuEventRecord on a freed
    handle) and, refused, kept the owner for good. The finaliser now records the stream's end first
    (release.StreamEnd), and the release waits for that event; it is destroyed once, with the end,
    not by the release. A stream close() waited for records nothing, unless its handle was handed
    out (__cuda_stream__, a borrowing Engine), whose users may queue more after the close: it is
    marked as it goes. (No driver: a stand-in stream with Stream's own finaliser, its context's
    calls recorded.)"""
    import memra_cuda.driver.stream as stream_module
    from cuda.bindings import driver as bindings
    from memra_cuda.driver import release

    import contextlib
    monkeypatch.setattr(stream_module, "driver", lambda: bindings)
    monkeypatch.setattr(stream_module, "relaxed_capture", contextlib.nullcontext)
    none = bindings.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
    before = release.pending()
    marked = [("cuStreamIsCapturing", "CUstream"), ("cuEventCreate", 2), ("cuEventRecord", "end event", "CUstream"),
              ("cuStreamDestroy", "CUstream")]
    for closed in (False, True, "handed out"):
        stream, tensor = StandInStream(), Holder()
        calls: list[tuple] = []
        reached: set[str] = set()
        label = f"collected with its stream, closed {closed}"

        def call(name: str, *args: object, calls: list = calls) -> object:
            calls.append((name, *args))
            return none if name == "cuStreamIsCapturing" else "end event" if name == "cuEventCreate" else None

        def mark() -> None:
            raise AssertionError("the release asked a destroyed stream for its mark")

        # a context that, as a PrimaryContext, does not reach the stream back (the finaliser holds it)
        stream.ctx = types.SimpleNamespace(device=0, fault=None, call=call, reached=reached.__contains__,
                                           run=lambda fn, name, argv: fn(*argv),
                                           finalize=lambda name, *args, calls=calls: calls.append((name, *args)))
        stream._mark = mark
        stream._end = release.StreamEnd(stream.ctx)  # as Stream.__init__ makes an owned stream's
        stream._finalizer = weakref.finalize(stream, stream_module._destroy, stream.ctx, "CUstream", stream._end)
        buf = DeviceBuffer(FAKE_PTR, np.uint32, 4, keepalive=tensor, label=label)
        stream._stream_owner = types.SimpleNamespace(buffer=buf)  # the cycle: the stream's owner holds the buffer
        buf.queued_on(stream)
        if closed == "handed out":
            stream._exported = True  # as __cuda_stream__ leaves it
            stream.close()
            assert calls == [], "a handed-out stream is closed to memra, destroyed only as it is collected"
        elif closed:
            stream.close()
            assert calls == [("cuStreamDestroy", "CUstream")], "close() waited for the stream: no end is marked"
            calls.clear()
        del tensor, buf, stream, mark
        gc.collect()
        release.drain()
        if closed == "handed out":
            assert release.pending() == before, "close() waited for the work queued on the memory before it"
            assert calls == marked + [("cuEventDestroy", "end event")], \
                "its handle's users may have queued more since: its end is marked as it goes, and destroyed once"
            continue
        if closed:
            assert calls == [] and release.pending() == before, "a closed stream ran its work"
            continue
        assert calls == marked, "the stream's end is marked before it is destroyed"
        assert release.pending() == before + 1, "the owner went with the stream, its work not known to have run"
        reached.add("end event")  # the device ran the destroyed stream's work
        release.drain()
        gc.collect()
        assert release.pending() == before
        assert calls[4:] == [("cuEventDestroy", "end event")], "the end's event is destroyed once, with the end"
        assert not any(isinstance(o, DeviceBuffer) and o.label == label for o in gc.get_objects())


def test_mapped_memory_is_not_freed_under_a_tensor_made_from_its_device_buffer():
    """MappedBuffer.free() refused while a numpy view of the memory lived, but not while a tensor
    on its `device` buffer did (memra_cuda.torch.tensor's hold, or torch.as_tensor of its array
    interface): the pinned memory went back under the tensor. It is refused now too, naming the
    buffer, and goes once the tensor and that buffer are dropped; a device buffer only launches
    held is poisoned as before. (No driver: the buffer is built by hand, its release counted.)"""
    from memra_cuda.driver.buffer import MappedBuffer

    def mapped() -> tuple[MappedBuffer, Releases]:
        buf, released = MappedBuffer.__new__(MappedBuffer), Releases()
        buf.dtype, buf.len, buf.label = np.dtype(np.uint32), 4, "feed"
        buf.engine = types.SimpleNamespace(device=0, closed=True)
        buf._ptr, buf._address, buf._viewed, buf._devices = FAKE_PTR, FAKE_PTR + 4096, [], []
        buf._own(released, "cuMemFreeHost", FAKE_PTR)
        return buf, released

    for read in ("hold", "interface"):
        buf, released = mapped()
        device, tensor = buf.device, Holder()
        if read == "hold":
            device.view(1, 2).hold(tensor)
        else:
            device.view(1, 2).__cuda_array_interface__
        with pytest.raises(ValueError, match=r"still read by a tensor or an array made from DeviceBuffer\(feed"):
            buf.free()
        assert released.calls == [] and not buf.freed
        del tensor, device
        gc.collect()
        buf.free()
        assert released.calls == [("cuMemFreeHost", FAKE_PTR)]
    buf, released = mapped()
    device, launch = buf.device, Holder()
    device.depend(launch)
    buf.free()
    assert released.calls == [("cuMemFreeHost", FAKE_PTR)]
    with pytest.raises(ValueError, match="which was freed"):
        launch._usable()


# -- adopting __cuda_array_interface__ objects (what needs no driver) ------------------------


class FakeArray:
    def __init__(self, **iface):
        self.__cuda_array_interface__ = {"shape": (4,), "typestr": "<u4", "data": (FAKE_PTR, False),
                                         "version": 3, **iface}


@pytest.mark.parametrize("iface", [{"shape": (4, 2), "strides": (4, 16)}, {"shape": (0,)}, {"typestr": "<c8"},
                                   {"mask": object()}, {"shape": (2, 3), "strides": (8, 8)}],
                         ids=["transposed", "empty", "complex", "masked", "gapped"])
def test_from_cuda_array_refuses_before_asking_the_driver(iface):
    with pytest.raises(ValueError):
        DeviceBuffer.from_cuda_array(FakeArray(**iface))


@pytest.mark.parametrize("shape, kind, message", [
    ((-1, -2), ValueError, r"^each dimension of an array interface's shape \(-1, -2\) must be an int of at least 0, "
                           r"not -1$"),
    ((4, -1), ValueError, r"^each dimension of an array interface's shape \(4, -1\) must be an int of at least 0"),
    (4, TypeError, r"^an array interface's shape must be a list, a tuple or a 1-D array of ints, not 4$"),
    ((2.0,), TypeError, r"^each dimension of an array interface's shape \(2\.0,\) must be an integer, not 2\.0$")],
    ids=["negatives", "one-negative", "bare-int", "float"])
def test_from_cuda_array_refuses_a_shape_of_anything_but_sizes_naming_it(monkeypatch, shape, kind, message):
    """An interface's shape was read as ints alone: (-1, -2) multiplied to 2 elements and was
    adopted, and a bare int met "'int' object is not iterable", naming nothing. Each dimension an
    int of at least 0 (as_size), in a tuple or a list, refused naming the shape before the driver
    is asked (here, a stand-in device lookup that would take it)."""
    import memra_cuda.driver.buffer as buffer_module

    monkeypatch.setattr(buffer_module, "_device_of", lambda ptr: 0)
    with pytest.raises(kind, match=message):
        DeviceBuffer.from_cuda_array(FakeArray(shape=shape))  # type: ignore[arg-type]
    assert len(DeviceBuffer.from_cuda_array(FakeArray(shape=[2, np.int64(3)]))) == 6  # type: ignore[arg-type]


@pytest.mark.parametrize("field, given, kind, message", [
    ("data", None, TypeError, r"^the data of FakeArray's __cuda_array_interface__ must be a \(pointer, read-only\) "
                              r"pair, not None$"),
    ("data", (FAKE_PTR,), TypeError, r"^the data of FakeArray's __cuda_array_interface__ must be a \(pointer, "),
    ("data", FAKE_PTR, TypeError, r"^the data of FakeArray's __cuda_array_interface__ must be a \(pointer, "),
    ("data", (1.5, False), TypeError, r"^the pointer of the data of FakeArray's __cuda_array_interface__ must be an "
                                     r"integer, not 1\.5$"),
    ("strides", 4, TypeError, r"^the strides of FakeArray's __cuda_array_interface__ \(None where it is contiguous\) "
                              r"must be a list, a tuple or a 1-D array of ints, not 4$"),
    ("strides", (4,), ValueError, r"^the strides of FakeArray's __cuda_array_interface__ must be one a dimension of "
                                  r"its shape \(2, 3\), not \(4,\)$"),
    ("strides", (12, 4, 4), ValueError, r"^the strides of FakeArray's __cuda_array_interface__ must be one a "),
    ("strides", (12.0, 4), TypeError, r"^each of the strides of FakeArray's __cuda_array_interface__ must be an "
                                      r"integer, not 12\.0$")],
    ids=["data-none", "data-one", "data-int", "data-float", "strides-int", "strides-short", "strides-long",
         "strides-float"])
def test_from_cuda_array_refuses_data_or_strides_of_no_form_naming_the_object_and_the_field(monkeypatch, field, given,
                                                                                             kind, message):
    """An interface's data of None met "'NoneType' object is not subscriptable" and a bare int
    for its strides "'int' object is not iterable", naming nothing; strides fewer than the
    dimensions were paired with the last ones alone (zip), so shape (2, 3) with strides (4,), its
    rows' stride not given, was adopted as contiguous. Each is refused naming the object and the
    field, before the driver is asked (here, a stand-in device lookup that would take it); a
    pair, strides of one an axis (a list, numpy's ints, an array) and None are taken."""
    import memra_cuda.driver.buffer as buffer_module

    monkeypatch.setattr(buffer_module, "_device_of", lambda ptr: 0)
    with pytest.raises(kind, match=message):
        DeviceBuffer.from_cuda_array(FakeArray(shape=(2, 3), **{field: given}))  # type: ignore[arg-type]
    missing = FakeArray()
    del missing.__cuda_array_interface__["data"]
    with pytest.raises(TypeError, match=r"^the data of FakeArray's __cuda_array_interface__ must be .*, not None$"):
        DeviceBuffer.from_cuda_array(missing)  # type: ignore[arg-type]
    for strides in (None, (12, 4), [12, np.int64(4)], np.array([12, 4])):
        buf = DeviceBuffer.from_cuda_array(FakeArray(shape=(2, 3), strides=strides))  # type: ignore[arg-type]
        assert (buf.ptr, len(buf)) == (FAKE_PTR, 6)
    assert len(DeviceBuffer.from_cuda_array(FakeArray(shape=(1, 3), strides=(0, 4)))) == 3  # type: ignore[arg-type]
    assert DeviceBuffer.from_cuda_array(FakeArray(data=[FAKE_PTR, True])).ptr == FAKE_PTR  # type: ignore[arg-type]


@pytest.mark.parametrize("iface", [None, [1, 2], {"typestr": "<u4", "data": (FAKE_PTR, False)},
                                   {"shape": (4,), "data": (FAKE_PTR, False)}],
                         ids=["none", "a-list", "no-shape", "no-typestr"])
def test_from_cuda_array_refuses_an_interface_that_is_no_dict_of_its_fields_naming_the_object(monkeypatch, iface):
    """An interface that was no mapping met "'NoneType' object is not subscriptable" or a list's
    "indices must be integers", and one without its shape or typestr a bare KeyError, naming
    nothing: a TypeError naming the object and the fields, before the driver is asked."""
    import memra_cuda.driver.buffer as buffer_module

    monkeypatch.setattr(buffer_module, "_device_of", lambda ptr: 0)
    array = FakeArray()
    array.__cuda_array_interface__ = iface
    with pytest.raises(TypeError, match=r"^the __cuda_array_interface__ of FakeArray must be a dict holding shape, "
                                        r"typestr and data, not "):
        DeviceBuffer.from_cuda_array(array)  # type: ignore[arg-type]


def test_an_adopted_tensor_that_moved_is_refused_at_its_next_use(monkeypatch):
    """A tensor's memory can move under its owner (resize_, set_, its storage resized to 0): every
    use of an adopted buffer's ptr (a launch's arguments, a table, a copy) asks the tensor for its
    address, and where it moved refuses, naming it, instead of writing into memory torch may have
    given another tensor; a view of it too. Its storage is held as well. (No driver: the device
    lookup stands in.)"""
    import memra_cuda.driver.buffer as buffer_module

    class Tensor(FakeArray):
        def __init__(self) -> None:
            super().__init__()
            self.at, self.storage = FAKE_PTR, object()

        def data_ptr(self) -> int:
            return self.at

        def untyped_storage(self) -> object:
            return self.storage
    monkeypatch.setattr(buffer_module, "_device_of", lambda ptr: 0)
    tensor = Tensor()
    buf = DeviceBuffer.from_cuda_array(tensor)  # type: ignore[arg-type]
    view = buf.view(1, 2)
    assert (buf.ptr, view.ptr, buf.foreign, buf._storage) == (FAKE_PTR, FAKE_PTR + 4, tensor, tensor.storage)
    tensor.at = FAKE_PTR + 4096  # resize_ moved it
    for moved in (buf, view):
        with pytest.raises(ValueError, match=f"names memory its tensor no longer holds .* at {FAKE_PTR + 4096:#x} now"):
            moved.ptr
    assert DeviceBuffer.from_cuda_array(FakeArray()).ptr == FAKE_PTR  # type: ignore[arg-type]  # no data_ptr: as before


def test_from_cuda_array_refuses_host_memory_naming_it():
    """An array of host memory has no __cuda_array_interface__ (a CPU tensor raises
    AttributeError when asked for it): a ValueError saying so, not the AttributeError."""
    with pytest.raises(ValueError, match="ndarray is not device memory"):
        DeviceBuffer.from_cuda_array(np.zeros(3, np.uint32))  # type: ignore[arg-type]


def test_from_cuda_array_says_how_to_adopt_a_bfloat16_array():
    """A bf16 tensor's interface gives typestr '<V2' (torch, ml_dtypes: numpy has no bfloat16),
    which no device buffer holds: the refusal names bfloat16 and the view that adopts its memory
    (as 2-byte ints), where it named only '|V2' and the types a buffer holds, none of which a bf16
    model's tensors are. Refused before the pointer is looked at: no driver needed."""
    class Bf16:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<V2", "data": (FAKE_PTR, False), "version": 2}
    with pytest.raises(ValueError, match=r"bfloat16 .*view\(torch\.int16\)"):
        DeviceBuffer.from_cuda_array(Bf16())  # type: ignore[arg-type]


def test_an_adoption_waits_on_its_producers_stream_only_where_no_capture_is_crossed(monkeypatch):
    """from_cuda_array(obj, engine) waits on the stream the interface names (v3's `stream`) by
    an event: with the engine's stream being captured (memra's Graph, torch.cuda.graph on it) and
    the producer's not of that capture, CUDA refused the wait (a CudaError from inside the
    capture, CUDA_ERROR_STREAM_CAPTURE_ISOLATION) and invalidated the capture; with the producer's
    being captured and the engine's not, the wait pulled the engine's stream into that capture,
    its later work captured and never run. Each is a CaptureError now, before anything is
    queued, naming the remedy; a wait inside one capture (cross-stream: both streams in it) is
    taken, as one outside any. The interface's values: None, no wait; 1 and 2 the default
    streams; 0 (disallowed by the interface) and a negative one a ValueError, before the driver
    is asked. Host logic alone: a stand-in engine told which streams are captured, and in which
    capture; the device lookup stands in."""
    import memra_cuda.driver.buffer as buffer_module
    from memra_cuda.errors import CaptureError

    captures: dict[int, int] = {}  # a stream's handle -> the id of the capture it is in
    waits: list[int] = []
    implicit = CudaError(906, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT", "an implicit dependency", "cuStreamIsCapturing")

    class StandIn(Stream):
        @property
        def capturing(self) -> bool:
            return self._stream_handle in captures

        def captures(self, stream) -> bool:
            if stream == 1 and "implicit" in captures:  # the legacy stream, asked while a blocking one is captured
                raise implicit
            return stream in captures

        def _capture_id(self, stream) -> int:
            return captures[getattr(stream, "handle", stream)]

        def wait_stream(self, other) -> None:
            waits.append(other)

    engine = StandIn.__new__(StandIn)
    engine.ctx, engine._stream_handle, engine.capture_hold = types.SimpleNamespace(device=0), 0x10, None
    engine._stream = types.SimpleNamespace(handle=0x10)
    monkeypatch.setattr(buffer_module, "_device_of", lambda ptr: 0)

    def adopt(**iface) -> DeviceBuffer:
        return DeviceBuffer.from_cuda_array(FakeArray(**iface), engine)  # type: ignore[arg-type]

    for stream, waited in ((None, []), (0x10, [0x10]), (1, [1]), (2, [2]), (0x20, [0x20])):
        waits.clear()
        assert adopt(stream=stream).ptr == FAKE_PTR and waits == waited, stream
    waits.clear()
    adopt()  # a v2 interface: no stream named
    for stream, error, message in ((0, ValueError, r"1 \(the legacy default stream\) .* not 0 \(the interface "
                                                   r"disallows 0\)"),
                                   (-3, ValueError, "not -3"),
                                   ("0x20", TypeError, "an array interface's stream must be an integer, not '0x20'")):
        with pytest.raises(error, match=message):
            adopt(stream=stream)

    captures[0x10] = 7  # the engine's stream being captured
    adopt(stream=0x10)  # its own: nothing to wait for, nothing crossed
    for stream, named in ((0x20, "stream 0x20"), (1, "the legacy default stream"),
                          (2, "the per-thread default stream")):
        with pytest.raises(CaptureError, match=rf"^StandIn\(device=0\) is being captured and FakeArray's "
                                               rf"__cuda_array_interface__ names {named}, which is not of its capture: "
                                               r".*adopt the array before capturing"):
            adopt(stream=stream)
    captures[0x20] = 8  # another capture's stream: CUDA would refuse to merge them
    with pytest.raises(CaptureError, match="which is not of its capture"):
        adopt(stream=0x20)
    assert waits == [0x10]
    captures[0x20] = 7  # forked into the engine's capture: the wait joins it
    adopt(stream=0x20)
    assert waits == [0x10, 0x20]

    del captures[0x10]  # the producer's being captured, the engine's not
    with pytest.raises(CaptureError, match=r"names stream 0x20, which is being captured and StandIn\(device=0\)'s "
                                           r"stream is not: the wait would pull this stream into that capture"):
        adopt(stream=0x20)
    captures["implicit"] = 0  # type: ignore[index]
    with pytest.raises(CaptureError, match="names the legacy default stream, which cannot be waited on while a "
                                           "stream is being captured") as refused:
        adopt(stream=1)
    assert refused.value.__cause__ is implicit and waits == [0x10, 0x20], "a refused wait was made"


def test_as_buffer_names_what_it_cannot_adopt():
    with pytest.raises(TypeError, match="draft_d must be a DeviceBuffer"):
        as_buffer(np.zeros(3, np.uint32), "draft_d")
    buf = fake_buffer()
    assert as_buffer(buf) is buf


def test_the_collector_stays_off_until_the_last_of_overlapping_captures_ends():
    """Captures on two engines from two threads overlap: the first to end must not turn the
    garbage collector back on under the other (a collection there can free memory the other
    capture's graph addresses, which invalidates it)."""
    from memra_cuda.driver.graph import collector_held
    assert gc.isenabled()
    first, second = collector_held(), collector_held()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert not gc.isenabled(), "the collector came back on while a capture was still running"
    second.__exit__(None, None, None)
    assert gc.isenabled()


# -- graph calls' edge data (the CUDA 12 bindings' argument rule) --------------------------------

def test_graph_calls_give_an_edge_each_and_name_the_form_the_bindings_have(monkeypatch):
    """CUDA 12's bindings refuse a dependency list without as many edge-data entries ("List is
    too small: 0 < 1") and spell the edge-taking calls <name>_v2; CUDA 13's take None and the
    plain name. The installed bindings' own CUgraphEdgeData, uninitialised (no driver needed)."""
    from types import SimpleNamespace

    from cuda.bindings import driver as bindings

    from memra_cuda.driver import graph

    monkeypatch.setattr(graph, "driver", lambda: bindings)
    edges = graph._edges(["a", "b"])
    assert len(edges) == 2 and all(isinstance(edge, bindings.CUgraphEdgeData) for edge in edges)
    assert edges[0] is not edges[1]
    assert graph._edges([]) is None
    for name in ("cuGraphAddNode", "cuStreamUpdateCaptureDependencies"):
        assert callable(getattr(bindings, graph._with_edges(name)))
    monkeypatch.setattr(graph, "driver", lambda: SimpleNamespace(cuGraphAddNode=1, cuGraphAddNode_v2=2))
    assert graph._with_edges("cuGraphAddNode") == "cuGraphAddNode_v2"
    monkeypatch.setattr(graph, "driver", lambda: SimpleNamespace(cuGraphAddNode=1))
    assert graph._with_edges("cuGraphAddNode") == "cuGraphAddNode"


def test_a_readback_on_a_guarded_stream_waits_once_for_the_copy_and_the_guards_see_it():
    """dtoh's copy to pageable memory is the wait (it waits for the stream itself): bracketed by
    the guards, with no extra synchronisation before it."""
    from types import SimpleNamespace

    from memra_cuda.driver.stream import Stream
    log: list[str] = []
    guard = SimpleNamespace(begin=lambda: log.append("begin"), end=lambda error: log.append("end"))
    buf = fake_buffer(4)
    engine = SimpleNamespace(guards=[guard], stream="s", readbacks=0, buffer=lambda b: b,
                             no_capture=lambda what, why: None, _wait_host=lambda: log.append("synchronize"),
                             ctx=SimpleNamespace(call=lambda name, *args: log.append(name)))
    engine.host_wait = lambda wait, *args: Stream.host_wait(engine, wait, *args)
    out = Engine.dtoh(engine, buf)
    assert out.shape == (4,) and log == ["begin", "cuMemcpyDtoHAsync", "end", "synchronize"]
    assert engine.readbacks == 1


@pytest.mark.parametrize("dtype", [">u4", "S4", "U1", np.complex64, object])
def test_a_readback_is_read_only_as_an_element_type_device_memory_holds(dtype):
    """dtoh(buf, dtype) checked `dtype`'s size alone: a u32 buffer read as ">u4" came back every
    word byte-swapped (7 as 117440512), as "S4" or "U1" as text, silently. The type is
    device_dtype's, as a view's, refused before the copy (ValueError; object, whose size is 8 on a
    64-bit machine, too)."""
    from types import SimpleNamespace

    log: list[str] = []
    engine = SimpleNamespace(guards=[], stream="s", readbacks=0, buffer=lambda b: b,
                             no_capture=lambda what, why: None, _wait_host=lambda: log.append("synchronize"),
                             host_wait=lambda wait, *args: wait(*args),
                             ctx=SimpleNamespace(call=lambda name, *args: log.append(name)))
    with pytest.raises(ValueError, match="cannot be the element type of device memory"):
        Engine.dtoh(engine, fake_buffer(4, np.uint64 if dtype is object else np.uint32), dtype)
    assert log == [], "refused before the copy"
    assert Engine.dtoh(engine, fake_buffer(4), np.int32).dtype == np.int32  # another type of the size: taken


def test_an_upload_without_a_dtype_is_checked_as_one_with_a_dtype():
    """htod(values) without a dtype sent np.ascontiguousarray(values): a masked array's masked
    values (the data under the mask) were uploaded, and a bool among ints stored as 1, silently,
    where with a dtype exact_array refuses both. Checked alike now, before anything is allocated."""
    from types import SimpleNamespace

    log: list[object] = []
    engine = SimpleNamespace(alloc=lambda dtype, length, label=None: log.append(("alloc", dtype, length)) or "buf",
                             copy_htod=lambda buf, host: log.append(host.tolist()))
    with pytest.raises(ValueError, match="a masked array with 1 masked values"):
        Engine.htod(engine, np.ma.array([1, 2, 3], mask=[0, 1, 0]))
    with pytest.raises(TypeError, match="bools given for a int64 buffer"):
        Engine.htod(engine, [True, 5])
    assert log == [], "refused before anything was allocated"
    assert Engine.htod(engine, np.ma.array([[1, 2], [3, 4]])) == "buf"  # nothing masked: taken, flattened
    assert Engine.htod(engine, [True, False]) == "buf"  # a bool buffer's bools: taken
    assert log == [("alloc", np.dtype(np.int64), 4), [1, 2, 3, 4], ("alloc", np.dtype(bool), 2), [True, False]]


@pytest.mark.parametrize("values", [[[1, 2], [3]], [1, [2, 3]], ([1.5], [2.5, 3.5]), [[1, 2], 3]],
                         ids=["rows", "number-beside-a-list", "tuple-of-rows", "list-beside-a-number"])
def test_a_ragged_list_is_refused_naming_it_by_every_copy(values):
    """A ragged list given to htod (with a dtype or without), copy_htod or exact_array met numpy's
    own ValueError ("setting an array element with a sequence ... inhomogeneous shape"), naming
    nothing. A ValueError naming the list, in exact_array's one place (values.host_array, which
    htod reads its dtype from where none is given), before anything is allocated or copied."""
    from types import SimpleNamespace

    log: list[object] = []
    engine = SimpleNamespace(alloc=lambda dtype, length, label=None: log.append("alloc"),
                             copy_htod=lambda buf, host: log.append("copy"), buffer=lambda dst, what: fake_buffer(8),
                             no_capture=lambda *why: log.append("capture?"))
    ragged = r"^values are numbers, or lists of them of one shape \(each row as long as the others\): not a ragged " \
             rf"list, {re.escape(repr(values))}$"
    for dtype in (np.uint32, np.float32):
        with pytest.raises(ValueError, match=ragged):
            exact_array(values, dtype)
        with pytest.raises(ValueError, match=ragged):
            Engine.htod(engine, values, dtype)
    with pytest.raises(ValueError, match=ragged):
        Engine.htod(engine, values)
    with pytest.raises(ValueError, match=ragged):
        Engine.copy_htod(engine, fake_buffer(8), values)
    assert log == [], "refused before anything was allocated or copied"
    assert exact_array([[1, 2], [3, 4]], np.uint32).tolist() == [1, 2, 3, 4]  # rows of one length: flattened


def test_an_upload_of_ints_past_int64_without_a_dtype_is_refused_not_sent_as_floats():
    """numpy reads [2**63 + 1, 1] (a u64 beside an int, [2**64 - 1, 5] too) as float64: htod
    without a dtype sent them rounded (2**63 + 1 as 2**63), silently. A ValueError asking for a
    dtype, before anything is allocated; floats, ints within int64 and an empty list as before."""
    from types import SimpleNamespace

    log: list[object] = []
    engine = SimpleNamespace(alloc=lambda dtype, length, label=None: log.append(("alloc", dtype, length)) or "buf",
                             copy_htod=lambda buf, host: log.append(host.tolist()))
    for values in ([2**63 + 1, 1], [2**64 - 1, 5], (np.uint64(2**64 - 1), -1), [2**64, 1]):
        with pytest.raises(ValueError, match=r"^ints past int64 given without a dtype, which numpy reads as "
                                             r"(float64|object): give one \(htod\(values, np.uint64\)\)"):
            Engine.htod(engine, values)
    assert log == [], "refused before anything was allocated"
    assert Engine.htod(engine, [1.5, 2]) == Engine.htod(engine, [2**63 - 1, -1]) == "buf"
    assert log[1::2] == [[1.5, 2.0], [2**63 - 1, -1]] and log[2] == ("alloc", np.dtype(np.int64), 2)


def memset_stand_in(log: list) -> object:
    """An engine for Engine.memset with no driver under it: its driver calls logged (name, bits)."""
    from types import SimpleNamespace

    ctx = SimpleNamespace(call=lambda name, ptr, bits, count, stream: log.append((name, bits)))
    return SimpleNamespace(buffer=lambda buf: buf, activate=lambda: ctx, stream="s", _uses=lambda *handles: None)


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.uint32, np.int32, np.uint64, np.float32, np.float64,
                                   np.bool_])
def test_memset_takes_an_int_not_a_bool_nor_a_float_equal_to_0(dtype):
    """memset asked `value != 0` before anything else: False, np.False_, 0.0, np.float64(0) and
    Fraction(0) equal 0, so they were taken as 0, where set_u32 (exact_int) refused them. By
    exact_int's rules now, as set_u32's and copy_htod's: a bool TypeError, a float ValueError, what
    is no number a TypeError; refused before the driver. An int, a numpy one too, as before."""
    from decimal import Decimal
    from fractions import Fraction

    log: list = []
    engine, buf = memset_stand_in(log), fake_buffer(8, dtype)
    for value, error in ((False, TypeError), (np.False_, TypeError), (0.0, ValueError), (-0.0, ValueError),
                         (np.float64(0), ValueError), (np.float32(0), ValueError), (Fraction(0), TypeError),
                         (Decimal(0), TypeError), ("0", TypeError), (None, TypeError),
                         (np.array([0, 0]), TypeError), (ArrayBool(), TypeError)):
        with pytest.raises(error):
            Engine.memset(engine, buf, value)
    assert log == [], "a refused value reached the driver"
    for value in (0, np.int32(0), np.uint64(0), np.int8(0)):
        Engine.memset(engine, buf, value)
    assert log == [("cuMemsetD8Async", 0)] * 4
    kind, size = np.dtype(dtype).kind, np.dtype(dtype).itemsize
    if kind not in "iu" or size > 4:  # a u64 buffer's 0.0 is exact_int's ("0.0 is not an integer (uint64 expected)")
        for value in (1, np.int64(1), 2**70, *((0.0, np.float32(0)) if kind not in "iu" else ())):
            with pytest.raises(ValueError, match=rf"^memset of {np.dtype(dtype).name} elements supports only the int "
                                                 rf"0, not {re.escape(repr(value))}$"):
                Engine.memset(engine, buf, value)


def test_memset_sends_a_numpy_integer_as_its_bits_and_refuses_one_out_of_range():
    log: list = []
    engine = memset_stand_in(log)
    Engine.memset(engine, fake_buffer(8, np.uint32), np.int32(7))
    Engine.memset(engine, fake_buffer(8, np.int8), np.int8(-3))
    Engine.memset(engine, fake_buffer(8, np.int16), -2)
    assert log == [("cuMemsetD32Async", 7), ("cuMemsetD8Async", 0xFD), ("cuMemsetD16Async", 0xFFFE)]
    for value in (np.int64(2**32), 2**32, -1):
        with pytest.raises(ValueError, match="outside the range of uint32"):
            Engine.memset(engine, fake_buffer(8, np.uint32), value)
    with pytest.raises(ValueError, match=r"^1\.5 is not an integer \(uint32 expected\)"):
        Engine.memset(engine, fake_buffer(8, np.uint32), 1.5)
    assert len(log) == 3


def test_a_launch_past_cudas_grid_limits_is_refused_at_prepare_naming_the_axis():
    from memra_cuda.driver.module import GRID_LIMITS, _dim3
    assert _dim3((64, 65535), "toy_probs's grid", GRID_LIMITS) == (64, 65535, 1)  # at the limit
    assert _dim3(2**31 - 1, "grid", GRID_LIMITS) == (2**31 - 1, 1, 1)
    for dims, axis in (((64, 65536), "y"), ((1, 1, 65536), "z"), (2**31, "x")):
        with pytest.raises(ValueError, match=f"toy_probs's grid .* limit of .* in {axis}"):
            _dim3(dims, "toy_probs's grid", GRID_LIMITS)
    with pytest.raises(ValueError, match="1 to 3 positive sizes"):
        _dim3((1, 0), "grid", GRID_LIMITS)


def test_a_kernels_launch_is_refused_past_the_grid_limits_before_the_driver_is_asked():
    """Launch (every prepare()) checks its grid against GRID_LIMITS under the kernel's name: the
    toy's grid rows a position (toy_probs, toy_tree_probs) rely on it. The stand-in kernel has no
    handle and no driver behind it, so a check after cuLaunchKernel's binding would fail otherwise."""
    from types import SimpleNamespace

    from memra_cuda.driver.module import Launch
    module = SimpleNamespace(_usable=lambda: None, engine=None)
    kernel = SimpleNamespace(module=module, name="toy_probs", handle=None, declared=tuple, signature=None,
                             check_sizes=lambda types: None)
    with pytest.raises(ValueError, match=r"toy_probs's grid \(64, 65536, 1\) is past CUDA's limit of 65535 in y"):
        Launch(kernel, [], grid=(64, 65536), block=256)
    with pytest.raises(ValueError, match="toy_probs's block .* 1 to 3 positive sizes"):
        Launch(kernel, [], grid=1, block=(256, 0))


def test_a_block_past_cudas_limits_is_refused_at_prepare_not_met_by_the_bindings_overflow():
    """A block was checked for its type and sign alone: one of 2**32 threads in x reached
    cuLaunchKernel's binding at the first launch ("value too large to convert to unsigned int", an
    OverflowError naming nothing, on the per-burst path), and one the driver refuses (2048 in x,
    65 in z, 32 x 64 threads) its CUDA_ERROR_INVALID_VALUE at every launch. Refused at prepare,
    naming the kernel and the axis, or the threads; at the limits, taken."""
    from types import SimpleNamespace

    from memra_cuda.driver.module import Launch, _block
    assert _block(1024, "block") == (1024, 1, 1) and _block((1, 1024), "block") == (1, 1024, 1)
    assert _block((16, 1, 64), "block") == (16, 1, 64) and _block(np.array([32, 32]), "block") == (32, 32, 1)
    for dims, axis, most in ((1025, "x", 1024), ((1, 1025), "y", 1024), ((1, 1, 65), "z", 64), (2**32, "x", 1024)):
        with pytest.raises(ValueError, match=f"^block .* is past CUDA's limit of {most} in {axis}$"):
            _block(dims, "block")
    with pytest.raises(ValueError, match=r"^block \(32, 64, 1\) holds 2048 threads, past CUDA's limit of 1024 a block"):
        _block((32, 64), "block")
    module = SimpleNamespace(_usable=lambda: None, engine=None)
    kernel = SimpleNamespace(module=module, name="toy_probs", handle=None, declared=tuple, signature=None,
                             check_sizes=lambda types: None)
    with pytest.raises(ValueError, match=r"^toy_probs's block \(4294967296, 1, 1\) is past CUDA's limit of 1024 in x"):
        Launch(kernel, [], grid=1, block=2**32)
    with pytest.raises(AttributeError):  # past every check, the stand-in's missing engine: the limit is taken
        Launch(kernel, [], grid=1, block=(8, 8, 16))


@pytest.mark.parametrize("dims", ["128", 2.5, (64, 2.9), True, (True, 2), [1, "2"], None])
def test_a_grid_or_block_of_no_ints_is_refused_not_read_digit_by_digit_or_truncated(dims):
    """_dim3 took each size through int(): a grid given as "128" was the grid (1, 2, 8), 16 blocks
    where 128 were meant; 2.9 blocks were 2 and True one, each launched without a word. A size is
    an int (or a numpy integer), one or a list of up to three."""
    from types import SimpleNamespace

    from memra_cuda.driver.module import GRID_LIMITS, Launch, _dim3
    with pytest.raises(TypeError, match="grid must be an int or 1 to 3 ints"):
        _dim3(dims, "grid", GRID_LIMITS)
    assert _dim3(np.array([2, 3]), "grid", GRID_LIMITS) == (2, 3, 1)  # a 1-D array of sizes, as before
    assert _dim3(np.uint32(7), "block") == (7, 1, 1)
    module = SimpleNamespace(_usable=lambda: None, engine=None)
    kernel = SimpleNamespace(module=module, name="toy_probs", handle=None, declared=tuple, signature=None,
                             check_sizes=lambda types: None)
    with pytest.raises(TypeError, match="toy_probs's block must be an int or 1 to 3 ints"):
        Launch(kernel, [], grid=1, block=dims)


@pytest.mark.parametrize(("shared", "error"), [(-1, ValueError), (2**32, ValueError), (1.5, TypeError),
                                               ("1024", TypeError), (True, TypeError)])
def test_a_launchs_shared_memory_is_a_byte_count_checked_at_prepare(shared, error):
    """`shared` went through int(): 1.5 bytes were 1, "1024" was 1024 and -1 reached the binding.
    A count of bytes, 0 to an unsigned int's most (at the limit taken), refused naming the kernel."""
    from types import SimpleNamespace

    from memra_cuda.driver.module import SHARED_MOST, Launch
    module = SimpleNamespace(_usable=lambda: None, engine=None)
    kernel = SimpleNamespace(module=module, name="toy_probs", handle=None, declared=tuple, signature=None,
                             check_sizes=lambda types: None)
    with pytest.raises(error, match="toy_probs's dynamic shared memory"):
        Launch(kernel, [], grid=1, block=32, shared=shared)
    with pytest.raises(AttributeError):  # past every check, the stand-in's missing engine: SHARED_MOST is taken
        Launch(kernel, [], grid=1, block=32, shared=SHARED_MOST)


@pytest.mark.parametrize("reported, release", [(12040, (12, 4)), (13010, (13, 1)), (12090, (12, 9))])
def test_the_drivers_version_is_read_as_its_release(monkeypatch, reported, release):
    """cuDriverGetVersion's 1000 * major + 10 * minor, read in one place (the compiler's NVRTC choice
    and the device loop's check for WHILE nodes both take it)."""
    from memra_cuda.driver import errors
    monkeypatch.setattr(errors, "call", lambda name: {"cuDriverGetVersion": reported}[name])
    assert errors.driver_version() == release


def test_a_switchs_bodies_are_a_list_or_a_tuple_refused_otherwise_before_the_driver():
    """LoopBuilder.switch(handle, bodies) given a generator met "object of type 'generator' has no
    len()" inside the graph's build, naming nothing, and a set's bodies would be its hashes' order,
    each case another's body. A list or a tuple, in order (as_listed): a TypeError naming the
    bodies before the driver is asked (no driver here: a builder with none, its node recorded)."""
    from memra_cuda.driver.graph import LoopBuilder

    def body() -> None:
        pass

    builder, added = object.__new__(LoopBuilder), []
    builder._conditional = lambda handle, kind, bodies: added.append((kind, bodies))  # type: ignore[method-assign]
    for bodies in ((b for b in [body]), {body}, {0: body}, body):
        with pytest.raises(TypeError, match=r"^a switch's bodies must be a list, a tuple or a 1-D array of callables "
                                            r"\(one a case, in order\), not "):
            builder.switch(0xC0, bodies)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^a switch needs at least one body$"):
        builder.switch(0xC0, ())
    assert added == []
    builder.switch(0xC0, (body, body))
    assert added == [("CU_GRAPH_COND_TYPE_SWITCH", [body, body])]


def test_a_captures_engines_share_one_hold_so_a_joined_engines_wait_is_taken_and_an_outsiders_refused():
    """A capture marks each of its engines (its own and `joined`) with the graph's hold, by which
    an engine's wait on an event of another knows whether it joins a capture it is one of. Each
    engine was given a bound method of its own (`self.hold` read anew), never the same object:
    every joined wait, a pipeline's between its stages, would have been refused. Host logic
    alone: stand-in engines, a capture that runs `issue` and stops before the driver."""
    from memra_cuda.driver.graph import Graph
    from memra_cuda.errors import CaptureError

    class Stop(Exception):
        pass

    main, joined, outsider = (stream_stand_in(activate=lambda: None) for _ in range(3))
    waits = []

    def issue():
        Engine._joins(joined, main)  # a joined stage waits on the capturing engine's event, and back
        Engine._joins(main, joined)
        with pytest.raises(CaptureError, match=r"would wait on a graph being captured .* joined=\[\.\.\.\]"):
            Engine._joins(outsider, main)
        waits.append("checked")

    def capture(engine, issue):
        issue()
        raise Stop

    with pytest.raises(Stop):
        Graph(main, issue, capture=capture, joined=[joined])  # type: ignore[arg-type]
    assert waits == ["checked"] and all(e.capture_hold is None for e in (main, joined, outsider))
    Engine._joins(outsider, main)  # no capture under way: nothing to join


def test_a_graphs_joined_engines_are_a_list_not_one_engine():
    """Graph(engine, issue, joined=other), one engine given for the list, met "'Engine' object is
    not iterable" as the capture's engines were gathered, naming nothing. A list or a tuple
    (as_listed): a TypeError naming joined, before the engine is activated or anything captured.
    Host logic alone: stand-in engines, a capture that runs `issue` and stops before the driver."""
    from memra_cuda.driver.graph import Graph

    class Stop(Exception):
        pass

    activated: list[str] = []
    main, other = (stream_stand_in(activate=lambda: activated.append("activate")) for _ in range(2))
    issued: list[str] = []

    def capture(engine, issue):
        issue()
        raise Stop

    for joined in (other, iter([other]), {"stage": other}):
        with pytest.raises(TypeError, match="^joined must be a list, a tuple or a 1-D array of engines, not "):
            Graph(main, lambda: issued.append("issued"), capture=capture, joined=joined)  # type: ignore[arg-type]
    assert activated == [] and issued == [] and main.capture_hold is None is other.capture_hold
    with pytest.raises(Stop):
        Graph(main, lambda: issued.append("issued"), capture=capture, joined=(other,))  # type: ignore[arg-type]
    assert activated == ["activate"] and issued == ["issued"]


def test_an_engine_being_captured_waits_only_on_work_of_its_own_capture():
    """CUDA forbids a stream being captured to wait on an event recorded outside its capture
    (before it began, say) or on a stream not in it, and invalidates the capture: the driver's
    refusal came as a bare CudaError from inside the capture. Refused before the wait now, naming
    both; a joined engine not yet forked into the capture still waits on what it likes. Host
    logic alone: stand-in engines whose context records the calls and which say themselves
    which streams are captured, a capture that runs `issue` and stops before the driver."""
    from memra_cuda.driver.event import Event
    from memra_cuda.driver.graph import Graph
    from memra_cuda.errors import CaptureError

    captured, calls = set(), []

    class StandIn(Engine):
        @property
        def capturing(self) -> bool:
            return self.stream in captured

        def captures(self, stream) -> bool:
            return getattr(stream, "stream", stream) in captured

        def wait_stream(self, other) -> None:
            calls.append("wait_stream")

    def engine(stream: int) -> Engine:
        made = StandIn.__new__(StandIn)
        made.ctx = types.SimpleNamespace(device=0, call=lambda name, *args: calls.append(name))
        made._stream, made.capture_hold = stream, None
        return made

    def event(on: Engine) -> Event:
        made = Event.__new__(Event)
        made.engine, made._handle = on, 0xe0
        return made

    class Stop(Exception):
        pass

    main, joined, outsider = engine(0x10), engine(0x20), engine(0x30)
    before = event(main)
    before.record()

    def issue():
        captured.add(0x10)  # the capture began on main's stream
        inside = event(main)
        inside.record()
        Engine.wait(joined, before)  # not forked into the capture yet: an eager wait, taken
        Engine.wait(joined, inside)  # the fork: joined's stream is in the capture from now on
        captured.add(0x20)
        Engine.wait(main, inside)
        forked = engine(0x40)  # forked into the capture by hand (no memra Graph's joined): of it all the same
        captured.add(0x40)
        Engine.wait(main, forked)
        for waiter, other in ((main, before), (joined, before), (main, outsider), (main, 0x30)):
            with pytest.raises(CaptureError, match=r"^StandIn\(device=0\) is being captured and would wait on "):
                Engine.wait(waiter, other)
        assert calls.count("cuStreamWaitEvent") == 3 and calls.count("wait_stream") == 1, "a refused wait was made"
        raise Stop

    with pytest.raises(Stop):
        Graph(main, issue, capture=lambda engine, issue: issue(), joined=[joined])  # type: ignore[arg-type]

"""StreamBufs' host-side bookkeeping, on CPU: the rings' room by its ledger (test_ledger.py
checks the ledger itself), who holds the buffers, the Readback, the rounds each row ran; the
fields' layout in their one allocation; and the streams an Engine may borrow (the CUDA stream
protocol). No device memory is touched: the buffers are built without their allocation
(__new__), the host logic alone, and the layout is laid over an address nobody reads."""
from __future__ import annotations

import numpy as np
import pytest

from memra_cuda import Geometry
from memra_cuda import StreamBufs
from memra_cuda.buffers import Ledger, Readback
from memra_cuda.buffers.arena import carve
from memra_cuda.buffers.layout import (ACC_TOTAL, ACC_WORDS, CTL_BUDGET, CTL_DONE, CTL_EOS, CTL_WORDS, RING_COUNT,
                                      RING_TOKENS)
from memra_cuda.driver.buffer import DeviceBuffer
from memra_cuda.driver.engine import Engine
from memra_cuda.driver.stream import Stream, handle_of
from memra_cuda.errors import BuffersHeld


def host_bufs(m_rounds: int = 4) -> StreamBufs:
    """The host half of a StreamBufs: its ledger and holder, no device memory."""
    bufs = StreamBufs.__new__(StreamBufs)
    bufs.m_rounds, bufs.engine = m_rounds, object()
    bufs.ledger = Ledger()
    bufs.holder, bufs._held_why = None, ""
    return bufs


def test_the_rings_hold_m_rounds_until_a_readback():
    bufs = host_bufs(m_rounds=4)
    bufs.check_free(4)
    bufs.ledger.queued(3)
    bufs.check_free(1)
    with pytest.raises(ValueError, match="3 round.*2 more would overrun the ring"):
        bufs.check_free(2)
    bufs.ledger.queued(0, readback=0)
    bufs.check_free(4)


class AddressOnly:
    """What carve asks of an engine: zeroed memory, here an address nobody reads."""

    def zeros(self, dtype, length, *, label):
        return DeviceBuffer.wrap(0x10000, dtype, length)


def test_the_fields_lie_one_after_another_each_of_batch_rows_in_one_allocation():
    """Row-major, in their order, nothing shared and nothing left over: StreamBufs' readback
    copies the first four fields as one span, and the tree kernels find each field from the
    allocation's address by this layout (ptx/spec_tree.cu)."""
    batch, fields = 3, {"ring_d": (np.uint32, 5), "ctl_d": (np.int32, 4), "score_d": (np.float32, 2)}
    arena, windows = carve(AddressOnly(), batch, fields, label="state")
    assert list(windows) == list(fields) and arena.len == batch * (5 + 4 + 2)
    starts = [(buf.ptr - arena.ptr) // 4 for buf in windows.values()]
    assert starts == [0, batch * 5, batch * (5 + 4)]
    assert [(buf.dtype, buf.len, buf.label) for buf in windows.values()] == [
        (np.dtype(dtype), batch * row, name) for name, (dtype, row) in fields.items()]


def test_the_buffers_have_one_holder_at_a_time():
    bufs, loop, other = host_bufs(), object(), object()
    bufs.hold(loop, "a device-mode loop is still running on these buffers")
    bufs.hold(loop, "a device-mode loop is still running on these buffers")  # the holder may say so twice
    with pytest.raises(BuffersHeld, match="still running") as refused:
        bufs.hold(other, "a second loop")
    assert isinstance(refused.value, ValueError)
    with pytest.raises(BuffersHeld):
        bufs.check_free()
    bufs.release(other)  # only the holder lets go
    assert bufs.holder is loop
    bufs.release(loop)
    bufs.check_free()
    bufs.hold(other, "now")
    assert bufs.holder is other


class Freed:
    """A stand-in buffer that counts its free()."""

    def __init__(self, freed: list[str], name: str) -> None:
        self.freed, self.name = freed, name

    def free(self) -> None:
        self.freed.append(self.name)


def test_buffers_a_device_loop_holds_are_not_freed_under_it():
    """free() freed every buffer while a running device loop held them: its rounds went on
    writing memory the allocator hands out again. It refuses now, as every other use is refused
    (BuffersHeld, the holder's words), before anything is freed; once released, it frees them."""
    bufs, loop, freed = host_bufs(), object(), []
    bufs._fields = {name: Freed(freed, name) for name in ("ring_d", "ctl_d")}
    bufs._arena, bufs._host = Freed(freed, "arena"), [Freed(freed, "slot 0"), Freed(freed, "slot 1")]
    bufs.hold(loop, "a device-mode loop is still running on these buffers")
    with pytest.raises(BuffersHeld, match="a device-mode loop is still running on these buffers"):
        bufs.free()
    assert freed == [], "a buffer was freed under the loop"
    bufs.release(loop)
    bufs.free()
    assert freed == ["ring_d", "ctl_d", "arena", "slot 0", "slot 1"]


class Recording:
    """An engine that records the host-to-device copies asked of it and writes nothing."""

    def __init__(self) -> None:
        self.copies: list[tuple[str, int, list[int]]] = []

    def copy_htod(self, buf, values, start=0):
        self.copies.append((buf, start, np.asarray(values).tolist()))


def row_bufs(batch: int = 3) -> StreamBufs:
    """The host half of a StreamBufs of `batch` rows whose fields are their names, over an
    engine that records what would be written where."""
    bufs = host_bufs()
    bufs.engine, bufs.batch, bufs._ring_row = Recording(), batch, 6
    for name in ("pend_d", "pos_ctr_d", "ctl_d", "ring_d", "brk_d", "acc_d"):
        setattr(bufs, name, name)
    bufs.positions, bufs.done = np.zeros(batch, np.int64), np.zeros(batch, bool)
    bufs.accepted = np.zeros(batch, np.int64)
    return bufs


def test_a_request_starts_in_a_row_in_one_call_checked_before_anything_is_written():
    """start_row: the row's pending token, position and stop rule together, so a server's
    admission never leaves a row live without its budget; a bad stop writes nothing at all."""
    bufs = row_bufs()
    for bad, error in ((dict(budget=-1), ValueError), (dict(budget=4, eos=-2), ValueError),
                       (dict(budget=2.5), TypeError), (dict(budget=2**31), ValueError)):
        with pytest.raises(error):
            bufs.start_row(1, 7, 5, **bad)
        assert bufs.engine.copies == [], f"{bad} refused after a write"
    with pytest.raises(TypeError, match="budget"):
        bufs.start_row(1, 7, 5)  # a budget (None: none) is named, never left out
    bufs.start_row(1, 7, 5, budget=4, eos=9)
    written = {buf: (start, values) for buf, start, values in bufs.engine.copies}
    assert written["pend_d"] == (1, [7]) and written["pos_ctr_d"] == (1, [5])
    start, ctl = written["ctl_d"]
    assert start == CTL_WORDS and len(ctl) == CTL_WORDS
    assert (ctl[CTL_EOS], ctl[CTL_BUDGET], ctl[CTL_DONE]) == (9, 4, 0)
    assert bufs.positions.tolist() == [0, 5, 0] and not bufs.done.any()
    bufs.start_row(2, 3, 0, budget=0)
    assert bufs.done.tolist() == [False, False, True], "a budget of 0 is done at once"


def test_a_zero_dimensional_array_is_one_value_for_every_row():
    """A 0-d array (np.array(5)) is an index as an int is, but per_row took it for one value a
    row and its len() raised a TypeError naming nothing: set_stop(budget=np.array(5)),
    generate_batch(np.array(5))."""
    bufs = row_bufs()
    bufs.set_stop(eos=np.array(9), budget=np.array(5))
    (_, start, ctl), = bufs.engine.copies
    assert start == 0 and [ctl[CTL_WORDS * row + CTL_BUDGET] for row in range(3)] == [5, 5, 5]
    assert [ctl[CTL_WORDS * row + CTL_EOS] for row in range(3)] == [9, 9, 9]
    with pytest.raises(TypeError, match="budget must be an integer"):
        bufs.set_stop(budget=np.array(5.0))


class Named(Stream):
    """A Stream without its context: what the methods are given, not what they use."""

    def __repr__(self) -> str:
        return "Stream(stand-in)"


def test_a_readback_takes_its_tokens_apart_when_asked():
    ring_row = 4  # count, then 3 tokens
    words = np.array([2, 11, 12, 0, 0, 0, 0, 0, 3, 31, 32, 33], np.uint32)
    done, positions = np.array([False, True, False]), np.array([5, 6, 7])
    readback = Readback(words, ring_row, [2, 0, 3], done, positions, np.zeros(3, np.int64))
    assert readback._tokens is None, "tokens taken apart before anyone asked"
    assert [t.tolist() for t in readback.tokens] == [[11, 12], [], [31, 32, 33]]
    assert readback.done is done and readback.positions is positions
    assert "5 tokens over 3 rows, 1 done" in repr(readback)


class ProtocolStream:
    def __init__(self, answer):
        self.answer = answer

    def __cuda_stream__(self):
        return self.answer


def test_each_rows_rounds_are_its_tokens_less_its_accepted_drafts_and_tau_and_the_drafts_agree():
    """From what the last readback brought (`accepted`), with no readback of their own: the
    engine here has no dtoh to call."""
    bufs = host_bufs()
    bufs.batch, bufs.k, bufs.engine = 3, 4, object()
    bufs.accepted = np.array([12, 0, 30], np.int64)  # each row's ACC_TOTAL at the last readback
    committed = [20, 5, 40]
    assert bufs.rounds_run(committed).tolist() == [8, 5, 10]
    assert bufs.drafts_accepted(committed) == (42, 4 * 23)
    assert bufs.tokens_per_round(committed) == 65 / 23
    with pytest.raises(ValueError, match=r"committed needs one value per row \(3\), not 2"):
        bufs.rounds_run([1, 2])
    # numpy's int64 cast truncated 20.9 to 20, read "5" as 5 and took -1: each a statistic silently wrong
    for call in (bufs.rounds_run, bufs.drafts_accepted, bufs.tokens_per_round):
        for bad, error, named in (([20.9, 5, 40], TypeError, r"committed must be an integer, not 20.9 \(row 0\)"),
                                  ([20, "5", 40], TypeError, r"committed must be an integer, not '5' \(row 1\)"),
                                  ([20, 5, -1], ValueError, r"committed must be an int from 0 to .*\(row 2\)"),
                                  ([20, True, 40], TypeError, r"not True \(row 1\)"),
                                  (25, ValueError, r"committed needs one value per row \(3\), not 1")):
            with pytest.raises(error, match=named):
                call(bad)
    bufs.batch, bufs.accepted = 1, np.zeros(1, np.int64)
    assert bufs.tokens_per_round(0) == 1.0  # no round ran


class Slot:
    """A pinned readback slot's words, as read()."""

    def __init__(self, words):
        self.words = np.array(words, np.int64).astype(np.uint32)

    def read(self):
        return self.words.copy()


def test_a_readback_brings_each_rows_accepted_drafts_with_its_tokens():
    """The one copy a burst's readback makes holds the rings, the ctl rows, the positions and
    acc_d side by side: receive takes each row's ACC_TOTAL from it (a request's acceptance with
    no readback of its own), and a reset row's count is 0 until the next readback."""
    from types import SimpleNamespace
    bufs = row_bufs(batch=2)
    bufs._ring_row, bufs.ring_cap = 3, 2  # a count, then 2 tokens
    bufs._rings_end, bufs._ctl_end, bufs._positions_end = 6, 6 + 2 * CTL_WORDS, 6 + 2 * CTL_WORDS + 2
    bufs.engine = SimpleNamespace(finish_readback=lambda event: None, copy_htod=lambda *args, **kwargs: None)
    ctl = [[-1, -1, 0, 1], [-1, -1, 1, 1]]  # row 1 done
    bufs._host = [Slot([2, 5, 6, 1, 7, 0, *ctl[0], *ctl[1], 10, 20, 1, 3, 0, 5])]
    readback = bufs.receive(0)
    assert readback.accepted.tolist() == [3, 5] and bufs.accepted.tolist() == [3, 5]
    assert readback.committed == [2, 1] and readback.positions.tolist() == [10, 20]
    assert readback.done.tolist() == [False, True] and [t.tolist() for t in readback.tokens] == [[5, 6], [7]]
    assert "8 drafts accepted" in repr(readback)
    with pytest.raises(ValueError):
        bufs.accepted[0] = 1  # read-only, as positions and done
    bufs.reset_row(1, 4, 2)
    assert bufs.accepted.tolist() == [3, 0], "a new request in row 1 has had no draft accepted"


def test_a_stream_is_taken_in_every_form_an_engine_author_has_one():
    """An int, `.cuda_stream` (torch), and the CUDA stream protocol (cuda.core, CuPy): the same
    handle, whatever the form; a protocol answer of another version refused (finding 5)."""
    forms = [0x1234, np.uint64(0x1234), type("Torch", (), {"cuda_stream": 0x1234})(), ProtocolStream((0, 0x1234))]
    assert [handle_of(form) for form in forms] == [0x1234] * 4
    for bad in ((1, 0x1234), 0x1234, (0,)):
        with pytest.raises(TypeError, match=r"__cuda_stream__\(\) must return \(0, handle\)"):
            handle_of(ProtocolStream(bad))
    for bad in ("stream 7", ProtocolStream((0, "7"))):
        with pytest.raises(TypeError, match="__cuda_stream__"):
            handle_of(bad)
    # an int no handle is met the binding's OverflowError ("can't convert negative value to unsigned
    # PY_LONG_LONG") as it was made a CUstream (Engine.wait, wait_stream, Engine(stream=...)), naming nothing
    for bad in (-1, 2**64, ProtocolStream((0, -1)), type("Torch", (), {"cuda_stream": 2**64})()):
        with pytest.raises(ValueError, match=r"^a stream handle \(an address\) must be an int from 0 to "
                                             r"18446744073709551615, not "):
            handle_of(bad)  # as_stream, read by Engine.wait, wait_stream, Engine(stream=...)
    assert handle_of(2**64 - 1) == 2**64 - 1 and handle_of(0) == 0  # at the limits: taken


@pytest.mark.parametrize("cls", ["StreamBufs", "TreeBufs"])
def test_the_fields_carved_are_the_buffers_the_class_declares(cls):
    """__init__ sets its attributes from carve's fields by name: a field carved but not declared
    would be an attribute mypy does not know, one declared but not carved an AttributeError."""
    import ast
    import inspect
    from memra_cuda.buffers.tree import TreeBufs
    klass = {"StreamBufs": StreamBufs, "TreeBufs": TreeBufs}[cls]
    (call,) = [node for node in ast.walk(ast.parse(inspect.getsource(klass.__init__).lstrip()))
               if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "carve"]
    carved = {key.value for key in call.args[2].keys}
    assert carved == {name for name, kind in klass.__annotations__.items() if kind == "DeviceBuffer"}


class HostOnly(Engine):
    """An Engine that touches no device: memory at an address nobody reads, host writes and the
    readback's copies recorded, and a pinned slot whose words the test sets."""

    def __init__(self) -> None:  # no context, no stream
        self.writes: list = []
        self.copies: list[tuple[object, DeviceBuffer]] = []
        self.slots: list[Slot] = []

    def zeros(self, dtype, length, *, label=None):
        return DeviceBuffer.wrap(0x10000, dtype, length)

    def pinned(self, dtype, length, *, label=None):
        self.slots.append(Slot(np.zeros(length, np.uint32)))
        return self.slots[-1]

    def copy_htod(self, dst, values, start=0):
        self.writes.append((dst, start))

    def prepare_dtoh(self, dst, src, start=0):
        self.copies.append((dst, src))
        return lambda: None

    def prepare_set_u32(self, buf, index, value, *, every=0):
        return lambda: None

    def finish_readback(self, event=None):
        pass


def test_the_readback_copies_the_fields_receive_reads_where_the_constructor_put_them():
    """A real StreamBufs' layout, on CPU: the readback's one copy spans the rings, ctl rows,
    positions and acc_d from the allocation's start, and receive reads each row's words at the
    addresses the fields were given (a value written at each field's own place comes back as that
    field's)."""
    engine = HostOnly()
    bufs = StreamBufs(engine, Geometry(2, 2, 3))
    (slot, span), _ = engine.copies  # one copy a readback slot
    assert span.ptr == bufs.ring_d.ptr and span.len == bufs.ring_d.len + bufs.ctl_d.len + bufs.pos_ctr_d.len + \
        bufs.acc_d.len
    assert bufs.acc_d.ptr + 4 * bufs.acc_d.len == span.ptr + 4 * span.len, "acc_d closes the copied span"
    words = np.zeros(span.len, np.int64)

    def at(field: DeviceBuffer, index: int, value: int) -> None:
        words[(field.ptr - span.ptr) // 4 + index] = value
    ring_row = 1 + bufs.ring_cap
    for row, (count, done, position, accepted) in enumerate([(2, 0, 10, 4), (0, 1, 20, 0), (1, 0, 30, 9)]):
        at(bufs.ring_d, row * ring_row + RING_COUNT, count)
        for i in range(count):
            at(bufs.ring_d, row * ring_row + RING_TOKENS + i, 100 * row + i)
        at(bufs.ctl_d, row * CTL_WORDS + CTL_DONE, done)
        at(bufs.pos_ctr_d, row, position)
        at(bufs.acc_d, row * ACC_WORDS + ACC_TOTAL, accepted)
    slot.words = words.astype(np.uint32)
    readback = bufs.receive(0)
    assert readback.committed == [2, 0, 1] and readback.done.tolist() == [False, True, False]
    assert readback.positions.tolist() == [10, 20, 30] and readback.accepted.tolist() == [4, 0, 9]
    assert [t.tolist() for t in readback.tokens] == [[0, 1], [], [200]]


def test_a_readback_slot_but_0_or_1_is_refused_before_anything_waits_or_is_queued():
    """receive(2) waited for the readback and counted it (the engine's readbacks) before its
    IndexError, which named nothing; queue_readback(2) raised one too. Each finds its slot
    first now, naming it; they test nothing else a burst (-1 is slot 1 in both, as in the
    ledger's), so a burst pays nothing for it."""
    engine = HostOnly()
    engine.capture_hold, waits, queued = None, [], []
    engine.finish_readback = lambda event=None: waits.append(event)
    bufs = StreamBufs(engine, Geometry(2, 2, 3))
    bufs._readback_copies = [lambda: queued.append(0), lambda: queued.append(1)]
    for slot, error in ((2, ValueError), (-3, ValueError), (None, TypeError), ("0", TypeError)):
        with pytest.raises(error, match="^a readback slot must be an int"):
            bufs.receive(slot)
        with pytest.raises(error, match="^a readback slot must be an int"):
            bufs.queue_readback(slot)
        assert waits == [] and queued == [] and bufs.ledger.covers == [0, 0]
    bufs.queue_readback(1)
    bufs.receive(1)
    assert waits == [None] and queued == [1]


def test_a_bool_readback_slot_is_refused_before_anything_waits_or_is_queued():
    """receive(True) and queue_readback(True) read and filled slot 1 (False slot 0), as a list
    indexes by a bool, and entered it in the ledger so: a TypeError naming the slot now, before
    anything is waited for, queued or entered, as as_slot refuses one where a slot is chosen."""
    engine = HostOnly()
    engine.capture_hold, waits, queued = None, [], []
    engine.finish_readback = lambda event=None: waits.append(event)
    bufs = StreamBufs(engine, Geometry(2, 2, 3))
    bufs._readback_copies = [lambda: queued.append(0), lambda: queued.append(1)]
    for slot in (True, False):
        with pytest.raises(TypeError, match=rf"^a readback slot must be an integer, not {slot}$"):
            bufs.queue_readback(slot)
        with pytest.raises(TypeError, match=rf"^a readback slot must be an integer, not {slot}$"):
            bufs.receive(slot)
    assert waits == [] and queued == [] and bufs.ledger.covers == [0, 0] and bufs.ledger.events == 0
    bufs.queue_readback(np.int64(1))
    bufs.receive(np.int64(1))
    assert waits == [None] and queued == [1] and bufs.ledger.covers == [0, 0]


def test_a_caches_layers_are_kv_layers_or_none_checked_when_it_is_made():
    """Cache("ab") held the layers "a" and "b", and Cache(None) was a bare TypeError; an entry that
    is no KVLayer (Cache([1])) failed only where its capacity or a table read it, an
    AttributeError naming nothing; cache + None an AttributeError too."""
    from memra_cuda.buffers import Cache, KVLayer
    layer = KVLayer(DeviceBuffer.wrap(0x7F0000000000, np.int32, 2), 64)  # an address nobody reads
    for kv in ("ab", None, 7, {layer}):
        with pytest.raises(TypeError, match=r"^kv must be a list, a tuple or a 1-D array of KVLayers or None, not "):
            Cache(kv)
    for kv, at in (([1], 0), ([layer, None, "layer"], 2), ((None, layer.len_d), 1)):
        with pytest.raises(TypeError, match=rf"^kv entry {at} must be a KVLayer \(or None\), not "):
            Cache(kv)
    cache = Cache((layer, None))
    assert cache.kv == [layer, None] and cache.capacity == 64
    assert (cache + Cache([None])).kv == [layer, None, None] and Cache(np.array([None, layer])).kv == [None, layer]
    for other in (None, [layer], (layer,)):
        with pytest.raises(TypeError, match=r"^unsupported operand type\(s\) for \+: 'Cache' and "):
            cache + other

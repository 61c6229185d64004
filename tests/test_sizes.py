"""Every size the public face takes is checked where it is given (issue 49, item 1): drafts,
rounds, rows, entries, widths, lengths. One that is negative, zero where none makes sense, past
its limit, a bool, a float or a string is refused naming the parameter: ValueError for
the right kind with the wrong value, TypeError for the wrong kind (docs/errors.md, "Bad
input"); numpy integers are sizes like any int. CPU only: every refusal comes before an engine
is asked for anything, so the engine here is a stand-in that has nothing to give."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from memra_cuda import (DeviceBuffer, DynamicTree, Geometry, Greedy, KVLayer, Module, RoundStream, Sampling,
                        StateLayer, StreamBufs, TreeShape, kv_capacity)
from memra_cuda.buffers import Capacity, KVData
from memra_cuda.buffers.geometry import MAX_BATCH
from memra_cuda.buffers.stream_bufs import per_row
from memra_cuda.buffers.tree import MAX_TREE_CANDIDATES

FAKE_PTR = 0x7F0000000000  # a device address nothing here reads
NO_ENGINE = object()  # what a call may not touch before its sizes are checked
WRONG_KIND = (2.5, 256.0, "4", b"4", True, False, np.bool_(True))  # None is some sizes' default


def words(n: int, dtype: Any = np.uint32) -> DeviceBuffer:
    return DeviceBuffer.wrap(FAKE_PTR, dtype, n)


def with_(call: Callable[..., Any], **good: Any) -> Callable[[str, Any], Any]:
    """`call` with the valid keywords `good`, one of them replaced."""
    return lambda name, value: call(**{**good, name: value})


KV_CAPACITY = with_(kv_capacity, prompt_len=5, max_new_tokens=256, geometry=Geometry(4, 16))
GEOMETRY = with_(Geometry, k=4, m_rounds=16)
# (what, the call with one keyword replaced, the keyword, its least and most values)
SIZES = [
    ("kv_capacity", KV_CAPACITY, "prompt_len", 1, None),
    ("kv_capacity", KV_CAPACITY, "max_new_tokens", 0, None),
    ("Geometry", GEOMETRY, "k", 0, None),
    ("Geometry", GEOMETRY, "m_rounds", 1, None),
    ("Geometry", GEOMETRY, "batch", 1, MAX_BATCH),
    ("Geometry", GEOMETRY, "width", 5, None),  # a round writes at least the k + 1 it may advance
    ("Capacity", with_(Capacity, entries=64, geometry=Geometry(4, 16)), "entries", 1, None),
    ("KVLayer.allocate", with_(KVLayer.allocate, engine=NO_ENGINE, capacity=64), "capacity", 1, 2**31 - 1),
    ("KVLayer.allocate", with_(KVLayer.allocate, engine=NO_ENGINE, capacity=64), "width", 1, None),
    ("KVLayer.allocate", with_(KVLayer.allocate, engine=NO_ENGINE, capacity=64), "batch", 1, MAX_BATCH),
    ("KVLayer", with_(KVLayer, len_d=words(1, np.int32), capacity=64), "capacity", 1, 2**31 - 1),
    ("StateLayer", with_(StateLayer, live_d=words(10), slots_d=words(20), row_words=5, k=1), "row_words", 1, None),
    ("StateLayer", with_(StateLayer, live_d=words(10), slots_d=words(20), row_words=5, k=1), "k", 0, None),
    *(("KVData", with_(KVData, k_d=words(80), row_stride=160, pos_stride=16, nbytes=16, capacity=10, batch=2),
       name, least, most)
      for name, least, most in (("row_stride", 0, 2**64 - 1), ("pos_stride", 0, None), ("nbytes", 1, None),
                                ("capacity", 1, None), ("batch", 1, MAX_BATCH))),
    ("TreeShape.chain", with_(TreeShape.chain, k=4), "k", 1, None),
    ("TreeShape.chain_with_leaves", with_(TreeShape.chain_with_leaves, k=4, leaves=1), "k", 1, None),
    ("TreeShape.chain_with_leaves", with_(TreeShape.chain_with_leaves, k=4, leaves=1), "leaves", 0,
     MAX_TREE_CANDIDATES - 1),
    *(("TreeShape.likeliest", with_(TreeShape.likeliest, size=8), name, 1, None) for name in ("size", "depth")),
    ("TreeShape.likeliest", with_(TreeShape.likeliest, size=8), "ranks", 1, MAX_TREE_CANDIDATES),
    *(("DynamicTree", with_(DynamicTree, depth=4, width=4, branch=4), name, 1, None) for name in ("depth", "width")),
    ("DynamicTree", with_(DynamicTree, depth=4, width=4, branch=4), "branch", 1, MAX_TREE_CANDIDATES),
    ("DeviceBuffer.wrap", with_(DeviceBuffer.wrap, ptr=FAKE_PTR, dtype=np.uint32), "length", 1, None),
    ("DeviceBuffer.view", with_(words(16).view, start=0), "count", 1, None),
    # refused where the rule is built, not where its kernel is prepared (as a round is made)
    ("Sampling", with_(Sampling, p_d=None, q_d=None, seed_d=None), "vocab", 1, 2**31 - 1),
]
CASES = [pytest.param(call, name, least, most, id=f"{what}-{name}") for what, call, name, least, most in SIZES]


@pytest.mark.parametrize("call, name, least, most", CASES)
def test_a_size_of_the_wrong_kind_is_a_type_error_naming_it(call, name, least, most):
    for value in WRONG_KIND:
        with pytest.raises(TypeError, match=rf"^{name} must be an integer, not {value!r}$"):
            call(name, value)


@pytest.mark.parametrize("call, name, least, most", CASES)
def test_a_size_out_of_its_range_is_a_value_error_naming_it(call, name, least, most):
    outside = [least - 1, least - 256, -(2**63)] + ([] if most is None else [most + 1, max(most + 1, 2**63)])
    for value in outside:
        with pytest.raises(ValueError, match=rf"^{name} must be an int (from {least} to {most}|of at least {least}), "
                                             rf"not {value}$"):
            call(name, value)


@pytest.mark.parametrize("call, name, least, most", CASES)
def test_numpy_integers_are_sizes(call, name, least, most):
    """The least value the size takes, as a numpy integer: it passes the size's own check (the
    call then goes on, to the stand-in engine or to a rule of the whole that this one value
    breaks, but never refuses the size)."""
    for value in (np.int64(least), np.uint16(least)):
        try:
            call(name, value)
        except (TypeError, ValueError) as refusal:
            assert not str(refusal).startswith(f"{name} must be"), refusal


def test_what_the_issue_found_is_refused():
    """Issue 49's findings, one by one: a negative budget once gave a capacity of -171, a negative
    k one too small, a float prompt length 341, overlap=-3 counted as true, a string prompt length
    Python's own concatenation error, and StreamBufs(None, ...) an AttributeError (so did
    Module(None, ptx), and a RoundStream given its engine, or anything else, for its buffers)."""
    assert kv_capacity(5, 256, Geometry(4, 16)) == 341 and type(kv_capacity(np.int64(5), 256, Geometry(4, 16))) is int
    with pytest.raises(ValueError, match="max_new_tokens must be an int of at least 0, not -256"):
        kv_capacity(5, -256, Geometry(4, 16))
    with pytest.raises(ValueError, match="k must be an int of at least 0, not -4"):
        kv_capacity(5, 256, Geometry(-4, 16))
    with pytest.raises(TypeError, match="prompt_len must be an integer, not 5.0"):
        kv_capacity(5.0, 256, Geometry(4, 16))
    with pytest.raises(TypeError, match="prompt_len must be an integer, not '5'"):
        kv_capacity("5", 256, Geometry(4, 16))
    for overlap in (-3, 1, "yes", None):
        with pytest.raises(TypeError, match=f"overlap must be True or False, not {overlap!r}"):
            kv_capacity(5, 256, Geometry(4, 16), overlap=overlap)
    geometry = Geometry(4, 16)
    assert kv_capacity(5, 256, geometry, overlap=np.bool_(True)) == kv_capacity(5, 256, geometry, overlap=True) == 421
    for make in (lambda: StreamBufs(None, Geometry(4, 16)), lambda: KVLayer.allocate(None, 64),
                 lambda: Module(None, ".version 8.0")):
        with pytest.raises(TypeError, match="engine must be an Engine, not None"):
            make()
    with pytest.raises(TypeError, match=r"^RoundStream's bufs must be a StreamBufs\(engine, geometry\), not 'x'$"):
        RoundStream("x", draft_chain=print, verify_trunk=print, draft_d=None, acceptance=Greedy(None),
                    rollback_tables=[])


def test_a_value_a_row_is_named_with_its_row():
    """Budgets, EOS ids, pending tokens and positions (per_row: one for all rows, or one a row):
    the value's name, and in a sequence its row."""
    assert per_row(np.int64(7), 2, "budget") == [7, 7] and per_row([None, 3], 2, "eos") == [None, 3]
    assert per_row(range(3), 3, "cap") == [0, 1, 2]  # one a row: it was one value for all, refused as row 0's
    with pytest.raises(ValueError, match=r"^cap needs one value per row \(3\), not 2$"):
        per_row(range(2), 3, "cap")
    with pytest.raises(ValueError, match=r"^eos must be None or an int from 0 to 2147483647, not -1 \(row 1\)$"):
        per_row([4, -1], 2, "eos")
    with pytest.raises(ValueError, match=r"^position must be an int from 0 to 2147483647, not 2147483648$"):
        per_row(2**31, 3, "position", optional=False)
    for value in (True, 1.0, None):
        with pytest.raises(TypeError, match="pending must be an integer"):
            per_row(value, 1, "pending", optional=False)
    # The wrong kind in a sequence names its row too, as a value out of range does: a batch's one
    # float among 64 positions was refused without saying which row it was.
    for values, row in (([4, 2.5], 1), ([True, 3, 3], 0), (np.array([1.0, 2.0]), 0)):
        with pytest.raises(TypeError, match=rf"^position must be an integer, not .+ \(row {row}\)$"):
            per_row(values, len(values), "position", optional=False)
    with pytest.raises(TypeError, match=r"^eos must be an integer, not 'x' \(row 2\)$"):
        per_row([None, 5, "x"], 3, "eos")


class Tensorish:
    """An array of another library (a tensor), as row_values knows one without importing it: an
    int `ndim`, a len() and a tolist(), and no numpy type."""

    def __init__(self, values: Any):
        self.values = np.asarray(values)
        self.ndim = self.values.ndim

    def __len__(self) -> int:
        return len(self.values)

    def tolist(self) -> Any:
        return self.values.tolist()

    def __index__(self) -> int:  # a 0-d one is an index, as torch's tensor(5) is
        if self.ndim:
            raise TypeError("only a 0-d array is an index")
        return int(self.values)


def test_an_array_of_any_library_is_one_value_a_row():
    """A 1-D array that is no numpy array (a torch tensor of a budget or an EOS a row) was one
    value for every row, refused as no integer; it is one a row now, as a list, a range and a
    numpy array are, its length checked by `what`; a 0-d one is one value for every row. A
    memoryview, which has an ndim and a tolist() too, is still no values (its bytes' ints)."""
    assert per_row(Tensorish([3, 4, 5]), 3, "budget") == [3, 4, 5]
    assert per_row(Tensorish([None, 9]), 2, "eos") == [None, 9]
    assert per_row(Tensorish(6), 3, "budget") == [6, 6, 6]
    assert per_row(np.array([1, 2]), 2, "eos") == [1, 2] and per_row(np.array(5), 2, "eos") == [5, 5]
    for values in (Tensorish([3, 4]), np.array([3, 4])):
        with pytest.raises(ValueError, match=r"^budget needs one value per row \(3\), not 2$"):
            per_row(values, 3, "budget")
    with pytest.raises(TypeError, match=r"^position must be an integer, not 2.5 \(row 1\)$"):
        per_row(Tensorish(np.array([1, 2.5], object)), 2, "position", optional=False)
    with pytest.raises(TypeError, match=r"^budget must be an integer, not True \(row 0\)$"):
        per_row(Tensorish([True, False]), 2, "budget")
    with pytest.raises(TypeError, match="^budget must be an integer, not <memory at "):
        per_row(memoryview(b"\x01\x02"), 2, "budget")


def test_a_sampling_rules_vocab_is_kept_as_the_int_checked():
    """Sampling's vocab is checked as the rule is built and kept as a plain int (a numpy integer
    too); None is still the rule's leave to derive it from p_d where its kernel is prepared."""
    rule = Sampling(None, None, None, np.int64(7))
    assert rule.vocab == 7 and type(rule.vocab) is int
    assert Sampling(None, None, None, None).vocab is None
    for bad, error in ((-5, ValueError), (0, ValueError), (True, TypeError), (7.0, TypeError), ("7", TypeError)):
        with pytest.raises(error, match=f"^vocab must be .*, not {bad!r}$"):
            Sampling(None, None, None, bad)


def test_a_caches_lengths_are_read_for_a_row_of_every_layers_batch():
    """Cache.lengths(engine, row) checks its row against the layers' batch before it reads: -1
    answered with the last row's lengths (numpy's indexing), a debugging aid reading another
    sequence's. A cache without KV has no batch to check the row against."""
    from types import SimpleNamespace
    from memra_cuda.buffers import Cache
    lens = {FAKE_PTR: np.array([3, 7], np.int32), FAKE_PTR + 64: np.array([4, 8, 9], np.int32)}
    engine = SimpleNamespace(dtoh=lambda buf: lens[buf.ptr])
    cache = Cache([KVLayer(words(2, np.int32), 64), None,
                   KVLayer(DeviceBuffer.wrap(FAKE_PTR + 64, np.int32, 3), 64)])
    assert cache.lengths(engine, 0) == [3, None, 4] and cache.lengths(engine, np.int64(1)) == [7, None, 8]
    for row in (-1, 2, -3):
        with pytest.raises(ValueError, match=rf"^row must be an int from 0 to 1, not {row}$"):
            cache.lengths(engine, row)
    with pytest.raises(TypeError, match="^row must be an integer, not True$"):
        cache.lengths(engine, True)
    assert Cache([None]).lengths(NO_ENGINE, 5) == [None]


def test_a_pipeline_stages_layer_bounds_are_ints_not_bools():
    """kv_len_ptr_table_range and state_copy_table_range take [start, stop) as ints (numpy's
    too): (False, True) was taken as layers [0, 1), and named so in the table's label."""
    from memra_cuda.buffers import Cache, kv_len_ptr_table_range, state_copy_table_range
    tables = (lambda layers: kv_len_ptr_table_range(NO_ENGINE, Cache([None, None]), layers),
              lambda layers: state_copy_table_range(NO_ENGINE, [None, None], layers))
    for table in tables:
        for layers, which in (((False, True), "start"), ((0, True), "stop"), ((np.bool_(False), 2), "start"),
                              ((0, 2.0), "stop")):
            with pytest.raises(TypeError, match=rf"^a layer range's {which} must be an integer, not "):
                table(layers)
        for layers in ((0, 2), (np.int64(0), np.uint8(2)), range(0, 2)):
            with pytest.raises(TypeError, match="engine must be an Engine"):  # the bounds taken: on to the engine
                table(layers)
        with pytest.raises(ValueError, match=r"layers \[0, 3\) are outside a model of 2 layers"):
            table((0, 3))


def test_a_pipeline_stages_layers_are_a_range_or_a_pair_refused_by_name_otherwise():
    """A stage's layers of another shape were unpacked as they came: a slice or None met "cannot
    unpack non-iterable ...", three bounds or one "too many values to unpack" / "not enough", each
    naming nothing, and bytes (b"\\x00\\x02") or a mapping ({0: .., 2: ..}) were taken as layers
    [0, 2), read as their ints or keys."""
    from memra_cuda.buffers import Cache, kv_len_ptr_table_range, state_copy_table_range
    tables = (lambda layers: kv_len_ptr_table_range(NO_ENGINE, Cache([None, None]), layers),
              lambda layers: state_copy_table_range(NO_ENGINE, [None, None], layers))
    for table in tables:
        for layers, error in ((slice(0, 2), TypeError), (None, TypeError), (b"\x00\x02", TypeError),
                              ({0: "a", 2: "b"}, TypeError), ({0, 2}, TypeError), (iter((0, 2)), TypeError),
                              ((0, 1, 2), ValueError), ((2,), ValueError), ([], ValueError)):
            with pytest.raises(error, match="^a layer range "):
                table(layers)
        for layers in ([0, 2], np.array([0, 2])):
            with pytest.raises(TypeError, match="engine must be an Engine"):  # the bounds taken: on to the engine
                table(layers)


class Untouched:
    """Buffers or a round that a call may not ask anything of before it has checked its slot."""

    def __getattr__(self, name):
        raise AssertionError(f".{name} was asked for before the slot was checked")


def test_a_burst_graphs_readback_slot_is_0_or_1_checked_before_anything_is_captured():
    """RoundStream.graph_for(slot) (public, and not a burst's: a burst finds its graph in the
    stream's dict) took any slot: -1 captured a second graph of slot 1, 2 raised an IndexError
    inside the capture. capture_graphs checked its slots for 0 or 1 alone, True among them."""
    from types import SimpleNamespace

    from memra_cuda import RoundStream
    stream = RoundStream.__new__(RoundStream)
    stream.round = stream.bufs = Untouched()
    stream._graphs, stream.sealed = {}, False
    for slot, error in ((-1, ValueError), (2, ValueError), (True, TypeError), (1.0, TypeError), ("0", TypeError)):
        with pytest.raises(error, match=rf"^a readback slot must be an int.*, not {slot!r}$"):
            stream.graph_for(slot, 1)
        with pytest.raises(error, match=rf"^a readback slot must be an int.*, not {slot!r}$"):
            stream.capture_graphs([1], slots=(slot,))
    stream.bufs = SimpleNamespace(m_rounds=4)  # what a length is checked against
    stream._graphs[1, 1] = graph = object()  # captured: found, nothing asked of the round
    assert stream.graph_for(np.int64(1), 1) is graph


def test_capture_graphs_checks_every_slot_and_length_before_it_captures_any():
    """capture_graphs read its lengths once per slot: an iterator of them was used up by slot 0,
    slot 1's graphs left uncaptured, silently (a sealed stream then refused overlap mode); a bad
    slot or length was refused only once the graphs before it were captured (each a device sync
    through torch); one length or one slot given bare met "'int' object is not iterable"."""
    from types import SimpleNamespace

    from memra_cuda import RoundStream
    stream = RoundStream.__new__(RoundStream)
    stream.bufs, stream._graphs, stream.sealed = SimpleNamespace(m_rounds=4), {}, False
    captured: list[tuple[int, int | None]] = []
    stream.graph_for = lambda slot, rounds=None: captured.append((slot, rounds))
    stream.capture_graphs([1, np.int64(2), None], slots=np.array([0, 1]))
    assert captured == [(0, 1), (0, 2), (0, 4), (1, 1), (1, 2), (1, 4)]
    captured.clear()
    for lengths, slots, error, named in (((n for n in (1, 2)), (0, 1), TypeError, "lengths"),
                                         ([1, 2], (0, 2), ValueError, "a readback slot"),
                                         ([1, 2, 8], (0,), ValueError, "rounds"), ([1, 0], (0,), ValueError, "rounds"),
                                         (4, (0,), TypeError, "lengths"), ([1], 0, TypeError, "slots"),
                                         ("12", (0,), TypeError, "lengths"), ({1, 2}, (0,), TypeError, "lengths")):
        with pytest.raises(error, match=f"^{named} "):
            stream.capture_graphs(lengths, slots=slots)
        assert captured == [], f"graphs were captured before {lengths!r}, {slots!r} was refused"


def _switches() -> list[tuple[str, Callable[[Any], Any]]]:
    """Each public switch of the layer that runs without a GPU up to its check, by name."""
    from memra_cuda import Engine, Event, RoundStream
    from memra_cuda.rounds.round import ChainRound
    from memra_cuda.rounds.schedule import Schedule
    from memra_cuda.testing.toy import ToyLM, ToyModel
    return [("pace", lambda flag: RoundStream.of(object.__new__(ChainRound), pace=flag)),
            ("seal", lambda flag: object.__new__(RoundStream).capture_graphs(seal=flag)),
            ("spin", lambda flag: Schedule(spin=flag)),
            ("zeroed", lambda flag: object.__new__(Engine).alloc(np.uint32, 4, zeroed=flag)),
            ("timing", lambda flag: Event(object(), timing=flag)),
            ("with_draft", lambda flag: ToyLM(None, ToyModel(), 64, with_draft=flag)),
            ("overlap", lambda flag: kv_capacity(5, 256, Geometry(4, 16), overlap=flag))]


@pytest.mark.parametrize("flag", ["False", "", 0, 1, None, 1.0])
@pytest.mark.parametrize("name", [name for name, _ in _switches()])
def test_a_switch_takes_true_or_false_alone_naming_itself(name, flag):
    """A switch given a string or a number was read by its truth: pace="False" paced, an
    Event(timing="no") timed, alloc(zeroed="False") queued a memset. Each is refused now, naming
    itself, before anything is made (as_flag, the one check of a switch)."""
    make = dict(_switches())[name]
    with pytest.raises(TypeError, match=f"{name} must be True or False, not {flag!r}"):
        make(flag)

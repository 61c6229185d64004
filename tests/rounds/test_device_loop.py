"""DeviceLoop's host side, on the CPU: what it is given is checked before anything is allocated,
captured or launched (device mode's loop itself runs in test_device_loop_gpu.py)."""
from __future__ import annotations

import numpy as np
import pytest

from memra_cuda import RoundStream
from memra_cuda.errors import CaptureError
from memra_cuda.rounds import device_loop
from memra_cuda.rounds.device_loop import DeviceLoop

ROW_MOST = 2**31 - 1  # a row's budget, an i32 (stream_bufs.ROW_VALUE_MOST)


class Bufs:
    """A loop's buffers: a batch, and whether they were asked if they are free."""

    batch = 2

    def __init__(self) -> None:
        self.asked = 0

    def check_free(self) -> None:
        self.asked += 1


def loop_on_host(monkeypatch: pytest.MonkeyPatch) -> tuple[DeviceLoop, list[tuple[int, int]]]:
    """A DeviceLoop with nothing captured whose feeds and captures touch no device: the feeds
    made (batch, cap) are listed, and a capture gives a stand-in graph."""
    made: list[tuple[int, int]] = []

    class Feed:
        def __init__(self, engine: object, batch: int, cap: int):
            self.batch, self.cap = batch, cap
            made.append((batch, cap))

        def free(self) -> None:
            pass

    class Graph:
        def free(self) -> None:
            pass

    monkeypatch.setattr(device_loop, "TokenFeed", Feed)
    loop = DeviceLoop.__new__(DeviceLoop)  # __init__ would load the decider's module
    loop.engine, loop.bufs = object(), Bufs()
    loop._feed = loop._graph = loop._paced = None
    loop.captures = 0
    monkeypatch.setattr(loop, "_capture", lambda feed, paced: Graph())
    return loop, made


def test_prepare_checks_its_cap_and_pacing_before_anything_is_allocated(monkeypatch):
    """prepare(cap, paced) took True and -5 as caps of 1, silently; 2.5 met "'float' object has no
    attribute 'bit_length'", naming nothing; 2**40 asked the driver for a feed of terabytes; a
    paced of 1 or "yes" was refused by the pass lengths inside the capture, once the feed was
    allocated. Each is refused naming the argument, before the buffers are asked about or a feed
    made, and serves() refuses them alike (RoundStream.require_loop asks it)."""
    loop, made = loop_on_host(monkeypatch)
    for cap, error in ((True, TypeError), (np.True_, TypeError), (2.5, TypeError), ("4", TypeError), (None, TypeError),
                       (np.array([4]), TypeError), (0, ValueError), (-5, ValueError), (ROW_MOST + 1, ValueError),
                       (2**40, ValueError)):
        with pytest.raises(error, match=r"^cap must be an int"):
            loop.prepare(cap, True)
        with pytest.raises(error, match=r"^cap must be an int"):
            loop.serves(cap, True)
    for paced in (1, 0, "yes", None, np.array([True])):
        with pytest.raises(TypeError, match=r"^paced must be True or False, not "):
            loop.prepare(4, paced)
        with pytest.raises(TypeError, match=r"^paced must be True or False, not "):
            loop.serves(4, paced)
    assert loop.bufs.asked == 0 and made == [] and loop.captures == 0
    loop.prepare(np.int64(100), np.True_)  # a numpy int and bool: taken, as their plain values
    assert made == [(2, 128)] and loop.captures == 1 and loop._paced is True
    assert loop.serves(128, True) and not loop.serves(129, True) and not loop.serves(1, False)
    loop.prepare(ROW_MOST, False)  # a row's most budget: a feed of 2**31 tokens a row
    assert made[-1] == (2, 2**31)


def test_capture_loop_names_its_tokens_where_they_are_past_a_rows_budget():
    """RoundStream.capture_loop(tokens) bounds its tokens as the loop bounds its cap, so a refusal
    names the argument the caller gave (capture_loop(2**31) was the loop's "cap must be ...")."""
    stream = RoundStream.__new__(RoundStream)
    prepared: list[tuple[int, bool]] = []

    class Loop:
        def prepare(self, cap: int, paced: bool) -> None:
            prepared.append((cap, paced))

    stream._device, stream.pace = Loop(), True
    for tokens, error in ((ROW_MOST + 1, ValueError), (0, ValueError), (True, TypeError), (7.0, TypeError)):
        with pytest.raises(error, match=r"^tokens must be an int"):
            stream.capture_loop(tokens)
    assert prepared == []
    stream.capture_loop(ROW_MOST)
    assert prepared == [(ROW_MOST, True)]


def test_require_loop_names_its_tokens_and_needs_no_loop_for_none():
    """RoundStream.require_loop(tokens) on a sealed stream passed its tokens to the loop's check,
    which named its `cap` (require_loop(0) was "cap must be an int from 1 ..."): its tokens are
    checked as its own, from 0, and a generation of no tokens asks for no loop."""
    stream = RoundStream.__new__(RoundStream)
    asked: list[tuple[int, bool]] = []

    class Loop:
        def serves(self, cap: int, paced: bool) -> bool:
            asked.append((cap, paced))
            return cap <= 64

    stream._device, stream.pace, stream.sealed = Loop(), True, True
    for tokens, error in ((ROW_MOST + 1, ValueError), (-1, ValueError), (True, TypeError), (7.0, TypeError)):
        with pytest.raises(error, match=r"^tokens must be an int"):
            stream.require_loop(tokens)
    stream.require_loop(0)
    assert asked == []
    stream.require_loop(np.int64(64))
    with pytest.raises(CaptureError, match="loop for 65 tokens a row was not captured"):
        stream.require_loop(65)
    assert asked == [(64, True), (65, True)]


def test_launch_checks_its_round_cap_before_the_feed_is_cleared_or_the_buffers_taken():
    """launch(max_rounds) met a bad cap only at the cap word's write (set_u32: True "a bool, not an
    integer", 2.5 or -1 outside a u32), once the buffers were taken and the feed cleared: the last
    launch's tokens, and every Landed of it, gone; 0 launched a loop that ran no round, its rows
    then refused as stopped at the cap. An int from 1 to I32_MOST (follow's round cap) is checked
    first now, naming it."""
    done: list[str] = []

    class Feed:
        def clear(self) -> None:
            done.append("clear")

    class Graph:
        def _usable(self) -> None:
            pass

        def launch(self) -> None:
            done.append("launch")

    class Held(Bufs):
        class ledger:
            @staticmethod
            def queued(rounds: int, readback: int) -> None:
                done.append("queued")

        def hold(self, holder: object, why: str) -> None:
            done.append("hold")

        def release(self, holder: object) -> None:
            done.append("release")

    class Engine:
        def set_u32(self, buf: object, index: int, value: int) -> None:
            done.append(f"cap {value}")

    loop = DeviceLoop.__new__(DeviceLoop)
    loop.engine, loop.bufs, loop._feed, loop._graph, loop._state_d = Engine(), Held(), Feed(), Graph(), None
    loop._event = type("Event", (), {"record": lambda self: done.append("record")})()
    for rounds, error in ((True, TypeError), (2.5, TypeError), ("7", TypeError), (None, TypeError), (0, ValueError),
                          (-1, ValueError), (ROW_MOST + 1, ValueError)):
        with pytest.raises(error, match=r"^max_rounds must be an int"):
            loop.launch(rounds)
    assert done == []
    loop.launch(np.int64(7))
    assert done == ["hold", "clear", "cap 7", "launch", "record", "queued"]


def test_a_device_loop_takes_a_round_checked_before_anything_is_loaded():
    """DeviceLoop(round) read its round's attributes first: None met "'NoneType' object has no
    attribute 'engine'", a RoundStream "no attribute 'pipelined'" and its buffers "no attribute
    'bufs'", each naming nothing. A TypeError saying what it takes, before the driver is asked."""
    from memra_cuda import Geometry, StreamBufs
    from memra_cuda.driver.engine import Engine

    bufs = StreamBufs.__new__(StreamBufs)
    bufs.engine, bufs.geometry = Engine.__new__(Engine), Geometry(2, 2)
    for given in (None, RoundStream.__new__(RoundStream), bufs, "round"):
        with pytest.raises(TypeError, match=r"^a device loop runs a Round's rounds \(ChainRound, TreeRound: a "
                                            r"RoundStream's \.round\), not "):
            DeviceLoop(given)


@pytest.mark.parametrize(("batch", "cap", "error", "message"), [
    (True, 4, TypeError, "^batch must be an integer, not True$"),
    (2.0, 4, TypeError, "^batch must be an integer, not 2.0$"),
    (0, 4, ValueError, "^batch must be an int from 1 to 65535, not 0$"),
    (65536, 4, ValueError, "^batch must be an int from 1 to 65535, not 65536$"),
    (2, True, TypeError, "^cap must be an integer, not True$"),
    (2, 4.0, TypeError, "^cap must be an integer, not 4.0$"),
    (2, 0, ValueError, f"^cap must be an int from 1 to {2**31}, not 0$"),
    (2, -3, ValueError, f"^cap must be an int from 1 to {2**31}, not -3$"),
    (2, 2**31 + 1, ValueError, f"^cap must be an int from 1 to {2**31}, not {2**31 + 1}$"),
])
def test_a_token_feed_checks_its_batch_and_cap_before_its_memory_is_mapped(monkeypatch, batch, cap, error, message):
    """TokenFeed(engine, batch, cap) took batch=True as one row, a float was refused as the mapped
    words' length (naming neither), and a cap of 0 or less was mapped. Each is refused naming
    the argument (as_batch, as_size; a cap up to the 2**31 tokens prepare() makes a feed of for a
    row's most budget), before anything is mapped."""
    def mapped(*args, **kwargs):
        raise AssertionError("the feed's memory was mapped before its batch and cap were checked")
    monkeypatch.setattr(device_loop, "MappedBuffer", mapped)
    with pytest.raises(error, match=message):
        device_loop.TokenFeed(object(), batch, cap)


def test_a_token_feed_takes_numpy_sizes_up_to_a_rows_most_budgets_feed(monkeypatch):
    """A numpy int is a size; the largest feed prepare() makes (2**31 tokens a row) is taken."""
    asked = []

    class Mapped:
        def __init__(self, engine, dtype, length, label):
            asked.append(length)
            raise RuntimeError("mapped")  # what was asked for is all this test looks at
    monkeypatch.setattr(device_loop, "MappedBuffer", Mapped)
    for batch, cap in ((np.int64(2), np.uint32(8)), (1, 2**31), (np.uint8(200), np.uint8(8))):
        with pytest.raises(RuntimeError, match="mapped"):
            device_loop.TokenFeed(object(), batch, cap)
    # the checked sizes, Python's ints, size the memory: a uint8 batch's words wrapped past 255
    assert asked == [device_loop.HEAD_WORDS + 2 + 2 * 2 * 8, device_loop.HEAD_WORDS + 1 + 2 * 2**31,
                     device_loop.HEAD_WORDS + 200 + 2 * 200 * 8]
    assert all(type(length) is int for length in asked)


def test_a_device_loops_schedule_is_a_schedule_checked_where_it_is_set():
    """loop.schedule took anything: a number of seconds (meant for look_s) or None met an
    AttributeError ("'float' object has no attribute 'begin'") in follow(), once the loop was
    launched and the buffers held. A TypeError naming it where it is set; a Schedule is taken."""
    from memra_cuda.rounds import Schedule
    loop = DeviceLoop.__new__(DeviceLoop)  # __init__ would load the decider's module
    kept = Schedule(look_s=0.0002, spin=True)
    loop.schedule = kept
    for given in (0.0002, None, "spin", Schedule):
        with pytest.raises(TypeError, match=r"^a device loop's schedule must be a Schedule \(memra_cuda\.rounds\."
                                            r"Schedule\(look_s=\.\.\., spin=\.\.\.\)\), not "):
            loop.schedule = given
    assert loop.schedule is kept

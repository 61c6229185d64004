"""The communicator's host side, without a GPU (docs/nccl.md): a rank's place from torchrun's
environment, the id exchange over TCP (every rank gets rank 0's id; a rank 0 that never comes and
ranks that never join are TimeoutErrors, not hangs), the watchdog's rule on a fake clock, how a
host wait answers to its guards, where libnccl is looked for, and, where an NCCL is installed
(the `nccl` extra), its version, ids and error words. None of it needs NCCL to import."""
from __future__ import annotations

import functools
import logging
import os
import pathlib
import re
import socket
import sys
import threading
import time
import types

import numpy as np
import pytest

from memra_cuda import Geometry
from memra_cuda.comm import NcclError, NcclUnavailable, RankFailure, Ranks, exchange_id
from memra_cuda.comm import library
from memra_cuda.comm.communicator import Watch, _Guard, _State
from memra_cuda.comm.library import IN_PROGRESS, UNIQUE_ID_BYTES, nccl_dtype, nccl_op
from memra_cuda.comm.launch import free_port
from memra_cuda.driver.stream import Stream


# -- a rank's place -------------------------------------------------------------------------------

def test_a_rank_reads_torchruns_variables():
    env = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29600"}
    assert Ranks.from_env(env) == Ranks(2, 4, 1, "10.0.0.7", 29601)  # torchrun's store holds MASTER_PORT
    assert Ranks.from_env({**env, "MEMRA_NCCL_PORT": "31000"}).port == 31000
    assert Ranks.from_env({"RANK": "0", "WORLD_SIZE": "1"}) == Ranks(0, 1, 0, "127.0.0.1", 29501)


@pytest.mark.parametrize("env, match", [
    ({"WORLD_SIZE": "2"}, "names RANK"),
    ({}, "RANK and WORLD_SIZE"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK must be a decimal integer"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "0 <= rank < world"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "port"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MEMRA_NCCL_PORT": "x"}, "MEMRA_NCCL_PORT must be a decimal integer"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, "local_rank"),
    # taken, and found out only in the exchange, under its timeout
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": ""},
     r"^address \(MASTER_ADDR\) is rank 0's host name or IP address, not '': name it, or leave it out"),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": " \t"}, r"^address \(MASTER_ADDR\) is .*, not ' \\t'"),
])
def test_a_rank_refuses_an_environment_it_cannot_serve(env, match):
    with pytest.raises(ValueError, match=match):
        Ranks.from_env(env)


@pytest.mark.parametrize("name", ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MEMRA_NCCL_PORT"])
@pytest.mark.parametrize("value", ["", "x", "1e3", "1_0", "\u0663", "1" * 5000])
def test_a_rank_names_the_variable_that_is_no_decimal_integer(name, value):
    """Each variable is read by its name: an empty or garbage one was "RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_PORT and MEMRA_NCCL_PORT are integers: invalid literal for int() with base
    10: ''", which of the five not said; and Python's own literals were taken, RANK=1_0 as rank 10
    and an Arabic-Indic three as 3, silently. A ValueError naming the variable and its value."""
    env = {"RANK": "0", "WORLD_SIZE": "2", name: value}
    shown = re.escape(repr(value)) if len(value) < 100 else ".*"
    with pytest.raises(ValueError, match=f"^{name} must be a decimal integer \\(as torchrun sets it\\), not {shown}"):
        Ranks.from_env(env)


def test_the_exchanges_port_past_65535_names_master_port_plus_one():
    """MASTER_PORT=65535 without MEMRA_NCCL_PORT was refused as "port=65536", a port no variable
    held: it names both now. The limits are taken."""
    env = {"RANK": "0", "WORLD_SIZE": "2"}
    with pytest.raises(ValueError, match=r"^the id exchange listens on MEMRA_NCCL_PORT, else MASTER_PORT \+ 1: "
                                         r"MASTER_PORT 65535 makes port 65536, not one of 1\.\.65535: "
                                         r"set MEMRA_NCCL_PORT"):
        Ranks.from_env({**env, "MASTER_PORT": "65535"})
    assert Ranks.from_env({**env, "MASTER_PORT": "65534"}).port == 65535
    assert Ranks.from_env({**env, "MASTER_PORT": "65535", "MEMRA_NCCL_PORT": "65535"}).port == 65535
    assert Ranks.from_env({**env, "MEMRA_NCCL_PORT": "1"}).port == 1
    assert Ranks.from_env({**env, "RANK": " 1\n", "WORLD_SIZE": "+2"}).rank == 1  # int()'s spaces and sign, kept
    for port in ("0", "65536", "-1"):
        with pytest.raises(ValueError, match=f"port={int(port)}"):
            Ranks.from_env({**env, "MEMRA_NCCL_PORT": port})


# -- the id exchange ------------------------------------------------------------------------------

def test_every_rank_gets_rank_zeros_id():
    port, world = free_port(), 4
    made = bytes(range(128))
    got: dict[int, bytes] = {}

    def rank(r: int) -> None:
        got[r] = exchange_id(Ranks(r, world, port=port), lambda: made, timeout=20)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (3, 1, 2, 0)]  # joiners before the server
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got == {r: made for r in range(world)}


def test_a_stray_connection_is_turned_away():
    port = free_port()
    got: list[bytes] = []
    server = threading.Thread(target=lambda: got.append(exchange_id(Ranks(0, 2, port=port), lambda: b"i" * 128, 20)))
    server.start()
    for _ in range(100):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as stray:
                stray.sendall(b"GET / HTTP/1.0\r\n\r\n")
            break
        except OSError:
            time.sleep(0.05)
    assert exchange_id(Ranks(1, 2, port=port), lambda: b"never", 20) == b"i" * 128
    server.join(30)
    assert got == [b"i" * 128]


def test_a_rank_zero_that_never_comes_is_a_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="rank 1 found no rank 0"):
        exchange_id(Ranks(1, 2, port=free_port()), lambda: b"x" * 128, timeout=0.5)
    assert time.monotonic() - start < 5


def test_ranks_that_never_join_are_a_timeout_naming_them():
    with pytest.raises(TimeoutError, match=r"served none of ranks \[1, 2\]"):
        exchange_id(Ranks(0, 3, port=free_port()), lambda: b"x" * 128, timeout=0.5)


def test_an_id_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="128 bytes"):
        exchange_id(Ranks(0, 1, port=free_port()), lambda: b"short", timeout=1)


@pytest.mark.parametrize("made", ["i" * 128, bytearray(128), [0] * 128])
def test_an_id_that_is_no_bytes_is_refused_though_of_128(made):
    """Each was rank 0's id, of the right length, served as it was (a str returned as the id)."""
    with pytest.raises(TypeError, match=f"as bytes .* not a {type(made).__name__}$"):
        exchange_id(Ranks(0, 1, port=free_port()), lambda: made, timeout=1)


# -- the watchdog's rule, on a fake clock -----------------------------------------------------------

def test_a_wait_past_the_timeout_is_a_failure_and_stays_one():
    watch = Watch(timeout=10.0, rank=1)
    assert watch.verdict(now=100.0, async_error=0) is None  # no wait yet
    watch.waits.update({1: 104.0, 2: 100.0})  # two threads waiting: the oldest wait counts
    assert watch.verdict(now=110.0, async_error=0) is None  # at the limit, not past it
    assert watch.verdict(now=110.0, async_error=IN_PROGRESS) is None  # NCCL still working: no error
    first = watch.verdict(now=110.5, async_error=0)
    assert first is not None and "timeout of 10 s" in first
    watch.waits.clear()
    assert watch.verdict(now=111.0, async_error=2) == first  # the first failure stays the verdict


def test_a_wait_that_ends_leaves_another_threads_wait_timed():
    watch = Watch(timeout=10.0, rank=0)
    state = _State(Lib(), 0x1, watch, Ctx())
    guard, other = _Guard(state), threading.Thread(target=lambda: _Guard(state).begin())
    other.start()
    other.join()
    guard.begin()
    guard.end(None)
    assert len(watch.waits) == 1 and watch.verdict(time.monotonic() + 11, 0) is not None


def test_an_asynchronous_error_is_a_failure_at_once():
    watch = Watch(timeout=10.0, rank=0)
    assert "ncclRemoteError" in watch.verdict(now=0.0, async_error=6)


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan")])
def test_a_timeout_is_a_number_of_seconds_above_0(timeout):
    with pytest.raises(ValueError, match="a communicator's timeout must be a number of seconds above 0"):
        Watch(timeout=timeout, rank=0)
    with pytest.raises(TypeError, match="a communicator's timeout must be a real number, not True"):
        Watch(timeout=True, rank=0)


@pytest.mark.parametrize("given", [{"timeout": float("nan")}, {"timeout": 0}, {"hello_budget": float("nan")}])
def test_the_id_exchange_refuses_a_timeout_it_could_never_reach_before_anything_is_made(given):
    """A NaN timeout made a deadline no clock reaches: a rank whose rank 0 never came waited for
    ever (and rank 0 called make_id first); now a ValueError, before either."""
    made = []
    with pytest.raises(ValueError, match="must be a number of seconds above 0"):
        exchange_id(Ranks(0, 2, port=free_port()), lambda: made.append(1) or b"x" * 128, **given)
    assert made == []


PAST_MOST = float(np.nextafter(2147483.647, 3e6))  # values.SECONDS_MOST's next float


@pytest.mark.parametrize("seconds", [PAST_MOST, 4294967.396, 1e10, float("inf")])
def test_a_timeout_past_a_sockets_longest_wait_is_refused_before_anything_is_made(seconds, monkeypatch):
    """A wait is at most SECONDS_MOST (2**31 - 1 ms, a socket's longest: past it a socket's
    timeout wrapped, 4294967.396 s timing out after 0.1 s; past threading.TIMEOUT_MAX, an infinity
    too, joining met OverflowError: timestamp out of range, after NCCL was loaded and its join
    begun, and a poll of 1e10 s ended the watchdog on its thread, silently, every wait untimed).
    Refused by name before make_id, NCCL or any rank; the limit itself is taken."""
    from memra_cuda.comm import communicator
    from memra_cuda.comm.launch import launch
    from memra_cuda.driver.values import SECONDS_MOST
    assert SECONDS_MOST == 2147483.647
    most = r"must be a number of seconds above 0 and at most 2147483\.647 \(2\*\*31 - 1 ms"
    with pytest.raises(ValueError, match=f"^a communicator's timeout {most}.*not {seconds!r}"):
        Watch(timeout=seconds, rank=0)
    assert Watch(timeout=SECONDS_MOST, rank=0).timeout == SECONDS_MOST
    made = []
    for given in ({"timeout": seconds}, {"hello_budget": seconds}):
        with pytest.raises(ValueError, match=most):
            exchange_id(Ranks(0, 2, port=free_port()), lambda: made.append(1) or b"x" * 128, **given)
    with pytest.raises(ValueError, match=f"^timeout {most}"):
        launch([sys.executable, "-c", "raise SystemExit(3)"], 1, timeout=seconds)
    joined = []
    engine = FakeEngine()
    lib = FakeNccl(engine.memory)
    lib.lib.ncclCommInitRank = lambda *args: joined.append(args) or 0
    monkeypatch.setattr(communicator, "nccl", lambda: lib)
    with pytest.raises(ValueError, match=f"^a communicator's timeout {most}"):
        communicator.Communicator(engine, 0, 2, bytes(128), timeout=seconds)
    with pytest.raises(ValueError, match=rf"^poll \(the watchdog's time between looks\) {most}"):
        communicator.Communicator(engine, 0, 2, bytes(128), poll=seconds)
    assert made == [] and joined == [] and engine.guards == []
    assert launch([sys.executable, "-c", "raise SystemExit(3)"], 1, timeout=SECONDS_MOST)[0].returncode == 3


class Lib:
    """What _State calls of libnccl, recorded (the watchdog's side, not a GPU's); `stuck`: the
    calls that never return."""

    def __init__(self, async_error: int = 0, stuck: tuple[str, ...] = ()):
        self.async_error, self.calls, self.stuck = async_error, [], stuck
        self.lib = types.SimpleNamespace(ncclCommGetAsyncError=self._get, **{
            f"ncclComm{name}": lambda comm, name=name: self._call(name) for name in ("Abort", "Finalize", "Destroy")})

    def _get(self, comm, out):
        out._obj.value = self.async_error
        return 0

    def _call(self, name):
        self.calls.append(name.lower())
        if name.lower() in self.stuck:
            threading.Event().wait(5)
        return 0


class Ctx:
    """PrimaryContext.run's shape: the call, its result checked by the caller."""

    @staticmethod
    def run(fn, name, args):
        return fn(*args)


def test_the_watchdog_aborts_once_on_an_error_and_the_wait_raises_rank_failure():
    lib = Lib(async_error=6)
    state = _State(lib, 0x1234, Watch(5.0, rank=3), Ctx())
    guard = _Guard(state)
    guard.begin()
    state.poll()
    state.poll()
    assert lib.calls == ["abort"]
    cause = RuntimeError("the synchronisation's own error")
    with pytest.raises(RankFailure, match="rank 3: NCCL reported ncclRemoteError") as info:
        guard.end(cause)
    assert info.value.__cause__ is cause
    state.release()
    assert lib.calls == ["abort"]  # an aborted communicator is not released again


def test_a_healthy_communicator_is_finalised_and_destroyed_once_and_polls_nothing_after():
    lib = Lib()
    state = _State(lib, 0x1234, Watch(5.0, rank=0), Ctx())
    guard = _Guard(state)
    guard.begin()
    state.poll()
    guard.end(None)
    state.release()
    state.release()
    state.poll()
    assert lib.calls == ["finalize", "destroy"]


def test_a_finalise_that_does_not_return_in_time_gives_way_to_an_abort():
    lib = Lib(stuck=("finalize",))
    state = _State(lib, 0x1234, Watch(0.2, rank=0), Ctx())
    start = time.monotonic()
    state.release()
    assert lib.calls == ["finalize", "abort"] and time.monotonic() - start < 2


# -- a host wait answers to its stream's guards --------------------------------------------------------

class Recorder:
    def __init__(self, log, raise_at_end=False):
        self.log, self.raise_at_end = log, raise_at_end

    def begin(self):
        self.log.append("begin")

    def end(self, error):
        self.log.append(f"end {type(error).__name__ if error else None}")
        if self.raise_at_end:
            raise RankFailure("peer gone", 0) from error


def test_a_host_wait_is_bracketed_by_every_guard():
    log: list[str] = []
    stream = types.SimpleNamespace(guards=[Recorder(log), Recorder(log)])
    assert Stream.host_wait(stream, lambda x: log.append(f"wait {x}") or 7, 5) == 7
    assert log == ["begin", "begin", "wait 5", "end None", "end None"]


def test_every_guard_ends_its_wait_though_the_first_raises():
    log: list[str] = []
    stream = types.SimpleNamespace(guards=[Recorder(log, raise_at_end=True), Recorder(log)])
    with pytest.raises(RankFailure, match="peer gone"):
        Stream.host_wait(stream, lambda: None)
    assert log == ["begin", "begin", "end None", "end None"]


def test_a_communicator_id_is_passed_whole():
    from memra_cuda.comm.library import UniqueIdArg
    made = bytes([7, 0, 0, 9] * 32)  # zeros inside, as rank 0's address and port have
    assert bytes(UniqueIdArg.from_buffer_copy(made)) == made


def test_a_guard_turns_a_failed_wait_into_its_own_error():
    log: list[str] = []
    stream = types.SimpleNamespace(guards=[Recorder(log, raise_at_end=True)])

    def wait():
        raise OSError("the driver's answer")
    with pytest.raises(RankFailure, match="peer gone"):
        Stream.host_wait(stream, wait)
    assert log == ["begin", "end OSError"]


def test_a_host_wait_without_guards_is_the_wait_alone():
    assert Stream.host_wait(types.SimpleNamespace(guards=[]), lambda: "done") == "done"


# -- the library ----------------------------------------------------------------------------------------

def test_memra_nccl_library_is_the_only_candidate_when_set():
    assert library.candidates({"MEMRA_NCCL_LIBRARY": "/opt/nccl/libnccl.so.2"}) == ["/opt/nccl/libnccl.so.2"]


def test_a_wheels_library_is_found_on_the_path(tmp_path):
    lib = tmp_path / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    found = library.candidates({}, [str(tmp_path)])
    assert str(lib) in found and found[-1] == "libnccl.so.2"


def test_no_library_is_nccl_unavailable_naming_where_it_looked(monkeypatch, tmp_path):
    missing = str(tmp_path / "libnccl.so.2")
    monkeypatch.setenv("MEMRA_NCCL_LIBRARY", missing)
    library.nccl.cache_clear()
    try:
        with pytest.raises(NcclUnavailable, match="pip install nvidia-nccl-cu12, the nccl extra's wheel") as info:
            library.nccl()
        assert missing in str(info.value)
    finally:
        library.nccl.cache_clear()


def test_element_types_and_reductions_map_to_nccls():
    assert [nccl_dtype(t) for t in (np.int8, np.uint8, np.int32, np.uint32, np.int64, np.uint64, np.float16,
                                    np.float32, np.float64, "bfloat16")] == list(range(10))
    assert [nccl_op(op) for op in ("sum", "prod", "max", "min", "avg")] == list(range(5))
    with pytest.raises(ValueError, match="not complex64"):
        nccl_dtype(np.complex64)
    with pytest.raises(ValueError, match="not 'xor'"):
        nccl_op("xor")


def test_an_nccl_error_names_the_call_and_nccls_word():
    err = NcclError(5, "ncclSend", "peer 3 is not a rank")
    assert str(err) == "ncclSend failed: ncclInvalidUsage: peer 3 is not a rank" and err.name == "ncclInvalidUsage"
    assert NcclError(42, "ncclX").name == "ncclResult 42"


@pytest.fixture(scope="module")
def nccl():
    try:
        return library.nccl()
    except NcclUnavailable as exc:
        pytest.skip(f"needs NCCL: {exc}")  # which names the wheel to install (library.EXTRA) and what was tried


def test_the_installed_nccl_has_a_version_and_makes_ids(nccl):
    assert nccl.version >= 21400 and nccl.version_text.count(".") == 2
    one, two = nccl.unique_id(), nccl.unique_id()
    assert len(one) == len(two) == UNIQUE_ID_BYTES and one != two


def test_a_failed_nccl_call_raises_naming_it(nccl):
    import ctypes
    with pytest.raises(NcclError, match="ncclCommCount failed: ncclInvalidArgument"):
        nccl.call("ncclCommCount", None, ctypes.byref(ctypes.c_int()))


# -- the toy's tensor-parallel shards ---------------------------------------------------------------

def test_shards_cover_the_layers_once_in_order_the_first_ones_larger():
    from memra_cuda.testing.toy.ranks import shard
    for layers in range(1, 12):
        for world in range(1, layers + 1):
            shards = [shard(layers, world, rank) for rank in range(world)]
            assert [i for s in shards for i in s] == list(range(layers))
            sizes = [len(s) for s in shards]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    with pytest.raises(ValueError, match="at least one"):
        shard(2, 3, 0)
    with pytest.raises(ValueError, match="rank 3"):
        shard(4, 3, 3)


def test_a_shards_numbers_are_ints_named_where_they_are_not():
    """shard(4, 2, True) was rank 1's shard, and a float met "'float' object cannot be interpreted
    as an integer", naming none of the three: each is checked as an int, naming it."""
    from memra_cuda.testing.toy.ranks import shard
    assert shard(np.int64(4), np.int32(2), np.uint8(1)) == range(2, 4)
    for args, error, named in (((4, 2, True), TypeError, "rank must be an integer, not True"),
                               ((4, 2, 1.0), TypeError, "rank must be an integer, not 1.0"),
                               ((4.0, 2, 0), TypeError, "layers must be an integer, not 4.0"),
                               ((4, 2.0, 0), TypeError, "world must be an integer, not 2.0"),
                               ((4, True, 0), TypeError, "world must be an integer, not True"),
                               ((4, 0, 0), ValueError, "world must be an int of at least 1, not 0"),
                               ((4, 2, -1), ValueError, "rank -1")):
        with pytest.raises(error, match=named):
            shard(*args)


# -- ranks started as torchrun would ------------------------------------------------------------------

def test_launch_starts_every_rank_with_torchruns_variables_and_a_port_of_its_own_for_the_exchange(monkeypatch):
    from memra_cuda.comm.launch import launch
    monkeypatch.setenv("MEMRA_NCCL_PORT", "1")  # a parent's is not every launch's
    show = "import os; print(os.environ['RANK'], os.environ['LOCAL_RANK'], os.environ['WORLD_SIZE'], " \
           "os.environ['NCCL_NVLS_ENABLE'], os.environ['MASTER_PORT'], os.environ['MEMRA_NCCL_PORT'])"
    ended = launch([sys.executable, "-c", show], 3, timeout=60)
    assert [(e.rank, e.returncode, e.stdout.split()[:4]) for e in ended] == \
        [(r, 0, [str(r), str(r), "3", "0"]) for r in range(3)]
    master, exchange = (int(port) for port in ended[0].stdout.split()[4:])
    assert master > 1 and exchange > 1 and master != exchange
    assert launch([sys.executable, "-c", show], 1, env={"MEMRA_NCCL_PORT": "7"}, timeout=60)[0].stdout.split()[5] == "7"


def test_launch_kills_every_rank_past_its_timeout():
    from memra_cuda.comm.launch import launch
    start = time.monotonic()
    ended = launch([sys.executable, "-c", "import os, time; os.environ['RANK'] == '1' and time.sleep(60)"], 2,
                   timeout=2)
    assert [e.returncode for e in ended] == [0, None] and time.monotonic() - start < 20


@pytest.mark.parametrize("world, timeout, error, match", [
    (0, 60, ValueError, "world must be an int from 1 to"),  # ran nothing: [], every rank "passed"
    (True, 60, TypeError, "world must be an integer, not True"),  # one rank told WORLD_SIZE=True
    (2.0, 60, TypeError, "world must be an integer"),
    (1, float("nan"), ValueError, "timeout must be a number of seconds above 0 .*, not nan"),  # waited for ever
    (1, 0, ValueError, "timeout must be a number of seconds above 0"),
    (1, "60", TypeError, "timeout must be a real number")])
def test_launch_refuses_a_world_or_a_timeout_it_cannot_keep_before_starting_a_rank(tmp_path, world, timeout, error,
                                                                                   match):
    from memra_cuda.comm.launch import launch
    ran = tmp_path / "ran"
    with pytest.raises(error, match=match):
        launch([sys.executable, "-c", f"open({str(ran)!r}, 'w')"], world, timeout=timeout)
    assert not ran.exists()


def test_a_world_of_one_rank_exchanges_nothing_and_listens_nowhere(caplog):
    """Rank 0 alone has no rank to serve: it listened all the same, so a one-rank run failed with
    "Address already in use" where another process held the port, a cluster address without a
    secret was refused as reachable beyond this host, and a warning said any process of this host
    could fetch the id, which nothing served. Its id is made and checked, and returned."""
    made = os.urandom(128)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="memra_cuda.comm.rendezvous"):
            assert exchange_id(Ranks(0, 1, port=port), lambda: made, 1.0) == made
            assert exchange_id(Ranks(0, 1, address="10.1.2.3", port=port), lambda: made, 1.0) == made
    assert caplog.records == []
    with pytest.raises(TypeError, match="make_id must return the communicator id as bytes"):
        exchange_id(Ranks(0, 1, port=port), lambda: "x" * 128, 1.0)
    with pytest.raises(ValueError, match="a communicator id is 128 bytes, not 127"):
        exchange_id(Ranks(0, 1, port=port), lambda: made[:127], 1.0)
    with pytest.raises(ValueError, match="hello_budget must be a number of seconds above 0"):
        exchange_id(Ranks(0, 1, port=port), lambda: made, 1.0, hello_budget=0)


@pytest.mark.parametrize("rank", [0, 1])
def test_every_rank_refuses_a_make_id_that_is_no_function_before_anything_is_made(rank):
    """The id itself given for make_id (bytes(128), or None) met "'bytes' object is not callable"
    on rank 0 alone, once its timeout and secret were checked, and the other ranks took it and
    waited for that rank 0 until their timeout. A TypeError naming make_id on every rank now."""
    for given in (bytes(128), None):
        with pytest.raises(TypeError, match=f"^make_id is a function making the communicator id "
                                            f"\\(lambda: nccl\\(\\).unique_id\\(\\)\\), not a {type(given).__name__}"):
            exchange_id(Ranks(rank, 2, port=free_port()), given, 30.0)


def test_rank_0_refuses_a_communicator_id_that_is_not_bytes_before_serving_it():
    """A str (or list, bytearray) of 128 made by make_id was served, or failed inside the serving
    thread: a TypeError naming make_id now, before any rank is served."""
    with pytest.raises(TypeError, match="make_id must return the communicator id as bytes .* not a str"):
        exchange_id(Ranks(0, 2, port=free_port()), lambda: "x" * 128, 1.0)


@pytest.mark.parametrize("argv, env, match", [
    ("python", None, "argv is the command as a non-empty list"),  # its letters were run: No such file 'p'
    ([], None, "argv is the command as a non-empty list"),  # an IndexError from inside Popen
    (None, {"X": 1}, "env maps names to values, both str"),  # Popen's TypeError naming no env
    (None, "X=1", "env maps names to values, both str")])
def test_launch_refuses_a_command_or_an_environment_it_cannot_run_before_starting_a_rank(tmp_path, argv, env, match):
    from memra_cuda.comm.launch import launch
    ran = tmp_path / "ran"
    with pytest.raises(TypeError, match=match):
        launch([sys.executable, "-c", f"open({str(ran)!r}, 'w')"] if argv is None else argv, 1, env=env, timeout=60)
    assert not ran.exists()


@pytest.mark.parametrize("argv, error, match", [
    ([sys.executable, 5], TypeError, r"argv is the command as a non-empty list of its words .*, not \[.*, 5\]"),
    ([sys.executable, None], TypeError, "argv is the command as a non-empty list of its words"),
    ((word for word in [sys.executable, "-c", "0"]), TypeError, "argv is the command as a non-empty list"),
    (iter([sys.executable, "-c", "0"]), TypeError, "argv is the command as a non-empty list"),
    ({sys.executable: 1}, TypeError, "argv is the command as a non-empty list"),  # KeyError 0
    ([sys.executable, "-c", "0", "a\x00b"], ValueError, r"argv's words are C strings, with no NUL byte: 'a\\x00b'"),
])
def test_launch_refuses_a_command_whose_words_no_process_takes_before_making_anything(tmp_path, monkeypatch, argv,
                                                                                      error, match):
    """A word that is no str (5, None) met Popen's "expected str, bytes or os.PathLike object, not
    int", a generator "'generator' object is not subscriptable" (a generator read whole gave the
    second rank no command), a dict KeyError 0, and a NUL byte Popen's "embedded null byte", each
    naming nothing and once the launch's ports, folder and output files were made. Refused first,
    naming argv; a tuple, bytes and a path are words too."""
    from memra_cuda.comm import launch as launching
    made = []
    monkeypatch.setattr(launching, "free_ports", lambda count: made.append(count) or [1, 2])
    with pytest.raises(error, match=match):
        launching.launch(argv, 2, timeout=60)
    assert made == []
    monkeypatch.undo()
    ran = tmp_path / "ran"
    words = (os.fsencode(sys.executable), "-c", f"open({str(ran)!r}, 'w')")
    assert [e.returncode for e in launching.launch(words, 1, timeout=60)] == [0] and ran.exists()
    assert [e.returncode for e in launching.launch([pathlib.Path(sys.executable), "-c", "0"], 1, timeout=60)] == [0]


@pytest.mark.parametrize("env", [{"A=B": "1"}, {"A\x00": "1"}, {"A": "1\x00"}])
def test_launch_refuses_an_environment_no_process_takes_before_making_anything(monkeypatch, env):
    """A name with "=" or a NUL, and a value with a NUL, met Popen's "illegal environment
    variable name" or "embedded null byte" once the ports, folder and files were made. Refused
    first, naming env."""
    from memra_cuda.comm import launch as launching
    made = []
    monkeypatch.setattr(launching, "free_ports", lambda count: made.append(count) or [1, 2])
    with pytest.raises(ValueError, match=r"^env's names hold no '=' or NUL byte, its values no "
                                         r"NUL byte \(a process's environment is C strings\), not "):
        launching.launch([sys.executable, "-c", "0"], 1, env=env, timeout=60)
    assert made == []


def test_launch_refuses_a_program_path_to_nothing_before_making_anything(tmp_path, monkeypatch):
    """A program named by a path that does not exist met Popen's FileNotFoundError only once the
    launch's ports, folder and output files were made: it is refused first, naming the path. A
    path that exists (sys.executable's, as every launch here runs) is run."""
    from memra_cuda.comm import launch as launching
    real_free_ports = launching.free_ports

    def no_ports(count):
        raise AssertionError("a launch made its ports")

    monkeypatch.setattr(launching, "free_ports", no_ports)
    for program in (str(tmp_path / "no-such-program"), "./no-such-program", tmp_path / "gone.sh"):
        with pytest.raises(FileNotFoundError, match=rf"^argv\[0\], the program each rank runs, is "
                                                    rf"'{re.escape(str(program))}': no such file"):
            launching.launch([program, "-c", "pass"], 2, timeout=60)
    monkeypatch.setattr(launching, "free_ports", real_free_ports)
    assert launching.launch([sys.executable, "-c", "print('ran')"], 1, timeout=60)[0].stdout == "ran\n"


def test_launch_refuses_more_ranks_than_it_may_hold_the_output_files_of(tmp_path, monkeypatch):
    """10**9 ranks started processes for half a minute, to an OSError of too many open files."""
    from memra_cuda.comm import launch as launching
    monkeypatch.setattr(launching.resource, "getrlimit", lambda _: (100, 100))
    ran = tmp_path / "ran"
    with pytest.raises(ValueError, match="a launch of 19 ranks holds 38 files open .* at most 18 ranks"):
        launching.launch([sys.executable, "-c", f"open({str(ran)!r}, 'w')"], 19, timeout=60)
    assert not ran.exists()


def _gone(pid: int) -> bool:
    """No such process, or only its zombie left for its new parent to reap."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _launch_a_rank_with_a_worker(launching, worker: str):
    """One rank, running `worker` (Python source) as a process of its own and sleeping, launched
    with a timeout of 3 s: how it ended, and whether its worker is gone (waited for up to 10 s)."""
    spawn = (f"import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', {worker!r}]); "
             "print(child.pid, flush=True); time.sleep(60)")
    ended = launching.launch([sys.executable, "-c", spawn], 1, timeout=3)
    child = int(ended[0].stdout.split()[0])
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    return ended[0], _gone(child)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_launch_stops_what_a_rank_started_and_kills_a_rank_that_ignores_sigterm(monkeypatch):
    """A rank that started a process of its own (torchrun its workers) is stopped with it; one
    that ignores SIGTERM gets SIGKILL after the grace."""
    from memra_cuda.comm import launch as launching
    monkeypatch.setattr(launching, "GRACE", 1.0)
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); " \
               "time.sleep(60)"
    start = time.monotonic()
    ended, worker_gone = _launch_a_rank_with_a_worker(launching, "import time; time.sleep(60)")
    assert ended.returncode is None and worker_gone
    ended = launching.launch([sys.executable, "-c", stubborn], 1, timeout=3)
    assert ended[0].returncode is None and ended[0].stdout.split() == ["up"] and time.monotonic() - start < 30


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_launch_kills_what_a_rank_started_that_ignores_sigterm_when_the_rank_itself_obeys(monkeypatch):
    """The rank ends at SIGTERM, its worker does not: the worker still gets SIGKILL after the grace
    (the session is what is stopped, not only its leader)."""
    from memra_cuda.comm import launch as launching
    monkeypatch.setattr(launching, "GRACE", 1.0)
    ended, worker_gone = _launch_a_rank_with_a_worker(
        launching, "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)")
    assert ended.returncode is None and worker_gone


# -- a Communicator over a recording stand-in for libnccl (its host logic, not a GPU's) ------------

class FakeNccl:
    """The libnccl calls a Communicator makes, recorded, over memory kept in `memory` (address ->
    array); an all-reduce combines this rank's buffer with `peer`'s values; `fail` maps a call's
    name to the result it returns."""

    def __init__(self, memory: dict, peer=None, fail: dict | None = None):
        self.memory, self.peer, self.fail, self.calls, self.joined_with = memory, peer, fail or {}, [], None
        names = ("ncclCommGetAsyncError", "ncclCommAbort", "ncclCommFinalize", "ncclCommDestroy", "ncclGroupStart",
                 "ncclGroupEnd", "ncclBroadcast", "ncclSend", "ncclRecv")
        self.lib = types.SimpleNamespace(ncclCommInitRank=self._init, ncclAllReduce=self._all_reduce,
                                         **{name: functools.partial(self._record, name) for name in names})

    def _record(self, name, *args):
        self.calls.append(name)
        if name == "ncclCommGetAsyncError":
            args[1]._obj.value = 0
        return self.fail.get(name, 0)

    def _init(self, comm, world, arg, rank):
        self.joined_with = bytes(arg)
        comm._obj.value = 0xC0
        return 0

    def _all_reduce(self, send, recv, count, kind, op, comm, stream):
        self.calls.append("ncclAllReduce")
        if "ncclAllReduce" in self.fail:
            return self.fail["ncclAllReduce"]
        mine = self.memory[send]
        self.memory[recv][:] = np.maximum(mine, self.peer) if self.peer is not None else mine
        return 0

    def call(self, name, *args):
        code = getattr(self.lib, name)(*args)
        if code:
            raise self.failure(code, name)

    def failure(self, code, call, comm=None):
        return NcclError(code, call, "the stand-in's")


class FakeEngine:
    """What a Communicator asks of its engine, host memory standing in for the device's."""

    device, closed, stream_handle, ctx, capture_hold = 0, False, 0x5, Ctx, None

    def __init__(self):
        self.guards, self.memory = [], {}

    def activate(self):
        return Ctx

    def check_owns(self, buf, what):
        pass

    def depend(self, dependent):
        pass

    def synchronize(self):
        Stream.host_wait(self, lambda: None)

    def htod(self, values, label=None):
        from memra_cuda.driver.buffer import DeviceBuffer
        host = np.array(values)
        address = 0x1000 * (len(self.memory) + 1)
        self.memory[address] = host
        return DeviceBuffer.wrap(address, host.dtype, host.size)

    def dtoh(self, buf):
        return self.memory[buf.ptr].copy()


@pytest.fixture
def fake(monkeypatch):
    """A Communicator of rank 0 of 2 over FakeNccl and FakeEngine (its watchdog thread runs)."""
    from memra_cuda.comm import communicator
    engine = FakeEngine()
    made: dict = {}

    def make(peer=None, fail=None, unique_id=bytes(range(128))):
        lib = FakeNccl(engine.memory, peer, fail)
        monkeypatch.setattr(communicator, "nccl", lambda: lib)
        made["comm"] = communicator.Communicator(engine, 0, 2, unique_id, timeout=5, poll=0.01)
        return made["comm"], lib, engine
    yield make
    if "comm" in made:
        made["comm"].free()


def test_a_communicator_joins_with_the_whole_id_and_is_released_once(fake):
    made = bytes([9, 0, 0, 7] * 32)  # zeros inside, as rank 0's address and port have
    comm, lib, engine = fake(unique_id=made)
    assert lib.joined_with == made and engine.guards == [comm._guard]
    comm.free()
    comm.free()
    assert lib.calls.count("ncclCommFinalize") == lib.calls.count("ncclCommDestroy") == 1
    assert "ncclCommAbort" not in lib.calls and engine.guards == []


def test_a_failed_enqueue_fails_the_communicator_and_raises_rank_failure(fake):
    comm, lib, engine = fake(fail={"ncclAllReduce": 6})
    buf = engine.htod(np.zeros(4, np.float32))
    with pytest.raises(RankFailure, match="ncclAllReduce failed: ncclRemoteError"):
        comm.all_reduce(buf)
    assert "ncclRemoteError" in comm.failure_reason
    calls = len(lib.calls)
    with pytest.raises(RankFailure):
        comm.all_reduce(buf)  # refused before NCCL is asked again
    assert lib.calls[calls:].count("ncclAllReduce") == 0
    with pytest.raises(RankFailure):
        engine.synchronize()  # every wait raises too
    assert _aborted(lib) and lib.calls.count("ncclCommAbort") == 1


def _aborted(lib) -> bool:
    """Whether the abort (on a thread of its own) has reached the stand-in, within a second."""
    for _ in range(100):
        if "ncclCommAbort" in lib.calls:
            return True
        time.sleep(0.01)
    return False


def test_a_group_that_fails_as_it_ends_fails_the_communicator_as_a_failed_call_does(fake):
    comm, lib, engine = fake(fail={"ncclGroupEnd": 6})
    buf = engine.htod(np.zeros(4, np.float32))
    with pytest.raises(RankFailure, match="ncclGroupEnd failed"):
        with comm.group():
            comm.send(buf, 1)
    assert "ncclGroupEnd" in comm.failure_reason and _aborted(lib)
    with pytest.raises(RankFailure):
        engine.synchronize()


def test_a_group_whose_body_raises_is_ended_and_the_bodys_error_is_seen(fake):
    comm, lib, engine = fake(fail={"ncclGroupEnd": 6})
    with pytest.raises(ValueError, match="peer must be"):
        with comm.group():
            comm.send(engine.htod(np.zeros(4, np.float32)), 7)
    assert lib.calls[-1] == "ncclGroupEnd" and comm.failure_reason is None


def test_a_watchdog_that_cannot_ask_nccl_fails_the_communicator_once(fake):
    comm, lib, engine = fake()

    def broken(*args):
        raise OSError("the library went away")
    lib.lib.ncclCommGetAsyncError = broken
    for _ in range(100):
        if comm.failure_reason:
            break
        time.sleep(0.01)
    assert comm.failure_reason.startswith("the watchdog could not ask NCCL for errors") and _aborted(lib)
    time.sleep(0.05)
    assert lib.calls.count("ncclCommAbort") == 1


def test_a_join_that_nccl_refuses_raises_its_error(fake, monkeypatch):
    from memra_cuda.comm import communicator
    lib = FakeNccl({})
    lib.lib.ncclCommInitRank = lambda *args: 5  # ncclInvalidUsage
    monkeypatch.setattr(communicator, "nccl", lambda: lib)
    with pytest.raises(NcclError):
        communicator.Communicator(FakeEngine(), 0, 2, bytes(128), timeout=5)


def test_agree_passes_where_the_ranks_agree_and_raises_where_they_do_not(fake):
    from memra_cuda.comm import RanksDiverged, digest
    tokens = [[5, 6, 7], [8]]
    words = np.array(digest(tokens), np.uint64)
    comm, lib, engine = fake(peer=np.concatenate([words, ~words]))
    comm.agree(digest(tokens), "the tokens")
    with pytest.raises(RanksDiverged, match="the tokens differ between ranks"):
        comm.agree(digest([[5, 6, 8], [8]]), "the tokens")
    assert comm.failure_reason and "differ" in comm.failure_reason


@pytest.mark.parametrize("unique_id, error, match", [
    (None, TypeError, "unique_id must be the communicator id as bytes .*, not a NoneType"),  # has no len()
    ("x" * 128, TypeError, "unique_id must be the communicator id as bytes .*, not a str"),  # ctypes', past NCCL
    ([0] * 128, TypeError, "unique_id must be the communicator id as bytes .*, not a list"),
    (bytes(127), ValueError, "a communicator id is 128 bytes"),
    (bytes(129), ValueError, "a communicator id is 128 bytes")])
def test_a_communicator_refuses_an_id_that_is_no_128_bytes_before_nccl_is_loaded(unique_id, error, match,
                                                                                monkeypatch):
    """None met "object of type 'NoneType' has no len()", and a str or a list of 128 passed, to
    meet ctypes' "a bytes-like object is required" once NCCL was loaded and the engine's context
    made current: a TypeError naming unique_id now, before either. A bytearray is bytes too."""
    from memra_cuda.comm import communicator
    loaded = []
    monkeypatch.setattr(communicator, "nccl", lambda: loaded.append(1) or FakeNccl({}))
    with pytest.raises(error, match=match):
        communicator.Communicator(FakeEngine(), 0, 2, unique_id)
    assert loaded == []
    communicator.Communicator(FakeEngine(), 0, 2, bytearray(128)).free()


def test_a_communicator_of_more_ranks_than_nccl_counts_is_refused_before_nccl_is_loaded(monkeypatch):
    """NCCL's nranks is a C int: a world of 2**31 was taken (Ranks refuses it), handed to
    ncclCommInitRank wrapped by ctypes. A ValueError naming MAX_WORLD; the limit itself is taken."""
    from memra_cuda.comm import communicator
    from memra_cuda.comm.rendezvous import MAX_WORLD
    lib = FakeNccl({})
    monkeypatch.setattr(communicator, "nccl", lambda: lib)
    with pytest.raises(ValueError, match=f"a world is at most {MAX_WORLD} ranks \\(NCCL's\\), not {MAX_WORLD + 1}"):
        communicator.Communicator(FakeEngine(), 0, MAX_WORLD + 1, bytes(128))
    assert lib.joined_with is None
    communicator.Communicator(FakeEngine(), MAX_WORLD - 1, MAX_WORLD, bytes(128)).free()


def test_a_communicator_refuses_what_it_cannot_join_or_queue(fake):
    from memra_cuda.comm import Communicator
    from memra_cuda.driver.buffer import DeviceBuffer
    with pytest.raises(ValueError, match="rank 2 of 2"):
        Communicator(FakeEngine(), 2, 2, bytes(128))
    with pytest.raises(ValueError, match="128 bytes"):
        Communicator(FakeEngine(), 0, 2, b"short")
    # the watchdog's sleep(poll) raised on its thread (the watchdog gone, every wait untimed), and a bool was 1 s
    for poll in (-1.0, 0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"^poll \(the watchdog's time between looks\) must be a number of "
                                             r"seconds above 0 and at most 2147483\.647"):
            Communicator(FakeEngine(), 0, 2, bytes(128), poll=poll)
    for args in (dict(poll="0.05"), dict(poll=True), dict(timeout=True)):
        with pytest.raises(TypeError, match="must be a real number"):
            Communicator(FakeEngine(), 0, 2, bytes(128), **args)
    comm, lib, engine = fake()
    four = DeviceBuffer.wrap(0x10, np.float32, 4)
    with pytest.raises(TypeError, match="DeviceBuffer"):
        comm.all_reduce(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="differ"):
        comm.all_reduce(four, DeviceBuffer.wrap(0x20, np.float32, 5))
    with pytest.raises(ValueError, match="cannot be reduced as float64"):
        comm.all_reduce(four, dtype="float64")
    with pytest.raises(ValueError, match=r"4-byte elements: they cannot be reduced as bfloat16 \(2 bytes\)"):
        comm.all_reduce(four, dtype="bfloat16")
    with pytest.raises(ValueError, match="peer must be a rank of 0..1"):
        comm.send(four, 2)
    with pytest.raises(ValueError, match="not 'xor'"):
        comm.all_reduce(four, op="xor")
    assert "ncclAllReduce" not in lib.calls and "ncclSend" not in lib.calls


def test_a_finaliser_that_fails_only_logs(caplog):
    from memra_cuda.comm.communicator import _release

    class Broken:
        engines = ()

        def release(self):
            raise RuntimeError("the device faulted")
    _release(Broken(), None)
    assert "the device faulted" in caplog.text


def test_an_operation_refuses_to_run_once_its_buffer_is_freed(fake):
    comm, lib, engine = fake()
    buf = engine.htod(np.zeros(4, np.float32))
    reduce = comm.prepare_all_reduce(buf)
    reduce()
    buf.free()
    with pytest.raises(ValueError, match="freed"):
        reduce()
    assert lib.calls.count("ncclAllReduce") == 1


def test_an_operation_on_another_device_or_nothing_to_agree_on_is_refused(fake):
    comm, lib, engine = fake()
    other = FakeEngine()
    other.device = 1
    with pytest.raises(ValueError, match="not on the communicator's device 0"):
        comm.all_reduce(engine.htod(np.zeros(4, np.float32)), engine=other)
    with pytest.raises(ValueError, match="non-empty sequence"):
        comm.agree([])


def test_a_join_that_never_returns_is_a_rank_failure_within_the_timeout(monkeypatch):
    from memra_cuda.comm import communicator
    lib = FakeNccl({})
    lib.lib.ncclCommInitRank = lambda comm, world, arg, rank: threading.Event().wait(30) or 0
    monkeypatch.setattr(communicator, "nccl", lambda: lib)
    start = time.monotonic()
    with pytest.raises(RankFailure, match="joining a communicator of 2 ranks took more than 0.3 s"):
        communicator.Communicator(FakeEngine(), 1, 2, bytes(128), timeout=0.3)
    assert time.monotonic() - start < 5


# -- refusals made before any device work ---------------------------------------------------------

def test_device_mode_refuses_a_rank_of_a_communicator_before_touching_the_driver():
    from memra_cuda.errors import LoopUnsupported
    from memra_cuda.rounds import Round
    from memra_cuda.rounds.device_loop import DeviceLoop
    rank = Round.__new__(Round)  # a rank's round: its engine guarded by a communicator, nothing built
    rank.engine, rank.bufs, rank.pipelined = types.SimpleNamespace(guards=[object()]), None, False
    with pytest.raises(LoopUnsupported, match="a rank of a communicator"):
        DeviceLoop(rank)


def test_the_toys_ranks_refuse_recurrent_layers_and_a_verify_past_a_block():
    from memra_cuda.testing.toy.ranks import ToyTensorParallel
    from memra_cuda.testing.toy.lm import BLOCK, ToyModel
    comm = types.SimpleNamespace(engine=None, world=2, rank=0)
    with pytest.raises(ValueError, match="recurrent layers run whole"):
        ToyTensorParallel(comm, ToyModel(kv_mask=(True, False), rec_mask=(False, True)), 64, Geometry(4, 2))
    with pytest.raises(ValueError, match=f"k must be < {BLOCK}"):
        ToyTensorParallel(comm, ToyModel(), 64, Geometry(BLOCK, 2))


def test_the_toys_ranks_and_pipeline_take_one_geometry_checked_before_anything_is_made():
    """The toy's ranks and pipeline took loose k, M and B, which nothing checked before the first
    use: a k of "3" met `k + 1` as a str's TypeError, and the pipeline allocated both stages'
    caches before StreamBufs' Geometry refused a bad B. They take one Geometry (the package's
    shape of rounds, as_geometry naming the loose integers), a chain's (a tree's width is
    refused), before any engine is touched: these engines are None."""
    from memra_cuda.buffers.tree import TreeShape
    from memra_cuda.testing.toy.lm import ToyModel
    from memra_cuda.testing.toy.pipeline import ToyPipeline
    from memra_cuda.testing.toy.ranks import ToyPipelineStage, ToyTensorParallel
    comm, model = types.SimpleNamespace(engine=None, world=2, rank=0), ToyModel()
    makes = (lambda shape: ToyTensorParallel(comm, model, 64, shape),
             lambda shape: ToyPipelineStage(comm, model, 64, shape),
             lambda shape: ToyPipeline([None, None], model, 64, 1, shape))
    for make in makes:
        for loose in (4, (4, 2), "3"):
            with pytest.raises(TypeError, match="a round's shape is one memra_cuda.Geometry"):
                make(loose)
        with pytest.raises(ValueError, match="chain rounds, of width k \\+ 1"):
            make(Geometry.of_tree(TreeShape.from_choices([[0], [1]]), 2))

"""Communicator: one rank of an NCCL communicator on an engine's device, its operations queued on
the engine's stream, where a stream capture takes them into the burst graph like any kernel.

Two rules of driver/handle.py hold for it as for a buffer: the communicator is released exactly
once, and a graph that captured one of its operations holds it, and refuses to run once it is
freed (free() frees such graphs first: NCCL releases a communicator only once they are gone) or
has failed.

A third is its own: **no host wait on a peer hangs.** NCCL's kernels wait on their peers on the
device, so a dead or stuck peer leaves the host blocked in a stream synchronisation that never
returns. The communicator's watchdog thread asks NCCL for asynchronous errors every `poll`
seconds and times every host wait on the engine (Stream.host_wait, through the guard it adds to
the engine): an error, or a wait longer than `timeout`, aborts the communicator, which ends its
kernels, and the wait raises RankFailure naming what happened. Each rank's waits are its own, so
every live rank raises within about `timeout` of its peer's end.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
from numpy.typing import DTypeLike

from ..driver.buffer import DeviceBuffer
from ..driver.call import Prepared
from ..driver.graph import Graph
from ..driver.handle import Handle
from ..driver.values import as_index, as_seconds
from .library import IN_PROGRESS, Nccl, NcclError, UniqueIdArg, check_id, nccl, nccl_op, nccl_type, result_name
from .rendezvous import Ranks, check_world, exchange_id

if TYPE_CHECKING:
    from ..driver.context import PrimaryContext
    from ..driver.engine import Engine

log = logging.getLogger("memra_cuda")


class RankFailure(NcclError):
    """A peer rank failed or went silent: this rank's communicator is aborted, and the work that
    needed it did not happen. Raised on every rank that waits on it, within its timeout."""

    def __init__(self, reason: str, rank: int):
        super().__init__(-1, "wait", reason, name="RANK_FAILURE", message=f"rank {rank}: {reason}")
        self.rank = rank


def digest(rows: Sequence[Sequence[int]]) -> list[int]:
    """Rows of token ids as a few u64 words for Communicator.agree: their count and a 128-bit
    digest (row boundaries included)."""
    hashed = hashlib.blake2b(digest_size=16)
    for row in rows:
        hashed.update(np.asarray(row, np.uint32).tobytes() + b"|")
    return [sum(map(len, rows)), *np.frombuffer(hashed.digest(), np.uint64).tolist()]


class RanksDiverged(NcclError):
    """The ranks hold different values where they must agree (Communicator.agree): raised on
    every rank, since every rank sees the same all-reduced extremes."""

    def __init__(self, what: str, low: list[int], high: list[int], rank: int):
        detail = f"{what} differ between ranks (lowest {low}, highest {high})"
        super().__init__(-1, "agree", detail, name="RANKS_DIVERGED", message=f"rank {rank}: {detail}")
        self.rank = rank


class Watch:
    """The watchdog's rule, apart from its thread and clock: a host wait that has run past
    `timeout` seconds (the oldest of those running, one a thread), or an asynchronous NCCL
    error, is a failure; the first failure stays the verdict."""

    def __init__(self, timeout: float, rank: int):
        self.timeout, self.rank = as_seconds(timeout, "a communicator's timeout"), rank  # a bool is none (True was 1 s)
        self.waits: dict[int, float] = {}  # thread -> when its host wait began
        self.failure: str | None = None

    def verdict(self, now: float, async_error: int) -> str | None:
        """The failure, if there is one now (the thread then aborts the communicator)."""
        if self.failure is None:
            oldest = min(list(self.waits.values()), default=None)  # a copy: the waiting threads change it
            if async_error not in (0, IN_PROGRESS):
                self.failure = f"NCCL reported {result_name(async_error)} (a peer rank failed, or its connection did)"
            elif oldest is not None and now - oldest > self.timeout:
                self.failure = (f"a wait on the GPU ran past the communicator's timeout of {self.timeout:g} s "
                                "(a peer rank dead, stuck, or not issuing the same operations)")
        return self.failure


class _Guard:
    """What the engines' host waits call (Stream.guards): times them for the watchdog and turns
    a failure into RankFailure. Holds the shared state, not the Communicator, so that a
    forgotten communicator can still be collected."""

    def __init__(self, state: _State):
        self.state = state

    def begin(self) -> None:
        self.state.watch.waits[threading.get_ident()] = time.monotonic()

    def end(self, error: BaseException | None) -> None:
        self.state.watch.waits.pop(threading.get_ident(), None)
        self.state.raise_if_failed(error)


class _State:
    """What the communicator and its watchdog thread share. `lock` (re-entrant: a finaliser may
    run on either thread) orders their NCCL calls and the flags; ncclCommAbort itself runs
    outside it, since from NCCL 2.26 it waits for every graph that captured the communicator
    to be destroyed, which only another thread may be about to do."""

    def __init__(self, lib: Nccl, comm: int, watch: Watch, ctx: PrimaryContext):
        self.lib, self.comm, self.watch, self.ctx = lib, comm, watch, ctx
        self.lock = threading.RLock()
        self.closed = False
        self.aborted = False
        self.owner: Callable[[], Communicator | None] = lambda: None  # a weak reference, once made
        self.engines: list[Engine] = []  # whose host waits the guard times

    def raise_if_failed(self, cause: BaseException | None = None) -> None:
        """Once the communicator failed: its owner's graphs poisoned, RankFailure (from `cause`)."""
        if self.watch.failure is not None:
            owner = self.owner()
            if owner is not None:
                owner.poison_graphs()
            raise RankFailure(self.watch.failure, self.watch.rank) from cause

    def poll(self) -> None:
        with self.lock:
            if self.closed or self.aborted:
                return
            error = ctypes.c_int()
            code = self.lib.lib.ncclCommGetAsyncError(ctypes.c_void_p(self.comm), ctypes.byref(error))
            if self.watch.verdict(time.monotonic(), error.value if code == 0 else code) is None:
                return
            self.aborted = True
        self._abort()

    def record_failure(self, reason: str) -> bool:
        """Record `reason` (unless a failure is recorded already) and claim the abort: whether
        the caller is to run it (abort_elsewhere, outside the lock)."""
        with self.lock:
            if self.watch.failure is None:
                self.watch.failure = reason
            if self.closed or self.aborted:
                return False
            self.aborted = True
            return True

    def _abort(self) -> None:
        """ncclCommAbort: the communicator's kernels stop, its resources go (called once, by
        whoever claimed it)."""
        try:
            _current(self.ctx, self.lib.lib.ncclCommAbort, ctypes.c_void_p(self.comm))
        except Exception as exc:  # noqa: BLE001 - a faulted device: nothing more can be released
            log.warning("memra_cuda: ncclCommAbort failed: %s", exc)

    def abort_elsewhere(self) -> None:
        """_abort on a thread of its own: the abort ends the kernels at once, but from NCCL 2.26
        returns only once the graphs that captured the communicator are gone, which the thread
        that asked may hold."""
        threading.Thread(target=self._abort, daemon=True, name="memra-nccl-abort").start()

    def release(self) -> None:
        """Release the communicator, once, and stop the watchdog. A healthy one is finalised (its
        last operations flushed to the peers) and destroyed, each within the timeout on a thread
        of its own; past that, or where it failed, it is aborted."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if self.aborted:
                return
            self.aborted = True
            graceful = self.watch.failure is None
        lib, comm, grace = self.lib.lib, ctypes.c_void_p(self.comm), self.watch.timeout
        if graceful and _within(grace, lambda: _current(self.ctx, lib.ncclCommFinalize, comm) == 0):
            if _within(grace, lambda: _current(self.ctx, lib.ncclCommDestroy, comm) == 0):
                return
            log.warning("memra_cuda: ncclCommDestroy did not return within %g s; its resources stay", grace)
            return  # a destroy under way cannot be aborted as well
        def abort() -> bool:
            self._abort()
            return True

        if not _within(grace, abort):
            log.warning("memra_cuda: ncclCommAbort did not return within %g s (graphs that captured the "
                        "communicator alive?); its resources stay", grace)


def _on_thread(call: Callable[[], Any], seconds: float, name: str) -> list[Any]:
    """call() on a daemon thread of its own, waited for `seconds`: [] if it has not returned by
    then (a call into NCCL that waits for a peer cannot be interrupted, only left behind), else
    [what it returned, or the exception it raised]."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except Exception as exc:  # noqa: BLE001 - handed to the waiting thread
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True, name=name)
    thread.start()
    thread.join(seconds)
    return out


def _within(seconds: float, call: Callable[[], bool]) -> bool:
    """Whether call(), on a thread of its own, returned True within `seconds` (a release's
    step: what it raised is logged, and counts as not)."""
    out = _on_thread(call, seconds, "memra-nccl-release")
    if out and isinstance(out[0], Exception):
        log.warning("memra_cuda: releasing a communicator: %s", out[0])
    return bool(out) and out[0] is True


def _release(state: _State, guard: _Guard) -> None:
    """The communicator's finaliser (free() or the collector): the engines' waits unguarded,
    the communicator released; never raises."""
    try:
        for engine in state.engines:
            if guard in engine.guards:
                engine.guards.remove(guard)
        state.release()
    except Exception as exc:  # noqa: BLE001 - a finaliser must not raise
        log.warning("memra_cuda: releasing a communicator failed: %s", exc)


def _watchdog(state: _State, poll: float) -> None:
    while not state.closed:
        try:
            state.poll()
        except Exception as exc:  # noqa: BLE001 - record it as the failure, end the communicator
            if state.record_failure(f"the watchdog could not ask NCCL for errors: {exc}"):
                state._abort()
        time.sleep(poll)


class NcclCall(Prepared):
    """One of a Communicator's operations, prepared: the driver layer's Prepared rules hold (it
    holds its buffers and the communicator, refuses to run once one is freed, and hands them to
    a graph being captured), issued under the communicator's lock, an NCCL failure failing the
    communicator and raising RankFailure."""

    def __init__(self, comm: Communicator, engine: Engine, name: str, argv: tuple, holds: tuple):
        fn = getattr(comm.lib.lib, name)
        super().__init__(engine, lambda *args: (0, fn(*args)), name, argv, (comm, *holds))
        self._comm = comm

    def __call__(self, *values: object) -> None:
        if values:
            self.set(*values)  # TypeError: an operation's arguments are fixed
        comm, state = self._comm, self._comm._state
        with state.lock:
            if state.aborted or state.watch.failure is not None:
                comm.check()
                raise RankFailure("the communicator was aborted", comm.rank)
            if self._refusal is not None:
                raise ValueError(self._refusal)
            code = self._ctx.run(self._fn, self._name, self._argv)[1]
        if code:
            comm.fail_on(code, self._name)
        hold = self.engine.capture_hold
        if hold is not None:
            hold(*self._holds)


def _current(ctx: PrimaryContext, fn: Callable[..., int], *args: Any) -> int:
    """`fn(*args)`, an NCCL call, with the engine's context current (NCCL uses the runtime,
    which takes the current context's device)."""
    return ctx.run(lambda *a: (0, fn(*a)), getattr(fn, "__name__", "nccl"), args)[1]


class Communicator(Handle):
    """Rank `rank` of `world` on `engine`'s device, joined with `unique_id` (rank 0's
    Nccl.unique_id(), passed to every rank: exchange_id, or the engine's own means). Joining
    waits for every rank, at most `timeout` seconds, which also bounds every later host wait
    on the engine (module docstring).

    The operations take DeviceBuffers of the engine and queue on its stream, or on another
    engine's of the same device (`engine=`: a torch decoder's stream, whose waits are then timed
    too); `group()` fuses several (a send and a receive that pair with a peer's) into one launch.
    Operations on several streams must not run at once: NCCL orders a communicator's
    operations only by the order they are issued in."""

    def __init__(self, engine: Engine, rank: int, world: int, unique_id: bytes, *, timeout: float = 30.0,
                 poll: float = 0.05):
        rank, world = as_index(rank, "rank"), as_index(world, "world")
        check_world(world)  # NCCL's nranks is a C int: ctypes handed it on wrapped
        if not 0 <= rank < world:
            raise ValueError(f"a rank is 0 <= rank < world, not rank {rank} of {world}")
        # None met "has no len()", a str or list of 128 ctypes' TypeError once NCCL was loaded and joining began
        check_id(unique_id, "unique_id must be", (bytes, bytearray))
        # Both checked before NCCL is loaded or joined: the watchdog's sleep(poll) raised on its
        # thread for a negative or NaN poll, which ended the watchdog silently, and with it the
        # timeout of every host wait (a dead peer then hung them).
        watch = Watch(timeout, rank)
        poll = as_seconds(poll, "poll (the watchdog's time between looks)")  # 1e10 s: time.sleep's OverflowError too
        self.engine, self.rank, self.world = engine, rank, world
        self.lib = lib = nccl()
        # Every connection made while joining, inside its timeout: NCCL otherwise connects a peer
        # at the first operation with it, out of the watchdog's reach.
        os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")
        ctx = engine.activate()
        comm = self._join(lib, ctx, rank, world, unique_id, watch.timeout)
        self._state = state = _State(lib, comm, watch, ctx)
        self._guard = guard = _Guard(state)
        self._finalizer = weakref.finalize(self, _release, state, guard)
        state.owner = weakref.ref(self)
        self._watch(engine)
        self._comm = ctypes.c_void_p(comm)
        threading.Thread(target=_watchdog, args=(state, poll), daemon=True, name=f"memra-nccl-rank{rank}").start()

    @staticmethod
    def _join(lib: Nccl, ctx: PrimaryContext, rank: int, world: int, unique_id: bytes, timeout: float) -> int:
        """ncclCommInitRank, which waits for every rank, on a thread of its own so that a rank
        that never joins is a TimeoutError here rather than a hang."""
        arg = UniqueIdArg.from_buffer_copy(unique_id)  # all 128 bytes (a char field's setter stops at a zero)

        def init() -> int | BaseException:
            comm = ctypes.c_void_p()
            code = _current(ctx, lib.lib.ncclCommInitRank, ctypes.byref(comm), world, arg, rank)
            return lib.failure(code, "ncclCommInitRank") if code else int(comm.value or 0)

        out = _on_thread(init, timeout, f"memra-nccl-join{rank}")
        if not out:  # the thread may still join later: that communicator is never released
            raise RankFailure(f"joining a communicator of {world} ranks took more than {timeout:g} s: some rank did "
                              "not join (or joined with another id)", rank)
        if isinstance(out[0], BaseException):
            raise out[0]
        return out[0]

    @classmethod
    def from_env(cls, engine: Engine | None = None, *, timeout: float = 30.0) -> Communicator:
        """The rank a launcher's environment describes (Ranks.from_env), on `engine` or a new
        Engine on device LOCAL_RANK, the id exchanged over TCP with rank 0 (exchange_id)."""
        ranks = Ranks.from_env()
        if engine is None:
            from ..driver.engine import Engine
            engine = Engine(ranks.local_rank)
        unique_id = exchange_id(ranks, lambda: nccl().unique_id(), timeout)
        return cls(engine, ranks.rank, ranks.world, unique_id, timeout=timeout)

    # -- what it is ---------------------------------------------------------------------------
    @property
    def failure_reason(self) -> str | None:
        """Why the communicator failed (None while it works)."""
        return self._state.watch.failure

    def check(self) -> None:
        """RankFailure if a peer failed (or the communicator was freed: ValueError)."""
        self._usable()
        self._state.raise_if_failed()

    def fail_on(self, code: int, call: str) -> NoReturn:
        """NCCL's `call` returned `code`: the communicator fails (aborted, its graphs poisoned)
        and RankFailure says why."""
        error = self.lib.failure(code, call, self._comm)
        self.abort(f"{error}")
        self.poison_graphs()
        raise RankFailure(str(error), self.rank) from error

    def poison_graphs(self) -> None:
        """Once a peer failed: every graph that captured one of this communicator's operations
        refuses to run (its kernels would wait on a communicator that is gone)."""
        self._notify(f"{self!r}")

    def abort(self, reason: str = "aborted by this rank") -> None:
        """End the communicator now: its kernels stop, every wait on them raises RankFailure. The
        abort runs on a thread of its own (from NCCL 2.26 it returns only once the graphs that
        captured the communicator are gone, which free() frees)."""
        if self._state.record_failure(reason):
            self._state.abort_elsewhere()

    def free(self) -> None:
        """Finish the engines' work (bounded by the timeout), free every graph that captured one
        of the communicator's operations (NCCL releases a communicator only once they are gone),
        then release it; those graphs refuse to run from now on."""
        if self.freed:
            return
        for engine in self._state.engines:  # every stream its operations were queued on
            if self._state.watch.failure is None and not engine.closed:
                with contextlib.suppress(RankFailure):
                    engine.synchronize()
        for dependent in list(self._dependents or ()):
            if isinstance(dependent, Graph):
                dependent.free()
        super().free()

    def agree(self, values: Sequence[int], what: str = "the values") -> None:
        """RanksDiverged on every rank unless every rank passes the same `values` (u64 words): an
        all-reduce of their maximum and of their complements' (their minimum), one readback. A
        host check between bursts, not for the per-round path; where it fails, every rank's
        communicator is failed (its graphs refuse, its release is an abort): what the ranks run
        together no longer agrees."""
        words = np.asarray(values, np.uint64)
        if words.ndim != 1 or not words.size:
            raise ValueError(f"agree() takes a non-empty sequence of u64 values, not {values!r}")
        both = self.engine.htod(np.concatenate([words, ~words]), label="agreement")
        self.all_reduce(both, op="max")
        seen = self.engine.dtoh(both)
        high, low = seen[:words.size], ~seen[words.size:]
        if (high != low).any():
            diverged = RanksDiverged(what, low.tolist(), high.tolist(), self.rank)
            with self._state.lock:  # every rank alike: what the ranks run together no longer agrees
                self._state.watch.failure = self._state.watch.failure or diverged.detail
            self.poison_graphs()
            raise diverged

    # -- operations -----------------------------------------------------------------------------
    # Each is checked once by its prepare_ form, which returns the call to issue again and again
    # (a round's, say): issuing it costs the NCCL call and one test of the communicator's state.
    # `engine`: another engine of the communicator's device to queue on (a torch decoder's stream,
    # say), whose host waits the watchdog then times too.
    def all_reduce(self, buf: DeviceBuffer, out: DeviceBuffer | None = None, op: str = "sum",
                   dtype: DTypeLike | None = None, *, engine: Engine | None = None) -> None:
        """out = op over the ranks of buf (in place where out is None); `dtype` reads the elements
        as another type of their size: "bfloat16" for a bf16 tensor's memory, wrapped as its
        2-byte ints (engine.buffer(t.view(torch.int16))), since a buffer holds no bfloat16."""
        self.prepare_all_reduce(buf, out, op, dtype, engine=engine)()

    def prepare_all_reduce(self, buf: DeviceBuffer, out: DeviceBuffer | None = None, op: str = "sum",
                           dtype: DTypeLike | None = None, *, engine: Engine | None = None) -> Callable[[], None]:
        """all_reduce checked once (buffers, dtype, op, engine), as a call to issue again and again:
        each issue costs the NCCL call and a test of the communicator's state."""
        engine, out = self._on(engine), buf if out is None else out
        count, kind = self._pair(engine, buf, out, dtype)
        return self._prepare(engine, "ncclAllReduce", (buf.ptr, out.ptr, count, kind, nccl_op(op)), (buf, out))

    def broadcast(self, buf: DeviceBuffer, root: int = 0, out: DeviceBuffer | None = None,
                  dtype: DTypeLike | None = None, *, engine: Engine | None = None) -> None:
        """out = root's buf on every rank (in place where out is None)."""
        self.prepare_broadcast(buf, root, out, dtype, engine=engine)()

    def prepare_broadcast(self, buf: DeviceBuffer, root: int = 0, out: DeviceBuffer | None = None,
                          dtype: DTypeLike | None = None, *, engine: Engine | None = None) -> Callable[[], None]:
        """broadcast checked once (buffers, dtype, root, engine), as a call to issue again and again:
        each issue costs the NCCL call and a test of the communicator's state."""
        engine, out = self._on(engine), buf if out is None else out
        count, kind = self._pair(engine, buf, out, dtype)
        return self._prepare(engine, "ncclBroadcast", (buf.ptr, out.ptr, count, kind, self._rank_of(root, "root")),
                             (buf, out))

    def send(self, buf: DeviceBuffer, peer: int, dtype: DTypeLike | None = None, *,
             engine: Engine | None = None) -> None:
        """buf to rank `peer`, which receives it with recv() of as many elements."""
        self.prepare_send(buf, peer, dtype, engine=engine)()

    def prepare_send(self, buf: DeviceBuffer, peer: int, dtype: DTypeLike | None = None, *,
                     engine: Engine | None = None) -> Callable[[], None]:
        """send checked once (buffer, dtype, peer, engine), as a call to issue again and again; where
        this rank also receives from `peer`, issue both inside one group(), or the two ranks wait on each other."""
        return self._point_to_point("ncclSend", buf, peer, dtype, engine)

    def recv(self, buf: DeviceBuffer, peer: int, dtype: DTypeLike | None = None, *,
             engine: Engine | None = None) -> None:
        """buf from rank `peer`'s send()."""
        self.prepare_recv(buf, peer, dtype, engine=engine)()

    def prepare_recv(self, buf: DeviceBuffer, peer: int, dtype: DTypeLike | None = None, *,
                     engine: Engine | None = None) -> Callable[[], None]:
        """recv checked once (buffer, dtype, peer, engine), as a call to issue again and again; where
        this rank also sends to `peer`, issue both inside one group(), or the two ranks wait on each other."""
        return self._point_to_point("ncclRecv", buf, peer, dtype, engine)

    def _point_to_point(self, name: str, buf: DeviceBuffer, peer: int, dtype: DTypeLike | None,
                        engine: Engine | None) -> Callable[[], None]:
        engine = self._on(engine)
        count, kind = self._pair(engine, buf, buf, dtype)
        return self._prepare(engine, name, (buf.ptr, count, kind, self._rank_of(peer, "peer")), (buf,))

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """The operations queued inside as one (ncclGroupStart/End): a rank's send to a peer and
        its receive from it must be in one group, or the two ranks wait on each other."""
        self.check()
        with self._state.lock:
            self.lib.call("ncclGroupStart")
        try:
            yield
        except BaseException:
            self._end_group()  # the group closed; the body's exception is the one to see
            raise
        code = self._end_group()
        if code:
            self.fail_on(code, "ncclGroupEnd")

    def _end_group(self) -> int:
        with self._state.lock:
            return _current(self._state.ctx, self.lib.lib.ncclGroupEnd)

    def _on(self, engine: Engine | None) -> Engine:
        """The engine an operation queues on: the communicator's, or another of its device."""
        engine = self.engine if engine is None else engine
        if engine.device != self.engine.device:
            raise ValueError(f"{engine!r} is not on the communicator's device {self.engine.device}")
        return engine

    def _watch(self, engine: Engine) -> None:
        """The guard joins `engine`'s host waits (the watchdog's timeout bounds them, a peer's
        failure raises in them), once an operation is prepared on it: a prepare refused before
        (its buffers, a freed communicator) left the guard on another engine for good, a freed
        communicator's raising RankFailure in every later synchronize."""
        if self._guard not in engine.guards:
            engine.guards.append(self._guard)
            self._state.engines.append(engine)

    def _pair(self, engine: Engine, buf: DeviceBuffer, out: DeviceBuffer, dtype: DTypeLike | None) -> tuple[int, int]:
        for what, b in (("buf", buf), ("out", out)):
            if not isinstance(b, DeviceBuffer):
                raise TypeError(f"{what} must be a DeviceBuffer (engine.buffer(tensor) wraps a tensor), not {b!r}")
            engine.check_owns(b, what)
        if out.nbytes != buf.nbytes or out.dtype != buf.dtype:
            raise ValueError(f"{buf!r} and {out!r} differ: an NCCL operation's buffers hold the same elements")
        element = buf.dtype if dtype is None else dtype
        kind, size = nccl_type(element)
        if size != buf.dtype.itemsize:
            raise ValueError(f"{buf!r} holds {buf.dtype.itemsize}-byte elements: they cannot be reduced as "
                             f"{dtype} ({size} bytes)")
        return buf.len, kind

    def _rank_of(self, rank: int, what: str) -> int:
        rank = as_index(rank, what)
        if not 0 <= rank < self.world:
            raise ValueError(f"{what} must be a rank of 0..{self.world - 1}, not {rank}")
        return rank

    def _prepare(self, engine: Engine, name: str, args: tuple, uses: tuple) -> NcclCall:
        """The NCCL call `name` over `args`, then the communicator and `engine`'s stream, checked
        and bound once (NcclCall)."""
        self._usable()
        call = NcclCall(self, engine, name, (*args, self._comm, ctypes.c_void_p(engine.stream_handle)), uses)
        self._watch(engine)
        return call

    def __repr__(self) -> str:
        reason = self.failure_reason
        state = "freed" if self.freed else (f"failed: {reason}" if reason else "live")
        return f"Communicator(rank {self.rank} of {self.world}, device {self.engine.device}, {state})"

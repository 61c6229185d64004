"""Ranks started from one process as torchrun would start them: what the tests and the bench
use to run a command over several GPUs of this host, one process a GPU."""
from __future__ import annotations

import os
import resource
import secrets
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..driver.values import TEXT_LIKE, as_seconds, as_size
from .rendezvous import MAX_WORLD, SECRET_VARIABLE


@dataclass(frozen=True)
class Ended:
    """How one rank's process ended: its exit status (None: killed at the timeout) and output."""

    rank: int
    returncode: int | None
    stdout: str
    stderr: str


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on this host now (each socket held open until all are bound,
    so no two are the same)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


GRACE = 10.0  # seconds a rank killed past the timeout has between SIGTERM and SIGKILL
OWN_FILES = 64  # of the open files' limit, what a launch leaves to this process's own


def launch(argv: Sequence[str], world: int, env: Mapping[str, str] | None = None, timeout: float = 300.0
           ) -> list[Ended]:
    """Run `argv` as `world` ranks on this host (RANK, WORLD_SIZE, LOCAL_RANK = RANK, MASTER_ADDR
    127.0.0.1, a free MASTER_PORT and a free MEMRA_NCCL_PORT for the id exchange, a new
    MEMRA_NCCL_SECRET that the ranks prove there, NVLink multicast off, unless `env` says
    otherwise: this process's own port and secret are not every launch's) and wait for all of
    them, at most `timeout` seconds. Past it, or if this process fails while they run, every rank
    still running is stopped with what it started (torchrun's workers): each rank leads a session
    of its own, which gets SIGTERM, then SIGKILL GRACE seconds later. Output goes to files, so no
    rank stalls on a full pipe. `world` is checked, 1 to MAX_WORLD (0 ran nothing, and its empty
    list read as every rank having passed; True ran one rank told WORLD_SIZE=True), and `timeout`
    is a number of seconds above 0 (a NaN waited for ever, a hung rank with it), as are `argv` (a
    list of words, str, bytes or paths, none holding a NUL byte: a str's letters were run as the
    command) and `env` (str to str, no "=" in a name, no NUL byte), before any rank starts. So is
    a world past what this process may open files for: 10**9 ranks started
    processes for half a minute, to an OSError of too many open files. A program named by a path
    (argv[0] with a separator: run as it is, not looked up on PATH) that does not exist is a
    FileNotFoundError naming it, as Popen's was, but before any port, folder or file is made."""
    world = as_size(world, "world", 1, MAX_WORLD)
    timeout = as_seconds(timeout, "timeout")
    # a list or tuple of words Popen runs: a word of no such type (5, None), a generator (read whole by the first
    # rank, the second given no command) or a dict met Popen's errors, naming nothing, once ports and files were made
    if (isinstance(argv, TEXT_LIKE) or not isinstance(argv, Sequence) or not argv
            or not all(isinstance(word, (str, bytes, os.PathLike)) for word in argv)):
        raise TypeError(f"argv is the command as a non-empty list of its words (['python', 'x.py']: str, bytes or "
                        f"paths), not {argv!r}")
    for word in argv:
        if b"\0" in os.fsencode(word):  # Popen's "embedded null byte", naming nothing
            raise ValueError(f"argv's words are C strings, with no NUL byte: {word!r}")
    _runnable(argv[0])
    if env is not None and not (isinstance(env, Mapping) and all(isinstance(x, str) for x in (*env, *env.values()))):
        raise TypeError(f"env maps names to values, both str, not {env!r}")
    if env is not None and any("=" in name or "\0" in name or "\0" in value for name, value in env.items()):
        raise ValueError(f"env's names hold no '=' or NUL byte, its values no NUL byte (a process's environment is C "
                         f"strings), not {env!r}")
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and 2 * world > soft - OWN_FILES:
        raise ValueError(f"a launch of {world} ranks holds {2 * world} files open (each rank's output), past what "
                         f"this process may open ({soft}, ulimit -n, less {OWN_FILES} of its own): at most "
                         f"{(soft - OWN_FILES) // 2} ranks")
    master, exchange = free_ports(2)
    base = {**os.environ, "NCCL_NVLS_ENABLE": "0", "MEMRA_NCCL_PORT": str(exchange),
            SECRET_VARIABLE: secrets.token_hex(32), **(env or {}),
            "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master)}
    with tempfile.TemporaryDirectory(prefix="memra-ranks-") as folder:
        files, procs = [], []
        try:
            for rank in range(world):
                out = open(os.path.join(folder, f"{rank}.out"), "w+")
                err = open(os.path.join(folder, f"{rank}.err"), "w+")
                files.append((out, err))
                procs.append(subprocess.Popen(list(argv), stdout=out, stderr=err, start_new_session=True,
                                              env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
            _wait(procs, timeout)
        finally:
            killed = [proc for proc in procs if proc.poll() is None]
            _stop(killed)
        ended = []
        for rank, (proc, (out, err)) in enumerate(zip(procs, files)):
            out.seek(0)
            err.seek(0)
            ended.append(Ended(rank, None if proc in killed else proc.returncode, out.read(), err.read()))
            out.close()
            err.close()
        return ended


def _runnable(program: str | bytes | os.PathLike) -> None:
    """FileNotFoundError naming `program` (argv[0], a word launch has checked) where it is a path (a
    separator in it: Popen runs it as it is, where a bare name is looked up on PATH) to nothing: Popen
    found it out only once the launch's ports, folder and output files were made. What else Popen
    refuses (a bare name not on PATH, a folder, a file not executable) is Popen's to say, as before."""
    path = os.fsdecode(program)
    if any(sep in path for sep in (os.sep, os.altsep) if sep) and not os.path.exists(path):
        raise FileNotFoundError(f"argv[0], the program each rank runs, is {path!r}: no such file (a path is run as "
                                "it is, from the current folder if relative, not looked up on PATH)")


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM to each process's session, SIGKILL to whatever of a session is left after GRACE
    seconds (the rank itself, or what it started, gone or not); a process that outlives even that
    is left to the system (never waited on without bound)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        procs = [proc for proc in procs if _session_alive(proc)]
        for proc in procs:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + GRACE
        while any(_session_alive(proc) for proc in procs) and time.monotonic() < deadline:
            time.sleep(0.05)


def _session_alive(proc: subprocess.Popen) -> bool:
    """Whether any process of the session `proc` leads is left (the rank itself reaped first: its
    zombie would count)."""
    proc.poll()
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait(procs: Sequence[subprocess.Popen], seconds: float) -> None:
    """Until every one of `procs` has ended, at most `seconds` in all."""
    deadline = time.monotonic() + seconds
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            return

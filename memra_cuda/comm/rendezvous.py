"""Where a rank stands (Ranks, from a launcher's environment) and how the ranks agree on one
communicator id: rank 0 makes it and hands it to the others over TCP (exchange_id), or the
engine passes it by its own means (a torch.distributed broadcast, a file, an MPI bcast).

The exchange is the only host traffic between ranks: the rounds themselves move everything on
the device. Every step of it is bounded by a timeout, so a rank that never comes makes the
others raise rather than wait.

The id is what NCCL's bootstrap trusts: whoever holds it can try to join the communicator. So
rank 0 serves it only to a connection that proves it holds the launch's secret (Ranks.secret,
MEMRA_NCCL_SECRET, 16 bytes at least), and only once a rank; every connection has a short budget
of its own, so a silent port scanner or a health check never holds up the ranks. Each
connection, in turn:

    rank 0 -> MAGIC, server nonce
    rank r -> MAGIC, r, world, client nonce, HMAC(secret, "C" | transcript)
    rank 0 -> where the proof fails, WRONG_SECRET alone; else a status, what comes with it (for
              "+", the id XOR a keystream of HMAC(secret, "K" | transcript)) and
              HMAC(secret, "S" | transcript | status | what comes with it)
    rank r -> ACK after "+", and only then does rank 0 count r as served

where the transcript is MAGIC, both nonces, r and world. Rank r's proof is fresh to this
connection (rank 0's nonce), so an eavesdropper cannot replay it; rank 0's tag proves it holds
the secret too and that its answer came unaltered, a refusal as much as the id: a stranger that
holds the port before rank 0 can answer anything, so a rank believes no answer without the tag and
asks again until its timeout. The mask keeps the id from an eavesdropper.

The rank proves first. One side must, and whichever does hands the other something to check
guesses of the secret against, offline. Rank 0 answers whoever connects while it listens; a rank
meets a stranger only where the stranger holds rank 0's address and port: before rank 0, which
then cannot listen and fails the launch, or after rank 0 has served every rank and gone, when only
a late second claim of a rank is left to ask. So rank 0 gives a connection that did not prove the
secret nothing made with it, not even a tag on its refusal (WRONG_SECRET): a rank whose secret is
not rank 0's cannot tell that refusal from a stranger's, and asks again too. Without a secret (an
empty one), only a loopback address is allowed: the same handshake runs, and proves nothing beyond
"a process of this host".
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import itertools
import logging
import os
import reprlib
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..driver.errors import MemraError
from ..driver.values import as_index, as_seconds
from .library import UNIQUE_ID_BYTES, check_id

log = logging.getLogger(__name__)

SECRET_VARIABLE = "MEMRA_NCCL_SECRET"
SECRET_MIN_BYTES = 16  # shorter is refused: guessed at rank 0's port (thousands a second) or from one proof
HELLO_BUDGET = 2.0  # seconds a connection has for its whole handshake: a silent one is dropped then, and alone
MAX_WORLD = 2**31 - 1  # NCCL's nranks is a C int (a hello carries rank and world in 4 bytes each)
SHOWN = 32  # the waiting ranks rank 0's timeout names; past them, their count

_MAKE_ONE = f"{SECRET_VARIABLE}=$(python -c 'import secrets; print(secrets.token_hex(32))')"
_MAGIC = b"memra-nccl-id/3\n"  # the protocol and its version: what is not a rank of ours is told apart at once
_NONCE = 32
_MAC = 32  # HMAC-SHA256
_HELLO = len(_MAGIC) + 4 + 4 + _NONCE + _MAC  # magic, rank, world, client nonce, proof
_HANDSHAKES = 256  # connections rank 0 handshakes with at once; more wait in the listen backlog
_OK, _ACK = b"+", b"!"  # rank 0's answer to a proven rank it serves, and the rank's once it holds the id
_AGAIN = b"a"  # another connection of this rank is mid-handshake: come again
_WRONG_SECRET = b"p"  # rank 0's answer to a hello that did not prove the secret: untagged, so never believed
_NOT_OF_WORLD, _SERVED = b"w", b"s"  # rank 0's answers to a proven claim it will never serve
_REFUSALS = {  # and what the refused rank is told
    _NOT_OF_WORLD: "rank {rank} of a world of {world} is not one of rank 0's ranks",
    _SERVED: "rank 0 served rank {rank} already: two processes claim it",
}
_TAGGED = {_OK, _AGAIN, *_REFUSALS}  # the answers rank 0 proves
_UNBELIEVED_PAUSE = 0.5  # seconds before asking again after an answer not believed: rank 0 logs every refusal


class RankRefused(MemraError, PermissionError):
    """Rank 0 refused this rank for good, and proved the refusal its own (a rank outside its world,
    a rank served already): asking again would not help, so the rank raises at once."""


@dataclass(frozen=True)
class Ranks:
    """This process's rank among `world`, the GPU it drives (`local_rank`, its device ordinal on
    this host), where rank 0 listens for the id exchange, and the launch's secret that every rank
    proves there (never in a repr, so never in a log)."""

    rank: int
    world: int
    local_rank: int = 0
    address: str = "127.0.0.1"
    port: int = 29501  # MASTER_PORT's default + 1 (torchrun's store holds MASTER_PORT)
    secret: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        """The numbers are checked ints, kept as plain ones (as_index: a float, a bool or a string
        is refused, naming it; 2.0 ranks met range() only once rank 0 listened, and True was rank
        1), and the world at most MAX_WORLD, NCCL's: a hello could not carry a world past 4 bytes
        (OverflowError on the rank), and rank 0 waited for ranks that no launch has. The address is
        a str, not empty or blank (from_env's MASTER_ADDR too: one check, one message), which was
        found out only in the exchange, under its timeout."""
        for name in ("rank", "world", "local_rank", "port"):
            object.__setattr__(self, name, as_index(getattr(self, name), name))
        # text, checked here: a bytes secret (os.urandom's) met "'bytes' object has no attribute 'encode'",
        # and None passed to fail on rank 0 alone, inside the exchange; the secret's value is never shown
        if not isinstance(self.address, str):
            raise TypeError(f"address must be a host name or an IP address (a str), not {self.address!r}")
        if not self.address.strip():  # taken, and found out only in the exchange, under its timeout
            raise ValueError(f"address (MASTER_ADDR) is rank 0's host name or IP address, not {self.address!r}: "
                             "name it, or leave it out (MASTER_ADDR unset) for 127.0.0.1")
        if self.address != self.address.strip():  # " 127.0.0.1" was no loopback: "reachable beyond this host"
            raise ValueError(f"address (MASTER_ADDR) {self.address!r} has white space around it: give the host "
                             "name or IP address alone")
        if not isinstance(self.secret, str):
            raise TypeError(f"secret must be a str ({SECRET_VARIABLE}'s value; '' for none), not a "
                            f"{type(self.secret).__name__}: random bytes are given as text, their .hex()")
        check_world(self.world)
        if not (0 <= self.rank < self.world and self.local_rank >= 0 and 0 < self.port < 65536):
            raise ValueError(f"a rank is 0 <= rank < world with local_rank >= 0 and a port in 1..65535, not "
                             f"rank={self.rank}, world={self.world}, local_rank={self.local_rank}, port={self.port}")
        if self.secret and len(self.secret.encode()) < SECRET_MIN_BYTES:
            raise ValueError(f"{SECRET_VARIABLE} is {len(self.secret.encode())} bytes: a secret is at least "
                             f"{SECRET_MIN_BYTES}, random (one overheard handshake, or guesses at rank 0's port, find "
                             f"a short one); make one with {_MAKE_ONE}, once a launch, and give it to every rank")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Ranks:
        """torchrun's variables: RANK, WORLD_SIZE, LOCAL_RANK (default 0), MASTER_ADDR (default
        127.0.0.1); the exchange's port is MEMRA_NCCL_PORT, else MASTER_PORT + 1 (default 29500
        + 1): torchrun's own store listens on MASTER_PORT. Its secret is MEMRA_NCCL_SECRET (none
        by default: then only a loopback MASTER_ADDR is served), of SECRET_MIN_BYTES at least. A
        MASTER_ADDR set empty (or blank) is refused by name, as any Ranks' address is: it was
        taken, and found out only in the exchange, under its timeout."""
        environ = os.environ if environ is None else environ
        missing = [name for name in ("RANK", "WORLD_SIZE") if name not in environ]
        if missing:
            raise ValueError(f"a rank's environment names {' and '.join(missing)} (as torchrun sets them)")
        address = environ.get("MASTER_ADDR", "127.0.0.1")  # set empty or blank: refused as Ranks' address
        numbers = {name: _decimal(environ, name, default) for name, default in
                   (("RANK", ""), ("WORLD_SIZE", ""), ("LOCAL_RANK", "0"), ("MASTER_PORT", "29500"))}
        if "MEMRA_NCCL_PORT" in environ:
            port = _decimal(environ, "MEMRA_NCCL_PORT", "")
        else:  # named: refused as Ranks' port of 65536, it was a port no variable held
            port = numbers["MASTER_PORT"] + 1
            if not 0 < port < 65536:
                raise ValueError(f"the id exchange listens on MEMRA_NCCL_PORT, else MASTER_PORT + 1: MASTER_PORT "
                                 f"{numbers['MASTER_PORT']} makes port {port}, not one of 1..65535: set "
                                 "MEMRA_NCCL_PORT to a free port")
        return cls(numbers["RANK"], numbers["WORLD_SIZE"], numbers["LOCAL_RANK"],
                   address, port, environ.get(SECRET_VARIABLE, ""))


def check_world(world: int) -> None:
    """ValueError for a world (an int) past MAX_WORLD, NCCL's: Ranks' and a Communicator's one check."""
    if world > MAX_WORLD:
        raise ValueError(f"a world is at most {MAX_WORLD} ranks (NCCL's), not {world}")


def _decimal(environ: Mapping[str, str], name: str, default: str) -> int:
    """The variable `name` (else `default`) as torchrun writes an integer: decimal digits, a sign
    and spaces around them allowed, as int() takes them. Each is named: which of five variables
    was empty or garbage went unsaid, and int()'s own literals were taken (RANK=1_0 as rank 10,
    an Arabic-Indic digit as its value), silently."""
    value = environ.get(name, default)
    digits = value.strip()
    digits = digits[1:] if digits.startswith(("+", "-")) else digits
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 20):  # past 20 digits, no port or rank
        raise ValueError(f"{name} must be a decimal integer (as torchrun sets it), not {reprlib.repr(value)}")
    return int(value)


def exchange_id(ranks: Ranks, make_id: Callable[[], bytes], timeout: float = 60.0, *,
                hello_budget: float = HELLO_BUDGET) -> bytes:
    """The communicator's id on every rank: rank 0 calls `make_id` (Nccl.unique_id) and serves
    the id to the world - 1 others at (address, port), each of which connects, retrying until
    `timeout` seconds have passed. TimeoutError past the timeout, saying what stood in the way:
    on rank 0, whom it served and whom not; on a rank, what it was told, or that nothing listened
    (a rank 0 not yet started, or one that has served every rank and gone). RankRefused where rank
    0 refuses a rank for good and proves it; ValueError, before anything else, where there is no
    secret and the address is not a loopback one, or where `timeout` or `hello_budget` is no
    number of seconds above 0 (a NaN deadline is never reached: a rank waited for ever). Each
    connection has `hello_budget` seconds for its handshake. A world of one rank exchanges
    nothing: its id is made and returned, and nothing listens."""
    timeout, hello_budget = as_seconds(timeout, "the id exchange's timeout"), as_seconds(hello_budget, "hello_budget")
    if not callable(make_id):  # the id itself: rank 0 met "'bytes' object is not callable", the others waited for it
        raise TypeError(f"make_id is a function making the communicator id (lambda: nccl().unique_id()), not a "
                        f"{type(make_id).__name__}")
    if ranks.world == 1:  # no rank to serve: it listened all the same (a port held elsewhere failed a one-rank run)
        return _made_id(make_id)
    if not ranks.secret and not _loopback(ranks.address):
        raise ValueError(f"the id exchange at {_where(ranks.address, ranks.port)} is reachable beyond this host, and "
                         f"the rank has no secret to prove: set {SECRET_VARIABLE} to one random value on every rank of "
                         f"the launch (for instance {_MAKE_ONE}, made once and given to each), or pass "
                         f"Ranks(secret=...)")
    deadline = time.monotonic() + timeout
    if ranks.rank == 0:
        unique_id = _made_id(make_id)
        if not ranks.secret:
            log.warning("the id exchange at %s has no %s: any process of this host can fetch the id",
                        _where(ranks.address, ranks.port), SECRET_VARIABLE)
        _Server(ranks, unique_id, hello_budget).serve(deadline)
        return unique_id
    return _Client(ranks).fetch(deadline, hello_budget)


def _made_id(make_id: Callable[[], bytes]) -> bytes:
    """Rank 0's id, made and checked: bytes, UNIQUE_ID_BYTES of them."""
    unique_id = make_id()
    check_id(unique_id, "make_id must return")  # a str, list or bytearray of 128 was served, or failed in the thread
    return unique_id


def _where(address: str, port: int) -> str:
    """address:port as a log or a message shows it, an IPv6 address in brackets."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _resolve(address: str, port: int) -> tuple[socket.AddressFamily, Any]:
    """The one address rank 0 listens on and its ranks connect to, and its family: IPv4 where the
    name has it, as the exchange always listened (a cluster's name may also resolve to an IPv6
    address its hosts do not route), else the first (::1, an IPv6 host). One, so that nothing
    listening at another address of the name (::1 beside 127.0.0.1) is ever asked."""
    try:
        found = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise socket.gaierror(exc.errno, f"{exc.strerror}: {_where(address, port)}") from None
    family, _, _, _, sockaddr = next((info for info in found if info[0] == socket.AF_INET), found[0])
    return family, sockaddr


def _loopback(address: str) -> bool:
    """Whether only this host reaches `address` (a name other than localhost is not trusted to)."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


class _Server:
    """Rank 0's side: every connection on a thread of its own, with `budget` seconds for its
    whole handshake, so a silent or slow one is dropped alone; a rank counts as served once it
    proved the secret, got the id and said so, and a claim of it from then on is refused."""

    def __init__(self, ranks: Ranks, unique_id: bytes, budget: float):
        self.ranks, self.unique_id, self.budget = ranks, unique_id, budget
        self.secret = ranks.secret.encode()
        self.where = _where(ranks.address, ranks.port)
        self.lock = threading.Lock()
        self.served: set[int] = set()
        self.claimed: set[int] = set()  # proven, the id on its way to it
        self.unproven: set[int] = set()  # claimed by a connection that did not prove the secret
        self.open: set[socket.socket] = set()
        self.slots = threading.BoundedSemaphore(_HANDSHAKES)
        self.over = False

    def serve(self, deadline: float) -> None:
        threads: list[threading.Thread] = []
        family, sockaddr = _resolve(self.ranks.address, self.ranks.port)
        with socket.create_server(sockaddr, family=family, reuse_port=False) as server:
            try:
                while self.unserved():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(self.timed_out())
                    if not self.slots.acquire(timeout=min(left, 0.1)):
                        continue
                    server.settimeout(min(left, 0.1))  # short: a rank served on another thread ends the loop
                    try:
                        conn, peer = server.accept()
                    except OSError as exc:
                        self.slots.release()
                        if not isinstance(exc, TimeoutError):
                            log.warning("the id exchange could not accept a connection (%s)", exc)
                            time.sleep(0.1)  # out of descriptors, say: the handshakes under way free them
                        continue
                    with self.lock:
                        self.open.add(conn)
                    threads = [t for t in threads if t.is_alive()]
                    threads.append(threading.Thread(target=self.handshake, args=(conn, peer), daemon=True,
                                                    name=f"memra-nccl-hello-{peer[0]}:{peer[1]}"))
                    threads[-1].start()
            finally:
                self.end(threads)

    def unserved(self) -> int:
        """How many of the other ranks are not served yet: counted, as the loop asks it at every
        turn (a set of every rank, made each time, took seconds and gigabytes in a large world,
        and rank 0's timeout never came)."""
        with self.lock:
            return self.ranks.world - 1 - len(self.served)

    def timed_out(self) -> str:
        """What rank 0 says at its timeout: whom it served and whom not (the first SHOWN, then how
        many more), and which of those only connections without the secret claimed (a rank whose
        secret is not rank 0's, most likely)."""
        world = self.ranks.world
        with self.lock:
            served = sorted(self.served)
            unproven = sorted(rank for rank in self.unproven if 0 < rank < world and rank not in self.served)
            shown = list(itertools.islice((rank for rank in range(1, world) if rank not in self.served), SHOWN))
        more = world - 1 - len(served) - len(shown)
        waiting = f"{shown} and {more} more" if more else f"{shown}"
        said = f"served ranks {served} but not ranks {waiting}" if served else f"served none of ranks {waiting}"
        said = f"rank 0 at {self.where} {said} by its timeout"
        if unproven:
            said += (f"; connections claiming ranks {unproven} did not prove {SECRET_VARIABLE} (a rank whose secret "
                     f"is not rank 0's, or a stranger)")
        return said

    def end(self, threads: list[threading.Thread]) -> None:
        """The exchange is over: what is still handshaking is cut (strays, a rank's second claim)."""
        with self.lock:
            self.over = True
            for conn in self.open:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        stop = time.monotonic() + 1.0
        for thread in threads:
            thread.join(max(stop - time.monotonic(), 0.0))

    def handshake(self, conn: socket.socket, peer: Any) -> None:
        who, claimed, until = _where(peer[0], peer[1]), False, time.monotonic() + self.budget
        rank: int | None = None
        try:
            server_nonce = secrets.token_bytes(_NONCE)
            _send(conn, _MAGIC + server_nonce, until)
            hello = _read(conn, _HELLO, until)
            if not hello.startswith(_MAGIC):
                log.warning("the id exchange dropped %s: it does not speak the exchange's protocol", who)
                return
            rank, world, client_nonce, proof = _parse(hello)
            transcript = _transcript(server_nonce, rank, world, client_nonce)
            if not hmac.compare_digest(proof, _mac(self.secret, b"C", transcript)):
                log.warning("the id exchange refused %s, claiming rank %d: it did not prove %s", who, rank,
                            SECRET_VARIABLE)
                with self.lock:
                    self.unproven.add(rank)
                _send(conn, _WRONG_SECRET, until)  # untagged: a tag would check the stranger's guesses of the secret
                return
            refusal = self.claim(rank, world)
            if refusal == _AGAIN:
                log.info("the id exchange told %s, claiming rank %d, to come again: another connection of that "
                         "rank is mid-handshake", who, rank)
            elif refusal:
                log.warning("the id exchange refused %s: %s", who, _REFUSALS[refusal].format(rank=rank, world=world))
            if refusal:
                _send(conn, _answer(self.secret, transcript, refusal), until)
                return
            claimed = True
            _send(conn, _answer(self.secret, transcript, _OK, _mask(self.secret, transcript, self.unique_id)), until)
            if _read(conn, len(_ACK), until) != _ACK:
                raise ConnectionError("it did not acknowledge the id")
            with self.lock:
                self.served.add(rank)
        except OSError as exc:  # ConnectionError and TimeoutError too
            if not self.over:
                claim = "" if rank is None else f", claiming rank {rank},"
                log.warning("the id exchange dropped %s%s: no whole handshake within its %g s (%s)", who, claim,
                            self.budget, exc)
        finally:
            with self.lock:
                self.open.discard(conn)
                if claimed and rank is not None:
                    self.claimed.discard(rank)
            conn.close()
            self.slots.release()

    def claim(self, rank: int, world: int) -> bytes:
        """Empty where `rank`, proven, is now this connection's to serve; else the refusal to send."""
        with self.lock:
            if world != self.ranks.world or not 0 < rank < world:
                return _NOT_OF_WORLD
            if rank in self.served:
                return _SERVED
            if rank in self.claimed:
                return _AGAIN
            self.claimed.add(rank)
            return b""


class _Client:
    """A rank's side: it asks rank 0 until its deadline, each attempt at most `budget` seconds,
    and raises RankRefused at once where rank 0 proves a refusal. An answer without that proof
    (a refusal, an id) is what a stranger holding rank 0's port can send as well: it is not
    believed but kept, to be named at the timeout, and asked again after a pause."""

    def __init__(self, ranks: Ranks):
        self.ranks, self.secret = ranks, ranks.secret.encode()
        self.where = _where(ranks.address, ranks.port)
        self.unbelieved: list[str] = []  # what the answers without rank 0's proof said

    def fetch(self, deadline: float, budget: float) -> bytes:
        last: OSError | None = None
        while time.monotonic() < deadline:
            told = len(self.unbelieved)
            try:
                return self.ask(min(deadline, time.monotonic() + budget))
            except RankRefused:
                raise
            except OSError as exc:  # ConnectionError and TimeoutError too: rank 0 not there yet, or someone else is
                last = exc
            pause = _UNBELIEVED_PAUSE if len(self.unbelieved) > told else 0.05
            time.sleep(max(min(pause, deadline - time.monotonic()), 0.0))
        raise TimeoutError(self.not_found(last))

    def not_found(self, last: OSError | None) -> str:
        """Why no rank 0 was found by the timeout, naming every cause the rank cannot tell apart."""
        rank, where = self.ranks.rank, self.where
        if self.unbelieved:
            return (f"rank {rank} found no rank 0 at {where} that proves {SECRET_VARIABLE} by its timeout: what "
                    f"listens there {self.unbelieved[-1]}, {len(self.unbelieved)} times, and did not prove "
                    f"{SECRET_VARIABLE}, so was not believed. Either rank 0's secret is not this rank's (every rank "
                    f"of a launch has the same one), or a process that is not rank 0 holds the port")
        if isinstance(last, ConnectionRefusedError):
            return (f"rank {rank} found no rank 0 at {where}: nothing listened there by its timeout. Either rank 0 "
                    f"has not started, or it has finished: it stops listening once it has served every rank, so "
                    f"where two processes claim rank {rank}, the one that comes after finds no one")
        return f"rank {rank} found no rank 0 at {where} by its timeout ({last})"

    def unbelieved_answer(self, said: str) -> ConnectionError:
        """The failure of an attempt whose answer did not prove the secret, kept as said."""
        self.unbelieved.append(said)
        return ConnectionError(f"what listens at {self.where} {said}, and did not prove {SECRET_VARIABLE}")

    def ask(self, until: float) -> bytes:
        rank, world, where = self.ranks.rank, self.ranks.world, self.where
        family, sockaddr = _resolve(self.ranks.address, self.ranks.port)
        with socket.socket(family, socket.SOCK_STREAM) as conn:
            conn.settimeout(max(until - time.monotonic(), 0.01))
            conn.connect(sockaddr)
            greeting = _read(conn, len(_MAGIC) + _NONCE, until)
            if not greeting.startswith(_MAGIC):
                raise ConnectionError(f"what listens at {where} does not speak the id exchange")
            client_nonce = secrets.token_bytes(_NONCE)
            transcript = _transcript(greeting[len(_MAGIC):], rank, world, client_nonce)
            _send(conn, _MAGIC + _words(rank, world) + client_nonce + _mac(self.secret, b"C", transcript), until)
            status = _read(conn, 1, until)
            if status == _WRONG_SECRET:
                raise self.unbelieved_answer(f"refused rank {rank}'s proof of {SECRET_VARIABLE}")
            if status not in _TAGGED:
                raise ConnectionError(f"what listens at {where} answered {status!r}")
            answer = status + _read(conn, (UNIQUE_ID_BYTES if status == _OK else 0) + _MAC, until)
            masked = answer[1:-_MAC]
            if not hmac.compare_digest(answer, _answer(self.secret, transcript, status, masked)):
                raise self.unbelieved_answer("answered as rank 0 would")
            if status == _AGAIN:
                raise ConnectionError(f"rank 0 at {where} is handshaking with another connection of rank {rank}")
            if status != _OK:
                raise RankRefused(f"rank 0 at {where} refused rank {rank}: " + _REFUSALS[status].format(
                    rank=rank, world=world))
            _send(conn, _ACK, until)
            return _mask(self.secret, transcript, masked)


def _answer(secret: bytes, transcript: bytes, status: bytes, masked: bytes = b"") -> bytes:
    """Rank 0's answer to a hello that proved the secret: its status, the masked id after "+", and
    its tag over both, which proves a refusal as it proves the id."""
    return status + masked + _mac(secret, b"S", transcript, status, masked)


def _words(*values: int) -> bytes:
    return b"".join(value.to_bytes(4, "little") for value in values)


def _parse(hello: bytes) -> tuple[int, int, bytes, bytes]:
    """A hello's rank, world, client nonce and proof."""
    at = len(_MAGIC)
    rank, world = (int.from_bytes(hello[i:i + 4], "little") for i in (at, at + 4))
    return rank, world, hello[at + 8:at + 8 + _NONCE], hello[at + 8 + _NONCE:]


def _transcript(server_nonce: bytes, rank: int, world: int, client_nonce: bytes) -> bytes:
    """What both proofs and the mask bind to: this connection alone (its nonces), this rank and world."""
    return _MAGIC + server_nonce + _words(rank, world) + client_nonce


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of `parts` under `key`; `label` keeps a rank's proof, rank 0's and the mask's
    key from ever being one another."""
    return hmac.new(key, label + b"".join(parts), hashlib.sha256).digest()


def _mask(secret: bytes, transcript: bytes, data: bytes) -> bytes:
    """`data` XOR a keystream of HMAC-SHA256 in counter mode under a key of this connection's own
    (so no two connections share a keystream): its own inverse."""
    key = _mac(secret, b"K", transcript)
    stream = b"".join(_mac(key, b"", block.to_bytes(4, "little")) for block in range(-(-len(data) // _MAC)))
    return bytes(a ^ b for a, b in zip(data, stream))


def _send(conn: socket.socket, data: bytes, until: float) -> None:
    conn.settimeout(max(until - time.monotonic(), 0.001))
    conn.sendall(data)


def _read(conn: socket.socket, n: int, until: float) -> bytes:
    """`n` bytes by `until` (TimeoutError): a peer that trickles them in gets no more time than a silent one."""
    out = b""
    while len(out) < n:
        left = until - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{len(out)} of {n} bytes came in time")
        conn.settimeout(left)
        chunk = conn.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"the connection closed after {len(out)} of {n} bytes")
        out += chunk
    return out

"""Where a rank stands (Ranks, from a launcher's environment) and how the ranks agree on one
communicator id: rank 0 makes it and hands it to the others over TCP (exchange_id), or the
engine passes it by its own means (a torch.distributed broadcast, a file, an MPI bcast).

The exchange is the only host traffic between ranks: the rounds themselves move everything on
the device. Every step of it is bounded by a timeout, so a rank that never comes makes the
others raise rather than wait.

The id is what NCCL's bootstrap trusts: whoever holds it can try to join the communicator. So
rank 0 serves it only to a connection that proves it holds the launch's secret (Ranks.secret,
MEMRA_NCCL_SECRET), and only once a rank; every connection has a short budget of its own, so a
silent port scanner or a health check never holds up the ranks. Each connection, in turn:

    rank 0 -> MAGIC, server nonce
    rank r -> MAGIC, r, world, client nonce, HMAC(secret, "C" | transcript)
    rank 0 -> status; if "+": the id XOR a keystream of HMAC(secret, "K" | transcript),
              HMAC(secret, "S" | transcript | masked id)
    rank r -> ACK, and only then does rank 0 count r as served

where the transcript is MAGIC, both nonces, r and world. Rank r's proof is fresh to this
connection (rank 0's nonce), so an eavesdropper cannot replay it; rank 0's tag proves it holds
the secret too and that the masked id came unaltered; the mask keeps the id from an eavesdropper.
Without a secret (an empty one), only a loopback address is allowed: the same handshake runs,
and proves nothing beyond "a process of this host".
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..driver.errors import MemraError
from .library import UNIQUE_ID_BYTES

log = logging.getLogger(__name__)

SECRET_VARIABLE = "MEMRA_NCCL_SECRET"
HELLO_BUDGET = 2.0  # seconds a connection has for its whole handshake: a silent one is dropped then, and alone

_MAGIC = b"memra-nccl-id/2\n"  # the protocol and its version: what is not a rank of ours is told apart at once
_NONCE = 32
_MAC = 32  # HMAC-SHA256
_HELLO = len(_MAGIC) + 4 + 4 + _NONCE + _MAC  # magic, rank, world, client nonce, proof
_HANDSHAKES = 256  # connections rank 0 handshakes with at once; more wait in the listen backlog
_OK, _ACK = b"+", b"!"  # rank 0's answer to a proven rank it serves, and the rank's once it holds the id
_AGAIN = b"a"  # another connection of this rank is mid-handshake: come again
_WRONG_SECRET, _NOT_OF_WORLD, _SERVED = b"p", b"w", b"s"  # rank 0's answers to a claim it will never serve
_REFUSALS = {  # and what the refused rank is told
    _WRONG_SECRET: "it did not prove {variable}: its secret is not rank 0's (every rank of a launch has the same one)",
    _NOT_OF_WORLD: "rank {rank} of a world of {world} is not one of rank 0's ranks",
    _SERVED: "rank 0 served rank {rank} already: two processes claim it",
}


class RankRefused(MemraError, PermissionError):
    """Rank 0 refused this rank for good (a secret that is not rank 0's, a rank outside its world,
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
        if not (0 <= self.rank < self.world and self.local_rank >= 0 and 0 < self.port < 65536):
            raise ValueError(f"a rank is 0 <= rank < world with local_rank >= 0 and a port in 1..65535, not "
                             f"rank={self.rank}, world={self.world}, local_rank={self.local_rank}, port={self.port}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Ranks:
        """torchrun's variables: RANK, WORLD_SIZE, LOCAL_RANK (default 0), MASTER_ADDR (default
        127.0.0.1); the exchange's port is MEMRA_NCCL_PORT, else MASTER_PORT + 1 (default 29500
        + 1): torchrun's own store listens on MASTER_PORT. Its secret is MEMRA_NCCL_SECRET (none
        by default: then only a loopback MASTER_ADDR is served)."""
        environ = os.environ if environ is None else environ
        missing = [name for name in ("RANK", "WORLD_SIZE") if name not in environ]
        if missing:
            raise ValueError(f"a rank's environment names {' and '.join(missing)} (as torchrun sets them)")
        try:
            numbers = {name: int(environ.get(name, default)) for name, default in
                       (("RANK", ""), ("WORLD_SIZE", ""), ("LOCAL_RANK", "0"), ("MASTER_PORT", "29500"))}
            port = int(environ["MEMRA_NCCL_PORT"]) if "MEMRA_NCCL_PORT" in environ else numbers["MASTER_PORT"] + 1
        except ValueError as exc:
            raise ValueError(f"RANK, WORLD_SIZE, LOCAL_RANK, MASTER_PORT and MEMRA_NCCL_PORT are integers: "
                             f"{exc}") from None
        return cls(numbers["RANK"], numbers["WORLD_SIZE"], numbers["LOCAL_RANK"],
                   environ.get("MASTER_ADDR", "127.0.0.1"), port, environ.get(SECRET_VARIABLE, ""))


def exchange_id(ranks: Ranks, make_id: Callable[[], bytes], timeout: float = 60.0, *,
                hello_budget: float = HELLO_BUDGET) -> bytes:
    """The communicator's id on every rank: rank 0 calls `make_id` (Nccl.unique_id) and serves
    the id to the world - 1 others at (address, port), each of which connects, retrying until
    `timeout` seconds have passed. TimeoutError, naming who was waited for, past the timeout;
    RankRefused where rank 0 refuses a rank for good; ValueError, before anything else, where
    there is no secret and the address is not a loopback one. Each connection has `hello_budget`
    seconds for its handshake."""
    if not ranks.secret and not _loopback(ranks.address):
        raise ValueError(f"the id exchange at {ranks.address}:{ranks.port} is reachable beyond this host, and the "
                         f"rank has no secret to prove: set {SECRET_VARIABLE} to one random value on every rank of "
                         f"the launch (for instance {SECRET_VARIABLE}=$(python -c 'import secrets; "
                         f"print(secrets.token_hex(32))'), made once and given to each), or pass Ranks(secret=...)")
    deadline = time.monotonic() + timeout
    if ranks.rank == 0:
        unique_id = make_id()
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"a communicator id is {UNIQUE_ID_BYTES} bytes, not {len(unique_id)}")
        if not ranks.secret:
            log.warning("the id exchange at %s:%d has no %s: any process of this host can fetch the id",
                        ranks.address, ranks.port, SECRET_VARIABLE)
        _Server(ranks, unique_id, hello_budget).serve(deadline)
        return unique_id
    return _fetch(ranks, deadline, hello_budget)


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
        self.lock = threading.Lock()
        self.served: set[int] = set()
        self.claimed: set[int] = set()  # proven, the id on its way to it
        self.open: set[socket.socket] = set()
        self.slots = threading.BoundedSemaphore(_HANDSHAKES)
        self.over = False

    def serve(self, deadline: float) -> None:
        threads: list[threading.Thread] = []
        with socket.create_server((self.ranks.address, self.ranks.port), reuse_port=False) as server:
            try:
                while self.waiting():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"rank 0 waited for ranks {self.waiting()} at {self.ranks.address}:"
                                           f"{self.ranks.port}, none came")
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

    def waiting(self) -> list[int]:
        with self.lock:
            return sorted(set(range(1, self.ranks.world)) - self.served)

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
        who, claimed, until = f"{peer[0]}:{peer[1]}", False, time.monotonic() + self.budget
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
                _send(conn, _WRONG_SECRET, until)
                return
            refusal = self.claim(rank, world)
            if refusal == _AGAIN:
                log.info("the id exchange told %s, claiming rank %d, to come again: another connection of that "
                         "rank is mid-handshake", who, rank)
            elif refusal:
                log.warning("the id exchange refused %s: %s", who, _REFUSALS[refusal].format(
                    variable=SECRET_VARIABLE, rank=rank, world=world))
            if refusal:
                _send(conn, refusal, until)
                return
            claimed = True
            masked = _mask(self.secret, transcript, self.unique_id)
            _send(conn, _OK + masked + _mac(self.secret, b"S", transcript, masked), until)
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


def _fetch(ranks: Ranks, deadline: float, budget: float) -> bytes:
    """Ask rank 0 until `deadline`, each attempt at most `budget` seconds; RankRefused at once."""
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            return _ask(ranks, min(deadline, time.monotonic() + budget))
        except RankRefused:
            raise
        except OSError as exc:  # ConnectionError and TimeoutError too: rank 0 not there yet, or someone else is
            last = exc
            time.sleep(0.05)
    raise TimeoutError(f"rank {ranks.rank} found no rank 0 at {ranks.address}:{ranks.port} ({last})")


def _ask(ranks: Ranks, until: float) -> bytes:
    secret = ranks.secret.encode()
    where = f"{ranks.address}:{ranks.port}"
    with socket.create_connection((ranks.address, ranks.port), timeout=max(until - time.monotonic(), 0.01)) as conn:
        greeting = _read(conn, len(_MAGIC) + _NONCE, until)
        if not greeting.startswith(_MAGIC):
            raise ConnectionError(f"what listens at {where} does not speak the id exchange")
        client_nonce = secrets.token_bytes(_NONCE)
        transcript = _transcript(greeting[len(_MAGIC):], ranks.rank, ranks.world, client_nonce)
        _send(conn, _MAGIC + _words(ranks.rank, ranks.world) + client_nonce + _mac(secret, b"C", transcript), until)
        status = _read(conn, 1, until)
        if status in _REFUSALS:
            raise RankRefused(f"rank 0 at {where} refused rank {ranks.rank}: " + _REFUSALS[status].format(
                variable=SECRET_VARIABLE, rank=ranks.rank, world=ranks.world))
        if status != _OK:
            raise ConnectionError(f"rank 0 at {where} is handshaking with another connection of rank {ranks.rank}"
                                  if status == _AGAIN else f"what listens at {where} answered {status!r}")
        reply = _read(conn, UNIQUE_ID_BYTES + _MAC, until)
        masked, tag = reply[:UNIQUE_ID_BYTES], reply[UNIQUE_ID_BYTES:]
        if not hmac.compare_digest(tag, _mac(secret, b"S", transcript, masked)):
            raise ConnectionError(f"what listens at {where} did not prove {SECRET_VARIABLE}: not this launch's rank 0")
        _send(conn, _ACK, until)
        return _mask(secret, transcript, masked)


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

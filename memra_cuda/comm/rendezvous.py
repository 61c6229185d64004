"""Where a rank stands (Ranks, from a launcher's environment) and how the ranks agree on one
communicator id: rank 0 makes it and hands it to the others over TCP (exchange_id), or the
engine passes it by its own means (a torch.distributed broadcast, a file, an MPI bcast).

The exchange is the only host traffic between ranks: the rounds themselves move everything on
the device. Every step of it is bounded by a timeout, so a rank that never comes makes the
others raise rather than wait.
"""
from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .library import UNIQUE_ID_BYTES

_HELLO = b"memra-nccl-id\n"  # what a joining rank sends first, so a stray connection is turned away


@dataclass(frozen=True)
class Ranks:
    """This process's rank among `world`, the GPU it drives (`local_rank`, its device ordinal on
    this host), and where rank 0 listens for the id exchange."""

    rank: int
    world: int
    local_rank: int = 0
    address: str = "127.0.0.1"
    port: int = 29501  # MASTER_PORT's default + 1 (torchrun's store holds MASTER_PORT)

    def __post_init__(self) -> None:
        if not (0 <= self.rank < self.world and self.local_rank >= 0 and 0 < self.port < 65536):
            raise ValueError(f"a rank is 0 <= rank < world with local_rank >= 0 and a port in 1..65535, not "
                             f"rank={self.rank}, world={self.world}, local_rank={self.local_rank}, port={self.port}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Ranks:
        """torchrun's variables: RANK, WORLD_SIZE, LOCAL_RANK (default 0), MASTER_ADDR (default
        127.0.0.1); the exchange's port is MEMRA_NCCL_PORT, else MASTER_PORT + 1 (default 29500
        + 1): torchrun's own store listens on MASTER_PORT."""
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
                   environ.get("MASTER_ADDR", "127.0.0.1"), port)


def exchange_id(ranks: Ranks, make_id: Callable[[], bytes], timeout: float = 60.0) -> bytes:
    """The communicator's id on every rank: rank 0 calls `make_id` (Nccl.unique_id) and serves
    the id to the world - 1 others at (address, port), each of which connects, retrying until
    `timeout` seconds have passed. TimeoutError, naming who was waited for, past the timeout."""
    deadline = time.monotonic() + timeout
    if ranks.rank == 0:
        unique_id = make_id()
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"a communicator id is {UNIQUE_ID_BYTES} bytes, not {len(unique_id)}")
        _serve(ranks, unique_id, deadline)
        return unique_id
    return _fetch(ranks, deadline)


def _serve(ranks: Ranks, unique_id: bytes, deadline: float) -> None:
    with socket.create_server((ranks.address, ranks.port), reuse_port=False) as server:
        served: set[int] = set()
        while len(served) < ranks.world - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                waiting = sorted(set(range(1, ranks.world)) - served)
                raise TimeoutError(f"rank 0 waited for ranks {waiting} at {ranks.address}:{ranks.port}, none came")
            server.settimeout(left)
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(max(deadline - time.monotonic(), 0.1))
                try:
                    hello = _read(conn, len(_HELLO) + 4)
                except (OSError, ConnectionError):
                    continue
                rank = int.from_bytes(hello[len(_HELLO):], "little")
                if hello[:len(_HELLO)] != _HELLO or not 0 < rank < ranks.world:
                    continue  # not one of ours
                try:
                    conn.sendall(unique_id)
                except OSError:
                    continue  # it went away: it will come again, or the timeout says who is missing
                served.add(rank)


def _fetch(ranks: Ranks, deadline: float) -> bytes:
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((ranks.address, ranks.port), timeout=1.0) as conn:
                conn.settimeout(max(deadline - time.monotonic(), 0.1))
                conn.sendall(_HELLO + ranks.rank.to_bytes(4, "little"))
                return _read(conn, UNIQUE_ID_BYTES)
        except (OSError, ConnectionError) as exc:
            last = exc
            time.sleep(0.05)
    raise TimeoutError(f"rank {ranks.rank} found no rank 0 at {ranks.address}:{ranks.port} ({last})")


def _read(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"the connection closed after {len(out)} of {n} bytes")
        out += chunk
    return out

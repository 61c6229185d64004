"""Ranks started from one process as torchrun would start them: what the tests and the bench
use to run a command over several GPUs of this host, one process a GPU."""
from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Ended:
    """How one rank's process ended: its exit status (None: killed at the timeout) and output."""

    rank: int
    returncode: int | None
    stdout: str
    stderr: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: Sequence[str], world: int, env: Mapping[str, str] | None = None, timeout: float = 300.0
           ) -> list[Ended]:
    """Run `argv` as `world` ranks on this host (RANK, WORLD_SIZE, LOCAL_RANK = RANK, MASTER_ADDR
    127.0.0.1, a free MASTER_PORT and the id exchange's port after it, NVLink multicast off
    unless `env` says otherwise) and wait for all of them, at most `timeout` seconds: past it,
    every rank still running is killed. Output goes to files, so no rank stalls on a full pipe."""
    port = free_port()
    base = {**os.environ, "NCCL_NVLS_ENABLE": "0", **(env or {}), "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    with tempfile.TemporaryDirectory(prefix="memra-ranks-") as folder:
        files, procs = [], []
        for rank in range(world):
            out = open(os.path.join(folder, f"{rank}.out"), "w+")
            err = open(os.path.join(folder, f"{rank}.err"), "w+")
            files.append((out, err))
            procs.append(subprocess.Popen(list(argv), stdout=out, stderr=err, text=True,
                                          env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                break
        ended = []
        for rank, (proc, (out, err)) in enumerate(zip(procs, files)):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                code = None
            else:
                code = proc.returncode
            out.seek(0)
            err.seek(0)
            ended.append(Ended(rank, code, out.read(), err.read()))
            out.close()
            err.close()
        return ended

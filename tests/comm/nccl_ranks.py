"""One rank of tests/comm/test_comm_gpu.py's two-process runs (launched as torchrun would, RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in its environment): `python nccl_ranks.py
JOB`, printing one JSON line of what it saw. Jobs: "ops" (an all-reduce, a broadcast and a
ring of sends, eagerly and replayed from one captured graph), "die" (rank 1 leaves after
joining; rank 0's all-reduce must end in RankFailure within its timeout), "tp" and "stages"
(the toy over tensor-parallel ranks or pipeline stages, models/ranks.py, in every case of CASES:
its tokens, burst by burst in graph mode, and the toy's on this GPU alone),
"diverge" (rank 1 reports other tokens than it committed: every rank must raise RanksDiverged).
Every wait, joining included, is bounded by MEMRA_TEST_TIMEOUT seconds (default 30)."""
from __future__ import annotations

import functools
import json
import os
import sys
import time

import numpy as np
import pytest

from memra_cuda import Geometry
from memra_cuda import Engine, Graph, StreamBufs
from memra_cuda.comm import Communicator
from memra_cuda.testing.toy.ranks import ToyPipelineStage, ToyTensorParallel
from memra_cuda.testing.toy.lm import ToyLM, ToyModel, ToySampling

MODEL = ToyModel(kv_mask=(True, True, False, True, True))  # five layers: shards of 3 and 2
K, M, CAPACITY, TOKENS = 4, 8, 512, 100


def unmet(reason: str) -> None:
    """A two-rank test's missing need (NCCL, a second GPU): skipped with the reason, or failed
    under MEMRA_REQUIRE_RANKS=1, where a run that must cover the ranks cannot pass without them."""
    if os.environ.get("MEMRA_REQUIRE_RANKS"):
        pytest.fail(f"MEMRA_REQUIRE_RANKS is set, but this {reason}")
    pytest.skip(reason)


def need_nccl():
    """The NCCL a rank loads (Nccl), else unmet."""
    from memra_cuda.comm import NcclUnavailable, nccl
    try:
        return nccl()
    except NcclUnavailable as exc:
        unmet(f"needs NCCL: {exc}")


def two_gpus() -> None:
    from memra_cuda.driver.errors import call
    if call("cuDeviceGetCount") < 2:
        unmet("needs two GPUs (the nvidia-h200-x2 kind)")


def ops(comm: Communicator, engine: Engine) -> dict:
    rank, world = comm.rank, comm.world
    mine = engine.htod(np.arange(16, dtype=np.float32) + 100 * rank)
    total, bcast, ring = (engine.zeros(np.float32, 16) for _ in range(3))
    after = (rank - 1) % world

    def issue() -> None:
        comm.all_reduce(mine, total)
        comm.broadcast(mine, root=1, out=bcast)
        with comm.group():
            comm.send(mine, (rank + 1) % world)
            comm.recv(ring, after)

    issue()
    eager = [engine.dtoh(b).tolist() for b in (total, bcast, ring)]
    for b in (total, bcast, ring):
        engine.memset(b, 0)
    graph = Graph(engine, issue)
    for _ in range(3):
        graph.launch()
    replayed = [engine.dtoh(b).tolist() for b in (total, bcast, ring)]
    return dict(eager=eager, replayed=replayed, ring_from=after)


def die(comm: Communicator, engine: Engine) -> dict:
    if comm.rank == 1:
        os._exit(0)  # gone without a word, its NCCL connections with it
    buf = engine.htod(np.ones(1 << 20, np.float32))
    start = time.monotonic()
    try:
        comm.all_reduce(buf)
        engine.synchronize()
        return dict(raised=None, seconds=time.monotonic() - start)
    except Exception as exc:  # RankFailure, or the failed call that found the peer gone; else named
        return dict(raised=f"{type(exc).__name__}: {exc}", seconds=time.monotonic() - start)


def prompts(batch: int) -> list[list[int]]:
    return [[1 + row, 7, 3 * row + 2][:1 + row % 3] for row in range(batch)]


def one_gpu(engine: Engine, batch: int, sampling: ToySampling | None) -> list[list[int]]:
    """The same requests through the whole toy on this GPU alone."""
    lm, bufs = ToyLM(engine, MODEL, CAPACITY, batch=batch, sampling=sampling), StreamBufs(engine, Geometry(K, M, batch))
    for row, prompt in enumerate(prompts(batch)):
        lm.prefill_row(bufs, row, prompt, seed=10 + row)
    return [row.tolist() for row in lm.round_stream(bufs).generate_batch(TOKENS, mode="graph")]


CASES = [(mode, batch, sampled) for mode in ("graph", "overlap") for batch in (1, 8) for sampled in (False, True)]


def ranks_job(kind: type, comm: Communicator, engine: Engine) -> dict:
    """Every case of CASES over one communicator (a pair of processes for all of them): each
    case's tokens, its bursts' tokens in graph mode, and the toy's on this GPU alone."""
    cases = {}
    for mode, batch, sampled in CASES:
        sampling = ToySampling() if sampled else None
        ranks = kind(comm, MODEL, CAPACITY, Geometry(K, M, batch), sampling=sampling)
        for row, prompt in enumerate(prompts(batch)):
            ranks.prefill_row(row, prompt, seed=10 + row)
        rounds = ranks.round_stream()
        bursts: list[list[list[int]]] = []
        if mode == "graph":  # burst by burst, to compare every burst's tokens across the ranks
            ranks.bufs.set_stop(budget=TOKENS)
            tokens: list[list[int]] = [[] for _ in range(batch)]
            while not ranks.bufs.done.all():
                readback = rounds.step("graph")
                bursts.append([row.tolist() for row in readback.tokens])
                for row, got in zip(tokens, readback.tokens):
                    row += got.tolist()
        else:
            tokens = [row.tolist() for row in rounds.generate_batch(TOKENS, mode=mode)]
        ranks.agree(tokens)
        cases[f"{mode}-B{batch}-{'sampling' if sampled else 'greedy'}"] = dict(
            layers=[ranks.layers.start, ranks.layers.stop], tokens=tokens, bursts=bursts,
            alone=one_gpu(engine, batch, sampling))
    return dict(cases=cases)


def diverge(comm: Communicator, engine: Engine) -> dict:
    """Both ranks generate alike; rank 1 then reports one token other than it committed."""
    ranks = ToyTensorParallel(comm, MODEL, CAPACITY, Geometry(K, M))
    ranks.prefill_row(0, prompts(1)[0])
    tokens = [row.tolist() for row in ranks.round_stream().generate_batch(TOKENS, mode="graph")]
    if comm.rank == 1:
        tokens[0][-1] += 1
    try:
        ranks.agree(tokens)
        return dict(raised=None)
    except Exception as exc:  # RanksDiverged wanted; anything else named
        return dict(raised=f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    job = sys.argv[1]
    timeout = float(os.environ.get("MEMRA_TEST_TIMEOUT", "30"))
    comm = Communicator.from_env(timeout=timeout)  # on a new Engine of device LOCAL_RANK
    engine = comm.engine
    jobs = {"ops": ops, "die": die, "diverge": diverge, "tp": functools.partial(ranks_job, ToyTensorParallel),
            "stages": functools.partial(ranks_job, ToyPipelineStage)}
    print(json.dumps(dict(rank=comm.rank, **jobs[job](comm, engine))), flush=True)
    if job != "die":
        comm.free()

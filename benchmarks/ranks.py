"""`make bench`'s part 5 over NCCL: one rank of the toy split over two processes, one a GPU
(models/ranks.py), started by bench.bench_pipeline as torchrun would start it.

    python -m memra_cuda.bench_ranks TOKENS K M      (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)

Pipeline stages and tensor-parallel ranks, bare and as 8B/0.5B (the verify's weights split
between the ranks, the draft's whole on each, since each runs it): microseconds a round in graph
mode, rank 0's printed as one JSON line of rows.
"""
from __future__ import annotations

import json
import sys

from .common import MODEL, PROMPT, us_per_round
from memra_cuda.buffers.capacity import kv_capacity
from memra_cuda.comm import Communicator
from memra_cuda.testing.toy.ranks import ToyPipelineStage, ToyTensorParallel
from memra_cuda.testing.toy.lm import COST_8B_05B, ToyCost


def main(argv: list[str]) -> int:
    tokens, k, m_rounds = (int(x) for x in argv)
    comm = Communicator.from_env(timeout=60)
    capacity = kv_capacity(len(PROMPT), tokens, k, m_rounds)
    rows = []
    for name, cost in (("bare", ToyCost()), ("8B/0.5B", COST_8B_05B)):
        share = ToyCost(verify_bytes=cost.verify_bytes // comm.world, draft_bytes=cost.draft_bytes)
        for kind, label in ((ToyPipelineStage, "pipeline stages"), (ToyTensorParallel, "tensor-parallel")):
            ranks = kind(comm, MODEL, capacity, k, m_rounds, cost=share)
            us = us_per_round(comm.engine, ranks.round_stream(), lambda: ranks.prefill_row(0, PROMPT), tokens,
                              "graph")
            rows.append(dict(model=name, kind=label, us_per_round=us))
            ranks.bufs.free()
    if comm.rank == 0:
        print(json.dumps(rows), flush=True)
    comm.free()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

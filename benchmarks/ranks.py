"""`make bench`'s part 5 over NCCL: one rank of the toy split over two processes, one a GPU
(memra_cuda.testing.toy.ranks), started by benchmarks/bench.py (bench_pipeline) as torchrun would start it.

    python -m benchmarks.ranks TOKENS K M      (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)

Pipeline stages and tensor-parallel ranks, bare and as 8B/0.5B (the verify's weights split
between the ranks, the draft's whole on each, since each runs it): microseconds a round in graph
mode, rank 0's printed as one JSON line of rows.
"""
from __future__ import annotations

import argparse
import json
import sys

from memra_cuda import Geometry, MemraError
from memra_cuda.buffers.capacity import kv_capacity
from memra_cuda.comm import Communicator
from memra_cuda.driver.values import as_size
from memra_cuda.testing.toy.lm import COST_8B_05B, ToyCost
from memra_cuda.testing.toy.ranks import ToyPipelineStage, ToyRank, ToyTensorParallel

from .common import MODEL, PROMPT, us_per_round
from .needs import refuse


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(prog="python -m benchmarks.ranks", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("tokens", type=int, help="tokens each generation makes")
    cli.add_argument("k", type=int, help="draft tokens per round")
    cli.add_argument("m_rounds", type=int, metavar="M", help="rounds per burst")
    args = cli.parse_args(argv)
    # the parser's errors, before the rank joins its peers (each was a traceback, TOKENS < 1 none till the rounds)
    try:
        as_size(args.tokens, "TOKENS", 1)
    except ValueError as exc:
        cli.error(str(exc))
    try:
        geometry = Geometry(args.k, args.m_rounds)
    except ValueError as exc:  # its errors name k and m_rounds: the arguments are K and M
        cli.error(f"K {args.k} M {args.m_rounds}: {exc}")
    capacity = kv_capacity(len(PROMPT), args.tokens, geometry)
    try:
        comm = Communicator.from_env(timeout=60)
    except (ValueError, MemraError) as exc:  # no launcher's environment, no GPU, no NCCL: one line, no traceback
        refuse("benchmarks.ranks", str(exc))
    kinds: tuple[tuple[type[ToyRank], str], ...] = ((ToyPipelineStage, "pipeline stages"),
                                                    (ToyTensorParallel, "tensor-parallel"))
    rows = []
    for name, cost in (("bare", ToyCost()), ("8B/0.5B", COST_8B_05B)):
        share = ToyCost(verify_bytes=cost.verify_bytes // comm.world, draft_bytes=cost.draft_bytes)
        for kind, label in kinds:
            ranks = kind(comm, MODEL, capacity, geometry, cost=share)
            us = us_per_round(comm.engine, ranks.round_stream(), lambda: ranks.prefill_row(0, PROMPT), args.tokens,
                              "graph")
            rows.append(dict(model=name, kind=label, us_per_round=us))
            ranks.bufs.free()
    if comm.rank == 0:
        print(json.dumps(rows), flush=True)
    comm.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())

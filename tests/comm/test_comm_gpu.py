"""Communicators on the GPU (docs/nccl.md): one rank on one GPU (an all-reduce, a broadcast and
a send to itself, eager and captured in a graph that holds the communicator; an abort, after
which every wait raises RankFailure), and two ranks in two processes on two GPUs, as torchrun
starts them: the operations equal numpy's, eagerly and replayed from a graph, over NVLink and
with NCCL forced onto its network transport; a rank that leaves makes the other raise within
its timeout. The toy over tensor-parallel ranks or pipeline stages (models/ranks.py) commits the
toy's own tokens: one rank on one GPU, and two ranks in two processes, greedy and sampled, B 1
and 8, graph (every burst the same on both) and overlap modes, over NVLink and the network
transport; ranks that generate differently raise on both. Skipped with the reason where NCCL
(the `nccl` extra) or a second GPU is missing."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from memra_cuda import Geometry
from memra_cuda import Graph
from memra_cuda.comm import Communicator, RankFailure
from memra_cuda.comm.launch import launch
from nccl_ranks import CASES, need_nccl, prompts, two_gpus

pytestmark = pytest.mark.gpu
HERE = Path(__file__).resolve().parent
NETWORK = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}  # one host standing in for two


@pytest.fixture(scope="module")
def lib(engine):
    return need_nccl()


@pytest.fixture
def one(engine, lib):
    comm = Communicator(engine, 0, 1, lib.unique_id(), timeout=20)
    yield comm
    comm.free()


def test_one_rank_reduces_broadcasts_and_sends_to_itself(engine, one):
    values = np.arange(32, dtype=np.float32) - 7
    buf, out, back = engine.htod(values), engine.zeros(np.float32, 32), engine.zeros(np.float32, 32)
    one.all_reduce(buf, out, op="max")
    one.broadcast(buf, root=0)
    with one.group():
        one.send(buf, 0)
        one.recv(back, 0)
    assert engine.dtoh(out).tolist() == values.tolist()
    assert engine.dtoh(back).tolist() == values.tolist()


def test_a_captured_operation_replays_and_its_graph_refuses_once_the_communicator_is_freed(engine, one):
    buf, out = engine.htod(np.arange(8, dtype=np.int64)), engine.zeros(np.int64, 8)
    graph = Graph(engine, lambda: one.all_reduce(buf, out))
    graph.launch()
    assert engine.dtoh(out).tolist() == list(range(8))
    one.free()  # frees the graph first: NCCL releases a communicator only once its graphs are gone
    with pytest.raises(ValueError, match="after free"):
        graph.launch()


def test_an_aborted_communicator_makes_every_wait_and_operation_raise(engine, one):
    buf = engine.zeros(np.float32, 4)
    one.abort("the test ends it")
    with pytest.raises(RankFailure, match="the test ends it"):
        engine.synchronize()
    with pytest.raises(RankFailure):
        one.all_reduce(buf)
    one.free()
    engine.synchronize()  # the guard left with the communicator


def test_a_communicator_refuses_what_it_cannot_queue(engine, one):
    other = np.zeros(4, np.float32)
    with pytest.raises(TypeError, match="DeviceBuffer"):
        one.all_reduce(other)
    with pytest.raises(ValueError, match="differ"):
        one.all_reduce(engine.zeros(np.float32, 4), engine.zeros(np.float32, 5))
    with pytest.raises(ValueError, match="peer must be a rank of 0..0"):
        one.send(engine.zeros(np.float32, 4), 1)
    with pytest.raises(ValueError, match="NCCL reduces"):
        one.all_reduce(engine.zeros(np.int16, 4))
    with pytest.raises(ValueError, match="4-byte elements: they cannot be reduced as float64"):
        one.all_reduce(engine.zeros(np.float32, 4), dtype="float64")
    with pytest.raises(ValueError, match="128 bytes"):
        Communicator(one.engine, 0, 1, b"short")


def test_an_operation_refused_leaves_no_watch_on_another_engine(engine, lib):
    """An operation prepared on another engine joins the communicator's guard to that engine's
    host waits; a prepare refused (its buffer, a freed communicator) attached the guard all the
    same, for good: after the communicator was freed, every later synchronize of that engine
    raised RankFailure from its release. The guard joins once an operation is prepared."""
    from memra_cuda import Engine
    comm = Communicator(engine, 0, 1, lib.unique_id(), timeout=20)
    other = Engine(engine.device)
    try:
        with pytest.raises(TypeError, match="DeviceBuffer"):
            comm.all_reduce(np.zeros(4, np.float32), engine=other)
        assert other.guards == [], "a refused prepare watched the engine"
        buf = other.zeros(np.float32, 4)
        comm.prepare_all_reduce(buf, engine=other)
        assert len(other.guards) == 1
        comm.free()
        assert other.guards == [], "the freed communicator's guard stayed"
        with pytest.raises(ValueError, match="after free"):
            comm.prepare_all_reduce(buf, engine=other)
        assert other.guards == []
        other.synchronize()
    finally:
        comm.free()
        other.close()


# -- two processes ---------------------------------------------------------------------------------

def run_ranks(job: str, extra: dict[str, str] | None = None, timeout: float = 120) -> list[dict]:
    """Each rank's JSON line from tests/comm/nccl_ranks.py JOB over two GPUs and its exit status (rc:
    None where killed at the timeout), or, with no JSON, its status and the end of its output
    (NCCL's warnings, NCCL_DEBUG=WARN unless set, go to stdout)."""
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])),
           "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"), **(extra or {})}
    out = []
    for ended in launch([sys.executable, str(HERE / "nccl_ranks.py"), job], 2, env, timeout):
        lines = [line for line in ended.stdout.splitlines() if line.startswith("{")]
        seen = json.loads(lines[-1]) if lines else dict(stdout=ended.stdout[-2000:], stderr=ended.stderr[-2000:])
        out.append(dict(seen, rc=ended.returncode))
    return out


@pytest.mark.parametrize("transport", [{}, NETWORK], ids=["default", "network"])
def test_two_ranks_reduce_broadcast_and_pass_a_ring_eagerly_and_from_a_graph(lib, transport):
    two_gpus()
    ranks = run_ranks("ops", transport)
    values = [np.arange(16, dtype=np.float32) + 100 * r for r in range(2)]
    for rank, seen in enumerate(ranks):
        assert seen.get("rank") == rank and seen["rc"] == 0, seen
        want = [(values[0] + values[1]).tolist(), values[1].tolist(), values[seen["ring_from"]].tolist()]
        assert seen["eager"] == want and seen["replayed"] == want


@pytest.mark.parametrize("transport", [{}, NETWORK], ids=["default", "network"])
def test_a_rank_that_leaves_makes_the_other_raise_within_its_timeout(lib, transport):
    two_gpus()
    start = time.monotonic()
    rank0 = run_ranks("die", {**transport, "MEMRA_TEST_TIMEOUT": "10"})[0]
    assert rank0.get("raised") and "rank 0" in rank0["raised"], rank0
    assert rank0["seconds"] < 30 and time.monotonic() - start < 90


# -- the toy over tensor-parallel ranks ------------------------------------------------------------

@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampling"])
@pytest.mark.parametrize("mode", ["graph", "overlap"])
@pytest.mark.parametrize("kind", ["ToyTensorParallel", "ToyPipelineStage"])
def test_one_rank_of_the_toy_equals_the_toy(engine, lib, kind, mode, sampled):
    """A communicator of one rank: the all-reduce (or the last stage's broadcast) inside the
    burst graph changes nothing, so the tokens are the whole toy's; device mode refuses the rank."""
    from memra_cuda import StreamBufs
    from memra_cuda.errors import LoopUnsupported
    from memra_cuda.testing.toy import ranks as toy_ranks
    from memra_cuda.testing.toy.lm import ToyLM, ToyModel, ToySampling
    model, sampling, batch = ToyModel(), ToySampling() if sampled else None, 3
    comm = Communicator(engine, 0, 1, lib.unique_id(), timeout=20)
    try:
        ranks = getattr(toy_ranks, kind)(comm, model, 256, Geometry(4, 8, batch), sampling=sampling)
        lm, bufs = ToyLM(engine, model, 256, batch=batch, sampling=sampling), StreamBufs(engine, Geometry(4, 8, batch))
        for row, prompt in enumerate(prompts(batch)):
            ranks.prefill_row(row, prompt, seed=row)
            lm.prefill_row(bufs, row, prompt, seed=row)
        got = [row.tolist() for row in ranks.round_stream().generate_batch(80, mode=mode)]
        want = [row.tolist() for row in lm.round_stream(bufs).generate_batch(80, mode="graph")]
        assert got == want
        ranks.agree(got)
        with pytest.raises(LoopUnsupported, match="communicator"):
            ranks.round_stream().generate_batch(8, mode="device")
    finally:
        comm.free()


@pytest.mark.parametrize("transport", [{}, NETWORK], ids=["default", "network"])
@pytest.mark.parametrize("kind", ["tp", "stages"], ids=["tensor-parallel", "pipeline"])
def test_two_ranks_commit_the_one_gpu_tokens(lib, kind, transport):
    """Tensor-parallel ranks and pipeline stages, greedy and sampled, B 1 and 8, graph and overlap
    modes (one pair of processes for all of them): every burst's tokens the same on both ranks
    (graph mode, burst by burst) and the whole generation the toy's on one GPU; the ranks' shards
    are layers 0..3 and 3..5."""
    two_gpus()
    ranks = run_ranks(kind, transport, timeout=300)
    for rank, seen in enumerate(ranks):
        assert seen.get("rank") == rank and seen["rc"] == 0, {key: v for key, v in seen.items() if key != "cases"}
        assert sorted(seen["cases"]) == sorted(f"{m}-B{b}-{'sampling' if s else 'greedy'}" for m, b, s in CASES)
    for case in ranks[0]["cases"]:
        mine, theirs = ranks[0]["cases"][case], ranks[1]["cases"][case]
        for rank, seen in enumerate((mine, theirs)):
            assert seen["tokens"] == seen["alone"], f"{case}, rank {rank}"
        assert [mine["layers"], theirs["layers"]] == [[0, 3], [3, 5]]
        assert mine["bursts"] == theirs["bursts"] and mine["tokens"] == theirs["tokens"], case
        assert (len(mine["bursts"]) > 1) == case.startswith("graph"), case


def test_a_rank_whose_tokens_differ_makes_every_rank_raise(lib):
    two_gpus()
    ranks = run_ranks("diverge", {"MEMRA_TEST_TIMEOUT": "10"})
    for rank, seen in enumerate(ranks):
        assert (seen.get("raised") or "").startswith("RanksDiverged: rank") and seen["rc"] == 0, f"rank {rank}: {seen}"

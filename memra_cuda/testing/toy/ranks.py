"""The toy over NCCL ranks, one process a GPU (docs/nccl.md): tensor-parallel ranks and
pipeline stages, the same rounds on every rank.

Every rank holds a contiguous share of the target's layers (`shard`) with their KV, the whole
draft (small: every rank runs it, at once, over the same committed tokens) and StreamBufs of its
own, and runs a RoundStream over them. One round, on each rank:

    draft chain ──▶ assemble ──▶ verify of this rank's layers (toy_verify's sums over them)
      tensor-parallel: all-reduce (sum) of every rank's sums
      pipeline stage: the earlier stages' sums received from the stage before, this stage's
        added, sent on to the next; the last stage's, the model's, broadcast back to every stage
    ──▶ the target's tokens (toy_finish) or its law (toy_probs) from the model's sums ──▶ accept,
    commit, rollback of this rank's layers and its draft

all inside the burst graph. Acceptance reads only what every rank holds alike: the drafts (the
same draft over the same tokens), the model's sums, the position-keyed draws of sampling. So
every rank commits the same tokens, reads the same positions back and takes the same host
decisions: the ranks keep in step with no word between their hosts, and no stage waits for the
others' control words, which each computes for itself. (Sending the verify's outcome back,
rather than acceptance's verdict, is what makes that so; for the toy it is one u32 a token.)

`agree` checks that the ranks did keep in step where a caller asks (after a generation, say): a
rank whose tokens differ makes every rank raise RanksDiverged; a rank that stops issuing rounds
makes the others' waits raise RankFailure (the communicator's watchdog).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ...buffers.geometry import Geometry
from ...buffers.stream_bufs import StreamBufs
from ...comm.communicator import digest
from ...driver.values import as_index, as_size
from ...kernels.spec import SpecKernels
from ...rounds.round import Step
from ...rounds.stream import RoundStream
from .lm import BLOCK, ToyCost, ToyLM, ToyModel, ToySampling, as_chain, as_toy_model

if TYPE_CHECKING:
    from ...comm.communicator import Communicator
    from ...driver.buffer import DeviceBuffer
    from ...driver.engine import Engine


def shard(layers: int, world: int, rank: int) -> range:
    """Rank `rank`'s contiguous share of `layers` layers among `world` ranks, the first
    layers % world ranks one layer more. Each checked as an int, naming it (as_size, as_index):
    rank=True was rank 1, and a float met "'float' object cannot be interpreted as an integer",
    naming none of them."""
    layers, world, rank = as_size(layers, "layers"), as_size(world, "world"), as_index(rank, "rank")
    if not 0 <= rank < world or layers < world:
        raise ValueError(f"{layers} layer(s) cannot give each of {world} ranks at least one (rank {rank})")
    base, extra = divmod(layers, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


class ToyRank:
    """This rank's part of the toy over `comm`'s ranks (on its engine's device): its shard of the
    target's layers, the whole draft, StreamBufs of chain rounds of `geometry` (a Geometry(k, M,
    batch): k drafts, M rounds a burst, B rows), greedy or with `sampling`. A kind of rank says
    how the ranks' verify sums become the model's (`_sums`)."""

    def __init__(self, comm: Communicator, model: ToyModel, capacity: int, geometry: Geometry,
                 cost: ToyCost = ToyCost(), sampling: ToySampling | None = None):
        geometry, model = as_chain(geometry), as_toy_model(model)
        if model.rec_layers:
            raise ValueError("the toy's ranks hold layers with KV or none: its recurrent layers run whole (ToyLM)")
        if geometry.k + 1 > BLOCK:
            raise ValueError(f"the toy verifies at most {BLOCK} tokens a round: k must be < {BLOCK}")
        self.comm = comm
        self.engine: Engine = comm.engine
        self.layers = shard(len(model.kv_mask), comm.world, comm.rank)
        self.lm = ToyLM(self.engine, model, capacity, cost, batch=geometry.batch, layers=self.layers,
                        sampling=sampling)
        self.bufs = StreamBufs(self.engine, geometry)
        self.spec = SpecKernels(self.engine)

    def prefill_row(self, row: int, prompt: Sequence[int], seed: int = 0) -> int:
        """This rank's caches and buffers for the request in slot `row` (every rank the same
        prompt and seed); its start position."""
        return self.lm.prefill_row(self.bufs, row, prompt, seed)

    def _sums(self) -> tuple[list[Step], DeviceBuffer]:
        """The steps of the verify of this rank's layers and the exchange after it, and the
        buffer where the model's sums ([B][k+1] u32) then are."""
        raise NotImplementedError

    def round_stream(self) -> RoundStream:
        """This rank's rounds (module docstring): graph and overlap modes (device mode refuses a
        rank of a communicator)."""
        return self.lm.round_stream(self.bufs, kernels=self.spec, sums=self._sums())

    def agree(self, tokens: Sequence[Sequence[int]]) -> None:
        """RanksDiverged on every rank unless every rank passes the same `tokens` (each row's
        committed tokens): their count and digest, all-reduced (Communicator.agree)."""
        self.comm.agree(digest(tokens), "the committed tokens")


class ToyTensorParallel(ToyRank):
    """A tensor-parallel rank: every rank's verify at once, over its layers, and the sums
    all-reduced."""

    def _sums(self) -> tuple[list[Step], DeviceBuffer]:
        sums_d = self.engine.zeros(np.uint32, self.bufs.batch * (self.bufs.k + 1), label="the verify's sums")
        return [*self.lm.verify_steps(self.bufs, None, partial_out=sums_d),
                self.comm.prepare_all_reduce(sums_d, op="sum")], sums_d  # this rank's, then all ranks


class ToyPipelineStage(ToyRank):
    """A pipeline stage (rank r holds the r-th shard): its verify waits for the stages before
    it, through the sums the one before sends, and sends its own on; the last stage's, the
    model's, are broadcast to every stage."""

    def _sums(self) -> tuple[list[Step], DeviceBuffer]:
        engine, comm, rows = self.engine, self.comm, self.bufs.batch * (self.bufs.k + 1)
        earlier_d = engine.zeros(np.uint32, rows, label="the earlier stages' verify sums") if comm.rank else None
        totals_d = engine.zeros(np.uint32, rows, label="the model's verify sums")
        receive = [] if earlier_d is None else [comm.prepare_recv(earlier_d, comm.rank - 1)]
        send = [comm.prepare_send(totals_d, comm.rank + 1)] if comm.rank + 1 < comm.world else []
        if receive or send:
            # Whatever NCCL sets up at a peer's first send or receive is done here, once, eagerly,
            # not inside the first burst's capture. The group's end is not timed (only the
            # synchronisation after it is a guarded wait): a neighbour that never comes hangs it.
            with comm.group():
                for step in receive + send:
                    step()
            engine.synchronize()
        verify = self.lm.verify_steps(self.bufs, None, partial_in=earlier_d, partial_out=totals_d)
        steps: list[Step] = [*receive, *verify, *send, comm.prepare_broadcast(totals_d, root=comm.world - 1)]
        return steps, totals_d

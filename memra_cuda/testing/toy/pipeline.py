"""The toy model as two pipeline stages on two engines (docs/pipeline.md, "Pipeline stages on several
GPUs").

Stage 0 holds the target layers [0, split) and the draft; stage 1 holds [split, L) and runs
accept and commit, so its StreamBufs are the ones read back. One round:

    stage 1 ──fork──▶ stage 0: draft chain, assemble, verify of its layers (partial sums)
    stage 0 ──peer copies of the drafts, the partial sums and the break marker──▶ stage 1:
        assemble, verify of its layers, accept, commit, rollback of its layers and pos_ctr
    stage 1 ──peer copies of ctl (keep, done), the pending token and brk──▶ stage 0:
        rollback of its layers, the draft's and its pos_ctr ──join──▶ stage 1

Each stage's rollback walks a range table of its own layers on its own device, so no kernel
dereferences another device's memory; events order the two streams without the host, and a
burst graph captured on stage 1's stream takes stage 0's work with it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ...buffers.acceptance import Greedy
from ...buffers.geometry import Geometry
from ...buffers.stream_bufs import StreamBufs
from ...driver.event import Event
from ...kernels.spec import SpecKernels
from ...rounds.round import Stages, chain
from ...rounds.stream import RoundStream
from ...buffers.tables import Cache, kv_len_ptr_table_range
from .lm import ToyCost, ToyLM, ToyModel, as_chain, as_toy_model

if TYPE_CHECKING:
    from ...driver.engine import Engine


class ToyPipeline:
    """The toy split at layer `split` over `engines` (two: stage 0 with the draft, stage 1 with
    accept and commit), each stage with its caches, StreamBufs of chain rounds of `geometry` (a
    Geometry(k, M, batch)) and kernels on its own device. `costs` are the stages' cost knobs
    (stage 0's draft bytes are the draft's)."""

    def __init__(self, engines: Sequence[Engine], model: ToyModel, capacity: int, split: int, geometry: Geometry,
                 costs: Sequence[ToyCost] = (ToyCost(), ToyCost())):
        geometry, model = as_chain(geometry), as_toy_model(model)
        if len(engines) != 2 or len(costs) != 2:
            raise ValueError(f"a toy pipeline has two stages: give two engines and two costs, not {len(engines)}")
        n_layers = len(model.kv_mask)
        if not 1 <= split < n_layers:
            raise ValueError(f"split must leave each stage at least one of the {n_layers} layers, not {split}")
        self.engines = tuple(engines)
        self.split = split
        batch = geometry.batch
        self.stages = [ToyLM(engines[0], model, capacity, costs[0], batch=batch, layers=range(0, split)),
                       ToyLM(engines[1], model, capacity, costs[1], batch=batch, layers=range(split, n_layers),
                             with_draft=False)]
        self.bufs = [StreamBufs(engine, geometry) for engine in engines]
        self.spec = [SpecKernels(engine) for engine in engines]
        # The whole model's KV as one cache, draft first: each stage's range is contiguous.
        self.cache = Cache(self.stages[0].draft.kv + self.stages[0].target.kv + self.stages[1].target.kv)

    def prefill_row(self, row: int, prompt: Sequence[int]) -> int:
        """Both stages' caches and buffers for the request in slot `row`; its start position."""
        for stage, bufs in zip(self.stages, self.bufs):
            start = stage.prefill_row(bufs, row, prompt)
        return start

    def round_stream(self) -> RoundStream:
        """The rounds of the module docstring, driven from stage 1 (whose buffers are read
        back), with stage 0's work forked off and joined back by events in every round."""
        (e0, e1), (s0, s1), (b0, b1) = self.engines, self.stages, self.bufs
        batch, k = b1.batch, b1.k
        drafts = [e.zeros(np.uint32, batch * max(k, 1), label=f"draft_d stage {i}") for i, e in enumerate(self.engines)]
        partials = [e.zeros(np.uint32, batch * (k + 1), label=f"partial sums stage {i}")
                    for i, e in enumerate(self.engines)]
        pred_d = e1.zeros(np.uint32, batch * (k + 1), label="pred_d")
        fork, forward, back, join = Event(e1, timing=False), Event(e0, timing=False), Event(e1, timing=False), \
            Event(e0, timing=False)
        stage0 = chain([*s0.draft_steps(b0, drafts[0]), self.spec[0].prepare_assemble_verify(b0, drafts[0]),
                        *s0.verify_steps(b0, None, partial_out=partials[0])])
        rollback0 = self.spec[0].prepare_rollback(
            b0, kv_len_ptr_table_range(e0, self.cache, range(0, 1 + self.split), b0.pos_ctr_d))
        table1 = kv_len_ptr_table_range(e1, self.cache, range(1 + self.split, len(self.cache)), b1.pos_ctr_d)

        def draft_chain() -> None:
            fork.record()
            e0.wait(fork)
            stage0()
            for dst, src in ((drafts[1], drafts[0]), (partials[1], partials[0]), (b1.brk_d, b0.brk_d)):
                e0.copy_to_peer(dst, src)
            forward.record()
            e1.wait(forward)

        def round_tail() -> None:
            for dst, src in ((b0.ctl_d, b1.ctl_d), (b0.pend_d, b1.pend_d), (b0.brk_d, b1.brk_d)):
                e1.copy_to_peer(dst, src)
            back.record()
            e0.wait(back)
            rollback0()
            join.record()
            e1.wait(join)

        return RoundStream(b1, kernels=self.spec[1], draft_chain=draft_chain,
                           verify_trunk=chain(s1.verify_steps(b1, pred_d, partial_in=partials[1])),
                           draft_d=drafts[1], acceptance=Greedy(pred_d), rollback_tables=[table1],
                           stages=Stages([e0], round_tail, self.cache.capacity),
                           pace=any(s.cost.paced for s in self.stages))

"""Rounds past every row's end skipped: the model's work of each round of a burst graph inside a
conditional IF node (docs/capacity.md, "Rounds past the end").

A burst is sized before its rounds run, on the tokens a round its rows made so far (Pace), so the
last burst of a request often runs past the request's end: at B = 1 a round of a real model's
draft and verify costs 0.7-0.9 ms, and a burst of 16 sized on a slower prompt's rate ran one or
two such rounds for nothing. Here a one-block kernel (spec_rows_live) reads every row's done flag
at the round's start and sets the IF node's condition, so once every row is done the round's
draft and verify are skipped, and its own small kernels (which take a done row's path, as ever)
are all it costs. Pace then sizes a burst to cover what the rows are expected to need rather
than to fall short of it (Pace's `skips`). What the IF nodes, their openers and the rounds sent
past the end cost gave back about what it saved, on an H100 with the trained pair at B = 1, so
a round skips nothing unless asked (skip_done; benchmarks/RESULTS.md).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..driver.graph import LoopBuilder, branch, check_loops, join
from ..kernels.signatures import load

if TYPE_CHECKING:
    from ..buffers.stream_bufs import StreamBufs
    from ..driver.module import Launch

Step = Callable[[], None]


class LiveGate:
    """The IF node around a round's model work, open while some row of `bufs` is live. Needs a
    CUDA 12.4+ driver (LoopUnsupported, raised here, before anything is loaded)."""

    def __init__(self, bufs: StreamBufs):
        check_loops()
        self.bufs = bufs
        self.kernel = load(bufs.engine, "device_loop").kernel("spec_rows_live")

    def opener(self, handle: Any) -> Launch:
        """The kernel that sets the IF node's condition on `handle` (a LoopBuilder's handle()):
        1 where some row is live, 0 where every row is done. One block."""
        return self.kernel.prepare(grid=1, block=256).set(ctl_d=self.bufs.ctl_d, B=self.bufs.batch,
                                                          handle=int(handle))

    def add(self, builder: LoopBuilder, opening: Step, work: Step) -> None:
        """Into the graph `builder` builds, after everything so far: `opening` (the round's steps
        before its model work) beside the opener, then an IF node of `work`, which waits for both.
        Each handle has its node: a round of the burst its own."""
        handle = builder.handle()
        opener = self.opener(handle)

        def open_round() -> None:
            node = branch(opener)
            opening()
            join(opener.engine, node)
        builder.issue(open_round)
        builder.when(handle, work)

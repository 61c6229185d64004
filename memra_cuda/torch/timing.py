"""The device's time of torch work: captured once as a CUDA graph and replayed between CUDA
events, so what is timed is the GPU's, not the host's launches. A decoder times its widths'
bodies with it (SpeculativeLlama's costs), the benchmarks their steps."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .adapter import torch_graph


def replay_ms(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, replays: int = 200) -> float:
    """Device milliseconds of one replay of `graph` on `stream`, between CUDA events around
    `replays` of them, after one untimed: a graph's first launch also uploads it to the device,
    which counted in a few replays' mean."""
    with torch.cuda.stream(stream):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / replays


def graph_ms(run: Callable[[], Any], stream: torch.cuda.Stream | None = None, replays: int = 200) -> float:
    """Device milliseconds of run(), captured in one CUDA graph on `stream` (the one whose
    buffers run() reads; a fresh one where None) after one eager run for torch's lazy set-up
    (and a compiled step's compiling), and replayed."""
    stream = torch.cuda.Stream() if stream is None else stream
    return replay_ms(captured(run, stream), stream, replays)


def captured(run: Callable[[], Any], stream: torch.cuda.Stream, keep_graph: bool = False) -> torch.cuda.CUDAGraph:
    """run() captured in one CUDA graph on `stream`, after one eager run (graph_ms's capture, for
    a caller that times several graphs in turn; `keep_graph`, torch's, for one that reads its nodes)."""
    with torch.cuda.stream(stream):
        run()
        with torch_graph(stream, keep_graph=keep_graph) as graph:
            run()
    return graph

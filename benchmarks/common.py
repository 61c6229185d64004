"""What every part of `make bench` shares: the toy model and prompt the parts decode, the
device timing of graphs (replays queued back to back, timed with events), and what a round
measured asks of the capacity rule.

bench.py runs the parts and imports the modules of the others (device.py, state.py, tree.py;
ranks.py is a program of its own); they take what they share from here, not from bench.py, so no
benchmark module imports another in a circle.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from memra_cuda.buffers.tree import Tree
from memra_cuda.driver.engine import Engine
from memra_cuda.driver.event import Event
from memra_cuda.driver.graph import Graph
from memra_cuda.rounds.stream import RoundStream
from memra_cuda.testing.toy.lm import ToyModel

MODEL = ToyModel(seed=2024, noise_ppm=100_000, p_min=0.05)
PROMPT = list(range(1, 17))


def depth_and_width(config: int | Tree) -> tuple[int, int]:
    """What the capacity rule takes of a round a bench measures, chain of k (an int) or tree: the
    most it advances (k, or the tree's depth) and what it writes past its position (k + 1, or
    T + 1 nodes)."""
    return (config, config + 1) if isinstance(config, int) else (config.depth, config.nodes)


def batch_prompts(batch: int) -> list[list[int]]:
    """B different prompts of different lengths (8 to 23 tokens)."""
    return [[(7 * b + i) % MODEL.vocab for i in range(8 + b % 16)] for b in range(batch)]


def replay_ms(engine: Engine, graph: Graph, replays: int) -> float:
    """Milliseconds of `replays` replays of `graph` queued back to back, timed on the device."""
    start, end = Event(engine), Event(engine)
    start.record()
    for _ in range(replays):
        graph.launch()
    end.record()
    return end.elapsed_ms(start)


def device_us(engine: Engine, step: Callable[[], None], launches: int = 50, replays: int = 10) -> float:
    """Device microseconds of one `step`: a graph of `launches` of them, replayed `replays`
    times after a warm-up."""
    def issue() -> None:
        for _ in range(launches):
            step()

    graph = Graph(engine, issue)
    graph.launch()
    us = replay_ms(engine, graph, replays) * 1e3 / (replays * launches)
    graph.free()
    return us


def us_per_round(engine: Engine, stream: RoundStream, prefill: Callable[[], object], tokens: int, mode: str) -> float:
    """Microseconds per round of generating `tokens` after `prefill()`, after one untimed warm-up
    generation (capture)."""
    prefill()
    stream.generate_batch(tokens, mode=mode)
    prefill()
    engine.synchronize()  # the prefill is not the rounds'
    rounds0 = stream.rounds
    t0 = time.perf_counter()
    stream.generate_batch(tokens, mode=mode)
    engine.synchronize()
    rounds = stream.rounds - rounds0
    if not rounds:
        raise RuntimeError(f"generating {tokens} tokens ran no round: nothing to time")
    return (time.perf_counter() - t0) / rounds * 1e6


__all__ = ["MODEL", "PROMPT", "batch_prompts", "device_us", "replay_ms", "us_per_round"]

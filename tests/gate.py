"""A stream held until the test lets it go, for GPU tests of what must wait for queued work.

A spin of fixed cycles (probe_spin) is over when it is over: where the host is descheduled for
its length (the suites share one GPU and its cores with a training run), the work queued behind
it has run before the test looks, and a test of "held while queued" fails for the machine's
load. probe_gate spins until the host writes its go word into mapped memory, so what is queued
behind it stays queued until the test says so; it gives up after GATE_MOST cycles, so a test that
fails inside holds its stream for seconds, not for ever."""
from __future__ import annotations

import gc

import numpy as np

from memra_cuda import Engine
from memra_cuda.driver import MappedBuffer

GATE_MOST = 20_000_000_000  # ~10 s of a ~2 GHz clock


class Gate:
    """`with Gate(engine):` the engine's stream runs nothing queued inside the block until it
    ends (or open() is called), then the host waits for the stream (engine.synchronize()).

    Garbage is collected first: memory memra frees (cuMemFree) waits for the device, so a
    collection inside the block that freed any would wait for the gate."""

    def __init__(self, engine: Engine):
        gc.collect()
        self.engine = engine
        self._flag = MappedBuffer(engine, np.uint32, 1)
        self._go = self._flag.live
        self._go[0] = 0
        engine.load_ptx("probe").kernel("probe_gate").prepare(["ptr", "u64"]).set(self._flag.device, GATE_MOST)()

    def open(self) -> None:
        self._go[0] = 1

    def __enter__(self) -> Gate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.open()
        self.engine.synchronize()  # the gate's kernel reads the mapped word until it has seen it

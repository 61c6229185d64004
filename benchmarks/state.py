"""`make bench`, part 7: what rolling back recurrent state costs a round, by strategy.

A hybrid model's round writes k + 1 snapshots of every recurrent layer's state (the verify's,
whichever strategy), then rolls back: COPY copies the kept snapshot over the live state
(kernel 8: one state read and written per row and layer), FLIP moves a slot index per row
(kernel 9: one word, whatever the state's size). For states of 4 KiB to 1 MiB a row and
layer, 4 layers, B = 1, 8 and 32, k = 4, every row keeping 3 tokens: the device time of each
rollback against the time of writing the snapshots it rolls back to (a memset of the k + 1
slots, the least the verify pays for them). Device time: a graph of 50 launches, replayed and
timed with events.
"""
from __future__ import annotations

import numpy as np

from memra_cuda import Geometry
from memra_cuda.buffers.layout import CTL_KEEP, CTL_WORDS
from memra_cuda.buffers.stream_bufs import StreamBufs
from memra_cuda.buffers.tables import StateLayer, state_copy_table, state_flip_table
from memra_cuda.driver.engine import Engine
from memra_cuda.kernels.spec import SpecKernels

from .common import device_us

K, LAYERS, KEEP = 4, 4, 3
ROW_BYTES = (4 << 10, 32 << 10, 128 << 10, 1 << 20)  # per row and layer: 128 KiB is 8 heads of 64 x 64 f32
BATCHES = (1, 8, 32)


def _rollbacks(engine: Engine, spec: SpecKernels, batch: int, row_words: int) -> dict[str, float]:
    bufs = StreamBufs(engine, Geometry(K, 1, batch))
    ctl = np.zeros((batch, CTL_WORDS), np.int32)
    ctl[:, CTL_KEEP] = KEEP
    engine.copy_htod(bufs.ctl_d, ctl.reshape(-1))
    layers = [StateLayer(engine.alloc(np.float32, batch * row_words, label="live"),
                         engine.alloc(np.float32, batch * (K + 1) * row_words, label="slots"), row_words, K)
              for _ in range(LAYERS)]
    copy = spec.prepare_state_copy(bufs, state_copy_table(engine, layers))
    flip = spec.prepare_state_flip(bufs, state_flip_table(engine, [engine.zeros(np.uint32, batch)]))

    def snapshots() -> None:
        for layer in layers:
            engine.memset(layer.slots_d, 0)

    figures = dict(copy_us=device_us(engine, copy), flip_us=device_us(engine, flip),
                   snapshots_us=device_us(engine, snapshots))
    for layer in layers:
        layer.live_d.free()
        layer.slots_d.free()
    bufs.free()
    return figures


def bench_state(engine: Engine, quick: bool) -> list[dict]:
    spec = SpecKernels(engine)
    rows = []
    print(f"\nrecurrent state rollback: {LAYERS} layers, k={K}, {KEEP} tokens kept a row; device time per round")
    print(f"{'B':>3} {'KiB/row/layer':>13} {'state MiB':>9} {'copy us':>8} {'flip us':>8} {'snapshots us':>12} "
          f"{'copy/snapshots':>14} {'copy GB/s':>9}")
    for batch in BATCHES[:2] if quick else BATCHES:
        for row_bytes in ROW_BYTES[:2] if quick else ROW_BYTES:
            state = batch * LAYERS * row_bytes  # the live state: what COPY reads and writes once
            found = _rollbacks(engine, spec, batch, row_bytes // 4)
            row = dict(batch=batch, layers=LAYERS, k=K, row_bytes=row_bytes, state_bytes=state, **found)
            rows.append(row)
            print(f"{batch:3d} {row_bytes >> 10:13d} {state / 2**20:9.2f} {found['copy_us']:8.2f} "
                  f"{found['flip_us']:8.2f} {found['snapshots_us']:12.2f} "
                  f"{found['copy_us'] / found['snapshots_us']:14.2f} {2 * state / found['copy_us'] / 1e3:9.0f}",
                  flush=True)
    return rows


__all__ = ["bench_state"]

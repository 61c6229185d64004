"""`make bench`, part 6: device-resident generation against the host-driven modes.

The bare toy and the 8B/0.5B stand-in, B = 1 and 32, k = 4, M = 16, each row its own prompt:
graph mode paced and unpaced, overlap, and device mode (one launch, device-side pacing,
tokens streamed through mapped memory), its host sleeping between looks (at most every 60 µs,
and every 150 µs: "lean") and spinning. For each: tokens/s, the host's CPU seconds per 1 000
tokens and as a share of the wall time (process time: a host blocked in a stream synchronise
spins; device mode's consumer counts the tokens of each look), and for device mode the delay
from a token's publishing (its %globaltimer stamp, right after its commit) to the host seeing
it, against one round plus 20 µs. Medians of 3 timed runs after a warm-up.
"""
from __future__ import annotations

import time

import numpy as np

from memra_cuda import Geometry
from memra_cuda.buffers.capacity import kv_capacity
from memra_cuda.buffers.stream_bufs import StreamBufs
from memra_cuda.driver.buffer import MappedBuffer
from memra_cuda.driver.engine import Engine
from memra_cuda.kernels.signatures import load
from memra_cuda.kernels.spec import SpecKernels
from memra_cuda.rounds.schedule import Schedule
from memra_cuda.rounds.stream import RoundStream
from memra_cuda.testing.toy.lm import COST_8B_05B, ToyCost, ToyLM

from .common import MODEL

K, M = 4, 16
RUNS = (("graph", True), ("graph", False), ("overlap", True), ("device", True), ("device lean", True),
        ("device spin", True))  # mode, pace
LEAN_LOOK_S = 150e-6  # "device lean": the host aims its looks 150 µs apart or more


def clock_offset(engine: Engine, trials: int = 40) -> int:
    """Device %globaltimer minus host perf_counter_ns, in ns, from the tightest of `trials`
    round trips through mapped memory (probe_clock)."""
    flag, stamp = MappedBuffer(engine, np.uint32, 4), MappedBuffer(engine, np.uint64, 1)
    launch = load(engine, "probe").kernel("probe_clock").prepare(grid=1, block=1)
    launch.set(flag=flag.device, device_ns=stamp.device)
    words, device_ns = flag.live, stamp.live  # views, taken once: the spins read the memory itself
    trips = []  # (round trip, device minus host at its middle)
    for _ in range(trials):
        words[:] = 0
        launch()
        while words[2] == 0:
            pass
        t0 = time.perf_counter_ns()
        words[0] = 1
        while words[1] == 0:
            pass
        t1 = time.perf_counter_ns()
        engine.synchronize()
        trips.append((t1 - t0, int(device_ns[0]) - (t0 + t1) // 2))
    del words, device_ns  # a mapped buffer refuses to be freed while a view of it is held
    flag.free()
    stamp.free()
    return min(trips)[1]


def _prompts(batch: int) -> list[list[int]]:
    rng = np.random.default_rng(batch)
    return [[int(t) for t in rng.integers(0, MODEL.vocab, int(rng.integers(4, 17)))] for _ in range(batch)]


def _run(lm: ToyLM, bufs: StreamBufs, stream: RoundStream, prompts: list[list[int]], tokens: int,
         mode: str) -> dict:
    for b, p in enumerate(prompts):
        lm.prefill_row(bufs, b, p)
    device = mode.startswith("device")
    offset = clock_offset(lm.engine) if device else 0  # the clocks drift apart by µs a second: anew
    rounds0 = stream.rounds
    c0, t0 = time.process_time(), time.perf_counter()
    if device:  # what a consumer does with the tokens here: count them, and keep them
        loop = stream.device_loop
        loop.schedule = Schedule(look_s=LEAN_LOOK_S if mode == "device lean" else Schedule.LOOK_S,
                                 spin=mode == "device spin")
        landed, made = [], 0
        following = stream.follow(tokens)
        setup = time.process_time() - c0
        for piece in following:
            made += piece.total
            landed.append(piece)
    else:
        made = sum(row.size for row in stream.generate_batch(tokens, mode=mode))
    lm.engine.synchronize()  # overlap leaves a burst running past the stop: its time counts too
    wall, cpu, rounds = time.perf_counter() - t0, time.process_time() - c0, stream.rounds - rounds0
    figures = dict(tokens_per_s=made / wall, cpu_s_per_1k=cpu / made * 1e3, cpu_share=cpu / wall,
                   us_per_round=wall / rounds * 1e6, made=made, looks_per_round=None, empty_looks=None,
                   setup_cpu_us=None, delay_p50_us=None, delay_p99_us=None)
    if device:  # delay: seen - (stamp - offset), stamps being the low 32 bits of device time
        delay = np.concatenate([(piece.seen_ns + offset - s.astype(np.int64)) % 2**32
                                for piece in landed for s in piece.stamps]) / 1e3
        looks, empty = loop.looks
        figures.update(looks_per_round=looks / rounds, empty_looks=empty / max(looks, 1), setup_cpu_us=setup * 1e6,
                       delay_p50_us=float(np.median(delay)), delay_p99_us=float(np.percentile(delay, 99)))
    return figures


def bench_device(engine: Engine, quick: bool) -> list[dict]:
    spec = SpecKernels(engine)
    rows = []
    print(f"{'model':8} {'B':>3} {'mode':14} {'tokens/s':>10} {'vs best':>7} {'us/round':>9} {'CPU s/1k tok':>12} "
          f"{'CPU/wall':>8} {'delay p50 us':>12} {'p99 us':>8} {'round+20':>8} {'looks/round':>11} {'empty':>6}")
    settings = (("bare", ToyCost(), 256 if quick else 2048), ("8B/0.5B", COST_8B_05B, 24 if quick else 96))
    for name, cost, tokens in settings:
        for batch in (1, 32):
            prompts = _prompts(batch)
            lm = ToyLM(engine, MODEL, kv_capacity(16, tokens, Geometry(K, M, batch), overlap=True), cost, batch=batch)
            bufs = StreamBufs(engine, Geometry(K, M, batch))
            stream = lm.round_stream(bufs, kernels=spec)
            found = {}
            for mode, pace in RUNS:
                stream.pace = pace
                _run(lm, bufs, stream, prompts, tokens, mode)  # warm-up: JIT, captures
                runs = [_run(lm, bufs, stream, prompts, tokens, mode) for _ in range(3)]
                mid = sorted(runs, key=lambda r: r["tokens_per_s"])[1]
                label = mode if mode != "graph" else f"graph {'paced' if pace else 'unpaced'}"
                found[label] = dict(model=name, batch=batch, mode=label, **mid)
            best = max(found[m]["tokens_per_s"] for m in found if not m.startswith("device"))
            for label, row in found.items():
                row["vs_best_host_mode"] = row["tokens_per_s"] / best
                late = "" if row["delay_p50_us"] is None else (
                    f"{row['delay_p50_us']:12.1f} {row['delay_p99_us']:8.1f} {row['us_per_round'] + 20:8.1f} "
                    f"{row['looks_per_round']:11.2f} {row['empty_looks']:6.0%}")
                print(f"{name:8} {batch:3} {label:14} {row['tokens_per_s']:10.0f} {row['vs_best_host_mode']:7.2f} "
                      f"{row['us_per_round']:9.1f} {row['cpu_s_per_1k']:12.4f} {row['cpu_share']:8.0%} {late}",
                      flush=True)
                rows.append(row)
            bufs.free()
    print("(the device clock's offset measured before every device run; a host mode's CPU includes spinning in "
          "its stream synchronise; median of 3 runs)")
    return rows


def summary(rows: list[dict]) -> str:
    """The device rows, one line each: the done-when figures."""
    return "\n".join(f"{r['mode']}, {r['model']} B={r['batch']}: {r['vs_best_host_mode']:.2f}x the best host mode, "
                     f"host CPU {r['cpu_share']:.0%} of wall, commit-to-host delay p50 {r['delay_p50_us']:.1f} us "
                     f"(one round + 20 us = {r['us_per_round'] + 20:.1f})"
                     for r in rows if r["mode"] in ("device", "device lean"))


__all__ = ["bench_device", "clock_offset", "summary"]

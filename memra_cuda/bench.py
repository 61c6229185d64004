"""`make bench`: what round-stream buys, measured on the GPU in one run.

1. Launch overhead: a prepared 1-argument launch against the bare cuLaunchKernel binding call.
2. Rounds: the readback loop (one round, read back, repeat) against round-stream (M rounds,
   one readback) and round-stream replayed as a CUDA graph, over k and M, for the bare toy
   model and for the toy made to cost what an 8B target with a 0.5B draft costs (the bytes of
   their bf16 weights streamed per verify and per draft step). The floor is the device-only time
   of the same round: graph replays back to back, timed with events, no host in the loop.

    python -m memra_cuda.bench [--json PATH] [--only launch|rounds] [--quick]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from .engine import Engine
from .errors import CudaUnavailable, call, driver
from .round_stream import StreamBufs
from .spec import RoundStream, SpecKernels
from .toy import COST_8B_05B, ToyCost, ToyLM, ToyModel

KS = (0, 2, 4, 8)
MS = (1, 4, 16, 64)
MODEL = ToyModel(seed=2024, noise_ppm=100_000, p_min=0.05)
PROMPT = list(range(1, 17))
NO_STOP = 2**31 - 1  # token budget that no benchmark run reaches


@dataclass
class Row:
    model: str
    k: int
    m_rounds: int | None
    mode: str
    us_per_round: float
    tokens_per_s: float
    readbacks_per_burst: float
    readbacks_per_token: float
    acceptance: float | None
    speedup: float = 1.0
    floor_us_per_round: float | None = None


class EventPair:
    """Two CUDA events on the engine's stream: device time between two points of the queue."""

    def __init__(self, engine: Engine):
        self.engine = engine
        engine.activate()
        self.events = [call("cuEventCreate", 0) for _ in range(2)]

    def record(self, which: int) -> None:
        call("cuEventRecord", self.events[which], self.engine.stream)

    def elapsed_ms(self) -> float:
        call("cuEventSynchronize", self.events[1])
        return float(call("cuEventElapsedTime", self.events[0], self.events[1]))

    def destroy(self) -> None:
        for event in self.events:
            call("cuEventDestroy", event)


def launch_overhead(engine: Engine, batch: int = 200, trials: int = 60) -> dict:
    """Median seconds per launch, bare binding vs prepared Launch, interleaved batches.

    Batches stay short of the driver's launch queue so both sides time the host, not the GPU.
    """
    kernel = engine.load_ptx("probe").kernel("probe_touch")
    target = engine.alloc_u32_zeroed(1)
    prepared = kernel.prepare(["ptr"], grid=1, block=32).set(target)
    bare, f, stream, params = driver().cuLaunchKernel, kernel.handle, engine.stream, prepared.args.pointer
    samples: dict[str, list[float]] = {"bare": [], "prepared": []}
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(batch):
            bare(f, 1, 1, 1, 32, 1, 1, 0, stream, params, 0)
        t1 = time.perf_counter()
        engine.synchronize()
        t2 = time.perf_counter()
        for _ in range(batch):
            prepared()
        t3 = time.perf_counter()
        engine.synchronize()
        samples["bare"].append((t1 - t0) / batch)
        samples["prepared"].append((t3 - t2) / batch)
    assert int(engine.dtoh(target)[0]) == 2 * batch * trials, "some launches did not run"
    bare_s, prepared_s = statistics.median(samples["bare"]), statistics.median(samples["prepared"])
    return {"bare_us": bare_s * 1e6, "prepared_us": prepared_s * 1e6, "ratio": prepared_s / bare_s}


def measure(engine: Engine, spec: SpecKernels, cost: ToyCost, weights, name: str, k: int,
            m_rounds: int, mode: str, rounds: int) -> Row:
    """Generate for `rounds` rounds after one warm-up step (which also captures the graph); in
    graph mode, then replay the same steps again from the same prompt for the device floor."""
    capacity = len(PROMPT) + (m_rounds + rounds + m_rounds) * (k + 1)
    lm = ToyLM(engine, MODEL, capacity, cost, weights)
    bufs = StreamBufs(engine, k, m_rounds)
    stream = lm.round_stream(spec, bufs)
    position = start(engine, lm, bufs, stream, mode)
    rounds0, readbacks0, bursts0, tokens = stream.rounds, engine.readbacks, stream.bursts, 0
    t0 = time.perf_counter()
    while stream.rounds - rounds0 < rounds:
        new, _ = stream.step(mode, position)
        tokens += len(new)
        position += len(new)
    wall = time.perf_counter() - t0
    done_rounds, bursts = stream.rounds - rounds0, stream.bursts - bursts0
    row = Row(name, k, None if mode == "readback" else m_rounds, mode, wall / done_rounds * 1e6,
              tokens / wall, (engine.readbacks - readbacks0) / bursts,
              (engine.readbacks - readbacks0) / tokens, (tokens - done_rounds) / (done_rounds * k) if k else None)
    if mode == "graph":
        start(engine, lm, bufs, stream, mode)
        row.floor_us_per_round = device_floor(engine, stream, bursts) * 1e3 / done_rounds
    bufs.free()
    return row


def start(engine: Engine, lm: ToyLM, bufs: StreamBufs, stream: RoundStream, mode: str) -> int:
    """Prefill, lift the stop rule, and take one untimed warm-up step (JIT, capture, caches)."""
    position = lm.prefill(bufs, PROMPT)
    bufs.set_stop(engine, budget=NO_STOP)
    return position + len(stream.step(mode, position)[0])


def device_floor(engine: Engine, stream: RoundStream, replays: int) -> float:
    """Milliseconds of `replays` graph replays queued back to back, timed on the device: the
    same rounds as the timed run, with no host in the loop."""
    events = EventPair(engine)
    events.record(0)
    for _ in range(replays):
        stream.graph.launch()
    events.record(1)
    ms = events.elapsed_ms()
    events.destroy()
    return ms


def bench_rounds(engine: Engine, quick: bool) -> list[Row]:
    spec = SpecKernels(engine)
    rows: list[Row] = []
    settings = [("bare", ToyCost(), 512 if not quick else 128),
                ("8B/0.5B", COST_8B_05B, 16 if not quick else 4)]
    for name, cost, rounds in settings:
        nbytes = max(cost.verify_bytes, cost.draft_bytes)
        weights = engine.alloc("u1", nbytes, zeroed=True) if nbytes else None
        for k in KS:
            base = measure(engine, spec, cost, weights, name, k, 1, "readback", rounds)
            base.floor_us_per_round = measure(engine, spec, cost, weights, name, k, 1, "graph", rounds).floor_us_per_round
            rows.append(base)
            print(format_row(base), flush=True)
            for m_rounds in MS:
                for mode in ("stream", "graph"):
                    row = measure(engine, spec, cost, weights, name, k, m_rounds, mode, max(rounds, m_rounds))
                    row.speedup = base.us_per_round / row.us_per_round
                    rows.append(row)
                    print(format_row(row), flush=True)
        if weights is not None:
            weights.free()
    return rows


HEADER = (f"{'model':8} {'k':>2} {'M':>3} {'mode':9} {'us/round':>9} {'tokens/s':>10} {'rb/burst':>8} "
          f"{'rb/token':>8} {'accept':>6} {'speedup':>7} {'floor us':>9} {'/floor':>6}")


def format_row(r: Row) -> str:
    floor = f"{r.floor_us_per_round:9.1f}" if r.floor_us_per_round else f"{'-':>9}"
    ratio = f"{r.us_per_round / r.floor_us_per_round:6.3f}" if r.floor_us_per_round and r.mode == "graph" else f"{'-':>6}"
    accept = f"{r.acceptance:6.2f}" if r.acceptance is not None else f"{'-':>6}"
    m = f"{r.m_rounds:3d}" if r.m_rounds else f"{'-':>3}"
    return (f"{r.model:8} {r.k:2d} {m} {r.mode:9} {r.us_per_round:9.1f} {r.tokens_per_s:10.0f} "
            f"{r.readbacks_per_burst:8.3f} {r.readbacks_per_token:8.4f} {accept} {r.speedup:6.2f}x {floor} {ratio}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memra_cuda.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--only", choices=["launch", "rounds"], help="run one part")
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run, not for figures)")
    args = parser.parse_args(argv)
    try:
        engine = Engine()
    except CudaUnavailable as exc:
        print(f"memra_cuda.bench: {exc}", file=sys.stderr)
        return 1
    report: dict = {}
    if args.only in (None, "launch"):
        report["launch"] = launch_overhead(engine)
        lo = report["launch"]
        print(f"launch overhead: bare cuLaunchKernel {lo['bare_us']:.2f} us, prepared Launch "
              f"{lo['prepared_us']:.2f} us, ratio {lo['ratio']:.3f}")
    if args.only in (None, "rounds"):
        print(f"toy model {MODEL}\n{HEADER}", flush=True)
        rows = bench_rounds(engine, args.quick)
        report["rounds"] = [asdict(r) for r in rows]
        print(f"\n{HEADER}")
        for r in rows:
            print(format_row(r))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`make bench`: what round-stream buys, measured on the GPU in one run. From the repository's
root: `PYTHONPATH=. python -m benchmarks.bench` (the benchmarks are programs of the checkout, not
of the wheel); --only runs one part.

1. Launch overhead: a prepared 1-argument launch against the bare cuLaunchKernel binding call;
   then the host path: µs per round of the readback loop and of graph mode, each beside its
   device floor (bench_host_path).
2. Rounds: the readback loop (one round, read back, repeat) against round-stream (M rounds,
   one readback), round-stream replayed as a CUDA graph, and graph replays overlapped with
   the readback, over k and M, for the bare toy model and for the toy made to cost what an 8B
   target with a 0.5B draft costs (the bytes of their bf16 weights streamed per verify and per
   draft step). Every run generates the same tokens from the same prompt. The floor is the
   device-only time of the same rounds: graph replays back to back, timed with events.
3. Batches: the bare toy at k=4, M=16 decoding B requests (their own prompts, the same
   budget) as one batched graph, against the same B requests decoded one after another by a
   single-sequence graph: tokens/s of each, and host readbacks per burst.
4. Sampling: greedy against stochastic acceptance (the toy's sampling mode), bare toy, k=4,
   M=16, V = 32 000 and 152 000: time per round and acceptance rate; then the device time of
   spec_accept_sample alone (a graph of launches, timed with events) at B = 1 and 32.
5. Pipeline (two GPUs): the toy split into two stages on two devices (memra_cuda.testing.toy.
   pipeline) against the same model on one, k=4, M=16, bare and as 8B/0.5B with the verify's
   weights split between the stages: time per round of each, in stream and graph mode; then,
   where NCCL is installed, the same split over NCCL ranks, one process a GPU (benchmarks/ranks.py
   over memra_cuda.testing.toy.ranks): pipeline stages and tensor-parallel ranks, graph mode,
   against the one GPU.
6. Device mode (benchmarks/device.py): one launch per generation, tokens streamed through mapped
   memory, against graph (paced and unpaced) and overlap, bare toy and 8B/0.5B, B = 1 and 32:
   tokens/s, host CPU, and the delay from a token's commit to the host seeing it.
7. Recurrent state (benchmarks/state.py): the device time of rolling back a hybrid model's state
   by copy and by flipping an index, over state sizes and batches, beside the time of writing
   the snapshots they roll back to.
8. Trees (benchmarks/tree.py): tokens per round and tokens/s of the best chain against the best
   static and dynamic tree, bare toy and 8B/0.5B, B = 1 and 32; the tree accepts alone against the
   HBM floor for their bytes.
9. PyTorch (`--only torch`, `make bench-torch`; needs torch, transformers and tokenizers): the
   sections of benchmarks/torch_engine.py (its docstring says which; the first, the headline on
   the trained pair, is benchmarks/headline.py), run only when asked for.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from memra_cuda import Geometry
from memra_cuda.buffers.capacity import kv_capacity
from memra_cuda.buffers.stream_bufs import StreamBufs
from memra_cuda.driver.buffer import DeviceBuffer
from memra_cuda.driver.engine import Engine
from memra_cuda.driver.errors import CudaUnavailable, driver
from memra_cuda.kernels.signatures import load
from memra_cuda.kernels.spec import SpecKernels
from memra_cuda.rounds.stream import RoundStream
from memra_cuda.testing.toy.lm import COST_8B_05B, ToyCost, ToyLM, ToyModel, ToySampling

from .common import MODEL, PROMPT, batch_prompts, device_us, replay_ms, us_per_round
from .device import bench_device, summary
from .needs import PAIR, needs
from .state import bench_state
from .torch_common import listed, writable
from .tree import bench_tree

KS = (0, 2, 4, 8)
MS = (1, 4, 16, 64)


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


def launch_overhead(engine: Engine, batch: int = 200, trials: int = 60) -> dict[str, float]:
    """Median seconds per launch, bare binding vs prepared Launch, interleaved batches.

    Batches stay short of the driver's launch queue so both sides time the host, not the GPU.
    """
    kernel = load(engine, "probe").kernel("probe_touch")
    target = engine.zeros(np.uint32, 1)
    prepared = kernel.prepare(grid=1, block=32).set(x=target)
    engine.ctx.make_current()  # the bare calls need it; the prepared launch checks it per call
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


def measure(engine: Engine, spec: SpecKernels, cost: ToyCost, weights: DeviceBuffer | None, name: str, k: int,
            m_rounds: int, mode: str, tokens: int, model: ToyModel = MODEL,
            sampling: ToySampling | None = None) -> Row:
    """Generate `tokens` tokens from PROMPT after the same generation untimed (JIT, and the
    capture of every graph it replays, paced last bursts too); for graph mode, then replay as
    many M-round bursts again from the same prompt, back to back and timed on the device, for
    the floor."""
    lm = ToyLM(engine, model, kv_capacity(len(PROMPT), tokens, Geometry(k, m_rounds), overlap=True), cost, weights,
               sampling=sampling)
    bufs = StreamBufs(engine, Geometry(k, m_rounds))
    stream = lm.round_stream(bufs, kernels=spec)
    lm.prefill(bufs, PROMPT)
    stream.generate(tokens, mode=mode)
    lm.prefill(bufs, PROMPT)
    rounds0, bursts0, readbacks0 = stream.rounds, stream.bursts, engine.readbacks
    t0 = time.perf_counter()
    made = len(stream.generate(tokens, mode=mode))
    engine.synchronize()  # overlap leaves a burst running past the stop: its time counts too
    wall = time.perf_counter() - t0
    bursts, readbacks = stream.bursts - bursts0, engine.readbacks - readbacks0
    rounds = stream.rounds - rounds0  # rounds issued, those after the stop included
    accepted, drafted = bufs.drafts_accepted(made)
    row = Row(name, k, None if mode == "readback" else m_rounds, mode, wall / rounds * 1e6, made / wall,
              readbacks / bursts, readbacks / made, accepted / drafted if drafted else None)
    if mode == "graph":
        lm.prefill(bufs, PROMPT)
        bufs.set_stop(budget=tokens)
        row.floor_us_per_round = device_floor(engine, stream, bursts) * 1e3 / (bursts * m_rounds)
    bufs.free()
    return row


def device_floor(engine: Engine, stream: RoundStream, replays: int, rounds: int | None = None) -> float:
    """Milliseconds of `replays` replays of the burst graph of `rounds` rounds (default M) queued
    back to back, timed on the device."""
    return replay_ms(engine, stream.graph_for(0, rounds), replays)


HOST_K, HOST_M, HOST_TOKENS = 4, 16, 512


def bench_host_path(engine: Engine, quick: bool) -> dict[str, dict[str, float]]:
    """What the host adds to a round: the same 512-token bare-toy generation (k=4, M=16, pace
    off) in the readback loop and in graph mode, median of 7 (3 with --quick), each beside its
    device floor: the same rounds replayed as graphs back to back (one-round graphs for the
    loop, M-round ones for graph mode). The bare toy's round is so cheap that the loop's host
    work shows whole; graph mode should sit on its floor."""
    spec, out = SpecKernels(engine), {}
    for mode, rounds in (("readback", 1), ("graph", HOST_M)):
        lm = ToyLM(engine, MODEL, kv_capacity(len(PROMPT), HOST_TOKENS, Geometry(HOST_K, HOST_M), overlap=True))
        bufs = StreamBufs(engine, Geometry(HOST_K, HOST_M))
        stream = lm.round_stream(bufs, kernels=spec)
        stream.pace = False
        lm.prefill(bufs, PROMPT)
        tokens = stream.generate(HOST_TOKENS, mode=mode).tolist()
        walls = []
        for _ in range(3 if quick else 7):
            lm.prefill(bufs, PROMPT)
            rounds0 = stream.rounds
            t0 = time.perf_counter()
            got = stream.generate(HOST_TOKENS, mode=mode)
            engine.synchronize()
            walls.append((time.perf_counter() - t0) / (stream.rounds - rounds0))
            assert got.tolist() == tokens, "the host-path generations differ"
        replays = (stream.rounds - rounds0) // rounds
        lm.prefill(bufs, PROMPT)
        bufs.set_stop(budget=HOST_TOKENS)
        floor = device_floor(engine, stream, replays, rounds) * 1e3 / (replays * rounds)
        out[mode] = dict(us_per_round=statistics.median(walls) * 1e6, floor_us_per_round=floor)
        bufs.free()
    return out


def bench_rounds(engine: Engine, quick: bool) -> list[Row]:
    spec = SpecKernels(engine)
    rows: list[Row] = []
    settings = [("bare", ToyCost(), 1536 if not quick else 256),
                ("8B/0.5B", COST_8B_05B, 96 if not quick else 24)]
    for name, cost, tokens in settings:
        nbytes = max(cost.verify_bytes, cost.draft_bytes)
        weights = engine.alloc("u1", nbytes, zeroed=True) if nbytes else None
        for k in KS:
            base = measure(engine, spec, cost, weights, name, k, 1, "readback", tokens)
            rows.append(base)
            print(format_row(base), flush=True)
            for m_rounds in MS:
                for mode in ("eager", "graph", "overlap"):
                    row = measure(engine, spec, cost, weights, name, k, m_rounds, mode,
                                  max(tokens, 4 * m_rounds * (k + 1)))  # 4 bursts at least
                    row.speedup = base.us_per_round / row.us_per_round
                    if m_rounds == 1 and mode == "graph":  # the same round's floor, for the loop too
                        base.floor_us_per_round = row.floor_us_per_round
                    rows.append(row)
                    print(format_row(row), flush=True)
        if weights is not None:
            weights.free()
    return rows


HEADER = (f"{'model':8} {'k':>2} {'M':>3} {'mode':9} {'us/round':>9} {'tokens/s':>10} {'rb/burst':>8} "
          f"{'rb/token':>8} {'accept':>6} {'speedup':>7} {'floor us':>9} {'/floor':>6}")


def format_row(r: Row) -> str:
    floor = f"{r.floor_us_per_round:9.1f}" if r.floor_us_per_round else f"{'-':>9}"
    graph_floor = r.floor_us_per_round if r.mode == "graph" else None
    ratio = f"{r.us_per_round / graph_floor:6.3f}" if graph_floor else f"{'-':>6}"
    accept = f"{r.acceptance:6.2f}" if r.acceptance is not None else f"{'-':>6}"
    m = f"{r.m_rounds:3d}" if r.m_rounds else f"{'-':>3}"
    return (f"{r.model:8} {r.k:2d} {m} {r.mode:9} {r.us_per_round:9.1f} {r.tokens_per_s:10.0f} "
            f"{r.readbacks_per_burst:8.3f} {r.readbacks_per_token:8.4f} {accept} {r.speedup:6.2f}x {floor} {ratio}")


BATCH_K, BATCH_M = 4, 16
BATCHES = (1, 8, 32, 128)


def bench_batch(engine: Engine, quick: bool) -> list[dict]:
    """Batched graph vs one-after-another single-sequence graphs, same requests, same tokens."""
    spec = SpecKernels(engine)
    tokens = 64 if quick else 256
    capacity = kv_capacity(24, tokens, Geometry(BATCH_K, BATCH_M, max(BATCHES)))
    single_lm = ToyLM(engine, MODEL, capacity)
    single_bufs = StreamBufs(engine, Geometry(BATCH_K, BATCH_M))
    single = single_lm.round_stream(single_bufs, kernels=spec)
    single_lm.prefill(single_bufs, PROMPT)
    single.generate(tokens)  # warm-up: capture
    rows = []
    print(f"{'B':>4} {'batched tok/s':>13} {'one-by-one tok/s':>16} {'speedup':>8} {'rb/burst':>8} {'us/burst':>9}")
    for batch in BATCHES:
        prompts = batch_prompts(batch)
        lm = ToyLM(engine, MODEL, capacity, batch=batch)
        bufs = StreamBufs(engine, Geometry(BATCH_K, BATCH_M, batch))
        stream = lm.round_stream(bufs, kernels=spec)
        for b, p in enumerate(prompts):
            lm.prefill_row(bufs, b, p)
        stream.generate_batch(tokens)  # warm-up
        for b, p in enumerate(prompts):
            lm.prefill_row(bufs, b, p)
        bursts0, readbacks0 = stream.bursts, engine.readbacks
        t0 = time.perf_counter()
        made = sum(len(out) for out in stream.generate_batch(tokens))
        batched_s = time.perf_counter() - t0
        bursts, readbacks = stream.bursts - bursts0, engine.readbacks - readbacks0
        t0 = time.perf_counter()
        made_single = 0
        for p in prompts:
            single_lm.prefill(single_bufs, p)
            made_single += len(single.generate(tokens))
        single_s = time.perf_counter() - t0
        row = dict(batch=batch, batched_tokens_per_s=made / batched_s, single_tokens_per_s=made_single / single_s,
                   readbacks_per_burst=readbacks / bursts, us_per_burst=batched_s / bursts * 1e6)
        row["speedup"] = row["batched_tokens_per_s"] / row["single_tokens_per_s"]
        rows.append(row)
        print(f"{batch:4d} {row['batched_tokens_per_s']:13.0f} {row['single_tokens_per_s']:16.0f} "
              f"{row['speedup']:7.2f}x {row['readbacks_per_burst']:8.3f} {row['us_per_burst']:9.1f}", flush=True)
        bufs.free()
    return rows


SAMPLE_VOCABS = (32_000, 152_000)


def bench_sampling(engine: Engine, quick: bool) -> dict:
    """Greedy and sampling rounds of the bare toy (graph mode), then the acceptance kernel alone."""
    spec = SpecKernels(engine)
    tokens = 256 if quick else 1024
    rounds = []
    print(f"{'V':>7} {'rule':8} {'us/round':>9} {'accept':>6} {'vs greedy':>9}")
    for vocab in SAMPLE_VOCABS:
        model = ToyModel(seed=2024, vocab=vocab, noise_ppm=100_000, p_min=0.05)
        greedy = measure(engine, spec, ToyCost(), None, "bare", BATCH_K, BATCH_M, "graph", tokens, model)
        sampled = measure(engine, spec, ToyCost(), None, "bare", BATCH_K, BATCH_M, "graph", tokens, model,
                          ToySampling())
        for rule, row in (("greedy", greedy), ("sampling", sampled)):
            ratio = row.us_per_round / greedy.us_per_round
            rounds.append(dict(vocab=vocab, rule=rule, us_per_round=row.us_per_round, acceptance=row.acceptance,
                               vs_greedy=ratio))
            print(f"{vocab:7d} {rule:8} {row.us_per_round:9.1f} {row.acceptance:6.2f} {ratio:8.2f}x", flush=True)
    alone = []
    print(f"\n{'V':>7} {'B':>3} {'accept_sample alone, device us':>31}")
    for vocab in SAMPLE_VOCABS:
        for batch in (1, 32):
            alone.append(dict(vocab=vocab, batch=batch, us=acceptance_us(engine, spec, vocab, batch)))
            print(f"{vocab:7d} {batch:3d} {alone[-1]['us']:31.2f}", flush=True)
    return {"rounds": rounds, "acceptance_alone": alone}


def acceptance_us(engine: Engine, spec: SpecKernels, vocab: int, batch: int, launches: int = 100,
                  replays: int = 20) -> float:
    """Device microseconds of one spec_accept_sample over B rows of V, k=4: a graph of
    `launches` launches (live rows, random distributions) replayed and timed with events."""
    k, rng = BATCH_K, np.random.default_rng(0)
    bufs = StreamBufs(engine, Geometry(k, 1, batch))
    p = rng.random((batch, k + 1, vocab), np.float32)
    q = rng.random((batch, k, vocab), np.float32)
    p_d, q_d = engine.htod(p / p.sum(-1, keepdims=True)), engine.htod(q / q.sum(-1, keepdims=True))
    seed_d = engine.htod(np.arange(batch, dtype=np.uint64))
    engine.copy_htod(bufs.vtok_d, rng.integers(0, vocab, batch * (k + 1)))
    us = device_us(engine, spec.prepare_accept_sample(bufs, p_d, q_d, seed_d, vocab), launches, replays)
    bufs.free()
    return us


def bench_pipeline(engine: Engine, quick: bool) -> list[dict]:
    """One GPU against two pipeline stages on two, the same rounds and tokens."""
    from memra_cuda.testing.toy.pipeline import ToyPipeline
    if driver().cuDeviceGetCount()[1] < 2:
        print("pipeline: skipped, needs two GPUs")
        return []
    second = Engine(1)
    tokens, k, m_rounds = (64 if quick else 512), BATCH_K, BATCH_M
    capacity = kv_capacity(len(PROMPT), tokens, Geometry(k, m_rounds))
    split = len(MODEL.kv_mask) // 2
    rows = []
    print(f"{'model':8} {'mode':7} {'one GPU us/round':>16} {'two stages us/round':>19} {'ratio':>6}")
    for name, cost in (("bare", ToyCost()), ("8B/0.5B", COST_8B_05B)):
        half = ToyCost(verify_bytes=cost.verify_bytes // 2, draft_bytes=cost.draft_bytes)
        lm = ToyLM(engine, MODEL, capacity, cost)
        bufs = StreamBufs(engine, Geometry(k, m_rounds))
        single = lm.round_stream(bufs)
        pipe = ToyPipeline([engine, second], MODEL, capacity, split, Geometry(k, m_rounds),
                           costs=(half, ToyCost(verify_bytes=cost.verify_bytes // 2)))
        piped = pipe.round_stream()
        for mode in ("eager", "graph"):
            one = us_per_round(engine, single, lambda: lm.prefill(bufs, PROMPT), tokens, mode)
            two = us_per_round(second, piped, lambda: pipe.prefill_row(0, PROMPT), tokens, mode)
            rows.append(dict(model=name, mode=mode, one_gpu_us_per_round=one, two_stage_us_per_round=two))
            print(f"{name:8} {mode:7} {one:16.1f} {two:19.1f} {two / one:6.2f}", flush=True)
        bufs.free()
    second.close()
    ranks = _nccl_ranks(tokens, k, m_rounds)
    if ranks:
        ones = {row["model"]: row["one_gpu_us_per_round"] for row in rows if row["mode"] == "graph"}
        title = "over NCCL, one process a GPU (benchmarks/ranks.py), graph mode: "
        print(f"{title}{'model':8} {'kind':16} {'us/round':>9} {'vs one GPU':>10}")
        for row in ranks:
            row["vs_one_gpu"] = row["us_per_round"] / ones[row["model"]]
            print(f"{'':{len(title)}}{row['model']:8} {row['kind']:16} {row['us_per_round']:9.1f} "
                  f"{row['vs_one_gpu']:9.2f}x", flush=True)
        rows += ranks
    return rows


def _nccl_ranks(tokens: int, k: int, m_rounds: int) -> list[dict]:
    """benchmarks/ranks.py's rows, from its two ranks started here as torchrun would (rank 0's), or none
    with the reason where NCCL is missing or a rank fails."""
    from memra_cuda.comm import NcclUnavailable, nccl
    from memra_cuda.comm.launch import launch
    try:
        nccl()
    except NcclUnavailable as exc:
        print(f"pipeline over NCCL: skipped ({exc})")
        return []
    # The ranks start where this process did (its directory, its PYTHONPATH): `benchmarks` imports there too.
    ended = launch([sys.executable, "-m", "benchmarks.ranks", str(tokens), str(k), str(m_rounds)], 2, timeout=600)
    lines = [line for line in ended[0].stdout.splitlines() if line.startswith("[")]
    if any(rank.returncode != 0 for rank in ended) or not lines:
        print("pipeline over NCCL: a rank failed:\n" + "\n".join(rank.stderr[-2000:] for rank in ended))
        return []
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=writable, metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--only", choices=["launch", "host", "rounds", "batch", "sampling", "pipeline", "device",
                                           "state", "tree", "torch"],
                        help="run one part (torch runs only when asked for)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run, not for figures)")
    parser.add_argument("--sections", metavar="NAMES", help="with --only torch, these of benchmarks/torch_engine.py's "
                        "sections alone (comma-separated, as headline,trees; default all)")
    args = parser.parse_args(argv)
    if args.sections and args.only != "torch":
        parser.error("--sections names sections of the torch part: give --only torch with it")
    from .torch_engine import SECTIONS  # numpy only: torch and transformers as its sections run
    try:
        sections = listed(args.sections, tuple(SECTIONS)) if args.sections else tuple(SECTIONS)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"--sections: {exc}")
    if args.only == "torch":  # as the other parts' GPU below: said before a section's import or tensor fails
        needs("benchmarks.bench", PAIR, gpu=True)
    try:
        engine = Engine()
    except CudaUnavailable as exc:
        print(f"benchmarks.bench: no GPU to measure on: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    report: dict = {}
    if args.only in (None, "launch"):
        report["launch"] = launch_overhead(engine)
        lo = report["launch"]
        print(f"launch overhead: bare cuLaunchKernel {lo['bare_us']:.2f} us, prepared Launch "
              f"{lo['prepared_us']:.2f} us, ratio {lo['ratio']:.3f}")
    if args.only in (None, "host"):
        report["host"] = bench_host_path(engine, args.quick)
        print(f"host path: bare toy, k={HOST_K}, M={HOST_M}, {HOST_TOKENS} tokens, pace off: " + ", ".join(
            f"{mode} {r['us_per_round']:.1f} us/round (device floor {r['floor_us_per_round']:.1f}, "
            f"{r['us_per_round'] / r['floor_us_per_round']:.2f}x)" for mode, r in report["host"].items()), flush=True)
    if args.only in (None, "rounds"):
        print(f"toy model {MODEL}\n{HEADER}", flush=True)
        rows = bench_rounds(engine, args.quick)
        report["rounds"] = [asdict(r) for r in rows]
        print(f"\n{HEADER}")
        for r in rows:
            print(format_row(r))
    if args.only in (None, "batch"):
        print(f"\nbatches: bare toy, k={BATCH_K}, M={BATCH_M}, graph mode, each request its own prompt")
        report["batch"] = bench_batch(engine, args.quick)
    if args.only in (None, "sampling"):
        print(f"\nsampling: bare toy, k={BATCH_K}, M={BATCH_M}, graph mode; then the acceptance kernel alone")
        report["sampling"] = bench_sampling(engine, args.quick)
    if args.only in (None, "pipeline"):
        print(f"\npipeline: the toy split at layer {len(MODEL.kv_mask) // 2} over two GPUs, k={BATCH_K}, M={BATCH_M}")
        report["pipeline"] = bench_pipeline(engine, args.quick)
    if args.only in (None, "device"):
        print("\ndevice mode: k=4, M=16, each row its own prompt; against the host-driven modes")
        report["device"] = bench_device(engine, args.quick)
        print(summary(report["device"]))
    if args.only in (None, "state"):
        report["state"] = bench_state(engine, args.quick)
    if args.only in (None, "tree"):
        report["tree"] = bench_tree(engine, args.quick)
    if args.only == "torch":
        from .torch_engine import bench_torch
        report["torch"] = bench_torch(args.quick, sections, json_path=args.json)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

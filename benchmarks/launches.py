"""What the GPU waits for between a generation's bursts (issue 47): a burst graph's launch on an
idle GPU against bursts queued back to back, and one request's wall in each of round-stream's
modes, on random-weight bf16 Llamas of the trained pair's shapes (benchmarks.steps' "target 12 x
768" and "draft 2 x 384"), B = 1.

At B = 1 a speculative generation spent about 20% of its wall outside its rounds' verifies and
drafts where the plain loop spent 4% (RESULTS.md, "where a round's time goes at B = 1"), and a
burst's launch was the suspect. Two measurements place it (on an H100 they cleared the launch:
the GPU waits 0.01 to 0.3 ms a burst of 16 rounds; RESULTS.md, "The launch probe"):

- the launch probe: for a graph, the host's time in one launch on an idle GPU ("host"), that
  launch's whole time to its burst's end ("alone") and a burst's time where five are queued back
  to back ("queued": the launches' host time hidden behind the GPU's work); alone - queued is
  what the GPU waits for a launch between bursts in graph mode. On torch graphs of N one-element
  adds, alone and with one more thing a burst graph holds (a copy to pinned memory, a driver
  memset, a branch on a second stream joined again); on the plain loop's burst (GraphedGreedy, 16
  steps); on a chain's (k = 4) and a static tree's (k = 8, a leaf each) burst graph of 16 rounds
  (RoundStream.graph_for's), on the same 16 rounds alone, and on those with their readback (one
  copy to pinned memory, one memset) queued after the graph instead of inside it;
- modes: one request of --prompt tokens and --new new ones in graph, overlap and device mode (the
  fastest of three, after one untimed), its wall, the rounds its row ran and the GPU was sent, and
  the share of the wall the round's verify and draft fill (v + d, each timed alone as a graph);
  the plain loop's wall beside its step. Random weights: the draft is never right, so every
  round makes one token, and a request is many bursts.

    PYTHONPATH=. python -m benchmarks.launches [--new 256] [--prompt 128] [--json PATH] [--quick]

Most of its time is compiling the three decoders' steps (--quick: shorter graphs and a shorter
request, a smoke run).
"""
from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

from .headline import save
from .needs import TORCH, needs
from .torch_common import TORCH_M, bounded, decoder, release, round_costs, time_generations, writable

MODES = ("graph", "overlap", "device")
EXTRAS = ("", "a copy to pinned memory", "a driver memset", "a branch")  # what a synthetic graph holds beside its adds
QUEUED = 10  # bursts queued back to back for a launch's "queued" time (the clock starts after the first)
BURST = TORCH_M  # the rounds (the plain loop's steps) of the bursts probed: M, torch_common.decoder's


def launched(label: str, launch: Callable[[], None], synchronize: Callable[[], None],
             clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """The launch probe of one graph (the module's docstring): `launch` queues it, `synchronize`
    waits for the GPU. One untimed launch first: a graph's first launch also uploads it. The
    queued bursts' clock starts once the first of them is launched: its launch is hidden behind
    no burst, and counted in the bursts' time it hid a share of the wait (where the GPU starts a
    burst while it is being launched, this reads up to a launch's host time / QUEUED short of a
    burst)."""
    launch()
    synchronize()
    begun = clock()
    launch()
    host = clock() - begun
    synchronize()
    alone = clock() - begun
    launch()
    begun = clock()
    for _ in range(QUEUED - 1):
        launch()
    synchronize()
    queued = (clock() - begun) / QUEUED
    return dict(label=label, host_ms=1e3 * host, alone_ms=1e3 * alone, queued_ms=1e3 * queued,
                wait_ms=1e3 * (alone - queued))


def probe_line(row: dict[str, Any]) -> str:
    return (f"launch probe: {row['label']}: the host's launch {row['host_ms']:.3f} ms; one burst alone "
            f"{row['alone_ms']:.3f} ms; queued back to back {row['queued_ms']:.3f} ms a burst: the GPU waits "
            f"{row['wait_ms']:.3f} ms a launch")


def mode_line(name: str, mode: str, row: dict[str, Any]) -> str:
    return (f"modes: {name}, {mode}: {row['tokens']} tokens in {row['rounds']} rounds ({row['sent']} sent) in "
            f"{row['wall_ms']:.2f} ms, {1e3 * row['wall_ms'] / row['rounds']:.1f} us a round; v + d "
            f"{row['vd_us']:.1f} us: {row['busy']:.0%} busy")


def synthetic(adds: Sequence[int]) -> list[dict[str, Any]]:
    """The launch probe on a torch graph of each of `adds` one-element adds with each of EXTRAS."""
    import torch
    from cuda.bindings import driver as cu
    from memra_cuda.torch.adapter import torch_graph
    x, src, other = (torch.zeros(64, device="cuda") for _ in range(3))
    pinned = torch.zeros(64, pin_memory=True)

    def probe(n: int, extra: str) -> dict[str, Any]:
        stream, side = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(stream):
            x.add_(1)  # torch's lazy set-up, outside the capture
        torch.cuda.synchronize()
        with torch_graph(stream) as graph:
            for i in range(n):
                x.add_(1)
                if extra == "a branch" and i == n // 2:
                    side.wait_stream(stream)
                    with torch.cuda.stream(side):
                        other.add_(1)
                    stream.wait_stream(side)
            if extra == "a copy to pinned memory":
                pinned.copy_(src, non_blocking=True)
            elif extra == "a driver memset":
                (err,) = cu.cuMemsetD32Async(other.data_ptr(), 0, other.numel(), stream.cuda_stream)
                if err != cu.CUresult.CUDA_SUCCESS:
                    raise RuntimeError(f"cuMemsetD32Async: {err!r}")

        def replay() -> None:
            with torch.cuda.stream(stream):
                graph.replay()
        return launched(f"{n} adds{' and ' + extra if extra else ''}", replay, torch.cuda.synchronize)

    return [probe(n, extra) for n in adds for extra in EXTRAS]


def spec_rows(name: str, spec: Any, request: Sequence[Any]) -> tuple[dict, list[dict]]:
    """A speculative decoder's rows: its request's wall in each of MODES (busy is speculative()'s),
    then the launch probe on its burst graph of BURST rounds, on the same rounds alone (a graph of
    their own), and on those with the readback queued after them. The rows are done: the rounds
    change nothing, and the probe's bursts need no reading back."""
    import torch
    from memra_cuda import Graph
    modes = {}
    for mode in MODES:
        spec.generate_batch(request, mode)
        walls, before = [], spec.rounds.rounds
        for _ in range(3):
            torch.cuda.synchronize()
            begun = time.perf_counter()
            got = spec.generate_batch(request, mode)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - begun)
        rounds = int(spec.bufs.rounds_run([len(row) for row in got]).max())
        wall_ms = 1e3 * min(walls)
        modes[mode] = dict(tokens=len(got[0]), rounds=rounds, sent=(spec.rounds.rounds - before) // 3,
                           wall_ms=wall_ms)
    round_ = spec.rounds.round
    alone = Graph(spec.engine, functools.partial(round_.issue, BURST), capture=round_.capture, joined=round_.joined)
    def alone_then_readback() -> None:  # the readback's copy and ring reset queued after the graph, not in it
        alone.launch()
        spec.bufs.queue_readback(0)
    probes = [launched(f"{name}, its burst graph of {BURST} rounds (RoundStream.graph_for's: the rounds, and its "
                       "readback where the graph holds it)", spec.rounds.graph_for(0, BURST).launch,
                       torch.cuda.synchronize),
              launched(f"{name}, the same {BURST} rounds alone", alone.launch, torch.cuda.synchronize),
              launched(f"{name}, the same {BURST} rounds alone, their readback queued after the graph",
                       alone_then_readback, torch.cuda.synchronize)]
    for row in probes:
        print(probe_line(row), flush=True)
    return modes, probes


def plain_rows(target: Any, request: Sequence[Any], new: int, prompt: int) -> tuple[dict, dict]:
    """The plain loop's (GraphedGreedy's) wall for the request beside its step, and the launch
    probe on its burst of BURST steps."""
    import torch
    from memra_cuda.torch import GraphedGreedy
    from memra_cuda.torch.timing import replay_ms
    greedy = GraphedGreedy(target, prompt + new + 64, 1, steps=BURST)
    greedy.capture()
    seconds, _ = time_generations(greedy.generate_batch, [request], passes=1)
    wall_ms = 1e3 * seconds
    graph = greedy.graph
    if graph is None:
        raise RuntimeError("GraphedGreedy.capture() left no burst graph to time")
    step_us = 1e3 * replay_ms(graph, greedy.stream) / greedy.steps
    plain = dict(wall_ms=wall_ms, step_us=step_us, busy=new * step_us / (1e3 * wall_ms))
    print(f"modes: plain, graph: {new} tokens in {wall_ms:.2f} ms, {1e3 * wall_ms / new:.1f} us a step; its graph's "
          f"{step_us:.1f} us: {plain['busy']:.0%} busy", flush=True)

    def replay() -> None:
        with torch.cuda.stream(greedy.stream):
            graph.replay()
    probe = launched(f"the plain loop, a burst of {greedy.steps} steps", replay, torch.cuda.synchronize)
    print(probe_line(probe), flush=True)
    return plain, probe


def speculative(name: str, kind: str, config: Any, target: Any, draft: Any, request: Sequence[Any], room: Any,
                step_us: float) -> tuple[dict, list[dict]]:
    """A speculative decoder's config row and its launch probes (spec_rows): the decoder of every
    mode (torch_common.decoder), its generations first, then its verify and draft timed alone
    (torch_common.round_costs, as the headline times them), and each mode's busy share."""
    import torch
    # never skipping: its rows are done when the bursts are probed, and skipped rounds would time nothing
    spec, verify, drafting = decoder(target, kind, config, room, 1, None, draft=draft, modes=MODES, skip_done=False)
    modes, probes = spec_rows(name, spec, request)
    v_us, d_us = (1e3 * ms for ms in round_costs(spec, verify, drafting))
    print(f"{name}: v {v_us:.1f} us ({v_us / step_us:.2f} steps), d {d_us:.1f} us ({d_us / step_us:.2f})", flush=True)
    for mode, row in modes.items():
        row.update(vd_us=v_us + d_us, busy=row["rounds"] * (v_us + d_us) / (1e3 * row["wall_ms"]))
        print(mode_line(name, mode, row), flush=True)
    torch.cuda.synchronize()
    return dict(name=name, v_us=v_us, d_us=d_us, modes=modes), probes


def on_gpu(new: int, prompt: int, adds: Sequence[int]) -> dict[str, Any]:
    """The whole run (the module's docstring), printed as it goes; its report."""
    import numpy as np
    import torch
    from memra_cuda.buffers.tree import TreeShape
    from memra_cuda.torch import Request, Room
    from .steps import SHAPES, build
    report: dict[str, Any] = dict(machine=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), new=new,
                                  prompt=prompt)
    report["synthetic"] = synthetic(adds)
    for row in report["synthetic"]:
        print(probe_line(row), flush=True)
    target, draft = build(SHAPES["target 12 x 768"]), build(SHAPES["draft 2 x 384"])
    request = [Request([int(t) for t in np.random.default_rng(0).integers(1, 8000, prompt)], new, None, 0)]
    report["plain"], probe = plain_rows(target, request, new, prompt)
    report["launches"], report["configs"] = [probe], []
    release()
    for name, kind, config in (("chain k = 4", "chain", 4), ("static k = 8, 1 leaf", "static",
                                                              TreeShape.chain_with_leaves(8, 1))):
        row, probes = speculative(name, kind, config, target, draft, request, Room(prompt, new),
                                  report["plain"]["step_us"])
        report["configs"].append(row)
        report["launches"] += probes
        release()  # the decoder's memory back before the next is built
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.launches", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--new", type=lambda text: bounded(text, 1), default=256, help="new tokens of the request")
    p.add_argument("--prompt", type=lambda text: bounded(text, 2), default=128, help="its prompt's tokens")
    p.add_argument("--json", type=writable, metavar="PATH", help="also write the report here")
    p.add_argument("--quick", action="store_true", help="graphs of 200 adds and a request of 32 new tokens (a smoke "
                   "run, not for figures)")
    args = p.parse_args(argv)
    needs("benchmarks.launches", TORCH, gpu=True)
    report = on_gpu(32 if args.quick else args.new, args.prompt, (200,) if args.quick else (2000, 5000))
    if args.json:
        save(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

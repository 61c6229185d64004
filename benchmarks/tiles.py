"""How memra_cuda.torch.skinny's kernel of a few rows should cut each projection (issue 47): its
Tiles swept over the pair's projections at a verify's rows, each cut's kernel timed on the device
beside the cut skinny.tiles() chooses (a guess from an H200's SM count, which the compiled step kept) and
F.linear's (cuBLAS), and the projections of a whole verify summed under each. Each cut's product
is checked against F.linear's before it is timed (an AssertionError naming it, where it is not).

The projections are a shape's of benchmarks/steps.py (the pair's target by default, --shape):
q, k and v fused, the attention's output, gate and up fused, down (over the gate and up,
SwiGLU's product made in the kernel as a step makes it: skinny.few_rows_gated), the head; bf16,
random weights, ROWS rows (--rows: 5, a chain's verify of k = 4 at B = 1). A cut's time is its kernel's alone,
a launch over each of several copies of the weight captured in one CUDA graph and replayed
between CUDA events (the median of RUNS): the copies pass twice the GPU's L2 cache, so each
launch reads its weight from HBM, as a step does, whose other layers' weights evict it. (Timed
over one weight, which stays in L2, the cuts best alone took 55 µs off a verify's projections on
an H100 and made the compiled verify 3-6% slower: 2026-12-06, RESULTS.md.) A split cut's partial
sums are summed by the kernel after it, which inductor fuses with the residual's add where the
split is small: the step's kernels (benchmarks.steps --few-rows) are the measure of a cut that
wins here. The sweep is in two stages:
the slice (block_n), the split of k (split_k) and block_k at skinny's other defaults; then, for
the FINALISTS fastest of those, the product's orientation (swap), warps and stages. Each line
gives the weight's HBM floor (its bytes over a device-to-device copy's bandwidth, measured here).
Prints, and with --json writes, the best cut of each projection; a verify's sum counts each
layer's four projections once per layer and the head once.

    PYTHONPATH=. python -m benchmarks.tiles [--rows 5,9] [--shape "draft 2 x 384"] [--json PATH]
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from .needs import needs
from .steps import SHAPES, Shape
from .torch_common import listed, writable

ROWS = (5,)
RUNS, REPLAYS = 5, 50
L2_PASSES = 2  # the weight's copies a launch cycles through hold this many times the L2 cache
BLOCK_NS, BLOCK_KS, SPLITS = (16, 32, 64), (64, 128), (1, 2, 3, 4, 6, 8)
SWAPS, WARPS, STAGES = (False, True), (2, 4, 8), (2, 3, 4)
FINALISTS = 2
TOLERANCE = 3e-2  # a cut's bf16 product against F.linear's in fp32 (outputs near 1: bf16 keeps 8 bits)


def projections(shape: Shape) -> dict[str, tuple[int, int]]:
    """Each projection of `shape` as (n, k), the weight's [n][k], as memra_cuda.torch.fused fuses
    them: q, k and v one matrix, gate and up another."""
    dim = shape.hidden // shape.heads
    return {"qkv": ((shape.heads + 2 * shape.kv_heads) * dim, shape.hidden), "o": (shape.hidden, shape.heads * dim),
            "gate_up": (2 * shape.inner, shape.hidden), "down": (shape.hidden, shape.inner),
            "head": (shape.vocab, shape.hidden)}


def verify_us(shape: Shape, us: dict[str, float]) -> float:
    """A verify's projections, in µs, from each projection's (`us`): four a layer, the head once."""
    return shape.layers * sum(us[name] for name in ("qkv", "o", "gate_up", "down")) + us["head"]


def first_cuts(k: int) -> list[Any]:
    """The first stage's cuts of a projection over `k`: every block_n, block_k and split of k that
    gives each slice of k at least one block_k (a later slice past k would add only zeros)."""
    from memra_cuda.torch.skinny import Tiles
    return [Tiles(block_n=n, block_k=bk, split_k=s) for n, bk, s in itertools.product(BLOCK_NS, BLOCK_KS, SPLITS)
            if s <= -(-k // bk)]


def second_cuts(best: Any) -> list[Any]:
    """The second stage's: `best` with every orientation, warps and stages."""
    return [replace(best, swap=swap, warps=warps, stages=stages)
            for swap, warps, stages in itertools.product(SWAPS, WARPS, STAGES)]


def copies_of(weight: Any) -> list[Any]:
    """`weight` and as many copies as make L2_PASSES times the GPU's L2 cache: launches that take
    them in turn read each from HBM."""
    import torch
    l2 = torch.cuda.get_device_properties(weight.device).L2_cache_size
    count = max(2, -(-L2_PASSES * l2 // (weight.numel() * weight.element_size())))
    return [weight, *(weight.clone() for _ in range(count - 1))]


def timed_us(launch: Callable[[Any], None], weights: Sequence[Any]) -> float:
    """µs of one launch(weight): one over each of `weights` captured in a CUDA graph (after one
    eager pass, which compiles), replayed REPLAYS times between events, the median of RUNS."""
    import torch

    from memra_cuda.torch.timing import captured, replay_ms

    def calls() -> None:
        for weight in weights:
            launch(weight)
    stream = torch.cuda.Stream()
    graph = captured(calls, stream)
    return 1000 * statistics.median(replay_ms(graph, stream, REPLAYS) for _ in range(RUNS)) / len(weights)


def sweep(n: int, k: int, rows: int, say: Callable[[str], None] = print, gated: bool = False) -> dict[str, Any]:
    """The cuts of a projection [n][k] at `rows`, timed: F.linear's, tiles()' and the best of the
    sweep; `gated`, the MLP's down as the step runs it (skinny.few_rows_gated: x the fused gate and
    up, [rows][2 k], SwiGLU's product made in the kernel; F.linear's time is its GEMM over the
    product made beforehand, which a step makes in a kernel of its own)."""
    import torch
    import torch.nn.functional as F

    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from memra_cuda.torch.fused import swiglu
    from memra_cuda.torch.skinny import launch, tiles
    x = torch.randn(rows, 2 * k if gated else k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    product = swiglu(x) if gated else x  # F.linear's operand (the kernel rounds once less: within TOLERANCE)
    want = F.linear(product.float(), weight.float())
    weights = copies_of(weight)
    outs: dict[int, torch.Tensor] = {}

    def kernel_us(cut: Any) -> float:
        """The cut's µs; infinite where Triton cannot build it for this GPU (a cut past its shared
        memory or registers: said, and left out of the best)."""
        if cut.split_k not in outs:  # one output a split, made once (partial sums in fp32)
            outs[cut.split_k] = (x.new_empty(cut.split_k, rows, n, dtype=torch.float32) if cut.split_k > 1
                                 else x.new_empty(rows, n))
        out = outs[cut.split_k]
        try:
            launch(x, weight, None, out, cut, gated=gated)
        except (CompilationError, OutOfResources) as exc:
            say(f"    {asdict(cut)}: not built ({type(exc).__name__})")
            return math.inf
        got = (out.sum(0) if cut.split_k > 1 else out).float()
        if not torch.allclose(got, want, rtol=TOLERANCE, atol=TOLERANCE):  # a fast wrong cut is no cut
            raise AssertionError(f"{asdict(cut)} is not F.linear at {n} x {k}: {(got - want).abs().max():.3g} off")
        return timed_us(lambda w: launch(x, w, None, out, cut, gated=gated), weights)
    chosen = tiles(n, k)
    timed: dict[Any, float] = {}
    for cut in [chosen, *first_cuts(k)]:
        timed[cut] = timed[cut] if cut in timed else kernel_us(cut)
    for best in sorted(timed, key=timed.__getitem__)[:FINALISTS]:
        for cut in second_cuts(best):
            timed[cut] = timed[cut] if cut in timed else kernel_us(cut)
    best = min(timed, key=timed.__getitem__)
    cublas = timed_us(lambda w: F.linear(product, w), weights)
    say(f"  {n} x {k}, {rows} rows: F.linear {cublas:.2f} µs | tiles() {timed[chosen]:.2f} µs {asdict(chosen)} | "
        f"best of {len(timed)} {timed[best]:.2f} µs {asdict(best)}")
    return dict(n=n, k=k, rows=rows, cuts=len(timed), cublas_us=round(cublas, 3), chosen=asdict(chosen),
                chosen_us=round(timed[chosen], 3), best=asdict(best), best_us=round(timed[best], 3))


def measure(shape_name: str, rows: Sequence[int], say: Callable[[str], None] = print) -> dict[str, Any]:
    """Every projection of the shape at each of `rows`, and a verify's sum under each choice."""
    from .headline import copy_bandwidth, floor_ms
    shape, bandwidth = SHAPES[shape_name], copy_bandwidth()
    say(f"{shape_name}: device-to-device copy {bandwidth / 1e12:.2f} TB/s")
    report: dict[str, Any] = dict(shape=shape_name, bandwidth=bandwidth, rows={})
    for count in rows:
        figures = {}
        for name, (n, k) in projections(shape).items():
            say(f"{name} (its weight's floor {1e3 * floor_ms(2 * n * k, bandwidth):.2f} µs)")
            figures[name] = sweep(n, k, count, say, gated=name == "down")
        sums = {way: verify_us(shape, {name: f[f"{way}_us"] for name, f in figures.items()})
                for way in ("cublas", "chosen", "best")}
        say(f"a verify's projections at {count} rows: F.linear {sums['cublas']:.1f} µs, tiles() {sums['chosen']:.1f}, "
            f"the best cuts {sums['best']:.1f} ({sums['best'] - sums['chosen']:+.1f})")
        report["rows"][count] = dict(projections=figures, verify_us={way: round(us, 1) for way, us in sums.items()})
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tiles", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=lambda text: listed(text, range(1, 17), int), default=ROWS,
                   help="the rows of each projection, comma-separated, each from 1 to 16 (default 5)")
    p.add_argument("--shape", choices=tuple(SHAPES), default="target 12 x 768", help="the model's shape (default "
                   "the pair's target)")
    p.add_argument("--json", type=writable, metavar="PATH", help="write the figures here")
    args = p.parse_args(argv)
    needs("benchmarks.tiles", ("torch", "triton"), gpu=True)
    report = measure(args.shape, args.rows)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

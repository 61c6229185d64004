"""The step table (issue 47): what one step of a model costs on this GPU, through transformers'
modules (memra_cuda.torch.Stack, the reference) and compiled (CompiledStack, what the decoders
run), beside the step's HBM floor.

Each row is one shape at one batch B and one width T (T = 1: a decode step; T = 5: a chain's
verify of k = 4), bf16, random weights, a static cache of CAPACITY slots of which VALID (--valid)
hold entries (random, never zeros): the step is the greedy step of a graphed decoding (the head's
argmax after each token), captured as a CUDA graph and timed over replays with CUDA events (the
device's time, not the host's). Its figures: milliseconds, the kernels in the graph, the HBM
floor (the bytes of the weights a step reads and of the valid K/V, over a device-to-device
copy's bandwidth measured here) and the compiled step's ratio to it; and how long the compiled
step took to compile the first time it ran (on this process's cache: cold where
TORCHINDUCTOR_CACHE_DIR is empty).

    PYTHONPATH=. python -m benchmarks.steps [--json PATH] [--rows N,...] [--attention sdpa,flex] [--static]
        [--untuned] [--names] [--setup] [--autotune] [--few-rows] [--pdl] [--valid N]

Run time on one H200 (2026-12-04), the first seven rows on a cold inductor cache with --setup:
400 s, most of it compiling.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .headline import copy_bandwidth, floor_ms, streamed_bytes
from .needs import TORCH, needs
from .torch_common import PLAIN_ATTENDS, bounded, listed, writable

CAPACITY, VALID = 576, 512
WIDEST = 16  # the most tokens a row's step may take here (FEW_ROWS' widest; ROWS' is 13): --valid leaves them room


@dataclass(frozen=True)
class Shape:
    """A Llama's shape: the pair's target and draft (benchmarks/pair.py) and two Llamas of 16 layers
    of 2048 (`tied`: the head is the input embedding)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    inner: int
    vocab: int
    tied: bool = False


SHAPES = {
    "target 12 x 768": Shape(12, 768, 12, 12, 2048, 8192),
    "draft 2 x 384": Shape(2, 384, 6, 6, 1024, 8192),
    "Llama 16 x 2048 (0.9 B)": Shape(16, 2048, 16, 8, 5632, 32000),  # memra_cuda.torch.testing's large
    "Llama 3.2 1B shape": Shape(16, 2048, 32, 8, 8192, 128256, tied=True),  # the 1.2 B
}
ROWS = (  # shape, B, T
    ("target 12 x 768", 1, 1), ("target 12 x 768", 64, 1), ("Llama 16 x 2048 (0.9 B)", 1, 1),
    ("Llama 16 x 2048 (0.9 B)", 64, 1), ("draft 2 x 384", 1, 1), ("target 12 x 768", 1, 5),
    ("target 12 x 768", 64, 5), ("Llama 3.2 1B shape", 1, 1), ("Llama 3.2 1B shape", 64, 1),
    ("target 12 x 768", 1, 9), ("target 12 x 768", 8, 1), ("target 12 x 768", 2, 5),  # k = 8; B = 8; B = 2, k = 4
    # the headline's best at B = 1 (chain k = 3 at T = 1, k = 6 greedy; the width of the k = 6 tree with a
    # leaf each, 12 nodes, causal here: its projections' rows), B = 16's step (FEW_ROWS' widest) and the
    # draft's step of two rows (a tree's level)
    ("target 12 x 768", 1, 4), ("target 12 x 768", 1, 7), ("target 12 x 768", 1, 13),
    ("target 12 x 768", 16, 1), ("draft 2 x 384", 1, 2),
    # a decode step at two rows and the draft's at B = 64: where one token's attention turns to flex
    ("target 12 x 768", 2, 1), ("draft 2 x 384", 64, 1),
)


def build(shape: Shape) -> Any:
    """A random-weight bf16 Llama of `shape` on the GPU, for inference."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.inner,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=4096,
                         tie_word_embeddings=shape.tied, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16).eval().requires_grad_(False)


def kv_bytes(shape: Shape, batch: int, valid: int) -> int:
    """Bytes of K and V a step reads: `valid` entries of every layer of `batch` rows, bf16."""
    return 2 * 2 * batch * shape.layers * shape.kv_heads * (shape.hidden // shape.heads) * valid


def kernels(graph: Any) -> int:
    """The kernel nodes of a torch CUDAGraph kept with keep_graph=True."""
    from cuda.bindings import driver
    handle = driver.CUgraph(graph.raw_cuda_graph())
    err, _, count = driver.cuGraphGetNodes(handle, 0)
    err, nodes, count = driver.cuGraphGetNodes(handle, count)
    kinds = [driver.cuGraphNodeGetType(node)[1] for node in nodes]
    return sum(kind == driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL for kind in kinds)


def timed_step(stack: Any, batch: int, tokens: int, replays: int = 100, repeats: int = 7,
               valid: int = VALID) -> dict[str, Any]:
    """A greedy step of `stack` at `valid` entries a row (rows of random tokens), graphed: its median
    device milliseconds over `repeats` runs of `replays` replays, its kernels and the seconds its first
    eager run took (a compiled step's compilation)."""
    import torch

    from memra_cuda.torch.timing import captured, replay_ms
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for cache in (*stack.kv.k, *stack.kv.v):
            cache.normal_()
        stack.kv.lengths.fill_(valid)
        token = torch.randint(0, stack.model.config.vocab_size, (batch, tokens), device="cuda")
        position = (valid + torch.arange(tokens, device="cuda"))[None].expand(batch, tokens)
        out = torch.zeros(batch, tokens, dtype=torch.long, device="cuda")

        def step() -> None:
            torch.argmax(stack.logits(token, position), -1, out=out)
        begun = time.perf_counter()
        step()
        torch.cuda.synchronize()
        first = time.perf_counter() - begun
        graph = captured(step, stream, keep_graph=True)
        graph.instantiate()
    runs = [replay_ms(graph, stream, replays) for _ in range(repeats)]
    return dict(ms=round(statistics.median(runs), 4), spread=round(max(runs) - min(runs), 4), kernels=kernels(graph),
                first_s=round(first, 1))


def kernel_names(stack: Any, batch: int, tokens: int, most: int = 25,
                 valid: int = VALID) -> list[tuple[str, int, float]]:
    """The kernels one eager greedy step of `stack` at `valid` entries a row runs, by name: (name,
    count, total device microseconds), the commonest first (torch's profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    token = torch.zeros(batch, tokens, dtype=torch.long, device="cuda")
    position = (valid + torch.arange(tokens, device="cuda"))[None].expand(batch, tokens)
    stack.logits(token, position).argmax(-1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        stack.logits(token, position).argmax(-1)
        torch.cuda.synchronize()
    rows = [(e.key[:90], e.count, round(e.device_time_total, 1)) for e in prof.key_averages()
            if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])[:most]


def measure(rows: Sequence[tuple[str, int, int]], attentions: Sequence[str], static: bool, untuned: bool = False,
            names: bool = False, say: Callable[[str], None] = print, autotune: bool = False,
            few_rows: bool = False, pdl: bool = False, valid: int = VALID,
            flex_options: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """Every row through the modules and compiled with each attention (and, with `static`, every
    shape compiled apart; with `autotune`, a row of several tokens with its GEMMs autotuned too;
    with `few_rows`, a row of FEW_ROWS rows with its projections through memra_cuda.torch.skinny's
    kernel too: two probes of the verify's GEMMs; with `pdl`, every row attending as the decoders
    attend with its Triton kernels launched by programmatic dependent launch too, a probe of the
    gaps between kernels, and with both, the two together; with `flex_options`, every row of
    several tokens attending through flex with each of those kernel_options too, beside the stack's default
    (with `few_rows`, its projections through skinny's kernel as well): a probe of the attention of
    a verify, whose flex decoding kernel comes with three more a layer), with the floor."""
    import torch
    from memra_cuda.torch import Stack
    from memra_cuda.torch.compiled import FEW_ROWS, CompiledStack, compiled_step
    bandwidth = copy_bandwidth()
    say(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s; cache {CAPACITY} slots, {valid} valid")
    out, models = [], {}
    for name, batch, tokens in rows:
        shape = SHAPES[name]
        if name not in models:
            models[name] = build(shape)
        model = models[name]
        floor = floor_ms(streamed_bytes(model) + kv_bytes(shape, batch, valid), bandwidth)
        row: dict[str, Any] = dict(shape=name, batch=batch, tokens=tokens, floor_ms=round(floor, 4))
        row["modules"] = timed_step(Stack(model, CAPACITY, batch), batch, tokens, valid=valid)
        # tuned None: the decoders' choice (the one-token step of one row tuned, CompiledStack)
        few = few_rows and batch * tokens in FEW_ROWS
        probed = flex_options if tokens > 1 else ()
        variants = [(attention, True, None, "inductor", None) for attention in attentions] + \
            ([(attentions[0], False, None, "inductor", None)] if static else []) + \
            ([(attentions[0], True, False, "inductor", None)] if untuned else []) + \
            ([(attentions[0], True, None, "few_rows", None)] if few else []) + \
            [("flex", True, None, projection, options) for options in probed
             for projection in ("inductor", "few_rows")[:1 + few]]
        for attention, dynamic, tuned, projection, options in variants:
            stack = CompiledStack(model, CAPACITY, batch, attention=attention, dynamic=dynamic,  # type: ignore[arg-type]
                                  tuning=tuned, projection=projection, flex_options=options)  # type: ignore[arg-type]
            key = f"compiled {attention}" + ("" if dynamic else " static") + ("" if tuned is None else " untuned") \
                + ("" if projection == "inductor" else " few rows") + ("" if options is None else f" {options}")
            row[key] = timed_step(stack, batch, tokens, valid=valid)
            if names:
                row[key]["names"] = kernel_names(stack, batch, tokens, valid=valid)
                for name, count, us in row[key]["names"]:
                    say(f"    {key}: {count:4d} x {us:8.1f} us  {name}")
            del stack
        if autotune and tokens > 1:  # the verify's step (flex: its shapes static) with max_autotune_gemm
            stack = CompiledStack(model, CAPACITY, batch, attention="flex")
            stack.wide_step = compiled_step(False, False, autotune=True)
            row["compiled flex autotune"] = timed_step(stack, batch, tokens, valid=valid)
            del stack
        # each width attending and tuned as the decoders do, inductor's kernels launched by PDL; with
        # few_rows, also its projections through skinny's kernel: the two probes together
        both = few_rows and batch * tokens in FEW_ROWS
        for projection in (("inductor", "few_rows") if both else ("inductor",)) if pdl else ():
            stack = CompiledStack(model, CAPACITY, batch, projection=projection)  # type: ignore[arg-type]
            stack.step = compiled_step(True, batch == 1, pdl=True)
            stack.wide_step = compiled_step(True, False, pdl=True)
            row["compiled pdl" + ("" if projection == "inductor" else " few rows")] = timed_step(stack, batch, tokens,
                                                                                                 valid=valid)
            del stack
        out.append(row)
        say(line(row))
        torch.cuda.empty_cache()
    return dict(bandwidth=bandwidth, capacity=CAPACITY, valid=valid, rows=out, device=torch.cuda.get_device_name())


def setup_seconds(k: int = 4, batch: int = 1) -> float:
    """What a SpeculativeLlama of the pair's shapes (random weights, bf16) spends before its first
    request: fusing, compiling every step it runs (its warm-up round) and capturing every graph."""
    from memra_cuda.torch import Room, SpeculativeLlama
    from torch._dynamo.utils import compile_times, counters
    target, draft = build(SHAPES["target 12 x 768"]), build(SHAPES["draft 2 x 384"])
    spec = SpeculativeLlama(target, draft, k=k, m_rounds=16, batch=batch, capacity=Room(128, 128))
    built = spec.setup_seconds
    spec.capture()
    print(f"a chain decoder of the pair's shapes (k = {k}, B = {batch}) was ready in {spec.setup_seconds:.1f} s "
          f"(fusing, compiling, capturing; {built:.1f} s of it before capture())")
    # where a cold setup's time went: each compiled function's compiles, and inductor's cache
    print(compile_times(repr="str", aggregate=True))
    print("inductor:", {key: value for key, value in sorted(counters["inductor"].items()) if "cache" in key})
    return spec.setup_seconds


def valid_entries(text: str) -> int:
    """--valid's N: the entries a row holds, from 1 to CAPACITY - WIDEST (argparse's type: another
    is its error, where a step's tokens would have run past the cache)."""
    return bounded(text, 1, CAPACITY - WIDEST)


def kernel_options(text: str) -> dict[str, Any]:
    """--flex-options' JSON object (argparse's type: anything else is its error, before any GPU work)."""
    try:
        options = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(options, dict):
        raise argparse.ArgumentTypeError(f"a JSON object of kernel_options by name, not {text!r}")
    return options


def line(row: dict[str, Any]) -> str:
    """One row of the table as text."""
    parts = [f"{row['shape']:<16} B={row['batch']:<3} T={row['tokens']}  floor {row['floor_ms']:.3f} ms"]
    for key, value in row.items():
        if isinstance(value, dict):
            parts.append(f"{key}: {value['ms']:.3f} ms ({value['kernels']} kernels, "
                         f"{value['ms'] / row['floor_ms']:.1f}x floor, first run {value['first_s']} s)")
    return " | ".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.steps", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=writable, metavar="PATH", help="write the figures here")
    p.add_argument("--rows", type=lambda text: listed(text, range(len(ROWS)), int),
                   help="the rows to run, by index (0-based), comma-separated (default all)")
    p.add_argument("--attention", type=lambda text: listed(text, PLAIN_ATTENDS), default="flex,sdpa",
                   help="compiled attentions to measure, each once (default flex,sdpa)")
    p.add_argument("--static", action="store_true", help="also the first attention compiled per shape")
    p.add_argument("--untuned", action="store_true", help="also the first attention without coordinate descent tuning")
    p.add_argument("--setup", action="store_true", help="first, the seconds a chain decoder of the pair's shapes "
                   "(k = 4, B = 1) spends compiling and capturing before its first request")
    p.add_argument("--names", action="store_true", help="the kernels of each compiled step, by name")
    p.add_argument("--autotune", action="store_true", help="also each row of several tokens with inductor's "
                   "max_autotune_gemm (Triton GEMM templates benchmarked at compile: slow to compile)")
    p.add_argument("--few-rows", action="store_true", help="also each row of 2 to 16 rows with its projections "
                   "through memra_cuda.torch.skinny's Triton kernel (CompiledStack's projection 'few_rows')")
    p.add_argument("--pdl", action="store_true", help="also each row, attending as the decoders do, with inductor's "
                   "Triton kernels launched by programmatic dependent launch (triton.enable_pdl); with --few-rows, "
                   "also both")
    p.add_argument("--flex-options", type=kernel_options, metavar="JSON", action="append", default=[],
                   help="also each row of several tokens attending through flex with these kernel_options (a JSON "
                   "object, e.g. '{\"FORCE_USE_FLEX_ATTENTION\": true}': one kernel a layer, not flex decoding's "
                   "four; '{}': torch's own choice, where the default gives a verify of one row "
                   "compiled.ONE_ROW_VERIFY); given again, each set apart")
    p.add_argument("--valid", type=valid_entries, default=VALID, help=f"the entries each row holds of the cache's "
                   f"{CAPACITY} (default {VALID}; from 1 to {CAPACITY - WIDEST}): SDPA reads the whole cache, flex "
                   "only what rows hold, so a served stream's rows, far from full, are measured at fewer")
    args = p.parse_args(argv)
    needs("benchmarks.steps", TORCH, gpu=True)
    rows = ROWS if args.rows is None else [ROWS[i] for i in args.rows]  # indices checked at parsing: -1 was the last
    setup = setup_seconds() if args.setup else None
    report = measure(rows, args.attention, args.static, args.untuned, args.names, autotune=args.autotune,
                     few_rows=args.few_rows, pdl=args.pdl, valid=args.valid, flex_options=args.flex_options)
    report["setup_seconds"] = setup
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

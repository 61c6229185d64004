"""`make bench-torch`: round-stream on a real transformer (examples/torch_llama.py), in one run.

1. One request, at two sizes (fp32 small, bf16 large): Hugging Face generate, its assisted
   generation with the same draft, plain greedy run eagerly and with each step a torch.cuda.graph, and
   round-stream in readback, graph, overlap and device modes; then the ideal speculative speedup over
   graphed greedy, tau / (1 + (k+1) c), and how much of it graph mode reaches, and the same for
   the work the example's round does (a verify of k+1 tokens, a draft step over two tokens and
   k-1 over one).
2. Batches, B in BATCHES (per size), prompts of 2 to 40 tokens: tokens/s of Hugging Face generate
   (left-padded; greedy and sampling), of batched greedy with each step a torch graph, and of
   round-stream graph mode (greedy and sampling at T = 1), with acceptance and the ratio to
   batched graphed greedy.
3. Continuous batching: 64 requests of mixed prompt and output lengths through 8 slots
   (SpeculativeLlama.serve), tokens/s and p50/p99 request latency (all arrive at once), against
   the same requests one at a time through round-stream and through graphed greedy.
4. Hybrid: the small model with layers HYBRID a gated linear recurrence, B in HYBRID_BATCHES,
   its state rolled back by copy and by flip, round-stream graph and overlap modes against the
   same model's plain greedy with each step a torch graph, and whether the tokens are its.

Needs torch and transformers, and the source checkout (the example is not in the wheel).

    PYTHONPATH=. python -m memra_cuda.bench_torch [--quick] [one_request|batches|serving|hybrid ...]

runs some sections alone (`make bench-torch` runs them all).
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

TORCH_K, TORCH_M = 4, 16
BATCHES = {"small": (1, 8, 32, 128, 512), "large": (1, 8, 32, 128)}
SERVED, SLOTS = 64, 8
HYBRID_BATCHES = (1, 8)


def load_example() -> Any:
    """examples/torch_llama.py, from the source checkout the bench runs in. An installed package
    has no examples/: say so in one line, not a traceback."""
    path = Path(__file__).resolve().parents[1] / "examples" / "torch_llama.py"
    if not path.is_file():
        raise SystemExit("memra_cuda.bench: the PyTorch example is examples/torch_llama.py of the source "
                         "repository, not part of the installed package: run `make bench-torch` from a checkout")
    spec = importlib.util.spec_from_file_location("torch_llama", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def _timed(run: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds of run() after one untimed warm-up run (graph captures, first loads)."""
    import torch
    run()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = run()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def _tokens_per_s(run: Callable[[int], list[int]], tokens: int) -> tuple[float, list[int]]:
    seconds, out = _timed(lambda: run(tokens))
    return len(out) / seconds, out


def _step_ms(step: Callable[..., Any], tokens: int = 1, replays: int = 200, **kwargs: Any) -> float:
    """Device milliseconds of step(tokens, positions) over `tokens` tokens of one row, captured
    as a graph and replayed."""
    import torch
    token = torch.zeros(1, tokens, dtype=torch.long, device="cuda")
    position = torch.arange(8, 8 + tokens, device="cuda")[None]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step(token, position, **kwargs)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            step(token, position, **kwargs)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / replays


def bench_one_request(llama: Any, quick: bool) -> list[dict]:
    rows: list[dict] = []
    print(f"{'size':6} {'method':22} {'tokens/s':>9} {'accept':>6} {'vs greedy':>9} {'vs HF assisted':>14}")
    for size in ("small", "large"):
        tokens = 64 if quick else 256
        model = llama.build_model(size)
        capacity = llama.capacity_for(len(llama.PROMPT), tokens, TORCH_K, TORCH_M)
        draft = llama.draft_model(model)
        spec = llama.SpeculativeLlama(model, k=TORCH_K, m_rounds=TORCH_M, capacity=capacity)
        greedy = llama.GraphedGreedy(model, capacity)
        eager = llama.GraphedGreedy(model, capacity, eager=True)
        methods = {
            "HF generate": (lambda n: llama.hf_greedy(model, llama.PROMPT, n), None),
            "HF assisted": (lambda n: llama.hf_greedy(model, llama.PROMPT, n, assistant=draft, k=TORCH_K), None),
            "greedy, eager loop": (lambda n: eager.generate(llama.PROMPT, n), None),
            "greedy, torch graph": (lambda n: greedy.generate(llama.PROMPT, n), None),
        }
        for mode in ("readback", "graph", "overlap", "device"):
            methods[f"round-stream {mode}"] = (lambda n, mode=mode: spec.generate(llama.PROMPT, n, mode=mode), spec)
        measured = {}
        for name, (run, speculative) in methods.items():
            rate, out = _tokens_per_s(run, tokens)
            measured[name] = row = dict(size=size, method=name, tokens_per_s=rate, acceptance=None)
            if speculative is not None:
                accepted, drafted = speculative.bufs.drafts_accepted(len(out))
                if drafted:  # a budget the first round meets drafts nothing to count
                    row.update(acceptance=accepted / drafted, tokens_per_round=len(out) * TORCH_K / drafted)
        for row in measured.values():
            row["vs_greedy"] = row["tokens_per_s"] / measured["greedy, torch graph"]["tokens_per_s"]
            row["vs_hf_assisted"] = row["tokens_per_s"] / measured["HF assisted"]["tokens_per_s"]
            accept = f"{row['acceptance']:6.2f}" if row["acceptance"] is not None else f"{'-':>6}"
            print(f"{size:6} {row['method']:22} {row['tokens_per_s']:9.0f} {accept} {row['vs_greedy']:8.2f}x "
                  f"{row['vs_hf_assisted']:13.2f}x", flush=True)
            rows.append(row)
        graph = measured["round-stream graph"]
        tau = graph["tokens_per_round"]
        target_ms = _step_ms(spec.target.greedy)
        c = _step_ms(spec.draft.greedy) / target_ms
        v = _step_ms(spec.verify, TORCH_K + 1) / target_ms  # the formula takes a verify for one step
        c2 = _step_ms(spec.draft.logits, 2, last=True) / target_ms
        ideal = tau / (1 + (TORCH_K + 1) * c)
        reached = graph["vs_greedy"] / ideal
        print(f"{size:6} ideal speedup over graphed greedy: tau={tau:.2f} tokens/round, c={c:.3f} "
              f"(draft step / target step) -> {ideal:.2f}x; graph mode reaches {graph['vs_greedy']:.2f}x "
              f"= {reached:.0%} of it", flush=True)
        own = tau / (v + c2 + (TORCH_K - 1) * c)
        print(f"{size:6} the example's round: a verify of k+1={TORCH_K + 1} tokens (v={v:.2f} target steps), "
              f"a draft step over 2 tokens (c2={c2:.3f}) and k-1 over one: tau / (v + c2 + (k-1) c) = "
              f"{own:.2f}x; graph mode reaches {graph['vs_greedy'] / own:.0%} of it", flush=True)
        rows.append(dict(size=size, method="ideal", tau=tau, c=c, c2=c2, v=v, ideal=ideal, reached=reached,
                         round_ideal=own, round_reached=graph["vs_greedy"] / own))
    return rows


def bench_batches(llama: Any, quick: bool) -> list[dict]:
    """Section 2: every method on the same B requests, tokens/s over all rows."""
    rows: list[dict] = []
    tokens = 32 if quick else 128
    print(f"\nbatches: k={TORCH_K}, M={TORCH_M}, {tokens} tokens a row, prompts of 2 to 40 tokens; sampling at T=1")
    print(f"{'size':6} {'B':>4} {'method':30} {'tokens/s':>9} {'accept':>6} {'vs batched graphed greedy':>26}")
    for size in ("small", "large"):
        model = llama.build_model(size)
        for batch in BATCHES[size]:
            rows += _bench_batch(llama, model, size, batch, tokens)
    return rows


def _bench_batch(llama: Any, model: Any, size: str, batch: int, tokens: int) -> list[dict]:
    """One size and B of section 2 (its caches and graphs go when it returns)."""
    sampling = llama.SamplingParams(1.0)
    prompts = llama.prompts(batch, seed=batch)
    requests = [llama.Request(prompt, tokens, None, seed) for seed, prompt in enumerate(prompts)]
    capacity = llama.capacity_for(max(map(len, prompts)), tokens, TORCH_K, TORCH_M, batch)
    greedy = llama.GraphedGreedy(model, capacity, batch)
    spec = llama.SpeculativeLlama(model, k=TORCH_K, m_rounds=TORCH_M, capacity=capacity, batch=batch)
    sampler = llama.SpeculativeLlama(model, k=TORCH_K, m_rounds=TORCH_M, capacity=capacity, batch=batch,
                                     sampling=sampling)
    methods = {
        "HF generate, greedy": (lambda: llama.hf_generate(model, prompts, tokens), None),
        "HF generate, sampling": (lambda: llama.hf_generate(model, prompts, tokens, sampling=sampling), None),
        "batched greedy, torch graph": (lambda: greedy.generate_batch(requests), None),
        "round-stream graph, greedy": (lambda: spec.generate_batch(requests), spec),
        "round-stream graph, sampling": (lambda: sampler.generate_batch(requests), sampler),
    }
    measured = {}
    for name, (run, speculative) in methods.items():
        seconds, out = _timed(run)
        count = sum(map(len, out))
        measured[name] = row = dict(size=size, batch=batch, method=name, tokens_per_s=count / seconds,
                                    acceptance=None)
        if speculative is not None:
            row["acceptance"] = speculative.acceptance([len(r) for r in out])
    for row in measured.values():
        row["vs_batched_greedy"] = row["tokens_per_s"] / measured["batched greedy, torch graph"]["tokens_per_s"]
        accept = f"{row['acceptance']:6.2f}" if row["acceptance"] is not None else f"{'-':>6}"
        print(f"{size:6} {batch:4} {row['method']:30} {row['tokens_per_s']:9.0f} {accept} "
              f"{row['vs_batched_greedy']:25.2f}x", flush=True)
    return list(measured.values())


def bench_serving(llama: Any, quick: bool) -> list[dict]:
    """Section 3: continuous batching against one request at a time."""
    import numpy as np
    gen = np.random.default_rng(64)
    count = 16 if quick else SERVED
    prompts = llama.prompts(count, seed=64)
    budgets = gen.integers(16, 193, count).tolist()
    requests = [llama.Request(prompt, budget) for prompt, budget in zip(prompts, budgets)]
    model = llama.build_model("small")
    capacity = llama.capacity_for(40, 192, TORCH_K, TORCH_M, SLOTS)
    server = llama.SpeculativeLlama(model, k=TORCH_K, m_rounds=TORCH_M, capacity=capacity, batch=SLOTS)
    server.capture()
    alone = llama.SpeculativeLlama(model, k=TORCH_K, m_rounds=TORCH_M,
                                   capacity=llama.capacity_for(40, 192, TORCH_K, TORCH_M))
    alone.capture()
    greedy = llama.GraphedGreedy(model, capacity)

    def one_at_a_time(generate: Callable[[Any], list[int]]) -> list[Any]:
        begun, out = time.perf_counter(), []
        for request in requests:
            tokens = generate(request)
            out.append(llama.Served(tokens, time.perf_counter() - begun))
        return out

    methods = {
        f"round-stream serve, {SLOTS} slots": lambda: server.serve(requests),
        "round-stream, one at a time": lambda: one_at_a_time(lambda r: alone.generate(r.prompt, r.max_new_tokens)),
        "graphed greedy, one at a time": lambda: one_at_a_time(lambda r: greedy.generate(r.prompt, r.max_new_tokens)),
    }
    print(f"\ncontinuous batching: small model, {count} requests (prompts of 2 to 40 tokens, 16 to 192 new tokens), "
          f"k={TORCH_K}, M={TORCH_M}, graph mode; latency from the start, all requests arriving at once")
    print(f"{'method':34} {'tokens/s':>9} {'p50 latency s':>13} {'p99 latency s':>13} {'total s':>8}")
    rows = []
    for name, run in methods.items():
        seconds, served = _timed(run)
        latencies = sorted(s.latency for s in served)
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        row = dict(method=name, tokens_per_s=sum(len(s.tokens) for s in served) / seconds,
                   p50_s=statistics.median(latencies), p99_s=p99, total_s=seconds)
        print(f"{name:34} {row['tokens_per_s']:9.0f} {row['p50_s']:13.3f} {p99:13.3f} {seconds:8.2f}", flush=True)
        rows.append(row)
    return rows


def bench_hybrid(llama: Any, quick: bool) -> list[dict]:
    """Section 4: the hybrid model against its own graphed plain greedy, tokens/s over all rows."""
    tokens = 64 if quick else 256
    model = llama.build_model("small", recurrent_layers=llama.HYBRID)
    print(f"\nhybrid: small model, layers {llama.HYBRID} a gated linear recurrence, k={TORCH_K}, M={TORCH_M}, "
          f"{tokens} tokens a row")
    print(f"{'B':>4} {'method':28} {'tokens/s':>9} {'accept':>6} {'vs graphed greedy':>18} {'same tokens':>11}")
    rows: list[dict] = []
    for batch in HYBRID_BATCHES:
        rows += _bench_hybrid_batch(llama, model, batch, tokens)
    return rows


def _bench_hybrid_batch(llama: Any, model: Any, batch: int, tokens: int) -> list[dict]:
    """One B of section 4 (its caches, states and graphs go when it returns)."""
    prompts = [llama.PROMPT] if batch == 1 else llama.prompts(batch, seed=batch)
    requests = [llama.Request(prompt, tokens) for prompt in prompts]
    capacity = llama.capacity_for(max(map(len, prompts)), tokens, TORCH_K, TORCH_M, batch)
    greedy = llama.GraphedGreedy(model, capacity, batch)
    methods: dict[str, tuple[Callable[[], Any], Any]] = {
        "plain greedy, torch graph": (lambda: greedy.generate_batch(requests), None)}
    for state in ("copy", "flip"):
        spec = llama.SpeculativeLlama(model, k=TORCH_K, m_rounds=TORCH_M, capacity=capacity, batch=batch,
                                      state_rollback=state)
        for mode in ("graph", "overlap"):
            methods[f"round-stream {mode}, {state}"] = (
                lambda spec=spec, mode=mode: spec.generate_batch(requests, mode), spec)
    measured, outputs = {}, {}
    for name, (run, speculative) in methods.items():
        seconds, outputs[name] = _timed(run)
        measured[name] = row = dict(batch=batch, method=name, tokens_per_s=sum(map(len, outputs[name])) / seconds,
                                    acceptance=None)
        if speculative is not None:
            row["acceptance"] = speculative.acceptance([len(r) for r in outputs[name]])
    reference = "plain greedy, torch graph"
    for name, row in measured.items():
        row["vs_graphed_greedy"] = row["tokens_per_s"] / measured[reference]["tokens_per_s"]
        row["same_tokens"] = outputs[name] == outputs[reference]
        accept = f"{row['acceptance']:6.2f}" if row["acceptance"] is not None else f"{'-':>6}"
        print(f"{batch:4} {row['method']:28} {row['tokens_per_s']:9.0f} {accept} {row['vs_graphed_greedy']:17.2f}x "
              f"{'yes' if row['same_tokens'] else 'NO':>11}", flush=True)
    return list(measured.values())


SECTIONS = {"one_request": bench_one_request, "batches": bench_batches, "serving": bench_serving,
            "hybrid": bench_hybrid}


def bench_torch(quick: bool, sections: Sequence[str] = tuple(SECTIONS)) -> dict[str, list[dict]]:
    llama = load_example()
    return {name: SECTIONS[name](llama, quick) for name in sections}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="round-stream on examples/torch_llama.py, some sections alone")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("sections", nargs="*", help=f"any of {', '.join(SECTIONS)} (default: all)")
    args = parser.parse_args()
    if set(args.sections) - set(SECTIONS):
        parser.error(f"sections are {', '.join(SECTIONS)}, not {', '.join(sorted(set(args.sections) - set(SECTIONS)))}")
    bench_torch(args.quick, args.sections or tuple(SECTIONS))

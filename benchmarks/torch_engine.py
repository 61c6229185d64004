"""`make bench-torch`: round-stream on a real transformer (memra_cuda.torch's decoders on a trained
target and draft, then on the random-weight Llamas of memra_cuda.torch.testing), in one run.

0. The headline (benchmarks/headline.py, whose docstring says what it measures): the pair
   benchmarks/pair.py trains (`make pair`, which `make bench-torch` runs first), prompts cut from
   its held-out files, B in TREE_BATCHES, greedy and sampled: the target's graphed greedy
   decoding beside its weights' HBM floor, chains, static and dynamic trees against their ideal,
   Hugging Face's assisted generation with the same pair, and tree_for_batch's picks derived on
   it. With a JSON path, its figures as each B ends (PATH's .headline.json) and a picture (.headline.png).
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
3. Continuous batching: 64 requests of mixed prompt and output lengths (benchmarks/serving.py's
   stream) through 8 slots, speculative and plain alike (SpeculativeLlama.serve,
   GraphedGreedy.serve), and through one slot each (a request at a time): tokens/s, time to
   first token and time between tokens, p50 and p99 (all arrive at once).
4. Hybrid: the small model with layers HYBRID a gated linear recurrence, B in HYBRID_BATCHES,
   its state rolled back by copy and by flip, round-stream graph and overlap modes against the
   same model's plain greedy with each step a torch graph, and whether the tokens are its.
5. Trees (memra_cuda.torch.TreeLlama), both sizes, B in TREE_BATCHES, greedy and sampling at T = 1,
   the head's logits scaled by TREE_LOGIT_SCALE: tokens/s of chains (CHAIN_KS), static trees
   (STATIC_TREES: likeliest trees and chains with leaves) and dynamic trees (DYNAMIC) at each B,
   and of the trees tree_for_batch picks, against graphed plain greedy; per configuration its
   tokens per round tau, its verify's and draft's device time in target steps (v, d), the ideal
   tau / (v + d) and how much of it it reaches, the rows' mean rounds over the slowest row's
   (rows) and how much of the batch's own ideal, ideal x rows, it reaches (batch: reach()); per
   B the best chain, static and dynamic tree, and the pick against the best chain.
   With a JSON path, a picture beside it (matplotlib, the `plot` extra): tokens/s against B.
6. Tree costs, B = 1, both sizes: a chain's draft step and verify, each draft level of a static
   tree and its verify, the whole target over 1 to 65 tokens through cuBLASLt and cuBLAS,
   torch.topk against two argmaxes, each captured alone, in target steps: where a tree's round
   goes, and what Stack.kernels is chosen by (benchmarks/RESULTS.md, "The PyTorch engine's kernels").

Needs torch and transformers (the headline tokenizers too: it finds the pair by pair.py's key),
and the source checkout (the benchmarks are not in the wheel).

    PYTHONPATH=. python -m benchmarks.torch_engine [--quick] [--json PATH]
        [--tree-sizes small,large] [--tree-batches 1,8,32,128]
        [headline|one_request|batches|serving|hybrid|trees|tree_costs ...]

runs some sections alone (`make bench-torch` runs them all), the trees section at some sizes and
batch sizes alone where asked.
"""
from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .common import depth_and_width
from .headline import headline
from .needs import PAIR, needs
from .serving import figures, request_stream
from .torch_common import (TORCH_K, TORCH_M, TREE_BATCHES, decoder, listed, measure_config, plain_decoding,
                           plot_trees, release, row_label, summary_line, time_generations, tree_label, tree_summary,
                           writable)
from memra_cuda import Geometry
from memra_cuda.buffers.tree import DynamicTree

BATCHES = {"small": (1, 8, 32, 128, 512), "large": (1, 8, 32, 128)}
SERVED, SLOTS = 64, 8
SERVED_BUDGETS = (16, 192)  # section 3's requests' new tokens, fewest and most
HYBRID_BATCHES = (1, 8)
# The head's scale for section 5, a trained model's confidence. Greedy tokens are the same at any
# scale (argmax does not move), but a random model's near-flat log-probabilities would leave the
# dynamic tree's ranking by cumulative draft log-probability nothing to rank by.
TREE_LOGIT_SCALE = 4.0
COST_K = 10  # the chain tree_costs sets against a static tree of 64 drafts, 10 deep
# Section 5's candidates at each B: they shrink as B grows, since a verify of T + 1 tokens a row
# is nearly free at B = 1 and costs about T + 1 target steps once the GEMMs are compute-bound.
CHAIN_KS = {1: (8, 10, 12), 8: (6, 8, 10), 32: (4, 6, 8), 128: (2, 3, 4)}
# memra_cuda.torch.testing.parse_tree's names: static_tree of T drafts and a depth, or a chain of k with leaves
STATIC_TREES = {1: ("static:32,8", "static:64,10", "static:128,12", "chain:10,2"),
                8: ("static:16,6", "static:32,8", "static:64,10", "chain:8,1"), 32: ("static:8,6", "static:12,6"),
                128: ("static:3,3", "static:6,4")}
DYNAMIC = {1: (DynamicTree(10, 4, 4),), 8: (DynamicTree(8, 2, 2),), 32: (DynamicTree(6, 2, 2),),
           128: (DynamicTree(3, 2, 2),)}


def _timed(run: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds of run() after one untimed warm-up run (graph captures, first loads), and its output."""
    seconds, (out,) = time_generations(lambda _: run(), [None], passes=1)
    return seconds, out


def _tokens_per_s(run: Callable[[int], list[int]], tokens: int) -> tuple[float, list[int]]:
    seconds, out = _timed(lambda: run(tokens))
    return len(out) / seconds, out


def _step_ms(step: Callable[..., Any], tokens: int = 1, replays: int = 200, **kwargs: Any) -> float:
    """Device milliseconds of step(tokens, positions) over `tokens` tokens of one row, captured
    as a graph and replayed."""
    import torch
    from memra_cuda.torch.timing import graph_ms
    token = torch.zeros(1, tokens, dtype=torch.long, device="cuda")
    position = torch.arange(8, 8 + tokens, device="cuda")[None]
    return graph_ms(lambda: step(token, position, **kwargs), replays=replays)


def bench_one_request(quick: bool) -> list[dict]:
    from memra_cuda.torch.testing import PROMPT, build_model
    from memra_cuda.torch import GraphedGreedy, SpeculativeLlama, capacity_for, hf_greedy, self_draft
    rows: list[dict] = []
    print(f"{'size':6} {'method':22} {'tokens/s':>9} {'accept':>6} {'vs greedy':>9} {'vs HF assisted':>14}")
    for size in ("small", "large"):
        tokens = 64 if quick else 256
        model = build_model(size)
        capacity = capacity_for(len(PROMPT), tokens, Geometry(TORCH_K, TORCH_M))
        draft = self_draft(model)
        spec = SpeculativeLlama(model, draft, k=TORCH_K, m_rounds=TORCH_M, capacity=capacity)
        greedy = GraphedGreedy(model, capacity)
        eager = GraphedGreedy(model, capacity, eager=True)
        methods: dict[str, tuple[Callable[[int], list[int]], SpeculativeLlama | None]] = {
            "HF generate": (lambda n: hf_greedy(model, PROMPT, n), None),
            "HF assisted": (lambda n: hf_greedy(model, PROMPT, n, assistant=draft, k=TORCH_K), None),
            "greedy, eager loop": (lambda n: eager.generate(PROMPT, n), None),
            "greedy, torch graph": (lambda n: greedy.generate(PROMPT, n), None),
        }
        for mode in ("readback", "graph", "overlap", "device"):
            methods[f"round-stream {mode}"] = (functools.partial(spec.generate, PROMPT, mode=mode), spec)
        measured: dict[str, dict[str, Any]] = {}
        for name, (run, speculative) in methods.items():
            rate, out = _tokens_per_s(run, tokens)
            measured[name] = row = dict(size=size, method=name, tokens_per_s=rate, acceptance=None)
            if speculative is not None:
                accepted, drafted = speculative.bufs.drafts_accepted(len(out))
                if drafted:  # a budget the first round meets drafts nothing to count
                    row.update(acceptance=accepted / drafted,
                               tokens_per_round=speculative.bufs.tokens_per_round(len(out)))
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
        v = _step_ms(spec.target.logits, TORCH_K + 1) / target_ms  # the formula takes a verify for one step
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


def bench_batches(quick: bool) -> list[dict]:
    """Section 2: every method on the same B requests, tokens/s over all rows."""
    from memra_cuda.torch.testing import build_model
    rows: list[dict] = []
    tokens = 32 if quick else 128
    print(f"\nbatches: k={TORCH_K}, M={TORCH_M}, {tokens} tokens a row, prompts of 2 to 40 tokens; sampling at T=1")
    print(f"{'size':6} {'B':>4} {'method':30} {'tokens/s':>9} {'accept':>6} {'vs batched graphed greedy':>26}")
    for size in ("small", "large"):
        model = build_model(size)
        for batch in BATCHES[size]:
            rows += _bench_batch(model, size, batch, tokens)
    return rows


def _bench_batch(model: Any, size: str, batch: int, tokens: int) -> list[dict]:
    """One size and B of section 2 (its caches and graphs go when it returns)."""
    from memra_cuda.torch.testing import prompts as some_prompts
    from memra_cuda.torch import (GraphedGreedy, Request, SamplingParams, SpeculativeLlama, capacity_for,
                                  hf_generate, self_draft)
    sampling = SamplingParams(1.0)
    prompts = some_prompts(batch, seed=batch)
    requests = [Request(prompt, tokens, None, seed) for seed, prompt in enumerate(prompts)]
    capacity = capacity_for(max(map(len, prompts)), tokens, Geometry(TORCH_K, TORCH_M, batch))
    greedy = GraphedGreedy(model, capacity, batch)
    spec = SpeculativeLlama(model, self_draft(model), k=TORCH_K, m_rounds=TORCH_M, capacity=capacity, batch=batch)
    sampler = SpeculativeLlama(model, self_draft(model), k=TORCH_K, m_rounds=TORCH_M, capacity=capacity, batch=batch,
                               sampling=sampling)
    methods = {
        "HF generate, greedy": (lambda: hf_generate(model, prompts, tokens), None),
        "HF generate, sampling": (lambda: hf_generate(model, prompts, tokens, sampling=sampling), None),
        "batched greedy, torch graph": (lambda: greedy.generate_batch(requests), None),
        "round-stream graph, greedy": (lambda: spec.generate_batch(requests), spec),
        "round-stream graph, sampling": (lambda: sampler.generate_batch(requests), sampler),
    }
    measured: dict[str, dict[str, Any]] = {}
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


def bench_serving(quick: bool) -> list[dict]:
    """Section 3: one request stream served through SLOTS slots by continuous batching,
    speculative and plain alike (SpeculativeLlama.serve, GraphedGreedy.serve: one Server), and
    through one slot (a request at a time), every request arriving at the start: tokens/s, time to
    first token and time between tokens (benchmarks/serving.py says how each is taken)."""
    from memra_cuda.torch.testing import build_model
    from memra_cuda.torch.testing import prompts as some_prompts
    from memra_cuda.torch import GraphedGreedy, SpeculativeLlama, capacity_for, self_draft
    count = 16 if quick else SERVED
    requests = request_stream(some_prompts(count, seed=64), seed=64, budgets=SERVED_BUDGETS)
    model = build_model("small")

    def capacity(batch: int) -> int:
        return capacity_for(40, SERVED_BUDGETS[1], Geometry(TORCH_K, TORCH_M, batch))

    def speculative(batch: int) -> Any:
        spec = SpeculativeLlama(model, self_draft(model), k=TORCH_K, m_rounds=TORCH_M, capacity=capacity(batch),
                                batch=batch)
        spec.capture()
        return spec

    servers = {f"round-stream serve, {SLOTS} slots": speculative(SLOTS),
               f"graphed greedy serve, {SLOTS} slots": GraphedGreedy(model, capacity(SLOTS), SLOTS),
               "round-stream, one at a time": speculative(1),
               "graphed greedy, one at a time": GraphedGreedy(model, capacity(1))}
    print(f"\ncontinuous batching: small model, {count} requests (prompts of 2 to 40 tokens, {SERVED_BUDGETS[0]} to "
          f"{SERVED_BUDGETS[1]} new tokens), k={TORCH_K}, M={TORCH_M}, graph mode; all requests arriving at once")
    print(f"{'method':34} {'tokens/s':>9} {'TTFT p50 ms':>11} {'p99':>8} {'TBT p50 ms':>10} {'p99':>8} {'total s':>8}")
    rows = []
    for name, server in servers.items():
        seconds, served = _timed(lambda: server.serve(requests))
        row: dict[str, Any] = dict(method=name, **figures(served), total_s=seconds)
        print(f"{name:34} {row['tokens_per_s']:9.0f} {1e3 * row['ttft_p50_s']:11.1f} {1e3 * row['ttft_p99_s']:8.1f} "
              f"{1e3 * row['tbt_p50_s']:10.2f} {1e3 * row['tbt_p99_s']:8.2f} {seconds:8.2f}", flush=True)
        rows.append(row)
    return rows


def bench_hybrid(quick: bool) -> list[dict]:
    """Section 4: the hybrid model against its own graphed plain greedy, tokens/s over all rows."""
    from memra_cuda.torch.testing import HYBRID, build_model
    tokens = 64 if quick else 256
    model = build_model("small", recurrent_layers=HYBRID)
    print(f"\nhybrid: small model, layers {HYBRID} a gated linear recurrence, k={TORCH_K}, M={TORCH_M}, "
          f"{tokens} tokens a row")
    print(f"{'B':>4} {'method':28} {'tokens/s':>9} {'accept':>6} {'vs graphed greedy':>18} {'same tokens':>11}")
    rows: list[dict] = []
    for batch in HYBRID_BATCHES:
        rows += _bench_hybrid_batch(model, batch, tokens)
    return rows


def _bench_hybrid_batch(model: Any, batch: int, tokens: int) -> list[dict]:
    """One B of section 4 (its caches, states and graphs go when it returns)."""
    from memra_cuda.torch.testing import PROMPT
    from memra_cuda.torch.testing import prompts as some_prompts
    from memra_cuda.torch import GraphedGreedy, Request, SpeculativeLlama, capacity_for, self_draft
    prompts = [PROMPT] if batch == 1 else some_prompts(batch, seed=batch)
    requests = [Request(prompt, tokens) for prompt in prompts]
    capacity = capacity_for(max(map(len, prompts)), tokens, Geometry(TORCH_K, TORCH_M, batch))
    greedy = GraphedGreedy(model, capacity, batch)
    methods: dict[str, tuple[Callable[[], Any], Any]] = {
        "plain greedy, torch graph": (lambda: greedy.generate_batch(requests), None)}
    for state in ("copy", "flip"):
        spec = SpeculativeLlama(model, self_draft(model), k=TORCH_K, m_rounds=TORCH_M, capacity=capacity,
                                batch=batch, state_rollback=state)
        for mode in ("graph", "overlap"):
            methods[f"round-stream {mode}, {state}"] = (
                functools.partial(spec.generate_batch, requests, mode), spec)
    measured: dict[str, dict[str, Any]] = {}
    outputs: dict[str, list[list[int]]] = {}
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


def bench_trees(quick: bool, sizes: Sequence[str] = ("small", "large"),
                batches: Sequence[int] = TREE_BATCHES) -> list[dict]:
    """Section 5: chains against static and dynamic trees at each B, and the trees the example
    picks there, greedy and sampled (tree_for_batch, benchmarks/picks.py), so that PICKED can be checked
    against what this machine measures."""
    from memra_cuda.torch.testing import build_model
    print(f"\ntrees: memra_cuda.torch.TreeLlama against the chain, M={TORCH_M}, graph mode, head scaled by "
          f"{TREE_LOGIT_SCALE:g}, {64 if quick else '256 (B <= 8) or 128'} tokens a row; sampling at T=1; v and d: "
          "the round's verify and draft in target steps, ideal = tau / (v + d), reached: the share of it got; "
          "rows: the rows' mean rounds over the batch's, its slowest row's (a batch's rounds its rows used); "
          "batch: the share got of the batch's ideal, ideal x rows (a batch runs until its slowest row is done)")
    print(f"{'size':6} {'B':>4} {'mode':8} {'kind':7} {'config':18} {'tokens/s':>9} {'tau':>5} {'v':>6} {'d':>6} "
          f"{'ideal':>6} {'reached':>7} {'rows':>5} {'batch':>5} {'vs plain':>8}")
    rows: list[dict] = []
    for size in sizes:
        model = build_model(size, logit_scale=TREE_LOGIT_SCALE)
        for batch in batches:
            rows += _bench_tree_batch(model, size, batch, quick)
    return rows


def _tree_candidates(picked: Sequence[Any], batch: int, quick: bool) -> list[tuple[str, Any]]:
    """(kind, config) of every configuration measured at `batch`: the chains' k, the static and
    dynamic trees (the first of each in a quick run), and `picked`, the trees the example picks
    there (greedy and sampled), each among its kind's where it is not one of them already."""
    from memra_cuda.torch.testing import parse_tree

    def some(options: Sequence[Any]) -> list[Any]:
        return list(options[:1] if quick else options)
    kinds = {"chain": some(CHAIN_KS[batch]),
             "static": [parse_tree(name) for name in some(STATIC_TREES[batch])],
             "dynamic": some(DYNAMIC[batch])}
    for tree in picked:
        kind = kinds["dynamic" if isinstance(tree, DynamicTree) else "static"]
        if tree not in kind:
            kind.append(tree)
    return [(kind, config) for kind, configs in kinds.items() for config in configs]


def _bench_tree_batch(model: Any, size: str, batch: int, quick: bool) -> list[dict]:
    """One size and B of section 5: plain decoding, then every candidate greedy and sampled, in
    caches of one capacity that each of them fits."""
    from .picks import PLAIN, tree_for_batch
    from memra_cuda.torch.testing import PROMPT
    from memra_cuda.torch.testing import prompts as some_prompts
    from memra_cuda.torch import Request, SamplingParams, capacity_for
    prompts = [PROMPT] if batch == 1 else some_prompts(batch, seed=batch)
    tokens = 64 if quick else (256 if batch <= 8 else 128)
    requests = [Request(prompt, tokens, None, seed) for seed, prompt in enumerate(prompts)]
    picked = {mode: tree_for_batch(size, batch, mode == "sampling") for mode in ("greedy", "sampling")}
    candidates = _tree_candidates([tree for tree in picked.values() if tree is not None and tree != PLAIN], batch,
                                  quick)
    depth, width = (max(values) for values in zip(*(depth_and_width(config) for _, config in candidates)))
    capacity = capacity_for(max(map(len, prompts)), tokens, Geometry(depth, TORCH_M, batch, width))
    baseline = plain_decoding(model, capacity, [requests])
    plain, step_ms = baseline["tokens_per_s"], baseline["step_ms"]
    release()
    print(f"{size:6} {batch:4} {'greedy':8} {'plain':7} {'':18} {plain:9.0f}   (a target step: {step_ms:.3f} ms)",
          flush=True)
    rows = [dict(size=size, batch=batch, mode="greedy", kind="plain", config="graphed greedy", **baseline)]
    for mode, sampling in (("greedy", None), ("sampling", SamplingParams(1.0))):
        measured = []
        for kind, config in candidates:
            row, = measure_config(model, kind, config, [requests], capacity, sampling, step_ms, plain, size=size,
                                 batch=batch, mode=mode, config=config if kind == "chain" else tree_label(config))
            print(f"{size:6} {batch:4} {mode:8} {kind:7} {row_label(row):18} {row['tokens_per_s']:9.0f} "
                  f"{row['tau']:5.2f} {row['v']:6.2f} {row['draft']:6.2f} {row['ideal']:5.2f}x "
                  f"{row['reached']:7.0%} {row['rows_share']:5.0%} {row['batch_reached']:5.0%} "
                  f"{row['vs_plain']:7.2f}x", flush=True)
            measured.append(row)
        chosen = rows[0] if picked[mode] == PLAIN else next(
            (row for (_, config), row in zip(candidates, measured) if config == picked[mode]), None)
        rows += measured + [tree_summary(measured, chosen, plain)]
        print(summary_line(rows[-1]), flush=True)
    return rows


def bench_tree_costs(quick: bool) -> list[dict]:
    """Section 6: where a tree's round goes against a chain's, at B = 1 on both sizes, in target
    steps, under the engine's kernels (Stack.kernels): a chain's draft step and verify (k = 10),
    each draft level of a static tree (T = 64, depth 10) and its verify; the target over n tokens
    through cuBLASLt and through cuBLAS (the evidence of memra_cuda.torch.stack.LT_ROWS); then two
    ways to take a level's two best candidates, torch.topk and best_ranks' two argmaxes."""
    import torch
    from memra_cuda.torch.timing import graph_ms

    from memra_cuda.torch.testing import PROMPT, build_model, static_tree
    from memra_cuda.torch import Request, best_ranks, capacity_for
    print("\ntree costs: B=1, device ms of each part captured alone, in target steps (a graphed greedy step)")
    rows: list[dict] = []
    for size in ("small", "large"):
        model = build_model(size, logit_scale=TREE_LOGIT_SCALE)
        tree = static_tree(64, 10)
        requests = [Request(PROMPT, 64)]
        capacity = capacity_for(len(PROMPT), 64, Geometry.of_tree(tree, TORCH_M, 1))
        # its step alone is read (its graph replayed after the generations, however many passes ran): one pass
        step_ms = plain_decoding(model, capacity, [requests], passes=1)["step_ms"]
        parts = {**_chain_parts(model, capacity, requests), **_tree_parts(model, tree, capacity, requests)}
        release()
        for width in (1, 8):
            logits = torch.randn(1, width, model.config.vocab_size, device="cuda", dtype=model.dtype)
            parts[f"top-2 of {width} node(s), torch.topk"] = graph_ms(lambda: logits.topk(2, dim=-1))
            best = torch.empty(1, width, 2, dtype=torch.long, device="cuda")
            parts[f"top-2 of {width} node(s), 2 argmaxes"] = graph_ms(lambda: best_ranks(logits, best))
        for part, ms in parts.items():
            rows.append(dict(size=size, part=part, ms=ms, target_steps=ms / step_ms))
            print(f"{size:6} {part:40} {ms:8.4f} ms {ms / step_ms:7.3f}", flush=True)
    return rows


def _chain_parts(model: Any, capacity: int, requests: Sequence[Any]) -> dict[str, float]:
    """Device ms of a chain's draft step (k = COST_K) and verify, each captured alone, and of its
    target over n tokens (scratch entries past the row's) through each BLAS library (the caller's
    release() gives the decoder's memory back)."""
    import torch
    from memra_cuda.torch.timing import graph_ms
    chain, verify, draft = decoder(model, "chain", COST_K, capacity)
    chain.generate_batch(requests)
    parts = {f"chain draft step (of {COST_K})": graph_ms(draft, chain.stream) / COST_K,
             f"chain verify ({COST_K + 1} tokens)": graph_ms(verify, chain.stream)}
    target = chain.target
    for n in (1, 2, 5, 8, 11, 16, 17, 33, 65):
        tokens = chain.views.vtok[:, :1].expand(1, n)
        positions = chain.views.pos_start.long() + torch.arange(n, device="cuda")
        for library in ("cublaslt", "cublas"):
            target.library = library
            parts[f"target over {n} tokens, {library}"] = graph_ms(lambda: target.logits(tokens, positions),
                                                                   chain.stream)
    target.library = None
    return parts


def _tree_parts(model: Any, tree: Any, capacity: int, requests: Sequence[Any]) -> dict[str, float]:
    """Device ms of each draft level of `tree` and of its verify, each captured alone (level 0
    first: its eager run before its capture makes the round's mask, which the levels after read)."""
    from memra_cuda.torch.timing import graph_ms
    spec, verify, _ = decoder(model, "static", tree, capacity)
    spec.generate_batch(requests)
    parts = {f"tree level {level} ({stop - start} nodes)": graph_ms(lambda: spec.draft_level(level),
                                                                    spec.stream)
             for level, (start, stop) in enumerate(tree.expanded) if stop > start}
    parts[f"tree verify ({tree.nodes} tokens)"] = graph_ms(verify, spec.stream)
    return parts


def bench_headline(quick: bool, json_path: str | Path | None = None) -> dict:
    """Section 0: the trained pair (benchmarks/headline.py), its figures also in `json_path` as
    they come, its picture beside (PATH with .png)."""
    return headline(quick, json_path=json_path)


# Callable[..., Any]: the sections' keywords differ (the trees' sizes= and batches=, the headline's json_path=)
SECTIONS: dict[str, Callable[..., Any]] = {"headline": bench_headline, "one_request": bench_one_request,
                                           "batches": bench_batches, "serving": bench_serving, "hybrid": bench_hybrid,
                                           "trees": bench_trees, "tree_costs": bench_tree_costs}


def bench_torch(quick: bool, sections: Sequence[str] = tuple(SECTIONS), json_path: str | Path | None = None,
                **trees: Sequence[Any]) -> dict[str, Any]:
    """The sections' rows by name (the headline's report, a dict); `trees`: bench_trees' sizes= and
    batches=, where given. The trees section's picture goes beside the JSON at `json_path` (its
    name, .png), and the headline's figures, as each batch size ends, to PATH with .headline.json
    (.headline.png its picture); the caller writes the whole JSON."""
    headline_json = None if json_path is None else Path(json_path).with_suffix(".headline.json")
    extra: dict[str, dict[str, Any]] = dict(trees=trees, headline=dict(json_path=headline_json))
    report = {name: SECTIONS[name](quick, **extra.get(name, {})) for name in sections}
    if "trees" in report:
        if json_path is None:
            print("trees: the picture goes beside the JSON: give --json PATH to get it")
        else:
            plot_trees(report["trees"], Path(json_path).with_suffix(".png"))
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.torch_engine",
                                     description="round-stream on memra_cuda.torch's decoders, some sections alone")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=writable, metavar="PATH",
                        help="also write the figures as JSON (and the trees' picture beside)")
    parser.add_argument("--tree-sizes", type=lambda text: listed(text, ("small", "large")),
                        help="the trees section at these model sizes only")
    parser.add_argument("--tree-batches", type=lambda text: listed(text, TREE_BATCHES, int),
                        help="the trees section at these batch sizes only")
    parser.add_argument("sections", nargs="*", help=f"any of {', '.join(SECTIONS)}, each once (default: all)")
    args = parser.parse_args()
    try:  # as bench.py's --sections: a section named twice was measured twice
        sections = listed(",".join(args.sections), tuple(SECTIONS)) if args.sections else tuple(SECTIONS)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"sections: {exc}")
    needs("benchmarks.torch_engine", PAIR, gpu=True)  # else a traceback from the first section (the pair's, the GPU's)
    trees = {name: value for name, value in (("sizes", args.tree_sizes), ("batches", args.tree_batches)) if value}
    report = bench_torch(args.quick, sections, args.json, **trees)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)

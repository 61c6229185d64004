"""`make bench`, part 8: trees against chains (docs/trees.md).

1. The toy, bare and as 8B/0.5B (its verify and each draft level streaming those models'
   weights), B = 1 and 32, graph mode, each row its own prompt: tokens per round and tokens/s of
   the chain at k = 4, 6 and 8, of static trees of T = 8 to 64 (the nodes most likely to be
   accepted if a draft rank r is right with probability 0.6 * 0.5**r: EAGLE's way of choosing a
   static tree), and of dynamic trees of the same sizes; the best of each kind. The toy's draft
   finds the target's token at rank 0 except at its noisy positions (10%), where it sits at
   rank 1 to 3, so a tree wins what a chain loses there.
2. The tree accepts alone, V = 152 000, T = 16 and 64, B = 1 and 32: the device time of kernel 13
   (greedy) and of kernel 14 (sampling, with a draft far from the target, so most children are
   rejected and the residuals' normalisers are summed), against the HBM floor for the bytes of
   the target's and the draft's laws at every node (B·(T+1)·V·8: what an accept reading every
   node's laws once reads), timed as a kernel streaming that many bytes.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from memra_cuda import Geometry
from memra_cuda.buffers.capacity import kv_capacity
from memra_cuda.buffers.stream_bufs import StreamBufs
from memra_cuda.buffers.tree import DynamicTree, Tree, TreeBufs, TreeShape
from memra_cuda.driver.buffer import DeviceBuffer
from memra_cuda.driver.engine import Engine
from memra_cuda.kernels.spec import SpecKernels
from memra_cuda.kernels.tree import SampledCandidates, TreeKernels
from memra_cuda.rounds.stream import RoundStream
from memra_cuda.testing.toy.lm import COST_8B_05B, ToyCost, ToyLM

from .common import MODEL, batch_prompts, depth_and_width, device_us

M, TOKENS, CANDIDATES = 16, 512, 8
CHAINS = (4, 6, 8)
SIZES = (8, 16, 32, 64)
DYNAMIC = {8: (4, 2, 2), 16: (4, 4, 4), 32: (8, 4, 4), 64: (8, 8, 4)}  # T: (depth, width, branch)
ACCEPT_VOCAB = 152_000


def static_tree(size: int) -> TreeShape:
    """The bench's static tree of `size` drafts, 8 deep, from the toy's 8 candidates."""
    return TreeShape.likeliest(size, depth=8, ranks=CANDIDATES)


def _generate(engine: Engine, lm: ToyLM, bufs: StreamBufs, stream: RoundStream,
              prompts: list[list[int]]) -> tuple[float, float]:
    """(tokens/s, tokens per round) of a timed generation after an untimed one (captures)."""
    for _ in range(2):
        for b, prompt in enumerate(prompts):
            lm.prefill_row(bufs, b, prompt)
        t0 = time.perf_counter()
        made = np.array([len(out) for out in stream.generate_batch(TOKENS, mode="graph")])
        engine.synchronize()
        wall = time.perf_counter() - t0
    return int(made.sum()) / wall, bufs.tokens_per_round(made)


def bench_tree_rounds(engine: Engine, quick: bool) -> list[dict[str, Any]]:
    spec = SpecKernels(engine)
    rows: list[dict[str, Any]] = []
    kinds: list[tuple[str, int, Tree | None]] = [("chain", k, None) for k in (CHAINS[:1] if quick else CHAINS)]
    kinds += [("static", size, static_tree(size)) for size in (SIZES[:2] if quick else SIZES)]
    kinds += [("dynamic", size, DynamicTree(*DYNAMIC[size])) for size in (SIZES[:2] if quick else SIZES)]
    print(f"{'model':8} {'B':>3} {'kind':8} {'k/T':>4} {'depth':>5} {'tok/round':>9} {'tok/s':>9}")
    for name, cost in (("bare", ToyCost()), ("8B/0.5B", COST_8B_05B)):
        weights = engine.alloc(np.uint8, max(cost.verify_bytes, cost.draft_bytes, 1), zeroed=True)
        for batch in (1, 32):
            prompts = batch_prompts(batch)
            for kind, size, tree in kinds:
                depth, width = depth_and_width(size if tree is None else tree)
                geometry = Geometry(depth, M, batch, width)
                capacity = kv_capacity(24, TOKENS, geometry)
                lm = ToyLM(engine, MODEL, capacity, cost, weights if cost.verify_bytes else None, batch=batch)
                bufs = StreamBufs(engine, geometry)
                stream = lm.round_stream(bufs, kernels=spec) if tree is None else \
                    lm.tree_round_stream(bufs, tree, candidates=CANDIDATES, kernels=spec)
                rate, per_round = _generate(engine, lm, bufs, stream, prompts)
                rows.append(dict(model=name, batch=batch, kind=kind, size=size, depth=depth,
                                 tokens_per_round=per_round, tokens_per_s=rate))
                print(f"{name:8} {batch:3d} {kind:8} {size:4d} {depth:5d} {per_round:9.2f} {rate:9.0f}", flush=True)
                bufs.free()
        weights.free()
    print(f"\n{'model':8} {'B':>3} {'best chain tok/s':>16} {'best static':>11} {'best dynamic':>12}")
    for name in ("bare", "8B/0.5B"):
        for batch in (1, 32):
            best = {kind: max((r for r in rows if r["model"] == name and r["batch"] == batch and r["kind"] == kind),
                              key=lambda r: r["tokens_per_s"]) for kind in ("chain", "static", "dynamic")}
            chain = best["chain"]["tokens_per_s"]
            print(f"{name:8} {batch:3d} {chain:10.0f} (k={best['chain']['size']}) " + " ".join(
                f"{best[kind]['tokens_per_s'] / chain:6.2f}x (T={best[kind]['size']})"
                for kind in ("static", "dynamic")))
    return rows


def _accept_rig(engine: Engine, tree: Tree, batch: int, sampled: bool,
                rng: np.random.Generator) -> tuple[StreamBufs, Callable[[], None]]:
    """One grown tree per row (random candidates), and the accept of `sampled` or greedy over it."""
    bufs = StreamBufs(engine, Geometry.of_tree(tree, 1, batch))
    nodes = TreeBufs(bufs, tree)
    kernels = TreeKernels(engine)
    T1, V = tree.nodes, ACCEPT_VOCAB
    engine.copy_htod(bufs.pend_d, rng.integers(0, V, batch))
    kernels.prepare_begin(bufs, nodes)()
    if sampled:
        p_d, q_d = _laws(engine, batch * T1, V, rng), _laws(engine, batch * T1, V, rng)
        seed_d = engine.htod(np.arange(batch, dtype=np.uint64))
        drawn = SampledCandidates(engine, batch, T1, tree.draws)
        for level in range(1, tree.depth + 1):
            kernels.prepare_draw(bufs, nodes, level, q_d, seed_d, V, drawn)()
            kernels.prepare_grow(bufs, nodes, level, drawn.tok_d, drawn.logq_d, drawn.sel_d)()
        return bufs, kernels.prepare_accept_sample(bufs, nodes, p_d, q_d, seed_d, V)
    tok_d = engine.htod(rng.integers(0, 4, batch * T1 * tree.draws).astype(np.uint32))
    logp_d = engine.htod(-np.sort(rng.random((batch * T1, tree.draws), np.float32), axis=1).reshape(-1))
    for level in range(1, tree.depth + 1):
        kernels.prepare_grow(bufs, nodes, level, tok_d, logp_d)()
    pred_d = engine.htod(rng.integers(0, 4, batch * T1).astype(np.uint32))  # a quarter of the children agree
    return bufs, kernels.prepare_accept_greedy(bufs, nodes, pred_d)


def _laws(engine: Engine, rows: int, vocab: int, rng: np.random.Generator, distinct: int = 16) -> DeviceBuffer:
    """f32 [rows][vocab] laws on the device: `distinct` random peaked ones, repeated."""
    laws = rng.random((distinct, vocab), np.float32) ** 4
    laws /= laws.sum(-1, keepdims=True)
    buf = engine.alloc(np.float32, rows * vocab)
    for row in range(0, rows, distinct):
        n = min(distinct, rows - row)
        engine.copy_htod(buf, laws[:n].reshape(-1), start=row * vocab)
    return buf


def bench_tree_accept(engine: Engine, quick: bool) -> list[dict]:
    rng, rows = np.random.default_rng(0), []
    lm = ToyLM(engine, MODEL, 1)  # its weight-streaming kernel times the floor
    print(f"\ntree accept alone, V = {ACCEPT_VOCAB}: device us, against the HBM floor for B·(T+1)·V·8 bytes")
    print(f"{'rule':8} {'T':>3} {'B':>3} {'us':>8} {'floor us':>8} {'ratio':>6}")
    for sampled in (False, True):
        for size in SIZES[1::2]:
            for batch in (1,) if quick else (1, 32):
                tree = static_tree(size)
                bufs, accept = _accept_rig(engine, tree, batch, sampled, rng)
                us = device_us(engine, accept, launches=20 if sampled else 50)
                nbytes = batch * tree.nodes * ACCEPT_VOCAB * 8
                weights = engine.alloc(np.uint8, nbytes, zeroed=True)
                lm.weights_d = weights
                floor = device_us(engine, lm.weight_reads(nbytes)[0], launches=20)
                weights.free()
                rule = "sampling" if sampled else "greedy"
                rows.append(dict(rule=rule, size=size, batch=batch, vocab=ACCEPT_VOCAB, us=us, floor_us=floor))
                print(f"{rule:8} {size:3d} {batch:3d} {us:8.2f} {floor:8.2f} {us / floor:6.2f}", flush=True)
                bufs.free()
    return rows


def bench_tree(engine: Engine, quick: bool) -> dict:
    print(f"\ntrees against chains: toy {MODEL}, M={M}, {TOKENS} tokens a row, graph mode, {CANDIDATES} candidates")
    return {"rounds": bench_tree_rounds(engine, quick), "accept": bench_tree_accept(engine, quick)}


__all__ = ["bench_tree", "static_tree"]

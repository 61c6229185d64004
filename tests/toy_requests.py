"""What the toy's batched end-to-end tests share, wherever their folder (tests/rounds, tests/testing):
requests whose rows stop at different rounds, by EOS and by budget; a sampled batch's tokens."""
from __future__ import annotations

import numpy as np

from memra_cuda import Geometry
from memra_cuda import StreamBufs, kv_capacity
from memra_cuda.buffers import DraftLengths
from memra_cuda.testing.toy.lm import ToyLM, ToyModel, target_greedy


def requests(model: ToyModel, batch: int, seed: int, max_budget: int = 90,
             max_prompt: int = 40) -> tuple[list[list[int]], list[int], list[int | None]]:
    """Per row: a prompt of 1 to max_prompt tokens, a budget of 0 to max_budget (max_budget in
    every fifth row), and for every third row an EOS taken from the middle of its greedy output
    (so it stops early)."""
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(0, model.vocab, int(rng.integers(1, max_prompt + 1)))]
               for _ in range(batch)]
    budgets = [int(rng.integers(0, max_budget + 1)) if b % 5 else max_budget for b in range(batch)]
    eos: list[int | None] = []
    for b, (prompt, budget) in enumerate(zip(prompts, budgets)):
        full = target_greedy(model, prompt, budget)
        eos.append(full[len(full) // 2] if b % 3 == 0 and full else None)
    return prompts, budgets, eos


def sampled(engine, spec, model, sampling, prompts, seeds, budget, k=4, m_rounds=4, mode="graph", eos=None,
            caps=None) -> list[list[int]]:
    """Each prompt's tokens, its seed's, sampled by the toy (`sampling`) in one batch of them;
    `caps`: each row's most draft length, applied by the length chooser (every width costing
    alike, so the width stays k)."""
    batch = len(prompts)
    lm = ToyLM(engine, model, kv_capacity(20, budget, Geometry(k, m_rounds, batch), overlap=True), batch=batch,
               sampling=sampling)
    bufs = StreamBufs(engine, Geometry(k, m_rounds, batch))
    lengths = None
    if caps is not None:
        lengths = DraftLengths(bufs, [1.0] * (k + 1), 0.0)
        lengths.set_caps(caps)
    stream = lm.round_stream(bufs, kernels=spec, lengths=lengths)
    for row, (prompt, seed) in enumerate(zip(prompts, seeds)):
        lm.prefill_row(bufs, row, prompt, seed)
    return [tokens.tolist() for tokens in stream.generate_batch(budget, eos=eos, mode=mode)]

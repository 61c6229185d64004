"""What speculative decoding is measured and checked against: the target's own greedy decoding,
plain (one token a step, each step a CUDA graph, GraphedGreedy) and Hugging Face's
(`generate`, hf_generate)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .decoder import Request
from .sampling import SamplingParams
from .compiled import stack_for


class GraphedGreedy:
    """Plain greedy decoding of a batch, the target alone: `steps` steps a burst (a token a row
    each), the burst captured once as a CUDA graph and replayed (or, with `eager`, run op by op:
    the loop an engine writes first), the host reading each burst's tokens back once, as a
    server streaming them would, until every row has its budget or its EOS (a row's tokens past
    its stop are dropped). The model's step is compiled where it fuses (`compiled`, as a
    decoder's: memra_cuda.torch.compiled.stack_for), so this is the best plain loop a PyTorch
    user writes, the baseline every speculative figure is measured against. A hybrid model's
    reference too, which Hugging Face's forward cannot run: its step updates the live state in
    place (LiveState)."""

    def __init__(self, model: Any, capacity: int, batch: int = 1, *, steps: int = 16, eager: bool = False,
                 compiled: bool | None = None):
        if steps < 1:
            raise ValueError(f"a burst runs at least one step, not {steps}")
        self.stream = torch.cuda.Stream()
        self.batch, self.steps, self.eager = batch, steps, eager
        with torch.cuda.stream(self.stream):
            self.stack = stack_for(model, capacity, batch, compiled=compiled)
            self.token = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
            self.position = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
            self.out = torch.zeros(batch, steps, dtype=torch.long, device="cuda")  # a burst's tokens
        self.graph: torch.cuda.CUDAGraph | None = None

    def _burst(self) -> None:
        for step in range(self.steps):
            self.token.copy_(self.stack.greedy(self.token, self.position))
            self.out[:, step:step + 1].copy_(self.token)
            self.position.add_(1)

    def _start(self, requests: Sequence[Request]) -> None:
        self.stack.prefill(range(self.batch), [r.prompt[:-1] for r in requests])
        self.token.copy_(torch.tensor([[r.prompt[-1]] for r in requests]))
        self.position.copy_(torch.tensor([[len(r.prompt) - 1] for r in requests]))

    def capture(self) -> None:
        """The burst's graph, now (a warm-up burst first, which compiles the step), so that no
        generation captures: a capture synchronises the device."""
        if self.graph is not None or self.eager:
            return
        with torch.cuda.stream(self.stream):
            self._start([Request([0, 0], 0)] * self.batch)
            self._burst()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=self.stream):
                self._burst()

    def generate_batch(self, requests: Sequence[Request]) -> list[list[int]]:
        """One request a row, each until its budget or its EOS."""
        if len(requests) != self.batch:
            raise ValueError(f"need one request per row ({self.batch}), not {len(requests)}")
        capacity = self.stack.kv.capacity
        for i, request in enumerate(requests):
            if len(request.prompt) - 1 + request.max_new_tokens > capacity:
                raise ValueError(f"request {i} ({len(request.prompt)} prompt tokens, {request.max_new_tokens} new) "
                                 f"needs a cache of {len(request.prompt) - 1 + request.max_new_tokens}; this holds "
                                 f"{capacity}")
        self.capture()
        with torch.cuda.stream(self.stream):
            self._start(requests)
            out: list[list[int]] = [[] for _ in requests]
            live = {row for row, request in enumerate(requests) if request.max_new_tokens > 0}
            while live:
                if self.graph is None:
                    self._burst()
                else:
                    self.graph.replay()
                burst = self.out.tolist()
                for row in list(live):
                    for token in burst[row]:
                        out[row].append(token)
                        if token == requests[row].eos or len(out[row]) == requests[row].max_new_tokens:
                            live.discard(row)
                            break
            return out

    def generate(self, prompt: Sequence[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
        """One request (a decoder of one row)."""
        return self.generate_batch([Request(prompt, max_new_tokens, eos)])[0]


def hf_generate(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos: int | None = None,
                sampling: SamplingParams | None = None, assistant: Any = None, k: int = 4) -> list[list[int]]:
    """Hugging Face's own decoding of a batch (prompts left-padded; greedy, or `sampling` from
    torch's generator), assisted by `assistant` (a draft model), k tokens at a time, if given.
    Each row's tokens stop at its EOS."""
    width = max(len(prompt) for prompt in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    extra: dict[str, Any] = {}
    if assistant is not None:
        config = assistant.generation_config
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = k, "constant"
        config.assistant_confidence_threshold = 0.0
        extra["assistant_model"] = assistant
    if sampling is not None:
        extra.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    else:
        extra.update(do_sample=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=0,
                         eos_token_id=eos, pad_token_id=0, **extra)[:, width:].tolist()
    return [row[:row.index(eos) + 1] if eos in row else row for row in out]


def hf_greedy(model: Any, prompt: Sequence[int], max_new_tokens: int, eos: int | None = None,
              assistant: Any = None, k: int = 4) -> list[int]:
    """Hugging Face's greedy decoding of one prompt."""
    return hf_generate(model, [prompt], max_new_tokens, eos, assistant=assistant, k=k)[0]

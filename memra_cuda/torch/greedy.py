"""What speculative decoding is measured and checked against: the target's own greedy decoding,
plain (one token a step, each step a CUDA graph, GraphedGreedy) and Hugging Face's
(`generate`, hf_generate)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .decoder import Request
from .sampling import SamplingParams
from .stack import Stack


class GraphedGreedy:
    """Plain greedy decoding of a batch, one token a row per step, the step captured once with
    torch.cuda.graph and replayed (or, with `eager`, run op by op: the loop an engine writes
    first); the host reads each step's tokens back (as an engine streaming tokens would) and
    stops when every row has its budget or its EOS. A hybrid model's reference, which Hugging
    Face's forward cannot run: its step updates the live state in place (LiveState)."""

    def __init__(self, model: Any, capacity: int, batch: int = 1, eager: bool = False):
        self.stream = torch.cuda.Stream()
        self.batch, self.eager = batch, eager
        self.stack = Stack(model, capacity, batch)
        self.token = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
        self.position = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
        self.graph: torch.cuda.CUDAGraph | None = None

    def _step(self) -> None:
        self.token.copy_(self.stack.greedy(self.token, self.position))
        self.position.add_(1)

    def _start(self, requests: Sequence[Request]) -> None:
        self.stack.prefill(range(self.batch), [r.prompt[:-1] for r in requests])
        self.token.copy_(torch.tensor([[r.prompt[-1]] for r in requests]))
        self.position.copy_(torch.tensor([[len(r.prompt) - 1] for r in requests]))

    def generate_batch(self, requests: Sequence[Request]) -> list[list[int]]:
        """One request a row, each until its budget or its EOS."""
        if len(requests) != self.batch:
            raise ValueError(f"need one request per row ({self.batch}), not {len(requests)}")
        with torch.cuda.stream(self.stream):
            self._start(requests)
            if self.graph is None and not self.eager:
                self._step()  # warm-up off the graph, then undo it
                self._start(requests)
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, stream=self.stream):
                    self._step()
            out: list[list[int]] = [[] for _ in requests]
            live = {row for row, request in enumerate(requests) if request.max_new_tokens > 0}
            while live:
                if self.graph is None:
                    self._step()
                else:
                    self.graph.replay()
                step = self.token[:, 0].tolist()
                for row in list(live):
                    out[row].append(step[row])
                    if step[row] == requests[row].eos or len(out[row]) == requests[row].max_new_tokens:
                        live.discard(row)
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

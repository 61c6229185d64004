"""Logits to the probabilities round-stream's stochastic acceptance reads.

Sampling (memra_cuda.Sampling) accepts a draft by the target's and the draft's probabilities,
f32 on the device; the decoders fill them from each model's logits with SamplingParams, in
the order Hugging Face's logits processors apply them, so that a request sampled here and by
`generate(do_sample=True, ...)` follows one law.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..driver.values import as_size


@dataclass(frozen=True)
class SamplingParams:
    """Temperature, then top-k (0: off), then top-p (1: off), as Hugging Face's logits
    processors apply them; greedy decoding is no SamplingParams at all (None)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (greedy is sampling=None), not {self.temperature}")
        as_size(self.top_k, "top_k", 0)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """f32 probabilities over the last dimension of `logits` ([..., V] -> [..., V])."""
        logits = logits.float() / self.temperature
        if self.top_k:
            kth = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, -math.inf)
        if self.top_p < 1:  # drop the least likely tokens whose mass together is at most 1 - top_p
            ascending, order = logits.sort(dim=-1)
            drop = ascending.softmax(-1).cumsum(-1) <= 1 - self.top_p
            drop[..., -1] = False  # the likeliest token always stays
            logits = logits.masked_fill(drop.scatter(-1, order, drop), -math.inf)
        return logits.softmax(-1)

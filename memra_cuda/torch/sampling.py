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

from ..driver.values import as_real, as_size


@torch.library.custom_op("memra_cuda::running_mass", mutates_args=())
def _running_mass(probs: torch.Tensor) -> torch.Tensor:
    """probs.cumsum(-1), an operator torch.compile does not look into: top-p's running mass over
    a vocabulary sorted ascending ([..., V] -> [..., V], f32). Inductor (torch 2.11, CUDA) splits
    a scan of a few rows over a vocabulary across blocks and failed to generate that kernel
    ("InductorError: TypeError: list indices must be integers or slices, not NoneType", seen on
    an H100: every compiled law with top-p); aten's cumsum, the one Hugging Face's top-p runs,
    leaves the rest of the law compiled."""
    return probs.cumsum(-1)


@_running_mass.register_fake
def _running_mass_shape(probs: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(probs)


@dataclass(frozen=True)
class SamplingParams:
    """Temperature, then top-k (0: off), then top-p (1: off), as Hugging Face's logits
    processors apply them; greedy decoding is no SamplingParams at all (None). The checked
    numbers are kept (a bool is none: True was a temperature of 1): a temperature finite and
    above 0 (an infinite one is no law of the model's: every token alike), a top_p in (0, 1]."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        temperature, top_p = as_real(self.temperature, "temperature"), as_real(self.top_p, "top_p")
        if not 0 < temperature < math.inf:
            raise ValueError(f"temperature must be finite and > 0 (greedy is sampling=None), not {self.temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_k", as_size(self.top_k, "top_k", 0))
        object.__setattr__(self, "top_p", top_p)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """f32 probabilities over the last dimension of `logits` ([..., V] -> [..., V]). The
        logits are taken from their largest before the temperature divides them (the same law:
        softmax does not see a shift), so that a small temperature drives them to -inf and the
        likeliest token to 0, where dividing first overflowed to inf and softmax gave NaN (which
        the kernels read as no mass: token 0, every round). The likeliest stays 0 compiled too,
        where the division is a product by 1 / temperature, inf past float32's range (0 x inf:
        NaN)."""
        logits = logits.float()
        shifted = logits - logits.amax(-1, keepdim=True)
        logits = torch.where(shifted == 0, shifted, shifted / self.temperature)
        if self.top_k:
            kth = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, -math.inf)
        if self.top_p < 1:  # drop the least likely tokens whose mass together is at most 1 - top_p
            ascending, order = logits.sort(dim=-1)
            drop = torch.ops.memra_cuda.running_mass(ascending.softmax(-1)) <= 1 - self.top_p
            drop[..., -1] = False  # the likeliest token always stays
            # back in vocabulary order (`order` is a permutation: the scatter writes every entry)
            logits = logits.masked_fill(torch.empty_like(drop).scatter_(-1, order, drop), -math.inf)
        return logits.softmax(-1)

    def fill(self, out: torch.Tensor, logits: torch.Tensor) -> None:
        """probs(logits) written into `out` (f32, the shape of `logits`): a round's p or q, which
        a decoder runs as its stack runs its forward (LayerStack.compiled: one kernel compiled)."""
        out.copy_(self.probs(logits))


def as_sampling(law: object, name: str = "sampling") -> SamplingParams | None:
    """`law` if it is a SamplingParams or None (greedy), else TypeError naming `name`: a decoder's
    `sampling` and `draft_sampling` (a float met .probs after the warm-up) and hf_generate's (a
    float met "'float' object has no attribute 'temperature'")."""
    if law is not None and not isinstance(law, SamplingParams):
        raise TypeError(f"{name} is a memra_cuda.torch.SamplingParams (or None: greedy), not {law!r}")
    return law

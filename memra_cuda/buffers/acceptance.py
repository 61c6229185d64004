"""The acceptance rule of a round, as one object a RoundStream is given.

Greedy acceptance keeps the drafts the target's own argmax agrees with; stochastic acceptance
keeps each draft with probability min(1, p/q) and samples the token after the last kept one
from the residual, so the committed tokens are distributed exactly as the target's sampling
(docs/sampling.md). Each rule names the buffers the model writes every round; the kernel that
judges it is SpecKernels.prepare_accept's choice, so a rule is plain data.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..driver.values import I32_MOST, as_size


@dataclass(frozen=True)
class Greedy:
    """Accept the longest prefix of drafts equal to the target's predictions: `pred_d`, the
    verify's next-token ids at the k+1 positions ([B][k+1], 32- or 64-bit integers)."""

    pred_d: Any


@dataclass(frozen=True)
class Sampling:
    """Accept stochastically: `p_d` the target's probabilities at the k+1 verify positions
    (f32 [B][k+1][vocab]), `q_d` the draft's at its k positions (f32 [B][max(k,1)][vocab]),
    `seed_d` each request's seed (u64 or i64 [B]), `vocab` the vocabulary size.

    `vocab` is checked where the rule is built (as_size: an int from 1 to 2**31 - 1, the most
    the kernels' V holds; a bool, a float or a string a TypeError, 0 or -5 a ValueError, each
    naming it) and kept as a plain int: it was refused only where its kernel was prepared, as a
    round was made. None, as before, leaves it to be derived from p_d's length there (give it:
    a p_d of the wrong length then passes where q_d fits the same wrong V). The buffers are
    checked where the kernel is prepared, against the engine and the buffers' B and k, which a
    rule does not know."""

    p_d: Any
    q_d: Any
    seed_d: Any
    vocab: int | None

    def __post_init__(self) -> None:
        if self.vocab is not None:
            object.__setattr__(self, "vocab", as_size(self.vocab, "vocab", 1, I32_MOST))


Acceptance = Greedy | Sampling

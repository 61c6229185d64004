"""What a server is measured on, and by: a stream of requests whose budgets a seeded generator
draws, and the figures a list of Served gives (memra_cuda.rounds.serving).

The figures, for a stream served through B slots, plain and speculative alike:

- tokens/s: every token served over the span from the first submission to the last end;
- time to first token (TTFT), p50 and p99 over the requests that got one: its first token's
  readback less its submission, so the wait for a slot and the prompt's prefill count;
- time between tokens (TBT), p50 and p99 over tokens: a readback brings a request several tokens
  at once (a burst's), so each token after a request's first readback is given that readback's
  wait since the request's previous one, shared by the tokens it brought. A token costs its share
  of a burst; a slow burst (a prefill of another row's request ahead of it) shows in p99. The
  tokens of a request's first readback count in its TTFT, not here. Beside it, the p99 without
  each request's last readback (tbt_p99_mid_s): a request that stops mid-burst waits for the
  burst's end, so its last readback's few tokens share a whole burst's wait, and the longer a
  burst (a speculative round makes several tokens a row), the more that weighs in p99.

Percentiles are nearest-rank: a value observed, never one between two.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from memra_cuda.rounds.serving import Request, Served

BUDGETS = (32, 512)  # the fewest and most new tokens a request of the stream asks for


def request_stream(prompts: Sequence[Sequence[int]], *, seed: int, budgets: tuple[int, int] = BUDGETS,
                   eos: int | None = None) -> list[Request]:
    """One request a prompt, in order, each with a budget drawn uniformly from budgets[0] to
    budgets[1] (both included) by a generator seeded with `seed`, so that every run and machine
    serves the same stream; `eos` (the tokenizer's) stops a request early, and its place in the
    stream is its sampling seed."""
    low, high = budgets
    if not 0 <= low <= high:
        raise ValueError(f"budgets are (fewest, most) new tokens with 0 <= fewest <= most, not {budgets}")
    drawn = np.random.default_rng(seed).integers(low, high + 1, len(prompts))
    return [Request(list(prompt), int(budget), eos, i) for i, (prompt, budget) in enumerate(zip(prompts, drawn))]


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank `q`th percentile of `values` (0 < q <= 100): the smallest value that at
    least q% of them are at most. NaN where there are none."""
    if not 0 < q <= 100:
        raise ValueError(f"a percentile is above 0 and at most 100, not {q}")
    ordered = sorted(values)
    return ordered[math.ceil(q / 100 * len(ordered)) - 1] if ordered else math.nan


def between_tokens(served: Served, last: bool = True) -> list[float]:
    """The time between tokens of each of a request's tokens after its first readback (the
    module's docstring says how), one value a token; its readbacks told apart by their times.
    `last=False` leaves out its last readback's (the burst it stopped in)."""
    readbacks = [(at, len(list(tokens))) for at, tokens in itertools.groupby(served.arrivals)]
    if not last:
        readbacks = readbacks[:-1]
    return [(at - before) / count for (before, _), (at, count) in zip(readbacks, readbacks[1:]) for _ in range(count)]


def figures(served: Sequence[Served]) -> dict[str, float]:
    """A stream's figures (the module's docstring): tokens_per_s, ttft_p50_s, ttft_p99_s,
    tbt_p50_s, tbt_p99_s, tbt_p99_mid_s, and the requests, refused and cancelled among them, and
    tokens."""
    ran = [out for out in served if out.refused is None]
    tokens = sum(len(out.tokens) for out in ran)
    span = max((out.finished for out in ran), default=0.0) - min((out.submitted for out in ran), default=0.0)
    first = [out.first_token for out in ran if out.first_token is not None]
    gaps = [gap for out in ran for gap in between_tokens(out)]
    return dict(tokens_per_s=tokens / span if span > 0 else math.nan,
                ttft_p50_s=percentile(first, 50), ttft_p99_s=percentile(first, 99),
                tbt_p50_s=percentile(gaps, 50), tbt_p99_s=percentile(gaps, 99),
                tbt_p99_mid_s=percentile([gap for out in ran for gap in between_tokens(out, last=False)], 99),
                requests=len(served), refused=len(served) - len(ran), cancelled=sum(out.cancelled for out in ran),
                tokens=tokens)

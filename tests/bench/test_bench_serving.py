"""benchmarks/serving.py, on CPU: the request stream a server is measured on is the same for a
seed and within its budgets, and the figures of a list of Served are what its docstring says:
tokens/s over the span served, TTFT and the time between tokens at nearest-rank percentiles."""
from __future__ import annotations

import math

import pytest

from benchmarks.serving import between_tokens, figures, percentile, request_stream
from memra_cuda.rounds import Served


def test_the_stream_draws_its_budgets_from_a_seed_within_their_bounds():
    prompts = [[i + 1] * (1 + i % 7) for i in range(400)]
    stream = request_stream(prompts, seed=3, eos=2)
    assert stream == request_stream(prompts, seed=3, eos=2), "a seed draws one stream"
    assert stream != request_stream(prompts, seed=4, eos=2)
    budgets = [request.max_new_tokens for request in stream]
    assert min(budgets) >= 32 and max(budgets) <= 512 and len(set(budgets)) > 200
    assert [request.prompt for request in stream] == prompts
    assert all(request.eos == 2 and request.seed == i for i, request in enumerate(stream))
    assert {r.max_new_tokens for r in request_stream(prompts[:50], seed=0, budgets=(5, 6))} == {5, 6}
    with pytest.raises(ValueError, match="0 <= fewest <= most"):
        request_stream(prompts, seed=0, budgets=(10, 9))


def test_percentiles_are_nearest_rank():
    values = list(range(1, 101))
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (50, 99, 100)
    assert percentile([3.0, 1.0], 50) == 1.0 and percentile([3.0, 1.0], 99) == 3.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="above 0 and at most 100"):
        percentile(values, 0)


def test_a_readbacks_wait_is_shared_by_the_tokens_it_brought():
    """Readbacks at 2, 5 and 6 s bringing 3, 2 and 1 tokens: the first three are the TTFT's, the
    next two waited 3 s between them (1.5 s each), the last 1 s."""
    served = Served([1] * 6, 0.0, 0.0, [2.0] * 3 + [5.0] * 2 + [6.0], 6.0)
    assert between_tokens(served) == [1.5, 1.5, 1.0]
    assert between_tokens(served, last=False) == [1.5, 1.5], "the last readback (at 6 s) left out"
    assert between_tokens(Served([1], 0.0, 0.0, [2.0], 2.0)) == []
    assert between_tokens(Served([], 0.0, 0.0, [], 0.0)) == []


def test_the_figures_of_a_stream():
    served = [Served([1] * 6, 0.0, 0.0, [2.0] * 3 + [5.0] * 2 + [6.0], 6.0),
              Served([1, 1], 1.0, 1.0, [4.0, 8.0], 8.0),
              Served([1], 0.0, 4.0, [5.0], 6.0, cancelled=True),
              Served([], 0.5, None, [], 0.5, refused="request 3 refused: too long")]
    got = figures(served)
    assert got["tokens_per_s"] == pytest.approx(9 / 8)  # 9 tokens from 0 s to 8 s
    assert (got["ttft_p50_s"], got["ttft_p99_s"]) == (3.0, 5.0)  # 2, 3 and 5 s
    assert (got["tbt_p50_s"], got["tbt_p99_s"]) == (1.5, 4.0)  # 1.5, 1.5, 1 and 4 s
    assert got["tbt_p99_mid_s"] == 1.5, "without each request's last readback: 1.5 and 1.5 s"
    assert (got["requests"], got["refused"], got["cancelled"], got["tokens"]) == (4, 1, 1, 9)
    empty = figures([Served([], 0.0, None, [], 0.0, refused="request 0 refused: no")])
    assert math.isnan(empty["tokens_per_s"]) and math.isnan(empty["ttft_p50_s"]) and empty["tokens"] == 0


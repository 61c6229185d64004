"""The toy in sampling mode on the GPU (ToySampling, spec_accept_sample in the round): a request's
tokens depend on its seed alone, not on the mode, M or its batch slot; a target at temperature 0
is greedy whatever the draft; and the first token sampled speculatively is distributed as the
target's own distribution says (chi-square), with a draft far from the target, at k = 0, 4, and
rows' most draft lengths 0 to 4."""
from __future__ import annotations

import numpy as np
import pytest

from memra_cuda.kernels import SpecKernels
from memra_cuda.rounds import MODES
from memra_cuda.testing.toy import lm as toy

from laws import assert_distributed_as, cells
from toy_requests import sampled

pytestmark = pytest.mark.gpu

MODEL = toy.ToyModel(seed=5, vocab=3000, kv_mask=(True, False, True), noise_ppm=200_000, p_min=0.05)
SAMPLING = toy.ToySampling(temperature=0.7, floor=0.1, draft_temperature=1.5, draft_floor=0.2)
PROMPTS = [[1, 2, 3], [7] * 12, [4, 0, 4, 0, 4]]


@pytest.fixture(scope="module")
def spec(engine):
    return SpecKernels(engine)


def test_a_request_depends_on_its_seed_alone(engine, spec):
    """Every mode, M in {1, 4, 16}, the request in slot 0 or 2 of a batch, with other requests
    beside it: the same tokens for the same seed; another seed gives other tokens."""
    want = sampled(engine, spec, MODEL, SAMPLING, PROMPTS[:1], [1234], 80)
    for mode in MODES:
        for m_rounds in (1, 4, 16):
            got = sampled(engine, spec, MODEL, SAMPLING, PROMPTS[:1], [1234], 80, m_rounds=m_rounds, mode=mode)
            assert got == want, f"mode {mode}, M={m_rounds}"
    moved = sampled(engine, spec, MODEL, SAMPLING, [PROMPTS[1], PROMPTS[2], PROMPTS[0]], [9, 10, 1234], 80)
    assert moved[2] == want[0], "the same request in slot 2 of a batch of 3"
    other = sampled(engine, spec, MODEL, SAMPLING, PROMPTS[:1], [1235], 80)
    assert other != want, "another seed samples other tokens"


@pytest.mark.parametrize("mode", MODES)
def test_a_target_at_temperature_zero_is_greedy_whatever_the_draft(engine, spec, mode):
    greedy_target = toy.ToySampling(temperature=0.0, floor=0.0, draft_temperature=2.0, draft_floor=0.5)
    eos = toy.target_greedy(MODEL, PROMPTS[1], 60)[30]
    got = sampled(engine, spec, MODEL, greedy_target, PROMPTS, [1, 2, 3], 60, mode=mode, eos=[None, eos, None])
    for row, prompt in enumerate(PROMPTS):
        assert got[row] == toy.target_greedy(MODEL, prompt, 60, eos if row == 1 else None), f"row {row}"


@pytest.mark.parametrize(("k", "mixed"), [(0, False), (4, False), (4, True)], ids=["k=0", "k=4", "lengths 0 to 4"])
def test_the_first_token_is_distributed_as_the_target_says(engine, spec, k, mixed):
    """4 000 rows of one prompt with seeds 0..3999, one token each, a draft that is often wrong
    and flatter than the target (and, `mixed`, rows' most draft lengths 0 to k in turn, applied by
    the length chooser): the token's histogram matches the target's law at that position
    (chi-square over cells of at least 50 expected draws)."""
    model = toy.ToyModel(seed=5, vocab=1000, kv_mask=(True, False, True), noise_ppm=500_000)
    rows, prompt = 4000, [3, 1, 4]
    got = sampled(engine, spec, model, SAMPLING, [prompt] * rows, list(range(rows)), 1, k=k, m_rounds=1,
                  caps=[row % (k + 1) for row in range(rows)] if mixed else None)
    first = np.array([tokens[0] for tokens in got])
    law = SAMPLING.target_law(model, prompt)
    cell = cells(law, rows)
    assert_distributed_as(cell[first], np.bincount(cell, weights=law), f"k={k}, mixed={mixed}: the first token")

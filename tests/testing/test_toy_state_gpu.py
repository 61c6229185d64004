"""The toy with recurrent layers on the GPU: hybrid-model state rollback in the round (kernel 8,
COPY, or kernel 9, FLIP, after the KV rollback), for the target's layers and the draft's copy of
them. Every row's tokens equal its own target greedy output in every mode, B in {1, 8}, k in
{0, 4}, rows stopping at different rounds by EOS and by budget, with every draft accepted and
none; the rounds and the live states equal the numpy mirror's (a wrong draft state would only
cost rounds); a second request on the same buffers starts from its own prompt's state; and what
the toy cannot run is refused."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from memra_cuda import Geometry
from memra_cuda import StreamBufs, kv_capacity
from memra_cuda.errors import LoopUnsupported
from memra_cuda.kernels import SpecKernels
from memra_cuda.rounds import MODES
from memra_cuda.buffers.layout import ACC_TOTAL, ACC_WORDS
from memra_cuda.testing.toy import lm as toy, numpy_loop
from test_toy import HYBRID

pytestmark = pytest.mark.gpu

MODEL = replace(HYBRID, noise_ppm=150_000)
WIDE = replace(MODEL, state_words=96)  # past a warp: a layer's words span several
MAX_PROMPT = 30


@pytest.fixture(scope="module")
def spec(engine):
    return SpecKernels(engine)


def requests(model: toy.ToyModel, batch: int, seed: int, max_budget: int = 80):
    """Per row a prompt of 1 to MAX_PROMPT tokens, a budget of 40 to max_budget (max_budget in
    row 0), and an EOS from the middle of every third row's own greedy output."""
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(0, model.vocab, int(rng.integers(1, MAX_PROMPT + 1)))]
               for _ in range(batch)]
    budgets = [max_budget] + [int(rng.integers(40, max_budget + 1)) for _ in range(batch - 1)]
    eos = []
    for b, (prompt, budget) in enumerate(zip(prompts, budgets)):
        full = toy.target_greedy(model, prompt, budget)
        eos.append(full[len(full) // 2] if b % 3 == 0 else None)
    return prompts, budgets, eos


class Hybrid:
    """A ToyLM of `model` with its buffers and RoundStream."""

    def __init__(self, engine, spec, model, state, batch, k, m_rounds, budget=80, mode="graph"):
        capacity = kv_capacity(MAX_PROMPT, budget, Geometry(k, m_rounds, batch), overlap=mode == "overlap")
        self.lm = toy.ToyLM(engine, model, capacity, batch=batch, state_rollback=state)
        self.bufs = StreamBufs(engine, Geometry(k, m_rounds, batch))
        self.stream = self.lm.round_stream(self.bufs, kernels=spec)

    def generate(self, prompts, budgets, eos, mode="graph") -> list[list[int]]:
        for b, prompt in enumerate(prompts):
            self.lm.prefill_row(self.bufs, b, prompt)
        try:
            got = self.stream.generate_batch(budgets, eos=eos, mode=mode)
        except LoopUnsupported as exc:  # device mode on a driver without conditional WHILE nodes
            pytest.skip(str(exc))
        return [tokens.tolist() for tokens in got]


def assert_greedy(model, got, prompts, budgets, eos, where):
    for b, (prompt, budget, stop) in enumerate(zip(prompts, budgets, eos)):
        want = toy.target_greedy(model, prompt, budget, stop)
        assert got[b] == want, f"{where}: row {b} (prompt {len(prompt)}, budget {budget}, eos {stop})"


@pytest.mark.parametrize("state", toy.STATE_ROLLBACKS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch,k,m_rounds", [(1, 4, 4), (8, 4, 8), (8, 0, 4)])
def test_every_row_equals_its_own_greedy_output(engine, spec, state, mode, batch, k, m_rounds):
    prompts, budgets, eos = requests(MODEL, batch, seed=10 * batch + k)
    hybrid = Hybrid(engine, spec, MODEL, state, batch, k, m_rounds, mode=mode)
    assert_greedy(MODEL, hybrid.generate(prompts, budgets, eos, mode), prompts, budgets, eos,
                  f"{state}, {mode}, B={batch}, k={k}")


@pytest.mark.parametrize("state", toy.STATE_ROLLBACKS)
@pytest.mark.parametrize("noise_ppm", [0, 1_000_000], ids=["all-accepted", "none-accepted"])
@pytest.mark.parametrize("model", [MODEL, WIDE], ids=["W4", "W96"])
def test_every_draft_accepted_or_none(engine, spec, model, noise_ppm, state):
    """A draft always right (p_min 0: every draft accepted, so slot k is the kept one every
    round, and the draft's own states must be right for it to stay right) or always wrong
    (slot 0 every round); states 4 and 96 words wide."""
    model, k = replace(model, noise_ppm=noise_ppm, p_min=0.0), 4
    prompts, budgets, eos = requests(model, 8, seed=noise_ppm + model.state_words)
    hybrid = Hybrid(engine, spec, model, state, 8, k, 8)
    got = hybrid.generate(prompts, budgets, eos)
    assert_greedy(model, got, prompts, budgets, eos, f"{state}, noise {noise_ppm}")
    accepted = engine.dtoh(hybrid.bufs.acc_d).reshape(8, ACC_WORDS)[:, ACC_TOTAL].tolist()
    committed = [len(tokens) for tokens in got]
    # committed - accepted counts rounds (kernel 4): k + 1 tokens a round but the last
    assert accepted == ([n - -(-n // (k + 1)) for n in committed] if noise_ppm == 0 else [0] * 8)


def mirror(model, state, k, m_rounds, prompt, budget, eos) -> numpy_loop.NumpyRoundStream:
    """The numpy round stream that ran the request."""
    capacity = kv_capacity(len(prompt), budget, Geometry(k, m_rounds))
    stream = numpy_loop.NumpyRoundStream(model, k, m_rounds, capacity, state)
    stream.generate(prompt, budget, eos)
    return stream


@pytest.mark.parametrize("state", toy.STATE_ROLLBACKS)
@pytest.mark.parametrize("k", [0, 4])
def test_rounds_and_live_states_equal_the_numpy_mirror(engine, spec, state, k):
    """One row at a time, readback mode (a round a step): the same rounds as NumpyRoundStream,
    which a wrong draft state would raise (its drafts would miss), and the same live states,
    the target's and the draft's, read through the index for FLIP."""
    model = replace(MODEL, noise_ppm=50_000, p_min=0.0)
    prompts, budgets, eos = requests(model, 4, seed=7 + k)
    for prompt, budget, stop in zip(prompts, budgets, eos):
        hybrid = Hybrid(engine, spec, model, state, 1, k, 1)
        got = hybrid.generate([prompt], [budget], [stop], mode="readback")
        want = mirror(model, state, k, 1, prompt, budget, stop)
        assert got[0] == toy.target_greedy(model, prompt, budget, stop)
        assert hybrid.stream.rounds == want.rounds, f"prompt {prompt}, budget {budget}, eos {stop}"
        target, draft = hybrid.lm.live_states()
        assert target[0].tolist() == want.tgt_states.live().tolist()
        assert draft[0].tolist() == want.draft_states.live().tolist()


@pytest.mark.parametrize("state", toy.STATE_ROLLBACKS)
def test_every_rows_live_states_equal_its_mirrors_after_a_batch(engine, spec, state):
    """B = 8 rows done at different rounds: each row's states stay as its last live round left
    them (keep 0 after), so they equal its own numpy mirror's."""
    prompts, budgets, eos = requests(MODEL, 8, seed=99)
    hybrid = Hybrid(engine, spec, MODEL, state, 8, 4, 8)
    hybrid.generate(prompts, budgets, eos)
    target, draft = hybrid.lm.live_states()
    for b, (prompt, budget, stop) in enumerate(zip(prompts, budgets, eos)):
        want = mirror(MODEL, state, 4, 8, prompt, budget, stop)
        assert target[b].tolist() == want.tgt_states.live().tolist(), f"row {b}: target"
        assert draft[b].tolist() == want.draft_states.live().tolist(), f"row {b}: draft"


@pytest.mark.parametrize("state", toy.STATE_ROLLBACKS)
def test_a_second_request_starts_from_its_own_prompts_state(engine, spec, state):
    """prefill_row sets the row's states (and a FLIP index moved on by the first request back to
    0) for the next request on the same buffers and captured graph."""
    hybrid = Hybrid(engine, spec, MODEL, state, 8, 4, 8)
    for request in range(2):
        prompts, budgets, eos = requests(MODEL, 8, seed=500 + request)
        assert_greedy(MODEL, hybrid.generate(prompts, budgets, eos), prompts, budgets, eos, f"request {request}")


def test_sampling_mode_at_temperature_zero_is_greedy(engine, spec):
    """Sampling mode takes the recurrent terms into the verify's sums and the draft's state."""
    sampling = toy.ToySampling(temperature=0.0, floor=0.0, draft_temperature=1.5, draft_floor=0.2)
    prompts, budgets, eos = requests(MODEL, 4, seed=3)
    for state in toy.STATE_ROLLBACKS:
        lm = toy.ToyLM(engine, MODEL, kv_capacity(MAX_PROMPT, 80, Geometry(4, 4, 4)), batch=4, sampling=sampling,
                       state_rollback=state)
        bufs = StreamBufs(engine, Geometry(4, 4, 4))
        stream = lm.round_stream(bufs, kernels=spec)
        for b, prompt in enumerate(prompts):
            lm.prefill_row(bufs, b, prompt, seed=b)
        got = [tokens.tolist() for tokens in stream.generate_batch(budgets, eos=eos, mode="graph")]
        assert_greedy(MODEL, got, prompts, budgets, eos, f"sampling, {state}")


def test_what_the_toy_cannot_run_is_refused(engine, spec):
    with pytest.raises(ValueError, match="state_rollback must be one of"):
        toy.ToyLM(engine, MODEL, 64, state_rollback="swap")
    with pytest.raises(ValueError, match="pipeline stages cannot roll back recurrent state"):
        toy.ToyLM(engine, MODEL, 64, layers=range(0, 2))
    with pytest.raises(ValueError, match="pipeline stages cannot roll back recurrent state"):
        toy.ToyLM(engine, MODEL, 64, with_draft=False)
    with pytest.raises(ValueError, match="2 layers x 300 words is more than 512"):
        toy.ToyLM(engine, replace(MODEL, state_words=300), 64)
    lm = toy.ToyLM(engine, MODEL, 64)
    with pytest.raises(ValueError, match="no recurrent states"):
        lm.live_states()
    lm.round_stream(StreamBufs(engine, Geometry(4, 2)), kernels=spec)
    with pytest.raises(ValueError, match="k = 2"):
        lm.prefill(StreamBufs(engine, Geometry(2, 2)), [1, 2, 3])
    with pytest.raises(ValueError, match="no recurrent states"):
        toy.ToyLM(engine, toy.ToyModel(), 64).live_states()

"""The hybrid random-weight Llama (memra_cuda.torch.testing, issue 20) through memra_cuda.torch's
decoders: the target's layers HYBRID a gated linear recurrence whose state round-stream rolls
back every round, by copy or by flipping an index (CopyState, FlipState). Its output equals its
own plain greedy decoding (GraphedGreedy: Hugging Face cannot run the layer) token for token
over 256 tokens, fp32, in every mode, both rollbacks, for one request and for a batch of 8 with
different budgets, EOS stops and a one-token prompt, and served continuously, with its
self-speculative draft and (graph mode, B = 8) with a separate draft model; sampled, a request's
tokens are the same in every mode; after a generation the state is the committed tokens' own;
and without the state's rollback the tokens go wrong. Skipped with the reason where torch or
transformers is missing.
"""
from __future__ import annotations

import pytest

from memra_cuda import Geometry
from memra_cuda.errors import LoopUnsupported
from memra_cuda.rounds import MODES

torch = pytest.importorskip("torch", reason="needs PyTorch (pip install '.[torch]' in the checkout)")
pytest.importorskip("transformers", reason="memra_cuda.torch.testing needs transformers")
from memra_cuda.torch.testing import HYBRID, PROMPT, build_model, prompts, separate_draft  # noqa: E402
from memra_cuda.torch import (GraphedGreedy, Request, SamplingParams, SpeculativeLlama, Stack,  # noqa: E402
                              capacity_for, self_draft)
from test_torch_batch_gpu import first_difference  # noqa: E402  (imports torch)

pytestmark = [pytest.mark.gpu, pytest.mark.torch]

K, M, TOKENS = 4, 16, 256
BUDGETS = {1: [TOKENS], 8: [256, 64, 256, 200, 256, 128, 256, 96]}
EOS_ROWS = {1: {}, 8: {2: 100, 5: 30}}  # row -> the index in its own output of the token it stops at
ROLLBACKS = ("copy", "flip")
CASES = [(state, batch, mode) for state in ROLLBACKS for batch in BUDGETS for mode in MODES]


@pytest.fixture(scope="module")
def batches(hybrid):
    """B -> (requests, what plain greedy decoding gives each, its greedy tokens K past every
    budget and EOS, capacity). One request of PROMPT; eight prompts of 2 to 40 tokens, budgets of
    64 to 256, two rows stopped by an EOS from their own output."""
    out = {}
    for batch, budgets in BUDGETS.items():
        rows = [PROMPT] if batch == 1 else [[1], *prompts(batch - 1, seed=7)]  # [1]: no prefill
        capacity = capacity_for(max(map(len, rows)), TOKENS, Geometry(K, M, batch))
        greedy = GraphedGreedy(hybrid, capacity, batch)
        longer = greedy.generate_batch([Request(p, n + K) for p, n in zip(rows, budgets)])
        stops = [longer[row][EOS_ROWS[batch][row]] if row in EOS_ROWS[batch] else None for row in range(batch)]
        requests = [Request(p, n, eos) for p, n, eos in zip(rows, budgets, stops)]
        want = [row[:n] for row, n in zip(longer, budgets)]
        want = [row[:row.index(eos) + 1] if eos in row else row for row, eos in zip(want, stops)]
        out[batch] = requests, want, longer, capacity
    return out


@pytest.fixture(scope="module")
def decoders(hybrid, batches):
    """(state, B) -> a SpeculativeLlama of the hybrid and its self-speculative draft, made once
    for the module."""
    made = {}

    def get(state: str, batch: int):
        if (state, batch) not in made:
            made[state, batch] = SpeculativeLlama(hybrid, self_draft(hybrid), k=K, m_rounds=M,
                                                  capacity=batches[batch][3], batch=batch, state_rollback=state)
        return made[state, batch]
    return get


def generate(spec, requests, mode: str) -> list[list[int]]:
    try:
        return spec.generate_batch(requests, mode)
    except LoopUnsupported as exc:
        pytest.skip(f"device mode needs conditional graph nodes: {exc}")


@pytest.mark.parametrize("state, batch, mode", CASES, ids=[f"{s}-B{b}-{m}" for s, b, m in CASES])
def test_hybrid_equals_its_own_plain_greedy(decoders, batches, state, batch, mode):
    spec = decoders(state, batch)
    requests, want, _, _ = batches[batch]
    got = generate(spec, requests, mode)
    for row, (mine, theirs) in enumerate(zip(got, want)):
        assert mine == theirs, f"{state}, {mode}, row {row}: first difference at token {first_difference(mine, theirs)}"
    assert 0.0 < spec.acceptance([len(row) for row in got]) < 1.0, "drafts must be rejected, so state rolled back"
    if batch > 1:
        assert any(r.eos is not None and len(row) < r.max_new_tokens for r, row in zip(requests, got)), \
            "no row stopped at its EOS before its budget"


@pytest.mark.parametrize("state", ROLLBACKS)
def test_after_a_generation_the_state_is_the_committed_tokens_own(hybrid, decoders, batches, state):
    """The rolled-back state itself: after a batch (rows done at different rounds, two by EOS,
    sitting rounds out), each row's live state equals the plain decoder's prefill of the tokens
    at positions below the row's pos_ctr (the pending token's, not yet taken in). A state off by
    one token, or a rejected draft's, differs by far more than the tolerance (states are ~10)."""
    spec = decoders(state, 8)
    requests, _, longer, capacity = batches[8]
    generate(spec, requests, "graph")
    layers, shape = len(HYBRID), (8, 64, 64)  # heads x d_k x d_v of the small model
    slots = K + 1 if state == "copy" else 2 * (K + 1)
    assert spec.draft.state is None and spec.target.state.slots.shape == (layers, 8, slots, *shape)
    committed = spec.views.pos_ctr[:, 0].tolist()
    full = [list(r.prompt) + tokens for r, tokens in zip(requests, longer)]
    assert all(n <= len(tokens) for n, tokens in zip(committed, full)), "committed past the reference's tokens"
    fresh = Stack(hybrid, capacity, batch=8)
    fresh.prefill(range(8), [tokens[:n] for tokens, n in zip(full, committed)])
    spec.target.state.begin()  # FLIP: which slot is each row's live one
    mine = torch.stack([spec.target.state.read(n) for n in range(layers)])
    torch.testing.assert_close(mine, fresh.state.live, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("state", ROLLBACKS)
def test_served_requests_equal_their_own_plain_greedy(hybrid, state):
    """Continuous batching: a row's state is prefilled anew while the other rows are mid-request
    (one-row prefill graphs of several lengths, a one-token prompt among them), and each request
    equals its plain greedy decoding alone."""
    lengths, budgets = (1, 7, 23, 3, 40, 12, 2, 31), (40, 80, 24, 64, 48, 80, 32, 56)
    rows = [[1]] + [(p + [5] * 40)[:n] for p, n in zip(prompts(len(lengths) - 1, seed=11), lengths[1:])]
    requests = [Request(prompt, n) for prompt, n in zip(rows, budgets)]
    capacity = capacity_for(max(lengths), max(budgets), Geometry(K, M, 4))
    alone = GraphedGreedy(hybrid, capacity)
    want = [alone.generate(r.prompt, r.max_new_tokens) for r in requests]
    spec = SpeculativeLlama(hybrid, self_draft(hybrid), k=K, m_rounds=M, capacity=capacity, batch=4,
                            state_rollback=state)
    served = spec.serve(requests, "graph")
    for i, (done, theirs) in enumerate(zip(served, want)):
        assert done.tokens == theirs, f"request {i}: first difference at token {first_difference(done.tokens, theirs)}"


@pytest.mark.parametrize("state", ROLLBACKS)
def test_sampled_tokens_are_the_same_in_every_mode(hybrid, state):
    """Sampling through the hybrid: the draws are keyed by seed and position, so a request's
    tokens are the same whatever the mode runs its rounds, as long as every rejected draft's
    state is rolled back out (acceptance below one: some were)."""
    rows = [PROMPT, [1, 300, 17]]
    requests = [Request(prompt, 64, None, seed) for seed, prompt in enumerate(rows, 3)]
    capacity = capacity_for(max(map(len, rows)), 64, Geometry(K, M, 2))
    spec = SpeculativeLlama(hybrid, self_draft(hybrid), k=K, m_rounds=M, capacity=capacity, batch=2,
                            state_rollback=state, sampling=SamplingParams(temperature=0.5))
    runs = {mode: generate(spec, requests, mode) for mode in ("readback", "graph", "device")}
    for mode, got in runs.items():
        for row, (mine, theirs) in enumerate(zip(got, runs["readback"])):
            assert mine == theirs, f"{mode}, row {row}: first difference at token {first_difference(mine, theirs)}"
    assert 0.0 < spec.acceptance([len(row) for row in runs["device"]]) < 1.0


def test_without_the_state_rollback_the_tokens_go_wrong(hybrid, batches):
    """The recurrent state matters: the same decoder with its state tables left out (the state
    stays the prompt's) gives other tokens."""

    class Unrolled(SpeculativeLlama):
        def state_tables(self) -> list:
            return []

    requests, want, _, capacity = batches[1]
    spec = Unrolled(hybrid, self_draft(hybrid), k=K, m_rounds=M, capacity=capacity)
    assert spec.rounds.round.after_commit == ()  # no state rollback queued (the lengths' is the greedy tail's)
    assert spec.generate_batch(requests, "graph") != want


def test_plain_greedy_graphed_equals_eager(hybrid, batches):
    """The reference itself: its graphed step updates the live state in place as the eager one does."""
    requests, want, _, capacity = batches[8]
    assert GraphedGreedy(hybrid, capacity, batch=8, eager=True).generate_batch(requests) == want


@pytest.mark.parametrize("state", ROLLBACKS)
def test_a_separate_draft_serves_the_hybrid_as_its_own_plain_greedy(hybrid, batches, state):
    """A draft model of its own (two attention layers, bf16, its own caches and prefills) beside
    the hybrid target: a batch of 8 in graph mode equals the target's plain greedy decoding."""
    requests, want, _, capacity = batches[8]
    spec = SpeculativeLlama(hybrid, separate_draft(hybrid), k=K, m_rounds=M, capacity=capacity, batch=8,
                            state_rollback=state)
    assert not spec.shared and spec.draft.state is None
    got = spec.generate_batch(requests, "graph")
    for row, (mine, theirs) in enumerate(zip(got, want)):
        assert mine == theirs, f"{state}, row {row}: first difference at token {first_difference(mine, theirs)}"
    assert 0.0 < spec.acceptance([len(row) for row in got]) < 1.0


def test_recurrent_layers_are_refused_in_the_draft(hybrid):
    """The draft folds its last step into the next round's first, taking a token twice: fine
    for a KV entry, wrong for a recurrent state."""
    with pytest.raises(ValueError, match="past the draft"):
        build_model("small", recurrent_layers=(0,))
    with pytest.raises(ValueError, match="must be attention"):
        SpeculativeLlama(hybrid, self_draft(hybrid, HYBRID[0] + 1))

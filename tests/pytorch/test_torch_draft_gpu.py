"""A separate draft model (issue 40, item 2): memra_cuda.torch's decoders given a target and a draft
that are two models of one vocabulary, each with its own static caches, prefills and graphs.

The draft here is memra_cuda.torch.testing.separate_draft of the small random-weight Llama: a
config of its own (two layers), parameters of its own in bf16 beside the fp32 target (copies of
the target's first layers, so it agrees often), sharing no module and so no cache. Greedy, every
row equals the target's own greedy decoding (Hugging Face's) token for token, chains and static
and dynamic trees, B 1 and 8, every mode; served continuously, each request its own, no graph
captured while serving; after a batch the draft's cache (an fp32 separate draft's, to compare
tightly) holds every committed token as its own prefill would; sampled, a request's tokens are
the same in every mode and the first token is distributed as the target's softmax, chain and
tree. The examples load a target and a draft from checkpoint directories and check themselves
against Hugging Face. Skipped with the reason where torch or transformers is missing.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from memra_cuda import Geometry
from memra_cuda.rounds import MODES

torch = pytest.importorskip("torch", reason="needs PyTorch (pip install '.[torch]' in the checkout)")
pytest.importorskip("transformers", reason="memra_cuda.torch.testing needs transformers")
from memra_cuda.torch.testing import prompts, separate_draft  # noqa: E402
from memra_cuda.torch import (Request, SamplingParams, SpeculativeLlama, Stack, capacity_for,  # noqa: E402
                              hf_greedy)
from test_torch_batch_gpu import (assert_first_sampled_token_is_the_targets_softmax, first_difference,  # noqa: E402
                                  sampled)
from test_torch_hybrid_gpu import BUDGETS, generate  # noqa: E402  (the same budgets)
from test_torch_stack import save_pair  # noqa: E402  (a tiny pair saved as checkpoint directories)
from test_torch_tree_gpu import (TREES, assert_first_sampled_tree_token_is_the_targets_softmax,  # noqa: E402
                                 assert_kv_is_a_fresh_prefill, greedy_requests, tree_decoder)

pytestmark = [pytest.mark.gpu, pytest.mark.torch]

K, M, TOKENS = 4, 16, 256
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def greedy_batches(small):
    """B -> (requests, Hugging Face's greedy of each alone, the longest prompt), as the trees' tests'."""
    return greedy_requests(small)


@pytest.fixture(scope="module")
def draft(small):
    """The small model's separate draft: two layers, bf16."""
    return separate_draft(small)


@pytest.fixture(scope="module")
def draft32(small):
    """The same in fp32, whose cache a fresh prefill must match to 1e-4."""
    return separate_draft(small, dtype=torch.float32)


def chain(model, draft_model, longest: int, batch: int, **kwargs) -> SpeculativeLlama:
    return SpeculativeLlama(model, draft_model, k=K, m_rounds=M, batch=batch,
                            capacity=capacity_for(longest, TOKENS, Geometry(K, M, batch)), **kwargs)


def assert_rows_equal(got: list[list[int]], want: list[list[int]], what: str) -> None:
    for row, (mine, theirs) in enumerate(zip(got, want)):
        assert mine == theirs, f"{what}, row {row}: first difference at token {first_difference(mine, theirs)}"


@pytest.fixture(scope="module")
def chains(small, draft, greedy_batches):
    """B -> a greedy chain decoder of the small model and its separate draft, made once."""
    return {batch: chain(small, draft, greedy_batches[batch][2], batch) for batch in BUDGETS}


CHAIN_CASES = [(batch, mode) for batch in BUDGETS for mode in MODES]


@pytest.mark.parametrize("batch, mode", CHAIN_CASES, ids=[f"B{b}-{m}" for b, m in CHAIN_CASES])
def test_chains_with_a_separate_draft_equal_the_targets_greedy(chains, greedy_batches, batch, mode):
    spec = chains[batch]
    assert not spec.shared and spec.draft.model.dtype == torch.bfloat16 and len(spec.draft.layers) == 2
    requests, want, _ = greedy_batches[batch]
    got = generate(spec, requests, mode)
    assert_rows_equal(got, want, f"chain, {mode}")
    assert 0.0 < spec.acceptance([len(row) for row in got]) < 1.0, "the draft must agree often, but not always"


@pytest.fixture(scope="module")
def trees(small, draft, greedy_batches):
    """(tree name, B) -> a greedy TreeLlama of the small model and its separate draft, made once."""
    return {(name, batch): tree_decoder(small, TREES[name], greedy_batches[batch][2], TOKENS, batch, draft=draft)
            for name in TREES for batch in BUDGETS}


TREE_CASES = [(name, batch, mode) for name in TREES for batch in BUDGETS for mode in MODES]


@pytest.mark.parametrize("name, batch, mode", TREE_CASES, ids=[f"{n}-B{b}-{m}" for n, b, m in TREE_CASES])
def test_trees_with_a_separate_draft_equal_the_targets_greedy(trees, greedy_batches, name, batch, mode):
    spec = trees[name, batch]
    assert spec.draft_mask is not spec.target_mask, "a mask in each model's dtype"
    requests, want, _ = greedy_batches[batch]
    got = generate(spec, requests, mode)
    assert_rows_equal(got, want, f"{name} tree, {mode}")
    tau = spec.bufs.tokens_per_round([len(row) for row in got])
    assert 1.2 < tau < spec.k + 1, f"{tau:.2f} tokens a round: the tree must accept some drafts and reject others"


def test_a_separate_drafts_cache_holds_every_committed_token_as_its_own_prefill(small, draft32, greedy_batches):
    """After a batch, the separate draft's entries at every committed position (but the last,
    which the next round's first step appends) are a fresh prefill's by the draft itself: its own
    prefill, not a copy of the target's, and its fold of the last draft."""
    requests, want, longest = greedy_batches[8]
    spec = chain(small, draft32, longest, 8)
    got = spec.generate_batch(requests, "graph")
    assert_rows_equal(got, want, "chain, fp32 draft")
    full = [list(r.prompt) + tokens for r, tokens in zip(requests, got)]
    committed = [min(int(n), len(tokens) - 1) - 1 for n, tokens in zip(spec.bufs.positions, full)]
    fresh = Stack(draft32, spec.draft.kv.capacity, batch=8)
    fresh.prefill(range(8), [tokens[:n] for tokens, n in zip(full, committed)])
    for mine, theirs in ((torch.stack(spec.draft.kv.k), torch.stack(fresh.kv.k)),  # [layers][B][heads][capacity][d]
                         (torch.stack(spec.draft.kv.v), torch.stack(fresh.kv.v))):
        for row, n in enumerate(committed):
            torch.testing.assert_close(mine[:, row, :, :n], theirs[:, row, :, :n], atol=1e-4, rtol=1e-4,
                                       msg=lambda m, row=row: f"row {row}: {m}")


@pytest.mark.parametrize("paged", [None, 16], ids=["static", "paged"])
def test_a_trees_caches_with_a_separate_draft_are_their_own_prefills(small, draft32, greedy_batches, paged):
    requests, want, longest = greedy_batches[8]
    spec = tree_decoder(small, TREES["static"], longest, TOKENS, 8, draft=draft32, paged=paged)
    got = generate(spec, requests, "graph")
    assert_rows_equal(got, want, f"tree, fp32 draft, paged={paged}")
    assert_kv_is_a_fresh_prefill(spec, requests, got)


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_served_requests_with_a_separate_draft_equal_hugging_face_each_alone(small, draft, kind):
    """Continuous batching: 10 requests through 3 slots, both models' rows prefilled anew (the
    draft's by its own one-row prefill graphs, captured up front with the target's) while the
    others are mid-request."""
    budgets = [40, 96, 17, 64, 80, 33, 96, 50, 71, 24]
    requests = [Request(p, n) for p, n in zip(prompts(10, seed=11), budgets)]
    spec = chain(small, draft, 40, 3) if kind == "chain" else tree_decoder(small, TREES["dynamic"], 40, 96, 3,
                                                                          draft=draft)
    spec.capture(("graph",))
    captured = spec.rounds.graphs, sorted(spec.target.prefills.graphs), sorted(spec.draft.prefills.graphs)
    assert captured[2], "the draft's own prefill graphs"
    served = spec.serve(requests)
    assert (spec.rounds.graphs, sorted(spec.target.prefills.graphs), sorted(spec.draft.prefills.graphs)) == captured, \
        "serving captured a graph"
    for i, (request, out) in enumerate(zip(requests, served)):
        want = hf_greedy(small, request.prompt, request.max_new_tokens)
        assert out.tokens == want, f"request {i}: first difference at token {first_difference(out.tokens, want)}"


def test_a_decoder_waits_for_the_weights_its_callers_stream_is_still_writing(small, greedy_batches):
    """A draft made a moment before its decoder, its weights still queued on the caller's stream
    behind a kernel that sleeps: the decoder's own stream (non-blocking, as torch's are) waits for
    them before fusing them. Unordered, the fused copies read memory not yet written, and the draft
    never agrees (its tokens still the target's: a failure only its acceptance shows)."""
    requests, want, longest = greedy_batches[1]
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # about half a second of the current stream, ahead of the draft's weights
    made = separate_draft(small)
    spec = chain(small, made, longest, 1)
    mine, theirs = made.model.layers[0], small.model.layers[0]
    for name in ("q_proj", "k_proj", "v_proj"):  # fused: views of one weight, copied on the decoder's stream
        assert torch.equal(getattr(mine.self_attn, name).weight, getattr(theirs.self_attn, name).weight.bfloat16())
    got = spec.generate_batch(requests, "graph")
    assert_rows_equal(got, want, "a draft made just before its decoder")
    assert spec.acceptance([len(row) for row in got]) > 0.0


# -- sampling -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_sampled_tokens_with_a_separate_draft_are_the_same_in_every_mode(peaked, kind):
    """Draws are keyed by seed and position, so a request's tokens do not depend on how the mode
    runs its rounds (one batch, its rows in one order; an fp32 draft: only the probabilities' last
    bits could move a draw, and those do not move with the mode)."""
    params = SamplingParams(temperature=1.0, top_k=200, top_p=0.95)
    draft_model = separate_draft(peaked, dtype=torch.float32)
    if kind == "chain":  # request index -> its tokens, a decoder a mode
        by_mode = {mode: sampled(peaked, 3, M, mode, [0, 1, 2], params, draft=draft_model) for mode in MODES}
        runs = {mode: [run[i] for i in range(3)] for mode, run in by_mode.items()}
    else:
        requests = [Request(p, 48, None, 100 + i) for i, p in enumerate(prompts(3, seed=5))]
        spec = tree_decoder(peaked, TREES["dynamic"], 40, 48, 3, draft=draft_model, sampling=params)
        runs = {mode: generate(spec, requests, mode) for mode in MODES}
    for mode, run in runs.items():
        assert_rows_equal(run, runs["graph"], f"{kind}, {mode} against graph")
    assert len({tuple(row) for row in runs["graph"]}) == 3, "different seeds, same tokens"


@pytest.mark.alone
def test_first_sampled_token_with_a_separate_draft_is_the_targets_softmax(peaked):
    assert_first_sampled_token_is_the_targets_softmax(peaked, separate_draft(peaked))


@pytest.mark.alone
def test_first_sampled_tree_token_with_a_separate_draft_is_the_targets_softmax(peaked):
    assert_first_sampled_tree_token_is_the_targets_softmax(peaked, separate_draft(peaked))


# -- the examples, from checkpoint directories ---------------------------------------------------

EXAMPLE_RUNS = {"chain": ("torch_llama.py", "--batch", "8"),
                "served": ("torch_llama.py", "--batch", "3", "--serve", "7"),
                "tree": ("torch_tree.py", "--batch", "8", "--tree", "static:8,4")}


@pytest.mark.parametrize("argv", EXAMPLE_RUNS.values(), ids=EXAMPLE_RUNS)
def test_the_examples_decode_a_pair_loaded_from_directories_as_hugging_face_does(engine, tmp_path, argv):
    """A tiny target and a draft of another shape saved with save_pretrained (and a tokenizer
    beside each), loaded by the example (--model, --draft, fp32): every row is Hugging Face's
    greedy decoding of its prompt, the example's own check."""
    save_pair(tmp_path)
    name, *rest = argv
    done = subprocess.run([sys.executable, str(EXAMPLES / name), "--model", str(tmp_path / "target"), "--draft",
                           str(tmp_path / "draft"), "--dtype", "float32", "--tokens", "48",
                           "--prompt", "w5 w9 w3", "--prompt", "w7", "--prompt", "w2 w2 w8 w40 w11", *rest],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "equals Hugging Face greedy on its own prompt: yes" in done.stdout, \
        done.stdout[-3000:] + done.stderr[-3000:]

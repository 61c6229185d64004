"""A request stream served through fewer slots, plain and speculative alike: GraphedGreedy,
SpeculativeLlama and TreeLlama (the small random-weight Llama and its self-speculative draft)
behind one memra_cuda.rounds.Server. Every request's tokens are the target's own greedy decoding of it alone
(Hugging Face's, hf_greedy) token for token, whatever row it ran in and whatever ran beside it; a
request that cannot run is refused alone, naming it, and the others are served; a request
cancelled mid-generation keeps the tokens it was sent (a prefix of its own output), its row goes
to the next request at the next boundary, and no other request's tokens change; no graph is
captured while serving. Skipped with the reason where torch or transformers is missing.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs PyTorch (pip install '.[torch]' in the checkout)")
pytest.importorskip("transformers", reason="memra_cuda.torch.testing needs transformers")
from memra_cuda import Geometry  # noqa: E402
from memra_cuda.buffers.layout import BRK_COUNT  # noqa: E402
from memra_cuda.torch.testing import prompts  # noqa: E402
from test_torch_batch_gpu import first_difference  # noqa: E402  (imports torch)
from interrupt import interrupt_once  # noqa: E402
from memra_cuda import TreeShape  # noqa: E402
from memra_cuda.errors import CaptureError  # noqa: E402
from memra_cuda.torch import (GraphedGreedy, Request, SpeculativeLlama, TreeLlama, capacity_for,  # noqa: E402
                              hf_greedy, self_draft)

pytestmark = [pytest.mark.gpu, pytest.mark.torch]

K, M, SLOTS, REQUESTS = 4, 16, 3, 10
LONG = 1  # the request of the most tokens, 96, more than a burst gives: a chain's (k + 1) M = 80


@pytest.fixture(scope="module")
def stream(small):
    """REQUESTS requests of prompts of 2 to 40 tokens and budgets of 8 to 96 (LONG's 96), every
    third stopped by an EOS taken from the middle of its own output, and what Hugging Face's
    greedy decoding gives each alone."""
    budgets = np.random.default_rng(48).integers(8, 97, REQUESTS)
    budgets[LONG] = 96
    requests = [Request(prompt, int(n)) for prompt, n in zip(prompts(REQUESTS, seed=48), budgets)]
    want = [hf_greedy(small, r.prompt, r.max_new_tokens) for r in requests]
    for i in range(0, REQUESTS, 3):
        eos = want[i][len(want[i]) // 2]
        requests[i] = requests[i]._replace(eos=eos)
        want[i] = want[i][:want[i].index(eos) + 1]
    assert any(len(tokens) < r.max_new_tokens for r, tokens in zip(requests, want)), "no EOS stops a request early"
    return requests, want


@pytest.fixture(params=["plain", "chain", "switch", "tree"])
def decoder(request, small):
    """The plain loop, the chain decoder, the chain decoder with bodies of widths 0 and 2 beside
    k's, one switched to each round by the width chosen (CUDA 12.8+; skipped, naming why, before),
    or a tree decoder of depth k (a chain with a leaf beside each draft), over SLOTS rows, every
    graph captured (a plain server captures its own as it is made)."""
    capacity = capacity_for(40, 96, Geometry(K, M, SLOTS))
    if request.param == "plain":
        return GraphedGreedy(small, capacity, SLOTS)
    if request.param == "tree":
        tree = TreeShape.chain_with_leaves(K, 1)
        spec = TreeLlama(small, self_draft(small), tree, m_rounds=M, batch=SLOTS,
                         capacity=capacity_for(40, 96, Geometry(K, M, SLOTS, tree.nodes)))
        spec.capture(("graph",))
        return spec
    widths = ()
    if request.param == "switch":
        request.getfixturevalue("switches")
        widths = (0, 2)
    spec = SpeculativeLlama(small, self_draft(small), k=K, m_rounds=M, capacity=capacity, batch=SLOTS, widths=widths)
    if widths:  # each width's body timed, and its time the chooser's cost of it
        assert set(spec.width_ms) == {0, 2, K} and all(ms > 0 for ms in spec.width_ms.values())
        # then costs of the test's own, under which a row at the prior's acceptance drafts (width 2) and
        # one that agrees widens (K): with the costs timed beside other workers' tests, no row drafted in
        # any request once (width 0 chosen throughout: a row's acceptance is learnt from judged drafts alone)
        spec.lengths.set_costs(spec.widths.costs({0: 1.0, 2: 1.2, K: 1.4}), 0.0)
    with pytest.raises(ValueError, match="mode must be one of"):
        spec.capture(("grpah",))  # a name misspelt: it captured as "graph"
    spec.capture("graph")
    return spec


def graphs(decoder) -> tuple:
    """Every graph the decoder holds, by identity: a capture while serving changes them."""
    if isinstance(decoder, GraphedGreedy):
        return decoder.graph, dict(decoder.stack.prefills.graphs)
    return (decoder.rounds.graphs, dict(decoder.target.prefills.graphs), dict(decoder.draft.prefills.graphs))


def test_every_request_is_its_own_greedy_output_and_one_that_cannot_run_is_refused_alone(small, stream, decoder):
    requests, want = stream
    too_long, outside = Request([1, 2, 3], 10_000), Request([1, small.config.vocab_size, 2], 5)
    queue = requests[:4] + [too_long] + requests[4:7] + [outside] + requests[7:]
    decoder.server()  # a plain server captures its graphs as it is made; the decoder's are captured
    captured = graphs(decoder)
    served = decoder.serve(queue)
    assert graphs(decoder) == captured, "serving captured a graph"
    assert served[4].refused is not None and served[4].refused.startswith("request 4 refused: 3 prompt tokens and "
                                                                          "10000 new need a ")
    assert served[8].refused == (f"request 8 refused: its prompt's token {small.config.vocab_size} (at 1) is outside "
                                 f"the vocabulary of {small.config.vocab_size} tokens")
    ran = [out for i, out in enumerate(served) if i not in (4, 8)]
    for i, (out, tokens) in enumerate(zip(ran, want)):
        assert out.refused is None and not out.cancelled
        assert out.tokens == tokens, f"request {i}: first difference at token {first_difference(out.tokens, tokens)}"
        assert len(out.arrivals) == len(out.tokens) and out.submitted <= out.admitted < out.arrivals[0] <= out.finished
        if isinstance(decoder, GraphedGreedy):
            assert out.accepted is None and out.rounds is None, "the plain loop has no drafts"
        else:  # read back with its tokens: every round commits its accepted drafts and one
            assert 0 <= out.accepted < len(out.tokens) and out.rounds == len(out.tokens) - out.accepted
    if not isinstance(decoder, GraphedGreedy):
        assert sum(out.accepted for out in ran) > 0, "a self-draft had no draft accepted in any request"


def test_a_cancelled_request_keeps_its_tokens_and_gives_its_row_to_the_next(stream, decoder):
    requests, want = stream
    server = decoder.server()
    ids = [server.submit(request) for request in requests]
    first, victim = server.step(), LONG  # admitted in row LONG, still running: no burst gives 96 tokens
    assert 0 < len(first.tokens[ids[victim]]) < len(want[victim]) and ids[victim] not in first.finished
    for taking in (decoder.server, lambda: decoder.generate_batch(requests[:SLOTS])):  # each ended every request
        with pytest.raises(RuntimeError, match="would take the rows of this decoder's server"):
            taking()
    assert server.cancel(ids[victim])
    second = server.step()
    assert ids[victim] in second.finished and ids[victim] not in second.tokens
    assert len(second.tokens) == SLOTS, "a row sat the burst out while requests were queued"
    served = {**first.finished, **second.finished}
    while not server.idle:
        served.update(server.step().finished)
    cancelled = served[ids[victim]]
    assert cancelled.cancelled and cancelled.tokens == first.tokens[ids[victim]]
    assert cancelled.tokens == want[victim][:len(cancelled.tokens)], "a cancelled request keeps its own tokens"
    for i in range(REQUESTS):
        if i != victim:
            out = served[ids[i]]
            assert not out.cancelled and out.tokens == want[i], \
                f"request {i}: first difference at token {first_difference(out.tokens, want[i])}"


def test_a_burst_whose_wait_an_interrupt_cut_short_is_handed_out_by_the_next_step(stream, decoder, monkeypatch):
    """A step interrupted as it waited for its burst: that burst ran, and its tokens are the
    decoder's alone until the next burst overwrites them. The next step hands them out (recover)
    before any row changes hands, so every request is still its own greedy output: without it,
    each lost that burst's tokens, silently."""
    requests, want = stream
    server = decoder.server()
    ids = [server.submit(request) for request in requests]
    first = server.step()
    if isinstance(decoder, GraphedGreedy):  # its wait is the read of its tokens
        interrupt_once(monkeypatch, decoder, "_tokens", waited=False)
    else:  # the wait for the pinned slot ends, the slot unread
        interrupt_once(monkeypatch, decoder.bufs.engine, "finish_readback")
    with pytest.raises(KeyboardInterrupt):
        server.step()
    served = dict(first.finished)
    while not server.idle:
        served.update(server.step().finished)
    for i, ident in enumerate(ids):
        assert served[ident].tokens == want[i], \
            f"request {i}: first difference at token {first_difference(served[ident].tokens, want[i])}"


@pytest.mark.parametrize("launched", [True, False], ids=["as the replay returns", "before its launch"])
def test_a_plain_burst_an_interrupt_cut_at_its_replay_leaves_no_hole(stream, small, monkeypatch, launched):
    """A Ctrl-C as the plain loop's replay returned (launched) came after the burst's launch, and
    recover() took it for one before: the rows had gone on, and every request lacked that burst's
    tokens in the middle of its output, silently. The device marks the burst's first token until
    the replay writes it, so the next step hands the burst out where it ran, and runs it where it
    did not: every request is its own greedy output either way."""
    requests, want = stream
    decoder = GraphedGreedy(small, capacity_for(40, 96, Geometry(K, M, SLOTS)), SLOTS)
    server = decoder.server()
    ids = [server.submit(request) for request in requests]
    served = dict(server.step().finished)
    interrupt_once(monkeypatch, decoder.graph, "replay", waited=launched)
    with pytest.raises(KeyboardInterrupt):
        server.step()
    while not server.idle:
        served.update(server.step().finished)
    for i, ident in enumerate(ids):
        assert served[ident].tokens == want[i], \
            f"request {i}: first difference at token {first_difference(served[ident].tokens, want[i])}"


def test_requests_at_their_own_draft_lengths_are_each_their_own_greedy_output(stream, decoder):
    """Every request with a most draft length of its own, 0 (speculation off) to past k, served
    together: each is its own greedy output (the plain loop takes the lengths and has no drafts).
    In the chain and tree decoders, generate_batch applies a batch's lengths too: the row at 0 had
    every round's acceptance capped (brk's count), one token a round."""
    requests, want = stream
    lengths = [i % (K + 2) for i in range(REQUESTS)]  # 0 .. k + 1: past k is k
    served = decoder.serve([r._replace(max_draft=n) for r, n in zip(requests, lengths)])
    for i, (out, tokens) in enumerate(zip(served, want)):
        assert out.refused is None and out.tokens == tokens, \
            f"request {i} at length {lengths[i]}: first difference at token {first_difference(out.tokens, tokens)}"
        if lengths[i] == 0 and not isinstance(decoder, GraphedGreedy):  # the output proves nothing of the cap
            assert out.accepted == 0 and out.rounds == len(tokens), f"request {i} at length 0 had drafts accepted"
    if isinstance(decoder, GraphedGreedy):
        return
    batch = [r._replace(max_draft=0 if row == 0 else None) for row, r in enumerate(requests[:SLOTS])]
    assert decoder.generate_batch(batch) == want[:SLOTS]
    capped = decoder.engine.dtoh(decoder.bufs.brk_d).reshape(SLOTS, -1)[:, BRK_COUNT]
    assert capped[0] == len(want[0]), "the row at length 0 commits one token a round, each round capped"
    decoder.prefill([0], [requests[0].prompt])  # a prefill's row drafts at the full length unless it says
    assert decoder.engine.dtoh(decoder.lengths.cap_d).tolist() == [K] * SLOTS
    with pytest.raises(ValueError, match="caps holds at most 1 ints, one a row, not 2"):
        decoder.prefill([0], [requests[0].prompt], caps=[0, 1])


def test_a_decoder_captured_for_device_mode_generates_a_batch_in_one_launch_capturing_nothing(small, stream):
    """capture(("graph", "device")) captures device mode's loop with the burst graphs, for any
    budget the caches hold: a batch generated in device mode then captures nothing and gives the
    target's own greedy decoding, as graph mode does; a decoder captured for graph mode alone
    refuses device mode (CaptureError) rather than capture its loop mid-generation."""
    requests, want = stream
    capacity = capacity_for(40, 96, Geometry(K, M, SLOTS))
    spec = SpeculativeLlama(small, self_draft(small), k=K, m_rounds=M, capacity=capacity, batch=SLOTS)
    spec.capture(("graph", "device"))
    loop, captured = spec.rounds.device_loop, graphs(spec)
    assert loop.captures == 1
    for start in range(0, REQUESTS - SLOTS + 1, SLOTS):
        batch = requests[start:start + SLOTS]
        assert spec.generate_batch(batch, "device") == want[start:start + SLOTS]
    assert loop.captures == 1 and graphs(spec) == captured, "a generation captured a graph"
    graph_only = SpeculativeLlama(small, self_draft(small), k=K, m_rounds=M, capacity=capacity, batch=SLOTS)
    graph_only.capture(("graph",))
    positions = graph_only.bufs.positions.tolist()
    with pytest.raises(CaptureError, match="capture_loop"):
        graph_only.generate_batch(requests[:SLOTS], "device")
    assert graph_only.bufs.positions.tolist() == positions, "the refused batch's rows were prefilled"
    assert graph_only.generate_batch(requests[:SLOTS], "graph") == want[:SLOTS]


def test_a_decoders_server_captures_every_graph_first_where_capture_was_not_called(small, stream):
    """server() on a decoder never captured: every graph is captured and the rounds sealed before
    the first request, so serving captures nothing (a capture mid-serving stalls every row)."""
    requests, want = stream
    spec = SpeculativeLlama(small, self_draft(small), k=K, m_rounds=M,
                            capacity=capacity_for(40, 96, Geometry(K, M, SLOTS)),
                            batch=SLOTS)
    server = spec.server()
    assert spec.rounds.sealed
    captured = graphs(spec)
    served = server.serve(requests)
    assert graphs(spec) == captured, "serving captured a graph"
    assert [out.tokens for out in served] == want

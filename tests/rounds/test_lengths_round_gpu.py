"""Rounds whose rows' draft lengths are chosen on the device (RoundStream(lengths=DraftLengths),
docs/lengths.md), the toy end to end on the GPU: rows of one batch at different lengths (0
included: speculation off), whatever the costs make of the batch's width, give each row the
target's own greedy output token for token, in every mode, and a switch of bodies by width too;
a sampled row at length 0 draws word for word what plain sampling (k = 0) draws for its seed (the
first token at mixed lengths distributed as the target's law: tests/testing/test_toy_sampling_gpu.py)."""
from __future__ import annotations

import numpy as np
import pytest

from memra_cuda import Geometry
from memra_cuda import UNCHECKED, StreamBufs, kv_capacity, kv_len_ptr_table
from memra_cuda.buffers import DraftLengths
from memra_cuda.buffers.acceptance import Greedy
from memra_cuda.buffers.layout import BRK_COUNT, BRK_WORDS
from memra_cuda.kernels import SpecKernels
from memra_cuda.driver.graph import stream_capture
from memra_cuda.errors import LoopUnsupported
from memra_cuda.rounds import MODES, RoundStream, Stages
from memra_cuda.rounds.round import chain
from memra_cuda.rounds.switch import Widths
from memra_cuda.testing.toy import lm as toy

from toy_requests import requests, sampled

pytestmark = pytest.mark.gpu

MODEL = toy.ToyModel(seed=21, vocab=50, kv_mask=(True, False, True), noise_ppm=150_000, p_min=0.1)
SAMPLING = toy.ToySampling(temperature=0.7, floor=0.1, draft_temperature=1.5, draft_floor=0.2)
K = 4
COSTS = {  # (verify_costs, draft_cost): widths all alike (the width stays k), dear (it falls to 0 and reopens), between
    "flat": ([1.0] * (K + 1), 0.0),
    "dear": ([1.0, 2.5, 4.0, 5.5, 7.0], 0.5),
    "between": ([1.0, 1.2, 1.4, 1.6, 1.8], 0.15),
}


@pytest.fixture(scope="module")
def spec(engine):
    return SpecKernels(engine)


def stream_of(engine, spec, lm, bufs, costs, caps):
    lengths = DraftLengths(bufs, *COSTS[costs])
    lengths.set_caps(caps)
    return lengths, lm.round_stream(bufs, kernels=spec, lengths=lengths)


ROWS, ROUNDS = 10, 4  # the mixed-length tests' batch and M


def mixed_rows(engine, mode):
    """The toy of ROWS rows, their StreamBufs, and their caps, 0 to k in turn."""
    capacity = kv_capacity(40, 90, Geometry(K, ROUNDS, ROWS), overlap=mode == "overlap")
    return (toy.ToyLM(engine, MODEL, capacity, batch=ROWS), StreamBufs(engine, Geometry(K, ROUNDS, ROWS)),
            [b % (K + 1) for b in range(ROWS)])


def each_its_own_greedy_output(lm, bufs, stream, mode, seed, what):
    """ROWS requests of different prompts, budgets and EOS (toy_requests, `seed`) generated
    together: each row's tokens are the target's greedy decoding of its request alone."""
    prompts, budgets, eos = requests(MODEL, ROWS, seed=seed)
    for b, prompt in enumerate(prompts):
        lm.prefill_row(bufs, b, prompt)
    got = stream.generate_batch(budgets, eos=eos, mode=mode)
    for b, (prompt, budget, stop) in enumerate(zip(prompts, budgets, eos)):
        assert got[b].tolist() == toy.target_greedy(MODEL, prompt, budget, stop), f"row {b} ({what}, {mode})"
    return got


@pytest.mark.parametrize("costs", sorted(COSTS))
@pytest.mark.parametrize("mode", MODES)
def test_rows_at_mixed_lengths_each_give_their_own_greedy_output(engine, spec, mode, costs):
    """Ten rows of different prompts, budgets and EOS, their caps 0 to k in turn: every row's
    tokens are the target's greedy decoding of its request alone; a row at length 0 had every
    round capped (brk's count of capped rounds) and no draft accepted."""
    lm, bufs, caps = mixed_rows(engine, mode)
    lengths, stream = stream_of(engine, spec, lm, bufs, costs, caps)
    got = each_its_own_greedy_output(lm, bufs, stream, mode, seed=48, what=f"{costs} costs")
    capped = engine.dtoh(bufs.brk_d).reshape(ROWS, BRK_WORDS)[:, BRK_COUNT]
    for b in range(ROWS):
        if caps[b] == 0:  # a round a token, each capped, no draft accepted
            assert capped[b] == len(got[b]) and bufs.accepted[b] == 0, f"row {b} at length 0"
    assert 0 <= int(engine.dtoh(lengths.width_d)[0]) <= K


def test_a_sampled_row_at_length_zero_draws_what_plain_sampling_draws(engine, spec):
    """A row whose cap is 0 in a batch of k = 4 (the other rows speculating beside it) commits,
    for its seed, the very tokens a decoder of k = 0 commits: speculation off is the plain
    decoding, not a decoding distributed like it."""
    prompts, seeds = [[1, 2, 3], [7] * 12, [4, 0, 4, 0, 4]], [11, 12, 13]
    plain = sampled(engine, spec, MODEL, SAMPLING, prompts, seeds, 60, k=0)
    mixed = sampled(engine, spec, MODEL, SAMPLING, prompts, seeds, 60, k=K, caps=[0, K, 0])
    assert mixed[0] == plain[0] and mixed[2] == plain[2]
    assert mixed[1] != plain[1], "the speculating row should draw its own way (else this test proves nothing)"


def switching(engine, spec, lm, bufs, costs, caps, widths):
    """A RoundStream of the toy (greedy) whose burst graphs switch among bodies of `widths` (and
    k) by the width chosen, each body first setting its own word of `ran` (the toy's verify reads
    every column whatever the width, so the markers are how a test tells which bodies ran)."""
    built = Widths(K, (*widths, K))
    verify_costs, draft_cost = COSTS[costs]
    lengths = DraftLengths(bufs, built.costs(dict(enumerate(verify_costs))), draft_cost)
    lengths.set_caps(caps)
    ran = engine.zeros(np.uint32, len(built.widths), label="which bodies ran")
    draft_d = engine.zeros(np.uint32, bufs.batch * K, label="draft_d")
    pred_d = engine.zeros(np.uint32, bufs.batch * (K + 1), label="pred_d")
    verify = chain(lm.verify_steps(bufs, pred_d))

    def body(width):
        marker = engine.prepare_set_u32(ran, built.widths.index(width), 1)
        return chain([marker, *lm.draft_steps(bufs, draft_d, width=width)])
    stream = RoundStream(bufs, draft_chain=body(K), verify_trunk=verify, draft_d=draft_d, acceptance=Greedy(pred_d),
                         rollback_tables=[kv_len_ptr_table(engine, lm.target + lm.draft, pos_ctr=bufs.pos_ctr_d)],
                         lengths=lengths, narrower={width: (body(width), verify) for width in widths}, kernels=spec)
    return built, lengths, ran, stream


@pytest.mark.parametrize("costs", sorted(COSTS))
@pytest.mark.parametrize("mode", ["graph", "overlap", "eager"])
def test_rounds_that_switch_bodies_by_width_give_each_row_its_own_greedy_output(engine, spec, switches, mode, costs):
    """Bodies of widths 0, 2 and k (1 and 3 run a wider one's, and are never chosen): rows at caps
    0 to k, whatever width the costs choose, each give their own greedy output. Which bodies ran:
    at flat costs k's (a row of cap k is live), at dear ones width 0's alone (from the first round:
    a fresh row's prior does not pay for a draft), in eager mode k's alone (a round issued from the
    host runs k's body, its rows capped alike)."""
    lm, bufs, caps = mixed_rows(engine, mode)
    built, lengths, ran, stream = switching(engine, spec, lm, bufs, costs, caps, (0, 2))
    each_its_own_greedy_output(lm, bufs, stream, mode, seed=49, what=f"{costs} costs, bodies by width")
    ran = engine.dtoh(ran).tolist()  # bodies of widths 0, 2, k
    if mode == "eager":
        assert ran == [0, 0, 1], f"{ran}: a round issued from the host runs k's body"
    elif costs == "dear":
        assert ran == [1, 0, 0], f"{ran}: dear widths should have chosen 0 from the first round"
    elif costs == "flat":
        assert ran[2] == 1, f"{ran}: at flat costs, rows of cap k choose k"
    assert int(engine.dtoh(lengths.width_d)[0]) in built.widths, "a width without a body was chosen"


def test_a_round_of_bodies_by_width_refuses_what_it_cannot_build(engine, spec, switches):
    """Before anything is queued: narrower bodies without lengths (nothing would pick one), with a
    capture of the caller's (the round builds its graphs itself), holding k (k's body is the
    round's own), or over pipeline stages (their streams join through events, which a
    conditional node's body cannot hold)."""
    lm, bufs, _ = mixed_rows(engine, "graph")
    draft_d = engine.zeros(np.uint32, bufs.batch * K, label="draft_d")
    pred_d = engine.zeros(np.uint32, bufs.batch * (K + 1), label="pred_d")
    draft, verify = chain(lm.draft_steps(bufs, draft_d)), chain(lm.verify_steps(bufs, pred_d))
    narrow = {1: (chain(lm.draft_steps(bufs, draft_d, width=1)), verify)}
    lengths = DraftLengths(bufs, [1.0] * (K + 1), 0.0)
    given = dict(draft_chain=draft, verify_trunk=verify, draft_d=draft_d, acceptance=Greedy(pred_d), kernels=spec,
                 rollback_tables=[kv_len_ptr_table(engine, lm.target + lm.draft, pos_ctr=bufs.pos_ctr_d)])
    with pytest.raises(ValueError, match="need lengths="):
        RoundStream(bufs, **given, narrower=narrow)
    with pytest.raises(ValueError, match="no capture="):
        RoundStream(bufs, **given, lengths=lengths, narrower=narrow, capture=stream_capture)
    with pytest.raises(ValueError, match=f"widths below k = {K}"):
        RoundStream(bufs, **given, lengths=lengths, narrower={K: (draft, verify)})
    with pytest.raises(LoopUnsupported, match="a round of bodies by width cannot run pipeline stages"):
        RoundStream(bufs, **given, lengths=lengths, narrower=narrow,
                    stages=Stages((), round_tail=lambda: None, capacity=UNCHECKED))
    RoundStream(bufs, **given, lengths=lengths, narrower=narrow)  # and the same, well formed, is taken

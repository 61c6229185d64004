"""Batched round-stream end to end on the GPU: B toy sequences per burst, each row's output
equal to that row's own target greedy output whatever the other rows do (different prompts,
lengths, EOS and budgets), in every mode, with one readback per burst for all rows, and in
batches of up to MAX_BATCH rows; a slot refilled mid-generation (continuous batching); bad batch
input refused before anything is queued."""
from __future__ import annotations

import numpy as np
import pytest

from memra_cuda import Geometry
from memra_cuda import Cache, StreamBufs, kv_capacity, kv_len_ptr_table
from memra_cuda.errors import CapacityError
from memra_cuda.kernels import SpecKernels
from memra_cuda.rounds import MODES
from memra_cuda.testing import reference as ref
from memra_cuda.buffers.geometry import MAX_BATCH
from memra_cuda.testing.toy import lm as toy
from toy_requests import requests

pytestmark = pytest.mark.gpu

MODEL = toy.ToyModel(seed=21, vocab=50, kv_mask=(True, False, True), noise_ppm=150_000, p_min=0.1)


@pytest.fixture(scope="module")
def spec(engine):
    return SpecKernels(engine)


def batched(engine, spec, batch, k, m_rounds, capacity):
    lm = toy.ToyLM(engine, MODEL, capacity, batch=batch)
    bufs = StreamBufs(engine, Geometry(k, m_rounds, batch))
    return lm, bufs, lm.round_stream(bufs, kernels=spec)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch,k,m_rounds", [(1, 4, 4), (3, 2, 1), (3, 4, 16), (32, 4, 16), (32, 0, 4)])
def test_every_row_equals_its_own_greedy_output(engine, spec, mode, batch, k, m_rounds):
    prompts, budgets, eos = requests(MODEL, batch, seed=batch * 100 + k * 10 + m_rounds)
    capacity = kv_capacity(40, max(budgets), Geometry(k, m_rounds, batch), overlap=mode == "overlap")
    lm, bufs, stream = batched(engine, spec, batch, k, m_rounds, capacity)
    for b, prompt in enumerate(prompts):
        lm.prefill_row(bufs, b, prompt)
    before = engine.readbacks
    got = stream.generate_batch(budgets, eos=eos, mode=mode)
    for b, (prompt, budget, stop) in enumerate(zip(prompts, budgets, eos)):
        want = toy.target_greedy(MODEL, prompt, budget, stop)
        assert got[b].tolist() == want, f"row {b} of {batch} (prompt {len(prompt)}, budget {budget}, eos {stop})"
    assert engine.readbacks - before == stream.bursts, "one readback per burst for all rows"


@pytest.mark.parametrize("batch", [1024 * 8 + 1, pytest.param(MAX_BATCH, marks=pytest.mark.large)])
def test_every_row_of_a_large_batch_equals_its_own_greedy_output(engine, spec, batch):
    """More rows than the warps of the largest grid the launcher makes for accept and commit (1024
    blocks of 8, a warp a row): row b's prompt is the (b % 97)-th, of 1 to 7 tokens, and its budget
    b % 5 + 1, so neighbouring rows differ and every row must commit. The oracle runs once for each of
    the 485 distinct requests."""
    k, m_rounds, distinct = 2, 2, 97
    prompts = [[(31 * r + 7 * j) % MODEL.vocab for j in range(1 + r % 7)] for r in range(distinct)]
    budgets = [b % 5 + 1 for b in range(batch)]
    want = {(r, n): toy.target_greedy(MODEL, prompts[r], n) for r in range(distinct) for n in set(budgets)}
    lm, bufs, stream = batched(engine, spec, batch, k, m_rounds, kv_capacity(7, 5, Geometry(k, m_rounds, batch)))
    for b in range(batch):
        lm.prefill_row(bufs, b, prompts[b % distinct])
    got = stream.generate_batch(budgets, mode="graph")
    for b in range(batch):
        assert got[b].tolist() == want[b % distinct, budgets[b]], f"row {b} of {batch}"


def test_rows_do_not_depend_on_each_other(engine, spec):
    """The same request in slot 0 of a batch of 3 gives the same tokens whatever shares the batch."""
    k, m_rounds, budget = 4, 4, 70
    capacity = kv_capacity(40, budget, Geometry(k, m_rounds, 3))
    lm, bufs, stream = batched(engine, spec, 3, k, m_rounds, capacity)
    prompt = [3, 1, 4, 1, 5]
    outputs = []
    for neighbours in ([[9], [2, 6]], [[7] * 30, [8, 8, 8]]):
        for b, p in enumerate([prompt, *neighbours]):
            lm.prefill_row(bufs, b, p)
        outputs.append(stream.generate_batch([budget, 5, 60], mode="graph")[0].tolist())
    assert outputs[0] == outputs[1] == toy.target_greedy(MODEL, prompt, budget)


def test_a_slot_refilled_mid_generation(engine, spec):
    """Continuous batching: between graph replays, slot 1 finishes and takes a new request
    (prefill_row = reset_row + its KV) while rows 0 and 2 run on; every request's tokens equal
    its own greedy output, and the graph is captured once."""
    k, m_rounds = 4, 4
    capacity = kv_capacity(40, 400, Geometry(k, m_rounds, 3))
    lm, bufs, stream = batched(engine, spec, 3, k, m_rounds, capacity)
    first = {0: ([5, 6, 7], 300), 1: ([1, 2], 25), 2: ([8] * 12, 200)}
    later = ([4, 4, 2, 9], 60)
    for b, (prompt, budget) in first.items():
        lm.prefill_row(bufs, b, prompt)
        bufs.set_stop_row(b, budget=budget)
    out = {b: [] for b in first}
    refilled, new_out = False, []
    graph = stream.graph
    while not bufs.done.all():
        readback = stream.step("graph")
        for b in first:
            (new_out if refilled and b == 1 else out[b]).extend(readback.tokens[b].tolist())
        if readback.done[1] and not refilled:
            lm.prefill_row(bufs, 1, later[0])
            bufs.set_stop_row(1, budget=later[1])
            refilled = True
            assert not readback.done[0] and not readback.done[2], "rows 0 and 2 still have budget"
    assert stream.graph is graph
    for b, (prompt, budget) in first.items():
        assert out[b] == toy.target_greedy(MODEL, prompt, budget), f"row {b}"
    assert new_out == toy.target_greedy(MODEL, *later), "the request that joined in slot 1"


def test_vacant_and_parked_slots_stay_inert(engine, spec):
    """Rows with a budget of 0 are done from the start: nothing committed, position and KV
    lengths unchanged, while the live row decodes."""
    k, m_rounds = 2, 4
    lm, bufs, stream = batched(engine, spec, 4, k, m_rounds, kv_capacity(10, 50, Geometry(k, m_rounds, 4)))
    starts = [lm.prefill_row(bufs, b, [b + 1] * (b + 2)) for b in range(4)]
    got = stream.generate_batch([0, 50, 0, 0], mode="eager")
    assert [len(t) for t in got] == [0, 50, 0, 0]
    assert got[1].tolist() == toy.target_greedy(MODEL, [2, 2, 2], 50)
    positions = engine.dtoh(bufs.pos_ctr_d).tolist()
    assert [positions[b] for b in (0, 2, 3)] == [starts[b] for b in (0, 2, 3)]
    for b in (0, 2, 3):
        assert set(lm.target.lengths(engine, b) + lm.draft.lengths(engine, b)) == {starts[b], None}


@pytest.mark.parametrize("batch", [1, 32])
def test_rollback_of_mixed_layers_per_row(engine, spec, batch):
    """A table over KV and no-KV layers plus pos_ctr at B rows: each row's lengths become that
    row's pos_start + keep, as the batched reference says."""
    mask = (True, False, True, False, True)
    cache = Cache.allocate(engine, mask, capacity=64, batch=batch)
    bufs = StreamBufs(engine, Geometry(4, 1, batch))
    table = kv_len_ptr_table(engine, cache, bufs.pos_ctr_d)
    rng = np.random.default_rng(batch)
    for _ in range(5):
        pos_start = rng.integers(-2**31, 2**31, batch, dtype=np.int64).astype(np.int32)
        ctl = np.tile(np.int32([-1, -1, 0, 0]), batch)
        ctl[ref.KEEP::4] = rng.integers(0, 6, batch)
        lengths = [rng.integers(0, 64, batch).astype(np.int32) if has else None for has in mask]
        for layer, values in zip(cache.kv, lengths):
            if layer is not None:
                engine.copy_htod(layer.len_d, values)
        engine.copy_htod(bufs.pos_start_d, pos_start)
        engine.copy_htod(bufs.ctl_d, ctl)
        spec.rollback(bufs, table)
        want_pos = np.zeros(batch, np.int32)
        ref.spec_rollback_stream([*lengths, want_pos], pos_start, ctl, batch)
        for layer, want in zip(cache.kv, lengths):
            if layer is not None:
                assert engine.dtoh(layer.len_d).tolist() == want.tolist()
        assert engine.dtoh(bufs.pos_ctr_d).tolist() == want_pos.tolist()


def test_capacity_is_checked_per_row(engine, spec):
    """One row with a long prompt has no room for a burst (plus the round a finished row may
    sit out) while the others have: CapacityError names that row, and nothing is queued."""
    k, m_rounds = 4, 4
    lm, bufs, stream = batched(engine, spec, 3, k, m_rounds, capacity=50)
    for b, p in enumerate([[1], [2] * 30, [3]]):
        lm.prefill_row(bufs, b, p)
    with pytest.raises(CapacityError, match="row 1 at position 29"):
        stream.generate_batch(100, mode="graph")
    assert stream.rounds == 0


def test_bad_batch_input_is_refused_before_anything_is_queued(engine, spec):
    with pytest.raises(ValueError, match="batch must be"):
        StreamBufs(engine, Geometry(4, 4, 0))
    bufs = StreamBufs(engine, Geometry(4, 4, 3))
    for bad in (-1, 3, 2**40):
        with pytest.raises(ValueError, match="outside a batch of 3|row"):
            bufs.reset_row(bad, 1, 2)
        with pytest.raises(ValueError, match="outside a batch of 3|row"):
            bufs.set_stop_row(bad, budget=3)
    with pytest.raises(ValueError, match="exactly 3 x 5"):
        spec.prepare_accept_greedy(bufs, engine.zeros(np.uint32, 5))  # one sequence's predictions
    with pytest.raises(ValueError, match="exactly 3 x 4"):
        spec.prepare_assemble_verify(bufs, engine.zeros(np.uint32, 4 * 3 + 1))
    single = Cache.allocate(engine, (True, False), capacity=16)  # i32[1] lengths
    with pytest.raises(ValueError, match=r"i32\[3\]"):
        spec.prepare_rollback(bufs, kv_len_ptr_table(engine, single))
    with pytest.raises(ValueError, match="same batch"):
        kv_len_ptr_table(engine, single, bufs.pos_ctr_d)
    lm = toy.ToyLM(engine, MODEL, 64, batch=2)
    with pytest.raises(ValueError, match="batch of 3"):
        lm.round_stream(bufs, kernels=spec)
    lm3 = toy.ToyLM(engine, MODEL, 64, batch=3)
    stream = lm3.round_stream(bufs, kernels=spec)
    with pytest.raises(ValueError, match="one value per row"):
        stream.generate_batch([10, 10])  # two budgets for three rows
    with pytest.raises(ValueError, match="batch of 1"):
        stream.generate(10)
    with pytest.raises(ValueError, match="prefill_row"):
        lm3.prefill(bufs, [1, 2])
    before = engine.dtoh(bufs.ctl_d).tolist()
    with pytest.raises(ValueError, match=r"max_new_tokens"):
        stream.generate_batch([5, -1, 5])
    assert engine.dtoh(bufs.ctl_d).tolist() == before, "nothing was queued"

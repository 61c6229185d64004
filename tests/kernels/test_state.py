"""Recurrent state rollback (kernels 8 and 9) without a GPU: the numpy reference's semantics,
by hand-worked values and by simulated rounds in which FLIP and COPY must both leave the state
a sequential model reaches on the kept tokens alone; and StateLayer's checks of its buffers.
"""
from __future__ import annotations

import numpy as np
import pytest

from memra_cuda import DeviceBuffer, StateLayer
from memra_cuda.testing import reference as ref
from memra_cuda.buffers.layout import CTL_WORDS
from memra_cuda.testing.reference import BUDGET, DONE, EOS, KEEP

# Keeps past k + 1, read as u32, clamp to k + 1: garbage and negative alike.
GARBAGE_KEEPS = (2**31 - 1, -1, -2**31)


def ctl_rows(*keeps: int, done: tuple[int, ...] = ()) -> np.ndarray:
    """ctl_d of one row per keep (no EOS, no budget); the rows `done` have their done flag set."""
    ctl = np.zeros((len(keeps), CTL_WORDS), np.int32)
    ctl[:, EOS] = ctl[:, BUDGET] = -1
    ctl[:, KEEP] = keeps
    ctl[list(done), DONE] = 1
    return ctl.reshape(-1)


def slots_of(batch: int, k: int, row_words: int) -> np.ndarray:
    """[B][k+1][row_words] words that name their place: 1000 b + 100 (slot + 1) + word."""
    b, i, w = np.meshgrid(np.arange(batch), np.arange(k + 1), np.arange(row_words), indexing="ij")
    return (1000 * b + 100 * (i + 1) + w).astype(np.uint32).reshape(-1)


# -- 8. spec_state_copy ------------------------------------------------------------------------

@pytest.mark.parametrize("k", (0, 1, 4))
def test_copy_makes_slot_keep_minus_one_live_for_every_keep(k):
    """Row b of three gets keep (b + shift) % (k + 2) over the shifts, so every keep 0..k+1 meets
    every row; keep 0 leaves the row's live state as it was, and the slots are only read."""
    batch, row_words = 3, 2
    for shift in range(k + 2):
        keeps = [(b + shift) % (k + 2) for b in range(batch)]
        live, slots = np.full(batch * row_words, 7, np.uint32), slots_of(batch, k, row_words)
        ref.spec_state_copy([(live, slots, row_words)], k, ctl_rows(*keeps), batch)
        want = [[7] * row_words if keep == 0 else [1000 * b + 100 * keep + w for w in range(row_words)]
                for b, keep in enumerate(keeps)]
        assert live.reshape(batch, row_words).tolist() == want, f"keeps {keeps}"
        assert slots.tolist() == slots_of(batch, k, row_words).tolist()


@pytest.mark.parametrize("keep", GARBAGE_KEEPS + (6,))
def test_copy_clamps_a_keep_past_k_plus_one_to_the_last_slot(keep):
    k, row_words = 4, 3
    live = np.zeros(row_words, np.uint32)
    ref.spec_state_copy([(live, slots_of(1, k, row_words), row_words)], k, ctl_rows(keep))
    assert live.tolist() == [500, 501, 502]


def test_copy_skips_layers_without_state_and_copies_each_layer_at_its_width():
    k, batch = 1, 2
    narrow, wide = np.zeros(batch, np.uint32), np.zeros(batch * 3, np.uint32)
    table = [None, (narrow, slots_of(batch, k, 1), 1), None, (wide, slots_of(batch, k, 3), 3)]
    ref.spec_state_copy(table, k, ctl_rows(2, 1), batch)
    assert narrow.tolist() == [200, 1100]
    assert wide.tolist() == [200, 201, 202, 1100, 1101, 1102]


def test_copy_leaves_a_done_row_alone():
    """Acceptance gives a done row keep 0 (contract 3), and keep 0 copies nothing."""
    k, row_words = 2, 2
    vtok, pred = np.zeros(2 * (k + 1), np.uint32), np.zeros(2 * (k + 1), np.uint32)
    brk, acc, last = np.zeros(4, np.uint32), np.zeros(4, np.uint32), np.zeros(2, np.uint32)
    ctl = ctl_rows(0, 0, done=(1,))
    ref.spec_accept_greedy_dc(vtok, pred, k, brk, acc, last, ctl, 2)
    assert ctl[KEEP::4].tolist() == [k + 1, 0]
    live = np.full(2 * row_words, 9, np.uint32)
    ref.spec_state_copy([(live, slots_of(2, k, row_words), row_words)], k, ctl, 2)
    assert live.tolist() == [300, 301, 9, 9]


# -- 9. spec_state_flip ------------------------------------------------------------------------

@pytest.mark.parametrize("k", (0, 1, 4))
def test_flip_moves_to_slot_keep_minus_one_of_the_other_bank_for_every_keep(k):
    """Every live index (either bank) meets every keep: keep 0 leaves it; otherwise it lands on
    slot keep - 1 of the bank it was not in."""
    k1 = k + 1
    for idx in range(2 * k1):
        for keep in range(k1 + 1):
            got = np.array([idx], np.uint32)
            ref.spec_state_flip([got], k, ctl_rows(keep))
            other = 0 if idx >= k1 else 1
            assert got[0] == (idx if keep == 0 else other * k1 + keep - 1), f"idx {idx} keep {keep}"


def test_flip_by_hand():
    """k = 2: banks {0, 1, 2} and {3, 4, 5}."""
    cases = [(0, 1, 3), (0, 3, 5), (2, 2, 4), (4, 3, 2), (5, 1, 0), (3, 0, 3), (1, 2**31 - 1, 5), (4, -1, 2)]
    for idx, keep, want in cases:
        got = np.array([idx], np.uint32)
        ref.spec_state_flip([got], 2, ctl_rows(keep))
        assert got[0] == want, f"idx {idx} keep {keep}"


@pytest.mark.parametrize("idx", (6, 7, 100, 2**31, 2**32 - 1))
def test_flip_counts_a_garbage_index_as_bank_one_and_lands_in_range(idx):
    got = np.array([idx], np.uint32)
    ref.spec_state_flip([got], 2, ctl_rows(2))
    assert got[0] == 1
    kept = np.array([idx], np.uint32)
    ref.spec_state_flip([kept], 2, ctl_rows(0))
    assert kept[0] == idx, "keep 0 leaves even a garbage index as it is"


def test_flip_skips_none_and_serves_each_row_with_its_keep():
    target, draft = np.array([0, 4, 1], np.uint32), np.array([3, 0, 5], np.uint32)
    ref.spec_state_flip([None, target, None, draft], 2, ctl_rows(3, 0, 1, done=(1,)), 3)
    assert target.tolist() == [5, 4, 3]
    assert draft.tolist() == [2, 0, 0]


# -- rounds: FLIP and COPY both keep what a sequential model would ------------------------------

def advance(state: np.ndarray, token: int) -> np.ndarray:
    """A recurrence: the state after `token`. Every word depends on the token and on its own
    past, so a state taken from the wrong slot, row or round shows."""
    mixed = state.astype(np.uint64) * np.uint64(2654435761) + np.uint64(token) + np.arange(state.size, dtype=np.uint64)
    return mixed.astype(np.uint32)  # the low 32 bits


@pytest.mark.parametrize("k", (0, 1, 4))
def test_rounds_of_flip_and_copy_keep_the_state_of_the_kept_tokens(k):
    """B rows over 12 rounds, some rows done from some round on (keep 0 then, but the model still
    runs on them): after each rollback, COPY's live state and FLIP's slot idx both equal the state
    a model reaches stepping over the kept tokens alone."""
    batch, row_words, k1 = 4, 3, k + 1
    rng = np.random.default_rng(k)
    truth = rng.integers(0, 2**32, (batch, row_words), dtype=np.uint32)
    live, slots = truth.copy(), np.zeros((batch, k1, row_words), np.uint32)
    banks, idx = np.zeros((batch, 2 * k1, row_words), np.uint32), np.zeros(batch, np.uint32)
    banks[:, 0] = truth
    done_from = rng.integers(0, 16, batch)
    for r in range(12):
        tokens = rng.integers(0, 50_000, (batch, k1))
        keeps = [0 if r >= done_from[b] else int(rng.integers(1, k1 + 1)) for b in range(batch)]
        for b in range(batch):  # the verify: k + 1 steps from the live state of each strategy
            state, flipped = live[b], banks[b, idx[b]]
            write = (1 - min(int(idx[b]) // k1, 1)) * k1
            for i in range(k1):
                state, flipped = advance(state, tokens[b, i]), advance(flipped, tokens[b, i])
                slots[b, i], banks[b, write + i] = state, flipped
            for i in range(keeps[b]):
                truth[b] = advance(truth[b], tokens[b, i])
        ctl = ctl_rows(*keeps, done=tuple(b for b in range(batch) if keeps[b] == 0))
        ref.spec_state_copy([(live.reshape(-1), slots.reshape(-1), row_words)], k, ctl, batch)
        ref.spec_state_flip([idx], k, ctl, batch)
        assert live.tolist() == truth.tolist(), f"COPY, round {r}, keeps {keeps}"
        assert banks[np.arange(batch), idx].tolist() == truth.tolist(), f"FLIP, round {r}, keeps {keeps}"


# -- StateLayer: the buffers' checks -----------------------------------------------------------

def words(n: int, dtype=np.uint32, at: int = 0x10000) -> DeviceBuffer:
    """A stand-in device buffer of n elements (never touched: the checks read sizes alone)."""
    return DeviceBuffer.wrap(at, dtype, n)


def test_state_layer_takes_exact_sizes_and_derives_the_batch():
    layer = StateLayer(words(3 * 5, np.float32), words(3 * 2 * 5, np.float32, 0x20000), 5, 1)
    assert (layer.batch, layer.k, layer.row_words) == (3, 1, 5)
    assert StateLayer(words(4), words(4 * 3), 1, 2).batch == 4


@pytest.mark.parametrize("live,slots,row_words,k,match", [
    (words(10), words(21), 5, 1, "slots_d must be"),  # one word too many
    (words(10), words(19), 5, 1, "slots_d must be"),
    (words(10), words(10), 5, 1, "slots_d must be"),  # k + 1 slots a row, not one
    (words(11), words(22), 5, 1, "live_d must be"),   # not whole rows
    (words(10, np.float64), words(20, np.float64), 5, 1, "32-bit words"),
    (words(10, np.uint16), words(20, np.uint16), 5, 1, "32-bit words"),
    (words(10), words(20, np.float32), 5, 1, "one type"),
    (words(10), words(20), 0, 1, "row_words"),
    (words(10), words(20), 5, -1, "k must be an int of at least 0"),
])
def test_state_layer_refuses_wrong_sizes_and_types(live, slots, row_words, k, match):
    with pytest.raises(ValueError, match=match):
        StateLayer(live, slots, row_words, k)


def test_state_layer_refuses_what_is_not_a_buffer():
    with pytest.raises(TypeError, match="live_d"):
        StateLayer(np.zeros(4, np.uint32), words(8), 1, 1)


def test_state_tables_naming_the_same_memory_are_refused_together():
    """RoundStream's check across its state tables (no GPU: it reads only what the tables
    hold): memory named twice would be rolled back twice a round, and a second flip undoes the
    first; tables of memory of their own pass."""
    from types import SimpleNamespace

    from memra_cuda.buffers.tables import state_targets_disjoint

    index, other = words(4, at=0x10000), words(4, at=0x20000)
    inside = DeviceBuffer.wrap(0x10008, np.uint32, 1)  # a word of `index`
    table = SimpleNamespace(targets=(index, None))
    state_targets_disjoint([table, SimpleNamespace(targets=(None, other))])
    for second in ((index,), (inside,)):
        with pytest.raises(ValueError, match="overlap"):
            state_targets_disjoint([table, SimpleNamespace(targets=second)])

"""Hand-worked cases for memra_cuda.testing.reference, the numpy statement of the kernel contracts.

The reference is the oracle the GPU tests compare the kernels against, so its own behaviour is
pinned here by expected values written out by hand, one small test per branch of each contract
(docs/kernels.md, "Kernel contracts"). Runs on CPU in every CI run.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from memra_cuda.buffers.layout import ACC_WORDS, BRK_WORDS, COST_VERIFY, CTL_WORDS, RATE_WORDS, RING_TOKENS
from memra_cuda.testing import reference as ref


def u32(*words: int) -> np.ndarray:
    return np.array(words, np.uint32)


def i32(*words: int) -> np.ndarray:
    return np.array(words, np.int32)


def ctl(eos: int = -1, budget: int = -1, done: int = 0, keep: int = 0) -> np.ndarray:
    """ctl_d: [eos id, token budget left, done flag, KV entries kept this round]."""
    return i32(eos, budget, done, keep)


# -- 1. spec_seed_gather ----------------------------------------------------------------------

def gather(acc0: int) -> list[int]:
    """Gather from 3 rows of 3 words into a row-sized output plus one guard word (7)."""
    rows = u32(10, 11, 12, 20, 21, 22, 30, 31, 32)
    out = u32(7, 7, 7, 7)
    ref.spec_seed_gather(rows, 3, 3, u32(acc0, 5), out)
    assert rows.tolist() == [10, 11, 12, 20, 21, 22, 30, 31, 32], "rows are read-only"
    return out.tolist()


def test_seed_gather_takes_row_acc():
    assert gather(0) == [10, 11, 12, 7]
    assert gather(1) == [20, 21, 22, 7]


def test_seed_gather_acc_on_last_row():
    assert gather(2) == [30, 31, 32, 7]


def test_seed_gather_acc_past_last_row_clamps_to_last_row():
    assert gather(3) == [30, 31, 32, 7]
    assert gather(4) == [30, 31, 32, 7]


def test_seed_gather_garbage_acc_clamps_to_last_row():
    assert gather(2**31) == [30, 31, 32, 7]
    assert gather(2**32 - 1) == [30, 31, 32, 7]


def test_seed_gather_without_rows_writes_nothing():
    out = u32(7, 7)
    ref.spec_seed_gather(u32(1, 2), 0, 2, u32(0, 0), out)
    assert out.tolist() == [7, 7]


# -- 2. spec_assemble_verify ------------------------------------------------------------------

def assemble(k: int, pos: int) -> tuple[list[int], list[int]]:
    """Assemble from pend 42 and drafts 5, 6, 7, 8 into a vtok of k+1 words: (vtok, pos_start)."""
    vtok, pos_start = np.full(k + 1, 9, np.uint32), i32(-1)
    ref.spec_assemble_verify(u32(42), u32(5, 6, 7, 8), k, vtok, i32(pos), pos_start)
    return vtok.tolist(), pos_start.tolist()


def test_assemble_verify_k0_is_the_pending_token_alone():
    assert assemble(0, 17) == ([42], [17])


def test_assemble_verify_takes_the_first_k_drafts():
    assert assemble(3, 17) == ([42, 5, 6, 7], [17])
    assert assemble(4, 17) == ([42, 5, 6, 7, 8], [17])


def test_assemble_verify_copies_any_position():
    assert assemble(1, 0) == ([42, 5], [0])
    assert assemble(1, 2**31 - 1) == ([42, 5], [2**31 - 1])
    assert assemble(1, -2**31) == ([42, 5], [-2**31])


# -- 3. spec_accept_greedy_dc -----------------------------------------------------------------

# k = 4: the pending token 50, then drafts 10, 11, 12, 13. AGREE is what a target that agrees
# with every draft predicts (its last entry, 14, is the bonus after all four).
VTOK = (50, 10, 11, 12, 13)
AGREE = (10, 11, 12, 13, 14)


def accept(pred=AGREE, vtok=VTOK, k=4, brk=(0, 0), acc=(7, 100), last_pred=77, done=0, keep=9) -> dict:
    """Run the reference on fresh buffers; return every buffer it may write, as lists."""
    state = dict(brk=u32(*brk), acc=u32(*acc), last_pred=u32(last_pred), ctl=ctl(-1, -1, done, keep))
    ref.spec_accept_greedy_dc(u32(*vtok), u32(*pred), k, state["brk"], state["acc"],
                              state["last_pred"], state["ctl"])
    return {name: words.tolist() for name, words in state.items()}


def accepted(n: int, bonus: int, total: int, brk_count: int = 0) -> dict:
    """What accept leaves after accepting n drafts (not done, eos and budget -1)."""
    return dict(brk=[0, brk_count], acc=[n, total], last_pred=[bonus], ctl=[-1, -1, 0, n + 1])


def test_accept_all_drafts_when_the_target_agrees():
    assert accept() == accepted(4, 14, 104)


def test_accept_stops_at_the_first_disagreement():
    # pred[3] == 13 agrees again, but acceptance never resumes after a rejection
    assert accept(pred=(10, 11, 99, 13, 14)) == accepted(2, 99, 102)


def test_accept_none_when_the_first_draft_is_rejected():
    assert accept(pred=(98, 11, 12, 13, 14)) == accepted(0, 98, 100)


def test_accept_break_at_first_draft_accepts_none():
    assert accept(brk=(1, 6)) == accepted(0, 10, 100, brk_count=7)


def test_accept_break_caps_the_accepted_prefix():
    assert accept(brk=(3, 0)) == accepted(2, 12, 102, brk_count=1)
    assert accept(brk=(4, 0)) == accepted(3, 13, 103, brk_count=1)


def test_accept_disagreement_before_the_break_wins():
    assert accept(pred=(10, 99, 12, 13, 14), brk=(4, 0)) == accepted(1, 99, 101, brk_count=1)


def test_accept_break_at_k_plus_one_caps_nothing_but_counts():
    assert accept(brk=(5, 0)) == accepted(4, 14, 104, brk_count=1)


def test_accept_garbage_break_larger_than_k_plus_one_caps_nothing_but_counts():
    assert accept(brk=(6, 0)) == accepted(4, 14, 104, brk_count=1)
    assert accept(brk=(2**31, 0)) == accepted(4, 14, 104, brk_count=1)
    assert accept(brk=(2**32 - 1, 0)) == accepted(4, 14, 104, brk_count=1)


def test_accept_break_count_wraps_at_32_bits():
    assert accept(brk=(2, 2**32 - 1)) == accepted(1, 11, 101, brk_count=0)


def test_accept_cumulative_count_wraps_at_32_bits():
    assert accept(acc=(0, 2**32 - 2)) == accepted(4, 14, 2)


def test_accept_k0_takes_the_prediction_after_the_pending_token():
    assert accept(pred=(61,), vtok=(50,), k=0) == accepted(0, 61, 100)
    assert accept(pred=(61,), vtok=(50,), k=0, brk=(1, 0)) == accepted(0, 61, 100, brk_count=1)


def test_accept_when_done_keeps_nothing_and_counts_nothing():
    # acc[0] = 0 and keep = 0; acc[1], last_pred and brk[1] unchanged; brk[0] still cleared
    done = dict(brk=[0, 5], acc=[0, 100], last_pred=[77], ctl=[-1, -1, 1, 0])
    assert accept(brk=(2, 5), done=1) == done


def test_accept_any_nonzero_done_flag_is_done():
    assert accept(done=-5)["ctl"] == [-1, -1, -5, 0]
    assert accept(done=2**31 - 1)["acc"] == [0, 100]


# -- 4. spec_ring_commit ----------------------------------------------------------------------

# k = 3: vtok is the pending token 50, then drafts 21, 22, 23. The bonus (last_pred) is 30.
def commit(n: int, bonus: int = 30, eos: int = -1, budget: int = -1, done: int = 0,
           ring: tuple = (0,), ring_cap: int = 6, pend: int = 5, accepted: bool = False) -> dict:
    """Commit with accept count n into a ring of ring_cap slots (plus the count) that starts as
    `ring` then zeros; return every buffer the commit may write, as lists (acc_d's too, if
    `accepted`: its total starts at 100 + n, as the accept kernel left it)."""
    ring_words = np.zeros(ring_cap + 1, np.uint32)
    ring_words[:len(ring)] = ring
    state = dict(ring=ring_words, ctl=ctl(eos, budget, done, keep=4), pend=u32(pend))
    if accepted:
        state["acc"] = u32(n, (100 + n) % 2**32)
    ref.spec_ring_commit(u32(50, 21, 22, 23), state.get("acc", u32(n, 0)), u32(bonus), state["ctl"], state["pend"],
                         state["ring"], ring_cap, 3)
    return {name: words.tolist() for name, words in state.items()}


def test_commit_done_at_entry_changes_nothing():
    assert commit(2, budget=4, done=1, ring=(2, 7, 8)) == dict(
        ring=[2, 7, 8, 0, 0, 0, 0], ctl=[-1, 4, 1, 4], pend=[5])


def test_commit_any_nonzero_done_flag_is_done():
    assert commit(2, done=-3) == dict(ring=[0] * 7, ctl=[-1, -1, -3, 4], pend=[5])


def test_commit_appends_the_accepted_drafts_then_the_bonus():
    assert commit(2) == dict(ring=[3, 21, 22, 30, 0, 0, 0], ctl=[-1, -1, 0, 4], pend=[30])


def test_commit_without_accepted_drafts_appends_the_bonus_alone():
    assert commit(0) == dict(ring=[1, 30, 0, 0, 0, 0, 0], ctl=[-1, -1, 0, 4], pend=[30])


def test_commit_appends_after_the_tokens_already_in_the_ring():
    assert commit(1, ring=(2, 7, 8)) == dict(ring=[4, 7, 8, 21, 30, 0, 0], ctl=[-1, -1, 0, 4], pend=[30])


def test_commit_eos_in_the_middle_stops_after_it():
    assert commit(3, eos=22) == dict(ring=[2, 21, 22, 0, 0, 0, 0], ctl=[22, -1, 1, 4], pend=[30])


def test_commit_stopped_inside_the_drafts_counts_only_those_before_its_last_token():
    """An EOS at draft 2 of 3 accepted: 2 tokens committed, 1 draft counted (100 + 1), so that
    committed - accepted still counts this as one round; a spent budget the same way."""
    assert commit(3, eos=22, accepted=True)["acc"] == [3, 101]
    assert commit(3, budget=1, accepted=True)["acc"] == [3, 100]
    assert commit(3, budget=0, accepted=True)["acc"] == [3, 100], "nothing committed: no draft counted"
    assert commit(3, accepted=True)["acc"] == [3, 103], "a whole round counts every draft"
    assert commit(2, eos=30, accepted=True)["acc"] == [2, 102], "a stop at the bonus cuts no draft"


def test_commit_eos_as_the_bonus():
    assert commit(2, eos=30) == dict(ring=[3, 21, 22, 30, 0, 0, 0], ctl=[30, -1, 1, 4], pend=[30])


def test_commit_eos_among_the_rejected_drafts_is_not_seen():
    assert commit(2, eos=23) == dict(ring=[3, 21, 22, 30, 0, 0, 0], ctl=[23, -1, 0, 4], pend=[30])


def test_commit_negative_eos_never_matches_even_token_0xffffffff():
    assert commit(0, bonus=2**32 - 1, eos=-1) == dict(
        ring=[1, 2**32 - 1, 0, 0, 0, 0, 0], ctl=[-1, -1, 0, 4], pend=[2**32 - 1])


def test_commit_budget_counts_down():
    assert commit(2, budget=10) == dict(ring=[3, 21, 22, 30, 0, 0, 0], ctl=[-1, 7, 0, 4], pend=[30])


def test_commit_budget_that_runs_out_mid_round():
    assert commit(3, budget=2) == dict(ring=[2, 21, 22, 0, 0, 0, 0], ctl=[-1, 0, 1, 4], pend=[30])


def test_commit_budget_spent_exactly_by_the_bonus():
    assert commit(2, budget=3) == dict(ring=[3, 21, 22, 30, 0, 0, 0], ctl=[-1, 0, 1, 4], pend=[30])


def test_commit_budget_zero_at_entry_is_done_with_nothing_appended():
    # the pending token still becomes the bonus
    assert commit(2, budget=0, ring=(1, 9)) == dict(ring=[1, 9, 0, 0, 0, 0, 0], ctl=[-1, 0, 1, 4], pend=[30])


def test_commit_budget_minus_one_is_unlimited():
    assert commit(3, budget=-1) == dict(ring=[4, 21, 22, 23, 30, 0, 0], ctl=[-1, -1, 0, 4], pend=[30])


def test_commit_any_negative_budget_is_unlimited_and_stays():
    assert commit(3, budget=-7) == dict(ring=[4, 21, 22, 23, 30, 0, 0], ctl=[-1, -7, 0, 4], pend=[30])


def test_commit_full_ring_is_never_written_past_ring_cap():
    # one slot left: 21 goes in, 22, 23 and 30 are dropped but still spend the budget
    assert commit(3, budget=10, ring=(3, 1, 2, 3), ring_cap=4) == dict(
        ring=[4, 1, 2, 3, 21], ctl=[-1, 6, 0, 4], pend=[30])


def test_commit_full_ring_keeps_its_count_and_still_sees_eos():
    assert commit(3, eos=22, ring=(4, 1, 2, 3, 4), ring_cap=4) == dict(
        ring=[4, 1, 2, 3, 4], ctl=[22, -1, 1, 4], pend=[30])


def test_commit_garbage_ring_count_clamps_to_ring_cap():
    assert commit(1, ring=(5, 1, 2, 3, 4), ring_cap=4) == dict(
        ring=[4, 1, 2, 3, 4], ctl=[-1, -1, 0, 4], pend=[30])
    assert commit(1, ring=(2**32 - 1, 1, 2, 3, 4), ring_cap=4) == dict(
        ring=[4, 1, 2, 3, 4], ctl=[-1, -1, 0, 4], pend=[30])


def test_commit_garbage_accept_count_clamps_to_k():
    all_in = dict(ring=[4, 21, 22, 23, 30, 0, 0], ctl=[-1, -1, 0, 4], pend=[30])
    assert commit(4) == all_in
    assert commit(2**31) == all_in
    assert commit(2**32 - 1) == all_in


# -- 5. spec_rollback_stream ------------------------------------------------------------------

def rollback(pos_start: int, keep: int, table: list) -> list:
    """Roll back a table of one-word lengths (None: a layer without KV); return their values."""
    ref.spec_rollback_stream(table, i32(pos_start), ctl(keep=keep))
    return [None if length is None else length.tolist() for length in table]


def test_rollback_sets_every_length_to_round_start_plus_keep():
    assert rollback(10, 3, [i32(1), i32(50), i32(-4)]) == [[13], [13], [13]]


def test_rollback_skips_none_entries():
    assert rollback(10, 3, [None, i32(1), None, i32(2)]) == [None, [13], None, [13]]
    assert rollback(10, 3, [None, None]) == [None, None]


def test_rollback_keep_zero_returns_to_round_start():
    assert rollback(10, 0, [i32(14)]) == [[10]]


def test_rollback_wraps_around_like_i32():
    assert rollback(2**31 - 2, 5, [i32(0)]) == [[-2**31 + 3]]
    assert rollback(-2**31, -1, [i32(0)]) == [[2**31 - 1]]
    assert rollback(-5, 3, [i32(0)]) == [[-2]]


def test_64_bit_token_buffers_are_read_as_their_low_32_bits():
    """PyTorch's argmax writes int64 ids: the kernels read the low word, so garbage above it
    neither breaks an agreement nor leaks into the bonus token."""
    vtok = np.array([9, 5, 6, 7], np.uint32)
    pred = np.array([5 + (3 << 32), 6, 8 + (1 << 40), 11], np.int64)
    brk, acc, last = np.zeros(2, np.uint32), np.zeros(2, np.uint32), np.zeros(1, np.uint32)
    ctl = np.array([-1, -1, 0, 0], np.int32)
    ref.spec_accept_greedy_dc(vtok, pred, 3, brk, acc, last, ctl)
    assert (acc[0], last[0], ctl[ref.KEEP]) == (2, 8, 3)
    out = np.zeros(4, np.uint32)
    ref.spec_assemble_verify(np.array([1], np.uint32), np.array([2 + (7 << 32), -1], np.int64), 2, out,
                             np.array([0], np.int32), np.array([0], np.int32))
    assert out[:3].tolist() == [1, 2, 2**32 - 1]


# -- batches: every contract applied to each row alone ------------------------------------------

def test_a_batched_call_equals_one_call_per_row():
    """Three rows in different states (one done, one with a break, one whose ring is full):
    the batched forms give, word for word, what the single-sequence forms give row by row."""
    k, ring_cap, batch = 3, 8, 3
    rng = np.random.default_rng(5)
    state = {
        "vtok": rng.integers(0, 3, batch * (k + 1)).astype(np.uint32),
        "pred": rng.integers(0, 3, batch * (k + 1)).astype(np.uint32),
        "draft": rng.integers(0, 3, batch * k).astype(np.uint32),
        "brk": u32(0, 0, 2, 7, 0, 0), "acc": u32(1, 0, 2, 9, 3, 1), "last": u32(4, 5, 6), "pend": u32(1, 2, 3),
        "ctl": np.concatenate([ctl(), ctl(eos=1, done=1), ctl(budget=2)]),
        "ring": np.concatenate([u32(0, *[0] * ring_cap), u32(2, 7, 7, *[0] * 6), u32(ring_cap, *range(ring_cap))]),
        "pos": i32(4, 9, 2**31 - 1), "start": i32(0, 0, 0), "len": i32(1, 2, 3),
    }

    def run(s: dict, rows: int, b: int = 0) -> None:
        """One round's kernels over `rows` rows starting at row b (rows = 1: row b alone)."""
        def view(name: str, n: int) -> np.ndarray:
            return s[name][b * n:(b + rows) * n]
        ref.spec_assemble_verify(view("pend", 1), view("draft", k), k, view("vtok", k + 1), view("pos", 1),
                                 view("start", 1), rows)
        ref.spec_accept_greedy_dc(view("vtok", k + 1), view("pred", k + 1), k, view("brk", 2), view("acc", 2),
                                  view("last", 1), view("ctl", 4), rows)
        ref.spec_ring_commit(view("vtok", k + 1), view("acc", 2), view("last", 1), view("ctl", 4), view("pend", 1),
                             view("ring", ring_cap + 1), ring_cap, k, rows)
        ref.spec_rollback_stream([view("len", 1), None, view("pos", 1)], view("start", 1), view("ctl", 4), rows)

    batched = {name: words.copy() for name, words in state.items()}
    run(batched, batch)
    single = {name: words.copy() for name, words in state.items()}
    for b in range(batch):
        run(single, 1, b)
    for name in state:
        assert batched[name].tolist() == single[name].tolist(), name
    assert batched["ctl"][ref.DONE::4].tolist()[1] == 1 and batched["ring"][1 + ring_cap] == 2, "done row inert"



# -- every function's buffers against the sizes it is given -----------------------------------

B, K, V, ROW, CAP = 2, 3, 5, 4, 6  # rows, drafts, vocabulary, a seed row's words, a ring's tokens


def sized_buffers() -> dict[str, np.ndarray]:
    """Zeroed buffers of B rows as the kernels lay them out for k = K, V and the rest."""
    f32 = np.float32
    shapes = {
        "pend": (np.uint32, 1), "draft": (np.uint32, K), "vtok": (np.uint32, K + 1), "pos_ctr": (np.int32, 1),
        "pos_start": (np.int32, 1), "pred": (np.uint32, K + 1), "brk": (np.uint32, BRK_WORDS),
        "acc": (np.uint32, ACC_WORDS), "last_pred": (np.uint32, 1), "ctl": (np.int32, CTL_WORDS),
        "ring": (np.uint32, RING_TOKENS + CAP), "p": (f32, (K + 1) * V), "q": (f32, K * V), "seed": (np.uint64, 1),
        "rows": (np.uint32, (K + 1) * ROW), "out": (np.uint32, ROW), "length": (np.int32, 1), "live": (np.uint32, ROW),
        "slots": (np.uint32, (K + 1) * ROW), "idx": (np.uint32, 1), "rate": (f32, RATE_WORDS), "cap": (np.uint32, 1)}
    return {**{name: np.zeros(B * row, dtype) for name, (dtype, row) in shapes.items()},
            "cost": np.zeros(COST_VERIFY + K + 1, f32), "width": np.zeros(1, np.uint32)}


# each public function of B rows, and the buffers it reads by their names in its refusal
SIZED = {
    "spec_seed_gather": (lambda a: ref.spec_seed_gather(a["rows"], K + 1, ROW, a["acc"], a["out"], B),
                         {"rows": "rows", "acc": "acc", "out": "out"}),
    "spec_assemble_verify": (lambda a: ref.spec_assemble_verify(a["pend"], a["draft"], K, a["vtok"], a["pos_ctr"],
                                                                a["pos_start"], B),
                             {name: name for name in ("pend", "draft", "vtok", "pos_ctr", "pos_start")}),
    "spec_accept_greedy_dc": (lambda a: ref.spec_accept_greedy_dc(a["vtok"], a["pred"], K, a["brk"], a["acc"],
                                                                  a["last_pred"], a["ctl"], B),
                              {name: name for name in ("vtok", "pred", "brk", "acc", "last_pred", "ctl")}),
    "spec_ring_commit": (lambda a: ref.spec_ring_commit(a["vtok"], a["acc"], a["last_pred"], a["ctl"], a["pend"],
                                                        a["ring"], CAP, K, B),
                         {name: name for name in ("vtok", "acc", "last_pred", "ctl", "pend", "ring")}),
    "spec_rollback_stream": (lambda a: ref.spec_rollback_stream([None, a["length"]], a["pos_start"], a["ctl"], B),
                             {"length": "len_ptrs[1]", "pos_start": "pos_start", "ctl": "ctl"}),
    "spec_accept_sample": (lambda a: ref.spec_accept_sample(a["vtok"], a["p"], a["q"], V, K, a["brk"], a["acc"],
                                                            a["last_pred"], a["ctl"], a["pos_start"], a["seed"], B),
                           {name: name for name in ("vtok", "p", "q", "brk", "acc", "last_pred", "ctl", "pos_start",
                                                    "seed")}),
    "spec_draft_sample": (lambda a: ref.spec_draft_sample(1, K, V, a["q"], a["pos_ctr"], a["seed"], a["draft"], B),
                          {name: name for name in ("q", "pos_ctr", "seed", "draft")}),
    "spec_state_copy": (lambda a: ref.spec_state_copy([None, (a["live"], a["slots"], ROW)], K, a["ctl"], B),
                        {"live": "table[1]'s live", "slots": "table[1]'s slots", "ctl": "ctl"}),
    "spec_state_flip": (lambda a: ref.spec_state_flip([a["idx"]], K, a["ctl"], B),
                        {"idx": "idx_ptrs[0]", "ctl": "ctl"}),
    "spec_choose_lengths": (lambda a: ref.spec_choose_lengths(a["ctl"], a["acc"], a["brk"], a["rate"], a["cap"],
                                                              a["cost"], a["width"], K, 0.9, 0.5, B),
                            {name: name for name in ("ctl", "acc", "brk", "rate", "cap", "cost", "width")}),
    "mark_lengths": (lambda a: ref.mark_lengths(a["ctl"], a["brk"], a["cap"], 1, K, B),
                     {name: name for name in ("ctl", "brk", "cap")}),
}


@pytest.mark.parametrize("function", list(SIZED))
def test_each_buffer_holds_the_rows_its_sizes_say_or_is_refused_naming_it(function):
    """The reference took k, V and B on trust: a buffer they did not fit met numpy's broadcast or
    index error, or a row read the next row's words as its own, silently (rows_of). Each buffer a
    word short, or of two dimensions, is refused before any is written, naming it; one with
    words to spare past its rows (a test's guard words, which the kernel never reads) is taken."""
    call, named = SIZED[function]
    call(sized_buffers())
    call({name: np.append(words, words[:3]) for name, words in sized_buffers().items()})
    for key, name in named.items():
        # a state layer's arrays are read by their words in order, whatever their shape (the toy's
        # numpy loop holds its slots [slots][row_words])
        shaped = function == "spec_state_copy" and key in ("live", "slots")
        if shaped:
            call({**sized_buffers(), key: sized_buffers()[key].reshape(B, -1)})
        for bad in ("short",) if shaped else ("short", "2-D"):
            given = sized_buffers()
            want = given[key].size
            given[key] = given[key][:-1] if bad == "short" else given[key].reshape(1, -1)
            before, shape = {n: words.copy() for n, words in given.items()}, re.escape(str(given[key].shape))
            kind = "an array" if shaped else "a flat array"
            with pytest.raises(ValueError, match=f"^{re.escape(name)} must be {kind} of at least {want} values "
                                                 rf"\(\d+ rows? of \d+\), not one of shape {shape}$"):
                call(given)
            assert all(np.array_equal(given[n], before[n]) for n in given), f"{function} wrote before {name}'s refusal"


def test_what_the_reference_writes_is_written_in_place_or_refused_naming_it():
    """A state layer's live array was read by its words through np.reshape, which copies an array
    its words are not evenly strided in (a [B][W] column slice of a wider array) and a list, so
    spec_state_copy rolled back the copy and the live state was left as it was, silently; a list
    given for any buffer was sliced into copies too, so a kernel's writes to it were lost.
    rows_of hands back a view of each buffer that the writes go through, and refuses, naming it,
    what no view reaches, before anything is written; an array a view does reach, strided or of
    another shape, is written through."""
    wide = np.zeros((B, ROW + 2), np.uint32)
    for live, what in ((wide[:, :ROW], "an array whose words one view reaches"), ([0] * (B * ROW), "a numpy")):
        given = live_buffers()
        given["slots"][:] = 7
        before = {n: words.copy() for n, words in given.items()}
        with pytest.raises(ValueError, match=f"^table\\[0\\]'s live must be {what}"):
            ref.spec_state_copy([(live, given["slots"], ROW)], K, given["ctl"], B)
        assert all(np.array_equal(given[n], before[n]) for n in given) and not np.asarray(live).any()
    given = live_buffers()
    ctl = given["ctl"].tolist()
    with pytest.raises(ValueError, match="^ctl must be a numpy array, which the reference writes in place, not a "
                                         "list$"):
        ref.spec_accept_greedy_dc(given["vtok"], given["pred"], K, given["brk"], given["acc"], given["last_pred"], ctl,
                                  B)
    # reached by a view: written through, whatever the strides or the shape
    given = live_buffers()
    given["slots"][:] = np.arange(given["slots"].size)
    strided, shaped = np.zeros(2 * B * ROW, np.uint32), np.zeros((B, ROW), np.uint32)
    ref.spec_state_copy([(strided[::2], given["slots"], ROW), (shaped, given["slots"], ROW)], K, given["ctl"], B)
    kept = given["slots"].reshape(B, K + 1, ROW)[:, 0]  # keep 1: slot 0 of each row
    assert strided[::2].tolist() == kept.reshape(-1).tolist() and not strided[1::2].any()
    assert shaped.tolist() == kept.tolist()


def test_a_round_tail_checks_every_steps_buffers_before_its_acceptance_writes_any():
    """spec_round_tail_greedy is the acceptance, the commit and the rollback in turn, and each
    checked its own buffers: a ring or a length array the sizes do not fit was refused by the
    commit or the rollback, after the acceptance had written acc, ctl, vtok and last_pred. All
    three steps' buffers are checked first; the tree's tail is checked so too (test_reference_tree)."""
    def tail(a):
        ref.spec_round_tail_greedy(a["vtok"], a["pred"], K, a["brk"], a["acc"], a["last_pred"], a["ctl"], a["pend"],
                                   a["ring"], CAP, [None, a["length"]], a["pos_start"], B)

    given = live_buffers()
    tail(given)
    assert not np.array_equal(given["ctl"], live_buffers()["ctl"]), "the acceptance writes ctl"
    for key, name in (("length", "len_ptrs[1]"), ("ring", "ring"), ("pos_start", "pos_start")):
        given = live_buffers()
        given[key] = given[key][:-1]
        before = {n: words.copy() for n, words in given.items()}
        with pytest.raises(ValueError, match=f"^{re.escape(name)} must be a flat array of at least "):
            tail(given)
        assert all(np.array_equal(given[n], before[n]) for n in given), f"the tail wrote before {name}'s refusal"


def test_a_batch_is_a_count_of_rows():
    """batch=True was one row and 2.0 met "'float' object cannot be interpreted as an integer"."""
    for bad, error in ((True, TypeError), (2.0, TypeError), (0, ValueError)):
        with pytest.raises(error, match="^batch must be an"):
            ref.spec_accept_greedy_dc(*(sized_buffers()[n] for n in ("vtok", "pred")), K,
                                      *(sized_buffers()[n] for n in ("brk", "acc", "last_pred", "ctl")), bad)


def test_a_numpy_batch_counts_rows_as_an_int():
    """spec_state_copy and spec_choose_lengths counted a row's words in the batch they were given
    after row_views had checked it (batch * row_words, batch * RATE_WORDS): a numpy uint8 batch of
    200 made 400 words 144, numpy's wrap, and the rows met "cannot reshape". The checked int is
    used, so np.uint8(200) is 200 rows, as 200 is."""
    rows, f32 = 200, np.float32

    def run(batch) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(0)
        a = {"ctl": np.tile(np.int32([-1, -1, 0, 1]), rows), "acc": rng.integers(0, 3, rows * ACC_WORDS, np.uint32),
             "brk": np.zeros(rows * BRK_WORDS, np.uint32), "rate": rng.random(rows * RATE_WORDS).astype(f32),
             "cap": np.full(rows, K, np.uint32), "cost": np.ones(COST_VERIFY + K + 1, f32),
             "width": np.full(1, K, np.uint32), "live": np.zeros(rows * 2, np.uint32),
             "slots": rng.integers(0, 9, rows * (K + 1) * 2, np.uint32)}
        ref.spec_state_copy([(a["live"], a["slots"], 2)], K, a["ctl"], batch)
        ref.spec_choose_lengths(a["ctl"], a["acc"], a["brk"], a["rate"], a["cap"], a["cost"], a["width"], K, 0.9,
                                0.5, batch)
        return a

    want, got = run(rows), run(np.uint8(rows))
    assert want["live"].any() and all(np.array_equal(got[n], want[n]) for n in want)


# each public function of k (and V, where it takes one), called with the sizes given
def _sized(function: str):
    return {
        "spec_assemble_verify": lambda a, k, v: ref.spec_assemble_verify(a["pend"], a["draft"], k, a["vtok"],
                                                                         a["pos_ctr"], a["pos_start"], B),
        "spec_accept_greedy_dc": lambda a, k, v: ref.spec_accept_greedy_dc(a["vtok"], a["pred"], k, a["brk"],
                                                                           a["acc"], a["last_pred"], a["ctl"], B),
        "spec_ring_commit": lambda a, k, v: ref.spec_ring_commit(a["vtok"], a["acc"], a["last_pred"], a["ctl"],
                                                                 a["pend"], a["ring"], CAP, k, B),
        "spec_round_tail_greedy": lambda a, k, v: ref.spec_round_tail_greedy(
            a["vtok"], a["pred"], k, a["brk"], a["acc"], a["last_pred"], a["ctl"], a["pend"], a["ring"], CAP,
            [a["length"]], a["pos_start"], B),
        "spec_accept_sample": lambda a, k, v: ref.spec_accept_sample(a["vtok"], a["p"], a["q"], v, k, a["brk"],
                                                                     a["acc"], a["last_pred"], a["ctl"],
                                                                     a["pos_start"], a["seed"], B),
        "spec_draft_sample": lambda a, k, v: ref.spec_draft_sample(0, k, v, a["q"], a["pos_ctr"], a["seed"],
                                                                   a["draft"], B),
        "spec_state_copy": lambda a, k, v: ref.spec_state_copy([(a["live"], a["slots"], ROW)], k, a["ctl"], B),
        "spec_state_flip": lambda a, k, v: ref.spec_state_flip([a["idx"]], k, a["ctl"], B),
        "spec_choose_lengths": lambda a, k, v: ref.spec_choose_lengths(a["ctl"], a["acc"], a["brk"], a["rate"],
                                                                       a["cap"], a["cost"], a["width"], k, 0.9, 0.5,
                                                                       B),
        "mark_lengths": lambda a, k, v: ref.mark_lengths(a["ctl"], a["brk"], a["cap"], 1, k, B),
        "width_values": lambda a, k, v: ref.width_values(np.full(B, 0.5), a["cap"][:B], a["cost"], k),
    }[function]


def live_buffers() -> dict[str, np.ndarray]:
    """sized_buffers with every row live, keeping one token and drafting: what a size reads."""
    given = sized_buffers()
    given["ctl"].reshape(B, -1)[:, ref.KEEP] = 1
    given["ctl"].reshape(B, -1)[:, ref.BUDGET] = -1
    given["ctl"].reshape(B, -1)[:, ref.EOS] = -1
    given["cap"][:] = K
    given["cost"][:] = 1
    return given


@pytest.mark.parametrize("function", ["spec_assemble_verify", "spec_accept_greedy_dc", "spec_ring_commit",
                                      "spec_round_tail_greedy", "spec_accept_sample", "spec_draft_sample",
                                      "spec_state_copy", "spec_state_flip", "spec_choose_lengths", "mark_lengths",
                                      "width_values"])
def test_k_is_a_count_of_drafts_refused_naming_it_before_anything_is_written(function):
    """A negative k made rows of negative length, which no buffer is too short for: a row's views
    were empty or reached into the next row's words, so spec_ring_commit committed the bonus
    alone, the state rollbacks and mark_lengths did nothing and spec_draft_sample drew into row 0,
    silently, and the rest met numpy's index error, naming nothing. Refused naming k (sizes, in
    row_views: as_size, as the launchers'), before any buffer is written; a bool or a float too."""
    call = _sized(function)
    call(live_buffers(), K, V)
    call(live_buffers(), 0, V)  # a round of no drafts: plain decoding
    for k, error, message in ((-1, ValueError, "^k must be an int of at least 0, not -1$"),
                              (-2, ValueError, "^k must be an int of at least 0, not -2$"),
                              (True, TypeError, "^k must be an integer, not True$"),
                              (3.0, TypeError, "^k must be an integer, not 3.0$")):
        given = live_buffers()
        before = {n: words.copy() for n, words in given.items()}
        with pytest.raises(error, match=message):
            call(given, k, V)
        assert all(np.array_equal(given[n], before[n]) for n in given), f"{function} wrote before k's refusal"


# each size of one function's own, and the least it takes, called with the size given
OWN_SIZES = {
    ("spec_ring_commit", "ring_cap", 0): lambda a, n: ref.spec_ring_commit(a["vtok"], a["acc"], a["last_pred"],
                                                                           a["ctl"], a["pend"], a["ring"], n, K, B),
    ("spec_round_tail_greedy", "ring_cap", 0): lambda a, n: ref.spec_round_tail_greedy(
        a["vtok"], a["pred"], K, a["brk"], a["acc"], a["last_pred"], a["ctl"], a["pend"], a["ring"], n, [a["length"]],
        a["pos_start"], B),
    ("spec_seed_gather", "n_rows", 0): lambda a, n: ref.spec_seed_gather(a["rows"], n, ROW, a["acc"], a["out"], B),
    ("spec_seed_gather", "row_words", 0): lambda a, n: ref.spec_seed_gather(a["rows"], K + 1, n, a["acc"], a["out"],
                                                                            B),
    ("spec_state_copy", "table[0]'s row_words", 0): lambda a, n: ref.spec_state_copy([(a["live"], a["slots"], n)], K,
                                                                                      a["ctl"], B),
    ("spec_state_copy", "slots", 1): lambda a, n: ref.spec_state_copy([(a["live"], a["slots"], 1)], K, a["ctl"], B,
                                                                      slots=n),
    ("spec_state_flip", "slots", 1): lambda a, n: ref.spec_state_flip([a["idx"]], K, a["ctl"], B, slots=n),
}


@pytest.mark.parametrize(("function", "size", "least"), list(OWN_SIZES))
def test_a_functions_own_sizes_are_counts_refused_naming_them_before_anything_is_written(function, size, least):
    """ring_cap, n_rows, row_words and slots were taken on trust: a negative one made rows of
    negative length or bounds numpy reads from the end, so spec_seed_gather's n_rows and a state
    layer's row_words of -1 copied other words, silently, and the rest met numpy's index or
    broadcast error or a division by zero, naming nothing; a bool was read as 1. Each is an int
    of at least 0 (slots, a bank a kept row reads one of, of at least 1), as_size naming it,
    before any buffer is written; the sizes the buffers are laid out for are taken."""
    call = OWN_SIZES[function, size, least]
    call(live_buffers(), {"ring_cap": CAP, "n_rows": K + 1, "row_words": ROW, "slots": K + 1}.get(
        size.removeprefix("table[0]'s "), ROW))
    for bad, error, message in ((least - 1, ValueError, f"an int of at least {least}, not {least - 1}"),
                                (-5, ValueError, f"an int of at least {least}, not -5"),
                                (True, TypeError, "an integer, not True"), (2.0, TypeError, "an integer, not 2.0")):
        given = live_buffers()
        before = {n: words.copy() for n, words in given.items()}
        with pytest.raises(error, match=f"^{re.escape(size)} must be {message}$"):
            call(given, bad)
        assert all(np.array_equal(given[n], before[n]) for n in given), f"{function} wrote before {size}'s refusal"


@pytest.mark.parametrize("function", ["spec_accept_sample", "spec_draft_sample"])
def test_v_is_a_vocabulary_of_at_least_one_token_refused_naming_it_before_anything_is_written(function):
    """V = 0 or -1 made q's rows empty, or slices numpy's negative bounds cut, so spec_draft_sample
    drew token 0 silently and spec_accept_sample met numpy's index error, naming nothing. Refused
    naming V (of at least 1, as the launchers' vocab), before any buffer is written."""
    call = _sized(function)
    for v, error, message in ((0, ValueError, "^V must be an int of at least 1, not 0$"),
                              (-1, ValueError, "^V must be an int of at least 1, not -1$"),
                              (True, TypeError, "^V must be an integer, not True$")):
        given = live_buffers()
        before = {n: words.copy() for n, words in given.items()}
        with pytest.raises(error, match=message):
            call(given, K, v)
        assert all(np.array_equal(given[n], before[n]) for n in given), f"{function} wrote before V's refusal"


@pytest.mark.parametrize(("a", "cap"), [
    (np.full(3, 0.5), np.full(2, 3)), (np.full(2, 0.5), np.full(3, 3)), (np.full(2, 0.5), np.int64(3)),
    (np.full((2, 1), 0.5), np.full((2, 1), 3)), (np.float64(0.5), np.full(1, 3)),
])
def test_width_values_takes_one_estimate_and_one_cap_a_row(a, cap):
    """width_values(a, cap, ...) read its rows by `cap >= i` over `a`: a cap short of the rows or
    past them met numpy's boolean index error, and one cap for all rows was taken, silently.
    Refused naming both and their shapes; the rows' own (1-D, of one length, none too) taken."""
    cost = np.ones(COST_VERIFY + K + 1, np.float32)
    with pytest.raises(ValueError, match=r"^a and cap must hold one value a row each \(1-D, of the same length\), "
                                         rf"not arrays of shapes {re.escape(str(np.shape(a)))} and "
                                         rf"{re.escape(str(np.shape(cap)))}$"):
        ref.width_values(a, cap, cost, K)
    assert ref.width_values(np.full(2, 0.5), np.full(2, 3), cost, K).shape == (K + 1,)
    assert ref.width_values(np.zeros(0), np.zeros(0, np.uint32), cost, K).tolist() == [0.0] * (K + 1)

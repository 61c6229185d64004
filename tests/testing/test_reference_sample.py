"""Hand-worked cases for stochastic acceptance in memra_cuda.testing.reference (contract 6), and the
theorem it exists for: committed tokens are distributed as sampling from the target, whatever
the draft.

The reference is the oracle of the kernel's GPU tests, so its behaviour is pinned here: where a
row has a single token of positive weight the expected token is written out by hand; where a race
decides, the expectation is the race itself (sample_race) on the weights the contract names, so
the test says which weights and which draw (position, purpose) the contract uses. Runs on CPU.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from memra_cuda.testing import reference as ref
from memra_cuda.testing.philox import uniform

from laws import (CHI2_999, CLOSE, CROSS_CHECK_ROWS, FAR, ROWS, TARGET, TOP_CELL_DRAWS, assert_distributed_as, cells,
                  chi2_critical, chi_square, theorem_rows)

NAN = float("nan")


def f32(*rows) -> np.ndarray:
    return np.array(rows, np.float32).reshape(-1)


def u32(*words: int) -> np.ndarray:
    return np.array(words, np.uint32)


def test_chi2_critical_meets_the_table():
    assert chi2_critical(5) == 20.515
    for df, value in ((10, 29.588), (30, 59.703), (100, 149.449)):  # standard tables
        assert value <= chi2_critical(df) < 1.01 * value


def test_cells_are_full_and_cover_the_law():
    law = np.random.default_rng(3).random(1000) ** 8
    law /= law.sum()
    index = cells(law, 20_000)
    mass = np.bincount(index, weights=law)
    assert index.min() == 0 and (np.diff(np.unique(index)) == 1).all()
    assert (mass * 20_000 >= 50).all() and abs(mass.sum() - 1) < 1e-12


# -- sample_race -----------------------------------------------------------------------------

def test_race_single_positive_weight_wins_whatever_the_draws():
    for seed in range(20):
        assert ref.sample_race(np.array([0, 0, 0.3, 0]), seed, 7, 1) == 2


def test_race_nan_negative_and_zero_weights_never_win():
    w = np.array([NAN, -5.0, 0.0, 1e-30, -np.inf, NAN])
    assert {ref.sample_race(w, seed, 3, 1) for seed in range(20)} == {3}


def test_race_without_positive_weight_is_minus_one():
    assert ref.sample_race(np.array([0.0, -1.0, NAN, -np.inf]), 5, 9, 1) == -1
    assert ref.sample_race(np.zeros(1), 5, 9, 1) == -1


def test_race_over_no_weights_is_minus_one_and_over_rows_refused():
    """An empty w has no positive weight, so -1 as the docstring says (the kernels' race over V = 0
    keeps no key), where np.argmax met "attempt to get argmax of an empty sequence"; a 2-D w (one
    token is drawn) met "truth value ... is ambiguous", and a bare number an IndexError."""
    assert ref.sample_race(np.zeros(0), 5, 9, 1) == -1
    assert ref.sample_race([], 5, 9, 1) == -1
    for bad in (np.ones((2, 3)), np.ones((1, 4)), np.float64(1.0)):
        with pytest.raises(ValueError, match=f"w must be one row of weights \\(1-D\\), not an array of shape "
                                             f"{re.escape(str(np.shape(bad)))}"):
            ref.sample_race(bad, 5, 9, 1)


def test_race_infinite_weights_tie_to_the_smallest_index():
    assert ref.sample_race(np.array([1.0, np.inf, 1.0, np.inf]), 11, 2, 1) == 1


def test_race_is_argmax_of_weight_over_exponential_draws_at_its_position_and_purpose():
    """E_v = -ln U(seed, position, v, purpose), written out."""
    w = np.array([0.1, 0.4, 0.2, 0.3])
    seed, position, purpose = 0xDEADBEEF12345678, 2**31 + 5, 2
    e = np.array([-np.log(uniform(seed, position, v, purpose)) for v in range(4)])
    assert ref.sample_race(w, seed, position, purpose) == int(np.argmax(w / e))
    assert np.array_equal(ref.race_scores(w, seed, position, purpose), w / e)


def test_race_scores_broadcast_rows_of_seeds_and_positions():
    w = np.array([0.5, 0.0, 0.5])
    seeds, positions = np.array([1, 2, 3], np.uint64), np.array([10, 20, 30])
    scores = ref.race_scores(w, seeds, positions, 1)
    assert scores.shape == (3, 3) and (scores[:, 1] == -np.inf).all()
    for row in range(3):
        assert np.array_equal(scores[row], ref.race_scores(w, seeds[row], positions[row], 1))


def test_race_draws_in_proportion_to_the_weights():
    """Unnormalised weights, 20 000 positions of one seed: the winners follow w / sum(w)."""
    w = np.array([1.0, 2.0, 3.0, 4.0, 10.0])
    tokens = np.argmax(ref.race_scores(w, 99, np.arange(20_000), ref.PURPOSE_SAMPLE), axis=-1)
    assert_distributed_as(tokens, w, "race winners")


# -- spec_accept_sample: hand-worked rows ----------------------------------------------------

# V = 4, k = 3: the pending token 50, then drafts 1, 2, 3 at absolute positions 11, 12, 13
# (pos_start 10). EVEN is a law on the 4 tokens; p has k+1 rows, q has k.
V, K, POS, SEED = 4, 3, 10, 1234
VTOK = (50, 1, 2, 3)
EVEN = (0.25, 0.25, 0.25, 0.25)


def sample(p, q, vtok=VTOK, k=K, brk=(0, 0), acc=(7, 100), last_pred=77, done=0, keep=9, pos_start=POS,
           seed=SEED, vocab=V) -> dict:
    """Run the reference on fresh buffers; return every buffer it may write, as lists."""
    state = dict(brk=u32(*brk), acc=u32(*acc), last_pred=u32(last_pred), ctl=np.array([-1, -1, done, keep], np.int32))
    inputs = dict(vtok=u32(*vtok), p=f32(*p), q=f32(*q), pos_start=np.array([pos_start], np.int32),
                  seed=np.array([seed], np.uint64))
    frozen = {name: words.copy() for name, words in inputs.items()}
    ref.spec_accept_sample(inputs["vtok"], inputs["p"], inputs["q"], vocab, k, state["brk"], state["acc"],
                           state["last_pred"], state["ctl"], inputs["pos_start"], inputs["seed"])
    assert all(np.array_equal(inputs[n], frozen[n], equal_nan=n in "pq") for n in inputs), "inputs are read-only"
    return {name: words.tolist() for name, words in state.items()}


def accepted(n: int, bonus: int, total: int, brk_count: int = 0) -> dict:
    """What accept leaves after accepting n drafts then the bonus (not done, eos and budget -1)."""
    return dict(brk=[0, brk_count], acc=[n, total], last_pred=[bonus], ctl=[-1, -1, 0, n + 1])


def test_p_equal_q_accepts_every_draft_and_samples_the_bonus_from_the_last_row():
    # p[3] (after all three drafts) puts all its mass on token 2
    assert sample(p=(EVEN, EVEN, EVEN, (0, 0, 1, 0)), q=(EVEN, EVEN, EVEN)) == accepted(3, 2, 103)


def test_zero_target_probability_rejects_and_the_residual_samples():
    # draft 2 (i = 1) has p = 0: rejected. Residual max(0, p[1] - q[1]) = (0, 0.75, 0, 0): token 1.
    assert sample(p=(EVEN, (0, 1, 0, 0), EVEN, EVEN), q=(EVEN, EVEN, EVEN)) == accepted(1, 1, 101)


def test_acceptance_stops_at_the_first_rejection():
    # draft 1 rejected; drafts 2 and 3 would pass (p == q) but are never judged
    assert sample(p=((0, 0, 0, 1), EVEN, EVEN, EVEN), q=(EVEN, EVEN, EVEN)) == accepted(0, 3, 100)


@pytest.mark.parametrize("draft", [V, V + 1, 2**31, 2**32 - 1])
def test_draft_id_past_the_vocabulary_is_rejected_without_indexing(draft):
    # residual (0, 0, 0, 0.75): token 3
    assert sample(p=((0, 0, 0, 1), EVEN, EVEN, EVEN), q=(EVEN, EVEN, EVEN), vtok=(50, draft, 2, 3)) == \
        accepted(0, 3, 100)


@pytest.mark.parametrize("bad", [NAN, -0.5, -np.inf, -0.0])
def test_nan_or_negative_target_probability_counts_as_zero(bad):
    p0 = (0.5, bad, 0.5, 0)  # draft 1's p is garbage: rejected; residual (0.25, 0, 0.25, 0) counts it as 0
    got = sample(p=(p0, EVEN, EVEN, EVEN), q=(EVEN, EVEN, EVEN))
    assert got["acc"] == [0, 100] and got["last_pred"][0] in (0, 2)
    assert got["last_pred"][0] == ref.sample_race(np.array([0.25, 0, 0.25, 0]), SEED, POS + 1, 1)


@pytest.mark.parametrize("bad", [NAN, -0.5, -np.inf])
def test_nan_or_negative_draft_probability_counts_as_zero_so_the_draft_is_accepted(bad):
    q0 = (0.5, bad, 0.5, 0.5)  # U * 0 < p[0][1]: accepted whatever U
    assert sample(p=(EVEN, EVEN, EVEN, (1, 0, 0, 0)), q=(q0, EVEN, EVEN)) == accepted(3, 0, 103)


def test_residual_without_positive_weight_falls_back_to_p():
    # p[0] == q[0] = (0, 1, 0, 0); draft 1 is token 1, accepted, so make it token 2 (p = q = 0): rejected,
    # the residual is all 0, and p[0] itself gives token 1
    assert sample(p=((0, 1, 0, 0), EVEN, EVEN, EVEN), q=((0, 1, 0, 0), EVEN, EVEN), vtok=(50, 2, 2, 3)) == \
        accepted(0, 1, 100)


def test_no_positive_weight_anywhere_commits_token_zero():
    garbage = (NAN, 0, -1, NAN)
    assert sample(p=(garbage, EVEN, EVEN, EVEN), q=(EVEN, EVEN, EVEN), last_pred=77) == accepted(0, 0, 100)


def test_k0_samples_from_p0_and_never_reads_q():
    assert sample(p=((0, 0, 1, 0),), q=((NAN, NAN, NAN, NAN),), vtok=(50,), k=0) == accepted(0, 2, 100)
    assert sample(p=((0, 0, 1, 0),), q=(EVEN,), vtok=(50,), k=0, brk=(1, 4)) == accepted(0, 2, 100, brk_count=5)


def test_break_caps_acceptance_and_the_bonus_comes_from_p_not_the_residual():
    """brk[0] = 2: one draft at most. At the cap n = limit, so the bonus is raced over p[1] =
    (0.5, 0, 0, 0.5); the residual against q[1] = (0, 0, 0, 1) would allow token 0 only."""
    p1, q1 = (0.5, 0, 0, 0.5), (0, 0, 0, 1)
    bonuses = set()
    for seed in range(16):
        got = sample(p=(EVEN, p1, EVEN, EVEN), q=(EVEN, q1, EVEN), brk=(2, 6), seed=seed)
        bonus = ref.sample_race(np.array(p1), seed, POS + 2, 1)
        assert got == accepted(1, bonus, 101, brk_count=7), f"seed {seed}"
        bonuses.add(bonus)
    assert bonuses == {0, 3}


def test_break_at_the_first_draft_samples_from_p0():
    assert sample(p=((0, 0, 0, 1), EVEN, EVEN, EVEN), q=((0, 0, 0, 1), EVEN, EVEN), brk=(1, 0)) == \
        accepted(0, 3, 100, brk_count=1)


def test_garbage_break_caps_nothing_but_counts():
    for brk in (K + 2, 2**31, 2**32 - 1):
        assert sample(p=(EVEN, EVEN, EVEN, (0, 0, 1, 0)), q=(EVEN, EVEN, EVEN), brk=(brk, 0)) == \
            accepted(3, 2, 103, brk_count=1)


def test_counters_wrap_at_32_bits():
    assert sample(p=(EVEN, EVEN, EVEN, (0, 0, 1, 0)), q=(EVEN, EVEN, EVEN), brk=(5, 2**32 - 1),
                  acc=(0, 2**32 - 2)) == accepted(3, 2, 1, brk_count=0)


def test_done_row_keeps_nothing_counts_nothing_and_draws_nothing():
    done = dict(brk=[0, 5], acc=[0, 100], last_pred=[77], ctl=[-1, -1, 1, 0])
    assert sample(p=(EVEN,) * 4, q=(EVEN,) * 3, brk=(2, 5), done=1) == done
    assert sample(p=(EVEN,) * 4, q=(EVEN,) * 3, done=-7)["acc"] == [0, 100]


@pytest.mark.parametrize("pos_start", [POS, 2**31 - 1, -2**31, -1])
def test_acceptance_draws_u_at_each_drafts_absolute_position(pos_start):
    """p/q = 1/2 at drafts 1 and 2, p == q at draft 3: draft 1 survives iff U(seed, pos_start + 1,
    0, 0) < 1/2 (positions as u32), draft 2 iff U at pos_start + 2 is, draft 3 always."""
    p = ((0, 0.5, 0, 0.5), (0, 0, 0.25, 0.75), EVEN, EVEN)
    q = ((0, 1, 0, 0), (0, 0, 0.5, 0.5), EVEN)
    for seed in range(32):
        u = [float(np.float32(uniform(seed, pos_start + 1 + i, 0, 0))) for i in range(2)]
        n = 0 if u[0] >= 0.5 else 1 if u[1] >= 0.5 else 3
        assert sample(p=p, q=q, pos_start=pos_start, seed=seed)["acc"][0] == n, f"seed {seed}, u {u}"


@pytest.mark.parametrize("seed,position", TOP_CELL_DRAWS)
def test_drafts_with_p_equal_to_q_are_accepted_even_at_the_largest_draw(seed, position):
    """U < 1 in float32 too, so U * q < p holds where p = q: all k drafts are accepted, the first at
    the position whose draw is the largest U."""
    assert np.float32(uniform(seed, position, 0, ref.PURPOSE_ACCEPT)) == np.float32(1 - 2.0**-24) < 1
    law = (0.1, 0.2, 0.3, 0.4)
    assert sample(p=(law,) * 4, q=(law,) * 3, vtok=(50, 3, 1, 3), pos_start=position - 1, seed=seed)["acc"] == [3, 103]


def test_residual_sampling_never_picks_a_token_where_p_is_not_above_q():
    """p = (0.1, 0.4, 0.2, 0.3), q = (0.4, 0.1, 0.3, 0.2): only tokens 1 and 3 have p > q. Over 300
    seeds, every bonus after a rejected first draft is one of them, both occur, and the accepted
    drafts are tokens with q > 0."""
    p, q = (0.1, 0.4, 0.2, 0.3), (0.4, 0.1, 0.3, 0.2)
    bonuses = []
    for seed in range(300):
        draft = ref.sample_race(np.array(q), seed, POS + 1, ref.PURPOSE_DRAFT)
        got = sample(p=(p,) * 4, q=(q,) * 3, vtok=(50, draft, 0, 0), seed=seed)
        if got["acc"][0] == 0:
            bonuses.append(got["last_pred"][0])
    assert set(bonuses) == {1, 3} and len(bonuses) > 30


# -- batching --------------------------------------------------------------------------------

def test_batched_call_equals_one_call_per_row():
    """Six rows of random laws (with zeros and NaNs), drafts (some past V), breaks and done flags:
    row b of the batched call is the single-row call on row b's buffers."""
    rng = np.random.default_rng(7)
    B, k, vocab = 6, 3, 5
    p = rng.random((B, k + 1, vocab)).astype(np.float32)
    q = rng.random((B, k, vocab)).astype(np.float32)
    p[rng.random(p.shape) < 0.2], q[rng.random(q.shape) < 0.1] = 0, NAN
    vtok = rng.integers(0, vocab + 2, (B, k + 1)).astype(np.uint32)
    state = dict(brk=np.array([[0, 3], [2, 0], [0, 0], [9, 1], [1, 0], [0, 0]], np.uint32),
                 acc=rng.integers(0, 2**32, (B, 2)).astype(np.uint32),
                 last_pred=rng.integers(0, 2**32, B).astype(np.uint32),
                 ctl=np.array([[-1, -1, d, 5] for d in (0, 0, 1, 0, 0, -3)], np.int32))
    pos_start, seed = rng.integers(-2**31, 2**31, B).astype(np.int32), rng.integers(0, 2**64, B, dtype=np.uint64)
    batched = {name: words.reshape(-1).copy() for name, words in state.items()}
    ref.spec_accept_sample(vtok.reshape(-1), p.reshape(-1), q.reshape(-1), vocab, k, batched["brk"],
                           batched["acc"], batched["last_pred"], batched["ctl"], pos_start, seed, batch=B)
    for b in range(B):
        row = {name: words[b].reshape(-1).copy() for name, words in state.items()}
        ref.spec_accept_sample(vtok[b], p[b].reshape(-1), q[b].reshape(-1), vocab, k, row["brk"], row["acc"],
                               row["last_pred"], row["ctl"], pos_start[b:b + 1], seed[b:b + 1])
        for name, words in row.items():
            assert batched[name].reshape(B, -1)[b].tolist() == words.tolist(), f"row {b}: {name}"
    assert batched["acc"][2 * 2] == 0 and batched["ctl"][4 * 2 + ref.KEEP] == 0, "row 2 is done"


# -- the theorem -----------------------------------------------------------------------------

def first_tokens(rows: dict[str, np.ndarray], q: np.ndarray, k: int) -> np.ndarray:
    """The first token each row commits, vectorised over rows (the reference takes a row at a time):
    draft 0 if it survives its test, else the bonus raced over the residual; with k = 0 the bonus
    raced over p[0]. Cross-checked against the reference on the first rows."""
    first = rows["pos_start"].astype(np.int64) + 1
    if k == 0:
        return np.argmax(ref.race_scores(TARGET, rows["seed"], first, ref.PURPOSE_SAMPLE), axis=-1)
    x = rows["vtok"][:, 1]
    u = uniform(rows["seed"], first, 0, ref.PURPOSE_ACCEPT).astype(np.float32)
    survives = u * q[x] < TARGET[x]
    residual = ref.bonus_weights(TARGET, q)
    bonus = np.argmax(ref.race_scores(residual, rows["seed"], first, ref.PURPOSE_SAMPLE), axis=-1)
    return np.where(survives, x, bonus)


def reference_first_tokens(rows: dict[str, np.ndarray], k: int) -> np.ndarray:
    """The first committed token of each row, by ref.spec_accept_sample on a batch of these rows."""
    n = len(rows["seed"])
    brk, acc, last_pred = np.zeros(2 * n, np.uint32), np.zeros(2 * n, np.uint32), np.zeros(n, np.uint32)
    ctl = np.tile(np.array([-1, -1, 0, 0], np.int32), n)
    ref.spec_accept_sample(rows["vtok"].reshape(-1), rows["p"].reshape(-1), rows["q"].reshape(-1), len(TARGET), k,
                           brk, acc, last_pred, ctl, rows["pos_start"], rows["seed"], batch=n)
    return np.where(acc[0::2] > 0, rows["vtok"][:, 1], last_pred) if k else last_pred


@pytest.mark.parametrize("q,k", [(CLOSE, 4), (FAR, 2), (FAR, 0)], ids=["close", "far", "k0"])
def test_committed_tokens_are_distributed_as_the_target(q, k):
    rows = theorem_rows(q, k, ROWS, np.random.default_rng(2024 + k))
    tokens = first_tokens(rows, q, k)
    head = {name: words[:CROSS_CHECK_ROWS] for name, words in rows.items()}
    assert np.array_equal(tokens[:CROSS_CHECK_ROWS], reference_first_tokens(head, k)), "helper != reference"
    assert_distributed_as(tokens, TARGET, f"first committed token, q={q.tolist()}, k={k}")


def test_the_chi_square_test_sees_the_far_drafts_own_law():
    """The power behind the theorem's test: committing the far drafts unjudged fails it."""
    rows = theorem_rows(FAR, 1, ROWS, np.random.default_rng(5))
    assert chi_square(rows["vtok"][:, 1], TARGET) > 100 * CHI2_999[len(TARGET) - 1]


# -- spec_draft_sample (contract 7) ----------------------------------------------------------

def test_draft_sample_draws_the_only_token_with_weight_into_its_step():
    k, V = 3, 4
    q = f32([0, 0, 0, 0], [0, 0, 0.5, 0], [0, 0, 0, 0])
    draft = np.array([9, 9, 9], np.uint32)
    ref.spec_draft_sample(1, k, V, q, np.array([7], np.int32), np.array([5], np.uint64), draft)
    assert draft.tolist() == [9, 2, 9]
    ref.spec_draft_sample(0, k, V, q, np.array([7], np.int32), np.array([5], np.uint64), draft)
    assert draft.tolist() == [0, 2, 9], "a row without weight draws 0"


def test_draft_sample_refuses_a_step_that_is_no_draft():
    """step=-1 indexed q's rows and draft from the end, numpy's way, and drew the last draft
    silently (the kernel's u32 step is past the chain, and its launcher refuses it); -2 drew an
    earlier one. A step is an int of at least 0 (as_size); one past the chain is clamped to the
    last draft, as the kernel clamps it."""
    k, V = 3, 4
    q = f32([0, 0, 0, 0], [0, 0, 0.5, 0], [0, 0.5, 0, 0])
    pos, seed = np.array([7], np.int32), np.array([5], np.uint64)
    for step, error in ((-1, ValueError), (-2, ValueError), (1.0, TypeError), (True, TypeError)):
        draft = np.array([9, 9, 9], np.uint32)
        with pytest.raises(error, match="^step must be an int"):
            ref.spec_draft_sample(step, k, V, q, pos, seed, draft)
        assert draft.tolist() == [9, 9, 9]
    draft = np.array([9, 9, 9], np.uint32)
    ref.spec_draft_sample(7, k, V, q, pos, seed, draft)
    assert draft.tolist() == [9, 9, 1], "a step past the chain redraws the last draft"


def test_draft_sample_races_at_the_position_of_the_token_it_drafts():
    """Draft `step` of a row at pos_ctr p sits at p + step + 1: the race is purpose 2 there."""
    k, V = 2, 50
    q = np.random.default_rng(1).random((2, k, V)).astype(np.float32)
    pos, seed = np.array([10, 20], np.int32), np.array([3, 4], np.uint64)
    draft = np.zeros(2 * k, np.int64)
    ref.spec_draft_sample(1, k, V, q.reshape(-1), pos, seed, draft, batch=2)
    for b in range(2):
        assert draft[b * k + 1] == ref.sample_race(q[b, 1], seed[b], int(pos[b]) + 2, ref.PURPOSE_DRAFT)

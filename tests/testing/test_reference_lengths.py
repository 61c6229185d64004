"""The length chooser's contract (docs/lengths.md) in memra_cuda.testing.reference, the oracle of its
GPU test: each row's running acceptance, the batch's width against a brute force over every
width, each row's length as its acceptance cap; and what the lengths must not change: greedy
output is the target's own (a row at length 0 commits the target's next token, a row of a batch
at any length commits what a chain of that length commits, the numpy loop with lengths chosen
every round decodes as the target), and sampled output is distributed as the target's, at
lengths mixed in one batch, 0 among them. Runs on CPU.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memra_cuda.buffers.layout import (ACC_ROUND, ACC_TOTAL, ACC_WORDS, BRK_MARK, BRK_WORDS, COST_DRAFT, COST_VERIFY,
                                       CTL_DONE, CTL_KEEP, CTL_WORDS, RATE_ACCEPTED, RATE_REJECTED, RATE_WORDS)
from memra_cuda.buffers.lengths import DECAY, PRIOR
from memra_cuda.testing import reference as ref
from memra_cuda.testing.philox import uniform
from memra_cuda.testing.toy import lm as toy, numpy_loop

from laws import CLOSE, CROSS_CHECK_ROWS, FAR, ROWS, TARGET, assert_distributed_as, theorem_rows

NAN, INF = float("nan"), float("inf")


class Rows:
    """The chooser's buffers for `batch` rows of k drafts: every row live and judged last round
    (keep 1) at width 0, with its statistics (accepted, rejected) and cap; flat costs (every
    width costs a plain step) unless given. choose's decay is 1 unless given, so that plain
    round moves no statistics (at a decay below 1 it moves them toward the prior)."""

    def __init__(self, k: int, rates, caps, verify=None, draft: float = 0.0, done=None):
        self.k, self.batch = k, len(caps)
        self.ctl = np.tile(np.array([-1, -1, 0, 1], np.int32), self.batch)
        if done is not None:
            self.ctl[CTL_DONE::CTL_WORDS] = done
        self.acc = np.zeros(ACC_WORDS * self.batch, np.uint32)
        self.brk = np.zeros(BRK_WORDS * self.batch, np.uint32)
        self.rate = np.zeros(RATE_WORDS * self.batch, np.float32)
        self.rate[RATE_ACCEPTED::RATE_WORDS], self.rate[RATE_REJECTED::RATE_WORDS] = np.array(rates, np.float32).T
        self.cap = np.array(caps, np.uint32)
        self.cost = np.zeros(COST_VERIFY + k + 1, np.float32)
        self.cost[COST_DRAFT], self.cost[COST_VERIFY:] = draft, np.ones(k + 1) if verify is None else verify
        self.width = np.zeros(1, np.uint32)

    def choose(self, decay: float = 1.0, prior: float = PRIOR) -> int:
        ref.spec_choose_lengths(self.ctl, self.acc, self.brk, self.rate, self.cap, self.cost, self.width, self.k,
                                decay, prior, batch=self.batch)
        return int(self.width[0])

    @property
    def marks(self) -> list[int]:
        return self.brk[BRK_MARK::BRK_WORDS].tolist()

    def row_rate(self, b: int) -> list[float]:
        return self.rate[RATE_WORDS * b:RATE_WORDS * (b + 1)].tolist()


def observed(k: int, rate, cap: int, width: int, accepted: int, keep: int = 1, decay: float = 0.5) -> list[float]:
    """One row's statistics after a round that judged it at width `width` and accepted `accepted`."""
    rows = Rows(k, [rate], [cap])
    rows.width[0], rows.acc[ACC_ROUND], rows.ctl[CTL_KEEP] = width, accepted, keep
    rows.choose(decay=decay, prior=0.25)
    return rows.row_rate(0)


# -- the statistics --------------------------------------------------------------------------

def test_a_judged_round_decays_the_statistics_and_adds_its_drafts_and_its_rejection():
    assert observed(4, [3.0, 1.0], cap=4, width=4, accepted=2) == [0.5 * 3 + 2, 0.5 * 1 + 1]


def test_a_round_that_accepted_its_whole_length_rejected_nothing():
    assert observed(4, [3.0, 1.0], cap=4, width=4, accepted=4) == [0.5 * 3 + 4, 0.5 * 1]
    assert observed(4, [3.0, 1.0], cap=2, width=4, accepted=2) == [0.5 * 3 + 2, 0.5 * 1], "the row's length was 2"
    assert observed(4, [3.0, 1.0], cap=4, width=1, accepted=1) == [0.5 * 3 + 1, 0.5 * 1], "the batch's width was 1"


def test_a_row_admitted_since_the_last_round_restarts_at_the_prior():
    """A reset clears keep, and every judged round sets it to at least 1."""
    assert observed(4, [30.0, 7.0], cap=4, width=4, accepted=2, keep=0) == [0.25, 0.75]


def test_a_plain_round_judges_nothing_and_decays_the_statistics_toward_the_prior():
    """0.5 * 3 + 0.5 * 0.25 and 0.5 * 1 + 0.5 * 0.75, whatever the round's count says."""
    assert observed(4, [3.0, 1.0], cap=0, width=4, accepted=3) == [1.625, 0.875], "speculation off"
    assert observed(4, [3.0, 1.0], cap=4, width=0, accepted=3) == [1.625, 0.875], "the batch's width was 0"
    assert observed(4, [3.0, 1.0], cap=4, width=0, accepted=0, decay=1.0) == [3.0, 1.0], "no decay: nothing moves"
    assert observed(4, [3.0, 1.0], cap=4, width=0, accepted=0, decay=0.0) == [0.25, 0.75], "all decay: the prior"


def test_garbage_counts_clamp_to_the_rows_length_and_k():
    assert observed(4, [3.0, 1.0], cap=3, width=4, accepted=2**32 - 1) == [0.5 * 3 + 3, 0.5 * 1]
    assert observed(4, [3.0, 1.0], cap=2**32 - 1, width=2**31, accepted=9) == [0.5 * 3 + 4, 0.5 * 1]
    assert observed(4, [3.0, 1.0], cap=4, width=4, accepted=1, keep=-7) == [0.5 * 3 + 1, 0.5 * 1 + 1], "judged"


def test_each_product_and_sum_of_the_statistics_is_rounded_to_f32_on_its_own():
    """No fused multiply-add: a case where one rounding would give another word."""
    decay, accepted = np.float32(0.9), np.uint32(1097432416).view(np.float32)  # 14.593109
    two_roundings = np.float32(decay * accepted) + np.float32(3)
    one_rounding = np.float32(float(decay) * float(accepted) + 3)
    assert two_roundings != one_rounding
    assert observed(4, [accepted, 1.0], cap=4, width=4, accepted=3, decay=decay)[0] == two_roundings


def test_a_plain_rounds_decay_toward_the_prior_is_rounded_to_f32_product_by_product():
    """accepted = decay * accepted + (1 - decay) * prior, rejected = decay * rejected +
    (1 - decay) * (1 - prior): each product, difference and sum rounded on its own, as the
    kernel's; a case where fusing decay * x into the sum would give other words."""
    decay, prior, x = np.float32(0.9), np.float32(0.25), np.uint32(1097432424).view(np.float32)  # 14.593117
    rest = np.float32(1) - decay
    towards = (rest * prior, rest * (np.float32(1) - prior))
    two_roundings = [np.float32(decay * x) + towards[0], np.float32(decay * x) + towards[1]]
    one_rounding = [np.float32(float(decay) * float(x) + float(t)) for t in towards]
    assert two_roundings[0] != one_rounding[0] and two_roundings[1] != one_rounding[1]
    assert observed(4, [x, x], cap=4, width=0, accepted=3, decay=decay) == two_roundings


def test_a_width_of_0_opens_again_when_the_prior_says_speculation_pays():
    """The review's case: B = 3 rows of k = 4, a draft step costing 0.2, a verify of w + 1
    tokens 1 + 0.3 w. One round rejecting every draft closes the width; at width 0 nothing is
    judged, so only the decay toward the prior can open it again. At a prior of 0.6 a row pays
    at width 1 (1.6 tokens for 1.5), and once open, drafts that are all accepted widen it to k.
    (At a prior of 0.5 these costs break even, 1.5 for 1.5, and the width stays 0.)"""
    k, batch, prior = 4, 3, 0.6
    rows = Rows(k, [[prior, 1 - prior]] * batch, caps=[k] * batch, verify=[1 + 0.3 * w for w in range(k + 1)],
                draft=0.2)
    rows.width[0] = k  # the last round was judged at width k and accepted nothing
    assert rows.choose(decay=DECAY, prior=prior) == 0, "an all-rejected round closes the width"
    widths = []
    for _ in range(40):  # every draft would be accepted
        rows.acc[ACC_ROUND::ACC_WORDS] = rows.width[0]
        widths.append(rows.choose(decay=DECAY, prior=prior))
    assert 1 in widths[:30], widths
    assert widths[-1] == k, widths


def test_a_done_row_is_left_as_it_is_and_weighs_nothing():
    rows = Rows(4, [[1.0, 0.0], [0.0, 1.0]], caps=[4, 4], done=[1, 0])
    rows.ctl[CTL_KEEP], rows.brk[BRK_MARK] = 0, 9  # an admission, were it live
    assert rows.choose() == 0, "the live row has a = 0: every width commits one token"
    assert rows.row_rate(0) == [1.0, 0.0] and rows.marks == [9, 1]


def truncated_geometric(rng: np.random.Generator, a: float, length: int) -> int:
    """Drafts accepted, each with probability a, until the first rejection or `length`."""
    n = 0
    while n < length and rng.random() < a:
        n += 1
    return n


def run_rounds(rows: Rows, rng: np.random.Generator, a: float, rounds: int, decay: float) -> float:
    """`rounds` rounds of one row at the width it is given, accepting as a geometric law of `a`;
    the row's estimate after them."""
    for _ in range(rounds):
        rows.choose(decay=decay)
        rows.acc[ACC_ROUND] = truncated_geometric(rng, a, min(int(rows.width[0]), int(rows.cap[0])))
        rows.ctl[CTL_KEEP] = 1
    return float(ref.length_estimates(rows.rate)[0])


def test_the_estimate_is_the_acceptance_of_a_geometric_law_and_follows_the_text():
    rng = np.random.default_rng(11)
    rows = Rows(4, [[0.0, 0.0]], caps=[4])  # flat costs: always the full width
    rows.ctl[CTL_KEEP] = 0
    assert abs(run_rounds(rows, rng, 0.7, 3000, decay=0.999) - 0.7) < 0.03
    assert run_rounds(rows, rng, 0.2, 100, decay=0.9) < 0.4, "the text got harder: the estimate follows it"
    frozen = Rows(4, [[0.0, 0.0]], caps=[4])
    frozen.ctl[CTL_KEEP] = 0
    run_rounds(frozen, rng, 0.7, 3000, decay=1.0)
    assert run_rounds(frozen, rng, 0.2, 100, decay=1.0) > 0.6, "without decay it would not"


@pytest.mark.parametrize(("words", "a"), [
    ([1.0, 1.0], 0.5), ([3.0, 1.0], 0.75), ([1.0, 0.0], 1.0), ([0.0, 2.0], 0.0), ([0.0, 0.0], 0.0),
    ([NAN, 1.0], 0.0), ([INF, 1.0], 0.0), ([1.0, INF], 0.0), ([-1.0, 3.0], 0.0), ([3.0, -1.0], 1.0),
    ([1.0, -1.0], 0.0)])
def test_the_estimate_is_clamped_and_garbage_is_no_acceptance(words, a):
    assert ref.length_estimates(np.array(words, np.float32)).tolist() == [a]


# -- the width -------------------------------------------------------------------------------

def tokens_expected(a: float, length: int) -> float:
    """E(L) in closed form: 1 + a + ... + a^L."""
    return length + 1.0 if a == 1 else (1 - a ** (length + 1)) / (1 - a)


def brute_force(a: np.ndarray, caps: list[int], verify: list[float], draft: float, k: int) -> list[float]:
    """Every width's expected tokens per unit of cost, one width at a time, in closed form."""
    values = []
    for w in range(k + 1):
        cost = float(np.float32(verify[w])) + w * float(np.float32(draft))
        tokens = sum(tokens_expected(float(x), min(w, c)) for x, c in zip(a, caps))
        values.append(tokens / cost if cost > 0 else -math.inf)
    return values


statistics = st.one_of(st.floats(0, 50, width=32), st.just(0.0))
costs = st.one_of(st.floats(0.0625, 8, width=32), st.sampled_from([1.0, 2.0, -1.0, 0.0, NAN]))


@settings(max_examples=300, deadline=None)
@given(data=st.data(), k=st.integers(0, 20), batch=st.integers(1, 9))
def test_the_width_is_the_best_by_brute_force(data, k, batch):
    rates = data.draw(st.lists(st.tuples(statistics, statistics), min_size=batch, max_size=batch), label="rates")
    caps = data.draw(st.lists(st.integers(0, k), min_size=batch, max_size=batch), label="caps")
    verify = data.draw(st.lists(costs, min_size=k + 1, max_size=k + 1), label="verify")
    draft = data.draw(st.sampled_from([0.0, 0.05, 0.3, 1.0]), label="draft")
    rows = Rows(k, rates, caps, verify, draft)
    width = rows.choose()
    values = brute_force(ref.length_estimates(rows.rate), caps, verify, draft, k)
    best = max(values)
    if best == -math.inf:
        assert width == 0, "no width has a positive cost: plain decoding"
    else:
        assert math.isclose(values[width], best, rel_tol=1e-12), f"width {width}: {values}"
    assert rows.marks == [min(width, c) + 1 if min(width, c) < k else 0 for c in caps]
    assert rows.width.tolist() == [width]


def test_a_perfect_draft_at_flat_costs_takes_the_largest_cap():
    """a = 1: E(L) = L + 1, so each width more adds a token per row that has it."""
    rows = Rows(8, [[1.0, 0.0]] * 3, caps=[0, 5, 2])
    assert rows.choose() == 5
    assert rows.marks == [1, 6, 3]


def test_ties_go_to_the_smaller_width():
    """Rows at a = 1 with a verify of w + 1 tokens costing w + 1 steps: every width commits
    one token per step; rows at a = 0 at flat costs: every width commits one token."""
    assert Rows(4, [[1.0, 0.0]] * 2, caps=[4, 4], verify=[1, 2, 3, 4, 5]).choose() == 0
    assert Rows(4, [[0.0, 1.0]] * 2, caps=[4, 4]).choose() == 0


def test_speculation_pays_where_the_drafts_are_cheap_and_right_and_not_otherwise():
    verify, draft = [1.0, 1.1, 1.2, 1.3, 1.4], 0.1
    assert Rows(4, [[9.0, 1.0]], caps=[4], verify=verify, draft=draft).choose() == 4  # a = 0.9
    assert Rows(4, [[1.0, 9.0]], caps=[4], verify=verify, draft=draft).choose() == 0  # a = 0.1
    assert Rows(4, [[1.0, 1.0]], caps=[4], verify=verify, draft=draft).choose() == 1  # a = 0.5


def test_a_width_the_costs_leave_out_is_never_chosen_and_without_any_the_width_is_0():
    rows = Rows(4, [[1.0, 0.0]], caps=[4], verify=[1, 1, 1, 1, NAN])
    assert rows.choose() == 3
    for verify in ([0, -1, NAN, 0, -INF], [NAN] * 5):
        rows = Rows(4, [[1.0, 0.0]], caps=[4], verify=verify)
        assert rows.choose() == 0 and rows.marks == [1]


def test_without_a_live_row_the_width_is_0():
    rows = Rows(4, [[1.0, 0.0]] * 2, caps=[4, 4], done=[1, -5])
    rows.width[0] = 3
    assert rows.choose() == 0 and rows.marks == [0, 0]


# -- the lengths as caps ---------------------------------------------------------------------

def test_a_mark_is_only_ever_lowered():
    assert [ref.tighter_mark(m, n) for m, n in ((0, 0), (0, 3), (3, 0), (2, 5), (5, 2))] == [0, 3, 3, 2, 2]


def test_each_live_row_is_capped_at_its_length_and_a_smaller_cap_stands():
    rows = Rows(4, [[1.0, 0.0]] * 5, caps=[0, 2, 4, 4, 3])
    rows.brk[BRK_MARK::BRK_WORDS] = [0, 2, 3, 9, 0]  # a p-min break already there: the smaller cap wins
    assert rows.choose() == 4
    assert rows.marks == [1, 2, 3, 9, 4]


# -- exact as today: greedy ------------------------------------------------------------------

def judge_greedy(k: int, vtok: np.ndarray, pred: np.ndarray, brk: np.ndarray, batch: int) -> dict[str, np.ndarray]:
    """Contracts 3 and 4 on `batch` fresh rows: the words each row ends the round with."""
    acc, last_pred = np.zeros(ACC_WORDS * batch, np.uint32), np.zeros(batch, np.uint32)
    ctl, pend = np.tile(np.array([-1, -1, 0, 0], np.int32), batch), np.zeros(batch, np.uint32)
    ring = np.zeros(batch * (1 + k + 1), np.uint32)
    ref.spec_accept_greedy_dc(vtok, pred, k, brk, acc, last_pred, ctl, batch=batch)
    ref.spec_ring_commit(vtok, acc, last_pred, ctl, pend, ring, k + 1, k, batch=batch)
    rings = ring.reshape(batch, k + 2)
    return dict(accepted=acc[ACC_ROUND::ACC_WORDS], total=acc[ACC_TOTAL::ACC_WORDS], bonus=last_pred,
                keep=ctl[CTL_KEEP::CTL_WORDS], pending=pend,
                tokens=[rings[b, 1:1 + rings[b, 0]].tolist() for b in range(batch)])


def test_a_greedy_row_at_length_0_commits_the_targets_own_next_token():
    """Every draft right, speculation off: the round commits pred[0] alone, as plain decoding."""
    k, pred = 4, np.array([11, 12, 13, 14, 15], np.uint32)
    rows = Rows(k, [[9.0, 1.0]], caps=[0])
    rows.choose()
    spoken = judge_greedy(k, np.array([7, 11, 12, 13, 14], np.uint32), pred, rows.brk, 1)
    plain = judge_greedy(0, np.array([7], np.uint32), pred[:1], np.zeros(BRK_WORDS, np.uint32), 1)
    assert spoken["tokens"] == plain["tokens"] == [[11]]
    for word in ("accepted", "total", "bonus", "keep", "pending"):
        assert spoken[word].tolist() == plain[word].tolist(), word


@pytest.mark.parametrize("seed", range(5))
def test_mixed_lengths_give_each_row_the_greedy_result_of_a_chain_of_its_own_length(seed):
    """A batch of rows whose drafts agree with the target for a while, each given its length by
    the chooser (and some a p-min break after it): each row's round is the round of a chain of
    its own length, min(length, break), alone."""
    rng = np.random.default_rng(seed)
    k, batch = 6, 40
    vtok = rng.integers(0, 3, (batch, k + 1)).astype(np.uint32)
    pred = rng.integers(0, 3, (batch, k + 1)).astype(np.uint32)
    agree = rng.integers(0, k + 1, batch)
    for b in range(batch):
        vtok[b, 1:1 + agree[b]] = pred[b, :agree[b]]
    rates = np.stack([rng.uniform(2, 10, batch), rng.uniform(0, 1, batch)], axis=1)  # a about 0.9
    rows = Rows(k, rates, caps=rng.integers(0, k + 1, batch).tolist(), verify=1 + 0.2 * np.arange(k + 1), draft=0.05)
    width = rows.choose()
    lengths = np.minimum(width, rows.cap.astype(int))
    breaks = np.where(rng.random(batch) < 0.3, rng.integers(0, k, batch), k)  # draft i's p-min break, or none
    for b in np.flatnonzero(breaks < k):
        rows.brk[BRK_WORDS * b + BRK_MARK] = ref.tighter_mark(int(rows.brk[BRK_WORDS * b + BRK_MARK]), breaks[b] + 1)
    batched = judge_greedy(k, vtok.reshape(-1), pred.reshape(-1), rows.brk, batch)
    assert 0 < width and len(set(np.minimum(lengths, breaks).tolist())) > 2, "the case mixes lengths"
    for b in range(batch):
        own = int(min(lengths[b], breaks[b]))
        alone = judge_greedy(own, vtok[b, :own + 1], pred[b, :own + 1], np.zeros(BRK_WORDS, np.uint32), 1)
        for word, value in alone.items():
            assert np.asarray(batched[word][b]).tolist() == np.asarray(value[0]).tolist(), f"row {b}: {word}"


class ChosenLengths(numpy_loop.NumpyRoundStream):
    """The numpy loop of one row with the length chooser first in every round, the body's
    width k: the lengths it chose are in `widths`."""

    def __init__(self, model: toy.ToyModel, k: int, m_rounds: int, capacity: int, cap: int,
                 verify: list[float], draft: float):
        super().__init__(model, k, m_rounds, capacity)
        self.rows = Rows(k, [[0.0, 0.0]], caps=[cap], verify=verify, draft=draft)
        self.rows.ctl, self.rows.acc, self.rows.brk = self.ctl, self.acc, self.brk  # the stream's own words
        self.widths: list[int] = []

    def round(self) -> None:
        if not self.ctl[CTL_DONE]:
            self.rows.choose(decay=DECAY)
            self.widths.append(min(int(self.rows.width[0]), int(self.rows.cap[0])))
        super().round()


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), noise_ppm=st.sampled_from([0, 100_000, 400_000, 1_000_000]),
       p_min=st.sampled_from([0.0, 0.1, 0.5]), k=st.integers(0, 7), cap=st.integers(0, 7),
       slope=st.sampled_from([0.0, 0.05, 0.2, 0.6]), draft=st.sampled_from([0.0, 0.05, 0.3]),
       max_new=st.integers(1, 60))
def test_the_numpy_loop_with_lengths_chosen_every_round_is_the_targets_greedy(seed, noise_ppm, p_min, k, cap,
                                                                                slope, draft, max_new):
    model = toy.ToyModel(seed=seed, vocab=50, noise_ppm=noise_ppm, p_min=p_min)
    prompt = [3, 1, 4, 1, 5]
    stream = ChosenLengths(model, k, 3, 512, min(cap, k), [1 + slope * w for w in range(k + 1)], draft)
    assert stream.generate(prompt, max_new) == toy.target_greedy(model, prompt, max_new)


def test_the_loops_lengths_follow_the_drafts_agreement():
    """A draft right most of the time, at costs where that pays at some widths and not others:
    the loop runs at several lengths, and still decodes as the target."""
    model = toy.ToyModel(seed=5, vocab=50, noise_ppm=250_000, p_min=0.05)
    prompt = [3, 1, 4, 1, 5]
    stream = ChosenLengths(model, 6, 3, 1024, 6, [1 + 0.15 * w for w in range(7)], 0.05)
    assert stream.generate(prompt, 300) == toy.target_greedy(model, prompt, 300)
    assert len(set(stream.widths)) > 2, stream.widths


# -- exact as today: sampling ----------------------------------------------------------------

def first_tokens(rows: dict[str, np.ndarray], q: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The first token each row commits at its length (kernel 6 with BRK_MARK = length + 1),
    vectorised over rows: at length 0 the bonus raced over p[0]; else draft 0 if it survives its
    test, else the bonus raced over the residual. Cross-checked against the reference."""
    first = rows["pos_start"].astype(np.int64) + 1
    x = rows["vtok"][:, 1]
    u = uniform(rows["seed"], first, 0, ref.PURPOSE_ACCEPT).astype(np.float32)
    plain = np.argmax(ref.race_scores(TARGET, rows["seed"], first, ref.PURPOSE_SAMPLE), axis=-1)
    residual = np.argmax(ref.race_scores(ref.bonus_weights(TARGET, q), rows["seed"], first, ref.PURPOSE_SAMPLE),
                         axis=-1)
    return np.where(lengths == 0, plain, np.where(u * q[x] < TARGET[x], x, residual))


def reference_first_tokens(rows: dict[str, np.ndarray], k: int, brk: np.ndarray) -> np.ndarray:
    n = len(rows["seed"])
    acc, last_pred = np.zeros(ACC_WORDS * n, np.uint32), np.zeros(n, np.uint32)
    ctl = np.tile(np.array([-1, -1, 0, 0], np.int32), n)
    ref.spec_accept_sample(rows["vtok"].reshape(-1), rows["p"].reshape(-1), rows["q"].reshape(-1), len(TARGET), k,
                           brk.copy(), acc, last_pred, ctl, rows["pos_start"], rows["seed"], batch=n)
    return last_pred if k == 0 else np.where(acc[ACC_ROUND::ACC_WORDS] > 0, rows["vtok"][:, 1], last_pred)


@pytest.mark.parametrize("q", [CLOSE, FAR], ids=["close", "far"])
def test_committed_tokens_are_distributed_as_the_target_at_mixed_lengths(q):
    """ROWS rows of one round, their caps 0 to k in turn, lengths chosen at flat costs (so each
    row's length is its cap): the first committed token is distributed as p at every length,
    and at length 0 it is the token plain sampling draws, word for word."""
    k = 4
    rows = theorem_rows(q, k, ROWS, np.random.default_rng(48))
    chooser = Rows(k, [[0.0, 0.0]] * ROWS, caps=np.arange(ROWS) % (k + 1))
    chooser.ctl[CTL_KEEP::CTL_WORDS] = 0  # every row just admitted
    assert chooser.choose() == k
    lengths = np.minimum(k, chooser.cap.astype(np.int64))
    assert (np.array(chooser.marks) == np.where(lengths < k, lengths + 1, 0)).all()
    tokens = first_tokens(rows, q, lengths)
    head = {name: words[:CROSS_CHECK_ROWS] for name, words in rows.items()}
    assert np.array_equal(tokens[:CROSS_CHECK_ROWS],
                          reference_first_tokens(head, k, chooser.brk[:BRK_WORDS * CROSS_CHECK_ROWS])), \
        "helper != reference"
    plain = {**head, "vtok": head["vtok"][:, :1], "p": head["p"][:, :len(TARGET)], "q": head["q"][:, :len(TARGET)]}
    at_zero = lengths[:CROSS_CHECK_ROWS] == 0
    assert np.array_equal(tokens[:CROSS_CHECK_ROWS][at_zero],
                          reference_first_tokens(plain, 0, np.zeros(BRK_WORDS * CROSS_CHECK_ROWS, np.uint32))[at_zero])
    for length in range(k + 1):
        assert_distributed_as(tokens[lengths == length], TARGET, f"first committed token at length {length}")
    assert_distributed_as(tokens, TARGET, "first committed token, every length")


"""spec_accept_sample (ptx/spec_sample.cu) on the GPU, against memra_cuda.testing.reference.

Random laws (peaked, flat, cut to a few tokens, all zero, sprinkled with NaN, negative and
infinite entries), drafts drawn from the draft's law and now and then past the vocabulary, and
random device state in every row (garbage break markers, counters near wrap-around, done flags,
positions at the i32 limits, any 64-bit seed). Every buffer of the burst is written, the kernel
launched, every buffer read back: the acceptance verdict (acc, keep, brk) must equal the
reference's word for word, and the sampled token too, or be a near tie the contract allows: a
token whose float64 race score is within 1e-5 relative of the reference's best (the kernel races
in f32). Then the theorem in one launch of 20 000 rows, and the launcher's refusals.

MEMRA_CASES (default 2000, spread over the configurations) and MEMRA_SEED as in
test_kernels_gpu.py; a failure names the configuration and the case's seed.
"""
from __future__ import annotations

import os
import zlib
from collections.abc import Iterator

import numpy as np
import pytest

from memra_cuda import Geometry
from memra_cuda import Graph, StreamBufs
from memra_cuda.kernels import SpecKernels
from memra_cuda.testing import reference as ref
from memra_cuda.testing.reference import DONE
from laws import CLOSE, FAR, ROWS, TARGET, TOP_CELL_DRAWS, assert_distributed_as, theorem_rows

pytestmark = pytest.mark.gpu

CASES = int(os.environ.get("MEMRA_CASES", "2000"))
SEED = int(os.environ.get("MEMRA_SEED", "0"))
NEAR_TIE = 1e-5
# 3000: six blocks per row, the last one partial; 152 000: a real vocabulary (297 blocks per row)
CONFIGS = [(B, V, k) for B in (1, 3, 32) for V in (1, 7, 1000, 3000) for k in (0, 1, 4)]
BIG_CONFIGS = [(B, 152_000, k) for B in (1, 32) for k in (0, 1, 4)]
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def spec(engine):
    return SpecKernels(engine)


# -- inputs ----------------------------------------------------------------------------------

def cases(name: str, config: tuple, n_cases: int) -> Iterator[tuple[np.random.Generator, str]]:
    """n_cases (at least one) fresh generators, seeded from the test, the configuration and the
    case index, and the words that name the case."""
    for case in range(max(1, n_cases)):
        seed = (SEED, zlib.crc32(name.encode()), *config, case)
        yield np.random.default_rng(seed), f"{name} (B, V, k)={config} case {case} (seed {seed})"


def pick(rng: np.random.Generator, options: list):
    return options[int(rng.integers(len(options)))]


def laws(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """float32 rows of probabilities over the last axis: flat or peaked, cut to a few tokens or
    not, some rows all zero, and at times garbage: NaN, negatives and -inf (read as 0), +inf."""
    w = rng.random(shape, np.float32) ** pick(rng, [1, 4, 16])
    w[rng.random(shape, np.float32) < pick(rng, [0, 0.5, 0.99])] = 0
    total = w.sum(axis=-1, keepdims=True)
    w = np.divide(w, total, out=np.zeros_like(w), where=total > 0).astype(np.float32)
    if rng.random() < 0.2:
        w[rng.random(shape[:-1]) < 0.3] = 0
    if rng.random() < 0.3:
        garbage = rng.random(shape, np.float32) < 0.05
        w[garbage] = np.array([NAN, -0.25, -INF, -0.0, INF], np.float32)[rng.integers(0, 5, int(garbage.sum()))]
    return w


def draw(rng: np.random.Generator, w: np.ndarray) -> np.ndarray:
    """One id per row of w, in proportion to its positive finite weights (any id where none), and
    one in ten past the vocabulary."""
    vocab = w.shape[-1]
    clean = np.where(np.isfinite(w) & (w > 0), w, 0).astype(np.float64)
    cdf = np.cumsum(clean, axis=-1)
    ids = np.minimum((cdf <= (rng.random(w.shape[:-1]) * cdf[..., -1])[..., None]).sum(axis=-1), vocab - 1)
    ids = np.where(cdf[..., -1] > 0, ids, rng.integers(0, vocab, ids.shape))
    past = np.array([vocab, vocab + 1, 2**31, 2**32 - 1], np.uint64)[rng.integers(0, 4, ids.shape)]
    return np.where(rng.random(ids.shape) < 0.1, past, ids).astype(np.uint32)


def random_state(rng: np.random.Generator, rig: Rig) -> dict[str, np.ndarray]:
    """Every integer buffer of the burst random, then one round's inputs and state in every row."""
    B, V, k = rig.rows, rig.vocab, rig.k
    state = {name: rng.integers(0, 256, buf.nbytes, dtype=np.uint8).view(buf.dtype)
             for name, buf in rig.device.items() if buf.dtype.kind != "f"}
    p = laws(rng, (B, k + 1, V))
    q = pick(rng, [lambda: p[:, :max(k, 1)].copy(), lambda: laws(rng, (B, max(k, 1), V)),
                   lambda: 0.7 * np.nan_to_num(p[:, :max(k, 1)], nan=0, posinf=0, neginf=0)
                   + 0.3 * laws(rng, (B, max(k, 1), V))])()
    state["p_d"], state["q_d"] = p.reshape(-1), q.astype(np.float32).reshape(-1)
    vtok = state["vtok_d"].reshape(B, k + 1)
    vtok[:, 1:] = draw(rng, q[:, :k])
    brk = state["brk_d"].reshape(B, 2)
    brk[:, 0] = np.where(rng.random(B) < 0.6, 0, rng.choice([1, 2, k, k + 1, k + 2, 2**31, 2**32 - 1], B))
    brk[:, 1] = np.where(rng.random(B) < 0.5, 2**32 - 1, brk[:, 1])
    acc = state["acc_d"].reshape(B, 2)
    acc[:, 1] = np.where(rng.random(B) < 0.5, 2**32 - 1 - rng.integers(0, k + 1, B), acc[:, 1])
    ctl = state["ctl_d"].reshape(B, 4)
    ctl[:, DONE] = np.where(rng.random(B) < 0.7, 0, rng.choice([1, -1, 2**31 - 1, -2**31], B))
    edges = np.array([0, -1, 2**31 - 1, 2**31 - 2, -2**31, 100], np.int32)
    state["pos_start_d"] = np.where(rng.random(B) < 0.5, edges[rng.integers(0, 6, B)], state["pos_start_d"])
    return state


# -- the harness -----------------------------------------------------------------------------

class Rig:
    """StreamBufs of B rows plus p_d, q_d and seed_d, allocated once, and the prepared launch."""

    def __init__(self, engine, spec, rows: int, vocab: int, k: int):
        self.engine, self.rows, self.vocab, self.k = engine, rows, vocab, k
        self.bufs = StreamBufs(engine, Geometry(k, 1, rows))
        self.device = {**self.bufs.buffers(), "p_d": engine.alloc(np.float32, rows * (k + 1) * vocab),
                       "q_d": engine.alloc(np.float32, rows * max(k, 1) * vocab),
                       "seed_d": engine.alloc(np.uint64, rows)}
        self.launch = spec.prepare_accept_sample(self.bufs, self.device["p_d"], self.device["q_d"],
                                                 self.device["seed_d"], vocab)

    def run(self, state: dict[str, np.ndarray], where: str, launch=None) -> None:
        """Write every buffer, launch (or `launch`, a graph's), read every buffer and check it."""
        for name, buf in self.device.items():
            self.engine.copy_htod(buf, state[name])
        (launch or self.launch)()
        check(state, {name: self.engine.dtoh(buf) for name, buf in self.device.items()}, self.vocab, self.k,
              self.rows, where)


def check(state: dict[str, np.ndarray], got: dict[str, np.ndarray], vocab: int, k: int, rows: int,
          where: str) -> None:
    """`got` (the buffers after the kernel) against the reference run on `state`: bit for bit,
    but for sampled tokens that are near ties of the reference's."""
    want = {name: words.copy() for name, words in state.items()}
    ref.spec_accept_sample(want["vtok_d"], want["p_d"], want["q_d"], vocab, k, want["brk_d"], want["acc_d"],
                           want["last_pred_d"], want["ctl_d"], want["pos_start_d"], want["seed_d"], batch=rows)
    for name, words in want.items():
        same = got[name].view(np.uint8) == words.view(np.uint8)
        if name != "last_pred_d" and not same.all():
            bad = np.unique(np.flatnonzero(~same) // words.dtype.itemsize)[:8]
            pytest.fail(f"{where}: {name}[{bad.tolist()}] is {got[name][bad].tolist()}, the reference says "
                        f"{words[bad].tolist()}")
    for b in np.flatnonzero(got["last_pred_d"] != want["last_pred_d"]):
        near_tie(state, int(b), int(want["acc_d"][2 * b]), int(got["last_pred_d"][b]),
                 int(want["last_pred_d"][b]), vocab, k, f"{where}, row {b}")


def near_tie(state: dict[str, np.ndarray], b: int, n: int, token: int, expected: int, vocab: int, k: int,
             where: str) -> None:
    """The kernel's token differs from the reference's: it must be a live row whose bonus was raced,
    and the token's float64 score within NEAR_TIE of the best."""
    assert state["ctl_d"][4 * b + DONE] == 0, f"{where}: a done row's last_pred changed"
    brk = int(state["brk_d"][2 * b])
    limit = min(k, brk - 1) if brk else k
    p = state["p_d"].reshape(-1, k + 1, vocab)[b]
    q = state["q_d"].reshape(-1, max(k, 1), vocab)[b]
    weights = ref.bonus_weights(p[n], q[n] if n < limit else None)
    assert weights is not None, f"{where}: no weight to race, the token is {ref.NO_MASS_TOKEN}, not {token}"
    position = int(state["pos_start_d"][b]) + 1 + n
    scores = ref.race_scores(weights, state["seed_d"][b], position, ref.PURPOSE_SAMPLE)
    best = scores[expected]
    assert token < vocab and scores[token] >= best * (1 - NEAR_TIE), (
        f"{where}: sampled {token} (score {scores[token] if token < vocab else 'none'}), the reference "
        f"{expected} (score {best}), after {n} accepted drafts")


# -- against the reference -------------------------------------------------------------------

@pytest.mark.parametrize("B,V,k", CONFIGS)
def test_accept_sample_matches_reference(engine, spec, B, V, k):
    rig = Rig(engine, spec, B, V, k)
    for rng, where in cases("accept_sample", (B, V, k), CASES // len(CONFIGS)):
        rig.run(random_state(rng, rig), where)


def test_the_four_argument_call_derives_the_vocabulary_from_p(engine, spec):
    """docs/kernels.md's ("Launchers") spec.prepare_accept_sample(bufs, p_d, q_d, seed_d): V = len(p_d) / (B (k+1))."""
    rig = Rig(engine, spec, 3, 7, 2)
    launch = spec.prepare_accept_sample(rig.bufs, rig.device["p_d"], rig.device["q_d"], rig.device["seed_d"])
    for rng, where in cases("accept_sample, V derived", (3, 7, 2), 20):
        rig.run(random_state(rng, rig), where, launch=launch)


@pytest.mark.parametrize("B,V,k", BIG_CONFIGS)
def test_accept_sample_matches_reference_on_a_real_vocabulary(engine, spec, B, V, k):
    rig = Rig(engine, spec, B, V, k)
    for rng, where in cases("accept_sample", (B, V, k), CASES // 1000):
        rig.run(random_state(rng, rig), where)


def test_captured_launch_replays_on_the_scratch_it_left_zeroed(engine, spec):
    """A graph of one launch (297 blocks per row, so the rows' last-block hand-off and the scratch
    reset matter), replayed on new state each time."""
    rig = Rig(engine, spec, 3, 152_000, 2)
    graph = Graph(engine, rig.launch)
    for rng, where in cases("accept_sample graph", (3, 152_000, 2), 4):
        rig.run(random_state(rng, rig), where, launch=graph.launch)


def test_a_draft_with_p_equal_to_q_is_accepted_at_the_largest_draw(engine, spec):
    """One row per (seed, position) of test_reference_sample.TOP_CELL_DRAWS, whose draft sits where
    U(seed, position, 0, 0) is the largest U: with p = q, U * q < p in f32 holds only while U < 1 in
    f32, so the draft is accepted (with 24-bit draws the kernel rejected it), as the reference says."""
    rows, vocab, k = len(TOP_CELL_DRAWS), 4, 1
    law = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    rig = Rig(engine, spec, rows, vocab, k)
    state = {name: np.zeros(buf.len, buf.dtype) for name, buf in rig.device.items()}
    state["vtok_d"][:] = np.tile(np.uint32([0, 3]), rows)
    state["p_d"][:], state["q_d"][:] = np.tile(law, rows * (k + 1)), np.tile(law, rows * k)
    state["ctl_d"][:] = np.tile(np.int32([-1, -1, 0, 0]), rows)
    state["pos_start_d"][:] = [position - 1 for _, position in TOP_CELL_DRAWS]
    state["seed_d"][:] = [seed for seed, _ in TOP_CELL_DRAWS]
    rig.run(state, "p = q at the largest draws")
    assert engine.dtoh(rig.bufs.acc_d).tolist() == [k, k] * rows, "every draft accepted"


# -- the theorem -----------------------------------------------------------------------------

STATE = ("vtok_d", "brk_d", "acc_d", "last_pred_d", "ctl_d", "pos_start_d")


def first_rows(buffers: dict[str, np.ndarray], rows: int, head: int) -> dict[str, np.ndarray]:
    return {name: words[:head * (len(words) // rows)] for name, words in buffers.items()}


@pytest.mark.parametrize("q,k", [(CLOSE, 4), (FAR, 2), (FAR, 0)], ids=["close", "far", "k0"])
def test_committed_tokens_are_distributed_as_the_target_in_one_launch(engine, spec, q, k):
    """ROWS rows of one round (test_reference_sample.theorem_rows: drafts raced from q), one launch:
    the first committed tokens follow the target; the first rows also match the reference."""
    rows = theorem_rows(q, k, ROWS, np.random.default_rng(SEED + 77 + k))
    bufs = StreamBufs(engine, Geometry(k, 1, ROWS))
    state = dict(vtok_d=rows["vtok"].reshape(-1), brk_d=np.zeros(2 * ROWS, np.uint32),
                 acc_d=np.zeros(2 * ROWS, np.uint32), last_pred_d=np.zeros(ROWS, np.uint32),
                 ctl_d=np.tile(np.array([-1, -1, 0, 0], np.int32), ROWS), pos_start_d=rows["pos_start"],
                 p_d=rows["p"].reshape(-1), q_d=rows["q"].reshape(-1), seed_d=rows["seed"])
    device = {**{name: getattr(bufs, name) for name in STATE},
              **{name: engine.alloc(state[name].dtype, state[name].size) for name in ("p_d", "q_d", "seed_d")}}
    for name, buf in device.items():
        engine.copy_htod(buf, state[name])
    spec.prepare_accept_sample(bufs, device["p_d"], device["q_d"], device["seed_d"], len(TARGET))()
    got = {name: engine.dtoh(buf) for name, buf in device.items()}
    accepted, bonus = got["acc_d"][0::2], got["last_pred_d"]
    tokens = np.where(accepted > 0, rows["vtok"][:, 1], bonus) if k else bonus
    assert_distributed_as(tokens, TARGET, f"first committed token on the GPU, q={q.tolist()}, k={k}")
    check(first_rows(state, ROWS, 300), first_rows(got, ROWS, 300), len(TARGET), k, 300,
          f"theorem rows, q={q.tolist()}, k={k}")


# -- the launcher's refusals -----------------------------------------------------------------

# A valid call on 3 rows with k = 2 and V = 7, and per refusal the argument it must name and what
# replaces the valid one: (dtype, length) of a buffer, or the vocabulary.
GOOD = dict(p_d=(np.float32, 3 * 3 * 7), q_d=(np.float32, 3 * 2 * 7), seed_d=(np.uint64, 3), vocab=7)
BAD = {
    "seed of u32": ("seed_d", dict(seed_d=(np.uint32, 3))),
    "seed of f64": ("seed_d", dict(seed_d=(np.float64, 3))),
    "a seed short": ("seed_d", dict(seed_d=(np.uint64, 2))),
    "a seed over": ("seed_d", dict(seed_d=(np.uint64, 4))),
    "p of f64": ("p_d", dict(p_d=(np.float64, 3 * 3 * 7))),
    "p a word long": ("p_d", dict(p_d=(np.float32, 3 * 3 * 7 + 1))),
    "p with k rows": ("p_d", dict(p_d=(np.float32, 3 * 2 * 7))),
    "q with k+1 rows": ("q_d", dict(q_d=(np.float32, 3 * 3 * 7))),
    "V = 0": ("vocab", dict(vocab=0)),
    "V = 2**31": ("vocab", dict(vocab=2**31)),
    "V not p's": ("p_d", dict(vocab=8)),
}


def small_call(engine, given: dict) -> tuple[StreamBufs, dict]:
    bufs = StreamBufs(engine, Geometry(2, 1, 3))
    return bufs, {name: engine.alloc(*given[name]) if name != "vocab" else given[name] for name in GOOD}


@pytest.mark.parametrize("what", list(BAD))
def test_bad_input_is_refused_before_anything_is_queued(engine, spec, monkeypatch, what):
    """A ValueError naming the argument, before the launcher allocates or loads anything (so before
    anything is queued on the stream)."""
    name, replaced = BAD[what]
    bufs, args = small_call(engine, {**GOOD, **replaced})

    def forbidden(*_args, **_kwargs):
        raise AssertionError("the launcher queued work before refusing its input")

    for method in ("alloc", "memset", "load_ptx"):
        monkeypatch.setattr(engine, method, forbidden)
    with pytest.raises(ValueError, match=name):
        spec.prepare_accept_sample(bufs, **args)


def test_the_valid_call_the_refusals_vary_prepares_and_survives_garbage(engine, spec):
    """The refusals are about what they name: the same call with GOOD buffers prepares, and
    launches on whatever the fresh buffers hold."""
    bufs, args = small_call(engine, GOOD)
    spec.prepare_accept_sample(bufs, **args)()
    engine.synchronize()

"""The round-stream kernels (ptx/spec_stream.cu) on the GPU, against memra_cuda.testing.reference.

Each kernel runs on thousands of seeded random and adversarial inputs: garbage accept counts,
ring counts and break markers, nonzero garbage done flags, budgets of 0, -1, -7 and 2**31-1,
EOS ids that are -1, a draft or the bonus, positions at the i32 limits, and tiny vocabularies
so drafts agree with predictions and accepts run long. Buffers are allocated and each launch
prepared once per configuration; per case EVERY buffer of the burst (not just the kernel's) is
written, the kernel launched, every buffer read back and compared word for word with the
reference run on host copies, so a stray write shows up as a difference, also into the next
field of StreamBufs' one allocation, where compute-sanitizer (`make sanitize`) cannot see a
bound; guard words around views catch overruns in the targeted tests below.

Every kernel runs batched too (B = 3 and 32, docs/buffers.md, "Batched layout"): each row gets
its own adversarial values and the batched reference is applied, so a row that reads or
writes another row's words shows up as a difference. The warp kernels (accept, commit) also
run on more rows than the largest grid the launcher makes has warps, up to MAX_BATCH.

MEMRA_CASES (default 2000 per kernel, spread over its configurations) lets the sanitizer run
use fewer; MEMRA_SEED varies the inputs. A failure names the kernel, the configuration and
the per-case seed, so the case can be replayed alone.
"""
from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterable, Iterator
from itertools import islice

import numpy as np
import pytest

from memra_cuda import Geometry
from memra_cuda import Cache, DeviceBuffer, StreamBufs, kv_len_ptr_table
from memra_cuda.buffers import PointerTable, kv_len_ptr_table_range
from memra_cuda.kernels import SpecKernels
from memra_cuda.testing import reference as ref
from memra_cuda.buffers.geometry import MAX_BATCH
from memra_cuda.kernels.spec import MAX_ROW_WORDS
from memra_cuda.testing.reference import BUDGET, DONE, EOS, KEEP

pytestmark = pytest.mark.gpu

CASES = int(os.environ.get("MEMRA_CASES", "2000"))
SEED = int(os.environ.get("MEMRA_SEED", "0"))
KS = (0, 1, 4, 8)
RING_ROUNDS = (1, 3)
BATCHES = (1, 3, 32)
SENTINEL = 0x5A5A5A5A  # fits both u32 and i32 buffers
# Past one launch's threads (1024 blocks of 256): the kernel's grid-stride loop must cover it.
PAST_ONE_GRID = 1024 * 256 + 3
# Past one launch's warps (1024 blocks of 8), one a row in accept and commit: each warp strides on to
# further rows. A batch of B rows is B cases at once, so these run LARGE_CASES cases.
LARGE_BATCHES = (1024 * 8 + 1, MAX_BATCH)
LARGE_CASES = 2

# Token sources: ids below a vocabulary size (1-3: drafts nearly always agree), or a palette
# of edge ids (0xFFFFFFFF is (u32)-1, which must never match "no EOS").
VOCABS = (1, 2, 3, 50_000, 2**32, (0, 1, 2**31 - 1, 2**31, 2**32 - 1))


@pytest.fixture(scope="module")
def spec(engine):
    return SpecKernels(engine)


# -- inputs ----------------------------------------------------------------------------------

def cases(kernel: str, config: tuple, n_configs: int) -> Iterator[tuple[np.random.Generator, str]]:
    """This configuration's share of MEMRA_CASES: a fresh generator per case, seeded from the
    kernel, the configuration and the case index, and the words that name the case."""
    for case in range(max(1, CASES // n_configs)):
        seed = (SEED, zlib.crc32(kernel.encode()), *config, case)
        yield np.random.default_rng(seed), f"{kernel} config={config} case {case} (seed {seed})"


def pick(rng: np.random.Generator, options: list):
    return options[int(rng.integers(len(options)))]


def random_words(rng: np.random.Generator, dtype: np.dtype, n: int) -> np.ndarray:
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)


def edge_count(rng: np.random.Generator, bound: int) -> int:
    """A u32 count read against `bound`: at the edges, inside at random, or garbage past it."""
    return pick(rng, [0, 1, max(bound - 1, 0), bound, bound + 1, int(rng.integers(0, bound + 2)),
                      2**31, 2**32 - 1, int(rng.integers(0, 2**32))])


def done_flag(rng: np.random.Generator) -> int:
    """Mostly not done; otherwise 1 or nonzero garbage, all of which mean done."""
    if rng.random() < 0.6:
        return 0
    return pick(rng, [1, 1, -1, 2, 2**31 - 1, -2**31, int(rng.integers(-2**31, 2**31))])


def position(rng: np.random.Generator) -> int:
    """An i32 position, often next to the limits where pos_start + keep wraps."""
    return pick(rng, [0, 1, -1, 2**31 - 1, 2**31 - 2, -2**31, -2**31 + 1,
                      int(rng.integers(0, 4096)), int(rng.integers(-2**31, 2**31))])


def draw_tokens(rng: np.random.Generator, n: int, vocab) -> np.ndarray:
    if isinstance(vocab, tuple):
        return np.array(vocab, np.uint32)[rng.integers(0, len(vocab), n)]
    return rng.integers(0, vocab, n, dtype=np.uint64).astype(np.uint32)


def show(words: np.ndarray) -> str:
    return str(words.tolist()) if words.size <= 16 else f"[{words.size} words, first {words[:8].tolist()}]"


# -- the harness -----------------------------------------------------------------------------

class Rig:
    """One StreamBufs of (k, m, batch) plus a kernel's extra buffers, allocated once.

    `check` is one case: write every buffer from `state` (host arrays by buffer name), launch,
    read every buffer back and compare it whole with `reference` applied to a host copy.
    Buffers the kernel is not given are in the compare too, to show it wrote nothing else.
    """

    def __init__(self, engine, k: int, m: int = 1, batch: int = 1, **extra: DeviceBuffer):
        self.engine = engine
        self.batch = batch
        self.bufs = StreamBufs(engine, Geometry(k, m, batch))
        self.device = {**self.bufs.buffers(), **extra}

    def random_state(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Random contents for every buffer: what the kernel must neither depend on nor touch."""
        return {name: random_words(rng, buf.dtype, buf.len) for name, buf in self.device.items()}

    def rows(self, state: dict[str, np.ndarray], *names: str) -> Iterator[dict[str, np.ndarray]]:
        """Per row of the batch, views of `names` in `state` (row b of a buffer of B·n words is
        words [b·n, (b+1)·n)): the single-sequence input makers then fill each row."""
        for b in range(self.batch):
            yield {name: state[name].reshape(self.batch, -1)[b] for name in names}

    def check(self, launch: Callable[[], None], state: dict[str, np.ndarray],
              reference: Callable[[dict[str, np.ndarray]], None], where: str) -> None:
        for name, buf in self.device.items():
            self.engine.copy_htod(buf, state[name])
        launch()
        want = {name: words.copy() for name, words in state.items()}
        reference(want)
        for name, buf in self.device.items():
            got = self.engine.dtoh(buf)
            if not np.array_equal(got, want[name]):
                inputs = ", ".join(f"{n}={show(w)}" for n, w in state.items())
                pytest.fail(f"{where}: {name} is {show(got)}, the reference says {show(want[name])}\n"
                            f"inputs: {inputs}")


# -- 1. seed_gather --------------------------------------------------------------------------

SEED_CONFIGS = [(k, row_words, batch) for k in KS for row_words in (1, 5, 300) for batch in BATCHES]


@pytest.mark.parametrize("k,row_words,batch", SEED_CONFIGS)
def test_seed_gather_matches_reference(engine, spec, k, row_words, batch):
    n_rows = k + 1  # the verify rows of one round
    out_words = row_words + 2 if batch == 1 else batch * row_words  # one sequence: two guard words
    rig = Rig(engine, k, batch=batch, rows_d=engine.zeros(np.uint32, batch * n_rows * row_words),
              out_d=engine.zeros(np.uint32, out_words))
    launch = spec.prepare_seed_gather(rig.bufs, rig.device["rows_d"], row_words, rig.device["out_d"])

    def reference(s):
        ref.spec_seed_gather(s["rows_d"], n_rows, row_words, s["acc_d"], s["out_d"], batch)

    for rng, where in cases("seed_gather", (k, row_words, batch), len(SEED_CONFIGS)):
        state = rig.random_state(rng)
        for row in rig.rows(state, "acc_d"):
            row["acc_d"][0] = edge_count(rng, n_rows - 1)
        rig.check(launch, state, reference, where)


@pytest.mark.parametrize("row_words", (1, 7, 300, PAST_ONE_GRID))
def test_seed_gather_copies_the_bonus_row_and_nothing_past_it(engine, spec, row_words):
    """Rows whose every word is distinct (row r, word i: (r+1) << 24 | i), so the wrong row or a
    shifted copy cannot pass; acc past the last row reads the last row; a guard word after the
    row stays."""
    n_rows = 5
    bufs = StreamBufs(engine, Geometry(n_rows - 1, 1))
    rows = ((np.arange(1, n_rows + 1, dtype=np.uint32)[:, None] << 24)
            | np.arange(row_words, dtype=np.uint32)).reshape(-1)
    rows_d = engine.htod(rows, np.uint32)
    out_d = engine.zeros(np.uint32, row_words + 1)
    launch = spec.prepare_seed_gather(bufs, rows_d, row_words, out_d)
    for acc, row in [(0, 0), (1, 1), (4, 4), (5, 4), (6, 4), (2**31, 4), (2**32 - 1, 4)]:
        engine.copy_htod(out_d, np.full(row_words + 1, SENTINEL, np.uint32))
        engine.copy_htod(bufs.acc_d, [acc, 3])
        launch()
        want = np.append(rows[row * row_words:(row + 1) * row_words], np.uint32(SENTINEL))
        got = engine.dtoh(out_d)
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, (f"row_words={row_words} acc={acc}: expected row {row} then the guard; "
                               f"words {bad[:8].tolist()} differ: {got[bad[:8]].tolist()} != {want[bad[:8]].tolist()}")


def test_seed_gather_takes_rows_of_up_to_its_most_words(engine, spec):
    """A row of MAX_ROW_WORDS words is prepared, one more refused naming it (the kernel's u32
    word index would wrap and never end): buffers wrapped around an address, never launched."""
    bufs = StreamBufs(engine, Geometry(1, 1))
    for words, fits in ((MAX_ROW_WORDS, True), (MAX_ROW_WORDS + 1, False)):
        rows_d, out_d = (DeviceBuffer.wrap(1 << 40, np.uint32, words, engine=engine) for _ in range(2))
        if fits:
            spec.prepare_seed_gather(bufs, rows_d, words, out_d)
        else:
            with pytest.raises(ValueError, match=f"row_words must be an int from 1 to {MAX_ROW_WORDS}"):
                spec.prepare_seed_gather(bufs, rows_d, words, out_d)


# -- 2. assemble_verify ----------------------------------------------------------------------

ASSEMBLE_KS = KS + (300,)  # 300: k + 1 threads need two blocks


# Token buffers the model writes come as u32 (the toy) or int64 (PyTorch's argmax).
TOKEN_DTYPES = {32: np.uint32, 64: np.int64}  # bits: dtype


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("width", list(TOKEN_DTYPES))
@pytest.mark.parametrize("k", ASSEMBLE_KS)
def test_assemble_verify_matches_reference(engine, spec, k, width, batch):
    # exactly k drafts a row (one at k=0); random 64-bit words: only their low 32 bits are ids
    rig = Rig(engine, k, batch=batch, draft_d=engine.alloc(TOKEN_DTYPES[width], batch * max(k, 1), zeroed=True))
    launch = spec.prepare_assemble_verify(rig.bufs, rig.device["draft_d"])

    def reference(s):
        ref.spec_assemble_verify(s["pend_d"], s["draft_d"], k, s["vtok_d"], s["pos_ctr_d"], s["pos_start_d"], batch)

    for rng, where in cases("assemble_verify", (k, width, batch), 2 * len(ASSEMBLE_KS) * len(BATCHES)):
        state = rig.random_state(rng)
        for row in rig.rows(state, "pos_ctr_d"):
            row["pos_ctr_d"][0] = position(rng)
        rig.check(launch, state, reference, where)


# -- 3. accept_greedy_dc ---------------------------------------------------------------------

def accept_inputs(rng: np.random.Generator, k: int, s: dict[str, np.ndarray]) -> None:
    """Drafts and predictions that agree on a random prefix (and by chance past it with a tiny
    vocabulary), a break marker at or past every edge, counters near wrap-around, a done flag."""
    vocab = pick(rng, VOCABS)
    vtok, pred = draw_tokens(rng, k + 1, vocab), draw_tokens(rng, k + 1, vocab)
    agree = int(rng.integers(0, k + 1))
    pred[:agree] = vtok[1:1 + agree]
    s["vtok_d"][:], s["pred_d"][:] = vtok, pred
    if s["pred_d"].dtype.itemsize == 8 and rng.random() < 0.3:  # garbage above the 32 bits of an id
        s["pred_d"][:] += rng.integers(1, 2**31, k + 1) << 32
    s["brk_d"][0] = edge_count(rng, k + 1) if rng.random() < 0.5 else 0
    s["brk_d"][1] = pick(rng, [0, 2**32 - 1, int(s["brk_d"][1])])
    s["acc_d"][1] = pick(rng, [0, 2**32 - 1, 2**32 - 1 - k // 2, int(s["acc_d"][1])])
    s["ctl_d"][DONE] = done_flag(rng)


def check_accept_greedy(engine, spec, k: int, width: int, batch: int,
                        runs: Iterable[tuple[np.random.Generator, str]]) -> None:
    """accept_greedy_dc against the reference on each of `runs` (from `cases`), every row drawn anew."""
    rig = Rig(engine, k, batch=batch, pred_d=engine.alloc(TOKEN_DTYPES[width], batch * (k + 1), zeroed=True))
    launch = spec.prepare_accept_greedy(rig.bufs, rig.device["pred_d"])

    def reference(s):
        ref.spec_accept_greedy_dc(s["vtok_d"], s["pred_d"], k, s["brk_d"], s["acc_d"], s["last_pred_d"], s["ctl_d"],
                                  batch)

    for rng, where in runs:
        state = rig.random_state(rng)
        for row in rig.rows(state, "vtok_d", "pred_d", "brk_d", "acc_d", "ctl_d"):
            accept_inputs(rng, k, row)
        rig.check(launch, state, reference, where)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("width", list(TOKEN_DTYPES))
@pytest.mark.parametrize("k", KS)
def test_accept_greedy_matches_reference(engine, spec, k, width, batch):
    check_accept_greedy(engine, spec, k, width, batch,
                        cases("accept_greedy_dc", (k, width, batch), 2 * len(KS) * len(BATCHES)))


@pytest.mark.parametrize("batch", LARGE_BATCHES)
@pytest.mark.parametrize("width", list(TOKEN_DTYPES))
def test_accept_greedy_serves_every_row_of_a_large_batch(engine, spec, width, batch):
    """Every row, done or not, has its acc, keep and brk written, so a row no warp served differs."""
    k = 4
    check_accept_greedy(engine, spec, k, width, batch,
                        islice(cases("accept_greedy_dc", (k, width, batch), 1), LARGE_CASES))


# -- 4. ring_commit --------------------------------------------------------------------------

def commit_inputs(rng: np.random.Generator, k: int, ring_cap: int, s: dict[str, np.ndarray]) -> None:
    """Accept and ring counts at or past every edge, EOS none (-1, other negatives), a taken
    token or any id, budgets 0, 1, 2, small, unlimited (-1, -7, -2**31) or huge, a done flag."""
    vocab = pick(rng, VOCABS)
    s["vtok_d"][:] = draw_tokens(rng, k + 1, vocab)
    s["last_pred_d"][:] = draw_tokens(rng, 1, vocab)
    s["acc_d"][0] = edge_count(rng, k)
    s["ring_d"][0] = edge_count(rng, ring_cap)
    n = min(int(s["acc_d"][0]), k)
    taken = [int(t) for t in (*s["vtok_d"][1:1 + n], s["last_pred_d"][0]) if t < 2**31]  # ids eos can be
    s["ctl_d"][EOS] = pick(rng, [-1, -1, -7, -2**31, int(rng.integers(0, 2**31)),
                                 *([pick(rng, taken)] * 3 if taken else [])])
    s["ctl_d"][BUDGET] = pick(rng, [0, 1, 2, -1, -1, -7, -2**31, 2**31 - 1, int(rng.integers(0, k + 3))])
    s["ctl_d"][DONE] = done_flag(rng)


COMMIT_CONFIGS = [(k, m, batch) for k in KS for m in RING_ROUNDS for batch in BATCHES]


def check_ring_commit(engine, spec, k: int, m: int, batch: int, runs: Iterable[tuple[np.random.Generator, str]],
                      live: tuple[int, ...] = ()) -> None:
    """ring_commit against the reference on each of `runs` (from `cases`), every row drawn anew; the
    rows `live` are never done (a done row is left as it is, so it cannot show whether it was served)."""
    rig = Rig(engine, k, m, batch)
    ring_cap = rig.bufs.ring_cap
    launch = spec.prepare_ring_commit(rig.bufs)

    def reference(s):
        ref.spec_ring_commit(s["vtok_d"], s["acc_d"], s["last_pred_d"], s["ctl_d"], s["pend_d"], s["ring_d"],
                             ring_cap, k, batch)

    for rng, where in runs:
        state = rig.random_state(rng)
        for row in rig.rows(state, "vtok_d", "last_pred_d", "acc_d", "ring_d", "ctl_d"):
            commit_inputs(rng, k, ring_cap, row)
        state["ctl_d"].reshape(batch, -1)[list(live), DONE] = 0
        rig.check(launch, state, reference, where)


@pytest.mark.parametrize("k,m,batch", COMMIT_CONFIGS)
def test_ring_commit_matches_reference(engine, spec, k, m, batch):
    check_ring_commit(engine, spec, k, m, batch, cases("ring_commit", (k, m, batch), len(COMMIT_CONFIGS)))


@pytest.mark.parametrize("batch", LARGE_BATCHES)
def test_ring_commit_serves_every_row_of_a_large_batch(engine, spec, batch):
    """The last row is live: it sets its pending token, ring count and done flag, or differs."""
    k, m = 4, 3
    check_ring_commit(engine, spec, k, m, batch, islice(cases("ring_commit", (k, m, batch), 1), LARGE_CASES),
                      live=(batch - 1,))


# -- 5. rollback_stream ----------------------------------------------------------------------

ROLLBACK_CONFIGS = [(n_ptrs, batch) for n_ptrs in (1, 2, 7, 64, 300) for batch in BATCHES]  # 300: two blocks


@pytest.mark.parametrize("n_ptrs,batch", ROLLBACK_CONFIGS)
def test_rollback_matches_reference(engine, spec, n_ptrs, batch):
    """Tables of null entries, i32[B] windows of a target array (repeats allowed) and pos_ctr_d,
    each a PointerTable built per case (so the launch is prepared per case too)."""
    k = 4
    n_targets = n_ptrs + 3
    rig = Rig(engine, k, batch=batch, targets=engine.zeros(np.int32, n_targets * batch))
    windows = [rig.device["targets"].view(i * batch, batch) for i in range(n_targets)]

    for rng, where in cases("rollback_stream", (n_ptrs, batch), len(ROLLBACK_CONFIGS)):
        state = rig.random_state(rng)
        kind = rng.choice(3, n_ptrs, p=[0.25, 0.1, 0.65])  # null, pos_ctr_d, a target window
        index = rng.integers(0, n_targets, n_ptrs)
        entries = [None if c == 0 else rig.bufs.pos_ctr_d if c == 1 else windows[i] for c, i in zip(kind, index)]
        launch = spec.prepare_rollback(rig.bufs, PointerTable(engine, entries))
        for row in rig.rows(state, "pos_start_d", "ctl_d"):
            row["pos_start_d"][0] = position(rng)
            row["ctl_d"][KEEP] = pick(rng, [0, 1, k + 1, int(rng.integers(0, k + 2)), -1, 2**31 - 1, -2**31,
                                            int(rng.integers(-2**31, 2**31))])

        def reference(s, kind=kind, index=index):
            lengths = [None if c == 0 else s["pos_ctr_d"] if c == 1 else s["targets"][i * batch:(i + 1) * batch]
                       for c, i in zip(kind, index)]
            ref.spec_rollback_stream(lengths, s["pos_start_d"], s["ctl_d"], batch)

        rig.check(launch, state, reference, where)


@pytest.mark.parametrize("n_slots", (5, 300, PAST_ONE_GRID))
@pytest.mark.parametrize("pos_start,keep,length", [(100, 3, 103), (-7, 2, -5), (2**31 - 2, 5, -2**31 + 3)])
def test_rollback_touches_exactly_the_nonzero_pointers(engine, spec, n_slots, pos_start, keep, length):
    """Slot j is three i32 words, the middle one its target; every third slot's table entry is
    null. Afterwards the targets of non-null entries hold pos_start + keep (wrapped) and every
    other word, guards and null slots' targets alike, still holds the sentinel."""
    words = engine.alloc(np.int32, 3 * n_slots)
    engine.copy_htod(words, np.full(3 * n_slots, SENTINEL, np.int32))
    target = 3 * np.arange(n_slots) + 1
    live = np.arange(n_slots) % 3 != 2
    table = PointerTable(engine, [words.view(int(t), 1) if alive else None for t, alive in zip(target, live)])
    want_words = np.where(live, np.uint64(words.ptr) + np.uint64(4) * target.astype(np.uint64), np.uint64(0))
    assert np.array_equal(engine.dtoh(table, np.uint64), want_words), "the table holds each view's address, 0 for None"
    bufs = StreamBufs(engine, Geometry(4, 1))
    engine.copy_htod(bufs.pos_start_d, [pos_start])
    engine.copy_htod(bufs.ctl_d, [-1, -1, 0, keep])
    spec.rollback(bufs, table)
    want = np.full(3 * n_slots, SENTINEL, np.int32)
    want[target[live]] = length
    got = engine.dtoh(words)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"n_slots={n_slots} pos_start={pos_start} keep={keep}: words {bad[:8].tolist()} "
                           f"are {got[bad[:8]].tolist()}, expected {want[bad[:8]].tolist()}")


# -- 3 + 4 + 5. round_tail_greedy ------------------------------------------------------------

def tail_inputs(rng: np.random.Generator, k: int, ring_cap: int, s: dict[str, np.ndarray]) -> None:
    """One row of a greedy round's tail: accept_inputs' drafts, predictions, mark, counters and
    done flag; then what the commit reads past them: a ring count at or past every edge (a full
    ring too), an EOS that is often a draft or a prediction (so a stop inside the accepted
    drafts, or at the bonus), budgets 0, 1, 2, small or unlimited; a position at the i32 edges;
    keep garbage (the acceptance writes it before the rollback reads it)."""
    accept_inputs(rng, k, s)
    s["ring_d"][0] = edge_count(rng, ring_cap)
    taken = [int(t) for t in (*s["vtok_d"][1:1 + k], *ref.ids(s["pred_d"])) if t < 2**31]  # ids eos can be
    s["ctl_d"][EOS] = pick(rng, [-1, -1, -7, -2**31, int(rng.integers(0, 2**31)),
                                 *([pick(rng, taken)] * 4 if taken else [])])
    s["ctl_d"][BUDGET] = pick(rng, [0, 0, 1, 2, -1, -1, -7, 2**31 - 1, int(rng.integers(0, k + 3))])
    s["ctl_d"][KEEP] = int(rng.integers(-2**31, 2**31))
    s["pos_start_d"][0] = position(rng)


TAIL_TABLES = (1, 7, 40)  # rollback entries: 40 is past a warp's lanes, which stride over them
TAIL_CONFIGS = [(k, m, width, batch, n_ptrs) for k in KS for m in RING_ROUNDS for width in TOKEN_DTYPES
                for batch in BATCHES for n_ptrs in TAIL_TABLES if m == 1 or n_ptrs == 7]


def check_round_tail_greedy(engine, spec, k: int, m: int, width: int, batch: int, n_ptrs: int,
                            runs: Iterable[tuple[np.random.Generator, str]], live: tuple[int, ...] = ()) -> None:
    """round_tail_greedy against the three launches it replaces (accept_greedy_dc, ring_commit,
    rollback_stream, in that order, from the same state) and against the reference's three
    functions, every buffer compared whole both ways. The table mixes null entries, pos_ctr_d
    and i32[B] windows of a target array (repeats allowed); the rows `live` are never done."""
    n_targets = n_ptrs + 3
    rig = Rig(engine, k, m, batch, pred_d=engine.alloc(TOKEN_DTYPES[width], batch * (k + 1), zeroed=True),
              targets=engine.zeros(np.int32, n_targets * batch))
    ring_cap = rig.bufs.ring_cap
    rng = np.random.default_rng((SEED, zlib.crc32(b"round_tail_greedy table"), k, m, width, batch, n_ptrs))
    kind = rng.choice(3, n_ptrs, p=[0.25, 0.1, 0.65])  # null, pos_ctr_d, a target window
    kind[-1] = 1  # pos_ctr_d last, as kv_len_ptr_table puts it
    index = rng.integers(0, n_targets, n_ptrs)
    windows = [rig.device["targets"].view(i * batch, batch) for i in range(n_targets)]
    table = PointerTable(engine, [None if c == 0 else rig.bufs.pos_ctr_d if c == 1 else windows[i]
                                  for c, i in zip(kind, index)])
    fused = spec.prepare_round_tail_greedy(rig.bufs, rig.device["pred_d"], table)
    assert fused.kernel.name == ("spec_round_tail_greedy" if width == 32 else "spec_round_tail_greedy_t64")
    three = [spec.prepare_accept_greedy(rig.bufs, rig.device["pred_d"]), spec.prepare_ring_commit(rig.bufs),
             spec.prepare_rollback(rig.bufs, table)]

    def reference(s):
        lengths = [None if c == 0 else s["pos_ctr_d"] if c == 1 else s["targets"][i * batch:(i + 1) * batch]
                   for c, i in zip(kind, index)]
        ref.spec_round_tail_greedy(s["vtok_d"], s["pred_d"], k, s["brk_d"], s["acc_d"], s["last_pred_d"], s["ctl_d"],
                                   s["pend_d"], s["ring_d"], ring_cap, lengths, s["pos_start_d"], batch)

    for rng, where in runs:
        state = rig.random_state(rng)
        for row in rig.rows(state, "vtok_d", "pred_d", "brk_d", "acc_d", "ctl_d", "ring_d", "pos_start_d"):
            tail_inputs(rng, k, ring_cap, row)
        state["ctl_d"].reshape(batch, -1)[list(live), DONE] = 0
        for name, buf in rig.device.items():  # the three launches, from the same state
            engine.copy_htod(buf, state[name])
        for launch in three:
            launch()
        separate = {name: engine.dtoh(buf) for name, buf in rig.device.items()}

        def as_separate(s, separate=separate):
            for name, words in separate.items():
                s[name][:] = words
        rig.check(fused, state, as_separate, f"{where}: against the three launches")
        rig.check(fused, state, reference, f"{where}: against the reference")


@pytest.mark.parametrize("k,m,width,batch,n_ptrs", TAIL_CONFIGS)
def test_round_tail_greedy_is_accept_commit_rollback(engine, spec, k, m, width, batch, n_ptrs):
    check_round_tail_greedy(engine, spec, k, m, width, batch, n_ptrs,
                            cases("round_tail_greedy", (k, m, width, batch, n_ptrs), len(TAIL_CONFIGS)))


@pytest.mark.parametrize("batch", LARGE_BATCHES)
@pytest.mark.parametrize("width", list(TOKEN_DTYPES))
def test_round_tail_greedy_serves_every_row_of_a_large_batch(engine, spec, width, batch):
    """More rows than the grid has warps: the last row is live, so a row no warp served differs."""
    k, m = 4, 3
    check_round_tail_greedy(engine, spec, k, m, width, batch, 7,
                            islice(cases("round_tail_greedy", (k, m, width, batch), 1), LARGE_CASES),
                            live=(batch - 1,))


def test_round_tail_greedy_refuses_what_its_three_launches_refuse(engine, spec):
    """Its pred_d is checked as the accept's, its table as the rollback's, when it is prepared."""
    bufs = StreamBufs(engine, Geometry(4, 1, 3))
    table = kv_len_ptr_table(engine, Cache.allocate(engine, (True,), capacity=8, batch=3), bufs.pos_ctr_d)
    with pytest.raises(ValueError, match="pred_d must hold exactly 3 x 5 = 15 elements"):
        spec.prepare_round_tail_greedy(bufs, engine.zeros(np.uint32, 5), table)
    with pytest.raises(ValueError, match="pred_d must be a buffer of 32- or 64-bit integer tokens"):
        spec.prepare_round_tail_greedy(bufs, engine.alloc(np.float32, 15), table)
    with pytest.raises(TypeError, match="a rollback table must be a PointerTable"):
        spec.prepare_round_tail_greedy(bufs, engine.zeros(np.uint32, 15), bufs.pos_ctr_d)
    single = kv_len_ptr_table(engine, Cache.allocate(engine, (True,), capacity=8))
    with pytest.raises(ValueError, match=r"must name i32\[3\] lengths"):
        spec.prepare_round_tail_greedy(bufs, engine.zeros(np.uint32, 15), single)


# -- the ring fills exactly to capacity ------------------------------------------------------

@pytest.mark.parametrize("k", (0, 1, 4))
@pytest.mark.parametrize("m", (1, 3))
def test_ring_fills_to_capacity_and_never_past(engine, spec, k, m):
    """m rounds in which every draft is accepted fill the ring with exactly m*(k+1) tokens, in
    order; two more rounds leave it full (count m*(k+1), tokens unchanged). The ring is a view
    into a larger buffer, so the words around it show that nothing was written past it."""
    bufs = StreamBufs(engine, Geometry(k, m))
    cap = m * (k + 1)
    assert (bufs.ring_cap, bufs.ring_d.len) == (cap, cap + 1), "StreamBufs sizes the ring m*(k+1)+1"
    guarded = engine.alloc(np.uint32, cap + 4)  # [guard, count, cap token slots, guard, guard]
    engine.memset(guarded, SENTINEL)
    allocated_ring = bufs.ring_d  # held: its zeroing memset may still be queued
    bufs.ring_d = guarded.view(1, cap + 1)
    engine.set_u32(bufs.ring_d, 0, 0)
    bufs.set_stop()  # no EOS, no budget
    draft_d, pred_d = engine.zeros(np.uint32, max(k, 1)), engine.zeros(np.uint32, k + 1)
    round_steps = [spec.prepare_assemble_verify(bufs, draft_d), spec.prepare_accept_greedy(bufs, pred_d),
                   spec.prepare_ring_commit(bufs)]
    committed = []
    for r in range(m + 2):
        drafts = [1000 * (r + 1) + i for i in range(1, k + 1)]
        bonus = 1000 * (r + 1) + 999
        if k:
            engine.copy_htod(draft_d, drafts)
        engine.copy_htod(pred_d, drafts + [bonus])  # the target agrees with every draft
        for step in round_steps:
            step()
        committed += drafts + [bonus]
        where = f"k={k} m={m} after round {r + 1}"
        got = engine.dtoh(guarded)
        full = committed[:cap]
        want = [SENTINEL, len(full), *full, *[SENTINEL] * (cap - len(full)), SENTINEL, SENTINEL]
        assert got.tolist() == want, f"{where}: [guard, ring, guard, guard] is {got.tolist()}, expected {want}"
        assert engine.dtoh(bufs.acc_d).tolist() == [k, (r + 1) * k], f"{where}: acc_d"
        assert engine.dtoh(bufs.pend_d).tolist() == [bonus], f"{where}: the bonus becomes the pending token"
        assert engine.dtoh(bufs.ctl_d).tolist() == [-1, -1, 0, k + 1], f"{where}: ctl_d (not done, keep k+1)"
    assert bufs.drain_ring().tolist() == committed[:cap], f"k={k} m={m}: drain_ring"
    allocated_ring.free()


# -- pointer tables --------------------------------------------------------------------------

KV_MASK = (True, False, True, True, False)


@pytest.fixture
def cache(engine):
    """Five layers, two without KV (None)."""
    return Cache.allocate(engine, KV_MASK, capacity=8)


def len_ptrs(cache: Cache, layers: range) -> list[int]:
    return [0 if cache.kv[i] is None else cache.kv[i].len_d.ptr for i in layers]


def test_kv_len_ptr_table_holds_each_length_pointer_then_pos_ctr(engine, cache):
    pos_ctr = engine.zeros(np.int32, 1)
    table = kv_len_ptr_table(engine, cache, pos_ctr)
    assert (table.dtype, table.len) == (np.dtype(np.uint64), 6)
    assert engine.dtoh(table, np.uint64).tolist() == len_ptrs(cache, range(5)) + [pos_ctr.ptr]
    assert [w == 0 for w in engine.dtoh(table, np.uint64).tolist()[:5]] == [not has for has in KV_MASK]


def test_kv_len_ptr_table_without_pos_ctr_has_no_extra_entry(engine, cache):
    table = kv_len_ptr_table(engine, cache)
    assert engine.dtoh(table, np.uint64).tolist() == len_ptrs(cache, range(5))


def test_kv_len_ptr_table_range_takes_only_its_layers(engine, cache):
    pos_ctr = engine.zeros(np.int32, 1)
    assert (engine.dtoh(kv_len_ptr_table_range(engine, cache, range(1, 4), pos_ctr), np.uint64).tolist()
            == len_ptrs(cache, range(1, 4)) + [pos_ctr.ptr])
    assert (engine.dtoh(kv_len_ptr_table_range(engine, cache, (2, 5)), np.uint64).tolist()
            == len_ptrs(cache, range(2, 5)))
    assert (engine.dtoh(kv_len_ptr_table_range(engine, cache, range(0, 5), pos_ctr), np.uint64).tolist()
            == engine.dtoh(kv_len_ptr_table(engine, cache, pos_ctr), np.uint64).tolist())


@pytest.mark.parametrize("layers", [range(0, 6), range(4, 6), (5, 6), range(-1, 2), (3, 2)], ids=str)
def test_kv_len_ptr_table_range_outside_the_cache_is_a_value_error(engine, cache, layers):
    with pytest.raises(ValueError):
        kv_len_ptr_table_range(engine, cache, layers, engine.zeros(np.int32, 1))


def test_rollback_through_cache_tables_sets_every_length_and_pos_ctr(engine, spec, cache):
    """The tables drive a real rollback: whole-cache, then split as two pipeline stages would."""
    bufs = StreamBufs(engine, Geometry(4, 1))
    whole = [kv_len_ptr_table(engine, cache, bufs.pos_ctr_d)]
    stages = [kv_len_ptr_table_range(engine, cache, range(0, 2)),
              kv_len_ptr_table_range(engine, cache, range(2, 5), bufs.pos_ctr_d)]
    for tables, pos_start, keep in [(whole, 17, 3), (stages, 40, 1)]:
        engine.copy_htod(bufs.pos_start_d, [pos_start])
        engine.copy_htod(bufs.ctl_d, [-1, -1, 0, keep])
        for table in tables:
            spec.rollback(bufs, table)
        length = pos_start + keep
        assert cache.lengths(engine) == [length if has else None for has in KV_MASK], f"{len(tables)} table(s)"
        assert engine.dtoh(bufs.pos_ctr_d).tolist() == [length], f"{len(tables)} table(s): pos_ctr_d"

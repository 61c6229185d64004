"""The length chooser (spec_choose_lengths, ptx/spec_stream.cu) on the GPU, against
memra_cuda.testing.reference, with the harness's habits of test_kernels_gpu.py: per case every
buffer of the round-stream state and of DraftLengths is written at random, the kernel launched,
and every buffer read back and compared with the reference run on host copies, so a stray
write shows up as a difference.

Rows mix done flags (garbage among them), keeps of 0 (rows just admitted) and garbage, accept
counts and caps at and past every edge, statistics that are NaN, infinite, negative, zero or of
a perfect draft, marks already set; the costs leave widths out (NaN, 0, negative, infinite).
The statistics and marks must be the reference's word for word (f32 NaNs as NaNs); the width
the reference's, or one whose value is the reference's best to the last bits (the kernel sums
a width's rows in another order), the marks then those of the kernel's width. Widths of one
pass of the chooser and of several (k = 15, 16, 40), batches past its block (513) and the
largest. MEMRA_CASES and MEMRA_SEED as in test_kernels_gpu.py.
"""
from __future__ import annotations

import math
from itertools import islice

import numpy as np
import pytest

from memra_cuda import Geometry
from memra_cuda import StreamBufs
from memra_cuda.buffers import DraftLengths
from memra_cuda.buffers.layout import (ACC_ROUND, BRK_MARK, COST_DRAFT, COST_VERIFY, CTL_DONE,
                                       CTL_KEEP, CTL_WORDS, RATE_WORDS)
from memra_cuda.buffers.lengths import DECAY, PRIOR
from memra_cuda.buffers.geometry import MAX_BATCH
from memra_cuda.kernels import SpecKernels
from memra_cuda.testing import reference as ref
from test_kernels_gpu import LARGE_CASES, cases, done_flag, edge_count, pick, random_words

pytestmark = pytest.mark.gpu

NAN, INF = float("nan"), float("inf")
KS = (0, 1, 4, 15, 16, 40)  # the chooser sums 16 widths a pass: one pass, its edge, three passes
BATCHES = (1, 3, 32, 513)  # 513: past the chooser's one block of 512 threads
# (decay, prior): the defaults, each end of what DraftLengths takes (a decay of 1 and a prior of 0 it
# refuses: the nearest f32s to them), and two others
DECAYS = ((DECAY, PRIOR), (0.0, 1.0), (float(np.nextafter(np.float32(1), np.float32(0))),
                                      float(np.nextafter(np.float32(0), np.float32(1)))), (0.37, 0.123))
CONFIGS = [(k, batch, i) for k in KS for batch in BATCHES for i in range(len(DECAYS))]
LENGTH_BUFFERS = ("rate_d", "cap_d", "cost_d", "width_d")


@pytest.fixture(scope="module")
def spec(engine):
    return SpecKernels(engine)


def statistics(rng: np.random.Generator) -> list[float]:
    """A row's (accepted, rejected): as rounds leave them, a perfect or a hopeless draft's, none, or garbage."""
    return pick(rng, [[float(rng.uniform(0, 50)), float(rng.uniform(0, 20))], [float(rng.uniform(0.1, 9)), 0.0],
                      [0.0, float(rng.uniform(0.1, 9))], [0.0, 0.0], [NAN, 1.0], [INF, 2.0], [1.0, INF],
                      [-3.0, 5.0], [5.0, -3.0], [3e38, 3e38], [float(rng.uniform(0, 1)), float(rng.uniform(0, 1))]])


def costs(rng: np.random.Generator, k: int) -> np.ndarray:
    """cost_d: verifies that grow with the width (flat, too), a draft step; now and then a width
    the costs leave out, or a garbage draft step."""
    cost = np.empty(COST_VERIFY + k + 1, np.float32)
    cost[COST_VERIFY:] = 1 + np.cumsum(rng.uniform(0, pick(rng, [0.0, 0.05, 0.3]), k + 1))
    cost[COST_DRAFT] = pick(rng, [0.0, 0.05, float(rng.uniform(0, 1)), NAN, -0.5, INF])
    for _ in range(int(rng.integers(0, 3))):
        cost[COST_VERIFY + int(rng.integers(0, k + 1))] = pick(rng, [NAN, 0.0, -1.0, INF, -INF])
    return cost


def random_state(rng: np.random.Generator, bufs: StreamBufs, lengths: DraftLengths) -> dict[str, np.ndarray]:
    """Every buffer at random, then the words the chooser reads drawn row by row at their edges."""
    k, batch = bufs.k, bufs.batch
    state = {name: random_words(rng, buf.dtype, buf.len) for name, buf in bufs.buffers().items()}
    ctl, acc, brk = (state[name].reshape(batch, -1) for name in ("ctl_d", "acc_d", "brk_d"))
    rate = np.array([statistics(rng) for _ in range(batch)], np.float32)
    cap = np.array([pick(rng, [0, 1, k, k + 1, int(rng.integers(0, k + 2)), 2**32 - 1]) for _ in range(batch)],
                   np.uint32)
    for b in range(batch):
        ctl[b, CTL_DONE] = done_flag(rng)
        ctl[b, CTL_KEEP] = pick(rng, [0, 0, 1, k + 1, int(rng.integers(1, k + 2)), -1, 2**31 - 1])
        acc[b, ACC_ROUND] = edge_count(rng, k + 1)
        brk[b, BRK_MARK] = 0 if rng.random() < 0.6 else edge_count(rng, k + 1)
    state.update(rate_d=rate.reshape(-1), cap_d=cap, cost_d=costs(rng, k),
                 width_d=np.array([edge_count(rng, k)], np.uint32))
    assert set(state) - set(bufs.buffers()) == set(LENGTH_BUFFERS)
    return state


def same_words(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal word for word; f32 words where both are NaN count as equal (a NaN's payload may differ)."""
    if got.dtype.kind != "f":
        return np.array_equal(got, want)
    return bool(np.all((got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))))


def width_values(state: dict[str, np.ndarray], k: int, batch: int) -> np.ndarray:
    """The reference's value of each width, over the live rows of `state` (after the chooser)."""
    live = np.flatnonzero(state["ctl_d"].reshape(batch, CTL_WORDS)[:, CTL_DONE] == 0)
    rates = state["rate_d"].reshape(batch, RATE_WORDS)[live]
    return ref.width_values(ref.length_estimates(rates), state["cap_d"][live], state["cost_d"], k)


def check(engine, launch, bufs: StreamBufs, lengths: DraftLengths, state: dict[str, np.ndarray], decay: float,
          prior: float, where: str) -> None:
    k, batch = bufs.k, bufs.batch
    device = {**bufs.buffers(), **{name: getattr(lengths, name) for name in LENGTH_BUFFERS}}
    for name, buf in device.items():
        engine.copy_htod(buf, state[name])
    launch()
    got = {name: engine.dtoh(buf) for name, buf in device.items()}
    want = {name: words.copy() for name, words in state.items()}
    ref.spec_choose_lengths(want["ctl_d"], want["acc_d"], want["brk_d"], want["rate_d"], want["cap_d"],
                            want["cost_d"], want["width_d"], k, decay, prior, batch)
    width, best = int(got["width_d"][0]), int(want["width_d"][0])
    if width != best:  # the rows of a width summed in another order: it must be the best to the last bits
        values = width_values(want, k, batch)
        assert width <= k and math.isclose(values[width], values[best], rel_tol=1e-12), \
            f"{where}: width {width}, the reference's {best}: values {values.tolist()}"
        want["width_d"][0], want["brk_d"] = width, state["brk_d"].copy()
        ref.mark_lengths(want["ctl_d"], want["brk_d"], want["cap_d"], width, k, batch)
    wrong = [name for name in device if not same_words(got[name], want[name])]
    assert not wrong, "\n".join(f"{where}: {name} is {got[name][:16].tolist()}..., the reference says "
                                f"{want[name][:16].tolist()}..." for name in wrong)


@pytest.mark.parametrize("k,batch,decays", CONFIGS)
def test_choose_lengths_matches_reference(engine, spec, k, batch, decays):
    decay, prior = DECAYS[decays]
    bufs = StreamBufs(engine, Geometry(k, 1, batch))
    lengths = DraftLengths(bufs, [1.0] * (k + 1), 0.0, decay, prior)
    launch = spec.prepare_choose_lengths(bufs, lengths)
    for rng, where in cases("choose_lengths", (k, batch, decays), len(CONFIGS)):
        check(engine, launch, bufs, lengths, random_state(rng, bufs, lengths), decay, prior, where)


@pytest.mark.parametrize("k", (4, 40))
def test_choose_lengths_over_the_largest_batch(engine, spec, k):
    bufs = StreamBufs(engine, Geometry(k, 1, MAX_BATCH))
    lengths = DraftLengths(bufs, [1.0] * (k + 1), 0.0)
    launch = spec.prepare_choose_lengths(bufs, lengths)
    for rng, where in islice(cases("choose_lengths_large", (k,), 1), LARGE_CASES):
        check(engine, launch, bufs, lengths, random_state(rng, bufs, lengths), DECAY, PRIOR, where)


def test_the_host_writes_caps_and_costs_where_the_chooser_reads_them(engine):
    bufs = StreamBufs(engine, Geometry(3, 1, 4))
    lengths = DraftLengths(bufs, [1.0, 1.5, 2.0, 2.5], 0.25)
    assert engine.dtoh(lengths.cap_d).tolist() == [3, 3, 3, 3], "every row starts at the full width"
    assert engine.dtoh(lengths.rate_d).tolist() == [PRIOR, 1 - PRIOR] * 4, "every row starts at the prior"
    cost = engine.dtoh(lengths.cost_d)
    assert cost[COST_DRAFT] == 0.25 and cost[COST_VERIFY:].tolist() == [1.0, 1.5, 2.0, 2.5]
    lengths.set_caps([0, 1, 2, 3])
    lengths.set_cap_row(2, 0)
    lengths.set_costs([1.0, 1.25, 1.5, 1.75], 0.5)
    assert engine.dtoh(lengths.cap_d).tolist() == [0, 1, 0, 3]
    assert engine.dtoh(lengths.cost_d).tolist() == [0.5, 1.0, 1.25, 1.5, 1.75]


def test_the_launcher_takes_only_the_lengths_of_its_buffers(engine, spec):
    bufs, other = StreamBufs(engine, Geometry(2, 1, 3)), StreamBufs(engine, Geometry(2, 1, 3))
    with pytest.raises(ValueError, match="were made for other round-stream buffers"):
        spec.prepare_choose_lengths(bufs, DraftLengths(other, [1.0] * 3, 0.0))
    with pytest.raises(TypeError, match="a DraftLengths, not"):
        spec.prepare_choose_lengths(bufs, bufs)

"""spec_draft_sample (ptx/spec_sample.cu, contract 7) on the GPU, against memra_cuda.testing.reference.

Random draft laws (test_sample_gpu.laws: peaked, flat, cut, all zero, sprinkled with NaN,
negative and infinite entries), positions at the i32 limits and any 64-bit seed, in both token
widths: the kernel must write the reference's token into draft[b][step] and nothing else, or a
near tie (float64 race score within 1e-5 relative of the best: the kernel races in f32). Then a
captured launch replayed on new state (the scratch it leaves zero), the draw's law over many
seeds, and the launcher's refusals.
"""
from __future__ import annotations

import numpy as np
import pytest

from memra_cuda import Geometry
from memra_cuda import Graph, StreamBufs
from memra_cuda.kernels import SpecKernels
from memra_cuda.testing import reference as ref
from laws import assert_distributed_as
from test_sample_gpu import CASES, NEAR_TIE, cases, laws

pytestmark = pytest.mark.gpu

CONFIGS = [(B, V, k) for B in (1, 3, 32) for V in (1, 7, 3000) for k in (1, 4)] + [(2, 152_000, 4)]
WIDTHS = {"u32": np.uint32, "i64": np.int64}


@pytest.fixture(scope="module")
def spec(engine):
    return SpecKernels(engine)


class Rig:
    """q_d, seed_d and draft_d of B rows beside StreamBufs (for pos_ctr_d), and one prepared
    launch per draft step."""

    def __init__(self, engine, spec, rows: int, vocab: int, k: int, width=np.uint32):
        self.engine, self.rows, self.vocab, self.k = engine, rows, vocab, k
        self.bufs = StreamBufs(engine, Geometry(k, 1, rows))
        self.q_d = engine.alloc(np.float32, rows * k * vocab)
        self.seed_d = engine.alloc(np.uint64, rows)
        self.draft_d = engine.alloc(width, rows * k)
        self.steps = [spec.prepare_draft_sample(self.bufs, self.q_d, self.seed_d, self.draft_d, step, vocab)
                      for step in range(k)]

    def state(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        B, V, k = self.rows, self.vocab, self.k
        edges = np.array([0, 1, 2**31 - 2, -1, -2**31, 4093], np.int32)
        return dict(q=laws(rng, (B, k, V)).reshape(-1),
                    pos=np.where(rng.random(B) < 0.5, edges[rng.integers(0, 6, B)],
                                 rng.integers(0, 2**20, B)).astype(np.int32),
                    seed=rng.integers(0, 2**64, B, dtype=np.uint64),
                    draft=rng.integers(0, 2**31, B * k).astype(self.draft_d.dtype))

    def run(self, state: dict[str, np.ndarray], step: int, where: str, launch=None) -> None:
        engine = self.engine
        engine.copy_htod(self.q_d, state["q"])
        engine.copy_htod(self.bufs.pos_ctr_d, state["pos"])
        engine.copy_htod(self.seed_d, state["seed"])
        engine.copy_htod(self.draft_d, state["draft"])
        (launch or self.steps[step])()
        got = engine.dtoh(self.draft_d).astype(np.int64)
        want = state["draft"].astype(np.int64)
        ref.spec_draft_sample(step, self.k, self.vocab, state["q"], state["pos"], state["seed"], want, self.rows)
        other = np.arange(got.size) % self.k != step
        assert (got[other] == want[other]).all(), f"{where}: a word other than draft[b][{step}] changed"
        for i in np.flatnonzero(got != want):
            b = i // self.k
            w = ref.probabilities(state["q"].reshape(self.rows, self.k, self.vocab)[b, step])
            scores = ref.race_scores(w, state["seed"][b], int(state["pos"][b]) + step + 1, ref.PURPOSE_DRAFT)
            token, expected = int(got[i]), int(want[i])
            # No weight (every score -inf: the token is 0) and infinite weights (ties to the
            # smallest id) leave no near tie: only the reference's token is right there.
            assert np.isfinite(scores[expected]), f"{where}, row {b}: drew {token}, the reference {expected}"
            assert token < self.vocab and scores[token] >= scores[expected] * (1 - NEAR_TIE), (
                f"{where}, row {b}: drew {token}, the reference {expected}")


@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("B,V,k", CONFIGS)
def test_draft_sample_matches_reference(engine, spec, B, V, k, width):
    rig = Rig(engine, spec, B, V, k, WIDTHS[width])
    for rng, where in cases(f"draft_sample {width}", (B, V, k), max(2, CASES // 20 // len(CONFIGS))):
        for step in range(k):
            rig.run(rig.state(rng), step, f"{where} step {step}")


def test_captured_launch_replays_on_the_scratch_it_left_zeroed(engine, spec):
    rig = Rig(engine, spec, 3, 152_000, 2)
    graph = Graph(engine, rig.steps[1])
    for rng, where in cases("draft_sample graph", (3, 152_000, 2), 4):
        rig.run(rig.state(rng), 1, where, launch=graph.launch)


def test_the_draw_is_distributed_as_the_drafts_law(engine, spec):
    """20 000 rows of one law, each its own seed: the drawn ids' histogram is the law."""
    rows = 20_000
    law = np.array([0.3, 0.25, 0.2, 0.15, 0.1], np.float32)
    rig = Rig(engine, spec, rows, law.size, 1)
    engine.copy_htod(rig.q_d, np.tile(law, rows))
    engine.copy_htod(rig.bufs.pos_ctr_d, np.full(rows, 17, np.int32))
    engine.copy_htod(rig.seed_d, np.arange(rows, dtype=np.uint64) * 0x9E3779B97F4A7C15)
    rig.steps[0]()
    assert_distributed_as(engine.dtoh(rig.draft_d).astype(np.int64), law.astype(np.float64), "the draft's draw")


@pytest.mark.parametrize("what,change,match", [
    ("step past the chain", dict(step=2), "step"),
    ("negative step", dict(step=-1), "step"),
    ("q_d one row short", dict(q=(np.float32, 3 * 2 * 7 - 7)), "q_d"),
    ("q_d as f64", dict(q=(np.float64, 3 * 2 * 7)), "q_d"),
    ("seed_d as u32", dict(seed=(np.uint32, 3)), "seed_d"),
    ("draft_d as f32", dict(draft=(np.float32, 6)), "draft_d"),
    ("draft_d one short", dict(draft=(np.uint32, 5)), "draft_d"),
    ("vocab 0", dict(vocab=0), "vocab"),
])
def test_bad_input_is_refused_before_anything_is_queued(engine, spec, monkeypatch, what, change, match):
    bufs = StreamBufs(engine, Geometry(2, 1, 3))
    given = {"q": (np.float32, 3 * 2 * 7), "seed": (np.uint64, 3), "draft": (np.uint32, 6), "step": 1, "vocab": 7,
             **change}
    q, seed, draft = (engine.alloc(*given[name]) for name in ("q", "seed", "draft"))

    def forbidden(*_args, **_kwargs):
        raise AssertionError("the launcher queued work before refusing its input")

    for method in ("alloc", "memset", "load_ptx"):
        monkeypatch.setattr(engine, method, forbidden)
    with pytest.raises(ValueError, match=match):
        spec.prepare_draft_sample(bufs, q, seed, draft, given["step"], given["vocab"])

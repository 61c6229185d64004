"""The toy split into two pipeline stages on two GPUs (memra_cuda.testing.toy.pipeline): its
tokens equal the one-GPU model's and the target's greedy output, burst by burst, and after every
burst each stage's KV lengths equal the one-GPU lengths of the same layers. Skipped, with the
reason, on a machine with fewer than two GPUs."""
from __future__ import annotations

import pytest

from memra_cuda import Geometry
from memra_cuda import Engine, StreamBufs, kv_capacity
from memra_cuda.driver.errors import driver
from memra_cuda.testing.toy import lm as toy
from memra_cuda.testing.toy.pipeline import ToyPipeline

pytestmark = pytest.mark.gpu

# No-KV layers on both sides of every split below.
MODEL = toy.ToyModel(seed=77, vocab=40, kv_mask=(True, False, True, False, True, True), noise_ppm=200_000,
                     p_min=0.1)


@pytest.fixture(scope="module")
def engines(engine):
    count = driver().cuDeviceGetCount()[1]
    if count < 2:
        pytest.skip(f"needs two GPUs: this machine has {count}")
    second = Engine(1)
    yield engine, second
    second.close()


def one_gpu(engine, k, m_rounds, capacity, batch):
    lm = toy.ToyLM(engine, MODEL, capacity, batch=batch)
    bufs = StreamBufs(engine, Geometry(k, m_rounds, batch))
    return lm, bufs, lm.round_stream(bufs)


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("split", [1, 3, 5])
@pytest.mark.parametrize("k,m_rounds", [(0, 1), (4, 1), (0, 16), (4, 16)])
def test_two_stages_equal_one_gpu_burst_by_burst(engines, mode, split, k, m_rounds):
    """Two rows, one stopped by EOS and one by its budget; after every burst, the tokens, the
    position and every KV length (the draft's, each stage's layers) equal the one-GPU run's."""
    e0, e1 = engines
    prompts, budgets = [[3, 1, 4, 1, 5], [9, 2]], [70, 45]
    full = toy.target_greedy(MODEL, prompts[0], budgets[0])
    eos = [full[len(full) // 2], None]
    capacity = kv_capacity(5, max(budgets), Geometry(k, m_rounds, 2))
    lm, bufs, single = one_gpu(e0, k, m_rounds, capacity, batch=2)
    pipe = ToyPipeline(engines, MODEL, capacity, split, Geometry(k, m_rounds, 2))
    piped = pipe.round_stream()
    for row, prompt in enumerate(prompts):
        assert pipe.prefill_row(row, prompt) == lm.prefill_row(bufs, row, prompt)
    bufs.set_stop(eos, budgets)
    pipe.bufs[1].set_stop(eos, budgets)
    got = {"one": [[], []], "two": [[], []]}
    while not (bufs.done.all() and pipe.bufs[1].done.all()):
        one, two = single.step(mode), piped.step(mode)
        for row in range(2):
            got["one"][row] += one.tokens[row].tolist()
            got["two"][row] += two.tokens[row].tolist()
            where = f"split {split}, k={k}, M={m_rounds}, {mode}, row {row}, burst {piped.bursts}"
            assert two.tokens[row].tolist() == one.tokens[row].tolist(), where
            assert two.positions[row] == one.positions[row] and two.done[row] == one.done[row], where
            stage0, stage1 = pipe.stages
            assert (stage0.draft.lengths(e0, row) + stage0.target.lengths(e0, row) + stage1.target.lengths(e1, row)
                    == lm.draft.lengths(e0, row) + lm.target.lengths(e0, row)), where
    for row, (prompt, budget) in enumerate(zip(prompts, budgets)):
        assert got["two"][row] == got["one"][row] == toy.target_greedy(MODEL, prompt, budget, eos[row])


def test_generate_batch_through_the_pipeline(engines):
    """The plain driver entry (generate_batch, graph mode) on the pipeline, three rows."""
    prompts = [[1], [2, 3, 4], [5] * 20]
    capacity = kv_capacity(20, 100, Geometry(4, 16, 3))
    pipe = ToyPipeline(engines, MODEL, capacity, 2, Geometry(4, 16, 3))
    stream = pipe.round_stream()
    for row, prompt in enumerate(prompts):
        pipe.prefill_row(row, prompt)
    out = stream.generate_batch([100, 60, 80], mode="graph")
    for row, (prompt, budget) in enumerate(zip(prompts, [100, 60, 80])):
        assert out[row].tolist() == toy.target_greedy(MODEL, prompt, budget), f"row {row}"


def test_a_pipeline_needs_two_stages_with_layers(engines):
    with pytest.raises(ValueError, match="split"):
        ToyPipeline(engines, MODEL, 64, 0, Geometry(4, 4))
    with pytest.raises(ValueError, match="split"):
        ToyPipeline(engines, MODEL, 64, len(MODEL.kv_mask), Geometry(4, 4))
    with pytest.raises(ValueError, match="two stages"):
        ToyPipeline(engines[:1], MODEL, 64, 2, Geometry(4, 4))

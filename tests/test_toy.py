"""The toy model's numpy half: the speculative loop built on reference.py reproduces the
target's own greedy decoding, whatever the model, prompt, k, noise, p_min, mask and stop rule."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from memra_cuda.models import toy, toy_reference

models = st.builds(
    toy.ToyModel,
    seed=st.integers(0, 2**32 - 1),
    vocab=st.sampled_from([1, 2, 3, 17, 32000, 2**31 - 1]),  # EOS ids are i32 on the device
    kv_mask=st.lists(st.booleans(), min_size=1, max_size=6).map(tuple),
    noise_ppm=st.sampled_from([0, 1000, 100_000, 500_000, 1_000_000]),
    p_min=st.sampled_from([0.0, 0.05, 0.3, 0.999, 1.0]),
)


@settings(max_examples=300, deadline=None)
@given(model=models, data=st.data(), k=st.integers(0, 8), m_rounds=st.integers(1, 6),
       max_new=st.integers(0, 80))
def test_numpy_speculative_loop_equals_target_greedy(model, data, k, m_rounds, max_new):
    prompt = data.draw(st.lists(st.integers(0, model.vocab - 1), min_size=1, max_size=24), label="prompt")
    want = toy.target_greedy(model, prompt, max_new)
    eos = data.draw(st.one_of(st.none(), st.sampled_from(want or [0]), st.integers(0, model.vocab - 1)), label="eos")
    want = toy.target_greedy(model, prompt, max_new, eos)
    assert toy_reference.speculative_generate(model, prompt, k, max_new, eos, m_rounds) == want


def test_every_kv_entry_matters():
    """A single changed history entry changes the prediction: the property that makes a wrong
    rollback or position visible in the output."""
    model = toy.ToyModel(vocab=2**32 - 1)
    base = model.predict(history=12345, token=7, pos=10)
    assert all(model.predict(12345 ^ (1 << bit), 7, 10) != base for bit in range(32))
    assert model.predict(12345, 7, 11) != base


def test_perfect_draft_accepts_everything():
    stream = toy_reference.NumpyRoundStream(toy.ToyModel(noise_ppm=0, p_min=0.0), k=4, m_rounds=2, capacity=256)
    out = stream.generate([1, 2, 3], max_new_tokens=40)
    rounds = 40 // 5
    assert len(out) == 40 and int(stream.acc[1]) == 4 * rounds and int(stream.brk[1]) == 0


def test_break_threshold_agrees_with_float_comparison():
    for p_min in [0.0, 0.001, 0.3, 0.5, 0.7, 0.999, 1.0, 2.0]:
        below = toy.ToyModel(p_min=p_min).break_below
        assert all((q < below) == (q / 1000 < p_min) for q in range(1000))


def test_fmix_matches_the_scalar_definition():
    values = np.array([0, 1, 0xDEADBEEF, 2**32 - 1], np.uint32)
    assert [int(v) for v in toy.fmix_array(values)] == [toy.fmix(int(v)) for v in values]
    assert toy.fmix(0) == 0

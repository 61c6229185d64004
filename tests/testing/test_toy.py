"""The toy model's numpy half: the speculative loop built on testing.reference reproduces the
target's own greedy decoding, whatever the model, prompt, k, noise, p_min, layers (KV,
recurrent, plain), state rollback and stop rule; and a wrong state rollback shows, in the
tokens (the target's) or in the rounds (the draft's)."""
from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memra_cuda.testing.toy import lm as toy, numpy_loop

KINDS = ("kv", "recurrent", "plain")
models = st.lists(st.sampled_from(KINDS), min_size=1, max_size=6).flatmap(lambda kinds: st.builds(
    toy.ToyModel,
    seed=st.integers(0, 2**32 - 1),
    vocab=st.sampled_from([1, 2, 3, 17, 32000, 2**31 - 1]),  # EOS ids are i32 on the device
    kv_mask=st.just(tuple(kind == "kv" for kind in kinds)),
    rec_mask=st.sampled_from([(), tuple(kind == "recurrent" for kind in kinds)]),
    state_words=st.integers(1, 6),
    noise_ppm=st.sampled_from([0, 1000, 100_000, 500_000, 1_000_000]),
    p_min=st.sampled_from([0.0, 0.05, 0.3, 0.999, 1.0]),
))

# A hybrid model: KV, recurrent and KV layers in turn (test_toy_state_gpu.py runs it on the GPU).
HYBRID = toy.ToyModel(seed=41, vocab=50, kv_mask=(True, False, True, False, True),
                      rec_mask=(False, True, False, True, False), noise_ppm=100_000, p_min=0.1)
PROMPTS = ([7], [3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2])


@settings(max_examples=300, deadline=None)
@given(model=models, data=st.data(), k=st.integers(0, 8), m_rounds=st.integers(1, 6),
       max_new=st.integers(0, 80), strategy=st.sampled_from(toy.STATE_ROLLBACKS))
def test_numpy_speculative_loop_equals_target_greedy(model, data, k, m_rounds, max_new, strategy):
    prompt = data.draw(st.lists(st.integers(0, model.vocab - 1), min_size=1, max_size=24), label="prompt")
    want = toy.target_greedy(model, prompt, max_new)
    eos = data.draw(st.one_of(st.none(), st.sampled_from(want or [0]), st.integers(0, model.vocab - 1)), label="eos")
    want = toy.target_greedy(model, prompt, max_new, eos)
    assert numpy_loop.speculative_generate(model, prompt, k, max_new, eos, m_rounds, strategy) == want


def test_every_kv_entry_matters():
    """A single changed history entry changes the prediction: the property that makes a wrong
    rollback or position visible in the output."""
    model = toy.ToyModel(vocab=2**32 - 1)
    base = model.predict(history=12345, token=7, pos=10)
    assert all(model.predict(12345 ^ (1 << bit), 7, 10) != base for bit in range(32))
    assert model.predict(12345, 7, 11) != base


def test_perfect_draft_accepts_everything():
    stream = numpy_loop.NumpyRoundStream(toy.ToyModel(noise_ppm=0, p_min=0.0), k=4, m_rounds=2, capacity=256)
    out = stream.generate([1, 2, 3], max_new_tokens=40)
    rounds = 40 // 5
    assert len(out) == 40 and int(stream.acc[1]) == 4 * rounds and int(stream.brk[1]) == 0


def test_break_threshold_agrees_with_float_comparison():
    for p_min in [0, 0.0, 0.001, 0.3, 0.5, 0.7, 0.999, 1.0]:
        below = toy.ToyModel(p_min=p_min).break_below
        assert all((q < below) == (q / 1000 < p_min) for q in range(1000))


def test_fmix_matches_the_scalar_definition():
    values = np.array([0, 1, 0xDEADBEEF, 2**32 - 1], np.uint32)
    assert [int(v) for v in toy.fmix_array(values)] == [toy.fmix(int(v)) for v in values]
    assert toy.fmix(0) == 0


def hybrid(noise_ppm: int, **fields) -> toy.ToyModel:
    return replace(HYBRID, noise_ppm=noise_ppm, **fields)


def generated(stream: numpy_loop.NumpyRoundStream, prompt: list[int], max_new: int,
              eos: int | None = None) -> tuple[list[int], list[int]]:
    """The stream's tokens, and every token at a position it kept (the target's greedy tokens
    past the stop too: a stop inside the accepted drafts keeps the drafts after it)."""
    out = stream.generate(prompt, max_new, eos)
    return out, (prompt + toy.target_greedy(stream.model, prompt, max_new + stream.k + 1))[:int(stream.pos_ctr[0])]


@pytest.mark.parametrize("strategy", toy.STATE_ROLLBACKS)
@pytest.mark.parametrize("k", [0, 1, 4])
@pytest.mark.parametrize("noise_ppm", [0, 100_000, 1_000_000])
def test_recurrent_layers_roll_back_to_the_kept_tokens(strategy, k, noise_ppm):
    """Every draft accepted, some, or none; a budget and an EOS: the tokens are the target's,
    and both models' live states are the recurrence over exactly the tokens the round kept."""
    model = hybrid(noise_ppm)
    for prompt in PROMPTS:
        full = toy.target_greedy(model, prompt, 60)
        for eos in (None, full[len(full) // 2]):
            stream = numpy_loop.NumpyRoundStream(model, k, 3, capacity=256, state_rollback=strategy)
            out, kept = generated(stream, prompt, 60, eos)
            assert out == toy.target_greedy(model, prompt, 60, eos), f"prompt {prompt}, eos {eos}"
            want = model.rec_states(kept)
            assert (stream.tgt_states.live() == want).all() and (stream.draft_states.live() == want).all()


def test_recurrent_layers_change_the_tokens():
    """The same layers with and without recurrent state decode differently, and so does every
    change of one state word: the property that makes a wrong state rollback visible."""
    plain = hybrid(0, rec_mask=())
    for prompt in PROMPTS:
        assert toy.target_greedy(HYBRID, prompt, 30) != toy.target_greedy(plain, prompt, 30)
    model = hybrid(0, vocab=2**32 - 1, state_words=3)
    states = model.recur(model.rec_states([5, 6, 7]), 8, 3)
    base = model.predict(12345, 8, 3, states)
    for layer in range(2):
        for word in range(3):
            for bit in (0, 17, 31):
                changed = states.copy()
                changed[layer, word] ^= np.uint32(1 << bit)
                assert model.predict(12345, 8, 3, changed) != base


def test_the_recurrence_depends_on_order():
    """Two tokens swapped (at their own positions) give another state: the state is no sum."""
    model = hybrid(0)
    assert (model.rec_states([1, 2, 3]) != model.rec_states([1, 3, 2])).any()
    assert (model.recur(model.recur(model.rec_states([]), 1, 0), 2, 0) !=
            model.recur(model.recur(model.rec_states([]), 2, 0), 1, 0)).any()


class NoStateRollback(numpy_loop.NumpyRoundStream):
    def roll_back_states(self) -> None:
        pass


class NoDraftStateRollback(numpy_loop.NumpyRoundStream):
    def roll_back_states(self) -> None:
        self.tgt_states.roll_back(self.ctl)


@pytest.mark.parametrize("strategy", toy.STATE_ROLLBACKS)
@pytest.mark.parametrize("k", [0, 4])
def test_a_skipped_state_rollback_changes_the_tokens(strategy, k):
    """Proof that the tests above can fail: without its state rollback the target's tokens go wrong."""
    model = hybrid(100_000)
    for prompt in PROMPTS:
        out = NoStateRollback(model, k, 3, capacity=256, state_rollback=strategy).generate(prompt, 40)
        assert out != toy.target_greedy(model, prompt, 40), f"prompt {prompt}"


@pytest.mark.parametrize("strategy", toy.STATE_ROLLBACKS)
def test_a_skipped_draft_state_rollback_costs_rounds(strategy):
    """The draft's states are in play: without their rollback the tokens stay the target's, but
    the draft, reading stale states, is rarely right, so the same request takes more rounds."""
    model, k = hybrid(0, p_min=0.0), 4
    for prompt in PROMPTS:
        right = numpy_loop.NumpyRoundStream(model, k, 1, capacity=256, state_rollback=strategy)
        stale = NoDraftStateRollback(model, k, 1, capacity=256, state_rollback=strategy)
        want = toy.target_greedy(model, prompt, 60)
        assert right.generate(prompt, 60) == stale.generate(prompt, 60) == want
        assert right.rounds == 60 // (k + 1), "a perfect draft: every draft accepted"
        assert stale.rounds > 2 * right.rounds, f"prompt {prompt}: {stale.rounds} rounds"


def test_the_hashes_take_ints_naming_what_is_none():
    """ToyModel's hashes took a float token, position or sum into fmix, to meet "unsupported
    operand type(s) for &" there, naming nothing (rec_states of a model without recurrent layers
    took it silently), and True was hashed as 1. Each is refused naming it (as_index); numpy's
    ints hash as Python's, as before."""
    plain = toy.ToyModel()
    states = HYBRID.rec_states([])
    uses = {"token": (lambda v: plain.embed(v, 3), lambda v: plain.kv_entries(v, 3), lambda v: plain.predict(0, v, 3),
                      lambda v: plain.history([1, v]), lambda v: plain.rec_states([v]),
                      lambda v: HYBRID.recur(states, v, 0)),
            "pos": (lambda v: plain.embed(1, v), lambda v: plain.draft_noisy(v), lambda v: plain.draft_breaks(v),
                    lambda v: plain.tree_candidates(5, v, 4), lambda v: plain.recur(np.zeros((0, 4), np.uint32), 1, v)),
            "history": (lambda v: plain.state(v, 1, 3),), "state": (lambda v: plain.candidates(v),),
            "total": (lambda v: plain.tree_candidates(v, 3, 4),)}
    for name, calls in uses.items():
        for call in calls:
            for bad in (1.0, 2.5, np.float32(3), True, np.True_, "7", None):
                with pytest.raises(TypeError, match=f"^{name} must be an integer, not {re.escape(repr(bad))}$"):
                    call(bad)
            assert str(call(np.uint32(7))) == str(call(np.int64(7))) == str(call(7)), name
    with pytest.raises(TypeError, match="^the toy's tree draft's candidates a node must be an integer, not 4.0$"):
        plain.tree_candidates(5, 3, 4.0)


def test_models_refuse_ill_formed_recurrent_layers():
    with pytest.raises(ValueError, match="rec_mask must be empty or name each of the 2 layers"):
        toy.ToyModel(kv_mask=(True, False), rec_mask=(True,))
    with pytest.raises(ValueError, match="layer 1 cannot keep both"):
        toy.ToyModel(kv_mask=(False, True), rec_mask=(True, True))
    for words in (0, toy.BLOCK + 1):
        with pytest.raises(ValueError, match="state_words"):
            toy.ToyModel(kv_mask=(False,), rec_mask=(True,), state_words=words)
    with pytest.raises(ValueError, match="state_rollback must be one of"):
        numpy_loop.NumpyRoundStream(HYBRID, 2, 1, 64, state_rollback="swap")
    with pytest.raises(ValueError, match="needs their states"):  # else predict() would leave them out
        HYBRID.predict(0, 1, 0)


def test_the_toys_numbers_are_checked_plain_ints():
    """A float seed met a TypeError deep in the hash, np.uint32(7) an OverflowError there (numpy's
    u32 arithmetic), a uint16 vocab likewise, and True was seed 1: each refused naming it, or kept
    as the plain int it is."""
    model = toy.ToyModel(seed=np.uint32(7), vocab=np.uint16(300), noise_ppm=np.int64(5), tree_spread=np.uint8(2))
    assert model == toy.ToyModel(seed=7, vocab=300, noise_ppm=5, tree_spread=2)
    assert all(type(getattr(model, name)) is int for name in ("seed", "vocab", "noise_ppm", "tree_spread"))
    assert toy.target_greedy(model, [1, 2, 3], 5) == toy.target_greedy(toy.ToyModel(seed=7, vocab=300), [1, 2, 3], 5)
    for field, bad, error, named in (("seed", 7.0, TypeError, "seed must be an integer, not 7.0"),
                                     ("seed", True, TypeError, "seed must be an integer, not True"),
                                     ("seed", 2**32, ValueError, "seed must be an int from 0 to 4294967295"),
                                     ("vocab", 0, ValueError, "vocab must be an int from 1"),
                                     ("noise_ppm", 0.5, TypeError, "noise_ppm must be an integer"),
                                     ("noise_ppm", 10**6 + 1, ValueError, "noise_ppm must be an int from 0 to 1000000"),
                                     ("tree_spread", 0, ValueError, "tree_spread must be an int from 1")):
        with pytest.raises(error, match=named):
            toy.ToyModel(**{field: bad})


def test_the_masks_are_tuples_of_bools_each_checked_naming_its_layer():
    """A mask's entries were read by their truth ("False" a KV layer; 0.5, None and "abc" taken
    too), and a list was kept as given, so hash(ToyModel(kv_mask=[True])) raised "unhashable"."""
    model = toy.ToyModel(kv_mask=[True, np.True_], rec_mask=np.array([False, False]))
    assert model.kv_mask == (True, True) and model.rec_mask == (False, False)
    assert all(type(flag) is bool for flag in (*model.kv_mask, *model.rec_mask))
    assert model == toy.ToyModel(kv_mask=(True, True), rec_mask=(False, False)) and hash(model) == hash(
        toy.ToyModel(kv_mask=(True, True), rec_mask=(False, False)))
    for kv_mask, rec_mask, named in (((True, "False"), (), "kv_mask\\[1\\] must be True or False, not 'False'"),
                                     ((0.5,), (), "kv_mask\\[0\\] must be True or False, not 0.5"),
                                     ((True, 1), (), "kv_mask\\[1\\] must be True or False, not 1"),
                                     ((False, False), (None, True), "rec_mask\\[0\\] must be True or False, not None"),
                                     ((False,), ("abc",), "rec_mask\\[0\\] must be True or False, not 'abc'"),
                                     ("ab", (), "kv_mask must be a list, a tuple or a 1-D array of bools"),
                                     (True, (), "kv_mask must be a list, a tuple or a 1-D array of bools")):
        with pytest.raises(TypeError, match=named):
            toy.ToyModel(kv_mask=kv_mask, rec_mask=rec_mask)


def test_the_numpy_streams_sizes_are_kept_as_plain_ints():
    """NumpyRoundStream computed its ring from the k and M it was given, before Geometry checked
    them: numpy ints' arithmetic wraps, so M a uint8 200 made a ring of 232 tokens (200 x 5 is
    1000), and a burst's tokens past them were dropped: 232 of 900 tokens, and no error."""
    model = toy.ToyModel(noise_ppm=0)
    stream = numpy_loop.NumpyRoundStream(model, np.uint8(4), np.uint8(200), np.uint16(4000))
    assert (stream.k, stream.m, stream.capacity, stream.ring_cap) == (4, 200, 4000, 1000)
    assert stream.generate([1, 2, 3], 900) == toy.target_greedy(model, [1, 2, 3], 900)
    with pytest.raises(TypeError, match="capacity must be an integer, not 256.0"):
        numpy_loop.NumpyRoundStream(model, 4, 2, 256.0)


def test_target_greedy_takes_a_budget_and_an_eos_of_the_model():
    """target_greedy read its budget by comparison: infinity ran for ever, 2.5 gave 3 tokens, NaN
    none, True one and "3" a bare TypeError; its EOS was compared with each token unchecked (a
    string or one past the vocabulary never met). A budget from 0 to 2**31 - 1 and an EOS below
    the vocabulary are taken, at their limits."""
    model = toy.ToyModel(vocab=100)
    first = toy.target_greedy(model, [1, 2], 1)[0]
    assert toy.target_greedy(model, [1, 2], 2**31 - 1, eos=np.int64(first)) == [first]
    assert toy.target_greedy(model, [1, 2], 0) == [] and len(toy.target_greedy(model, [1, 2], 3, eos=99)) == 3
    for budget, eos, error, named in ((float("inf"), None, TypeError, "max_new_tokens must be an integer, not inf"),
                                      (2.5, None, TypeError, "max_new_tokens must be an integer, not 2.5"),
                                      (float("nan"), None, TypeError, "max_new_tokens must be an integer, not nan"),
                                      (True, None, TypeError, "max_new_tokens must be an integer, not True"),
                                      ("3", None, TypeError, "max_new_tokens must be an integer, not '3'"),
                                      (-1, None, ValueError, "max_new_tokens must be an int from 0 to 2147483647"),
                                      (2**31, None, ValueError, "max_new_tokens must be an int from 0 to 2147483647"),
                                      (3, "3", TypeError, "eos must be an integer, not '3'"),
                                      (3, 2.0, TypeError, "eos must be an integer, not 2.0"),
                                      (3, 100, ValueError, "eos must be None or an int from 0 to 99, not 100"),
                                      (3, -1, ValueError, "eos must be None or an int from 0 to 99, not -1")):
        with pytest.raises(error, match=named):
            toy.target_greedy(model, [1, 2], budget, eos)


def test_the_numpy_loops_check_the_budget_and_eos_as_the_gpu_stream_does():
    """The ctl words' numpy cast read eos "3" as 3 and truncated 2.9 to 2, met 2**31 with a bare
    OverflowError, truncated a budget of 2.5 and took -1 for no limit; None met a bare TypeError
    after the prefill. Now each an int from 0 to 2**31 - 1 (the eos or None), as RoundStream's
    per_row checks them, refused before the stream is touched or a cache sized."""
    from memra_cuda.buffers.tree import TreeShape
    model = toy.ToyModel(vocab=100)
    first = toy.target_greedy(model, [1, 2], 1)[0]
    stream = numpy_loop.NumpyRoundStream(model, 2, 4, 64)
    assert stream.generate([1, 2], 2**31 - 1, eos=first) == [first]  # the budget at its limit
    assert numpy_loop.speculative_generate(model, [1, 2], 2, 4, eos=2**31 - 1) == toy.target_greedy(model, [1, 2], 4)
    tree = TreeShape.from_choices([[0], [1]])
    entries = [lambda budget, eos: numpy_loop.speculative_generate(model, [1, 2], 2, budget, eos),
               lambda budget, eos: numpy_loop.tree_speculative_generate(model, [1, 2], tree, budget, eos),
               lambda budget, eos: stream.generate([3, 4, 5], budget, eos)]
    before = (stream.pend.copy(), stream.pos_ctr.copy(), stream.ctl.copy())
    for budget, eos, error, named in ((2.5, None, TypeError, "max_new_tokens must be an integer, not 2.5"),
                                      (None, None, TypeError, "max_new_tokens must be an integer, not None"),
                                      (-1, None, ValueError, "max_new_tokens must be an int from 0 to 2147483647"),
                                      (2**31, None, ValueError, "max_new_tokens must be an int from 0 to 2147483647"),
                                      (5, "3", TypeError, "eos must be an integer, not '3'"),
                                      (5, 2.9, TypeError, "eos must be an integer, not 2.9"),
                                      (5, True, TypeError, "eos must be an integer, not True"),
                                      (5, 2**31, ValueError, "eos must be None or an int from 0 to 2147483647")):
        for entry in entries:
            with pytest.raises(error, match=named):
                entry(budget, eos)
    assert all((now == then).all() for now, then in zip((stream.pend, stream.pos_ctr, stream.ctl), before))


def test_p_min_is_a_probability():
    """ToyModel(p_min=2) (a percentage, say) was taken: every draft step broke, and nothing said
    why. A real number from 0 to 1, else refused naming p_min."""
    for bad in (2, 1.5, -0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"p_min must be a probability from 0 to 1 .*, not " + repr(bad)):
            toy.ToyModel(p_min=bad)
    for bad in ("0.1", True, None):
        with pytest.raises(TypeError, match=f"p_min must be a real number, not {bad!r}"):
            toy.ToyModel(p_min=bad)


def test_the_sampling_modes_numbers_are_real_numbers_kept_as_floats():
    """ToySampling(temperature=True) was taken as 1, floor=None met a bare comparison's TypeError,
    and .target(0) divided the floor by a vocabulary of 0 (ZeroDivisionError)."""
    sampling = toy.ToySampling(temperature=1, floor=np.float32(0.5), draft_temperature=np.int64(2), draft_floor=1)
    assert sampling == toy.ToySampling(1.0, 0.5, 2.0, 1.0)
    assert all(type(getattr(sampling, name)) is float for name in ("temperature", "floor", "draft_temperature",
                                                                   "draft_floor"))
    for field, bad in (("temperature", True), ("floor", None), ("draft_temperature", "1.0"), ("draft_floor", np.True_)):
        with pytest.raises(TypeError, match=f"{field} must be a real number, not {bad!r}"):
            toy.ToySampling(**{field: bad})
    with pytest.raises(ValueError, match="floor must be >= 0 \\(a floor at most 1\\), not 1.5"):
        toy.ToySampling(floor=1.5)
    assert toy.ToySampling().target(np.int64(1))[0] == np.float32(0.05)  # the vocabulary at its least
    for vocab, error, named in ((0, ValueError, "vocab must be an int of at least 1, not 0"),
                                (True, TypeError, "vocab must be an integer, not True"),
                                (2.0, TypeError, "vocab must be an integer, not 2.0")):
        with pytest.raises(error, match=named):
            toy.ToySampling().target(vocab)


def test_the_sampling_weights_check_their_temperature_and_floor_as_the_fields_are():
    """ToySampling.weights is public, and its temperature and floor were unchecked: NaN and -1
    were read as greedy, True as 1.0, and a floor of 1.5 gave negative weights. Refused with the
    fields' own rules, naming each; what the fields take, it takes alike."""
    assert toy.ToySampling.weights(8, np.float32(1), np.int64(0)) == toy.ToySampling(1.0, 0.0).target(8)
    assert toy.ToySampling.weights(8, 0.0, 1.0) == (np.float32(1 / 8), 0.0, 0.0, 0.0, 0.0)
    for temperature, floor, error, named in (
            (float("nan"), 0.1, ValueError, "temperature must be >= 0 \\(a floor at most 1\\), not nan"),
            (-1.0, 0.1, ValueError, "temperature must be >= 0 \\(a floor at most 1\\), not -1.0"),
            (True, 0.1, TypeError, "temperature must be a real number, not True"),
            (1.0, 1.5, ValueError, "floor must be >= 0 \\(a floor at most 1\\), not 1.5"),
            (1.0, float("nan"), ValueError, "floor must be >= 0 \\(a floor at most 1\\), not nan"),
            (1.0, np.True_, TypeError, f"floor must be a real number, not {np.True_!r}"),
            (1.0, None, TypeError, "floor must be a real number, not None")):
        with pytest.raises(error, match=named):
            toy.ToySampling.weights(8, temperature, floor)


def test_the_sampling_laws_do_not_check_the_fields_again(monkeypatch):
    """ToySampling is frozen and its fields checked when it is made: target() and draft() ran
    them through _law_number again, each time (through the public weights()). They check the
    vocabulary alone, and give weights()' values."""
    sampling = toy.ToySampling(temperature=0.7, floor=0.1, draft_temperature=1.5, draft_floor=0.2)
    want = toy.ToySampling.weights(50, 0.7, 0.1), toy.ToySampling.weights(50, 1.5, 0.2)

    def checked_again(value, name):
        raise AssertionError(f"{name} checked again")
    monkeypatch.setattr(toy, "_law_number", checked_again)
    assert (sampling.target(50), sampling.draft(50)) == want
    with pytest.raises(ValueError, match="vocab must be an int of at least 1, not 0"):
        sampling.draft(0)


def test_the_target_law_takes_a_context_of_the_models_tokens():
    """ToySampling.target_law(model, []) met an IndexError, a float token a TypeError deep in the
    hash ("unsupported operand type(s) for &="), a uint32 array an OverflowError there (numpy's u32
    arithmetic), and a token past the vocabulary was hashed into a law no request has, silently.
    Refused naming the context (as_prompt); a context of the model's tokens gives the law it gave,
    a distribution over the vocabulary."""
    model, sampling = toy.ToyModel(vocab=100), toy.ToySampling()
    law = sampling.target_law(model, [1, 2, 3])
    assert law.shape == (100,) and abs(law.sum() - 1) < 1e-12
    assert np.array_equal(sampling.target_law(model, np.array([1, 2, 3], np.uint32)), law)
    no_context = "the context must be a sequence of at least one token id"
    for context, error, named in (([], ValueError, no_context),
                                  ([1, 100], ValueError, "the context's token 100 \\(at 1\\) is outside the vocab"),
                                  ([1, -1], ValueError, "the context's token -1 \\(at 1\\) is outside the vocab"),
                                  ([1, 2.0], TypeError, no_context), ([True, 2], TypeError, no_context),
                                  ("ab", TypeError, no_context)):
        with pytest.raises(error, match=named):
            sampling.target_law(model, context)


def test_the_target_law_of_a_model_with_recurrent_layers_counts_their_states():
    """target_law on a model with recurrent layers (which ToyLM samples, its toy_verify adding their
    states to the sums toy_probs reads) met "a model with recurrent layers needs their states after
    the token". Their states after the context count now: at temperature 0 and floor 0 the law is
    the target's greedy token, target_greedy's, at every step, and the states change the law."""
    model = toy.ToyModel(seed=4, vocab=64, kv_mask=(True, False, False), rec_mask=(False, True, False))
    greedy = toy.ToySampling(temperature=0.0, floor=0.0)
    prompt = [3, 1, 4]
    out = toy.target_greedy(model, prompt, 12)
    assert [int(np.argmax(greedy.target_law(model, prompt + out[:t]))) for t in range(12)] == out
    assert all(greedy.target_law(model, prompt + out[:t]).max() == 1 for t in range(12))
    plain = replace(model, rec_mask=())
    assert not np.array_equal(toy.ToySampling().target_law(model, prompt), toy.ToySampling().target_law(plain, prompt))


def test_the_toys_model_and_tree_are_checked_where_they_enter():
    """Anything but a ToyModel given for the model (None, a dict of its fields) met an
    AttributeError deep inside ("'NoneType' object has no attribute 'vocab'"), naming nothing, in
    the oracle, the numpy loops and the engines' constructors; NumpyTreeRoundStream's tree None met
    "no attribute 'depth'" where tree_speculative_generate's was refused. Each a TypeError naming
    what it is, before an engine, a communicator or a cache is touched (so no GPU is needed here)."""
    from memra_cuda import Geometry
    from memra_cuda.buffers.tree import TreeShape
    from memra_cuda.testing.toy import pipeline, ranks
    model = toy.ToyModel(vocab=100)
    tree = TreeShape.from_choices([[0], [1]])
    entries = [lambda m: toy.target_greedy(m, [1, 2], 3), lambda m: toy.ToySampling().target_law(m, [1, 2]),
               lambda m: numpy_loop.speculative_generate(m, [1, 2], 2, 3),
               lambda m: numpy_loop.tree_speculative_generate(m, [1, 2], tree, 3),
               lambda m: numpy_loop.NumpyRoundStream(m, 2, 4, 64),
               lambda m: numpy_loop.NumpyTreeRoundStream(m, tree, 4, 64), lambda m: toy.ToyLM(None, m, 64),
               lambda m: pipeline.ToyPipeline([None, None], m, 64, 1, Geometry(2, 4)),
               lambda m: ranks.ToyTensorParallel(None, m, 64, Geometry(2, 4))]
    for bad in (None, {"vocab": 100}, "model"):
        for entry in entries:
            with pytest.raises(TypeError, match=f"the toy's model is a ToyModel, not {re.escape(repr(bad))}"):
                entry(bad)
    assert entries[0](model) == toy.target_greedy(model, [1, 2], 3)
    for bad in (None, [[0], [1]]):
        with pytest.raises(TypeError, match="a tree is a TreeShape or a DynamicTree"):
            numpy_loop.NumpyTreeRoundStream(model, bad, 4, 64)


def test_the_toys_cost_is_bytes():
    """ToyCost(-5) was taken and paced the bursts (to meet a u64's refusal of -1 words at the
    verify's launch), 2.5 and NaN reached the weights' allocation, True paced the bursts as a byte,
    and ToyLM's cost=None met "no attribute 'verify_bytes'". Each field an int from 0 to
    2**64 - 1, kept as a plain int, refused naming it; a cost a ToyCost (no GPU is needed here)."""
    assert toy.ToyCost(np.int64(16), 2**64 - 1) == toy.ToyCost(16, 2**64 - 1)
    assert type(toy.ToyCost(np.uint32(32)).verify_bytes) is int and not toy.ToyCost().paced
    for field in ("verify_bytes", "draft_bytes"):
        for bad, error in ((-5, ValueError), (2**64, ValueError), (2.5, TypeError), (float("nan"), TypeError),
                           (True, TypeError), ("16", TypeError), (None, TypeError)):
            with pytest.raises(error, match=f"{field} must be "):
                toy.ToyCost(**{field: bad})
    with pytest.raises(TypeError, match="the toy's cost is a ToyCost, not None"):
        toy.ToyLM(None, toy.ToyModel(), 64, cost=None)


def test_the_toy_lm_refuses_a_capacity_or_a_batch_that_is_no_size():
    """ToyLM(engine, model, "512") and batch=2.7 were taken through int(); refused by name now,
    before the engine is touched (so no GPU is needed here)."""
    for capacity, batch, error, message in (("512", 1, TypeError, "capacity must be an integer, not '512'"),
                                            (2.7, 1, TypeError, "capacity must be an integer, not 2.7"),
                                            (0, 1, ValueError, "capacity must be an int of at least 1, not 0"),
                                            (64, 2.7, TypeError, "batch must be an integer, not 2.7"),
                                            (64, True, TypeError, "batch must be an integer, not True"),
                                            (64, 0, ValueError, "batch must be an int from 1 to 65535, not 0")):
        with pytest.raises(error, match=message):
            toy.ToyLM(None, toy.ToyModel(), capacity, batch=batch)  # type: ignore[arg-type]


def test_the_flip_index_names_a_slot_whatever_its_value():
    """live_slot is kernel 9's bank rule, which ToyLM reads FLIP states back through: an index
    in range names its own slot, a garbage one a slot of bank 1."""
    idx = np.array([0, 2, 3, 5, 6, 7, 2**32 - 1], np.int64)
    assert toy.live_slot(idx, 2).tolist() == [0, 2, 3, 5, 3, 4, 3 + (2**32 - 1) % 3]


def test_the_toys_verify_steps_refuse_what_their_sums_cannot_fill():
    """probs_step and finish_step, refused before any kernel is bound."""
    from types import SimpleNamespace
    sums = SimpleNamespace(len=6)
    lm = SimpleNamespace(sampling=None, model=toy.ToyModel(vocab=50))
    with pytest.raises(ValueError, match="no sampling="):
        toy.ToyLM.probs_step(lm, sums, SimpleNamespace(len=300))
    lm.sampling = toy.ToySampling()
    with pytest.raises(ValueError, match="a law of 50 for each of the 6 sums"):
        toy.ToyLM.probs_step(lm, sums, SimpleNamespace(len=299))
    with pytest.raises(ValueError, match="a token for each of the 6 sums"):
        toy.ToyLM.finish_step(lm, sums, SimpleNamespace(len=5))


def test_a_prompt_that_is_no_sequence_of_token_ids_is_refused_naming_it_where_it_enters():
    """Every way a prompt enters the toy (its GPU prefill, its numpy loops, target_greedy) checks
    it first (driver.values.as_prompt): a generator or a bare numpy integer met len() deep inside
    ("object of type 'generator' has no len()"), a token past the vocabulary was hashed as any
    other. The GPU prefill's refusal comes before it touches its engine or buffers."""
    from memra_cuda.buffers.tree import TreeShape
    model = toy.ToyModel(seed=3, vocab=50)
    lm = object.__new__(toy.ToyLM)  # its host side: the check comes before any device work
    lm.model, lm.capacity = model, 32
    entries = [("row 1's prompt", lambda prompt: lm.prefill_row(None, 1, prompt)),
               ("the prompt", lambda prompt: numpy_loop.speculative_generate(model, prompt, 2, 4)),
               ("the prompt", lambda prompt: numpy_loop.tree_speculative_generate(
                   model, prompt, TreeShape.from_choices([[0], [1]]), 4)),
               ("the prompt", lambda prompt: toy.target_greedy(model, prompt, 4))]
    for prompt, error in (((token for token in [1, 2]), TypeError), (np.int64(5), TypeError), (5, TypeError),
                          ("12", TypeError), ([1, 2.5], TypeError), ([True, 2], TypeError), ([], ValueError),
                          (np.array([[1, 2]]), TypeError)):
        for what, entry in entries:
            with pytest.raises(error, match=f"{what} must be a sequence of at least one token id"):
                entry(prompt)
    for what, entry in entries:
        with pytest.raises(ValueError, match=f"{what}'s token 50 \\(at 1\\) is outside the vocabulary of 50"):
            entry([3, 50])
    assert toy.target_greedy(model, np.array([3, 4], np.uint32), 4) == toy.target_greedy(model, (3, 4), 4)


def test_a_prompt_longer_than_the_toys_caches_is_refused_by_its_length_before_it_is_read():
    """The toy's GPU prefill read a prompt whole (range(3 * 10**7): seconds) before it compared
    its length with the caches, and its numpy loop's prefill wrote the caches' every slot, then
    met an IndexError. Each refuses a prompt of more than the caches hold and the pending token
    by its len(), unread, the caches untouched; at the limit, it is taken."""
    from stand_in import Unread
    model = toy.ToyModel(seed=3, vocab=50)
    lm = object.__new__(toy.ToyLM)  # its host side: the check comes before any device work
    lm.model, lm.capacity = model, 32
    with pytest.raises(ValueError, match="row 1's prompt of 34 tokens does not fit a row \\(at most 33\\)"):
        lm.prefill_row(None, 1, Unread(34))
    stream = numpy_loop.NumpyRoundStream(model, 2, 2, 8)
    with pytest.raises(ValueError, match="the prompt of 10 tokens does not fit a row \\(at most 9\\)"):
        stream.prefill([1] * 10)
    assert not stream.draft_kv.any() and stream.draft_len[0] == 0, "a refused prefill wrote the caches"
    assert stream.prefill([1] * 9) == 8


def test_the_longest_prompt_a_row_takes_is_its_caches_slots_and_its_pending_token():
    """The "capacity + 1" written in each place a row is filled (the toy's two prefills, the
    torch decoders' longest_prompt): one rule, named once (longest_prompt_for), so they cannot
    drift apart. At its limit a prompt is taken, one token more refused by its length."""
    from memra_cuda.driver.values import as_prompt, longest_prompt_for
    assert [longest_prompt_for(slots) for slots in (1, 8, 32)] == [2, 9, 33]
    assert as_prompt(range(33), 50, "the prompt", longest_prompt_for(32)).size == 33
    with pytest.raises(ValueError, match="the prompt of 34 tokens does not fit a row \\(at most 33\\)"):
        as_prompt(range(34), 50, "the prompt", longest_prompt_for(32))

"""memra_cuda.rounds.serving's Server on CPU: continuous batching is host logic, driven here
through a decoder of plain Python (Counting) and a clock of the test's own. Counting stands in
for a model, not for the device: a request's tokens are a function of its prompt and position
alone (so its output is the same in any row, beside any others), and a burst commits one to three
tokens a row, as a speculative round commits its accepted drafts and one (tests/stand_in.py). What
is checked is the server's part: which request a row runs, when, and whose tokens it hands back as which request's;
refusals, cancels and the times each token was read back."""
from __future__ import annotations

import copy
import itertools
import math
import pickle
import re
import reprlib
import sys
import threading
from collections import UserString

import numpy as np
import pytest

from memra_cuda.errors import BuffersHeld, CapacityError, CudaError, MemraError, RequestRefused
from memra_cuda.rounds import Request, Served, Server, serving
from memra_cuda.rounds.serving import Driven

from interrupt import acting_before, interrupt_before, interrupt_once
from stand_in import CAPACITY, VOCAB, Clock, Counting, Unread, UnreadArray, alone, commits, mixed, token


def test_every_request_gets_its_own_output_through_fewer_slots():
    requests = mixed(11)
    assert any(len(alone(r)) < r.max_new_tokens for r in requests), "no request stops at its EOS"
    decoder = Counting(3)
    served = Server(decoder, clock=decoder.clock).serve(requests)
    for i, (request, out) in enumerate(zip(requests, served)):
        assert out.tokens == alone(request), f"request {i}"
        assert out.refused is None and not out.cancelled
        assert len(out.arrivals) == len(out.tokens) and out.finished == out.arrivals[-1]
    assert sum(call == ("burst",) for call in decoder.calls) < sum(len(alone(r)) for r in requests) / 3, \
        "the slots ran one request at a time"


def test_a_freed_slot_takes_the_next_request_at_once_in_submission_order():
    """Rows 0 and 1 start requests 0 and 1; request 0 stops in the first burst (a budget of 1),
    so row 0 takes request 2 before the next burst, then request 3: every admission one call
    (prefill and stop rule together), nothing between it and the burst."""
    first, long, *short = [Request([1, 2], 1), Request([3], 12), Request([4, 5, 6], 1), Request([7], 1)]
    decoder = Counting(2)
    server = Server(decoder, clock=decoder.clock)
    for request in (first, long, *short):
        server.submit(request)
    server.step()
    server.step()
    server.step()
    assert decoder.calls == [("park", (0, 1)), ("admit", 0, (1, 2)), ("admit", 1, (3,)), ("burst",),
                             ("admit", 0, (4, 5, 6)), ("burst",), ("admit", 0, (7,)), ("burst",)]


def test_a_request_that_cannot_run_is_refused_alone_naming_it():
    good = mixed(4)
    bad = {1: (Request([1] * 30, 20), "request 1 refused: 50 entries needed; a row holds 40"),
           2: (Request([3, VOCAB, 4], 5), f"token {VOCAB} \\(at 1\\) is outside the vocabulary of {VOCAB}"),
           3: (Request([3], 5, eos=VOCAB + 2), f"EOS {VOCAB + 2} is outside the vocabulary"),
           5: (Request([], 5), "at least one token id"),
           6: (Request([1, 2.5], 5), "at least one token id"),
           7: (Request([True], 5), "at least one token id"),
           8: (Request([2], -1), "max_new_tokens must be an int from 0 to 2147483647, not -1"),
           9: (Request([2], 4, seed=1.5), "its seed must be an integer"),
           10: (Request([2], 4, seed=2**64), rf"its seed must be an int from 0 to 2\*\*64 - 1 .*not {2**64}"),
           11: (Request([2], 4, max_draft=-1), "max_draft must be None or an int of at least 0, not -1"),
           12: (Request([2], 4, max_draft=True), "max_draft must be an integer, not True"),
           13: (Request([2], 4, seed=True), "its seed must be an integer, not True"),
           14: (Request([2], 4, seed=np.True_), "its seed must be an integer, not np.True_"),
           15: (Request([True, 5], 5), "at least one token id"),  # numpy reads the list as ints: True was token 1
           # a seed is a 64-bit key: -1 was taken, the int64 bits of another
           16: (Request([2], 4, seed=-1), r"its seed must be an int from 0 to 2\*\*64 - 1 \(a 64-bit key\), not -1$")}
    requests = list(good)
    for place, (request, _) in sorted(bad.items()):
        requests.insert(place, request)
    decoder = Counting(2)
    served = Server(decoder, clock=decoder.clock).serve(requests)
    for place, (request, reason) in bad.items():
        out = served[place]
        assert out.refused is not None and out.refused.startswith(f"request {place} refused: "), out.refused
        assert pytest.approx(out.latency) == 0 and out.tokens == [] and out.admitted is None
        assert re.search(reason, out.refused), out.refused
    assert [out.tokens for out in served if out.refused is None] == [alone(r) for r in good]
    assert sum(call[0] == "admit" for call in decoder.calls) == len(good), "a refused request took a row"


def test_a_seed_is_a_64_bit_key_from_0():
    """A request's seed keys its draws, the 64-bit Philox key (docs/sampling.md): every key from 0
    to 2**64 - 1 is well formed (2**63 and more were refused, as past the int64 a sampled decoder
    keeps them in, which now holds their bits), and a negative seed is malformed (it was taken as
    the bits of another key), naming it, at submit as everywhere a seed enters (values.as_seed)."""
    for seed in (0, 2**63 - 1, 2**63, 2**64 - 1, np.uint64(2**64 - 1)):
        assert serving.malformed(Request([2], 4, seed=seed), VOCAB) is None, seed
    kept = serving.admitted(Request([2], 4, seed=np.uint64(2**64 - 1)), VOCAB, 0, 1)[1]
    assert kept.seed == 2**64 - 1 and type(kept.seed) is int
    for seed in (-1, -(2**63), 2**64):
        assert serving.malformed(Request([2], 4, seed=seed), VOCAB) == (
            f"its seed must be an int from 0 to 2**64 - 1 (a 64-bit key), not {seed}")
    server = Server(Counting(2))
    with pytest.raises(RequestRefused, match=r"request 0 refused: its seed must be an int from 0 .*, not -5$"):
        server.submit(Request([1], 3, seed=-5))


def test_submit_refuses_at_once_and_changes_nothing_else():
    decoder = Counting(2)
    server = Server(decoder, clock=decoder.clock)
    with pytest.raises(RequestRefused, match="request 0 refused: 45 entries needed") as refused:
        server.submit(Request([1] * 40, 5))
    assert isinstance(refused.value, ValueError) and isinstance(refused.value, MemraError)
    assert refused.value.ident == 0 and "a row holds 40" in refused.value.reason
    assert server.idle and decoder.calls == [("park", (0, 1))]
    assert server.submit(Request([1], 3)) == 1, "ids count refused requests too"
    assert server.step().finished == {} and decoder.calls[1:] == [("admit", 0, (1,)), ("burst",)]


def test_a_prompt_longer_than_a_row_takes_is_refused_by_its_length_before_it_is_read():
    """A lazy or huge prompt was read whole before the decoder's room refused it: submit() of
    Request(range(3 * 10**7), 8) made it a numpy array and a tuple of its ints (8 s, hundreds of
    MB), to be refused by refusal() (or, here, by its 51st token, outside the vocabulary). Past
    the decoder's longest_prompt it is refused by its len(), unread, naming the request (an
    array of any library's, a len() past sys.maxsize too), at submit, in a batch and at an admission, the copy a Server
    kept from a larger decoder too; at the limit it is read and checked as before, and a
    decoder without longest_prompt reads every prompt as before."""
    from memra_cuda.rounds.serving import admitted, batch_admitted
    decoder = Counting(2)
    server = Server(decoder, clock=decoder.clock)
    for ident, (prompt, shown) in enumerate(((Unread(CAPACITY + 1), f"{CAPACITY + 1} tokens"),
                                             (range(3 * 10**7), f"{3 * 10**7} tokens"),
                                             (np.zeros(CAPACITY + 1, np.int64), f"{CAPACITY + 1} tokens"),
                                             (UnreadArray(CAPACITY + 1), f"{CAPACITY + 1} tokens"),
                                             (range(10**20), r"more than \d+ tokens"))):
        with pytest.raises(RequestRefused, match=f"request {ident} refused: its prompt of {shown} does not fit a row "
                                                 rf"\(at most {CAPACITY}\)"):
            server.submit(Request(prompt, 8))
    assert server.idle and decoder.calls == [("park", (0, 1))]
    assert server.submit(Request(list(range(CAPACITY)), 0)) == 5  # at the limit, read and checked
    with pytest.raises(RequestRefused, match=f"request 1 refused: its prompt of {CAPACITY + 1} tokens does not fit"):
        batch_admitted([Request([1], 2), Request(Unread(CAPACITY + 1), 2)], VOCAB, 2, longest=CAPACITY)
    with pytest.raises(ValueError, match=f"a request not admitted: its prompt of {CAPACITY + 1} tokens does not fit"):
        admitted(Request(Unread(CAPACITY + 1), 2), VOCAB, 0, 1, CAPACITY)
    kept = admitted(Request(list(range(CAPACITY + 1)), 2), VOCAB, 0, 1)[1]  # a larger decoder's server's copy
    with pytest.raises(ValueError, match=f"its prompt of {CAPACITY + 1} tokens does not fit a row"):
        admitted(kept, VOCAB, 0, 1, CAPACITY)
    unbounded = Counting(1)
    del unbounded.longest_prompt  # optional: without it, every prompt is read first
    with pytest.raises(AssertionError, match="was read"):
        Server(unbounded, clock=unbounded.clock).submit(Request(Unread(CAPACITY + 1), 8))
    for longest, error in ((0, ValueError), (True, TypeError), (2.5, TypeError)):
        decoder.longest_prompt = longest
        with pytest.raises(error, match="a decoder's longest_prompt must be an"):
            Server(decoder)


def cancelled_run(requests: list[Request], victim: int, after: int, batch: int = 2):
    """`requests` through `batch` slots, request `victim` cancelled after `after` steps: every
    Served by id, the decoder, and the tokens the victim had when it was cancelled."""
    decoder = Counting(batch)
    server = Server(decoder, clock=decoder.clock)
    ids = [server.submit(request) for request in requests]
    out, had = {}, []
    for _ in range(after):
        progress = server.step()
        out.update(progress.finished)
        had += progress.tokens.get(victim, [])
    assert server.cancel(ids[victim])
    while not server.idle:
        out.update(server.step().finished)
    return out, decoder, had


def test_a_cancel_frees_the_slot_at_the_next_boundary_and_changes_no_other_request():
    requests = [Request([i + 1, 2 * i], 14 + i) for i in range(5)]
    out, decoder, had = cancelled_run(requests, victim=1, after=2)
    cancelled = out[1]
    assert cancelled.cancelled and cancelled.refused is None
    assert cancelled.tokens == had and 0 < len(had) < len(alone(requests[1]))
    assert cancelled.tokens == alone(requests[1])[:len(had)], "a cancelled request keeps the tokens it was sent"
    assert cancelled.finished == 2.0, "ended at the boundary after the second burst"
    # request 1 ran in row 1: the boundary parks row 1 and gives it the next request, before the burst
    bursts = [i for i, call in enumerate(decoder.calls) if call == ("burst",)]
    assert decoder.calls[bursts[1] + 1:bursts[1] + 3] == [("park", (1,)), ("admit", 1, (3, 4))]
    without = Server(Counting(2)).serve(requests[:1] + requests[2:])
    assert [out[i].tokens for i in (0, 2, 3, 4)] == [served.tokens for served in without]
    assert not any(out[i].cancelled for i in (0, 2, 3, 4))


def test_a_queued_request_cancelled_never_takes_a_row():
    requests = [Request([1], 9), Request([2], 9), Request([3], 9)]
    out, decoder, had = cancelled_run(requests, victim=2, after=1)
    assert out[2].cancelled and out[2].tokens == [] and out[2].admitted is None and had == []
    assert out[2].finished == 1.0
    assert [call for call in decoder.calls if call[0] == "admit"] == [("admit", 0, (1,)), ("admit", 1, (2,))]


def test_cancel_refuses_an_id_never_given_and_says_false_for_one_that_ended():
    decoder = Counting(1)
    server = Server(decoder, clock=decoder.clock)
    with pytest.raises(ValueError, match="no request 0 was submitted to this server \\(0 so far\\)"):
        server.cancel(0)
    ident = server.submit(Request([1], 1))
    with pytest.raises(ValueError, match="no request 1"):
        server.cancel(1)
    assert ident in server.step().finished and server.idle
    assert server.cancel(ident) is False
    again = server.submit(Request([1], 9))
    assert server.cancel(again) and server.cancel(again), "a second cancel before the boundary"
    assert list(server.step().finished) == [again] and server.idle


def test_a_cancel_asked_during_the_step_that_ends_its_request_is_dropped_with_it():
    """A cancel from another thread (a client hanging up while a burst runs), or from a clock or
    a decoder calling back, of a request that burst then finished: the request ended, and its
    cancel stayed queued, so every later step raised KeyError naming it and the server served
    no more."""
    decoder = Counting(2)
    server = Server(decoder, clock=decoder.clock)
    first = server.submit(Request([1, 2], 1))
    burst = decoder.burst

    def cancelling():
        out = burst()
        assert server.cancel(first), "still running: its cancel is taken"
        return out

    decoder.burst = cancelling
    assert list(server.step().finished) == [first], "its burst finished it: it ended so, not cancelled"
    decoder.burst = burst
    assert server.idle and server.step() == (None, {}, {})
    second = server.submit(Request([3], 2))
    finished = {}
    while not server.idle:
        finished.update(server.step().finished)
    assert list(finished) == [second] and not finished[second].cancelled
    assert server.cancel(first) is False, "ended: its result stands"


def test_a_cancel_asked_while_the_boundary_parks_the_rows_of_others_takes_effect_at_the_next():
    """The boundary's cancels were cleared all at once after the rows were parked: one asked
    meanwhile (the park calling back, or another thread) was dropped, though cancel() said True,
    and its request ran to the end of its budget."""
    decoder = Counting(2)
    server = Server(decoder, clock=decoder.clock)
    first, second = server.submit(Request([1, 2], 30)), server.submit(Request([3], 30))
    server.step()
    park = decoder.park

    def parking(rows):
        park(rows)
        assert server.cancel(second)

    decoder.park = parking
    assert server.cancel(first) and list(server.step().finished) == [first]
    decoder.park = park
    ended = server.step().finished
    assert list(ended) == [second] and ended[second].cancelled and len(ended[second].tokens) < 30


def test_a_step_inside_a_step_is_refused_and_the_outer_step_goes_on():
    """A step called back from the decoder's burst (or the clock, or another thread) ran the
    rows' next burst and ended their requests; the outer step then met a request that had ended
    (KeyError), its burst's tokens lost: request 0 ended with 1 of its 3 tokens, silently."""
    decoder = Counting(1)
    server = Server(decoder, clock=decoder.clock)
    first, second = server.submit(Request([1, 2], 3)), server.submit(Request([3], 3))
    burst, inner = decoder.burst, []

    def stepping():
        out = burst()
        with pytest.raises(RuntimeError, match="step\\(\\) was called while a step of this server runs"):
            server.step()
        inner.append(True)
        return out

    decoder.burst = stepping
    ended = dict(server.step().finished)
    decoder.burst = burst
    while not server.idle:
        ended.update(server.step().finished)
    assert inner == [True]
    assert [ended[ident].tokens for ident in (first, second)] == [alone(Request([1, 2], 3)), alone(Request([3], 3))]


def test_a_second_thread_stepping_as_the_first_begins_is_refused(monkeypatch):
    """step() read its flag and then set it: a second thread stepping between the two passed the
    check, and both steps ran the rows' bursts. The second thread steps here at the first step's
    first get_ident (where the flag was set; now its first call into the decoder, the flag set
    since the step began) and is refused; the first runs on, its request its own greedy decoding
    alone."""
    decoder = Counting(1)
    server = Server(decoder, clock=decoder.clock)
    ident = server.submit(Request([1, 2], 3))
    first, seen = threading.get_ident(), []

    def outcome():
        try:
            seen.append(server.step())
        except RuntimeError as error:
            seen.append(error)

    def between():  # the first step, as it sets its flag: another thread steps, once
        me = threading.get_ident()
        if me == first and not seen:
            other = threading.Thread(target=outcome)
            other.start()
            other.join()
        return me

    monkeypatch.setattr(serving, "threading", type("Threading", (), {"get_ident": staticmethod(between)}))
    ended = dict(server.step().finished)
    monkeypatch.undo()
    assert len(seen) == 1 and isinstance(seen[0], RuntimeError), seen
    assert "step() was called while a step of this server runs" in str(seen[0])
    while not server.idle:
        ended.update(server.step().finished)
    assert ended[ident].tokens == alone(Request([1, 2], 3))


def test_a_budget_past_a_rows_i32_is_malformed_before_any_row_is_touched():
    """A row's budget is an i32 on the device: a speculative decoder's generate_batch and admit()
    prefilled the rows (their caches overwritten) before StreamBufs refused 2**31; it is a
    malformed request now, refused where every request is checked (as the server's, naming it)."""
    from memra_cuda.rounds.serving import batch_admitted, malformed
    assert malformed(Request([1], 2**31 - 1), VOCAB) is None
    assert "max_new_tokens must be an int from 0 to 2147483647, not 2147483648" in malformed(Request([1], 2**31), VOCAB)
    with pytest.raises(RequestRefused, match="request 0 refused: max_new_tokens must be an int from 0 to"):
        batch_admitted([Request([1], 2**31)], VOCAB, 1)
    decoder = Counting(1, capacity=2**40)
    with pytest.raises(RequestRefused, match="max_new_tokens must be an int from 0 to 2147483647"):
        Server(decoder).submit(Request([1], 2**32))


def test_each_token_carries_its_readback_time_and_the_first_one_the_time_to_first_token():
    """The clock moves a second a burst: a burst's tokens share its readback's time, a request
    queued behind a full slot is admitted at the boundary its slot was freed at, and its time to
    first token counts its wait."""
    clock = Clock()
    decoder = Counting(1, clock)
    server = Server(decoder, clock=clock)
    clock.now = 10.0
    first, second = server.submit(Request([1], 4)), server.submit(Request([2], 3))
    served = {}
    while not server.idle:
        progress = server.step()
        assert progress.at == clock.now
        for ident, new in progress.tokens.items():
            assert new, f"request {ident} ran a burst and got no token"
        served.update(progress.finished)
    one, two = served[first], served[second]
    assert one.submitted == two.submitted == 10.0 and one.admitted == 10.0
    assert one.first_token == 1.0 and one.arrivals == sorted(one.arrivals) and one.arrivals[0] == 11.0
    assert two.admitted == one.finished, "admitted at the boundary its row was freed at"
    assert two.first_token == two.admitted + 1.0 - 10.0
    assert two.latency == two.finished - 10.0 and len(set(two.arrivals)) <= len(two.tokens)
    assert len(set(one.arrivals)) < len(one.arrivals), "no burst delivered more than one token"


def test_a_request_that_stops_inside_a_burst_ends_there_and_frees_its_row():
    prompt = next((p,) for p in range(1, 200) if commits((p,), 0) == 3 and token((p,), 0) != token((p,), 1))
    at_eos = Request(list(prompt), 10, eos=token(prompt, 1))  # stops at its 2nd token of a burst of 3
    at_budget = Request(list(prompt), 2)
    decoder = Counting(1)
    server = Server(decoder, clock=decoder.clock)
    ids = [server.submit(at_eos), server.submit(at_budget), server.submit(Request([5], 1))]
    progress = server.step()
    assert progress.tokens == {ids[0]: list(alone(at_eos))} and len(alone(at_eos)) == 2
    assert list(progress.finished) == [ids[0]]
    progress = server.step()
    assert progress.tokens == {ids[1]: alone(at_budget)} and list(progress.finished) == [ids[1]]
    assert decoder.calls[-2:] == [("admit", 0, prompt), ("burst",)]


def test_a_budget_of_zero_ends_at_the_head_of_the_queue_without_a_row():
    decoder = Counting(1)
    server = Server(decoder, clock=decoder.clock)
    nothing = server.submit(Request([3, 4], 0))
    progress = server.step()
    assert progress.at is None and progress.tokens == {} and decoder.calls == [("park", (0,))], \
        "a burst ran for a request of budget 0"
    assert progress.finished[nothing].tokens == [] and progress.finished[nothing].admitted == 0.0
    served = Server(Counting(1)).serve([Request([1], 5), Request([2], 0), Request([3], 4)])
    assert [out.tokens for out in served] == [alone(Request([1], 5)), [], alone(Request([3], 4))]


def test_an_idle_server_runs_no_burst_and_serve_wants_one():
    decoder = Counting(2)
    server = Server(decoder, clock=decoder.clock)
    assert server.step() == (None, {}, {}) and decoder.calls == [("park", (0, 1))]
    assert server.serve([]) == []
    server.submit(Request([1], 3))
    with pytest.raises(ValueError, match="serve\\(\\) takes an idle server to idle; 1 request"):
        server.serve([Request([2], 3)])


def test_serve_refusing_a_server_whose_ends_wait_for_the_next_step_counts_them():
    """A request another submitted during serve() and that ended in it waits for the next
    step to hand it out: the server is not idle, and serve() said "0 request(s) are in this one"."""
    decoder = Counting(2)
    server = Server(decoder, clock=decoder.clock)
    burst = decoder.burst

    def submitting():
        if decoder.calls.count(("burst",)) == 0:
            server.submit(Request([4], 1))
        return burst()

    decoder.burst = submitting
    assert [out.tokens for out in server.serve([Request([1, 2], 6)])] == [alone(Request([1, 2], 6))]
    assert not server.idle
    with pytest.raises(ValueError, match="takes an idle server to idle; 0 request\\(s\\) are in this one, 1 ended "
                                         "for the next step to hand out: step\\(\\) until it is idle"):
        server.serve([Request([2], 3)])
    assert list(server.step().finished) == [1] and server.idle


def device_fault() -> CudaError:
    return CudaError(700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered", "cuLaunchKernel")


@pytest.mark.parametrize("failure", [lambda: RuntimeError("the admission failed"), device_fault, "held"],
                         ids=["RuntimeError", "CudaError", "BuffersHeld"])
def test_a_request_whose_admission_raised_about_the_decoder_stays_at_the_head_of_the_queue(failure):
    """A failure of the decoder's, not of the request: the device's (a RuntimeError, a
    CudaError), or a ValueError of buffers a device loop holds, which parking the row raises
    too. Raised to the caller, and the request is admitted by a later step."""
    decoder = Counting(1)
    server = Server(decoder, clock=decoder.clock)
    ident = server.submit(Request([1], 3))
    if failure == "held":
        def held(rows):
            raise BuffersHeld("the buffers are held by a device loop")
        decoder.failure, decoder.park = (lambda: BuffersHeld("the buffers are held by a device loop")), held
    else:
        decoder.failure = failure
    decoder.failing = 1
    with pytest.raises(type(decoder.failure()), match="the admission failed|an illegal memory access|held"):
        server.step()
    assert not server.idle
    if failure == "held":
        del decoder.park  # the device loop let go
    while not server.idle:
        finished = server.step().finished
    assert finished[ident].tokens == alone(Request([1], 3)) and finished[ident].refused is None


@pytest.mark.parametrize("failure", [ValueError, TypeError, lambda text: CapacityError(text),
                                     lambda text: RequestRefused(0, text)],
                         ids=["ValueError", "TypeError", "CapacityError", "RequestRefused"])
def test_a_request_whose_admission_raised_about_itself_is_refused_alone_and_the_others_go_on(failure):
    """Issue 48, item 5: a request that cannot be served is refused alone, naming it. Its
    admission raised a ValueError or a TypeError (a value of its own the decoder cannot take):
    it ends refused at that step, its row parked again and given to the next request; the step
    raises nothing (it raised at every later step, the request stuck at the queue's head)."""
    requests = mixed(5)
    decoder = Counting(2)
    server = Server(decoder, clock=decoder.clock)
    ids = [server.submit(request) for request in requests]
    decoder.failing, decoder.failure = 1, lambda: failure("no room for it in this row")
    progress = server.step()
    refused = progress.finished[ids[0]]
    name = type(decoder.failure()).__name__
    assert refused.refused is not None and refused.refused.startswith(f"request {ids[0]} refused: its admission "
                                                                      f"raised {name}: ")
    assert "no room for it in this row" in refused.refused
    assert refused.tokens == [] and refused.admitted is None and not refused.cancelled and refused.finished == 0.0
    assert set(progress.tokens) == {ids[1], ids[2]}, "the rows went to the next requests at the same step"
    assert decoder.calls[:4] == [("park", (0, 1)), ("park", (0,)), ("admit", 0, tuple(requests[1].prompt)),
                                 ("admit", 1, tuple(requests[2].prompt))], "the failed row was not parked"
    out = {ident: served for ident, served in progress.finished.items()}
    while not server.idle:
        out.update(server.step().finished)
    assert [out[ident].tokens for ident in ids[1:]] == [alone(r) for r in requests[1:]]
    assert all(out[ident].refused is None for ident in ids[1:])


def test_serve_hands_back_a_request_refused_at_its_admission_in_its_place():
    requests = mixed(4)
    decoder = Counting(1)
    decoder.failing, decoder.failure = 1, lambda: ValueError("its prompt cannot be prefilled")
    served = Server(decoder, clock=decoder.clock).serve(requests)
    assert served[0].refused == "request 0 refused: its admission raised ValueError: its prompt cannot be prefilled"
    assert [out.tokens for out in served[1:]] == [alone(r) for r in requests[1:]]


def test_a_prompt_changed_after_submit_is_not_the_one_admitted():
    """The server checks the prompt at submit and keeps that copy (a tuple of ints): a caller
    who changes its list or array afterwards, a token past the vocabulary or a negative one
    in it, changes nothing a row is given (an unchecked token would fault the device in the
    embedding lookup)."""
    decoder = Counting(2)
    server = Server(decoder, clock=decoder.clock)
    listed, array = [1, 2, 3], np.array([4, 5], np.int64)
    ids = [server.submit(Request(listed, 30)), server.submit(Request(array, 30))]
    listed[0] = 10**9
    listed.append(-5)
    array[0] = VOCAB + 7
    progress = server.step()
    assert decoder.calls[1:3] == [("admit", 0, (1, 2, 3)), ("admit", 1, (4, 5))]
    kept = [decoder.rows[0], decoder.rows[1]]
    assert all(type(r.prompt) is tuple and all(type(t) is int for t in r.prompt) for r in kept if r is not None)
    assert progress.tokens[ids[0]] == alone(Request([1, 2, 3], 30))[:len(progress.tokens[ids[0]])]


def test_a_budget_changed_after_submit_is_not_the_one_admitted():
    """A budget, EOS, seed or most draft length given as a 0-d array (an index, as any int is)
    is kept as the int that was checked: an array raised to a million after submit would have
    taken a row past the room refusal() measured (a speculative decoder's rows then stalled
    every burst; the plain decoding wrote past its cache's end, clamped, silently)."""
    decoder = Counting(1)
    server = Server(decoder, clock=decoder.clock)
    budget, eos, seed, most = (np.array(v) for v in (5, 7, 3, 2))
    ident = server.submit(Request([1, 2], budget, eos=eos, seed=seed, max_draft=most))
    for value in (budget, eos, seed, most):
        value[()] = 10**6
    server.step()
    kept = decoder.rows[0]
    assert kept is not None and (kept.max_new_tokens, kept.eos, kept.seed, kept.max_draft) == (5, 7, 3, 2)
    assert all(type(v) is int for v in (kept.max_new_tokens, kept.eos, kept.seed, kept.max_draft)), ident


def test_the_copy_a_server_kept_is_admitted_without_its_tokens_read_again_and_a_changed_one_is_checked(monkeypatch):
    """A decoder's admit() checks what it is given (rounds.serving.admitted), but the copy its
    Server kept from the submit was checked already (~40 us a 300-token prompt): that copy comes
    back as it is, its tokens unread, where they lie in the decoder's vocabulary. The same copy
    changed (_replace), against a smaller vocabulary, or a caller's own request is read in full
    and refused naming what is wrong."""
    from memra_cuda.rounds.serving import admitted
    kept = admitted(Request([1, 2, 3], 4, eos=5), VOCAB, 0, 1)[1]
    reads = []
    real = serving.as_prompt
    monkeypatch.setattr(serving, "as_prompt", lambda *args: reads.append(args[0]) or real(*args))
    assert admitted(kept, VOCAB, 1, 2) == (1, kept) and admitted(kept, VOCAB, 1, 2)[1] is kept and reads == []
    with pytest.raises(ValueError, match="row 2 is not one of the decoder's 2"):
        admitted(kept, VOCAB, 2, 2)
    changed = kept._replace(prompt=(1, VOCAB))
    assert type(changed) is Request
    with pytest.raises(ValueError, match=f"its prompt's token {VOCAB} \\(at 1\\) is outside the vocabulary"):
        admitted(changed, VOCAB, 0, 1)
    with pytest.raises(ValueError, match="its prompt's token 3 \\(at 2\\) is outside the vocabulary of 3"):
        admitted(kept, 3, 0, 1)
    with pytest.raises(ValueError, match="its EOS 5 is outside the vocabulary of 5"):
        admitted(admitted(Request([1], 4, eos=5), VOCAB, 0, 1)[1], 5, 0, 1)  # its tokens in, its EOS not
    assert admitted(Request(list(kept.prompt), 4, eos=5), VOCAB, 0, 1)[1] == kept and len(reads) == 5
    # whatever a NamedTuple makes from the copy is a plain Request, checked anew: _make (a classmethod,
    # which _replace called unbound from Request calls too) and a pickle's round trip made the copy's
    # own type, a negative token or budget passed as checked
    assert repr(kept) == "Request(prompt=(1, 2, 3), max_new_tokens=4, eos=5, seed=0, max_draft=None)"
    for made in (kept._make([(1, -3), 4, None, 0, None]), Request._replace(kept, prompt=(1, -3)),
                 pickle.loads(pickle.dumps(kept._replace(prompt=(1, -3))))):
        assert type(made) is Request
        with pytest.raises(ValueError, match="its prompt's token -3 \\(at 1\\) is outside the vocabulary"):
            admitted(made, VOCAB, 0, 1)
    server = Server(Counting(1), clock=Clock())
    with pytest.raises(RequestRefused, match="max_new_tokens must be"):
        server.submit(kept._make([(1, 2), -4, None, 0, None]))


def test_a_server_over_a_decoder_of_no_rows_is_refused_naming_its_batch():
    """A batch of 0 left serve() stepping for ever: no row ever took a request."""
    for batch, error in ((0, ValueError), (-1, ValueError), (True, TypeError), (2.0, TypeError)):
        decoder = Counting(1)
        decoder.batch = batch  # type: ignore[assignment]
        with pytest.raises(error, match=f"a decoder's batch must be an int of at least 1, not {batch}|"
                                        f"a decoder's batch must be an integer, not {batch}"):
            Server(decoder)
        assert decoder.calls == [], "a refused server parked rows"
    with pytest.raises(TypeError, match=r"a decoder has batch, vocab, refusal, admit, burst, park \(memra_cuda"
                                        r"\.rounds\.serving\.Decoder\): type object has no batch, vocab"):
        Server(object())  # type: ignore[arg-type]

    class Speculative:  # a speculative decoder's face: rows, a vocabulary, admit, and a server of its own
        batch, vocab = 1, 8

        def admit(self, row, request): ...

        def server(self): ...

    with pytest.raises(TypeError, match=r"type Speculative has no refusal, burst, park; it makes its own: "
                                        r"decoder.server\(\)$"):
        Server(Speculative())  # type: ignore[arg-type]
    decoder = Counting(1)
    decoder.vocab = 0
    with pytest.raises(ValueError, match="a decoder's vocab must be an int of at least 1, not 0"):
        Server(decoder)
    assert len(Server(Counting(1)).serve([Request([1], 2)])) == 1


def test_what_is_not_a_request_or_an_id_is_a_type_error_naming_what_is_wanted():
    """A tuple of a request's fields has no names (it met AttributeError on .prompt); True is no
    request id (cancel(True) cancelled request 1), and no seed (seed=True was seed 1)."""
    decoder = Counting(2)
    server = Server(decoder, clock=decoder.clock)
    wanted = (r"a request is a memra_cuda\.rounds\.Request\(prompt, max_new_tokens, eos=None, seed=0, "
              r"max_draft=None\), not \(\[1\], 3\)")
    with pytest.raises(TypeError, match=wanted):
        server.submit(([1], 3))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=wanted):
        server.serve([Request([2], 3), ([1], 3)])  # type: ignore[list-item]
    assert server.idle and decoder.calls == [("park", (0, 1))], "serve() submitted requests before refusing one"
    assert server.submit(Request([1], 3)) == 0, "what is not a request took an id"
    server.submit(Request([2], 3))
    for ident in (True, np.True_, 1.0):
        with pytest.raises(TypeError, match="a request's id must be an integer, not"):
            server.cancel(ident)  # type: ignore[arg-type]
    assert server.cancel(np.int64(1)) and list(server.step().finished) == [1]


def test_requests_that_ended_at_a_step_that_raised_are_handed_out_by_the_next():
    """A cancel and a budget of 0 take effect at a boundary whose admission then raises: the two
    ended there, and the next step hands them out (they were dropped, never reported, so a caller
    waiting for them waited for ever)."""
    decoder = Counting(1)
    server = Server(decoder, clock=decoder.clock)
    running = server.submit(Request([1], 9))
    server.step()
    nothing, queued = server.submit(Request([2], 0)), server.submit(Request([3], 3))
    assert server.cancel(running)
    decoder.failing = 1
    with pytest.raises(RuntimeError, match="the admission failed"):
        server.step()
    finished = server.step().finished
    assert finished[running].cancelled and finished[nothing].tokens == [] and not finished[nothing].cancelled
    while not server.idle:
        finished.update(server.step().finished)
    assert sorted(finished) == [running, nothing, queued] and finished[queued].tokens == alone(Request([3], 3))


def test_each_request_carries_its_accepted_drafts_and_rounds_from_its_readbacks():
    """A speculative decoder's burst brings each row's accepted drafts with its tokens: a
    request's Served has them as its last readback said (a round commits its accepted drafts and
    one token, so its rounds are its tokens less them), a cancelled one's too; the plain loop's
    (no drafts) has none."""
    requests = mixed(9)
    decoder = Counting(3, drafts=True)
    server = Server(decoder, clock=decoder.clock)
    ids = [server.submit(request) for request in requests]
    bursts: dict[int, int] = {}
    out = {}
    while not server.idle:
        progress = server.step()
        for ident, new in progress.tokens.items():
            bursts[ident] = bursts.get(ident, 0) + bool(new)
            if ident == ids[2] and ident not in progress.finished:
                server.cancel(ident)
        out.update(progress.finished)
    assert out[ids[2]].cancelled and 0 < len(out[ids[2]].tokens) < len(alone(requests[2]))
    for i, ident in enumerate(ids):
        served = out[ident]
        assert served.tokens == alone(requests[i])[:len(served.tokens)] and served.rounds == bursts[ident], i
        assert served.accepted == len(served.tokens) - bursts[ident]
    assert any(out[ident].accepted for ident in ids), "no draft was ever accepted: the test proves nothing"
    plain = Server(Counting(2), clock=Clock()).serve(mixed(3))
    assert all(served.accepted is None and served.rounds is None for served in plain)


def test_a_batch_runs_the_checked_copies_of_its_requests():
    """generate_batch's requests as Server.submit keeps them (rounds.serving.batch_admitted): plain
    ints and a tuple, the caller's requests untouched (GraphedGreedy counted a budget given as a
    0-d array down in place, so the same request given again generated nothing); the first
    malformed one refused naming its row; a batch of another size refused."""
    from memra_cuda.rounds.serving import batch_admitted
    budget = np.array(3)
    given = [Request([1, 2], budget, np.int64(5)), Request(np.array([4]), 2, None, np.uint64(9))]
    kept = batch_admitted(given, VOCAB, 2)
    assert kept == [Request((1, 2), 3, 5), Request((4,), 2, None, 9)]
    assert all(type(v) is int for r in kept for v in (*r.prompt, r.max_new_tokens, r.seed))
    assert given[0].max_new_tokens is budget and type(kept[0].max_new_tokens) is int
    with pytest.raises(RequestRefused, match=f"request 1 refused: its prompt's token {VOCAB} .at 0. is outside"):
        batch_admitted([given[0], Request([VOCAB], 2)], VOCAB, 2)
    with pytest.raises(ValueError, match=r"need one request per row \(3\), not 2"):
        batch_admitted(given, VOCAB, 3)


def test_an_empty_refusal_refuses_a_batch_as_a_server_saying_no_reason_was_given():
    """A decoder's refusal() returning "" refuses, in a batch (rounds.serving.batch_admitted) as at
    a Server's submit: anything but None is a refusal (the batch admitted the row, where a
    burst's capacity check then raised mid-generation). The message says no reason was given
    rather than ending at "refused: "; None admits."""
    from memra_cuda.rounds.serving import batch_admitted
    given = [Request((1,), 2), Request((2,), 2)]
    refusal = {(1,): None, (2,): ""}
    with pytest.raises(RequestRefused, match=r"^request 1 refused: no reason given$") as refused:
        batch_admitted(given, VOCAB, 2, lambda request: refusal[request.prompt])
    assert (refused.value.ident, refused.value.reason) == (1, "no reason given")
    assert batch_admitted(given, VOCAB, 2, lambda request: None) == given
    decoder = Counting(2)
    decoder.refusal = lambda request: refusal[request.prompt]  # type: ignore[method-assign]
    server = Server(decoder, clock=decoder.clock)
    assert server.submit(given[0]) == 0
    with pytest.raises(RequestRefused, match=r"^request 1 refused: no reason given$"):
        server.submit(given[1])


def test_a_decoders_rows_are_not_taken_from_a_server_with_requests_in_flight():
    """Driven, as the decoders hold it: a new server (which parks every row) and a batch (which
    prefills every row) ended a running server's requests, each reported as finished, its tokens
    cut short. Each is refused while a request is queued, running or waiting for its cancel, and
    allowed once the server is idle or dropped."""
    decoder, driven = Counting(2), Driven()
    driven.take("generate_batch")  # no server yet
    server = driven.by(Server(decoder, clock=decoder.clock))
    driven.take("a new server")  # idle: nothing in flight
    ident = server.submit(Request([1, 2, 3], 30))
    for what in ("a new server", "generate_batch"):
        with pytest.raises(RuntimeError, match=f"{what} would take the rows of this decoder's server"):
            driven.take(what)
    server.step()
    assert server.cancel(ident)
    with pytest.raises(RuntimeError):
        driven.take("a new server")  # its cancel not yet taken
    while not server.idle:
        server.step()
    driven.take("a new server")
    server.submit(mixed(1)[0])
    del server  # dropped with a request queued: nothing drives the rows
    driven.take("a new server")


def test_a_decoders_rows_are_not_taken_from_any_of_its_servers_with_requests_in_flight():
    """Driven kept the last server made alone: a second server, made while the first was idle,
    left the first unguarded, so a batch (or a third server) was allowed while the first ran
    requests, and ended them. Every server made over the rows is kept, each weakly."""
    decoder, driven = Counting(2), Driven()
    first = driven.by(Server(decoder, clock=decoder.clock))
    second = driven.by(Server(decoder, clock=decoder.clock))  # the first idle: allowed
    first.submit(Request([1, 2, 3], 30))
    first.step()
    with pytest.raises(RuntimeError, match="generate_batch would take the rows of this decoder's server"):
        driven.take("generate_batch")
    del first  # dropped with a request running: nothing it holds is anyone's
    driven.take("generate_batch")
    assert second.idle


def test_a_rows_admission_or_park_by_the_engine_is_refused_while_a_server_has_requests_in_flight():
    """A decoder's admit() (and the plain loop's park()) called by the engine while a server over
    the rows had requests in flight took a row the server held: an admission overwrote a running
    request's row (GraphedGreedy: it ended cut short, its last tokens of another prompt), a park
    ended it as stopped. Driven.take_row refuses them, naming the call, from anything but a
    server's own step, whose admissions and parks (a cancel's, a refusal's) go on as before;
    once the server is idle, the rows are the engine's again."""

    class Guarded(Counting):  # a decoder that guards its rows as GraphedGreedy does
        def admit(self, row, request):
            self.driven.take_row("admit()")
            super().admit(row, request)

        def park(self, rows):
            self.driven.take_row("park()")
            super().park(rows)

    decoder = Guarded(2)
    decoder.driven = Driven()
    server = Server(decoder, clock=decoder.clock)  # its parking of every row is allowed: nothing in flight
    first, second = server.submit(Request([1, 2, 3], 30)), server.submit(Request([4, 5], 30))
    for call, what in ((lambda: decoder.admit(1, Request([6], 2)), "admit\\(\\)"),
                       (lambda: decoder.park([0]), "park\\(\\)")):
        with pytest.raises(RuntimeError, match=f"{what} would take the rows of this decoder's server"):
            call()  # queued, not yet in a row: the rows are the server's all the same
    server.step()  # its own admissions
    assert decoder.calls[1:3] == [("admit", 0, (1, 2, 3)), ("admit", 1, (4, 5))]
    with pytest.raises(RuntimeError, match="admit\\(\\) would take the rows"):
        decoder.admit(0, Request([6], 2))
    assert server.cancel(first)
    ended = server.step().finished  # its own park, the cancel's
    assert ended[first].cancelled and ("park", (0,)) in decoder.calls
    while not server.idle:
        ended = server.step().finished
    assert ended[second].tokens == alone(Request([4, 5], 30)), "the server's request lost its row"
    decoder.admit(0, Request([6], 2))  # idle: the engine's rows again
    decoder.park([0])


class Guarded(Counting):
    """A decoder that guards its rows as GraphedGreedy and a speculative decoder's server.decoder
    do (Driven.take_row, in each of admit, park, burst and recover). With `pausing`, its next
    burst, once past its guard, signals `inside` and waits for `go_on`: another thread calls in
    there, mid-step."""

    def __init__(self, batch: int):
        super().__init__(batch)
        self.driven = Driven()
        self.pausing = False
        self.inside, self.go_on = threading.Event(), threading.Event()

    def admit(self, row, request):
        self.driven.take_row("admit()")
        super().admit(row, request)

    def burst(self):
        self.driven.take_row("burst()")
        if self.pausing:
            self.pausing = False
            self.inside.set()
            assert self.go_on.wait(30), "the test never let the step go on"
        return super().burst()

    def recover(self):
        self.driven.take_row("recover()")
        return super().recover()

    def park(self, rows):
        self.driven.take_row("park()")
        super().park(rows)


def test_a_rows_admission_park_or_burst_from_another_thread_is_refused_as_a_server_steps():
    """Driven.take_row exempted every call made while a server over the rows stepped (its flag a
    bool): another thread's decoder.admit(), park(), burst() or recover(), made as the server
    stepped on its own thread, got through and took the server's rows (an admission over the row
    its request ran in, a park that ended it as stopped, a burst whose tokens the server never
    saw). The exemption is the server's own calls alone (Server._into): the other thread is refused mid-step, as
    between steps, the server's own calls go on, and its request ends as its own."""
    decoder = Guarded(2)
    server = Server(decoder, clock=decoder.clock)
    request = Request([1, 2, 3], 30)
    ident = server.submit(request)
    ended: dict = {}
    failed: list[BaseException] = []

    def step() -> None:
        try:
            ended.update(server.step().finished)
        except BaseException as exc:  # handed to the test's thread
            failed.append(exc)

    decoder.pausing = True
    stepper = threading.Thread(target=step)
    stepper.start()
    try:
        assert decoder.inside.wait(30), "the step never reached its burst"
        for call, what in ((lambda: decoder.admit(1, Request([6], 2)), "admit\\(\\)"),
                           (lambda: decoder.park([0]), "park\\(\\)"), (decoder.burst, "burst\\(\\)"),
                           (decoder.recover, "recover\\(\\)")):
            with pytest.raises(RuntimeError, match=f"{what} would take the rows of this decoder's server"):
                call()  # from this thread, as the server steps on its own
    finally:
        decoder.go_on.set()
        stepper.join(30)
    assert not stepper.is_alive() and not failed, failed
    assert decoder.calls == [("park", (0, 1)), ("admit", 0, (1, 2, 3)), ("burst",)], "a call by hand got through"
    while not server.idle:
        ended.update(server.step().finished)
    assert ended[ident].tokens == alone(request) and not ended[ident].cancelled, "the server's request lost its row"
    decoder.admit(1, Request([6], 2))  # idle: the rows are the engine's again, from any thread
    decoder.park([1])


def test_a_rows_admission_park_or_burst_from_the_servers_own_clock_is_refused_mid_step():
    """The stepping thread was exempt for the whole step, so a call by hand on it mid-step got
    through: the server's clock (or any callback it runs) calling decoder.burst() ran the rows,
    a burst whose tokens the server never saw. The exemption is the server's own calls into the
    rows now (Server._into): the clock's calls are refused, the server's go on, and its request
    ends as its own."""
    decoder = Guarded(2)
    tick, by_hand = decoder.clock, []

    def clock() -> float:
        if by_hand == []:  # armed: the step's first reading
            for call, what in ((lambda: decoder.admit(1, Request([6], 2)), "admit"),
                               (lambda: decoder.park([0]), "park"), (decoder.burst, "burst"),
                               (decoder.recover, "recover")):
                try:
                    call()
                    by_hand.append(f"{what} got through")
                except RuntimeError as exc:
                    by_hand.append(str(exc))
        return tick()

    server = Server(decoder, clock=tick)
    request = Request([1, 2, 3], 30)
    ident = server.submit(request)
    server.clock, by_hand = clock, []
    ended = dict(server.step().finished)
    server.clock = tick
    refused = "would take the rows of this decoder's server"
    assert len(by_hand) == 4 and all(refused in said for said in by_hand), by_hand
    assert decoder.calls == [("park", (0, 1)), ("admit", 0, (1, 2, 3)), ("burst",)], "a call by hand got through"
    while not server.idle:
        ended.update(server.step().finished)
    assert ended[ident].tokens == alone(request) and not ended[ident].cancelled


def test_two_servers_over_one_decoder_never_run_requests_at_once():
    """Two servers made while both were idle each held every row free: the second's requests were
    admitted into the rows the first's ran in, and a request ended with another's tokens (on
    GraphedGreedy, one request's from its fourth token on, the other's cut short, neither
    cancelled, nothing raised). A submit to one is refused while the other has requests in
    flight, before it takes an id; once that one is idle, each serves its own."""
    decoder = Counting(1)
    decoder.driven = Driven()
    first, second = Server(decoder, clock=decoder.clock), Server(decoder, clock=decoder.clock)
    a, b = Request([1, 2, 3], 9), Request([4, 5], 9)
    ident = first.submit(a)
    first.step()
    with pytest.raises(RuntimeError, match="a request submitted to another server over its rows would take the rows"):
        second.submit(b)
    assert second.idle
    ended: dict = {}
    while not first.idle:
        ended.update(first.step().finished)
    assert ended[ident].tokens == alone(a) and not ended[ident].cancelled
    assert second.submit(b) == 0  # the refused submit took no id
    with pytest.raises(RuntimeError, match="would take the rows of this decoder's server"):
        first.serve([a])
    while not second.idle:
        ended = second.step().finished
    assert ended[0].tokens == alone(b)
    assert [out.tokens for out in first.serve([a, b])] == [alone(a), alone(b)]


def taken_mid_serve(decoder) -> tuple[Server, Server]:
    """Two servers over `decoder`'s one row, the first's clock letting the second take it between the
    first serve()'s two submissions (its second reading): the second submits a request of its own
    and steps, admitting it, so the first's serve() is refused its next admission."""
    readings = []

    def clock() -> float:
        readings.append(1)
        if len(readings) == 2:
            second.submit(Request([4, 5], 9))
            second.step()
        return decoder.clock()

    first, second = Server(decoder, clock=clock), Server(decoder, clock=decoder.clock)
    return first, second


def test_a_server_holding_only_ends_to_hand_out_is_refused_a_submit_while_another_runs():
    """The check asked whether the server was idle, which a server is not while an end waits for
    its next step: one holding only a refusal's end (its serve() cut short as the other server
    took the rows from its clock) took a submit, and admitted it into the row the other's
    request ran in. What counts is a request in flight, not an end to hand out."""
    decoder = Counting(1)
    decoder.driven = Driven()
    first, second = taken_mid_serve(decoder)
    with pytest.raises(RuntimeError, match="would take the rows of this decoder's server"):
        first.serve([Request([VOCAB], 2), Request([1, 2], 3)])  # the first refused, the second stopped
    assert not first.idle  # the refusal's end, for its next step
    with pytest.raises(RuntimeError, match="a request submitted to another server over its rows would take"):
        first.submit(Request([1, 2], 3))
    ended: dict = {}
    while not second.idle:
        ended.update(second.step().finished)
    assert ended[0].tokens == alone(Request([4, 5], 9))
    assert first.step().finished[0].refused is not None and first.idle


def test_a_server_holding_only_ends_to_hand_out_does_not_refuse_another_servers_own_step():
    """Driven.take_row refused a call into the rows while any other server over them was not
    idle, which a server holding only ends for its next step to hand out is not (its serve() cut
    short as the other server took the rows from its clock): it holds no row, yet the other's own
    step was refused, its burst (and any admission) a RuntimeError at every step until the first
    stepped. What counts is a request in flight; the other's step runs, and its request ends as
    its own (a decoder that guards its rows as GraphedGreedy does)."""
    decoder = Guarded(1)
    first, second = taken_mid_serve(decoder)
    with pytest.raises(RuntimeError, match="would take the rows of this decoder's server"):
        first.serve([Request([VOCAB], 2), Request([1, 2], 3)])
    assert not first.idle and not first.in_flight and first.unreported == [0]  # the refusal's end: no row held
    assert not second.idle
    with pytest.raises(RuntimeError, match="burst\\(\\) would take the rows"):
        decoder.burst()  # by hand, though, while the second's request runs
    ended: dict = {}
    while not second.idle:
        ended.update(second.step().finished)
    assert ended[0].tokens == alone(Request([4, 5], 9)) and not ended[0].cancelled
    assert first.step().finished[0].refused is not None and first.idle


def test_a_serve_whose_request_a_step_not_its_own_ended_raises_rather_than_steps_forever():
    """A step outside serve() (its clock, or the decoder's refusal, calling step() between its
    submissions) handed out one of serve()'s requests' ends: serve() stepped the idle server for
    ever, waiting for it. It raises naming the request, once nothing is left in flight, and its
    other requests' ends come from the next step, as after any serve() that raised."""
    decoder = Counting(2)
    readings, took = [], {}

    def clock() -> float:
        readings.append(decoder.clock())
        assert len(readings) < 1000, "serve() kept stepping an idle server"
        if len(readings) == 2:  # before serve()'s second submission: its first is queued
            took.update(server.step().finished)
        return decoder.clock()

    server = Server(decoder, clock=clock)
    quick, slow = Request([1, 2], 1), Request([3], 4)
    with pytest.raises(RuntimeError, match=r"serve\(\)'s request\(s\) \[0\] ended in a step not serve\(\)'s"):
        server.serve([quick, slow])
    assert list(took) == [0] and took[0].tokens == alone(quick)
    rest = server.step().finished  # as after any serve() that raised: its requests that had ended
    assert list(rest) == [1] and rest[1].tokens == alone(slow) and server.idle


def test_serve_inside_a_step_is_refused_before_it_submits_anything():
    """serve() called by the clock of a step of the same server submitted its requests, then met
    the refusal of its own step inside that step; the ends it left (a refusal's) were dropped as
    the outer step raised, an id taken and never handed out. It is refused first."""
    decoder = Counting(2)
    calls = []

    def clock() -> float:
        if not calls:
            calls.append(1)
            server.serve([Request([1], 2), Request([VOCAB], 2)])  # the second would be refused
        return decoder.clock()

    server = Server(decoder, clock=clock)
    with pytest.raises(RuntimeError, match=r"serve\(\) was called while a step of this server runs"):
        server.step()
    assert server.idle and server.submit(Request([1], 2)) == 0


def test_a_set_of_requests_is_refused_its_order_being_its_hashes():
    """serve() and a batch took a set, and handed the results back in its iteration order, the
    hashes' (a row each in that order too): the caller could not tell whose each was."""
    from memra_cuda.rounds.serving import batch_admitted
    decoder = Counting(2)
    server = Server(decoder, clock=decoder.clock)
    requests = [Request((9,), 1), Request((1,), 1)]
    for given in (set(requests), frozenset(requests), dict.fromkeys(requests)):
        with pytest.raises(TypeError, match=r"serve\(\) takes a sequence of requests \(a list\)"):
            server.serve(given)
        with pytest.raises(TypeError, match=r"a batch takes a sequence of requests \(a list\)"):
            batch_admitted(given, VOCAB, 2)
    assert server.idle


def test_a_request_submitted_by_another_during_serve_is_handed_out_by_the_next_step():
    """serve() read every request that ended as one of its own: a request submitted meanwhile
    (the decoder calling back, another thread) was a KeyError, and every result of the call
    was lost. Its own come back in order; the other's end comes from the next step()."""
    decoder = Counting(2)
    server = Server(decoder, clock=decoder.clock)
    mine, theirs = [Request([1, 2], 6), Request([3], 2)], Request([4, 5], 3)
    burst, given = decoder.burst, []

    def submitting():
        if not given:
            given.append(server.submit(theirs))
        return burst()

    decoder.burst = submitting
    served = server.serve(mine)
    decoder.burst = burst
    assert [out.tokens for out in served] == [alone(r) for r in mine]
    ended: dict = {}
    while not server.idle:
        ended.update(server.step().finished)
    assert list(ended) == given and ended[given[0]].tokens == alone(theirs)


def test_a_server_holding_only_ends_to_hand_out_is_named_so_where_it_keeps_the_rows():
    """Driven.take counts a server not idle, its ends for the next step to hand out too (a
    request another submitted during serve(), say): it said that server "has requests in
    flight", which it had none of, and "a cancel ends its request", of a request already ended.
    It says what the server holds, and that step() hands it out."""
    decoder, driven = Counting(2), Driven()
    server = driven.by(Server(decoder, clock=decoder.clock))
    burst, given = decoder.burst, []

    def submitting():
        if not given:
            given.append(server.submit(Request([4, 5], 1)))
        return burst()

    decoder.burst = submitting
    server.serve([Request([1, 2], 12)])
    assert not server.in_flight and not server.idle, "the other's request did not end inside serve()"
    assert server.unreported == [1]
    with pytest.raises(RuntimeError, match=r"generate_batch would take the rows of this decoder's server, which "
                                           r"holds the end of request\(s\) \[1\] for its next step\(\) to hand out"):
        driven.take("generate_batch")
    assert list(server.step().finished) == given and server.idle and server.unreported == []
    driven.take("generate_batch")


def test_what_a_server_holds_is_said_by_its_own_members():
    """Driven read a server's privates (its live requests, its ends for the next step, the
    thread it calls its rows on) to say whether the rows are taken. The server says so itself:
    in_flight (a request queued, running or waiting for its cancel), unreported (the ends its
    next step hands out) and calling(thread) (its own call into the rows, on that thread)."""
    decoder = Counting(1)
    server = Server(decoder, clock=decoder.clock)
    me = threading.get_ident()
    assert not server.in_flight and server.unreported == [] and not server.calling(me)
    first, second = server.submit(Request([1], 1)), server.submit(Request([2], 1))
    assert server.in_flight and not server.idle
    seen = []
    burst = decoder.burst
    decoder.burst = lambda: seen.append((server.calling(me), server.calling(me + 1))) or burst()
    assert list(server.step().finished) == [first] and seen == [(True, False)] and not server.calling(me)
    assert server.cancel(second) and server.in_flight
    assert list(server.step().finished) == [second] and not server.in_flight and server.idle


class FailingClock(Clock):
    """The test's clock, raising at its next reading once `failing` is set."""

    failing = False

    def __call__(self) -> float:
        if self.failing:
            self.failing = False
            raise OSError("the clock failed")
        return self.now


def test_a_burst_whose_readback_time_the_clock_failed_to_give_is_recorded_by_the_next_step():
    """The clock raised as the step read its burst back: the burst's tokens were dropped (the
    decoder's rows had gone on), and so were the ends of the requests that ended earlier in the
    step; a request that stopped in the burst ended at a later one with none of its tokens. The
    next step records that burst, stamped with its own reading, and runs none of its own."""
    clock = FailingClock()
    decoder = Counting(2, clock)
    server = Server(decoder, clock=clock)
    requests = [Request([1, 2], 1), Request([3], 9), Request([4], 0)]
    ids = [server.submit(request) for request in requests]
    burst = decoder.burst

    def failing():
        out = burst()
        clock.failing = True
        return out

    decoder.burst = failing
    with pytest.raises(OSError, match="the clock failed"):
        server.step()
    decoder.burst = burst
    assert not server.idle
    clock.now = 7.0
    progress = server.step()
    assert decoder.calls.count(("burst",)) == 1, "the step that records the burst ran one of its own"
    assert progress.at == 7.0 and set(progress.tokens) == {ids[0], ids[1]} and sorted(progress.finished) == ids[::2]
    out = dict(progress.finished)
    while not server.idle:
        out.update(server.step().finished)
    assert [out[ident].tokens for ident in ids] == [alone(request) for request in requests]
    assert out[ids[0]].arrivals == [7.0] and out[ids[0]].finished == 7.0


def test_ends_left_to_a_step_whose_clock_raised_at_its_start_are_handed_out_by_the_next():
    """A step that raised leaves the requests that ended in it to the next; where that one's
    clock raised as it began, they were dropped, never reported."""
    clock = FailingClock()
    decoder = Counting(1, clock)
    server = Server(decoder, clock=clock)
    running = server.submit(Request([1], 9))
    server.step()
    queued = server.submit(Request([3], 3))
    assert server.cancel(running)
    decoder.failing = 1
    with pytest.raises(RuntimeError, match="the admission failed"):
        server.step()
    clock.failing = True
    with pytest.raises(OSError, match="the clock failed"):
        server.step()
    finished = server.step().finished
    assert finished[running].cancelled
    while not server.idle:
        finished.update(server.step().finished)
    assert sorted(finished) == [running, queued] and finished[queued].tokens == alone(Request([3], 3))


def test_the_requests_of_a_serve_that_raised_that_had_ended_are_handed_out_by_the_next_step():
    """serve() raised (an interrupt in a burst): the requests of it still in flight were handed
    out by later steps, but those that had ended before were lost, reported nowhere."""
    decoder = Counting(1)
    server = Server(decoder, clock=decoder.clock)
    requests = [Request([1, 2], 1), Request([3], 9)]
    burst = decoder.burst

    def interrupted():
        if decoder.calls.count(("burst",)) == 1:
            raise KeyboardInterrupt
        return burst()

    decoder.burst = interrupted
    with pytest.raises(KeyboardInterrupt):
        server.serve(requests)
    decoder.burst = burst
    finished = {}
    while not server.idle:
        finished.update(server.step().finished)
    assert sorted(finished) == [0, 1] and [finished[i].tokens for i in (0, 1)] == [alone(r) for r in requests]


def test_one_request_given_for_a_sequence_of_them_is_a_type_error_saying_so():
    """A Request is a tuple of its five fields: serve(request) read each field as a request
    (refusing its prompt as no Request), and a batch of two given one counted five requests."""
    from memra_cuda.rounds.serving import batch_admitted
    request = Request([1, 2], 3)
    decoder = Counting(2)
    server = Server(decoder, clock=decoder.clock)
    with pytest.raises(TypeError, match=r"serve\(\) takes a sequence of requests, not one Request: give \[request\]"):
        server.serve(request)
    for batch in (2, 5):
        with pytest.raises(TypeError, match="a batch takes a sequence of requests, not one Request"):
            batch_admitted(request, VOCAB, batch)
    assert server.idle and server.serve([request])[0].tokens == alone(request)


@pytest.mark.parametrize("given", [None, 5, "ab"], ids=["None", "int", "str"])
def test_what_is_no_sequence_of_requests_is_a_type_error_naming_it(given):
    """serve(None), serve(5) and a batch of None met "object of type 'NoneType' has no len()";
    a string was read one character a request. Each is refused naming what was given; any
    other iterable of requests is taken, a generator too."""
    from memra_cuda.rounds.serving import batch_admitted
    decoder = Counting(2)
    server = Server(decoder, clock=decoder.clock)
    with pytest.raises(TypeError, match=rf"serve\(\) takes a sequence of requests \(a list\), not {given!r}"):
        server.serve(given)
    with pytest.raises(TypeError, match=rf"a batch takes a sequence of requests \(a list\), not {given!r}"):
        batch_admitted(given, VOCAB, 2)
    requests = [Request([1, 2], 3), Request([4], 2)]
    assert [s.tokens for s in server.serve(r for r in requests)] == [alone(r) for r in requests]  # any iterable
    assert batch_admitted((r for r in requests), VOCAB, 2) == batch_admitted(requests, VOCAB, 2)


def test_a_server_made_directly_over_a_decoder_that_keeps_its_servers_is_one_of_them():
    """Server(decoder) over a decoder with a `driven` (GraphedGreedy's) was unknown to it: its
    requests ran in rows the decoder's batch then prefilled over, and a second server parked
    them. Now the server tells the decoder's Driven, as the decoder's own server() does."""
    decoder = Counting(2)
    decoder.driven = Driven()
    server = Server(decoder, clock=decoder.clock)
    server.submit(Request([1, 2, 3], 30))
    with pytest.raises(RuntimeError, match="generate_batch would take the rows of this decoder's server"):
        decoder.driven.take("generate_batch")
    with pytest.raises(RuntimeError, match="a new server would take the rows"):
        Server(decoder, clock=decoder.clock)
    assert decoder.calls == [("park", (0, 1))], "the refused server parked the rows"
    while not server.idle:
        server.step()
    Server(decoder, clock=decoder.clock)  # idle: allowed


def test_a_burst_whose_readback_an_interrupt_cut_short_is_handed_out_by_the_next_step_first():
    """An interrupt in a burst's wait: the burst ran (the rows moved on), its tokens unread. The
    next step asks the decoder to recover it before any cancel or admission (a row changing hands
    would make it another request's), so every request keeps every token; a cancel asked
    meanwhile takes effect at the step after. Without it, the next burst overwrote the tokens:
    each request lost that burst's, and one that stopped in it ended later with fewer, silently."""
    decoder = Counting(2, drafts=True)
    server = Server(decoder, clock=decoder.clock)
    requests = mixed(6)
    ids = [server.submit(request) for request in requests]
    out = dict(server.step().finished)
    decoder.interrupting = 1
    with pytest.raises(KeyboardInterrupt):
        server.step()
    running = [ident for ident in server._slots if ident is not None]  # the rows the cut burst ran
    assert server.cancel(running[0])
    decoder.calls.clear()
    recovered = server.step()
    assert decoder.calls == [("recover",)], "the step that recovers a burst ran anything else"
    assert set(recovered.tokens) == set(running) and recovered.at is not None
    out.update(recovered.finished)
    while not server.idle:
        out.update(server.step().finished)
    assert out[running[0]].cancelled or running[0] in recovered.finished
    for ident, request in zip(ids, requests):
        if not out[ident].cancelled:
            assert out[ident].tokens == alone(request), f"request {ident} lost tokens"
        assert out[ident].tokens == alone(request)[:len(out[ident].tokens)]


@pytest.mark.parametrize("decoder_recovers", [True, False], ids=["nothing to recover", "no recover"])
def test_a_burst_that_raised_with_nothing_to_recover_leaves_the_next_step_to_go_on(decoder_recovers):
    """burst() raised before it ran anything (a capacity refusal, say), or the decoder has no
    recover(): the next step is a whole one, its cancels first; it does not ask again (a burst
    that raised as it was queued, asked for at every step, left the server stuck)."""
    decoder = Counting(1)
    server = Server(decoder, clock=decoder.clock)
    ids = [server.submit(Request([1], 9)), server.submit(Request([2], 3))]
    server.step()
    burst, asked = decoder.burst, []

    def refused():
        decoder.burst = burst
        raise CapacityError("a row would pass its cache")

    decoder.burst = refused
    if not decoder_recovers:
        decoder.recover = None  # getattr finds None: the server asks a decoder without recover nothing
    else:
        recover = decoder.recover
        decoder.recover = lambda: asked.append(1) or recover()
    with pytest.raises(CapacityError):
        server.step()
    assert server.cancel(ids[0])
    done = server.step().finished
    assert done[ids[0]].cancelled, "the cancel waited for a step that only asked for a burst"
    while not server.idle:
        done.update(server.step().finished)
    assert done[ids[1]].tokens == alone(Request([2], 3))
    assert asked == ([1] if decoder_recovers else [])


def test_a_recover_that_raises_is_not_asked_again():
    """The decoder's recover() raised an Exception (its failure, which asking again would repeat):
    the server asks no more, and the step after goes on as a whole one, its cancels first; an
    interrupt cut short at every step asked for ever, none of them taking a cancel."""
    decoder = Counting(1)
    server = Server(decoder, clock=decoder.clock)
    ids = [server.submit(Request([1], 9)), server.submit(Request([2], 3))]
    server.step()
    decoder.interrupting = 1
    with pytest.raises(KeyboardInterrupt):
        server.step()

    def failing():
        raise RuntimeError("the readback could not be read")

    decoder.recover = failing
    with pytest.raises(RuntimeError, match="could not be read"):
        server.step()
    assert server.cancel(ids[0])
    done = server.step().finished
    assert done[ids[0]].cancelled
    while not server.idle:
        done.update(server.step().finished)
    assert done[ids[1]].tokens == alone(Request([2], 3))


@pytest.mark.parametrize("short", ["tokens", "done", "accepted"])
def test_a_burst_of_fewer_rows_than_the_batch_is_refused_naming_both_and_changes_no_request(short):
    """A decoder whose Burst held fewer rows than its batch met an IndexError as the server read
    its news. A ValueError naming the burst's rows and the batch now, before any request changes:
    their tokens are the last burst's, and the next step ends them cancelled (the burst dropped:
    recorded again, it would raise again, at every step; run on, each request would lack its
    tokens, a hole in its output)."""
    decoder = Counting(2, drafts=True)
    server = Server(decoder, clock=decoder.clock)
    ids = [server.submit(Request([1], 9)), server.submit(Request([2], 9))]
    before = server.step().tokens
    burst = decoder.burst

    def one_row():  # the burst ran every row, and its decoder gives one row's `short`
        out = burst()
        return out._replace(**{short: getattr(out, short)[:1]})

    decoder.burst = one_row
    counts = {"tokens": 2, "done": 2, "accepted": 2, short: 1}
    with pytest.raises(ValueError, match=re.escape(
            "the decoder's burst has news of fewer rows than its batch of 2 (tokens of {tokens}, done of {done}, "
            "accepted of {accepted})".format(**counts))):
        server.step()
    decoder.burst = burst
    done = server.step().finished  # the rows ran past the dropped burst's tokens: their requests end cancelled
    assert [done[ident].tokens for ident in ids] == [before[ident] for ident in ids], "the burst's news was recorded"
    assert all(done[ident].cancelled for ident in ids) and server.idle


@pytest.mark.parametrize("news, said", [
    (lambda out: out._replace(tokens=[out.tokens[0], None]), "NoneType"),
    (lambda out: None, "a decoder's burst() returns a memra_cuda.rounds.Burst(tokens, done, accepted), not None"),
    (lambda out: (out.tokens, out.done), "a decoder's burst() returns a memra_cuda.rounds.Burst(tokens, done, "
                                          "accepted), not ([")])
def test_a_burst_whose_news_cannot_be_read_ends_its_requests_rather_than_leave_a_hole(news, said):
    """A burst of every row whose news cannot be read (a row's tokens None; no Burst at all, which
    met "'NoneType' object has no attribute 'tokens'", naming nothing) raised as it was read, and
    was dropped; its requests ran on from rows that had gone past its tokens, each with a hole in
    its output, silently. They end cancelled at the next step, with the tokens read before."""
    decoder = Counting(2, drafts=True)
    server = Server(decoder, clock=decoder.clock)
    ids = [server.submit(Request([1], 9)), server.submit(Request([2], 9))]
    before = server.step().tokens
    burst = decoder.burst

    def unreadable():  # the burst ran every row, and its decoder gives news that cannot be read
        return news(burst())

    decoder.burst = unreadable
    with pytest.raises(TypeError, match=re.escape(said)):
        server.step()
    decoder.burst = burst
    done = server.step().finished
    assert [done[ident].tokens for ident in ids] == [before[ident] for ident in ids], "the burst's news was recorded"
    assert all(done[ident].cancelled for ident in ids) and server.idle


def _idle(server: Server) -> dict[int, Served]:
    """Every request's end, stepping until the server is idle: none ends twice, and it goes idle."""
    out: dict[int, Served] = {}
    for _ in range(200):
        if server.idle:
            return out
        for ident, served in server.step().finished.items():
            assert ident not in out, f"request {ident} ended twice"
            out[ident] = served
    raise AssertionError("the server never went idle")


def test_a_serve_that_raised_hands_out_its_refusals_too(monkeypatch):
    """A request refused at submit inside a serve() that an interrupt then cut short: its end is
    handed out by the next step, as those of its requests that ran are (it was in serve()'s own
    list alone, and reported nowhere)."""
    decoder = Counting(1)
    server = Server(decoder, clock=decoder.clock)
    interrupt_once(monkeypatch, decoder, "burst", waited=False)
    requests = [Request([1], 3), Request([VOCAB], 3)]  # the second names a token outside the vocabulary: id 1
    with pytest.raises(KeyboardInterrupt):
        server.serve(requests)
    out = _idle(server)
    assert sorted(out) == [0, 1] and out[0].tokens == alone(requests[0])
    assert out[1].refused is not None and "outside the vocabulary" in out[1].refused


@pytest.mark.parametrize("lower_row_freed", [False, True], ids=["same row", "another row"])
def test_an_admission_an_interrupt_cut_short_leaves_no_row_running_for_no_request(monkeypatch, lower_row_freed):
    """Ctrl-C as the decoder's admit returns (the row started): the row is parked, the request
    admitted again by a later step, its output its own. It stayed started while the server held
    the row free: the next admission into it met a live row, or, where another row freed first
    took the request, the decoder ran it twice."""
    decoder = Counting(2)
    server = Server(decoder, clock=decoder.clock)
    first = server.submit(Request([1], 30))
    server.step()
    second = server.submit(Request([2], 6))
    interrupt_once(monkeypatch, decoder, "admit", waited=True)
    with pytest.raises(KeyboardInterrupt):
        server.step()  # request `second` started in row 1, then the interrupt
    assert decoder.rows[1] is None, "the row the admission started runs on, though the server holds it free"
    if lower_row_freed:
        server.cancel(first)
    out = _idle(server)
    assert out[second].tokens == alone(Request([2], 6))
    assert out[first].cancelled if lower_row_freed else out[first].tokens == alone(Request([1], 30))


def test_an_interrupt_between_a_rows_admission_and_the_queue_admits_it_once():
    """Ctrl-C after the admission, before the request leaves the queue: the next step finds it
    admitted and runs it in its row (it admitted it again, into a second row, its tokens twice
    over, and the next request starved)."""
    decoder = Counting(2)
    server = Server(decoder, clock=decoder.clock)
    requests = [Request([1], 6), Request([2], 6)]
    ids = [server.submit(request) for request in requests]
    line = "self._queue.popleft()  # only now: a request whose admission raised is still at the head"
    with interrupt_before(serving, line) as fired, pytest.raises(KeyboardInterrupt):
        server.step()
    assert fired
    out = _idle(server)
    assert [out[i].tokens for i in ids] == [alone(request) for request in requests]


def test_a_submit_an_interrupt_cut_short_leaves_the_server_idle():
    """Ctrl-C inside submit, as its recorded request is queued: no id given, nothing runs, the
    request taken back (a request kept but never queued never ran nor ended: idle never again,
    and a loop stepping until idle stepped for ever)."""
    decoder = Counting(1)
    server = Server(decoder, clock=decoder.clock)
    with interrupt_before(serving, "self._queue.append(ident)") as fired, pytest.raises(KeyboardInterrupt):
        server.submit(Request([1], 3))
    assert fired and server.idle and not server._queue
    assert server.step() == (None, {}, {}) and ("admit", 0, (1,)) not in decoder.calls
    assert server.serve([Request([2], 3)])[0].tokens == alone(Request([2], 3))


def test_a_submit_interrupted_as_it_queues_takes_no_id():
    """Ctrl-C as a submit queued its request took the request back but not its id: the counter
    stayed ahead, the next request's id skipped one, and ids no longer counted the requests in
    submission order (the class's promise). The id goes back with the request now: the ids given
    are consecutive, and the queue holds exactly the requests submitted."""
    decoder = Counting(2)
    server = Server(decoder, clock=decoder.clock)
    first = server.submit(Request([1], 4))
    with interrupt_before(serving, "self._queue.append(ident)") as fired, pytest.raises(KeyboardInterrupt):
        server.submit(Request([2], 4))
    assert fired
    requests = [Request([3], 5), Request([4, 5], 3)]
    ids = [server.submit(request) for request in requests]
    assert [first, *ids] == [0, 1, 2] and list(server._queue) == [0, 1, 2] and sorted(server._live) == [0, 1, 2]
    out = _idle(server)
    assert [out[i].tokens for i in ids] == [alone(request) for request in requests]
    assert out[first].tokens == alone(Request([1], 4))


@pytest.mark.parametrize("line", ["self._live[ident] = _Running(checked, submitted)", "self._queue.append(ident)"],
                         ids=["before its record", "before its queueing"])
def test_a_step_by_another_thread_inside_a_submit_never_loses_the_request(line):
    """Another thread's step landing inside a submit, between its queueing and its request's
    record (a submit meanwhile is allowed: serve()'s and step()'s docstrings), found an id queued
    with no request and dropped it, as an interrupted submit's: the request, recorded after, was
    live but in no queue and no row, never ran nor ended, and the server was never idle again (a
    loop stepping until idle stepped for ever, serve() too). Recorded before it is queued, the
    request is one that step leaves for the next, which admits it; a step before either sees
    nothing of it."""
    decoder = Counting(1)
    server = Server(decoder, clock=decoder.clock)
    steps: list = []
    request = Request([1, 2], 5)
    with acting_before(serving, line, lambda: steps.append(server.step())) as fired:
        ident = server.submit(request)
    assert fired and steps == [(None, {}, {})]
    ended = _idle(server)
    assert ended[ident].tokens == alone(request) and not ended[ident].cancelled


@pytest.mark.parametrize("line", ["if queued:  # after its end: an interrupt between the two leaves an id _admit "
                                  "drops, where one", "self._queue.popleft()"], ids=["cancel", "refusal"])
def test_an_interrupt_between_an_end_and_the_queue_leaves_it_ended_once(line):
    """Ctrl-C as a queued request cancelled, or refused at its admission, has ended but not yet
    left the queue: the next step hands its end out and drops its id (it left the queue but had
    not ended: every later step raised, or it never ended)."""
    decoder = Counting(1)
    server = Server(decoder, clock=decoder.clock)
    running = server.submit(Request([1], 9))
    server.step()
    queued = server.submit(Request([2], 3))
    if line == "self._queue.popleft()":
        server.cancel(running)
        decoder.failure, decoder.failing = (lambda: ValueError("no room")), 1
    else:
        server.cancel(queued)
    with interrupt_before(serving, line) as fired, pytest.raises(KeyboardInterrupt):
        server.step()
    assert fired
    out = _idle(server)
    refusal = line == "self._queue.popleft()"
    assert sorted(out) == [running, queued] and out[running].cancelled == refusal
    assert "no room" in (out[queued].refused or "") if refusal else out[queued].cancelled


def test_a_decoders_own_refusal_naming_another_request_leaves_serve_its_own():
    """A decoder whose refusal() raises a RequestRefused of its own (naming its row 0) inside a
    serve(): the refusal is the request's serve() submitted, and serve() returns (it read the
    refusal's id as the request's and waited for ever for the other's place)."""
    decoder = Counting(1)
    server = Server(decoder, clock=decoder.clock)
    own, calls = decoder.refusal, []

    def refusal(request):
        calls.append(request)
        if len(calls) == 2:
            raise RequestRefused(0, "the decoder's own, naming its row 0")
        return own(request)

    decoder.refusal = refusal
    steps, step = [], server.step

    def bounded():
        steps.append(1)
        assert len(steps) < 100, "serve() never returned"
        return step()

    server.step = bounded  # type: ignore[method-assign]
    first, second = server.serve([Request([1], 3), Request([2], 3)])
    assert first.tokens == alone(Request([1], 3)) and "the decoder's own" in (second.refused or "")
    # the refusal names the id the request took, not the decoder's row (request 0 was served)
    assert (second.refused or "").startswith("request 1 refused: the decoder's own")
    calls.clear()
    server.submit(Request([1], 3))
    with pytest.raises(RequestRefused, match="request 3 refused: the decoder's own") as refused:
        server.submit(Request([2], 3))
    assert refused.value.ident == 3 and refused.value.__cause__.ident == 0


def test_a_clock_that_is_no_function_is_refused_where_the_server_is_made():
    """A clock of None met "'NoneType' object is not callable" at the first submit, its id taken."""
    for clock in (None, 3.0, "perf_counter"):
        with pytest.raises(TypeError, match="a server's clock is a function giving seconds"):
            Server(Counting(1), clock=clock)  # type: ignore[arg-type]


def test_a_clock_reading_that_is_no_finite_number_is_refused_as_the_clocks_failure():
    """A clock giving None or text was taken, its readings stamped on every Served, whose latency
    then met "unsupported operand type(s) for -" naming nothing; one giving NaN made every time
    and latency NaN, silently. A reading that is no finite real number (a bool neither: True was
    1 second) is refused, naming it, as a clock that raises is: a submit takes no id and queues
    nothing, and a burst read back is kept for the next step to record. The largest finite
    readings are taken, as floats (a numpy float's too)."""
    for reading, error, named in ((None, TypeError, "must be a real number, not None"),
                                  ("1.0", TypeError, "must be a real number, not '1.0'"),
                                  (True, TypeError, "must be a real number, not True"),
                                  (math.nan, ValueError, "must be a finite number of seconds, not nan"),
                                  (math.inf, ValueError, "must be a finite number of seconds, not inf"),
                                  (-math.inf, ValueError, "must be a finite number of seconds, not -inf")):
        decoder = Counting(1)
        server = Server(decoder, clock=lambda reading=reading: reading)
        with pytest.raises(error, match=f"^a server's clock reading {named}$"):
            server.submit(Request([1, 2], 3))
        assert server.idle and decoder.calls == [("park", (0,))]
        server.clock = decoder.clock
        assert server.submit(Request([1, 2], 3)) == 0, "the refused reading took an id"
        server.step()
        server.clock = lambda reading=reading: reading
        with pytest.raises(error, match=f"^a server's clock reading {named}$"):
            server.step()  # its burst read back, and kept
        server.clock = decoder.clock
        out = server.step()
        assert decoder.calls.count(("burst",)) == 2 and out.at == decoder.clock.now
    for reading in (sys.float_info.max, -sys.float_info.max, np.float32(2.5), 10**300):
        server = Server(Counting(1), clock=lambda reading=reading: reading)
        served = server.serve([Request([1, 2], 3)])[0]
        assert type(served.submitted) is float and served.submitted == served.finished == float(reading)


@pytest.mark.parametrize("prompt, named", [([2**64], f"{2**64} \\(at 0\\)"), ([1, 2**63], f"{2**63} \\(at 1\\)"),
                                           ([-1, 2**63], "-1 \\(at 0\\)"), ([np.uint64(3), -1], "-1 \\(at 1\\)")],
                         ids=["2**64", "2**63", "negative first", "uint64 beside a negative"])
def test_a_prompt_of_ints_past_int64_is_refused_as_outside_the_vocabulary(prompt, named):
    """numpy reads such a list as objects or floats, and the refusal said the prompt was no token
    ids (ints), which it is: its first token outside the vocabulary is named, as any other's."""
    server = Server(Counting(1))
    with pytest.raises(RequestRefused, match=f"its prompt's token {named} is outside the vocabulary of {VOCAB}"):
        server.submit(Request(prompt, 3))
    for prompt in ([1.0, 2], [True, 2], [[1], [2]]):
        with pytest.raises(RequestRefused, match="must be a sequence of at least one token id"):
            server.submit(Request(prompt, 3))


def refused_as_no_prompt(given):
    """`given`, as a request's prompt, refused as what is no prompt at every entry, a TypeError
    whatever its length (a row's most given or not), the server's refusal saying so alike."""
    from memra_cuda.driver.values import as_prompt, token_ids
    from memra_cuda.rounds.serving import admitted, batch_admitted
    shown = re.escape(reprlib.repr(given))
    named = f"its prompt must be a sequence of at least one token id \\(an int\\), not {shown}$"
    for most in (None, 1, CAPACITY):
        with pytest.raises(TypeError, match=f"^{named}"):
            as_prompt(given, VOCAB, "its prompt", most)
    with pytest.raises(TypeError, match="^row 0's prompt must be token ids \\(ints\\)"):
        token_ids(given, VOCAB, "row 0's prompt")  # a stack's prefill's check
    server = Server(Counting(1))
    with pytest.raises(RequestRefused, match=f"^request 0 refused: {named}"):
        server.submit(Request(given, 3))
    with pytest.raises(RequestRefused, match=f"^request 0 refused: {named}"):
        batch_admitted([Request(given, 3)], VOCAB, 1, longest=CAPACITY)
    with pytest.raises(ValueError, match=f"^a request not admitted: {named}"):
        admitted(Request(given, 3), VOCAB, 0, 1, CAPACITY)
    assert server.idle and server.submit(Request([5, 17], 3)) == 1


@pytest.mark.parametrize("given", [bytearray(b"\x00\x01"), memoryview(b"\x00\x01"), bytearray(), UserString("ab"),
                                   b"\x00\x01"],
                         ids=["bytearray", "memoryview", "empty bytearray", "UserString", "bytes"])
def test_requests_in_bytes_or_text_are_no_sequence_of_requests_whatever_holds_them(given):
    """str and bytes were refused as no sequence of requests, a bytearray, a memoryview or a
    UserString read as one: each of its ints or characters then refused as no Request (another
    message), and an empty bytearray served as no requests at all, [] without a word. Each is
    refused as bytes is, the same TypeError (as_requests, TEXT_LIKE)."""
    from memra_cuda.rounds.serving import batch_admitted
    decoder = Counting(2)
    server = Server(decoder, clock=decoder.clock)
    shown = re.escape(reprlib.repr(given))
    with pytest.raises(TypeError, match=rf"^serve\(\) takes a sequence of requests \(a list\), not {shown}$"):
        server.serve(given)
    with pytest.raises(TypeError, match=rf"^a batch takes a sequence of requests \(a list\), not {shown}$"):
        batch_admitted(given, VOCAB, 2)
    assert server.idle and decoder.calls == [("park", (0, 1))]


@pytest.mark.parametrize("given", [b"\x05\x11", bytearray(b"\x05\x11"), memoryview(b"\x05\x11"), b"", bytearray(),
                                   memoryview(b""), bytearray(CAPACITY + 1)],
                         ids=["bytes", "bytearray", "memoryview", "no bytes", "no bytearray", "no memoryview",
                              "a bytearray past a row"])
def test_a_prompt_of_bytes_is_refused_as_bytes_is_whatever_holds_them(given):
    """A prompt of bytes was refused (a TypeError: numpy read them as one string), while a
    bytearray or a memoryview of the same bytes was read as their ints, tokens 5 and 17 run
    without a word; an empty one was a ValueError, one past a row's room a ValueError by its
    length. Each is refused as bytes is now, the same TypeError."""
    refused_as_no_prompt(given)


@pytest.mark.parametrize("given", [[[1], [2]], [[5, 17]] * (CAPACITY + 2), ((5,),) * (CAPACITY + 2),
                                   [np.array([5, 17])] * (CAPACITY + 2)],
                         ids=["two prompts", "prompts past a row", "tuples past a row", "arrays past a row"])
def test_a_list_of_prompts_given_for_one_is_refused_as_no_prompt_whatever_its_length(given):
    """A list of prompts where one prompt is expected was a TypeError (no token ids) while it
    was short, but one of more prompts than a row takes tokens was refused by its length, as a
    prompt of that many tokens: its type is refused first now, the same TypeError whatever its
    length, its items unread."""
    refused_as_no_prompt(given)


@pytest.mark.parametrize("given", ["", "\x05\x11", np.str_(""), UserString(""), UserString("\x05\x11"),
                                   UserString("x" * (CAPACITY + 1))],
                         ids=["empty", "str", "numpy's", "empty UserString", "UserString", "a UserString past a row"])
def test_a_string_prompt_is_refused_alike_empty_or_not(given):
    """A str prompt was a TypeError, "" and "ab" alike, but a UserString (a Sequence, of its
    characters) was not: an empty one was a ValueError, one past a row's room a ValueError by its
    length, each saying another thing. Every string prompt is refused as a str is now: the same
    TypeError, as_prompt's, whatever its length."""
    refused_as_no_prompt(given)


def test_a_refusal_in_serve_whose_clock_then_raised_is_handed_out_by_the_next_step():
    """serve() stamped a request refused at its submission with a reading taken after the
    refusal: where the clock raised there, serve() raised and the refusal, its id taken, was
    handed out by nothing. Each submission is stamped first now: the refusal is recorded as it is
    made, handed out by the next step as serve()'s other ends are, and the request whose stamp
    raised was never submitted (the next submit takes its id)."""
    clock = FailingClock()
    decoder = Counting(1, clock)
    server = Server(decoder, clock=clock)
    refusal = decoder.refusal

    def failing(request):
        reason = refusal(request)
        clock.failing = reason is not None  # the clock's next reading raises
        return reason

    decoder.refusal = failing
    requests = [Request([1], 3), Request([1] * 40, 5), Request([2], 3)]
    with pytest.raises(OSError, match="the clock failed"):
        server.serve(requests)
    decoder.refusal = refusal
    out = _idle(server)
    assert sorted(out) == [0, 1] and out[0].tokens == alone(requests[0])
    assert (out[1].refused or "").startswith("request 1 refused: 45 entries needed") and out[1].latency == 0
    assert server.submit(requests[2]) == 2, "the request whose stamp raised was submitted"


@pytest.mark.parametrize("point", ["ended", "self._cancels.discard(ident)", "self._slots[running.row] = None",
                                   "del self._live[ident]"], ids=["in ended()", "its cancel", "its row", "itself"])
@pytest.mark.parametrize("by", ["burst", "cancel"])
def test_an_interrupt_as_a_request_ends_leaves_it_ended_once_and_the_others_whole(monkeypatch, point, by):
    """Ctrl-C as a request ends (by its burst, or by its cancel at the boundary), inside
    _Running.ended or between the server's changes as it forgets the request: the request ends
    once, handed out by this step or the next, every other keeps its tokens, and the server goes
    on. It was forgotten with its row still held or its cancel still asked (KeyError at every
    later step), or its end was lost; and an end cut short in a burst's record left the requests
    after it without that burst's tokens."""
    decoder = Counting(2)
    server = Server(decoder, clock=decoder.clock)
    requests = [Request([1, 2], 1), Request([3], 1), Request([4], 30)]  # 0 and 1 end in the first burst
    ids = [server.submit(request) for request in requests]
    out: dict[int, Served] = {}
    if by == "burst":
        burst = decoder.burst

        def cancelling():  # its cancel asked as the burst that ends it runs: the set holds it as it ends
            decoder.burst = burst
            assert server.cancel(ids[0])
            return burst()

        decoder.burst = cancelling
    else:
        out.update(server.step().finished)
        out.update(server.step().finished)  # request 2 runs in row 0
        assert server.cancel(ids[2])
    if point == "ended":
        interrupt_once(monkeypatch, serving._Running, "ended", waited=False)
        with pytest.raises(KeyboardInterrupt):
            out.update(server.step().finished)
    else:
        with interrupt_before(serving, point) as fired, pytest.raises(KeyboardInterrupt):
            out.update(server.step().finished)
        assert fired
    for ident, served in _idle(server).items():
        assert ident not in out, f"request {ident} ended twice"
        out[ident] = served
    assert sorted(out) == ids
    assert [out[ident].tokens for ident in ids[:2]] == [alone(request) for request in requests[:2]]
    assert out[ids[2]].tokens == alone(requests[2])[:len(out[ids[2]].tokens)]
    assert out[ids[2]].cancelled == (by == "cancel")
    assert server.serve([Request([5], 4)])[0].tokens == alone(Request([5], 4))


@pytest.mark.parametrize("failing", ["clock", "refusal"])
def test_a_submit_that_raised_takes_no_id_and_queues_nothing(failing, monkeypatch):
    """A submit whose clock raised, or whose decoder's refusal() did (an interrupt, a fault of the
    decoder's own), had taken an id: the next request's skipped it, and cancel() of the skipped id
    said it was submitted. Such a submit now leaves no trace: the next one takes the id it would
    have taken, and nothing but it runs."""
    clock = FailingClock()
    decoder = Counting(1, clock)
    server = Server(decoder, clock=clock)
    assert server.submit(Request([1], 3)) == 0
    if failing == "clock":
        clock.failing = True
    else:
        interrupt_once(monkeypatch, decoder, "refusal", waited=False)
    with pytest.raises(OSError if failing == "clock" else KeyboardInterrupt):
        server.submit(Request([2], 3))
    assert server.submit(Request([3], 3)) == 1, "the submit that raised took an id"
    with pytest.raises(ValueError, match="no request 2 was submitted to this server \\(2 so far\\)"):
        server.cancel(2)
    out = _idle(server)
    assert sorted(out) == [0, 1] and out[1].tokens == alone(Request([3], 3))


@pytest.mark.parametrize("given, named", [(None, r"serve\(\) takes a sequence of requests \(a list\), not None"),
                                          (Request([1], 3), r"serve\(\) takes a sequence of requests, not one "
                                                            r"Request: give \[request\]"),
                                          ([Request([1], 3), ([2], 3)], r"a request is a memra_cuda\.rounds\.Request")],
                         ids=["None", "one Request", "a tuple among them"])
def test_a_decoders_serve_checks_its_requests_before_it_makes_its_server(given, named):
    """A decoder's serve() (Driven.serve) made its server first, its graphs captured and every
    row parked, one of the decoder's servers, and only then met requests that were none: the
    same TypeError, after that work. The requests are checked first now, as serve() checks them,
    and the server is made only for requests it can take."""
    decoder = Counting(2)
    decoder.driven = Driven()
    made: list[Server] = []

    def server() -> Server:
        made.append(Server(decoder, clock=decoder.clock))
        return made[-1]

    with pytest.raises(TypeError, match=named):
        decoder.driven.serve(server, given)
    assert made == [] and decoder.calls == [] and not list(decoder.driven._servers)
    requests = [Request([1, 2], 3), Request([4], 2)]
    served = decoder.driven.serve(server, (request for request in requests))  # any iterable, as serve() takes
    assert [out.tokens for out in served] == [alone(request) for request in requests] and len(made) == 1


@pytest.mark.parametrize("line", ["del self._live[ident]", "self._cancels.add(ident)"],
                         ids=["as the step forgets it", "inside cancel()"])
def test_a_cancel_from_another_thread_as_its_request_ends_is_dropped_with_it(line):
    """Another thread's cancel() of a request as a step forgets it (after _forget dropped its
    cancel, before it dropped the request: the order 58c419a gave it), or a step on another
    thread ending the request inside cancel() (after its check, before its add): the cancel was
    kept for a request no longer live, and every later step raised KeyError naming it, the
    server serving no more. The request ends as its burst ended it, the cancel dropped."""
    decoder = Counting(2)
    server = Server(decoder, clock=decoder.clock)
    first, second = server.submit(Request([1, 2], 1)), server.submit(Request([3], 9))  # the first ends in a burst
    out: dict[int, Served] = {}
    said: list[bool] = []
    if line == "del self._live[ident]":
        with acting_before(serving, line, lambda: said.append(server.cancel(first))) as fired:
            out.update(server.step().finished)
    else:
        with acting_before(serving, line, lambda: out.update(server.step().finished)) as fired:
            said.append(server.cancel(first))
    assert fired and said == [True] and list(out) == [first] and not out[first].cancelled
    for ident, served in _idle(server).items():
        assert ident not in out, f"request {ident} ended twice"
        out[ident] = served
    assert sorted(out) == [first, second] and out[second].tokens == alone(Request([3], 9))
    assert server.serve([Request([5], 4)])[0].tokens == alone(Request([5], 4))


def test_a_cancel_of_a_request_whose_end_waits_for_the_next_step_says_false():
    """Ctrl-C as a step forgets a request its burst ended: its end waits for the next step to
    hand out, and the request is still live until then (58c419a). cancel() said True, that it
    would be cancelled, and the next step handed it out not cancelled; it had ended: False."""
    decoder = Counting(2)
    server = Server(decoder, clock=decoder.clock)
    first, second = server.submit(Request([1, 2], 1)), server.submit(Request([3], 9))
    with interrupt_before(serving, "del self._live[ident]") as fired, pytest.raises(KeyboardInterrupt):
        server.step()
    assert fired and not server.idle
    assert server.cancel(first) is False, "a request that had ended was to be cancelled"
    assert server.cancel(second) is True
    out = _idle(server)
    assert sorted(out) == [first, second] and not out[first].cancelled and out[second].cancelled
    assert out[first].tokens == alone(Request([1, 2], 1))


def test_an_interrupt_as_serve_sorts_a_steps_ends_loses_none():
    """Ctrl-C as serve() sorted the ends a step handed it into its list (a loop's back edge is
    where CPython raises a pending interrupt): the step had handed them out, serve() had not
    kept them, and no later step handed them out: lost. Each is handed out by the next step,
    once, as those of serve()'s requests still in flight are by the steps that end them."""
    decoder = Counting(3)
    server = Server(decoder, clock=decoder.clock)
    requests = [Request([1, 2], 1), Request([3], 1), Request([4], 9)]  # the first two end in the first burst
    with interrupt_before(serving, "out[place[ident]] = served") as fired, pytest.raises(KeyboardInterrupt):
        server.serve(requests)
    assert fired
    out = _idle(server)
    assert sorted(out) == [0, 1, 2], "a request serve() was handed was lost"
    assert [out[i].tokens for i in range(3)] == [alone(request) for request in requests]


def test_an_interrupt_as_serve_builds_its_list_loses_none():
    """Ctrl-C as serve() built the list it returns, every request ended: each end had been
    handed to serve() alone, and the list was never returned. Each is handed out by the next
    step, once."""
    decoder = Counting(3)
    server = Server(decoder, clock=decoder.clock)
    requests = [Request([1, 2], 1), Request([3], 1), Request([4], 2)]
    with interrupt_before(serving, "return [out[i] for i in range(len(requests))]  # in here: an interrupt as it is "
                                   "built hands them out") as fired, pytest.raises(KeyboardInterrupt):
        server.serve(requests)
    assert fired
    out = _idle(server)
    assert sorted(out) == [0, 1, 2], "a request serve() had ended was lost"
    assert [out[i].tokens for i in range(3)] == [alone(request) for request in requests]


def test_rows_to_park_are_read_no_further_than_the_batch_and_one():
    """A decoder's park() (as_rows, public through GraphedGreedy's and a speculative decoder's
    server) read any iterable whole: park(itertools.repeat(0)) never returned. At most the batch
    and one are read now, a row given twice counted twice: the batch's count passes (park([0, 0])
    of two rows, as the plain loop's tests give it), one more is a ValueError naming the call."""
    from memra_cuda.rounds.serving import as_rows

    def endless(batch):  # itertools.repeat(0), failing where it is read past the batch and one
        for _ in range(batch + 1):
            yield 0
        raise AssertionError("rows were read past the batch and one")

    for batch in (1, 2, 5):
        assert as_rows([0] * batch, batch, "park()") == [0] * batch  # at the limit
        assert as_rows(range(batch), batch, "park()") == list(range(batch))
        for rows in ([0] * (batch + 1), endless(batch), iter([0] * (batch + 1) + ["never read"])):
            with pytest.raises(ValueError, match=f"park\\(\\) names more rows than the decoder's {batch}$"):
                as_rows(rows, batch, "park()")
    with pytest.raises(ValueError, match="names more rows"):
        as_rows(itertools.repeat(0), 2, "park()")
    with pytest.raises(ValueError, match="row 2 is not one of the decoder's 2"):  # each row checked as it is read
        as_rows(itertools.count(), 2, "park()")


def test_rows_to_park_given_as_a_0_d_array_are_refused_naming_the_call():
    """A row given bare as a 0-d array (numpy's, or a tensor's: an Iterable by its type) met
    "iteration over a 0-d array" inside as_rows, naming nothing; it is refused as a bare int is."""
    from memra_cuda.rounds.serving import as_rows
    for rows in (np.array(1), np.array([1]).reshape(())):
        with pytest.raises(TypeError, match=r"^park\(\) takes rows, ints of the decoder's 2, not array\(1\)$"):
            as_rows(rows, 2, "park()")
    assert as_rows(np.array([1, 0]), 2, "park()") == [1, 0]


def test_a_checked_copy_rebuilt_by_calling_its_type_is_a_plain_request_checked_anew():
    """The copy admitted() and batch_admitted() hand back (_Kept) passes their check at once by its
    type; calling that type, as type(kept)(*fields) does and a pytree's map rebuilds a NamedTuple
    (torch.utils._pytree.tree_map), made another of it from fields never checked: a negative
    token, a budget past a row's i32, a seed that is no int, a negative EOS or most draft length
    were admitted as checked (the token a device fault at the row's embedding lookup). It makes
    a plain Request now, refused naming what is wrong; a copy's too, and the fields that were
    checked pass as before."""
    from memra_cuda.rounds.serving import admitted, batch_admitted
    kept = admitted(Request([1, 2, 3], 4, eos=5), VOCAB, 0, 1)[1]
    assert admitted(kept, VOCAB, 0, 1)[1] is kept
    for made, named in ((type(kept)((1, -3), 4), "token -3 \\(at 1\\) is outside the vocabulary"),
                        (type(kept)(*(-v if type(v) is int else v for v in kept)), "max_new_tokens must be"),
                        (kept.__class__(prompt=(1,), max_new_tokens=2**31), "max_new_tokens must be an int from"),
                        (type(kept)((1,), 4, None, "seed"), "its seed must be an integer"),
                        (type(kept)((1,), 4, -1), "eos must be None or an int of at least 0, not -1"),
                        (type(kept)((1,), 4, None, 0, -2), "max_draft must be None or an int of at least 0"),
                        (type(kept)((0.5,), 4), "its prompt must be a sequence of at least one token id")):
        assert type(made) is Request
        with pytest.raises(ValueError, match=named):
            admitted(made, VOCAB, 0, 1)
        with pytest.raises(RequestRefused, match=named):
            batch_admitted([made], VOCAB, 1)
        with pytest.raises(RequestRefused, match=named):
            Server(Counting(1), clock=Clock()).submit(made)
    rebuilt = type(kept)(*kept)  # at the limit: the fields that were checked
    assert type(rebuilt) is Request and rebuilt == kept and admitted(rebuilt, VOCAB, 0, 1)[1] == kept
    for copied in (copy.copy(kept), copy.deepcopy(kept)):
        assert type(copied) is Request and copied == kept


def test_a_batchs_requests_are_read_no_further_than_the_batch_and_one():
    """A batch's requests (batch_admitted: every decoder's generate_batch) were listed whole before
    their count was compared with the batch: generate_batch(itertools.repeat(request)) never
    returned, its list growing until memory ran out. No more than the batch and one are read now:
    the batch's count runs, one more is refused as more than the batch, before any is checked."""
    from memra_cuda.rounds.serving import batch_admitted
    request = Request((1, 2), 3)  # as its checked copy reads

    def endless(batch):  # itertools.repeat(request), failing where it is read past the batch and one
        yield from [request] * (batch + 1)
        raise AssertionError("requests were read past the batch and one")

    for batch in (1, 2, 5):
        assert batch_admitted(iter([request] * batch), VOCAB, batch) == [request] * batch  # at the limit
        for requests in (endless(batch), itertools.repeat(request), [request] * (batch + 1),
                         iter([request] * (batch + 1) + ["never read"])):
            with pytest.raises(ValueError, match=rf"need one request per row \({batch}\), not more than {batch}$"):
                batch_admitted(requests, VOCAB, batch)
    with pytest.raises(ValueError, match=r"need one request per row \(3\), not 2$"):
        batch_admitted(iter([request] * 2), VOCAB, 3)


@pytest.mark.parametrize("given", [np.ma.array([5], mask=[True]), np.ma.array([5], mask=[False])],
                         ids=["its token masked", "nothing masked"])
def test_a_masked_array_is_no_prompt(given):
    """A numpy masked array was read by its data, the masked entries as tokens: a prompt's
    masked token ran as any other. Masked or not, it is refused as no prompt: its mask says
    which entries are none, and a prompt has no such entries."""
    refused_as_no_prompt(given)



class _Interrupting:
    """A server's step lock where a Ctrl-C is handled as a call returns (CPython handles a signal as
    a call returns, not as a `with` block takes a lock): acquire() and a `with` block's exit raise
    KeyboardInterrupt once, after taking or releasing the lock, as a signal that came in the call."""

    def __init__(self, lock):
        self.lock, self.fired = lock, []

    def _interrupt(self):
        if not self.fired:
            self.fired.append(True)
            raise KeyboardInterrupt

    def acquire(self, *args, **kwargs):
        taken = self.lock.acquire(*args, **kwargs)
        self._interrupt()
        return taken

    def release(self):
        self.lock.release()

    def locked(self):
        return self.lock.locked()

    def __enter__(self):
        return self.lock.__enter__()

    def __exit__(self, *exc):
        self.lock.__exit__(*exc)
        if exc == (None, None, None):
            self._interrupt()


def test_an_interrupt_as_a_step_takes_its_lock_leaves_the_server_to_step_on():
    """step() took its lock before the try that released it: a Ctrl-C handled as the lock's
    acquire returned left it held for good, and every later step was refused as if one still ran
    ("step() was called while a step of this server runs"), the server's requests never served.
    The interrupt is raised; the server then steps on to idle, each request its own greedy
    decoding alone."""
    decoder = Counting(2)
    server = Server(decoder, clock=decoder.clock)
    requests = mixed(4)
    idents = [server.submit(request) for request in requests]
    server._step_held = interrupting = _Interrupting(server._step_held)
    with pytest.raises(KeyboardInterrupt):
        server.step()
    assert interrupting.fired
    ended: dict[int, Served] = {}
    for _ in range(100):
        if server.idle:
            break
        ended.update(server.step().finished)
    assert server.idle
    assert [ended[ident].tokens for ident in idents] == [alone(request) for request in requests]

"""benchmarks/soak.py's host logic on CPU, over the stand-in decoder (tests/stand_in.py): the
stream it draws, a soak that loses nothing and keeps every request's own output (refused,
cancelled and served mixed), and a verdict that fails where memory grows or a request's tokens
are another's."""
from __future__ import annotations

from benchmarks.soak import Mix, check, soak, soak_requests, verdict
from memra_cuda.rounds import Server

from stand_in import CAPACITY, VOCAB, Counting, alone

MIX = Mix(prompt=(1, 10), budget=(1, 25), eos=0.3, refused=0.1, cancelled=0.2)


def test_the_stream_is_drawn_by_its_seed_with_its_share_of_each_fate():
    requests, cancel = soak_requests(2000, VOCAB, CAPACITY, seed=3, mix=MIX)
    assert (requests, cancel) == soak_requests(2000, VOCAB, CAPACITY, seed=3, mix=MIX)
    assert requests != soak_requests(2000, VOCAB, CAPACITY, seed=4, mix=MIX)[0]
    assert [r.seed for r in requests] == list(range(2000))
    outside = sum(max(r.prompt) >= VOCAB for r in requests)
    too_long = sum(r.max_new_tokens == CAPACITY for r in requests)
    assert 60 < outside < 140 and 60 < too_long < 140 and 320 < len(cancel) < 480
    assert all(1 <= len(r.prompt) <= 10 and (1 <= r.max_new_tokens <= 25 or r.max_new_tokens == CAPACITY)
               for r in requests)
    own = [r.max_draft for r in requests if r.max_draft is not None]
    assert 300 < len(own) < 500 and set(own) == {0, 1, 2, 3, 4}


def run(count=600, batch=4, memory=None):
    requests, cancel = soak_requests(count, VOCAB, CAPACITY, seed=11, mix=MIX)
    decoder = Counting(batch)
    readings = iter(range(10**6))
    found = soak(Server(decoder, clock=decoder.clock), requests, cancel,
                 memory=memory or (lambda: 1000), warm_up=2 * batch, clock=lambda: float(next(readings)))
    return requests, cancel, found


def test_a_soak_ends_every_request_once_each_its_own_output():
    requests, cancel, found = run()
    assert not found.lost and not found.twice and sorted(found.served) == list(range(len(requests)))
    counts = found.counts()
    assert counts["refused"] == sum(max(r.prompt) >= VOCAB or r.max_new_tokens == CAPACITY for r in requests)
    assert 0 < counts["cancelled"] <= len(cancel)
    assert not any(found.served[i].cancelled for i in range(len(requests)) if i not in cancel)
    checked, wrong = check(found, requests, alone, 10**6, seed=1)
    assert checked == len(requests) - counts["refused"] and wrong == []
    held, line = verdict(found, wrong, checked)
    assert held and line.startswith(f"soak: held: {len(requests)} requests ({counts['refused']} refused, "), line
    assert 0 < len(found.memory) < found.steps, "memory is read once warm, after every step"


def test_the_verdict_fails_where_memory_grows_or_a_request_is_anothers():
    grows = iter(range(1000, 10**9))
    requests, _, found = run(memory=lambda: next(grows))
    assert 0.01 < found.drift and not verdict(found, [], 1)[0] and "FAILED" in verdict(found, [], 1)[1]
    requests, _, found = run()
    victim = next(i for i, served in found.served.items() if served.refused is None and len(served.tokens) > 1
                  and not served.cancelled)
    found.served[victim] = found.served[victim]._replace(tokens=found.served[victim].tokens[::-1] + [0])
    checked, wrong = check(found, requests, alone, 10**6, seed=1)
    assert len(wrong) == 1 and wrong[0].startswith(f"request {victim}: ") and not verdict(found, wrong, checked)[0]


def test_the_verdict_fails_where_admissions_fail_and_nothing_is_checked():
    """A decoder whose admission raises a ValueError (a bug in it, say) has every request it
    takes refused by the server, the others going on: the soak counts them, as none of its
    stream asks for that, and fails; and a soak that checked no request holds nothing."""
    requests, cancel = soak_requests(200, VOCAB, CAPACITY, seed=11, mix=MIX)
    decoder = Counting(4)
    decoder.failing, decoder.failure = 10**6, lambda: ValueError("a bug in the decoder")
    readings = iter(range(10**6))
    found = soak(Server(decoder, clock=decoder.clock), requests, cancel,
                 memory=lambda: 1000, warm_up=8, clock=lambda: float(next(readings)))
    well_formed = [i for i, r in enumerate(requests) if max(r.prompt) < VOCAB and r.max_new_tokens != CAPACITY]
    assert not found.lost and sorted(found.unadmitted) == well_formed
    checked, wrong = check(found, requests, alone, 10**6, seed=1)
    held, line = verdict(found, wrong, checked)
    assert checked == 0 and not held and f"refused at their admission {len(found.unadmitted)}" in line, line
    requests, _, found = run()
    assert not verdict(found, [], 0)[0], "a soak that checked nothing held"


def test_the_command_line_refuses_what_the_soak_could_only_fail_on_before_building_a_model(monkeypatch, capsys):
    """--checked 0 could only fail the verdict, and a negative one met numpy's refusal in check(),
    after the whole soak on the GPU; a negative --seed met numpy's after the model was built.
    argparse's error naming the option (exit 2), with nothing run."""
    import pytest

    from benchmarks import soak as soaking
    ran = []
    monkeypatch.setattr(soaking, "needs", lambda *args, **kwargs: None)  # the run is stubbed: nothing to need
    monkeypatch.setattr(soaking, "on_gpu", lambda *args: ran.append(args) or {"held": True})
    assert soaking.main(["--requests", "10", "--batch", "2", "--checked", "3", "--seed", "0"]) == 0
    for option, value in (("--checked", "0"), ("--checked", "-5"), ("--seed", "-1"), ("--requests", "0"),
                          ("--batch", "0"), ("--batch", "65536")):
        with pytest.raises(SystemExit) as exited:
            soaking.main([option, value])
        assert exited.value.code == 2 and f"{option} must be an int" in capsys.readouterr().err
    assert ran == [(10, 2, 3, 0)]

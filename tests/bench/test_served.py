"""benchmarks/served.py's host side, on CPU: each B's stream, tau from the requests' accepted
drafts, a decoder's row against the plain decoding's, the best chain at each B and decoding."""
from __future__ import annotations

import pytest

from benchmarks.served import (ADAPTIVE, CHAINS, adaptive_rows, best, format_row, is_adaptive, plains, row_of,
                               run_spread, servable, stream_for, summary_lines, tau)
from benchmarks.torch_common import PLAIN_ATTENDS, TORCH_M
from memra_cuda.rounds import Served

HELDOUT = {"prompts": [{"ids": [1, 2 + i, 3]} for i in range(473)]}  # the pair's pool: B = 128 serves 512


def served(tokens: int, accepted: int | None, at: float = 1.0) -> Served:
    return Served(list(range(tokens)), 0.0, 0.0, [at] * tokens, at, accepted=accepted)


def test_each_b_serves_four_requests_a_slot_of_held_out_prompts_in_order_from_the_first_again():
    for batch, count in ((1, 16), (8, 32), (128, 512)):
        stream = stream_for(HELDOUT, batch, eos=0)
        assert len(stream) == count and [r.prompt for r in stream] == [[1, 2 + i % 473, 3] for i in range(count)]
        assert all(r.eos == 0 and 32 <= r.max_new_tokens <= 512 for r in stream)
    assert stream_for(HELDOUT, 8, eos=0) == stream_for(HELDOUT, 8, eos=0), "one seeded stream"
    assert all(8 <= r.max_new_tokens <= 16 for r in stream_for(HELDOUT, 8, eos=None, quick=True))
    with pytest.raises(ValueError, match="heldout.json holds no prompts"):
        stream_for({"prompts": []}, 1, eos=None)
    assert set(CHAINS) == set(ADAPTIVE) == {1, 8, 32, 64, 128}
    assert all(0 in a.widths and max(a.widths) < a.k and 1 <= a.rounds <= TORCH_M for a in ADAPTIVE.values())
    # the adaptive configuration can run every chain measured beside it: at B = 32, T = 1, widths 0, 1
    # and 3 lost to the chain of 2 it lacked
    assert all(set(CHAINS[batch]) <= {a.k, *a.widths} for batch, a in ADAPTIVE.items())


def test_the_adaptive_configuration_is_its_rows_at_its_own_m_never_past_the_runs():
    """B = 128's adaptive configuration bursts 8 rounds (a request's last tokens wait a whole
    burst); a run at a shorter --rounds serves it at that M; its rows at other M's (--adaptive-rounds)
    and a chain's are not it; an earlier run's row without `rounds` was at its run's M."""
    assert ADAPTIVE[128].rounds == 8 and ADAPTIVE[128].at(16) == 8 and ADAPTIVE[128].at(4) == 4
    assert ADAPTIVE[8].at(16) == TORCH_M
    row = {"batch": 128, "config": "adaptive k=2 M=8", "rounds": 8}
    assert is_adaptive(row, 16) and not is_adaptive(dict(row, rounds=16), 16)
    assert not is_adaptive(dict(row, config="chain k=2"), 16)
    assert is_adaptive({"batch": 8, "config": "adaptive k=4"}, 16) and not is_adaptive({"batch": 128,
                                                                                        "config": "adaptive k=2"}, 16)
    rows = [dict(row, mode="greedy"), {"batch": 32, "config": "adaptive k=3", "mode": "greedy", "rounds": 16},
            {"batch": 8, "config": "adaptive k=4", "mode": "greedy", "rounds": 16},
            {"batch": 8, "config": "adaptive k=4", "mode": "sampling", "rounds": 16}]
    assert [r["batch"] for r in adaptive_rows({"rows": rows, "m_rounds": 16}, "greedy")] == [8, 32, 128]


def test_tau_is_tokens_over_rounds_and_none_without_drafts():
    assert tau([served(10, 6), served(5, 1), served(0, 0)]) == 15 / (4 + 4)
    assert tau([served(10, None), served(3, None)]) is None


def test_rows_compare_with_the_plain_decoding_and_the_best_chain_is_picked():
    plain = row_of(8, "greedy", "plain", [[served(100, None, at=2.0)]], 1.0, None)
    assert plain["vs_plain"] == 1.0 and plain["tokens_per_s"] == 50.0 and plain["tau"] is None
    fast = row_of(8, "greedy", "chain k=2", [[served(150, 90, at=2.0)]], 30.0, plain["tokens_per_s"])
    slow = row_of(8, "greedy", "chain k=4", [[served(120, 80, at=2.0)]], 30.0, plain["tokens_per_s"])
    sampled = row_of(8, "sampling", "chain k=2", [[served(60, 20, at=2.0)]], 30.0, plain["tokens_per_s"])
    assert fast["vs_plain"] == 1.5 and fast["tau"] == 150 / 60
    adaptive = row_of(8, "greedy", "adaptive k=4", [[served(300, 200, at=2.0)]], 30.0, plain["tokens_per_s"])
    picked = best([plain, slow, fast, sampled, adaptive])  # the best fixed chain: the adaptive one is measured by it
    assert [(b["batch"], b["mode"], b["config"], b["vs_plain"]) for b in picked] == [
        (8, "greedy", "chain k=2", 1.5), (8, "sampling", "chain k=2", 0.6)]
    assert "1.50x" in format_row(fast) and " 2.50 " in format_row(fast) and format_row(plain).split()[3] == "50"


def test_a_row_is_its_median_run_and_says_how_far_its_runs_lay_apart():
    """Three timed runs of one stream, the same tokens in different times: the row is the median
    run's (its TTFT and TBT too, not a mix), every run's tokens/s kept in run order; no run refused."""
    runs = [[served(100, 60, at=2.0)], [served(100, 60, at=1.0)], [served(100, 60, at=4.0)]]
    row = row_of(8, "greedy", "chain k=2", runs, 30.0, 25.0)
    assert row["runs_tokens_per_s"] == [50.0, 100.0, 25.0] and row["tokens_per_s"] == 50.0
    assert row["vs_plain"] == 2.0 and row["ttft_p50_s"] == 2.0 and row["tau"] == 100 / 40
    assert run_spread(row) == (100.0 - 25.0) / 50.0 and format_row(row).endswith(" 150.0%")
    alone = row_of(8, "greedy", "chain k=2", runs[:1], 30.0, 25.0)
    assert run_spread(alone) is None and format_row(alone).endswith(" 30.0"), "one run: no spread to say"
    assert run_spread({"tokens_per_s": 1.0}) is None, "an earlier report's row kept no runs"
    with pytest.raises(ValueError, match="no timed run"):
        row_of(8, "greedy", "chain k=2", [], 30.0, 25.0)


def test_a_decoder_serves_one_untimed_warm_up_then_the_stream_timed_runs_times():
    """_served: through one server, a warm-up stream of B requests at WARM_TOKENS new tokens
    each (untimed, its records dropped), then the whole stream TIMED_RUNS times, a run's records
    each, in run order."""
    from benchmarks.served import TIMED_RUNS, WARM_TOKENS, _served
    served_calls: list[list] = []

    class Server:
        def serve(self, requests: list) -> list[int]:
            served_calls.append(list(requests))
            return [len(served_calls)]  # a run's records: which call served them

    class Decoder:
        servers = 0

        def server(self) -> Server:
            self.servers += 1
            return Server()

    decoder, stream = Decoder(), stream_for(HELDOUT, 8, eos=0)
    runs = _served(decoder, stream, 8)
    assert decoder.servers == 1 and len(served_calls) == 1 + TIMED_RUNS == 4
    assert served_calls[0] == [r._replace(max_new_tokens=WARM_TOKENS) for r in stream[:8]], "B short requests first"
    assert served_calls[1:] == [stream] * TIMED_RUNS and runs == [[2], [3], [4]], "then the stream, each run timed"


def test_a_pair_that_cannot_serve_every_b_is_refused_before_any_runs():
    servable(HELDOUT, [1, 8, 128], eos=0)
    with pytest.raises(ValueError, match="holds no prompts"):
        servable({"prompts": []}, [1, 256], eos=0)
    with pytest.raises(ValueError, match=r"no single EOS token id \(config.eos_token_id = \[0, 1\]\)"):
        servable(HELDOUT, [1], eos=[0, 1])


def test_the_baseline_at_each_b_is_the_faster_plain_decoding():
    """The plain decoding is measured with each attention of its one-token step (SDPA over the
    whole cache, flex over what a row holds): the picture's baseline at each B is the faster."""
    assert sorted(PLAIN_ATTENDS) == ["flex", "sdpa"]
    rows = [row_of(8, "greedy", "plain sdpa", [[served(100, None, at=2.0)]], 1.0, None),
            row_of(8, "greedy", "plain flex", [[served(120, None, at=2.0)]], 1.0, None),
            row_of(1, "greedy", "plain sdpa", [[served(30, None, at=1.0)]], 1.0, None),
            row_of(1, "greedy", "plain flex", [[served(20, None, at=1.0)]], 1.0, None),
            row_of(8, "greedy", "chain k=2", [[served(300, 90, at=2.0)]], 1.0, 60.0)]
    assert plains(rows) == {1: 30.0, 8: 60.0}


def test_a_resumed_report_keeps_its_other_batches_only_where_it_is_of_this_pair_and_m(tmp_path):
    """--resume: the rows of the B's this run does not serve are kept from the report of the same
    pair (the same trained weights), M, --quick and projection; anything else is refused naming
    what differs (a report from before projections were recorded among them)."""
    import json

    from benchmarks.served import resumed
    pair = {"key": "620e7b973acb", "target": {"heldout_loss": 2.1208}}
    rows = [row_of(b, "greedy", "plain", [[served(100, None)]], 1.0, None) for b in (32, 1, 64)]
    path = tmp_path / "s.json"
    path.write_text(json.dumps(dict(pair=pair, m_rounds=16, quick=False, projection="inductor", rows=rows)))
    assert [row["batch"] for row in resumed(path, pair, 16, False, [64, 128], "inductor")] == [32, 1]
    retrained = {"key": "620e7b973acb", "target": {"heldout_loss": 2.1301}}
    for mine, what in (((retrained, 16, False), "pair"), ((pair, 8, False), "M"), ((pair, 16, True), "quick")):
        with pytest.raises(ValueError, match=f"another {what} "):
            resumed(path, *mine, [64], "inductor")
    with pytest.raises(ValueError, match="another projection \\('inductor', this run 'few_rows'\\)"):
        resumed(path, pair, 16, False, [64], "few_rows")
    path.write_text(json.dumps(dict(pair=pair, m_rounds=16, quick=False, rows=rows)))
    with pytest.raises(ValueError, match="another projection \\(None, "):
        resumed(path, pair, 16, False, [64], "inductor")
    path.write_text(json.dumps(dict(m_rounds=16, quick=False, projection="inductor", rows=rows)))
    with pytest.raises(ValueError, match="another pair \\(None, this run \\{'key': '620e7b973acb'"):
        resumed(path, pair, 16, False, [64], "inductor")


def test_a_pair_is_the_same_where_its_weights_are_and_its_agreement_measured_again_may_move():
    """same_pair: one key's deterministic training, measured again on another lease (top-1 93.04%
    against 93.1%, a loss 0.0004 nats off), is the same pair; another key, shape or size, or a
    held-out loss past the evaluation's noise (a pair trained again another way), is not."""
    from benchmarks.served import LOSS_NOISE, same_pair
    mine = {"key": "431e93f7075e", "target": {"layers": 12, "params": 97536768, "heldout_loss": 2.12},
            "draft": {"layers": 2, "params": 9832320, "heldout_loss": 2.2111}, "top": {"1": 0.9304},
            "overlap_t1": 0.7767}
    again = dict(mine, top={"1": 0.931}, overlap_t1=0.7771, draft=dict(mine["draft"], heldout_loss=2.2115))
    assert same_pair(mine, again) and same_pair(again, mine)
    for other in (dict(mine, key="620e7b973acb"), dict(mine, target=dict(mine["target"], layers=16)),
                  dict(mine, target=dict(mine["target"], heldout_loss=2.12 + 2 * LOSS_NOISE)),
                  {k: v for k, v in mine.items() if k != "draft"}, None):
        assert not same_pair(mine, other), other


def test_the_rounds_a_burst_are_refused_at_parsing_before_the_pair_loads(monkeypatch, capsys):
    """--rounds 0 (or past a ring's room) met Geometry's refusal in the first B's decoders, after
    the pair had loaded; argparse's error naming --rounds now (exit 2), with nothing run."""
    from benchmarks import served as serving
    ran = []
    monkeypatch.setattr(serving, "needs", lambda *args, **kwargs: None)  # the run is stubbed: nothing to need
    monkeypatch.setattr(serving, "served_headline", lambda *args: ran.append(args))
    assert serving.main(["--rounds", "8", "--batches", "1"]) == 0 and ran[0][-5] == 8
    for rounds in ("0", "-3", str(2**31)):
        with pytest.raises(SystemExit) as exited:
            serving.main(["--rounds", rounds])
        assert exited.value.code == 2 and "--rounds: m_rounds must be" in capsys.readouterr().err
    assert len(ran) == 1


def test_the_summary_sets_the_adaptive_configuration_beside_the_best_chain_or_alone_where_none_ran():
    """A line a B and decoding: the best fixed chain and the adaptive configuration against the
    plain decoding (and the adaptive against that chain); where --fixed-at left B's chains out,
    the adaptive configuration alone, against the plain decoding. The p99 without each request's
    last readback follows where a row has it (not a NaN: no request read back thrice; not an
    earlier run's row, which lacks it)."""
    plain = row_of(8, "greedy", "plain sdpa", [[served(100, None, at=2.0)]], 1.0, None)
    chain = dict(row_of(8, "greedy", "chain k=2", [[served(150, 90, at=2.0)]], 30.0, 50.0), tbt_p99_s=0.0011,
                 tbt_p99_mid_s=0.0007)
    adaptive = dict(row_of(8, "greedy", "adaptive k=4", [[served(120, 60, at=2.0)]], 30.0, 50.0), tbt_p99_s=0.0009)
    alone = dict(row_of(32, "sampling", "adaptive k=3", [[served(200, 90, at=2.0)]], 30.0, 80.0), tbt_p99_s=0.002)
    del adaptive["tbt_p99_mid_s"]
    rows = [plain, chain, adaptive, row_of(32, "greedy", "plain flex", [[served(160, None, at=2.0)]], 1.0, None), alone]
    first, second = summary_lines(rows, best(rows))
    assert first == ("  B =   8 greedy    best chain chain k=2 75 tokens/s, 1.50x plain, TBT p99 1.10 ms (0.70 "
                     "without a request's last readback); "
                     "adaptive k=4 60 tokens/s, 1.20x plain, 80.0% of the best chain, TBT p99 0.90 ms")
    assert second == "  B =  32 sampling  adaptive k=3 100 tokens/s, 1.25x plain, TBT p99 2.00 ms"


def test_fixed_at_names_the_batches_whose_chains_run_and_refuses_another(monkeypatch, capsys):
    from benchmarks import served as serving
    ran = []
    monkeypatch.setattr(serving, "needs", lambda *args, **kwargs: None)
    monkeypatch.setattr(serving, "served_headline", lambda *args: ran.append(args))
    assert serving.main(["--fixed-at", "1,128"]) == 0 and ran[-1][-3] == [1, 128]
    assert serving.main([]) == 0 and ran[-1][-3] is None
    with pytest.raises(SystemExit) as exited:
        serving.main(["--fixed-at", "2"])
    assert exited.value.code == 2 and "--fixed-at" in capsys.readouterr().err


def test_adaptive_rounds_names_other_ms_the_adaptive_configuration_is_served_at(monkeypatch, capsys):
    """--adaptive-rounds M,M reaches the run (before the projection, which stays last); none
    given, none; a repeated or non-positive M is argparse's error, and so is one above --rounds
    (every decoder's caches, the plain decoding's too, are sized at --rounds' M), nothing run."""
    from benchmarks import served as serving
    ran = []
    monkeypatch.setattr(serving, "needs", lambda *args, **kwargs: None)
    monkeypatch.setattr(serving, "served_headline", lambda *args: ran.append(args))
    assert serving.main(["--adaptive-rounds", "8,4", "--batches", "128"]) == 0 and ran[-1][-2] == [8, 4]
    assert serving.main(["--projection", "inductor"]) == 0 and ran[-1][-2] == () and ran[-1][-1] == "inductor"
    for bad, why in (("8,8", "each once"), ("0", "a count of 1 or more"), ("x", "a count of 1 or more"),
                     ("17", "--adaptive-rounds: each M at most --rounds (16)"), (str(2**31), "at most --rounds")):
        with pytest.raises(SystemExit) as exited:
            serving.main(["--adaptive-rounds", bad])
        assert exited.value.code == 2 and why in capsys.readouterr().err, bad
    assert len(ran) == 2


def test_each_m_of_adaptive_rounds_serves_the_adaptive_configuration_again_its_rows_saying_so(monkeypatch):
    """_bench_batch with --adaptive-rounds 8,4,16 at M = 16: the plain decoding at M = 16, then the
    adaptive configuration at M = 16 (unsaid), 8 and 4 (said, 16 not twice), greedy and sampled,
    each decoder built with its own M, in caches sized for the widest M; every row its `rounds`.
    The decoders are stand-ins (the plumbing is what is checked; tests/pytorch serve for real)."""
    pytest.importorskip("torch", reason="needs PyTorch (pip install '.[torch]' in the checkout)")
    import memra_cuda.torch as mt
    from benchmarks import served as serving
    built, sized = [], []

    class Plain:
        def __init__(self, target, capacity, batch, steps, attention):
            built.append(("plain", attention, steps, capacity))

        def server(self):
            return self

    class Spec:
        setup_seconds = 1.0

        def __init__(self, target, draft, *, k, m_rounds, capacity, batch, sampling, widths):
            built.append(("spec", k, m_rounds, capacity, tuple(widths), sampling is None))

        def capture(self, modes):
            assert modes == ("graph",)

    monkeypatch.setattr(mt, "GraphedGreedy", Plain)
    monkeypatch.setattr(mt, "SpeculativeLlama", Spec)
    monkeypatch.setattr(mt, "capacity_for", lambda prompt, new, geometry: sized.append(geometry.m_rounds) or 999)
    monkeypatch.setattr(serving, "release", lambda: None)
    monkeypatch.setattr(serving, "_served", lambda decoder, requests, batch: [[
        Served([1] * 10, 0.0, 0.0, [1.0] * 5 + [2.0] * 5, 2.0, accepted=None if isinstance(decoder, Plain) else 4)]])
    target = type("Target", (), {"config": type("Config", (), {"eos_token_id": 0})()})()
    rows = serving._bench_batch(target, None, HELDOUT, 32, False, 16, fixed=False, adaptive_rounds=[8, 4, 16])
    k, widths = ADAPTIVE[32].k, ADAPTIVE[32].widths
    assert sized == [16]
    assert [(row["mode"], row["config"], row["rounds"]) for row in rows] == [
        *(("greedy", f"plain {attention}", 16) for attention in PLAIN_ATTENDS),
        *((mode, f"adaptive k={k}{label}", m) for mode in ("greedy", "sampling")
          for label, m in (("", 16), (" M=8", 8), (" M=4", 4)))]
    assert [b[2] for b in built if b[0] == "spec"] == [16, 8, 4, 16, 8, 4]
    assert all(b[1] == k and b[4] == tuple(widths) for b in built if b[0] == "spec")
    # B = 128's configuration is at its own M (8) first, then the others asked for; 8 not twice
    built.clear()
    rows = serving._bench_batch(target, None, HELDOUT, 128, False, 16, fixed=False, adaptive_rounds=[16, 8])
    assert [(row["config"], row["rounds"]) for row in rows if row["mode"] == "greedy"][-2:] == [
        ("adaptive k=2 M=8", 8), ("adaptive k=2", 16)]

"""The headline section's pieces that hold without a GPU (benchmarks/headline.py): the configurations
it measures and the trees it fits to the pair's agreement, the prompts it cuts from a heldout.json,
the arithmetic of the ideal, the rows' share and the HBM floor, the picks derived from a table of
results and printed in PICKED's form, the table's rows and the JSON's shape."""
from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from memra_cuda import DynamicTree, TreeShape
from benchmarks.headline import (BATCHES, CHAIN_KS, HEADER, QUICK_BATCHES, STATIC, Config, assemble, configurations,
                                 copy_bytes_per_s, derive_picks, describe, floor_ms, format_row, load_pair, pair_info,
                                 measure_batches, picked_dict, picks_text, prompt_groups, save, split_line, summarise,
                                 tree_rates)
from benchmarks.torch_common import figures, median_index, reach, request_split, rows_share, time_generations

TOP = {"1": 0.865, "2": 0.93, "4": 0.958, "8": 0.974}  # report.json's agreement (JSON keys), 2026-12-02's pair
REPORT = dict(key="3f2a9c1e0b7d", vocab=8192,
              target=dict(layers=12, hidden=768, params=97_500_000, heldout_loss=2.187, steps=716),
              draft=dict(layers=2, hidden=384, params=9_800_000, heldout_loss=2.021, steps=1289),
              agreement=dict(prompts=64, top=TOP, tokens_per_round={"2": 2.56}, overlap_t1=0.764))
NAMESPACE = {"TreeShape": TreeShape, "DynamicTree": DynamicTree}


def test_the_likeliest_trees_are_fitted_to_the_pairs_top_1_and_top_2():
    # the draft's best candidate right at 86.5% of positions, its second at 6.5% = 0.865 x 0.075
    assert tree_rates(TOP) == (0.865, 0.075)
    assert tree_rates({"1": 0.5, "2": 0.5}) == (0.5, 0.001)  # no second choice ever right: fall's floor
    assert tree_rates({"1": 0.016, "2": 0.207}) == (0.016, 1.0)  # a draft trained for seconds
    assert tree_rates({"1": 0.0, "2": 0.1}) == (0.001, 1.0)
    for bad in ({"1": 0.9, "2": 0.8}, {"1": -0.1, "2": 0.5}, {"1": 0.5, "2": 1.5}):
        with pytest.raises(ValueError, match="top-2 >= top-1"):
            tree_rates(bad)


@pytest.mark.parametrize("batch", BATCHES)
def test_each_batch_measures_every_chain_and_static_and_dynamic_trees_that_rebuild_from_their_source(batch):
    configs = configurations(batch, TOP)
    assert [c.spec for c in configs if c.kind == "chain"] == list(CHAIN_KS)
    assert all(c.source is None for c in configs if c.kind == "chain")
    trees = [c for c in configs if c.kind != "chain"]
    assert {c.kind for c in trees} == {"static", "dynamic"}
    assert len([c for c in trees if c.kind == "static"]) == len(STATIC[batch])
    for config in trees:
        assert config.source is not None and eval(config.source, NAMESPACE) == config.spec  # PICKED's form rebuilds it
        assert isinstance(config.spec, TreeShape if config.kind == "static" else DynamicTree)
        config.spec.check_sampled()  # each is measured at temperature 1 too
    assert len({c.label for c in configs}) == len(configs), "every configuration its own name in the table"


def test_the_trees_shrink_as_the_batch_grows():
    most = {batch: max(c.spec.nodes for c in configurations(batch, TOP) if not isinstance(c.spec, int))
            for batch in BATCHES}
    assert [most[b] for b in BATCHES] == sorted(most.values(), reverse=True)
    assert most[1] > most[128]


def test_a_chain_with_leaves_and_a_likeliest_tree_are_named_as_the_trees_section_names_them():
    static = {c.source: c.label for c in configurations(1, TOP) if c.kind == "static"}
    assert static["TreeShape.chain_with_leaves(6, 1)"] == "k=6, 1 leaf"
    assert static["TreeShape.likeliest(16, depth=6, right=0.865, fall=0.075, ranks=4)"] == "T=16, depth 6"
    assert Config("chain", 4, None).label == "k=4"
    assert Config("dynamic", DynamicTree(6, 2, 2), "DynamicTree(6, 2, 2)").label == "6x2, branch 2"


def test_the_quick_run_takes_one_configuration_of_each_kind_at_two_batch_sizes():
    assert QUICK_BATCHES == (1, 8) and set(QUICK_BATCHES) <= set(BATCHES)
    for batch in QUICK_BATCHES:
        assert [c.kind for c in configurations(batch, TOP, quick=True)] == ["chain", "static", "dynamic"]


def test_a_short_lease_measures_the_chains_and_the_first_trees_it_names():
    """--chains and --trees cut the configurations (a lease short of time measures those an earlier
    run found best): the chains named, in their order, and the first N static and dynamic trees;
    --trees 0 no tree; a bad value is argparse's error, naming what it takes."""
    import argparse
    from benchmarks.headline import tree_count
    configs = configurations(1, TOP, chains=[6, 3], trees=1)
    assert [(c.kind, c.label) for c in configs] == [("chain", "k=6"), ("chain", "k=3"), ("static", "k=6, 1 leaf"),
                                                     ("dynamic", "6x2, branch 2")]
    assert [c.kind for c in configurations(8, TOP, chains=[2], trees=0)] == ["chain"]
    assert configurations(32, TOP, trees=9) == configurations(32, TOP)  # past the trees a B has: every one
    assert [(c.kind, c.label) for c in configurations(1, TOP, chains=[4], trees=(2, 0))] == [
        ("chain", "k=4"), ("static", "k=6, 1 leaf"), ("static", "k=8, 1 leaf")]  # S,D: no dynamic tree
    assert [c.kind for c in configurations(1, TOP, chains=[], trees=(0, 1))] == ["dynamic"]
    assert tree_count("2") == 2 and tree_count("0") == 0 and tree_count("2,0") == (2, 0)
    for bad in ("-1", "two", "1.5", "2,-1", "1,2,3", ","):
        with pytest.raises(argparse.ArgumentTypeError, match="a count of 0 or more"):
            tree_count(bad)


@pytest.mark.parametrize("program", ["headline", "served"])
def test_the_projection_named_reaches_the_run_and_another_is_argparses_error(program, monkeypatch, capsys):
    """--projection (both programs that measure the pair) is passed to the run, which sets it for
    every compiled step, the baseline's too; left out, None (the library's default); a name that
    is none of the projections is refused before anything runs."""
    import importlib
    module = importlib.import_module(f"benchmarks.{program}")
    ran = []
    run = "headline" if program == "headline" else "served_headline"
    monkeypatch.setattr(module, "needs", lambda *args, **kwargs: None)  # the run is stubbed: nothing to need
    monkeypatch.setattr(module, run, lambda *args: ran.append(args))
    at = -2 if program == "headline" else -1  # the headline's last: --skip-done
    assert module.main(["--projection", "few_rows", "--batches", "1"]) == 0 and ran[-1][at] == "few_rows"
    assert module.main(["--batches", "1"]) == 0 and ran[-1][at] is None
    with pytest.raises(SystemExit) as exited:
        module.main(["--projection", "cublas"])
    assert exited.value.code == 2 and "invalid choice: 'cublas'" in capsys.readouterr().err and len(ran) == 2


def test_skip_done_named_reaches_the_run_as_a_bool(monkeypatch, capsys):
    """--skip-done on|off is passed to the run as True or False (left out, False: the decoders'
    own default); another word is argparse's error, before anything runs."""
    from benchmarks import headline
    ran = []
    monkeypatch.setattr(headline, "needs", lambda *args, **kwargs: None)
    monkeypatch.setattr(headline, "headline", lambda *args: ran.append(args))
    for given, want in ((["--skip-done", "on"], True), (["--skip-done", "off"], False), ([], False)):
        assert headline.main([*given, "--batches", "1"]) == 0 and ran[-1][-1] is want
    with pytest.raises(SystemExit) as exited:
        headline.main(["--skip-done", "yes"])
    assert exited.value.code == 2 and "invalid choice: 'yes'" in capsys.readouterr().err and len(ran) == 3


def test_every_decoder_a_run_builds_is_given_its_skip_done_as_a_bool(monkeypatch):
    """decoder() gives each decoder the run's skip_done (skipping; off unless asked) or its own
    argument, always a bool: a None reached the decoders, which refuse anything but a bool."""
    pytest.importorskip("torch", reason="needs PyTorch (pip install '.[torch]' in the checkout)")
    import memra_cuda.torch as memra_torch
    from benchmarks import torch_common
    given = []

    class Decoder:
        tree = SimpleNamespace(depth=0)

        def __init__(self, *args, skip_done, **kwargs):
            given.append(skip_done)

        def capture(self, modes):
            pass

        verify_trunk = draft_chain = verify_tree = draft_level = None

    monkeypatch.setattr(memra_torch, "SpeculativeLlama", Decoder)
    monkeypatch.setattr(memra_torch, "TreeLlama", Decoder)
    monkeypatch.setattr(memra_torch, "self_draft", lambda model: model)
    torch_common.decoder(object(), "chain", 4, 64)
    torch_common.decoder(object(), "static", object(), 64)
    with torch_common.skipping(True):
        torch_common.decoder(object(), "chain", 4, 64)
        torch_common.decoder(object(), "chain", 4, 64, skip_done=False)
    torch_common.decoder(object(), "static", object(), 64, skip_done=True)
    assert given == [False, False, True, False, True] and torch_common.SKIP_DONE is False


def test_the_modes_named_reach_the_run_and_a_device_row_says_so(monkeypatch, capsys):
    """--modes (round-stream's graph, overlap and device) is passed to the run, each once; left
    out, None (graph mode alone); another mode (readback, eager: no headline's) is argparse's
    error. A row timed in overlap or device mode is labelled so, one in graph mode as before."""
    from benchmarks import headline
    from benchmarks.torch_common import row_label
    ran = []
    monkeypatch.setattr(headline, "needs", lambda *args, **kwargs: None)
    monkeypatch.setattr(headline, "headline", lambda *args: ran.append(args))
    assert headline.main(["--modes", "graph,device", "--batches", "1"]) == 0 and ran[-1][-3] == ["graph", "device"]
    assert headline.main(["--modes", "overlap,graph", "--batches", "1"]) == 0 and ran[-1][-3] == ["overlap", "graph"]
    assert headline.main(["--batches", "1"]) == 0 and ran[-1][-3] is None
    for bad in ("readback", "eager", "device,device"):
        with pytest.raises(SystemExit) as exited:
            headline.main(["--modes", bad])
        assert exited.value.code == 2 and "graph, overlap, device, each once" in capsys.readouterr().err
    assert len(ran) == 3
    chain = dict(kind="chain", config=4)
    assert row_label(chain) == row_label(dict(chain, launch="graph")) == "k=4"
    assert row_label(dict(chain, launch="device")) == "k=4, device"
    assert row_label(dict(chain, launch="overlap")) == "k=4, overlap"
    assert row_label(dict(kind="static", config="k=8, 1 leaf", launch="device")) == "k=8, 1 leaf, device"


def test_a_runs_projection_holds_inside_it_alone_and_is_one_of_the_librarys(monkeypatch):
    """projected() sets the default every compiled step reads as it is built, inside its block
    alone (a test or program that runs a section goes on with its own default after it, an
    exception too); the choices are the library's own, and a name the library lacks is refused
    without changing the default. A default set wrong by hand reaches a stack built after it."""
    torch = pytest.importorskip("torch", reason="needs PyTorch (pip install '.[torch]' in the checkout)")
    transformers = pytest.importorskip("transformers", reason="needs transformers")
    from benchmarks.torch_common import PROJECTIONS, projected
    from memra_cuda.torch import CompiledStack, compiled
    assert PROJECTIONS == compiled.PROJECTIONS
    monkeypatch.setattr(compiled, "PROJECTION", compiled.PROJECTION)  # undone after the test
    default = compiled.PROJECTION
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    with projected(None) as used:
        assert used == compiled.PROJECTION == default
    for projection in ("inductor", "few_rows"):
        with projected(projection) as used:
            assert used == compiled.PROJECTION == projection
            CompiledStack(model, 64, compile=False)  # each where it serves: inductor's on a CPU
        assert compiled.PROJECTION == default
    with pytest.raises(RuntimeError, match="inside"), projected("inductor"):
        raise RuntimeError("inside")
    assert compiled.PROJECTION == default
    with pytest.raises(ValueError, match="projection is one of"), projected("cublas"):
        pass
    assert compiled.PROJECTION == default
    compiled.PROJECTION = "cublas"  # what projected refuses, set by hand: a stack built after reads it
    with pytest.raises(ValueError, match="\\(memra_cuda.torch.compiled.PROJECTION\\)"):
        CompiledStack(model, 64, compile=False)


def write_heldout(tmp_path, count: int, length: int = 5) -> dict:
    """A heldout.json as benchmarks/pair.py writes it, of `count` prompts, and the pair's other files."""
    pool = [dict(path=f"stdlib/m{i}.py", start=3 * i, ids=list(range(100 * i, 100 * i + length)), text=f"t{i}")
            for i in range(count)]
    heldout = dict(prompt_len=length, prompts=pool)
    (tmp_path / "heldout.json").write_text(json.dumps(heldout, indent=0))
    (tmp_path / "report.json").write_text(json.dumps(REPORT))
    (tmp_path / "target").mkdir()
    (tmp_path / "draft").mkdir()
    return heldout


def test_prompts_are_cut_from_heldout_json_one_generation_a_prompt_at_b_1(tmp_path):
    write_heldout(tmp_path, 10)
    report, heldout = load_pair(tmp_path)
    assert report == REPORT
    one = prompt_groups(heldout, 1, one_row=3)
    assert one == [[(0, [0, 1, 2, 3, 4])], [(1, [100, 101, 102, 103, 104])], [(2, [200, 201, 202, 203, 204])]]
    (batch,) = prompt_groups(heldout, 8, one_row=3)
    assert [seed for seed, _ in batch] == list(range(8)), "each row its own seed: its index in the pool"
    assert [ids[0] for _, ids in batch] == [100 * i for i in range(8)]
    with pytest.raises(ValueError, match="holds 10 prompts; B = 32 needs 32"):
        prompt_groups(heldout, 32, one_row=3)


def test_a_directory_that_is_not_a_whole_pair_is_refused_naming_what_it_lacks(tmp_path):
    (tmp_path / "target").mkdir()
    with pytest.raises(FileNotFoundError, match="lacks draft, report.json, heldout.json; `make pair`"):
        load_pair(tmp_path)


def test_every_line_names_the_pair_and_the_machine():
    line = describe(pair_info(REPORT), "NVIDIA H200", "2026-12-03")
    for words in ("pair 3f2a9c1e0b7d", "Llama 12 x 768", "97.5 M params", "2.187 nats/token", "Llama 2 x 384",
                  "2.021", "86.5%", "NVIDIA H200", "2026-12-03"):
        assert words in line


def test_batches_run_one_after_another_share_their_rounds_as_one_batch_does():
    one = np.array([10, 8, 6])
    assert rows_share([one]) == pytest.approx(24 / 30)  # one batch: the trees section's share
    assert rows_share([np.array([7]), np.array([3]), np.array([12])]) == 1.0  # B = 1: every row its batch's
    # two batches of two: (10 + 5 + 4 + 4) rounds used of 2 x 10 + 2 x 4 run
    assert rows_share([np.array([10, 5]), np.array([4, 4])]) == pytest.approx(23 / 28)
    assert rows_share([np.zeros(3, np.int64)]) == 1.0


def test_a_rows_figures_are_its_tokens_over_its_rounds_and_the_ideal_its_costs_allow():
    # B = 1, two prompts one after another: 128 tokens in 40 rounds, 128 in 24; 0.5 s in all
    got = figures([[128], [128]], [np.array([40]), np.array([24])], 0.5, v=1.1, d=0.9)
    assert got["tokens_per_s"] == 512 and got["tau"] == 4.0 and got["ideal"] == pytest.approx(2.0)
    assert got["rows_share"] == 1.0 and (got["v"], got["draft"]) == (1.1, 0.9)
    # then the trees section's reach(): 1.8x plain of an ideal of 2x
    assert reach(1.8, got["ideal"], got["rows_share"])["reached"] == pytest.approx(0.9)


def test_where_a_rows_ideal_went_multiplies_back_to_what_it_reached():
    """figures() given the rounds sent and the step: `used`, the share of the rounds sent that
    committed a row's tokens, `busy`, the share of the seconds the verifies and drafts fill; with
    the plain loop's busy share, used x busy / plain_busy is `reached`, whatever the numbers."""
    from benchmarks.torch_common import busy_share
    # B = 2, two batches: rows of 128 and 96 tokens in 40 and 30 rounds, then 64 and 128 in 20 and
    # 32; 48 and 36 rounds sent (past the slower row's end: 8 and 4); 0.05 s; a step of 0.4 ms
    got = figures([[128, 96], [64, 128]], [np.array([40, 30]), np.array([20, 32])], 0.05, v=1.2, d=0.8,
                  sent=84, step_ms=0.4)
    assert got["sent"] == 84 and got["used"] == pytest.approx(122 / (2 * 84))
    assert got["busy"] == pytest.approx(84 * 2.0 * 0.4 / 50)
    plain = 4000.0  # tokens/s, B = 2
    plain_busy = busy_share(plain, 0.4, 2)
    assert plain_busy == pytest.approx(0.8)
    reached = reach(got["tokens_per_s"] / plain, got["ideal"], got["rows_share"])["reached"]
    assert got["used"] * got["busy"] / plain_busy == pytest.approx(reached)
    assert "used" not in figures([[8]], [np.array([4])], 0.01, v=1.0, d=1.0)  # not given: not claimed
    line = format_row(dict(row(2, "greedy", "chain", 4, got["tokens_per_s"]), **got,
                           **reach(got["tokens_per_s"] / plain, got["ideal"], got["rows_share"])))
    assert line.endswith(f" {got['used']:5.0%} {got['busy']:5.0%}")


def test_where_a_requests_time_went_adds_up_to_its_wall_from_what_was_measured():
    """request_split: B = 1's requests timed one after another, each one's wall its rounds (the
    plain loop's steps) at their cost inside a burst graph, its start and the rest, the rounds and
    readbacks a request's mean of those measured (an EOS may end a request early), not a budget's."""
    # 8 requests in 0.2 s sent 164 rounds and read 20 bursts back; a round 1.0 ms in its burst graph
    # (its verify and draft 0.9 ms of it, timed alone), a start 2.5 ms
    spec = request_split(0.2, 8, 164, 1.0, 0.9, 2.5, 20)
    assert spec == pytest.approx(dict(request_ms=25.0, request_rounds=20.5, round_ms=1.0, rounds_ms=20.5, vd_ms=0.9,
                                      start_ms=2.5, rest_ms=2.0, bursts=2.5))
    # the plain loop: 8 requests in 0.4 s, 8 bursts of 16 steps each, a step 0.367 ms; its step is the whole round
    plain = request_split(0.4, 8, 8 * 8 * 16, 0.367, None, 2.6, 64)
    assert plain.pop("vd_ms") is None
    assert plain == pytest.approx(dict(request_ms=50.0, request_rounds=128, round_ms=0.367, rounds_ms=128 * 0.367,
                                       start_ms=2.6, rest_ms=50.0 - 128 * 0.367 - 2.6, bursts=8))
    for split in (spec, plain):
        assert split["rounds_ms"] + split["start_ms"] + split["rest_ms"] == pytest.approx(split["request_ms"])
    assert request_split(0.2, 8, 8 * 20, 1.0, 0.9, 2.5, 8)["rest_ms"] == pytest.approx(2.5)  # one burst each


def test_a_configuration_is_timed_in_the_median_of_its_passes():
    """time_generations: one untimed run of the first group, then every group timed alone in each
    of three passes, between synchronisations; the median pass's seconds and its outputs (after
    each generation, read outside the timed spans), which carry what that pass counted."""
    # each group's start and end: the passes take 10 (5 + 5), 4 (3 + 1) and 2 (1 + 1) seconds
    ticks = iter([0.0, 5.0, 5.0, 10.0, 10.0, 13.0, 13.0, 14.0, 14.0, 15.0, 15.0, 16.0])
    ran: list[str] = []
    synchronised: list[int] = []
    pass_of = iter(p for p in range(3) for _ in range(2))

    def generate(group: str) -> str:
        ran.append(group)
        return group

    seconds, taken = time_generations(generate, ["a", "b"], after=lambda out: (out, next(pass_of)),
                                      synchronize=lambda: synchronised.append(len(ran)), clock=lambda: next(ticks))
    assert ran == ["a", "a", "b", "a", "b", "a", "b"], "the first group untimed, then three passes"
    assert seconds == 4.0 and taken == [("a", 1), ("b", 1)], "the median pass's, its own outputs"
    assert synchronised == [n for generated in range(2, 8) for n in (generated - 1, generated)], \
        "each timed generation between two synchronisations"


def test_the_timed_passes_run_with_the_heap_before_them_frozen():
    """What was alive before the passes is out of the collector's sight while they run (a
    collection of the models' objects inside a timed span would time the heap), and back in it
    after, the untimed first run outside; a caller's own freeze is left as it was."""
    import gc
    frozen: list[int] = []

    def generate(group: str) -> str:
        frozen.append(gc.get_freeze_count())
        return group

    assert gc.get_freeze_count() == 0
    time_generations(generate, ["a", "b"], synchronize=lambda: None)
    assert frozen[0] == 0 and all(count > 0 for count in frozen[1:]) and len(frozen) == 7
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        time_generations(generate, ["a"], synchronize=lambda: None, passes=1)
        assert gc.get_freeze_count() > 0, "the caller's freeze stays"
    finally:
        gc.unfreeze()


def test_the_median_is_one_whole_pass_or_run():
    """median_index: the median's index (of an even count the upper middle one), for the caller to
    keep that pass's or run's figures whole."""
    assert median_index([10.0, 4.0, 2.0]) == 1 and median_index([2.0, 9.0, 4.0]) == 2
    assert median_index([5.0]) == 0 and median_index([3.0, 1.0]) == 0 and median_index([1.0, 1.0, 1.0]) == 1


def test_a_rows_rounds_and_readbacks_are_its_median_passes_own(monkeypatch):
    """_bench_tree_config at B = 1: each mode's row counts the rounds sent and the bursts read back
    by the generations of its median pass alone (each generation brings its own counts), not the
    untimed first's nor another pass's or mode's, beside that pass's seconds and tokens."""
    from benchmarks import torch_common
    now = [0.0]
    durations = [100.0, 5.0, 5.0, 2.0, 2.0, 1.0, 1.0] * 2  # a mode's untimed first, then passes of 10, 4 and 2 s

    class Rounds:
        rounds, bursts = 7, 3  # the stream's counts run on from before the generations

    class Bufs:
        @staticmethod
        def rounds_run(lengths: list[int]) -> np.ndarray:
            return np.array(lengths) // 2

    class Spec:
        rounds, bufs, setup_seconds, calls = Rounds(), Bufs(), 1.5, 0

        def generate_batch(self, group: list[str], mode: str) -> list[list[int]]:
            call = self.calls
            self.calls += 1
            now[0] += durations[call]
            self.rounds.rounds += 10 + call
            self.rounds.bursts += 1 + call
            return [[0] * (4 + 2 * call) for _ in group]

    spec = Spec()
    monkeypatch.setattr(torch_common, "decoder", lambda *args, **kwargs: (spec, None, None))
    monkeypatch.setattr(torch_common, "round_costs", lambda *args: (0.6, 0.3))
    monkeypatch.setattr(torch_common, "burst_round_ms", lambda spec: 1.0)
    monkeypatch.setattr(torch_common, "decoder_start_ms", lambda spec, request: 2.5)
    monkeypatch.setattr(torch_common, "time_generations", functools.partial(
        torch_common.time_generations, synchronize=lambda: None, clock=lambda: now[0]))
    graph, overlap = torch_common._bench_tree_config(None, "chain", 4, [["p"], ["q"]], 999, None, 0.1,
                                                     modes=("graph", "overlap"))
    # the median passes: the graph mode's 3rd and 4th generations (calls 3 and 4), the overlap's 10th and 11th
    for row, (first, second) in ((graph, (3, 4)), (overlap, (10, 11))):
        tokens = (4 + 2 * first) + (4 + 2 * second)
        assert row["sent"] == (10 + first) + (10 + second) and row["bursts"] == ((1 + first) + (1 + second)) / 2
        assert row["request_rounds"] == row["sent"] / 2 and row["request_ms"] == pytest.approx(2e3)
        assert row["tokens_per_s"] == tokens / 4.0 and row["tau"] == tokens / (tokens // 2)
    assert (graph["launch"], overlap["launch"]) == ("graph", "overlap") and spec.calls == 14


def test_where_a_requests_time_went_is_a_line_a_row():
    """split_line: the plain loop's steps, a chain's or tree's rounds with its verify and draft
    alone beside them, named with the decoding and the mode (graph mode's too); a mean to a
    tenth, a whole one bare, one readback singular (device mode's, a launch a request)."""
    tree = dict(row(1, "greedy", "static", "k=8, 1 leaf", 5000.0, LEAVES),
                **request_split(0.2, 8, 164, 1.0, 0.9, 2.5, 20))
    assert split_line(tree) == ("where a request's time went, greedy k=8, 1 leaf (graph): 25.0 ms: 20.5 rounds x "
                                "1.000 ms = 20.5 ms (v + d 0.900 ms a round), its start 2.5 ms, the rest 2.0 ms over "
                                "2.5 readbacks")
    chain = dict(row(1, "sampling", "chain", 4, 3000.0), launch="device",
                 **request_split(0.3, 8, 240, 1.1, 1.0, 2.4, 8))
    assert split_line(chain) == ("where a request's time went, sampling k=4 (device): 37.5 ms: 30 rounds x 1.100 ms = "
                                 "33.0 ms (v + d 1.000 ms a round), its start 2.4 ms, the rest 2.1 ms over 1 readback")
    plain = dict(row(1, "greedy", "plain", "graphed greedy", 2560.0, "PLAIN", step_ms=0.367),
                 **request_split(0.4, 8, 8 * 8 * 16, 0.367, None, 2.6, 64))
    assert split_line(plain) == ("where a request's time went, plain graphed greedy: 50.0 ms: 128 steps x 0.367 ms = "
                                 "47.0 ms, its start 2.6 ms, the rest 0.4 ms over 8 readbacks")


def test_the_hbm_floor_is_the_weights_read_once_at_the_copys_bandwidth():
    # 20 copies of 1 GiB in 10 ms: each reads and writes it, 4.29 TB/s
    bandwidth = copy_bytes_per_s(1 << 30, 20, 10.0)
    assert bandwidth == pytest.approx(2 * 20 * 2**30 / 0.010)
    assert floor_ms(182_000_000, bandwidth) == pytest.approx(182_000_000 / bandwidth * 1e3)
    assert floor_ms(4_000_000_000, 4e12) == pytest.approx(1.0)


def test_the_weights_a_step_reads_leave_out_the_input_embedding_but_not_a_tied_head():
    torch = pytest.importorskip("torch", reason="needs PyTorch (pip install '.[torch]' in the checkout)")
    transformers = pytest.importorskip("transformers", reason="needs transformers")
    from benchmarks.headline import streamed_bytes
    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1,
                 num_key_value_heads=1)
    for tied in (False, True):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=tied, **shape))
        model = model.to(torch.bfloat16)
        every = sum(p.numel() for p in model.parameters()) * 2
        table = 256 * 64 * 2
        assert streamed_bytes(model) == (every if tied else every - table), f"tied={tied}"


def row(batch, mode, kind, config, tokens_per_s, source=None, **more):
    return dict(size="pair", batch=batch, mode=mode, kind=kind, config=config, source=source,
                tokens_per_s=tokens_per_s, **more)


def measured(batch, mode, kind, config, tokens_per_s, source=None, plain=1000.0, tau=3.0, v=1.1, d=0.5):
    """A chain's or tree's row as _bench_batch makes it."""
    out = row(batch, mode, kind, config, tokens_per_s, source, tau=tau, v=v, draft=d, ideal=tau / (v + d),
              rows_share=1.0, setup_s=95.0, sent=100, used=0.9, busy=0.8)
    out.update(reach(tokens_per_s / plain, out["ideal"], out["rows_share"]))
    return out


LEAVES = "TreeShape.chain_with_leaves(6, 1)"
TABLE = [
    row(1, "greedy", "plain", "graphed greedy", 1000.0, "PLAIN", vs_plain=1.0, step_ms=0.3, floor_ms=0.05),
    row(1, "greedy", "HF", "assisted, k=4", 200.0, vs_plain=0.2),
    measured(1, "greedy", "chain", 4, 1900.0), measured(1, "greedy", "static", "k=6, 1 leaf", 2100.0, LEAVES),
    measured(1, "greedy", "dynamic", "6x2, branch 2", 1500.0, "DynamicTree(6, 2, 2)"),
    measured(1, "sampling", "chain", 4, 1500.0), measured(1, "sampling", "static", "k=6, 1 leaf", 1400.0, LEAVES),
    measured(1, "sampling", "dynamic", "6x2, branch 2", 1300.0, "DynamicTree(6, 2, 2)"),
    row(8, "greedy", "plain", "graphed greedy", 8000.0, "PLAIN", vs_plain=1.0, step_ms=0.31, floor_ms=0.05),
    measured(8, "greedy", "chain", 3, 14000.0, plain=8000.0), measured(8, "greedy", "chain", 4, 15000.0, plain=8000.0),
    measured(8, "greedy", "static", "k=4, 1 leaf", 14500.0, "TreeShape.chain_with_leaves(4, 1)", plain=8000.0),
    measured(8, "greedy", "dynamic", "6x2, branch 2", 9000.0, "DynamicTree(6, 2, 2)", plain=8000.0),
    measured(8, "sampling", "chain", 4, 12000.0, plain=8000.0),
    measured(8, "sampling", "static", "k=4, 1 leaf", 11000.0, "TreeShape.chain_with_leaves(4, 1)", plain=8000.0),
    measured(8, "sampling", "dynamic", "6x2, branch 2", 12500.0, "DynamicTree(6, 2, 2)", plain=8000.0),
]


def test_the_picks_are_the_fastest_chain_or_tree_at_each_batch_and_decoding():
    picks = derive_picks(TABLE)
    assert {mode: {b: (r["kind"], r["config"]) for b, r in by_b.items()} for mode, by_b in picks.items()} == {
        "greedy": {1: ("static", "k=6, 1 leaf"), 8: ("chain", 4)},
        "sampling": {1: ("chain", 4), 8: ("dynamic", "6x2, branch 2")}}, "never the plain or Hugging Face's rows"


def test_the_picks_print_as_picked_takes_them():
    picks = derive_picks(TABLE)
    assert eval(picked_dict(picks["greedy"]), NAMESPACE) == {1: TreeShape.chain_with_leaves(6, 1), 8: None}
    assert eval(picked_dict(picks["sampling"]), NAMESPACE) == {1: None, 8: DynamicTree(6, 2, 2)}
    text = picks_text(picks, "pair 3f2a9c1e0b7d on NVIDIA H200")
    assert "pair 3f2a9c1e0b7d on NVIDIA H200" in text.splitlines()[0]
    assert '    "pair": {1: TreeShape.chain_with_leaves(6, 1), 8: None},  # greedy; the chains: k=4 at 8' in text
    assert "{1: None, 8: DynamicTree(6, 2, 2)}; the chains: k=4 at 1" in text
    assert "PLAIN where" not in text  # every pick beats the graphed greedy target


def test_other_modes_rows_are_summed_up_apart_and_never_picked_for_a_server():
    """--modes graph,overlap,device: the picks (tree_for_batch's, for servers, which step one
    burst at a time) and the best of each kind come from graph mode's rows alone, whatever the
    other modes'; a line a B and decoding sets the fastest in each mode that ran there side by
    side, in graph, overlap, device order, labelled; a B where graph mode alone ran has none."""
    from benchmarks.headline import launch_line, launch_summary, summarise
    graphed = [dict(r, launch="graph") if r["kind"] in ("chain", "static", "dynamic") else r for r in TABLE]

    def sped(launch, by):
        return [dict(r, launch=launch, tokens_per_s=r["tokens_per_s"] * by, vs_plain=r["vs_plain"] * by,
                     reached=r["reached"] * by)
                for r in graphed if r.get("launch") == "graph" and r["batch"] == 1 and r["kind"] == "chain"]
    device, overlap = sped("device", 1.5), sped("overlap", 1.25)
    both = graphed + device  # B = 1: the chain in device mode outruns every tree in graph mode
    every = graphed + device + overlap
    def named(picks):
        return {mode: {b: (r["kind"], r["config"]) for b, r in by_b.items()} for mode, by_b in picks.items()}
    assert named(derive_picks(both)) == named(derive_picks(every)) == named(derive_picks(TABLE))
    assert summarise(both) == summarise(every) == summarise(graphed) and \
        [s["chosen"] for s in summarise(every)] == [s["chosen"] for s in summarise(TABLE)]
    assert launch_summary(TABLE) == [] and launch_summary(graphed) == []
    (greedy, sampled) = launch_summary(both)
    assert greedy["launches"] == ["graph", "device"] and "overlap_config" not in greedy
    assert (greedy["batch"], greedy["mode"], greedy["device_config"], greedy["graph_config"]) == \
        (1, "greedy", "k=4, device", "k=6, 1 leaf")
    assert greedy["device_tokens_per_s"] == 2850.0 and greedy["graph_tokens_per_s"] == 2100.0
    assert sampled["device_config"] == "k=4, device" and sampled["graph_config"] == "k=4"
    line = launch_line(greedy)
    assert line.startswith("B = 1 greedy: graph mode's fastest k=6, 1 leaf 2100 tok/s (2.10x, ")
    assert line.index("graph mode's") < line.index("device mode's fastest k=4, device 2850 tok/s (2.85x, ")
    (greedy, _) = launch_summary(every)
    assert greedy["launches"] == ["graph", "overlap", "device"] and greedy["overlap_config"] == "k=4, overlap"
    line = launch_line(greedy)
    assert line.index("graph mode's") < line.index("overlap mode's fastest k=4, overlap 2375 tok/s") < \
        line.index("device mode's")


@pytest.mark.parametrize("left_out", [("dynamic",), ("static", "dynamic"), ("chain",)])
def test_a_run_that_left_a_kind_out_sums_up_prints_and_draws_the_kinds_it_ran(left_out, tmp_path):
    """--trees S,0 (no dynamic tree: stop 72's lease, whose summary met max() of nothing) or
    --chains with none: the best of each kind that ran, against the chain where one ran, the line
    naming those alone; the picture drawn where matplotlib is."""
    from benchmarks.headline import plot_headline, summarise, summary_line
    rows = [r for r in TABLE if r["kind"] not in left_out]
    summaries = summarise(rows)
    assert [(s["batch"], s["mode"]) for s in summaries] == [(1, "greedy"), (1, "sampling"), (8, "greedy"),
                                                            (8, "sampling")]
    for summary in summaries:
        line = summary_line(summary)
        assert all(f"best {kind} " not in line for kind in left_out) and "best " in line, line
        assert ("the chain" in line) == ("chain" not in left_out), line
        assert ("best_tree" in summary) == ("static" not in left_out or "dynamic" not in left_out)
    report = json.loads(json.dumps(assemble(pair_info(REPORT), "NVIDIA H100", "2026-12-06", {}, {}, rows)))
    assert report["best"] == json.loads(json.dumps(summaries))
    if importlib.util.find_spec("matplotlib"):
        plot_headline(report, tmp_path / "headline.png")
        assert (tmp_path / "headline.png").read_bytes().startswith(b"\x89PNG")


def test_where_every_configuration_loses_to_greedy_decoding_the_greedy_pick_is_not_to_speculate():
    slow = [dict(r, tokens_per_s=r["tokens_per_s"] / 2.5, vs_plain=r["vs_plain"] / 2.5)  # B = 1's best: greedy
            if r["batch"] == 1 and r["kind"] != "plain" else r for r in TABLE]  # 0.84x, sampled 0.60x
    picks = derive_picks(slow)
    assert picks["greedy"][1]["kind"] == "plain" and picks["greedy"][1]["instead_of"]["config"] == "k=6, 1 leaf"
    assert picks["greedy"][8]["config"] == 4, "1.88x the graphed greedy target: speculated"
    assert picks["sampling"][1]["config"] == 4, "the graphed greedy target does not sample: never PLAIN"
    namespace = dict(NAMESPACE, PLAIN="plain")  # benchmarks.picks.PLAIN, without importing torch
    assert eval(picked_dict(picks["greedy"]), namespace) == {1: "plain", 8: None}
    lines = picks_text(picks, "pair 3f2a9c1e0b7d on NVIDIA H200").splitlines()
    assert lines[-2:] == ["    greedy, PLAIN where every chain and tree measured was slower than the graphed greedy "
                          "target: B = 1 (the fastest, k=6, 1 leaf, 0.84x)",
                          "    sampled, slower than the graphed greedy target even at its fastest: B = 1 (0.60x)"]
    for summary in summarise(slow):
        if summary["mode"] == "greedy":  # the greedy pick is never slower than the target alone
            assert summary["chosen_tokens_per_s"] >= summary["plain_tokens_per_s"], summary

def test_the_tables_rows_line_up_under_its_header():
    lines = [format_row(r) for r in TABLE]
    width = len(HEADER.split(" vs plain")[0]) + len(" vs plain")
    assert all(line[width - 1] == "x" for line in lines), "tokens/s and vs plain under their heads"
    chain = format_row(TABLE[2])
    assert chain.split() == ["1", "greedy", "chain", "k=4", "1900", "1.90x", "3.00", "1.10", "0.50", "1.88x", "101%",
                             "100%", "101%", "95", "90%", "80%"]
    assert len(chain) == len(HEADER)
    assert "a step 0.300 ms: 6.0x the weights' HBM floor, 0.050 ms" in lines[0]
    assert lines[1].split() == ["1", "greedy", "HF", "assisted,", "k=4", "200", "0.20x"]


def test_the_json_holds_the_pair_the_machine_the_floor_the_rows_the_best_and_the_picks(capsys):
    info = pair_info(REPORT)
    settings = dict(batches=[1, 8], tokens=128, one_row_prompts=8, prompt_len=128, m_rounds=16, hf_k=4)
    floor = dict(weight_bytes=182_000_000, copy_bytes_per_s=4.0e12, floor_ms=0.0455)
    report = json.loads(json.dumps(assemble(info, "NVIDIA H200", "2026-12-03", settings, floor, TABLE)))
    assert set(report) == {"model", "machine", "date", "settings", "floor", "rows", "best", "launches", "picks"}
    assert report["launches"] == [], "no row ran in overlap or device mode"
    assert report["model"]["key"] == "3f2a9c1e0b7d" and report["model"]["target"]["heldout_loss"] == 2.187
    assert report["machine"] == "NVIDIA H200" and report["floor"] == floor and report["settings"] == settings
    assert len(report["rows"]) == len(TABLE)
    assert report["picks"] == {"greedy": {"1": LEAVES, "8": None}, "sampling": {"1": None, "8": "DynamicTree(6, 2, 2)"}}
    best = {(b["batch"], b["mode"]): b for b in report["best"]}
    assert set(best) == {(1, "greedy"), (1, "sampling"), (8, "greedy"), (8, "sampling")}
    assert best[1, "greedy"]["chosen"] == "k=6, 1 leaf" and best[1, "greedy"]["chosen_vs_chain"] == pytest.approx(
        2100 / 1900)
    assert best[8, "greedy"]["chain"] == 4 and best[8, "greedy"]["plain_tokens_per_s"] == 8000.0
    assert len(capsys.readouterr().out.splitlines()) == 4, "the summary: a line a batch size and decoding"
    split = request_split(0.2, 8, 164, 1.0, 0.9, 2.5, 20)
    timed = [dict(r, **split) if r["batch"] == 1 and r["kind"] != "HF" else r for r in TABLE]  # as _bench_batch's
    report = json.loads(json.dumps(assemble(info, "NVIDIA H200", "2026-12-03", settings, floor, timed)))
    lines = capsys.readouterr().out.splitlines()
    assert lines[4:] == [split_line(r) for r in timed if r["batch"] == 1 and r["kind"] != "HF"], \
        "then where a request's time went, a line a B = 1 row that measured it, in the table's order"
    assert len(lines) == 4 + 7 and lines[4].startswith("where a request's time went, plain graphed greedy: 25.0 ms")
    assert sum({"round_ms", "start_ms", "bursts"} <= set(r) for r in report["rows"]) == 7, "the JSON's rows carry them"


@pytest.mark.parametrize("matplotlib", [False, True], ids=["without matplotlib", "with matplotlib"])
def test_the_picture_is_the_trees_sections_of_the_pairs_best(monkeypatch, tmp_path, capsys, matplotlib):
    from benchmarks.headline import plot_headline
    if matplotlib:
        pytest.importorskip("matplotlib", reason="the picture needs matplotlib (the plot extra)")
    else:
        monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    report = json.loads(json.dumps(assemble(pair_info(REPORT), "NVIDIA H200", "2026-12-03", {}, {}, TABLE)))
    capsys.readouterr()
    picture = tmp_path / "headline.png"
    plot_headline(report, picture)  # from the JSON, as a reader of the file would draw it again
    out = capsys.readouterr().out
    assert picture.exists() == matplotlib and out.count("\n") == 1, out
    if matplotlib:
        assert picture.read_bytes().startswith(b"\x89PNG")


# -- what pair.py writes ------------------------------------------------------------------------

QUICK_PAIR = ["--quick", "--max-files", "1000", "--target-steps", "8", "--draft-steps", "8"]


@pytest.fixture(scope="module")
def quick_pair(tmp_path_factory):
    """A pair trained by `python -m benchmarks.pair --quick` on the CPU (seconds), in a cache of its
    own, and the arguments it ran with."""
    for name in ("torch", "transformers", "tokenizers"):
        pytest.importorskip(name, reason="benchmarks/pair.py trains with torch, transformers and tokenizers")
    import benchmarks
    argv = [*QUICK_PAIR, "--cache", str(tmp_path_factory.mktemp("pair"))]
    done = subprocess.run([sys.executable, "-m", "benchmarks.pair", *argv], capture_output=True, text=True,
                          cwd=Path(benchmarks.__file__).absolute().parents[1], timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (where,) = [path.parent for path in Path(argv[-1]).glob("*/report.json")]
    return where, argv


def test_the_headline_finds_a_pair_by_pair_pys_own_key(quick_pair):
    from benchmarks.headline import pair_dir
    where, argv = quick_pair
    assert pair_dir(argv) == where


def test_the_headline_reads_what_pair_py_writes(quick_pair):
    where, _ = quick_pair
    report, heldout = load_pair(where)
    info = pair_info(report)
    assert f"pair {where.name} (target Llama 2 x 128" in describe(info, "cpu", "today")
    ((seed, ids),) = prompt_groups(heldout, 1, one_row=1)[0]
    assert seed == 0 and len(ids) == heldout["prompt_len"] == 32
    for batch in BATCHES:  # trees fitted to whatever a draft trained for a second agrees
        assert configurations(batch, info["top"])


def test_the_figures_so_far_replace_the_last_batch_sizes_whole(tmp_path, capsys):
    path = tmp_path / "torch.headline.json"
    first = assemble(pair_info(REPORT), "NVIDIA H200", "2026-12-03", {}, {}, TABLE[:8])  # B = 1 alone
    save(first, path)
    assert json.loads(path.read_text())["picks"]["greedy"] == {"1": LEAVES}
    save(assemble(pair_info(REPORT), "NVIDIA H200", "2026-12-03", {}, {}, TABLE), path)
    assert json.loads(path.read_text())["picks"]["greedy"] == {"1": LEAVES, "8": None}
    assert [f.name for f in tmp_path.iterdir()] == [path.name], "no partial file left beside it"


def test_a_run_stopped_after_a_batch_size_keeps_the_ones_it_finished():
    saved: list[list[dict]] = []

    def measure(batch: int) -> list[dict]:
        if batch == 32:
            raise TimeoutError("the machine's ten minutes")
        return [row for row in TABLE if row["batch"] == batch]

    with pytest.raises(TimeoutError):
        measure_batches([1, 8, 32, 128], measure, lambda rows: saved.append(list(rows)))  # as written then
    assert [len(rows) for rows in saved] == [8, len(TABLE)], "after B = 1 and after B = 8"
    assert saved[-1] == TABLE
    quiet: list[list[dict]] = []
    assert measure_batches([1, 8], measure, quiet.append) == TABLE and len(quiet) == 1, "the last B is the caller's"
    assert measure_batches([1, 8], measure) == TABLE

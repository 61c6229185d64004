"""benchmarks/steps.py's arithmetic, without a GPU: the K/V bytes a step reads beside its weights,
and a row of the step table as it prints."""
from __future__ import annotations

from benchmarks.steps import ROWS, SHAPES, kv_bytes, line


def test_a_step_reads_the_valid_entries_of_every_layer_and_row_in_bf16():
    target = SHAPES["target 12 x 768"]  # 12 layers, 12 K/V heads of 64
    assert kv_bytes(target, 1, 512) == 2 * 2 * 12 * 12 * 64 * 512  # K and V, two bytes each
    assert kv_bytes(target, 64, 512) == 64 * kv_bytes(target, 1, 512)
    llama = SHAPES["Llama 3.2 1B shape"]  # heads of 64, 8 of them K/V
    assert kv_bytes(llama, 1, 100) == 2 * 2 * 16 * 8 * 64 * 100
    assert all(shape in SHAPES for shape, _, _ in ROWS)


def test_a_row_gives_each_ways_time_kernels_and_ratio_to_the_floor():
    row = dict(shape="target 12 x 768", batch=1, tokens=1, floor_ms=0.05,
               modules=dict(ms=1.25, kernels=508, first_s=0.5), **{"compiled sdpa": dict(ms=0.375, kernels=135,
                                                                                        first_s=26.5)})
    text = line(row)
    assert "floor 0.050 ms" in text and "modules: 1.250 ms (508 kernels, 25.0x floor" in text
    assert "compiled sdpa: 0.375 ms (135 kernels, 7.5x floor, first run 26.5 s)" in text


def test_rows_are_indices_into_the_table_refused_at_parsing_outside_it(monkeypatch, capsys):
    """--rows takes indices 0 to len(ROWS) - 1: -1 ran the last row, silently, and one past the
    table met an IndexError after parsing. Outside, argparse's error naming --rows (exit 2)."""
    import pytest

    from benchmarks import steps
    ran = []
    monkeypatch.setattr(steps, "needs", lambda *args, **kwargs: None)  # the run is stubbed: nothing to need
    monkeypatch.setattr(steps, "measure", lambda rows, *args, **kwargs: ran.append(list(rows)) or {})
    assert steps.main(["--rows", f"0,{len(ROWS) - 1}"]) == 0 and ran == [[ROWS[0], ROWS[-1]]]
    for rows in ("-1", str(len(ROWS)), "0,-1", "1.0", ""):
        with pytest.raises(SystemExit) as exited:
            steps.main(["--rows", rows])
        assert exited.value.code == 2 and "argument --rows" in capsys.readouterr().err
    assert len(ran) == 1


def test_the_entries_a_row_holds_reach_the_run_and_leave_the_widest_step_room(monkeypatch, capsys):
    """--valid (default VALID) is what every row holds when a step is timed: SDPA reads the whole
    cache and flex what rows hold, so a served stream's rows, far from full, are measured at
    fewer. From 1 to CAPACITY - WIDEST, at both ends; past them argparse's error (exit 2), where
    the widest step's tokens would have run past the cache."""
    import pytest

    from benchmarks import steps
    assert max(tokens for _, _, tokens in ROWS) <= steps.WIDEST
    ran = []
    monkeypatch.setattr(steps, "needs", lambda *args, **kwargs: None)  # the run is stubbed: nothing to need
    monkeypatch.setattr(steps, "measure", lambda rows, *args, **kwargs: ran.append(kwargs["valid"]) or {})
    for argv, valid in (([], steps.VALID), (["--valid", "1"], 1), (["--valid", str(steps.CAPACITY - steps.WIDEST)],
                                                                    steps.CAPACITY - steps.WIDEST)):
        assert steps.main(["--rows", "0", *argv]) == 0 and ran[-1] == valid
    for bad in ("0", str(steps.CAPACITY - steps.WIDEST + 1), "half"):
        with pytest.raises(SystemExit) as exited:
            steps.main(["--rows", "0", "--valid", bad])
        assert exited.value.code == 2 and "argument --valid" in capsys.readouterr().err
    assert len(ran) == 3


def test_flex_options_are_a_json_object_handed_to_the_run(monkeypatch, capsys):
    """Each --flex-options' JSON object reaches measure() as a dict, in order (none given: none);
    JSON that is not an object, or no JSON, is argparse's error naming it (exit 2), before any
    GPU work."""
    import pytest

    from benchmarks import steps
    ran = []
    monkeypatch.setattr(steps, "needs", lambda *args, **kwargs: None)  # the run is stubbed: nothing to need
    monkeypatch.setattr(steps, "measure", lambda rows, *args, **kwargs: ran.append(kwargs["flex_options"]) or {})
    assert steps.main(["--rows", "5"]) == 0 and ran == [[]]
    assert steps.main(["--rows", "5", "--flex-options", '{"FORCE_USE_FLEX_ATTENTION": true, "BLOCK_M": 16}',
                       "--flex-options", '{"SPLIT_KV": 1}']) == 0
    assert ran[-1] == [{"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 16}, {"SPLIT_KV": 1}]
    for bad in ("[1, 2]", "true", "{force}"):
        with pytest.raises(SystemExit) as exited:
            steps.main(["--rows", "5", "--flex-options", bad])
        assert exited.value.code == 2 and "argument --flex-options" in capsys.readouterr().err
    assert len(ran) == 2


def test_attentions_are_named_each_once_and_refused_at_parsing_otherwise(monkeypatch, capsys):
    """A misspelt one (or ',') reached CompiledStack's refusal after the GPU check, rows into the run;
    one named twice was measured twice."""
    import pytest

    from benchmarks import steps
    ran = []
    monkeypatch.setattr(steps, "needs", lambda *args, **kwargs: None)  # the run is stubbed: nothing to need
    monkeypatch.setattr(steps, "measure", lambda rows, attentions, *args, **kwargs: ran.append(attentions) or {})
    assert steps.main(["--rows", "0"]) == 0 and steps.main(["--rows", "0", "--attention", "sdpa"]) == 0
    assert ran == [["flex", "sdpa"], ["sdpa"]]
    for attention in ("bogus", ",", "flex,flex", ""):
        with pytest.raises(SystemExit) as exited:
            steps.main(["--attention", attention])
        assert exited.value.code == 2 and "argument --attention" in capsys.readouterr().err
    assert len(ran) == 2

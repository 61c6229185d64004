"""benchmarks/picture.py on CPU: a report's picture drawn again from its JSON, served's or the
headline's by its fields, and what it refuses in one line (a report of neither, a file that is no
JSON, a machine without matplotlib)."""
from __future__ import annotations

import json
import sys

import pytest

from benchmarks.headline import assemble, pair_info
from benchmarks.picture import drawer, main
from benchmarks.served import best, plot, row_of
from memra_cuda.rounds import Served
from test_headline import REPORT, TABLE


def served_report() -> dict:
    """benchmarks.served's JSON of one B, as its run writes it."""
    def stream(tokens: int, accepted: int | None) -> list[list[Served]]:  # one timed run
        return [[Served(list(range(tokens)), 0.0, 0.0, [2.0] * tokens, 2.0, accepted=accepted)]]
    plain = row_of(8, "greedy", "plain sdpa", stream(100, None), 1.0, None)
    rows = [plain, row_of(8, "greedy", "chain k=2", stream(150, 90), 30.0, plain["tokens_per_s"]),
            row_of(8, "greedy", "adaptive k=3 (0, 1)", stream(160, 95), 30.0, plain["tokens_per_s"])]
    return json.loads(json.dumps(dict(name="pair 3f2a9c1e0b7d on NVIDIA H200, 2026-12-06", machine="NVIDIA H200",
                                      date="2026-12-06", m_rounds=16, batches=[8], rows=rows, best=best(rows))))


def headline_report(capsys) -> dict:
    report = json.loads(json.dumps(assemble(pair_info(REPORT), "NVIDIA H200", "2026-12-03", {}, {}, TABLE)))
    capsys.readouterr()  # assemble's summary lines
    return report


def test_each_programs_report_is_drawn_by_its_own_picture(capsys):
    from benchmarks.headline import plot_headline
    assert drawer(served_report()) is plot and drawer(headline_report(capsys)) is plot_headline
    for neither in ({"rows": []}, [1, 2], {"m_rounds": 16, "rows": []}):
        with pytest.raises(ValueError, match="neither benchmarks.served's report"):
            drawer(neither)


@pytest.mark.parametrize("which", ["served", "headline"])
def test_a_picture_is_drawn_beside_the_report_or_where_asked(tmp_path, capsys, which):
    pytest.importorskip("matplotlib", reason="the picture needs matplotlib (the plot extra)")
    report = tmp_path / f"{which}.json"
    report.write_text(json.dumps(served_report() if which == "served" else headline_report(capsys)))
    assert main([str(report)]) == 0
    assert (tmp_path / f"{which}.png").read_bytes().startswith(b"\x89PNG")
    elsewhere = tmp_path / "elsewhere.png"
    assert main([str(report), "--out", str(elsewhere)]) == 0 and elsewhere.read_bytes().startswith(b"\x89PNG")
    assert str(elsewhere) in capsys.readouterr().out


def test_what_it_cannot_draw_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    cases = {"missing.json": None, "bad.json": "{not json", "other.json": json.dumps({"rows": []})}
    for name, text in cases.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        with pytest.raises(SystemExit) as ended:
            main([str(tmp_path / name)])
        err = capsys.readouterr().err
        assert ended.value.code == 1 and err.startswith(f"benchmarks.picture: {tmp_path / name}: ")
        assert err.count("\n") == 1, err
    good = tmp_path / "served.json"
    good.write_text(json.dumps(served_report()))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as on a machine without it
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *args: None if name == "matplotlib" else object())
    with pytest.raises(SystemExit):
        main([str(good)])
    assert "no module named 'matplotlib'" in capsys.readouterr().err and not good.with_suffix(".png").exists()

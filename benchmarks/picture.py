"""A report's picture drawn again from its JSON, on any machine: benchmarks.served and
benchmarks.headline draw theirs beside their --json where matplotlib (the `plot` extra) is
installed, and the GPU machine that measured may have none (the lent H200s have none), so the
figures come back as JSON and the picture is drawn here. Which program wrote a report is read
from its fields: served's has its rounds a burst (m_rounds), the headline's its models (model).
Needs matplotlib; no GPU, no torch.

    PYTHONPATH=. python -m benchmarks.picture REPORT.json [--out PICTURE.png]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .headline import plot_headline
from .needs import refuse
from .served import plot


def drawer(report: Mapping[str, Any]) -> Callable[[Mapping[str, Any], Path], None]:
    """The program's picture for `report`: served's or the headline's; ValueError naming the
    fields found where it is neither's."""
    fields = set(report) if isinstance(report, Mapping) else set()
    if {"m_rounds", "rows", "best", "name"} <= fields:
        return plot
    if {"model", "machine", "date", "best"} <= fields:
        return plot_headline
    found = sorted(fields) if isinstance(report, Mapping) else type(report).__name__
    raise ValueError(f"neither benchmarks.served's report (its m_rounds, rows, best and name) nor "
                     f"benchmarks.headline's (its model, machine, date and best): found {found}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.picture", description=__doc__.split("\n\n")[0])
    p.add_argument("report", help="a report's JSON, written by benchmarks.served or benchmarks.headline --json")
    p.add_argument("--out", help="the picture (PNG; default: the report's path with .png)")
    args = p.parse_args(argv)
    try:
        report = json.loads(Path(args.report).read_text(encoding="utf-8"))
        draw = drawer(report)
    except (OSError, ValueError) as exc:  # json's JSONDecodeError is a ValueError
        refuse("benchmarks.picture", f"{args.report}: {exc}")
    if importlib.util.find_spec("matplotlib") is None:
        refuse("benchmarks.picture", "no module named 'matplotlib': the picture needs it (pip install matplotlib, "
               "the plot extra)")
    out = Path(args.out) if args.out else Path(args.report).with_suffix(".png")
    draw(report, out)
    print(f"benchmarks.picture: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

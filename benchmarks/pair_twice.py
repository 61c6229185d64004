"""Issue 47 item 5: whether the pair reproduces. `make pair` twice with one key, each run a process
of its own into an empty cache of its own, as two machines' first runs would, then the two reports
side by side: the same key, the target's and the draft's held-out losses within 0.02 nats/token
(LOSS_TOLERANCE), the draft's top-1 agreement along the target's greedy text within one point
(TOP1_TOLERANCE).

    python -m benchmarks.pair_twice [--caches DIR DIR] [--json PATH] [-- pair.py's flags, --quick ...]

The caches must not hold the key already (a run that finds its pair trains nothing: no second
run); left out, two new folders under the system's temporary one. The first cache's pair is the
one to measure with (`benchmarks.headline --pair`), so one lease trains it once for both. Exits 1
where the two disagree, and where a run fails, in one line after the run's own (where torch,
transformers or tokenizers is missing, pair.py's one line), the new folders that hold no pair
removed. Imports no torch itself: each run is pair.py's own process.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .headline import load_pair
from .torch_common import writable

LOSS_TOLERANCE = 0.02  # nats/token, each model's held-out loss
TOP1_TOLERANCE = 0.01  # the draft's top-1 agreement, a share (one point)


def refuse_held(cache: Path) -> None:
    """ValueError where `cache` holds a pair already: a run there would find it and train nothing."""
    if any(cache.glob("*/report.json")):
        raise ValueError(f"{cache} holds a pair already: a run there would find it and train nothing")


def train(cache: Path, flags: Sequence[str]) -> Path:
    """One `python -m benchmarks.pair FLAGS --cache CACHE` into `cache` (after the flags, so that a
    --cache among them cannot send both runs into one), which must be empty of pairs; the
    directory of the pair it trained (its one key's)."""
    refuse_held(cache)
    subprocess.run([sys.executable, "-m", "benchmarks.pair", *flags, "--cache", str(cache)], check=True)
    found = sorted(path.parent for path in cache.glob("*/report.json"))
    if len(found) != 1:
        raise RuntimeError(f"benchmarks.pair left {len(found)} pairs in {cache}, not one")
    return found[0]


def agreement(first: Mapping[str, Any], second: Mapping[str, Any]) -> dict[str, Any]:
    """The two reports (report.json) side by side: each figure of both, their difference, its
    tolerance and whether it holds; `agree` where every one does and the key is one."""
    figures = {f"{name} held-out loss": (first[name]["heldout_loss"], second[name]["heldout_loss"], LOSS_TOLERANCE)
               for name in ("target", "draft")}
    figures["draft top-1 agreement"] = (_top1(first), _top1(second), TOP1_TOLERANCE)
    # to a millionth: report.json's figures have four places, and 2.1208 - 2.1008 is 0.02 and a bit in floats
    rows = {what: dict(first=a, second=b, difference=round(abs(a - b), 6), tolerance=tolerance,
                       holds=round(abs(a - b), 6) <= tolerance)
            for what, (a, b, tolerance) in figures.items()}
    same_key = first["key"] == second["key"]
    return dict(key=first["key"], same_key=same_key, figures=rows,
                agree=same_key and all(row["holds"] for row in rows.values()))


def _top1(report: Mapping[str, Any]) -> float:
    """The draft's top-1 agreement: report.json's agreement.top, its keys k as JSON writes them."""
    top = report["agreement"]["top"]
    return float(top["1"] if "1" in top else top[1])


def lines(result: Mapping[str, Any]) -> list[str]:
    """The comparison as text, a line a figure and a verdict."""
    out = [f"pair twice: key {result['key']}" + ("" if result["same_key"] else " and another: not one pair's runs")]
    for what, row in result["figures"].items():
        out.append(f"  {what:24} {row['first']:.4f}  {row['second']:.4f}  difference {row['difference']:.4f} "
                   f"(at most {row['tolerance']}): {'holds' if row['holds'] else 'DOES NOT HOLD'}")
    out.append("the two runs agree" if result["agree"] else "the two runs DISAGREE")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pair_twice", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--caches", nargs=2, type=Path, metavar="DIR", help="the two runs' caches (default: two new "
                        "temporary folders)")
    parser.add_argument("--json", type=writable, metavar="PATH", help="also write the comparison as JSON")
    parser.add_argument("flags", nargs="*", help="pair.py's own flags, after --")
    args = parser.parse_args(argv)
    caches = args.caches or [Path(tempfile.mkdtemp(prefix=f"pair{i}-")) for i in (1, 2)]
    if caches[0].resolve() == caches[1].resolve():
        parser.error("--caches: two folders, not one twice (the second run would find the first's pair)")
    for cache in caches:  # both before either trains: the second found full after the first's minutes of training
        refuse_held(cache)
    try:
        pairs = [train(cache, args.flags) for cache in caches]
    except subprocess.CalledProcessError as exc:  # its own lines say why (pair.py's, one where a package is missing)
        print(f"benchmarks.pair_twice: {shlex.join(exc.cmd)} exited with status {exc.returncode}: no pair to "
              "compare", file=sys.stderr)
        for cache in () if args.caches else caches:  # the new folders, where no run left a pair (else kept)
            with contextlib.suppress(OSError):
                cache.rmdir()
        return 1
    reports = [load_pair(pair)[0] for pair in pairs]
    result = dict(agreement(*reports), pairs=[str(pair) for pair in pairs])
    print("\n".join(lines(result)), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if result["agree"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

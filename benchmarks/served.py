"""The served headline (issue 48): the trained pair (benchmarks/pair.py) serving a stream of
requests through B slots by continuous batching, the plain decoding and speculation alike, where
the headline (benchmarks/headline.py) decodes static batches.

At B = 1, 8, 32, 64 and 128: a stream of max(16, 4 B) requests, held-out prompts of the pair's
heldout.json in order (from the first again past its end), each with a budget drawn from 32 to 512
new tokens by a seeded generator and the pair's end-of-text token honoured
(benchmarks/serving.py's request_stream), every request submitted at the start. Through each
decoder, graph mode, M = 16 (--rounds), every graph captured before the stream (a warm-up stream
of B requests of 8 tokens first, untimed), the stream is served three times (TIMED_RUNS), each run
timed by its Served records, and a row is the median run's (its column "spread": how far the runs lay
apart, (fastest - slowest) / median):

- the plain decoding: the target alone, compiled, graphed, a readback a burst of 16 steps
  (GraphedGreedy), its one-token step attending by SDPA over the whole cache and by flex over the
  blocks a row holds (PLAIN_ATTENDS): the faster is the baseline of every ratio, sampled rows' too;
- chains of k drafts (SpeculativeLlama), fewer and shorter as B grows (CHAINS), greedy and
  sampled at temperature 1;
- the adaptive configuration (ADAPTIVE): a chain with bodies of narrower widths, 0 among them,
  the width chosen each round on the device from the rows' acceptance and each body's measured
  time (docs/lengths.md; where the driver has no SWITCH nodes, the row says so and is skipped), at
  an M of its own where a shorter burst keeps the p99 time between tokens (8 at B = 128, its row
  "adaptive k=2 M=8");

each with tokens/s over the span served, time to the first token and time between tokens at p50 and
p99 (benchmarks/serving.py says how each is taken; every request arrives at the start, so a
request's time to its first token includes its wait for a slot: at B = 1, up to 15 requests'),
tokens a round (tau, from each request's accepted drafts read back with its tokens) and the
decoder's setup seconds. Then, at each B and decoding, the best chain and the adaptive configuration
against the plain decoding (--fixed-at B,B: the fixed chains at those B's alone, elsewhere the plain decoding
and the adaptive configuration, which issue 48's bars read; a lease short of time). --adaptive-rounds M,M
serves the adaptive configuration again at each of those M's (its rows say "M=..."): a request that stops
mid-burst waits for the burst's end, so its last tokens' wait, and the p99 time between tokens, grow with a
burst's wall, which a speculative round of several tokens a row lengthens. One
table; with --json, the figures, written again as each B ends, and a picture beside them (PATH with
.png; matplotlib, the plot extra); with --resume too, added to the report there: a run of every B
that one call's time limit cuts into several, on one machine's pair, is one table and one picture
(`python -m benchmarks.picture PATH` draws it again from the JSON where the GPU's machine had no
matplotlib).
--projection sets how every compiled step multiplies its projections, the plain decoding's too
(docs/compiled.md; the report says which). Needs torch, transformers and tokenizers, a GPU and the
pair (`make pair`).

    PYTHONPATH=. python -m benchmarks.served [--quick] [--json PATH [--resume]] [--pair DIR] [--batches 1,8,32,64,128]
        [--rounds M] [--projection few_rows] [--fixed-at 1] [--adaptive-rounds 8,4]
"""
from __future__ import annotations

import argparse
import json
import math
import textwrap
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .headline import MODES, describe, measure_batches, opened, pair_arguments, save
from .needs import PAIR, needs
from .serving import figures, request_stream
from .torch_common import PLAIN_ATTENDS, TORCH_M, bounded, listed, median_index, projected, pyplot, release
from memra_cuda import Geometry
from memra_cuda.errors import SwitchUnsupported
from memra_cuda.rounds.serving import Request, Served

BATCHES, QUICK_BATCHES = (1, 8, 32, 64, 128), (1, 8)
# a verify's cost grows with B; at B = 1 the distilled pair's chain of 8 makes 6.70 tokens a round (k = 6: 5.67)
CHAINS = {1: (2, 3, 4, 6, 8), 8: (2, 3, 4), 32: (1, 2, 3), 64: (1, 2), 128: (1, 2)}


@dataclass(frozen=True)
class Adaptive:
    """The adaptive configuration at one B: a chain of `k` with bodies of the narrower `widths`, one
    chosen each round on the device (SpeculativeLlama's widths; a CUDA 12.8+ driver), 0 among them
    (plain decoding), and every chain CHAINS measures at that B among them (at B = 32, T = 1, widths
    0, 1 and 3 alone, 1.10x, lost to the chain of 2, 1.16x, that they could not run); served at
    `rounds` a burst (at most --rounds, which sizes every cache). A request that stops mid-burst
    waits for the burst's end, so its last tokens wait a whole burst, and a burst's wall grows
    with B: where a round costs most, a shorter burst keeps the p99 time between tokens at the
    plain decoding's (B = 128, an H100: M = 8 against 16 kept the tokens/s and brought the p99
    under the plain decoding's; M = 4 paid a readback too often. benchmarks/RESULTS.md)."""
    k: int
    widths: tuple[int, ...]
    rounds: int = TORCH_M

    def at(self, m_rounds: int) -> int:
        """Its M in a run whose bursts (and caches) are at most `m_rounds`."""
        return min(self.rounds, m_rounds)


ADAPTIVE = {1: Adaptive(8, (0, 2, 3, 4, 6)), 8: Adaptive(4, (0, 1, 2, 3)), 32: Adaptive(3, (0, 1, 2)),
            64: Adaptive(2, (0, 1)), 128: Adaptive(2, (0, 1), 8)}
STREAM_SEED = 48
WARM_TOKENS = 8  # the warm-up stream's budget a request
# The stream is served this many times a decoder, each run timed, and a row is its median run's: one run
# of ~1 to 3 s measured B = 128's adaptive configuration at 1.25x in one lease and 1.88x in the next
# (the same pair, card and stream), and a run more costs seconds where a decoder's setup costs tens.
TIMED_RUNS = 3


def stream_for(heldout: Mapping[str, Any], batch: int, eos: int | None, quick: bool = False) -> list[Request]:
    """B's stream: max(16, 4 B) held-out prompts in order (max(4, 2 B) of 8 to 16 tokens under
    `quick`), from the first again where the pool holds fewer (473 prompts; B = 128 serves 512:
    a prompt served twice has a budget of its own, and nothing is cached between requests), budgets
    from request_stream's seeded draw, the pair's EOS."""
    pool, count = heldout["prompts"], max(4, 2 * batch) if quick else max(16, 4 * batch)
    if not pool:
        raise ValueError("heldout.json holds no prompts")
    return request_stream([list(pool[i % len(pool)]["ids"]) for i in range(count)], seed=STREAM_SEED, eos=eos,
                          budgets=(8, 16) if quick else (32, 512))


def servable(heldout: Mapping[str, Any], batches: Sequence[int], eos: object, quick: bool = False) -> None:
    """ValueError now, before any B runs, where the pair cannot serve them all: its target names
    no single EOS id, or its held-out pool is empty."""
    if not isinstance(eos, int):
        raise ValueError(f"the pair's target names no single EOS token id (config.eos_token_id = {eos!r})")
    stream_for(heldout, min(batches), eos, quick)  # refuses an empty pool


def tau(served: Sequence[Served]) -> float | None:
    """Tokens a round over the requests that ran, from the accepted drafts each one's readbacks
    brought (None for a decoder without drafts)."""
    ran = [(len(out.tokens), out.rounds) for out in served if out.rounds]
    return sum(tokens for tokens, _ in ran) / sum(rounds for _, rounds in ran) if ran else None


def row_of(batch: int, mode: str, config: str, runs: Sequence[Sequence[Served]], setup_s: float,
           plain: float | None) -> dict[str, Any]:
    """One decoder's row from its timed `runs` of the stream (each run one Served a request): the
    figures of the median run by tokens/s (every run serves the same requests to the same tokens,
    greedy or seeded, so they differ only in time), each run's tokens/s in run order
    (`runs_tokens_per_s`), tau, setup, and its tokens/s over the plain decoding's (`plain`; None:
    this is the plain decoding)."""
    if not runs:
        raise ValueError(f"{config} at B = {batch}: no timed run of the stream")
    found = [figures(served) for served in runs]
    middle = median_index([run["tokens_per_s"] for run in found])
    vs_plain = 1.0 if plain is None else found[middle]["tokens_per_s"] / plain
    return dict(batch=batch, mode=mode, config=config, **found[middle], tau=tau(runs[middle]), setup_s=setup_s,
                vs_plain=vs_plain, runs_tokens_per_s=[run["tokens_per_s"] for run in found])


def run_spread(row: Mapping[str, Any]) -> float | None:
    """How far a row's timed runs lay apart: (fastest - slowest) / the median's tokens/s; None for
    a row of one run (or an earlier report's, which kept none)."""
    runs = row.get("runs_tokens_per_s") or []
    return (max(runs) - min(runs)) / row["tokens_per_s"] if len(runs) > 1 else None


def plains(rows: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """B -> the faster plain decoding's tokens/s (the baseline), over the rows of the plain
    decoding's attentions."""
    out: dict[int, float] = {}
    for row in rows:
        if row["config"].startswith("plain"):
            out[row["batch"]] = max(out.get(row["batch"], 0.0), row["tokens_per_s"])
    return dict(sorted(out.items()))


def best(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """At each B and decoding, the fixed chain of the most tokens/s, beside the plain decoding's
    (the adaptive configuration is measured against it: within 5 % of it at B = 1, the issue asks)."""
    out = []
    for key in sorted({(row["batch"], row["mode"]) for row in rows if row["config"].startswith("chain")}):
        chains = [row for row in rows if (row["batch"], row["mode"]) == key and row["config"].startswith("chain")]
        top = max(chains, key=lambda row: row["tokens_per_s"])
        out.append(dict(batch=key[0], mode=key[1], config=top["config"], tokens_per_s=top["tokens_per_s"],
                        vs_plain=top["vs_plain"], tbt_p99_s=top["tbt_p99_s"],
                        tbt_p99_mid_s=top.get("tbt_p99_mid_s")))
    return out


def summary_lines(rows: Sequence[Mapping[str, Any]], tops: Sequence[Mapping[str, Any]]) -> list[str]:
    """A line for each B and decoding served: its best fixed chain (best(); none where --fixed-at
    left the chains out) and the adaptive configuration, each against the plain decoding, the
    adaptive against the best chain too, with their p99 times between tokens (and, where the row
    has it, that p99 without each request's last readback: benchmarks/serving.py)."""
    lines = []
    for batch, mode in sorted({(row["batch"], row["mode"]) for row in rows if not row["config"].startswith("plain")}):
        top = next((top for top in tops if (top["batch"], top["mode"]) == (batch, mode)), None)
        parts = [] if top is None else [f"best chain {top['config']} {top['tokens_per_s']:.0f} tokens/s, "
                                         f"{top['vs_plain']:.2f}x plain, {tbt_text(top)}"]
        for row in rows:
            if (row["batch"], row["mode"]) == (batch, mode) and row["config"].startswith("adaptive"):
                against = "" if top is None else f", {row['tokens_per_s'] / top['tokens_per_s']:.1%} of the best chain"
                parts.append(f"{row['config']} {row['tokens_per_s']:.0f} tokens/s, {row['vs_plain']:.2f}x plain"
                             f"{against}, {tbt_text(row)}")
        lines.append(f"  B = {batch:>3} {mode:9} " + "; ".join(parts))
    return lines


def is_adaptive(row: Mapping[str, Any], m_rounds: int) -> bool:
    """Whether `row` is the adaptive configuration of its B, at ADAPTIVE's M for a run at most
    `m_rounds` a burst (--adaptive-rounds' other M's are rows apart; an earlier run's row without
    `rounds` was served at the run's M)."""
    return row["config"].startswith("adaptive") and row.get("rounds", m_rounds) == ADAPTIVE[row["batch"]].at(m_rounds)


def adaptive_rows(report: Mapping[str, Any], mode: str) -> list[Mapping[str, Any]]:
    """The adaptive configuration's rows of one decoding, by B (a resumed report's rows are in the
    order its runs served them: a line through them in that order doubled back)."""
    return sorted((row for row in report["rows"] if row["mode"] == mode and is_adaptive(row, report["m_rounds"])),
                  key=lambda row: row["batch"])


def tbt_text(row: Mapping[str, Any]) -> str:
    """A row's p99 time between tokens, and without each request's last readback where it has it."""
    mid = row.get("tbt_p99_mid_s")  # NaN where no request read back thrice; absent from earlier runs' rows
    return f"TBT p99 {1e3 * row['tbt_p99_s']:.2f} ms" + ("" if mid is None or math.isnan(mid) else
                                                          f" ({1e3 * mid:.2f} without a request's last readback)")


HEADER = (f"{'B':>4} {'decoding':9} {'config':16} {'tokens/s':>9} {'vs plain':>8} {'tau':>5} {'TTFT p50 ms':>11} "
          f"{'p99':>8} {'TBT p50 ms':>10} {'p99':>7} {'setup s':>7} {'spread':>6}")


def format_row(row: Mapping[str, Any]) -> str:
    tau_text = "" if row["tau"] is None else f"{row['tau']:.2f}"
    apart = run_spread(row)
    return (f"{row['batch']:>4} {row['mode']:9} {row['config']:16} {row['tokens_per_s']:9.0f} {row['vs_plain']:7.2f}x "
            f"{tau_text:>5} {1e3 * row['ttft_p50_s']:11.1f} {1e3 * row['ttft_p99_s']:8.1f} "
            f"{1e3 * row['tbt_p50_s']:10.2f} {1e3 * row['tbt_p99_s']:7.2f} {row['setup_s']:7.1f}"
            + ("" if apart is None else f" {apart:6.1%}"))


def plot(report: Mapping[str, Any], path: str | Path) -> None:
    """Tokens/s against B: the plain decoding, the best fixed chain and the adaptive
    configuration, greedy and sampled (without matplotlib, one line)."""
    plt = pyplot("served", path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    plain = plains(report["rows"])
    ax.plot(list(plain), list(plain.values()), "k-o", label="plain (compiled, graphed; the faster attention)")
    for mode, color in zip(MODES, ("b", "r")):
        top = [row for row in report["best"] if row["mode"] == mode]
        ax.plot([r["batch"] for r in top], [r["tokens_per_s"] for r in top], f"{color}-s", label=f"best chain, {mode}")
        adaptive = adaptive_rows(report, mode)
        ax.plot([r["batch"] for r in adaptive], [r["tokens_per_s"] for r in adaptive], f"{color}--^",
                label=f"adaptive, {mode}")
    ax.set(xscale="log", yscale="log", xlabel="slots (B)", ylabel="tokens/s served",
           title=textwrap.fill(report["name"], 110))  # one line of it ran past the picture
    ax.title.set_fontsize(7)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _served(decoder: Any, requests: Sequence[Request], batch: int) -> list[list[Served]]:
    """The stream through `decoder`'s server TIMED_RUNS times, each run timed, after an untimed
    warm-up stream of B short requests (the server's first steps, the host's caches), every
    graph captured before any."""
    server = decoder.server()
    server.serve([request._replace(max_new_tokens=WARM_TOKENS) for request in requests[:batch]])
    return [server.serve(requests) for _ in range(TIMED_RUNS)]


def _bench_batch(target: Any, draft: Any, heldout: Mapping[str, Any], batch: int, quick: bool,
                 m_rounds: int, fixed: bool = True, adaptive_rounds: Sequence[int] = ()) -> list[dict]:
    """B's rows: the plain decoding, then each chain (where `fixed`) and the adaptive
    configuration (again at each of `adaptive_rounds`' other M's, none above m_rounds), greedy and
    sampled, in caches of one capacity (sized at m_rounds), every row's M its `rounds`."""
    from memra_cuda.torch import GraphedGreedy, SamplingParams, SpeculativeLlama, capacity_for
    from memra_cuda.errors import NotFused
    requests = stream_for(heldout, batch, target.config.eos_token_id, quick)
    chains = (CHAINS[batch][:1] if quick else CHAINS[batch]) if fixed else ()
    capacity = capacity_for(max(len(r.prompt) for r in requests), max(r.max_new_tokens for r in requests),
                            Geometry(max(*CHAINS[batch], ADAPTIVE[batch].k), m_rounds, batch))
    rows = []
    for attention in PLAIN_ATTENDS:
        begun = time.perf_counter()
        try:
            plain_decoder = GraphedGreedy(target, capacity, batch, steps=m_rounds, attention=attention)
        except NotFused:  # the model's own modules: no attention to choose
            continue
        plain_decoder.server()  # its burst's graph and every prefill graph, as a chain's setup_seconds count them
        setup = time.perf_counter() - begun
        label = f"plain {attention}"
        rows.append(dict(row_of(batch, "greedy", label, _served(plain_decoder, requests, batch), setup, None),
                         rounds=m_rounds))
        del plain_decoder
        release()
    plain = max(row["tokens_per_s"] for row in rows)  # the baseline: the faster plain decoding
    for row in rows:
        row["vs_plain"] = row["tokens_per_s"] / plain
        print(format_row(row), flush=True)
    adaptive = ADAPTIVE[batch]
    configs: list[tuple[str, int, tuple[int, ...], int]] = [(f"chain k={chain}", chain, (), m_rounds)
                                                            for chain in chains]
    configs += [(f"adaptive k={adaptive.k}" + ("" if m == m_rounds else f" M={m}"), adaptive.k, adaptive.widths, m)
                for m in dict.fromkeys((adaptive.at(m_rounds), *adaptive_rounds))]
    for mode, sampling in zip(MODES, (None, SamplingParams(1.0))):
        for label, chain, narrower, rounds in configs:
            try:
                spec = SpeculativeLlama(target, draft, k=chain, m_rounds=rounds, capacity=capacity, batch=batch,
                                        sampling=sampling, widths=narrower)
            except SwitchUnsupported as missing:
                release()
                print(f"{batch:>4} {mode:9} {label:16} skipped: {missing}", flush=True)
                continue
            spec.capture(("graph",))
            rows.append(dict(row_of(batch, mode, label, _served(spec, requests, batch), spec.setup_seconds, plain),
                             rounds=rounds))
            del spec
            release()
            print(format_row(rows[-1]), flush=True)
    return rows


def resumed(path: str | Path, pair: Mapping[str, Any], m_rounds: int, quick: bool,
            batches: Sequence[int], projection: str) -> list[dict]:
    """The rows of an earlier run's report at `path` to keep beside this run's: those of the B's
    this run does not serve, where the report is of this pair (same_pair: the same trained
    weights) at this M, `quick` and projection; ValueError naming what differs otherwise. One
    machine's time limit cuts a run of every B into several; a run resumed on a pair trained again
    is another pair."""
    report = json.loads(Path(path).read_text())
    if not same_pair(pair, theirs := report.get("pair")):
        raise ValueError(f"{path} was served with another pair ({theirs!r}, this run {pair!r}): not resumed")
    for what, mine, theirs in (("M", m_rounds, report.get("m_rounds")), ("quick", quick, report.get("quick")),
                               ("projection", projection, report.get("projection"))):
        if mine != theirs:
            raise ValueError(f"{path} was served with another {what} ({theirs!r}, this run {mine!r}): "
                             "not resumed")
    return [row for row in report["rows"] if row["batch"] not in batches]


LOSS_NOISE = 0.002  # nats/token: a held-out loss evaluated again on the same weights moves by less


def same_pair(mine: Mapping[str, Any], theirs: Mapping[str, Any] | None) -> bool:
    """Whether two pairs' infos (headline.pair_info) name the same trained weights: the same key,
    shapes and sizes, and held-out losses within LOSS_NOISE. Training is deterministic, so a key
    trains the same weights each time; the losses and the draft's agreement are measured again on
    each machine, on kernels that may reduce in another order (two leases' top-1 read 93.1% and
    93.0% on one key), so the agreement is not compared and a loss only to its noise."""
    if theirs is None or set(mine) != set(theirs):
        return False
    for name, value in mine.items():
        if name in ("top", "overlap_t1"):
            continue
        other = theirs[name]
        if isinstance(value, Mapping) and isinstance(other, Mapping):
            if set(value) != set(other) or any(
                    abs(value[k] - other[k]) > LOSS_NOISE if k == "heldout_loss" else value[k] != other[k]
                    for k in value):
                return False
        elif value != other:
            return False
    return True


def served_headline(quick: bool = False, pair: str | Path | None = None, batches: Sequence[int] | None = None,
                    json_path: str | Path | None = None, m_rounds: int = TORCH_M, resume: bool = False,
                    fixed_at: Sequence[int] | None = None, adaptive_rounds: Sequence[int] = (),
                    projection: str | None = None) -> dict:
    """The section (the module's docstring): prints the table and the best at each B, returns
    the report; with `json_path`, written after each B and at the end, the picture beside it;
    with `resume`, the report there keeps its other B's rows (resumed). `projection`: every
    compiled step's, the plain decoding's too (projected; None: the library's default).
    `fixed_at`: the B's whose fixed chains run (None: every B; elsewhere the plain decoding and
    the adaptive configuration alone, what issue 48's bars read there). `adaptive_rounds`: other
    M's the adaptive configuration is served at too."""
    with projected(projection) as used:
        return _served_headline(quick, pair, batches, json_path, m_rounds, resume, used, fixed_at, adaptive_rounds)


def _served_headline(quick: bool, pair: str | Path | None, batches: Sequence[int] | None,
                     json_path: str | Path | None, m_rounds: int, resume: bool, projection: str,
                     fixed_at: Sequence[int] | None = None, adaptive_rounds: Sequence[int] = ()) -> dict:
    """served_headline()'s run, every compiled step's projections `projection`'s."""
    from memra_cuda.torch import load_model
    where, _, heldout, info, machine, date = opened(pair)
    name = "served: " + describe(info, machine, date)
    batches = list(batches or (QUICK_BATCHES if quick else BATCHES))
    kept: list[dict] = []
    if resume:  # before the models load: a report it may not resume is refused at once
        if json_path is None:
            raise ValueError("resume adds to the report at json_path: name one")
        kept = resumed(json_path, info, m_rounds, quick, batches, projection) if Path(json_path).exists() else []
    target, draft = load_model(where / "target"), load_model(where / "draft")
    servable(heldout, batches, target.config.eos_token_id, quick)
    print(f"\n{name}")
    print(f"a stream of max(16, 4 B) held-out requests, {'8 to 16' if quick else '32 to 512'} new tokens each "
          f"(seed {STREAM_SEED}), the EOS honoured, all submitted at once, through B slots by continuous batching; "
          f"graph mode, M = {m_rounds} (a slot freed mid-burst waits for the burst's end), every graph captured "
          "first; vs plain: tokens/s against the target's own compiled greedy decoding served alike, the faster "
          f"of its two attentions (sampled rows too); every compiled step's projections: {projection!r}")
    print(HEADER, flush=True)

    def out(rows: list[dict]) -> dict:
        rows = kept + rows
        return dict(name=name, machine=machine, date=date, pair=info, quick=quick, m_rounds=m_rounds,
                    projection=projection,
                    batches=sorted({row["batch"] for row in rows} | set(batches)), rows=rows, best=best(rows))
    rows = measure_batches(batches, lambda batch: _bench_batch(target, draft, heldout, batch, quick, m_rounds,
                                                               fixed_at is None or batch in fixed_at,
                                                               adaptive_rounds),
                           None if json_path is None else lambda rows: save(out(rows), json_path))
    result = out(rows)
    print(f"\nthe best chain and the adaptive configuration at each B and decoding ({name}):")
    for line in summary_lines(result["rows"], result["best"]):
        print(line, flush=True)
    if json_path is not None:
        save(result, json_path)
        plot(result, Path(json_path).with_suffix(".png"))
    return result


def rounds_listed(text: str) -> list[int]:
    """--adaptive-rounds' M's: positive ints, each once (argparse's type; what a ring holds is
    checked against each B's geometry after parsing)."""
    rounds = [bounded(item, 1) for item in text.split(",")]
    if len(set(rounds)) != len(rounds):
        raise argparse.ArgumentTypeError(f"M's each once, not {text!r}")
    return rounds


def main(argv: list[str] | None = None) -> int:
    parser = pair_arguments("benchmarks.served", __doc__ or "", BATCHES, "B = 1 and 8, one chain, a few short requests")
    parser.add_argument("--rounds", type=int, default=TORCH_M, help=f"M, the rounds (the plain loop's steps) a burst "
                        f"(default {TORCH_M}): a slot freed mid-burst waits for the burst's end, so a second run at "
                        "another M says what that costs")
    parser.add_argument("--resume", action="store_true", help="add to the report at --json: its rows of other B's "
                        "are kept where it is of this pair, M, --quick and --projection (a run of every B cut into "
                        "several by a machine's time limit, on one machine's pair)")
    parser.add_argument("--fixed-at", type=lambda text: listed(text, BATCHES, int), metavar="B,B",
                        help="the B's whose fixed chains run (default every B; elsewhere the plain decoding and the "
                        "adaptive configuration alone: a lease short of time)")
    parser.add_argument("--adaptive-rounds", type=rounds_listed, metavar="M,M",
                        default=(), help="other M's the adaptive configuration is served at too, each its own rows "
                        "(a request's last tokens wait for its burst's end: what a shorter burst buys and costs)")
    args = parser.parse_args(argv)
    if args.resume and args.json is None:
        parser.error("--resume adds to the report at --json PATH: name one")
    try:  # every B's widest round at this M, before the pair loads: Geometry's refusal came after it
        for batch in args.batches or BATCHES:
            Geometry(max(*CHAINS[batch], ADAPTIVE[batch].k), args.rounds, batch)
    except ValueError as exc:
        parser.error(f"--rounds: {exc}")
    if any(rounds > args.rounds for rounds in args.adaptive_rounds):  # the caches, every row's, are sized at M
        parser.error(f"--adaptive-rounds: each M at most --rounds ({args.rounds}), for which every decoder's caches "
                     f"are sized (the plain decoding's too), not {args.adaptive_rounds}")
    needs("benchmarks.served", PAIR, gpu=True)
    served_headline(args.quick, args.pair, args.batches, args.json, args.rounds, args.resume, args.fixed_at,
                    args.adaptive_rounds, args.projection)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The headline of `make bench-torch` (issue 40): round-stream on a trained target and draft, the
pair benchmarks/pair.py trains on the machine's own Python sources, decoding prompts cut from its
held-out files, where the random-weight Llamas of the other sections set agreement by hand.

At B = 1, 8, 32 and 128 (B = 1: 8 prompts one after another, ONE_ROW_PROMPTS; each row 128 new
tokens, TOKENS; timed in three passes, the median pass kept, TIMED_PASSES), greedy and sampled at
temperature 1, graph mode, M = 16:

- the target's own greedy decoding, each step a CUDA graph (GraphedGreedy), its one-token step
  attending by SDPA over the whole cache and by flex over what a row holds (PLAIN_ATTENDS): the
  faster is the baseline, and its step beside the weights' HBM floor (the bytes of the target's
  weights a step reads, over the bandwidth of a large device-to-device copy measured here): how
  far the baseline is from a memory-bound engine;
- chains of k = 2, 3, 4, 6, 8 drafts (SpeculativeLlama), static trees (chains with leaves, and
  the likeliest trees for this pair's own top-1 and top-2 agreement in report.json) and dynamic
  trees (TreeLlama), fewer and smaller as B grows (STATIC, DYNAMIC): tokens/s, tokens a round
  (tau), the round's verify and draft in target steps (v, d), the ideal tau / (v + d) and the
  share of it reached, as the trees section reports them (reach()), and where the rest went:
  `used`, the share of the rounds sent that committed a row's tokens, and `busy`, the share of
  the time the verifies and drafts fill, beside the plain loop's own busy share (reached = used x
  busy / the plain loop's: torch_common.figures);
- at B = 1, where a request's time went, a line a row under the summary (the plain loop's and every
  chain's and tree's in each mode): its wall, the rounds (steps) it sent at a round's device time
  inside its burst graph (beside the round's verify and draft alone), its start (the prefills,
  the host's issue included) and the rest, the GPU idle while the host works, over the request's
  readbacks (torch_common.request_split; the rows' round_ms, start_ms, bursts and the rest);
- Hugging Face's generate and its assisted generation with the same pair (assistant_model,
  k = HF_K), at B = 1 only: it serves one sequence at a time;
- tree_for_batch's picks derived again on this pair: the fastest configuration at each B and
  decoding, printed in the form benchmarks/picks.py's PICKED takes.

One table; with --json, the figures as JSON, written again as each batch size ends (a run cut
short keeps what it measured), and at the end a picture beside it (PATH with .png; under
bench-torch PATH's .headline.json and .headline.png; matplotlib, the `plot` extra; `python -m
benchmarks.picture PATH` draws it again from the JSON elsewhere). The table's header, its summary,
the picks and the picture name the pair (its cache key and losses) and the machine. Needs
torch, transformers and tokenizers, a GPU, and the pair: `make pair` trains it (minutes)
or finds it in its cache (seconds); `make bench-torch` runs it first.
--projection sets how every compiled step multiplies its projections, the baseline's too
(docs/compiled.md; the settings say which).
--modes graph,overlap,device times each chain and tree in each of round-stream's modes named, from
one decoder captured for them all (overlap: the burst graphs two deep, the next queued before the
last is read; device mode: one launch a generation, its loop captured before the first request;
their rows say so); the baseline stays the graphed plain loop, a graph of 16 steps a readback.

    PYTHONPATH=. python -m benchmarks.headline [--quick] [--json PATH] [--pair DIR] [--batches 1,8,32,128]
                                              [--chains 3,6] [--trees N|S,D] [--modes graph,overlap]
                                              [--projection few_rows]

Run time on one H200 (2026-12-02): B = 1 to 32 and B = 128's greedy rows took about four and a
half minutes, most of it building, capturing and timing the decoders, so the whole about six;
--quick (B = 1 and 8, one configuration of each kind, 32 tokens a row) under a minute.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import depth_and_width
from .needs import PAIR, needs
from .torch_common import (PROJECTIONS, SPECULATIVE, TIMED_PASSES, TORCH_M, TREE_BATCHES, bounded, busy_share,
                           launch_of, listed, measure_config, plain_decoding, plot_trees, projected, release, row_label,
                           skipping, summary_line, time_generations, token_count, tree_label, tree_summary,
                           writable)
from memra_cuda import Geometry
from memra_cuda.buffers.tree import DynamicTree, Tree, TreeShape

SIZE = "pair"  # the trees section's `size` of these rows (its summary and picture take them)
BATCHES, QUICK_BATCHES = TREE_BATCHES, (1, 8)
TOKENS, QUICK_TOKENS = 128, 32  # new tokens a row: as many as the pair's agreement was measured over
ONE_ROW_PROMPTS, QUICK_ONE_ROW = 8, 2  # B = 1: one prompt's tau is one file's luck (code repeats itself)
CHAIN_KS = (2, 3, 4, 6, 8)
# round-stream's modes a chain or tree may be timed in (--modes): a burst graph and a readback each
# up to M rounds (the default, a server's); overlap's burst graphs two deep, the next queued before
# the last is read, so the host's turn-around between bursts (its wait, Pace, the next graph's
# launch) runs beside the GPU's rounds; or device mode's one launch a generation, no readback
# until its end (at B = 1 the time between bursts is a share of a request's: RESULTS.md, "The
# headline at B = 1 in graph and device mode" and "... served at B = 8 to 128")
LAUNCHES = ("graph", "overlap", "device")
TreeCounts = int | tuple[int, int]  # --trees: the first N static and dynamic trees each, or (static, dynamic)
# Hugging Face's drafts a round. Its eager steps are the host's launches, a target step (11.2 ms on
# the H200) about five draft steps whatever their tokens, so by pair.py's costs and chain tau its
# time a token is near flat from k = 4 to 8 (5.2 to 5.5 ms): 4, its examples' and hf_generate's.
HF_K = 4
RANKS = 4  # the most candidates a node of a likeliest tree takes
# Static trees at each B: ("leaves", k, n) is a chain of k with the next n candidates beside each
# node (TreeShape.chain_with_leaves: the draft's levels stay one node, so its cost is a chain's,
# and the draft's second choice is right at about half of the positions where its first is
# wrong, report.json's top-2 against top-1); ("likeliest", T, depth) the T likeliest drafts for
# this pair's own agreement (tree_rates). Fewer verify tokens as B grows: at B = 1 a verify of
# T + 1 tokens costs about one step, once the GEMMs are compute-bound about T + 1.
STATIC: dict[int, tuple[tuple[str, int, int], ...]] = {
    1: (("leaves", 6, 1), ("leaves", 8, 1), ("likeliest", 16, 6), ("likeliest", 32, 8)),
    8: (("leaves", 4, 1), ("leaves", 6, 1), ("likeliest", 16, 6)),
    32: (("leaves", 3, 1), ("likeliest", 8, 4)),
    128: (("leaves", 2, 1), ("likeliest", 4, 3))}
# Dynamic trees (depth, width, branch): a trained draft's confidence, unlike a random one's, should
# tell a dynamic tree where to spend its nodes; depths about where the chain's tau stops growing
# (report.json: k = 8 gains little over 6), widths shrinking with B as the static trees do.
DYNAMIC: dict[int, tuple[tuple[int, int, int], ...]] = {
    1: ((6, 2, 2), (8, 4, 2)), 8: ((6, 2, 2),), 32: ((4, 2, 2),), 128: ((3, 2, 2),)}
MODES = ("greedy", "sampling")  # sampling: at temperature 1


@dataclass(frozen=True)
class Config:
    """One decoder measured: a chain (`spec` its k) or a tree, and `source`, the expression that
    rebuilds the tree (None for a chain: PICKED's word for it)."""

    kind: str
    spec: int | Tree
    source: str | None

    @property
    def label(self) -> str:
        return f"k={self.spec}" if isinstance(self.spec, int) else tree_label(self.spec)


def tree_rates(top: Mapping[str, float]) -> tuple[float, float]:
    """TreeShape.likeliest's `right` and `fall` for a draft whose top-1 is the target's token at a
    share top["1"] of positions and its top-2 at top["2"] (report.json's agreement, JSON's string
    keys): the best candidate right at top-1, the second at top-2 - top-1 = right * fall. Rounded
    to three places, so that the printed constructor rebuilds the same tree, and kept in
    likeliest's range, (0, 1] each (a draft barely trained can be right more often second than
    first: its trees are then as wide as RANKS allows)."""
    right, second = float(top["1"]), float(top["2"]) - float(top["1"])
    if not 0 <= right <= float(top["2"]) <= 1:
        raise ValueError(f"a draft's top-1 and top-2 agreement must be shares with top-2 >= top-1, not {dict(top)}")
    right = max(round(right, 3), 0.001)
    return right, min(max(round(second / right, 3), 0.001), 1.0)


def configurations(batch: int, top: Mapping[str, float], quick: bool = False, chains: Sequence[int] | None = None,
                   trees: TreeCounts | None = None) -> list[Config]:
    """Every chain and tree measured at `batch` (the first of each kind where `quick`); `chains`
    the chains' ks instead of CHAIN_KS, `trees` the first so many static and dynamic trees each,
    or (static, dynamic) so many of each (a lease short of time measures the configurations an
    earlier run found best)."""
    right, fall = tree_rates(top)

    def static(shape: tuple[str, int, int]) -> Config:
        name, a, b = shape
        if name == "leaves":
            return Config("static", TreeShape.chain_with_leaves(a, b), f"TreeShape.chain_with_leaves({a}, {b})")
        return Config("static", TreeShape.likeliest(a, depth=b, right=right, fall=fall, ranks=RANKS),
                      f"TreeShape.likeliest({a}, depth={b}, right={right}, fall={fall}, ranks={RANKS})")

    ks: Sequence[int] = (4,) if quick else CHAIN_KS if chains is None else chains
    most = (1, 1) if quick else trees if isinstance(trees, tuple) else (trees, trees)
    statics, dynamics = STATIC[batch][:most[0]], DYNAMIC[batch][:most[1]]
    return ([Config("chain", k, None) for k in ks] + [static(shape) for shape in statics]
            + [Config("dynamic", DynamicTree(*shape), "DynamicTree({}, {}, {})".format(*shape)) for shape in dynamics])


# -- the pair and its prompts -------------------------------------------------------------------

def pair_dir(argv: Sequence[str] = ()) -> Path:
    """Where `python -m benchmarks.pair` with `argv` keeps its pair (none: `make pair`'s, of
    pair.py's default settings): its cache key as pair.py computes it, by its own functions (a
    listing of the corpus, seconds; imports torch)."""
    from . import pair
    args = pair.parse(list(argv))
    key, _ = pair.cache_key(args, pair.read_docs(pair.list_files(args.max_file_kb * 1024), args.max_files))
    return Path(args.cache) / key


def load_pair(where: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """report.json and heldout.json of the pair in `where`, refused, naming what is missing, where
    it is not a whole one."""
    missing = [name for name in ("target", "draft", "report.json", "heldout.json") if not (where / name).exists()]
    if missing:
        raise FileNotFoundError(f"{where} is not a trained pair (benchmarks/pair.py's cache): it lacks "
                                f"{', '.join(missing)}; `make pair` trains the default one")
    return json.loads((where / "report.json").read_text()), json.loads((where / "heldout.json").read_text())


def trained_pair(text: str) -> str:
    """--pair's DIR, as an argparse type: a whole trained pair, load_pair's refusal its error (it
    came after the GPU check, and a file given met a traceback)."""
    try:
        load_pair(Path(text))
    except (OSError, ValueError) as exc:  # a file unreadable, or JSON that is none
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def prompt_groups(heldout: Mapping[str, Any], batch: int, one_row: int) -> list[list[tuple[int, list[int]]]]:
    """What each timed generation decodes: (its index in heldout.json, the prompt's ids) a row.
    B = 1: the first `one_row` prompts, one a generation; else one generation of the first
    `batch`. The pool's prompts are cut by pair.py from held-out files, at an offset set by the
    path's hash, in the order of that hash (stdlib and packages mixed)."""
    pool, need = heldout["prompts"], one_row if batch == 1 else batch
    if len(pool) < need:
        raise ValueError(f"heldout.json holds {len(pool)} prompts; B = {batch} needs {need}")
    chosen = [(i, list(pool[i]["ids"])) for i in range(need)]
    return [[row] for row in chosen] if batch == 1 else [chosen]


def opened(pair: str | Path | None) -> tuple[Path, dict[str, Any], dict[str, Any], dict[str, Any], str, str]:
    """A run's pair (`pair`, default `make pair`'s) and what names it: its directory, report.json,
    heldout.json, pair_info(), this machine's GPU and today's date (the headline's and the
    served table's start; torch and transformers imported here, their progress bars off)."""
    import torch
    import transformers
    transformers.utils.logging.disable_progress_bar()  # from_pretrained's bars, noise in a table (as pair.py)
    where = pair_dir() if pair is None else Path(pair)
    report, heldout = load_pair(where)
    return where, report, heldout, pair_info(report), torch.cuda.get_device_name(), time.strftime("%Y-%m-%d")


def pair_info(report: Mapping[str, Any]) -> dict[str, Any]:
    """What names the pair beside every figure: its key, shapes, sizes and held-out losses, and
    the draft's agreement (report.json)."""
    models = {name: {k: report[name][k] for k in ("layers", "hidden", "params", "heldout_loss")}
              for name in ("target", "draft")}
    agreement = report["agreement"]
    return dict(key=report["key"], **models, top=agreement["top"], overlap_t1=agreement["overlap_t1"])


def describe(info: Mapping[str, Any], machine: str, date: str) -> str:
    """The pair and the machine, in a line."""
    t, d = info["target"], info["draft"]
    return (f"pair {info['key']} (target Llama {t['layers']} x {t['hidden']}, {t['params'] / 1e6:.1f} M params, "
            f"held-out {t['heldout_loss']:.3f} nats/token; draft Llama {d['layers']} x {d['hidden']}, "
            f"{d['params'] / 1e6:.1f} M, {d['heldout_loss']:.3f}; the draft's top-1 is the target's greedy token "
            f"{float(info['top']['1']):.1%} of the time) on {machine}, {date}")


# -- the arithmetic -----------------------------------------------------------------------------

def streamed_bytes(model: Any) -> int:
    """Bytes of `model`'s weights a decode step reads once: every parameter (a shared one once),
    but the input embedding's table, of which a step reads only its B rows, unless the head is
    tied to it and reads it whole."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    if head is None or head.weight is not embedding:
        total -= embedding.numel() * embedding.element_size()
    return int(total)


def copy_bytes_per_s(nbytes: int, copies: int, ms: float) -> float:
    """Device memory bandwidth of `copies` copies of `nbytes` in `ms`: each reads and writes them."""
    return 2 * nbytes * copies / (ms / 1e3)


def floor_ms(weight_bytes: int, bytes_per_s: float) -> float:
    """The HBM floor of a step: milliseconds to read `weight_bytes` at `bytes_per_s`."""
    return weight_bytes / bytes_per_s * 1e3


# -- the picks ----------------------------------------------------------------------------------

def served_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows a server's choice is made from, graph mode's: a server steps one burst at a time,
    where overlap keeps two in flight and device mode runs a whole batch in one launch."""
    return [row for row in rows if launch_of(row) == "graph"]


def fastest(rows: Sequence[dict[str, Any]], key: Callable[[dict[str, Any]], Any]) -> dict[Any, dict[str, Any]]:
    """key(row) -> the fastest chain or tree of `rows` with that key, in the order the keys come."""
    found: dict[Any, dict[str, Any]] = {}
    for row in rows:
        if row["kind"] in SPECULATIVE:
            at = key(row)
            if at not in found or row["tokens_per_s"] > found[at]["tokens_per_s"]:
                found[at] = row
    return found


def derive_picks(rows: Sequence[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    """mode -> B -> the fastest chain or tree measured there in graph mode: tree_for_batch's rule
    (PICKED: the fastest configuration, a tree where one beat every chain), on one run, for the
    servers it picks for (served_rows). Greedy, the graphed greedy target's own row where even the
    fastest is slower (PLAIN: not speculated; the row keeps the fastest it beat as `instead_of`),
    so that a greedy pick is never slower than decoding without a draft. Sampled, never PLAIN: the
    graphed greedy target does not sample."""
    picks: dict[str, dict[int, dict[str, Any]]] = {}
    rows = served_rows(rows)
    for (mode, batch), row in fastest(rows, lambda row: (row["mode"], row["batch"])).items():
        picks.setdefault(mode, {})[batch] = row
    plain = {row["batch"]: row for row in rows if row["kind"] == "plain"}
    greedy = picks.get("greedy", {})
    for batch, quickest in greedy.items():
        if batch in plain and quickest["tokens_per_s"] < plain[batch]["tokens_per_s"]:
            greedy[batch] = dict(plain[batch], instead_of=quickest)
    return picks


def picked_dict(picks: Mapping[int, dict[str, Any]]) -> str:
    """One mode's picks as PICKED writes a model's: {B: the tree's constructor, None for the chain,
    or PLAIN}."""
    return "{" + ", ".join(f"{batch}: {picks[batch]['source']}" for batch in sorted(picks)) + "}"


def picks_text(picks: Mapping[str, Mapping[int, dict[str, Any]]], name: str) -> str:
    """The lines that give the picks to the next reader of benchmarks/picks.py."""
    chains = {mode: ", ".join(f"k={row['config']} at {batch}" for batch, row in sorted(by_b.items())
                              if row["kind"] == "chain") or "none"
              for mode, by_b in picks.items()}
    lines = [f"tree_for_batch's picks derived again on {name}, in the form of benchmarks/picks.py's PICKED "
             "(None: the chain; PLAIN: not speculated):"]
    if "greedy" in picks:
        lines.append(f'    "{SIZE}": {picked_dict(picks["greedy"])},  # greedy; the chains: {chains["greedy"]}')
    if "sampling" in picks:
        lines.append(f"    sampled at T = 1 (tree_for_batch gives the chain at every B today): "
                     f"{picked_dict(picks['sampling'])}; the chains: {chains['sampling']}")
    plain = [f"B = {batch} (the fastest, {row_label(row['instead_of'])}, {row['instead_of']['vs_plain']:.2f}x)"
             for batch, row in sorted(picks.get("greedy", {}).items()) if row["kind"] == "plain"]
    if plain:
        lines.append("    greedy, PLAIN where every chain and tree measured was slower than the graphed greedy target: "
                     + ", ".join(plain))
    slower = [f"B = {batch} ({row['vs_plain']:.2f}x)" for batch, row in sorted(picks.get("sampling", {}).items())
              if row["vs_plain"] < 1]
    if slower:
        lines.append("    sampled, slower than the graphed greedy target even at its fastest: " + ", ".join(slower))
    return "\n".join(lines)


# -- the table ----------------------------------------------------------------------------------

HEADER = (f"{'B':>4} {'decoding':8} {'kind':7} {'config':22} {'tokens/s':>9} {'vs plain':>8} {'tau':>5} {'v':>6} "
          f"{'d':>6} {'ideal':>6} {'reached':>7} {'rows':>5} {'batch':>5} {'setup':>6} {'used':>5} {'busy':>5}")


def format_row(row: dict[str, Any]) -> str:
    """A row of the table: the baseline with its step beside the HBM floor (and its busy share),
    Hugging Face's with its tokens/s alone, a chain's or a tree's with its tau, costs, the share
    of its ideal, and where the rest went (used x busy / the plain loop's busy = reached:
    torch_common.figures)."""
    head = f"{row['batch']:4} {row['mode']:8} {row['kind']:7} {row_label(row):22} {row['tokens_per_s']:9.0f} " \
           f"{row['vs_plain']:7.2f}x"
    if row["kind"] == "plain":
        busy = f"; its steps {row['busy']:.0%} of its time" if "busy" in row else ""
        return head + (f"   a step {row['step_ms']:.3f} ms: {row['step_ms'] / row['floor_ms']:.1f}x the weights' "
                       f"HBM floor, {row['floor_ms']:.3f} ms{busy}")
    if row["kind"] == "HF":
        return head
    spent = f" {row['used']:5.0%} {row['busy']:5.0%}" if "used" in row else ""
    return head + (f" {row['tau']:5.2f} {row['v']:6.2f} {row['draft']:6.2f} {row['ideal']:5.2f}x {row['reached']:7.0%}"
                   f" {row['rows_share']:5.0%} {row['batch_reached']:5.0%} {row.get('setup_s', 0):6.0f}{spent}")


def summarise(rows: Sequence[dict[str, Any]]) -> list[dict]:
    """The trees section's summary (tree_summary) of each B and decoding in graph mode (best chain,
    static and dynamic tree, and the pick against the best chain), the pick being the fastest."""
    rows = served_rows(rows)
    plain = {row["batch"]: row["tokens_per_s"] for row in rows if row["kind"] == "plain"}
    picks = derive_picks(rows)
    return [tree_summary([row for row in rows if row["kind"] in SPECULATIVE and row["mode"] == mode
                          and row["batch"] == batch], picks[mode][batch], plain[batch])
            for batch in sorted(plain) for mode in MODES if batch in picks.get(mode, {})]


def launch_summary(rows: Sequence[dict[str, Any]]) -> list[dict]:
    """Each B and decoding where some chain or tree ran in a mode beside graph mode (--modes):
    the fastest in each mode that ran there, in LAUNCHES' order, with its speed-up and the share
    of its ideal it reached (`launches` names the modes; `{mode}_{field}` holds each figure)."""
    best = fastest(rows, lambda row: (row["batch"], row["mode"], launch_of(row)))
    out = []
    for batch in sorted({row["batch"] for row in rows}):
        for mode in MODES:
            ran = [launch for launch in LAUNCHES if (batch, mode, launch) in best]
            if len(ran) > 1:
                out.append(dict(batch=batch, mode=mode, launches=ran, **{
                    f"{launch}_{field}": row_label(row) if field == "config" else row[field]
                    for launch, row in ((launch, best[batch, mode, launch]) for launch in ran)
                    for field in ("config", "tokens_per_s", "vs_plain", "reached")}))
    return out


def launch_line(summary: Mapping[str, Any]) -> str:
    """launch_summary's line: B and decoding, then each mode's fastest."""
    return (f"B = {summary['batch']} {summary['mode']}: " + ", ".join(
        f"{launch} mode's fastest {summary[f'{launch}_config']} {summary[f'{launch}_tokens_per_s']:.0f} tok/s "
        f"({summary[f'{launch}_vs_plain']:.2f}x, {summary[f'{launch}_reached']:.0%} of its ideal)"
        for launch in summary["launches"]))


def counted(count: float, noun: str) -> str:
    """A mean count of `noun` as split_line says it: to a tenth, a whole one bare and a single one
    singular ("8 readbacks", "20.4 rounds", "1 readback")."""
    number = f"{count:.1f}".removesuffix(".0")
    return f"{number} {noun}" if number == "1" else f"{number} {noun}s"


def split_line(row: dict[str, Any]) -> str:
    """Where a B = 1 row's request's time went (torch_common.request_split): its wall, its rounds
    (the plain loop's steps) at their device time inside a burst graph (a round's verify and
    draft, timed alone, beside it), its start, and the rest, over its readbacks."""
    if row["kind"] == "plain":
        name, sent, alone = "plain graphed greedy", "step", ""
    else:
        label = row_label(dict(kind=row["kind"], config=row["config"]))
        name, sent, alone = (f"{row['mode']} {label} ({launch_of(row)})", "round",
                             f" (v + d {row['vd_ms']:.3f} ms a round)")
    return (f"where a request's time went, {name}: {row['request_ms']:.1f} ms: {counted(row['request_rounds'], sent)}"
            f" x {row['round_ms']:.3f} ms = {row['rounds_ms']:.1f} ms{alone}, its start {row['start_ms']:.1f} ms, "
            f"the rest {row['rest_ms']:.1f} ms over {counted(row['bursts'], 'readback')}")


def _report(info: Mapping[str, Any], machine: str, date: str, settings: Mapping[str, Any],
            floor: Mapping[str, float], rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The section's JSON: the pair, the machine and date, the settings, the HBM floor, the rows,
    the best of each kind at each B and decoding, and the picks (mode -> B -> the constructor,
    null for the chain, "PLAIN" not to speculate)."""
    picks = derive_picks(rows)
    return dict(model=dict(info), machine=machine, date=date, settings=dict(settings), floor=dict(floor),
                rows=[dict(row) for row in rows], best=summarise(rows), launches=launch_summary(rows),
                picks={mode: {batch: row["source"] for batch, row in sorted(by_b.items())}
                       for mode, by_b in picks.items()})


def assemble(info: Mapping[str, Any], machine: str, date: str, settings: Mapping[str, Any],
             floor: Mapping[str, float], rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The section's JSON (_report), its summary printed, a line a B and decoding (and, where
    some ran in overlap or device mode, a line a B and decoding of the fastest in each mode),
    then where a request's time went, a line a row that measured it (B = 1's plain and
    speculative rows: split_line)."""
    report = _report(info, machine, date, settings, floor, rows)
    for summary in report["best"]:
        print(summary_line(summary), flush=True)
    for summary in report["launches"]:
        print(launch_line(summary), flush=True)
    for row in rows:
        if "request_ms" in row:
            print(split_line(row), flush=True)
    return report


def measure_batches(batches: Sequence[int], measure: Callable[[int], list[dict]],
                    saved: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """measure(B)'s rows of every B in turn; after each but the last, saved(the rows so far), so
    that a run stopped by a machine's time limit keeps the batch sizes it finished."""
    rows: list[dict] = []
    for batch in batches:
        rows += measure(batch)
        if saved is not None and batch != batches[-1]:
            saved(rows)
    return rows


def save(report: Mapping[str, Any], path: str | Path) -> None:
    """Write the section's JSON to `path` whole or not at all (a temporary file renamed over it),
    so that a run stopped between two batch sizes leaves the last one's figures readable."""
    path = Path(path)
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(report, indent=2))
    part.replace(path)


def plot_headline(report: Mapping[str, Any], path: str | Path) -> None:
    """The trees section's picture (plot_trees: tokens/s against B of plain decoding, the best
    chain and tree and that tree's ideal, greedy and sampled) of this pair, titled with it."""
    plot_trees(report["best"], path, title=describe(report["model"], report["machine"], report["date"]))


# -- on the GPU ---------------------------------------------------------------------------------

def copy_bandwidth(nbytes: int = 1 << 30, copies: int = 20) -> float:
    """Bytes/s of device memory, from `copies` device-to-device copies of `nbytes` timed with events."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(copies):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return copy_bytes_per_s(nbytes, copies, start.elapsed_time(end))


def _hugging_face(target: Any, draft: Any, groups: Sequence[Sequence[Any]], plain: float) -> list[dict]:
    """B = 1: Hugging Face's greedy generate, and its assisted generation with the draft, greedy
    and sampled (its tokens/s counts the tokens it made, in case it stopped early)."""
    from memra_cuda.torch import SamplingParams, hf_generate
    runs = {("greedy", "generate"): (None, None), ("greedy", f"assisted, k={HF_K}"): (None, draft),
            ("sampling", f"assisted, k={HF_K}"): (SamplingParams(1.0), draft)}
    rows = []
    for (mode, label), (sampling, assistant) in runs.items():
        def generate(group: Sequence[Any], sampling: Any = sampling, assistant: Any = assistant) -> list[list[int]]:
            return [hf_generate(target, [r.prompt], r.max_new_tokens, sampling=sampling, assistant=assistant,
                                k=HF_K)[0] for r in group]
        seconds, outs = time_generations(generate, groups, passes=1)  # ~40 s a pass: its spread is not a bar's
        rate = token_count(outs) / seconds
        rows.append(dict(size=SIZE, batch=1, mode=mode, kind="HF", config=label, source=None, tokens_per_s=rate,
                         vs_plain=rate / plain))
        print(format_row(rows[-1]), flush=True)
    return rows


def _bench_batch(target: Any, draft: Any, heldout: Mapping[str, Any], batch: int, top: Mapping[str, float],
                 quick: bool, tokens: int, one_row: int, floor: float, chains: Sequence[int] | None = None,
                 trees: TreeCounts | None = None, launches: Sequence[str] = ("graph",)) -> list[dict]:
    """One B: the baseline, Hugging Face's at B = 1, then every chain and tree greedy and sampled,
    in caches of one capacity that each of them fits (attention reads the whole cache: one
    capacity keeps their costs comparable)."""
    from memra_cuda.torch import Request, SamplingParams, capacity_for
    groups = [[Request(ids, tokens, None, seed) for seed, ids in group]
              for group in prompt_groups(heldout, batch, one_row)]
    configs = configurations(batch, top, quick, chains, trees)
    depth, width = (max(values) for values in zip(*(depth_and_width(config.spec) for config in configs)))
    longest = max(len(r.prompt) for group in groups for r in group)
    capacity = capacity_for(longest, tokens, Geometry(depth, TORCH_M, batch, width))
    baseline = plain_decoding(target, capacity, groups)
    plain, step_ms = baseline["tokens_per_s"], baseline["step_ms"]
    release()
    rows = [dict(size=SIZE, batch=batch, mode="greedy", kind="plain", config="graphed greedy", source="PLAIN",
                 **baseline, vs_plain=1.0, floor_ms=floor, busy=busy_share(plain, step_ms, batch))]
    print(format_row(rows[0]), flush=True)
    if batch == 1:
        rows += _hugging_face(target, draft, groups, plain)
        release()
    for mode, sampling in zip(MODES, (None, SamplingParams(1.0))):
        for config in configs:
            for row in measure_config(target, config.kind, config.spec, groups, capacity, sampling, step_ms, plain,
                                      draft, launches, size=SIZE, batch=batch, mode=mode, source=config.source,
                                      config=config.spec if config.kind == "chain" else config.label):
                print(format_row(row), flush=True)
                rows.append(row)
    return rows


def headline(quick: bool = False, pair: str | Path | None = None, batches: Sequence[int] | None = None,
             json_path: str | Path | None = None, chains: Sequence[int] | None = None,
             trees: TreeCounts | None = None, launches: Sequence[str] | None = None,
             projection: str | None = None, skip_done: bool = False) -> dict:
    """The section: the pair in `pair` (default: `make pair`'s), at `batches` (default BATCHES,
    or QUICK_BATCHES where `quick`); prints the table, the best at each B and the picks, and
    returns assemble()'s report. With `json_path`, the report so far is written there after each
    batch size (a run cut short by a machine's time limit keeps what it measured), and the picture
    beside it at the end (its name with .png). `chains` and `trees` cut the configurations
    (configurations(); the report's settings say so). `projection`: every compiled step's,
    the baseline's too (projected; None: the library's default; the settings say which).
    `skip_done`: every decoder's (skipping; the settings say)."""
    with projected(projection) as used, skipping(skip_done):
        return _headline(quick, pair, batches, json_path, chains, trees, tuple(launches or LAUNCHES[:1]), used,
                         skip_done)


def _headline(quick: bool, pair: str | Path | None, batches: Sequence[int] | None, json_path: str | Path | None,
              chains: Sequence[int] | None, trees: TreeCounts | None, launches: Sequence[str], projection: str,
              skip_done: bool = False) -> dict:
    """headline()'s run, every compiled step's projections `projection`'s."""
    from memra_cuda.torch import load_model
    where, report, heldout, info, machine, date = opened(pair)
    name = describe(info, machine, date)
    target, draft = load_model(where / "target"), load_model(where / "draft")  # as saved: bf16
    for model in (target, draft):  # every row makes its whole budget, as the engine's requests here (no eos)
        model.generation_config.eos_token_id = None
    bandwidth, weights = copy_bandwidth(), streamed_bytes(target)
    release()  # the copy's two buffers
    floor = floor_ms(weights, bandwidth)
    batches = list(batches or (QUICK_BATCHES if quick else BATCHES))
    tokens, one_row = (QUICK_TOKENS, QUICK_ONE_ROW) if quick else (TOKENS, ONE_ROW_PROMPTS)
    settings = dict(batches=batches, tokens=tokens, one_row_prompts=one_row, prompt_len=heldout["prompt_len"],
                    m_rounds=TORCH_M, hf_k=HF_K, dtype=str(target.dtype).removeprefix("torch."), quick=quick,
                    pair_dir=str(where), chains=None if quick else list(CHAIN_KS if chains is None else chains),
                    trees=None if quick else trees, launches=list(launches), projection=projection,
                    skip_done=skip_done)
    print(f"\nheadline: {name}")
    print(f"prompts: heldout.json's first B ({heldout['prompt_len']} tokens, cut from held-out files), {tokens} new "
          f"tokens a row (B = 1: {one_row} prompts one after another; the median of {TIMED_PASSES} passes), "
          f"{settings['dtype']}, "
          f"{' and '.join(launches)} mode{'s' if len(launches) > 1 else ''}, "
          f"M={TORCH_M}, sampling at T=1. vs plain: against the target's compiled greedy decoding, a graph of "
          "16 steps a readback (sampled rows too); v and d: the round's verify and draft in target steps; ideal = "
          "tau / (v + d); reached: the share of it got; rows: the rows' mean rounds over the slowest row's; batch: "
          "the share got of the batch's ideal, ideal x rows; setup: the seconds a decoder compiled and captured "
          f"before its first request; every compiled step's projections: {projection!r}. Hugging Face at B = 1 "
          "only (it serves one sequence at a time)")
    print("no graph is captured inside a timed run: every decoder is captured before its first request and sealed "
          "(a capture there would be a CaptureError, ending the run)")
    print(f"weights' HBM floor: {weights / 1e6:.1f} MB of the target's weights a step (all but the input "
          f"embedding) / {bandwidth / 1e9:.0f} GB/s (a device-to-device copy of 1 GiB) = {floor:.3f} ms")
    print(HEADER, flush=True)
    floors = dict(weight_bytes=weights, copy_bytes_per_s=bandwidth, floor_ms=floor)
    rows = measure_batches(
        batches, lambda batch: _bench_batch(target, draft, heldout, batch, info["top"], quick, tokens, one_row, floor,
                                            chains, trees, launches),
        None if json_path is None else lambda rows: save(_report(info, machine, date, settings, floors, rows),
                                                         json_path))
    print(f"\nbest at each B and decoding ({name}):")
    out = assemble(info, machine, date, settings, floors, rows)
    print(picks_text(derive_picks(rows), name), flush=True)
    if json_path is not None:
        save(out, json_path)
        plot_headline(out, Path(json_path).with_suffix(".png"))
    return out


def pair_arguments(program: str, doc: str, batches: Sequence[int], quick: str) -> argparse.ArgumentParser:
    """The command line of a program that measures the pair: its whole docstring as --help, and
    --quick (`quick` says what it cuts), --json, --pair, --batches (some of `batches`) and
    --projection."""
    parser = argparse.ArgumentParser(prog=f"python -m {program}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"{quick} (a smoke run, not for figures)")
    parser.add_argument("--json", type=writable, metavar="PATH", help="also write the figures as JSON, and the "
                        "picture beside (PATH with .png; needs matplotlib)")
    parser.add_argument("--pair", type=trained_pair, metavar="DIR", help="the pair's directory (default: `make "
                        "pair`'s, of pair.py's default settings, in its cache)")
    parser.add_argument("--batches", type=lambda text: listed(text, batches, int),
                        help=f"these of {','.join(map(str, batches))} only")
    parser.add_argument("--projection", choices=PROJECTIONS, help="how every compiled step multiplies its "
                        "projections, the plain loop's too (default: memra_cuda.torch.compiled.PROJECTION; "
                        "docs/compiled.md)")
    return parser


def tree_count(text: str) -> TreeCounts:
    """--trees' N (the first N static and N dynamic trees) or S,D (S static, D dynamic), counts of
    0 or more (argparse's type: another is its error)."""
    if "," in text:
        static, dynamic = text.split(",", 1)
        return bounded(static, 0), bounded(dynamic, 0)
    return bounded(text, 0)


def main(argv: list[str] | None = None) -> int:
    parser = pair_arguments("benchmarks.headline", __doc__ or "", BATCHES, "B = 1 and 8, one configuration of "
                            f"each kind, {QUICK_TOKENS} tokens a row")
    parser.add_argument("--chains", type=lambda text: listed(text, range(1, 33), int),
                        help=f"the chains' ks (default {','.join(map(str, CHAIN_KS))})")
    parser.add_argument("--trees", type=tree_count, metavar="N|S,D",
                        help="the first N static trees and the first N dynamic trees of each B, or the first S "
                        "static and D dynamic (default all)")
    parser.add_argument("--modes", type=lambda text: listed(text, LAUNCHES),
                        help=f"round-stream's modes each chain and tree runs in, of {','.join(LAUNCHES)} (default "
                        f"{LAUNCHES[0]}; overlap: two bursts in flight; device: one launch a generation, its "
                        "loop captured before the first)")
    parser.add_argument("--skip-done", choices=("on", "off"), default="off",
                        help="whether the decoders' burst graphs skip the rounds past every row's end (default "
                        "off, the decoders' own; docs/capacity.md)")
    args = parser.parse_args(argv)
    needs("benchmarks.headline", PAIR, gpu=True)
    headline(args.quick, args.pair, args.batches, args.json, args.chains, args.trees, args.modes, args.projection,
             args.skip_done == "on")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

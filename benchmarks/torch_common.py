"""What the torch sections of `make bench-torch` share, torch_engine.py's and the headline's
(headline.py): timing generations and graphs on the device, a chain's or a tree's row measured
against plain decoding and its ideal, the summary, names and picture of the trees, and the
comma-separated lists their command lines take.

torch_engine.py runs the sections, the headline among them; both take what they share from here,
so that neither imports the other back (as common.py is for `make bench`'s parts). torch is
imported where a function runs, not here: bench.py reads the sections' names without it.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from memra_cuda.buffers.tree import DynamicTree, TreeShape

if TYPE_CHECKING:  # memra_cuda.torch imports torch, which this module leaves to the functions that run
    from memra_cuda.torch.attention import Attention
    from memra_cuda.torch.kv import Room

TORCH_K, TORCH_M = 4, 16  # every torch section's chain k and rounds a burst, M
TREE_BATCHES = (1, 8, 32, 128)  # the trees section's and the headline's batch sizes
SPECULATIVE = ("chain", "static", "dynamic")  # the kinds of a speculative row, the chain first
TIMED_STARTS = 5  # a request's start timed so many times, its median kept (issued_ms)
# The groups of a configuration timed so many times over, the median pass kept (time_generations): a pass of
# 8 requests at B = 1 lasts ~0.2 s, and one pass a lease read a configuration 4-10% apart from the last lease's.
TIMED_PASSES = 3
TIMED_BURSTS = 10  # burst graphs launched back to back to time a round inside one (burst_round_ms)
# Whether the decoders a run builds skip rounds past every row's end (their skip_done, off unless
# asked): --skip-done's, for the run (skipping)
SKIP_DONE = False


def time_generations(generate: Callable[[Any], Any], groups: Sequence[Any],
                     after: Callable[[Any], Any] = lambda out: out, passes: int = TIMED_PASSES,
                     synchronize: Callable[[], None] | None = None,
                     clock: Callable[[], float] = time.perf_counter) -> tuple[float, list[Any]]:
    """Seconds of generate(group) over every group, each timed alone between synchronisations
    (`synchronize`; None: the device's, torch.cuda.synchronize) after one untimed run of the first
    (first loads; the decoders measured are captured before, and sealed: a capture inside a timed
    run is a CaptureError, not a slow figure), in the median of `passes` passes over the groups
    (median_index); and after(its output) of each of that pass's, read outside the timed spans.
    What a generation counts (the rounds it sent) travels in its output, so the pass kept brings
    its own counts. The objects alive before the passes are frozen out of the collector's sight
    while they run (gc.freeze, as a server does once it is warm): a collection of the models'
    and torch's objects inside a span of ~20 ms would time the process's heap, not the decoding,
    and every row, the plain loop's too, is timed so."""
    if synchronize is None:
        import torch
        synchronize = torch.cuda.synchronize
    generate(groups[0])
    timed: list[tuple[float, list[Any]]] = []
    thawed = gc.get_freeze_count() == 0  # a caller's own freeze is left as it was
    if thawed:
        gc.collect()
        gc.freeze()
    try:
        for _ in range(passes):
            seconds, taken = 0.0, []
            for group in groups:
                synchronize()
                start = clock()
                out = generate(group)
                synchronize()
                seconds += clock() - start
                taken.append(after(out))
            timed.append((seconds, taken))
    finally:
        if thawed:
            gc.unfreeze()
    return timed[median_index([seconds for seconds, _ in timed])]


def median_index(values: Sequence[float]) -> int:
    """Which of `values` is their median (of an even count, the upper middle one): a timed pass or
    run is kept whole, its outputs beside its own time, not a mix of several."""
    return sorted(range(len(values)), key=values.__getitem__)[len(values) // 2]


def token_count(outs: Sequence[Sequence[Sequence[int]]]) -> int:
    """The tokens of generations' rows."""
    return sum(len(row) for out in outs for row in out)


def tree_label(tree: Any) -> str:
    """A tree's name in the table and the JSON (a static tree's repr lists every node)."""
    if isinstance(tree, DynamicTree):
        return f"{tree.depth}x{tree.width}, branch {tree.branch}"
    leaves = (tree.nodes - 1) // tree.depth - 1
    if leaves and tree == TreeShape.chain_with_leaves(tree.depth, leaves):
        return f"k={tree.depth}, {leaves} {'leaf' if leaves == 1 else 'leaves'}"
    return f"T={tree.nodes - 1}, depth {tree.depth}"


def launch_of(row: dict) -> str:
    """The round-stream mode a measured row ran in (its `launch`; graph mode, where it says none)."""
    return row.get("launch", "graph")


def row_label(row: dict) -> str:
    """A measured configuration's name in the table: k=... for a chain; ", overlap" or ", device"
    where it ran in that mode (launch_of; graph mode unsaid)."""
    name = f"k={row['config']}" if row["kind"] == "chain" else row["config"]
    return name + ("" if launch_of(row) == "graph" else f", {launch_of(row)}")


# The plain decoding's one-token step, attending by SDPA over the whole cache (measured faster at one
# row, and where rows hold nearly all of it) and by flex (only the blocks a row holds: a row of a
# generation holds its prompt and what it has made so far, often half its cache): the faster of the
# two is the baseline of every ratio, whichever the library's default at the batch (compiled.attends)
PLAIN_ATTENDS: tuple[Attention, ...] = ("sdpa", "flex")
# How every compiled step of a run multiplies its projections (memra_cuda.torch.compiled's
# PROJECTIONS, named here without torch for --help): --projection's choices
PROJECTIONS = ("inductor", "few_rows")


@contextlib.contextmanager
def projected(projection: str | None) -> Iterator[str]:
    """Inside the block, every compiled step built, the plain loop's and the decoders' alike,
    multiplies its projections by `projection` (None: the library's default, PROJECTION), so a
    ratio compares one arithmetic; gives the projection in force, for the report's settings. The
    default is back as it was after the block (a test or a program that runs a section goes on
    with its own)."""
    from memra_cuda.torch import compiled
    if projection is not None and projection not in compiled.PROJECTIONS:
        raise ValueError(f"projection is one of {compiled.PROJECTIONS}, not {projection!r}")
    before = compiled.PROJECTION
    compiled.PROJECTION = before if projection is None else projection
    try:
        yield compiled.PROJECTION
    finally:
        compiled.PROJECTION = before


@contextlib.contextmanager
def skipping(skip_done: bool) -> Iterator[None]:
    """Inside the block, every decoder built by decoder() is given `skip_done`, so a run can set
    the rounds past the end against their skipping; as it was after."""
    global SKIP_DONE
    before, SKIP_DONE = SKIP_DONE, skip_done
    try:
        yield
    finally:
        SKIP_DONE = before


def reach(vs_plain: float, ideal: float, rows_share: float) -> dict:
    """How near a configuration got to its ideal speedup over plain decoding (`ideal`, tau / (v +
    d), tau a row's tokens over the rounds that row ran): `reached`, against that ideal, and
    `batch_reached`, against the batch's (`batch_ideal`: ideal x rows_share, the rows' mean
    rounds over the slowest row's). A batch whose rows start together runs until its slowest is
    done, every row a verify, so its rounds are the slowest row's: `batch_reached` is the share
    of what the batch's own measured costs allow, and `reached` also charges it the rounds its
    rows that finished early sat through."""
    batch_ideal = ideal * rows_share
    return dict(vs_plain=vs_plain, reached=vs_plain / ideal, batch_ideal=batch_ideal,
                batch_reached=vs_plain / batch_ideal)


def plain_decoding(model: Any, capacity: int, groups: Sequence[Sequence[Any]],
                   passes: int = TIMED_PASSES) -> dict[str, Any]:
    """Graphed plain greedy over the groups of requests (a generation each, time_generations, in
    `passes` passes): its `tokens_per_s`, and `step_ms`, the device milliseconds of its step, the unit of v and d: the
    replay of the graph a generation leaves, a burst of `steps` steps, over its steps. Where each
    group is one request (B = 1), where a request's time went too (request_split): its steps a
    step_ms each (the burst graph's own time), its start (greedy_start_ms) and its bursts,
    computed, as GraphedGreedy counts none: a generation of one row reads a burst of `steps`
    tokens back until the row has its own, ceil(tokens / steps), the one an EOS ends too, and
    each burst runs all its steps. Where the model's step compiles, with each attention of
    PLAIN_ATTENDS, and the faster's figures: the baseline."""
    from memra_cuda.errors import NotFused
    from memra_cuda.torch import GraphedGreedy
    from memra_cuda.torch.timing import replay_ms
    found = []
    for attention in PLAIN_ATTENDS:
        try:
            greedy = GraphedGreedy(model, capacity, len(groups[0]), attention=attention)
        except NotFused:  # the model's own modules: no attention to choose
            continue
        greedy.capture()
        seconds, outs = time_generations(greedy.generate_batch, groups, passes=passes)
        step_ms = replay_ms(greedy.graph, greedy.stream) / greedy.steps
        plain: dict[str, Any] = dict(tokens_per_s=token_count(outs) / seconds, step_ms=step_ms)
        if len(groups[0]) == 1:
            bursts = sum(math.ceil(len(row) / greedy.steps) for out in outs for row in out)
            plain.update(request_split(seconds, len(groups), bursts * greedy.steps, step_ms, None,
                                       greedy_start_ms(greedy, groups[0][0]), bursts))
        found.append(plain)
        del greedy
        release()
    return max(found, key=lambda row: row["tokens_per_s"])


def _bench_tree_config(model: Any, kind: str, config: Any, groups: Sequence[Sequence[Any]], capacity: int,
                       sampling: Any, step_ms: float, draft: Any = None,
                       modes: Sequence[str] = ("graph",)) -> list[dict]:
    """figures() of one chain or tree of `model` and `draft` (default its self-speculative one)
    over the groups of requests (a generation each, time_generations) in each of round-stream's
    `modes` ("graph": a burst graph and a readback each up to M rounds; "overlap": two such bursts
    in flight; "device": one launch a generation), one decoder captured for them all, its round's
    draft and then its verify each captured alone on the decoder's stream after the generations,
    in target steps: a dict a mode, its `launch`. At B = 1, where a request's time went too
    (request_split): its rounds sent and bursts read back in each mode's timed generations, and
    a round inside the burst graph (burst_round_ms) and a request's start (decoder_start_ms),
    timed once after the verify and draft, every mode's row the same. The decoder goes when
    this returns, for release() to give its memory back: at B = 128 a sampled tree holds p and q
    of [B][T+1][32000] floats."""
    spec, verify, draft_levels = decoder(model, kind, config, capacity, len(groups[0]), sampling, draft=draft,
                                         modes=modes)

    def generate(group: Sequence[Any], mode: str) -> tuple[list[list[int]], tuple[int, int]]:
        """A generation's rows, with the rounds it sent to the GPU and the bursts it read back (its
        stream's counts, which run on across generations)."""
        rounds, bursts = spec.rounds.rounds, spec.rounds.bursts
        out = spec.generate_batch(group, mode)
        return out, (spec.rounds.rounds - rounds, spec.rounds.bursts - bursts)

    def after(generated: tuple[list[list[int]], tuple[int, int]]) -> tuple[list[int], np.ndarray, tuple[int, int]]:
        out, counts = generated
        lengths = [len(row) for row in out]
        return lengths, spec.bufs.rounds_run(lengths), counts

    timed = [(mode, *time_generations(functools.partial(generate, mode=mode), groups, after)) for mode in modes]
    v_ms, d_ms = round_costs(spec, verify, draft_levels)
    # B = 1: where a request's time went (request_split); the start last, its prefill moves the row's positions
    costs = (burst_round_ms(spec), decoder_start_ms(spec, groups[0][0])) if len(groups[0]) == 1 else None
    rows = []
    for mode, seconds, taken in timed:
        lengths, rounds, counts = zip(*taken)
        sent, bursts = (sum(column) for column in zip(*counts))
        row = dict(figures(lengths, rounds, seconds, v_ms / step_ms, d_ms / step_ms, sent, step_ms),
                   setup_s=spec.setup_seconds, launch=mode)
        if costs is not None:
            round_ms, start_ms = costs
            row.update(request_split(seconds, len(groups), sent, round_ms, v_ms + d_ms, start_ms, bursts))
        rows.append(row)
    return rows


def round_costs(spec: Any, verify: Callable[[], None], draft: Callable[[], None]) -> tuple[float, float]:
    """Device milliseconds of a decoder's round's verify and its whole draft (decoder()'s two
    callables), each captured alone on the decoder's stream and replayed, after its generations.
    The verify reads what its round's draft made (a tree's node slots and mask: tensors of
    whichever graph captured the draft last, whose memory other graphs' replays may have written
    since; after device mode's loop, slots out of range), so the draft is captured and replayed
    first and held while the verify is timed, as a round runs them."""
    from memra_cuda.torch.timing import captured, graph_ms, replay_ms
    drafted = captured(draft, spec.stream)
    draft_ms = replay_ms(drafted, spec.stream)
    return graph_ms(verify, spec.stream), draft_ms


def burst_round_ms(spec: Any, launches: int = TIMED_BURSTS) -> float:
    """Device milliseconds of a decoder's round inside its burst graph: its verify and draft, the
    round's own kernels (acceptance, commit, rollback and the like) and its share of the burst's
    readback. The graph of M rounds (the decoder's m_rounds: capture() captures it whatever the
    modes, and a sealed stream's graph_for hands it out, never captures) launched `launches`
    times back to back, timed on the device (common.replay_ms), over its rounds, after one
    untimed launch (a graph's first also uploads it, and device mode's rows never launched it).
    Every mode's round, as far as this says: overlap's bursts are these rounds read back into
    another slot, and device mode's loop runs them in conditional nodes, not timed apart. After
    the decoder's generations: its rows are done, so the rounds commit nothing (launches.spec_rows
    relies on the same), each row's position frozen where its last generation left it, where
    round_costs timed the verify and draft. A decoder that skips rounds past every row's end
    (skip_done) would skip these: its burst is timed over live rows instead (live_burst_ms)."""
    from .common import replay_ms
    rounds = spec.bufs.m_rounds
    burst = spec.rounds.graph_for(0, rounds)
    if spec.rounds.round.gate is not None:
        return live_burst_ms(spec, burst, launches) / rounds
    burst.launch()
    return replay_ms(spec.engine, burst, launches) / (launches * rounds)


def live_burst_ms(spec: Any, burst: Any, launches: int) -> float:
    """Device milliseconds of one launch of `burst` (a graph of the decoder's M rounds) over rows
    live throughout: before each launch every row starts again from a two-token prompt with a
    budget past the burst's tokens (its capacity checked for it, as a step checks it), then the
    launch alone is timed between events; the median of `launches` after an untimed one. The rows
    are left done, their budgets 0, as the decoder's generations leave them."""
    from memra_cuda.driver.event import Event
    bufs, times = spec.bufs, []
    start, end = Event(spec.engine), Event(spec.engine)
    for _ in range(launches + 1):
        spec.prefill(range(spec.batch), [[0, 0]] * spec.batch)
        bufs.set_stop(budget=(bufs.m_rounds + 1) * (bufs.k + 1))
        spec.rounds.round.capacity.check_burst(bufs.positions, bufs.done, bufs.m_rounds, bufs.ledger.unseen_rounds)
        start.record()
        burst.launch()
        end.record()
        end.synchronize()
        times.append(end.elapsed_ms(start))
    bufs.set_stop(budget=0)
    return float(np.median(times[1:]))


def issued_ms(run: Callable[[], Any], stream: Any, times: int = TIMED_STARTS) -> float:
    """Device milliseconds of run() on `stream`, idle before it, between CUDA events recorded on it
    before and after the call: the host's issue included, which the GPU waits for at a request's
    start (a prefill's launches and uploads); the median of `times` (one may meet the collector)."""
    import torch
    spans = []
    for _ in range(times):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record(stream)
        run()
        end.record(stream)
        end.synchronize()
        spans.append(start.elapsed_time(end))
    return float(np.median(spans))


def decoder_start_ms(spec: Any, request: Any) -> float:
    """Device milliseconds of `request`'s start in a decoder of one row (issued_ms): both models'
    prefills of its prompt (a self-speculative draft's cache copied from the target's instead) and
    the row's buffers reset (RoundDecoder.prefill, as generate_batch starts it), after the
    decoder's generations. The row is left done again (budget 0, as RoundDecoder._warm_up leaves
    its rows: a prefill lifts the stop rule), so that nothing after finds it live."""
    ms = issued_ms(lambda: spec.prefill([0], [request.prompt], [request.seed]), spec.stream)
    spec.bufs.set_stop(budget=0)
    return ms


def greedy_start_ms(greedy: Any, request: Any) -> float:
    """Device milliseconds of `request`'s start in row 0 of a GraphedGreedy (issued_ms): its
    prefill of the prompt but its last token, which becomes the row's next input at its position
    (GraphedGreedy.admit, the one-row prefill graph generate_batch's start replays), after its
    generations; the row parked after."""
    ms = issued_ms(lambda: greedy.admit(0, request), greedy.stream)
    greedy.park([0])
    return ms


def request_split(seconds: float, requests: int, rounds: int, round_ms: float, vd_ms: float | None,
                  start_ms: float, bursts: int) -> dict[str, float | None]:
    """Where a request's time went, of `requests` timed one after another (B = 1) in `seconds`,
    which sent the GPU `rounds` rounds (the plain loop: steps) and read `bursts` bursts back: its
    wall (`request_ms`); its rounds (`request_rounds`) at `round_ms` each inside their burst
    graphs (`rounds_ms`), of which `vd_ms` the round's verify and draft timed alone (None: the
    plain loop's step, which is the whole of it); its start (`start_ms`, its prefills, the host's
    issue included); and the rest (`rest_ms`), the GPU idle while the host works: at its `bursts`
    readbacks (each a request's: the wait, the tokens taken apart, the next burst's pacing and
    launch) and at the generation's end. The rounds and readbacks are the ones measured, not the
    budget's: an EOS may end a request early."""
    request_ms, request_rounds = 1e3 * seconds / requests, rounds / requests
    rounds_ms = request_rounds * round_ms
    return dict(request_ms=request_ms, request_rounds=request_rounds, round_ms=round_ms, rounds_ms=rounds_ms,
                vd_ms=vd_ms, start_ms=start_ms, rest_ms=request_ms - rounds_ms - start_ms, bursts=bursts / requests)


def measure_config(model: Any, kind: str, spec: Any, groups: Sequence[Sequence[Any]], capacity: int, sampling: Any,
                   step_ms: float, plain: float, draft: Any = None, modes: Sequence[str] = ("graph",),
                   **fields: Any) -> list[dict]:
    """One chain's or tree's rows, one for each of `modes`: `fields` and its kind, its figures
    (_bench_tree_config) and how near its ideal it got against `plain` tokens/s (reach), its
    decoder released before the next is built."""
    rows = [dict(fields, kind=kind, **figured)
            for figured in _bench_tree_config(model, kind, spec, groups, capacity, sampling, step_ms, draft, modes)]
    release()
    for row in rows:
        row.update(reach(row["tokens_per_s"] / plain, row["ideal"], row["rows_share"]),
                   plain_busy=busy_share(plain, step_ms, len(groups[0])))
    return rows


def figures(lengths: Sequence[Sequence[int]], rounds: Sequence[np.ndarray], seconds: float, v: float,
            d: float, sent: int | None = None, step_ms: float | None = None) -> dict[str, float]:
    """A configuration's row from its generations (each one's rows' token counts and rounds) and
    its round's verify and draft in target steps: tokens/s, tau over every row, the ideal
    tau / (v + d) and the rows' share of the batches' rounds. Given the rounds the generations
    `sent` to the GPU and the target's step, where the rest of the ideal went: `used`, the share
    of the rounds sent (each a row's) that committed a row's tokens (not one past its end, nor a
    finished row's in a batch still running), and `busy`, the share of the timed seconds the
    rounds' verifies and drafts fill at the costs v and d (the rest: the round's own kernels,
    prefills, the host's readbacks and launches). With the plain loop's own busy share
    (busy_share), reached = used x busy / plain_busy exactly."""
    tokens = sum(sum(group) for group in lengths)
    ran = sum(int(np.sum(r)) for r in rounds)
    tau = tokens / ran if ran else 1.0
    out = dict(tokens_per_s=tokens / seconds, tau=tau, v=v, draft=d, ideal=tau / (v + d),
               rows_share=rows_share(rounds))
    if sent and step_ms is not None:
        batch = len(lengths[0])
        out.update(sent=sent, used=ran / (batch * sent), busy=sent * (v + d) * step_ms / (1e3 * seconds))
    return out


def busy_share(tokens_per_s: float, step_ms: float, batch: int) -> float:
    """The plain loop's busy share: its steps' device time (a step a token of each of its `batch`
    rows) over its timed seconds, the rest its prefills, readbacks, launches and steps past a
    row's end: what `busy` is for a round, the unit of figures()'s decomposition of reached."""
    return tokens_per_s * step_ms / (1e3 * batch)


def rows_share(rounds: Sequence[np.ndarray]) -> float:
    """The rows' mean rounds over their batch's slowest row's, over batches run one after another
    (each's StreamBufs.rounds_run; B = 1's prompts are batches of one): the rounds the rows ran over
    the rounds the batches ran, each its slowest row's times its rows, the share of them its rows
    used; 1 where none ran a round (a budget of 0)."""
    ran = sum(len(r) * int(np.max(r, initial=0)) for r in rounds)
    return sum(float(np.sum(r)) for r in rounds) / ran if ran else 1.0


def decoder(model: Any, kind: str, config: Any, capacity: int | Room, batch: int = 1, sampling: Any = None,
            draft: Any = None, modes: Sequence[str] = ("graph",),
            skip_done: bool | None = None) -> tuple[Any, Callable[[], None], Callable[[], None]]:
    """A chain's decoder (`config` its k) or a tree's (`config` the tree) of `model` and `draft`
    (default its self-speculative one), every graph of `modes` captured (device mode's loop for any
    budget its caches hold) and the decoder sealed (RoundDecoder.capture), and the two callables
    its round runs: the verify and the whole draft. `skip_done`: the decoder's (None: the run's,
    SKIP_DONE, a bool)."""
    from memra_cuda.torch import SpeculativeLlama, TreeLlama, self_draft
    draft = self_draft(model) if draft is None else draft
    skip_done = SKIP_DONE if skip_done is None else skip_done
    if kind == "chain":
        chain = SpeculativeLlama(model, draft, k=config, m_rounds=TORCH_M, capacity=capacity, batch=batch,
                                 sampling=sampling, skip_done=skip_done)
        chain.capture(tuple(modes))
        return chain, chain.verify_trunk, chain.draft_chain
    spec = TreeLlama(model, draft, config, m_rounds=TORCH_M, capacity=capacity, batch=batch,
                     sampling=sampling, skip_done=skip_done)
    spec.capture(tuple(modes))

    def draft_levels() -> None:
        for d in range(spec.tree.depth + 1):
            spec.draft_level(d)

    return spec, spec.verify_tree, draft_levels


def release() -> None:
    """Give a dropped decoder's device memory back before the next is built: its RoundStream
    holds the decoder's own bound methods, a cycle only the collector breaks, and torch's
    allocator keeps freed blocks cached until emptied."""
    import torch
    gc.collect()
    torch.cuda.empty_cache()


def tree_summary(measured: list[dict], chosen: dict | None, plain: float) -> dict:
    """One size, B and mode of section 5: the best of each kind measured (a run may leave a kind
    out: --chains, --trees), and the pick (`chosen`; the best chain where tree_for_batch says the
    chain; plain decoding's row where it says PLAIN, which has no ideal to reach), each against the
    best chain where a chain ran. `best_tree` and its figures where a tree ran."""
    best = {kind: max(mine, key=lambda row: row["tokens_per_s"])
            for kind in SPECULATIVE if (mine := [row for row in measured if row["kind"] == kind])}
    chosen = chosen or best["chain"]
    chain = best["chain"]["tokens_per_s"] if "chain" in best else None
    first = measured[0]
    summary = dict(size=first["size"], batch=first["batch"], mode=first["mode"], kind="best",
                   plain_tokens_per_s=plain, chosen=chosen["config"], chosen_kind=chosen["kind"],
                   chosen_tokens_per_s=chosen["tokens_per_s"],
                   chosen_vs_chain=chain and chosen["tokens_per_s"] / chain,
                   chosen_reached=chosen.get("reached"), chosen_batch_reached=chosen.get("batch_reached"))
    trees = [best[kind] for kind in SPECULATIVE[1:] if kind in best]
    if trees:
        tree = max(trees, key=lambda row: row["tokens_per_s"])
        summary.update(best_tree=tree["config"], best_tree_kind=tree["kind"],
                       best_tree_tokens_per_s=tree["tokens_per_s"],
                       best_tree_vs_chain=chain and tree["tokens_per_s"] / chain,
                       best_tree_ideal=tree["ideal"], best_tree_reached=tree["reached"])
    for kind, row in best.items():
        summary.update({kind: row["config"], f"{kind}_tokens_per_s": row["tokens_per_s"]})
    return summary


def summary_line(summary: dict) -> str:
    """tree_summary's line: the best of each kind measured and the pick against the best chain."""
    def label(kind: str, config: Any) -> str:
        return row_label(dict(kind=kind, config=config))
    against = f" = {summary['chosen_vs_chain']:.2f}x the chain" if summary["chosen_vs_chain"] else ""
    return (f"{summary['size']:6} {summary['batch']:4} {summary['mode']:8} " + ", ".join(
        f"best {kind} {label(kind, summary[kind])} {summary[f'{kind}_tokens_per_s']:.0f} tok/s"
        for kind in SPECULATIVE if kind in summary) +
        f", chosen {summary['chosen_kind']} {label(summary['chosen_kind'], summary['chosen'])}{against}")


def pyplot(who: str, path: str | Path) -> Any:
    """matplotlib's pyplot drawing to files, or None where matplotlib (the `plot` extra) is
    absent, said in one line by `who`: a picture is optional, a run's figures are not."""
    try:
        import matplotlib
    except ImportError:
        print(f"{who}: no picture at {path} without matplotlib (`pip install matplotlib` to get the picture)")
        return None
    matplotlib.use("Agg")  # a file, no display
    import matplotlib.pyplot as plt
    return plt


def plot_trees(rows: list[dict], path: str | Path, title: str | None = None) -> None:
    """Section 5's picture at `path` (PNG): tokens/s against B for plain decoding, the best chain,
    the best tree and that tree's ideal (ideal x plain tokens/s), a panel per model size (the
    rows' `size`, the headline's "pair" too), greedy solid and sampling dashed, under `title`.
    matplotlib is optional (the `plot` extra): without it, one line."""
    plt = pyplot("trees", path)
    if plt is None:
        return
    best = [row for row in rows if row["kind"] == "best"]
    sizes = list(dict.fromkeys(row["size"] for row in best))
    if not sizes:
        return
    series = {"plain decoding": lambda r: r["plain_tokens_per_s"], "best chain": lambda r: r.get("chain_tokens_per_s"),
              "best tree": lambda r: r.get("best_tree_tokens_per_s"),
              "ideal of the best tree": lambda r: r.get("best_tree_ideal", 0) * r["plain_tokens_per_s"] or None}
    figure, axes = plt.subplots(1, len(sizes), figsize=(6.5 * len(sizes), 4.5), squeeze=False)
    for axis, size in zip(axes[0], sizes):
        for mode, style in (("greedy", "-"), ("sampling", "--")):
            mine = sorted((row for row in best if row["size"] == size and row["mode"] == mode),
                          key=lambda row: row["batch"])
            for color, (name, value) in enumerate(series.items()):
                points = [(row["batch"], value(row)) for row in mine if value(row)]  # a kind a run left out: none
                if not points or (name == "plain decoding" and mode == "sampling"):  # plain decoding is greedy
                    continue
                axis.plot(*zip(*points), style, color=f"C{color}",
                          marker="o", label=name if name == "plain decoding" else f"{name}, {mode}")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xticks(TREE_BATCHES, [str(b) for b in TREE_BATCHES])
        axis.set(title=f"{size} model", xlabel="B (rows)", ylabel="tokens/s, all rows")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize="small")
    if title:
        figure.suptitle(title, fontsize="small", wrap=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"trees: the picture is {path}")


def bounded(text: str, least: int, most: int | None = None) -> int:
    """An int from `least` to `most` (no bound: None), as an argparse type: another is its error,
    naming the span."""
    try:
        number = int(text)
    except ValueError:
        number = least - 1
    if number < least or (most is not None and number > most):
        span = f"an int from {least} to {most}" if most is not None else f"a count of {least} or more"
        raise argparse.ArgumentTypeError(f"{span}, not {text!r}")
    return number


def writable(text: str) -> str:
    """--json's PATH, as an argparse type: a file that can be written, in a folder that exists (a
    folder, a missing folder or one not ours is its error). The programs open it only once their
    figures are in, minutes into a run that the refusal then threw away."""
    path = Path(text)
    if path.is_dir() or not path.parent.is_dir() or not os.access(path if path.exists() else path.parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"a file to write, in a folder that exists, not {text!r}")
    return text


def listed(text: str, known: Sequence[Any], kind: Callable[[str], Any] = str) -> list[Any]:
    """A comma-separated subset of `known`, each once (argparse's type: a wrong item is its error;
    one named twice ran twice, a B's whole measurement again, and its rows twice in the report)."""
    try:
        items = [kind(item) for item in text.split(",")]
    except ValueError:
        items = [text]
    if set(items) - set(known) or len(set(items)) != len(items):
        raise argparse.ArgumentTypeError(f"a comma-separated list of {', '.join(map(str, known))}, each once, "
                                         f"not {text!r}")
    return items

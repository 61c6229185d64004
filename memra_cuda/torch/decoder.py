"""What a round-stream decoder of a target and a draft model does with them: prefill rows,
capture every graph up front, generate a batch, serve a queue continuously.

The chain's decoder (SpeculativeLlama) and the tree's (TreeLlama) differ in their round, not in
this: both keep a Stack of each model over static caches of B rows, one torch stream and an
engine on it, StreamBufs for the rows, and a RoundStream. A new request changes only values in
device buffers (its prompt's KV, start_row), so no graph is ever recaptured while serving, and
every capture (which through torch synchronises the device) can be made first. Serving itself,
the queue and the slots, is memra_cuda.rounds.serving's Server, the plain loop's too.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import torch

from ..buffers.capacity import CapacityError, kv_capacity
from ..buffers.lengths import DraftLengths
from ..buffers.geometry import Geometry, as_geometry
from ..buffers.stream_bufs import Readback, StreamBufs
from ..buffers.tables import StateIndexTable, StateTable
from ..driver.engine import Engine
from ..driver.values import (as_flag, as_listed, as_prompt, as_seed, as_size, distinct_rows, longest_prompt_for,
                             seed_bits)
from ..rounds.serving import Burst, Driven, Request, Served, Server, admitted, as_rows, batch_admitted
from ..rounds.stream import MODES, Mode, RoundStream, as_mode
from .adapter import decoder_stream, engine
from .kv import CACHE_LAYOUTS, CacheLayout, Room, StaticKV, as_layout, cache_slots
from .sampling import SamplingParams, as_sampling
from .compiled import as_compiled, stack_for
from .state import CopyState, FlipState, has_recurrent, rollback
from .uploads import uploaded
from .views import RoundViews


Law = Callable[[torch.Tensor, torch.Tensor], None]  # SamplingParams.fill(out, logits), as a decoder runs it


def fold(root: torch.Tensor, start: torch.Tensor, lone: torch.Tensor, vtok: torch.Tensor,
         accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A round's first draft step's tokens and positions ([B][2] each), which append the token
    the last round accepted deepest along with `root` ([B][1], at `start`): vtok[accepted] at
    start - 1 (where every draft was accepted, the last draft step, which the draft never ran,
    folded in here, docs/model-side.md; otherwise an entry rewritten unchanged). A `lone` row
    ([B][1] bool) has none to append (at position 0, a done row, whose entries stay as they are,
    or where that entry is there already): the root fills both columns. Arithmetic a decoder
    compiles with its draft's step (LayerStack.compiled)."""
    behind = torch.where(lone, root, vtok.gather(1, accepted.long().clamp(0, vtok.shape[1] - 1)))
    return torch.cat([behind, root], 1), torch.cat([start - 1 + lone.long(), start], 1)


class RoundDecoder:
    """Target and draft Stacks of the geometry's B rows (`target`, `draft`) wired to a RoundStream
    (`rounds`, over StreamBufs `bufs` of `geometry`) on one torch stream (`stream`, the engine's), and
    what a user does with them: prefill rows, capture the graphs, generate a batch, admit a
    request into a row, serve a queue.

    `model` and `draft` are LlamaForCausalLM-shaped models of one vocabulary: two models (a
    trained pair, loaded with memra_cuda.torch.load_model), or the target and its own first
    layers (memra_cuda.torch.self_draft), whose draft cache a prefill then copies from the
    target's instead of computing it. The draft is attention only: its first step folds in the
    last round's deepest draft (docs/model-side.md), taking a token a second time in most rounds,
    which rewrites a KV entry unchanged but would take it into a recurrent state twice. A hybrid
    target's recurrent state is rolled back by `state_rollback`, "copy" or "flip", keeping a slot
    for each token a round verifies (the geometry's width: a chain's k + 1, a tree's T + 1).

    A subclass sets `rounds`, the verify's output (`pred_d`, or `p_d` with sampling), then calls
    _warm_up()."""

    rounds: RoundStream
    lengths: DraftLengths  # each request's most draft length, applied on the device (each subclass makes it)
    pred_d: torch.Tensor  # greedy: the target's token at each verified position, [B][width]
    p_d: torch.Tensor  # sampling: the target's probabilities there, [B][width][V]

    def __init__(self, model: Any, draft: Any, geometry: Geometry, *,
                 capacity: int | Room, sampling: SamplingParams | None, draft_sampling: SamplingParams | None,
                 state_rollback: str, cache: CacheLayout = StaticKV,
                 on_engine: Callable[[Engine], None] | None = None, compiled: bool | None = None,
                 skip_done: bool = False):
        """`capacity`: each model's cache slots a row, or a Room the geometry sizes them for
        (capacity_for). `on_engine` is called with the engine as soon as it exists, before anything runs on it
        (examples/torch_tp.py lets its communicator time the engine's waits and its graphs hold it).
        `compiled`: each model's step compiled (CompiledStack) where it fuses and the cache is
        static (None), always (True: NotFused where it cannot), or never (False: Stack, the
        model's own modules)."""
        begun = time.perf_counter()
        geometry = as_geometry(geometry)
        refuse(model, draft, state_rollback)
        self.skip_done = as_skip_done(model, skip_done)  # the round's (Round's skip_done), refused here
        capacity = cache_slots(capacity, geometry)  # whole blocks
        if sampling is None and draft_sampling is not None:
            raise ValueError("draft_sampling is the draft's law of a sampled decoder: give sampling= too")
        sampling, draft_sampling = as_sampling(sampling), as_sampling(draft_sampling, "draft_sampling")
        # before the stream and the engine: both were made, and on_engine=5 raised as it was called
        compiled = as_compiled(compiled)
        cache = as_layout(cache, "cache", CACHE_LAYOUTS)
        if on_engine is not None and not callable(on_engine):
            raise TypeError(f"on_engine is a function called with the decoder's Engine, or None, not {on_engine!r}")
        self.k: int = geometry.k
        self.batch: int = geometry.batch
        batch = self.batch
        self.vocab: int = model.config.vocab_size  # every token a request names is below it
        # the warm-up's round (a prompt of two tokens, its pending one at position 1): refused there, after both
        # models were compiled, as a "next burst" no one had asked for
        need = kv_capacity(1, 0, geometry.with_rounds(1))
        if need > capacity:
            raise CapacityError(f"a cache of {capacity} slots a row (whole blocks) cannot take one round of "
                                f"{geometry.width} tokens a row at k = {geometry.k}, B = {geometry.batch}: it needs "
                                f"{need} (a Room sizes the caches for the requests: memra_cuda.torch.Room)")
        self.sampling, self.draft_sampling = sampling, draft_sampling or sampling
        self.stream = decoder_stream()  # after the caller's: stack_for fuses the models' weights on it
        with torch.cuda.stream(self.stream):
            self.engine = engine()
            if on_engine is not None:
                on_engine(self.engine)
            verified = geometry.width - 1  # the tokens a round verifies past the pending one: state slots
            self.target = stack_for(model, capacity, batch, state=rollback(state_rollback, self.engine, verified),
                                    cache=cache, compiled=compiled)
            self.draft = stack_for(draft, capacity, batch, cache=cache, compiled=compiled)
            self.shared = self.draft.prefix_of(self.target)
            self.bufs = StreamBufs(self.engine, geometry)
            self.views = RoundViews(self.bufs)
            # each row's request's sampling seed, set at its prefill
            self.seed_d = torch.zeros(batch, dtype=torch.int64, device="cuda")
        # and the caller's stream waits for the weights fused there, as GraphedGreedy's does (the
        # models' own modules are views of them), not on a warm-up's readback to have ordered it
        torch.cuda.current_stream().wait_stream(self.stream)
        # each law's probabilities written where the round reads them (SamplingParams.fill), run
        # as the stack of the logits it reads runs its forward: compiled, one kernel where six
        # launched (LayerStack.compiled)
        self.target_law: Law | None = None if sampling is None else self.target.compiled(sampling.fill)
        self.draft_law: Law | None = (None if self.draft_sampling is None
                                      else self.draft.compiled(self.draft_sampling.fill))
        self.driven = Driven()  # the servers made over the rows (server()), each held weakly
        self.setup_seconds = time.perf_counter() - begun  # a subclass's _warm_up adds its own, capture() too

    def _warm_up(self) -> None:
        """One eager round, so torch's lazy set-up (library handles, workspaces) and every compiled
        step a round runs happen before any capture; the next prefill resets everything it
        touched. Then every slot is vacant."""
        begun = time.perf_counter()
        self.prefill(range(self.batch), [[0, 0]] * self.batch)
        self.rounds.step("readback")
        self.bufs.set_stop(budget=0)
        self.setup_seconds += time.perf_counter() - begun

    def _verdict(self, logits: torch.Tensor) -> None:
        """What a verify leaves its acceptance kernel from the target's logits over the verified
        tokens ([B][T][V], T up to the geometry's width: a narrower width's fill the first T columns):
        their greedy tokens, or their probabilities."""
        width = logits.shape[1]
        if self.target_law is None:
            torch.argmax(logits, -1, out=self.pred_d[:, :width])
        else:
            self.target_law(self.p_d[:, :width], logits)

    def _prefilled(self, index: torch.Tensor, prompts: Sequence[Sequence[int]]) -> None:
        """What a subclass sets for the rows `index` once their prompts are in."""

    def state_tables(self) -> list[StateTable | StateIndexTable]:
        """RoundStream's state_tables: the hybrid target's one table (none for a pure-attention
        model, nor for the draft, which is attention only)."""
        state = self.target.state
        return [state.table(self.engine)] if isinstance(state, (CopyState, FlipState)) else []

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]],
                seeds: Sequence[int] | None = None, caps: Sequence[int] | None = None) -> list[int]:
        """Both caches of each row take its prompt but the last token, which becomes pending;
        `seeds` are the rows' requests' (sampling), `caps` their most draft lengths (default k:
        a new request drafts at the full length unless it says). The rows' stop rules are lifted
        (set_stop sets the next ones). Returns the rows' start positions. Rows (distinct rows of
        the batch), caps, seeds and prompts are checked before any row is written: a cap refused
        after the caches were filled left the rows live with no budget. Caps and seeds are lists
        (as_listed): a mapping's keys were taken for them, {row: seed} sampling each row with its
        row's number for a seed, without a word. RuntimeError while a server over the rows has a
        request in flight (Driven.take): a row may be one it holds."""
        self.driven.take("prefill()")
        rows = distinct_rows(rows, self.batch, "a prefill's rows")
        listed = ([self.k] * len(rows) if caps is None
                  else as_listed(caps, "a prefill's caps", "ints, one a row", len(rows)))  # more: unread
        caps = [as_size(c, "a most draft length", 0, self.k) for c in listed]
        if len(caps) != len(rows):
            raise ValueError(f"need one most draft length for each of the {len(rows)} rows, not {len(caps)}")
        return self._prefill_trusted(rows, *self._checked_prompts(rows, prompts, seeds), caps)

    def _prefill_trusted(self, rows: list[int], prompts: Sequence[Sequence[int]], seeds: Sequence[int] | None,
                         caps: Sequence[int]) -> list[int]:
        """prefill() of what is checked already: prefill's own arguments, or generate_batch's
        requests (rounds.serving.batch_admitted's copies) and their caps (_cap)."""
        starts, pending = self._fill_trusted(rows, prompts, seeds)
        with torch.cuda.stream(self.stream):
            if rows == list(range(self.batch)):
                self.bufs.reset(pending, starts)
                self.lengths.set_caps(caps)
            else:
                for row, token, start, cap in zip(rows, pending, starts, caps):
                    self.bufs.reset_row(row, token, start)
                    self.lengths.set_cap_row(row, cap)
        return starts

    def admit(self, row: int, request: Request) -> None:
        """Start `request` in slot `row` between bursts, in one call: both caches of the row take
        its prompt but the last token, which becomes pending, and the row takes its stop rule
        with it (StreamBufs.start_row), so no burst finds it live without its budget. The other
        rows run on untouched: continuous batching's unit (a Server's admission). The request
        is checked as Server.submit checks it (rounds.serving.admitted: the copy a Server kept
        from its submit passes at once): well formed, its tokens in the vocabulary; its room is
        checked by every burst (CapacityError). RuntimeError, from anything but a server's own
        calls, while a server over the rows has a request in flight (Driven.take_row): the row
        may be one it holds."""
        self.driven.take_row("admit()")
        # refused before the row is touched
        row, request = admitted(request, self.vocab, row, self.batch, self.longest_prompt)
        (start,), (pending,) = self._fill_trusted([row], [request.prompt], [request.seed])
        with torch.cuda.stream(self.stream):
            self.bufs.start_row(row, pending, start, budget=request.max_new_tokens, eos=request.eos)
            self.lengths.set_cap_row(row, self._cap(request))

    def _cap(self, request: Request) -> int:
        """A checked request's most draft length in this decoder (its own, a plain int since its
        check: rounds.serving's admitted and batch_admitted), at most k."""
        return self.k if request.max_draft is None else min(request.max_draft, self.k)

    def _checked_prompts(self, rows: list[int], prompts: Sequence[Sequence[int]],
                         seeds: Sequence[int] | None) -> tuple[list[list[int]], list[int] | None]:
        """A prefill's prompts, one a row, each as the list of ints that was checked (at least one
        token, each of the vocabulary: as_prompt), and its seeds (None: none given), one a row,
        as ints from 0 to 2**64 - 1 (as_seed), or a refusal naming what, before any row is
        written. More of either than the rows are refused by their count, unread: range(10**10)
        was listed whole (tens of GB, a MemoryError) to be refused as one a row."""
        prompts = as_listed(prompts, "a prefill's prompts", "prompts, one a row", len(rows))
        if len(prompts) != len(rows):
            raise ValueError(f"need one prompt for each of the {len(rows)} rows, not {len(prompts)}")
        seeds = None if seeds is None else as_listed(seeds, "a prefill's seeds", "ints, one a row", len(rows))
        if seeds is not None and len(seeds) != len(rows):
            raise ValueError(f"need one seed for each of the {len(rows)} rows, not {len(seeds)}")
        checked = None if seeds is None else [as_seed(seed, "its seed") for seed in seeds]
        # the whole prompt, its last (pending) token too, which only the draft's first step looks up
        return [as_prompt(prompt, self.vocab, f"row {row}'s prompt", self.longest_prompt).tolist()
                for row, prompt in zip(rows, prompts)], checked

    def _fill_trusted(self, rows: list[int], prompts: Sequence[Sequence[int]],
                      seeds: Sequence[int] | None) -> tuple[list[int], list[int]]:
        """Both caches of each row take its prompt but the last token, and what a subclass sets
        for the rows (_prefilled) and their seeds are set: everything of a request's start but
        the buffers' row. The rows, prompts and seeds are checked already, where they entered
        (prefill's checks, admitted's, batch_admitted's, a Server's submit): each prompt a
        sequence of ints of the vocabulary, which both stacks take unchecked (their
        _prefill_trusted). Returns the rows' start positions and pending tokens."""
        heads = [prompt[:-1] for prompt in prompts]
        with torch.cuda.stream(self.stream):
            index = uploaded(rows, torch.long, "cuda")
            self.target._prefill_trusted(rows, heads)
            if self.shared:
                self.draft.kv.copy_rows(self.target.kv, rows)
            else:
                self.draft._prefill_trusted(rows, heads)
            self._prefilled(index, prompts)
            if self.sampling is not None:
                # int64 holds a seed's 64 bits (seed_bits: 2**64 - 1 is -1), which the kernels read as its key
                bits = [seed_bits(seed) for seed in seeds] if seeds is not None else [0] * len(rows)
                self.seed_d[index] = uploaded(bits, torch.long, "cuda")
        return [len(prompt) - 1 for prompt in prompts], [prompt[-1] for prompt in prompts]

    def capture(self, modes: Sequence[str] = ("graph", "overlap")) -> None:
        """Every graph the modes may replay (each burst length pacing may ask for; with "device",
        device mode's loop for any budget the caches hold), and every one-row prefill graph of
        both models, captured now, before any request: through torch a capture synchronises the
        device, which a server must not do mid-request. From then on a graph of another mode is a
        CaptureError, not a capture (the rounds are sealed). setup_seconds is then what the
        decoder spent compiling and capturing before its first request. Each mode is checked
        first: a misspelt one is a ValueError, not a "graph". Device mode runs a whole batch in one
        launch (generate_batch), no server's mode. RuntimeError while a server over the rows has a
        request in flight (Driven.take), as GraphedGreedy's: a prefill graph's warm-up writes
        into the last prefilled row, and a capture synchronises the device mid-serving. `modes` is
        one mode's name or a list or tuple of at least one (as_listed: None met "'NoneType' object
        is not iterable", b"graph" a mode 103, and () captured graph mode's graphs and sealed the
        rounds, refusing every other mode's from then on); a set of them is taken too."""
        # a set's order is no matter here (the modes are a set): as_listed refuses one, for its order
        listed = ([modes] if isinstance(modes, str) else list(modes) if isinstance(modes, AbstractSet)
                  else as_listed(modes, "capture()'s modes", "mode names"))
        if not listed:
            raise ValueError(f"capture() takes at least one mode of {', '.join(MODES)}, not none: the rounds are "
                             "sealed after it, and a mode not captured is refused from then on")
        wanted = {as_mode(mode) for mode in listed}
        self.driven.take("capture()")
        begun = time.perf_counter()
        with torch.cuda.stream(self.stream):
            self.target.capture_prefills()
            if not self.shared:
                self.draft.capture_prefills()
            self.rounds.capture_graphs(slots=(0, 1) if Mode.OVERLAP in wanted else (0,), seal=True)
            if Mode.DEVICE in wanted:  # a row's new tokens never outnumber its cache's slots
                self.rounds.capture_loop(self.target.kv.capacity)
        self.setup_seconds += time.perf_counter() - begun

    def generate_batch(self, requests: Sequence[Request], mode: str = "graph") -> list[list[int]]:
        """One request per row, all started together and generated until each stops. A request
        that is malformed, names a token outside the vocabulary or needs more room than the
        caches hold in `mode` (room) is refused (RequestRefused, naming its row) before anything
        runs: past the room, a burst's capacity check raised mid-generation, every row's tokens
        lost. So is the batch (RuntimeError) while a server over the rows has a request in
        flight (Driven.take: step it until it is idle), and, in device mode on sealed rounds, one
        whose budgets the loop captured before cannot take (CaptureError: capture(("device",)))."""
        mode = as_mode(mode)
        requests = batch_admitted(requests, self.vocab, self.batch, lambda request: self.room(request, mode),
                                  self.longest_prompt)
        most = max(r.max_new_tokens for r in requests)
        if mode is Mode.DEVICE and most:  # refused before the rows are touched, where follow() would capture its loop
            self.rounds.require_loop(most)
        if most:  # overlap's second slot, where capture() left it out: refused before the rows are touched too
            self.rounds.require_graphs(mode)
        self.driven.take("generate_batch")
        self._prefill_trusted(list(range(self.batch)), [r.prompt for r in requests], [r.seed for r in requests],
                              [self._cap(r) for r in requests])
        out = self.rounds.generate_batch([r.max_new_tokens for r in requests],
                                         eos=[r.eos for r in requests], mode=mode)
        return [tokens.tolist() for tokens in out]

    @property
    def longest_prompt(self) -> int:
        """The most tokens a prompt can have: all but its last (pending) token fill a row's caches,
        as a stack's prefill takes them (room() refuses a prompt shorter still wherever a burst is
        to run). A longer one is refused by its length, before its tokens are read
        (rounds.serving's Decoder)."""
        return longest_prompt_for(self.target.kv.capacity)

    def room(self, request: Request, mode: Mode | str) -> str | None:
        """Why a checked `request` cannot run in a row in `mode` (its prompt and budget past the
        caches' room: kv_capacity of this decoder's rounds, a burst of `mode`'s, one more in
        flight for "overlap"), as a clause that follows "request N refused: "; None where it can.
        `mode` is a Mode or its name, as everywhere else a decoder takes one (as_mode; ValueError
        naming the choices): "overlap" by its name was measured without its burst in flight, a
        request said to fit that generate_batch in overlap mode then refused."""
        mode = as_mode(mode)
        rule, capacity = self.rounds.round.capacity, self.target.kv.capacity
        prompt, new = len(request.prompt), request.max_new_tokens
        need = kv_capacity(prompt, new, rule.geometry.with_rounds(self.rounds.rounds_per_step(mode)),
                           overlap=mode is Mode.OVERLAP)
        if need > capacity:
            return (f"{prompt} prompt tokens and {new} new need a KV cache of {need} entries in {mode.value} "
                    f"mode; these hold {capacity}")
        return None

    def generate(self, prompt: Sequence[int], max_new_tokens: int, *, eos: int | None = None,
                 mode: str = "graph", seed: int = 0) -> list[int]:
        """One request (a decoder of one row)."""
        return self.generate_batch([Request(prompt, max_new_tokens, eos, seed)], mode)[0]

    def server(self, mode: str = "graph", *, clock: Callable[[], float] = time.perf_counter) -> Server:
        """A Server (memra_cuda.rounds.serving) over the batch's slots, each of its bursts one
        step of `mode`: submit, cancel and step requests through it. Every graph is captured
        first where capture() has not been (a capture mid-serving would stall every row), and
        every slot is parked now. "overlap" and "device" are refused: a server admits requests
        between bursts, and they keep a burst in flight or run a whole generation in one launch.
        RuntimeError while another server over the rows has a request in flight (Driven.take:
        step it until it is idle), whose rows this one would park."""
        mode = as_mode(mode)
        if mode is Mode.OVERLAP:
            raise ValueError('a server steps one burst at a time: "overlap" keeps two in flight (generate_batch)')
        if mode is Mode.DEVICE:
            raise ValueError('a server steps one burst at a time: "device" generates until every row is done, in '
                             "one launch (generate_batch)")
        self.driven.take("a new server")
        if not self.rounds.sealed:
            self.capture(("graph",))
        return Server(_Slots(self, mode), clock=clock)

    def serve(self, requests: Sequence[Request], mode: str = "graph") -> list[Served]:
        """Continuous batching: the requests, queued in order, through the batch's slots
        (server(mode).serve): a slot takes the next request as soon as its own stops, between
        bursts, and every step runs all slots. One Served a request, in order; a request that
        cannot run (its prompt and budget past the caches' room in this mode, a token outside
        the vocabulary) is refused alone, its Served's `refused` saying why. Where it raises (an
        interrupt), its server drives the rows no more (Driven.serve)."""
        return self.driven.serve(lambda: self.server(mode), requests)  # made once the requests are checked

    def acceptance(self, committed: int | Sequence[int]) -> float:
        """The share of drafted tokens accepted, given each row's committed tokens."""
        accepted, drafted = self.bufs.drafts_accepted(committed)
        return accepted / drafted if drafted else 1.0


class _Slots:
    """A RoundDecoder's rows as a Server drives them (memra_cuda.rounds.serving.Decoder), every
    burst one step of `mode`: a request fits where the capacity rule every burst is checked by
    (the round's k, batch and width, this mode's rounds a step) gives it room."""

    def __init__(self, decoder: RoundDecoder, mode: Mode):
        self.decoder, self.mode = decoder, mode
        self.batch, self.vocab, self.driven = decoder.batch, decoder.vocab, decoder.driven  # Server tells driven

    @property
    def longest_prompt(self) -> int:
        """The decoder's: a longer prompt is refused by its length, unread (Server.submit)."""
        return self.decoder.longest_prompt

    def refusal(self, request: Request) -> str | None:
        return self.decoder.room(request, self.mode)

    def admit(self, row: int, request: Request) -> None:
        """The decoder's own admit: the copy the Server kept passes its check at once."""
        self.decoder.admit(row, request)

    def burst(self) -> Burst:
        """One step of the mode. RuntimeError, from anything but a server's own calls, while a
        server over the rows has a request in flight (Driven.take_row, as the decoder's admit):
        server.decoder.burst() ran the server's rows, and their tokens never reached it."""
        self.driven.take_row("burst()")
        return _burst(self.decoder.rounds.step(self.mode))

    def recover(self) -> Burst | None:
        """The last burst, where an interrupt cut its readback's wait short (RoundStream.recover);
        refused so too (Driven.take_row): it is the server's to recover."""
        self.driven.take_row("recover()")
        readback = self.decoder.rounds.recover()
        return None if readback is None else _burst(readback)

    def park(self, rows: Sequence[int]) -> None:
        """The rows stopped (budget 0), each checked before any is (rounds.serving.as_rows): every
        row was stopped where as many rows as the batch were given, [0, 0] of two rows too. Refused
        so too (Driven.take_row), as GraphedGreedy's park: a request in a row parked by hand
        ended as if it had stopped."""
        self.driven.take_row("park()")
        parked, bufs = set(as_rows(rows, self.batch, "park()")), self.decoder.bufs
        if len(parked) == self.batch:
            bufs.set_stop(budget=0)
        else:
            for row in sorted(parked):
                bufs.set_stop_row(row, budget=0)


def _burst(readback: Readback) -> Burst:
    """A step's readback as a Server reads a burst: each row's new tokens, done flag and accepted drafts."""
    return Burst([tokens.tolist() for tokens in readback.tokens], readback.done.tolist(), readback.accepted.tolist())


def as_skip_done(model: Any, skip_done: object) -> bool:
    """A decoder's skip_done as a bool, refused before anything is made where its round could not
    skip (rounds.gate): with a recurrent layer in the target (its state's rollback reads what the
    skipped verify writes). A chain's bodies of narrower widths refuse it too (SpeculativeLlama)."""
    skip_done = as_flag(skip_done, "skip_done")
    if skip_done and has_recurrent(model.model.layers):
        raise ValueError("skip_done takes no hybrid target: its recurrent state's rollback after the commit reads "
                         "the slots the round's verify writes, which a skipped round leaves as they were")
    return skip_done


def refuse(model: Any, draft: Any, state_rollback: str) -> None:
    """What every round-stream decoder refuses of its models, before any device work: what is
    not a transformers model (a draft left out: memra_cuda.torch.self_draft makes one of the
    target's first layers), a rollback it has no strategy for, a draft of another vocabulary,
    and a recurrent layer in the draft."""
    for name, given in (("model", model), ("draft", draft)):
        if not hasattr(getattr(given, "config", None), "vocab_size") or not hasattr(getattr(given, "model", None),
                                                                                    "layers"):  # OPT's: .model.decoder
            shown = type(given).__name__ if isinstance(given, torch.nn.Module) else repr(given)  # not a page of modules
            raise TypeError(f"the {name} is a transformers causal LM (LlamaForCausalLM-shaped; a draft of the "
                            f"target's first layers is memra_cuda.torch.self_draft(model, layers)), not {shown}")
    if state_rollback not in ("copy", "flip"):
        raise ValueError(f'state_rollback is "copy" or "flip", not {state_rollback!r}')
    if draft.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"the draft's vocabulary ({draft.config.vocab_size} tokens) is not the target's "
                         f"({model.config.vocab_size}): the two must share a tokenizer")
    if has_recurrent(draft.model.layers):
        raise ValueError("the draft's layers must be attention: its first step folds in the last round's deepest "
                         "draft (docs/model-side.md), which a recurrent layer's state cannot take; put recurrent "
                         "layers past the draft's")

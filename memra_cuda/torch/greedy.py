"""What speculative decoding is measured and checked against: the target's own greedy decoding,
plain (one token a step, each step a CUDA graph, GraphedGreedy, which serves a request stream
as the speculative decoders do) and Hugging Face's (`generate`, hf_generate)."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..buffers.geometry import as_batch
from ..driver.values import as_flag, as_listed, as_size, longest_prompt_for
from ..rounds.serving import (Burst, Driven, Request, Served, Server, admitted, as_rows,
                              batch_admitted)
from .adapter import decoder_stream, torch_graph
from .sampling import SamplingParams, as_sampling
from .attention import Attention, aligned
from .compiled import as_attention, as_compiled, stack_for
from .kv import Room, as_capacity
from .uploads import uploaded

NO_BURST = -1  # out's first token until a replay's first step writes a token there (recover)


class _Stop:
    """A row's request's stop, kept on the host: its EOS, and the tokens it may still take."""

    __slots__ = ("eos", "left")

    def __init__(self, eos: int | None, budget: int):
        self.eos, self.left = eos, budget

    def take(self, tokens: list[int]) -> list[int]:
        """The tokens of a burst the request keeps: up to its EOS (kept) or its budget; `left`
        is 0 once it has stopped."""
        kept = tokens[:self.left]
        if self.eos in kept:
            kept = kept[:kept.index(self.eos) + 1]
            self.left = 0
        else:
            self.left -= len(kept)
        return kept


def advance(logits: torch.Tensor, token: torch.Tensor, position: torch.Tensor, out: torch.Tensor) -> None:
    """A plain step's end: each row's greedy token after `logits` ([B][1][V]) becomes its next
    input (`token`, [B][1]) and its entry of the burst's step (`out`, [B][1]: a row of the
    [steps][B] burst, seen as a column), and its `position` ([B][1])
    moves on one; four launches op by op, one kernel compiled (LayerStack.compiled)."""
    best = logits.argmax(-1)
    token.copy_(best)
    out.copy_(best)
    position.add_(1)


class GraphedGreedy:
    """Plain greedy decoding of a batch, the target alone: `steps` steps a burst (a token a row
    each), the burst captured once as a CUDA graph and replayed (or, with `eager`, no graph:
    each step's kernels launched from the host, compiled where the step is, the loop an engine
    writes first), the host reading each burst's tokens back once, as a server streaming them
    would, until every row has its budget or its EOS (a row's tokens past its stop are
    dropped). The model's step is compiled where it fuses (`compiled`, as a
    decoder's: memra_cuda.torch.compiled.stack_for), so this is the best plain loop a PyTorch
    user writes, the baseline every speculative figure is measured against. A hybrid model's
    reference too, which Hugging Face's forward cannot run: its step updates the live state in
    place (LiveState). `capacity`: the cache's slots a row, or a Room (a row holds its prompt but
    the last token, and its budget: capacity_for's plain rule). `steps` is at most a row's cache
    slots (`capacity` rounded up to whole blocks, attention.aligned): no request takes more tokens
    than its row holds, so a step past them is past every row's stop. `attention` is its compiled
    step's (CompiledStack's: left out, each width's measured faster; a served stream's rows hold
    less than the whole cache, which "flex" reads only as far as they hold).

    Its rows are a Server's Decoder (memra_cuda.rounds.serving), so the baseline serves a
    request stream exactly as the speculative decoders do (serve, server): a request is
    admitted into a row between bursts, and its stop is kept on the host. A vacant row decodes
    on in the graph, its tokens unread (the cache clamps its positions)."""

    def __init__(self, model: Any, capacity: int | Room, batch: int = 1, *, steps: int = 16, eager: bool = False,
                 compiled: bool | None = None, attention: Attention | None = None):
        capacity = as_capacity(capacity, None)  # these before the stream, as a round decoder checks its own
        # a burst runs at least one step, and at most a row's cache slots (its capacity in whole blocks, the
        # compiled stack's, the most any stack has): a request takes no more tokens than its row holds, so a
        # step past them is past every row's stop (2**40 met torch's out of memory for `out`, 16 TB, after the
        # stream and the model's fused weights; 10**7 fitted, and its capture ran ten million steps)
        slots = aligned(capacity)
        steps, eager = as_size(steps, f"steps (a row's cache holds {slots} slots)", 1, slots), as_flag(eager, "eager")
        # True was a batch of 1 whose server() was refused, 0 one never served; past MAX_BATCH, its cache
        # refused it after the stream and the model's fused weights
        batch = as_batch(batch)
        compiled, attention = as_compiled(compiled), as_attention(attention)  # an unknown attention met the stream
        self.stream = decoder_stream()  # after the caller's: stack_for fuses the model's weights on it
        self.batch, self.steps, self.eager = batch, steps, eager
        self.vocab: int = model.config.vocab_size  # every token a request names is below it
        with torch.cuda.stream(self.stream):
            self.stack = stack_for(model, capacity, batch, compiled=compiled, attention=attention)
            self.token = torch.zeros(batch, 1, dtype=torch.long, device="cuda")  # each row's next input, [B][1]
            self.position = torch.zeros(batch, 1, dtype=torch.long, device="cuda")  # its position, [B][1]
            # a burst's tokens, [steps][B] (read back [B][steps]), a step's row of whole 16 bytes: advance()
            # writes it compiled, and inductor cloned a row off 16 bytes before every call
            self.out = torch.zeros(steps, batch + batch % 2, dtype=torch.long, device="cuda")
            self._first = self.out[0, :1]  # the burst's first token: NO_BURST until a replay writes it
        self.advance = self.stack.compiled(advance)  # with the step, as gpt-fast compiles its argmax with it
        self.graph: torch.cuda.CUDAGraph | None = None
        self._cut = False  # a replayed burst's tokens not yet read (recover)
        self._stops: list[_Stop | None] = [None] * batch  # each row's request's stop; None: vacant
        self.driven = Driven()  # the servers made over the rows (server()), each held weakly
        # and the caller's stream waits for the weights fused here, which the model's own modules are views of
        # now (a round decoder's warm-up reads back, so its constructor returns with them written)
        torch.cuda.current_stream().wait_stream(self.stream)

    def _burst(self) -> None:
        for step in range(self.steps):
            self.advance(self.stack.logits(self.token, self.position), self.token, self.position,
                         self.out[step, :self.batch, None])

    def _start(self, requests: Sequence[Request]) -> None:
        """Every row starts its request (one a row, each checked already: batch_admitted's
        copies, or capture's own), its prompt taken by the stack unchecked; each row is vacant
        until its caller gives it a stop (generate_batch): a request admitted by hand before
        kept its stop, and capture()'s warm-up handed its tokens out as that request's."""
        self._cut = False  # every row starts again: no burst of theirs to recover
        self._stops = [None] * self.batch
        self.stack._prefill_trusted(range(self.batch), [r.prompt[:-1] for r in requests])
        self.token.copy_(uploaded([[r.prompt[-1]] for r in requests], self.token.dtype, self.token.device))
        self.position.copy_(uploaded([[len(r.prompt) - 1] for r in requests], self.position.dtype,
                                     self.position.device))

    def capture(self) -> None:
        """The burst's graph, now (a warm-up burst first, which compiles the step), so that no
        generation captures: a capture synchronises the device. The warm-up starts every row
        (a prompt of two tokens each) and runs it, each row vacant after it (a request admitted
        by hand kept its stop, and the next burst handed it the warm-up's tokens): RuntimeError
        while a server over the rows has a request in flight (Driven.take), whose rows it took (a
        Server made directly, its bursts run eagerly until then, had its requests' rows started
        again, their tokens wrong)."""
        if self.graph is not None or self.eager:
            return
        self.driven.take("capture()")
        with torch.cuda.stream(self.stream):
            self._start([Request([0, 0], 0)] * self.batch)
            self._burst()
            with torch_graph(self.stream) as graph:
                self._burst()
            self.graph = graph  # kept once captured: a capture that raised left none to replay

    @property
    def longest_prompt(self) -> int:
        """The most tokens a prompt can have: all but its last fill a row's cache (refusal's rule
        at a budget of 0). A longer one is refused by its length, before its tokens are read
        (rounds.serving's Decoder)."""
        return longest_prompt_for(self.stack.kv.capacity)

    def refusal(self, request: Request) -> str | None:
        """Why `request` does not fit a row's cache (its prompt but the last token and its
        budget), or None. A burst may run a row past its stop: those steps' positions are
        clamped to the cache and their tokens dropped."""
        capacity, need = self.stack.kv.capacity, len(request.prompt) - 1 + request.max_new_tokens
        if need > capacity:
            return (f"{len(request.prompt)} prompt tokens and {request.max_new_tokens} new need a cache of {need}; "
                    f"this holds {capacity}")
        return None

    def admit(self, row: int, request: Request) -> None:
        """Start `request` in slot `row` between bursts, in one call: the row's cache takes its
        prompt but the last token, which becomes the row's next input at its position, and its
        stop (EOS, budget) is kept on the host. The other rows run on untouched. The request is
        checked as Server.submit checks it (rounds.serving.admitted: the copy a Server kept from
        its submit passes at once) and for its room (refusal: a row past its cache would run at
        clamped positions, its tokens wrong, silently); the stack takes the checked prompt as it
        is (LayerStack._prefill_trusted). RuntimeError, from anything but a server's own calls,
        while a server over the rows has a request in flight (Driven.take_row): the row may be
        one it holds."""
        self.driven.take_row("admit()")
        row, request = admitted(request, self.vocab, row, self.batch, self.longest_prompt)
        if (why := self.refusal(request)) is not None:
            raise ValueError(f"a request not admitted: {why}")
        prompt = request.prompt
        self._cut = False  # a row changes hands: the last burst's tokens are not its request's
        with torch.cuda.stream(self.stream):
            self.stack._prefill_trusted([row], [prompt[:-1]])
            self.token[row, 0] = int(prompt[-1])
            self.position[row, 0] = len(prompt) - 1
        self._stops[row] = _Stop(request.eos, request.max_new_tokens)

    def burst(self) -> Burst:
        """One burst of every row (the graph's replay, or its steps run eagerly) and its one
        readback: each row's tokens up to its stop (a vacant row's none); a row that reached its
        stop is done, and vacant from then on. RuntimeError, from anything but a server's own
        calls, while a server over the rows has a request in flight (Driven.take_row): the burst
        ran its requests' rows and read their tokens here, counting down their budgets, and the
        server never saw them (a request ended with a burst's tokens missing, or as finished
        short of its budget)."""
        self.driven.take_row("burst()")
        self._cut = False
        with torch.cuda.stream(self.stream):
            if self.graph is None:
                self._burst()
                self._cut = True  # till its tokens are read: recover() reads them where an interrupt cuts the wait
            else:
                # An interrupt as the replay returns came after its launch, one as torch's replay()
                # began before it; the host cannot tell which, so the device does: the first token
                # is NO_BURST until the replay's first step writes it (recover)
                self._first.fill_(NO_BURST)
                self._cut = True
                self.graph.replay()
        return self._read(self._tokens())

    def recover(self) -> Burst | None:
        """The last burst, where an interrupt cut its readback's wait short (it ran, and its tokens
        are in `out` until the next burst); None where they were read, where a row was admitted,
        parked or every row started since, or where the interrupt came before the burst was
        queued whole (an eager one is many launches; a graph's replay not launched leaves its
        first token NO_BURST). An interrupt as a replay returned, after its launch, was taken
        for one before it: its rows had gone on past tokens no step was given, a hole in each
        request's output, silently. RuntimeError, from anything but a server's
        own calls, while a server over the rows has a request in flight (Driven.take_row): the
        burst is that server's to recover, and read here its tokens were lost to it."""
        self.driven.take_row("recover()")
        if not self._cut:
            return None
        out = self._tokens()
        return None if out[0][0] == NO_BURST else self._read(out)

    def _tokens(self) -> list[list[int]]:
        """The last burst's tokens, [B][steps], read back (the wait for it)."""
        with torch.cuda.stream(self.stream):
            out = self.out[:, :self.batch].T.tolist()
        self._cut = False
        return out

    def _read(self, out: list[list[int]]) -> Burst:
        """The burst of tokens `out` ([B][steps]): each row's up to its stop."""
        tokens: list[list[int]] = []
        for row, stop in enumerate(self._stops):
            tokens.append([] if stop is None else stop.take(out[row]))
            if stop is not None and stop.left == 0:
                self._stops[row] = None
        return Burst(tokens, [stop is None for stop in self._stops])

    def park(self, rows: Sequence[int]) -> None:
        """The rows' requests dropped: their tokens are read no more. Every row is checked before
        any is parked (rounds.serving.as_rows): -1 parked the last row, whose request then ended
        as if it had stopped, its tokens cut short, and True row 1. RuntimeError, from anything
        but a server's own calls, while a server over the rows has a request in flight
        (Driven.take_row): its request would end so too (a cancel is server.cancel)."""
        self.driven.take_row("park()")
        for row in as_rows(rows, self.batch, "park()"):
            self._stops[row] = None
        self._cut = False  # rows changed hands: the last burst is not their requests' any more

    def generate_batch(self, requests: Sequence[Request]) -> list[list[int]]:
        """One request a row, started together, each until its budget or its EOS. A request that
        is malformed, names a token outside the vocabulary or does not fit its row's cache is
        refused (RequestRefused, naming its row) before anything runs; so is the batch
        (RuntimeError) while a server over the rows has a request in flight (Driven.take: step it
        until it is idle)."""
        requests = batch_admitted(requests, self.vocab, self.batch, self.refusal, self.longest_prompt)
        self.driven.take("generate_batch")
        self.capture()
        with torch.cuda.stream(self.stream):
            self._start(requests)
        self._stops = [_Stop(r.eos, r.max_new_tokens) if r.max_new_tokens else None for r in requests]
        out: list[list[int]] = [[] for _ in requests]
        while any(stop is not None for stop in self._stops):
            for row, tokens in enumerate(self.burst().tokens):
                out[row] += tokens
        return out

    def generate(self, prompt: Sequence[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
        """One request (a decoder of one row)."""
        return self.generate_batch([Request(prompt, max_new_tokens, eos)])[0]

    def server(self, *, clock: Callable[[], float] = time.perf_counter) -> Server:
        """A Server (memra_cuda.rounds.serving) over the batch's slots, every slot vacant. The
        burst's graph and every one-row prefill graph are captured first, as a speculative
        decoder's capture() does: a capture synchronises the device, which a server must not do
        mid-request. RuntimeError while another server over the rows has a request in flight
        (Driven.take: step it until it is idle), whose rows this one would park."""
        self.driven.take("a new server")
        self.capture()
        with torch.cuda.stream(self.stream):
            self.stack.capture_prefills()
        return Server(self, clock=clock)  # which tells self.driven

    def serve(self, requests: Sequence[Request]) -> list[Served]:
        """Continuous batching, as a speculative decoder's serve(): the requests, queued in
        order, through the batch's slots (server().serve). One Served a request, in order; a
        request that cannot run is refused alone, its Served's `refused` saying why. Where it
        raises (an interrupt), its server drives the rows no more (Driven.serve)."""
        return self.driven.serve(self.server, requests)  # made once the requests are checked


def hf_generate(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos: int | None = None,
                sampling: SamplingParams | None = None, assistant: Any = None, k: int = 4) -> list[list[int]]:
    """Hugging Face's own decoding of a batch (prompts left-padded; greedy, or `sampling` from
    torch's generator), assisted by `assistant` (a draft model), k tokens at a time, if given.
    Each row's tokens stop at its EOS. The prompts, the budget and EOS are checked before the
    model runs as a decoder's generate_batch checks its requests (rounds.serving.batch_admitted:
    RequestRefused naming the prompt's row), the reference held to the rules of what it checks:
    a token outside the vocabulary met the embedding's IndexError (a device assert on a GPU), a
    budget of 2.5 or True was taken (3 tokens, 1), an EOS outside the vocabulary stopped no row,
    and no prompts met max()'s; an `assistant` that is no model is a TypeError naming it. A
    budget of 0 gives each row no tokens, as a decoder's does (Hugging Face's generate refuses
    it)."""
    listed = as_listed(prompts, "hf_generate's prompts", "prompts, one a row")
    if not listed:
        raise ValueError("hf_generate takes at least one prompt")
    requests = batch_admitted([Request(prompt, max_new_tokens, eos) for prompt in listed], model.config.vocab_size,
                              len(listed))
    sampling, k = as_sampling(sampling), as_size(k, "k (the assistant's drafts a round)")
    if assistant is not None and not (hasattr(assistant, "generation_config")
                                      and hasattr(getattr(assistant, "config", None), "vocab_size")):
        # its generation_config is set below: a name or a path met "'str' object has no attribute 'generation_config'"
        shown = type(assistant).__name__ if isinstance(assistant, torch.nn.Module) else repr(assistant)
        raise TypeError(f"hf_generate's assistant is a transformers causal LM (a draft model) or None, not {shown}")
    max_new_tokens, eos, prompts = requests[0].max_new_tokens, requests[0].eos, [r.prompt for r in requests]
    if not max_new_tokens:
        return [[] for _ in prompts]
    width = max(len(prompt) for prompt in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    extra: dict[str, Any] = {}
    if assistant is not None:
        config = assistant.generation_config
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = k, "constant"
        config.assistant_confidence_threshold = 0.0
        extra["assistant_model"] = assistant
    if sampling is not None:
        extra.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    else:
        extra.update(do_sample=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=0,
                         eos_token_id=eos, pad_token_id=0, **extra)[:, width:].tolist()
    return [row[:row.index(eos) + 1] if eos in row else row for row in out]


def hf_greedy(model: Any, prompt: Sequence[int], max_new_tokens: int, eos: int | None = None,
              assistant: Any = None, k: int = 4) -> list[int]:
    """Hugging Face's greedy decoding of one prompt."""
    return hf_generate(model, [prompt], max_new_tokens, eos, assistant=assistant, k=k)[0]

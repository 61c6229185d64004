"""A server over a decoder's B slots: requests queued, admitted into free slots between bursts,
cancelled at a burst's boundary, refused alone, and each one's tokens kept with the host's
time of each.

Continuous batching is host logic, the same whatever runs the bursts: which request a freed slot
takes, when a cancel takes effect, what a refused request leaves behind (nothing). It is written
once, here, against Decoder, the few things a decoder does with its rows (memra_cuda.torch's
decoders in a mode, and GraphedGreedy, the plain loop, are Decoders), so that speculation and
the plain decoding it is measured against serve alike, and a CPU test drives it with a decoder
of plain Python. Nothing here touches the device.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import math
import reprlib
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar

from ..driver.errors import MemraError
from ..driver.values import I32_MOST, TEXT_LIKE, as_index, as_prompt, as_real, as_seed, as_size

_T = TypeVar("_T")


class Request(NamedTuple):
    """A request for a decoder's rows or a server's queue: a `prompt` of at least one token,
    `max_new_tokens` its budget (0: nothing to generate), `eos` stops it (None: its budget
    alone), `seed` keys its sampled draws, `max_draft` its most draft length a round (0:
    speculation off, the plain decoding; None or more than the decoder's k: k), applied on the
    device (docs/lengths.md). A Server keeps a copy of it whose prompt is a tuple of ints, the
    one it checked (Server.submit)."""

    prompt: Sequence[int]
    max_new_tokens: int
    eos: int | None = None
    seed: int = 0
    max_draft: int | None = None


class Served(NamedTuple):
    """What became of a request: its `tokens`, and the host clock's readings (seconds):
    `submitted`, `admitted` (it took a slot, or, of budget 0, reached the queue's head and ended
    there without one: its wait in the queue either way; None where it never got so far),
    `arrivals` (one a token: when the readback that brought it was received, so a burst's tokens
    share one) and `finished` (the readback that found it stopped, its cancel, or its refusal).
    `refused` says why it never ran (None where it ran); `cancelled`: it was cancelled, and
    `tokens` are those read back before. `accepted`: its drafts accepted, as its last readback
    brought them (None from a decoder without drafts, or where it never ran a burst)."""

    tokens: list[int]
    submitted: float
    admitted: float | None
    arrivals: list[float]
    finished: float
    refused: str | None = None
    cancelled: bool = False
    accepted: int | None = None

    @property
    def rounds(self) -> int | None:
        """The rounds it ran, each committing its accepted drafts and one token (None where
        `accepted` is)."""
        return None if self.accepted is None else len(self.tokens) - self.accepted

    @property
    def latency(self) -> float:
        """Seconds from its submission to its end."""
        return self.finished - self.submitted

    @property
    def first_token(self) -> float | None:
        """Seconds from its submission to its first token's readback (time to first token); None
        where it got no token."""
        return self.arrivals[0] - self.submitted if self.arrivals else None


class Burst(NamedTuple):
    """One burst's news of every row, read back once: `tokens[row]`, what the row committed in it,
    in order, up to its stop (none for a vacant or parked row); `done[row]`, whether the row has
    stopped (its EOS or its budget reached; a vacant or parked row is done); `accepted[row]`, the
    drafts its request has had accepted since it began, read back with the tokens (None: a
    decoder without drafts)."""

    tokens: Sequence[Sequence[int]]
    done: Sequence[bool]
    accepted: Sequence[int] | None = None


class Decoder(Protocol):
    """What a Server asks of a decoder: its rows, one request each, and their bursts. The server
    calls these between bursts only, and keeps which request holds which row."""

    @property
    def batch(self) -> int:
        """The rows (slots), B."""

    @property
    def vocab(self) -> int:
        """The tokens of its vocabulary: every token a request names is below it."""

    def refusal(self, request: Request) -> str | None:
        """Why a well-formed `request` cannot run in a row (its prompt and budget past the
        caches' room), as a clause that follows "request N refused: "; None where it can."""

    def admit(self, row: int, request: Request) -> None:
        """Start `request` in the vacant `row`, in one call: its prompt in and its stop rule set,
        so the next burst runs it; the other rows untouched. `request` is the server's checked
        copy (its prompt a tuple of ints in the vocabulary); a ValueError or TypeError refuses
        it alone (Server._refuse), anything else raised is the decoder's failure."""

    def burst(self) -> Burst:
        """Run one burst of every row, and read it back once."""

    # A decoder may also have recover() -> Burst | None: the last burst, where an interrupt cut its
    # readback's wait short (it ran: its tokens are the decoder's alone), read back now; None where
    # it was read or a row changed hands since. A Server whose burst() raised asks for it at its next
    # step, before any row changes hands; without it, that burst's tokens are lost (not in DECODES:
    # optional).
    #
    # And longest_prompt: int, the most tokens a prompt can have in a row (its cache's slots and the
    # pending token; refusal() refuses any longer): a Server refuses a longer prompt by its len(),
    # before its tokens are read (as_prompt's most), where range(3 * 10**7) was read whole, seconds
    # and hundreds of MB, for refusal() to refuse. Without it, every prompt is read first (optional).

    def park(self, rows: Sequence[int]) -> None:
        """Stop `rows` (vacant ones, or cancelled requests'): they sit the bursts out, done,
        until a request is admitted into them."""


DECODES = ("batch", "vocab", "refusal", "admit", "burst", "park")  # what a Server asks of a Decoder


class RequestRefused(MemraError, ValueError):
    """A request refused before it took a slot: malformed, naming a token outside the
    vocabulary, or needing more room than the caches hold. `ident` names it (a server's id, or
    its place in a batch), `reason` says why (an empty reason, a decoder's refusal() returning "",
    says none was given); nothing else changed, and the other requests go on."""

    def __init__(self, ident: int, reason: str):
        self.ident, self.reason = ident, reason or "no reason given"
        super().__init__(f"request {ident} refused: {self.reason}")


def as_request(request: object) -> Request:
    """`request` if it is a Request, else TypeError saying what one is (a plain tuple of its
    fields has no names to check them by)."""
    if not isinstance(request, Request):
        raise TypeError("a request is a memra_cuda.rounds.Request(prompt, max_new_tokens, eos=None, seed=0, "
                        f"max_draft=None), not {reprlib.repr(request)}")
    return request


def as_requests(requests: Iterable[Request], what: str, most: int | None = None) -> list[Request]:
    """`requests` as a list (a generator's too; no more than `most` and one read, None: no bound),
    unless it is one Request or nothing to iterate over: TypeError saying that `what` takes a
    sequence of them. A Request is a tuple of its five fields, each then read as a request:
    serve() refused the prompt as no Request, and a batch of two counted five requests; None or a
    number met "object of type 'int' has no len()", and a string's characters were read as
    requests (text and bytes alike: a bytearray, a memoryview or a UserString was read as its
    ints or characters, each refused as no Request)."""
    if isinstance(requests, Request):
        raise TypeError(f"{what} takes a sequence of requests, not one Request: give [request]")
    if not isinstance(requests, Iterable) or isinstance(requests, (*TEXT_LIKE, Set, Mapping)):
        # a set's order is its hashes': results in order were in no order the caller could read
        raise TypeError(f"{what} takes a sequence of requests (a list), not {reprlib.repr(requests)}")
    return list(requests if most is None else itertools.islice(requests, most + 1))


def _serve_requests(requests: Iterable[Request]) -> list[Request]:
    """serve()'s `requests` as a list, each a Request, else TypeError (as_requests, as_request):
    Server.serve checks them before it submits any, Driven.serve before it makes a server."""
    return [as_request(request) for request in as_requests(requests, "serve()")]


def malformed(request: Request, vocab: int) -> str | None:
    """Why `request` is none a decoder over `vocab` tokens can run, whatever its room: a prompt
    that is not one or more token ids, a budget, EOS, seed (0 to 2**64 - 1) or most draft length that
    is not one, a token outside the vocabulary (whose embedding lookup would fault the device).
    None where it is well formed; TypeError for what is not a Request at all."""
    checked = _checked(request, vocab)
    return checked if isinstance(checked, str) else None


def batch_admitted(requests: Sequence[Request], vocab: int, batch: int,
                   refusal: Callable[[Request], str | None] | None = None,
                   longest: int | None = None) -> list[Request]:
    """What a decoder's generate_batch starts, one request a row of its `batch`: the copies
    Server.submit would keep (admitted's), or RequestRefused naming the first malformed one's row
    (a prompt past the decoder's `longest` among them, refused by its length before it is read),
    or the first whose checked copy `refusal` refuses (a decoder's room: past it a burst's capacity
    check raised mid-generation, every row's tokens lost), as Server.submit does: anything but
    None, "" too, is a refusal; ValueError where they are not one a row. The copies, not the
    caller's requests, run: a budget given as a 0-d array was counted down in place, so the same
    request given again generated nothing. No more than `batch` and one are read: a generate_batch
    of itertools.repeat(request) was listed for ever."""
    requests = as_requests(requests, "a batch", batch)
    if len(requests) != batch:
        given = len(requests) if len(requests) < batch else f"more than {batch}"
        raise ValueError(f"need one request per row ({batch}), not {given}")
    kept: list[Request] = []
    for row, request in enumerate(requests):
        checked = _checked(request, vocab, longest)
        if isinstance(checked, str):
            raise RequestRefused(row, checked)
        if refusal is not None and (reason := refusal(checked)) is not None:  # "" refuses too, as in Server
            raise RequestRefused(row, reason)
        kept.append(checked)
    return kept


def admitted(request: Request, vocab: int, row: int, batch: int,
             longest: int | None = None) -> tuple[int, Request]:
    """What a decoder's admit() starts, and where: `row` as a plain int of its `batch`, and the
    copy of `request` that Server.submit keeps (its prompt a tuple of ints in the `vocab`, of at
    most `longest` tokens, refused by its length before it is read; its numbers plain ints), or
    ValueError or TypeError naming what is wrong. admit() is public: an engine may call it without
    a Server, and a token outside the vocabulary would fault the device in the embedding lookup, a
    bool row be read as row 1."""
    row = as_row(row, batch)
    checked = _checked(request, vocab, longest)
    if isinstance(checked, str):
        raise ValueError(f"a request not admitted: {checked}")
    return row, checked


def as_row(row: object, batch: int) -> int:
    """`row` as one of a decoder's `batch` rows, else TypeError (a bool is no row: True was read as
    row 1) or ValueError naming it (a negative row indexed from the end: -1 was row B - 1)."""
    row = as_index(row, "a row")
    if not 0 <= row < batch:
        raise ValueError(f"row {row} is not one of the decoder's {batch}")
    return row


def as_rows(rows: object, batch: int, what: str) -> list[int]:
    """`rows` (a list, a range, a set; a row given twice is the caller's to fold) as rows of a
    decoder's `batch`, each checked (as_row) before any is used, else TypeError or ValueError
    naming it. Text and bytes are no rows: a park() of b"\\x00\\x01" stopped rows 0 and 1. At
    most `batch` are read, a row given twice counted twice, and one more is a ValueError naming
    `what`: itertools.repeat(0) was read for ever (each 0 a row), never refused. A 0-d array (one
    row given bare, numpy's or a tensor) is no rows either: its iteration's "iteration over a 0-d
    array" named nothing."""
    if isinstance(rows, TEXT_LIKE) or not isinstance(rows, Iterable) or getattr(rows, "ndim", None) == 0:
        raise TypeError(f"{what} takes rows, ints of the decoder's {batch}, not {reprlib.repr(rows)}")
    checked = [as_row(row, batch) for row in itertools.islice(rows, batch + 1)]
    if len(checked) > batch:
        raise ValueError(f"{what} names more rows than the decoder's {batch}")
    return checked


class _Kept(Request):
    """A checked copy of a request (the copy a Server keeps from its submit), which _checked
    makes: its prompt a tuple of ints, its numbers plain ints, each immutable. Every way a
    NamedTuple makes another from it (its type called, as type(kept)(*fields) and a pytree's
    map rebuild one; _make, which _replace and copy.replace call; a copy, a pickle's round trip)
    makes a plain Request, to be checked anew: a type called made one of negative tokens and
    budget that _checked then trusted, a device fault at the row's embedding lookup. Only
    _checked builds one (Request.__new__ given this type), as only a private name reaches the
    stacks' unchecked prefill. It reads as the Request it is a copy of."""

    __slots__ = ()

    def __new__(cls, *fields: Any, **named: Any) -> Request:  # type: ignore[misc]  # a plain one: unchecked
        return Request(*fields, **named)

    @classmethod
    def _make(cls, iterable: Iterable[Any]) -> Request:  # type: ignore[override]  # a plain one: unchecked
        return Request._make(iterable)  # _replace and copy.replace make theirs here too

    def __reduce__(self) -> tuple[type[Request], tuple[Any, ...]]:
        return Request, tuple(self)

    def __repr__(self) -> str:
        return repr(Request(*self))


def _checked(request: Request, vocab: int, longest: int | None = None) -> Request | str:
    """`request` with its prompt a tuple of ints taken from the very copy that was checked, and
    its budget, EOS, seed and most draft length the plain ints checked, or why it is malformed
    (malformed's reasons), or why its prompt, of more than `longest` tokens (a decoder's
    longest_prompt; None: no bound), fits no row, said by its length before it is read. The
    copy is what a server keeps: a caller who changes the list, or the 0-d array of a budget (an
    index as any int is), it gave after submit() cannot slip an unchecked token or a budget past
    the room refusal() measured into a row. A copy made here comes back as it is where its tokens
    lie in `vocab` and it is no longer than `longest` (a type check, one max() and a len(), where
    the whole check cost ~40 us a 300-token prompt): the request a Server kept from its submit is
    admitted by its decoder's admit() without being checked again."""
    if (type(request) is _Kept and max(request.prompt, default=vocab) < vocab and (request.eos or 0) < vocab
            and (longest is None or len(request.prompt) <= longest)):
        return request
    request = as_request(request)
    try:
        prompt = as_prompt(request.prompt, vocab, "its prompt", longest)  # a copy, never the caller's list itself
        # a row's budget is an i32 on the device (StreamBufs' ROW_VALUE_MOST): past it, a decoder's
        # generate_batch and admit() prefilled the rows before the budget was refused
        budget = as_size(request.max_new_tokens, "max_new_tokens", 0, I32_MOST)
        seed = as_seed(request.seed, "its seed")  # 0 to 2**64 - 1: a Philox key (values.as_seed)
        eos = None if request.eos is None else as_size(request.eos, "eos", 0, also="None")
        most = None if request.max_draft is None else as_size(request.max_draft, "max_draft", 0, also="None")
    except (TypeError, ValueError) as exc:
        return str(exc)
    if eos is not None and eos >= vocab:
        return f"its EOS {eos} is outside the vocabulary of {vocab} tokens"
    return Request.__new__(_Kept, tuple(prompt.tolist()), budget, eos, seed, most)


@dataclass
class _Running:
    """A request from its submission to its end: what the server knows of it."""

    request: Request
    submitted: float
    admitted: float | None = None
    row: int | None = None
    tokens: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    accepted: int | None = None

    def ended(self, at: float, cancelled: bool = False, refused: str | None = None) -> Served:
        return Served(self.tokens, self.submitted, self.admitted, self.arrivals, at, refused=refused,
                      cancelled=cancelled, accepted=self.accepted)


class Progress(NamedTuple):
    """What one Server.step did: `tokens`, the new tokens of each request its burst ran, by id,
    read back at `at` (None where no burst ran); `finished`, the requests that ended in it
    (stopped, cancelled, refused at their admission), by id."""

    at: float | None
    tokens: dict[int, list[int]]
    finished: dict[int, Served]


class Server:
    """Continuous batching over a `decoder`'s rows, driven one burst at a time by the engine's
    loop: submit() queues a request (or refuses it at once), step() admits queued requests into
    free rows and runs one burst, cancel() ends a request at the next step's start. Every row
    is parked when the server is made: it starts with all of them free.

    Requests are admitted in the order submitted, into the lowest free rows. A row freed by a
    request that stopped in a burst takes the next request at the next step (a burst runs to
    its end: a slot freed mid-burst waits for it). A request of budget 0 ends when it reaches
    the queue's head, without a slot. Ids count from 0 in submission order, a refused request's
    too. `clock` (seconds) stamps the times Served records: a test gives its own.

    The decoder's batch and vocabulary (at least one row, one token), and its longest_prompt
    where it has one, are checked here, naming them: a decoder of no rows would leave serve()
    waiting for ever. A decoder that keeps its servers (a `driven`, as GraphedGreedy has) is
    told of this one, made directly as its own server() makes it: RuntimeError while another
    of them has requests in flight, whose rows this one would park, and this one's requests are
    guarded from the decoder's batches (a server made directly drove rows the decoder's
    generate_batch then prefilled over).
    """

    def __init__(self, decoder: Decoder, *, clock: Callable[[], float] = time.perf_counter):
        missing = [name for name in DECODES if not hasattr(decoder, name)]
        if missing:
            own = "; it makes its own: decoder.server()" if callable(getattr(decoder, "server", None)) else ""
            raise TypeError(f"a decoder has {', '.join(DECODES)} (memra_cuda.rounds.serving.Decoder): "
                            f"type {type(decoder).__name__} has no {', '.join(missing)}{own}")
        batch = as_size(decoder.batch, "a decoder's batch")
        as_size(decoder.vocab, "a decoder's vocab")
        longest = getattr(decoder, "longest_prompt", None)  # optional: a prompt past it is refused unread
        self._longest = None if longest is None else as_size(longest, "a decoder's longest_prompt")
        if not callable(clock):  # else the first submit met "'NoneType' object is not callable", its id taken
            raise TypeError(f"a server's clock is a function giving seconds (time.perf_counter), not {clock!r}")
        driven = getattr(decoder, "driven", None)  # a decoder's own servers (GraphedGreedy's server() makes them)
        self._driven = driven if isinstance(driven, Driven) else None
        if self._driven is not None:
            self._driven.take("a new server")
        self.decoder, self.clock = decoder, clock
        self._slots: list[int | None] = [None] * batch  # the id of the request in each row
        self._queue: collections.deque[int] = collections.deque()  # ids waiting for a row, in order
        self._live: dict[int, _Running] = {}  # every request submitted that has not ended, by id
        self._cancels: set[int] = set()  # ids to end at the next step's start
        self._next = 0
        # ended at a step that raised, or another's inside serve(): the next step hands them out
        self._unreported: dict[int, Served] = {}
        # the thread the server calls its decoder's rows on (_into), None otherwise: that call alone is the
        # server's (Driven.take_row), not its clock's, nor a callback's, on the same thread mid-step
        self._calling: int | None = None
        # a step runs: step() and serve() inside one are refused; set under _step_held, held for that alone
        # (step), and read by serve() without it
        self._stepping = False
        self._step_held = threading.Lock()
        # the burst this server ran and has not recorded, with the rows it ran: None as the decoder
        # runs it (burst() raised: the next step asks the decoder to recover it), or read back but
        # not stamped (the clock raised: the next step records it)
        self._unrecorded: tuple[list[tuple[int, int]], Burst | None] | None = None
        decoder.park(range(batch))
        if self._driven is not None:
            self._driven.by(self)

    def _now(self) -> float:
        """The clock's reading, a finite number of seconds (as_real's TypeError for what is no real
        number, a ValueError naming it for an infinity or a NaN), raised as a clock's own failure is
        (nothing taken at a submit, a burst kept for the next step): a clock giving None or text was
        taken, its readings stamped on every Served, whose latency then met a TypeError naming
        nothing, and one giving NaN made every time NaN, silently."""
        reading = self.clock()
        if type(reading) is float and reading - reading == 0.0:  # a finite float, at once: twice a step
            return reading
        reading = as_real(reading, "a server's clock reading")
        if not math.isfinite(reading):
            raise ValueError(f"a server's clock reading must be a finite number of seconds, not {reading}")
        return reading

    @property
    def idle(self) -> bool:
        """No request waits, runs or waits for its cancel to take effect (or for the step that
        hands out its end, after one that raised)."""
        return not self._live and not self._unreported

    @property
    def in_flight(self) -> bool:
        """A request waits, runs or waits for its cancel to take effect: the server holds its
        decoder's rows (Driven), where one holding only ends for its next step to hand out
        (`unreported`) holds none."""
        return bool(self._live)

    @property
    def unreported(self) -> list[int]:
        """The ids, in order, of requests that have ended and whose ends the next step() hands out
        (ended in a step that raised, or another's ended inside serve())."""
        return sorted(self._unreported)

    def calling(self, thread: int) -> bool:
        """Whether the server is calling its decoder's rows (admit, park, burst, recover: _into)
        on `thread` (threading.get_ident()) now: that call is its own (Driven.take_row)."""
        return self._calling == thread

    def submit(self, request: Request) -> int:
        """Queue `request` and give its id; RequestRefused naming the id and why, where it is
        malformed, names a token outside the vocabulary or cannot fit a row (nothing else
        changes: no slot, no queue, no device work); TypeError, taking no id, for what is not a
        Request. Anything else its clock or the decoder's refusal() raises (an interrupt there),
        or an interrupt as the request is queued, takes no id and queues nothing. The server
        keeps a copy, its prompt the tuple of ints that was checked: the caller's list, changed
        later, is never what a row is given."""
        request = as_request(request)
        return self._submit(request, self._now())

    def _submit(self, request: Request, submitted: float) -> int:
        """submit() of a Request stamped `submitted` (the clock read before: where it raises,
        nothing is taken). Its id is taken after the decoder's refusal(), so a submit that raised
        anything but a refusal took none, and the next submit gets it: the id was taken first,
        and the next request's skipped it. A refusal takes the id and names it, a decoder's own
        RequestRefused too (naming its row, it named another request, a live one perhaps)."""
        checked = _checked(request, self.decoder.vocab, self._longest)
        try:
            if isinstance(checked, str):
                raise RequestRefused(self._next, checked)
            if (reason := self.decoder.refusal(checked)) is not None:
                raise RequestRefused(self._next, reason)
        except RequestRefused as refused:  # the server's, or the decoder's own: the request's refusal
            ident, self._next = self._next, self._next + 1
            if refused.ident != ident:
                raise RequestRefused(ident, refused.reason) from refused
            raise
        if self._driven is not None and not self._live:  # asked after refusal(), which may call back
            # two servers made while both were idle each held every row free: the second's requests
            # were admitted into the first's rows, one request ending with another's tokens
            self._driven.take("a request submitted to another server over its rows", beside=self)
        ident = self._next
        # live before it is queued: another thread's step between the two finds it live, not yet queued, and
        # the next admits it (queued first, that step dropped its id as an interrupted submit's, and the
        # request, live, never ran nor ended: the server never idle again); an interrupt as it is recorded or
        # queued takes it back, so no request is left live but never queued, and its id with it (the next
        # submit's skipped it: ids not consecutive, the counter ahead of the queue), unless another submit
        # (another thread's) has taken one since
        try:
            self._next = ident + 1
            self._live[ident] = _Running(checked, submitted)
            self._queue.append(ident)
        except BaseException:
            self._live.pop(ident, None)
            if self._next == ident + 1:
                self._next = ident
            raise
        return ident

    def cancel(self, ident: int) -> bool:
        """Cancel request `ident` at the next step's start (a burst's boundary): a queued one
        leaves the queue, a running one's row is parked and given to the next request. It ends
        then, cancelled, with the tokens read back so far (step's `finished`). False where it
        has ended already (its result stands); ValueError for an id this server never gave,
        TypeError for what is not an int (True is no id, though it was read as 1)."""
        ident = as_index(ident, "a request's id")
        if not 0 <= ident < self._next:
            raise ValueError(f"no request {ident} was submitted to this server ({self._next} so far)")
        if ident not in self._live or ident in self._unreported:  # the latter ended at a step that raised
            return False  # as it forgot the request: the next step hands its end out (True said it would be cancelled)
        self._cancels.add(ident)
        return True

    def step(self) -> Progress:
        """One boundary and one burst: cancels take effect, queued requests take the free rows,
        then one burst of every row runs and is read back; a request found stopped gives its row
        back. Where no row is busy, no burst runs; nor where the last step's clock raised as it
        read its burst back: this step records that burst instead (_record). RuntimeError, before
        anything is done, for a step inside a step (the decoder or the clock calling back, another
        thread): the inner one took the rows' next burst and ended its requests, so the outer read
        a request that had ended (KeyError) and lost its burst's tokens, the request ending with
        fewer, silently. The flag is read and set under a lock: read and then set, it let a second
        thread through between the two, and both steps ran the rows. It is set inside the try that
        clears it: the lock, held for the whole step and taken before its try, was kept for good
        where an interrupt came as it was taken (a signal is handled as a call returns), every
        later step refused as if one still ran, the server never usable again."""
        stepping = False
        try:
            with self._step_held:  # held for the check and the set alone
                if self._stepping:
                    raise RuntimeError("step() was called while a step of this server runs (from its decoder or its "
                                       "clock, or another thread): step one at a time, from one loop")
                stepping = self._stepping = True  # the local first: its finally clears what it set
            return self._step()
        finally:
            if stepping:
                self._stepping = False

    def _step(self) -> Progress:
        finished, self._unreported = self._unreported, {}
        try:
            for ident in finished.keys() & self._live.keys():  # ended where the step raised as it forgot them (_end)
                self._forget(ident)
            if self._unrecorded is not None and (unrecorded := self._recovered(*self._unrecorded)) is not None:
                return self._record(*unrecorded, finished)
            now = self._now()  # in here: where it raised, the ends the last step left to this one were dropped
            self._cancel(now, finished)
            self._admit(now, finished)
            busy = [(row, ident) for row, ident in enumerate(self._slots) if ident is not None]
            if not busy:
                return Progress(None, {}, finished)
            self._unrecorded = busy, None  # as the decoder runs it: kept where burst() raises
            burst = self._into(self.decoder.burst)
            self._unrecorded = busy, burst
            return self._record(busy, burst, finished)
        except BaseException:
            self._unreported = finished  # requests that ended here (cancelled, budget 0) are not lost
            raise

    def _recovered(self, busy: list[tuple[int, int]],
                   burst: Burst | None) -> tuple[list[tuple[int, int]], Burst] | None:
        """The burst this server has not recorded, run over the `busy` rows: read back already,
        or (None) the one whose burst() raised, where the decoder recovers it (an interrupt cut
        its readback's wait short: it ran, and a burst run now would overwrite its tokens, each
        request that stopped in it then ending with fewer, silently). None where the decoder
        has none to give (burst() raised before anything ran, or it has no recover): that step is
        over, and this one goes on, its cancels first."""
        if burst is None:
            recover = getattr(self.decoder, "recover", None)
            try:
                burst = None if recover is None else self._into(recover)
            except Exception:  # the decoder's failure, which asking again would repeat: only an interrupt keeps it
                self._unrecorded = None
                raise
            if burst is None:
                self._unrecorded = None
                return None
            self._unrecorded = busy, burst
        return busy, burst

    def _record(self, busy: list[tuple[int, int]], burst: Burst, finished: dict[int, Served]) -> Progress:
        """The `busy` rows' news from `burst`, stamped with the clock's reading: each request's
        tokens, and its end where its row is done. Where the clock raises, the burst is kept
        (_unrecorded) and the next step records it, with its own reading and no burst of its own:
        the decoder's rows had gone on, so the burst's tokens were lost, and a request that
        stopped in it ended at a later burst with fewer tokens, silently. Its news is read
        whole before any request changes, so a burst that cannot be read changes none, and every
        request has its tokens before any ends: an exception as one ends (_end) leaves the others
        running with them, to end at the next burst (their rows done), where they lost the burst's.
        A burst of fewer rows than the batch (a decoder's own Burst) is a ValueError naming both: it
        met an IndexError as its news was read; what is no Burst (None, a bare tuple) a TypeError
        saying what burst() returns. A burst whose news cannot be read (those, or a row's tokens
        None) raises before the clock is read or any request changes, and is dropped, as recording
        it again would raise again, every later step with it; and its rows' requests
        are cancelled (they end at the next step with the tokens read before it), as their rows
        went on past tokens no step can give them: run on, each would have a hole in its output,
        silently."""
        try:
            if not isinstance(burst, Burst):  # None or a bare (tokens, done) met "has no attribute 'tokens'"
                raise TypeError(f"a decoder's burst() returns a memra_cuda.rounds.Burst(tokens, done, accepted), not "
                                f"{reprlib.repr(burst)}")
            rows = len(self._slots)  # a len() or three a burst: nothing beside the burst's own readback
            given = (len(burst.tokens), len(burst.done), rows if burst.accepted is None else len(burst.accepted))
            if min(given) < rows:
                shown = "" if burst.accepted is None else f", accepted of {given[2]}"
                raise ValueError(f"the decoder's burst has news of fewer rows than its batch of {rows} (tokens of "
                                 f"{given[0]}, done of {given[1]}{shown}): a Burst gives every row's, a vacant "
                                 "row's too")
            news = [(ident, list(burst.tokens[row]), None if burst.accepted is None else int(burst.accepted[row]),
                     bool(burst.done[row])) for row, ident in busy]
        except Exception:  # unreadable news (a short burst, a row's tokens None): dropped, its requests ended
            self._unrecorded = None
            self._cancels.update(ident for _, ident in busy)
            raise
        at = self._now()
        self._unrecorded = None
        tokens: dict[int, list[int]] = {}
        for ident, new, accepted, _ in news:
            running = self._live[ident]
            running.tokens += new
            running.arrivals += [at] * len(new)
            if accepted is not None:
                running.accepted = accepted
            tokens[ident] = new
        for ident, _, _, done in news:
            if done:
                self._end(ident, at, finished)
        return Progress(at, tokens, finished)

    def serve(self, requests: Sequence[Request]) -> list[Served]:
        """Every request submitted now, then steps until each of them has ended: one Served a
        request, in order; a refused one's `refused` says why, and the others run on. What is
        not a Request is a TypeError before any request is submitted. A request submitted
        meanwhile by someone else (the decoder calling back, another thread) is not serve()'s:
        it runs in the same bursts, and its end, where one of them reaches it, is handed out by
        the next step(), as its submitter steps for it (serve() read it as one of its own: a
        KeyError, and every result of the call lost). Where a step raises (an interrupt, a device
        fault), serve() raises it, and its requests that had ended are handed out by the next
        step(), as those still in flight are by the steps that end them: they were lost, the
        server's steps reporting the others alone. Each request is stamped before it is submitted,
        so a refusal is recorded as it is made; where the clock raises, serve() raises with that
        request and those after it never submitted (a refusal stamped after it was made was lost
        with the clock's failure, its id taken)."""
        if self._stepping:  # its step would be refused after its submissions, their refusals lost
            raise RuntimeError("serve() was called while a step of this server runs (its clock or its decoder "
                               "calling back): serve() steps the server itself")
        if not self.idle:
            # the ends left for the next step to hand out count too: "0 request(s)" said nothing was in it
            raise ValueError(f"serve() takes an idle server to idle; {len(self._live)} request(s) are in this one, "
                             f"{len(self._unreported)} ended for the next step to hand out: step() until it is idle")
        requests = _serve_requests(requests)
        out: dict[int, Served] = {}
        place: dict[int, int] = {}  # a request's id -> its place in `requests`, a refused one's too
        others: dict[int, Served] = {}
        ended: dict[int, Served] = {}  # the last step's ends, kept whole: an interrupt as serve() sorts them loses none
        try:
            for i, request in enumerate(requests):
                at = self._now()  # before its submission: a refusal is stamped as it is made
                try:
                    place[self._submit(request, at)] = i
                except RequestRefused as refusal:
                    place[refusal.ident] = i  # so that a serve() that raises hands it out too
                    out[i] = Served([], at, None, [], at, refused=str(refusal))
            while len(out) < len(requests):
                if self.idle:  # a step not serve()'s (its clock or the decoder's refusal calling step()) took them
                    missing = sorted(ident for ident, i in place.items() if i not in out)
                    raise RuntimeError(f"serve()'s request(s) {missing} ended in a step not serve()'s (its clock or "
                                       "its decoder calling step()), which handed out their results")
                ended = self.step().finished
                for ident, served in ended.items():
                    if ident in place:
                        out[place[ident]] = served
                    else:
                        others[ident] = served
            return [out[i] for i in range(len(requests))]  # in here: an interrupt as it is built hands them out
        except BaseException:
            others.update(ended)  # those it had not sorted yet (each sorted one is the same Served, by the same id)
            others.update((ident, out[i]) for ident, i in place.items() if i in out)
            raise
        finally:
            self._unreported.update(others)

    def _cancel(self, now: float, finished: dict[int, Served]) -> None:
        """The cancels asked for since the last step: queued requests leave the queue, running
        ones' rows are parked (one call) and freed. Each leaves the set as its request ends
        (_end), so a cancel asked meanwhile (the park calling back, another thread) stays for
        the next step: clearing the set dropped it, its request then running to its end though
        cancel() had said True."""
        # a cancel of a request that has ended since it was asked is dropped: another thread's cancel() between its
        # check and its add, or between _forget's discard and its del, left an id no step could end (KeyError at
        # every later step)
        if not self._cancels:  # the common step: no walk of every live request
            return
        self._cancels.intersection_update(self._live)
        cancels = sorted(self._cancels)
        rows = [row for ident in cancels if (row := self._live[ident].row) is not None]
        if rows:
            self._into(self.decoder.park, rows)
        for ident in cancels:
            queued = self._live[ident].row is None
            self._end(ident, now, finished, cancelled=True)
            if queued:  # after its end: an interrupt between the two leaves an id _admit drops, where one
                self._queue.remove(ident)  # out of the queue but not ended made every later step raise

    def _admit(self, now: float, finished: dict[int, Served]) -> None:
        """Queued requests into the free rows, in order; one of budget 0 ends at the head of the
        queue without a row. A request the decoder's admit refuses (ValueError or TypeError: a
        value of its own the decoder cannot take) ends refused there, alone (_refuse), and the
        next takes the row; anything else the admission raises (a device fault, an interrupt) is
        the decoder's, not the request's, and leaves it at the head of the queue for the next
        step, the row parked where the decoder can park it (the admission may have started it), as
        does a decoder that cannot park the row after a refusal (its buffers held by a device loop)."""
        if not self._queue:
            return
        free = collections.deque(row for row, ident in enumerate(self._slots) if ident is None)
        while self._queue:
            ident = self._queue[0]
            running = self._live.get(ident)
            if running is None or running.row is not None:
                pass  # a cancel or a refusal an interrupt cut short after its end, an admission after its row
            elif running.request.max_new_tokens == 0:
                running.admitted = now
                self._end(ident, now, finished)
            elif free:
                row = free.popleft()
                try:
                    # the row is the request's before the decoder's admit: an interrupt after admit
                    # returned, before the request left the queue, finds it so, and the next step
                    # takes it off the queue (above), where it admitted it again, into a second row
                    running.admitted, running.row, self._slots[row] = now, row, ident
                    self._into(self.decoder.admit, row, running.request)
                except BaseException as exc:
                    running.admitted, running.row, self._slots[row] = None, None, None
                    free.appendleft(row)
                    if isinstance(exc, (ValueError, TypeError)):
                        self._refuse(ident, row, now, exc, finished)
                        continue
                    # the decoder's failure, or an interrupt: whatever the admission started in the row
                    # sits the bursts out (it ran on, a request the server had not given it, and
                    # the next admission into the row met a live one)
                    with contextlib.suppress(Exception):
                        self._into(self.decoder.park, [row])
                    raise
            else:
                return
            self._queue.popleft()  # only now: a request whose admission raised is still at the head

    def _refuse(self, ident: int, row: int, now: float, exc: Exception, finished: dict[int, Served]) -> None:
        """Request `ident`, at the queue's head, whose admission into `row` raised `exc`, ended
        refused (issue 48: a request that cannot be served is refused alone, naming it, and the
        others go on); without this, it stayed at the head and every later step raised. The row
        is parked first, so whatever the failed admission left in it sits the bursts out; where
        the decoder cannot park it, the failure is the decoder's (BuffersHeld, say): raised, the
        request still at the head. Its end is in `finished` before it leaves the queue, as in
        _cancel: a request out of the queue but not ended never ended."""
        self._into(self.decoder.park, [row])
        self._end(ident, now, finished, refused=str(RequestRefused(ident, f"its admission raised "
                                                                           f"{type(exc).__name__}: {exc}")))
        self._queue.popleft()

    def _into(self, call: Callable[..., _T], *args: Any) -> _T:
        """`call(*args)`, a call of this server's into its decoder's rows (admit, park, burst,
        recover): the one Driven.take_row lets through. The step's thread was exempt throughout
        the step, so its clock (or a callback) calling decoder.burst() by hand mid-step got
        through, a burst whose tokens the server never saw."""
        self._calling = threading.get_ident()
        try:
            return call(*args)
        finally:
            self._calling = None

    def _end(self, ident: int, at: float, finished: dict[int, Served], cancelled: bool = False,
             refused: str | None = None) -> None:
        """Request `ident` ended at `at`: its Served in `finished`, then the server forgets it
        (_forget). An exception before its Served is in `finished` (in ended(), say) leaves it
        running; one after, ended, its end handed out by the next step, which forgets it first
        (_step). It was half ended: forgotten with its row held or its cancel asked (KeyError at
        every later step), or forgotten with its end never handed out."""
        finished[ident] = self._live[ident].ended(at, cancelled, refused)
        self._forget(ident)

    def _forget(self, ident: int) -> None:
        """Request `ident`, ended, forgotten: a cancel asked for it (one asked during the step that
        ended it: from another thread, or the clock or the decoder called back, met a KeyError at
        every later step), its row (if it held one), and itself last, so that, cut short, it is
        still live and the next step forgets it again."""
        running = self._live[ident]
        self._cancels.discard(ident)
        if running.row is not None:
            self._slots[running.row] = None
        del self._live[ident]


class Driven:
    """The Servers made over a decoder's rows (held weakly: a server dropped drives nothing), so
    that nothing else takes the rows from one with requests in flight: a new server parks every
    row and a batch prefills every row, either of which ended that server's requests, each then
    reported as finished, its tokens cut short; an admission, a park or a burst by hand (take_row)
    takes one. Every server made is kept, not the last alone: a second server made while the
    first was idle left the first's later requests unguarded."""

    def __init__(self) -> None:
        self._servers: weakref.WeakSet[Server] = weakref.WeakSet()

    def take(self, what: str, beside: Server | None = None) -> None:
        """RuntimeError naming `what` where a server over the rows (but `beside`) is not idle: a
        request queued, running or waiting for its cancel, or an end its next step hands out
        (named so: "has requests in flight" was said of a server that had none). take_row counts
        the requests in flight alone."""
        for server in list(self._servers):
            if server is not beside and not server.idle:
                if server.in_flight:
                    raise RuntimeError(self._taken(what))
                raise RuntimeError(f"{what} would take the rows of this decoder's server, which holds the end of "
                                   f"request(s) {server.unreported} for its next step() to hand out: "
                                   "step it until it is idle")

    def take_row(self, what: str) -> None:
        """take(what) of a call a server's own step makes into the rows too (a decoder's admit(),
        park(), burst() and recover()): a server's own call (Server._into, on the thread that makes
        it: its _calling, that thread's id, set already: one get_ident is added to a call) is not
        refused. Called by the engine while a server had requests in flight, admit()
        overwrote a row the server held for one of them, park() stopped one, and burst() ran them,
        reading tokens the server never saw: that request ended with another's tokens, or cut
        short, silently. Another thread's call as the server steps on its own is refused too: a
        step exempted every caller, so an engine's thread took the rows mid-step. What counts is
        a request in flight (queued, running, or waiting for its cancel), which holds the rows:
        a server holding only ends for its next step to hand out holds none (a serve() cut short
        as another server took the rows), where it refused the other's own step, every admission
        and burst of it, until it stepped."""
        me = threading.get_ident()
        if any(server.in_flight and not server.calling(me) for server in list(self._servers)):
            raise RuntimeError(self._taken(what))

    @staticmethod
    def _taken(what: str) -> str:
        return (f"{what} would take the rows of this decoder's server, which has requests in flight: "
                "step it until it is idle (a cancel ends its request at the next step)")

    def by(self, server: Server) -> Server:
        """`server`, from now one of those driving the rows."""
        self._servers.add(server)
        return server

    def serve(self, make: Callable[[], Server], requests: Iterable[Request]) -> list[Served]:
        """make().serve(requests) for a decoder's own serve(), whose server no caller holds. The
        requests are checked first, as serve() checks them: the server was made before (its
        graphs captured, every row parked, one of these) for requests that were none. Where serve()
        raises (an interrupt, a device fault), that server drives the rows no more. Its requests
        in flight are nobody's to step or cancel, and the traceback that holds it lives on (a
        REPL's sys.last_exc, a caught exception): every later serve(), server() and
        generate_batch of the decoder was refused until the traceback went."""
        requests = _serve_requests(requests)
        server = make()
        try:
            return server.serve(requests)
        except BaseException:
            self._servers.discard(server)
            raise

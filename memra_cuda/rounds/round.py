"""The round as an object: one round's launches on a StreamBufs, validated and composed once.

A round, in stream order: [seed_gather] → draft → assemble → verify → accept → commit →
rollback of the KV lengths [→ rollback of recurrent state] [→ the other pipeline stages'
tail], for every row of the batch at once; a greedy round's accept, commit and rollback of its
first table are one launch (the greedy round tail). A Round checks what it is given (tables,
stages), takes how the model's work is scoped and captured from its engine's Framework, and
issues R rounds; it knows nothing of modes, which are RoundStream's (stream.py), nor of models,
whose work reaches it as callables. ChainRound verifies a chain of k drafts; TreeRound
(tree_round.py) a tree of drafts (docs/trees.md), the second kind of the same thing.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..buffers.acceptance import Greedy, Sampling
from ..buffers.capacity import UNCHECKED, Capacity, Unchecked, kv_entries
from ..buffers.tables import AddressTable, PointerTable, StateIndexTable, StateTable, state_targets_disjoint
from ..driver.engine import as_engine
from ..driver.graph import Capture, LoopBuilder, LoopUnsupported, branch, capturing, join, loops
from ..driver.values import TEXT_LIKE, as_flag, as_listed
from ..kernels.spec import SpecKernels
from .gate import LiveGate
from .switch import Widths, WidthSwitch

if TYPE_CHECKING:
    from ..buffers.acceptance import Acceptance
    from ..buffers.lengths import DraftLengths
    from ..buffers.stream_bufs import StreamBufs
    from ..driver.engine import Engine
    from ..driver.module import Launch

Step = Callable[[], None]
# A kind of round's steps up to its acceptance: those that open the round, the model's work (its
# draft and verify), and those that close it (Round's `before_commit`)
Parts = tuple[Sequence[Step], Sequence[Step], Sequence[Step]]


def chain(launches: Sequence[Step]) -> Step:
    """One callable issuing `launches` in order: a draft chain or verify trunk from its kernels.
    Each is checked callable here, not when the round first issues it: a launch that is not
    callable, or one callable given alone (chain(fn), not chain([fn])), is a TypeError saying so.
    The launches come in their order: a set of them is refused (its order is its members'
    hashes', the launches' addresses, so a draft chain's steps were issued in an order of the
    allocator's, silently), and a mapping (its keys, not launches given as such)."""
    if (callable(launches) or isinstance(launches, (*TEXT_LIKE, Set, Mapping))
            or not isinstance(launches, Iterable)):
        raise TypeError(f"chain takes a list of launches (callables), not {launches!r}: chain([launch])")
    steps = tuple(launches)
    for i, step in enumerate(steps):
        if not callable(step):
            raise TypeError(f"chain's launch {i} is not callable: {step!r}")

    def issue() -> None:
        for step in steps:
            step()
    return issue


class Beside:
    """A launch off a round's path where a graph is captured: a branch at the round's start
    (driver.graph.branch), beside the model's draft and verify, joined before the acceptance,
    its first reader; in line where nothing is captured (eager and readback modes). The length
    chooser's (`choose_beside`), for a model whose draft and verify neither read nor write what
    it does (bufs.ctl_d, acc_d and brk_d, the DraftLengths'): a node fewer on a round's path,
    where at B = 1 each costs about 5 us of a 0.7-0.9 ms round."""

    def __init__(self, launch: Launch):
        self.launch = launch
        self._node: Any = None  # the branch of the round being captured, till its join

    def fork(self) -> None:
        self._node = None  # a capture that raised between a fork and its join left one
        if capturing(self.launch.engine):
            self._node = branch(self.launch)
        else:
            self.launch()

    def join(self) -> None:
        node, self._node = self._node, None
        if node is not None:
            join(self.launch.engine, node)


def as_kernels(kernels: object, who: str, bufs: StreamBufs | None = None) -> SpecKernels:
    """`kernels` if it is a SpecKernels; None, where `bufs` are given (a default of None), the
    SpecKernels of their engine, built here. Anything else is a TypeError naming `who`, at
    construction: a falsy value (0, "") was taken for None and replaced by the default, silently,
    and one of another type met an AttributeError at its first launcher, naming nothing."""
    if kernels is None and bufs is not None:
        return SpecKernels(bufs.engine)
    if not isinstance(kernels, SpecKernels):
        raise TypeError(f"{who}'s kernels must be a SpecKernels (SpecKernels(engine))"
                        f"{', or None to build them' if bufs is not None else ''}, not {kernels!r}")
    return kernels


def length_chooser(kernels: SpecKernels, bufs: StreamBufs, lengths: DraftLengths | None,
                   beside: bool) -> tuple[tuple[Step, ...], tuple[Step, ...]]:
    """The length chooser's steps (docs/lengths.md): those that open a round and those its
    acceptance waits for. In line, its launch opens the round; `beside` (a bool, and only with
    `lengths`), it is a Beside's fork there and its join before the acceptance."""
    beside = as_flag(beside, "choose_beside")
    if lengths is None:
        if beside:
            raise ValueError("choose_beside runs the length chooser beside the draft: it needs lengths= (a "
                             "DraftLengths)")
        return (), ()
    launch = kernels.prepare_choose_lengths(bufs, lengths)  # refuses others' buffers
    if not beside:
        return (launch,), ()
    off_path = Beside(launch)
    return (off_path.fork,), (off_path.join,)


@dataclass(frozen=True)
class Stages:
    """What a pipeline of stages on several engines (the toy's: testing/toy/pipeline.py) adds to a
    round: `engines`, the other stages' engines, whose streams the callables fork to and join
    back from (their work joins the burst graph); `round_tail`, queued after this stage's
    rollback (the accept state sent back, the other stages' rollbacks); `capacity`, the fewest
    KV entries the other stages' caches hold. `engines` is kept as a tuple of Engines, each
    checked here: a string was taken as one engine a character, a number failed only in the Round."""

    engines: Sequence[Engine]
    round_tail: Step | None = None
    capacity: int | Unchecked | None = None

    def __post_init__(self) -> None:
        engines = as_listed(self.engines, "Stages' engines", "Engines")
        object.__setattr__(self, "engines", tuple(as_engine(e, f"Stages' engine {i}") for i, e in enumerate(engines)))
        if self.round_tail is not None and not callable(self.round_tail):  # queued after every round's commit
            raise TypeError(f"round_tail must be a callable that queues the other stages' work, or None, not "
                            f"{self.round_tail!r}")
        if (self.engines or self.round_tail is not None) and self.capacity is None:
            raise ValueError("Stages must say how many KV entries the other stages' caches hold (capacity=), "
                             "or capacity=UNCHECKED: their rollback runs in round_tail, out of the check's sight")
        object.__setattr__(self, "capacity", kv_entries(self.capacity))


class Round:
    """What every kind of round shares, checked when it is built, before anything is queued:

    - `rollback_tables`, PointerTables of KV lengths (kv_len_ptr_table): one must hold
      bufs.pos_ctr_d (how the position advances), and each that names KV lengths must know their
      capacity (or say capacity=UNCHECKED), which with the stages' is the round's `capacity`
      rule (capacity.Capacity);
    - `state_tables`, the recurrent state rolled back after the lengths: a StateTable by copy,
      a StateIndexTable by flip, never naming the same memory twice;
    - the engine's Framework (driver.framework): the model's work runs inside its scope and
      graphs capture through it unless `capture` says otherwise; an engine from
      `memra_cuda.torch.engine()` scopes and captures the way its framework needs.

    A kind of round gives `before_commit`, which composes the steps up to acceptance once all this
    is checked, as three parts: those that open the round, the model's work (its draft and
    verify, and what runs between their launches), and those that close it; and the
    `capacities` of any other caches its steps write (the KV a tree round
    compacts); the bufs' geometry says how far a round writes past a row's position; the
    commit (kernel 4) and the rollbacks after it are the same for every kind, but for which
    slot of recurrent state is kept (_roll_back_state). A kind whose acceptance fuses with them
    (greedy: the greedy round tail) gives `fused_tail` instead of its acceptance's launch:
    given the first rollback table, it makes the one launch that accepts, commits and rolls
    that table back, and the steps to run right after it (a tree's compaction); that launch is
    then the round's `commit`, and the other tables' rollbacks follow the steps.
    `steps` is one whole round, `issue(R)` queues R of them, and device mode publishes each
    commit on a branch beside the next round, so it takes the three parts apart. A round whose
    bodies a SWITCH chooses by width (ChainRound's `narrower`) gives its graphs' capture
    (burst_capture); so does one that skips rounds past every row's end (`skip_done`: its burst
    graphs hold each round's model work in an IF node, open while some row is live, LiveGate;
    a CUDA 12.4+ driver); every other round's graphs capture `issue`.
    """

    acceptance: Acceptance
    switch: WidthSwitch | None = None  # a SWITCH of the round's bodies by width (ChainRound's `narrower`)

    def __init__(self, bufs: StreamBufs, kernels: SpecKernels, before_commit: Callable[[], Parts], *,
                 rollback_tables: Sequence[PointerTable],
                 state_tables: Sequence[StateTable | StateIndexTable], capture: Capture | None,
                 stages: Stages | None, capacities: Sequence[int | None] = (),
                 fused_tail: Callable[[PointerTable], tuple[Launch, Sequence[Step]]] | None = None,
                 skip_done: bool = False):
        if kernels.engine is not bufs.engine:
            raise ValueError(f"the kernels belong to {kernels.engine!r}, the buffers to {bufs.engine!r}")
        tables, states = _kv_tables(bufs, rollback_tables), _state_tables(state_tables)
        stages = stages or Stages(())
        self.bufs, self.kernels, self.engine = bufs, kernels, bufs.engine
        self.capacity = Capacity.of((stages.capacity, *capacities, *(table.capacity for table in tables)),
                                    bufs.geometry)
        # The policy of whoever owns the memory (memra_cuda.torch.engine()): its scope around the
        # model's work; its captures are the ones Graph takes where `capture` is None.
        self.scope = self.engine.framework.scope
        self.capture = capture
        self.joined = tuple(stages.engines)  # the other stages' engines, whose work a burst graph holds
        self.pipelined = bool(self.joined) or stages.round_tail is not None
        self.gate: LiveGate | None = None  # skip_done's, made last: everything else is refused first
        skip_done = as_flag(skip_done, "skip_done")
        if skip_done and capture is not None:
            raise ValueError("a round that skips rounds past the end builds its graphs itself: it takes no capture=")
        if skip_done and states:
            raise ValueError("skip_done takes no state tables: the recurrent state's rollback after the commit reads "
                             "the slots the round's verify writes, which a skipped round leaves as they were")
        opening, work, closing = (tuple(part) for part in before_commit())
        self.opening, self.work, self.closing = opening, work, closing
        self.before_commit: tuple[Step, ...] = (*opening, *work, *closing)
        then: Sequence[Step] = ()
        if fused_tail is None:
            self.commit = kernels.prepare_ring_commit(bufs)
        else:  # the acceptance, the commit and the first table's rollback: one launch
            self.commit, then = fused_tail(tables[0])
            tables = tables[1:]
        self.after_commit: tuple[Step, ...] = (
            *then,
            *(kernels.prepare_rollback(bufs, table) for table in tables),
            *(self._roll_back_state(table) for table in states),
            *([stages.round_tail] if stages.round_tail is not None else []),
        )
        self.steps: tuple[Step, ...] = (*self.before_commit, self.commit, *self.after_commit)
        if skip_done:
            refuse_conditionals(self, "skipping rounds past the end (skip_done)", "pass skip_done=False")
            self.gate = LiveGate(bufs)  # LoopUnsupported on a driver before 12.4

    def _roll_back_state(self, table: StateTable | StateIndexTable) -> Step:
        """The live state after the round's kept tokens: a chain's slot keep - 1 (kernels 8, 9)."""
        if isinstance(table, StateTable):
            return self.kernels.prepare_state_copy(self.bufs, table)
        return self.kernels.prepare_state_flip(self.bufs, table)

    def issue(self, rounds: int) -> None:
        """Queue `rounds` rounds on the engine's stream (inside the model's scope)."""
        steps = self.steps
        with self.scope():
            for _ in range(rounds):
                for step in steps:
                    step()

    def burst_capture(self, rounds: int, then: Step) -> Capture | None:
        """How the graph of a burst of `rounds` rounds and `then` (its readback) is captured:
        None, the round's own way (`capture`, or the framework's) of capturing `issue`; with
        `skip_done`, built node by node (the engine's framework's way of building conditional
        nodes, or the driver's), each round's model work in an IF node (LiveGate)."""
        gate = self.gate
        if gate is None:
            return None
        opening, work = self.scoped(self.opening), self.scoped(self.work)
        return self.built_burst(rounds, then, lambda builder: gate.add(builder, opening, work))

    def built_burst(self, rounds: int, then: Step, opened: Callable[[LoopBuilder], None]) -> Capture:
        """The Capture of a burst graph built node by node (the engine's framework's way of
        building conditional nodes, or the driver's): each of `rounds` rounds `opened(builder)`
        (its opening and its model's work, in conditional nodes of some kind), then its closing,
        its commit and what follows; then `then`, its readback."""
        tail = self.scoped((*self.closing, self.commit, *self.after_commit))

        def build(builder: LoopBuilder) -> None:
            for _ in range(rounds):
                opened(builder)
                builder.issue(tail)
            builder.issue(then)
        return self.conditional_capture(build)

    def scoped(self, steps: Sequence[Step]) -> Step:
        """chain(steps) issued inside the model's scope."""
        issue_all = chain(steps)

        def issue() -> None:
            with self.scope():
                issue_all()
        return issue

    def conditional_capture(self, build: Callable[[LoopBuilder], None]) -> Capture:
        """The Capture of a graph built node by node (`build`, with conditional nodes): the
        engine's framework's way of building one, or the driver's."""
        return (self.engine.framework.loop_capture or loops)(build)


def refuse_conditionals(round: Round, who: str, instead: str, also: str = "") -> None:
    """LoopUnsupported, naming `who` and what to do `instead`, unless `round`'s work can sit in a
    conditional node's body (device mode's WHILE loop, a SWITCH of bodies by width): the work of
    one context (no pipeline stages, whose streams join through events, which a body cannot
    hold) and no communicator's rank (NCCL's operations inside a body are untried; `also`, a
    reason of `who`'s own). Checked before anything touches the driver."""
    if round.pipelined:
        raise LoopUnsupported(f"{who} cannot run pipeline stages: a conditional node's body holds the work of one "
                              "context, and the stages' streams join through events, which a body cannot hold; "
                              f"{instead}")
    if round.engine.guards:
        raise LoopUnsupported(f"{who} cannot run a rank of a communicator (memra_cuda.comm): {also}NCCL's operations "
                              f"inside a conditional node's body are untried; {instead}")


class ChainRound(Round):
    """A round that verifies a chain: the model's `draft_chain` writes k drafts to `draft_d`,
    assemble_verify lines up the pending token and the drafts in bufs.vtok_d, the model's
    `verify_trunk` writes what `acceptance` reads (Greedy(pred_d) or Sampling(p_d, q_d,
    seed_d, vocab)), and acceptance keeps the longest agreeing prefix (docs/model-side.md).
    `seed_gather` (kernel 1), when given, opens the round: an EAGLE-style draft's hidden row.
    `lengths` (DraftLengths of these bufs), when given, opens it before that: the length chooser
    (docs/lengths.md) caps each row's acceptance at its length, min(width, its request's cap).
    With `choose_beside` it runs beside the draft and the verify where a graph is captured, off
    the round's path (Beside): only for a model whose draft and verify neither read nor write
    what it does (the toy's draft writes brk_d), and with no narrower bodies. With `skip_done`
    its burst graphs skip the draft and the verify of a round once every row is done (Round's).

    `narrower` ({W: (draft_chain_W, verify_trunk_W)}, widths below k) gives the round bodies of
    those widths, a draft chain of W steps and a verify of W + 1 tokens a row writing the same
    buffers' first W (+ 1) columns; with them (and `lengths`, whose width picks one), a burst
    graph runs, each round, the body of the width chosen (a SWITCH node: memra_cuda.rounds.switch,
    a CUDA 12.8+ driver), or the narrowest wider one's. A round issued from the host (eager and
    readback modes, device mode's loop) runs k's body, its rows capped alike: the same tokens."""

    def __init__(self, bufs: StreamBufs, kernels: SpecKernels, *, draft_chain: Step, verify_trunk: Step,
                 draft_d: Any, acceptance: Acceptance, rollback_tables: Sequence[PointerTable],
                 state_tables: Sequence[StateTable | StateIndexTable] = (), seed_gather: Launch | None = None,
                 lengths: DraftLengths | None = None, narrower: Mapping[int, tuple[Step, Step]] | None = None,
                 choose_beside: bool = False, skip_done: bool = False, capture: Capture | None = None,
                 stages: Stages | None = None):
        _check_steps(draft_chain, verify_trunk, narrower, seed_gather)
        kernels = as_kernels(kernels, "ChainRound")
        if not isinstance(acceptance, (Greedy, Sampling)):
            raise TypeError(f"acceptance must be Greedy(pred_d) or Sampling(p_d, q_d, seed_d, vocab), "
                            f"not {acceptance!r}")
        if not bufs.geometry.chain:
            raise ValueError(f"a chain's round verifies k + 1 = {bufs.k + 1} tokens a row, but its buffers' geometry "
                             f"says {bufs.geometry.width} (a tree's: TreeRound)")
        self.acceptance, self.lengths = acceptance, lengths
        choose, chosen = length_chooser(kernels, bufs, lengths, choose_beside)
        if narrower and chosen:
            raise ValueError("a SWITCH of bodies by width reads the width the chooser picks before the body runs: "
                             "choose_beside takes no narrower bodies")
        assemble = kernels.prepare_assemble_verify(bufs, draft_d)
        # Greedy acceptance is the greedy round tail's first part (the round's commit); sampled
        # acceptance is a launch of its own before the commit.
        self.accept: tuple[Step, ...] = () if isinstance(acceptance, Greedy) else \
            (kernels.prepare_accept(bufs, acceptance),)
        self.head: tuple[Step, ...] = (*choose, *([seed_gather] if seed_gather is not None else []))
        # with `narrower`: each width's draft, assembly and verify, in the widths' order
        self.bodies: tuple[tuple[Step, ...], ...] = ()
        if narrower:
            if lengths is None:
                raise ValueError("bodies of narrower widths need lengths= (a DraftLengths), whose chooser picks one")
            if capture is not None:
                raise ValueError("a round of bodies by width builds its graphs itself: it takes no capture=")
            if bufs.k in narrower:
                raise ValueError(f"narrower holds the widths below k = {bufs.k}: k's body is draft_chain and "
                                 "verify_trunk")
            widths = Widths(bufs.k, (*narrower, bufs.k))
            given = {**narrower, bufs.k: (draft_chain, verify_trunk)}
            self.bodies = tuple((given[width][0], assemble, given[width][1]) for width in widths.widths)

        if narrower and as_flag(skip_done, "skip_done"):
            raise ValueError("a round of bodies by width runs a SWITCH of them, not an IF: skip_done takes no "
                             "narrower bodies")

        def before_commit() -> Parts:
            return self.head, (draft_chain, assemble, verify_trunk), (*chosen, *self.accept)
        fused_tail = None
        if isinstance(acceptance, Greedy):
            pred_d = acceptance.pred_d

            def fused_tail(table: PointerTable) -> tuple[Launch, Sequence[Step]]:
                return kernels.prepare_round_tail_greedy(bufs, pred_d, table), ()
        super().__init__(bufs, kernels, before_commit,
                         rollback_tables=rollback_tables, state_tables=state_tables, capture=capture, stages=stages,
                         fused_tail=fused_tail, skip_done=skip_done)
        if lengths is not None and self.bodies:
            refuse_conditionals(self, "a round of bodies by width", "give it no narrower bodies")
            self.switch = WidthSwitch(lengths, widths)  # SwitchUnsupported on a driver before 12.8

    def burst_capture(self, rounds: int, then: Step) -> Capture | None:
        """With bodies by width: the graph built node by node (the engine's framework's way of
        building conditional nodes, or the driver's), each round its head, the SWITCH of its
        bodies, then acceptance and what follows it; then `then`. Without: Round's."""
        if self.switch is None:
            return super().burst_capture(rounds, then)
        switch, head, bodies = self.switch, self.scoped(self.head), [self.scoped(body) for body in self.bodies]

        def opened(builder: LoopBuilder) -> None:
            builder.issue(head)
            switch.add(builder, bodies)
        return self.built_burst(rounds, then, opened)  # its closing is its acceptance (no chooser beside)


def _check_steps(draft_chain: object, verify_trunk: object, narrower: Mapping[int, tuple[Step, Step]] | None,
                 seed_gather: object = None) -> None:
    """TypeError naming the first of a chain's steps that is not a callable (what queues the
    model's work; chain() makes one of launches; `seed_gather`, where given, a prepared launch),
    and each of `narrower`'s bodies unless it is such a pair: checked first, when the round is
    built, as TreeRound checks its steps. A list of
    launches given as the draft chain was taken, and raised only when the round first issued it:
    after the length chooser's launch (moving each row's statistics on by a round that never ran)
    and the seed gather's were queued, or inside a graph's capture."""
    steps: list[tuple[str, object]] = [("draft_chain", draft_chain), ("verify_trunk", verify_trunk)]
    if narrower is not None and not isinstance(narrower, Mapping):
        raise TypeError(f"narrower maps widths below k to their (draft_chain, verify_trunk), not {narrower!r}")
    for width, body in (narrower or {}).items():
        if not (isinstance(body, Sequence) and not isinstance(body, TEXT_LIKE) and len(body) == 2):
            raise TypeError(f"narrower[{width!r}] must be a pair (draft_chain, verify_trunk) of width {width!r}, "
                            f"not {body!r}")
        steps += [(f"narrower[{width!r}]'s draft_chain", body[0]), (f"narrower[{width!r}]'s verify_trunk", body[1])]
    if seed_gather is not None:
        steps.append(("seed_gather", seed_gather))
    for name, step in steps:
        if not callable(step):
            raise TypeError(f"{name} must be a callable that queues the model's work (chain([...]) of its launches), "
                            f"not {step!r}")


def _kv_tables(bufs: StreamBufs, given: Sequence[PointerTable]) -> list[PointerTable]:
    """The rollback tables, refused unless they are KV-length tables that move the position and
    say their capacity, given in a list, a tuple or a 1-D array (as_listed: a bare int met "'int'
    object is not iterable", a set was taken in its hashes' order)."""
    if isinstance(given, AddressTable):
        raise TypeError(f"rollback_tables is a list of tables, not one table: [{given!r}]")
    tables = as_listed(given, "rollback_tables", "PointerTables of KV lengths (kv_len_ptr_table)")
    if not tables:
        raise ValueError("rollback needs at least one pointer table (one of them holding bufs.pos_ctr_d)")
    for table in tables:
        if not isinstance(table, PointerTable) or isinstance(table, StateIndexTable):
            raise TypeError(f"rollback tables must be PointerTables of KV lengths (kv_len_ptr_table builds them; "
                            f"state tables go in state_tables), not {table!r}")
        if table.capacity is None and any(t is not None and t is not bufs.pos_ctr_d for t in table.targets):
            raise ValueError(f"rollback table {table!r} names KV lengths but not their capacity, so no burst "
                             "could be checked against it: build it with kv_len_ptr_table, or give "
                             f"PointerTable(..., capacity=entries), or capacity={UNCHECKED!r} to go unchecked")
    if not any(table.holds(bufs.pos_ctr_d) for table in tables):
        raise ValueError("no rollback table holds bufs.pos_ctr_d, so the position would never advance: "
                         "pass pos_ctr=bufs.pos_ctr_d to kv_len_ptr_table")
    return tables


def _state_tables(given: Sequence[StateTable | StateIndexTable]) -> list[StateTable | StateIndexTable]:
    """The state tables, refused unless each is a copy or flip table and none names another's
    memory, given in a list, a tuple or a 1-D array (as_listed, as the rollback tables)."""
    if isinstance(given, AddressTable):
        raise TypeError(f"state_tables is a list of tables, not one table: [{given!r}]")
    states = as_listed(given, "state_tables", "StateTables (state_copy_table) or StateIndexTables (state_flip_table)")
    for table in states:
        if not isinstance(table, (StateTable, StateIndexTable)):
            raise TypeError(f"state tables must be StateTables (state_copy_table) or StateIndexTables "
                            f"(state_flip_table), not {table!r}")
    state_targets_disjoint(states)
    return states

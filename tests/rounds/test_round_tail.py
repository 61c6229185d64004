"""Which launches a round issues, and in which of its parts, on the host alone: a greedy round's
acceptance, commit and first rollback are one launch (the greedy round tail: kernels 3, 4 and 5,
or a tree's 13, 4 and 5) and that launch is the round's `commit`; a sampled round keeps its
acceptance's own launches before kernel 4. Every mode issues these parts: eager, readback, graph
and overlap issue `steps`, the SWITCH of bodies by width `closing`, `commit` and `after_commit`
after its bodies, device mode `before_commit`, its join, `commit`, its publish, `after_commit`.
The kernels and buffers are stand-ins that record what was prepared (no driver); the kernels
themselves are tested against the launches they replace in tests/kernels (GPU). A model's steps
are named functions, so a round's steps read as the names of its kernels and the model's work;
tests/rounds/test_tree_round.py builds its tree rounds here too (tree_round_of)."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from memra_cuda import DynamicTree, Geometry, TreeShape
from memra_cuda.buffers import PointerTable
from memra_cuda.buffers.acceptance import Greedy, Sampling
from memra_cuda.buffers.tables import KVDataTable
from memra_cuda.buffers.tree import Candidates, TreeBufs
from memra_cuda.kernels.spec import SpecKernels
from memra_cuda.rounds import tree_round
from memra_cuda.rounds.round import ChainRound


class Step:
    """A prepared launch's stand-in: its kernel's name and what it was prepared with."""

    def __init__(self, name: str, *given: object):
        self.name, self.given = name, given

    def __call__(self) -> None:
        pass

    def __repr__(self) -> str:
        return self.name


class Kernels(SpecKernels):
    """SpecKernels' launchers as the rounds call them, each making a Step named after its kernel
    (a SpecKernels, as a round takes no other kernels, with no module loaded)."""

    def __init__(self, engine: object):  # no super().__init__: nothing is loaded
        self.engine = engine

    def prepare_assemble_verify(self, bufs, draft_d):
        return Step("assemble")

    def prepare_accept(self, bufs, rule):
        assert isinstance(rule, Sampling), f"a greedy round accepts in its tail, not by prepare_accept: {rule!r}"
        return Step("accept_sample")

    def prepare_ring_commit(self, bufs):
        return Step("commit")

    def prepare_rollback(self, bufs, table):
        return Step("rollback", table)

    def prepare_round_tail_greedy(self, bufs, pred_d, table):
        return Step("round_tail", pred_d, table)

    def prepare_choose_lengths(self, bufs, lengths):
        return Step("choose", lengths)


class TreeKernels:
    """TreeKernels' launchers as TreeRound calls them."""

    def __init__(self, engine: object):
        self.engine = engine

    def prepare_begin(self, bufs, tree):
        return Step("begin")

    def prepare_grow(self, bufs, tree, level, *candidates):
        return Step(f"grow{level}")

    def prepare_draw(self, bufs, tree, level, *law):
        return Step(f"draw{level}")

    def prepare_accept_greedy(self, bufs, tree, pred_d):
        return Step("tree_accept")

    def prepare_accept_sample(self, bufs, tree, *law):
        return Step("tree_accept_sample")

    def prepare_compact(self, bufs, tree, table):
        return Step("compact", table)

    def prepare_round_tail_greedy(self, bufs, tree, pred_d, table):
        return Step("tree_round_tail", pred_d, table)


def table(*targets: object) -> PointerTable:
    """A PointerTable's stand-in naming `targets` (no device memory), of a capacity of 64."""
    made = object.__new__(PointerTable)
    made.targets, made.capacity = targets, 64
    return made


def buffers(geometry: Geometry) -> SimpleNamespace:
    engine = SimpleNamespace(framework=SimpleNamespace(scope=contextlib.nullcontext, loop_capture=None), guards=())
    return SimpleNamespace(engine=engine, geometry=geometry, k=geometry.k, batch=geometry.batch,
                           pos_ctr_d=object(), pos_start_d=object())


def names(steps) -> list[str]:
    """Each launch's kernel, or the name model() gave the model's step."""
    return [step.name if isinstance(step, Step) else step.__name__ for step in steps]


def model(name: str):
    def step() -> None:
        pass
    step.__name__ = name
    return step


PRED = object()


def chain_round(acceptance, tables: int = 1, **given) -> tuple[ChainRound, list[PointerTable]]:
    """A ChainRound (k = 4, B = 3) and its rollback tables; `given` adds to its arguments
    (lengths, choose_beside, narrower)."""
    bufs = buffers(Geometry(4, 2, 3))
    rollback = [table(bufs.pos_ctr_d), *(table(object()) for _ in range(tables - 1))]
    return ChainRound(bufs, Kernels(bufs.engine), draft_chain=model("draft"), verify_trunk=model("verify"),
                      draft_d=object(), acceptance=acceptance, rollback_tables=rollback, **given), rollback


def test_a_greedy_chain_round_accepts_commits_and_rolls_back_in_one_launch():
    """The tail replaces accept, commit and the first table's rollback; a second table's
    rollback follows it as before. Device mode joins its publish before `commit`, which now
    accepts too: the acceptance reads nothing the publish writes."""
    round_, tables = chain_round(Greedy(PRED), tables=2)
    assert names(round_.before_commit) == ["draft", "assemble", "verify"]
    assert round_.commit.name == "round_tail" and round_.commit.given == (PRED, tables[0])
    assert names(round_.after_commit) == ["rollback"] and round_.after_commit[0].given == (tables[1],)
    assert round_.steps == (*round_.before_commit, round_.commit, *round_.after_commit)
    assert round_.accept == ()  # its closing: what a SWITCH of bodies issues between its bodies and the commit


def test_a_sampled_chain_round_keeps_its_acceptance_launch():
    round_, tables = chain_round(Sampling(object(), object(), object(), 7))
    assert names(round_.steps) == ["draft", "assemble", "verify", "accept_sample", "commit", "rollback"]
    assert round_.commit.name == "commit" and names(round_.accept) == ["accept_sample"]
    assert round_.after_commit[0].given == (tables[0],)


def tree_round_of(monkeypatch, acceptance, tree: TreeShape | DynamicTree = TreeShape.chain(2), tables: int = 1,
                  **given) -> tuple[tree_round.TreeRound, list[PointerTable]]:
    """A TreeRound over `tree` (B = 3) and its rollback tables, the first holding pos_ctr_d: the
    draft's levels are model steps level0, level1, ..., its verify `verify`; a greedy round's
    candidates are the draft's; `given` adds to or replaces TreeRound's arguments (kv_data,
    compact, draft_places, candidates=None)."""
    monkeypatch.setattr(tree_round, "TreeKernels", TreeKernels)
    monkeypatch.setattr(tree_round, "SampledCandidates", lambda *args: SimpleNamespace(tok_d=0, logq_d=0, sel_d=0))
    bufs = buffers(Geometry.of_tree(tree, 2, 3))
    tree_bufs = object.__new__(TreeBufs)
    tree_bufs.bufs, tree_bufs.tree, tree_bufs.nodes = bufs, tree, tree.nodes
    rollback = [table(bufs.pos_ctr_d), *(table(object()) for _ in range(tables - 1))]
    candidates = Candidates(object(), object()) if isinstance(acceptance, Greedy) else None
    args = dict(draft_levels=[model(f"level{d}") for d in range(tree.depth + 1)], verify_tree=model("verify"),
                acceptance=acceptance, candidates=candidates, rollback_tables=rollback)
    return tree_round.TreeRound(bufs, tree_bufs, Kernels(bufs.engine), **{**args, **given}), rollback


def kv_data() -> KVDataTable:
    made = object.__new__(KVDataTable)
    made.layers, made.batch = [SimpleNamespace(capacity=64)], 3
    return made


def test_a_greedy_tree_round_compacts_after_its_tail(monkeypatch):
    """13, 4 and 5 in one launch, then kernel 15: compaction reads keep, the accepted count, the
    path and pos_start, which the commit and the rollback leave alone (the GPU test
    test_greedy_tree_round_tail_then_compaction_is_the_rounds_order checks the buffers)."""
    round_, tables = tree_round_of(monkeypatch, Greedy(PRED), kv_data=kv_data())
    assert names(round_.before_commit) == ["begin", "level0", "grow1", "level1", "grow2", "level2", "verify"]
    assert round_.commit.name == "tree_round_tail" and round_.commit.given == (PRED, tables[0])
    assert names(round_.after_commit) == ["compact"]


def test_a_greedy_tree_round_rolls_its_other_tables_back_after_the_compaction(monkeypatch):
    """The tail rolls back the first table alone (its launch names one); the other tables'
    rollbacks (kernel 5) follow the compaction, as a chain's follow its tail: they read keep and
    pos_start, which the compaction leaves alone, and write no KV entry it moves."""
    data = kv_data()
    round_, tables = tree_round_of(monkeypatch, Greedy(PRED), tables=2, kv_data=data)
    assert round_.commit.name == "tree_round_tail" and round_.commit.given == (PRED, tables[0])
    assert names(round_.after_commit) == ["compact", "rollback"]
    assert round_.after_commit[0].given == (data,) and round_.after_commit[1].given == (tables[1],)
    assert round_.steps == (*round_.before_commit, round_.commit, *round_.after_commit)


@pytest.mark.parametrize("with_kv_data", [False, True])
def test_a_greedy_tree_round_with_its_models_compaction_keeps_the_rounds_order(monkeypatch, with_kv_data):
    """A model's own compact= may read what the commit and the rollback move (a length, the
    position): its round accepts, compacts, then commits and rolls back, as before."""
    given = dict(kv_data=kv_data()) if with_kv_data else {}
    round_, _ = tree_round_of(monkeypatch, Greedy(PRED), compact=model("compact_paged"), **given)
    verify_to_compact = ["verify", "tree_accept", *(["compact"] if with_kv_data else []), "compact_paged"]
    assert names(round_.before_commit)[-len(verify_to_compact):] == verify_to_compact
    assert round_.commit.name == "commit"
    assert names(round_.after_commit) == ["rollback"]


def test_a_sampled_tree_round_keeps_its_acceptance_launches(monkeypatch):
    round_, _ = tree_round_of(monkeypatch, Sampling(object(), object(), object(), 7), kv_data=kv_data())
    assert names(round_.before_commit)[-3:] == ["verify", "tree_accept_sample", "compact"]
    assert round_.commit.name == "commit" and names(round_.after_commit) == ["rollback"]


LENGTHS = object()  # a DraftLengths' stand-in: the stand-in kernels take it as it is


def test_the_length_chooser_opens_a_round_or_runs_beside_it_till_its_acceptance(monkeypatch):
    """In line, the chooser opens the round; `choose_beside` forks it off the round's path at the
    round's start (a Beside: a branch where a graph is captured) and joins it just before the
    acceptance, its first reader (a greedy round's tail, a sampled round's accept launch), so
    the draft and the verify run beside it (a node fewer on a round's path)."""
    sampling = Sampling(object(), object(), object(), 7)
    chain_steps = lambda acceptance, beside: names(chain_round(acceptance, lengths=LENGTHS,  # noqa: E731
                                                               choose_beside=beside)[0].steps)
    assert chain_steps(Greedy(PRED), False) == ["choose", "draft", "assemble", "verify", "round_tail"]
    assert chain_steps(Greedy(PRED), True) == ["fork", "draft", "assemble", "verify", "join", "round_tail"]
    assert chain_steps(sampling, True) == ["fork", "draft", "assemble", "verify", "join", "accept_sample", "commit",
                                           "rollback"]
    tree = dict(lengths=LENGTHS, choose_beside=True, kv_data=kv_data())
    assert names(tree_round_of(monkeypatch, Greedy(PRED), **tree)[0].steps) == [
        "fork", "begin", "level0", "grow1", "level1", "grow2", "level2", "verify", "join", "tree_round_tail", "compact"]
    assert names(tree_round_of(monkeypatch, sampling, **tree)[0].steps)[-6:] == [
        "verify", "join", "tree_accept_sample", "compact", "commit", "rollback"]
    own = names(tree_round_of(monkeypatch, Greedy(PRED), lengths=LENGTHS, choose_beside=True,
                              compact=model("compact_paged"))[0].steps)
    assert own[0] == "fork" and own[-6:] == ["verify", "join", "tree_accept", "compact_paged", "commit", "rollback"]


@pytest.mark.parametrize("given, error, message", [
    (dict(choose_beside=True), ValueError, "choose_beside runs the length chooser beside the draft: it needs lengths="),
    (dict(lengths=LENGTHS, choose_beside=1), TypeError, "choose_beside must be True or False, not 1"),
    (dict(lengths=LENGTHS, choose_beside=True, narrower={2: (model("draft2"), model("verify2"))}), ValueError,
     "choose_beside takes no narrower bodies"),
], ids=["no-lengths", "an-int", "narrower"])
def test_a_chooser_beside_what_it_cannot_run_beside_is_refused(given, error, message):
    with pytest.raises(error, match=message):
        chain_round(Greedy(PRED), **given)


def test_beside_branches_where_a_graph_is_captured_and_launches_in_line_where_not(monkeypatch):
    """Beside.fork adds its launch as a branch while the stream is captured, and join() makes
    the stream's next work wait for it; in line (eager and readback modes) there is nothing to
    join. A capture that raised between a fork and its join leaves no branch for the next
    round's join to name (the driver's calls are stand-ins: what is checked is which is made)."""
    from memra_cuda.rounds import round as round_module

    made: list[tuple] = []
    capturing = [True]
    monkeypatch.setattr(round_module, "capturing", lambda engine: capturing[0])
    monkeypatch.setattr(round_module, "branch", lambda launch: made.append(("branch",)) or "node")
    monkeypatch.setattr(round_module, "join", lambda engine, node: made.append(("join", node)))
    launched: list[str] = []

    class Launch:
        engine = object()

        def __call__(self) -> None:
            launched.append("in line")

    beside = round_module.Beside(Launch())
    beside.fork()
    beside.join()
    assert made == [("branch",), ("join", "node")] and launched == []
    beside.fork()  # captured, then the capture raised before the join
    capturing[0] = False
    beside.fork()
    beside.join()
    assert launched == ["in line"] and made == [("branch",), ("join", "node"), ("branch",)]


@pytest.mark.parametrize("given", [5, "tables", "set", "generator", "mapping"])
@pytest.mark.parametrize("which", ["rollback_tables", "state_tables"])
def test_a_rounds_tables_come_in_a_list_or_a_tuple_refused_naming_them_otherwise(which, given):
    """rollback_tables and state_tables went through list(): a bare int met "'int' object is not
    iterable", naming nothing, a set of tables was taken in its hashes' order (the tables'
    addresses: the rollbacks issued in an order of the allocator's), a generator and a mapping's
    keys were taken too. Refused naming them (as_listed), before anything is prepared from them."""
    bufs = buffers(Geometry(4, 2, 3))
    first, second = table(bufs.pos_ctr_d), table(object())
    made = {"set": {first, second}, "generator": (t for t in (first, second)), "mapping": {first: 0, second: 1}}
    tables = dict(rollback_tables=[first], state_tables=[])
    tables[which] = made.get(given, given)
    of = ("PointerTables of KV lengths .kv_len_ptr_table." if which == "rollback_tables" else
          r"StateTables .state_copy_table. or StateIndexTables .state_flip_table.")
    with pytest.raises(TypeError, match=f"^{which} must be a list, a tuple or a 1-D array of {of}, not "):
        ChainRound(bufs, Kernels(bufs.engine), draft_chain=model("draft"), verify_trunk=model("verify"),
                   draft_d=object(), acceptance=Greedy(PRED), **tables)


def test_a_rounds_tables_in_a_tuple_are_taken_in_their_order():
    bufs = buffers(Geometry(4, 2, 3))
    first, second = table(bufs.pos_ctr_d), table(object())
    round_ = ChainRound(bufs, Kernels(bufs.engine), draft_chain=model("draft"), verify_trunk=model("verify"),
                        draft_d=object(), acceptance=Greedy(PRED), rollback_tables=(first, second), state_tables=())
    assert round_.commit.given == (PRED, first) and round_.after_commit[0].given == (second,)

"""Rounds past every row's end skipped, on the host alone (memra_cuda.rounds.gate; docs/capacity.md,
"Rounds past the end"): a round's steps fall in three parts, the model's work between those that
open and close the round, in every kind of round; with skip_done a burst graph is built node by
node, each round its opening beside the gate's opener, an IF node of its work, then the rest of
the round, and the readback after the last; what cannot sit in a conditional node is refused,
naming it, before any driver call. Stand-ins record what is built (no driver); the GPU test is
tests/rounds/test_gate_gpu.py."""
from __future__ import annotations

import pytest

from memra_cuda import Greedy, Sampling
from memra_cuda.buffers.capacity import UNCHECKED
from memra_cuda.buffers.tables import StateTable
from memra_cuda.errors import LoopUnsupported
from memra_cuda.rounds import Stages, round as round_module
from test_round_tail import PRED, chain_round, kv_data, model, names, tree_round_of

LENGTHS = object()


def test_a_chain_rounds_work_is_its_draft_and_verify_between_its_opening_and_closing():
    greedy, _ = chain_round(Greedy(PRED), lengths=LENGTHS)
    assert (names(greedy.opening), names(greedy.work), names(greedy.closing)) == \
        (["choose"], ["draft", "assemble", "verify"], [])
    sampled, _ = chain_round(Sampling(object(), object(), object(), 7))
    assert (names(sampled.opening), names(sampled.work), names(sampled.closing)) == \
        ([], ["draft", "assemble", "verify"], ["accept_sample"])
    assert sampled.before_commit == (*sampled.opening, *sampled.work, *sampled.closing)


def test_a_tree_rounds_work_is_its_levels_grows_and_verify(monkeypatch):
    greedy, _ = tree_round_of(monkeypatch, Greedy(PRED), kv_data=kv_data())
    assert (names(greedy.opening), names(greedy.work), names(greedy.closing)) == \
        (["begin"], ["level0", "grow1", "level1", "grow2", "level2", "verify"], [])
    sampled, _ = tree_round_of(monkeypatch, Sampling(object(), object(), object(), 7), kv_data=kv_data())
    assert names(sampled.work) == ["level0", "draw1", "grow1", "level1", "draw2", "grow2", "level2", "verify"]
    assert names(sampled.closing) == ["tree_accept_sample", "compact"]
    paged, _ = tree_round_of(monkeypatch, Greedy(PRED), compact=model("compact_paged"))
    assert names(paged.closing) == ["tree_accept", "compact_paged"]


class Gate:
    """LiveGate's stand-in: each add() enters what it was given into the builder's parts."""

    def __init__(self, bufs):
        self.bufs = bufs

    def add(self, builder, opening, work):
        builder.built.append(("gate", opening, work))


class Builder:
    """A LoopBuilder's stand-in: the parts in the order they were added."""

    def __init__(self):
        self.built = []

    def issue(self, work):
        self.built.append(("issue", work))


def built_burst(round_, rounds: int, then) -> list:
    """What round_.burst_capture(rounds, then) builds through a framework's loop capture, each
    part the steps it issues in the model's scope (Round.scoped: a marked tuple here)."""
    builder = Builder()
    round_.engine.framework.loop_capture = lambda build: (build(builder), "capture")[1]
    round_.scoped = lambda steps: ("scoped", tuple(steps))
    assert round_.burst_capture(rounds, then) == "capture"
    return builder.built


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_a_skipping_burst_is_each_rounds_opening_and_gated_work_then_the_rest_then_the_readback(monkeypatch, kind):
    monkeypatch.setattr(round_module, "LiveGate", Gate)
    if kind == "chain":
        round_, _ = chain_round(Greedy(PRED), lengths=LENGTHS, skip_done=True)
    else:
        round_, _ = tree_round_of(monkeypatch, Greedy(PRED), kv_data=kv_data(), skip_done=True)
    assert isinstance(round_.gate, Gate) and round_.gate.bufs is round_.bufs
    then = model("readback")
    built = built_burst(round_, 3, then)
    gated = ("gate", ("scoped", round_.opening), ("scoped", round_.work))
    rest = ("issue", ("scoped", (*round_.closing, round_.commit, *round_.after_commit)))
    assert built == [gated, rest] * 3 + [("issue", then)]
    assert names(round_.work)[-1] == "verify" and round_.commit.name.endswith("round_tail")


def test_without_skip_done_the_round_captures_its_burst_the_frameworks_way():
    round_, _ = chain_round(Greedy(PRED), lengths=LENGTHS)
    assert round_.gate is None and round_.burst_capture(4, model("readback")) is None


def test_what_cannot_sit_in_a_conditional_node_is_refused_before_the_driver(monkeypatch):
    with pytest.raises(LoopUnsupported, match=r"skipping rounds past the end \(skip_done\) cannot run pipeline"):
        chain_round(Greedy(PRED), skip_done=True, stages=Stages((), round_tail=lambda: None, capacity=UNCHECKED))
    with pytest.raises(ValueError, match="a round that skips rounds past the end builds its graphs itself"):
        chain_round(Greedy(PRED), skip_done=True, capture=lambda engine, issue: None)
    with pytest.raises(ValueError, match="skip_done takes no narrower bodies"):
        chain_round(Greedy(PRED), lengths=LENGTHS, skip_done=True, narrower={1: (model("d1"), model("v1"))})
    states = object.__new__(StateTable)
    states.targets = ()
    with pytest.raises(ValueError, match="skip_done takes no state tables"):
        chain_round(Greedy(PRED), skip_done=True, state_tables=[states])
    for flag in ("yes", 1, None):
        with pytest.raises(TypeError, match="^skip_done must be True or False"):
            chain_round(Greedy(PRED), skip_done=flag)
        with pytest.raises(TypeError, match="^skip_done must be True or False"):
            tree_round_of(monkeypatch, Greedy(PRED), kv_data=kv_data(), skip_done=flag)

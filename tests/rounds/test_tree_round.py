"""TreeRound's steps on the host (no driver: the tree kernels' launchers stand in, each a label):
a round grows every level between the draft's, unless its draft places a greedy static tree's
children itself (draft_places), and what cannot place its own children is refused before
anything is asked of the buffers or the kernels."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from memra_cuda import DynamicTree, Greedy, Sampling, TreeRound, TreeShape
from memra_cuda.buffers import Candidates, TreeBufs
from memra_cuda.rounds import round as round_module
from memra_cuda.rounds import tree_round

TREE = TreeShape.chain_with_leaves(3, 1)  # depth 3


class Labels:
    """TreeKernels whose launches are their names: kernel 11's with its level."""

    def __init__(self, engine: object):
        self.engine = engine

    def prepare_begin(self, bufs, tree):
        return "begin"

    def prepare_grow(self, bufs, tree, level, tok_d, logq_d, sel_d=None):
        return f"grow {level}"

    def prepare_accept_greedy(self, bufs, tree, pred_d):
        return "accept"

    def prepare_compact(self, bufs, tree, kv_data):
        return "compact"

    def prepare_round_tail_greedy(self, bufs, tree, pred_d, table):
        return "tail"


def level(d: int):
    def step() -> None:
        """Draft level d."""
    step.__name__ = f"level {d}"
    return step


def name(step) -> str:
    return step if isinstance(step, str) else step.__name__


def steps_of(monkeypatch, tree=TREE, **given) -> list[str]:
    """The names of a TreeRound's steps, over `tree`, with `given` changed: those before the
    commit, then a greedy round's tail (its acceptance, commit and rollback) and what follows it."""
    monkeypatch.setattr(tree_round, "TreeKernels", Labels)

    def init(self, bufs, kernels, before_commit, fused_tail=None, **rest):
        """Round's: the steps before the commit, then (a greedy tail) the commit and what follows it."""
        tail = () if fused_tail is None else (lambda launch, then: (launch, *then))(*fused_tail(None))
        self.before_commit = (*before_commit(), *tail)
    monkeypatch.setattr(round_module.Round, "__init__", init)
    bufs = SimpleNamespace(engine=object())
    nodes = TreeBufs.__new__(TreeBufs)
    nodes.bufs, nodes.tree = bufs, tree
    args = dict(draft_levels=[level(d) for d in range(tree.depth + 1)], verify_tree=lambda: None,
                acceptance=Greedy(None), candidates=Candidates(None, None), rollback_tables=[],
                kv_data=SimpleNamespace(capacity=64))
    args.update(given)
    made = TreeRound(bufs, nodes, SimpleNamespace(), **args)
    return [name(step) for step in made.before_commit]


def test_a_draft_that_places_its_children_runs_its_levels_with_no_grow_between(monkeypatch):
    placed = steps_of(monkeypatch, draft_places=True, candidates=None)
    assert placed[:5] == ["begin", "level 0", "level 1", "level 2", "level 3"]
    assert placed[6:] == ["tail", "compact"] and not any(step.startswith("grow") for step in placed)
    grown = steps_of(monkeypatch)
    assert grown[:8] == ["begin", "level 0", "grow 1", "level 1", "grow 2", "level 2", "grow 3", "level 3"]
    assert grown[9:] == ["tail", "compact"]
    own = steps_of(monkeypatch, draft_places=True, candidates=None, kv_data=None, compact=level(9))
    assert own[5:] == ["<lambda>", "accept", "level 9"]  # a model's own compaction: the acceptance apart


@pytest.mark.parametrize("change, error, message", [
    (dict(tree=DynamicTree(2, 2, 2)), ValueError, "only a greedy static tree's draft places its own children"),
    (dict(acceptance=Sampling(None, None, None, 8)), ValueError, "only a greedy static tree's draft places"),
    (dict(candidates=Candidates(None, None)), ValueError, "a draft that places its own children offers no "
                                                          "candidates"),
    (dict(draft_places="True"), TypeError, "draft_places must be True or False, not 'True'"),
], ids=["dynamic", "sampled", "candidates", "a-string"])
def test_what_cannot_place_its_own_children_is_refused(monkeypatch, change, error, message):
    """A dynamic tree's children are weighed by kernel 11 and a sampled tree's drawn by kernel
    12: a round of either that left out the grows would verify whatever the last round left."""
    given = {"draft_places": True, "candidates": None, **change}
    with pytest.raises(error, match=message):
        steps_of(monkeypatch, **given)

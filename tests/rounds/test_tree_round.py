"""TreeRound's steps on the host (no driver: the stand-in kernels and buffers of
test_round_tail.py, each launch a Step named after its kernel, the model's steps by name): a
round grows every level between the draft's, unless its draft places a greedy static tree's
children itself (draft_places), and what cannot place its own children is refused before the
tree kernels are asked for."""
from __future__ import annotations

import pytest

from memra_cuda import DynamicTree, Greedy, Sampling, TreeShape
from memra_cuda.buffers import Candidates

from test_round_tail import PRED, TreeKernels, kv_data, model, names, tree_round_of

TREE = TreeShape.chain_with_leaves(3, 1)  # depth 3


def test_a_draft_that_places_its_children_runs_its_levels_with_no_grow_between(monkeypatch):
    placed, _ = tree_round_of(monkeypatch, Greedy(PRED), TREE, draft_places=True, candidates=None, kv_data=kv_data())
    assert names(placed.steps) == ["begin", "level0", "level1", "level2", "level3", "verify", "tree_round_tail",
                                   "compact"]
    assert placed.commit.name == "tree_round_tail"
    grown, _ = tree_round_of(monkeypatch, Greedy(PRED), TREE, kv_data=kv_data())
    assert names(grown.steps) == ["begin", "level0", "grow1", "level1", "grow2", "level2", "grow3", "level3", "verify",
                                  "tree_round_tail", "compact"]
    assert grown.commit.name == "tree_round_tail"
    # a model's own compaction: the acceptance a launch apart, before it
    own, _ = tree_round_of(monkeypatch, Greedy(PRED), TREE, draft_places=True, candidates=None,
                           compact=model("level9"))
    assert names(own.steps) == ["begin", "level0", "level1", "level2", "level3", "verify", "tree_accept", "level9",
                                "commit", "rollback"]


@pytest.mark.parametrize("change, error, message", [
    (dict(tree=DynamicTree(2, 2, 2)), ValueError, "only a greedy static tree's draft places its own children"),
    (dict(acceptance=Sampling(None, None, None, 8)), ValueError, "only a greedy static tree's draft places"),
    (dict(candidates=Candidates(None, None)), ValueError, "a draft that places its own children offers no "
                                                          "candidates"),
    (dict(draft_places="True"), TypeError, "draft_places must be True or False, not 'True'"),
], ids=["dynamic", "sampled", "candidates", "a-string"])
def test_what_cannot_place_its_own_children_is_refused(monkeypatch, change, error, message):
    """A dynamic tree's children are weighed by kernel 11 and a sampled tree's drawn by kernel
    12: a round of either that left out the grows would verify whatever the last round left.
    The refusal comes before the round asks for its tree kernels (a stand-in that fails if made)."""
    def asked(self, engine):
        raise AssertionError("the tree kernels were asked for before the refusal")
    monkeypatch.setattr(TreeKernels, "__init__", asked)
    given = {"acceptance": Greedy(PRED), "draft_places": True, "candidates": None, "kv_data": kv_data(), **change}
    with pytest.raises(error, match=message):
        tree_round_of(monkeypatch, **given)


@pytest.mark.parametrize(("draws", "error"), [(True, TypeError), (2.0, TypeError), (0, ValueError), (9, ValueError)])
def test_a_sampled_trees_draws_are_refused_naming_them_before_anything_is_allocated(draws, error):
    """SampledCandidates took draws=True as 1 draw (a bool passed its range test), refused only
    later by a launch's argument named R; its draws are checked where it is built, naming them,
    before the engine allocates (no engine needed to see it)."""
    from memra_cuda.buffers.layout import MAX_TREE_DRAWS
    from memra_cuda.kernels.tree import SampledCandidates
    assert MAX_TREE_DRAWS == 8
    with pytest.raises(error, match="a sampled node's draws \\(children\\) must be an int"):
        SampledCandidates(None, 1, 4, draws)  # type: ignore[arg-type]

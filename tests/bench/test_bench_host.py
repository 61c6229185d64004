"""The benchmarks' host-side pieces that hold without a GPU: what the trees section's picture
does where matplotlib (an optional extra) is missing, and what the capacity rule takes of a
round a bench measures, how the trees section is asked for in part, and how it tells a
batch's ideal from a row's."""
from __future__ import annotations

import argparse
import sys

import numpy as np
import pytest

from memra_cuda import DynamicTree, TreeShape
from benchmarks.common import depth_and_width
from benchmarks.torch_common import TREE_BATCHES, listed, plot_trees, reach, rows_share


def test_the_trees_picture_without_matplotlib_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    picture = tmp_path / "trees.png"
    plot_trees([dict(kind="best", size="small", batch=1, mode="greedy")], picture)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "matplotlib" in out and not picture.exists()


def test_a_chain_and_a_tree_tell_the_capacity_rule_their_depth_and_width():
    assert depth_and_width(4) == (4, 5)
    assert depth_and_width(DynamicTree(3, 4, 2)) == (3, 13)
    assert depth_and_width(TreeShape.from_choices([[0], [1], [0, 0]])) == (2, 4)


def test_the_trees_sections_parts_are_lists_of_known_names():
    assert listed("1,128", TREE_BATCHES, int) == [1, 128]
    assert listed("large", ("small", "large")) == ["large"]
    for text in ("2", "1,x", "", "1,1", "8,1,8"):  # one named twice ran twice: a B's whole measurement again
        with pytest.raises(argparse.ArgumentTypeError, match="comma-separated list of"):
            listed(text, TREE_BATCHES, int)
    with pytest.raises(argparse.ArgumentTypeError, match="small, large, each once, not 'medium'"):
        listed("medium", ("small", "large"))
    with pytest.raises(argparse.ArgumentTypeError, match="each once, not 'large,large'"):
        listed("large,large", ("small", "large"))


def test_the_rows_share_is_their_mean_rounds_over_the_slowest_rows_and_1_where_none_ran():
    assert rows_share([np.array([10, 8, 6])]) == pytest.approx(0.8)
    assert rows_share([np.array([7])]) == 1.0 and rows_share([np.zeros(4, np.int64)]) == 1.0


def test_a_batch_is_held_to_the_ideal_of_its_slowest_rows_rounds():
    # 2.4x plain against an ideal of 3x from each row's tau; the rows ran, on average, 80% of
    # the rounds of the slowest, which the whole batch ran: its own ideal is 2.4x
    got = reach(2.4, 3.0, 0.8)
    assert got["reached"] == pytest.approx(0.8) and got["batch_ideal"] == pytest.approx(2.4)
    assert got["batch_reached"] == pytest.approx(1.0) and got["vs_plain"] == 2.4
    assert reach(2.4, 3.0, 1.0)["batch_reached"] == pytest.approx(got["reached"])  # one row, or rows alike

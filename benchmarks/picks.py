"""The tree to verify for the random-weight Llamas of memra_cuda.torch.testing at each model size,
decoding and batch size, as `make bench-torch`'s trees section measured it on an H200: PICKED,
and tree_for_batch, which examples/torch_tree.py's `--tree auto` takes. The trees section
measures the picks again beside every chain and tree it tries; the headline derives a trained
pair's in the same form (benchmarks/RESULTS.md has both).

They are this benchmark's measurements, so they stay with it, out of the wheel: they hold for
those models on that machine alone, and an engine with a model of its own measures its own (or
names its tree). Needs torch and transformers (static_tree is the random-weight models').
"""
from __future__ import annotations

from typing import Literal

from memra_cuda.buffers.geometry import as_batch
from memra_cuda.buffers.tree import Tree, TreeShape
from memra_cuda.driver.values import as_flag
from memra_cuda.torch.testing import static_tree

PLAIN: Literal["plain"] = "plain"  # a pick's word for "do not speculate": GraphedGreedy, the target alone
Pick = Tree | None | Literal["plain"]  # a tree (TreeLlama), None for the chain (SpeculativeLlama), or PLAIN

# The tree per model size, decoding and batch size (None: the chain, SpeculativeLlama), from `make
# bench-torch`'s trees section on an H200: at each B, the fastest measured configuration, where a
# tree was faster than every chain measured in two runs of the section. Greedy, the large model's
# trees: static_tree(64, 10) 1.18-1.19x the best chain at B = 1, (32, 8) 1.12-1.18x at 8, (12, 6)
# 1.02-1.06x at 32, (6, 4) 1.09-1.10x at 128; the small model's, since a level leaves out its leaves
# (tree.expanded): chain_with_leaves(10, 2) 1.005-1.009x at B = 1, (6, 4) 1.03-1.04x at 128 (at 8
# and 32 a tree was ahead in one run only: the chain). Sampled, the chain at every B (the best tree
# 0.88-1.01x): tree_for_batch gives None. PLAIN where no chain or tree measured beat the graphed greedy
# target alone (none here: the trained pair's headline derives its own picks and prints them in this form).
PICKED: dict[str, dict[int, Pick]] = {
    "small": {1: TreeShape.chain_with_leaves(10, 2), 8: None, 32: None, 128: static_tree(6, 4)},
    "large": {1: static_tree(64, 10), 8: static_tree(32, 8), 32: static_tree(12, 6), 128: static_tree(6, 4)},
}


def tree_for_batch(size: str, batch: int, sampled: bool = False) -> Pick:
    """The tree to verify at `batch` rows of the `size` model, greedy or `sampled`, None where
    the chain is faster, or PLAIN where speculating at all is slower: the measured pick of the
    largest batch size measured not above `batch`; sampled, always None (no tree was ahead of the
    chain in two runs at any B). Each argument is checked first, `batch` as a decoder's (1 to
    MAX_BATCH): True was a batch of 1, 0 or -5 the smallest measured, 2.5 B = 1's, a size of
    none measured a KeyError, and sampled="no" the chain, whatever the size."""
    if not isinstance(size, str) or size not in PICKED:
        raise ValueError(f"size is one of {', '.join(map(repr, PICKED))}: the models measured, not {size!r}")
    batch = as_batch(batch)
    if as_flag(sampled, "sampled"):
        return None
    picks = PICKED[size]
    below = [b for b in picks if b <= batch]
    return picks[max(below)] if below else picks[min(picks)]

"""Sampled trees are exact (docs/sampling.md, "Trees"): 20 000 requests of one prompt, each its own
seed, two tokens each, through the toy's tree rounds on the GPU (the layer's draws, recursive
rejection sampling without replacement): the first token is distributed as the target's law at
the prompt, and the pair as that law times the target's law after the first token (chi-square at
significance 0.001), for a static and a dynamic tree, with a draft far from the target and one
close to it (a close draft hides a forgotten removal of rejected siblings below 0.5%), and with the
far draft at mixed draft lengths (each row capped at 0 to the depth, on the device)."""
from __future__ import annotations

import numpy as np
import pytest

from memra_cuda import Geometry
from memra_cuda import DynamicTree, StreamBufs, TreeShape, kv_capacity
from memra_cuda.buffers import DraftLengths
from memra_cuda.kernels import SpecKernels
from memra_cuda.testing.toy import lm as toy

from laws import assert_distributed_as, cells

pytestmark = pytest.mark.gpu

ROWS, BATCH, VOCAB = 20_000, 5_000, 20
PROMPT = [3, 1, 4, 1, 5]
TREES = {"static": TreeShape.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
         "dynamic": DynamicTree(depth=3, width=4, branch=3)}
FAR = (toy.ToyModel(seed=5, vocab=VOCAB, kv_mask=(True, False, True), noise_ppm=500_000),
       toy.ToySampling(temperature=0.7, floor=0.1, draft_temperature=2.0, draft_floor=0.5))
CLOSE = (toy.ToyModel(seed=5, vocab=VOCAB, kv_mask=(True, False, True), noise_ppm=0),
         toy.ToySampling(temperature=0.7, floor=0.1, draft_temperature=0.8, draft_floor=0.15))


@pytest.fixture(scope="module")
def spec(engine):
    return SpecKernels(engine)


def sample_pairs(engine, spec, model, sampling, tree, mixed: bool = False) -> np.ndarray:
    """[ROWS][2]: the first two tokens of ROWS requests of PROMPT, seeds 0..ROWS-1; `mixed`: each
    row's draft length capped at 0 to the depth in turn (DraftLengths at flat costs)."""
    capacity = kv_capacity(len(PROMPT), 2, Geometry.of_tree(tree, 1, BATCH))
    lm = toy.ToyLM(engine, model, capacity, batch=BATCH, sampling=sampling)
    bufs = StreamBufs(engine, Geometry.of_tree(tree, 1, BATCH))
    lengths = None
    if mixed:
        lengths = DraftLengths(bufs, [1.0] * (tree.depth + 1), 0.0)
        lengths.set_caps([row % (tree.depth + 1) for row in range(BATCH)])
    stream = lm.tree_round_stream(bufs, tree, kernels=spec, lengths=lengths)
    pairs = []
    for first in range(0, ROWS, BATCH):
        for row in range(BATCH):
            lm.prefill_row(bufs, row, PROMPT, seed=first + row)
        pairs += [tokens[:2].tolist() for tokens in stream.generate_batch(2, mode="graph")]
    bufs.free()
    return np.array(pairs, np.int64)


@pytest.mark.parametrize("draft", ["far", "close", "far, mixed lengths"])
@pytest.mark.parametrize("name", TREES)
def test_sampled_trees_commit_the_targets_law(engine, spec, name, draft):
    """Mixed lengths: the rows' caps 0 to the depth in turn, a capped row's bonus drawn from p
    itself where its walk stops at the cap."""
    model, sampling = FAR if draft.startswith("far") else CLOSE
    pairs = sample_pairs(engine, spec, model, sampling, TREES[name], mixed=draft.endswith("mixed lengths"))
    first = sampling.target_law(model, PROMPT)
    assert_distributed_as(pairs[:, 0], first, f"{name} tree, {draft} draft: first token")
    joint = np.concatenate([first[t] * sampling.target_law(model, PROMPT + [t]) for t in range(VOCAB)])
    cell = cells(joint, ROWS)
    law = np.bincount(cell, weights=joint)
    assert_distributed_as(cell[pairs[:, 0] * VOCAB + pairs[:, 1]], law, f"{name} tree, {draft} draft: pair")

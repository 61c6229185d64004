"""A tree's ancestor mask as SDPA's attention mask.

A tree round's nodes sit at slots pos_start + i of the static cache, siblings side by side, so
a node must attend to the committed prefix and to its own ancestors and to nothing else past
the root: not its siblings, not their subtrees, not the stale entries of earlier rounds.
TreeBufs gives the ancestors as bits (docs/trees.md); TreeMask turns them into SDPA's additive
mask over the whole cache.
"""
from __future__ import annotations

import numpy as np
import torch

from ..buffers.tree import DynamicTree, Tree, TreeShape
from ..driver.values import as_size
from .attention import MOST_SLOTS
from .models import is_float_dtype
from .stack import Compile, op_by_op


class TreeMask:
    """The attention mask of a tree's nodes for SDPA, [B][1][n][capacity] additive (0 where a node
    attends, -inf elsewhere, in `dtype`, the model's: SDPA would turn a boolean mask into this at
    every layer): node i attends to every slot before the root (the committed prefix) and to slot
    pos_start + j for each j in its ancestor mask (itself included).

    A round pays for it once where it can. `at(pos_start)`, at the round's first draft level,
    works out which slots lie before the root and which node each slot past it holds. A static
    tree's ancestors are the same every round (the layer grows the same mask_d), so its whole mask
    is made then, for the draft's levels and the verify alike; a dynamic tree's are known a level
    at a time, from TreeBufs.mask_d's words (`words`, [B][T+1][W] int32: node j at bit j % 32 of
    word j // 32), read as each level's mask is asked for. `compiled` runs that arithmetic
    (a decoder's is its draft stack's LayerStack.compiled: a kernel or two where op by op it was
    a dozen launches a round); left out, op by op.

    Refused as it is made, naming what is wrong: `words` that are no int32 tensor or not 3-D (a
    2-D one met a bare IndexError), a `capacity` that is no int from 1 to MOST_SLOTS (as_size: 2.5
    made 3 slots, True 1), a `tree` of more nodes than the words' 32W bits hold (a bare IndexError),
    or none at all, and a `dtype` that is no float of 2 bytes or more (TypeError: a bool one was
    taken, its -inf True, every slot attended)."""

    def __init__(self, words: torch.Tensor, capacity: int, dtype: torch.dtype, tree: Tree | None = None, *,
                 compiled: Compile = op_by_op):
        if not isinstance(words, torch.Tensor) or words.dtype != torch.int32:
            raise TypeError(f"TreeMask's words are mask_d's 32-bit words, an int32 tensor, not "
                            f"{words.dtype if isinstance(words, torch.Tensor) else type(words).__name__}")
        if words.dim() != 3:
            raise ValueError(f"TreeMask's words are [B][T+1][W], not {list(words.shape)}")
        capacity = as_size(capacity, "capacity", most=MOST_SLOTS)
        if not is_float_dtype(dtype):  # an int one met "cannot be converted ... without overflow" (-inf); a bool one
            # was taken, a mask whose -inf is True (attend) in a boolean mask, and float8_e4m3fn holds no -inf
            raise TypeError(f"TreeMask's dtype is a floating-point torch.dtype of 2 bytes or more (the model's: its 0 "
                            f"and -inf), not {dtype!r}")
        if tree is not None and not isinstance(tree, (TreeShape, DynamicTree)):  # its .nodes an AttributeError
            raise TypeError(f"TreeMask's tree is a TreeShape, a DynamicTree or None, not {tree!r}")
        self.words = words
        self.nodes = 32 * words.shape[2]
        if tree is not None and tree.nodes > self.nodes:
            raise ValueError(f"a tree of {tree.nodes} nodes takes {-(-tree.nodes // 32)} mask words a node, "
                             f"not the {words.shape[2]} TreeMask's words have")
        every = torch.arange(self.nodes, device=words.device)
        self.word, self.bit = every // 32, (every % 32).to(torch.int32)
        self.slots = torch.arange(capacity, device=words.device)
        self.zero = torch.zeros((), dtype=dtype, device=words.device)
        self.never = torch.full((), -torch.inf, dtype=dtype, device=words.device)
        self.ancestors: torch.Tensor | None = None
        if isinstance(tree, TreeShape):  # [1][T+1][32W], mask_d's bits as bools: row i node i's ancestors
            mask = tree.fixed_fields()["mask"]  # [T+1][W'] u32, W' <= W: node j at bit j % 32 of word j // 32
            bit = np.arange(32 * mask.shape[1])
            ancestors = torch.zeros(tree.nodes, self.nodes, dtype=torch.bool)
            ancestors[:, :bit.size] = torch.from_numpy((mask[:, bit // 32] >> (bit % 32).astype(np.uint32)) & 1 != 0)
            self.ancestors = ancestors[None].to(words.device)
        self._round, self._level = compiled(round_part), compiled(level_mask)

    def at(self, pos_start: torch.Tensor) -> TreeMask:
        """The round's part, for roots at slot `pos_start` ([B][1])."""
        self.prefix, self.inside, self.node, whole = self._round(self.slots, pos_start, self.nodes, self.ancestors,
                                                                 self.zero, self.never)
        if whole is not None:
            self.whole = whole
        return self

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """The mask of nodes start..stop (after at() this round), [B][1][stop - start][capacity]."""
        if self.ancestors is not None:
            return self.whole[:, :, start:stop]
        return self._level(self.words[:, start:stop], self.word, self.bit, self.node, self.prefix, self.inside,
                           self.zero, self.never)


def round_part(slots: torch.Tensor, pos_start: torch.Tensor, nodes: int, ancestors: torch.Tensor | None,
               zero: torch.Tensor, never: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """TreeMask.at's arithmetic for roots at `pos_start` ([B][1]) of a cache of `slots`: which slots
    lie before the root (`prefix`, [B][1][capacity]), which hold the round's nodes (`inside`,
    likewise) and which node each slot past the root holds (`node`, [B][capacity]), and a static
    tree's whole mask from its `ancestors` (None for a dynamic tree's)."""
    relative = slots - pos_start  # [B][capacity]
    prefix = (relative < 0)[:, None, :]
    inside = ((relative >= 0) & (relative < nodes))[:, None, :]
    node = relative.clamp(0, nodes - 1)
    whole = None if ancestors is None else mask_of(ancestors.expand(len(pos_start), -1, -1), node, prefix, inside,
                                                   zero, never)
    return prefix, inside, node, whole


def level_mask(words: torch.Tensor, word: torch.Tensor, bit: torch.Tensor, node: torch.Tensor, prefix: torch.Tensor,
               inside: torch.Tensor, zero: torch.Tensor, never: torch.Tensor) -> torch.Tensor:
    """A dynamic tree's level's mask from its nodes' ancestor `words` ([B][n][W]) (TreeMask.rows)."""
    return mask_of(((words[..., word] >> bit) & 1).bool(), node, prefix, inside, zero, never)


def mask_of(bits: torch.Tensor, node: torch.Tensor, prefix: torch.Tensor, inside: torch.Tensor, zero: torch.Tensor,
            never: torch.Tensor) -> torch.Tensor:
    """The mask of n nodes whose ancestors are `bits` ([B][n][32W]), contiguous: SDPA's fused
    kernels refuse a mask whose rows are not, and would leave the math path alone."""
    tree = bits.gather(2, node[:, None, :].expand(-1, bits.shape[1], -1))  # [B][n][capacity]
    return torch.where(prefix | (tree & inside), zero, never)[:, None]

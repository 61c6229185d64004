"""How a compiled step's queries attend over a static cache: to what each row holds, and no more.

A round's forwards attend in three ways (the `attend` FusedLlama.forward takes):

- **a prefill** from position 0 attends causally over its own tokens' K and V, computed in the
  same forward: `causal`, SDPA with is_causal, the cache never read;
- **a decode step or a chain's verify** (T tokens a row at slots s_t, the draft's or the
  target's): query t attends to every slot <= s_t;
- **a tree's verify or a draft level** attends where an additive mask ([R][1][T][capacity],
  memra_cuda.torch.TreeMask's) is 0: the committed prefix and the node's ancestors.

For the last two, `flex` reads only the cache blocks a row can see: each row's blocks up to its
furthest slot, those wholly below its nearest slot (which every query sees: a chain's first
token, a tree's root, is every query's ancestor) taken whole, the others through the mask,
all worked out on the device from the slots inside the step (flex_attention's BlockMask), so a
row of 100 tokens in a cache of 4096 reads one block, not 32, and a captured graph follows the
rows as they grow. `sdpa` is the plain alternative: SDPA over the whole capacity under an
additive mask (what gpt-fast does), kept to measure against and for a CPU.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F

from ..driver.values import I32_MOST

Attention = Literal["flex", "sdpa"]
ATTENTIONS: tuple[Attention, ...] = ("flex", "sdpa")
BLOCK = 128  # flex_attention's block of queries and of cache slots (its default)


# The most slots a capacity may ask for: a row's lengths are i32 (KVLayer), and aligned() rounds up
# to whole blocks, so the most whole blocks an i32 counts (2**31 - 1 asked was a cache of 2**31)
MOST_SLOTS = I32_MOST // BLOCK * BLOCK


def aligned(capacity: int) -> int:
    """A compiled stack's capacity for one asked for: whole blocks, so that no block of the cache
    is cut short (flex_attention's kernels then never mask a block's tail)."""
    return -(-capacity // BLOCK) * BLOCK


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# flex_attention's kernel_options as sorted (name, value) pairs: a compiled step's argument, whose
# every value compiles apart (a dict's would not be one hashable constant)
FlexOptions = tuple[tuple[str, Any], ...]


def as_flex_options(options: Mapping[str, Any] | None) -> FlexOptions:
    """`options` (flex_attention's kernel_options, or None) as FlexOptions; TypeError naming
    flex_options where it is no mapping of names, so that a typo's kind fails here, not in a
    compile. Their values are torch's to judge, as its compile reads them."""
    if options is None:
        return ()
    if not isinstance(options, Mapping) or not all(isinstance(name, str) for name in options):
        raise TypeError(f"flex_options is a mapping of flex_attention's kernel_options by name, or None, "
                        f"not {options!r}")
    return tuple(sorted(options.items()))


def causal(scale: float, gqa: bool) -> Attend:
    """A prefill's attention: causal over its own K and V (q [R][H][T][d], k and v [R][H_kv][T][d];
    `gqa`: H_kv < H)."""
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
               cache_v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return attend


def block_counts(slots: torch.Tensor, seen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For each tile of BLOCK queries of each row ([R][T] tokens at `slots`): the leading blocks of
    the cache every query of the tile sees whole (flex_attention skips their mask) and the blocks
    it sees at all, [R][tiles] each. Causal (`seen` None), a block below the tile's first slot is
    seen whole; under a tree's mask (`seen`, [R][T][capacity] bools) only a block every query sees
    in full, read from the mask: the nodes of a level past a block boundary must not see their
    uncles in the block before, below their own slots."""
    rows, tokens = slots.shape
    tiles = -(-tokens // BLOCK)  # of queries: one below BLOCK tokens a row

    def tiled(t: torch.Tensor) -> torch.Tensor:  # [R][T][...] -> [R][tiles][BLOCK][...], the last query repeated
        return torch.cat([t, t[:, -1:].expand(rows, tiles * BLOCK - tokens, *t.shape[2:])], 1).view(
            rows, tiles, BLOCK, *t.shape[2:])
    padded = tiled(slots)
    if seen is None:
        whole = (padded.amin(-1) + 1) // BLOCK
    else:
        covered = seen.shape[-1] // BLOCK
        full = seen[..., :covered * BLOCK].reshape(rows, tokens, covered, BLOCK).all(-1)  # [R][T][blocks]
        whole = tiled(full).all(2).int().cumprod(-1).sum(-1)  # the leading blocks all of a tile sees whole
    return whole, padded.amax(-1) // BLOCK + 1


def masked(kind: Attention, slots: torch.Tensor, capacity: int, scale: float, gqa: bool, dtype: torch.dtype,
           mask: torch.Tensor | None = None, flex_options: FlexOptions = ()) -> Attend:
    """The attention of R rows of T tokens at `slots` ([R][T] int64, within the capacity) over the
    whole cache (every row of it, in order): to every slot <= a token's own, or where `mask`
    ([R][1][T][capacity]) is 0, or True for a bool one (SDPA's sense, as Stack reads it); `dtype`
    the queries' (SDPA's mask is made in it once, not cast in every layer); `flex_options`,
    flex_attention's kernel_options as (name, value) pairs (none: torch's own choice)."""
    if kind == "sdpa":
        if mask is None:
            mask = torch.zeros((), dtype=dtype, device=slots.device).where(
                torch.arange(capacity, device=slots.device) <= slots[..., None], -torch.inf)[:, None]
        bias = mask if mask.dtype == torch.bool else mask.to(dtype)  # a bool mask is SDPA's own sense

        def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
                 cache_v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, cache_k, cache_v, attn_mask=bias, scale=scale, enable_gqa=gqa)
        return sdpa
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    rows, tokens = slots.shape
    last = tokens - 1
    tree = None if mask is None else mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0  # [R][T][capacity]
    if tree is None:
        def visible(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return kv <= slots[b, q.clamp(max=last)]
    else:
        top = tree.shape[-1] - 1

        def visible(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return tree[b, q.clamp(max=last), kv.clamp(max=top)]
    blocks = -(-capacity // BLOCK)
    whole, seen = block_counts(slots, tree)
    tiles = whole.shape[1]
    every = torch.arange(blocks, device=slots.device)
    block_mask = BlockMask.from_kv_blocks(
        (seen - whole)[:, None].int(), (whole[..., None] + every).clamp(max=blocks - 1)[:, None].int(),
        whole[:, None].int(), every.expand(rows, 1, tiles, blocks).int(), BLOCK_SIZE=BLOCK, mask_mod=visible,
        seq_lengths=(tokens, capacity), compute_q_blocks=False)

    def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
             cache_v: torch.Tensor) -> torch.Tensor:
        out = flex_attention(q, cache_k, cache_v, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                             kernel_options=dict(flex_options) or None)
        assert isinstance(out, torch.Tensor)
        return out
    return flex


"""A Llama-family model's layers split over tensor-parallel ranks, Megatron's way.

Each rank keeps its share of every decoder layer: q, k, v, gate and up by their output rows (a
head's or a column's worth each), o and down by their input columns, their outputs summed over
the ranks. The sum is the caller's (`reduce`, in place on the current stream: memra_cuda.comm's
all-reduce on the decoder's stream, so that a captured burst holds it), so every rank's logits
are the same numbers and every rank accepts the same drafts. The embeddings, norms and head stay
whole. examples/torch_tp.py runs round-stream over such ranks (docs/nccl.md).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..driver.values import as_index
from .kv import head_size
from .state import has_recurrent


class Reduced(torch.nn.Module):
    """A row-parallel linear (o_proj, down_proj): this rank's input columns of the weight, its
    output summed over the ranks by `reduce`, in place."""

    def __init__(self, weight: torch.Tensor, reduce: Callable[[torch.Tensor], None]):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(x, self.weight)
        self.reduce(out)
        return out


def shard(model: Any, rank: int, world: int, reduce: Callable[[torch.Tensor], None]) -> None:
    """Keep rank `rank`'s share of every decoder layer of `model` (in place), its row-parallel
    outputs summed over the `world` ranks by `reduce`. The config then counts this rank's heads
    and MLP columns, as its caches are made from it (a self-speculative draft made after
    sharding shares both). Refused, with nothing changed, where `rank` is not one of the world,
    the ranks cannot share the heads and columns evenly, a layer is recurrent (its state is not
    split) or a row-parallel linear has a bias (it would be added once a rank), and where `reduce`
    is no function (TypeError)."""
    rank, world = as_index(rank, "rank"), as_index(world, "world")  # True was rank 1
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not one of a world of {world} ranks")  # its share would be empty
    if not callable(reduce):  # else every layer was split, the first forward meeting "object is not callable"
        raise TypeError(f"reduce is a function summing a tensor over the ranks in place (an all-reduce), "
                        f"not {reduce!r}")
    config = model.config
    heads, kv_heads, inner = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    if heads % world or kv_heads % world or inner % world:
        raise ValueError(f"{world} ranks cannot share {heads} heads, {kv_heads} KV heads and {inner} MLP columns "
                         "evenly")
    if has_recurrent(model.model.layers):
        raise ValueError("shard() splits attention layers: a recurrent layer's state is not split")
    if any(layer.self_attn.o_proj.bias is not None or layer.mlp.down_proj.bias is not None
           for layer in model.model.layers):
        raise ValueError("a row-parallel linear with a bias would add it once a rank")
    dim = head_size(config)

    def rows(linear: torch.nn.Linear, width: int) -> None:
        linear.weight = torch.nn.Parameter(linear.weight[rank * width:(rank + 1) * width].contiguous(),
                                           requires_grad=False)
        if linear.bias is not None:
            linear.bias = torch.nn.Parameter(linear.bias[rank * width:(rank + 1) * width].contiguous(),
                                             requires_grad=False)

    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        rows(attention.q_proj, heads // world * dim)
        rows(attention.k_proj, kv_heads // world * dim)
        rows(attention.v_proj, kv_heads // world * dim)
        cols = heads // world * dim
        attention.o_proj = Reduced(attention.o_proj.weight[:, rank * cols:(rank + 1) * cols], reduce)
        rows(mlp.gate_proj, inner // world)
        rows(mlp.up_proj, inner // world)
        mlp.down_proj = Reduced(mlp.down_proj.weight[:, rank * (inner // world):(rank + 1) * (inner // world)], reduce)
    config.head_dim = dim  # transformers 5 sets it; an older config would take it from the heads left
    config.num_attention_heads, config.num_key_value_heads = heads // world, kv_heads // world
    config.intermediate_size = inner // world

"""Tensor parallelism for the Llama of examples/torch_llama.py: ranks, one process a GPU, started
by torchrun, each holding its share of every layer (Megatron's split: q, k, v, gate and up by
their output rows, a head's or a column's worth each; o and down by their input columns, their
outputs all-reduced) and running the example's round-stream decoder over it.

The all-reduces are memra_cuda.comm's (docs/nccl.md), queued on the stream the model runs on:
inside a burst they are part of the graph torch captures, the graph holds the communicator, and
the communicator's watchdog bounds every readback of the decoder's engine. Every rank's logits
are the same all-reduced numbers, so every rank accepts the same drafts and takes the same host
decisions. torch.distributed (gloo, on the host) passes the communicator's id, nothing else.

    torchrun --nproc-per-node 2 examples/torch_tp.py [--size small|large] [--batch B] [--tokens 256]

checks, on every rank, that the sharded model's logits are the whole model's, that
round-stream's tokens in graph and overlap modes equal the ranks' own plain greedy decoding
(each step a torch graph; fp32, the small model: bf16 rounds a verify's GEMMs otherwise), and
that the ranks agree. The plain decoder's waits are torch's, which the watchdog does not time.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch_llama import (PROMPT, GraphedGreedy, RecurrentLayer, Request, SpeculativeLlama, build_model, capacity_for,
                         decoding_arguments, head_size, prompts)
from transformers import LlamaForCausalLM

from memra_cuda import Engine
from memra_cuda.torch import adapter as memra_torch
from memra_cuda.comm import Communicator, digest, nccl


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


def shard(model: LlamaForCausalLM, rank: int, world: int, reduce: Callable[[torch.Tensor], None]) -> None:
    """Keep rank `rank`'s share of every decoder layer of `model` (in place), its row-parallel
    outputs summed over the ranks by `reduce`; the embeddings, norms and head stay whole. The
    config then counts this rank's heads and MLP columns, as its caches are made from it."""
    config = model.config
    heads, kv_heads, inner = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    if heads % world or kv_heads % world or inner % world:
        raise ValueError(f"{world} ranks cannot share {heads} heads, {kv_heads} KV heads and {inner} MLP columns "
                         "evenly")
    if any(isinstance(layer, RecurrentLayer) for layer in model.model.layers):
        raise ValueError("the example shards attention layers: a recurrent layer's state is not split")
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


class TensorParallel:
    """This rank's communicator and the engines its all-reduces queue on, one a torch stream the
    model runs on (a decoder's, given by `watch`; any other, made when first met, which is in a
    step run before any capture): `reduce` sums a tensor over the ranks on the current stream."""

    def __init__(self, rank: int, world: int, device: int, timeout: float = 30.0):
        unique_id = [nccl().unique_id() if rank == 0 else None]
        dist.broadcast_object_list(unique_id, src=0)
        self.comm = Communicator(Engine(device), rank, world, unique_id[0], timeout=timeout)
        self.engines: dict[int, Engine] = {}

    def watch(self, engine: Engine) -> None:
        """The all-reduces on `engine`'s stream queue through it: its graphs hold the
        communicator, its waits are timed."""
        self.engines[engine.stream_handle] = engine

    def reduce(self, tensor: torch.Tensor) -> None:
        stream = torch.cuda.current_stream()
        engine = self.engines.get(stream.cuda_stream)
        if engine is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("an all-reduce captured on a stream no engine was made for before: its graph "
                                   "would not hold the communicator (watch() the decoder's engine, or run a step "
                                   "on the stream before capturing it)")
            engine = self.engines[stream.cuda_stream] = memra_torch.engine(stream)
        bf16 = tensor.dtype == torch.bfloat16
        buf = memra_torch.buffer(tensor.view(torch.int16) if bf16 else tensor)
        self.comm.all_reduce(buf, dtype="bfloat16" if bf16 else None, engine=engine)


def main(argv: list[str] | None = None) -> int:
    args = decoding_arguments(__doc__.split("\n")[0]).parse_args(argv)
    dist.init_process_group("gloo")  # the host's side: the communicator's id
    rank, world, device = dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(device)
    model = build_model(args.size)  # the same random weights on every rank (one seed)
    probe = torch.tensor([PROMPT], device="cuda")
    with torch.no_grad():
        whole = model(probe).logits.float()
        tp = TensorParallel(rank, world, device)
        shard(model, rank, world, tp.reduce)
        drift = float((model(probe).logits.float() - whole).abs().max() / whole.abs().max())
    batch = [PROMPT] if args.batch == 1 else prompts(args.batch)
    requests = [Request(prompt, args.tokens) for prompt in batch]
    capacity = capacity_for(max(map(len, batch)), args.tokens, args.k, args.m_rounds, args.batch)
    want = GraphedGreedy(model, capacity, args.batch).generate_batch(requests)
    spec = SpeculativeLlama(model, k=args.k, m_rounds=args.m_rounds, capacity=capacity, batch=args.batch,
                            on_engine=tp.watch)
    got = {mode: spec.generate_batch(requests, mode) for mode in ("graph", "overlap")}
    spec.engine.synchronize()  # an overlapped burst may still run: no other stream's all-reduce meanwhile
    # RanksDiverged on every rank where the ranks' tokens differ, plain or round-stream's
    tp.comm.agree(digest(want + got["graph"] + got["overlap"]), "the ranks' tokens")
    exact = model.dtype == torch.float32  # bf16's B(k+1)-row GEMMs round otherwise than B-row ones
    verdicts = ", ".join(f"{mode} mode: {'yes' if tokens == want else 'NO'}" for mode, tokens in got.items())
    print(f"rank {rank} of {world}: {args.size} model, B={args.batch}, k={args.k}: the sharded model's logits are "
          f"the whole model's to {drift:.1e} of their largest; round-stream equals the ranks' plain greedy "
          f"decoding in {verdicts}{'' if exact else ' (bf16: not checked)'}", flush=True)
    ok = drift < (1e-4 if exact else 3e-2) and (not exact or all(tokens == want for tokens in got.values()))
    tp.comm.free()  # the graphs that captured it first (NCCL waits for them), then the communicator
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

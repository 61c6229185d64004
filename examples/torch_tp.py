"""Tensor parallelism for the Llama of examples/torch_llama.py: ranks, one process a GPU, started
by torchrun, each holding its share of every layer (memra_cuda.torch.shard, Megatron's split: q,
k, v, gate and up by their output rows, a head's or a column's worth each; o and down by their
input columns, their outputs all-reduced) and running memra_cuda.torch's round-stream decoder
over it, with a self-speculative draft of its first layer.

The all-reduces are memra_cuda.comm's (docs/nccl.md), queued on the stream the model runs on:
inside a burst they are part of the graph torch captures, the graph holds the communicator, and
the communicator's watchdog bounds every readback of the decoder's engine. Every rank's logits
are the same all-reduced numbers, so every rank accepts the same drafts and takes the same host
decisions. torch.distributed (gloo, on the host) passes the communicator's id, nothing else.

    torchrun --nproc-per-node 2 examples/torch_tp.py [--size small|large] [--batch B] [--tokens 256]
        [--k 4] [--m-rounds 16]

checks, on every rank, that the sharded model's logits are the whole model's, that
round-stream's tokens in graph and overlap modes equal the ranks' own plain greedy decoding
(each step a torch graph; fp32, the small model: bf16 rounds a verify's GEMMs otherwise), and
that the ranks agree. The plain decoder's waits are torch's, which the watchdog does not time.
Needs torchrun to start it, the `torch` and `nccl` extras and NVIDIA GPUs: without one of them,
says so in one line (exit status 1).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

if __package__:  # python -m examples.NAME: the examples' own modules beside it, as a script finds them
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import _needs  # before torch: says in one line, and exits, where torch or transformers is missing
from _cli import sizes
import torch
import torch.distributed as dist

import memra_cuda.torch as memra_torch
from memra_cuda import Geometry
from memra_cuda import Engine
from memra_cuda.comm import Communicator, NcclUnavailable, digest, nccl
from memra_cuda.torch.testing import PROMPT, SIZES, build_model, prompts
from memra_cuda.torch import GraphedGreedy, Request, SpeculativeLlama, capacity_for, self_draft, shard

RENDEZVOUS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what torchrun sets for env://, read by every rank


class TensorParallel:
    """This rank's communicator and the engines its all-reduces queue on, one a torch stream the
    model runs on (a decoder's, given by `watch`; any other, made when first met, which is in a
    step run before any capture): `reduce` sums a tensor over the ranks on the current stream."""

    def __init__(self, rank: int, world: int, device: int, timeout: float = 30.0):
        shared = [nccl().unique_id() if rank == 0 else None]
        dist.broadcast_object_list(shared, src=0)  # rank 0's id, on every rank
        unique_id = shared[0]
        assert unique_id is not None
        self.comm = Communicator(Engine(device), rank, world, unique_id, timeout=timeout)
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


def arguments(argv: list[str] | None) -> argparse.Namespace:
    """The random-weight model and the decoding every rank runs."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small", help="the random-weight Llama (default: "
                        "small, fp32, whose tokens are checked)")
    parser.add_argument("--batch", type=int, default=1, help="rows decoded together (default 1)")
    parser.add_argument("--tokens", type=int, default=256, help="new tokens a row (default 256)")
    parser.add_argument("--k", type=int, default=4, help="drafts a round (default 4)")
    parser.add_argument("--m-rounds", type=int, default=16, metavar="M", help="rounds a burst, M (default 16)")
    args = parser.parse_args(argv)
    sizes(parser, args)  # before torchrun's ranks build and shard a model each: a traceback on every rank after
    return args


def launched() -> None:
    """Exit with one line where this process is not a rank torchrun started: torch.distributed's
    rendezvous reads the rank, the world and rank 0's address from the variables torchrun sets."""
    unset = [name for name in RENDEZVOUS if name not in os.environ]
    if unset:
        _needs.refuse(f"its ranks are started by torchrun, which sets {', '.join(unset)} (not set here): "
                      f"torchrun --nproc-per-node 2 {shlex.join(sys.argv)}")


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    launched()
    _needs.gpu()
    try:
        nccl()
    except NcclUnavailable as exc:  # on every rank, before rank 0 would fail alone with the others waiting
        _needs.refuse(str(exc))
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
    capacity = capacity_for(max(map(len, batch)), args.tokens, Geometry(args.k, args.m_rounds, args.batch))
    want = GraphedGreedy(model, capacity, args.batch).generate_batch(requests)
    spec = SpeculativeLlama(model, self_draft(model), k=args.k, m_rounds=args.m_rounds, capacity=capacity,
                            batch=args.batch, on_engine=tp.watch)  # the draft made after sharding: its caches too
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

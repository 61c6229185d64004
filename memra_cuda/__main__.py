"""`make demo`: speculative decoding of the toy model on the GPU, checked against the
target's own greedy output.

    python -m memra_cuda [--k 4] [--m-rounds 16] [--tokens 512] [--mode graph] [--eos ID]
"""
from __future__ import annotations

import argparse
import sys
import time

from .buffers.stream_bufs import StreamBufs
from .driver.engine import Engine
from .driver.errors import CudaUnavailable
from .testing.toy.lm import ToyLM, ToyModel, target_greedy
from .buffers.capacity import kv_capacity
from .rounds.stream import MODES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memra_cuda", description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, default=4, help="draft tokens per round")
    parser.add_argument("--m-rounds", type=int, default=16, help="rounds per burst (per host readback)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens to generate (the budget)")
    parser.add_argument("--mode", choices=MODES, default="graph")
    parser.add_argument("--eos", type=int, default=None, help="stop after this token id")
    parser.add_argument("--prompt", type=int, nargs="+", default=[101, 2023, 2003, 1037, 3231])
    args = parser.parse_args(argv)
    model = ToyModel(seed=7, noise_ppm=100_000, p_min=0.05)
    try:
        engine = Engine()
    except CudaUnavailable as exc:  # no driver or no GPU: one line, no traceback
        print(f"memra_cuda: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    with engine:
        capacity = kv_capacity(len(args.prompt), args.tokens, args.k, args.m_rounds, args.mode == "overlap")
        lm = ToyLM(engine, model, capacity)
        bufs = StreamBufs(engine, args.k, args.m_rounds)
        stream = lm.round_stream(bufs)
        lm.prefill(bufs, args.prompt)
        stream.generate(args.tokens, eos=args.eos, mode=args.mode)  # warm-up
        lm.prefill(bufs, args.prompt)  # also zeroes the acceptance counters
        readbacks0 = engine.readbacks
        t0 = time.perf_counter()
        tokens = stream.generate(args.tokens, eos=args.eos, mode=args.mode).tolist()
        seconds = time.perf_counter() - t0
        readbacks = engine.readbacks - readbacks0
        accepted, drafted = bufs.drafts_accepted(len(tokens))
    want = target_greedy(model, args.prompt, args.tokens, args.eos)
    print(f"prompt     {args.prompt}")
    print(f"generated  {len(tokens)} tokens: {tokens[:24]}{' ...' if len(tokens) > 24 else ''}")
    print(f"mode       {args.mode}, k={args.k}, M={args.m_rounds}")
    if args.k:
        print(f"acceptance {accepted / drafted:.1%} of drafted tokens ({accepted} of {drafted})")
    print(f"readbacks  {readbacks} ({len(tokens) / max(readbacks, 1):.1f} tokens per host readback)")
    print(f"speed      {len(tokens) / seconds:,.0f} tokens/s")
    print(f"matches the target's greedy output: {'yes' if tokens == want else 'NO'}")
    return 0 if tokens == want else 1


if __name__ == "__main__":
    sys.exit(main())

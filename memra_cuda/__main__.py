"""Speculative decoding of the toy model on this machine's GPU (`make demo`, `memra-cuda-demo`),
checked token for token against the target's own greedy output.

The toy (memra_cuda.testing.toy, docs/toy-model.md) is a hash model whose next token depends on
every KV entry, so a wrong position or rollback shows in the tokens; its draft is wrong at a
tenth of the positions. The demo decodes the prompt once untimed (compiling, capturing) and once
timed, then prints the tokens, the drafts accepted, the host readbacks, the speed and whether
the output matches. Exit status: 0 on a match, 1 on a mismatch or without a GPU (said in one
line, as the examples and benchmarks say it), 2 for an option out of range (the parser's, said
before any GPU work).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .buffers.capacity import i32_kv_capacity
from .buffers.geometry import Geometry
from .buffers.stream_bufs import ROW_VALUE_MOST, StreamBufs
from .driver.engine import Engine
from .driver.errors import CudaUnavailable
from .driver.values import as_size
from .rounds.stream import MODES
from .testing.toy.lm import ToyLM, ToyModel, target_greedy

PROMPT = [101, 2023, 2003, 1037, 3231]


def parser() -> argparse.ArgumentParser:
    """The demo's options, each with its help and default."""
    script = Path(sys.argv[0]).stem == "memra-cuda-demo"  # the wheel's script: its usage names it, not -m
    cli = argparse.ArgumentParser(prog="memra-cuda-demo" if script else "python -m memra_cuda", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--k", type=int, default=4, help="draft tokens per round (default: %(default)s)")
    cli.add_argument("--m-rounds", type=int, default=16, metavar="M",
                     help="rounds per burst, between two host readbacks (default: %(default)s)")
    cli.add_argument("--tokens", type=int, default=512, help="tokens to generate (default: %(default)s)")
    cli.add_argument("--mode", choices=MODES, default="graph",
                     help="how the rounds are issued (docs/round-stream.md; default: %(default)s)")
    cli.add_argument("--eos", type=int, default=None, metavar="ID",
                     help="stop after this token id (default: none, the budget alone)")
    cli.add_argument("--prompt", type=int, nargs="+", default=PROMPT, metavar="ID",
                     help=f"the prompt's token ids (default: {' '.join(map(str, PROMPT))})")
    return cli


def main(argv: list[str] | None = None) -> int:
    cli = parser()
    args = cli.parse_args(argv)
    # Out of range is the parser's error (exit status 2), said before any engine is made: inside one,
    # Geometry's refusal of `--k -1` or `--m-rounds 0` was a traceback on a machine with a GPU.
    try:
        geometry = Geometry(args.k, args.m_rounds)
    except ValueError as exc:  # its errors name k and m_rounds: the options are --k and --m-rounds
        cli.error(f"--k {args.k} --m-rounds {args.m_rounds}: {exc}")
    model = ToyModel(seed=7, noise_ppm=100_000, p_min=0.05)
    overlap = args.mode == "overlap"
    try:
        as_size(args.tokens, "--tokens", 0, ROW_VALUE_MOST)  # the budget, a row's i32
        # the toy's tokens: past its vocabulary, its prefill (and target_greedy) refused them after the engine's work
        for token in (*args.prompt, *([] if args.eos is None else [args.eos])):
            as_size(token, "--prompt and --eos take the toy's token ids, each", 0, model.vocab - 1)
        # a cache's positions are i32s too: past them, ToyLM refused the capacity once the engine was made
        capacity = i32_kv_capacity(len(args.prompt), args.tokens, geometry, overlap=overlap, what="--tokens")
    except ValueError as exc:
        cli.error(str(exc))
    try:
        engine = Engine()
    except CudaUnavailable as exc:  # no driver or no GPU: one line, no traceback; 2 is the parser's, for the options
        print(f"memra_cuda: no GPU to run the demo on: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    with engine:
        lm = ToyLM(engine, model, capacity)
        bufs = StreamBufs(engine, geometry)
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
    if drafted:
        print(f"acceptance {accepted / drafted:.1%} of drafted tokens ({accepted} of {drafted})")
    print(f"readbacks  {readbacks} ({len(tokens) / max(readbacks, 1):.1f} tokens per host readback)")
    print(f"speed      {len(tokens) / seconds:,.0f} tokens/s")
    print(f"matches the target's greedy output: {'yes' if tokens == want else 'NO'}")
    return 0 if tokens == want else 1


if __name__ == "__main__":
    sys.exit(main())

"""A real transformer decoding through round-stream: a Llama-architecture model from
`transformers` and a draft of the same tokenizer serving a batch of requests on one PyTorch
stream, greedy or sampled, whole batches at once or continuously as requests come and go.

The models come from checkpoint directories (`--model DIR`, and `--draft DIR` for a draft model
of its own; transformers' from_pretrained, local files only), or are built with random weights
(`--size small|large`, nothing downloaded), whose layers past the first are scaled down so that
the self-speculative draft (the target's first `--draft-layers` layers and its head) agrees
with the target often but not always. Everything the decoder does is memra_cuda.torch's
(docs/torch.md): static KV caches of B rows registered as round-stream's KV tables, positions
read on the device, one-row prefill graphs, the serving loop.

The random model's hybrid variant (`--hybrid`) has a few of the target's layers a gated linear
recurrence, whose state round-stream rolls back in the same round, by copy or by flipping an
index (`--state-rollback copy|flip`); its reference is its own plain greedy decoding, as Hugging
Face cannot run the layer.

    python examples/torch_llama.py [--size small|large | --model DIR [--draft DIR] [--prompt TEXT]]
        [--batch B] [--serve N] [--tokens 256] [--k 4] [--m-rounds 16] [--mode graph] [--eos ID]
        [--temperature T --top-k K --top-p P] [--hybrid [--state-rollback copy|flip]]

Greedy in fp32 (the small random model, or `--dtype float32`), every row is checked against
Hugging Face's greedy decoding of its prompt alone. `make bench-torch` times the decoder. Needs
the `torch` extra and an NVIDIA GPU: without them, says so in one line (exit status 1).
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__:  # python -m examples.NAME: the examples' own modules beside it, as a script finds them
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import _needs  # before torch: says in one line, and exits, where torch or transformers is missing
from _cli import command_line, describe, finish, models, parse, requests

from memra_cuda.buffers import MAX_BATCH
from memra_cuda.torch import Room, SpeculativeLlama


def main(argv: list[str] | None = None) -> int:
    parser = command_line((__doc__ or "").split("\n\n")[0])
    parser.add_argument("--serve", type=int, metavar="N", default=None,
                        help=f"serve N requests continuously through the --batch slots, at most {MAX_BATCH} "
                        "(default: one batch, every row started together)")
    args, sampling = parse(parser, argv)
    if args.serve is not None and args.serve < 1:
        parser.error(f"--serve takes at least 1 request, not {args.serve}")
    if args.serve is not None and args.mode in ("overlap", "device"):
        parser.error("--serve runs in any mode but overlap and device (they keep two bursts in flight, or run a whole "
                     "generation in one launch)")
    # --serve's most is the largest batch's rows, what the example builds without it (one a row): every
    # request is built before the first runs (requests()), and --serve 10**9 built them till memory ran out
    if args.serve is not None and args.serve > MAX_BATCH:
        parser.error(f"--serve takes at most {MAX_BATCH} requests (a batch's most rows: each is built before the "
                     f"first runs), not {args.serve}")
    _needs.gpu()
    target, draft, tokenizer = models(args)
    queue = requests(args, tokenizer, args.serve)
    room = Room(max(len(r.prompt) for r in queue), args.tokens)  # sized by the decoder's k, M and B
    spec = SpeculativeLlama(target, draft, k=args.k, m_rounds=args.m_rounds, capacity=room, batch=args.batch,
                            sampling=sampling, state_rollback=args.state_rollback)
    if args.serve is None:
        got = spec.generate_batch(queue, args.mode)
        how = f"acceptance {spec.acceptance([len(row) for row in got]):.2f}"
    else:
        spec.capture((args.mode,))  # every graph before the first request, as a server does
        got = [served.tokens for served in spec.serve(queue, args.mode)]
        how = f"{len(queue)} requests served through {args.batch} slots"
    print(f"{describe(args)}, B={args.batch}, k={args.k}, M={args.m_rounds}, {args.mode}, "
          f"{'greedy' if sampling is None else sampling}: {sum(map(len, got))} tokens, {how}")
    return finish(args, tokenizer, target, queue, got, sampling, spec.target.kv.capacity)


if __name__ == "__main__":
    sys.exit(main())

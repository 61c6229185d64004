"""Trees on the Llama of examples/torch_llama.py: the same target and draft, but each round the
draft grows a tree of candidates through the layer (static or dynamic, docs/trees.md), the target
verifies all of its T + 1 nodes in one forward under the ancestor mask, and the layer commits the
path the target accepts and moves that path's K/V to consecutive slots in both models' static
caches (kernel 15), greedy or sampled, in every mode (memra_cuda.torch.TreeLlama).

`--tree auto` takes what `make bench-torch`'s trees section measured fastest on an H200 for the
random-weight model of `--size` at the batch size (tree_for_batch of the checkout's
benchmarks/picks.py), and refuses where the chain (examples/torch_llama.py) was faster; a loaded
model names its tree.

    python examples/torch_tree.py [--size small|large | --model DIR [--draft DIR] [--prompt TEXT]]
        [--batch B] [--tokens 256] [--tree auto|static:N[,DEPTH]|chain:K,LEAVES|dynamic:D,W,B]
        [--mode graph] [--temperature T ...] [--hybrid [--state-rollback copy|flip]]

Greedy in fp32, every row is checked against Hugging Face's greedy decoding of its prompt alone.
Needs the `torch` extra and an NVIDIA GPU: without them, says so in one line (exit status 1).
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__:  # python -m examples.NAME: the examples' own modules beside it, as a script finds them
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import _needs  # before torch: says in one line, and exits, where torch or transformers is missing
from _cli import command_line, describe, finish, models, parse, requests

from memra_cuda import Geometry
from memra_cuda.buffers.tree import Tree
from memra_cuda.torch import Room, TreeLlama
from memra_cuda.torch.testing import parse_tree


def measured_pick(size: str, batch: int, sampled: bool) -> Tree | str | None:
    """tree_for_batch of benchmarks/picks.py, in the checkout beside examples/: the picks are the
    benchmark's measurements on the random-weight models, kept with it, not in the wheel."""
    checkout = str(Path(__file__).resolve().parents[1])
    if checkout not in sys.path:
        sys.path.insert(0, checkout)
    from benchmarks.picks import tree_for_batch
    return tree_for_batch(size, batch, sampled)


def main(argv: list[str] | None = None) -> int:
    parser = command_line((__doc__ or "").split("\n\n")[0], k=False)
    parser.add_argument("--tree", default="static:16",
                        help='"static:N[,DEPTH]" (memra_cuda.torch.testing.static_tree), "chain:K,LEAVES" (a chain '
                        'with leaves), "dynamic:D,W,B" (DynamicTree) or "auto" (tree_for_batch of '
                        'benchmarks/picks.py: random-weight models) (default: %(default)s)')
    args, sampling = parse(parser, argv)
    tree: Tree | None
    if args.tree == "auto":
        if args.model is not None:
            parser.error("--tree auto is what was measured on the random-weight models: name a --tree")
        pick = measured_pick(args.size, args.batch, sampling is not None)
        decoding = "greedy" if sampling is None else "sampled"
        if pick is None:
            parser.error(f"at B={args.batch} the {args.size} model decodes {decoding} faster by the chain: "
                         "examples/torch_llama.py, or name a --tree")
        if isinstance(pick, str):  # PLAIN
            parser.error(f"at B={args.batch} the {args.size} model decodes {decoding} faster alone, not "
                         "speculated (memra_cuda.torch.GraphedGreedy), or name a --tree")
        tree = pick
    else:
        try:
            tree = parse_tree(args.tree)
        except ValueError as exc:  # named by the option: "size must be ..." named none; parse_tree knows no auto
            parser.error(f'--tree {args.tree}: {exc} (or "auto", the pick measured fastest)')
    try:  # the decoder's refusals, before any model is built: each was a traceback after it
        if sampling is not None:
            tree.check_sampled()
        Geometry.of_tree(tree, args.m_rounds, args.batch)
    except ValueError as exc:
        parser.error(f"--tree {args.tree}: {exc}")
    _needs.gpu()
    target, draft, tokenizer = models(args)
    queue = requests(args, tokenizer)
    room = Room(max(len(r.prompt) for r in queue), args.tokens)  # sized by the tree, M and B
    spec = TreeLlama(target, draft, tree, m_rounds=args.m_rounds, capacity=room, batch=args.batch,
                     sampling=sampling, state_rollback=args.state_rollback)
    got = spec.generate_batch(queue, args.mode)
    print(f"{describe(args)}, B={args.batch}, {tree}, {args.mode}, {'greedy' if sampling is None else sampling}: "
          f"{sum(map(len, got))} tokens, {spec.bufs.tokens_per_round([len(row) for row in got]):.2f} tokens a round")
    return finish(args, tokenizer, target, queue, got, sampling, spec.target.kv.capacity)


if __name__ == "__main__":
    sys.exit(main())

"""The PyTorch examples' command line, shared by examples/torch_llama.py and torch_tree.py: their
options (the models, random of a size or loaded from directories; the batch, budget, k and M;
the mode, sampling and the hybrid variant), what the options ask for (the models, the requests,
a line that names the models) and the check of a greedy fp32 run.

The examples' own module, not the wheel's: an engine of one's own has a command line of its own.
An example run as a script (python examples/NAME.py, from any directory) finds it beside itself,
after _needs, which says in one line what is missing where torch or transformers is.
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch

from memra_cuda import Geometry
from memra_cuda.buffers.stream_bufs import ROW_VALUE_MOST
from memra_cuda.rounds import MODES
from memra_cuda.torch import (GraphedGreedy, Request, SamplingParams, hf_greedy, load_model, load_tokenizer,
                              self_draft)
from memra_cuda.torch.models import DTYPES as DTYPE_NAMES
from memra_cuda.torch.models import check_model, check_tokenizer_directory, has_tokenizer
from memra_cuda.torch.testing import HYBRID, PROMPT, SIZES, VOCAB, build_model, prompts

DTYPES = {name: name if name == "auto" else getattr(torch, name) for name in DTYPE_NAMES}  # --dtype's


def command_line(description: str, k: bool = True) -> argparse.ArgumentParser:
    """The examples' shared options: the models (random of a size, or loaded from directories),
    the batch, budget, k (a chain's) and M, the mode, sampling and the hybrid variant."""
    parser = argparse.ArgumentParser(description=description)
    models = parser.add_argument_group("models")
    models.add_argument("--size", choices=sorted(SIZES), default="small",
                        help="the random-weight Llama to build when no --model is given (default: small, fp32)")
    models.add_argument("--model", metavar="DIR", help="load the target from a directory save_pretrained wrote")
    models.add_argument("--draft", metavar="DIR", help="load a draft model of the same tokenizer from a directory "
                        "(default: the target's first --draft-layers layers and its head)")
    models.add_argument("--draft-layers", type=int, default=1, metavar="N",
                        help="the self-speculative draft's layers (default 1)")
    models.add_argument("--dtype", choices=sorted(DTYPES), default="auto",
                        help="the loaded models' dtype (default: the checkpoint's; float32 checks greedy against "
                        "Hugging Face)")
    models.add_argument("--prompt", action="append", metavar="TEXT",
                        help="a prompt for a loaded model's tokenizer; the rows take them in turn (repeatable)")
    models.add_argument("--hybrid", action="store_true",
                        help=f"the random-weight model with layers {HYBRID} a gated linear recurrence, checked "
                        "against its plain greedy decoding")
    models.add_argument("--state-rollback", choices=["copy", "flip"], default="copy",
                        help="how the hybrid's recurrent state is rolled back (default: copy)")
    decoding = parser.add_argument_group("decoding")
    decoding.add_argument("--batch", type=int, default=1, metavar="B", help="rows decoded together (default 1)")
    decoding.add_argument("--tokens", type=int, default=256, metavar="N", help="new tokens a row (default 256)")
    if k:
        decoding.add_argument("--k", type=int, default=4, metavar="K", help="drafts a round (default 4)")
    decoding.add_argument("--m-rounds", type=int, default=16, metavar="M", help="rounds a burst, M (default 16)")
    decoding.add_argument("--mode", choices=MODES, default="graph", help="how bursts run (default: graph)")
    decoding.add_argument("--eos", type=int, default=None, metavar="ID",
                          help="stop a row at this token (default: a loaded tokenizer's EOS; none for random models)")
    decoding.add_argument("--temperature", type=float, default=None, metavar="T",
                          help="sample at this temperature (default: greedy)")
    decoding.add_argument("--top-k", type=int, default=0, metavar="K", help="sampling's top-k (default 0: off)")
    decoding.add_argument("--top-p", type=float, default=1.0, metavar="P", help="sampling's top-p (default 1: off)")
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace,
                                                                             SamplingParams | None]:
    """command_line's arguments and the sampling they ask for; options that do not go together
    are the parser's errors, as are --model and --draft where they name no model directory (found
    only after the GPU check, or after the target's weights had loaded, where its tokenizer was
    missing), and where load_model refuses them before any weight is made (config.json's fields,
    the weights' shapes and dtypes: load_model's check_model)."""
    args = parser.parse_args(argv)
    if args.state_rollback != "copy" and not args.hybrid:
        parser.error("--state-rollback is for the model with recurrent layers: add --hybrid")
    if args.model is None and (args.draft or args.prompt or args.dtype != "auto"):
        parser.error("--draft, --prompt and --dtype are for a loaded model: add --model DIR")
    if args.model is not None and args.hybrid:
        parser.error("--hybrid is the random-weight model's variant: leave out --model")
    # load_model's checks and load_tokenizer's, said here (a draft's tokenizer is its target's: it may have none)
    for flag, directory, checks in (("--model", args.model, (check_model, check_tokenizer_directory)),
                                    ("--draft", args.draft, (check_model,))):
        try:
            for check in checks if directory is not None else ():
                check(directory)
        except (FileNotFoundError, ValueError, TypeError) as exc:  # a config.json's field, a tensor's shape
            parser.error(f"{flag}: {exc}")
    if args.draft_layers < 1:
        parser.error(f"--draft-layers takes at least one layer, not {args.draft_layers}")
    if args.model is None:  # the random model's layers and vocabulary are known now, before it is built
        most = min(HYBRID) if args.hybrid else SIZES[args.size]["num_hidden_layers"] - 1
        if args.draft_layers > most:
            parser.error(f"--draft-layers takes at most {most} of the {args.size} model's layers (the draft's are "
                         f"the target's first{', before its recurrent ones' if args.hybrid else ''}), "
                         f"not {args.draft_layers}")
        if args.eos is not None and args.eos >= VOCAB:
            parser.error(f"--eos is a token id of the random model's vocabulary (0 to {VOCAB - 1}), not {args.eos}")
    sizes(parser, args)
    if args.eos is not None and args.eos < 0:
        parser.error(f"--eos is a token id (0 or more), not {args.eos}")
    if args.temperature is None and (args.top_k != 0 or args.top_p != 1.0):
        parser.error("--top-k and --top-p shape sampling, and without --temperature the decoding is greedy: "
                     "add --temperature T")
    try:
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p) if args.temperature is not None else None
    except ValueError as exc:  # its errors name temperature, top_k and top_p: the options are these
        parser.error(f"--temperature {args.temperature} --top-k {args.top_k} --top-p {args.top_p}: {exc}")
    return args, sampling


def sizes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--batch, --tokens, --k (where the parser has it) and --m-rounds checked, the parser's error
    where one is wrong: here, before any model is built or loaded (a traceback from a decoder's
    refusal after). examples/torch_tp.py's too."""
    for name, least in (("batch", 1), ("tokens", 0), ("k", 1), ("m_rounds", 1)):
        if getattr(args, name, least) < least:
            parser.error(f"--{name.replace('_', '-')} takes at least {least}, not {getattr(args, name)}")
    try:  # their most: the rounds' shape (a tree's depth is its own, checked with the tree)
        Geometry(getattr(args, "k", 1), args.m_rounds, args.batch)
    except ValueError as exc:
        parser.error(f"--k, --m-rounds and --batch: {exc}")
    if args.tokens > ROW_VALUE_MOST:
        parser.error(f"--tokens takes at most {ROW_VALUE_MOST} (a row's budget is an i32), not {args.tokens}")


def models(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """The target, the draft and the tokenizer (None for random models) the arguments ask for. A
    draft directory's tokenizer, where it has one, must be the target's."""
    if args.model is None:
        target = build_model(args.size, draft_layers=args.draft_layers, recurrent_layers=HYBRID if args.hybrid else ())
        return target, self_draft(target, args.draft_layers), None
    dtype = DTYPES[args.dtype]
    target, tokenizer = load_model(args.model, dtype=dtype), load_tokenizer(args.model)
    if args.draft is None:
        return target, self_draft(target, args.draft_layers), tokenizer
    if has_tokenizer(args.draft) and load_tokenizer(args.draft).get_vocab() != tokenizer.get_vocab():
        raise SystemExit(f"the draft in {args.draft} has another tokenizer than the target in {args.model}")
    return target, load_model(args.draft, dtype=dtype), tokenizer


def requests(args: argparse.Namespace, tokenizer: Any, count: int | None = None) -> list[Request]:
    """`count` requests (default: a row each): PROMPT (one) or prompts() of 2 to 40 random tokens
    for a random model; the --prompt texts in turn (default, a line of Python) for a loaded one,
    which stops at its tokenizer's EOS unless --eos says another. Each samples with its own seed.
    A --prompt the tokenizer makes no tokens of ends the program naming it (SystemExit)."""
    count = args.batch if count is None else count
    if tokenizer is None:
        batch = [PROMPT] if count == 1 else prompts(count)
        return [Request(prompt, args.tokens, args.eos, seed) for seed, prompt in enumerate(batch)]
    texts = args.prompt or ["def fibonacci(n):\n"]
    eos = args.eos if args.eos is not None else tokenizer.eos_token_id
    encoded = [tokenizer.encode(text) for text in texts]
    for text, tokens in zip(texts, encoded):  # a decoder refused it, a traceback once the models had loaded
        if not len(tokens):
            raise SystemExit(f"--prompt {text!r} is no tokens to the tokenizer of {args.model}: a prompt holds at "
                             "least one")
    return [Request(encoded[i % len(texts)], args.tokens, eos, i) for i in range(count)]


def describe(args: argparse.Namespace) -> str:
    """The models the arguments asked for, in a line."""
    if args.model is not None:
        return f"{args.model} with draft {args.draft or f'the first {args.draft_layers} layer(s)'}"
    hybrid = f", hybrid (layers {HYBRID} recurrent, state by {args.state_rollback})" if args.hybrid else ""
    return f"random-weight {args.size} model{hybrid}"


def finish(args: argparse.Namespace, tokenizer: Any, target: Any, requests: Sequence[Request], got: list[list[int]],
           sampling: SamplingParams | None, capacity: int) -> int:
    """The first request's output (its text where a tokenizer is loaded, else its first ids),
    then the exit status: a greedy fp32 run's check_greedy, 0 for any other."""
    print(repr(tokenizer.decode(got[0])) if tokenizer is not None else got[0][:32])
    if target.dtype == torch.float32 and sampling is None:
        return check_greedy(target, requests, got, capacity, args.hybrid)
    return 0


def check_greedy(model: Any, requests: Sequence[Request], got: list[list[int]], capacity: int, hybrid: bool) -> int:
    """The exit status of a greedy fp32 run: whether every row equals Hugging Face's greedy
    decoding of its prompt alone (a hybrid model's own plain greedy decoding, which Hugging Face
    cannot run), printed."""
    if hybrid:
        want = GraphedGreedy(model, capacity, len(requests)).generate_batch(requests)
        reference = "its own plain greedy decoding"
    else:
        want = [hf_greedy(model, r.prompt, r.max_new_tokens, r.eos) for r in requests]
        reference = "Hugging Face greedy on its own prompt"
    same = got == want
    print(f"every row equals {reference}: {'yes' if same else 'NO'}")
    return 0 if same else 1

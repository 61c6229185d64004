"""A server's soak (issue 48): thousands of requests through a decoder's slots, with random budgets,
EOS, cancellations and refused requests mixed in, checking what a server that runs for days must
keep:

- no request lost: every request submitted ends exactly once (served, cancelled or refused);
- device memory flat: once warm (after the first `warm_up` requests ran to their end), the
  device's memory in use moves by at most 1 % of what it held then;
- every checked request (a seeded sample of those that ran) is its own decoding alone: a
  cancelled one a prefix of it.

    PYTHONPATH=. python -m benchmarks.soak [--requests 5000] [--batch 64] [--checked 200] [--seed 48]
        [--json PATH]

On the GPU it serves memra_cuda.torch.testing's small random-weight Llama (fp32, its head scaled
so that its greedy tokens are clear winners) through SpeculativeLlama (its own first layer as the
draft, k = 4, M = 16, graph mode), every graph captured first, and checks requests against
GraphedGreedy of one row: the target's own greedy decoding, alone. It prints one verdict line and
exits non-zero where a check fails. The soak itself (soak(), check()) is host logic over any
memra_cuda.rounds.Decoder, which a CPU test drives with a decoder of plain Python.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memra_cuda.buffers.geometry import MAX_BATCH
from memra_cuda.driver.values import as_size
from memra_cuda.rounds.serving import Request, RequestRefused, Served, Server

from .needs import TORCH, needs
from .torch_common import writable

DRIFT = 0.01  # the most device memory may move once warm, as a share of what it held then


@dataclass(frozen=True)
class Mix:
    """What a soak's stream is made of: prompts of `prompt` tokens and budgets of `budget` (each a
    (fewest, most) drawn uniformly), an EOS for `eos` of the requests (a random token: most run to
    their budget, some stop early), `refused` of them malformed or too long for a row (half
    naming a token outside the vocabulary, half asking for `room` new tokens), `cancelled` of
    the others cancelled once their first tokens arrive, and `drafts` of them with a most draft
    length of their own, 0 (speculation off) to `most_draft`."""

    prompt: tuple[int, int] = (1, 48)
    budget: tuple[int, int] = (1, 256)
    eos: float = 0.25
    refused: float = 0.02
    cancelled: float = 0.05
    drafts: float = 0.2
    most_draft: int = 4


def soak_requests(count: int, vocab: int, room: int, seed: int, mix: Mix = Mix()) -> tuple[list[Request], set[int]]:
    """`count` requests as `mix` says, drawn by a generator seeded with `seed` (each its place as
    its sampling seed), and the places of those to cancel."""
    rng = np.random.default_rng(seed)
    requests, cancel = [], set()
    for place in range(count):
        prompt = rng.integers(0, vocab, int(rng.integers(mix.prompt[0], mix.prompt[1] + 1))).tolist()
        budget = int(rng.integers(mix.budget[0], mix.budget[1] + 1))
        eos = int(rng.integers(0, vocab)) if rng.random() < mix.eos else None
        fate = rng.random()
        if fate < mix.refused / 2:
            prompt[int(rng.integers(len(prompt)))] = vocab
        elif fate < mix.refused:
            budget = room
        elif fate < mix.refused + mix.cancelled:
            cancel.add(place)
        max_draft = int(rng.integers(0, mix.most_draft + 1)) if rng.random() < mix.drafts else None
        requests.append(Request(prompt, budget, eos, place, max_draft))
    return requests, cancel


@dataclass
class Soak:
    """What a soak found: each request's Served by its place in the stream (`served`), the places
    that never ended (`lost`) or ended twice (`twice`) or were refused at their admission once
    submit had taken them (`unadmitted`: a decoder's admission failing, which no request of the
    stream asks for), the device memory in use after each step once warm (`memory`, bytes), the
    steps run and the seconds they took."""

    served: dict[int, Served] = field(default_factory=dict)
    lost: list[int] = field(default_factory=list)
    twice: list[int] = field(default_factory=list)
    unadmitted: list[int] = field(default_factory=list)
    memory: list[int] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0

    @property
    def drift(self) -> float:
        """How far device memory moved once warm, as a share of what it held first (0 unmeasured)."""
        return (max(self.memory) - min(self.memory)) / self.memory[0] if self.memory else 0.0

    def counts(self) -> dict[str, int]:
        outs = self.served.values()
        return dict(requests=len(self.served) + len(self.lost), refused=sum(o.refused is not None for o in outs),
                    cancelled=sum(o.cancelled for o in outs), tokens=sum(len(o.tokens) for o in outs))


def soak(server: Server, requests: Sequence[Request], cancel: set[int], *, memory: Callable[[], int],
         warm_up: int, clock: Callable[[], float] = time.perf_counter) -> Soak:
    """Submit every request (a refused one ends there), then step `server` until it is idle,
    cancelling each request of `cancel` at the step after its first tokens arrive, and reading
    `memory` after every step once `warm_up` requests have ended in a step (refusals aside)."""
    out, place, ended, begun = Soak(), {}, 0, clock()
    for i, request in enumerate(requests):
        try:
            place[server.submit(request)] = i
        except RequestRefused as refused:
            now = clock()
            out.served[i] = Served([], now, None, [], now, refused=str(refused))
    while not server.idle:
        progress = server.step()
        out.steps += 1
        ended += len(progress.finished)
        for ident, served in progress.finished.items():
            if place[ident] in out.served:
                out.twice.append(place[ident])
            if served.refused is not None:
                out.unadmitted.append(place[ident])
            out.served[place[ident]] = served
        for ident in progress.tokens:
            if place[ident] in cancel and ident not in progress.finished:
                server.cancel(ident)
        if ended >= warm_up:
            out.memory.append(memory())
    out.seconds = clock() - begun
    out.lost = [i for i in range(len(requests)) if i not in out.served]
    return out


def check(found: Soak, requests: Sequence[Request], alone: Callable[[Request], list[int]], checked: int,
          seed: int) -> tuple[int, list[str]]:
    """A seeded sample of `checked` requests that ran (all of them where fewer ran), each against
    `alone` (its own decoding by itself): a served one equal to it, a cancelled one a prefix of
    it. The requests checked, and what differs, one line a request (none: all agree)."""
    ran = sorted(i for i, served in found.served.items() if served.refused is None)
    sample = np.random.default_rng(seed).choice(ran, min(checked, len(ran)), replace=False)
    wrong = []
    for i in sorted(int(i) for i in sample):
        got, want = found.served[i].tokens, alone(requests[i])
        if found.served[i].cancelled:
            want = want[:len(got)]
        if got != want:
            at = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            wrong.append(f"request {i}: {len(got)} tokens against {len(want)}, the first difference at {at}")
    return len(sample), wrong


def verdict(found: Soak, wrong: Sequence[str], checked: int) -> tuple[bool, str]:
    """Whether the soak held, and one line saying what it found."""
    counts = found.counts()
    held = (not found.lost and not found.twice and not found.unadmitted and not wrong and checked > 0
            and found.drift <= DRIFT and bool(found.memory))
    line = (f"soak: {'held' if held else 'FAILED'}: {counts['requests']} requests ({counts['refused']} refused, "
            f"{counts['cancelled']} cancelled), {counts['tokens']} tokens in {found.steps} steps, "
            f"{found.seconds:.1f} s; lost {len(found.lost)}, ended twice {len(found.twice)}, refused at their "
            f"admission {len(found.unadmitted)}; device memory "
            f"moved {100 * found.drift:.2f}% once warm (at most {100 * DRIFT:.0f}%, {len(found.memory)} readings); "
            f"{checked - len(wrong)} of {checked} checked requests their own greedy decoding alone")
    return held, line


def on_gpu(requests: int, batch: int, checked: int, seed: int) -> dict[str, Any]:
    """The soak on this GPU (the module's docstring): the decoder, the oracle, the verdict."""
    import torch
    from memra_cuda.torch import GraphedGreedy, Room, SpeculativeLlama, self_draft
    from memra_cuda.torch.testing import build_model
    k, m_rounds, mix = 4, 16, Mix()
    model = build_model("small", logit_scale=8.0)
    room = Room(mix.prompt[1], mix.budget[1])  # each decoder sizes its caches for it, by its own geometry
    spec = SpeculativeLlama(model, self_draft(model), k=k, m_rounds=m_rounds, capacity=room, batch=batch)
    stream, cancel = soak_requests(requests, model.config.vocab_size, spec.target.kv.capacity, seed, mix)
    spec.capture(("graph",))
    print(f"soak: a chain decoder of B = {batch}, k = {k}, M = {m_rounds}, ready in {spec.setup_seconds:.1f} s",
          flush=True)

    allocated: list[int] = []  # torch's own, beside the device's (its cache's reserve could hide a leak)

    def in_use() -> int:
        allocated.append(torch.cuda.memory_allocated())
        free, total = torch.cuda.mem_get_info()
        return total - free
    found = soak(spec.server("graph"), stream, cancel, memory=in_use, warm_up=2 * batch)
    oracle = GraphedGreedy(model, room, 1)
    checked, wrong = check(found, stream, lambda r: oracle.generate(r.prompt, r.max_new_tokens, eos=r.eos),
                           checked, seed)
    held, line = verdict(found, wrong, checked)
    print(line, *wrong[:10], sep="\n", flush=True)
    return dict(held=held, line=line, wrong=wrong, counts=found.counts(), drift=found.drift, steps=found.steps,
                seconds=found.seconds, memory_first=found.memory[:1], memory_last=found.memory[-1:],
                torch_allocated_first=allocated[:1], torch_allocated_last=allocated[-1:],
                device=torch.cuda.get_device_name(), batch=batch, k=k, m_rounds=m_rounds, seed=seed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--checked", type=int, default=200, help="requests checked against their decoding alone")
    p.add_argument("--seed", type=int, default=48)
    p.add_argument("--json", type=writable, metavar="PATH", help="write the findings here")
    args = p.parse_args(argv)
    # Said before the model is built: a --checked below 1 met numpy's refusal (or a verdict that could
    # only fail) after the whole soak, minutes of GPU time; a negative --seed numpy's, past the build.
    for name, least, most in (("requests", 1, None), ("batch", 1, MAX_BATCH), ("checked", 1, None),
                              ("seed", 0, None)):
        try:
            as_size(getattr(args, name), f"--{name}", least, most)
        except ValueError as exc:
            p.error(str(exc))
    needs("benchmarks.soak", TORCH, gpu=True)
    report = on_gpu(args.requests, args.batch, args.checked, args.seed)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["held"] else 1


if __name__ == "__main__":
    sys.exit(main())

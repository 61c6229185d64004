"""Prompts into a stack's static cache: one row as a CUDA graph per power-of-two length (2 the
least), several rows eagerly.

Continuous batching prefills a row at a time, and run eagerly a short prompt's prefill is
mostly the host launching kernels (10 ms against 1 ms on the GPU for the small random-weight
model), so a one-row prefill replays a graph captured once for its length's bucket. Several rows
run eagerly, padded to the longest. Neither is ever one token wide (LEAST_WIDTH): a width of one
would compile a step of its own (torch.compile specialises a size of one), where every wider
width shares one. A padding's entries, past its prompt, are rewritten before
any position reads them. Both kinds of stack (memra_cuda.torch.Stack, CompiledStack) prefill
through this, with a `fill` of their own.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..driver.values import as_listed, as_size, distinct_rows, token_ids
from .adapter import torch_graph
from .kv import StaticKV
from .uploads import uploaded

Fill = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
"""A stack's forward of R prompts from position 0: (tokens [R][W] int64, their cache rows [R],
their lengths [R] int32, the rest of each row padding) -> None; K and V land in the cache."""


# A prefill is never narrower: torch.compile specialises a size of one, so a prefill one token wide
# would be a whole model's compilation of its own, which no longer prompt reuses.
LEAST_WIDTH = 2


def bucket(length: int, capacity: int) -> int:
    """The width of the one-row prefill graph a prompt of `length` tokens replays: the power of
    two at least its length, LEAST_WIDTH the least, the capacity the most."""
    return min(max(LEAST_WIDTH, 1 << (length - 1).bit_length()), capacity)


class Prefills:
    """The prefills of a cache `kv` run by `fill`, and their graphs (`graphs`: a prompt length
    bucket -> its graph), of a model over `vocab` tokens. `reset`, where given, is called with the
    rows (a [R] device index) before their prompts go in (a hybrid stack's recurrent state starts
    from zero)."""

    def __init__(self, kv: StaticKV, fill: Fill, device: torch.device, vocab: int,
                 reset: Callable[[torch.Tensor], None] | None = None):
        self.kv, self.fill, self.device, self.reset = kv, fill, device, reset
        self.vocab = as_size(vocab, "vocab")
        self.prompt = torch.zeros(1, kv.capacity, dtype=torch.long, device=device)  # one row's
        self.row = torch.zeros(1, dtype=torch.long, device=device)
        self.length = torch.zeros(1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _check(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> tuple[list[int], list[np.ndarray]]:
        """The rows as ints and the prompts as the int64 copies that were checked (what is
        prefilled: a prompt read again could give other tokens, and numpy's uint64 met torch's
        promotion error), or a refusal, before a device index would assert or writes race:
        rows that are not distinct rows of the batch (a bool, a float or a 0-d tensor is no row:
        two tensors of row 0 were two rows to set()), one a prompt; a token that is not an int
        of the vocabulary (its embedding lookup would fault the device; a float was truncated).
        A prompt longer than the cache is _run's to refuse."""
        batch = self.kv.lengths.shape[1]
        rows = distinct_rows(rows, batch, "a prefill's rows")
        if len(rows) != len(prompts):
            raise ValueError(f"a prefill takes one prompt for each of distinct rows of 0..{batch - 1}, not rows "
                             f"{rows} and {len(prompts)} prompt(s)")
        checked = [token_ids(prompt, self.vocab, f"row {row}'s prompt").astype(np.int64)
                   for row, prompt in zip(rows, prompts)]  # first: len() of a generator or an int raised deep inside
        return rows, checked

    def run(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        """Each prompt's K and V at positions 0.. of its row; the row's lengths become the prompt's."""
        prompts = as_listed(prompts, "a prefill's prompts", "prompts, one a row")  # a dict's keys are no prompts
        self._run(*self._check(rows, prompts))

    def _run_trusted(self, rows: Sequence[int], heads: Sequence[Sequence[int]]) -> None:
        """run() of rows and prompts a decoder checked where its request entered (distinct rows
        of the batch, each prompt a sequence of ints of the vocabulary), not checked again: each
        prompt is only made the int64 array that is prefilled. The caller vouches for them (a
        token outside the vocabulary faults the device); checked here too, a 300-token prompt
        cost each stack's prefill ~40 us more."""
        self._run(rows, [np.asarray(head, np.int64) for head in heads])

    def _run(self, rows: Sequence[int], checked: list[np.ndarray]) -> None:
        """run() of checked rows and their prompts (int64, [length] each), a prompt longer than
        the cache refused before any row is touched."""
        longest = max((len(prompt) for prompt in checked), default=0)
        if longest > self.kv.capacity:
            raise ValueError(f"a prompt of {longest} tokens does not fit a cache of {self.kv.capacity}")
        if not rows:  # nothing to prefill
            return
        lengths = [len(prompt) for prompt in checked]
        index, counts = uploaded(rows, torch.long, self.device), uploaded(lengths, torch.int32, self.device)
        if self.reset is not None:
            self.reset(index)
        if len(rows) == 1 and lengths[0] and self.device.type == "cuda":
            self.prompt[0, :lengths[0]].copy_(torch.from_numpy(checked[0]), non_blocking=True)
            self.row.copy_(index)
            self.length.copy_(counts)
            self._graph(lengths[0]).replay()
        elif max(lengths, default=0):
            width = min(max(LEAST_WIDTH, *lengths), self.kv.capacity)
            padded = torch.zeros(len(checked), width, dtype=torch.long)
            for r, prompt in enumerate(checked):
                padded[r, :len(prompt)] = torch.from_numpy(prompt)
            self.fill(uploaded(padded, torch.long, self.device), index, counts)
        self.kv.lengths[:, index] = counts

    def _graph(self, length: int) -> torch.cuda.CUDAGraph:
        width = bucket(length, self.kv.capacity)
        if width not in self.graphs:
            self.fill(self.prompt[:, :width], self.row, self.length)  # torch's lazy set-up off the graph
            # Captured on the caller's stream (a decoder's: a tensor-parallel model's all-reduces
            # go on the stream they run on, examples/torch_tp.py); from the default stream, which
            # cannot be captured, on torch's own side stream. Kept once captured.
            current = torch.cuda.current_stream()
            with torch_graph(None if current == torch.cuda.default_stream() else current) as graph:
                self.fill(self.prompt[:, :width], self.row, self.length)
            self.graphs[width] = graph
        return self.graphs[width]

    def capture(self) -> None:
        """Every one-row prefill graph, now: a capture synchronises the device, so not while
        serving, and the warm-up before each writes scratch entries into a row."""
        length = LEAST_WIDTH
        while length < self.kv.capacity:
            self._graph(length)
            length *= 2
        self._graph(self.kv.capacity)  # the last bucket, the capacity itself

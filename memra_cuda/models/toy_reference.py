"""The toy run through the numpy reference: the round-stream loop on numpy buffers, the oracle of
the end-to-end tests (memra_cuda.reference is the tests' oracle; no production code imports it).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .. import reference as ref
from ..layout import CTL_DONE
from ..stream import kv_capacity
from .toy import M32, ToyModel, fmix, fmix_array, salt


class NumpyRoundStream:
    """Round-stream on numpy buffers: the toy's draft and verify, and reference.py for the rest.

    Same buffers, same round order, same clamps as on the GPU; the draft's KV stores
    E(t, j) and it recomputes the target's sums from them, as toy_lm.cu does.
    """

    def __init__(self, model: ToyModel, k: int, m_rounds: int, capacity: int):
        self.model, self.k, self.m, self.capacity = model, k, m_rounds, capacity
        self.ring_cap = m_rounds * (k + 1)
        u32 = lambda n: np.zeros(n, np.uint32)  # noqa: E731
        self.vtok, self.brk, self.pend, self.last_pred = u32(k + 1), u32(2), u32(1), u32(1)
        self.ring, self.acc, self.draft, self.pred = u32(self.ring_cap + 1), u32(2), u32(max(k, 1)), u32(k + 1)
        self.pos_ctr, self.pos_start = np.zeros(1, np.int32), np.zeros(1, np.int32)
        self.ctl = np.array([-1, -1, 0, 0], np.int32)
        self.tgt = [np.zeros(capacity, np.uint32) if kv else None for kv in model.kv_mask]
        self.tgt_len = [np.zeros(1, np.int32) if kv else None for kv in model.kv_mask]
        self.draft_kv, self.draft_len = np.zeros(capacity, np.uint32), np.zeros(1, np.int32)
        self.rounds = 0

    def prefill(self, prompt: Sequence[int]) -> int:
        n = len(prompt) - 1
        for j, token in enumerate(prompt[:-1]):
            e = self.model.embed(token, j)
            self.draft_kv[j] = e
            for layer, data in enumerate(self.tgt):
                if data is not None:
                    data[j] = fmix(e ^ salt(layer))
        for length in [*self.tgt_len, self.draft_len, self.pos_ctr]:
            if length is not None:
                length[0] = n
        self.pend[0] = prompt[-1]
        return n

    def draft_step(self, step: int) -> None:
        model, p = self.model, int(self.pos_ctr[0]) + step
        t = int(self.pend[0] if step == 0 else self.draft[step - 1])
        if step < self.k:
            history = sum(int(fmix_array(self.draft_kv[:p] ^ np.uint32(salt(layer))).sum(dtype=np.uint64))
                          for layer, kv in enumerate(model.kv_mask) if kv)
            pred = model.predict(history & M32, t, p)
            self.draft[step] = (pred + 1) % model.vocab if model.draft_noisy(p) else pred
            if model.draft_breaks(p) and self.brk[0] == 0:
                self.brk[0] = step + 1
        self.draft_kv[p] = model.embed(t, p)
        self.draft_len[0] = p + 1

    def verify(self) -> None:
        model, pos = self.model, int(self.pos_start[0])
        history = sum(int(data[:pos].sum(dtype=np.uint64)) for data in self.tgt if data is not None) & M32
        for i, t in enumerate(int(x) for x in self.vtok):
            self.pred[i] = model.predict(history, t, pos + i)
            history = (history + model.kv_entries(t, pos + i)) & M32
            e = model.embed(t, pos + i)
            for layer, data in enumerate(self.tgt):
                if data is not None:
                    data[pos + i] = fmix(e ^ salt(layer))
        for length in self.tgt_len:
            if length is not None:
                length[0] = pos + self.k + 1

    def round(self) -> None:
        for step in range(self.k + 1):
            self.draft_step(step)
        ref.spec_assemble_verify(self.pend, self.draft, self.k, self.vtok, self.pos_ctr, self.pos_start)
        self.verify()
        ref.spec_accept_greedy_dc(self.vtok, self.pred, self.k, self.brk, self.acc, self.last_pred, self.ctl)
        ref.spec_ring_commit(self.vtok, self.acc, self.last_pred, self.ctl, self.pend, self.ring,
                             self.ring_cap, self.k)
        ref.spec_rollback_stream([*self.tgt_len, self.draft_len, self.pos_ctr], self.pos_start, self.ctl)
        self.rounds += 1

    def generate(self, prompt: Sequence[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
        pos = self.prefill(prompt)
        self.ctl[:] = [-1 if eos is None else eos, max_new_tokens, 0, 0]
        out: list[int] = []
        while not self.ctl[CTL_DONE]:
            if pos + len(out) + self.ring_cap > self.capacity:
                raise ValueError("numpy round stream: cache too small for the next burst")
            for _ in range(self.m):
                self.round()
            out += [int(t) for t in self.ring[1:1 + int(self.ring[0])]]
            self.ring[0] = 0
        return out


def speculative_generate(model: ToyModel, prompt: Sequence[int], k: int, max_new_tokens: int,
                         eos: int | None = None, m_rounds: int = 4) -> list[int]:
    """The whole speculative loop in numpy (see NumpyRoundStream)."""
    capacity = kv_capacity(len(prompt), max_new_tokens, k, m_rounds)
    return NumpyRoundStream(model, k, m_rounds, capacity).generate(prompt, max_new_tokens, eos)

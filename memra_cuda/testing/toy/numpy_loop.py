"""The toy run through the numpy reference: the whole round-stream loop on numpy buffers, chain
(NumpyRoundStream, speculative_generate) and tree (NumpyTreeRoundStream, tree_speculative_generate),
the toy's draft and verify in numpy and memra_cuda.testing.reference / reference_tree for the
layer's kernels. What the toy on the GPU (ToyLM) must match, buffer for buffer: the oracle of the
end-to-end tests, and of a user's own kernels run in the toy's place.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np

from .. import reference as ref
from .. import reference_tree as ref_tree
from ...buffers.layout import CTL_DONE, ROOT_PARENT
from ...buffers.capacity import Capacity, kv_capacity
from ...buffers.geometry import Geometry
from ...buffers.tree import DynamicTree, Tree
from ...buffers.stream_bufs import ROW_VALUE_MOST
from ...driver.values import as_prompt, as_size, longest_prompt_for
from .lm import M32, STATE_ROLLBACKS, ToyModel, as_candidates, as_toy_model, fmix, fmix_array, live_slot, salt


class NumpyStates:
    """One model's recurrent states laid out as ToyLM lays them out, for one sequence: per
    recurrent layer a live state of `state_words` and k + 1 slots (COPY), or 2(k + 1) slots and
    the model's one slot index (FLIP; docs/model-side.md, "Recurrent state")."""

    def __init__(self, model: ToyModel, k: int, state_rollback: str):
        if state_rollback not in STATE_ROLLBACKS:
            raise ValueError(f"state_rollback must be one of {STATE_ROLLBACKS}, not {state_rollback!r}")
        self.k, self.words, self.flip = k, model.state_words, state_rollback == "flip"
        layers = len(model.rec_layers)
        self.slots = [np.zeros(((2 if self.flip else 1) * (k + 1), self.words), np.uint32) for _ in range(layers)]
        self.live_state = [np.zeros(self.words, np.uint32) for _ in range(0 if self.flip else layers)]
        self.idx = np.zeros(1, np.uint32)

    def live(self) -> np.ndarray:
        """The state the next round reads, [layers][words]: the live state, or slot idx (by
        kernel 9's bank rule)."""
        if not self.flip:
            return self._rows(self.live_state)
        return self._rows([slots[live_slot(int(self.idx[0]), self.k)] for slots in self.slots])

    def slot(self, i: int) -> np.ndarray:
        """Slot i of the bank this round writes (COPY: its only one), [layers][words]."""
        return self._rows([slots[self._written() + i] for slots in self.slots])

    def write(self, i: int, states: np.ndarray) -> None:
        for slots, state in zip(self.slots, states):
            slots[self._written() + i] = state

    def start(self, states: np.ndarray) -> None:
        """A new request's state: live (COPY), or slot 0 with idx 0 (FLIP)."""
        self.idx[0] = 0
        for layer, state in enumerate(states):
            (self.slots[layer][0] if self.flip else self.live_state[layer])[:] = state

    def roll_back(self, ctl: np.ndarray) -> None:
        """Kernel 8 or 9 on this model's states, as ToyLM's state table has them."""
        if self.flip:
            ref.spec_state_flip([self.idx], self.k, ctl)
        else:
            ref.spec_state_copy([(live, slots, self.words) for live, slots in zip(self.live_state, self.slots)],
                                self.k, ctl)

    def roll_back_tree(self, t: ref_tree.TreeArrays, ctl: np.ndarray) -> None:
        """Kernel 16 or 17 on this model's states (a tree's: k + 1 = T + 1 slots a bank), the
        kept slot the accepted path's last node."""
        if self.flip:
            ref_tree.spec_tree_state_flip([self.idx], self.k + 1, t, ctl, t.depth_max)
        else:
            table = [(live, slots, self.words) for live, slots in zip(self.live_state, self.slots)]
            ref_tree.spec_tree_state_copy(table, self.k + 1, t, ctl, t.depth_max)

    def _written(self) -> int:
        """The first slot of the bank this round writes: the other one than idx's (FLIP)."""
        return (1 - int(live_slot(int(self.idx[0]), self.k)) // (self.k + 1)) * (self.k + 1) if self.flip else 0

    def _rows(self, rows: list[np.ndarray]) -> np.ndarray:
        return np.array(rows, np.uint32).reshape(len(self.slots), self.words)


class NumpyRoundStream:
    """Round-stream on numpy buffers: the toy's draft and verify, and testing.reference for the rest.

    Same buffers, same round order, same clamps as on the GPU; the draft's KV stores
    E(t, j) and it recomputes the target's sums from them, as toy_lm.cu does, and it keeps its
    own copy of the target's recurrent states, rolled back as the target's are (`state_rollback`).
    Its rounds' shape is `geometry` (k, M, one row, the width a round writes).
    """

    def __init__(self, model: ToyModel, k: int, m_rounds: int, capacity: int, state_rollback: str = "copy",
                 width: int | None = None):
        self._start(Geometry(k, m_rounds, 1, width), model, capacity, state_rollback)

    def _start(self, geometry: Geometry, model: ToyModel, capacity: int, state_rollback: str) -> None:
        """The buffers of rounds of `geometry` (checked as it was built: before the model and the
        capacity), whose k and M are kept as the plain ints it holds: numpy ints' arithmetic wraps
        (M a uint8 200 made a ring of 232 tokens, and a burst's past them were dropped, the output
        cut short silently)."""
        model = as_toy_model(model)
        self.geometry = geometry
        self.model, self.k, self.m, self.capacity = model, geometry.k, geometry.m_rounds, as_size(capacity, "capacity")
        k, self.ring_cap = self.k, self.m * (self.k + 1)
        # the rule generate() checks before each burst (`width`: what a round writes, a tree's T + 1)
        self.room = Capacity(self.capacity, geometry)
        u32 = lambda n: np.zeros(n, np.uint32)  # noqa: E731
        self.vtok, self.brk, self.pend, self.last_pred = u32(k + 1), u32(2), u32(1), u32(1)
        self.ring, self.acc, self.draft, self.pred = u32(self.ring_cap + 1), u32(2), u32(max(k, 1)), u32(k + 1)
        self.pos_ctr, self.pos_start = np.zeros(1, np.int32), np.zeros(1, np.int32)
        self.ctl = np.array([-1, -1, 0, 0], np.int32)
        self.tgt = [np.zeros(self.capacity, np.uint32) if kv else None for kv in model.kv_mask]
        self.tgt_len = [np.zeros(1, np.int32) if kv else None for kv in model.kv_mask]
        self.draft_kv, self.draft_len = np.zeros(self.capacity, np.uint32), np.zeros(1, np.int32)
        self.tgt_states = NumpyStates(model, k, state_rollback)
        self.draft_states = NumpyStates(model, k, state_rollback)
        self.rounds = 0

    def prefill(self, prompt: Sequence[int]) -> int:
        """The prompt but its last token into the caches (its last pending), as the toy's
        prefill_row: a prompt longer than they hold is refused by its length (it wrote the
        caches' slots, then met an IndexError)."""
        prompt = as_prompt(prompt, self.model.vocab, "the prompt", longest_prompt_for(self.capacity)).tolist()
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
        states = self.model.rec_states(prompt[:-1])
        self.tgt_states.start(states)
        self.draft_states.start(states)
        self.pend[0] = prompt[-1]
        return n

    def draft_step(self, step: int) -> None:
        model, p = self.model, int(self.pos_ctr[0]) + step
        t = int(self.pend[0] if step == 0 else self.draft[step - 1])
        states = model.recur(self.draft_states.live() if step == 0 else self.draft_states.slot(step - 1), t, p)
        self.draft_states.write(step, states)
        if step < self.k:
            history = sum(int(fmix_array(self.draft_kv[:p] ^ np.uint32(salt(layer))).sum(dtype=np.uint64))
                          for layer, kv in enumerate(model.kv_mask) if kv)
            pred = model.predict(history & M32, t, p, states)
            self.draft[step] = (pred + 1) % model.vocab if model.draft_noisy(p) else pred
            if model.draft_breaks(p):  # lowering the row's cap (a length chosen may stand lower)
                self.brk[0] = ref.tighter_mark(int(self.brk[0]), step + 1)
        self.draft_kv[p] = model.embed(t, p)
        self.draft_len[0] = p + 1

    def verify(self) -> None:
        model, pos = self.model, int(self.pos_start[0])
        history = sum(int(data[:pos].sum(dtype=np.uint64)) for data in self.tgt if data is not None) & M32
        states = self.tgt_states.live()
        for i, t in enumerate(int(x) for x in self.vtok):
            states = model.recur(states, t, pos + i)
            self.tgt_states.write(i, states)
            self.pred[i] = model.predict(history, t, pos + i, states)
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
        self.roll_back_states()
        self.rounds += 1

    def roll_back_states(self) -> None:
        """After the KV rollback, as RoundStream's state tables: the target's and the draft's."""
        self.tgt_states.roll_back(self.ctl)
        self.draft_states.roll_back(self.ctl)

    def generate(self, prompt: Sequence[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
        max_new_tokens, eos = stop_rule(max_new_tokens, eos)
        pos = self.prefill(prompt)
        self.ctl[:] = [-1 if eos is None else eos, max_new_tokens, 0, 0]
        out: list[int] = []
        while not self.ctl[CTL_DONE]:
            if self.room.burst_short(np.array([pos + len(out)]), np.zeros(1, bool), self.m).size:
                raise ValueError("numpy round stream: cache too small for the next burst")
            for _ in range(self.m):
                self.round()
            out += [int(t) for t in self.ring[1:1 + int(self.ring[0])]]
            self.ring[0] = 0
        return out


def stop_rule(max_new_tokens: int, eos: int | None) -> tuple[int, int | None]:
    """A row's budget and EOS as the GPU's stream checks them (stream_bufs.per_row): each an int
    from 0 to ROW_VALUE_MOST, the EOS or None. The ctl words' numpy cast read eos "3" as 3 and truncated
    2.9, raised a bare OverflowError at 2**31, truncated a budget of 2.5, and took -1 for none."""
    max_new_tokens = as_size(max_new_tokens, "max_new_tokens", 0, ROW_VALUE_MOST)
    return max_new_tokens, None if eos is None else as_size(eos, "eos", 0, ROW_VALUE_MOST, also="None")


def speculative_generate(model: ToyModel, prompt: Sequence[int], k: int, max_new_tokens: int,
                         eos: int | None = None, m_rounds: int = 4, state_rollback: str = "copy") -> list[int]:
    """The whole speculative loop in numpy (see NumpyRoundStream)."""
    model = as_toy_model(model)
    prompt = as_prompt(prompt, model.vocab, "the prompt").tolist()
    max_new_tokens, eos = stop_rule(max_new_tokens, eos)  # before a cache is sized for the budget
    capacity = kv_capacity(len(prompt), max_new_tokens, Geometry(k, m_rounds))
    return NumpyRoundStream(model, k, m_rounds, capacity, state_rollback).generate(prompt, max_new_tokens, eos)


class NumpyTreeRoundStream(NumpyRoundStream):
    """The tree round (docs/trees.md) on numpy buffers for one sequence, greedy: the toy's tree
    draft and verify (docs/toy-model.md, "Trees") and testing.reference_tree for the layer's
    kernels (begin, grow, accept, compact, state copy or flip), testing.reference for the
    commit and the rollback; the recurrent states have T + 1 slots a bank. `tree` is a TreeShape
    or a DynamicTree; the round's k is its depth D; `candidates` is K, each node's candidates."""

    def __init__(self, model: ToyModel, tree: Tree, m_rounds: int, capacity: int, candidates: int = 8,
                 state_rollback: str = "copy"):
        # the tree's geometry first (k its depth, width its T + 1 nodes): Geometry.of_tree refuses
        # what is no tree (a TypeError; None met "no attribute 'depth'")
        self._start(Geometry.of_tree(tree, m_rounds), model, capacity, state_rollback)
        self.tree, self.K, self.T1 = tree, as_candidates(candidates), self.geometry.width
        self.levels = list(tree.levels)
        self.t = ref_tree.TreeArrays.zeros(self.T1, self.k, 1)
        self.cand_tok = np.zeros(self.T1 * self.K, np.uint32)
        self.cand_logp = np.zeros(self.T1 * self.K, np.float32)
        self.pred = np.zeros(self.T1, np.uint32)
        self.tgt_states = NumpyStates(model, self.T1 - 1, state_rollback)
        self.draft_states = NumpyStates(model, self.T1 - 1, state_rollback)
        if isinstance(tree, DynamicTree):
            self.grow = partial(ref_tree.spec_tree_grow, width=tree.width, branch=tree.branch)
        else:
            self.grow = partial(ref_tree.spec_tree_grow, shape_rank=np.array(tree.rank, np.uint32),
                                shape_parent=np.array([ROOT_PARENT, *tree.parent[1:]], np.uint32))
        self.accepted: list[int] = []  # the drafts each live round accepted

    def _node_states(self, states: NumpyStates, c: int, parent: int, before: int) -> np.ndarray:
        """Node c's recurrent states: its parent's slot moved on by its token (from the round's
        state where the parent is not before `before`: node 0, or garbage)."""
        r = self.t.row(0)
        prev = states.slot(parent) if parent < before else states.live()
        new = self.model.recur(prev, int(r.tok[c]), int(r.pos[c]))
        states.write(c, new)
        return new

    def _kv_sum(self, entry: int) -> int:
        """A draft entry's terms over the target's KV layers."""
        return sum(fmix(entry ^ salt(layer)) for layer, kv in enumerate(self.model.kv_mask) if kv) & M32

    def draft_level(self, d: int) -> None:
        """toy_tree_draft of level d: the level's KV and states; below D, its candidates."""
        model, r, K = self.model, self.t.row(0), self.K
        start, stop = self.levels[d]
        last, pos = d == self.k, int(self.pos_start[0]) % 2**32
        toks, logps = self.cand_tok.reshape(self.T1, K), self.cand_logp.reshape(self.T1, K)
        if pos >= self.capacity:
            if not last:
                toks[start:stop], logps[start:stop] = 0, -np.inf
            return
        states = [self._node_states(self.draft_states, c, int(r.parent[c]), start) for c in range(start, stop)]
        if not last:
            history = sum(int(fmix_array(self.draft_kv[:pos] ^ np.uint32(salt(layer))).sum(dtype=np.uint64))
                          for layer, kv in enumerate(model.kv_mask) if kv)
            ancestor = [self._kv_sum(int(self.draft_kv[pos + a])) if pos + a < self.capacity else 0
                        for a in range(start)]
            for c, node_states in zip(range(start, stop), states):
                above = history + sum(ancestor[a] for a in ref_tree.mask_bits(r.mask[c]) if a < start)
                t, p = int(r.tok[c]), int(r.pos[c]) % 2**32
                total = model.state(above & M32, t, p, node_states if model.rec_layers else None) ^ model.seed
                toks[c], logps[c] = model.tree_candidates(total, p, K)
        for c in range(start, stop):
            if pos + c < self.capacity:
                self.draft_kv[pos + c] = model.embed(int(r.tok[c]), int(r.pos[c]) % 2**32)
        self.draft_len[0] = min(pos + stop, self.capacity)

    def verify(self) -> None:
        """toy_tree_verify: every node under its ancestor mask, its entries at pos_start + i."""
        model, r, T1 = self.model, self.t.row(0), self.T1
        pos = int(self.pos_start[0]) % 2**32
        if pos >= self.capacity:
            self.pred[:] = 0
            return
        history = sum(int(data[:pos].sum(dtype=np.uint64)) for data in self.tgt if data is not None)
        fresh = [model.kv_entries(int(r.tok[c]), int(r.pos[c]) % 2**32) for c in range(T1)]
        for c in range(T1):
            node_states = self._node_states(self.tgt_states, c, int(r.parent[c]), c)
            above = history + sum(fresh[a] for a in ref_tree.mask_bits(r.mask[c]) if a != c and a < T1)
            t, p = int(r.tok[c]), int(r.pos[c]) % 2**32
            self.pred[c] = model.predict(above & M32, t, p, node_states if model.rec_layers else None)
        for c in range(T1):
            if pos + c < self.capacity:
                e = model.embed(int(r.tok[c]), int(r.pos[c]) % 2**32)
                for layer, data in enumerate(self.tgt):
                    if data is not None:
                        data[pos + c] = fmix(e ^ salt(layer))
        for length in self.tgt_len:
            if length is not None:
                length[0] = min(pos + T1, self.capacity)

    def compact_table(self) -> list[tuple[np.ndarray, None, int, int, int, int]]:
        """spec_tree_compact's table: every target KV layer, then the draft's, one word a position."""
        return [(data, None, self.capacity, 1, 1, self.capacity) for data in [*self.tgt, self.draft_kv]
                if data is not None]

    def round(self) -> None:
        k, t = self.k, self.t
        ref_tree.spec_tree_begin(t, self.pend, self.pos_ctr, self.pos_start, self.vtok, k)
        for d in range(k):
            self.draft_level(d)
            self.grow(t, d + 1, self.levels, self.cand_tok, self.cand_logp, self.cand_logp, self.K, self.pos_start)
        self.draft_level(k)
        self.verify()
        ref_tree.spec_tree_accept_greedy(t, self.pred, k, self.vtok, self.brk, self.acc, self.last_pred, self.ctl)
        if not self.ctl[CTL_DONE]:
            self.accepted.append(int(self.acc[0]))
        ref_tree.spec_tree_compact(self.compact_table(), t, self.acc, self.pos_start, self.ctl, k)
        ref.spec_ring_commit(self.vtok, self.acc, self.last_pred, self.ctl, self.pend, self.ring, self.ring_cap, k)
        ref.spec_rollback_stream([*self.tgt_len, self.draft_len, self.pos_ctr], self.pos_start, self.ctl)
        self.tgt_states.roll_back_tree(t, self.ctl)
        self.draft_states.roll_back_tree(t, self.ctl)
        self.rounds += 1


def tree_speculative_generate(model: ToyModel, prompt: Sequence[int], tree: Tree, max_new_tokens: int,
                              eos: int | None = None, m_rounds: int = 4, candidates: int = 8,
                              state_rollback: str = "copy") -> list[int]:
    """The whole tree speculative loop in numpy (see NumpyTreeRoundStream)."""
    model = as_toy_model(model)
    prompt = as_prompt(prompt, model.vocab, "the prompt").tolist()
    max_new_tokens, eos = stop_rule(max_new_tokens, eos)  # before a cache is sized for the budget
    capacity = kv_capacity(len(prompt), max_new_tokens, Geometry.of_tree(tree, m_rounds))
    stream = NumpyTreeRoundStream(model, tree, m_rounds, capacity, candidates, state_rollback)
    return stream.generate(prompt, max_new_tokens, eos)

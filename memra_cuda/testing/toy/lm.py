"""The toy language model: its definition in numpy, and the same model on the GPU.

A deterministic model whose next token depends on every KV entry and every word of recurrent
state, so a wrong rollback or a wrong position changes the output (docs/toy-model.md,
"Definition"). The numpy half is the oracle: `target_greedy` is what any correct speculative
decoder must reproduce (testing.toy.numpy_loop runs the whole round-stream loop on numpy buffers).
`ToyLM` is the same model as ptx/toy_lm.cu kernels, wired to a RoundStream of chain or tree
rounds: what the demo decodes, the benchmarks measure, and a test drives the layer with where a
real model is not the point.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ...buffers.acceptance import Acceptance, Greedy, Sampling
from ...buffers.stream_bufs import ROW_VALUE_MOST
from ...driver.values import (U64_MOST, as_flag, as_index, as_listed, as_prompt, as_real, as_seed, as_size,
                              longest_prompt_for)
from ...kernels.signatures import load
from ...kernels.spec import batch_rows
from ...rounds.round import Step, chain
from ...rounds.tree_round import TreeRound
from ...rounds.stream import RoundStream
from ...buffers.tables import (Cache, KVData, KVLayer, PointerTable, StateIndexTable, StateLayer, StateTable,
                               kv_data_table, kv_len_ptr_table, state_copy_table, state_flip_table)
from ...buffers.geometry import Geometry, as_batch, as_geometry
from ...buffers.tree import Candidates, DynamicTree, TreeBufs, TreeShape

if TYPE_CHECKING:
    from ...buffers.lengths import DraftLengths
    from ...buffers.stream_bufs import StreamBufs
    from ...buffers.tree import Tree
    from ...driver.buffer import DeviceBuffer
    from ...driver.engine import Engine
    from ...driver.module import Launch
    from ...kernels.spec import SpecKernels

M32 = 0xFFFFFFFF
BLOCK = 512  # toy_lm.cu's block size; verify handles k + 1 <= BLOCK tokens
SAMPLE_BLOCK = 256  # toy_lm.cu's SAMPLE_BLOCK, the block of toy_draft_sample
STATE_ROLLBACKS = ("copy", "flip")  # how recurrent state rolls back: kernel 8 or kernel 9
MAX_CANDIDATES = 32  # a tree draft node's candidates (toy_tree_draft's K)


def fmix(h: int) -> int:
    h &= M32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def fmix_array(h: np.ndarray) -> np.ndarray:
    """fmix over a u32 array (in u64, masked, so nothing overflows)."""
    h = h.astype(np.uint64)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return (h ^ (h >> 16)).astype(np.uint32)


def salt(layer: int) -> int:
    return fmix(0x27D4EB2F * (layer + 1))


def as_candidates(candidates: object) -> int:
    """The toy's tree draft's candidates a node, K, as an int from 1 to MAX_CANDIDATES (as_size's
    refusals: int() took 2.7 as 2, True as 1 and "8" as 8, and the numpy oracle took 0 too)."""
    return as_size(candidates, "the toy's tree draft's candidates a node", 1, MAX_CANDIDATES)


def live_slot(idx: int | np.ndarray, k: int) -> int | np.ndarray:
    """The slot a FLIP index names, by kernel 9's bank rule: a garbage index still names a slot."""
    return np.minimum(idx // (k + 1), 1) * (k + 1) + idx % (k + 1)


@dataclass(frozen=True)
class ToyModel:
    """The toy's parameters: target layers `kv_mask` (True: the layer has a KV cache) and
    `rec_mask` (True: a recurrent layer, of `state_words` u32 of state; empty: none), the
    draft's error rate `noise_ppm` and its confidence floor `p_min`. In a tree, the draft ranks
    the target's token 1 to `tree_spread` at a noisy position (docs/toy-model.md, "Trees")."""

    seed: int = 1
    vocab: int = 32000
    kv_mask: tuple[bool, ...] = (True, True, False, True)
    noise_ppm: int = 100_000
    p_min: float = 0.0
    rec_mask: tuple[bool, ...] = ()
    state_words: int = 4
    tree_spread: int = 3

    def __post_init__(self) -> None:
        """The numbers are kept as the checked plain ints (as_size's refusals, naming each): a
        float seed met a TypeError deep in the hash, np.uint32(7) an OverflowError there (numpy's
        u32 arithmetic), and True was seed 1. The masks are kept as tuples of bools (as_flag's
        refusal, naming the layer): an entry was read by its truth ("False" a KV layer), and a
        list left the model unhashable."""
        kv_mask = as_listed(self.kv_mask, "kv_mask", "bools, one a layer")
        rec_mask = as_listed(self.rec_mask, "rec_mask", "bools, one a layer")
        if not 1 <= len(kv_mask) <= 32:
            raise ValueError(f"the toy has 1 to 32 target layers, not {len(kv_mask)}")
        if rec_mask and len(rec_mask) != len(kv_mask):
            raise ValueError(f"rec_mask must be empty or name each of the {len(kv_mask)} layers, not "
                             f"{len(rec_mask)}")
        for name, mask in (("kv_mask", kv_mask), ("rec_mask", rec_mask)):
            object.__setattr__(self, name, tuple(as_flag(flag, f"{name}[{layer}]") for layer, flag in enumerate(mask)))
        for name, least, most in (("seed", 0, M32), ("vocab", 1, M32), ("noise_ppm", 0, 1_000_000),
                                  ("state_words", 1, BLOCK), ("tree_spread", 1, M32)):
            object.__setattr__(self, name, as_size(getattr(self, name), name, least, most))
        both = [layer for layer in self.rec_layers if self.kv_mask[layer]]
        if both:
            raise ValueError(f"layer {both[0]} cannot keep both a KV cache and a recurrent state")
        # A probability: the draft breaks where its confidence is below it (0, never; 1, always), so
        # a value past 1 (a percentage, say) would break every round without saying why.
        if not 0 <= as_real(self.p_min, "p_min") <= 1:
            raise ValueError(f"p_min must be a probability from 0 to 1 (the draft's confidence floor), "
                             f"not {self.p_min!r}")

    # The hashes take ints (as_index's TypeError, naming each: a token, a position, a hash sum):
    # a float met "unsupported operand type(s) for &" deep in fmix (or was taken, silently, by
    # rec_states of a model without recurrent layers), and a bool was hashed as 0 or 1.

    def embed(self, token: int, pos: int) -> int:
        token, pos = as_index(token, "token"), as_index(pos, "pos")
        return fmix(token * 0x9E3779B1 + pos * 0x85EBCA77 + self.seed)

    @property
    def kv_bits(self) -> int:
        return sum(1 << layer for layer, has_kv in enumerate(self.kv_mask) if has_kv)

    @property
    def rec_layers(self) -> tuple[int, ...]:
        """The recurrent layers, in order."""
        return tuple(layer for layer, rec in enumerate(self.rec_mask) if rec)

    @property
    def rec_bits(self) -> int:
        return sum(1 << layer for layer in self.rec_layers)

    def recur(self, states: np.ndarray, token: int, pos: int) -> np.ndarray:
        """The recurrent layers' states, u32[len(rec_layers)][state_words], after `token` at
        `pos`: s[w] <- fmix(s[w] + fmix(E(token, pos) ^ salt(l)) + w) in each layer l. The one
        recurrence of the numpy half (prefill, draft and verify all step through it)."""
        e = self.embed(token, pos)  # which checks them, whether or not there is a state to step
        if not self.rec_layers:
            return states
        drive = fmix_array(np.array([e ^ salt(layer) for layer in self.rec_layers], np.uint32))
        words = np.arange(self.state_words, dtype=np.uint64)
        return fmix_array((states.astype(np.uint64) + drive[:, None] + words) & M32)

    def rec_states(self, tokens: Sequence[int]) -> np.ndarray:
        """The recurrent states after `tokens` at positions 0.. (a prefill), from zero."""
        states = np.zeros((len(self.rec_layers), self.state_words), np.uint32)
        for pos, token in enumerate(tokens):
            states = self.recur(states, token, pos)
        return states

    @property
    def break_below(self) -> int:
        """Draft confidences q/1000 below p_min, counted: a break is `q < break_below`, so the
        kernel compares integers exactly as numpy does."""
        return int(np.count_nonzero(np.arange(1000) / 1000 < self.p_min))

    def state(self, history: int, token: int, pos: int, states: np.ndarray | None = None) -> int:
        """The target's hash state after `token` at `pos` (`history`: the wrapping sum of every
        KV layer's entries before pos; `states`: the recurrent layers' states after the token,
        as recur() leaves them); its greedy token is fmix(state) % vocab."""
        if states is None and self.rec_layers:
            raise ValueError("a model with recurrent layers needs their states after the token (recur())")
        token, history = as_index(token, "token"), as_index(history, "history")  # a non-KV layer hashes the token
        e = self.embed(token, pos)
        total = history if states is None else history + int(states.sum(dtype=np.uint64))
        recurrent = set(self.rec_layers)
        for layer, has_kv in enumerate(self.kv_mask):
            if layer not in recurrent:
                total += fmix(e ^ salt(layer)) if has_kv else fmix(token ^ salt(layer))
        return self.seed ^ (total & M32)

    def predict(self, history: int, token: int, pos: int, states: np.ndarray | None = None) -> int:
        """The target's greedy token after `token` at `pos`."""
        return fmix(self.state(history, token, pos, states)) % self.vocab

    def candidates(self, state: int) -> list[int]:
        """Sampling mode's four candidate tokens at a hash state (toy_lm.cu's mixture)."""
        state = as_index(state, "state")
        return [fmix(state ^ ((j * 0x27D4EB2F) & M32)) % self.vocab for j in range(4)]

    def kv_entries(self, token: int, pos: int) -> int:
        """Sum over the KV layers of the entries token-at-pos appends."""
        e = self.embed(token, pos)
        return sum(fmix(e ^ salt(layer)) for layer, has_kv in enumerate(self.kv_mask) if has_kv) & M32

    def history(self, tokens: Sequence[int]) -> int:
        """The wrapping sum of every KV layer's entries for `tokens` at positions 0.. (a prefill)."""
        total = 0
        for pos, token in enumerate(tokens):
            total = (total + self.kv_entries(token, pos)) & M32
        return total

    def draft_noisy(self, pos: int) -> bool:
        pos = as_index(pos, "pos")
        return fmix(((pos * 0x9E3779B1) & M32) ^ self.seed ^ 0x5BD1E995) % 1_000_000 < self.noise_ppm

    def draft_breaks(self, pos: int) -> bool:
        pos = as_index(pos, "pos")
        return fmix(pos ^ self.seed ^ 0x68E31DA4) % 1000 < self.break_below

    def tree_candidates(self, total: int, pos: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """A tree draft node's `k` candidates, best first (toy_tree_draft): tokens u32[k] and
        log-probabilities f32[k], for the sum `total` toy_draft_step would hash at `pos`. Rank 0
        is the chain's draft; at a noisy position the target's token pred sits at rank
        rho = 1 + fmix(total ^ 0x1b873593) % tree_spread (absent if rho >= k); the other ranks
        are decoys, never pred. logp_j = -(j * gap) / 1000 (f32), gap in [500, 2500)."""
        total, k = as_index(total, "total") & M32, as_candidates(k)
        pred = fmix(self.seed ^ total) % self.vocab
        noisy = self.draft_noisy(pos)
        rho = 1 + fmix(total ^ 0x1B873593) % self.tree_spread if noisy else 0
        gap = 500 + fmix(total ^ 0x2545F491) % 2000
        tokens = np.zeros(k, np.uint32)
        for j in range(k):
            if j == 0:
                tokens[j] = (pred + 1) % self.vocab if noisy else pred
            elif j == rho:
                tokens[j] = pred
            else:
                decoy = fmix(total ^ (((j + 1) * 0x27D4EB2F) & M32)) % self.vocab
                tokens[j] = (pred + 2) % self.vocab if decoy == pred else decoy
        logp = np.array([np.float32(-float(j * gap)) / np.float32(1000.0) for j in range(k)], np.float32)
        return tokens, logp


def as_toy_model(model: object) -> ToyModel:
    """`model` if it is a ToyModel, else TypeError naming it: the toy's oracle, its numpy loops and
    its engines read its fields, so anything else (None, a dict of its fields) met an
    AttributeError ("'NoneType' object has no attribute 'vocab'") deep inside, naming nothing."""
    if not isinstance(model, ToyModel):
        raise TypeError(f"the toy's model is a ToyModel, not {model!r}")
    return model


def as_chain(geometry: object) -> Geometry:
    """`geometry` if it is a chain's Geometry (the toy's ranks and pipeline run chain rounds),
    else TypeError (as_geometry's: the loose k, M and B it replaces named) or ValueError (a
    tree's width)."""
    geometry = as_geometry(geometry)
    if not geometry.chain:
        raise ValueError(f"the toy's ranks and pipeline run chain rounds, of width k + 1: not {geometry}")
    return geometry


def target_greedy(model: ToyModel, prompt: Sequence[int], max_new_tokens: int,
                  eos: int | None = None) -> list[int]:
    """The target's own greedy continuation: the output speculative decoding must equal.
    `max_new_tokens` is a row's budget (0 to ROW_VALUE_MOST: infinity ran for ever, 2.5 gave 3 tokens)
    and `eos` None or a token id of the model (a string, a float or one past the vocabulary was
    compared with each token and never met)."""
    model = as_toy_model(model)
    prompt = as_prompt(prompt, model.vocab, "the prompt").tolist()
    max_new_tokens = as_size(max_new_tokens, "max_new_tokens", 0, ROW_VALUE_MOST)
    if eos is not None:
        eos = as_size(eos, "eos", 0, model.vocab - 1, also="None")
    history, states = model.history(prompt[:-1]), model.rec_states(prompt[:-1])
    token, pos = prompt[-1], len(prompt) - 1
    out: list[int] = []
    while len(out) < max_new_tokens:
        states = model.recur(states, token, pos)
        nxt = model.predict(history, token, pos, states)
        history = (history + model.kv_entries(token, pos)) & M32
        out.append(nxt)
        if nxt == eos:
            break
        token, pos = nxt, pos + 1
    return out


def _law_number(value: object, name: str) -> float:
    """A sampling law's temperature or floor (`name` holds which) as a float (as_real's
    TypeError, naming it), ValueError unless it is >= 0 and, a floor, at most 1: a NaN or a
    negative temperature would be read as greedy, and a floor above 1 gives negative weights.
    The one check of them, for ToySampling's fields and its public `weights` alike."""
    number = as_real(value, name)
    if not (number >= 0 and (number <= 1 or "temperature" in name)):
        raise ValueError(f"{name} must be >= 0 (a floor at most 1), not {number}")
    return number


def _mixture(vocab: int, temperature: float, floor: float) -> tuple[float, ...]:
    """ToySampling.weights of a checked vocabulary, temperature and floor (its, or a ToySampling's
    fields)."""
    j = np.arange(4)
    c = np.exp(-j / temperature) if temperature > 0 else (j == 0).astype(float)
    c = (1 - floor) * c / c.sum()
    return tuple(float(np.float32(w)) for w in (floor / vocab, *c))


@dataclass(frozen=True)
class ToySampling:
    """The toy's sampling mode (toy_lm.cu, "Sampling mode"): at each position the target's
    distribution puts `floor` of its mass evenly on the vocabulary and the rest on four
    candidate tokens (the first is the greedy token) weighted softmax(-j / temperature); the
    draft's is the same mixture with its own temperature and floor, at the draft's hash state
    (which differs at its noisy positions). Temperature 0 and floor 0 make the target greedy."""

    temperature: float = 1.0
    floor: float = 0.05
    draft_temperature: float = 1.0
    draft_floor: float = 0.1

    def __post_init__(self) -> None:
        """Each field kept as the float it is (_law_number's refusals, naming it): True was a
        temperature of 1, and None met a bare comparison's TypeError."""
        for name in ("temperature", "floor", "draft_temperature", "draft_floor"):
            object.__setattr__(self, name, _law_number(getattr(self, name), name))

    @staticmethod
    def weights(vocab: int, temperature: float, floor: float) -> tuple[float, ...]:
        """(floor / vocab, c_0 .. c_3) as the kernels take them (f32 values); `vocab` a size (0
        divided the floor by zero), `temperature` and `floor` checked as the fields are
        (_law_number, naming each): this is public, and a NaN or a negative temperature was read
        as greedy, True as 1.0, and a floor above 1 gave negative weights."""
        return _mixture(as_size(vocab, "vocab"), _law_number(temperature, "temperature"), _law_number(floor, "floor"))

    def target(self, vocab: int) -> tuple[float, ...]:
        """The target's weights (weights'), `vocab` a size: the fields were checked when this
        frozen object was made, and are not again."""
        return _mixture(as_size(vocab, "vocab"), self.temperature, self.floor)

    def draft(self, vocab: int) -> tuple[float, ...]:
        """The draft's weights, as target's."""
        return _mixture(as_size(vocab, "vocab"), self.draft_temperature, self.draft_floor)

    def target_law(self, model: ToyModel, context: Sequence[int]) -> np.ndarray:
        """The target's law of the token after `context` (toy_lm.cu's mixture at its hash state),
        over the vocabulary: what a sampled request's next token is distributed as. `context` is a
        prompt of the model's tokens (as_prompt's refusals, naming it): an empty one met an
        IndexError, a float token a TypeError deep in the hash, a uint32 array an OverflowError
        there (numpy's u32 arithmetic), and a token past the vocabulary, which no request holds,
        was hashed into a law, silently. A model's recurrent layers count with their states after
        the context, as toy_verify adds them to the sums toy_probs reads (a model with recurrent
        layers, which ToyLM samples, met "needs their states after the token")."""
        model = as_toy_model(model)
        context = as_prompt(context, model.vocab, "the context").tolist()
        states = model.rec_states(context) if model.rec_layers else None
        state = model.state(model.history(context[:-1]), context[-1], len(context) - 1, states)
        floor, *weights = self.target(model.vocab)
        law = np.full(model.vocab, floor, np.float64)
        for token, weight in zip(model.candidates(state), weights):
            law[token] += weight
        return law / law.sum()


@dataclass(frozen=True)
class ToyCost:
    """Bytes of "weights" the verify trunk and each draft step stream from device memory, so
    the toy can stand in for a real model's memory-bound forward pass."""

    verify_bytes: int = 0
    draft_bytes: int = 0

    def __post_init__(self) -> None:
        """Each kept as the checked plain int it is, 0 to 2**64 - 1 bytes (as_size's refusals,
        naming it; the kernel's count of 16-byte words is a u64): -5 was taken and paced the
        bursts, to meet a u64's refusal of -1 words at the verify's launch, 2.5 and NaN reached
        the weights' allocation, and True paced the bursts as a byte."""
        for name in ("verify_bytes", "draft_bytes"):
            object.__setattr__(self, name, as_size(getattr(self, name), name, 0, U64_MOST))

    @property
    def paced(self) -> bool:
        """Whether bursts should be paced (RoundStream's `pace`): a toy that streams weights
        stands in for a real model, whose rounds cost more than a readback; the bare toy's
        rounds (~20 us) cost less."""
        return bool(self.verify_bytes or self.draft_bytes)


def _sampling_mode(sampling: ToySampling | None) -> ToySampling:
    """A ToyLM's sampling mode, for the kernels of that mode alone (their laws are its)."""
    if sampling is None:
        raise ValueError("the toy's laws are sampling mode's: this ToyLM has no sampling=")
    return sampling


def _law(weights: tuple[float, ...]) -> dict[str, float]:
    """A law's weights (ToySampling.target, .draft) by the names the kernels give them."""
    floor, c0, c1, c2, c3 = weights
    return dict(floor=floor, c0=c0, c1=c1, c2=c2, c3=c3)


# An 8B target and a 0.5B draft in bf16, memory-bound: their weights, read once per forward pass.
COST_8B_05B = ToyCost(verify_bytes=16 * 10**9, draft_bytes=1 * 10**9)


class ToyStates:
    """One model's recurrent states on the GPU (the target's, or the draft's copy of them) for
    `batch` rows, laid out for rollback by `strategy`: per recurrent layer, slots [B][k+1][W] and
    a live state [B][W] ("copy"), or slots [B][2(k+1)][W] and the model's one slot index idx_d,
    u32[B] ("flip"); for a tree of T + 1 nodes k is T (a slot a node). The kernels find them
    through address tables of the recurrent layers."""

    def __init__(self, engine: Engine, model: ToyModel, batch: int, k: int, strategy: str, label: str):
        self.rec_mask, self.k, self.words, self.flip = model.rec_mask, k, model.state_words, strategy == "flip"
        n_slots = (2 if self.flip else 1) * (k + 1)
        self.slots = [engine.zeros(np.uint32, batch * n_slots * self.words, label=f"{label} state slots {layer}")
                      for layer in model.rec_layers]
        self.live = [] if self.flip else [engine.zeros(np.uint32, batch * self.words, label=f"{label} state {layer}")
                                          for layer in model.rec_layers]
        self.idx_d = engine.zeros(np.uint32, batch, label=f"{label} state index") if self.flip else None
        self.slots_d = PointerTable(engine, self.slots, label=f"{label} state slots")
        self.live_d = None if self.flip else PointerTable(engine, self.live, label=f"{label} states")

    def kernel_args(self) -> tuple[DeviceBuffer | int, ...]:
        """The kernels' (live table, slots table, index): 0 for what the strategy lacks."""
        return (0 if self.live_d is None else self.live_d, self.slots_d, 0 if self.idx_d is None else self.idx_d)

    def layers(self) -> list[StateLayer | None]:
        """The model's layers as state_copy_table takes them (None: no recurrent state)."""
        layers = (StateLayer(live, slots, self.words, self.k) for live, slots in zip(self.live, self.slots))
        return [next(layers) if rec else None for rec in self.rec_mask]

    def read(self, engine: Engine) -> np.ndarray:
        """The states the next round reads, [B][recurrent layers][W], read back (for tests)."""
        if self.idx_d is None:  # copy: the live states themselves
            return np.stack([engine.dtoh(live).reshape(-1, self.words) for live in self.live], axis=1)
        idx = engine.dtoh(self.idx_d).astype(np.int64)
        rows = np.arange(idx.size)
        return np.stack([engine.dtoh(slots).reshape(idx.size, -1, self.words)[rows, live_slot(idx, self.k)]
                         for slots in self.slots], axis=1)


class ToyLM:
    """The toy on the GPU for `batch` sequences: target and draft KV caches ([B][capacity]
    entries per layer, i32[B] lengths), recurrent states, the kernels, and their wiring. Each
    row has its own prompt, position, caches and states; the weights (the cost knob) are read
    once for the batch.

    A pipeline stage (testing.toy.pipeline) holds only the target layers `layers` of the model,
    and the draft only if `with_draft`; its verify passes partial sums on to the next stage.
    With `sampling`, the draft samples its tokens, the verify writes the target's probabilities
    and the round accepts stochastically (spec_accept_sample), each row with its request's seed.

    A model with recurrent layers rolls their state back by `state_rollback`, "copy" (kernel 8) or
    "flip" (kernel 9), the target's and the draft's alike (ToyStates). Their slots depend on k,
    so they are allocated for the StreamBufs this model first meets, and a round of another k
    is refused.

    `tree_round_stream` runs tree rounds (docs/trees.md; docs/toy-model.md, "Trees"): the draft a
    level at a time (toy_tree_draft), the verify of every node under its ancestor mask
    (toy_tree_verify), recurrent states with a slot a node (kernels 16, 17 roll them back).
    """

    def __init__(self, engine: Engine, model: ToyModel, capacity: int, cost: ToyCost = ToyCost(),
                 weights: DeviceBuffer | None = None, batch: int = 1, layers: range | None = None,
                 with_draft: bool = True, sampling: ToySampling | None = None, state_rollback: str = "copy"):
        """`weights`: a buffer to stream for the cost knob, shareable between models (one is
        allocated when the cost needs it and none is given). `capacity` and `batch` are sizes,
        refused by name before anything is allocated ("512" or 2.7 is no size: int() would take it)."""
        model = as_toy_model(model)
        if not isinstance(cost, ToyCost):  # its fields are read below: None met "no attribute 'verify_bytes'"
            raise TypeError(f"the toy's cost is a ToyCost, not {cost!r}")
        self.engine, self.model, self.capacity, self.cost = engine, model, as_size(capacity, "capacity"), cost
        self.batch, with_draft = as_batch(batch), as_flag(with_draft, "with_draft")
        self.layers = range(len(model.kv_mask)) if layers is None else layers
        if not (self.layers.step == 1 and 0 <= self.layers.start < self.layers.stop <= len(model.kv_mask)):
            raise ValueError(f"a stage holds a contiguous, non-empty range of the model's {len(model.kv_mask)} "
                             f"layers, not {layers}")
        if state_rollback not in STATE_ROLLBACKS:
            raise ValueError(f"state_rollback must be one of {STATE_ROLLBACKS}, not {state_rollback!r}")
        if model.rec_layers and (self.layers != range(len(model.kv_mask)) or not with_draft):
            raise ValueError("the toy's pipeline stages cannot roll back recurrent state: a model with recurrent "
                             "layers runs whole (layers=None, with_draft=True)")
        if len(model.rec_layers) * model.state_words > BLOCK:
            raise ValueError(f"the toy's kernels give every recurrent word a thread of one block: "
                             f"{len(model.rec_layers)} layers x {model.state_words} words is more than {BLOCK}")
        self.state_rollback = state_rollback
        self.states: tuple[ToyStates, ToyStates] | None = None  # the target's and the draft's, once k is known
        self.module = load(engine, "toy_lm")  # every prepare takes its types from the kernels' signatures
        self.target = Cache.allocate(engine, model.kv_mask[self.layers.start:self.layers.stop], self.capacity,
                                     batch=self.batch)
        self.draft = Cache.allocate(engine, [True] if with_draft else [], self.capacity, batch=self.batch)
        target = self.target.kv
        self.data_ptrs_d = PointerTable(engine, [None if kv is None else kv.data_d for kv in target], label="toy data")
        self.len_ptrs_d = PointerTable(engine, [None if kv is None else kv.len_d for kv in target], label="toy lengths")
        weight_bytes = max(cost.verify_bytes, cost.draft_bytes)
        if weights is not None and weights.nbytes < weight_bytes:
            raise ValueError(f"the cost streams {weight_bytes} bytes but weights hold {weights.nbytes}")
        if weights is None and weight_bytes:
            weights = engine.alloc(np.uint8, weight_bytes, zeroed=True, label="toy weights")
        self.weights_d = weights
        self.sink_d = engine.zeros(np.uint32, 1, label="toy sink")
        # The prompt's home on the device: it outlives the prefill kernel that reads it.
        self.prompt_d = engine.zeros(np.uint32, self.capacity, label="toy prompt")
        self.sampling = sampling
        self.seed_d = engine.alloc(np.uint64, self.batch, zeroed=True, label="request seeds") if sampling else None
        self.tree: Tree | None = None  # the tree of tree_round_stream, once built

    def prefill(self, bufs: StreamBufs, prompt: Sequence[int], seed: int = 0) -> int:
        """Fill both caches with the prompt but its last token, which becomes pending, and
        reset the request's buffers (prefill_row of row 0: bufs.reset_row, for one sequence all
        that bufs.reset does; the stop rule is generate's). Returns the
        start position, len(prompt) - 1. For one sequence; a batch fills its rows with
        prefill_row."""
        if self.batch != 1:
            raise ValueError(f"prefill() fills a batch of 1; this model holds {self.batch}: use prefill_row")
        return self.prefill_row(bufs, 0, prompt, seed)

    def prefill_row(self, bufs: StreamBufs, row: int, prompt: Sequence[int], seed: int = 0) -> int:
        """prefill() for the sequence in slot `row` (bufs.reset_row), leaving the other rows
        alone: a new request joins between bursts. `seed` is the request's (sampling mode): its
        tokens depend on it alone (an int from 0 to 2**64 - 1, as_seed, checked before the row is
        reset), its prompt ints of the model's vocabulary (as_prompt). Returns its start position."""
        # all but its last token fill the caches: a longer prompt is refused by its length, unread
        prompt = as_prompt(prompt, self.model.vocab, f"row {row}'s prompt", longest_prompt_for(self.capacity)).tolist()
        n = len(prompt) - 1
        self._check_batch(bufs)
        seed = as_seed(seed)
        states = self._states(bufs, self._prefill_k(bufs))
        engine = self.engine
        bufs.reset_row(row, prompt[-1], n)
        if self.seed_d is not None:
            engine.copy_htod(self.seed_d, [seed], start=row)
        if n:
            engine.copy_htod(self.prompt_d, prompt[:-1])
            draft = self.draft.kv[0] if self.draft.kv else None  # a pipeline stage may hold none
            self.module.kernel("toy_prefill").prepare(grid=(n + BLOCK - 1) // BLOCK, block=BLOCK).set(
                tokens=self.prompt_d, n=n, row=row, capacity=self.capacity, tgt_data=self.data_ptrs_d,
                tgt_len=self.len_ptrs_d, n_layers=len(self.layers), layer0=self.layers.start,
                draft_data=draft.data_d if draft else 0, draft_len=draft.len_d if draft else 0, seed=self.model.seed)()
        else:
            for kv in [*self.target.kv, *self.draft.kv]:
                if kv is not None:
                    engine.set_u32(kv.len_d, row, 0)
        if states is not None:  # the target's states and the draft's copy, a launch each
            prefill_state = self.module.kernel("toy_prefill_state").prepare(grid=1, block=BLOCK)
            for model_states in states:
                live, slots, idx = model_states.kernel_args()
                prefill_state.set(tokens=self.prompt_d, n=n, row=row, live=live, slots=slots, idx=idx,
                                  rec_mask=self.model.rec_bits, words=self.model.state_words, k1=model_states.k + 1,
                                  seed=self.model.seed)()
        return n

    def _states(self, bufs: StreamBufs, k: int | None = None) -> tuple[ToyStates, ToyStates] | None:
        """The target's and the draft's recurrent states (None without recurrent layers),
        allocated for the k of the first StreamBufs they meet; `k` says another number of slots
        (a tree's T + 1 slots: k = T)."""
        if not self.model.rec_layers:
            return None
        k = bufs.k if k is None else k
        if self.states is None:
            self.states = (ToyStates(self.engine, self.model, self.batch, k, self.state_rollback, "target"),
                           ToyStates(self.engine, self.model, self.batch, k, self.state_rollback, "draft"))
        elif self.states[0].k != k:
            raise ValueError(f"this toy's recurrent states hold the k + 1 = {self.states[0].k + 1} slots of the "
                             f"rounds it first met, not those of k = {k}: make another ToyLM")
        return self.states

    def _prefill_k(self, bufs: StreamBufs) -> int:
        """The slots' k a prefill of `bufs` lays the states out for: the tokens a round of their
        geometry verifies past the pending one (a tree's T, a chain's k)."""
        return bufs.geometry.width - 1

    def _state_args(self, bufs: StreamBufs, which: int, k: int | None = None) -> dict[str, DeviceBuffer | int]:
        """A round kernel's recurrent-state arguments for the target (`which` 0) or the draft
        (1), by name: that model's tables and index (nulls without recurrent layers), the
        recurrent layers' bits and their words (`k`: as _states)."""
        states = self._states(bufs, k)
        st_live, st_slots, st_idx = states[which].kernel_args() if states else (0, 0, 0)
        return dict(st_live=st_live, st_slots=st_slots, st_idx=st_idx, rec_mask=self.model.rec_bits,
                    words=self.model.state_words)

    def state_tables(self, bufs: StreamBufs, k: int | None = None) -> list[StateTable | StateIndexTable]:
        """RoundStream's state_tables for this model: one table over the target's and the
        draft's recurrent states (none without recurrent layers; `k`: as _states)."""
        states = self._states(bufs, k)
        if states is None:
            return []
        if self.state_rollback == "flip":
            return [state_flip_table(self.engine, [model_states.idx_d for model_states in states])]
        return [state_copy_table(self.engine, [layer for model_states in states for layer in model_states.layers()])]

    def live_states(self) -> tuple[np.ndarray, np.ndarray]:
        """The target's and the draft's recurrent states the next round reads, each
        [B][recurrent layers][W], read back (for tests and debugging)."""
        if self.states is None:
            raise ValueError("no recurrent states: the model has no recurrent layers, or no StreamBufs met yet")
        return self.states[0].read(self.engine), self.states[1].read(self.engine)

    def _check_batch(self, bufs: StreamBufs) -> None:
        if bufs.batch != self.batch:
            raise ValueError(f"buffers for a batch of {bufs.batch} do not fit a toy model of {self.batch} rows")

    def _draft_layer(self) -> KVLayer:
        """The draft's one KV layer (a pipeline stage without the draft has none)."""
        layer = self.draft.kv[0] if self.draft.kv else None
        if layer is None:
            raise ValueError("this pipeline stage holds no draft: the stage that has it runs the draft chain")
        return layer

    def weight_reads(self, nbytes: int) -> list[Launch]:
        """The cost knob: a grid-wide pass over `nbytes` of weights (nothing when 0)."""
        if not nbytes:
            return []
        grid = 4 * self.engine.multiprocessors
        return [self.module.kernel("toy_stream_weights").prepare(grid=grid, block=512)
                .set(weights=self.weights_d, n_vec=nbytes // 16, sink=self.sink_d)]

    def draft_steps(self, bufs: StreamBufs, draft_d: DeviceBuffer, q_d: DeviceBuffer | None = None,
                    width: int | None = None) -> list[Launch]:
        """The k+1 launches of one draft chain (each after its share of weight streaming); in
        sampling mode each of the first k is followed by its draw, which writes the draft's
        probabilities to q_d, [B][max(k, 1)][vocab]. `width` W < k: the first W + 1 steps only,
        a chain of W drafts (step W predicts a draft no row of that width judges, and appends
        the last draft's entry, as step k does)."""
        last = bufs.k if width is None else as_size(width, "width", 0, bufs.k)
        self._check_batch(bufs)
        draft_d = batch_rows("draft_d", self.engine.buffer(draft_d, "draft_d"), self.batch, max(bufs.k, 1), bufs.k)
        m, draft, engine = self.model, self._draft_layer(), self.engine
        kernel = self.module.kernel("toy_draft_step")
        # sampling: the hash state each step leaves for its draw
        state_d = None if q_d is None else engine.zeros(np.uint32, self.batch, label="draft hash states")
        steps: list[Launch] = []
        reads = self.weight_reads(self.cost.draft_bytes)
        for step in range(last + 1):
            steps += reads
            steps.append(kernel.prepare(grid=self.batch, block=BLOCK).set(
                step=step, k=bufs.k, pend_d=bufs.pend_d, draft_d=draft_d, pos_ctr=bufs.pos_ctr_d, brk_d=bufs.brk_d,
                draft_data=draft.data_d, draft_len=draft.len_d, capacity=self.capacity, kv_mask=m.kv_bits,
                n_layers=len(m.kv_mask), seed=m.seed, vocab=m.vocab, noise_ppm=m.noise_ppm,
                break_below=m.break_below, state_d=0 if state_d is None else state_d, **self._state_args(bufs, 1)))
            if q_d is not None and state_d is not None and step < bufs.k:
                steps.append(self._draft_sample(bufs, step, state_d, draft_d, q_d))
        return steps

    def _draft_sample(self, bufs: StreamBufs, step: int, state_d: DeviceBuffer, draft_d: DeviceBuffer,
                      q_d: DeviceBuffer) -> Launch:
        """Sampling mode: draft token `step` drawn over the vocabulary by many blocks a row."""
        vocab, engine = self.model.vocab, self.engine
        blocks = max(1, min(-(-vocab // SAMPLE_BLOCK), 16 * engine.multiprocessors // self.batch))
        scratch = engine.alloc(np.uint64, 2 * self.batch, zeroed=True, label="draft race scratch")
        law = _law(_sampling_mode(self.sampling).draft(vocab))
        return self.module.kernel("toy_draft_sample").prepare(grid=(blocks, self.batch), block=SAMPLE_BLOCK).set(
            step=step, k=bufs.k, state_d=state_d, pos_ctr=bufs.pos_ctr_d, draft_d=draft_d, q_d=q_d, seed_d=self.seed_d,
            vocab=vocab, **law, scratch=scratch)

    def verify_steps(self, bufs: StreamBufs, pred_d: DeviceBuffer | None, partial_in: DeviceBuffer | None = None,
                     partial_out: DeviceBuffer | None = None) -> list[Launch]:
        """The verify trunk: its weight reads, then k+1 tokens through this model's target
        layers. A pipeline stage adds the earlier stages' sums (`partial_in`) and, unless it is
        the last, writes its own to `partial_out` instead of predictions to `pred_d`: each one
        u32 per token, [B][k+1]."""
        self._check_batch(bufs)
        if (pred_d is None) == (partial_out is None):
            raise ValueError("a verify writes either predictions (pred_d) or partial sums (partial_out)")
        pred, before, after = (  # 0: a null pointer, for the kernel
            batch_rows(name, self.engine.buffer(buf, name), self.batch, bufs.k + 1) if buf is not None else 0
            for name, buf in (("pred_d", pred_d), ("partial_in", partial_in), ("partial_out", partial_out)))
        m = self.model
        verify = self.module.kernel("toy_verify").prepare(grid=self.batch, block=BLOCK).set(
            vtok_d=bufs.vtok_d, k1=bufs.k + 1, pos_start_d=bufs.pos_start_d, pred_d=pred, tgt_data=self.data_ptrs_d,
            tgt_len=self.len_ptrs_d, n_layers=len(self.layers), capacity=self.capacity, seed=m.seed, vocab=m.vocab,
            layer0=self.layers.start, partial_in=before, partial_out=after, **self._state_args(bufs, 0))
        return [*self.weight_reads(self.cost.verify_bytes), verify]

    def probs_step(self, totals_d: DeviceBuffer, p_d: DeviceBuffer) -> Launch:
        """toy_probs: the target's sampling law p_d ([rows][vocab]) at each position whose verify
        sums totals_d holds (toy_verify's partial_out, after the last layer)."""
        law = _law(_sampling_mode(self.sampling).target(self.model.vocab))
        vocab, rows = self.model.vocab, totals_d.len
        if p_d.len != rows * vocab:
            raise ValueError(f"p_d must hold a law of {vocab} for each of the {rows} sums, not {p_d!r}")
        return self.module.kernel("toy_probs").prepare(grid=(min(-(-vocab // 256), 64), rows), block=256).set(
            totals=totals_d, rows=rows, seed=self.model.seed, vocab=vocab, **law, p_d=p_d)

    def finish_step(self, totals_d: DeviceBuffer, pred_d: DeviceBuffer) -> Launch:
        """toy_finish: the target's greedy token at each position whose verify sums totals_d holds,
        added up over tensor-parallel ranks (testing.toy.ranks)."""
        if pred_d.len != totals_d.len:
            raise ValueError(f"pred_d must hold a token for each of the {totals_d.len} sums, not {pred_d!r}")
        n = totals_d.len
        return self.module.kernel("toy_finish").prepare(grid=-(-n // 256), block=256).set(
            totals=totals_d, n=n, seed=self.model.seed, vocab=self.model.vocab, pred_d=pred_d)

    def round_stream(self, bufs: StreamBufs, *, kernels: SpecKernels | None = None,
                     sums: tuple[Sequence[Step], DeviceBuffer] | None = None,
                     lengths: DraftLengths | None = None, widths: Sequence[int] = (),
                     skip_done: bool = False) -> RoundStream:
        """A RoundStream driving this model: rollback walks one table over target and draft
        layers with pos_ctr last, then one over their recurrent states (state_tables).
        `sums`: the steps of a verify that leaves the model's sums ([B][k+1] u32) in the buffer
        given with them, for the target's tokens (toy_finish) or its law (toy_probs) to be made
        from: a rank's, whose own layers are a share of the model's (testing.toy.ranks). By
        default this model's verify_steps: greedy, they make its tokens themselves; sampling,
        they leave the sums for toy_probs. `lengths`: each row's draft length chosen on the
        device every round (RoundStream's); `widths` (below k), bodies of those widths, which a
        burst graph switches among by the width chosen (RoundStream's `narrower`). `skip_done`: the
        burst graphs skip a round's draft and verify once every row is done (RoundStream's)."""
        if bufs.k + 1 > BLOCK:
            raise ValueError(f"the toy verifies at most {BLOCK} tokens a round: k must be < {BLOCK}")
        self._check_batch(bufs)
        engine, rows = self.engine, bufs.batch * (bufs.k + 1)
        draft_d = engine.zeros(np.uint32, bufs.batch * max(bufs.k, 1), label="draft_d")
        state_tables = self.state_tables(bufs)
        rollback_tables = [kv_len_ptr_table(engine, self.target + self.draft, pos_ctr=bufs.pos_ctr_d)]
        verify: Sequence[Step]
        acceptance: Acceptance
        if self.sampling is None:
            pred_d = engine.zeros(np.uint32, rows, label="pred_d")
            verify = (self.verify_steps(bufs, pred_d) if sums is None else
                      [*sums[0], self.finish_step(sums[1], pred_d)])
            draft = self.draft_steps(bufs, draft_d)
            acceptance = Greedy(pred_d)
        else:
            if sums is None:
                totals_d = engine.zeros(np.uint32, rows, label="verify sums")
                sums = self.verify_steps(bufs, None, partial_out=totals_d), totals_d
            vocab = self.model.vocab
            q_d = engine.alloc(np.float32, bufs.batch * max(bufs.k, 1) * vocab, zeroed=True, label="q_d")
            p_d = engine.alloc(np.float32, rows * vocab, zeroed=True, label="p_d")
            draft = self.draft_steps(bufs, draft_d, q_d)
            verify = [*sums[0], self.probs_step(sums[1], p_d)]
            acceptance = Sampling(p_d, q_d, self.seed_d, vocab)
        # a narrower width's body: its first draft steps, and the whole verify (the toy's verify
        # reads every token of the row; the columns past the width are judged by no row)
        narrower = {width: (chain(self.draft_steps(bufs, draft_d, None if self.sampling is None else q_d, width)),
                            chain(verify)) for width in widths}
        return RoundStream(bufs, draft_chain=chain(draft), verify_trunk=chain(verify), draft_d=draft_d,
                           acceptance=acceptance, rollback_tables=rollback_tables, state_tables=state_tables,
                           lengths=lengths, narrower=narrower or None, skip_done=skip_done, pace=self.cost.paced,
                           kernels=kernels)

    def tree_draft_levels(self, bufs: StreamBufs, nodes: TreeBufs, *, cand_tok_d: DeviceBuffer | None = None,
                          cand_logp_d: DeviceBuffer | None = None, candidates: int = 8,
                          hash_d: DeviceBuffer | None = None, q_d: DeviceBuffer | None = None) -> list[list[Launch]]:
        """The D + 1 steps of a tree draft, each a list of launches: the cost knob's weight reads,
        then toy_tree_draft over the level's nodes; greedy, levels 0..D-1 write `candidates`
        candidates a node to cand_tok_d / cand_logp_d ([B][T+1][K]); sampling (hash_d [B][T+1],
        q_d f32 [B][T+1][V] given), their hash states, then toy_tree_probs writes the level's q rows."""
        m, t1, batch, draft = self.model, nodes.nodes, self.batch, self._draft_layer()
        kernel = self.module.kernel("toy_tree_draft")
        reads = self.weight_reads(self.cost.draft_bytes)
        sampled = hash_d is not None
        states = self._state_args(bufs, 1, t1 - 1)
        steps = []
        for d, (start, stop) in enumerate(nodes.levels):
            last = d == nodes.depth
            level = [*reads, kernel.prepare(grid=batch, block=BLOCK).set(
                start=start, stop=stop, last=int(last), t1=t1, mask_words=nodes.words,
                cands=0 if sampled else candidates, tok_d=nodes.tok_d, parent_d=nodes.parent_d, pos_d=nodes.pos_d,
                mask_d=nodes.mask_d, pos_start_d=bufs.pos_start_d, cand_tok=0 if sampled else cand_tok_d,
                cand_logp=0 if sampled else cand_logp_d, hash_d=hash_d if sampled else 0, draft_data=draft.data_d,
                draft_len=draft.len_d, capacity=self.capacity, kv_mask=m.kv_bits, n_layers=len(m.kv_mask),
                seed=m.seed, vocab=m.vocab, noise_ppm=m.noise_ppm, spread=m.tree_spread, **states)]
            if sampled and not last:
                grid = (min(-(-m.vocab // 256), 64), batch * (stop - start))  # a grid row a node
                level.append(self.module.kernel("toy_tree_probs").prepare(grid=grid, block=256).set(
                    hash_d=hash_d, t1=t1, start=start, stop=stop, batch=batch, vocab=m.vocab,
                    **_law(_sampling_mode(self.sampling).draft(m.vocab)), q_d=q_d))
            steps.append(level)
        return steps

    def tree_verify_steps(self, bufs: StreamBufs, nodes: TreeBufs, *, pred_d: DeviceBuffer | None = None,
                          totals_d: DeviceBuffer | None = None) -> list[Launch]:
        """The tree verify: its weight reads, then toy_tree_verify over every node, writing the
        target's predictions (pred_d, [B][T+1]) or its sums (totals_d, [B][T+1], for toy_probs)."""
        m, t1 = self.model, nodes.nodes
        verify = self.module.kernel("toy_tree_verify").prepare(grid=self.batch, block=BLOCK).set(
            t1=t1, mask_words=nodes.words, tok_d=nodes.tok_d, parent_d=nodes.parent_d, pos_d=nodes.pos_d,
            mask_d=nodes.mask_d, pos_start_d=bufs.pos_start_d, pred_d=0 if pred_d is None else pred_d,
            totals_d=0 if totals_d is None else totals_d, tgt_data=self.data_ptrs_d, tgt_len=self.len_ptrs_d,
            n_layers=len(self.layers), capacity=self.capacity, seed=m.seed, vocab=m.vocab,
            **self._state_args(bufs, 0, t1 - 1))
        return [*self.weight_reads(self.cost.verify_bytes), verify]

    def tree_round_stream(self, bufs: StreamBufs, tree: Tree, *, candidates: int = 8,
                          kernels: SpecKernels | None = None, lengths: DraftLengths | None = None,
                          skip_done: bool = False) -> RoundStream:
        """A RoundStream of tree rounds (docs/trees.md) driving this model: TreeBufs(bufs, tree), the
        draft's D + 1 levels (toy_tree_draft, candidates=K of them a node, or in sampling mode the
        draft's q rows), the verify of every node under its ancestor mask (toy_tree_verify, and
        toy_probs in sampling mode), Greedy(pred_d) with Candidates, or Sampling(p_d, q_d, seed_d,
        vocab); one rollback table over target and draft layers with pos_ctr last, the KV data of
        every layer for the compaction, and the recurrent states with T + 1 slots a bank. bufs must be
        of Geometry.of_tree(tree, ...); a model with recurrent layers lays its states out for the tree, so build
        this stream before the first prefill. The round's tree buffers: stream.round.tree_bufs.
        `lengths`: each row's acceptance capped at the length chosen for it on the device, as deep
        as the tree goes (TreeRound's lengths=). `skip_done`: the burst graphs skip a round's draft
        and verify once every row is done (TreeRound's)."""
        if not isinstance(tree, (TreeShape, DynamicTree)):
            raise TypeError(f"a tree is a TreeShape or a DynamicTree, not {tree!r}")
        if bufs.geometry != Geometry.of_tree(tree, bufs.m_rounds, bufs.batch):
            raise ValueError(f"a tree of depth {tree.depth} runs on StreamBufs of Geometry.of_tree (k = {tree.depth}, "
                             f"width {tree.nodes}), not k = {bufs.k}, width {bufs.geometry.width}")
        if self.layers != range(len(self.model.kv_mask)) or not self.draft.kv:
            raise ValueError("the toy's tree rounds run the whole model: a pipeline stage (layers=, with_draft=False) "
                             "has no tree verify")
        if tree.nodes > BLOCK:
            raise ValueError(f"the toy verifies at most {BLOCK} tree nodes a round, not {tree.nodes}")
        candidates = as_candidates(candidates)
        if self.sampling is None and tree.draws > candidates:
            raise ValueError(f"the tree asks for {tree.draws} candidates a node, but the draft offers {candidates}")
        if self.sampling is not None:
            tree.check_sampled()
        self._check_batch(bufs)
        self._states(bufs, tree.nodes - 1)  # refused if the states were laid out for other rounds
        engine, t1, batch, vocab = self.engine, tree.nodes, bufs.batch, self.model.vocab
        nodes = TreeBufs(bufs, tree)
        table = kv_len_ptr_table(engine, self.target + self.draft, pos_ctr=bufs.pos_ctr_d)
        kv_data = kv_data_table(engine, [None if kv is None else KVData.from_layer(kv)
                                         for kv in [*self.target.kv, *self.draft.kv]])
        state_tables = self.state_tables(bufs, t1 - 1)
        verify: Sequence[Step]
        acceptance: Acceptance
        drafted: Candidates | None = None  # greedy: the candidates the levels chose among
        if self.sampling is None:
            cand_tok_d = engine.zeros(np.uint32, batch * t1 * candidates, label="tree candidates")
            cand_logp_d = engine.alloc(np.float32, batch * t1 * candidates, zeroed=True, label="tree candidate logp")
            pred_d = engine.zeros(np.uint32, batch * t1, label="tree pred_d")
            levels = self.tree_draft_levels(bufs, nodes, cand_tok_d=cand_tok_d, cand_logp_d=cand_logp_d,
                                            candidates=candidates)
            verify = self.tree_verify_steps(bufs, nodes, pred_d=pred_d)
            acceptance, drafted = Greedy(pred_d), Candidates(cand_tok_d, cand_logp_d)
        else:
            rows = batch * t1
            hash_d = engine.zeros(np.uint32, rows, label="tree draft hash states")
            q_d = engine.alloc(np.float32, rows * vocab, zeroed=True, label="tree q_d")
            p_d = engine.alloc(np.float32, rows * vocab, zeroed=True, label="tree p_d")
            totals_d = engine.zeros(np.uint32, rows, label="tree verify sums")
            probs = self.probs_step(totals_d, p_d)
            levels = self.tree_draft_levels(bufs, nodes, hash_d=hash_d, q_d=q_d)
            verify = [*self.tree_verify_steps(bufs, nodes, totals_d=totals_d), probs]
            acceptance = Sampling(p_d, q_d, self.seed_d, vocab)
        rnd = TreeRound(bufs, nodes, kernels=kernels, draft_levels=[chain(level) for level in levels],
                        verify_tree=chain(verify), acceptance=acceptance, candidates=drafted, rollback_tables=[table],
                        kv_data=kv_data, state_tables=state_tables, lengths=lengths, skip_done=skip_done)
        self.tree = tree  # prefills lay the states out for it from now on
        return RoundStream.of(rnd, pace=self.cost.paced)


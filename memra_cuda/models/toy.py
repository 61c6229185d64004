"""The toy language model: its definition in numpy, and the same model on the GPU.

A deterministic model whose next token depends on every KV entry, so a wrong rollback or a
wrong position changes the output (docs/toy-model.md, "Definition"). The numpy half is the
oracle: `target_greedy` is what any correct speculative decoder must reproduce (toy_reference.py runs
the whole round-stream loop on numpy buffers, for the tests).
`ToyLM` is the same model as ptx/toy_lm.cu kernels, wired to a RoundStream.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..acceptance import Greedy, Sampling
from ..kernels import batch_rows
from ..stream import RoundStream, chain
from ..tables import Cache, PointerTable, kv_len_ptr_table

if TYPE_CHECKING:
    from ..bufs import StreamBufs
    from ..driver.buffer import DeviceBuffer
    from ..driver.engine import Engine
    from ..driver.module import Launch
    from ..kernels import SpecKernels

M32 = 0xFFFFFFFF
BLOCK = 512  # toy_lm.cu's block size; verify handles k + 1 <= BLOCK tokens
SAMPLE_BLOCK = 256  # toy_lm.cu's SAMPLE_BLOCK, the block of toy_draft_sample


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


@dataclass(frozen=True)
class ToyModel:
    """The toy's parameters: target layers `kv_mask` (True: the layer has a KV cache), the
    draft's error rate `noise_ppm` and its confidence floor `p_min`."""

    seed: int = 1
    vocab: int = 32000
    kv_mask: tuple[bool, ...] = (True, True, False, True)
    noise_ppm: int = 100_000
    p_min: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= len(self.kv_mask) <= 32:
            raise ValueError(f"the toy has 1 to 32 target layers, not {len(self.kv_mask)}")
        if not 0 <= self.seed <= M32 or not 1 <= self.vocab <= M32:
            raise ValueError("seed must be a u32 and vocab a positive u32")
        if not 0 <= self.noise_ppm <= 1_000_000:
            raise ValueError(f"noise_ppm must be in [0, 1e6], not {self.noise_ppm}")

    def embed(self, token: int, pos: int) -> int:
        return fmix(token * 0x9E3779B1 + pos * 0x85EBCA77 + self.seed)

    @property
    def kv_bits(self) -> int:
        return sum(1 << layer for layer, has_kv in enumerate(self.kv_mask) if has_kv)

    @property
    def break_below(self) -> int:
        """Draft confidences q/1000 below p_min, counted: a break is `q < break_below`, so the
        kernel compares integers exactly as numpy does."""
        return int(np.count_nonzero(np.arange(1000) / 1000 < self.p_min))

    def state(self, history: int, token: int, pos: int) -> int:
        """The target's hash state after `token` at `pos` (`history`: the wrapping sum of every
        KV layer's entries before pos); its greedy token is fmix(state) % vocab."""
        e = self.embed(token, pos)
        total = history
        for layer, has_kv in enumerate(self.kv_mask):
            total += fmix(e ^ salt(layer)) if has_kv else fmix(token ^ salt(layer))
        return self.seed ^ (total & M32)

    def predict(self, history: int, token: int, pos: int) -> int:
        """The target's greedy token after `token` at `pos`."""
        return fmix(self.state(history, token, pos)) % self.vocab

    def candidates(self, state: int) -> list[int]:
        """Sampling mode's four candidate tokens at a hash state (toy_lm.cu's mixture)."""
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
        return fmix(((pos * 0x9E3779B1) & M32) ^ self.seed ^ 0x5BD1E995) % 1_000_000 < self.noise_ppm

    def draft_breaks(self, pos: int) -> bool:
        return fmix(pos ^ self.seed ^ 0x68E31DA4) % 1000 < self.break_below


def target_greedy(model: ToyModel, prompt: Sequence[int], max_new_tokens: int,
                  eos: int | None = None) -> list[int]:
    """The target's own greedy continuation: the output speculative decoding must equal."""
    history = model.history(prompt[:-1])
    token, pos, out = int(prompt[-1]), len(prompt) - 1, []
    while len(out) < max_new_tokens:
        nxt = model.predict(history, token, pos)
        history = (history + model.kv_entries(token, pos)) & M32
        out.append(nxt)
        if nxt == eos:
            break
        token, pos = nxt, pos + 1
    return out


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
        for name in ("temperature", "floor", "draft_temperature", "draft_floor"):
            value = getattr(self, name)
            if not (value >= 0 and (value <= 1 or "temperature" in name)):
                raise ValueError(f"{name} must be >= 0 (a floor at most 1), not {value}")

    @staticmethod
    def weights(vocab: int, temperature: float, floor: float) -> tuple[float, ...]:
        """(floor / vocab, c_0 .. c_3) as the kernels take them (f32 values)."""
        j = np.arange(4)
        c = np.exp(-j / temperature) if temperature > 0 else (j == 0).astype(float)
        c = (1 - floor) * c / c.sum()
        return tuple(float(np.float32(w)) for w in (floor / vocab, *c))

    def target(self, vocab: int) -> tuple[float, ...]:
        return self.weights(vocab, self.temperature, self.floor)

    def draft(self, vocab: int) -> tuple[float, ...]:
        return self.weights(vocab, self.draft_temperature, self.draft_floor)


@dataclass(frozen=True)
class ToyCost:
    """Bytes of "weights" the verify trunk and each draft step stream from device memory, so
    the toy can stand in for a real model's memory-bound forward pass."""

    verify_bytes: int = 0
    draft_bytes: int = 0

    @property
    def paced(self) -> bool:
        """Whether bursts should be paced (RoundStream's `pace`): a toy that streams weights
        stands in for a real model, whose rounds cost more than a readback; the bare toy's
        rounds (~20 us) cost less."""
        return bool(self.verify_bytes or self.draft_bytes)


# An 8B target and a 0.5B draft in bf16, memory-bound: their weights, read once per forward pass.
COST_8B_05B = ToyCost(verify_bytes=16 * 10**9, draft_bytes=1 * 10**9)


class ToyLM:
    """The toy on the GPU for `batch` sequences: target and draft KV caches ([B][capacity]
    entries per layer, i32[B] lengths), the kernels, and their wiring. Each row has its own
    prompt, position and caches; the weights (the cost knob) are read once for the batch.

    A pipeline stage (models/pipeline.py) holds only the target layers `layers` of the model,
    and the draft only if `with_draft`; its verify passes partial sums on to the next stage.
    With `sampling`, the draft samples its tokens, the verify writes the target's probabilities
    and the round accepts stochastically (spec_accept_sample), each row with its request's seed.
    """

    def __init__(self, engine: Engine, model: ToyModel, capacity: int, cost: ToyCost = ToyCost(),
                 weights: DeviceBuffer | None = None, batch: int = 1, layers: range | None = None,
                 with_draft: bool = True, sampling: ToySampling | None = None):
        """`weights`: a buffer to stream for the cost knob, shareable between models (one is
        allocated when the cost needs it and none is given)."""
        self.engine, self.model, self.capacity, self.cost = engine, model, int(capacity), cost
        self.batch = int(batch)
        self.layers = range(len(model.kv_mask)) if layers is None else layers
        if not (self.layers.step == 1 and 0 <= self.layers.start < self.layers.stop <= len(model.kv_mask)):
            raise ValueError(f"a stage holds a contiguous, non-empty range of the model's {len(model.kv_mask)} "
                             f"layers, not {layers}")
        self.module = engine.load_ptx("toy_lm")
        self.target = Cache.allocate(engine, model.kv_mask[self.layers.start:self.layers.stop], capacity,
                                     batch=self.batch)
        self.draft = Cache.allocate(engine, [True] if with_draft else [], capacity, batch=self.batch)
        layers = self.target.kv
        self.data_ptrs_d = PointerTable(engine, [None if kv is None else kv.data_d for kv in layers], label="toy data")
        self.len_ptrs_d = PointerTable(engine, [None if kv is None else kv.len_d for kv in layers], label="toy lengths")
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

    def prefill(self, bufs: StreamBufs, prompt: Sequence[int], seed: int = 0) -> int:
        """Fill both caches with the prompt but its last token, which becomes pending, and
        reset the request's buffers (bufs.reset; the stop rule is generate's). Returns the
        start position, len(prompt) - 1. For one sequence; a batch fills its rows with
        prefill_row."""
        if self.batch != 1:
            raise ValueError(f"prefill() fills a batch of 1; this model holds {self.batch}: use prefill_row")
        return self.prefill_row(bufs, 0, prompt, seed)

    def prefill_row(self, bufs: StreamBufs, row: int, prompt: Sequence[int], seed: int = 0) -> int:
        """prefill() for the sequence in slot `row` (bufs.reset_row), leaving the other rows
        alone: a new request joins between bursts. `seed` is the request's (sampling mode): its
        tokens depend on it alone. Returns its start position."""
        n = len(prompt) - 1
        if not 0 <= n <= self.capacity:
            raise ValueError(f"a prompt of {len(prompt)} tokens does not fit a cache of {self.capacity}")
        self._check_batch(bufs)
        engine = self.engine
        bufs.reset_row(engine, row, prompt[-1], n)
        if self.seed_d is not None:
            engine.copy_htod(self.seed_d, [seed], start=row)
        if n:
            engine.copy_htod(self.prompt_d, prompt[:-1])
            draft = self.draft.kv[0] if self.draft.kv else None
            self.module.kernel("toy_prefill").prepare(
                ["ptr", "u32", "u32", "u32", "ptr", "ptr", "u32", "u32", "ptr", "ptr", "u32"],
                grid=(n + BLOCK - 1) // BLOCK, block=BLOCK)(
                self.prompt_d, n, row, self.capacity, self.data_ptrs_d, self.len_ptrs_d, len(self.layers),
                self.layers.start, draft.data_d if draft else 0, draft.len_d if draft else 0, self.model.seed)
        else:
            for kv in [*self.target.kv, *self.draft.kv]:
                if kv is not None:
                    engine.set_u32(kv.len_d, row, 0)
        return n

    def _check_batch(self, bufs: StreamBufs) -> None:
        if bufs.batch != self.batch:
            raise ValueError(f"buffers for a batch of {bufs.batch} do not fit a toy model of {self.batch} rows")

    def _weight_reads(self, nbytes: int) -> list[Launch]:
        """The cost knob: a grid-wide pass over `nbytes` of weights (nothing when 0)."""
        if not nbytes:
            return []
        grid = 4 * self.engine.multiprocessors
        return [self.module.kernel("toy_stream_weights").prepare(["ptr", "u64", "ptr"], grid=grid, block=512)
                .set(self.weights_d, nbytes // 16, self.sink_d)]

    def draft_steps(self, bufs: StreamBufs, draft_d: DeviceBuffer, q_d: DeviceBuffer | None = None) -> list[Launch]:
        """The k+1 launches of one draft chain (each after its share of weight streaming); in
        sampling mode each of the first k is followed by its draw, which writes the draft's
        probabilities to q_d, [B][max(k, 1)][vocab]."""
        self._check_batch(bufs)
        draft_d = batch_rows("draft_d", self.engine.buffer(draft_d, "draft_d"), self.batch, max(bufs.k, 1), bufs.k)
        if not self.draft.kv:
            raise ValueError("this pipeline stage holds no draft: the stage that has it runs the draft chain")
        m, draft, engine = self.model, self.draft.kv[0], self.engine
        kernel = self.module.kernel("toy_draft_step")
        types = ["u32", "u32", *["ptr"] * 6, *["u32"] * 7, "ptr"]
        state_d = engine.zeros(np.uint32, self.batch, label="draft states") if q_d is not None else None
        steps, reads = [], self._weight_reads(self.cost.draft_bytes)
        for step in range(bufs.k + 1):
            steps += reads
            steps.append(kernel.prepare(types, grid=self.batch, block=BLOCK).set(
                step, bufs.k, bufs.pend_d, draft_d, bufs.pos_ctr_d, bufs.brk_d, draft.data_d, draft.len_d,
                self.capacity, m.kv_bits, len(m.kv_mask), m.seed, m.vocab, m.noise_ppm, m.break_below,
                0 if state_d is None else state_d))
            if state_d is not None and step < bufs.k:
                steps.append(self._draft_sample(bufs, step, state_d, draft_d, q_d))
        return steps

    def _draft_sample(self, bufs: StreamBufs, step: int, state_d: DeviceBuffer, draft_d: DeviceBuffer,
                      q_d: DeviceBuffer) -> Launch:
        """Sampling mode: draft token `step` drawn over the vocabulary by many blocks a row."""
        vocab, engine = self.model.vocab, self.engine
        blocks = max(1, min(-(-vocab // SAMPLE_BLOCK), 16 * engine.multiprocessors // self.batch))
        scratch = engine.alloc(np.uint64, 2 * self.batch, zeroed=True, label="draft race scratch")
        return self.module.kernel("toy_draft_sample").prepare(
            ["u32", "u32", *["ptr"] * 5, "u32", *["f32"] * 5, "ptr"], grid=(blocks, self.batch),
            block=SAMPLE_BLOCK).set(step, bufs.k, state_d, bufs.pos_ctr_d, draft_d, q_d, self.seed_d, vocab,
                                    *self.sampling.draft(vocab), scratch)

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
        verify = self.module.kernel("toy_verify").prepare(
            ["ptr", "u32", "ptr", "ptr", "ptr", "ptr", *["u32"] * 5, "ptr", "ptr"], grid=self.batch, block=BLOCK).set(
            bufs.vtok_d, bufs.k + 1, bufs.pos_start_d, pred, self.data_ptrs_d, self.len_ptrs_d,
            len(self.layers), self.capacity, m.seed, m.vocab, self.layers.start, before, after)
        return [*self._weight_reads(self.cost.verify_bytes), verify]

    def round_stream(self, spec: SpecKernels, bufs: StreamBufs) -> RoundStream:
        """A RoundStream driving this model: rollback walks one table over target and draft
        layers with pos_ctr last."""
        if bufs.k + 1 > BLOCK:
            raise ValueError(f"the toy verifies at most {BLOCK} tokens a round: k must be < {BLOCK}")
        self._check_batch(bufs)
        engine = self.engine
        draft_d = engine.zeros(np.uint32, bufs.batch * max(bufs.k, 1), label="draft_d")
        table = kv_len_ptr_table(engine, self.target + self.draft, pos_ctr=bufs.pos_ctr_d)
        if self.sampling is None:
            pred_d = engine.zeros(np.uint32, bufs.batch * (bufs.k + 1), label="pred_d")
            return RoundStream(spec, bufs, draft_chain=chain(self.draft_steps(bufs, draft_d)),
                               verify_trunk=chain(self.verify_steps(bufs, pred_d)), draft_d=draft_d,
                               acceptance=Greedy(pred_d), rollback_tables=[table], pace=self.cost.paced)
        vocab, rows = self.model.vocab, bufs.batch * (bufs.k + 1)
        if rows > 65535:
            raise ValueError(f"the toy's sampling verify gives each of B(k+1) = {rows} positions a grid row: "
                             "at most 65535")
        q_d = engine.alloc(np.float32, bufs.batch * max(bufs.k, 1) * vocab, zeroed=True, label="q_d")
        p_d = engine.alloc(np.float32, rows * vocab, zeroed=True, label="p_d")
        totals_d = engine.zeros(np.uint32, rows, label="verify sums")
        probs = self.module.kernel("toy_probs").prepare(
            ["ptr", "u32", "u32", "u32", *["f32"] * 5, "ptr"], grid=(min(-(-vocab // 256), 64), rows), block=256).set(
            totals_d, rows, self.model.seed, vocab, *self.sampling.target(vocab), p_d)
        return RoundStream(spec, bufs, draft_chain=chain(self.draft_steps(bufs, draft_d, q_d)),
                           verify_trunk=chain([*self.verify_steps(bufs, None, partial_out=totals_d), probs]),
                           draft_d=draft_d, acceptance=Sampling(p_d, q_d, self.seed_d, vocab), rollback_tables=[table],
                           pace=self.cost.paced)

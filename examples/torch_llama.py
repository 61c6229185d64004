"""A real transformer decoding through round-stream: a Llama-architecture model from
`transformers` with a self-speculative draft, serving a batch of requests on one PyTorch stream,
greedy or sampled, whole batches at once or continuously as requests come and go.

The model is built from a config with random weights (nothing is downloaded). Its draft is
honestly part of it: the same embeddings, first decoder layer(s), final norm and head; the
target's remaining layers have their residual contributions (o_proj, down_proj) scaled down,
so the draft agrees with the target often but not always. Both keep a static KV cache of B rows
whose per-layer lengths are device int32 tensors registered with round-stream as KVLayers, and
every position they use is read on the device, per row, so a whole burst of rounds over the
whole batch can be captured.

Its hybrid variant (`--hybrid`, build_model(recurrent_layers=HYBRID)) has a few of the target's
layers a gated linear recurrence instead of attention (RecurrentLayer), whose state of heads ×
d_k × d_v a row the verify leaves in slots after each of its k+1 tokens and round-stream rolls
back in the same round, by copy or by flipping an index (`--state-rollback copy|flip`); its
reference is its own plain greedy decoding (GraphedGreedy), as Hugging Face cannot run the
layer.

    PYTHONPATH=. python examples/torch_llama.py [--size small|large] [--batch B] [--tokens 256]
        [--k 4] [--m-rounds 16] [--mode graph] [--eos ID] [--temperature T --top-k K --top-p P]
        [--hybrid [--state-rollback copy|flip]]

`make bench-torch` times it against Hugging Face generate, assisted generation with the same
draft, and plain greedy decoding captured with torch.cuda.graph, one request and batches, and
the hybrid variant against its own graphed plain greedy.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import functools
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaConfig, LlamaForCausalLM

from memra_cuda import (Cache, Engine, Greedy, KVLayer, Mode, RoundStream, Sampling, StateLayer, StreamBufs,
                        kv_capacity, kv_len_ptr_table, state_copy_table, state_flip_table)
from memra_cuda.buffers import KVData, StateIndexTable, StateTable
from memra_cuda.kernels import SpecKernels
from memra_cuda.rounds import MODES
from memra_cuda.torch import adapter as memra_torch
from memra_cuda.buffers.layout import ACC_ROUND, ACC_WORDS, CTL_DONE, CTL_WORDS
from memra_cuda.rounds.stream import as_mode

SIZES = {  # the prototype model, and one about 16 times its parameters
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=8, dtype=torch.float32),
    "large": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                  num_key_value_heads=8, dtype=torch.bfloat16),
}
PROMPT = [1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203]
HYBRID = (2, 5)  # the hybrid variant's recurrent layers: the target's, past the draft's
GATE_BIAS = 3.0  # sigmoid(3) = 0.95: a recurrent state remembers about the last twenty tokens


def prompts(batch: int, seed: int = 0, shortest: int = 2, longest: int = 40) -> list[list[int]]:
    """`batch` prompts of different lengths (from `shortest` to `longest` tokens), each starting
    with BOS: requests as a server sees them."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (batch,), generator=gen).tolist()
    return [[1] + torch.randint(2, 32000, (n - 1,), generator=gen).tolist() for n in lengths]


def build_model(size: str = "small", *, draft_layers: int = 1, residual_scale: float = 0.01,
                logit_scale: float = 1.0, head_dim: int | None = None, recurrent_layers: Sequence[int] = (),
                seed: int = 0) -> LlamaForCausalLM:
    """A random-weight Llama of `size` on the GPU, with layers past the draft's scaled down.
    `logit_scale` multiplies the head's weights: random ones give logits so flat that sampling
    is near uniform; a scale of a few makes the sampled law peaked, as a trained model's is.
    `head_dim` sets a head size other than hidden_size / heads, as some configs do.
    `recurrent_layers` (the hybrid variant: HYBRID) become RecurrentLayers, scaled down alike;
    Hugging Face's own forward cannot run them, the example's Stack can."""
    count = SIZES[size]["num_hidden_layers"]
    if any(not draft_layers <= i < count for i in recurrent_layers):
        raise ValueError(f"recurrent layers must be among layers {draft_layers}..{count - 1}, past the draft's "
                         f"{draft_layers}: the draft stays attention (it folds its last step, docs/model-side.md), "
                         f"not {tuple(recurrent_layers)}")
    shape = dict(SIZES[size], **({"head_dim": head_dim} if head_dim else {}))
    dtype = shape.pop("dtype")
    config = LlamaConfig(vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, attn_implementation="sdpa", **shape)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            for layer in model.model.layers[draft_layers:]:
                layer.self_attn.o_proj.weight.mul_(residual_scale)
                layer.mlp.down_proj.weight.mul_(residual_scale)
            model.lm_head.weight.mul_(logit_scale)
            for i in recurrent_layers:
                model.model.layers[i] = RecurrentLayer(model.model.layers[i], config, residual_scale)
    model = model.to(dtype).eval().requires_grad_(False)  # inference: no autograd graph kept alive by the caches
    model.generation_config.eos_token_id = None  # greedy runs to the budget unless an EOS is asked for
    model.generation_config.pad_token_id = 0
    return model


def draft_model(model: LlamaForCausalLM, draft_layers: int = 1) -> LlamaForCausalLM:
    """The draft as a model of its own (for Hugging Face's assisted generation): the target's
    own modules, first `draft_layers` layers only."""
    config = LlamaConfig(**{**model.config.to_dict(), "num_hidden_layers": draft_layers})
    with torch.device("meta"):
        draft = LlamaForCausalLM(config)
    draft.model.embed_tokens = model.model.embed_tokens
    draft.model.layers = torch.nn.ModuleList(model.model.layers[:draft_layers])
    draft.model.norm, draft.model.rotary_emb, draft.lm_head = model.model.norm, model.model.rotary_emb, model.lm_head
    draft.generation_config = copy.deepcopy(model.generation_config)
    return draft.eval()


@dataclass(frozen=True)
class SamplingParams:
    """Temperature, then top-k (0: off), then top-p (1: off), as Hugging Face's logits
    processors apply them; probs() turns logits into the f32 probabilities round-stream's
    stochastic acceptance reads, on the device."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (greedy is sampling=None), not {self.temperature}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an int >= 0, not {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float() / self.temperature
        if self.top_k:
            kth = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, -math.inf)
        if self.top_p < 1:  # drop the least likely tokens whose mass together is at most 1 - top_p
            ascending, order = logits.sort(dim=-1)
            drop = ascending.softmax(-1).cumsum(-1) <= 1 - self.top_p
            drop[..., -1] = False  # the likeliest token always stays
            logits = logits.masked_fill(drop.scatter(-1, order, drop), -math.inf)
        return logits.softmax(-1)


def head_size(config: LlamaConfig) -> int:
    """The config's head_dim where it has one, else hidden_size / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class RecurrentLayer(torch.nn.Module):
    """A decoder layer whose attention is a gated linear recurrence (random weights), between the
    Llama layer's own norms and MLP. Per head, with x_t the normed input:

        g_t = sigmoid(w_g x_t + b_g),   S_t = g_t S_{t-1} + k_t^T v_t,   o_t = q_t S_t / sqrt(d_k)

    with q, k (d_k) and v (d_v = d_k) projections of x_t, S a d_k × d_v matrix (heads × d_k × d_v
    a row, fp32 whatever the model's dtype) and o_t, over the heads, through an output
    projection scaled down like the other layers past the draft's. A module of its own rather
    than a replaced attention: Stack hands it the state in and takes the states out, which no
    transformers decoder layer would pass along.
    """

    def __init__(self, layer: torch.nn.Module, config: LlamaConfig, out_scale: float):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        self.mlp = layer.mlp
        self.heads, self.d_k, self.d_v = config.num_attention_heads, head_size(config), head_size(config)
        hidden, std = config.hidden_size, config.initializer_range
        self.q_proj = torch.nn.Linear(hidden, self.heads * self.d_k, bias=False)
        self.k_proj = torch.nn.Linear(hidden, self.heads * self.d_k, bias=False)
        self.v_proj = torch.nn.Linear(hidden, self.heads * self.d_v, bias=False)
        self.gate = torch.nn.Linear(hidden, self.heads)
        self.o_proj = torch.nn.Linear(self.heads * self.d_v, hidden, bias=False)
        for linear in (self.q_proj, self.k_proj, self.v_proj, self.gate):
            torch.nn.init.normal_(linear.weight, std=std)
        torch.nn.init.constant_(self.gate.bias, GATE_BIAS)
        torch.nn.init.normal_(self.o_proj.weight, std=std * out_scale)

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return self.heads, self.d_k, self.d_v

    def forward(self, hidden: torch.Tensor, state: torch.Tensor,
                store: Callable[[int, torch.Tensor], None] | None = None,
                active: torch.Tensor | None = None,
                parents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden` is [R][T][hidden_size], R rows of T tokens; `state` [R][heads][d_k][d_v] the
        rows' state before the first token, only read. Token by token, as a decoder steps, so
        the state after every token exists: `store(t, state)` takes the one after token t. Where
        `active` [R][T] is False a row's state stays as it was (a prefill's padding). The tokens
        are a tree's nodes where `parents` [R][T] is given: token t >= 1 steps from the state
        after its parent (an earlier token; a garbage parent is clamped to one), token 0 from
        `state`. Returns the layer's output and the state after the last token."""
        x = self.input_layernorm(hidden)
        rows, tokens, _ = x.shape
        q = (self.q_proj(x).float() * self.d_k ** -0.5).view(rows, tokens, self.heads, 1, self.d_k)
        k = self.k_proj(x).float().view(rows, tokens, self.heads, self.d_k, 1)
        v = self.v_proj(x).float().view(rows, tokens, self.heads, 1, self.d_v)
        g = torch.sigmoid(self.gate(x).float()).view(rows, tokens, self.heads, 1, 1)
        if parents is not None:
            every = torch.arange(rows, device=x.device)
            parents = parents.long()
            after_node = torch.empty(rows, tokens, *state.shape[1:], device=x.device)
        out = []
        for t in range(tokens):
            if parents is not None and t:
                state = after_node[every, parents[:, t].clamp(0, t - 1)]
            after = g[:, t] * state + k[:, t] * v[:, t]
            state = after if active is None else torch.where(active[:, t, None, None, None], after, state)
            if parents is not None:
                after_node[:, t] = state
            if store is not None:
                store(t, state)
            out.append(q[:, t] @ state)  # [R][heads][1][d_v]
        mixed = torch.stack(out, 1).view(rows, tokens, self.heads * self.d_v).to(hidden.dtype)
        hidden = hidden + self.o_proj(mixed)
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), state


class LiveState:
    """The state of a Stack's recurrent layers for plain decoding (GraphedGreedy): `live`
    [layers][B][heads][d_k][d_v], which every forward reads and leaves, in place, as the state
    after its last token.

    The interface every strategy gives Stack: begin() before a forward over every row, which
    reads each layer's state with read() and hands the state after each token to store();
    reset() and set_prompt() for a new request. Every tensor stays at its address, so graphs
    captured over them stay valid.
    """

    def __init__(self, layers: int, batch: int, shape: tuple[int, int, int]):
        self.live = torch.zeros(layers, batch, *shape, device="cuda")

    def begin(self) -> None:
        """Per-forward set-up shared by every layer (FlipState works out its slots once here)."""

    def read(self, layer: int) -> torch.Tensor:
        return self.live[layer]

    def store(self, layer: int, token: int, state: torch.Tensor) -> None:
        self.live[layer].copy_(state)

    def reset(self, rows: torch.Tensor) -> None:
        """Zero state for a new request in each of `rows`: a prompt of one token runs no prefill
        forward to set it."""
        self.live[:, rows] = 0

    def set_prompt(self, layer: int, rows: torch.Tensor, state: torch.Tensor) -> None:
        """Each of `rows` starts from `state` (its prompt's, [rows][...])."""
        self.live[layer].index_copy_(0, rows, state)


class CopyState(LiveState):
    """Rollback by copy (docs/model-side.md, "Recurrent state"): the live state as LiveState's,
    and `slots` [layers][B][k+1][...]. A forward over every row (the verify) reads live and
    writes the state after its token i to slot i, never live, so a rejected draft's state never
    reaches it; round-stream's rollback copies slot keep - 1 over live."""

    def __init__(self, layers: int, batch: int, shape: tuple[int, int, int], k: int):
        super().__init__(layers, batch, shape)
        self.k = k
        self.slots = torch.zeros(layers, batch, k + 1, *shape, device="cuda")

    def store(self, layer: int, token: int, state: torch.Tensor) -> None:
        self.slots[layer, :, token].copy_(state)

    def table(self, engine: Engine) -> StateTable:
        words = self.live[0, 0].numel()
        return state_copy_table(engine, [StateLayer(live, slots, words, self.k)
                                         for live, slots in zip(self.live, self.slots)])


class FlipState:
    """Rollback by flipping an index: `slots` [layers][B][2(k+1)][...], two banks of k + 1, and
    one u32[B] slot index for the model (`index_d`, round-stream's; `index`, its int32 view).
    With bank = min(idx / (k+1), 1), a forward over every row reads slot bank·(k+1) + idx % (k+1)
    and writes the state after its token i to slot (1 - bank)·(k+1) + i, in the other bank, so
    the slot it read is never written; round-stream's rollback points idx at the kept slot and
    copies nothing. (The verify here still gathers each row's slot into a tensor of its own, as
    much as COPY's rollback moves: a kernel that took the index itself would not, which is where
    FLIP saves; `make bench-torch` times this example's.) A prompt's state goes to slot 0, idx 0."""

    def __init__(self, layers: int, batch: int, shape: tuple[int, int, int], k: int, engine: Engine):
        self.k = k
        self.slots = torch.zeros(layers, batch, 2 * (k + 1), *shape, device="cuda")
        self.index_d = engine.zeros(np.uint32, batch, label="state slot index")
        self.index = memra_torch.tensor(self.index_d, torch.int32)
        self.rows = torch.arange(batch, device="cuda")

    def begin(self) -> None:
        index = self.index.long() % 2**32  # the u32 the rollback kernel reads, garbage included
        bank = (index // (self.k + 1)).clamp(max=1)
        self.reading = bank * (self.k + 1) + index % (self.k + 1)
        self.writing = (1 - bank)[:, None] * (self.k + 1) + torch.arange(self.k + 1, device="cuda")  # [B][k+1]

    def read(self, layer: int) -> torch.Tensor:
        return self.slots[layer, self.rows, self.reading]

    def store(self, layer: int, token: int, state: torch.Tensor) -> None:
        self.slots[layer, self.rows, self.writing[:, token]] = state

    def reset(self, rows: torch.Tensor) -> None:
        self.slots[:, rows, 0] = 0
        self.index[rows] = 0

    def set_prompt(self, layer: int, rows: torch.Tensor, state: torch.Tensor) -> None:
        self.slots[layer, rows, 0] = state

    def table(self, engine: Engine) -> StateIndexTable:
        return state_flip_table(engine, [self.index_d])


class StaticKV:
    """K and V of `batch` rows for `n_layers` layers at fixed addresses, written at per-row
    device positions.

    Hugging Face's attention calls update(k, v, layer) with the new entries of the rows in the
    forward (`rows`, or every row where None); they land at `positions` ([rows][tokens], set by
    the caller for this forward) and the rows' whole caches come back, masked by the caller.
    `lengths` (int32 [layers][B]) counts each row's entries per layer: round-stream's rollback
    rewrites them, which is all it takes to forget rejected drafts.
    """

    def __init__(self, config: LlamaConfig, n_layers: int, batch: int, capacity: int, dtype: torch.dtype):
        heads = config.num_key_value_heads
        self.k = torch.zeros(n_layers, batch, heads, capacity, head_size(config), dtype=dtype, device="cuda")
        self.v = torch.zeros_like(self.k)
        self.lengths = torch.zeros(n_layers, batch, dtype=torch.int32, device="cuda")
        self.capacity = capacity
        self.rows: torch.Tensor | None = None
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
        self._every_row = torch.arange(batch, device="cuda")[:, None]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int, *args, **kwargs):
        rows = self._every_row if self.rows is None else self.rows[:, None]
        self.k[layer][rows, :, self.positions] = key.transpose(1, 2)
        self.v[layer][rows, :, self.positions] = value.transpose(1, 2)
        if self.rows is None:
            return self.k[layer], self.v[layer]
        return self.k[layer].index_select(0, self.rows), self.v[layer].index_select(0, self.rows)

    def cache(self) -> Cache:
        return Cache([KVLayer(self.lengths[i], self.capacity) for i in range(len(self.lengths))])

    def data(self) -> list[KVData]:
        """Where the entries live, for a tree round's compaction (kernel 15): one record a layer
        and KV head, as this cache keeps a head's positions together ([B][heads][capacity][d]).
        A record's buffers are contiguous views from its head's first entry on, so each holds
        the tensor it names."""
        layers, batch, heads, capacity, dim = self.k.shape
        size = self.k.element_size()
        entry = dim * size
        words = dim * size // 4  # as int32: torch gives bfloat16 tensors no __cuda_array_interface__
        flat_k, flat_v = (kv.view(torch.int32).view(layers, -1) for kv in (self.k, self.v))
        return [KVData(flat_k[layer, head * capacity * words:], flat_v[layer, head * capacity * words:],
                       row_stride=heads * capacity * entry, pos_stride=entry, nbytes=entry, capacity=capacity,
                       batch=batch)
                for layer in range(layers) for head in range(heads)]

    def copy_rows(self, other: StaticKV, rows: torch.Tensor) -> None:
        """`other`'s first layers' entries and lengths in `rows` (what a stack of those same
        layers computes over the same tokens)."""
        n = len(self.lengths)
        for mine, theirs in ((self.k, other.k), (self.v, other.v)):
            mine.index_copy_(1, rows, theirs[:n].index_select(1, rows))
        self.lengths.index_copy_(1, rows, other.lengths[:n].index_select(1, rows))


class Stack:
    """Embeddings, the first `n_layers` decoder layers, final norm and head of a Llama, run
    over a StaticKV of `batch` rows at positions held on the device: append(tokens, positions)
    adds the tokens' KV ([rows][tokens] each) and returns their final hidden states; logits()
    also applies the head. No value is read on the host.

    Its RecurrentLayers (a hybrid model's) keep their state in `state`, made by
    `state(layers, batch, (heads, d_k, d_v))`: LiveState for plain decoding, CopyState or
    FlipState for round-stream (None without such layers). `cache` makes the KV cache, as
    StaticKV(config, layers, batch, capacity, dtype) does (torch_tree.PagedKV lays it in pages)."""

    def __init__(self, model: LlamaForCausalLM, n_layers: int, capacity: int, batch: int = 1,
                 state: Callable[[int, int, tuple[int, int, int]], LiveState | FlipState] = LiveState,
                 cache: Callable[..., StaticKV] = StaticKV):
        self.model = model
        self.layers = model.model.layers[:n_layers]
        self.batch = batch
        self.kv = cache(model.config, n_layers, batch, capacity, model.dtype)
        recurrent = [layer for layer in self.layers if isinstance(layer, RecurrentLayer)]
        self.state = state(len(recurrent), batch, recurrent[0].state_shape) if recurrent else None
        self.slots = torch.arange(capacity, device="cuda")
        self.library: str | None = None  # None: blas_for's pick at each forward; a library's name pins it
        self.zero = torch.zeros((), dtype=model.dtype, device="cuda")  # an additive mask's two values
        self.never = torch.full((), -torch.inf, dtype=model.dtype, device="cuda")
        # The rotary embedding of every position, computed once by the model's own module (the
        # same numbers it computes per call): a step then gathers rows instead of recomputing
        # them, a dozen fewer kernels per step.
        dummy = torch.zeros(1, 1, 1, dtype=model.dtype, device="cuda")
        self.cos, self.sin = (t[0] for t in model.model.rotary_emb(dummy, self.slots[None]))
        self.prompt = torch.zeros(1, capacity, dtype=torch.long, device="cuda")  # one row's prefill
        self.prompt_row = torch.zeros(1, dtype=torch.long, device="cuda")
        self.prompt_len = torch.zeros(1, dtype=torch.long, device="cuda")
        self.prefills: dict[int, torch.cuda.CUDAGraph] = {}  # prompt length bucket -> its graph

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor, last: bool = False, **tree: torch.Tensor
               ) -> torch.Tensor:
        """The head's logits after each of `tokens` ([B][T] at `positions`), or after the last
        of each row's (the head then runs on one token a row). `tree`: append's slots, mask
        and parents, for a tree's nodes."""
        hidden = self.append(tokens, positions, **tree)
        hidden = hidden[:, -1:] if last else hidden
        with blas(self._library(hidden.shape[0] * hidden.shape[1])):  # the head's rows: B where `last`
            return self.model.lm_head(hidden)

    @contextlib.contextmanager
    def kernels(self, rows: int) -> Iterator[None]:
        """The kernels the layers of a forward of `rows` token rows (B x T) run: blas_for's BLAS library (or the
        pinned `library`), and in fp32 SDPA's math path, prefills included. SDPA's default pick
        there, its memory-efficient kernel, is the slow one at a decoder's few queries: 62 of a
        one-token draft step's 187 us on the small model, whose graphed step falls from 1.30 to
        0.87 ms through the math path (H200). In bf16 SDPA's own pick, a fused kernel, stays."""
        math = sdpa_kernel([SDPBackend.MATH]) if self.model.dtype == torch.float32 else contextlib.nullcontext()
        with blas(self._library(rows)), math:
            yield

    def _library(self, rows: int) -> str:
        return self.library or blas_for(self.model.dtype, rows)

    def greedy(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The next token after each of `tokens`."""
        return self.logits(tokens, positions).argmax(-1)

    def append(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None = None,
               lengths: torch.Tensor | None = None, *, slots: torch.Tensor | None = None,
               mask: torch.Tensor | None = None, parents: torch.Tensor | None = None) -> torch.Tensor:
        """`tokens` and `positions` are [rows][T]; rows (a device index) are the cache rows
        they belong to, every row where None.

        A prefill gives `lengths` ([rows]: each row's prompt tokens, the rest padding): its
        recurrent layers start from zero and leave each row's state after its last prompt token
        as the row's live state. Any other forward runs over every row, its recurrent layers
        from the rows' live state, handing the state after each token to `state` (a verify's
        go to slots, for round-stream to roll back).

        A tree's nodes (torch_tree.py) sit at `positions` (their depth past the root, for RoPE)
        but their K/V go to `slots` ([rows][T], the root's position plus the node's index), each
        attends where `mask` ([rows][1][T][capacity], additive: 0 attends, -inf not) says, and a
        recurrent layer steps each node from its parent's state (`parents`, [rows][T]). Otherwise
        the slots are the positions and the mask causal."""
        inner = self.model.model
        top = self.kv.capacity - 1
        positions = positions.long().clamp(0, top)  # a garbage position never writes outside
        slots = positions if slots is None else slots.long().clamp(0, top)
        hidden = inner.embed_tokens(tokens.long())
        rope = self.cos[positions], self.sin[positions]
        if mask is None:
            # causal over each row's absolute positions, additive (SDPA turns a boolean mask into
            # this at every layer)
            mask = torch.where(self.slots <= positions[..., None], self.zero, self.never)[:, None]
        self.kv.rows, self.kv.positions = rows, slots
        if self.state is not None and lengths is None:
            self.state.begin()
        with self.kernels(tokens.numel()):
            n = 0  # recurrent layers so far
            for layer in self.layers:
                if isinstance(layer, RecurrentLayer):
                    if lengths is None:
                        hidden, _ = layer(hidden, self.state.read(n), functools.partial(self.state.store, n),
                                          parents=parents)
                    else:
                        start = torch.zeros(hidden.shape[0], *layer.state_shape, device="cuda")
                        hidden, prompt = layer(hidden, start, active=self.slots[:hidden.shape[1]] < lengths[:, None])
                        self.state.set_prompt(n, rows, prompt)
                    n += 1
                    continue
                out = layer(hidden, attention_mask=mask, position_ids=positions, past_key_values=self.kv,
                            use_cache=True, cache_position=slots[0], position_embeddings=rope)
                hidden = out[0] if isinstance(out, tuple) else out
        return inner.norm(hidden)

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        """Each prompt's KV at positions 0.. of its row (lengths become the prompt's), and its
        recurrent layers' state after it live.

        One row is a graph, captured once for every power-of-two length: run eagerly, a short
        prompt's prefill is mostly the host launching a few hundred kernels (10 ms here, against
        1 ms on the GPU), and continuous batching prefills one row at a time. Several rows run
        eagerly, padded to the longest. A padding's entries, past its prompt, are rewritten
        before any position reads them."""
        lengths = [len(prompt) for prompt in prompts]
        if max(lengths, default=0) > self.kv.capacity:
            raise ValueError(f"a prompt of {max(lengths)} tokens does not fit a cache of {self.kv.capacity}")
        index = torch.tensor(list(rows), device="cuda")
        counts = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        if self.state is not None:
            self.state.reset(index)
        if len(rows) == 1 and lengths[0]:
            self.prompt[0, :lengths[0]].copy_(torch.tensor(prompts[0]), non_blocking=True)
            self.prompt_row.copy_(index)
            self.prompt_len.copy_(counts)
            self._prefill_graph(lengths[0]).replay()
        elif max(lengths, default=0):
            width = max(lengths)
            padded = torch.tensor([list(prompt) + [0] * (width - len(prompt)) for prompt in prompts])
            self.append(padded.cuda(), self.slots[:width].expand(len(rows), width), index,
                        counts if self.state is not None else None)
        self.kv.lengths[:, index] = counts

    def _prefill_graph(self, length: int) -> torch.cuda.CUDAGraph:
        bucket = min(1 << (length - 1).bit_length(), self.kv.capacity)
        if bucket not in self.prefills:
            lengths = self.prompt_len if self.state is not None else None  # the recurrence skips the padding
            # torch's lazy set-up off the graph
            self.append(self.prompt[:, :bucket], self.slots[None, :bucket], self.prompt_row, lengths)
            self.prefills[bucket] = graph = torch.cuda.CUDAGraph()
            # Captured on the caller's stream (a decoder's: a tensor-parallel model's all-reduces
            # go on the stream they run on, examples/torch_tp.py); from the default stream, which
            # cannot be captured, on torch's own side stream.
            current = torch.cuda.current_stream()
            with torch.cuda.graph(graph, stream=None if current == torch.cuda.default_stream() else current):
                self.append(self.prompt[:, :bucket], self.slots[None, :bucket], self.prompt_row, lengths)
        return self.prefills[bucket]

    def capture_prefills(self) -> None:
        """Every one-row prefill graph, now: a capture synchronises the device, so not while
        serving, and the eager warm-up before each writes scratch entries (and recurrent state)
        into a row."""
        length = 1
        while length < self.kv.capacity:
            self._prefill_graph(length)
            length *= 2
        self._prefill_graph(self.kv.capacity)  # the last bucket, the capacity itself


class Request(NamedTuple):
    """A request for generate_batch's slots or serve's queue (seed: sampling's)."""

    prompt: Sequence[int]
    max_new_tokens: int
    eos: int | None = None
    seed: int = 0


class Served(NamedTuple):
    """A request's tokens, and the seconds from the start of serve() to its last token."""

    tokens: list[int]
    latency: float


class RoundDecoder:
    """What the example's speculative decoders share, the chain's (SpeculativeLlama) and the
    tree's (torch_tree.TreeLlama): target and draft Stacks of `batch` rows (`target`, `draft`)
    wired to a RoundStream (`rounds`, over StreamBufs `bufs` of k) on one torch stream, and what
    a user does with them: prefill rows, capture the graphs, generate a batch, serve a queue.
    A subclass builds those and sets `width`, what a round writes past its position (a tree's
    T + 1; None for a chain's k + 1), `sampling` and, sampling, `seed_d` ([B] int64)."""

    width: int | None = None

    @staticmethod
    def _check(model: LlamaForCausalLM, draft_layers: int, state_rollback: str) -> None:
        """What either decoder refuses of its model: a rollback it has no strategy for, and a
        recurrent layer in the draft's."""
        if state_rollback not in ("copy", "flip"):
            raise ValueError(f'state_rollback is "copy" or "flip", not {state_rollback!r}')
        if any(isinstance(layer, RecurrentLayer) for layer in model.model.layers[:draft_layers]):
            raise ValueError(f"the draft's {draft_layers} layer(s) must be attention: its first step folds in the "
                             "last round's deepest draft (docs/model-side.md), which a recurrent layer's state "
                             "cannot take; put recurrent layers past the draft's")

    def _stacks(self, capacity: int, draft_layers: int, state_rollback: str, verified: int,
                cache: Callable[..., StaticKV] = StaticKV) -> None:
        """`target` and `draft` of the decoder's model and batch on the engine's stream, the
        target's recurrent state kept for each of the `verified` + 1 tokens a round verifies
        (`verified`: k, or a tree's T; the strategy's k)."""
        strategy = (functools.partial(CopyState, k=verified) if state_rollback == "copy" else
                    functools.partial(FlipState, k=verified, engine=self.engine))
        model, batch = self.model, self.batch
        self.target = Stack(model, model.config.num_hidden_layers, capacity, batch, strategy, cache)
        self.draft = Stack(model, draft_layers, capacity, batch, cache=cache)

    def _round_views(self) -> None:
        """The decoder's StreamBufs' words the draft's first step reads, as tensors: `vtok` [B][k+1] (the last
        round's verified tokens), `accepted` [B][1] (its drafts accepted) and `done` [B][1]."""
        bufs = self.bufs
        self.vtok = memra_torch.tensor(bufs.vtok_d, torch.int32).view(bufs.batch, bufs.k + 1)
        acc = memra_torch.tensor(bufs.acc_d, torch.int32).view(bufs.batch, ACC_WORDS)
        self.accepted = acc[:, ACC_ROUND:ACC_ROUND + 1]
        self.done = memra_torch.tensor(bufs.ctl_d).view(bufs.batch, CTL_WORDS)[:, CTL_DONE:CTL_DONE + 1]

    def _folded_logits(self, root: torch.Tensor, start: torch.Tensor, lone: torch.Tensor) -> torch.Tensor:
        """The draft's logits after `root` ([B][1], at positions `start`) in a round's first
        draft step, which appends the token the last round accepted deepest along with it
        (vtok[accepted] at start - 1: where every draft was accepted, the last draft step, which
        the draft never ran, folded in here, docs/model-side.md; otherwise an entry rewritten
        unchanged). A `lone` row has none to append (at position 0, a done row, whose entries
        stay as they are, or where that entry is there already): the root fills both columns."""
        behind = torch.where(lone, root, self.vtok.gather(1, self.accepted.long().clamp(0, self.k)))
        positions = torch.cat([start - 1 + lone.long(), start], 1)
        return self.draft.logits(torch.cat([behind, root], 1), positions, last=True)

    def _warm_up(self) -> None:
        """One eager round, so torch's lazy set-up (library handles, workspaces) happens before
        any capture; the next prefill resets everything it touched. Then every slot is vacant."""
        self.prefill(range(self.batch), [[0, 0]] * self.batch)
        self.rounds.step("readback")
        self.bufs.set_stop(budget=0)

    def _prefilled(self, index: torch.Tensor, prompts: Sequence[Sequence[int]]) -> None:
        """What a subclass sets for the rows `index` once their prompts are in."""

    def state_tables(self) -> list[StateTable | StateIndexTable]:
        """RoundStream's state_tables: the hybrid target's one table (none for a pure-attention
        model, nor for the draft, which is attention only)."""
        return [] if self.target.state is None else [self.target.state.table(self.engine)]

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]],
                seeds: Sequence[int] | None = None) -> list[int]:
        """Both caches of each row take its prompt but the last token, which becomes pending;
        `seeds` are the rows' requests' (sampling). Returns the rows' start positions."""
        rows = list(rows)
        if any(not prompt for prompt in prompts) or len(prompts) != len(rows):
            raise ValueError(f"need one prompt of at least one token for each of the {len(rows)} rows")
        starts = [len(prompt) - 1 for prompt in prompts]
        with torch.cuda.stream(self.stream):
            index = torch.tensor(rows, device="cuda")
            self.target.prefill(rows, [prompt[:-1] for prompt in prompts])
            self.draft.kv.copy_rows(self.target.kv, index)
            pending = [int(prompt[-1]) for prompt in prompts]
            if rows == list(range(self.batch)):
                self.bufs.reset(pending, starts)
            else:
                for row, token, start in zip(rows, pending, starts):
                    self.bufs.reset_row(row, token, start)
            self._prefilled(index, prompts)
            if self.sampling is not None:
                self.seed_d[index] = torch.tensor(list(seeds or [0] * len(rows)), device="cuda")
        return starts

    def capture(self, modes: Sequence[str] = ("graph", "overlap")) -> None:
        """Every graph the modes may replay, and every one-row prefill graph, captured now,
        before any request: through torch a capture synchronises the device, which a server
        must not do mid-request."""
        with torch.cuda.stream(self.stream):
            self.target.capture_prefills()
            self.rounds.capture_graphs(slots=(0, 1) if "overlap" in modes else (0,))

    def generate_batch(self, requests: Sequence[Request], mode: str = "graph") -> list[list[int]]:
        """One request per row, all started together and generated until each stops."""
        if len(requests) != self.batch:
            raise ValueError(f"need one request per row ({self.batch}), not {len(requests)}")
        self.prefill(range(self.batch), [r.prompt for r in requests], [r.seed for r in requests])
        out = self.rounds.generate_batch([r.max_new_tokens for r in requests],
                                         eos=[r.eos for r in requests], mode=mode)
        return [tokens.tolist() for tokens in out]

    def generate(self, prompt: Sequence[int], max_new_tokens: int, *, eos: int | None = None,
                 mode: str = "graph", seed: int = 0) -> list[int]:
        return self.generate_batch([Request(prompt, max_new_tokens, eos, seed)], mode)[0]

    def serve(self, requests: Sequence[Request], mode: str = "graph") -> list[Served]:
        """Continuous batching: the requests, queued in order, through the batch's slots. A
        slot is filled (prefill, reset_row, set_stop_row) as soon as its request stops, between
        bursts, and every step runs all slots; no graph is recaptured."""
        if as_mode(mode) is Mode.OVERLAP:
            raise ValueError('serve() steps one burst at a time: "overlap" keeps two in flight (generate_batch)')
        rounds, capacity = self.rounds.rounds_per_step(mode), self.target.kv.capacity
        for i, request in enumerate(requests):  # refused before anything runs, not mid-serving
            need = kv_capacity(len(request.prompt), request.max_new_tokens, self.k, rounds, batch=self.batch,
                               width=self.width)
            if need > capacity:
                raise ValueError(f"request {i} ({len(request.prompt)} prompt tokens, {request.max_new_tokens} new) "
                                 f"needs a KV cache of {need} entries in {mode} mode; these hold {capacity}")
        queue = collections.deque(enumerate(requests))
        slots: list[int | None] = [None] * self.batch
        tokens: list[list[int]] = [[] for _ in range(self.batch)]
        out: list[Served | None] = [None] * len(requests)
        self.bufs.set_stop(budget=0)
        begun = time.perf_counter()
        while queue or any(slot is not None for slot in slots):
            for row in range(self.batch):
                if slots[row] is None and queue:
                    slots[row], request = queue.popleft()
                    tokens[row] = []
                    self.prefill([row], [request.prompt], [request.seed])
                    self.bufs.set_stop_row(row, request.eos, request.max_new_tokens)
            readback = self.rounds.step(mode)
            for row, slot in enumerate(slots):
                if slot is None:
                    continue
                tokens[row] += readback.tokens[row].tolist()
                if readback.done[row]:
                    out[slot] = Served(tokens[row], time.perf_counter() - begun)
                    slots[row] = None
        return out

    def acceptance(self, committed: int | Sequence[int]) -> float:
        accepted, drafted = self.bufs.drafts_accepted(committed)
        return accepted / drafted if drafted else 1.0


class SpeculativeLlama(RoundDecoder):
    """Target and draft Stacks of `batch` rows wired to a RoundStream on one torch stream.

    The draft chain runs k draft steps from each row's pending token at its pos_ctr; the verify
    trunk runs the target over vtok at pos_start. Both read every position from round-stream's
    device buffers and write straight into the buffers it reads: greedy, int64 ids (argmax's
    own type) to draft_d and pred_d; with `sampling`, the target's probabilities to p_d, the
    draft's (`draft_sampling`, default the same) to q_d, and each draft token drawn from them by
    round-stream's position-keyed race (spec_draft_sample), so a request's tokens depend on its
    seed alone. The RoundStream is torch-backed, so the callables need no stream of their own.

    The draft's KV of the last draft token is missing after a round that accepted every draft.
    Instead of a (k+1)-th draft step for it every round (docs: the model's side), the first step
    appends the token behind the pending one along with it: vtok_d[acc_d[0]] at pos_ctr - 1,
    which is that draft or, in any other round, a token whose entry it rewrites unchanged. A step
    over two tokens costs little more than over one.

    A hybrid target's recurrent state is rolled back by `state_rollback`: "copy" (CopyState) or
    "flip" (FlipState), its table passed to RoundStream's state_tables (state_tables()), which
    rolls it back every round after the KV lengths. The draft must be attention only: the fold
    above steps over the token behind the pending one again in most rounds, which rewrites a KV
    entry unchanged but would take a token into a recurrent state twice.
    """

    def __init__(self, model: LlamaForCausalLM, *, k: int = 4, m_rounds: int = 16, capacity: int = 1024,
                 batch: int = 1, draft_layers: int = 1, sampling: SamplingParams | None = None,
                 draft_sampling: SamplingParams | None = None, state_rollback: str = "copy",
                 on_engine: Callable[[Engine], None] | None = None):
        """`on_engine` is called with the engine as soon as it exists, before anything runs on it
        (examples/torch_tp.py lets its communicator time the engine's waits and its graphs hold it)."""
        if k < 1:
            raise ValueError(f"the example drafts k >= 1 tokens a round, not {k}")
        self._check(model, draft_layers, state_rollback)
        self.model, self.k, self.batch = model, k, batch
        self.sampling, self.draft_sampling = sampling, draft_sampling or sampling
        self.stream = torch.cuda.Stream()
        with torch.cuda.stream(self.stream):
            self.engine = memra_torch.engine()
            if on_engine is not None:
                on_engine(self.engine)
            self._stacks(capacity, draft_layers, state_rollback, k)
            self.bufs = bufs = StreamBufs(self.engine, k, m_rounds, batch)
            self.pend = memra_torch.tensor(bufs.pend_d, torch.int32)[:, None]
            self.pos_ctr = memra_torch.tensor(bufs.pos_ctr_d)[:, None]
            self.pos_start = memra_torch.tensor(bufs.pos_start_d)[:, None]
            self._round_views()
            self.draft_d = torch.zeros(batch, k, dtype=torch.long, device="cuda")
            self.steps = torch.arange(k + 1, device="cuda")
            spec = SpecKernels(self.engine)
            vocab = model.config.vocab_size
            if sampling is None:
                self.pred_d = torch.zeros(batch, k + 1, dtype=torch.long, device="cuda")
                acceptance = Greedy(self.pred_d)
            else:
                self.p_d = torch.zeros(batch, k + 1, vocab, device="cuda")
                self.q_d = torch.zeros(batch, k, vocab, device="cuda")
                self.seed_d = torch.zeros(batch, dtype=torch.int64, device="cuda")
                self.draws = [spec.prepare_draft_sample(bufs, self.q_d, self.seed_d, self.draft_d, step, vocab)
                              for step in range(k)]
                acceptance = Sampling(self.p_d, self.q_d, self.seed_d, vocab)
            table = kv_len_ptr_table(self.engine, self.target.kv.cache() + self.draft.kv.cache(),
                                     pos_ctr=bufs.pos_ctr_d)
            self.rounds = RoundStream(bufs, kernels=spec, draft_chain=self.draft_chain, verify_trunk=self.verify_trunk,
                                      draft_d=self.draft_d, acceptance=acceptance, rollback_tables=[table],
                                      state_tables=self.state_tables())
            self._warm_up()

    def draft_chain(self) -> None:
        positions = self.pos_ctr.long() + self.steps  # [B][k+1]: where each draft step's input sits
        # Where the last round accepted no draft, vtok[0] is the token behind the pending one
        # (that round's own pending token, or the prompt's, which a prefill writes there),
        # appended again unchanged.
        lone = (self.done != 0) | (positions[:, :1] == 0)
        token = self._draft_token(0, self._folded_logits(self.pend, positions[:, :1], lone))
        for step in range(1, self.k):
            token = self._draft_token(step, self.draft.logits(token, positions[:, step:step + 1]))

    def _draft_token(self, step: int, logits: torch.Tensor) -> torch.Tensor:
        """Draft token `step` of every row ([B][1]) from the draft's logits there."""
        if self.sampling is None:
            torch.argmax(logits, -1, out=self.draft_d[:, step:step + 1])
        else:
            self.q_d[:, step].copy_(self.draft_sampling.probs(logits[:, 0]))
            self.draws[step]()
        return self.draft_d[:, step:step + 1]

    def verify_trunk(self) -> None:
        logits = self.target.logits(self.vtok, self.pos_start.long() + self.steps)
        if self.sampling is None:
            torch.argmax(logits, -1, out=self.pred_d)
        else:
            self.p_d.copy_(self.sampling.probs(logits))

    def _prefilled(self, index: torch.Tensor, prompts: Sequence[Sequence[int]]) -> None:
        """reset zeroes acc_d, so the first draft step reads vtok_d[0] as the token behind the
        pending one: the prompt's last but one."""
        behind = torch.tensor([prompt[-2] if len(prompt) > 1 else 0 for prompt in prompts], device="cuda")
        self.vtok[index, 0] = behind.to(torch.int32)


@contextlib.contextmanager
def blas(library: str) -> Iterator[None]:
    """torch's preferred BLAS library ("cublas", "cublaslt") for the kernels issued inside."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


# The most token rows (B x T) a forward takes through cuBLASLt, per dtype; past them, and at one
# row (GEMVs, which are cuBLAS's), cuBLAS. Measured on an H200 by `make bench-torch`'s
# tree_costs, the whole target at B = 1 in target steps: in fp32 cuBLAS serves a few rows at
# nearly twice a GEMV's time, cuBLASLt mostly faster up to 16 rows and the slower from 17 (2
# tokens: 1.25 through cuBLASLt, 1.40 through cuBLAS; 5: 1.34, 1.46; 8: 1.57, 1.53, the one
# size up to 16 where cuBLAS was ahead; 11: 1.35, 1.52; 16: 1.51, 1.62; 17: 1.89, 1.63; 65:
# 2.44, 1.88; the small model); in bf16 the two are alike from 1 to 65 rows (within 0.6%, the
# large model), and cuBLASLt, which the verify had always taken, serves every size from 2.
LT_ROWS = {torch.float32: 16, torch.bfloat16: 1 << 30}


def blas_for(dtype: torch.dtype, rows: int) -> str:
    """The BLAS library for a forward of `rows` token rows in `dtype` (Stack.kernels)."""
    return "cublaslt" if 2 <= rows <= LT_ROWS.get(dtype, 0) else "cublas"


def capacity_for(prompt_len: int, tokens: int, k: int, m_rounds: int, batch: int = 1, width: int | None = None) -> int:
    """A cache for every mode (overlap's two bursts in flight): `width` a tree's T + 1. Rounded up
    to 16 slots: SDPA's memory-efficient kernel copies a mask whose rows are not 16-aligned into
    a padded one at every call."""
    need = kv_capacity(prompt_len, tokens, k, m_rounds, overlap=True, batch=batch, width=width)
    return -(-need // 16) * 16


def hf_generate(model: LlamaForCausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                eos: int | None = None, sampling: SamplingParams | None = None,
                assistant: LlamaForCausalLM | None = None, k: int = 4) -> list[list[int]]:
    """Hugging Face's own decoding of a batch (prompts left-padded; greedy, or `sampling` from
    torch's generator), assisted by `assistant`, k tokens at a time, if given. Each row's
    tokens stop at its EOS."""
    width = max(len(prompt) for prompt in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    extra: dict = {}
    if assistant is not None:
        config = assistant.generation_config
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = k, "constant"
        config.assistant_confidence_threshold = 0.0
        extra["assistant_model"] = assistant
    if sampling is not None:
        extra.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    else:
        extra.update(do_sample=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=0,
                         eos_token_id=eos, pad_token_id=0, **extra)[:, width:].tolist()
    return [row[:row.index(eos) + 1] if eos in row else row for row in out]


def hf_greedy(model: LlamaForCausalLM, prompt: Sequence[int], max_new_tokens: int, eos: int | None = None,
              assistant: LlamaForCausalLM | None = None, k: int = 4) -> list[int]:
    """Hugging Face's greedy decoding of one prompt."""
    return hf_generate(model, [prompt], max_new_tokens, eos, assistant=assistant, k=k)[0]


class GraphedGreedy:
    """Plain greedy decoding of a batch, one token a row per step, the step captured once with
    torch.cuda.graph and replayed (or, with `eager`, run op by op: the loop an engine writes
    first); the host reads each step's tokens back (as an engine streaming tokens would) and
    stops when every row has its budget or its EOS."""

    def __init__(self, model: LlamaForCausalLM, capacity: int, batch: int = 1, eager: bool = False):
        self.stream = torch.cuda.Stream()
        self.batch, self.eager = batch, eager
        self.stack = Stack(model, model.config.num_hidden_layers, capacity, batch)
        self.token = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
        self.position = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
        self.graph: torch.cuda.CUDAGraph | None = None

    def _step(self) -> None:
        self.token.copy_(self.stack.greedy(self.token, self.position))
        self.position.add_(1)

    def _start(self, requests: Sequence[Request]) -> None:
        self.stack.prefill(range(self.batch), [r.prompt[:-1] for r in requests])
        self.token.copy_(torch.tensor([[r.prompt[-1]] for r in requests]))
        self.position.copy_(torch.tensor([[len(r.prompt) - 1] for r in requests]))

    def generate_batch(self, requests: Sequence[Request]) -> list[list[int]]:
        with torch.cuda.stream(self.stream):
            self._start(requests)
            if self.graph is None and not self.eager:
                self._step()  # warm-up off the graph, then undo it
                self._start(requests)
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, stream=self.stream):
                    self._step()
            out: list[list[int]] = [[] for _ in requests]
            live = {row for row, request in enumerate(requests) if request.max_new_tokens > 0}
            while live:
                if self.graph is None:
                    self._step()
                else:
                    self.graph.replay()
                step = self.token[:, 0].tolist()
                for row in list(live):
                    out[row].append(step[row])
                    if step[row] == requests[row].eos or len(out[row]) == requests[row].max_new_tokens:
                        live.discard(row)
            return out

    def generate(self, prompt: Sequence[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
        return self.generate_batch([Request(prompt, max_new_tokens, eos)])[0]


def decoding_arguments(description: str, k: bool = True) -> argparse.ArgumentParser:
    """The command line's model size, batch, budget, k (a chain's) and M, which the examples share."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=256)
    if k:
        parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--m-rounds", type=int, default=16)
    return parser


def round_arguments(parser: argparse.ArgumentParser) -> None:
    """A speculative decoder's mode, sampling and hybrid model on the command line."""
    parser.add_argument("--mode", choices=MODES, default="graph")
    parser.add_argument("--temperature", type=float, default=None, help="sample (default: greedy)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--hybrid", action="store_true",
                        help=f"layers {HYBRID} a gated linear recurrence, checked against its plain greedy decoding")
    parser.add_argument("--state-rollback", choices=["copy", "flip"], default="copy",
                        help="how the hybrid's recurrent state is rolled back")


def parse_rounds(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace,
                                                                                     SamplingParams | None]:
    """round_arguments' parse: the arguments and the sampling they ask for, a rollback without
    --hybrid a parser error."""
    args = parser.parse_args(argv)
    if args.state_rollback != "copy" and not args.hybrid:
        parser.error("--state-rollback is for the model with recurrent layers: add --hybrid")
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p) if args.temperature is not None else None
    return args, sampling


def check_greedy(model: LlamaForCausalLM, requests: Sequence[Request], got: list[list[int]], capacity: int,
                 hybrid: bool) -> int:
    """The exit status of an example's greedy fp32 run: whether every row equals Hugging Face's
    greedy decoding of its prompt alone (a hybrid model's own plain greedy decoding, which Hugging
    Face cannot run), printed."""
    if hybrid:
        want, reference = GraphedGreedy(model, capacity, len(requests)).generate_batch(requests), \
            "its own plain greedy decoding"
    else:
        want = [hf_greedy(model, r.prompt, r.max_new_tokens, r.eos) for r in requests]
        reference = "Hugging Face greedy on its own prompt"
    same = got == want
    print(f"every row equals {reference}: {'yes' if same else 'NO'}")
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    parser = decoding_arguments(__doc__.split("\n")[0])
    round_arguments(parser)
    parser.add_argument("--eos", type=int, default=None)
    args, sampling = parse_rounds(parser, argv)
    model = build_model(args.size, recurrent_layers=HYBRID if args.hybrid else ())
    batch = [PROMPT] if args.batch == 1 else prompts(args.batch)
    requests = [Request(prompt, args.tokens, args.eos, seed) for seed, prompt in enumerate(batch)]
    capacity = capacity_for(max(len(p) for p in batch), args.tokens, args.k, args.m_rounds, args.batch)
    spec = SpeculativeLlama(model, k=args.k, m_rounds=args.m_rounds, capacity=capacity, batch=args.batch,
                            sampling=sampling, state_rollback=args.state_rollback)
    got = spec.generate_batch(requests, args.mode)
    hybrid = f"hybrid (layers {HYBRID} recurrent, state by {args.state_rollback}), " if args.hybrid else ""
    print(f"{args.size} model, {hybrid}B={args.batch}, k={args.k}, M={args.m_rounds}, {args.mode}, "
          f"{'greedy' if sampling is None else sampling}: {sum(map(len, got))} tokens, "
          f"acceptance {spec.acceptance([len(row) for row in got]):.2f}")
    print(got[0][:32], "..." if len(got[0]) > 32 else "")
    if model.dtype == torch.float32 and sampling is None:
        return check_greedy(model, requests, got, capacity, args.hybrid)
    return 0


if __name__ == "__main__":
    sys.exit(main())

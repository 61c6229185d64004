"""The layers of a transformers Llama-family model run over a static cache of B rows.

Round-stream captures whole bursts, so a forward may read no value on the host: every row's
tokens and positions come as device tensors ([B][T]), rows at different positions share one
batch without padding, and each row attends over the whole static cache masked at its own
position. transformers' own forward cannot do that (its cache positions are one per batch), so
Stack calls the model's modules itself: the embeddings, each decoder layer (with the cache as
its `past_key_values`, the mask and the rotary embedding of each row's positions), the final
norm and the head. LlamaForCausalLM-shaped models fit (`.model.embed_tokens`, `.model.layers`,
`.model.norm`, `.model.rotary_emb`, `.lm_head`) whose forward is those parts alone: Llama,
Mistral, Qwen2 and their like, not a family that scales outside its layers (SCALED_TYPES).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..driver.values import as_flag, as_size
from .kv import CACHE_LAYOUTS, CacheLayout, StaticKV, as_layout
from .prefill import Prefills
from .state import STATE_LAYOUTS, LiveState, Recurrent, State, StateLayout

INDICES = frozenset((torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8))  # a forward's ids' dtypes
_PARTS = ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head", "config")
# Model families whose forward does more than Stack runs (embeddings, layers, final norm, head):
# Granite's embedding multiplier and logit scaling, Cohere's logit scale, Gemma's embedding
# normaliser and soft-capping; Stack would skip it, their logits wrong, silently. By model type,
# and by the config fields that say it (a family of another name that has them)
SCALED_TYPES = ("granite", "cohere", "gemma")  # a prefix of config.model_type: gemma2, gemma3_text, cohere2
SCALED_FIELDS = ("embedding_multiplier", "logits_scaling", "logit_scale", "final_logit_softcapping")
# Rotary embeddings whose frequencies follow the sequence's length (transformers' dynamic_rope_update):
# computed once over the cache, they are the model's own only while the cache is within the length
# they were trained to, past which a short sequence would get a long one's
LENGTH_ROPES = ("dynamic", "longrope")


def _check_shape(model: Any, capacity: int) -> None:
    """Refuse, naming what is missing, a model Stack cannot run (not LlamaForCausalLM-shaped, or
    one whose forward does more than its parts: SCALED_TYPES, SCALED_FIELDS), and a sliding
    window shorter than the cache, which Stack's causal mask would not apply."""
    for path in _PARTS:
        owner = model
        for name in path.split("."):
            if not hasattr(owner, name):
                raise TypeError(f"{type(model).__name__} has no {path}: Stack runs LlamaForCausalLM-shaped models "
                                "(Llama, Mistral, Qwen2 and their like)")
            owner = getattr(owner, name)
    kind = str(getattr(model.config, "model_type", ""))
    fields = [name for name in SCALED_FIELDS if getattr(model.config, name, None) is not None]
    if kind.startswith(SCALED_TYPES) or fields:
        raise TypeError(f"a {kind!r} model scales or caps outside its layers ({', '.join(fields) or 'its family'}), "
                        "which Stack, running its embeddings, layers, norm and head, would skip: its logits "
                        "wrong, silently")
    window = sliding_window(model.config)
    if window and capacity > window:
        raise ValueError(f"the model attends within a sliding window of {window} positions, which Stack does not "
                         f"apply: a cache of {capacity} would attend past it (use a capacity of at most {window})")


def sliding_window(config: Any) -> int | None:
    """The positions a model's attention reaches back, where its config limits them (Mistral's,
    Qwen2's with use_sliding_window); None where it attends to everything."""
    return getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None


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
# 2.44, 1.88; the small random-weight model); in bf16 the two are alike from 1 to 65 rows
# (within 0.6%, the large one), and cuBLASLt serves every size from 2.
LT_ROWS = {torch.float32: 16, torch.bfloat16: 1 << 30}


def blas_for(dtype: torch.dtype, rows: int) -> str:
    """The BLAS library for a forward of `rows` token rows in `dtype` (Stack.kernels)."""
    return "cublaslt" if 2 <= rows <= LT_ROWS.get(dtype, 0) else "cublas"


def rotary(model: Any, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding of every one of `slots` ([capacity]), cos and sin [capacity][d] in the
    model's dtype, computed once by the model's own module (the same numbers it computes per
    call, its scaling included): a step then gathers rows instead of recomputing them."""
    module = model.model.rotary_emb
    kind, trained = str(getattr(module, "rope_type", "default")), _trained_length(model.config, module)
    if kind.startswith(LENGTH_ROPES) and trained is not None and slots.shape[0] > trained:
        raise ValueError(f"the model's rotary embedding ({kind!r}) changes with the sequence's length past {trained} "
                         f"positions, so computed once over a cache of {slots.shape[0]} it would not be the "
                         f"model's own for a shorter sequence: use a capacity of at most {trained}")
    dummy = torch.zeros(1, 1, 1, dtype=model.dtype, device=slots.device)
    cos, sin = module(dummy, slots[None])
    return cos[0], sin[0]


def _trained_length(config: Any, module: Any) -> int | None:
    """The length past which a LENGTH_ROPES embedding changes: LongRoPE's original length (in
    transformers 5's rope_parameters, 4's rope_scaling, or the config), a dynamic one's (the
    module's original_max_seq_len, which transformers sets from max_position_embeddings)."""
    if str(getattr(module, "rope_type", "")) == "longrope":
        for where in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)):
            if isinstance(where, dict) and where.get("original_max_position_embeddings") is not None:
                return int(where["original_max_position_embeddings"])
        return getattr(config, "original_max_position_embeddings", None)
    return getattr(module, "original_max_seq_len", None)


Compile = Callable[[Callable[..., Any]], Callable[..., Any]]  # LayerStack.compiled: arithmetic as a stack runs it


def op_by_op(arithmetic: Callable[..., Any]) -> Callable[..., Any]:
    """`arithmetic` as it is, run op by op: the Compile of a stack that runs the model's own
    modules (Stack.compiled, a CompiledStack's with compile=False) and of a TreeMask made
    outside a decoder."""
    return arithmetic


class LayerStack:
    """What every stack of a model's layers over a static cache does the same way, whichever runs
    the layers (Stack: the model's own modules; CompiledStack: its compiled step): `model`,
    `layers`, `kv` and `prefills` are a subclass's, and logits() its forward."""

    model: Any
    layers: Sequence[Any]
    device: torch.device  # the model's: every tensor a forward takes is on it
    kv: StaticKV
    prefills: Prefills

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor, last: bool = False, *,
               slots: torch.Tensor | None = None, mask: torch.Tensor | None = None,
               parents: torch.Tensor | None = None) -> torch.Tensor:
        """The head's logits after each of `tokens` ([B][T] at `positions`), [B][T][V], or after
        the last of each row's, [B][1][V] (the head then runs on one token a row). A tree's nodes
        give `slots` (where their K and V go, [B][T]), `mask` (TreeMask's rows) and `parents`
        (for recurrent layers): see Stack.append. A mask of bools is True where a token sees a
        slot; one of floats is added to the scores, as SDPA adds it (0 seen, -inf not): a float
        mask of 0s and 1s hides nothing, and which it is cannot be told without reading it."""
        raise NotImplementedError

    def _check_rows(self, tokens: torch.Tensor, positions: torch.Tensor, last: bool, slots: torch.Tensor | None,
                    mask: torch.Tensor | None = None, parents: torch.Tensor | None = None) -> bool:
        """ValueError, before any K or V is written, unless `tokens` are the batch's rows ([B][T])
        and `positions` (and `slots`, `parents`) one a token: fewer rows wrote over another row's cache
        before a shape error, more attended to row 0's, and a [B][2] of slots for one token each
        wrote two; TypeError unless each is an integer tensor (float tokens were truncated to
        others). Shapes and dtypes alone: nothing is read from the device. Then the mask's
        (_check_mask). Returns `last` as a bool (as_flag: "False" was read by its truth, a [B][1][V]
        where [B][T][V] was asked, and a tensor met torch's "ambiguous" truth)."""
        batch = self.kv.lengths.shape[1]
        self._check_ids("a forward", "[B][T] tokens, positions and slots, B = {batch}, T >= 1", batch,
                        tokens, positions, slots, parents=parents)
        self._check_mask(mask, batch, tokens.shape[1])
        return as_flag(last, "a forward's last")

    def _check_ids(self, what: str, shape: str, rows: int, tokens: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor | None, named: torch.Tensor | None = None, *,
                   parents: torch.Tensor | None = None, lengths: torch.Tensor | None = None) -> None:
        """_check_rows' and Stack.append's check (`what` names the caller, `shape` what it takes, its
        {batch} the batch's rows, formatted only for a refusal: a forward in eager mode checks each step):
        TypeError unless the tokens, positions, slots, parents, lengths and `named` rows are integer
        tensors, ValueError unless they are on the stack's device (meta tokens embedded as zeros,
        silently), the tokens are `rows` rows of T >= 1 (T = 0: no logits, not even `last`'s
        [B][1][V]), the positions, slots and parents one a token and the lengths one a row."""
        for name, given in (("tokens", tokens), ("positions", positions), ("slots", slots), ("rows", named),
                            ("parents", parents), ("lengths", lengths)):
            if given is not None and getattr(given, "dtype", None) not in INDICES:
                raise TypeError(f"{what}'s {name} are an integer tensor, not {getattr(given, 'dtype', given)!r}")
            if given is not None and given.device != self.device:
                raise ValueError(f"{what}'s {name} are on {given.device}, not the stack's device, {self.device}")
        width = tokens.shape[1] if tokens.dim() == 2 else 0
        if not width or tokens.shape[0] != rows or positions.shape != tokens.shape or any(
                given is not None and given.shape != tokens.shape for given in (slots, parents)) or (
                lengths is not None and lengths.shape != (rows,)):
            takes = shape.format(batch=self.kv.lengths.shape[1])
            raise ValueError(f"{what} takes {takes}: not tokens {list(tokens.shape)}, positions {list(positions.shape)}"
                             + "".join(f", {name} {list(given.shape)}" for name, given in (
                                 ("slots", slots), ("rows", named), ("parents", parents), ("lengths", lengths))
                                       if given is not None))

    def _check_mask(self, mask: torch.Tensor | None, rows: int, tokens: int) -> None:
        """TypeError unless `mask` (where given) is a bool or float tensor (an int one was taken as
        additive, 0 and 1: every slot seen), ValueError unless it is [R][1][T][capacity] (R the
        forward's `rows`), a row a row and a slot a slot (one row's was broadcast to every row
        through SDPA, and flex read a mask narrower than the cache at its last slot for every slot
        past it), each silently."""
        if mask is None:
            return
        if not isinstance(mask, torch.Tensor) or not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
            raise TypeError(f"a forward's mask is a tensor of bools or floats, not {getattr(mask, 'dtype', mask)!r}")
        if mask.device != self.device:
            raise ValueError(f"a forward's mask is on {mask.device}, not the stack's device, {self.device}")
        want = [rows, 1, tokens, self.kv.capacity]
        if list(mask.shape) != want:
            raise ValueError(f"a forward's mask is [R][1][T][capacity], {want}: not {list(mask.shape)}")

    def compiled(self, arithmetic: Callable[..., Any]) -> Callable[..., Any]:
        """`arithmetic` (the tensor arithmetic a round runs around this stack's forward: its
        inputs from the round's buffers, a law's probabilities of its logits) run as the forward
        runs: here op by op (op_by_op), as the model's modules are (a CompiledStack compiles it)."""
        return op_by_op(arithmetic)

    def greedy(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The next token after each of `tokens`, [B][T] int64."""
        return self.logits(tokens, positions).argmax(-1)

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        """Each prompt's K and V at positions 0.. of its row (lengths become the prompt's), and a
        hybrid stack's recurrent state after it live (memra_cuda.torch.prefill: a row as a graph)."""
        self.prefills.run(rows, prompts)

    def _prefill_trusted(self, rows: Sequence[int], heads: Sequence[Sequence[int]]) -> None:
        """prefill() of rows and prompts a decoder has checked already (Prefills._run_trusted):
        a request's prompt is checked once, where it enters, not again at each stack."""
        self.prefills._run_trusted(rows, heads)

    def capture_prefills(self) -> None:
        """Every one-row prefill graph, now (Prefills.capture)."""
        self.prefills.capture()

    def prefix_of(self, other: LayerStack) -> bool:
        """Whether this stack's model is `other`'s first layers under the same embeddings (a
        self-speculative draft's): its K and V over any tokens are then `other`'s first layers'."""
        mine, theirs = self.model.model, other.model.model
        return (mine.embed_tokens is theirs.embed_tokens and len(self.layers) <= len(other.layers)
                and all(a is b for a, b in zip(self.layers, other.layers)))


class Stack(LayerStack):
    """A model's embeddings, decoder layers, final norm and head over a static cache of `batch`
    rows and `capacity` positions: append(tokens, positions) adds the tokens' KV ([rows][T]
    each) and returns their final hidden states; logits() also applies the head. No value is
    read on the host.

    `model` is a LlamaForCausalLM-shaped transformers model (a self-speculative draft is one too:
    memra_cuda.torch.self_draft). Its `Recurrent` layers (a hybrid model's) keep their state in
    `state`, made by the `state` layout: LiveState for plain decoding, CopyState or FlipState for
    round-stream (None without such layers). `cache` lays out the KV cache (StaticKV; PagedKV).
    Everything lives on the model's device; one-row prefills are CUDA graphs there."""

    def __init__(self, model: Any, capacity: int, batch: int = 1, *, state: StateLayout = LiveState,
                 cache: CacheLayout = StaticKV):
        capacity = as_size(capacity, "capacity")  # before the window compares with it: "64" met a bare TypeError
        cache, state = as_layout(cache, "cache", CACHE_LAYOUTS), as_layout(state, "state", STATE_LAYOUTS)
        _check_shape(model, capacity)
        self.model = model
        self.layers = model.model.layers[:model.config.num_hidden_layers]
        self.device = torch.device(model.device)
        self.kv = cache(model.config, len(self.layers), batch, capacity, model.dtype, self.device)
        self.recurrent = [isinstance(layer, Recurrent) for layer in self.layers]
        shapes = [layer.state_shape for layer, mine in zip(self.layers, self.recurrent) if mine]
        self.state: State | None = state(len(shapes), batch, shapes[0], self.device) if shapes else None
        attention = next((layer for layer, mine in zip(self.layers, self.recurrent) if not mine), None)
        # transformers 5.x renames a layer's past_key_values to cache: pass the cache by the name it takes
        name = "cache" if attention is not None and \
            "cache" in inspect.signature(attention.forward).parameters else "past_key_values"
        self._cache = {name: self.kv}  # an attention layer's keyword, made once, not at every layer of a forward
        self.slots = torch.arange(capacity, device=self.device)
        self.library: str | None = None  # None: blas_for's pick at each forward; a library's name pins it
        self.zero = torch.zeros((), dtype=model.dtype, device=self.device)  # an additive mask's two values
        self.never = torch.full((), -torch.inf, dtype=model.dtype, device=self.device)
        self.cos, self.sin = rotary(model, self.slots)
        self.prefills = Prefills(self.kv, self._fill, self.device, model.config.vocab_size,
                                 self.state.reset if self.state is not None else None)

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor, last: bool = False, *,
               slots: torch.Tensor | None = None, mask: torch.Tensor | None = None,
               parents: torch.Tensor | None = None) -> torch.Tensor:
        last = self._check_rows(tokens, positions, last, slots, mask, parents)
        hidden = self._append(tokens, positions, slots=slots, mask=mask, parents=parents)  # checked just above
        hidden = hidden[:, -1:] if last else hidden
        with self._blas(hidden.shape[0] * hidden.shape[1]):  # the head's rows: B where `last`
            return self.model.lm_head(hidden)

    @contextlib.contextmanager
    def kernels(self, rows: int) -> Iterator[None]:
        """The kernels the layers of a forward of `rows` token rows (B x T) run: blas_for's BLAS
        library (or the pinned `library`), and in fp32 SDPA's math path, prefills included.
        SDPA's default pick there, its memory-efficient kernel, is the slow one at a decoder's
        few queries: 62 of a one-token draft step's 187 us on the small random-weight model,
        whose graphed step falls from 1.30 to 0.87 ms through the math path (H200). In bf16
        SDPA's own pick, a fused kernel, stays."""
        math = sdpa_kernel([SDPBackend.MATH]) if self.model.dtype == torch.float32 else contextlib.nullcontext()
        with self._blas(rows), math:
            yield

    def _blas(self, rows: int) -> contextlib.AbstractContextManager[None]:
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return blas(self.library or blas_for(self.model.dtype, rows))

    def append(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None = None,
               lengths: torch.Tensor | None = None, *, slots: torch.Tensor | None = None,
               mask: torch.Tensor | None = None, parents: torch.Tensor | None = None) -> torch.Tensor:
        """`tokens` and `positions` are [R][T]; `rows` ([R], a device index) are the cache rows
        they belong to, every row where None. Returns the final hidden states, [R][T][hidden].
        Tokens, positions, slots and rows are device values, so they are clamped, not checked (a
        check would wait for the GPU): a token past the vocabulary reads the last embedding, a
        position or a row past the cache writes its last slot or row, never outside it.

        A prefill gives `lengths` ([R]: each row's prompt tokens, the rest padding): its
        recurrent layers start from zero and leave each row's state after its last prompt token
        as the row's live state. Any other forward runs over every row, its recurrent layers
        from the rows' live state, handing the state after each token to `state` (a verify's
        go to slots, for round-stream to roll back).

        A tree's nodes sit at `positions` (the root's plus their depth, for RoPE) but their K/V
        go to `slots` ([R][T], the root's position plus the node's index), each attends where
        `mask` ([R][1][T][capacity], additive: 0 attends, -inf not) says, and a recurrent layer
        steps each node from its parent's state (`parents`, [R][T]). Otherwise the slots are the
        positions and the mask causal. Its rows' shapes and dtypes are checked first (_check_append);
        logits() and a prefill, which check or make their own, run _append."""
        self._check_append(tokens, positions, rows, lengths, slots, mask, parents)
        if rows is not None:  # a prefill's rows are checked host ints: only a caller's are clamped
            rows = rows.long().clamp(0, self.kv.lengths.shape[1] - 1)
        return self._append(tokens, positions, rows, lengths, slots=slots, mask=mask, parents=parents)

    def _append(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None = None,
                lengths: torch.Tensor | None = None, *, slots: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, parents: torch.Tensor | None = None) -> torch.Tensor:
        inner = self.model.model
        top = self.kv.capacity - 1
        positions = positions.long().clamp(0, top)  # a garbage position never writes outside
        slots = positions if slots is None else slots.long().clamp(0, top)
        # nor a garbage token reads outside the embeddings (on a GPU, a device-side assert: the context lost)
        hidden = inner.embed_tokens(tokens.long().clamp(0, inner.embed_tokens.num_embeddings - 1))
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
            for layer, recurrent in zip(self.layers, self.recurrent):
                if recurrent:
                    hidden = self._recurrent(layer, n, hidden, rows, lengths, parents)
                    n += 1
                    continue
                out = layer(hidden, attention_mask=mask, position_ids=positions, use_cache=True,
                            cache_position=slots[0], position_embeddings=rope, **self._cache)
                hidden = out[0] if isinstance(out, tuple) else out
        return inner.norm(hidden)

    def _check_mask(self, mask: torch.Tensor | None, rows: int, tokens: int) -> None:
        """LayerStack's check, and TypeError for a float mask of another dtype than the model's:
        the model's own attention adds it to scores of its dtype, and SDPA refused it only once the
        first layer's K and V had been written (a CompiledStack casts it)."""
        super()._check_mask(mask, rows, tokens)
        if mask is not None and mask.dtype.is_floating_point and mask.dtype != self.zero.dtype:
            raise TypeError(f"a forward's float mask is added to the scores in the model's dtype, {self.zero.dtype}: "
                            f"not {mask.dtype} (or a mask of bools)")

    def _check_append(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None,
                      lengths: torch.Tensor | None, slots: torch.Tensor | None, mask: torch.Tensor | None,
                      parents: torch.Tensor | None) -> None:
        """append's arguments, as _check_rows checks a forward's (shapes and dtypes alone): [R][T]
        integer tokens, positions, slots and parents, R the batch's rows or, with `rows`, as many
        as it names (an integer [R], at most the batch); integer `lengths` [R]; the mask R rows of
        _check_mask's. One row of tokens given for two was written into every row's K and V before
        a shape error, and float tokens were truncated; a mask, lengths or parents of other rows
        were broadcast, or refused by the first layer that read them, after the embeddings ran."""
        batch = self.kv.lengths.shape[1]
        # a `rows` that is no tensor counts -1 here, and is refused by its dtype first
        counted = getattr(rows, "ndim", 0) == 1 and rows.shape[0] <= batch  # type: ignore[union-attr]
        want = batch if rows is None else rows.shape[0] if counted else -1
        self._check_ids("append", "[R][T] tokens, positions and slots, T >= 1, R the batch's {batch} rows or as "
                        "many as `rows` names", want, tokens, positions, slots, rows, parents=parents, lengths=lengths)
        self._check_mask(mask, want, tokens.shape[1])

    def _recurrent(self, layer: Recurrent, n: int, hidden: torch.Tensor, rows: torch.Tensor | None,
                   lengths: torch.Tensor | None, parents: torch.Tensor | None) -> torch.Tensor:
        """Recurrent layer `n` of the stack over `hidden` (see append)."""
        assert self.state is not None  # made with the stack wherever it has a recurrent layer
        if lengths is None:
            hidden, _ = layer(hidden, self.state.read(n), functools.partial(self.state.store, n), parents=parents)
            return hidden
        start = torch.zeros(hidden.shape[0], *layer.state_shape, device=self.device)
        hidden, prompt = layer(hidden, start, active=self.slots[:hidden.shape[1]] < lengths[:, None])
        self.state.set_prompt(n, rows, prompt)
        return hidden

    def _fill(self, tokens: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor) -> None:
        """Prefills' forward: the recurrent layers skip each row's padding."""
        self._append(tokens, self.slots[:tokens.shape[1]].expand(*tokens.shape), rows,
                     lengths if self.state is not None else None)

"""A model's step compiled once and captured inside the rounds' graphs: the forward at the
hardware's pace.

Run through transformers' modules, a step is some 40 kernels a layer; a CUDA graph removes the
host's launches but not the kernels (509 for the pair's 12-layer target at B = 1, 1.28 ms on an
H200). CompiledStack runs gpt-fast's recipe instead: the model's weights fused (FusedLlama), one
K and one V tensor a layer (StaticKV) written at each token's own slot in place, and the step
compiled by torch.compile (inductor, no graph break), which fuses the norms, the rotary
embedding and the MLP's activation around the GEMMs (in a step of a few rows, skinny's kernel
makes the activation's product itself, as it reads the down projection's input). Attention
reads only the cache blocks a row holds (memra_cuda.torch.attention). The compiled code is what
a round's graph captures: a step is compiled the first time it runs at a shape, which a decoder
does before any capture (its warm-up round), never inside one.

Shapes are dynamic but for sizes of one (torch.compile's rule) and the capacity: one
compilation serves every batch and width of a kind (a decode step or a verify, a tree's, a
prefill) at a capacity, so a server's decoders of several B and k share it, and a row of one
token, the common decode step, gets its own. A step that attends through flex (by default a
verify, and a decode step of several rows) is the exception: its every shape compiles apart (_run).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F

from .attention import ATTENTIONS, MOST_SLOTS, Attention, FlexOptions, aligned, as_flex_options, causal, masked
from ..buffers.geometry import as_batch
from ..driver.errors import NotFused
from ..driver.module import GRID_LIMITS
from ..driver.values import as_flag, as_size
from .fused import FusedLlama, Linear, check_fuses, fuse
from .kv import CacheLayout, StaticKV
from .prefill import Prefills
from .stack import LayerStack, Stack, op_by_op, rotary, sliding_window
from .state import LiveState, StateLayout

# How a step of one token (False) and of several, a verify (True), attend when a stack is not told,
# by its rows. A verify through flex: 0.469 ms against SDPA's 0.520 at B = 1, 0.906 against 1.248 at
# B = 64 (an H200, bf16, the pair's target, 512 of 576 slots held, 2026-12-04, benchmarks.steps):
# SDPA's 64-query tiles read the whole capacity for 5 queries, flex only the blocks held. One token,
# one row through SDPA, which led at every fill (0.381 against flex's 0.397 on that H200; an H100 0.356
# against 0.363 with 128, 256 and 512 of 640 held); rows of a batch through flex, for they hold less
# than the cache as a server's do (B = 64 on an H100, 2026-12-05: 0.660 against SDPA's 0.953 with 128
# of 576 held, 0.967 against 0.952 with 512; the H200 0.833 against 0.829 with 512)
ONE_ROW_STEP: Attention = "sdpa"  # one row's decode step; every other width attends through flex
# flex_attention's kernel_options for a verify (several tokens) of one row, where a stack is told none:
# flex's one-kernel attention over tiles of 16 queries. Torch's own choice below 128 queries is its
# decoding kernel, which splits the row's cache over thread blocks and sums the splits in three
# kernels more a layer, and its one-kernel attention's own tiles are of 64 or 128 queries, nearly all
# idle for a verify's 5. The pair's target, B = 1, 512 of 576 held, projections few_rows (an H100,
# 2026-12-06, benchmarks.steps): T = 4, 5, 7 at 0.397, 0.396, 0.398 ms against torch's choice's 0.433,
# 0.416, 0.442 and the one-token step's 0.362 (1.10 steps where it was 1.15 to 1.22); the one kernel
# at its own tiles 0.52. Every other step keeps torch's choice: at B = 64, T = 5, the one-kernel
# attention (its own tiles) stopped that run with an illegal address, unexplained, where torch's
# choice served.
ONE_ROW_VERIFY: FlexOptions = (("BLOCK_M", 16), ("FORCE_USE_FLEX_ATTENTION", True))
# The most blocks a CUDA grid holds in y (the driver's GRID_LIMITS), where flex_attention's decoding
# kernel puts a batch's rows times its KV heads (torch 2.11: "invalid argument" at B = 20 000 of 8 heads)
GRID_Y = GRID_LIMITS[1]
# How a step's projections multiply: "inductor", F.linear as torch.compile makes it (cuBLAS's GEMMs, a
# one-row GEMV a reduction fused with its norm); "few_rows", a step of FEW_ROWS rows, 2 to 16 (a
# verify's at a small batch; a prefill never), through memra_cuda.torch.skinny's Triton kernel, which
# reads each weight once over narrow slices of its columns, where cuBLAS's wide tiles left an H200's
# SMs idle (4.7 µs a GEMM of the verify of 5 rows). The default is what measured faster: "few_rows",
# faster than inductor's at every width an H100 measured (2, 4, 5, 7, 8, 9, 10, 13 and 16 rows: 2 to
# 13%, 2026-12-05; benchmarks.steps --few-rows), where it serves the model (a 16-bit one on a GPU, triton there), and
# inductor's where not; the H200's widths are to measure (RESULTS.md). Read as each stack is built: a
# program sets it before its decoders are made (the benchmarks' --projection)
Projection = Literal["inductor", "few_rows"]
PROJECTIONS: tuple[Projection, ...] = ("inductor", "few_rows")
PROJECTION: Projection = "few_rows"
FEW_ROWS = range(2, 17)  # one row stays inductor's tuned reduction
# The compilations a function keeps (torch.compile's 8, and 256 in all): a process's decoders compile
# each step, law and round arithmetic a shape, a batch and a width apart (flex's steps, every
# arithmetic), and past either limit a fullgraph compile raises (a benchmark's decoders of every B pass 256)
RECOMPILES = 1024


def _step(fused: FusedLlama, cos: torch.Tensor, sin: torch.Tensor, keys: list[torch.Tensor],
          values: list[torch.Tensor], tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
          rows: torch.Tensor, mask: torch.Tensor | None, attention: str, last: bool, linear: Linear,
          flex: FlexOptions = (), down: Linear | None = None) -> torch.Tensor:
    """What is compiled: positions and slots kept inside the cache (a garbage one never writes
    outside) and tokens inside the vocabulary (nor reads past the embeddings), the rotary rows
    gathered, the attention chosen (flex's with `flex`'s kernel_options), the fused forward, its
    projections through `linear` (F.linear, or memra_cuda.torch.skinny.few_rows) and its MLP's
    down projection through `down` (None: `linear`'s; skinny.few_rows_gated)."""
    capacity = keys[0].shape[2]
    positions, slots = positions.long().clamp(0, capacity - 1), slots.long().clamp(0, capacity - 1)
    tokens = tokens.long().clamp(0, fused.embed.shape[0] - 1)  # nor a garbage token read past the embeddings
    shape = fused.shape
    attend = (causal(shape.scale, shape.gqa) if attention == "prefill"
              else masked(attention, slots, capacity, shape.scale, shape.gqa, keys[0].dtype, mask,  # type: ignore[arg-type]
                          flex))
    return fused(tokens, cos[positions], sin[positions], keys, values, rows, slots, attend, last, linear, down)


_COMPILED: dict[tuple[bool, bool, bool, bool], Any] = {}


def compiled_step(dynamic: bool = True, tuning: bool = True, autotune: bool = False, pdl: bool = False) -> Any:
    """_step through torch.compile (fullgraph: a graph break is an error, not a slow step); with
    `dynamic`, the sizes _run marks dynamic stay symbolic, every other one static; with `tuning`,
    inductor's coordinate descent tunes each kernel's launch (gpt-fast's setting); with
    `autotune`, inductor benchmarks its Triton GEMM templates against cuBLAS for each GEMM at
    compile time (max_autotune_gemm: a verify's GEMMs of a few rows, where cuBLAS took 4.7 µs
    each on an H200); with `pdl`, inductor's Triton kernels launch by programmatic dependent
    launch (triton.enable_pdl, Hopper and later: a kernel starts while the one before it ends and
    waits on the device for what it reads, where a step of 135 kernels for 0.381 ms is mostly the
    gaps between them). benchmarks/steps.py --autotune and --pdl measure the last two, not yet any
    decoder's."""
    if (dynamic, tuning, autotune, pdl) not in _COMPILED:
        import torch._dynamo
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, RECOMPILES)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, RECOMPILES)
        options = {"coordinate_descent_tuning": tuning, **({"max_autotune_gemm": True} if autotune else {}),
                   **({"triton.enable_pdl": True} if pdl else {})}
        _COMPILED[dynamic, tuning, autotune, pdl] = torch.compile(_step, fullgraph=True,
                                                                  dynamic=None if dynamic else False, options=options)
    return _COMPILED[dynamic, tuning, autotune, pdl]


def _sizes(tensor: torch.Tensor | None, *dynamic: int) -> None:
    """`tensor`'s dims `dynamic` symbolic in a compiled step (a size of one excepted), every other
    static: automatic dynamic shapes would otherwise make a dim dynamic that merely differs
    between two models (their heads), at a kernel's cost."""
    if tensor is None:
        return
    import torch._dynamo
    for dim in range(tensor.dim()):
        if dim in dynamic:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
        else:
            torch._dynamo.mark_static(tensor, dim)


def _no_grad(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """`compiled` run under torch.no_grad(), so that what its guards see of autograd is the same
    at every call: a decoder's warm-up compiles it and a capture replays that compilation, and a
    guard that failed in between would compile inside the capture. Under the caller's grad mode, a
    capture under torch.no_grad() after a warm-up under grad mode failed the grad-mode guard; and a
    law's p_d and q_d (SamplingParams.fill), once written with the logits of a model whose
    parameters require grad, required grad, so that the capture's slices of them failed the
    requires_grad guard their first call had passed."""
    def run(*args: Any) -> Any:
        with torch.no_grad():
            return compiled(*args)
    return run


def attends(attention: Attention | None, batch: int, kv_heads: int) -> dict[bool, Attention]:
    """How a step of one token (False) and of several (True) attend, for a stack of `batch` rows
    of `kv_heads` KV heads told `attention` (or not: one row's decode step ONE_ROW_STEP, every
    other width flex): SDPA, not told, where flex's kernels would put more blocks (rows times KV
    heads) in a grid's y than it holds (GRID_Y); told flex, refused there."""
    attention = as_attention(attention)
    if batch * kv_heads > GRID_Y:
        if attention == "flex":
            raise ValueError(f"attention 'flex' serves at most {GRID_Y} rows x KV heads (its kernel's grid), not "
                             f"{batch} x {kv_heads}: a smaller batch, or attention='sdpa'")
        return {False: "sdpa", True: "sdpa"}
    faster: dict[bool, Attention] = {False: ONE_ROW_STEP if batch == 1 else "flex", True: "flex"}
    return {wide: attention or faster[wide] for wide in (False, True)}


class CompiledStack(LayerStack):
    """A LlamaForCausalLM-shaped model's compiled step over a static cache of `batch` rows and
    `capacity` positions, rounded up to whole blocks of the attention (attention.aligned)
    (memra_cuda.torch.Stack's interface, for models that fuse: attention layers of plain Linear
    projections and SiLU, no recurrent layer; NotFused otherwise).

    `attention` is how a decode step or a verify attends ("sdpa": the whole capacity under a
    mask; "flex": the blocks each row holds, every shape compiled apart); left out, each width
    attends the way that measured faster at its rows (`attends`: SDPA for one row's decode step,
    flex for every other); where `batch` times the KV heads
    pass flex's grid (GRID_Y), every width attends through SDPA, and "flex" is refused
    (ValueError, by `attends`); `compile=False` runs the same step eagerly (a CPU's check of the
    arithmetic); `dynamic=False` compiles every shape
    apart; `tuning` (inductor's coordinate descent, gpt-fast's setting) tunes each kernel's
    launch of the one-token step at its compilation: None, at B = 1 alone (a step of several
    rows, a verify and a prefill compile untuned: there it costs compile time and gains
    nothing); True or False, at any B. `projection` is how a decode step's or a verify's
    projections multiply (PROJECTIONS): "few_rows" needs triton and a 16-bit model on a GPU
    (ValueError, naming what is missing), and serves steps of FEW_ROWS rows; left out,
    PROJECTION where it serves the model, inductor's where not (an fp32 model, a CPU's).
    `flex_options` are flex_attention's kernel_options for every step that attends through flex;
    left out, ONE_ROW_VERIFY's for a verify of one row (flex's one kernel over tiles of 16
    queries) and torch's own choice for every other step ({} asks torch's choice for all)."""

    def __init__(self, model: Any, capacity: int, batch: int = 1, *, attention: Attention | None = None,
                 compile: bool = True, dynamic: bool = True, tuning: bool | None = None,
                 projection: Projection | None = None, flex_options: Mapping[str, Any] | None = None):
        batch = as_batch(batch)  # before flex's grid is counted: "2" * 8 heads met a bare TypeError there
        check_fuses(model)  # before its config's heads are read: GPT-2's has none, a bare AttributeError
        compile, dynamic = as_flag(compile, "compile"), as_flag(dynamic, "dynamic")
        tuning = None if tuning is None else as_flag(tuning, "tuning", also="None")
        self.attends = attends(attention, batch, model.config.num_key_value_heads)
        told = None if flex_options is None else as_flex_options(flex_options)
        self.flex = {wide: told if told is not None else ONE_ROW_VERIFY if wide and batch == 1 else ()
                     for wide in (False, True)}
        # before it is rounded up: "64" and True are no capacities, and 2**31 - 1 rounded up passed an i32's most
        capacity = as_size(capacity, "capacity", most=MOST_SLOTS)
        self.few_rows = self._projection(model, projection)
        window = sliding_window(model.config)
        if window and aligned(capacity) > window:  # the step attends to the whole cache a row holds
            raise NotFused(f"the model attends within a sliding window of {window} positions, which the compiled "
                           f"step does not apply: its cache of {aligned(capacity)} would attend past it")
        self.model, self.fused = model, fuse(model)
        self.layers = model.model.layers[:model.config.num_hidden_layers]
        self.device = torch.device(model.device)
        self.kv = StaticKV(model.config, len(self.layers), batch, aligned(capacity), model.dtype, self.device)
        self.state = None  # no recurrent layer: a model with one does not fuse
        self.slots = torch.arange(self.kv.capacity, device=self.device)
        self.cos, self.sin = rotary(model, self.slots)  # [capacity][d] each
        # tuning pays at one token a row, where inductor turns each GEMM into a reduction fused
        # with the norm before it and the tuning sizes those (0.367 ms against 0.466 for the pair's
        # target on an H200); a verify's or a prefill's GEMMs stay GEMMs, and tuning the kernels
        # around them moved nothing (0.527 against 0.528 at B = 1, T = 5) but doubled their compiling.
        # So does a step of several rows: its batch is symbolic, and inductor rewrites a GEMM of
        # one row only (0.825 tuned against 0.822 untuned at B = 64): B = 1's step alone is tuned
        self.step = compiled_step(dynamic, batch == 1 if tuning is None else tuning) if compile else _step
        self.wide_step = compiled_step(dynamic, False) if compile else _step
        self.compiles, self.dynamic = compile, compile and dynamic
        if self.dynamic:
            for tensor in (*self.kv.k, *self.kv.v):
                _sizes(tensor, 0)  # [B][H_kv][capacity][d]: a capacity of its own compiles apart
            for tensor in (self.cos, self.sin):
                _sizes(tensor)
        self.prefills = Prefills(self.kv, self._fill, self.device, model.config.vocab_size)

    @staticmethod
    def _projection(model: Any, projection: Projection | None) -> tuple[Linear, Linear] | None:
        """The projections of a step of FEW_ROWS rows, every one's and the MLP's down of its gate
        and up: memra_cuda.torch.skinny's few_rows and few_rows_gated for "few_rows" (refused,
        naming why, where it cannot serve `model`), None for "inductor"; left out (None),
        PROJECTION's where it serves `model`, else None."""
        named = projection is not None
        projection = projection if named else PROJECTION
        if projection not in PROJECTIONS:
            raise ValueError(f"projection is one of {PROJECTIONS} (or left out: {PROJECTION!r} where it serves), "
                             f"not {projection!r}" + ("" if named else " (memra_cuda.torch.compiled.PROJECTION)"))
        if projection == "inductor":
            return None
        if model.device.type != "cuda" or model.dtype not in (torch.bfloat16, torch.float16):
            why = (f"serves a bf16 or fp16 model on a GPU, not {model.dtype} on {model.device.type} (fp32's "
                   "products stay cuBLAS's own)")
        else:
            try:
                from .skinny import few_rows, few_rows_gated
                return few_rows, few_rows_gated
            except ImportError as e:
                why = f"needs triton (torch's own on a CUDA machine): {e}"
        if named:
            raise ValueError(f"projection 'few_rows' {why}") from None
        return None

    def _run(self, step: Any, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
             mask: torch.Tensor | None, attention: str, last: bool, linear: Linear = F.linear,
             flex: FlexOptions = (), down: Linear | None = None) -> torch.Tensor:
        if self.dynamic:
            # flex_attention's kernels fail on a symbolic batch or width in torch 2.11 (an illegal
            # address at B = 64, a lowering error at T = 2): its steps compile a shape apart
            shapes = (0, 1) if attention != "flex" else ()
            # the rows through an alias of this call's own: they are one tensor every step takes (the cache's
            # every_row), where each call's marks stayed (a one-token step's dynamic batch, a flex step's static
            # one), and torch 2.12 and later guard on them: a step compiled before another marked the rows
            # compiled again after it, in a capture
            rows = rows.view(rows.shape)
            for tensor in (tokens, positions, slots):
                _sizes(tensor, *shapes)  # rows, tokens a row
            _sizes(rows, *shapes[:1])
            _sizes(mask, *(0, 2) if shapes else ())  # [R][1][T][capacity]
        with torch.no_grad():  # the same guards at the warm-up and in a capture, whatever the caller's grad mode
            return step(self.fused, self.cos, self.sin, self.kv.k, self.kv.v, tokens, positions, slots, rows, mask,
                        attention, last, linear, flex, down)

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor, last: bool = False, *,
               slots: torch.Tensor | None = None, mask: torch.Tensor | None = None,
               parents: torch.Tensor | None = None) -> torch.Tensor:
        last = self._check_rows(tokens, positions, last, slots, mask, parents)
        wide = tokens.shape[1] > 1  # a verify's, or the one-token step (tuned)
        attention, step = self.attends[wide], self.wide_step if wide else self.step
        few = tokens.shape[0] * tokens.shape[1] in FEW_ROWS  # rows x tokens a row: the GEMMs' rows
        linear, down = self.few_rows if few and self.few_rows is not None else (F.linear, None)
        return self._run(step, tokens, positions, positions if slots is None else slots, self.kv.every_row, mask,
                         attention, last, linear, self.flex[wide], down)

    def compiled(self, arithmetic: Callable[..., Any]) -> Callable[..., Any]:
        """`arithmetic` compiled whole (no graph break, every shape apart: a decoder runs it at its
        one batch and a few widths), as the step is: a kernel or two inside the round's graph
        where op by op it was one launch an op, each a few microseconds at a small batch (a law's
        probabilities of a row's logits: six launches for one kernel's work); op by op where
        this stack runs its step eagerly (compile=False). It runs with autograd off (_no_grad)."""
        if not self.compiles:
            return op_by_op(arithmetic)
        return _no_grad(torch.compile(arithmetic, fullgraph=True, dynamic=False))

    def _fill(self, tokens: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor) -> None:
        """Prefills' forward: the prompts' K and V, their attention causal over themselves."""
        positions = self.slots[:tokens.shape[1]].expand(*tokens.shape)
        self._run(self.wide_step, tokens, positions, positions, rows[:, None], None, "prefill", True)  # untuned


def _layout_name(cache: CacheLayout) -> str:
    """A cache layout's name for a message: PagedKV's where a decoder gave functools.partial(PagedKV,
    page=...), whose repr says little."""
    return str(getattr(getattr(cache, "func", cache), "__name__", cache))


def as_attention(attention: Any) -> Attention | None:
    """A stack's `attention=` checked (None, or one of ATTENTIONS by name: an array of the name
    compared equal to it), ValueError naming it: where a decoder is made, before its stream (an
    unknown one was refused by the compiled step, after the stream), and again by attends."""
    if attention is not None and not (isinstance(attention, str) and attention in ATTENTIONS):
        raise ValueError(f"attention is one of {ATTENTIONS} (or left out: each width's faster), not {attention!r}")
    return attention


def as_compiled(compiled: Any) -> bool | None:
    """A decoder's `compiled=` checked (None, True or False, as_flag's TypeError naming it): where
    a decoder is made, before its stream, and again by stack_for for its own callers."""
    return None if compiled is None else as_flag(compiled, "compiled", also="None")


def stack_for(model: Any, capacity: int, batch: int = 1, *, state: StateLayout = LiveState,
              cache: CacheLayout = StaticKV, compiled: bool | None = None,
              attention: Attention | None = None) -> Stack | CompiledStack:
    """The stack a decoder runs `model` on: its compiled step (CompiledStack, attending by
    `attention`) where the model fuses and `cache` is the static one, else its own modules (Stack:
    recurrent layers and their `state`, a paged cache, a tensor-parallel rank). `compiled` True
    insists (NotFused says why not), False refuses; so does an `attention` named, which only the
    compiled step has."""
    compiled = as_compiled(compiled)
    if compiled is not False and cache is StaticKV:
        try:
            return CompiledStack(model, capacity, batch, attention=attention)
        except NotFused:
            if compiled or attention is not None:
                raise
    elif compiled:
        raise NotFused(f"the compiled step keeps a static cache, not {_layout_name(cache)}")
    if attention is not None:
        raise ValueError(f"attention={attention!r} is the compiled step's, and this stack is the model's own modules "
                         f"(compiled={compiled}, cache {_layout_name(cache)})")
    return Stack(model, capacity, batch, state=state, cache=cache)

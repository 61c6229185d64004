"""A linear layer of a few rows as one Triton kernel: a verify's GEMMs at a small batch.

A verify of k + 1 tokens at B = 1 multiplies 5 rows by each weight. cuBLAS serves that shape
with a GEMM of wide tiles: few thread blocks, so each of the pair's target's 48 GEMMs took about
4.7 µs on an H200 (benchmarks/RESULTS.md, "A verify's kernels"), where reading its weights once
takes under 1.5 µs, and the one-token step, whose GEMVs inductor writes as reductions, pays about
half that. This kernel tiles the other way: every thread block takes all the rows (up to
BLOCK_M, padded) and a narrow slice of the output's columns, so the weight is read once, by as
many blocks as there are slices (times SPLIT_K slices of k, where the columns are too few to
busy the SMs), with the rows' product on the tensor cores and fp32 sums. The MLP's down
projection takes the fused gate and up as they are (`few_rows_gated`): the kernel makes SwiGLU's
silu(gate) * up as it reads its rows, where inductor, which cannot fuse that product into an op
it does not see into, ran a kernel of its own for it, one a layer.

It is a `torch.library.triton_op`, so torch.compile sees into it (no graph break) and a CUDA
graph captures it like any kernel; the compiled step (memra_cuda.torch.compiled) calls it, through
`few_rows` and `few_rows_gated`, where a step's rows are few. Its tiles are the op's arguments, so they are part of
the compiled graph (and of inductor's cache key), as the kernel's source is. Needs triton
(torch's own, on a CUDA machine); this module is imported only where the step is compiled with
it. A CPU tensor, called eagerly, goes to F.linear.
"""
from dataclasses import astuple, dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import wrap_triton

from ..driver.values import as_flag, as_size
from .fused import swiglu

BLOCK_M = 16  # the rows a block multiplies: the tensor cores' least; fewer are padded, more take more blocks
DTYPES = (torch.bfloat16, torch.float16)  # fp32 stays with F.linear: its products must be cuBLAS's own, not TF32's


@triton.jit
def _linear(x, weight, bias, out, rows, n, k, x_row, w_row, out_row, STEPS: tl.constexpr, HAS_BIAS: tl.constexpr,  # type: ignore[no-untyped-def]
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
            SWAP: tl.constexpr, GATED: tl.constexpr):
    """out[rows][n] = x[rows][k] @ weight[n][k]^T (+ bias[n]), each row `x_row`, `w_row`,
    `out_row` elements after the last, its elements contiguous: this block's BLOCK_N columns of
    its BLOCK_M rows over its 1/SPLIT_K of k, summed in fp32 a BLOCK_K at a time (SWAP: as
    weight @ x^T, the columns the tensor cores' M, which Hopper's widest instruction wants);
    rows, columns and k past their ends are masked (read as 0, never written). STEPS, the BLOCK_Ks
    of a slice (the same for every slice), is a constant: a kernel per k (a model's projections
    have two or three), and the loop's count known. With SPLIT_K > 1,
    out is fp32 partial sums, [SPLIT_K][rows][n] (out_row apart), the bias left to the caller.
    GATED: each row of x holds SwiGLU's gate and then its up (k each), and the product's x is
    silu(gate) * up, made in fp32 as it is read and rounded once to x's dtype (as inductor's
    fused kernel made it, one kernel a layer fewer)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = (tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # offsets in int64: rows x k or
    wide = cols.to(tl.int64)  # SPLIT_K x rows x n, or a weight's n x k, may pass 2**31 elements
    first = tl.program_id(2) * STEPS * BLOCK_K
    last = tl.minimum(first + STEPS * BLOCK_K, k)
    if SWAP:
        sums = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        sums = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, STEPS):  # a constant count: Triton's interpreter (3.6) cannot loop to a runtime int
        ks = first + step * BLOCK_K + tl.arange(0, BLOCK_K)
        at, inside = x + m[:, None] * x_row + ks[None, :], (m[:, None] < rows) & (ks[None, :] < last)
        if GATED:
            gate = tl.load(at, mask=inside, other=0.0).to(tl.float32)
            up = tl.load(at + k, mask=inside, other=0.0).to(tl.float32)
            a = (gate * tl.sigmoid(gate) * up).to(x.dtype.element_ty)
        else:
            a = tl.load(at, mask=inside, other=0.0)
        w = tl.load(weight + wide[:, None] * w_row + ks[None, :], mask=(cols[:, None] < n) & (ks[None, :] < last),
                    other=0.0)
        if SWAP:
            sums = tl.dot(w, tl.trans(a), sums)
        else:
            sums = tl.dot(a, tl.trans(w), sums)
    if SWAP:
        sums = tl.trans(sums)
    if HAS_BIAS and SPLIT_K == 1:
        sums += tl.load(bias + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    at = out + tl.program_id(2).to(tl.int64) * rows * out_row + m[:, None] * out_row + cols[None, :]
    tl.store(at, sums.to(out.dtype.element_ty), mask=(m[:, None] < rows) & (cols[None, :] < n))


@dataclass(frozen=True)
class Tiles:
    """How _linear cuts one projection: `block_n` columns and `block_k` of k a step, `split_k`
    slices of k (blocks of partial sums, summed after), `swap` (the product as weight @ x^T),
    `warps` and `stages` (Triton's launch and software pipelining). The compiled step builds one
    as it is traced, and hands it to the op as its values (`astuple`). Each is checked as it is
    built, TypeError or ValueError naming it: block_n and block_k powers of two of at least 16
    (tl.arange's lengths, tl.dot's least), warps a power of two (Triton's), split_k and stages at
    least 1, swap a bool; a block_n of 0 divided by zero at the launch."""

    block_n: int = 16
    block_k: int = 128
    split_k: int = 1
    swap: bool = False
    warps: int = 4
    stages: int = 4

    def __post_init__(self) -> None:
        for name, least, power in (("block_n", 16, True), ("block_k", 16, True), ("split_k", 1, False),
                                   ("warps", 1, True), ("stages", 1, False)):
            value = as_size(getattr(self, name), name, least)
            if power and value & (value - 1):
                raise ValueError(f"{name} must be a power of two, not {value}")
            object.__setattr__(self, name, value)
        object.__setattr__(self, "swap", as_flag(self.swap, "swap"))


SMS = 132  # an H200's streaming multiprocessors: the blocks a projection should at least give


def tiles(n: int, k: int) -> Tiles:
    """The Tiles of a projection of `n` columns over `k`: narrow slices, so that a projection of
    a few thousand columns spreads over more blocks than an H200 has SMs; where its slices are
    still fewer (768 columns: 48), k split into as many slices as fill them (of whole BLOCK_Ks);
    past 8192 columns (a head, and a large model's fused gate and up: Llama 3 8B's 28 672) wider
    slices, k whole. A guess that measured faster in the compiled verify (an H100, 2026-12-06)
    than three rules built on benchmarks.tiles' best cuts alone, whose wider splits of k add the
    partial sums' kernel; that sweep timed its weights from L2, and runs again over copies that
    pass it (RESULTS.md)."""
    if n > 8192:
        return Tiles(block_n=64)
    cut = Tiles()
    slices = -(-n // cut.block_n)
    return replace(cut, split_k=min(-(-k // cut.block_k), max(1, -(-SMS // slices))))


def launch(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor,  # noqa: UP045
           cut: Tiles, kernel: object = _linear, gated: bool = False) -> None:
    """_linear over `x` ([rows][k], or with `gated` SwiGLU's gate and up, [rows][2 k]) into `out`
    ([rows][n], or [split_k][rows][n] of fp32 partial sums), their elements contiguous; `kernel`
    the launcher (wrap_triton(_linear) inside the op)."""
    rows, (n, k) = x.shape[0], weight.shape
    kernel[(triton.cdiv(n, cut.block_n), triton.cdiv(rows, BLOCK_M), cut.split_k)](  # type: ignore[index]
        x, weight, weight if bias is None else bias, out, rows, n, k, x.stride(0), weight.stride(0), out.stride(-2),
        STEPS=triton.cdiv(triton.cdiv(k, cut.split_k), cut.block_k), HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M,
        BLOCK_N=cut.block_n, BLOCK_K=cut.block_k, SPLIT_K=cut.split_k, SWAP=cut.swap, GATED=gated,
        num_warps=cut.warps, num_stages=cut.stages)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], gated: bool) -> None:  # noqa: UP045
    """ValueError unless the operands are F.linear's (`gated`: x twice the weight's k wide, its
    gate and its up), of one dtype, and the weight contiguous: the kernel takes n and k from the
    weight and nothing in it checks x against them (when it took k from x, an x narrower than
    the weight was multiplied by its first columns, a wider one read past the weight's rows, a
    short bias past its end); a copy of a strided weight would be made at every call, inside the
    step's graph. At the op's trace, under torch.compile: not in the graph's calls."""
    wide = 2 if gated else 1
    linear = (weight.dim() == 2 and x.dim() >= 1 and x.shape[-1] == wide * weight.shape[1] and weight.dtype == x.dtype
              and (bias is None or (bias.shape == weight.shape[:1] and bias.dtype == x.dtype)))
    if not linear:
        raise ValueError(f"few_rows_linear multiplies x [..., {'2 k' if gated else 'k'}] by a weight [n][k] and adds "
                         f"a bias [n] (F.linear's{', x its gate and up' if gated else ''}), "
                         f"all of one dtype: not x {list(x.shape)} {x.dtype}, weight {list(weight.shape)} "
                         f"{weight.dtype}, bias {None if bias is None else f'{list(bias.shape)} {bias.dtype}'}")
    if not weight.is_contiguous():
        raise ValueError(f"few_rows_linear reads its weight in place: a contiguous [n][k], not strides "
                         f"{weight.stride()}")


@torch.library.triton_op("memra_cuda::few_rows_linear", mutates_args=())
def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],  # noqa: UP045
                    block_n: int, block_k: int, split_k: int, swap: bool, warps: int, stages: int,
                    gated: bool) -> torch.Tensor:
    """F.linear(x, weight, bias) ([..., k]: its leading dims the rows; `gated`, F.linear of
    swiglu(x), x [..., 2 k]) through _linear cut as the Tiles the other arguments give
    (arguments, so the compiled graph holds them); operands that are not F.linear's, or a weight
    not contiguous, refused (_check)."""
    _check(x, weight, bias, gated)
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    cut = Tiles(block_n, block_k, split_k, swap, warps, stages)
    if split_k == 1:
        out = x.new_empty(flat.shape[0], weight.shape[0])
        launch(flat, weight, None if bias is None else bias.contiguous(), out, cut, wrap_triton(_linear), gated)
    else:
        partial = x.new_empty(split_k, flat.shape[0], weight.shape[0], dtype=torch.float32)
        launch(flat, weight, None, partial, cut, wrap_triton(_linear), gated)
        summed = partial.sum(0)
        out = (summed if bias is None else summed + bias.float()).to(x.dtype)
    return out.view(*x.shape[:-1], weight.shape[0])


@few_rows_linear.register_kernel("cpu")
def _on_cpu(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], block_n: int,  # noqa: UP045
            block_k: int, split_k: int, swap: bool, warps: int, stages: int, gated: bool) -> torch.Tensor:
    Tiles(block_n, block_k, split_k, swap, warps, stages)  # the GPU body's refusals of a cut, on any device
    return F.linear(swiglu(x) if gated else x, weight, bias)


def few_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool = False) -> torch.Tensor:
    """F.linear's arguments to few_rows_linear, cut as tiles() says for the weight's shape
    (`gated`: x is SwiGLU's fused gate and up, few_rows_gated's)."""
    return torch.ops.memra_cuda.few_rows_linear(x, weight, bias, *astuple(tiles(*weight.shape)), gated)


def few_rows_gated(mixed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The MLP's down projection of SwiGLU's fused gate and up (`mixed`, [..., 2 k]) as one
    few_rows_linear: the product silu(gate) * up made as the kernel reads it."""
    return few_rows(mixed, weight, bias, gated=True)

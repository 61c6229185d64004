"""memra_cuda.torch.skinny's linear of a few rows: its Triton kernel against F.linear in Triton's
interpreter on the CPU (fp32 and fp16: the interpreter's dot is wrong in bf16), on a GPU in bf16
eagerly, compiled and captured, and as a CompiledStack's projection ("few_rows") beside
inductor's; and what CompiledStack refuses of it, naming why. Skipped with the reason where
torch or triton (torch's own on a CUDA machine) is missing."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import astuple

import pytest

torch = pytest.importorskip("torch", reason="needs PyTorch (pip install '.[torch]' in the checkout)")

pytestmark = pytest.mark.torch

# rows, columns, k, bias: one row; a verify's five; a block of rows and one past it; columns and k
# not whole tiles (skinny.tiles: 16 or 64 columns, 128 of k)
SHAPES = ((1, 48, 128, False), (5, 200, 96, True), (16, 33, 257, True), (17, 301, 64, False))
# the cuts of the shapes: the default, k in four slices (the last short, or empty), the product swapped, both
CUTS = ("[skinny.Tiles(), skinny.Tiles(block_k=32, split_k=4), skinny.Tiles(block_n=64, swap=True), "
        "skinny.Tiles(block_n=32, block_k=32, split_k=3, swap=True)]")


def test_the_kernel_is_f_linear_in_tritons_interpreter():
    """Every row, column and bias of F.linear's product, rows, columns and k past whole tiles
    masked: the kernel run on the CPU by Triton's interpreter (set before triton is imported, so
    in a process of its own)."""
    pytest.importorskip("triton", reason="the kernel is Triton's (torch's own on a CUDA machine)")
    script = textwrap.dedent(f"""
        import torch, torch.nn.functional as F
        from memra_cuda.torch import skinny
        torch.manual_seed(0)
        for rows, n, k, bias in {SHAPES!r}:
            for cut in CUTS:
                for dtype in (torch.float32, torch.float16):
                    # small integers: every product and sum exact in fp32, so the kernel's must equal F.linear's
                    x, w = (torch.randint(-3, 4, size).to(dtype) for size in ((rows, k), (n, k)))
                    b = torch.randint(-3, 4, (n,)).to(dtype) if bias else None
                    out = torch.full((cut.split_k, rows, n) if cut.split_k > 1 else (rows, n), float("nan"),
                                     dtype=torch.float32 if cut.split_k > 1 else dtype)
                    skinny.launch(x, w, b if cut.split_k == 1 else None, out, cut)
                    got = out.sum(0) + (0 if b is None else b.float()) if cut.split_k > 1 else out.float()
                    want = F.linear(x.float(), w.float(), None if b is None else b.float())
                    assert torch.equal(got, want), (rows, n, k, bias, cut, dtype, (got - want).abs().max())
                # gated: x is SwiGLU's gate and up side by side, the product made in fp32 and rounded once
                mixed = torch.randn(rows, 2 * k).to(torch.float16)
                w = torch.randint(-3, 4, (n, k)).to(torch.float16)
                gate, up = mixed.float().chunk(2, -1)
                a = (gate * torch.sigmoid(gate) * up).to(torch.float16)
                out = torch.full((cut.split_k, rows, n) if cut.split_k > 1 else (rows, n), float("nan"))
                skinny.launch(mixed, w, None, out, cut, gated=True)
                got = out.sum(0) if cut.split_k > 1 else out
                want = F.linear(a.float(), w.float())
                torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))
        print("same")
    """).replace("CUTS", CUTS)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, TRITON_INTERPRET="1"))
    assert done.returncode == 0 and done.stdout.strip() == "same", done.stderr[-3000:]


def test_the_kernel_compiles_for_hopper_without_a_gpu():
    """The kernel through Triton's own compiler to an sm_90 cubin, on any machine, as a launch on
    a GPU specialises it (its pointers and sizes known multiples of 16, so its loads are
    pipelined: cp.async), for the cuts tiles() gives (split k, a head's wide slices) and the
    swapped product: the interpreter above runs Python, and a kernel it passes may still not
    compile (a constexpr worked out inside the kernel did not in Triton 3.6, the H200's)."""
    triton = pytest.importorskip("triton", reason="the kernel is Triton's (torch's own on a CUDA machine)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from memra_cuda.torch import skinny
    ints = ("rows", "n", "k", "x_row", "w_row", "out_row")
    signature = {**{name: "*bf16" for name in ("x", "weight", "bias", "out")}, **dict.fromkeys(ints, "i32")}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature) if name != "rows"}
    cuts = (skinny.tiles(768, 2048), skinny.tiles(128256, 2048), skinny.Tiles(block_n=64, swap=True))
    for cut, gated in (*((cut, False) for cut in cuts), (skinny.tiles(768, 2048), True)):
        assert cut.split_k == 3 or cut.block_n == 64, cut  # the cuts meant: k split, wide slices, swapped
        constants = dict(STEPS=-(-2048 // (cut.split_k * cut.block_k)), HAS_BIAS=cut.split_k == 1,
                         BLOCK_M=skinny.BLOCK_M, BLOCK_N=cut.block_n, BLOCK_K=cut.block_k, SPLIT_K=cut.split_k,
                         SWAP=cut.swap, GATED=gated)
        source = ASTSource(fn=skinny._linear, signature={**signature, **dict.fromkeys(constants, "constexpr")},
                           constexprs=constants, attrs=aligned)
        built = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=cut.warps, num_stages=cut.stages))
        assert len(built.asm["cubin"]) > 0 and "cp.async" in built.asm["ptx"], cut


def test_operands_that_are_not_f_linears_are_refused_as_the_op_is_traced():
    """The op's GPU body, traced as torch.compile traces it (fake CUDA tensors: on any machine),
    refuses what F.linear refuses: when the kernel read k from x and n from the weight, an x one
    column narrower than the weight was multiplied by its first columns (Triton's interpreter:
    x @ weight[:, :k]^T), one wider read past the weight's rows, and a bias one short past its
    end. Operands of F.linear's shapes are traced."""
    pytest.importorskip("triton", reason="the kernel is Triton's (torch's own on a CUDA machine)")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memra_cuda.torch import skinny
    with FakeTensorMode():
        def cuda(*size, dtype=torch.bfloat16):
            return torch.empty(size, dtype=dtype, device="cuda")
        x, weight, bias = cuda(5, 64), cuda(48, 64), cuda(48)
        assert skinny.few_rows(x, weight, bias).shape == (5, 48)  # F.linear's: traced
        for given in ((cuda(5, 63), weight, bias), (cuda(5, 65), weight, bias), (x, weight, cuda(47)),
                      (x, cuda(48, 64, dtype=torch.float16), None), (x, weight, cuda(48, dtype=torch.float32)),
                      (x, cuda(48, 64, 1), None)):
            with pytest.raises(ValueError, match=re.escape("few_rows_linear multiplies x [..., k] by a weight [n][k]")):
                skinny.few_rows_linear(*given, *astuple(skinny.Tiles()), False)
        # gated: x is the gate and the up, twice the weight's k; F.linear's width is refused there
        assert skinny.few_rows_gated(cuda(5, 128), weight, bias).shape == (5, 48)
        assert skinny.tiles(768, 2048).split_k > 1  # a down projection's cut: its partial sums traced too
        assert skinny.few_rows_gated(cuda(5, 4096), cuda(768, 2048), cuda(768)).shape == (5, 768)
        with pytest.raises(ValueError, match=re.escape("few_rows_linear multiplies x [..., 2 k] by a weight [n][k]")):
            skinny.few_rows_gated(x, weight, bias)
        with pytest.raises(ValueError, match="reads its weight in place: a contiguous"):
            skinny.few_rows(x, cuda(64, 48).t(), None)


@pytest.mark.parametrize(("field", "value", "error", "why"), [
    ("block_n", 0, ValueError, "block_n must be an int of at least 16, not 0"),  # divided by zero at the launch
    ("block_n", 48, ValueError, "block_n must be a power of two, not 48"),  # tl.arange's length
    ("block_k", 8, ValueError, "block_k must be an int of at least 16, not 8"),  # under tl.dot's least
    ("block_k", 64.0, TypeError, "block_k must be an integer"),
    ("split_k", 0, ValueError, "split_k must be an int of at least 1, not 0"),
    ("warps", 3, ValueError, "warps must be a power of two, not 3"),
    ("stages", -1, ValueError, "stages must be an int of at least 1, not -1"),
    ("swap", 1, TypeError, "swap must be True or False, not 1")])
def test_a_cut_the_kernel_cannot_take_is_refused_as_it_is_built_naming_its_field(field, value, error, why):
    """Tiles, built by hand, by tiles() (dataclasses.replace) or by the op from its arguments (on
    a GPU's fake tensors as torch.compile traces it, and on the CPU, whose kernel is F.linear):
    few_rows_linear(block_n=0) divided by zero sizing its grid, a block_n of 48 met tl.arange's
    refusal inside Triton."""
    pytest.importorskip("triton", reason="the kernel is Triton's (torch's own on a CUDA machine)")
    from dataclasses import fields, replace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from memra_cuda.torch import skinny
    for build in (lambda: skinny.Tiles(**{field: value}), lambda: replace(skinny.tiles(768, 2048), **{field: value})):
        with pytest.raises(error, match=why):
            build()
    if error is TypeError:
        return  # the op's schema refuses a float for an int and an int for a bool itself, naming the argument
    cut = [value if named.name == field else getattr(skinny.Tiles(), named.name) for named in fields(skinny.Tiles)]
    with pytest.raises(error, match=why):
        skinny.few_rows_linear(torch.ones(5, 32), torch.ones(48, 32), None, *cut, False)
    with FakeTensorMode():
        x, weight = torch.empty(5, 64, dtype=torch.bfloat16, device="cuda"), torch.empty(48, 64, dtype=torch.bfloat16,
                                                                                          device="cuda")
        with pytest.raises(error, match=why):
            skinny.few_rows_linear(x, weight, None, *cut, False)


def test_a_projection_the_kernel_cannot_serve_is_refused_naming_why():
    pytest.importorskip("transformers", reason="memra_cuda.torch's models need transformers")
    from memra_cuda.torch.compiled import CompiledStack
    from test_torch_stack import tiny
    with pytest.raises(ValueError, match="projection is one of"):
        CompiledStack(tiny(), 40, projection="cublas", compile=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bf16 or fp16 model on a GPU, not torch.float32 on cpu"):
        CompiledStack(tiny(), 40, projection="few_rows", compile=False)


def test_a_step_of_few_rows_takes_the_op_and_a_prefill_never():
    """The plumbing, on the CPU (the op's CPU kernel is F.linear): a step of 2 to 16 rows calls
    few_rows for every projection and the head, few_rows_gated for every MLP's down, and gives
    the logits the step without it gives; one row, more than 16 and a prefill never call them."""
    pytest.importorskip("triton", reason="the kernel is Triton's (torch's own on a CUDA machine)")
    pytest.importorskip("transformers", reason="memra_cuda.torch's models need transformers")
    from memra_cuda.torch.compiled import CompiledStack
    from memra_cuda.torch.skinny import few_rows, few_rows_gated
    from test_torch_stack import tiny
    model = tiny()
    calls = []

    def counted(projection):
        def call(x, weight, bias):
            calls.append(projection)
            return projection(x, weight, bias)
        return call
    plain, few = (CompiledStack(model, 40, batch=3, compile=False) for _ in range(2))
    few.few_rows = counted(few_rows), counted(few_rows_gated)  # the CPU's stand-in: refused off a GPU
    for stack in (plain, few):
        stack.prefill(range(3), [[1, 5, 9, 3], [2, 8, 6], [4, 4, 7, 7, 1]])
    assert not calls, "a prefill took the op"
    for width, rows in ((1, 3), (5, 15), (6, 18)):
        tokens = torch.arange(3 * width).view(3, width) % 90
        positions = torch.tensor([[5 + i for i in range(width)]] * 3)
        calls.clear()
        torch.testing.assert_close(few.logits(tokens, positions), plain.logits(tokens, positions))
        layers = len(model.model.layers)
        want = [few_rows] * (3 * layers + 1) + [few_rows_gated] * layers if 2 <= rows <= 16 else []
        assert sorted(calls, key=id) == sorted(want, key=id), (width, calls)


@pytest.mark.gpu
def test_few_rows_on_a_gpu_are_f_linears_eager_compiled_and_captured(engine):
    """bf16 on the GPU, small integers (every product and sum exact in fp32, so each path must
    give F.linear's fp32 product rounded to bf16 once, exactly): each shape under each cut
    eagerly, then few_rows inside torch.compile (fullgraph: no break) and replayed from a CUDA
    graph of the compiled call on new inputs; and the compiled call copies no weight (inductor
    clones what it takes a kernel to write: a weight of 64 MiB cloned would show in the peak)."""
    pytest.importorskip("triton", reason="the kernel is Triton's (torch's own on a CUDA machine)")
    from memra_cuda.torch.skinny import Tiles, few_rows, few_rows_linear

    def small(*size: int) -> torch.Tensor:
        return torch.randint(-3, 4, size, device="cuda").to(torch.bfloat16)

    def want(x, w, b):
        return torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float()).to(torch.bfloat16)
    compiled = torch.compile(lambda x, w, b: few_rows(x, w, b) * 1, fullgraph=True)
    for rows, n, k, bias in SHAPES:
        x, w, b = small(rows, k), small(n, k), small(n) if bias else None
        for cut in (Tiles(), Tiles(block_k=32, split_k=4), Tiles(block_n=64, swap=True)):
            got = few_rows_linear(x, w, b, cut.block_n, cut.block_k, cut.split_k, cut.swap, cut.warps, cut.stages,
                                  False)
            assert torch.equal(got, want(x, w, b)), (rows, n, k, bias, cut)
        assert torch.equal(compiled(x, w, b), want(x, w, b)), (rows, n, k, bias)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                out = compiled(x, w, b)
        x.copy_(small(rows, k))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want(x, w, b)), (rows, n, k, bias, "replayed")
    x, w = small(5, 4096), small(8192, 4096)
    compiled(x, w, None)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    compiled(x, w, None)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < w.nbytes // 4, "the compiled call copied the weight"


@pytest.mark.gpu
def test_few_rows_gated_is_the_down_projection_of_swiglus_product_on_a_gpu(engine):
    """bf16 on the GPU, a verify's 5 rows of the pair's down projection (768 x 2048): few_rows_gated
    of the fused gate and up is F.linear of silu(gate) * up made in fp32 and rounded once to bf16
    (inductor's fused kernel's product), eagerly under tiles()' cut (k split in three) and a
    swapped one, and compiled (fullgraph: no break)."""
    pytest.importorskip("triton", reason="the kernel is Triton's (torch's own on a CUDA machine)")
    from memra_cuda.torch.skinny import Tiles, few_rows_gated, few_rows_linear
    generator = torch.Generator(device="cuda").manual_seed(3)
    mixed = torch.randn(5, 2 * 2048, device="cuda", generator=generator).to(torch.bfloat16)
    w = (torch.randn(768, 2048, device="cuda", generator=generator) / 45).to(torch.bfloat16)
    gate, up = mixed.float().chunk(2, -1)
    want = torch.nn.functional.linear((gate * torch.sigmoid(gate) * up).to(torch.bfloat16).float(), w.float())
    compiled = torch.compile(lambda x, w: few_rows_gated(x, w, None) * 1, fullgraph=True)
    swapped = Tiles(block_n=64, swap=True)
    for got in (few_rows_gated(mixed, w, None), compiled(mixed, w),
                few_rows_linear(mixed, w, None, *astuple(swapped), True)):
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.mark.gpu
def test_a_verify_through_few_rows_is_inductors_verify_in_bf16(engine):
    """The small random-weight Llama in bf16, compiled both ways at B = 1: a verify of 5 tokens, a
    step of 2 rows of 3 and a one-token step of 8 rows (SDPA's, its batch symbolic: the draft's
    and the plain loop's at B = 8; all in FEW_ROWS) give inductor's logits within bf16's
    rounding, and the same greedy tokens wherever inductor's top two are not within that rounding."""
    pytest.importorskip("triton", reason="the kernel is Triton's (torch's own on a CUDA machine)")
    pytest.importorskip("transformers", reason="memra_cuda.torch's models need transformers")
    from memra_cuda.torch.compiled import CompiledStack
    from memra_cuda.torch.testing import build_model
    from memra_cuda.torch.skinny import few_rows, few_rows_gated
    model = build_model("small").to(torch.bfloat16)
    assert CompiledStack(model, 64).few_rows == (few_rows, few_rows_gated), "left out, few_rows where it serves"
    for batch, width in ((1, 5), (2, 3), (8, 1)):
        stacks = [CompiledStack(model, 64, batch, projection=projection) for projection in ("inductor", "few_rows")]
        prompts = [[1, 5, 9, 3, 7][:4 + r] for r in range(batch)]
        tokens = torch.tensor([[4 + i + r for i in range(width)] for r in range(batch)], device="cuda")
        positions = torch.tensor([[len(p) + i for i in range(width)] for p in prompts], device="cuda")
        got = []
        for stack in stacks:
            stack.prefill(range(batch), prompts)
            got.append(stack.logits(tokens, positions).float())
        inductor, few = got
        torch.testing.assert_close(few, inductor, atol=0.05 * float(inductor.abs().max()), rtol=0.05)
        top2 = inductor.topk(2, -1).values
        clear = (top2[..., 0] - top2[..., 1]) > 0.05 * float(inductor.abs().max())
        assert torch.equal(few.argmax(-1)[clear], inductor.argmax(-1)[clear])


@pytest.mark.gpu
@pytest.mark.alone
def test_split_k_partial_sums_past_two_to_the_31_elements_land_in_their_slice(engine):
    """The public op over enough rows that a slice of k's partial sums starts past 2**31 elements
    of its [split_k][rows][n] buffer (slice 7 of 8 at 300 000 rows x 1 024 columns: 2.15e9): each
    slice's offset is int64 as the rows' are (int32, slice 7 wrapped to about 8.6 GB before the
    buffer: another tensor overwritten or the context lost, its own sums never written). Small
    integers, so the sum of the slices is F.linear's exactly; the buffer takes 9.8 GB (alone)."""
    pytest.importorskip("triton", reason="the kernel is Triton's (torch's own on a CUDA machine)")
    from memra_cuda.torch.skinny import Tiles, few_rows_linear
    rows, n, k, cut = 300_000, 1024, 256, Tiles(block_n=64, block_k=32, split_k=8)
    assert (cut.split_k - 1) * rows * n >= 2**31 and cut.split_k * cut.block_k == k  # every slice of k non-empty
    x = torch.randint(-3, 4, (rows, k), device="cuda").to(torch.bfloat16)
    w = torch.randint(-3, 4, (n, k), device="cuda").to(torch.bfloat16)
    got = few_rows_linear(x, w, None, *astuple(cut), False)
    torch.cuda.synchronize()
    for part in (slice(0, 4096), slice(rows - 4096, rows)):  # the first rows and the last, where slice 7 ends
        want = torch.nn.functional.linear(x[part].float(), w.float()).to(torch.bfloat16)
        assert torch.equal(got[part], want), part

"""memra_cuda.torch's compiled step on the CPU (torch and transformers, no GPU), against Hugging
Face's own forward on tiny random Llamas: the fused weights (held once, shared with a
self-speculative draft), a CompiledStack's rows at their own positions and a tree's nodes under
the ancestor mask with either attention, run eagerly (the arithmetic) and compiled (no graph
break), its capacity in whole blocks, and what does not fuse refused by name. The GPU tests run
the decoders on it (every decoder compiles where its models fuse)."""
from __future__ import annotations

import functools
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs PyTorch (pip install '.[torch]' in the checkout)")
pytest.importorskip("transformers", reason="memra_cuda.torch's models need transformers")

from memra_cuda.torch import GraphedGreedy, PagedKV, SamplingParams, Stack, TreeMask, self_draft  # noqa: E402
from memra_cuda.torch.attention import BLOCK, block_counts  # noqa: E402
from memra_cuda.torch.compiled import ONE_ROW_VERIFY, CompiledStack, compiled_step, stack_for  # noqa: E402
from memra_cuda.torch.fused import fuse  # noqa: E402
from memra_cuda.errors import NotFused  # noqa: E402
from memra_cuda.torch.parallel import shard  # noqa: E402

from test_torch_stack import (TOL, TREE, VOCAB, ancestors, hf_logits, hybrid, mask_words,  # noqa: E402
                              rows_give_hugging_faces_logits, tiny)

pytestmark = pytest.mark.torch

ATTENTIONS = ("sdpa", "flex", None)  # None: each width its own (compiled.attends)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_rows_at_their_own_positions_give_hugging_faces_logits(attention):
    """Three rows prefilled to different lengths (one of a single token: nothing to prefill), then
    stepped together, one token and then three a row (a verify), each at its own positions: every
    token's logits are Hugging Face's over that row's sequence alone."""
    model = tiny()
    rows_give_hugging_faces_logits(model, CompiledStack(model, 40, batch=3, attention=attention, compile=False))


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_flex_options_reach_every_flex_attention_call_and_leave_its_logits_hugging_faces(monkeypatch, compile):
    """CompiledStack(flex_options=) hands flex_attention its kernel_options at every call of a step
    that attends through flex (a probe's: FORCE_USE_FLEX_ATTENTION takes one kernel a layer where
    flex decoding took four), eagerly and as the compiled step is traced, and its rows' logits stay
    Hugging Face's; left out, ONE_ROW_VERIFY's for a verify of one row, and none (torch's own
    choice) for every other step."""
    import torch.nn.attention.flex_attention as flex_module
    given = []
    original = flex_module.flex_attention

    def spy(*args, **kwargs):
        given.append(kwargs.get("kernel_options"))
        return original(*args, **kwargs)
    monkeypatch.setattr(flex_module, "flex_attention", spy)
    model = tiny()
    options = {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 16}
    rows_give_hugging_faces_logits(model, CompiledStack(model, 40, batch=3, attention="flex", compile=compile,
                                                        flex_options=options))
    assert given and all(kernel == options for kernel in given)
    given.clear()
    rows_give_hugging_faces_logits(model, CompiledStack(model, 40, batch=3, attention="flex", compile=compile))
    assert given and all(kernel is None for kernel in given)
    for told, verify in ((None, dict(ONE_ROW_VERIFY)), ({}, None)):  # one row: {} asks torch's choice
        one = CompiledStack(model, 40, attention="flex", compile=compile, flex_options=told)
        row = [1, 5, 9, 3, 4, 8]
        one.prefill([0], [row[:-1]])
        for width, kernel in ((1, None), (3, verify)):
            given.clear()
            tokens = torch.tensor([row[-1:] + [(7 * i) % VOCAB for i in range(1, width)]])
            got = one.logits(tokens, len(row) - 1 + torch.arange(width)[None])
            for i in range(width):
                torch.testing.assert_close(got[0, i], hf_logits(model, row + tokens[0, 1:i + 1].tolist()), **TOL)
            assert given and all(each == kernel for each in given), (told, width, given)
            row = row + tokens[0, 1:].tolist() + [int(got[0, -1].argmax())]


@pytest.mark.parametrize("options", [[("FORCE_USE_FLEX_ATTENTION", True)], {1: True}, "BLOCK_M=16", True])
def test_flex_options_that_are_no_mapping_of_names_are_refused_naming_it(options):
    with pytest.raises(TypeError, match="flex_options is a mapping of flex_attention's kernel_options"):
        CompiledStack(tiny(), 40, attention="flex", compile=False, flex_options=options)


@pytest.mark.parametrize("static", [True, False], ids=["static", "from-words"])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_a_trees_nodes_see_the_prefix_and_their_ancestors_only(attention, static):
    """Each node's logits are Hugging Face's over the prompt and the node's root path: not its
    siblings, not their subtrees, not the stale entries an earlier round left past the root."""
    model = tiny()
    stack = CompiledStack(model, 40, batch=2, attention=attention, compile=False)
    prompts = [[1, 5, 9, 3, 4], [2, 8, 6, 1, 7, 30, 31, 9, 4]]
    stack.prefill(range(2), [p[:-1] for p in prompts])
    start = torch.tensor([[len(p) - 1] for p in prompts])
    stack.logits(torch.full((2, 12), 50), start + torch.arange(12))  # an earlier round's entries
    tokens = torch.randint(0, VOCAB, (2, TREE.nodes), generator=torch.Generator().manual_seed(1))
    tokens[:, 0] = torch.tensor([p[-1] for p in prompts])
    depth = torch.tensor([len(ancestors(TREE, i)) - 1 for i in range(TREE.nodes)])
    mask = TreeMask(mask_words(TREE, 2), stack.kv.capacity, model.dtype, TREE if static else None).at(start)
    logits = stack.logits(tokens, start + depth, slots=start + torch.arange(TREE.nodes), mask=mask.rows(0, TREE.nodes))
    for r, prompt in enumerate(prompts):
        for node in range(TREE.nodes):
            path = prompt[:-1] + [int(tokens[r, i]) for i in ancestors(TREE, node)]
            torch.testing.assert_close(logits[r, node], hf_logits(model, path), **TOL,
                                       msg=lambda m, r=r, node=node: f"row {r}, node {node}: {m}")


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_a_level_past_a_block_sees_only_its_ancestors_in_the_block_before(attention):
    """A draft's level of a tree (nodes 3 to 6, at slots 128 on) whose earlier levels (nodes 0 to
    2, slots 125 to 127) lie in the block before: each node's logits are Hugging Face's over its
    root path. flex took the blocks below a level's first slot as seen whole, as a causal step
    may, so nodes 3 and 5 saw their uncles at slots 126 and 127 (a separate draft's cache on the
    H200 differed from its own prefill at one position)."""
    model = tiny()
    stack = CompiledStack(model, 2 * BLOCK, attention=attention, compile=False)
    prompt = [int(t) for t in torch.randint(1, VOCAB, (BLOCK - 2,), generator=torch.Generator().manual_seed(2))]
    stack.prefill([0], [prompt[:-1]])
    start = torch.tensor([[len(prompt) - 1]])  # the root's slot: 125
    tokens = torch.randint(0, VOCAB, (1, TREE.nodes), generator=torch.Generator().manual_seed(3))
    tokens[0, 0] = prompt[-1]
    depth = torch.tensor([len(ancestors(TREE, i)) - 1 for i in range(TREE.nodes)])
    mask = TreeMask(mask_words(TREE, 1), stack.kv.capacity, model.dtype, TREE).at(start)
    stack.logits(tokens, start + depth, slots=start + torch.arange(TREE.nodes), mask=mask.rows(0, TREE.nodes))
    level = slice(3, TREE.nodes)  # past the block: slots 128 to 131
    slots = (start + torch.arange(TREE.nodes))[:, level]
    logits = stack.logits(tokens[:, level], (start + depth)[:, level], slots=slots,
                          mask=mask.rows(level.start, level.stop))
    for i, node in enumerate(range(level.start, level.stop)):
        path = prompt[:-1] + [int(tokens[0, j]) for j in ancestors(TREE, node)]
        torch.testing.assert_close(logits[0, i], hf_logits(model, path), **TOL,
                                   msg=lambda m, node=node: f"node {node}: {m}")
    # run eagerly, flex_attention applies the mask to every block: the blocks it would skip the mask of
    # compiled (the GPU's kernels) are checked here, every one seen whole by each node of the level
    seen = mask.rows(level.start, level.stop)[:, 0] == 0
    whole, _ = block_counts(slots, seen)
    assert whole.tolist() == [[0]] and block_counts(slots)[0].tolist() == [[1]]  # causally, block 0 was whole
    root = (start + 2, mask_words(TREE, 1))  # the root at 127: the block below it (prefix and root) is whole
    verify = TreeMask(root[1], stack.kv.capacity, model.dtype, TREE).at(root[0]).rows(0, TREE.nodes)[:, 0] == 0
    assert block_counts(root[0] + torch.arange(TREE.nodes), verify)[0].tolist() == [[1]]


def test_the_compiled_step_is_the_eager_steps_arithmetic_in_one_graph():
    """torch.compile with fullgraph: a graph break would be an error, not a slower step (the
    modules' Stack broke at its BLAS switch). A prefill, a decode step and a verify of every row
    give the eager step's logits."""
    model = tiny()
    eager, compiled = (CompiledStack(model, 40, batch=2, compile=flag) for flag in (False, True))
    prompts = [[1, 5, 9, 3], [2, 8, 6, 1, 7, 30]]
    for stack in (eager, compiled):
        stack.prefill(range(2), prompts)
    for width in (1, 3):
        tokens = torch.tensor([[4 + i for i in range(width)], [9 + i for i in range(width)]])
        positions = torch.tensor([[len(p) + i for i in range(width)] for p in prompts])
        torch.testing.assert_close(compiled.logits(tokens, positions), eager.logits(tokens, positions), **TOL)


@pytest.mark.parametrize("flag", ["False", 0, 1.0])
@pytest.mark.parametrize(("name", "make"), [
    ("compile", lambda flag: CompiledStack(tiny(), 40, compile=flag)),
    ("dynamic", lambda flag: CompiledStack(tiny(), 40, dynamic=flag)),
    ("tuning", lambda flag: CompiledStack(tiny(), 40, tuning=flag)),
    ("compiled", lambda flag: stack_for(tiny(), 40, compiled=flag)),
    ("eager", lambda flag: GraphedGreedy(tiny(), 40, eager=flag))])
def test_a_stacks_switches_take_true_or_false_alone(name, make, flag):
    """compile="False" compiled, eager="False" ran the plain loop eagerly, compiled=0 chose the
    modules: each switch read by its truth. Refused now, naming itself (None also, where it is
    one of the switch's values), before a stream or a compilation is made."""
    with pytest.raises(TypeError, match=f"{name} must be (None or )?True or False, not {flag!r}"):
        make(flag)


def test_a_step_compiled_for_programmatic_dependent_launch_is_the_eager_steps_arithmetic():
    """compiled_step(pdl=True), benchmarks.steps --pdl's probe: torch.compile takes inductor's option
    (an option this torch lacks would raise at the compile), and a decode step and a verify give
    the eager step's logits (on a CPU the option generates nothing; a GPU's kernels wait on it)."""
    model = tiny()
    eager, compiled = (CompiledStack(model, 40, batch=1, compile=flag) for flag in (False, True))
    compiled.step, compiled.wide_step = compiled_step(pdl=True), compiled_step(tuning=False, pdl=True)
    assert compiled.step is not compiled_step() and compiled.step is compiled_step(pdl=True)
    for stack in (eager, compiled):
        stack.prefill([0], [[1, 5, 9, 3]])
    for width in (1, 3):
        tokens, positions = torch.tensor([[4 + i for i in range(width)]]), torch.tensor([[4 + i for i in range(width)]])
        torch.testing.assert_close(compiled.logits(tokens, positions), eager.logits(tokens, positions), **TOL)


def test_a_rounds_arithmetic_runs_as_its_stack_runs_its_step():
    """LayerStack.compiled: the modules' Stack and an eager CompiledStack run a round's arithmetic
    as it is; a compiled stack compiles it (one graph) to the same numbers. Op by op is one
    name, stack.op_by_op, what a TreeMask made outside a decoder runs its arithmetic by too (it
    had an identity of its own, mask._as_is)."""
    import inspect

    from memra_cuda.torch.stack import op_by_op
    assert inspect.signature(TreeMask).parameters["compiled"].default is op_by_op
    model = tiny()

    def arithmetic(x: torch.Tensor) -> torch.Tensor:
        return (x.long() * 3 + 1).clamp(0, 40)
    for eager in (Stack(model, 40), CompiledStack(model, 40, compile=False)):
        assert eager.compiled(arithmetic) is arithmetic
    compiled = CompiledStack(model, 40).compiled(arithmetic)
    assert compiled is not arithmetic
    x = torch.arange(-3, 20, dtype=torch.int32)
    assert torch.equal(compiled(x), arithmetic(x))


LAWS = [SamplingParams(1.0), SamplingParams(0.7, top_k=20), SamplingParams(1.3, top_p=0.8),
        SamplingParams(0.5, top_k=20, top_p=0.9), SamplingParams(1e-45)]


@pytest.mark.parametrize("law", LAWS, ids=["T=1", "top-k", "top-p", "all", "T=1e-45"])
def test_a_laws_probabilities_compiled_fill_each_draft_steps_rows_as_eagerly(law):
    """A decoder's draft_law and target_law (SamplingParams.fill through CompiledStack.compiled):
    each draft step's [B][V] of q_d ([B][k][V]) and a verify's [B][T][V] of p_d take probs()'s
    numbers, every step from one compilation (a slice of q_d is another step's at another
    offset); a temperature of 1e-45, whose reciprocal is inf in float32, gives the likeliest token
    all the mass (on a GPU inductor divides by a constant as a product by its reciprocal)."""
    fill = CompiledStack(tiny(), 40).compiled(law.fill)
    batch, k, vocab = 3, 4, VOCAB
    logits = torch.randn(batch, k + 1, vocab, generator=torch.Generator().manual_seed(4)).bfloat16() * 4
    q = torch.zeros(batch, k, vocab)
    fill(q[:, 0], logits[:, 0])
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(1, k):
            fill(q[:, step], logits[:, step])
    torch.testing.assert_close(q, law.probs(logits[:, :k]), atol=1e-6, rtol=1e-5)
    p = torch.zeros(batch, k + 1, vocab)
    fill(p[:, :3], logits[:, :3])
    torch.testing.assert_close(p[:, :3], law.probs(logits[:, :3]), atol=1e-6, rtol=1e-5)
    assert not p[:, 3:].any(), "a verify of 3 tokens wrote past its columns"
    assert torch.isfinite(q).all() and torch.allclose(q.sum(-1), torch.ones(batch, k))
    if law.temperature < 1e-30:
        assert q.max(-1).values.min() == 1


def test_top_ps_running_mass_is_aten_s_cumsum_where_the_law_compiles():
    """Top-p's running mass reaches the compiler as one opaque operator (memra_cuda::running_mass),
    not as a cumsum for inductor to lower: inductor (torch 2.11, CUDA) split a few rows' scan over a
    vocabulary and failed to generate it, every compiled law with top-p (an H100)."""
    graphs = []

    def keep(graph, inputs):
        graphs.append(graph)
        return graph.forward

    law = SamplingParams(0.5, top_k=20, top_p=0.9)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5)) * 4
    torch.testing.assert_close(torch.compile(law.probs, backend=keep, fullgraph=True)(logits), law.probs(logits))
    targets = [str(node.target) for graph in graphs for node in graph.graph.nodes]
    assert any("running_mass" in target for target in targets), targets
    assert not any("cumsum" in target for target in targets), targets


def test_a_compiled_step_compiles_once_whatever_autograd_says():
    """The step, as the arithmetic around it: a decoder warmed up under grad mode (its
    constructor's) and captured under torch.no_grad() (`with torch.no_grad(): spec.generate(...)`,
    whose first burst captures) recompiled the step inside the capture. It runs with autograd
    off, so its logits carry no grad history even where the model's parameters require grad."""
    stack = CompiledStack(tiny().requires_grad_(True), 40, batch=2, attention="sdpa")
    stack.prefill(range(2), [[1, 2, 3], [4, 5, 6, 7]])
    tokens, positions = torch.tensor([[3], [7]]), torch.tensor([[2], [3]])
    want = stack.logits(tokens, positions)  # the warm-up, under grad mode
    assert not want.requires_grad
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        got = stack.logits(tokens, positions)  # the capture's
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("batch", [1, 2])
def test_a_rounds_steps_compile_once_whatever_attention_each_width_takes(batch):
    """A chain round's draft steps as its warm-up runs them and its capture again: the fold's two
    tokens (flex, each shape static) then a token a step (at one row SDPA, its batch marked
    dynamic; at two flex, static), every one over the cache's rows (StaticKV.every_row, one
    tensor). Its marks stayed on it, so the flex step compiled before the first one-token step
    marked the rows found them marked in the capture, and torch 2.12 and later (which guard on
    maybe_mark_dynamic's and mark_static's marks) compiled it again inside the capture; as did a
    verify after a width-0 body's."""
    draft = CompiledStack(tiny(), 40, batch=batch)
    assert draft.attends == {False: "sdpa" if batch == 1 else "flex", True: "flex"}
    draft.prefill(range(batch), [[1, 2, 3] * 5, [4, 5, 6] * 4][:batch])
    folds, ones, at = torch.tensor([[4, 5], [7, 8]]), torch.tensor([[6], [9]]), torch.tensor([[14], [11]])

    def chain_round() -> list[torch.Tensor]:
        logits = [draft.logits(folds[:batch], torch.cat([at, at + 1], 1)[:batch], last=True)]
        for step in range(1, 4):
            logits.append(draft.logits(ones[:batch], (at + 1 + step)[:batch]))
        return logits
    want = chain_round()  # the warm-up
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = chain_round()  # the capture's
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)


def test_a_rounds_compiled_arithmetic_compiles_once_whatever_autograd_says():
    """A decoder's warm-up compiles its round's arithmetic and its capture replays that
    compilation (one compiling there fails the capture), so nothing autograd says may fail a guard
    in between. Under the caller's autograd, a law's q_d slice filled from logits that require
    grad (a model whose parameters do, Hugging Face's from_pretrained's, run under grad mode)
    made q_d require grad, and the next slice recompiled; chain_start warmed up under grad mode
    recompiled in a capture under torch.no_grad()."""
    from memra_cuda.torch.chain import chain_start
    stack, law = CompiledStack(tiny(), 40), SamplingParams(0.7)
    fill, start = stack.compiled(law.fill), stack.compiled(chain_start)
    logits = torch.randn(2, 3, VOCAB, generator=torch.Generator().manual_seed(6)).requires_grad_()
    q = torch.zeros(2, 3, VOCAB)
    inputs = (torch.tensor([[5], [7]], dtype=torch.int32), torch.tensor([[3], [0]], dtype=torch.int32),
              torch.zeros(2, 1, dtype=torch.int32), torch.arange(10, dtype=torch.int32).view(2, 5),
              torch.tensor([[2], [1]], dtype=torch.int32), torch.arange(5))
    fill(q[:, 0], logits[:, 0])  # the warm-up, under grad mode
    want = start(*inputs)
    with torch._dynamo.config.patch(error_on_recompile=True):
        fill(q[:, 1], logits[:, 1])  # the capture's
        with torch.no_grad():
            fill(q[:, 2], logits[:, 2])
            got = start(*inputs)
    assert not q.requires_grad
    torch.testing.assert_close(q, law.probs(logits).detach(), atol=1e-6, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.gpu
def test_a_tiny_temperature_compiled_on_a_gpu_gives_the_likeliest_token_all_the_mass(engine):
    """On a GPU inductor divides by a constant (a law's temperature, which torch.compile takes as
    one) as a product by its reciprocal: 1 / 1e-45 is inf in float32, and the likeliest token's
    0 x inf was NaN, which the kernels read as no mass (token 0, every round). probs() keeps it 0."""
    fill = CompiledStack(tiny().cuda(), 40).compiled(SamplingParams(1e-45).fill)
    logits = torch.randn(3, 2, VOCAB, generator=torch.Generator().manual_seed(5)).cuda()
    out = torch.zeros(3, 2, VOCAB, device="cuda")
    fill(out, logits)
    assert torch.isfinite(out).all() and out.max(-1).values.min() == 1
    assert torch.equal(out.argmax(-1), logits.argmax(-1))


@pytest.mark.parametrize("static", [True, False], ids=["static", "from-words"])
def test_a_trees_mask_compiled_is_its_masks_arithmetic(static):
    """TreeMask(compiled=): a static tree's whole mask and a dynamic tree's levels, made by the
    draft stack's compiled arithmetic (as TreeLlama makes them), are the op-by-op masks exactly,
    round after round at other roots (one compilation: the roots are values, not shapes), a
    root near the cache's end included."""
    words = mask_words(TREE, 3)
    compiled = CompiledStack(tiny(), 40).compiled
    eager, fused = (TreeMask(words, 128, torch.bfloat16, TREE if static else None, **extra)
                    for extra in ({}, dict(compiled=compiled)))
    levels = [(0, 1), (1, 3), (3, 6), (0, TREE.nodes)]
    for round_, roots in enumerate(([[5], [0], [17]], [[9], [120], [126]], [[1], [2], [3]])):
        start = torch.tensor(roots)
        eager.at(start)
        with torch._dynamo.config.patch(error_on_recompile=round_ > 0):
            fused.at(start)
            for level in levels:
                got, want = fused.rows(*level), eager.rows(*level)
                assert got.dtype == want.dtype and torch.equal(got, want), (roots, level)


def test_the_plain_loops_step_end_compiled_is_its_arithmetic():
    """GraphedGreedy's advance, compiled with its stack's step: each step of a burst, the greedy
    token into the row's next input and the burst's column and the position on one, as op by op,
    every column from one compilation."""
    from memra_cuda.torch.greedy import advance

    def burst(run):  # GraphedGreedy's burst: out [steps][B + B % 2], a step's row [B][1]
        token, position = torch.zeros(3, 1, dtype=torch.long), torch.tensor([[4], [0], [9]])
        out = torch.zeros(5, 4, dtype=torch.long)
        for step in range(5):
            run(torch.randn(3, 1, VOCAB, generator=torch.Generator().manual_seed(step)), token, position,
                out[step, :3, None])
        return token, position, out
    compiled = CompiledStack(tiny(), 40).compiled(advance)
    compiled(torch.zeros(3, 1, VOCAB), *burst(advance)[:2], torch.zeros(5, 4, dtype=torch.long)[4, :3, None])
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = burst(compiled)
    want = burst(advance)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert want[1].tolist() == [[9], [5], [14]] and len(set(want[2][:, 0].tolist())) > 1
    assert not want[2][:, 3].any(), "a step wrote past its batch's row"


def first_inputs(pend, pos_ctr, done, vtok, accepted, lone_if_unaccepted: bool):
    """What a round's first draft step reads, by the rule (docs/model-side.md), row by row: the
    token vtok[accepted] at pos - 1 and the pending one at pos; the pending one twice at pos where
    the row is done, at position 0, or (a tree's) accepted nothing."""
    tokens, positions = [], []
    for row in range(len(pend)):
        at, a = int(pos_ctr[row, 0]), min(int(accepted[row, 0]), vtok.shape[1] - 1)
        lone = done[row, 0] != 0 or at == 0 or (lone_if_unaccepted and a == 0)
        tokens.append([int(pend[row, 0]) if lone else int(vtok[row, a]), int(pend[row, 0])])
        positions.append([at if lone else at - 1, at])
    return torch.tensor(tokens), torch.tensor(positions)


def test_a_rounds_first_draft_step_reads_what_the_last_round_accepted_deepest_compiled_or_not():
    """chain_start and tree_start, which a decoder compiles with its draft's step: the fold's
    tokens and positions by the rule (first_inputs), row by row, rows done, at position 0, with
    nothing accepted and with every draft (and a garbage count past k, clamped), compiled the
    same; the chain's each step's position and the tree's each node's slot too."""
    from memra_cuda.torch.chain import chain_start
    from memra_cuda.torch.tree import tree_start
    k = 4
    pend = torch.tensor([[11], [12], [13], [14], [15], [16]], dtype=torch.int32)
    pos = torch.tensor([[9], [0], [30], [7], [5], [20]], dtype=torch.int32)
    done = torch.tensor([[0], [0], [1], [0], [0], [0]], dtype=torch.int32)
    accepted = torch.tensor([[2], [1], [3], [0], [4], [9]], dtype=torch.int32)
    vtok = torch.arange(100, 100 + 6 * (k + 1), dtype=torch.int32).view(6, k + 1)
    steps = torch.arange(k + 1)
    compile_ = CompiledStack(tiny(), 40).compiled
    for start in (chain_start, compile_(chain_start)):
        tokens, first, positions = start(pend, pos, done, vtok, accepted, steps)
        want_tokens, want_first = first_inputs(pend, pos, done, vtok, accepted, lone_if_unaccepted=False)
        assert torch.equal(tokens.long(), want_tokens) and torch.equal(first, want_first)
        assert torch.equal(positions, pos.long() + steps)
    node_index = torch.arange(7)
    for start in (tree_start, compile_(tree_start)):
        tokens, first, slots = start(pend, pos, accepted, done, vtok, node_index)
        want_tokens, want_first = first_inputs(pend, pos, done, vtok, accepted, lone_if_unaccepted=True)
        assert torch.equal(tokens.long(), want_tokens) and torch.equal(first, want_first)
        assert torch.equal(slots, pos.long() + node_index)


@pytest.mark.parametrize("attention", ("sdpa", "flex"))
def test_a_bool_mask_is_read_in_sdpas_sense(attention):
    """A mask of bools (True where a query sees, SDPA's and Stack's sense) gives the additive
    mask's logits: the step took it as 0/1 (SDPA: every slot seen) or inverted it (flex)."""
    model = tiny()
    stack = CompiledStack(model, 40, batch=1, attention=attention, compile=False)
    stack.prefill([0], [[1, 5, 9, 3]])
    tokens, positions = torch.tensor([[4, 6, 8]]), torch.tensor([[4, 5, 5]])  # node 2 beside node 1, not behind it
    seen = torch.arange(stack.kv.capacity)[None, None, None] <= torch.tensor([4, 5, 4])[None, None, :, None]
    seen[0, 0, 2, 6] = True  # node 2 at slot 6 sees itself, not node 1 at slot 5
    additive = torch.zeros(seen.shape).masked_fill(~seen, -torch.inf)
    slots = torch.tensor([[4, 5, 6]])
    want = stack.logits(tokens, positions, slots=slots, mask=additive)
    torch.testing.assert_close(stack.logits(tokens, positions, slots=slots, mask=seen), want, **TOL)


def test_a_forward_of_rows_that_are_not_the_batchs_is_refused_before_a_cache_is_written():
    """One row on a stack of two overwrote row 1's cache before a shape error; three attended
    to row 0's; slots for two tokens a row where one is given wrote two; a mask not a row's and
    a slot's each was broadcast or read short. Each stack refuses them by their shapes, its
    cache as it was."""
    for stack in (Stack(tiny(), 40, batch=2), *(CompiledStack(tiny(), 40, batch=2, attention=attention, compile=False)
                                               for attention in ("sdpa", "flex"))):
        stack.prefill([0, 1], [[1, 5, 9], [2, 8]])
        before = [cache.clone() for cache in (*stack.kv.k, *stack.kv.v)]
        for tokens, positions, slots in ((torch.tensor([[3]]), torch.tensor([[5]]), None),
                                         (torch.tensor([[3]] * 3), torch.tensor([[5]] * 3), None),
                                         (torch.tensor([3, 4]), torch.tensor([5, 5]), None),
                                         (torch.tensor([[3], [4]]), torch.tensor([[3, 4]]), None),
                                         (torch.tensor([[3], [4]]), torch.tensor([[3], [2]]),
                                          torch.tensor([[5, 6]] * 2)),
                                         (torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long),
                                          None)):  # T = 0 gave [B][0][V], even as `last`'s [B][1][V]
            with pytest.raises(ValueError, match="a forward takes \\[B\\]\\[T\\] tokens, positions and slots, "
                                                 "B = 2, T >= 1"):
                stack.logits(tokens, positions, slots=slots)
        # float tokens were truncated to other tokens (1.7 as 1), a list met an AttributeError
        for tokens, positions, named in ((torch.tensor([[1.7], [2.2]]), torch.tensor([[3], [2]]), "tokens"),
                                         ([[1], [2]], torch.tensor([[3], [2]]), "tokens"),
                                         (torch.tensor([[1], [2]]), torch.tensor([[True], [False]]), "positions")):
            with pytest.raises(TypeError, match=f"a forward's {named} are an integer tensor, not"):
                stack.logits(tokens, positions)  # type: ignore[arg-type]
        # a mask a slot short of the cache (flex read its last slot for the rest), one row's (SDPA
        # broadcast it to both), one token's for two; an int mask was taken as additive 0 and 1
        tokens, positions = torch.tensor([[3, 4], [4, 5]]), torch.tensor([[3, 4], [2, 3]])
        seen = torch.arange(stack.kv.capacity) <= positions[..., None, None].transpose(1, 2)  # [B][1][T][capacity]
        for mask in (seen[..., :-1], seen[:1], seen[:, :, :1], torch.cat([seen, seen[..., :1]], -1)):
            with pytest.raises(ValueError, match=re.escape(f"a forward's mask is [R][1][T][capacity], "
                                                           f"{[2, 1, 2, stack.kv.capacity]}: not {list(mask.shape)}")):
                stack.logits(tokens, positions, mask=mask)
        with pytest.raises(TypeError, match="a forward's mask is a tensor of bools or floats, not torch.int32"):
            stack.logits(tokens, positions, mask=seen.int())
        # a float mask of another dtype: SDPA refused it under the model's own modules once the first
        # layer's K and V were written (a compiled stack casts it to its own)
        if isinstance(stack, CompiledStack):
            stack.logits(tokens, positions, mask=torch.where(seen, 0.0, float("-inf")).double())
            before = [cache.clone() for cache in (*stack.kv.k, *stack.kv.v)]
        else:
            with pytest.raises(TypeError, match="float mask is added to the scores in the model's dtype, "
                                                "torch.float32: not torch.float64"):
                stack.logits(tokens, positions, mask=torch.where(seen, 0.0, float("-inf")).double())
        # a meta tensor embedded as zeros (no error): each of a forward's tensors is on the stack's device
        for named, given in (("tokens", dict(tokens=tokens.to("meta"))),
                             ("positions", dict(positions=positions.to("meta"))),
                             ("slots", dict(slots=positions.to("meta"))), ("mask", dict(mask=seen.to("meta")))):
            verb = "is" if named == "mask" else "are"
            with pytest.raises(ValueError, match=f"a forward's {named} {verb} on meta, not the stack's device, cpu"):
                stack.logits(**{**dict(tokens=tokens, positions=positions), **given})
        assert all(torch.equal(a, b) for a, b in zip(before, (*stack.kv.k, *stack.kv.v))), type(stack).__name__
        stack.logits(tokens, positions, mask=seen)  # the mask at its shape, bools


def test_a_forwards_last_is_true_or_false():
    """last="False" was read by its truth (the last token's [B][1][V] where every token's was asked),
    None as False, and a tensor met torch's "Boolean value of Tensor is ambiguous": each stack
    refuses what is no bool by name, before its cache is written."""
    tokens, positions = torch.tensor([[3, 4], [4, 5]]), torch.tensor([[0, 1], [0, 1]])
    for stack in (Stack(tiny(), 40, batch=2), CompiledStack(tiny(), 40, batch=2, compile=False)):
        for last in ("False", None, 1, torch.tensor(True)):
            with pytest.raises(TypeError, match=re.escape(f"a forward's last must be True or False, not {last!r}")):
                stack.logits(tokens, positions, last=last)  # type: ignore[arg-type]
        assert not any(cache.any() for cache in (*stack.kv.k, *stack.kv.v)), type(stack).__name__
        assert stack.logits(tokens, positions, last=np.False_).shape == (2, 2, VOCAB)  # numpy's bool is a bool
        assert stack.logits(tokens, positions, last=True).shape == (2, 1, VOCAB)


def test_a_capacity_is_whole_blocks_and_a_garbage_position_stays_inside():
    stack = CompiledStack(tiny(), 40, compile=False)
    assert stack.kv.capacity == BLOCK and stack.kv.k[0].shape[2] == BLOCK
    logits = stack.logits(torch.tensor([[3, 4]]), torch.tensor([[-7, 1 << 40]]))
    assert torch.isfinite(logits).all() and stack.kv.lengths.tolist() == [[0]] * 3  # lengths are the round's
    # the capacity asked for is checked before it is rounded up ("64" met a bare TypeError, True was 128)
    for capacity, error in (("64", TypeError), (True, TypeError), (2.5, TypeError), (0, ValueError), (-5, ValueError)):
        with pytest.raises(error, match=f"capacity must be an int|capacity must be an integer, not {capacity!r}"):
            CompiledStack(tiny(), capacity, compile=False)
    stack.prefill([], [])  # nothing to prefill: no rows, nothing written
    assert stack.kv.lengths.tolist() == [[0]] * 3


def test_a_capacity_past_the_most_whole_blocks_an_i32_counts_is_refused_before_a_cache_is_made(monkeypatch):
    """2**31 - 1 slots rounded up to whole blocks was a cache of 2**31, whose i32 lengths wrap:
    KVLayer refused it only once every cache had been allocated (or torch ran out of memory
    first). Every way a cache's size is given (a decoder's capacity or Room, a stack's, a
    StaticKV's) refuses one past MOST_SLOTS naming it, before a tensor is made; MOST_SLOTS
    itself stays whole blocks an i32 counts."""
    from memra_cuda.torch import Room
    from memra_cuda.torch.attention import MOST_SLOTS, aligned
    from memra_cuda.torch.kv import StaticKV, as_capacity
    assert aligned(MOST_SLOTS) == MOST_SLOTS <= 2**31 - 1 < aligned(MOST_SLOTS + 1)
    assert as_capacity(MOST_SLOTS, None) == MOST_SLOTS  # the limit (a cache that large is not made here)
    model, made = tiny(), []
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: made.append(a) or pytest.fail("a cache was made"))
    too_many = f"capacity must be {{}}an int from 1 to {MOST_SLOTS}, not {MOST_SLOTS + 1}"
    with pytest.raises(ValueError, match=too_many.format("a Room or ")):
        as_capacity(MOST_SLOTS + 1, None)
    with pytest.raises(ValueError, match=r"prompt_len 2147483000 and tokens 1000 take a cache of \d+ slots a "
                       f"row, past the most a row holds, {MOST_SLOTS}"):
        as_capacity(Room(2_147_483_000, 1000), None)
    for build in (lambda: Stack(model, MOST_SLOTS + 1), lambda: CompiledStack(model, MOST_SLOTS + 1, compile=False),
                  lambda: StaticKV(model.config, 1, 1, MOST_SLOTS + 1, torch.float32, "cpu")):
        with pytest.raises(ValueError, match=too_many.format("")):
            build()
    assert not made


def test_left_out_the_projection_is_the_defaults_where_it_serves_and_inductors_where_not(monkeypatch):
    """The default projection ("few_rows", PROJECTION) serves a 16-bit model on a GPU: left out,
    a stack of an fp32 model or one on the CPU multiplies by inductor's projections, where
    "few_rows" named is refused naming why; a default that is none of the projections (a program
    that set it wrong) is refused naming PROJECTION, as each stack is built."""
    from memra_cuda.torch import compiled
    assert compiled.PROJECTION == "few_rows" and compiled.PROJECTIONS == ("inductor", "few_rows")
    for model in (tiny(), tiny().to(torch.bfloat16)):  # fp32, and bf16 on the CPU
        assert CompiledStack(model, 40, compile=False).few_rows is None
        assert CompiledStack(model, 40, compile=False, projection="inductor").few_rows is None
        with pytest.raises(ValueError, match="projection 'few_rows' serves a bf16 or fp16 model on a GPU"):
            CompiledStack(model, 40, compile=False, projection="few_rows")
    with pytest.raises(ValueError, match="projection is one of \\('inductor', 'few_rows'\\).* not 'cublas'$"):
        CompiledStack(tiny(), 40, compile=False, projection="cublas")  # type: ignore[arg-type]
    monkeypatch.setattr(compiled, "PROJECTION", "cublas")
    with pytest.raises(ValueError, match="not 'cublas' \\(memra_cuda.torch.compiled.PROJECTION\\)"):
        CompiledStack(tiny(), 40, compile=False)


def test_without_triton_the_default_falls_back_to_inductors_and_few_rows_named_is_refused(monkeypatch):
    """A 16-bit model on a GPU where memra_cuda.torch.skinny cannot be imported (no triton): left
    out, the projection is inductor's; "few_rows" named is refused naming triton."""
    import sys
    from types import SimpleNamespace
    monkeypatch.setitem(sys.modules, "memra_cuda.torch.skinny", None)  # its import raises ImportError
    gpu_bf16 = SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16)
    assert CompiledStack._projection(gpu_bf16, None) is None
    with pytest.raises(ValueError, match="projection 'few_rows' needs triton"):
        CompiledStack._projection(gpu_bf16, "few_rows")


def test_a_batch_is_checked_before_flexs_grid_is_sized_by_it():
    """The batch sized flex's grid before it was checked: "2" (times 2 KV heads, "22") met a bare
    comparison's TypeError, None a multiplication's, and one past MAX_BATCH with flex asked for
    was refused as flex's, not as a batch. Each names the batch; MAX_BATCH itself is a batch."""
    from memra_cuda.buffers.geometry import MAX_BATCH, as_batch
    assert as_batch(MAX_BATCH) == MAX_BATCH  # the limit: a StaticKV of that many rows is too large to make here
    for batch, error in (("2", TypeError), (None, TypeError), ([2], TypeError), (True, TypeError), (2.0, TypeError),
                         (0, ValueError), (MAX_BATCH + 1, ValueError)):
        with pytest.raises(error, match=f"batch must be an int(eger)?.* {re.escape(repr(batch))}$"):
            CompiledStack(tiny(), 40, batch, attention="flex", compile=False)  # type: ignore[arg-type]


def test_flex_is_chosen_only_where_its_grid_holds_the_batch():
    """flex_attention's decoding kernel puts rows x KV heads in a grid's y (at most GRID_Y): at the
    limit each width attends as measured faster at its rows (one row's decode step through SDPA,
    every other through flex); one past it both take SDPA, and flex asked for is refused, naming
    the limit (it met "invalid argument" at the launch, 20 000 rows of 8)."""
    from memra_cuda.torch.compiled import GRID_Y, attends
    assert attends(None, 1, 8) == {False: "sdpa", True: "flex"} == attends(None, 1, GRID_Y)
    assert attends(None, 2, 8) == {False: "flex", True: "flex"} == attends(None, GRID_Y // 8, 8)
    assert attends("flex", 1, GRID_Y) == {False: "flex", True: "flex"} == attends("flex", GRID_Y, 1)
    assert attends("sdpa", 2, 8) == {False: "sdpa", True: "sdpa"}
    assert attends(None, 2, GRID_Y // 2 + 1) == {False: "sdpa", True: "sdpa"} == attends("sdpa", 1, GRID_Y + 1)
    with pytest.raises(ValueError, match=f"'flex' serves at most {GRID_Y} rows x KV heads .* not 1 x {GRID_Y + 1}"):
        attends("flex", 1, GRID_Y + 1)
    with pytest.raises(ValueError, match="attention is one of"):
        CompiledStack(tiny(), 40, attention="math", compile=False)  # type: ignore[arg-type]
    assert CompiledStack(tiny(), 40, 1, compile=False).attends == {False: "sdpa", True: "flex"}
    assert CompiledStack(tiny(), 40, 3, compile=False).attends == {False: "flex", True: "flex"}


def test_fusing_holds_the_weights_once_and_leaves_the_model_as_it_was():
    """q, k and v (and gate and up) become one matrix; the model's own weights become views of it,
    so nothing is held twice and Hugging Face's forward gives the same logits."""
    model = tiny()
    before = hf_logits(model, [1, 5, 9, 3])
    fused = fuse(model)
    layer, attention = fused.layers[0], model.model.layers[0].self_attn
    start, size = layer.qkv.data_ptr(), layer.qkv.numel() * layer.qkv.element_size()
    for linear in (attention.q_proj, attention.k_proj, attention.v_proj):
        assert start <= linear.weight.data_ptr() < start + size
    assert fuse(model) is fused, "a model is fused once"
    torch.testing.assert_close(hf_logits(model, [1, 5, 9, 3]), before, atol=0, rtol=0)


def test_a_self_speculative_draft_fuses_to_its_targets_layers():
    model = tiny()
    draft = self_draft(model, 1)
    assert fuse(draft).layers[0] is fuse(model).layers[0]
    assert CompiledStack(draft, 40, compile=False).prefix_of(CompiledStack(model, 40, compile=False))


def test_what_does_not_fuse_is_refused_naming_why_and_runs_through_its_modules():
    with pytest.raises(NotFused, match="layer 1 is recurrent"):
        fuse(hybrid())
    assert isinstance(stack_for(hybrid(), 40), Stack)  # its own modules, its state rolled back there
    with pytest.raises(NotFused, match="recurrent"):
        stack_for(hybrid(), 40, compiled=True)
    sharded = tiny()
    shard(sharded, 0, 2, lambda out: None)
    with pytest.raises(NotFused, match="o_proj is Reduced"):
        fuse(sharded)
    gelu = tiny()
    gelu.config.hidden_act = "gelu"
    with pytest.raises(NotFused, match="'gelu' is not SiLU"):
        fuse(gelu)
    with pytest.raises(NotFused, match="static cache"):
        stack_for(tiny(), 40, cache=PagedKV, compiled=True)
    with pytest.raises(NotFused, match="static cache, not PagedKV$"):  # a decoder's pages: a partial, named
        stack_for(tiny(), 40, cache=functools.partial(PagedKV, page=16), compiled=True)
    assert isinstance(stack_for(tiny(), 40, cache=PagedKV), Stack)
    assert isinstance(stack_for(tiny(), 40), CompiledStack)
    assert isinstance(stack_for(tiny(), 40, compiled=False), Stack)
    # an attention named is the compiled step's: kept by it, refused (naming why) where the modules run
    assert stack_for(tiny(), 40, attention="flex").attends == {False: "flex", True: "flex"}  # type: ignore[union-attr]
    with pytest.raises(NotFused, match="recurrent"):
        stack_for(hybrid(), 40, attention="flex")
    for kwargs in (dict(compiled=False), dict(cache=PagedKV)):
        with pytest.raises(ValueError, match="attention='flex' is the compiled step's"):
            stack_for(tiny(), 40, attention="flex", **kwargs)


@pytest.mark.parametrize("change", ["load_state_dict(assign=True)", "a weight set anew", "model.double()"])
def test_a_model_whose_weights_were_replaced_is_fused_again(change):
    """fuse() kept a model's fused weights for good: a stack made after its weights were replaced
    ran the ones fused before (another model's logits, silently), or met mixed dtypes after
    model.double(). Now a stack made after the change gives the changed model's logits."""
    model, prompt = tiny(), [1, 5, 9, 3, 4, 7]
    before = fuse(model)
    if change == "load_state_dict(assign=True)":
        model.load_state_dict(tiny(seed=5).state_dict(), assign=True)
    elif change == "a weight set anew":
        layer = model.model.layers[1]
        layer.mlp.up_proj.weight = torch.nn.Parameter(torch.randn_like(layer.mlp.up_proj.weight) * 0.02,
                                                     requires_grad=False)
    else:
        model.double()
    assert fuse(model) is not before and fuse(model) is fuse(model), "fused again once, then kept"
    stack = CompiledStack(model, 40, compile=False)
    stack.prefill([0], [prompt[:-1]])
    got = stack.logits(torch.tensor([prompt[-1:]]), torch.tensor([[len(prompt) - 1]]))[0, -1]
    torch.testing.assert_close(got, hf_logits(model, prompt).to(got.dtype), **TOL)


def test_a_model_that_no_longer_fuses_is_refused_as_such_when_fused_again():
    """A model fused, then cut into a tensor-parallel rank's share (or given a recurrent layer):
    fuse() looked at the fused weights first and met an AttributeError on the parts the model no
    longer has; NotFused says why."""
    model = tiny()
    fuse(model)
    shard(model, 0, 2, lambda tensor: None)
    with pytest.raises(NotFused, match="layer 0's o_proj is Reduced, not a torch.nn.Linear"):
        fuse(model)


def test_the_hosts_checks_of_a_size_trace_where_the_size_is_symbolic():
    """A size check inside a compiled function of dynamic shapes (skinny's Tiles of a weight's
    shape, in the GPU test of few_rows) sees a SymInt: is_bool looked for a dtype on it, which
    dynamo cannot trace (fullgraph: an error, where it passed before is_bool). Each check still
    refuses a bool there."""
    from memra_cuda.driver.values import as_index, as_size, is_bool
    sized = torch.compile(lambda x: x * as_size(x.shape[0], "rows") + as_index(x.shape[-1], "k"),
                          fullgraph=True, dynamic=True)
    for rows in (3, 5):
        assert torch.equal(sized(torch.ones(rows, 2)), torch.full((rows, 2), rows + 2.0))
    assert is_bool(torch.tensor(True)) and not is_bool(torch.tensor(1)) and not is_bool(7)
    with pytest.raises(TypeError, match="rows"):
        as_size(torch.tensor(True), "rows")
    with pytest.raises(TypeError, match="rows must be an integer, not an array of one"):
        as_size(torch.tensor([3]), "rows")  # operator.index read it as 3
    assert as_index(torch.tensor(3), "k") == 3

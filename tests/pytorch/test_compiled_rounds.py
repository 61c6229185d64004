"""A decoder's round compiles at its warm-up and never after, on the CPU: every callable a burst
captures (a chain's draft_chain and verify_trunk at each width, greedy and sampled; a tree's
draft levels and verify, static and dynamic; the plain loop's burst), run over CompiledStacks of
tiny random Llamas the way the decoder runs them, then again with other values in every buffer
under error_on_recompile, under grad mode and under torch.no_grad() (a caller's generate may
run under either). On a GPU that second run is inside a CUDA graph's capture, where a
compilation fails the capture (or synchronises the device): what the GPU tests would meet only
as a capture error, on a lease, is a named guard here.

The round's buffers are int32 slices of one tensor at their fields' offsets (views.windows over
the fields StreamBufs and TreeBufs carve, in their order), as the decoders' views are over the
device's arena. The decoders are made without their constructors, which need CUDA streams and
an engine: each test sets the attributes its callables read, as the constructor sets them."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs PyTorch (pip install '.[torch]' in the checkout)")
pytest.importorskip("transformers", reason="memra_cuda.torch's models need transformers")

from memra_cuda import DynamicTree, TreeShape  # noqa: E402
from memra_cuda.buffers.geometry import Geometry  # noqa: E402
from memra_cuda.buffers.layout import ACC_WORDS, BRK_WORDS, CTL_WORDS, RING_TOKENS  # noqa: E402
from memra_cuda.torch import GraphedGreedy, SamplingParams, SpeculativeLlama, TreeLlama, TreeMask  # noqa: E402
from memra_cuda.torch import views  # noqa: E402
from memra_cuda.torch.chain import chain_start  # noqa: E402
from memra_cuda.torch.compiled import CompiledStack  # noqa: E402
from memra_cuda.torch.greedy import advance  # noqa: E402
from memra_cuda.torch.tree import ChildPlacement, tree_start  # noqa: E402

from test_torch_stack import TREE, VOCAB, mask_words, tiny  # noqa: E402

pytestmark = pytest.mark.torch

CAPACITY = 64
LAW = SamplingParams(0.7, top_k=20, top_p=0.9)


def carved(fields: dict[str, int], batch: int, **rest: object) -> tuple[SimpleNamespace, torch.Tensor]:
    """Buffers of `fields` (name: words a row) side by side in one allocation, as carve lays them
    out: their stand-ins (an address and a length each, which views.windows reads) and the
    allocation's words, [B x sum(fields)] int32, which views.tensor gives for it."""
    arena = SimpleNamespace(ptr=1 << 20, len=batch * sum(fields.values()), dtype=np.dtype(np.uint32))
    bufs, start = SimpleNamespace(arena=arena, batch=batch, **rest), 0
    for name, row in fields.items():
        setattr(bufs, name, SimpleNamespace(ptr=arena.ptr + 4 * start, len=batch * row, dtype=arena.dtype))
        start += batch * row
    return bufs, torch.zeros(arena.len, dtype=torch.int32)


def round_views(monkeypatch, geometry: Geometry, tree: TreeShape | DynamicTree | None = None):
    """RoundViews (and a tree's TreeViews) over CPU words laid out as StreamBufs (TreeBufs)
    carve them."""
    k, batch = geometry.k, geometry.batch
    bufs, words = carved({"ring_d": RING_TOKENS + geometry.m_rounds * geometry.width, "ctl_d": CTL_WORDS,
                          "pos_ctr_d": 1, "acc_d": ACC_WORDS, "vtok_d": k + 1, "brk_d": BRK_WORDS, "pend_d": 1,
                          "last_pred_d": 1, "pos_start_d": 1}, batch, k=k)
    with monkeypatch.context() as patch:
        patch.setattr(views, "tensor", lambda buf, dtype=None: words)
        patch.setattr(views, "StreamBufs", SimpleNamespace)  # the stand-ins pass as what they stand in for
        made = views.RoundViews(bufs)
    if tree is None:
        return made, None
    n, w = tree.nodes, -(-tree.nodes // 32)
    tree_bufs, tree_words = carved({"tok_d": n, "parent_d": n, "depth_d": n, "rank_d": n, "pos_d": n,
                                    "mask_d": n * w, "score_d": n, "path_d": tree.depth + 1}, batch,
                                   bufs=bufs, nodes=n, words=w, depth=tree.depth)
    with monkeypatch.context() as patch:
        patch.setattr(views, "tensor", lambda buf, dtype=None: tree_words)
        patch.setattr(views, "TreeBufs", SimpleNamespace)
        return made, views.TreeViews(tree_bufs)


def scramble(made: views.RoundViews, k: int, seed: int) -> None:
    """Other values in every word a round reads: positions, tokens, counts, done rows."""
    gen = torch.Generator().manual_seed(seed)
    made.pos_ctr.copy_(torch.randint(1, CAPACITY // 2, made.pos_ctr.shape, generator=gen))
    made.pos_start.copy_(made.pos_ctr)
    for field in (made.pend, made.vtok):
        field.copy_(torch.randint(0, VOCAB, field.shape, generator=gen))
    made.accepted.copy_(torch.randint(0, k + 1, made.accepted.shape, generator=gen))
    made.done.copy_(torch.randint(0, 2, made.done.shape, generator=gen))


def models(decoder, batch: int, attention: str | None = None) -> None:
    """The decoder's target and draft (fewer layers, other weights) compiled, their parameters
    requiring grad (as from_pretrained leaves them), each prefilled as a decoder's warm-up
    prefills (two tokens a row)."""
    decoder.target, decoder.draft = (CompiledStack(model.requires_grad_(), CAPACITY, batch, attention=attention)
                                     for model in (tiny(2), tiny(1, seed=1)))
    for stack in (decoder.target, decoder.draft):
        stack.prefill(range(batch), [[0, 0]] * batch)


def laws(decoder, sampling: SamplingParams | None, verified: int, drafted: int) -> None:
    """RoundDecoder's laws and their buffers: greedy, the verify's tokens ([B][verified]);
    sampled, p_d and q_d ([B][drafted][V]: a chain draws each draft token from its step's q, as
    memra's draw kernel does, a row's likeliest here)."""
    target, draft, batch = decoder.target, decoder.draft, decoder.batch
    decoder.target_law = None if sampling is None else target.compiled(sampling.fill)
    decoder.draft_law = None if sampling is None else draft.compiled(sampling.fill)
    if sampling is None:
        decoder.pred_d = torch.zeros(batch, verified, dtype=torch.long)
        return
    decoder.p_d, decoder.q_d = torch.zeros(batch, verified, VOCAB), torch.zeros(batch, drafted, VOCAB)
    decoder.draws = [lambda step=step: decoder.draft_d[:, step].copy_(decoder.q_d[:, step].argmax(-1))
                     for step in range(drafted)]


def chain(monkeypatch, batch: int, sampling: SamplingParams | None, k: int = 3) -> SpeculativeLlama:
    """A SpeculativeLlama of `batch` rows drafting k tokens a round, as its callables read it."""
    decoder = object.__new__(SpeculativeLlama)
    decoder.k, decoder.batch = k, batch
    decoder.views, _ = round_views(monkeypatch, Geometry(k, 4, batch))
    models(decoder, batch)
    decoder.draft_d, decoder.steps = torch.zeros(batch, k, dtype=torch.long), torch.arange(k + 1)
    decoder.start = decoder.draft.compiled(chain_start)
    laws(decoder, sampling, k + 1, k)
    return decoder


def body(decoder: SpeculativeLlama, width: int | None, seed: int) -> None:
    """A chain round's body at `width` (None: k) over other values in every buffer."""
    scramble(decoder.views, decoder.k, seed)
    decoder.draft_chain(width)
    decoder.verify_trunk(width)


@pytest.mark.parametrize("batch, sampling, widths", [(1, None, ()), (2, LAW, (0, 1))],
                         ids=["greedy", "sampled-widths"])
def test_a_chain_round_compiles_nothing_after_its_warm_up(monkeypatch, batch, sampling, widths):
    """SpeculativeLlama: its warm-up round (k); with narrower widths, each width's body as
    _measure_widths runs it (eagerly, then in the graph it times); then every width's body again
    as the burst graphs capture them (the SWITCH's bodies): nothing compiles after each shape's
    first run."""
    decoder = chain(monkeypatch, batch, sampling)
    k = decoder.k
    body(decoder, None, 0)  # the warm-up round
    for width in (*widths, k) if widths else ():  # _measure_widths, where there are bodies to choose from
        body(decoder, width, 1)
        with torch._dynamo.config.patch(error_on_recompile=True):
            body(decoder, width, 2)
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():  # `with torch.no_grad(): generate()`
        for seed, width in enumerate((None, *widths, k) * 2):
            body(decoder, width, 3 + seed)


def test_a_rounds_model_work_runs_in_the_mode_its_engine_was_made_in(monkeypatch):
    """memra_cuda.torch's scope around a burst's model work (adapter.scope, entered by the rounds
    once a burst): autograd off and torch.inference_mode() as when the engine was made. A decoder
    made outside inference mode and generating inside it (`with torch.inference_mode():
    spec.generate(...)`, how a model is commonly run) captured its first burst there, where its
    tensors' dispatch keys were not its warm-up's: every step and arithmetic compiled again
    inside the capture. One made inside inference mode and run outside it wrote its inference
    tensors in place, which torch refuses."""
    from memra_cuda.torch.adapter import framework
    decoder, scope = chain(monkeypatch, 1, None), framework(None).scope  # the engine made with the decoder
    with scope():
        body(decoder, None, 0)  # the warm-up round (rounds.step)
    with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True), scope():
        body(decoder, None, 1)  # the capture's
    with torch.inference_mode():
        decoder, scope = chain(monkeypatch, 1, None), framework(None).scope
        with scope():
            body(decoder, None, 0)
    with torch._dynamo.config.patch(error_on_recompile=True), scope():
        body(decoder, None, 1)
    assert decoder.draft_d.is_inference()


def test_a_torch_capture_holds_the_collector_off_from_its_beginning_to_its_end(monkeypatch):
    """adapter.torch_graph, the one way memra_cuda.torch makes and captures a torch graph (a test
    of the package's source keeps it so): Python's collector off before torch's capture begins
    and until it has ended, as memra's own captures hold it (torch no longer collects before a
    capture; a collection inside one destroyed a dropped decoder's graph there, invalidating the
    capture), and back on after, a capture that raised too; the graph made for it, of the kind
    destroyed relaxed. torch.cuda.graph and the graph replaced by recorders (no CUDA here): the
    order is what is tested; the GPU tests drop graphs inside real captures."""
    import contextlib
    import gc
    from memra_cuda.torch import adapter
    seen = []

    @contextlib.contextmanager
    def graph(graph, stream=None, capture_error_mode="global"):
        seen.append(("begins", gc.isenabled(), graph, stream, capture_error_mode))
        yield
        seen.append(("ends", gc.isenabled()))
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(adapter, "_RelaxedGraph", lambda keep_graph: ("a graph", keep_graph))
    assert gc.isenabled()
    with adapter.torch_graph("stream", "thread_local", keep_graph=True) as made:
        seen.append(("captures", gc.isenabled()))
    assert made == ("a graph", True)
    assert seen == [("begins", False, made, "stream", "thread_local"), ("captures", False), ("ends", False)]
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="refused"), adapter.torch_graph():
        raise RuntimeError("the capture refused")
    assert gc.isenabled() and seen[-1] == ("begins", False, ("a graph", False), None, "global")


@pytest.mark.parametrize("tree, batch, sampling", [(TREE, 2, None), (DynamicTree(2, 2, 2), 1, LAW)],
                         ids=["static-greedy", "dynamic-sampled"])
def test_a_tree_round_compiles_nothing_after_its_warm_up(monkeypatch, tree, batch, sampling):
    """TreeLlama: every draft level and the verify (TreeMask's arithmetic compiled with the
    draft's step, as the decoder makes it), its warm-up round and then rounds at other roots,
    other ancestors and other counts. SDPA: the CPU's inductor compiles no flex_attention under a
    tree's mask (the GPU's does)."""
    decoder = object.__new__(TreeLlama)
    decoder.tree, decoder.batch, nodes = tree, batch, tree.nodes
    decoder.views, decoder.tree_views = round_views(monkeypatch, Geometry.of_tree(tree, 4, batch), tree)
    models(decoder, batch, "sdpa")
    mask = TreeMask(decoder.tree_views.words, decoder.target.kv.capacity, torch.float32, tree,
                    compiled=decoder.draft.compiled)
    decoder.target_mask = decoder.draft_mask = mask
    decoder.masks = [mask]
    decoder.node_index, decoder.start = decoder.target.slots[:nodes], decoder.draft.compiled(tree_start)
    laws(decoder, sampling, nodes, nodes)
    decoder.candidates = tree.draws
    # a greedy static tree's levels place its children (ChildPlacement); the others offer candidates
    decoder.placement = ChildPlacement(tree, tree.draws, decoder.tree_views, decoder.draft.compiled) \
        if sampling is None and isinstance(tree, TreeShape) else None
    decoder.cand_tok = torch.zeros(batch, nodes, tree.draws, dtype=torch.long)
    decoder.cand_logp = torch.zeros(batch, nodes, tree.draws)

    def round_(seed: int) -> None:
        scramble(decoder.views, tree.depth, seed)
        made, gen = decoder.tree_views, torch.Generator().manual_seed(seed)
        made.tok.copy_(torch.randint(0, VOCAB, made.tok.shape, generator=gen))
        made.pos.copy_(decoder.views.pos_start + torch.arange(nodes) % (tree.depth + 1))
        made.words.copy_(mask_words(tree, batch) if isinstance(tree, TreeShape) else
                         torch.randint(0, 1 << nodes, made.words.shape, generator=gen, dtype=torch.int32))
        for level in range(tree.depth + 1):
            decoder.draft_level(level)
        decoder.verify_tree()
    round_(0)
    with torch._dynamo.config.patch(error_on_recompile=True):
        round_(1)
        with torch.no_grad():  # `with torch.no_grad(): generate()`
            round_(2)


def test_the_plain_loops_burst_compiles_nothing_after_its_warm_up():
    """GraphedGreedy: capture() runs a burst eagerly (the step and advance compiled, each step's
    row of the burst another slice) and captures the next; then bursts at other positions."""
    decoder = object.__new__(GraphedGreedy)
    decoder.batch, decoder.steps = 1, 4
    decoder.stack = CompiledStack(tiny(1).requires_grad_(), CAPACITY)
    decoder.stack.prefill([0], [[0, 0]])
    decoder.token, decoder.position = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long)
    decoder.out = torch.zeros(decoder.steps, 2, dtype=torch.long)
    decoder._first = decoder.out[0, :1]  # the burst's first token, marked before a replay
    decoder.advance = decoder.stack.compiled(advance)
    decoder._burst()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for position in (1, 9, 30):
            decoder.position.fill_(position)
            with torch.no_grad() if position == 30 else torch.enable_grad():
                decoder._burst()
    assert decoder.position.item() == 30 + decoder.steps


def test_a_decoders_widths_are_timed_in_turn_each_keeping_its_fastest(monkeypatch):
    """_measure_widths times every width's body in turn, MEASURED_PASSES times, and each width's
    cost is the fastest of its passes: a body timed once, alone, took whatever else the GPU ran
    then as its own cost (a self-draft's width 0 then won at every row, and no draft was judged)."""
    import contextlib
    from memra_cuda.torch import chain as chain_module
    decoder = object.__new__(SpeculativeLlama)
    decoder.views, _ = round_views(monkeypatch, Geometry(3, 4, 1))
    decoder.stream, decoder.target = None, SimpleNamespace(kv=SimpleNamespace(capacity=CAPACITY))
    decoder.widths = SimpleNamespace(widths=(0, 2, 3), costs=lambda relative: relative)
    given, decoder.width_ms, decoder.setup_seconds = [], {}, 0.0
    decoder.lengths = SimpleNamespace(set_costs=lambda costs, draft: given.append((costs, draft)))
    passes = iter([5.0, 4.0, 9.0, 3.0, 6.0, 8.0, 4.0, 5.0, 7.0])  # each pass's times of widths 0, 2 and 3
    timed: list[int] = []

    def replay_ms(graph, stream, replays):
        timed.append(graph)
        return next(passes)
    monkeypatch.setattr(chain_module, "captured", lambda run, stream: run.args[0])  # a width's "graph": the width
    monkeypatch.setattr(chain_module, "replay_ms", replay_ms)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    decoder._measure_widths()
    assert chain_module.MEASURED_PASSES == 3 and timed == [0, 2, 3] * 3
    assert decoder.width_ms == {0: 3.0, 2: 4.0, 3: 7.0}
    assert given == [({0: 1.0, 2: 4.0 / 3.0, 3: 7.0 / 3.0}, 0.0)]
    assert decoder.views.pos_ctr.eq(CAPACITY // 2).all() and decoder.views.pos_start.eq(CAPACITY // 2).all()


def test_a_graphs_time_leaves_out_its_first_replay(monkeypatch):
    """replay_ms replays once before its first event: a graph's first launch also uploads it to
    the device, which counted in a few replays' mean."""
    import contextlib
    from memra_cuda.torch.timing import replay_ms
    order: list[str] = []

    class Event:
        made = 0

        def __init__(self, enable_timing: bool):
            self.name, Event.made = ("start", "end")[Event.made], Event.made + 1

        def record(self) -> None:
            order.append(self.name)

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end: Event) -> float:
            return 10.0
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    assert replay_ms(SimpleNamespace(replay=lambda: order.append("replay")), None, 5) == 2.0
    assert order == ["replay", "start", *["replay"] * 5, "end"]

"""Embedded in PyTorch: a borrowed stream orders memra's kernels with torch's ops, tensors are
taken wherever buffers are, a capture through the adapter keeps torch's allocator away from
the graph's memory, and a real transformer (memra_cuda.torch.SpeculativeLlama over the small
random-weight Llama and its self-speculative draft) decodes through round-stream to exactly
Hugging Face's own greedy output.

Skipped with the reason where torch (or transformers, for the Llama) is not installed; the
core package and `make test` never import them.
"""
from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from memra_cuda import Geometry
from memra_cuda import (Cache, DeviceBuffer, Engine, Event, Graph, Greedy, KVLayer, RoundStream, StreamBufs,
                        kv_len_ptr_table)
from memra_cuda.errors import CaptureError
from memra_cuda.rounds import MODES
from gate import Gate
from run_python import run_script

torch = pytest.importorskip("torch", reason="needs PyTorch (pip install '.[torch]' in the checkout)")
memra_torch = pytest.importorskip("memra_cuda.torch")

pytestmark = [pytest.mark.gpu, pytest.mark.torch]


@pytest.fixture
def side_stream(engine):
    """A non-default torch stream, current for the test (graph capture needs one)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        yield stream


def increment(engine: Engine, n: int):
    return engine.load_ptx("probe").kernel("probe_increment").prepare(["ptr", "u32"], grid=-(-n // 128), block=128)


def slow_values(n: int) -> torch.Tensor:
    """int32 values 0..n-1, produced behind a large matmul, so work that does not wait for
    them runs first."""
    a = torch.randn(4096, 4096, device="cuda")
    big = a @ a @ a
    return (big[0, :n] * 0).to(torch.int32) + torch.arange(n, device="cuda", dtype=torch.int32)


# -- streams ----------------------------------------------------------------------------------

@pytest.mark.parametrize("default_stream", [False, True], ids=["side-stream", "default-stream"])
def test_engine_on_torchs_stream_needs_no_synchronisation(engine, default_stream):
    stream = torch.cuda.default_stream() if default_stream else torch.cuda.Stream()
    with torch.cuda.stream(stream):
        shared = memra_torch.engine()
        assert shared.borrowed and shared.stream_handle == stream.cuda_stream
        for _ in range(3):
            x = slow_values(1000)
            increment(shared, 1000)(x, 1000)  # the tensor itself as the argument
            assert x.cpu().tolist() == list(range(1, 1001))
        shared.close()
        torch.ones(1, device="cuda").cpu()  # the borrowed stream outlives the engine


def test_engine_wait_joins_a_torch_stream_and_an_event(engine, side_stream):
    x = slow_values(1000)
    engine.wait(side_stream)  # engine's own stream after everything queued on torch's
    increment(engine, 1000)(x, 1000)
    done = Event(engine)
    done.record()
    with Engine(engine.device, stream=side_stream.cuda_stream) as other:
        other.wait(done)  # torch's stream after memra's increment, through the event
        y = x * 2
        assert y.cpu().tolist() == [2 * i for i in range(1, 1001)]


def test_an_adoption_inside_torchs_capture_refuses_a_wait_across_it(engine, side_stream):
    """An array whose interface names its producer's stream (v3, as CuPy's does) adopted with an
    engine on torch's stream inside torch.cuda.graph: the engine's wait on the producer's
    stream, not of the capture, invalidated torch's capture (CUDA forbids the wait), which then
    failed to end. A CaptureError now, before anything is queued: the capture goes on and
    replays; adopted before capturing, the array is waited for as before."""
    x = torch.zeros(8, dtype=torch.int32, device="cuda")

    class Produced:
        __cuda_array_interface__ = {**x.__cuda_array_interface__, "version": 3, "stream": engine.stream_handle}

    graph = torch.cuda.CUDAGraph()
    with Engine(engine.device, stream=side_stream.cuda_stream) as borrowed:
        DeviceBuffer.from_cuda_array(Produced(), borrowed)  # before the capture: a wait, as before
        with torch.cuda.graph(graph, stream=side_stream):
            with pytest.raises(CaptureError, match=r"is being captured and Produced's __cuda_array_interface__ names "
                                                   r"stream 0x.*adopt the array before capturing"):
                DeviceBuffer.from_cuda_array(Produced(), borrowed)
            x.add_(1)
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
    assert x.tolist() == [2] * 8


# -- tensors where buffers are taken ----------------------------------------------------------

def test_tensors_are_adopted_kept_alive_and_checked(engine):
    t = torch.arange(10, dtype=torch.int64, device="cuda")
    alive = weakref.ref(t)
    buf = DeviceBuffer.from_cuda_array(t)
    del t
    gc.collect()
    assert alive() is not None and buf.dtype == np.int64 and buf.len == 10 and not buf.owns_memory
    assert engine.dtoh(buf).tolist() == list(range(10))
    buf.free()
    gc.collect()
    assert alive() is None, "freeing the adopted buffer lets go of the tensor"

    square = torch.zeros(4, 4, device="cuda")
    with pytest.raises(ValueError, match="not contiguous"):
        DeviceBuffer.from_cuda_array(square.t())
    assert DeviceBuffer.from_cuda_array(square[1]).len == 4  # a row is contiguous
    with pytest.raises(TypeError, match="__cuda_array_interface__"):
        engine.dtoh(torch.zeros(3))  # host tensors have no such interface
    host = np.zeros(4, np.uint32)

    class HostArray:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<u4", "data": (host.ctypes.data, False),
                                    "version": 2}
    with pytest.raises(ValueError, match="device memory"):
        DeviceBuffer.from_cuda_array(HostArray())


def test_tensors_in_copies_kv_layers_and_back(engine):
    shared = memra_torch.engine()  # torch's current stream: copies and torch ops in one order
    lengths = torch.zeros(3, dtype=torch.int32, device="cuda")
    layer = KVLayer(lengths[1:2], capacity=8)
    shared.copy_htod(layer.len_d, [5])
    shared.set_u32(lengths, 2, 9)
    assert lengths.cpu().tolist() == [0, 5, 9]
    assert KVLayer(lengths, capacity=8).batch == 3  # one length per sequence of a batch of 3
    with pytest.raises(ValueError, match="i32\\[B\\]"):
        KVLayer(lengths.to(torch.int64), capacity=8)
    ids = shared.htod([7, 8, 2**31 - 1], np.uint32)
    view = memra_torch.tensor(ids, torch.int32)
    assert view.tolist() == [7, 8, 2**31 - 1]
    view[0] = 1
    assert shared.dtoh(ids, np.uint32).tolist() == [1, 8, 2**31 - 1]
    with pytest.raises(ValueError, match="cannot be read as"):
        memra_torch.tensor(ids, torch.int64)



def test_a_tensor_on_a_freed_buffer_keeps_the_memory_until_it_is_gone(engine):
    """A buffer freed while a tensor on it lives (a decoder's views of its StreamBufs, say) is
    refused to memra at once, but its memory is not handed out again: the tensor reads what it
    held, however many buffers of its size are allocated meanwhile, and the memory goes back
    once the tensor and its views are gone (DeviceBuffer.hold; the CPU test sees the release)."""
    shared = memra_torch.engine()
    arena = shared.htod(list(range(64)), np.uint32)
    ids = memra_torch.tensor(arena.view(8, 8), torch.int32)[None]  # a view of a window, as RoundViews makes
    address = arena.ptr
    arena.free()
    with pytest.raises(ValueError, match="used after free"):
        arena.ptr
    others = [shared.htod([0] * 64, np.uint32) for _ in range(32)]
    assert address not in {other.ptr for other in others}, "memory a tensor holds was handed out again"
    assert ids.tolist() == [list(range(8, 16))]


@pytest.mark.parametrize("queued", ["memset", "launch"])
def test_a_tensor_dropped_with_work_queued_on_it_is_handed_to_no_new_tensor_before_that_work_ran(engine, queued):
    """A tensor passed to memra (engine.memset(tensor, v), a launch prepared on it, run and dropped)
    is adopted by a buffer collected as the call returns, which dropped its hold at once: the
    caller's `del tensor` then gave the block back to torch's allocator with memra's memset or
    kernel still queued behind a spin on the engine's stream, torch handed it to the next tensor
    of its size on its own stream, which filled it at once, and memra's work landed in that new
    tensor afterwards. The collected buffer now keeps the tensor until the engine's stream has
    run that work (release_after; the CPU test sees the bookkeeping): the new tensor gets other
    memory and keeps its values, and the old one goes at the engine's synchronize()."""
    n = 1 << 20  # 4 MiB of int32: a block of torch's large pool, handed out whole to the next of its size
    first = torch.empty(n, dtype=torch.int32, device="cuda")
    address = first.data_ptr()
    del first
    if torch.empty(n, dtype=torch.int32, device="cuda").data_ptr() != address:
        pytest.skip("torch's allocator did not hand a freed block to the next tensor of its size: the hazard this "
                    "test guards against cannot happen here")
    tensor = torch.zeros(n, dtype=torch.int32, device="cuda")
    held, address = weakref.ref(tensor), tensor.data_ptr()
    touch = engine.load_ptx("probe").kernel("probe_touch").prepare(["ptr"])
    torch.cuda.synchronize()  # the tensor's zeros written: the gate below holds only memra's work
    with Gate(engine):  # the engine's stream runs nothing queued here until the block ends (tests/gate.py)
        if queued == "memset":
            engine.memset(tensor, 12345)  # adopted for the call alone
        else:
            touch.set(tensor)()  # tensor[0] += 1, adopted for the launch alone
            touch.set(engine.zeros(np.uint32, 1))  # the launch lets go of the adopted tensor
        del tensor
        gc.collect()
        assert held() is not None, "the tensor went back to torch's allocator with memra's work on it still queued"
        fresh = torch.full((n,), 7, dtype=torch.int32, device="cuda")  # torch's stream: it does not wait for memra's
        assert fresh.data_ptr() != address, "torch handed the memory memra's queued work writes to a new tensor"
    torch.cuda.synchronize()
    assert int((fresh != 7).sum()) == 0, "memra's queued work wrote the tensor torch made after the drop"
    assert held() is None, "the engine's stream ran the work: the tensor goes back at its synchronize()"


def test_a_rounds_views_are_slices_of_its_allocation_at_their_true_offsets(engine):
    """RoundViews and TreeViews: each field an int32 slice of one tensor over its allocation, at
    the field's address and at a storage offset that is its place there, so torch.compile reads
    the field's true alignment (a field's own tensor, at offset 0, was taken as 16-byte aligned
    and cloned before every compiled call where it was not: pos_ctr at B = 1, say); what the
    engine writes into a field reads back through its view."""
    from memra_cuda import TreeShape
    from memra_cuda.buffers.tree import TreeBufs
    shared = memra_torch.engine()
    tree = TreeShape.chain_with_leaves(3, 1)
    bufs = StreamBufs(shared, Geometry.of_tree(tree, 4, 1))
    tree_bufs = TreeBufs(bufs, tree)
    views, nodes = memra_torch.RoundViews(bufs), memra_torch.TreeViews(tree_bufs)
    fields = [(views.pend, bufs.pend_d, bufs.arena), (views.pos_ctr, bufs.pos_ctr_d, bufs.arena),
              (views.pos_start, bufs.pos_start_d, bufs.arena), (views.vtok, bufs.vtok_d, bufs.arena),
              (nodes.tok, tree_bufs.tok_d, tree_bufs.arena), (nodes.pos, tree_bufs.pos_d, tree_bufs.arena)]
    for view, buf, arena in fields:
        assert view.dtype == torch.int32 and view.data_ptr() == buf.ptr, buf
        assert view.storage_offset() * 4 == buf.ptr - arena.ptr, buf
    assert any(view.data_ptr() % 16 for view, _, _ in fields), "no field is off 16 bytes: nothing tested"
    shared.copy_htod(bufs.pos_ctr_d, [123])
    assert views.pos_ctr.tolist() == [[123]]


# -- capture through torch ----------------------------------------------------------------------

def test_replays_of_an_adapter_capture_leave_later_tensors_untouched(engine, side_stream):
    shared = memra_torch.engine()
    x = torch.arange(4096, dtype=torch.int32, device="cuda")
    out = torch.zeros_like(x)
    bump = increment(shared, 4096)

    def issue():
        scratch = x * 3  # torch allocates inside the capture: the graph's own memory
        scratch = scratch + 1
        bump(scratch, 4096)
        out.copy_(scratch)

    graph = Graph(shared, issue, capture=memra_torch.capture)
    later = [torch.full((int(n),), i, dtype=torch.int32, device="cuda")
             for i, n in enumerate(np.random.default_rng(3).integers(1, 20000, 288))]
    for _ in range(5):
        graph.launch()
    assert out.cpu().tolist() == (torch.arange(4096) * 3 + 2).tolist()
    damaged = [i for i, t in enumerate(later) if not bool((t == i).all())]
    assert damaged == [], f"replays overwrote {len(damaged)} of {len(later)} tensors allocated after capture"
    graph.free()


def test_adapter_capture_refuses_the_default_stream(engine):
    with torch.cuda.stream(torch.cuda.default_stream()):
        shared = memra_torch.engine()
        with pytest.raises(RuntimeError, match="default stream cannot be captured"):
            Graph(shared, lambda: None, capture=memra_torch.capture)


# -- a real transformer -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def decoder(small):
    from memra_cuda.torch.testing import PROMPT  # transformers: only for the tests that take the Llama
    tokens = 256
    capacity = memra_torch.capacity_for(len(PROMPT), tokens, Geometry(4, 16))
    spec = memra_torch.SpeculativeLlama(small, memra_torch.self_draft(small), k=4, m_rounds=16, capacity=capacity)
    want = memra_torch.hf_greedy(small, PROMPT, tokens)
    return small, spec, want, PROMPT


def test_the_decoder_keeps_no_autograd_graph_in_its_caches(decoder):
    """Issue 18, case 5: the example's readback mode ran at 179 tok/s against 403 for a plain
    loop, its KV writes recording autograd history through weights that required grad."""
    model, spec, want, prompt = decoder
    assert not any(p.requires_grad for p in model.parameters())
    spec.generate(prompt, 16, mode="readback")
    for stack in (spec.target, spec.draft):
        assert all(kv.grad_fn is None and not kv.requires_grad for kv in stack.kv.k + stack.kv.v)


@pytest.mark.parametrize("mode", MODES)
def test_the_decoder_equals_hugging_face_greedy(decoder, mode):
    model, spec, want, prompt = decoder
    got = spec.generate(prompt, len(want), mode=mode)
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert got == want, f"{mode}: first difference at token {first}"
    assert 0.0 < spec.acceptance(len(got)) < 1.0, "the draft must agree often, but not always"


@pytest.mark.parametrize("mode", MODES)
def test_the_decoder_stops_at_eos_like_hugging_face(decoder, mode):
    model, spec, want, prompt = decoder
    eos = want[100]
    expected = memra_torch.hf_greedy(model, prompt, len(want), eos=eos)
    assert expected[-1] == eos and len(expected) <= 101
    assert spec.generate(prompt, len(want), eos=eos, mode=mode) == expected


def test_the_draft_cache_holds_every_committed_token(decoder):
    """The output is right whatever the draft's cache holds (the target verifies every draft),
    so look at the cache itself: after a generation its entries at every committed position
    equal a fresh prefill of the same tokens. The entry of a round's last draft, when all k
    were accepted, is appended by the next round's first step: had it been skipped, the stale
    entry of a rejected draft, or none, would be there."""
    model, spec, want, prompt = decoder
    got = spec.generate(prompt, 200, mode="graph")
    assert spec.acceptance(len(got)) > 0.5, "too few rounds accept every draft to tell"
    committed = min(int(spec.bufs.positions[0]), len(prompt) + len(got) - 1)
    fresh = memra_torch.Stack(spec.draft.model, spec.draft.kv.capacity)
    fresh.prefill([0], [(list(prompt) + got)[:committed]])
    for mine, theirs in ((torch.stack(spec.draft.kv.k), torch.stack(fresh.kv.k)),
                         (torch.stack(spec.draft.kv.v), torch.stack(fresh.kv.v))):
        torch.testing.assert_close(mine[..., :committed, :], theirs[..., :committed, :], atol=1e-4, rtol=1e-4)


def test_a_prompt_of_one_token(decoder):
    model, spec, _, _ = decoder
    assert spec.generate([1], 64, mode="graph") == memra_torch.hf_greedy(model, [1], 64)


def test_a_decoder_made_outside_inference_mode_generates_inside_it(small):
    """`with torch.inference_mode(): spec.generate(...)`, how a model is commonly run, on a decoder
    made outside it: its first burst is captured there, where its tensors' dispatch keys are not
    its warm-up's, so every step compiled again inside the capture (a failed capture). Its rounds
    run as its engine was made (memra_cuda.torch.adapter.scope): Hugging Face's tokens."""
    from memra_cuda.torch.testing import PROMPT
    capacity = memra_torch.capacity_for(len(PROMPT), 256, Geometry(4, 16))  # the module's decoder's: its compilations
    spec = memra_torch.SpeculativeLlama(small, memra_torch.self_draft(small), k=4, m_rounds=16, capacity=capacity)
    with torch.inference_mode():
        got = spec.generate(PROMPT, 64, mode="graph")
    assert got == memra_torch.hf_greedy(small, PROMPT, 64)


# -- safe by default: what a user forgets must not give wrong tokens or overwrite tensors ------

VOCAB = 1000


def counted(pending: int, n: int) -> list[int]:
    return [(pending + i) % VOCAB for i in range(1, n + 1)]


class Counting:
    """A torch model whose next token is the last + 1 (mod VOCAB), draft and target alike, so
    the tokens after pending t are t+1, t+2, ... Each step allocates temporaries and puts a
    matmul before its write: work ordered on the wrong stream reads stale tokens, and memory
    torch hands out during a capture is in use at every replay. Nothing here wraps the
    callables in a stream or passes a capture: the adapter's defaults must do it."""

    def __init__(self, engine: Engine, k: int = 3, m_rounds: int = 4):
        self.engine, self.k = engine, k
        self.bufs = StreamBufs(engine, Geometry(k, m_rounds))
        self.pend = memra_torch.tensor(self.bufs.pend_d, torch.int32)
        self.vtok = memra_torch.tensor(self.bufs.vtok_d, torch.int32)
        self.draft_d = torch.zeros(max(k, 1), dtype=torch.int64, device="cuda")
        self.pred_d = torch.zeros(k + 1, dtype=torch.int64, device="cuda")
        table = kv_len_ptr_table(engine, Cache([]), pos_ctr=self.bufs.pos_ctr_d)
        self.rounds = RoundStream(self.bufs, draft_chain=self.draft_chain, verify_trunk=self.verify_trunk,
                                  draft_d=self.draft_d, acceptance=Greedy(self.pred_d), rollback_tables=[table])
        torch.cuda.synchronize()  # the tensors made on torch's current stream are ready for the engine's

    @staticmethod
    def slow_zero() -> torch.Tensor:
        a = torch.ones(2048, 2048, device="cuda")
        return (a @ a)[0, :1].long() * 0

    def draft_chain(self) -> None:
        token = self.pend[:1].long()
        for i in range(self.k):
            token = (token + 1 + self.slow_zero()) % VOCAB
            self.draft_d[i:i + 1].copy_(token)

    def verify_trunk(self) -> None:
        self.pred_d.copy_((self.vtok.long() + 1 + self.slow_zero()) % VOCAB)

    def generate(self, pending: int, n: int, mode: str) -> list[int]:
        self.bufs.reset(pending, 0)
        return self.rounds.generate(n, mode=mode).tolist()


@pytest.mark.parametrize("mode", ["readback", "eager"])
def test_callables_run_on_the_engines_stream_without_being_wrapped(engine, mode):
    """The engine borrows one stream while torch's current stream is another (neither the
    legacy default stream, which would order them implicitly): the callables' torch ops must
    still be ordered with memra's kernels (eager modes: wrong tokens otherwise)."""
    with torch.cuda.stream(torch.cuda.Stream()):
        shared = memra_torch.engine(torch.cuda.Stream())
        assert torch.cuda.current_stream().cuda_stream != shared.stream_handle
        model = Counting(shared)
        assert model.generate(7, 40, mode) == counted(7, 40)


@pytest.mark.parametrize("mode", ["graph", "device"])
def test_torch_backed_graphs_keep_torchs_allocator_away_without_being_told(engine, side_stream, mode):
    """No capture= given: the burst graph (device mode's loop) must still be captured with
    torch's allocator told, so tensors allocated after it never share memory with the
    temporaries the graph writes at every replay."""
    model = Counting(memra_torch.engine())
    assert model.generate(3, 24, "readback") == counted(3, 24)  # torch's cache now holds such blocks
    assert model.generate(3, 24, mode) == counted(3, 24)  # the capture
    later = [torch.full((2048, 2048), float(i), device="cuda") for i in range(8)]
    later_ids = [torch.full((1,), i, dtype=torch.int64, device="cuda") for i in range(64)]
    for _ in range(3):
        assert model.generate(3, 24, mode) == counted(3, 24)
    torch.cuda.synchronize()
    assert all(bool((t == i).all()) for i, t in enumerate(later)), "a replay wrote into a later tensor"
    assert [int(t) for t in later_ids] == list(range(64)), "a replay wrote into a later tensor"


def test_a_captured_burst_draws_new_random_numbers_at_every_launch(engine, side_stream):
    shared = memra_torch.engine()
    out = torch.zeros(4, device="cuda")
    graph = Graph(shared, lambda: out.copy_(torch.rand(4, device="cuda")), capture=memra_torch.capture)
    draws = []
    for _ in range(3):
        graph.launch()
        shared.synchronize()
        draws.append(tuple(out.tolist()))
    assert len(set(draws)) == 3, f"the replays drew the same numbers: {draws}"


class Noisy(Counting):
    """Counting, with torch's random numbers drawn in the draft chain."""

    def draft_chain(self) -> None:
        super().draft_chain()
        self.noise = torch.rand(4, device="cuda")


def test_device_mode_refuses_torchs_random_numbers(engine, side_stream):
    """A WHILE loop replays its body with the offsets of the capture: torch.rand would draw the
    same numbers at every pass, so capturing it is refused, and the other modes still run."""
    model = Noisy(memra_torch.engine())
    for _ in range(2):  # a refused capture leaves no half-built loop behind
        with pytest.raises(CaptureError, match="random numbers"):
            model.generate(3, 24, "device")
    assert model.generate(3, 24, "graph") == counted(3, 24)


# A device-mode loop (loop_capture) whose last reference goes while torch captures a graph of its
# own on another stream, in each of CUDA's capture modes: torch.cuda.MemPool's destructor aborted the
# process there (torch 2.11, "captures_underway.empty() INTERNAL ASSERT FAILED"), which a test process
# cannot survive to report, and a capture of the default mode ("global") may refuse a graph's destroy
DROPPED_DURING_A_CAPTURE = """
import gc, sys, weakref, torch
import memra_cuda.torch as memra_torch
from memra_cuda import Graph
with torch.cuda.stream(torch.cuda.Stream()):
    engine = memra_torch.engine()
    x = torch.zeros(1 << 20, device="cuda")
    loop = Graph(engine, lambda: None, capture=memra_torch.loop_capture(lambda b: b.issue(lambda: x.copy_(x + 1))))
    loop.launch()
    engine.synchronize()
    gone = []
    weakref.finalize(loop._owner, gone.append, "gone")  # the loop's graph and pool go with it
    theirs, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.graph(theirs, stream=side, capture_error_mode=sys.argv[1]):
        y = x * 2
        del loop
        gc.collect()
        inside = list(gone)
    theirs.replay()
    torch.cuda.synchronize()
    print("survived", int(x[0]), int(y[0]), *inside)
"""


@pytest.mark.parametrize("capture_mode", ["global", "thread_local", "relaxed"])
def test_a_loop_dropped_while_torch_captures_leaves_the_process_and_the_capture_running(engine, capture_mode):
    done = run_script(DROPPED_DURING_A_CAPTURE, capture_mode, timeout=300)
    assert done.returncode == 0 and "survived 1 2 gone" in done.stdout, (done.stdout, done.stderr[-3000:])


def test_every_burst_length_is_captured_up_front(engine, side_stream):
    model = Counting(memra_torch.engine(), k=3, m_rounds=8)  # paced: bursts of 1, 2, 4 or 8 rounds
    model.rounds.capture_graphs()
    lengths = ((0, 1), (0, 2), (0, 4), (0, 8))
    assert model.rounds.graphs == lengths
    assert model.generate(5, 37, "graph") == counted(5, 37)
    assert model.rounds.graphs == lengths, "a length was captured mid-generation"


def spin(engine, busy) -> None:
    """~0.1 s of work on the engine's stream, then busy[0] += 1."""
    engine.load_ptx("probe").kernel("probe_spin").prepare(["ptr", "u64"]).set(busy, 200_000_000)()


def test_a_buffers_tensor_is_read_after_what_its_engine_queued(engine):
    """A kernel spins on the engine's own stream and then counts; torch reads its count at once on
    its current stream, and must see the count, not the memory before it; an upload queued behind
    it likewise."""
    busy = engine.zeros(np.uint32, 1)
    spin(engine, busy)
    assert memra_torch.tensor(busy).cpu().tolist() == [1]
    spin(engine, busy)
    ids = engine.htod([7, 2**32 - 1], np.uint32)
    assert memra_torch.tensor(ids, torch.int32).cpu().tolist() == [7, -1]


def test_a_buffers_tensor_waits_on_the_legacy_stream_and_on_no_closed_engine(engine):
    """An engine on the legacy stream (the interface's 1, which torch would take for an id of its
    own), read from a side stream of torch's; a buffer outliving its engine names no stream."""
    with Engine(engine.device, stream=0) as legacy:
        busy = legacy.zeros(np.uint32, 1)
        spin(legacy, busy)
        with torch.cuda.stream(torch.cuda.Stream()):
            assert memra_torch.tensor(busy).cpu().tolist() == [1]
        ids = legacy.htod([5], np.uint32)
    assert "stream" not in ids.__cuda_array_interface__
    with torch.cuda.stream(torch.cuda.Stream()):
        assert memra_torch.tensor(ids).cpu().tolist() == [5]


def test_a_buffers_tensor_that_would_wait_is_refused_inside_a_capture(engine):
    ids = engine.htod([7], np.uint32)
    engine.synchronize()
    with pytest.raises(CaptureError, match=r"tensor\(.*before capturing"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            memra_torch.tensor(ids)


def test_tensor_of_a_buffer_as_any_type_of_its_size(engine):
    ids = engine.htod([7, 2**32 - 1], np.uint32)
    assert memra_torch.tensor(ids).dtype == torch.uint32
    same = memra_torch.tensor(ids, torch.uint32)
    assert same.dtype == torch.uint32 and same.data_ptr() == ids.ptr
    assert memra_torch.tensor(ids, torch.int32).cpu().tolist() == [7, -1]


def test_an_upload_queues_behind_the_streams_work_without_waiting_for_it(engine, side_stream):
    """memra_cuda.torch.uploads.uploaded: the host goes on while the stream is busy (a request's
    start went through torch.tensor(..., device=), which waits for every kernel queued before
    its copy), and the values land in stream order, behind that work; a CPU device gets the
    values as they are."""
    from memra_cuda.torch.uploads import uploaded
    first, second = (torch.zeros(3, dtype=torch.int32, device="cuda") for _ in range(2))
    uploaded([0], torch.int32, "cuda")  # torch's pinned allocator takes its first block (cudaHostAlloc waits)
    side_stream.synchronize()
    torch.cuda._sleep(500_000_000)  # a kernel that spins a quarter of a second or more
    first.copy_(uploaded([5, 6, 7], torch.int32, "cuda"))
    second.copy_(uploaded([8, 9, 10], torch.int32, "cuda"))  # a pinned block of its own: the first's copy is queued
    assert not side_stream.query(), "an upload waited for the kernel queued before it"
    side_stream.synchronize()
    assert first.tolist() == [5, 6, 7] and second.tolist() == [8, 9, 10]
    on_cpu = uploaded([[1], [2]], torch.long, "cpu")
    assert on_cpu.device.type == "cpu" and on_cpu.dtype == torch.long and on_cpu.tolist() == [[1], [2]]

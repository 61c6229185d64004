"""The typed launchers of stochastic acceptance (contract 6, ptx/spec_sample.cu; the rule itself,
as RoundStream takes it, is acceptance.Sampling) and of the draft's position-keyed draw (contract 7).

Like SpecKernels' launchers, it checks everything the host knows (dtypes, exact sizes, the engine
the buffers belong to, the vocabulary) before anything is queued, so a wrong buffer is a clear
exception here rather than a kernel reading past the rows it was meant to read.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from ..driver.buffer import BufferLike, DeviceBuffer
from ..driver.module import Launch
from ..driver.values import as_index, as_size, short_name
from .signatures import load

if TYPE_CHECKING:
    from ..buffers.stream_bufs import StreamBufs
    from ..driver.engine import Engine


# spec_sample.cu's THREADS and PER_THREAD: a block races THREADS * PER_THREAD entries of V per pass.
THREADS = 256
PER_THREAD = 2


def prepare_accept_sample(engine: Engine, bufs: StreamBufs, p_d: BufferLike, q_d: BufferLike, seed_d: BufferLike,
                          vocab: int | None = None) -> Launch:
    """A prepared launch of spec_accept_sample over bufs' B rows, to keep and call every round.

    p_d: float32 [B][k+1][V], the target's probabilities at the k+1 verify positions; q_d: float32
    [B][max(k,1)][V], the draft's at its k positions; seed_d: [B] 64-bit seeds (uint64, or int64
    for frameworks without unsigned types: the kernel reads the bits). Sizes must be exact. Give
    V (`vocab`) where you can: derived from p_d (the four-argument call of docs/kernels.md, "Launchers"), a p_d of the
    wrong length passes whenever q_d happens to fit the same wrong V.

    Allocates the kernel's scratch (zeroed; every launch leaves it zeroed again), so call it
    before capturing a graph: the launch itself is capturable and replays unchanged.
    """
    k, rows = bufs.k, bufs.batch  # rows <= 65535, gridDim.y's cap: StreamBufs holds no more
    if vocab is None:
        vocab = engine.buffer(p_d, "p_d").len // (rows * (k + 1))
    vocab = as_size(vocab, "vocab", 1, 2**31 - 1)
    p_d = _exact(engine.buffer(p_d, "p_d"), "p_d", ("f32",), (rows, k + 1, vocab))
    q_d = _exact(engine.buffer(q_d, "q_d"), "q_d", ("f32",), (rows, max(k, 1), vocab))
    seed_d = _exact(engine.buffer(seed_d, "seed_d"), "seed_d", ("u64", "i64"), (rows,))
    vtok_d, brk_d, acc_d, last_pred_d, ctl_d, pos_start_d = (
        engine.buffer(getattr(bufs, name), name)
        for name in ("vtok_d", "brk_d", "acc_d", "last_pred_d", "ctl_d", "pos_start_d"))
    module = load(engine, "spec_sample")  # once per engine: Engine.load_ptx keeps it
    scratch = engine.alloc(np.uint64, 2 * rows, zeroed=True, label="spec_accept_sample scratch")
    # A block per THREADS·PER_THREAD entries, but not more blocks than fill the GPU a few times
    # over: a large batch would only queue them and pile atomics on each row's scratch. The
    # kernel's grid-stride loop covers V with any count.
    blocks_per_row = max(1, min(-(-vocab // (THREADS * PER_THREAD)), 16 * engine.multiprocessors // rows))
    return module.kernel("spec_accept_sample").prepare(grid=(blocks_per_row, rows), block=THREADS).set(
        vtok_d=vtok_d, p_d=p_d, q_d=q_d, V=vocab, k=k, B=rows, brk_d=brk_d, acc_d=acc_d, last_pred_d=last_pred_d,
        ctl_d=ctl_d, pos_start_d=pos_start_d, seed_d=seed_d, scratch=scratch)


def prepare_draft_sample(engine: Engine, bufs: StreamBufs, q_d: BufferLike, seed_d: BufferLike,
                         draft_d: BufferLike, step: int, vocab: int) -> Launch:
    """A prepared launch of spec_draft_sample: draft token `step` (0 <= step < k) of every row
    raced from the draft's probabilities q_d[b][step] (float32 [B][max(k,1)][V]) with purpose 2 at
    the position it will sit at, pos_ctr + step + 1, into draft_d[b][step] (32- or 64-bit ids,
    [B][max(k,1)]), with each row's seed_d. A draft chain calls one per draft step, after the step
    that writes q_d's row and before the step that reads the token. Allocates its scratch, so
    prepare it before capturing."""
    k, rows = bufs.k, bufs.batch
    step, vocab = as_index(step, "step"), as_size(vocab, "vocab", 1, 2**31 - 1)
    if not 0 <= step < k:
        raise ValueError(f"step must be a draft step in [0, k={k}), not {step}")
    q_d = _exact(engine.buffer(q_d, "q_d"), "q_d", ("f32",), (rows, k, vocab))
    seed_d = _exact(engine.buffer(seed_d, "seed_d"), "seed_d", ("u64", "i64"), (rows,))
    draft_d = _exact(engine.buffer(draft_d, "draft_d"), "draft_d", ("u32", "i32", "u64", "i64"), (rows, k))
    module = load(engine, "spec_sample")
    scratch = engine.alloc(np.uint64, 2 * rows, zeroed=True, label="spec_draft_sample scratch")
    blocks_per_row = max(1, min(-(-vocab // THREADS), 16 * engine.multiprocessors // rows))
    name = "spec_draft_sample" if draft_d.dtype.itemsize == 4 else "spec_draft_sample_t64"
    return module.kernel(name).prepare(grid=(blocks_per_row, rows), block=THREADS).set(
        step=step, k=k, V=vocab, B=rows, q_d=q_d, pos_ctr_d=bufs.pos_ctr_d, seed_d=seed_d, draft_d=draft_d,
        scratch=scratch)


def _exact(buf: DeviceBuffer, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...]) -> DeviceBuffer:
    """`buf` if its element type is one of `dtypes` (u64, f32, ...) and it holds exactly `shape`."""
    length = math.prod(shape)
    if short_name(buf.dtype) not in dtypes or buf.len != length:
        want = " or ".join(f"{dtype}{''.join(f'[{n}]' for n in shape)}" for dtype in dtypes)
        raise ValueError(f"{name} must be {want} ({length} elements), not {buf!r}")
    return buf


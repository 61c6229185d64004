"""The typed launcher of stochastic acceptance (contract 6, ptx/spec_sample.cu; the rule itself,
as RoundStream takes it, is acceptance.Sampling).

Like SpecKernels' launchers, it checks everything the host knows (dtypes, exact sizes, the engine
the buffers belong to, the vocabulary) before anything is queued, so a wrong buffer is a clear
exception here rather than a kernel reading past the rows it was meant to read.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .driver.buffer import DeviceBuffer
from .driver.values import as_index, short_name
from .driver.module import Launch

if TYPE_CHECKING:
    from .bufs import StreamBufs
    from .driver.engine import Engine


# spec_sample.cu's THREADS and PER_THREAD: a block races THREADS * PER_THREAD entries of V per pass.
THREADS = 256
PER_THREAD = 2
_TYPES = ["ptr", "ptr", "ptr", "u32", "u32", "u32"] + ["ptr"] * 7


def prepare_accept_sample(engine: Engine, bufs: StreamBufs, p_d: Any, q_d: Any, seed_d: Any,
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
    vocab = as_index(vocab, "vocab")
    if not 0 < vocab < 2**31:
        raise ValueError(f"vocab (V) must be in [1, 2**31), not {vocab}")
    p_d = _exact(engine.buffer(p_d, "p_d"), "p_d", ("f32",), (rows, k + 1, vocab))
    q_d = _exact(engine.buffer(q_d, "q_d"), "q_d", ("f32",), (rows, max(k, 1), vocab))
    seed_d = _exact(engine.buffer(seed_d, "seed_d"), "seed_d", ("u64", "i64"), (rows,))
    vtok_d, brk_d, acc_d, last_pred_d, ctl_d, pos_start_d = (
        engine.buffer(getattr(bufs, name), name)
        for name in ("vtok_d", "brk_d", "acc_d", "last_pred_d", "ctl_d", "pos_start_d"))
    module = engine.load_ptx("spec_sample")  # once per engine: Engine.load_ptx keeps it
    scratch = engine.alloc(np.uint64, 2 * rows, zeroed=True, label="spec_accept_sample scratch")
    # A block per THREADS·PER_THREAD entries, but not more blocks than fill the GPU a few times
    # over: a large batch would only queue them and pile atomics on each row's scratch. The
    # kernel's grid-stride loop covers V with any count.
    blocks_per_row = max(1, min(-(-vocab // (THREADS * PER_THREAD)), 16 * engine.multiprocessors // rows))
    return module.kernel("spec_accept_sample").prepare(_TYPES, (blocks_per_row, rows), THREADS).set(
        vtok_d, p_d, q_d, vocab, k, rows, brk_d, acc_d, last_pred_d, ctl_d, pos_start_d, seed_d, scratch)


def _exact(buf: DeviceBuffer, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...]) -> DeviceBuffer:
    """`buf` if its element type is one of `dtypes` (u64, f32, ...) and it holds exactly `shape`."""
    length = math.prod(shape)
    if short_name(buf.dtype) not in dtypes or buf.len != length:
        want = " or ".join(f"{dtype}{''.join(f'[{n}]' for n in shape)}" for dtype in dtypes)
        raise ValueError(f"{name} must be {want} ({length} elements), not {buf!r}")
    return buf

"""The device buffers of a burst, the pointer tables rollback walks, and the one readback.

Every value that changes from round to round lives in these buffers, so the host can issue M
rounds without looking, and a graph captured over them replays unchanged.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from .buffer import DeviceBuffer
from .cache import Cache
from .reference import DONE

if TYPE_CHECKING:
    from .engine import Engine
    from .event import Event


class StreamBufs:
    """All device state of one sequence's round stream (DESIGN.md's table), plus a pinned
    mirror of the ring and ctl_d for readbacks issued inside a captured graph."""

    def __init__(self, engine: Engine, k: int, m_rounds: int):
        if k < 0 or m_rounds < 1:
            raise ValueError(f"need k >= 0 draft tokens and m_rounds >= 1, not k={k}, m_rounds={m_rounds}")
        self.k = int(k)
        self.m_rounds = int(m_rounds)
        self.ring_cap = self.m_rounds * (self.k + 1)
        self.vtok_d = engine.alloc_u32_zeroed(k + 1)
        self.brk_d = engine.alloc_u32_zeroed(2)
        self.pend_d = engine.alloc_u32_zeroed(1)
        self.last_pred_d = engine.alloc_u32_zeroed(1)
        self.pos_ctr = engine.alloc_i32_zeroed(1)
        self.pos_start_d = engine.alloc_i32_zeroed(1)
        self.ring_d = engine.alloc_u32_zeroed(self.ring_cap + 1)
        self.acc_d = engine.alloc_u32_zeroed(2)
        self.ctl_d = engine.htod_i32([-1, -1, 0, 0])
        # Two slots, so one burst's readback can be read while the next burst writes the other.
        self._host = [engine.pinned(np.uint32, self.ring_d.len + self.ctl_d.len) for _ in range(2)]

    def set_stop(self, engine: Engine, eos: int | None = None, budget: int | None = None) -> None:
        """The stop rule of the next generation (None: no EOS / no budget); clears `done`."""
        if eos is not None and not 0 <= eos < 2**31:
            raise ValueError(f"eos must be a token id in [0, 2**31), not {eos}")
        if budget is not None and not 0 <= budget < 2**31:
            raise ValueError(f"budget must be a token count in [0, 2**31), not {budget}")
        engine.copy_htod(self.ctl_d, [-1 if eos is None else eos, -1 if budget is None else budget, 0, 0])

    def drain_ring(self, engine: Engine) -> np.ndarray:
        """The committed tokens in order: one readback. The caller zeroes ring_d[0] after."""
        return _ring_tokens(engine.dtoh(self.ring_d), self.ring_cap)

    def queue_readback(self, engine: Engine, slot: int = 0) -> None:
        """Queue ring and ctl copies into pinned slot 0 or 1, then reset the ring (capturable)."""
        engine.copy_dtoh_async(self._host[slot], self.ring_d)
        engine.copy_dtoh_async(self._host[slot], self.ctl_d, start=self.ring_d.len)
        engine.set_u32(self.ring_d, 0, 0)

    def collect(self, engine: Engine, slot: int = 0, event: Event | None = None) -> tuple[np.ndarray, bool]:
        """Wait for queue_readback's copies into `slot` (one readback; only up to `event`, if
        given): (tokens, done)."""
        engine.finish_readback(event)
        host = self._host[slot].read()
        ctl = host[self.ring_d.len:].view(np.int32)
        return _ring_tokens(host[:self.ring_d.len], self.ring_cap), bool(ctl[DONE])

    def drafts_accepted(self, engine: Engine, committed: int) -> tuple[int, int]:
        """(accepted, drafted) since prefill, for `committed` tokens generated (one readback).

        Every round commits its accepted drafts plus one token, so the rounds that ran before
        the stop number committed - accepted, and each drafted k tokens.
        """
        accepted = int(engine.dtoh(self.acc_d)[1])
        return accepted, self.k * (committed - accepted)

    def buffers(self) -> dict[str, DeviceBuffer]:
        return {name: buf for name, buf in vars(self).items() if isinstance(buf, DeviceBuffer)}

    def free(self) -> None:
        for buf in [*self.buffers().values(), *self._host]:
            buf.free()


def _ring_tokens(ring: np.ndarray, ring_cap: int) -> np.ndarray:
    return ring[1:1 + min(int(ring[0]), ring_cap)].astype(np.uint32)


def drain_ring(bufs: StreamBufs, engine: Engine) -> np.ndarray:
    return bufs.drain_ring(engine)


def len_pointer_words(layers: Sequence, pos_ctr: DeviceBuffer | None = None) -> np.ndarray:
    """The table's contents: each layer's len_d pointer, 0 for a layer without KV, pos_ctr last."""
    words = [0 if layer is None else layer.len_d.ptr for layer in layers]
    if pos_ctr is not None:
        if pos_ctr.dtype != np.int32:
            raise ValueError(f"pos_ctr must be an i32 buffer, not {pos_ctr!r}")
        words.append(pos_ctr.ptr)
    if not words:
        raise ValueError("a pointer table needs at least one layer or pos_ctr")
    return np.array(words, np.uint64)


def kv_len_ptr_table(engine: Engine, cache: Cache, pos_ctr: DeviceBuffer | None = None) -> DeviceBuffer:
    """u64 device table of every layer's length pointer (and pos_ctr's, last), for rollback."""
    return engine.htod(len_pointer_words(cache.kv, pos_ctr))


def kv_len_ptr_table_range(engine: Engine, cache: Cache, layers: range | tuple[int, int],
                           pos_ctr: DeviceBuffer | None = None) -> DeviceBuffer:
    """The table for the layers [start, stop) one pipeline stage owns, so a rollback launched
    on that stage's device never touches another device's memory."""
    start, stop = (layers.start, layers.stop) if isinstance(layers, range) else layers
    if isinstance(layers, range) and layers.step != 1:
        raise ValueError(f"layer range must be contiguous, not {layers}")
    if not 0 <= start <= stop <= len(cache.kv):
        raise ValueError(f"layers [{start}, {stop}) are outside a cache of {len(cache.kv)} layers")
    return engine.htod(len_pointer_words(cache.kv[start:stop], pos_ctr))

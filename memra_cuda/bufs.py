"""The device buffers of a burst, and the one readback.

Every value that changes from round to round lives in these buffers, so the host can issue M
rounds without looking, and a graph captured over them replays unchanged.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .driver.buffer import DeviceBuffer, as_index
from .reference import DONE

if TYPE_CHECKING:
    from .driver.engine import Engine
    from .driver.event import Event


class StreamBufs:
    """All device state of one sequence's round stream (DESIGN.md's table), plus a pinned
    mirror of the ring and ctl_d for readbacks issued inside a captured graph.

    Every device buffer field ends in `_d`; `pos_ctr` is DESIGN.md's name for `pos_ctr_d`.
    free() frees them all, and every graph captured over them then refuses to replay.
    """

    def __init__(self, engine: Engine, k: int, m_rounds: int):
        k, m_rounds = as_index(k, "k"), as_index(m_rounds, "m_rounds")
        if k < 0 or m_rounds < 1:
            raise ValueError(f"need k >= 0 draft tokens and m_rounds >= 1, not k={k}, m_rounds={m_rounds}")
        self.k = k
        self.m_rounds = m_rounds
        self.ring_cap = m_rounds * (k + 1)
        self.vtok_d = engine.alloc_u32_zeroed(k + 1, label="vtok_d")
        self.brk_d = engine.alloc_u32_zeroed(2, label="brk_d")
        self.pend_d = engine.alloc_u32_zeroed(1, label="pend_d")
        self.last_pred_d = engine.alloc_u32_zeroed(1, label="last_pred_d")
        self.pos_ctr_d = engine.alloc_i32_zeroed(1, label="pos_ctr_d")
        self.pos_start_d = engine.alloc_i32_zeroed(1, label="pos_start_d")
        self.ring_d = engine.alloc_u32_zeroed(self.ring_cap + 1, label="ring_d")
        self.acc_d = engine.alloc_u32_zeroed(2, label="acc_d")
        self.ctl_d = engine.htod([-1, -1, 0, 0], np.int32, label="ctl_d")
        # Two slots, so one burst's readback can be read while the next burst writes the other.
        self._host = [engine.pinned(np.uint32, self.ring_d.len + self.ctl_d.len, label=f"readback slot {i}")
                      for i in range(2)]

    @property
    def pos_ctr(self) -> DeviceBuffer:
        return self.pos_ctr_d

    def reset(self, engine: Engine, pending: int, position: int) -> None:
        """Start a new request on these buffers: `pending` is the last prompt token (its KV not
        yet computed), `position` the KV entries already committed (the prompt but its last
        token). Ring, counters, done and keep are cleared and the stop rule is lifted (set_stop
        sets the next one); captured graphs stay valid. The model's KV lengths are the model's
        to set (to `position`)."""
        if not 0 <= as_index(pending, "pending") < 2**31:
            raise ValueError(f"pending must be a token id in [0, 2**31), not {pending}")
        if not 0 <= as_index(position, "position") < 2**31:
            raise ValueError(f"position must be in [0, 2**31), not {position}")
        engine.copy_htod(self.pend_d, [pending])
        engine.copy_htod(self.pos_ctr_d, [position])
        engine.copy_htod(self.ctl_d, [-1, -1, 0, 0])
        for buf in (self.ring_d, self.brk_d, self.acc_d):
            engine.memset(buf, 0)

    def set_stop(self, engine: Engine, eos: int | None = None, budget: int | None = None) -> None:
        """The stop rule of the next generation (None: no EOS / no budget); clears `done`."""
        if eos is not None and not 0 <= as_index(eos, "eos") < 2**31:
            raise ValueError(f"eos must be a token id in [0, 2**31), not {eos}")
        if budget is not None and not 0 <= as_index(budget, "budget") < 2**31:
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
        """(accepted, drafted) since the request began, for `committed` tokens generated (one
        readback).

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

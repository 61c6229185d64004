"""KV caches as the round-stream kernels see them: a length on the device per layer."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from .buffer import DeviceBuffer

if TYPE_CHECKING:
    from .engine import Engine


class KVLayer:
    """One layer's KV storage: `data_d` of `capacity` entries and its length `len_d` (i32[1]).

    Only `len_d` matters to round-stream (rollback rewrites it); `data_d` belongs to the model.
    """

    def __init__(self, len_d: DeviceBuffer, capacity: int, data_d: DeviceBuffer | None = None):
        if len_d.dtype != np.int32 or len_d.len != 1:
            raise ValueError(f"a KV length must be an i32[1] device buffer, not {len_d!r}")
        self.len_d = len_d
        self.capacity = int(capacity)
        self.data_d = data_d

    @classmethod
    def allocate(cls, engine: Engine, capacity: int, width: int = 1, dtype: Any = np.uint32) -> KVLayer:
        """A zero-length layer of `capacity` entries of `width` elements each."""
        if capacity < 1 or width < 1:
            raise ValueError(f"a KV layer needs a positive capacity and width, not {capacity}, {width}")
        return cls(engine.alloc_i32_zeroed(1), capacity, engine.alloc(dtype, capacity * width, zeroed=True))


class Cache:
    """A model's KV layers in order; None stands for a layer without KV (linear attention,
    KV shared with another layer)."""

    def __init__(self, kv: Sequence[KVLayer | None]):
        self.kv = list(kv)

    @classmethod
    def allocate(cls, engine: Engine, kv_mask: Sequence[bool], capacity: int, width: int = 1) -> Cache:
        return cls([KVLayer.allocate(engine, capacity, width) if has_kv else None for has_kv in kv_mask])

    def __len__(self) -> int:
        return len(self.kv)

    def __add__(self, other: Cache) -> Cache:
        """Both caches' layers in one: one pointer table can then roll back target and draft."""
        return Cache(self.kv + other.kv)

    @property
    def capacity(self) -> int | None:
        """Entries every layer can hold (None for a cache without KV)."""
        caps = [layer.capacity for layer in self.kv if layer is not None]
        return min(caps) if caps else None

    def lengths(self, engine: Engine) -> list[int | None]:
        """Each layer's length, read back (one readback per layer: for tests and debugging)."""
        return [None if layer is None else int(engine.dtoh(layer.len_d)[0]) for layer in self.kv]

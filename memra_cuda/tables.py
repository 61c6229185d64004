"""KV caches as the round-stream kernels see them, and the pointer tables that name them.

Rollback walks a table of device addresses that lives in device memory, so no launch-time
check can see what it points at. The table carries that check itself (PointerTable): it holds
the buffers it names, knows the capacity of the KV layers behind them, and refuses to be used
once one of them is freed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from .driver.buffer import DeviceBuffer, as_buffer, device_allocation
from .driver.values import as_index

if TYPE_CHECKING:
    from .driver.engine import Engine


class KVLayer:
    """One layer's KV storage: `data_d` of `capacity` entries per sequence and its lengths
    `len_d`, i32[B]: one per sequence of the batch (B = 1 for one sequence).

    Only `len_d` matters to round-stream (rollback rewrites it); `data_d` belongs to the model.
    Either may be a DeviceBuffer or a __cuda_array_interface__ object (a torch tensor).
    """

    def __init__(self, len_d: Any, capacity: int, data_d: Any = None):
        len_d = as_buffer(len_d, "len_d")
        if len_d.dtype != np.int32:
            raise ValueError(f"KV lengths must be an i32[B] device buffer (one per sequence), not {len_d!r}")
        self.len_d = len_d
        self.capacity = as_index(capacity, "capacity")
        if self.capacity < 1:
            raise ValueError(f"a KV layer needs a positive capacity, not {capacity}")
        self.data_d = None if data_d is None else as_buffer(data_d, "data_d")

    @property
    def batch(self) -> int:
        return self.len_d.len

    @classmethod
    def allocate(cls, engine: Engine, capacity: int, width: int = 1, dtype: Any = np.uint32,
                 batch: int = 1) -> KVLayer:
        """A zero-length layer of `capacity` entries of `width` elements for each of `batch`
        sequences: data_d is [batch][capacity][width]."""
        if capacity < 1 or width < 1 or batch < 1:
            raise ValueError(f"a KV layer needs a positive capacity, width and batch, not {capacity}, {width}, "
                             f"{batch}")
        return cls(engine.zeros(np.int32, batch, label="len_d"), capacity,
                   engine.alloc(dtype, batch * capacity * width, zeroed=True, label="data_d"))


class Cache:
    """A model's KV layers in order; None stands for a layer without KV (linear attention,
    KV shared with another layer)."""

    def __init__(self, kv: Sequence[KVLayer | None]):
        self.kv = list(kv)

    @classmethod
    def allocate(cls, engine: Engine, kv_mask: Sequence[bool], capacity: int, width: int = 1,
                 batch: int = 1) -> Cache:
        return cls([KVLayer.allocate(engine, capacity, width, batch=batch) if has_kv else None
                    for has_kv in kv_mask])

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

    def lengths(self, engine: Engine, row: int = 0) -> list[int | None]:
        """Each layer's length for sequence `row`, read back (one readback per layer: for tests
        and debugging)."""
        return [None if layer is None else int(engine.dtoh(layer.len_d)[row]) for layer in self.kv]


class Unchecked:
    """The capacity of a rollback table whose KV capacity the caller chose not to give: asked
    for by name (`capacity=UNCHECKED`), never by omission."""

    def __repr__(self) -> str:
        return "UNCHECKED"


UNCHECKED = Unchecked()


class PointerTable(DeviceBuffer):
    """A u64 device array of the addresses of `targets` (0 for None), which it holds.

    For kernels that read addresses from device memory: rollback's KV lengths, a model's
    per-layer data. Freeing a target explicitly poisons the table: its `ptr` (and so every
    launch or graph bound to it) refuses with a ValueError naming the target.

    `capacity` is the fewest entries any KV layer behind the table holds, which is how
    RoundStream knows how far a burst may go; None where the table names no KV lengths (a
    model's data pointers; pos_ctr alone). A rollback table over KV lengths must give it:
    RoundStream refuses one that does not, unless it says `capacity=UNCHECKED`.
    """

    def __init__(self, engine: Engine, targets: Sequence[Any], *, capacity: int | Unchecked | None = None,
                 label: str = "pointer table"):
        if not (capacity is None or capacity is UNCHECKED):
            capacity = as_index(capacity, "capacity")
            if capacity < 1:
                raise ValueError(f"capacity must be a positive number of KV entries, None or UNCHECKED, not {capacity}")
        held = tuple(None if t is None else engine.buffer(t, f"table entry {i}") for i, t in enumerate(targets))
        if not held:
            raise ValueError("a pointer table needs at least one entry")
        words = np.array([0 if t is None else t.ptr for t in held], np.uint64)
        ctx, ptr = device_allocation(engine, words.nbytes)
        super().__init__(ptr, np.uint64, len(words), engine=engine, label=label)
        self._own(ctx, "cuMemFree", ptr)
        engine.copy_htod(self, words)
        self.targets = held
        self.capacity = capacity
        for target in held:
            if target is not None:
                target.depend(self)

    def holds(self, buf: DeviceBuffer) -> bool:
        return any(t is buf for t in self.targets)


def _length_table(engine: Engine, layers: Sequence[KVLayer | None], pos_ctr: Any, label: str) -> PointerTable:
    """The rollback table of `layers` (and pos_ctr, last): every length an i32[B] of one B."""
    targets: list[DeviceBuffer | None] = [None if layer is None else layer.len_d for layer in layers]
    if pos_ctr is not None:
        pos_ctr = as_buffer(pos_ctr, "pos_ctr")
        if pos_ctr.dtype != np.int32:
            raise ValueError(f"pos_ctr must be an i32 buffer, not {pos_ctr!r}")
        targets.append(pos_ctr)
    batches = {target.len for target in targets if target is not None}
    if len(batches) > 1:
        raise ValueError(f"{label}: every length must be an i32[B] of the same batch B, not "
                         f"{[target for target in targets if target is not None]}")
    capacities = [layer.capacity for layer in layers if layer is not None]
    return PointerTable(engine, targets, capacity=min(capacities) if capacities else None, label=label)


def kv_len_ptr_table(engine: Engine, cache: Cache, pos_ctr: Any = None) -> PointerTable:
    """Every layer's length pointer (and pos_ctr's, last), for rollback."""
    return _length_table(engine, cache.kv, pos_ctr, "kv lengths")


def kv_len_ptr_table_range(engine: Engine, cache: Cache, layers: range | tuple[int, int],
                           pos_ctr: Any = None) -> PointerTable:
    """The table for the layers [start, stop) one pipeline stage owns, so a rollback launched
    on that stage's device never touches another device's memory."""
    start, stop = (layers.start, layers.stop) if isinstance(layers, range) else layers
    if isinstance(layers, range) and layers.step != 1:
        raise ValueError(f"layer range must be contiguous, not {layers}")
    if not 0 <= start <= stop <= len(cache.kv):
        raise ValueError(f"layers [{start}, {stop}) are outside a cache of {len(cache.kv)} layers")
    return _length_table(engine, cache.kv[start:stop], pos_ctr, f"kv lengths of layers [{start}, {stop})")

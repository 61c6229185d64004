"""KV caches and recurrent state as the round-stream kernels see them, and the tables that name them.

Rollback walks a table of device addresses that lives in device memory, so no launch-time
check can see what it points at. The table carries that check itself (AddressTable): it holds
the buffers it names and refuses to be used once one of them is freed; a PointerTable also
knows the capacity of the KV layers behind it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .capacity import Unchecked, kv_entries
from .geometry import as_batch
from ..driver.buffer import DeviceBuffer, as_buffer, device_allocation
from ..driver.engine import as_engine
from ..driver.values import I32_MOST, U64_MOST, as_index, as_listed, as_size

if TYPE_CHECKING:
    from ..driver.engine import Engine


class KVLayer:
    """One layer's KV storage: `data_d` of `capacity` entries per sequence and its lengths
    `len_d`, i32[B]: one per sequence of the batch (B = 1 for one sequence).

    Only `len_d` matters to round-stream (rollback rewrites it); `data_d` belongs to the model.
    Either may be a DeviceBuffer or a __cuda_array_interface__ object (a torch tensor). Where
    `data_d` is given it holds the capacity it is said to (at least `capacity` elements for each
    sequence): the capacity rule trusts the number, and bursts run up to it. A capacity past an
    i32's most is refused: the lengths that run up to it are i32 and would wrap past it.
    """

    def __init__(self, len_d: Any, capacity: int, data_d: Any = None):
        len_d = as_buffer(len_d, "len_d")
        if len_d.dtype != np.int32:
            raise ValueError(f"KV lengths must be an i32[B] device buffer (one per sequence), not {len_d!r}")
        self.len_d = len_d
        self.capacity = as_size(capacity, "capacity", 1, I32_MOST)  # a length of len_d's i32 reaches it
        self.data_d = None if data_d is None else as_buffer(data_d, "data_d")
        if self.data_d is not None and self.data_d.len < len_d.len * self.capacity:
            raise ValueError(f"data_d of {self.data_d.len} elements cannot hold a capacity of {self.capacity} for each "
                             f"of {len_d.len} sequence(s)")

    @property
    def batch(self) -> int:
        """The sequences (rows) the layer holds: one length each in `len_d`."""
        return self.len_d.len

    @classmethod
    def allocate(cls, engine: Engine, capacity: int, width: int = 1, dtype: Any = np.uint32,
                 batch: int = 1) -> AllocatedKV:
        """A zero-length layer of `capacity` entries of `width` elements for each of `batch`
        sequences: data_d is [batch][capacity][width], there for certain (AllocatedKV)."""
        capacity, width = as_size(capacity, "capacity", 1, I32_MOST), as_size(width, "width")
        batch, engine = as_batch(batch), as_engine(engine)
        return AllocatedKV(engine.zeros(np.int32, batch, label="len_d"), capacity,
                           engine.alloc(dtype, batch * capacity * width, zeroed=True, label="data_d"))


class AllocatedKV(KVLayer):
    """A KVLayer that holds its data for certain, what KVLayer.allocate returns: `data_d` is a
    DeviceBuffer, never None, and typed so, so that a model's code hands it to a copy or a launch
    without a check a type checker would otherwise ask for."""

    data_d: DeviceBuffer

    def __init__(self, len_d: Any, capacity: int, data_d: Any):
        if data_d is None:
            raise TypeError("an AllocatedKV holds its data: data_d must be a buffer, not None")
        super().__init__(len_d, capacity, data_d)


class Cache:
    """A model's KV layers in order; None stands for a layer without KV (linear attention,
    KV shared with another layer). Each is checked here, TypeError naming its index: a string
    was taken as layers of its characters, and a layer that is no KVLayer failed only when a
    capacity or a table read it."""

    def __init__(self, kv: Sequence[KVLayer | None]):
        self.kv: list[KVLayer | None] = as_listed(kv, "kv", "KVLayers or None")
        for i, layer in enumerate(self.kv):
            if layer is not None and not isinstance(layer, KVLayer):
                raise TypeError(f"kv entry {i} must be a KVLayer (or None), not {layer!r}")

    @classmethod
    def allocate(cls, engine: Engine, kv_mask: Sequence[bool], capacity: int, width: int = 1,
                 batch: int = 1) -> Cache:
        """A cache of one layer per entry of `kv_mask`, in order: where True, a zero-length
        KVLayer.allocate of `capacity` entries of `width` for `batch` sequences; where False, None."""
        return cls([KVLayer.allocate(engine, capacity, width, batch=batch) if has_kv else None
                    for has_kv in kv_mask])

    def __len__(self) -> int:
        return len(self.kv)

    def __add__(self, other: object) -> Cache:
        """Both caches' layers in one: one pointer table can then roll back target and draft.
        Another operand is Python's TypeError (NotImplemented), naming both types."""
        if not isinstance(other, Cache):
            return NotImplemented
        return Cache(self.kv + other.kv)

    @property
    def capacity(self) -> int | None:
        """Entries every layer can hold (None for a cache without KV)."""
        caps = [layer.capacity for layer in self.kv if layer is not None]
        return min(caps) if caps else None

    def lengths(self, engine: Engine, row: int = 0) -> list[int | None]:
        """Each layer's length for sequence `row`, read back (one readback per layer: for tests
        and debugging). `row` is checked first, a row of every layer's batch (ValueError or
        TypeError naming it): -1 is refused, not read as numpy's last row, another sequence's."""
        batches = [layer.batch for layer in self.kv if layer is not None]
        row = as_size(row, "row", 0, min(batches) - 1 if batches else None)
        return [None if layer is None else int(engine.dtoh(layer.len_d)[row]) for layer in self.kv]


class AddressTable(DeviceBuffer):
    """A u64 device array of `words`, among them the addresses of `targets`, which it holds.

    For kernels that read addresses from device memory. Freeing a target explicitly poisons the
    table: its `ptr` (and so every launch or graph bound to it) refuses with a ValueError naming
    the target. `targets` are buffers the engine may use (Engine.buffer), None where the table
    names nothing.
    """

    def __init__(self, engine: Engine, words: np.ndarray, targets: tuple[DeviceBuffer | None, ...], label: str):
        ctx, ptr = device_allocation(engine, words.nbytes)
        super().__init__(ptr, np.uint64, len(words), engine=engine, label=label)
        self._own(ctx, "cuMemFree", ptr)
        engine.copy_htod(self, words)
        self.targets = targets
        for target in targets:
            if target is not None:
                target.depend(self)

    def holds(self, buf: DeviceBuffer) -> bool:
        return any(t is buf for t in self.targets)


class PointerTable(AddressTable):
    """A u64 device array of the addresses of `targets` (0 for None), which it holds.

    For kernels that read addresses from device memory: rollback's KV lengths, a model's
    per-layer data, the state indices of FLIP rollback (state_flip_table).

    `capacity` is the fewest entries any KV layer behind the table holds, which is how
    RoundStream knows how far a burst may go; None where the table names no KV lengths (a
    model's data pointers; pos_ctr alone). A rollback table over KV lengths must give it:
    RoundStream refuses one that does not, unless it says `capacity=UNCHECKED`.
    """

    def __init__(self, engine: Engine, targets: Sequence[Any], *, capacity: int | Unchecked | None = None,
                 label: str = "pointer table"):
        engine, capacity = as_engine(engine), kv_entries(capacity)
        held = tuple(None if t is None else engine.buffer(t, f"table entry {i}") for i, t in enumerate(targets))
        if not held:
            raise ValueError("a pointer table needs at least one entry")
        super().__init__(engine, np.array([0 if t is None else t.ptr for t in held], np.uint64), held, label)
        self.capacity = capacity


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
    start, stop = _layer_range(layers, len(cache.kv))
    return _length_table(engine, cache.kv[start:stop], pos_ctr, f"kv lengths of layers [{start}, {stop})")


def _layer_range(layers: range | tuple[int, int], count: int) -> tuple[int, int]:
    """(start, stop) of the contiguous layers [start, stop) of a model of `count` layers, each an
    int (a bool is no layer: (False, True) was taken as [0, 1)), given as a range or a pair (a
    list, a tuple or a 1-D array of two: as_listed): anything else is a TypeError or ValueError
    naming the range, where a slice, None or three bounds met the unpacking's "cannot unpack" or
    "too many values", naming nothing, and bytes or a mapping were read as their ints or keys."""
    if isinstance(layers, range):
        start, stop = layers.start, layers.stop
    else:
        pair = as_listed(layers, "a layer range", "ints, its start and stop", 2)
        if len(pair) != 2:
            raise ValueError(f"a layer range is its start and stop, two ints (or a range), not {pair}")
        start, stop = pair
    start, stop = as_index(start, "a layer range's start"), as_index(stop, "a layer range's stop")
    if isinstance(layers, range) and layers.step != 1:
        raise ValueError(f"layer range must be contiguous, not {layers}")
    if not 0 <= start <= stop <= count:
        raise ValueError(f"layers [{start}, {stop}) are outside a model of {count} layers")
    return start, stop


class KVData:
    """Where one layer's K and V entries live, for the tree round's compaction (kernel 15): `k_d`
    and `v_d` (None for a layer of one buffer: the toy's, MLA's latent), each row of the batch
    `row_stride` bytes apart, each position `pos_stride` bytes apart, `nbytes` of one entry at one
    position (all multiples of 4: the kernel moves 32-bit words), `capacity` positions in each of
    `batch` rows. Either buffer may be a DeviceBuffer or a __cuda_array_interface__ object (a
    torch tensor); each must hold the bytes this layout reaches."""

    def __init__(self, k_d: Any, v_d: Any = None, *, row_stride: int, pos_stride: int, nbytes: int, capacity: int,
                 batch: int):
        self.batch = as_batch(batch)
        self.k_d = as_buffer(k_d, "k_d")
        self.v_d = None if v_d is None else as_buffer(v_d, "v_d")
        # the record's words are u64: one row's stride is never used (row 0 starts at the buffer), so no extent
        # bounds it, and 2**64 met KVDataTable's packing as a bare OverflowError
        self.row_stride = as_size(row_stride, "row_stride", 0, U64_MOST)
        self.pos_stride = as_size(pos_stride, "pos_stride", 0)
        self.nbytes, self.capacity = as_size(nbytes, "nbytes"), as_size(capacity, "capacity")
        if any(x % 4 for x in (self.row_stride, self.pos_stride, self.nbytes)):
            raise ValueError(f"KV data moves in 32-bit words: strides and nbytes must be multiples of 4, not "
                             f"row_stride={row_stride}, pos_stride={pos_stride}, nbytes={nbytes}")
        if self.pos_stride < self.nbytes:
            raise ValueError(f"positions {pos_stride} bytes apart cannot hold entries of {nbytes} bytes")
        row_bytes = (self.capacity - 1) * self.pos_stride + self.nbytes  # a row's entries, rows apart
        side_by_side = self.row_stride >= self.nbytes and \
            self.pos_stride >= (self.batch - 1) * self.row_stride + self.nbytes  # or a position's rows, positions apart
        if self.batch > 1 and self.row_stride < row_bytes and not side_by_side:
            raise ValueError(f"rows {row_stride} bytes apart overlap: {capacity} positions {pos_stride} bytes apart "
                             f"reach {row_bytes} bytes, and every entry needs its own bytes (the compaction moves "
                             "the rows at once)")
        extent = (self.batch - 1) * self.row_stride + (self.capacity - 1) * self.pos_stride + self.nbytes
        for buf in filter(None, (self.k_d, self.v_d)):
            if buf.ptr % 4:
                raise ValueError(f"{buf!r} is not 4-byte aligned: the compaction moves 32-bit words")
            if buf.nbytes < extent:
                raise ValueError(f"{buf!r} holds {buf.nbytes} bytes, but {self.batch} rows of {self.capacity} "
                                 f"positions ({row_stride} and {pos_stride} bytes apart) reach {extent}")

    @classmethod
    def from_layer(cls, layer: KVLayer) -> KVData:
        """A KVLayer's data_d as [B][capacity][width] elements of 4 or 8 bytes, one buffer."""
        if layer.data_d is None:
            raise ValueError(f"{layer!r} has no data_d to compact")
        data, batch = layer.data_d, layer.batch
        if data.nbytes % (batch * layer.capacity):
            raise ValueError(f"data_d ({data.nbytes} bytes) is not [{batch}][{layer.capacity}][width]")
        entry = data.nbytes // (batch * layer.capacity)
        return cls(data, row_stride=layer.capacity * entry, pos_stride=entry, nbytes=entry, capacity=layer.capacity,
                   batch=batch)


class KVDataTable(AddressTable):
    """The table kernel 15 reads: per layer the record (K address, V address, row stride,
    position stride, bytes, capacity), zeros for None (a layer without KV), holding every buffer
    it names; every layer of one batch B (`batch`)."""

    RECORD = 6

    def __init__(self, engine: Engine, layers: Sequence[KVData | None], label: str = "kv data"):
        self.layers = tuple(layers)
        if not self.layers:
            raise ValueError("a KV data table needs at least one entry")
        for i, layer in enumerate(self.layers):
            if layer is not None and not isinstance(layer, KVData):
                raise TypeError(f"kv data entry {i} must be a KVData (or None), not {layer!r}")
        batches = {layer.batch for layer in self.layers if layer is not None}
        if len(batches) > 1:
            raise ValueError(f"{label}: every layer must hold the same batch B, not {sorted(batches)}")
        _named_once(self.layers, label)
        self.batch = batches.pop() if batches else None
        engine = as_engine(engine)
        words = np.zeros((len(self.layers), self.RECORD), np.uint64)
        held: list[DeviceBuffer | None] = []
        for i, layer in enumerate(self.layers):
            if layer is None:
                held += [None, None]
                continue
            k_d = engine.buffer(layer.k_d, f"layer {i} KV")
            v_d = None if layer.v_d is None else engine.buffer(layer.v_d, f"layer {i} KV")
            words[i] = (k_d.ptr, 0 if v_d is None else v_d.ptr, layer.row_stride, layer.pos_stride, layer.nbytes,
                        layer.capacity)
            held += [k_d, v_d]
        super().__init__(engine, words.reshape(-1), tuple(held), label)

    @property
    def capacity(self) -> int | None:
        caps = [layer.capacity for layer in self.layers if layer is not None]
        return min(caps) if caps else None


def _named_once(layers: Sequence[KVData | None], label: str) -> None:
    """ValueError where a table's records name one address twice (a layer listed twice, or a
    layer's V its K): kernel 15 gives each record's K and V a block of its own, each moving the
    path's entries depth by depth, so two blocks over one memory race, one reading a slot the
    other has already overwritten, and the accepted path's KV comes out wrong, silently (the
    numpy reference, which moves every layer at one depth before the next, shows nothing)."""
    seen: dict[int, str] = {}
    for i, layer in enumerate(layers):
        if layer is None:
            continue
        for name, buf in (("K", layer.k_d), ("V", layer.v_d)):
            if buf is None:
                continue
            if buf.ptr in seen:
                raise ValueError(f"{label}: layer {i}'s {name} is at the address of {seen[buf.ptr]} ({buf!r}): the "
                                 "compaction would move that memory twice at once; name each K and V once (a "
                                 "layer of one buffer gives v_d=None)")
            seen[buf.ptr] = f"layer {i}'s {name}"


def kv_data_table(engine: Engine, layers: Sequence[KVData | None]) -> KVDataTable:
    """The compaction table of a model's KV layers in order (None: a layer without KV)."""
    return KVDataTable(engine, layers)


class StateLayer:
    """One layer's recurrent state (Mamba, gated delta nets, linear attention) for rollback by
    copy: `live_d` [B][row_words], the state the model reads, and `slots_d` [B][k+1][row_words],
    where the verify writes the state after each of its k + 1 tokens (slot i after token i).

    A state cannot be rolled back by a length, so rollback copies the kept slot over the live
    state (spec_state_copy). Elements are 32-bit words of one 4-byte type (f32 state, say):
    the kernel copies words. Either buffer may be a DeviceBuffer or a __cuda_array_interface__
    object (a torch tensor).
    """

    def __init__(self, live_d: Any, slots_d: Any, row_words: int, k: int):
        self.live_d, self.slots_d = as_buffer(live_d, "live_d"), as_buffer(slots_d, "slots_d")
        self.row_words, self.k = as_size(row_words, "row_words"), as_size(k, "k", 0)
        if self.live_d.dtype.itemsize != 4 or self.slots_d.dtype != self.live_d.dtype:
            raise ValueError(f"live_d and slots_d must hold 32-bit words of one type, not {self.live_d!r} and "
                             f"{self.slots_d!r}")
        if self.live_d.len % self.row_words:
            raise ValueError(f"live_d must be [B][{self.row_words}], not {self.live_d!r}")
        want = self.batch * (self.k + 1) * self.row_words
        if self.slots_d.len != want:
            raise ValueError(f"slots_d must be [{self.batch}][{self.k + 1}][{self.row_words}] = {want} words "
                             f"(k + 1 slots a row), not {self.slots_d!r}")

    @property
    def batch(self) -> int:
        """The rows the state holds: `live_d`'s words, `row_words` a row."""
        return self.live_d.len // self.row_words


class StateTable(AddressTable):
    """The table spec_state_copy reads: per layer the record (live address, slots address,
    row_words), zeros for None (a layer without state), holding every buffer it names.

    `batch` and `k` are those of every layer (None where every entry is None): the launcher
    checks them against the StreamBufs it rolls back.
    """

    def __init__(self, engine: Engine, layers: Sequence[StateLayer | None], label: str):
        self.layers = tuple(layers)
        if not self.layers:
            raise ValueError("a state table needs at least one entry")
        shapes = {(layer.batch, layer.k) for layer in self.layers if layer is not None}
        if len(shapes) > 1:
            raise ValueError(f"{label}: every layer must have the same batch B and k, not (B, k) in {sorted(shapes)}")
        self.batch: int | None = None
        self.k: int | None = None
        if shapes:
            self.batch, self.k = shapes.pop()
        engine = as_engine(engine)
        words = np.zeros((len(self.layers), 3), np.uint64)
        held: list[DeviceBuffer | None] = []
        for i, layer in enumerate(self.layers):
            if layer is None:
                held += [None, None]
                continue
            live = engine.buffer(layer.live_d, f"layer {i} live_d")
            slots = engine.buffer(layer.slots_d, f"layer {i} slots_d")
            words[i] = live.ptr, slots.ptr, layer.row_words
            held += [live, slots]
        _disjoint(held, label)
        super().__init__(engine, words.reshape(-1), tuple(held), label)


def state_copy_table(engine: Engine, layers: Sequence[StateLayer | None]) -> StateTable:
    """The COPY rollback table of a model's layers in order (None: a layer without state)."""
    return StateTable(engine, layers, "recurrent state")


def state_copy_table_range(engine: Engine, layers: Sequence[StateLayer | None],
                           stage: range | tuple[int, int]) -> StateTable:
    """The table for the layers [start, stop) one pipeline stage owns, so a rollback launched
    on that stage's device never touches another device's memory."""
    start, stop = _layer_range(stage, len(layers))
    return StateTable(engine, layers[start:stop], f"recurrent state of layers [{start}, {stop})")


class StateIndexTable(PointerTable):
    """The FLIP rollback table (spec_state_flip): per model, the u32[B] slot index its stateful
    layers read their live state at (None: skip), all of one B.

    One index a model, not a layer: a model's layers share keep, so they flip together. A type
    of its own, so a RoundStream knows which rollback a state table asks for; u32 only, so a KV
    length table (i32) and this one never stand in for each other.
    """

    def __init__(self, engine: Engine, indices: Sequence[Any], label: str = "state indices"):
        buffers = [None if idx is None else as_buffer(idx, f"index {i}") for i, idx in enumerate(indices)]
        present = [buf for buf in buffers if buf is not None]
        if any(buf.dtype != np.uint32 for buf in present) or len({buf.len for buf in present}) > 1:
            raise ValueError(f"state indices must be u32[B] buffers of one batch B, not {present}")
        _disjoint(present, label)
        super().__init__(engine, buffers, label=label)


def state_flip_table(engine: Engine, indices: Sequence[Any]) -> StateIndexTable:
    """The FLIP rollback table of one index per model (StateIndexTable)."""
    return StateIndexTable(engine, indices)


def state_targets_disjoint(tables: Sequence[AddressTable]) -> None:
    """Refuse state tables that name the same memory twice: a round would roll it back twice,
    and a second flip undoes the first (a copy of another table's slot wins at random)."""
    _disjoint([target for table in tables for target in table.targets], "state tables")


def _disjoint(buffers: Sequence[DeviceBuffer | None], label: str) -> None:
    """Refuse a state table whose buffers overlap: each is written by its own entry's threads, so
    shared memory would race (and an index flipped twice would undo its own rollback)."""
    spans = sorted(((buf.ptr, buf.ptr + buf.nbytes, buf) for buf in buffers if buf is not None), key=lambda s: s[0])
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"{label}: {first!r} and {second!r} overlap; every buffer of a state table must "
                             f"have its own memory")


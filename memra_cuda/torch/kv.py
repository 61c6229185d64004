"""Static KV caches that round-stream rolls back by their lengths alone.

A captured burst replays the same addresses every time, so a cache must never move: StaticKV
keeps K and V of B rows at fixed addresses and writes each forward's entries at per-row
positions read on the device. Its per-layer lengths are int32 tensors registered with
round-stream as KVLayers (`cache()`): the rollback rewrites them, which is all it takes to forget
rejected drafts, since every forward masks each row past its own position. A tree round also
moves the accepted path's entries to consecutive slots: `data()` describes where they live for
the layer's kernel (KVData records), and PagedKV, whose pages the kernel cannot describe, moves
them itself (`compact`).

Both are what transformers' attention layers call as their `past_key_values`: `update(k, v,
layer)` with the new entries of the rows in the forward, which land at `positions` (set by the
caller for the forward) and return those rows' whole caches, masked by the caller.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..buffers.capacity import kv_capacity
from ..buffers.geometry import Geometry, as_batch
from ..buffers.tables import Cache, KVData, KVLayer
from ..driver.values import as_size, distinct_rows
from .attention import MOST_SLOTS, aligned
from .models import is_float_dtype
from .uploads import uploaded


def head_size(config: Any) -> int:
    """The config's head_dim where it has one, else hidden_size / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def capacity_for(prompt_len: int, tokens: int, geometry: Geometry | None) -> int:
    """A cache for a prompt and a budget in every mode (overlap's two bursts in flight) of rounds
    of `geometry` (a chain's Geometry(k, M, B), a tree's Geometry.of_tree); None: the plain
    decoding's (GraphedGreedy: the prompt but its last token, and the budget). Rounded up to 16
    slots: SDPA's memory-efficient kernel copies a mask whose rows are not 16-aligned into a
    padded one at every call. A size past MOST_SLOTS, the most a row holds, is a ValueError naming
    prompt_len and tokens: said here, where the size is asked for (it was returned, and the
    decoder given it refused "capacity", a number the caller never wrote)."""
    if geometry is None:
        need = max(as_size(prompt_len, "prompt_len") - 1 + as_size(tokens, "tokens", 0), 1)
    else:
        need = kv_capacity(prompt_len, tokens, geometry, overlap=True)
    slots = -(-need // 16) * 16
    if slots > MOST_SLOTS:
        raise ValueError(f"prompt_len {prompt_len} and tokens {tokens} take a cache of {slots} slots a row, past "
                         f"the most a row holds, {MOST_SLOTS} (its lengths are i32)")
    return slots


@dataclass(frozen=True)
class Room:
    """What each row of a decoder must hold: a prompt of up to `prompt_len` tokens and up to
    `tokens` new ones. Given as a decoder's `capacity`, it is sized by the decoder's own geometry
    (capacity_for), so k, M and B are stated once, to the decoder."""

    prompt_len: int
    tokens: int

    def __post_init__(self) -> None:
        """Both checked as the Room is built (a prompt holds its pending token: at least one)."""
        object.__setattr__(self, "prompt_len", as_size(self.prompt_len, "prompt_len"))
        object.__setattr__(self, "tokens", as_size(self.tokens, "tokens", 0))

    def entries(self, geometry: Geometry | None) -> int:
        """The cache it takes in rounds of `geometry` (None: the plain decoding)."""
        return capacity_for(self.prompt_len, self.tokens, geometry)


def as_capacity(capacity: int | Room, geometry: Geometry | None) -> int:
    """A decoder's `capacity`, a number of cache slots or a Room sized for `geometry`, as slots
    (as_size's refusals, naming it; a Room's, capacity_for's), at most MOST_SLOTS: past it,
    refused before any cache is allocated (KVLayer refused it only once the caches were)."""
    if isinstance(capacity, Room):
        return capacity.entries(geometry)
    if isinstance(capacity, (tuple, list)):  # as_size's TypeError would not say what else it takes
        raise TypeError(f"capacity is a Room(prompt_len, tokens) or an int of slots, not {capacity!r}")
    return as_size(capacity, "capacity", most=MOST_SLOTS, also="a Room")


def cache_slots(capacity: int | Room, geometry: Geometry) -> int:
    """A round decoder's cache slots a row for `capacity` (as_capacity's), in whole blocks
    (aligned): both models' caches and a tree's masks alike, compiled or not."""
    return aligned(as_capacity(capacity, geometry))


class StaticKV:
    """K and V of `batch` rows for `layers` layers at fixed addresses, one tensor a layer
    ([B][heads][capacity][head size] each, a head's positions together: a forward writes its own
    slots of a layer's tensor, which a compiled step does in place), at per-row device positions.

    `lengths` (int32 [layers][B]) counts each row's entries per layer. Before a forward the
    caller sets `rows` (the cache rows its token rows belong to, a [R] device index; None: every
    row) and `positions` ([R][T] slots its tokens' entries go to)."""

    def __init__(self, config: Any, layers: int, batch: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str = "cuda"):
        self._bookkeeping(layers, batch, capacity, device, dtype)
        shape = (batch, config.num_key_value_heads, capacity, head_size(config))
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]

    def _bookkeeping(self, layers: int, batch: int, capacity: int, device: torch.device | str,
                     dtype: torch.dtype) -> None:
        """What every layout keeps beside its entries: lengths, rows and positions (its sizes
        checked first, so a bad one is named, not left to torch; and the entries' `dtype`, a
        model's float: an int cache took a forward's K and V truncated, silently)."""
        layers, capacity = as_size(layers, "layers"), as_size(capacity, "capacity", most=MOST_SLOTS)
        if not is_float_dtype(dtype):
            raise TypeError(f"{type(self).__name__}'s dtype is a floating-point torch.dtype of 2 bytes or more (the "
                            f"model's), not {dtype!r}")
        batch = as_batch(batch)
        self.capacity = capacity
        self.lengths = torch.zeros(layers, batch, dtype=torch.int32, device=device)
        self.rows: torch.Tensor | None = None
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.every_row = torch.arange(batch, device=device)[:, None]  # [B][1]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' Cache.update: `key` and `value` [R][heads][T][d] land at `positions`;
        returns the rows' K and V, [R][heads][capacity][d]."""
        rows = self.every_row if self.rows is None else self.rows[:, None]
        self.k[layer][rows, :, self.positions] = key.transpose(1, 2)
        self.v[layer][rows, :, self.positions] = value.transpose(1, 2)
        if self.rows is None:
            return self.k[layer], self.v[layer]
        return self.k[layer].index_select(0, self.rows), self.v[layer].index_select(0, self.rows)

    def cache(self) -> Cache:
        """The layers' lengths as round-stream's KVLayers (for kv_len_ptr_table)."""
        return Cache([KVLayer(self.lengths[i], self.capacity) for i in range(len(self.lengths))])

    def data(self) -> list[KVData]:
        """Where the entries live, for a tree round's compaction (kernel 15): one record a layer
        and KV head, as this cache keeps a head's positions together ([B][heads][capacity][d]).
        A record's buffers are contiguous views from its head's first entry on, so each holds
        the tensor it names."""
        batch, heads, capacity, dim = self.k[0].shape
        entry = dim * self.k[0].element_size()
        words = entry // 4  # as int32: torch gives bfloat16 tensors no __cuda_array_interface__
        flat = [(k.view(torch.int32).view(-1), v.view(torch.int32).view(-1)) for k, v in zip(self.k, self.v)]
        return [KVData(k[head * capacity * words:], v[head * capacity * words:], row_stride=heads * capacity * entry,
                       pos_stride=entry, nbytes=entry, capacity=capacity, batch=batch)
                for k, v in flat for head in range(heads)]

    def __repr__(self) -> str:
        return (f"{type(self).__name__} of {len(self.k)} layer(s), batch {self.lengths.shape[1]}, capacity "
                f"{self.capacity}, entries {list(self.k[0].shape)} {self.k[0].dtype} on {self.k[0].device}")

    def copy_rows(self, other: StaticKV, rows: Sequence[int]) -> None:
        """`other`'s first layers' entries and lengths in `rows` (what a stack of those same
        layers computes over the same tokens: a self-speculative draft's prefill), from a cache
        of the same layout, batch and capacity. Both are checked first, naming what is wrong
        (nothing copied): `other` a cache of this one's kind, batch, capacity, heads, head size,
        dtype and device with at least its layers (index_copy_ met a shorter capacity with a
        shape error, a PagedKV's pages as a StaticKV's rows); `rows` distinct rows of the batch
        (distinct_rows: a row past it would be a device-side assert)."""
        if not isinstance(other, StaticKV):
            raise TypeError(f"copy_rows copies from a StaticKV or a PagedKV, not a {type(other).__name__}")
        if type(other) is not type(self) or len(other.k) < len(self.k) or \
                other.k[0].shape != self.k[0].shape or other.k[0].dtype != self.k[0].dtype or \
                other.k[0].device != self.k[0].device:
            raise ValueError(f"copy_rows copies from a cache of its own layout, batch and capacity and at least its "
                             f"layers: not a {other!r} into a {self!r}")
        index = uploaded(distinct_rows(rows, self.lengths.shape[1], "copy_rows' rows"), torch.long,
                         self.lengths.device)
        held = self._held(index)  # the first index of each layer's tensor that holds the rows' entries
        for mine, theirs in zip(self.k + self.v, other.k[:len(self.k)] + other.v[:len(self.v)]):
            mine.index_copy_(0, held, theirs.index_select(0, held))
        self.lengths.index_copy_(1, index, other.lengths[:len(self.lengths)].index_select(1, index))

    def _held(self, rows: torch.Tensor) -> torch.Tensor:
        """Where `rows`' entries are in a layer's tensor, by its first index: the rows themselves."""
        return rows


CacheLayout = Callable[[Any, int, int, int, torch.dtype, torch.device], StaticKV]
"""How a Stack makes its cache: (config, layers, batch, capacity, dtype, device) -> the cache."""

CACHE_LAYOUTS = "StaticKV, PagedKV"  # a Stack's cache layouts, as as_layout's refusal names them


def as_layout(layout: Any, what: str, kinds: str) -> Any:
    """`layout` (a Stack's `cache` or `state`: a class, or a function, that makes one) where it can be
    called, else TypeError naming `what` and the `kinds` there are: a name ("paged"), or a cache made
    already, met "'str' object is not callable" as the stack was made (a decoder's after its stream
    and engine), and a state layout no stack without recurrent layers calls was taken, silently."""
    if not callable(layout):
        raise TypeError(f"{what} is a {what} layout ({kinds}, or a function making one as they are called), "
                        f"not {layout!r}")
    return layout


PAGE = 16  # PagedKV's positions a page, left out


class PagedKV(StaticKV):
    """StaticKV's cache laid out in pages of `page` positions, as a paged engine keeps it: one pool
    of pages a layer ([layers][pages][heads][page][d]), a row's logical page j at physical page
    `table[row, j]`, the pages of every row shuffled through the pool. The layer's compaction
    kernel cannot describe it (its entries are not one stride apart), so a tree round moves the
    accepted path by the model's own callable: compact(), a few torch ops a depth. Each forward
    gathers a row's pages into logical order for the attention: a reference of the route, not a
    fast paged attention. A page holds at most the capacity, or PAGE where that is longer (one
    page a row): a longer one was allocated whole for every row, 4096 positions a row for a
    capacity of 16."""

    def __init__(self, config: Any, layers: int, batch: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str = "cuda", page: int = PAGE):
        capacity = as_size(capacity, "capacity", most=MOST_SLOTS)  # _bookkeeping's check, before the page's
        page = as_size(page, "page", 1, max(capacity, PAGE))  # positions a page holds
        self._bookkeeping(layers, batch, capacity, device, dtype)
        per_row = -(-capacity // page)
        self.pool_k = torch.zeros(layers, batch * per_row, config.num_key_value_heads, page, head_size(config),
                                  dtype=dtype, device=device)
        self.pool_v = torch.zeros_like(self.pool_k)
        self.k, self.v = list(self.pool_k), list(self.pool_v)  # a layer's pool of pages each
        shuffle = torch.randperm(batch * per_row, generator=torch.Generator().manual_seed(per_row))
        self.table = shuffle.view(batch, per_row).to(device)  # the same for every cache of this shape
        self.page = page

    def _at(self, rows: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The physical page and the offset in it of each of `slots` of `rows` (broadcast)."""
        return self.table[rows, slots // self.page], slots % self.page

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.every_row if self.rows is None else self.rows[:, None]
        page, offset = self._at(rows, self.positions)
        self.k[layer][page, :, offset] = key.transpose(1, 2)
        self.v[layer][page, :, offset] = value.transpose(1, 2)
        return self.gather(layer, rows[:, 0])

    def gather(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `rows` in logical order, [rows][heads][capacity][d], for the attention."""
        pages = self.table[rows]  # [rows][per_row]
        k, v = (kv[layer][pages].permute(0, 2, 1, 3, 4).flatten(2, 3)[:, :, :self.capacity] for kv in (self.k, self.v))
        return k, v

    def compact(self, path: torch.Tensor, accepted: torch.Tensor, start: torch.Tensor) -> None:
        """The layer's kernel 15 in torch: for d = 1..D in increasing d (a deeper depth's source
        can be a shallower one's destination), each row with at least d drafts accepted moves the
        entries at slot start + path[d] to start + d, in every layer; slots past the capacity
        are skipped. `path` [B][D+1], `accepted` and `start` [B][1]."""
        rows = self.every_row[:, 0]
        path, accepted, start = path.long(), accepted.long()[:, 0], start.long()[:, 0]
        for d in range(1, path.shape[1]):
            source, target = start + path[:, d], start + d
            move = (accepted >= d) & (source != target) & (source < self.capacity) & (target < self.capacity)
            (sp, so), (tp, to) = (self._at(rows, slot.clamp(0, self.capacity - 1)) for slot in (source, target))
            for kv in (self.pool_k, self.pool_v):
                kv[:, tp, :, to] = torch.where(move[:, None, None, None], kv[:, sp, :, so], kv[:, tp, :, to])

    def _held(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows' pages: a PagedKV of the same batch and capacity has these same pages."""
        return self.table[rows].flatten()

    def data(self) -> list[KVData]:
        raise TypeError("a paged cache is not one stride a position: the layer's compaction cannot move it "
                        "(TreeLlama(paged=...) gives the round compact= instead)")

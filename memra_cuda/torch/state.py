"""Recurrent state that round-stream rolls back, by copy or by flipping an index.

A layer with recurrent state (Mamba, gated delta nets, linear attention) cannot be rolled back
by a length: the verify's state after a rejected draft must never become the live one. The
verify keeps the state after each of its tokens in a slot, and round-stream's rollback makes the
state after the last kept token live, on the device, in the same round (docs/model-side.md,
"Recurrent state"): CopyState copies that slot over the live state, FlipState points a per-row
index at it. LiveState is plain decoding's, where every token is kept.

Every tensor stays at its address, so every graph captured over them stays valid. A strategy
serves a Stack's `Recurrent` layers through one interface (`State`): begin() before a forward
over every row, read() a layer's state before it, store() the state after each token; reset()
and set_prompt() for a new request.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import numpy as np
import torch

from ..buffers.tables import StateIndexTable, StateLayer, StateTable, state_copy_table, state_flip_table
from ..driver.engine import Engine
from ..buffers.geometry import as_batch
from ..driver.values import as_listed, as_size
from .views import tensor


class Recurrent(torch.nn.Module):
    """A decoder layer with recurrent state, which a Stack runs instead of calling it as a
    transformers layer: no transformers layer would hand its states along.

    A subclass sets `state_shape`, one row's state (fp32 whatever the model's dtype), and
    implements forward(hidden, state, store=None, active=None, parents=None) -> (hidden, state):
    `hidden` [R][T][hidden size], R rows of T tokens; `state` [R][*state_shape] the rows' state
    before the first token, only read; `store(t, state)` takes the state after token t; where
    `active` [R][T] is False a row's state stays as it was (a prefill's padding); where
    `parents` [R][T] is given the tokens are a tree's nodes, token t >= 1 stepping from the state
    after its parent, token 0 from `state`. It returns the layer's output and the state after
    the last token. memra_cuda.torch.testing.RecurrentLayer is one."""

    state_shape: tuple[int, ...]


def has_recurrent(layers: Iterable[Any]) -> bool:
    """Whether any of a model's decoder `layers` (model.model.layers, or the first few of them) is
    Recurrent: what a draft, a shard, a draft of the target's first layers and a decoder that
    skips rounds past the end each refuse."""
    return any(isinstance(layer, Recurrent) for layer in layers)


class State(Protocol):
    """What a Stack asks of its recurrent layers' state (LiveState, CopyState, FlipState)."""

    def begin(self) -> None: ...

    def read(self, layer: int) -> torch.Tensor: ...

    def store(self, layer: int, token: int, state: torch.Tensor) -> None: ...

    def reset(self, rows: torch.Tensor) -> None: ...

    def set_prompt(self, layer: int, rows: torch.Tensor, state: torch.Tensor) -> None: ...


StateLayout = Callable[[int, int, tuple[int, ...], torch.device], State]
"""How a Stack makes its state: (recurrent layers, batch, one row's state shape, device) -> it."""

STATE_LAYOUTS = "LiveState, CopyState, FlipState"  # a Stack's state layouts, as kv.as_layout's refusal names them


def state_sizes(layers: int, batch: int, shape: tuple[int, ...]) -> tuple[int, int, tuple[int, ...]]:
    """A state layout's sizes as plain ints, each refused by name (as_size's, as_batch's, as_listed's):
    a batch of True was one row, a negative count met torch's "negative dimension", and a shape of
    ("4",) or 4 its zeros() error, naming no argument."""
    layers, batch = as_size(layers, "layers"), as_batch(batch)
    sizes = as_listed(shape, "a state's shape", "sizes, one a dimension")
    return layers, batch, tuple(as_size(size, f"a state's shape[{i}]") for i, size in enumerate(sizes))


class LiveState:
    """The state of a Stack's recurrent layers for plain decoding: `live` [layers][B][...], which
    every forward reads and leaves, in place, as the state after its last token."""

    def __init__(self, layers: int, batch: int, shape: tuple[int, ...], device: torch.device | str = "cuda"):
        layers, batch, shape = state_sizes(layers, batch, shape)
        self.live = torch.zeros(layers, batch, *shape, device=device)

    def begin(self) -> None:
        """Per-forward set-up shared by every layer (FlipState works out its slots once here)."""

    def read(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s state of every row before the forward."""
        return self.live[layer]

    def store(self, layer: int, token: int, state: torch.Tensor) -> None:
        """The state after token `token` of the forward, every row."""
        self.live[layer].copy_(state)

    def reset(self, rows: torch.Tensor) -> None:
        """Zero state for a new request in each of `rows`: a prompt of one token runs no prefill
        forward to set it."""
        self.live[:, rows] = 0

    def set_prompt(self, layer: int, rows: torch.Tensor, state: torch.Tensor) -> None:
        """Each of `rows` starts from `state` (its prompt's, [rows][...])."""
        self.live[layer].index_copy_(0, rows, state)


class CopyState(LiveState):
    """Rollback by copy: the live state as LiveState's, and `slots` [layers][B][k+1][...]. A
    forward over every row (the verify) reads live and writes the state after its token i to
    slot i, never live, so a rejected draft's state never reaches it; round-stream's rollback
    copies slot keep - 1 over live (`table`). A tree keeps a slot a node (k = T). k is an int of
    at least 0 (one slot: the pending token's alone), refused as it is given (as_size: -1 made no
    slot, True two, and the verify's store met a bare IndexError)."""

    def __init__(self, layers: int, batch: int, shape: tuple[int, ...], device: torch.device | str = "cuda", *,
                 k: int):
        k = as_size(k, "k", 0)
        super().__init__(layers, batch, shape, device)  # its sizes checked there (state_sizes)
        self.k = k
        self.slots = torch.zeros(*self.live.shape[:2], k + 1, *self.live.shape[2:], device=device)

    def store(self, layer: int, token: int, state: torch.Tensor) -> None:
        self.slots[layer, :, token].copy_(state)

    def table(self, engine: Engine) -> StateTable:
        """RoundStream's state table: each layer's live state and slots."""
        words = self.live[0, 0].numel()
        return state_copy_table(engine, [StateLayer(live, slots, words, self.k)
                                         for live, slots in zip(self.live, self.slots)])


class FlipState:
    """Rollback by flipping an index: `slots` [layers][B][2(k+1)][...], two banks of k + 1, and
    one u32[B] slot index for the model (`index_d`, round-stream's; `index`, its int32 view).
    With bank = min(idx / (k+1), 1), a forward over every row reads slot bank·(k+1) + idx % (k+1)
    and writes the state after its token i to slot (1 - bank)·(k+1) + i, in the other bank, so
    the slot it read is never written (a done row, which keeps nothing, keeps its state); the
    rollback points idx at the kept slot and copies nothing. A prompt's state goes to slot 0,
    idx 0. (The verify here still gathers each row's slot into a tensor of its own, as much as
    the copy moves: a layer kernel that took the index itself would not, which is where
    flipping saves.)"""

    def __init__(self, layers: int, batch: int, shape: tuple[int, ...], device: torch.device | str = "cuda", *,
                 k: int, engine: Engine):
        self.k = k = as_size(k, "k", 0)  # as CopyState's
        layers, batch, shape = state_sizes(layers, batch, shape)  # before the engine is asked for the index
        self.slots = torch.zeros(layers, batch, 2 * (k + 1), *shape, device=device)
        self.index_d = engine.zeros(np.uint32, batch, label="state slot index")
        self.index = tensor(self.index_d, torch.int32)
        self.rows = torch.arange(batch, device=device)
        self.tokens = torch.arange(k + 1, device=device)  # a forward's token i writes its bank's slot i

    def begin(self) -> None:
        """From the slot index, once a forward: the slot each row reads (the state its index
        points at) and the slots it writes (the other bank's)."""
        index = self.index.long() % 2**32  # the u32 the rollback kernel reads, garbage included
        bank = (index // (self.k + 1)).clamp(max=1)
        self.reading = bank * (self.k + 1) + index % (self.k + 1)  # [B]
        self.writing = (1 - bank)[:, None] * (self.k + 1) + self.tokens  # [B][k+1]

    def read(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s state of every row before the forward: the slot its index points at."""
        return self.slots[layer, self.rows, self.reading]

    def store(self, layer: int, token: int, state: torch.Tensor) -> None:
        """The state after token `token` of the forward, every row, into its slot of the bank it
        does not read."""
        self.slots[layer, self.rows, self.writing[:, token]] = state

    def reset(self, rows: torch.Tensor) -> None:
        """Zero state for a new request in each of `rows`: slot 0 zeroed, the index at it."""
        self.slots[:, rows, 0] = 0
        self.index[rows] = 0

    def set_prompt(self, layer: int, rows: torch.Tensor, state: torch.Tensor) -> None:
        """Each of `rows` starts from `state` (its prompt's, [rows][...]), in slot 0."""
        self.slots[layer, rows, 0] = state

    def table(self, engine: Engine) -> StateIndexTable:
        """RoundStream's state table: the slot index."""
        return state_flip_table(engine, [self.index_d])


def rollback(strategy: str, engine: Engine, k: int) -> StateLayout:
    """A round-stream decoder's state layout by name: "copy" (CopyState) or "flip" (FlipState),
    k + 1 slots a bank (a chain's k, a tree's T)."""
    if strategy == "copy":
        return lambda layers, batch, shape, device: CopyState(layers, batch, shape, device, k=k)
    if strategy == "flip":
        return lambda layers, batch, shape, device: FlipState(layers, batch, shape, device, k=k, engine=engine)
    raise ValueError(f'state_rollback is "copy" or "flip", not {strategy!r}')


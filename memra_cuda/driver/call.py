"""Prepared driver calls: checked once, then issued at the cost of the bare binding.

The per-round path of a round stream is a fixed list of launches, copies and memsets whose
arguments never change (every per-round value lives in device memory). So every check that
can be made once (types, sizes, the engine a buffer belongs to, that the memory is alive) is
made when the call is prepared, and issuing it again is one binding call on a prebuilt
argument tuple, inside the context's fast path (PrimaryContext.run). What is left per call is
what cannot move earlier: one attribute test for memory freed since (Handle's poisoning), the
device's sticky fault, the context being current, and handing the addressed memory to a graph
being captured.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .handle import Handle

if TYPE_CHECKING:
    from .stream import Stream


class Prepared(Handle):
    """A driver call queued on `stream` with fixed arguments `argv`, addressing `holds`.

    It holds the handles its arguments address (buffers, pinned memory, a module) and refuses
    to run, naming what was freed, once one of them is freed explicitly or the stream closed.
    """

    def __init__(self, stream: Stream, fn: Callable[..., tuple], name: str, argv: tuple,
                 holds: Sequence[Handle | None] = ()):
        stream.activate()
        self.engine = stream
        self._ctx = stream.ctx
        self._fn, self._name, self._argv = fn, name, argv
        self._holds: tuple[Handle, ...] = ()
        stream.depend(self)
        self._bind(holds)

    def _bind(self, holds: Sequence[Handle | None]) -> None:
        self._holds = tuple(h for h in holds if h is not None)
        for handle in self._holds:
            handle.depend(self)

    def set(self, *values: object, **named: object) -> Prepared:
        """New argument values: only launches take them (Launch.set)."""
        raise TypeError(f"{self!r} has fixed arguments: prepare another call instead")

    def __call__(self, *values: object) -> None:
        """Issue the call, first storing `values` if any are given (a Launch's arguments in order:
        a kernel with a signature takes its own by name, through Launch.set, before the call).
        No keywords here: a launch is called every round, and `**named` would cost a dict each."""
        if values:
            self.set(*values)
        if self._refusal is not None:
            raise ValueError(self._refusal)
        self._ctx.run(self._fn, self._name, self._argv)
        hold = self.engine.capture_hold
        if hold is not None:
            hold(*self._holds)

    def __repr__(self) -> str:
        return f"Prepared({self._name})"

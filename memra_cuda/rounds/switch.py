"""A round's bodies by width, one of them chosen on the device every round (docs/lengths.md,
"Running the chosen width"): the length chooser writes the batch's width W to width_d, a
selector kernel (spec_select_width) turns it into a conditional SWITCH node's value, and the
node runs the body built for W: a draft chain of W steps and a verify of W + 1 tokens a row. No
host sync, no re-capture: the width a round runs is a device value like every other.

Widths says which widths have a body (each body costs a compile and a capture, so a round has a
few, k among them); a width the chooser might pick that has no body of its own runs the
narrowest wider one, its rows capped at their lengths, which keeps the round exact, and its
cost is left out of the chooser's (`verify_costs`), so it is not picked. WidthSwitch adds the
SWITCH of a round's bodies to a graph being built (LoopBuilder).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..buffers.lengths import DraftLengths
from ..driver.graph import LoopBuilder, check_switch
from ..driver.values import TEXT_LIKE, as_size
from ..kernels.signatures import load

if TYPE_CHECKING:
    from ..driver.module import Launch


def _collection(widths: object, bounds: str) -> Iterable[int]:
    """`widths` where it is a collection of widths: not text or bytes (a bytearray's ints were
    read as widths), nor a mapping, whose keys are not widths given as such (a decoder took a
    dict's keys without a word), nor a 0-d array (its iteration's TypeError named nothing)."""
    if (isinstance(widths, (*TEXT_LIKE, Mapping)) or not isinstance(widths, Iterable)
            or getattr(widths, "ndim", None) == 0):
        raise TypeError(f"widths must be a collection of ints {bounds}, not {widths!r}")
    return widths


@dataclass(frozen=True)
class Widths:
    """The widths, 0 to `k`, that a round has a body of, k always among them (the widest: every
    width runs a body at least as wide)."""

    k: int
    widths: tuple[int, ...]

    def __post_init__(self) -> None:
        """The checked plain ints are kept, k among them: a numpy k's arithmetic wraps (uint8 255
        + 1 is 0, so body_of was empty), and the selector on the device reads body_of. The widths
        are any collection of ints (sorted here) but a string or a mapping, whose keys are not
        widths given as such; at most k + 2 of them (each of 0..k once, and k again: a decoder's k
        beside its caller's), read no further, so an endless iterator is refused, where
        itertools.repeat(1) was read for ever."""
        k = as_size(self.k, "k", 0)
        given = _collection(self.widths, "from 0 to k (k among them)")
        widths = tuple(as_size(width, "a width", 0, k) for width in itertools.islice(given, k + 3))
        if len(widths) > k + 2:
            raise ValueError(f"widths name at most k + 2 = {k + 2} widths (each of 0..k once, and k again), not more")
        if k not in widths:
            raise ValueError(f"the widths a round has bodies of must include k = {k} (the widest), not {widths}")
        object.__setattr__(self, "k", k)
        object.__setattr__(self, "widths", tuple(sorted(set(widths))))

    @classmethod
    def beside(cls, k: int, narrower: Iterable[int]) -> Widths:
        """A chain decoder's widths: the `narrower` ones its caller gave (any of 0 to k), checked
        as a collection before k joins them, and k; read up to one past the most Widths takes (k + 1
        of the caller's: an endless iterator was unpacked for ever, Ctrl-C unheard, before it)."""
        k = as_size(k, "k", 0)  # before it bounds the read: a numpy k + 2 wraps
        return cls(k, (*itertools.islice(_collection(narrower, "from 0 to k (k is added)"), k + 2), k))

    @property
    def body_of(self) -> tuple[int, ...]:
        """For each width 0..k, the index (into `widths`) of the body that runs it: its own, or
        the narrowest wider one's."""
        return tuple(next(i for i, built in enumerate(self.widths) if built >= width) for width in range(self.k + 1))

    def costs(self, measured: Mapping[int, float]) -> list[float | None]:
        """DraftLengths' verify_costs: each width's measured cost where it has a body (`measured`
        must give every one, a mapping of width to cost), None where it has none, so the chooser
        never picks it. A list or an array of costs is refused (TypeError naming `measured`): its
        widths were looked for among its values (`in`), then its costs read by index, so one was
        taken by chance where a cost equalled a width, and refused as missing where none did."""
        if not isinstance(measured, Mapping):
            raise TypeError(f"measured must map each width to its cost ({{width: cost}}), not {measured!r}")
        missing = [width for width in self.widths if width not in measured]
        if missing:
            raise ValueError(f"no measured cost for the width(s) {missing} the round has bodies of")
        return [measured[width] if width in self.widths else None for width in range(self.k + 1)]


class WidthSwitch:
    """The SWITCH of a round's bodies by the width `lengths` chooses (DraftLengths of the round's
    buffers, their k `widths.k`): body_of on the device, and for each SWITCH node added
    (`add`), its own condition and the selector launch that sets it. Needs a CUDA 12.8+ driver
    (SwitchUnsupported, raised here, before anything is allocated)."""

    def __init__(self, lengths: DraftLengths, widths: Widths):
        if not isinstance(lengths, DraftLengths):
            raise TypeError(f"a switch by width reads a DraftLengths' width, not {lengths!r}")
        if not isinstance(widths, Widths) or widths.k != lengths.k:
            raise ValueError(f"the widths must be Widths of k = {lengths.k}, the lengths' k, not {widths!r}")
        check_switch()
        self.lengths, self.widths, engine = lengths, widths, lengths.engine
        self.kernel = load(engine, "device_loop").kernel("spec_select_width")
        self.body_of_d = engine.htod(np.array(widths.body_of, np.uint32), label="body_of")

    def select(self, handle: Any) -> Launch:
        """The selector of the SWITCH node on `handle` (a LoopBuilder's handle()): its condition
        set to the body of the width chosen this round. One thread."""
        return self.kernel.prepare(grid=1, block=32).set(width_d=self.lengths.width_d, body_of=self.body_of_d,
                                                         k=self.widths.k, handle=int(handle))

    def add(self, builder: LoopBuilder, bodies: Sequence[Callable[[], None]]) -> None:
        """Into the graph `builder` builds, after everything so far: the selector, then a SWITCH
        node of `bodies`, one for each of the widths in order (each issues its work on the
        builder's stream)."""
        if len(bodies) != len(self.widths.widths):
            raise ValueError(f"need one body for each of the widths {self.widths.widths}, not {len(bodies)}")
        handle = builder.handle()
        builder.issue(self.select(handle))
        builder.switch(handle, bodies)

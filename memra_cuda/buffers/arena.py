"""Many device fields in one allocation: StreamBufs' and TreeBufs' state.

The fields of a burst's state lie one after another in one zeroed allocation of 32-bit words,
so one copy reads several side by side (StreamBufs' readback of rings, ctl rows, positions and
acceptance counts),
a tree kernel finds every field from one address, and one free frees them all.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import DTypeLike

if TYPE_CHECKING:
    from ..driver.buffer import DeviceBuffer
    from ..driver.engine import Engine


def carve(engine: Engine, batch: int, fields: Mapping[str, tuple[DTypeLike, int]],
          label: str) -> tuple[DeviceBuffer, dict[str, DeviceBuffer]]:
    """One zeroed allocation holding `fields` (name: (a 32-bit dtype, words per row)) in their
    order, `batch` rows each, row-major; returns it and each field's window, labelled by its name."""
    arena = engine.zeros(np.uint32, batch * sum(row for _, row in fields.values()), label=label)
    windows, start = {}, 0
    for name, (dtype, row) in fields.items():
        windows[name] = arena.view(start, batch * row, dtype, label=name)
        start += batch * row
    return arena, windows

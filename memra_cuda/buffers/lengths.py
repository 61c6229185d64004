"""Each row's draft length, chosen on the device every round (docs/lengths.md): the buffers of the
length chooser (spec_choose_lengths) beside a StreamBufs.

The chooser keeps each row's running acceptance (rate_d), is told each request's most draft
length (cap_d) and the measured costs of the widths (cost_d), and decides the batch's width
(width_d) and each row's length, which it writes as the row's acceptance cap into the StreamBufs'
brk_d. The host writes caps and costs between bursts; graphs captured over them stay valid.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..driver.values import as_listed, as_real, as_size
from .arena import carve
from .layout import COST_DRAFT, COST_VERIFY, RATE_ACCEPTED, RATE_REJECTED, RATE_WORDS
from .stream_bufs import StreamBufs, row_values

if TYPE_CHECKING:
    from ..driver.buffer import DeviceBuffer

DECAY = 0.9  # a round's weight a round later: a row's estimate follows its last ten or so rounds
PRIOR = 0.5  # a fresh row's estimate, worth one judged draft: neither way, until its rounds say


class DraftLengths:
    """The length chooser's buffers for the rows of `bufs` (docs/lengths.md).

    `verify_costs[w]`, w = 0..k, is the measured cost of the batch's verify of w + 1 tokens a
    row, in plain steps (`verify_costs[0]`, the plain step, is 1), or None for a width the
    rounds do not run (the chooser never picks it); `draft_cost` a draft step's,
    in the same unit. `decay` (0 to below 1) is what a round's statistics weigh a round later,
    `prior` (above 0, up to 1) the acceptance a row starts from when it is admitted, and the one
    a round at length 0 (nothing judged) decays its statistics toward. Every row's cap starts at k
    (speculation on, at the full width); set a request's cap when its row is admitted
    (`set_cap_row`, beside `bufs.start_row`), before its first round.
    """

    # One allocation, in this order (docs/lengths.md, "DraftLengths"):
    rate_d: DeviceBuffer  # f32[B][RATE_WORDS]: each row's decayed drafts accepted and rounds that rejected one
    cap_d: DeviceBuffer  # u32[B]: each row's most draft length, its request's (0: speculation off)
    cost_d: DeviceBuffer  # f32[COST_VERIFY + k + 1]: a draft step's cost, then each width's verify
    width_d: DeviceBuffer  # u32[1]: the batch's width, chosen each round: the selector a SWITCH reads

    def __init__(self, bufs: StreamBufs, verify_costs: Sequence[float | None], draft_cost: float, decay: float = DECAY,
                 prior: float = PRIOR):
        if not isinstance(bufs, StreamBufs):
            raise TypeError(f"DraftLengths are made for a StreamBufs, not {bufs!r}")
        self.bufs, self.engine, self.k, self.batch = bufs, bufs.engine, bufs.k, bufs.batch
        # a decay of 1 or a prior of 0 would settle the width at 0 for good: a round at length 0
        # moves no statistics (decay 1), or moves them toward an acceptance of 0 (prior 0)
        self.decay, self.prior = _fraction(decay, "decay", refused=1.0), _fraction(prior, "prior", refused=0.0)
        costs = self._costs(verify_costs, draft_cost)
        self._arena, fields = carve(self.engine, 1, {
            "rate_d": (np.float32, self.batch * RATE_WORDS), "cap_d": (np.uint32, self.batch),
            "cost_d": (np.float32, costs.size), "width_d": (np.uint32, 1)}, label="draft lengths")
        vars(self).update(fields)  # each the attribute the class declares
        # Every row's statistics start at the prior, as the kernel restarts an admitted row's: a
        # row already live when these are made (keep >= 1) is never restarted, and zeros are an
        # acceptance of 0, which can settle the width at 0, where no row learns any more.
        rate = np.zeros((self.batch, RATE_WORDS), np.float32)
        prior32 = np.float32(self.prior)
        rate[:, RATE_ACCEPTED], rate[:, RATE_REJECTED] = prior32, np.float32(1) - prior32
        self.engine.copy_htod(self.rate_d, rate.reshape(-1))
        self.engine.copy_htod(self.cost_d, costs)
        self.engine.copy_htod(self.cap_d, np.full(self.batch, self.k, np.uint32))

    def set_costs(self, verify_costs: Sequence[float | None], draft_cost: float) -> None:
        """New measured costs (as the constructor takes them), for the rounds to come."""
        costs = self._costs(verify_costs, draft_cost)
        self.bufs.check_free()
        self.engine.copy_htod(self.cost_d, costs)

    def set_caps(self, caps: int | Sequence[int] | np.ndarray) -> None:
        """Every row's most draft length, one for all or one per row, each from 0 (speculation off:
        the row decodes as the plain target does) to k."""
        self._write_caps(0, row_values(caps, self.batch, "caps")[0])

    def set_cap_row(self, row: int, cap: int) -> None:
        """Row `row`'s most draft length (0 to k): its request's, set when the row is admitted."""
        row = as_size(row, "row", 0, self.batch - 1)
        self._write_caps(row, [cap])

    def _write_caps(self, first: int, caps: Sequence[object]) -> None:
        checked = [as_size(cap, f"the cap of row {first + i}", 0, self.k) for i, cap in enumerate(caps)]
        self.bufs.check_free()
        self.engine.copy_htod(self.cap_d, np.array(checked, np.uint32), start=first)

    def _costs(self, verify_costs: Sequence[float | None], draft_cost: float) -> np.ndarray:
        """cost_d's words, checked: k + 1 verify costs, each positive or None (a width the rounds
        do not run: NaN, which the chooser leaves out whatever the draft cost adds to it, where a
        0 would be weighed as W draft steps), at least one of them positive, and a draft
        step's cost of at least 0, all finite as f32 (a cost the chooser could not weigh is
        refused here). They come as a list, a tuple or a 1-D array, in width order: a mapping's
        or a set's iteration would give its keys or an order of its own as the costs."""
        verify = as_listed(verify_costs, "verify_costs", "costs, one a width in order", self.k + 1)
        if len(verify) != self.k + 1:
            raise ValueError(f"verify_costs needs one cost per width 0..k ({self.k + 1}), not {len(verify)}")
        if all(cost is None for cost in verify):
            raise ValueError("verify_costs leaves every width out (None): the rounds run at least one")
        costs = np.empty(COST_VERIFY + self.k + 1, np.float32)
        costs[COST_DRAFT] = _cost(draft_cost, "draft_cost", positive=False)
        for w, cost in enumerate(verify):
            costs[COST_VERIFY + w] = np.nan if cost is None else _cost(cost, f"verify_costs[{w}]", positive=True)
        return costs

    def __repr__(self) -> str:
        return f"DraftLengths(k={self.k}, batch={self.batch}, decay={self.decay}, prior={self.prior})"


def _fraction(value: object, what: str, refused: float) -> float:
    """`value` as a float from 0 to 1 but its `refused` end, as the f32 the chooser reads (NaN
    never is): at a decay of 1 or a prior of 0 (0.99999999 is 1 as an f32, 1e-50 is 0), a batch
    whose width fell to 0 would keep it there, no row judged again."""
    number = as_real(value, what)
    with np.errstate(over="ignore"):
        as_f32 = float(np.float32(number))
    if not 0.0 <= as_f32 <= 1.0 or as_f32 == refused:
        bounds = "from 0 to below 1" if refused else "above 0, up to 1"
        why = ": a width at 0 would stay there, every row's speculation off for good" if as_f32 == refused else ""
        raise ValueError(f"{what} must be a number {bounds} as an f32, not {value!r}{why}")
    return number


def _cost(value: object, what: str, positive: bool) -> np.float32:
    """`value` as the f32 the chooser reads, refused unless finite there and positive (or at
    least 0, where not `positive`): 1e-50 is 0 as an f32, and 1e39 infinite."""
    with np.errstate(over="ignore"):
        number = np.float32(as_real(value, what))
    if not (np.isfinite(number) and (number > 0 if positive else number >= 0)):
        raise ValueError(f"{what} must be {'positive' if positive else 'at least 0'} and finite as an f32, "
                         f"not {value!r}")
    return number

"""Host values onto the device without waiting for it.

`torch.tensor(values, device="cuda")` copies from pageable memory and then synchronises the
current stream: the host waits for every kernel queued before the copy, and the GPU then idles
while the host queues what comes next. A request's start (its rows, prompt lengths, pending and
seeds, a prefill after another) made six such waits, so the GPU sat idle between a request's
prefills and its first burst for as long as the host took to queue them. Through pinned memory and
a non-blocking copy the host queues on while the GPU works; torch's pinned allocator keeps the
block until the copy has run.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def uploaded(values: Sequence[Any] | torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`values` (a sequence, or a tensor on the host) as a tensor of `dtype` on `device`, queued on
    the current stream without synchronising it (a CPU device gets the host's tensor)."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)

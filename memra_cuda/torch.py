"""memra_cuda inside a PyTorch engine (optional: needs `torch`; nothing else imports this).

Three things make the embedding correct rather than merely possible:

- **One stream.** `engine()` borrows torch's current stream, so memra's kernels and the
  model's torch ops are ordered by the stream itself, with no synchronisation in between.
  Graph capture needs a stream other than the default one: create the engine inside
  `with torch.cuda.stream(torch.cuda.Stream()):`.
- **Shared memory.** `buffer(tensor)` adopts a tensor without copying (any API that takes a
  buffer takes a tensor too); `tensor(buf)` is the other direction, a tensor on memra's memory.
- **Capture torch knows about.** `capture` records a round-stream burst through
  `torch.cuda.graph` with a private memory pool kept alive with the graph, so torch's
  allocator never hands the graph's scratch memory to tensors allocated later: pass
  `capture=memra_cuda.torch.capture` to `Graph` or `RoundStream`.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .driver.buffer import DeviceBuffer
from .driver.engine import Engine
from .driver.errors import CaptureError, driver

_TYPESTR = {torch.bool: "|b1", torch.uint8: "|u1", torch.int8: "|i1", torch.int16: "<i2", torch.int32: "<i4",
            torch.int64: "<i8", torch.float16: "<f2", torch.float32: "<f4", torch.float64: "<f8"}


def engine(stream: torch.cuda.Stream | None = None) -> Engine:
    """An Engine on `stream` (default: torch's current stream), borrowed and never destroyed."""
    stream = stream if stream is not None else torch.cuda.current_stream()
    return Engine(stream.device.index, stream=stream.cuda_stream)


def buffer(tensor: torch.Tensor) -> DeviceBuffer:
    """The tensor's memory as a DeviceBuffer that keeps the tensor alive and owns nothing."""
    return DeviceBuffer.from_cuda_array(tensor)


class _Alias:
    """The `__cuda_array_interface__` of a buffer, reinterpreted as another element type."""

    def __init__(self, buf: DeviceBuffer, dtype: torch.dtype):
        size = torch.empty(0, dtype=dtype).element_size()
        if dtype not in _TYPESTR or size != buf.dtype.itemsize:
            raise ValueError(f"{buf!r} cannot be read as {dtype}: elements of {buf.dtype.itemsize} bytes")
        self.buf = buf  # torch keeps this object, and so the buffer, alive with the tensor
        self.__cuda_array_interface__ = {**buf.__cuda_array_interface__, "typestr": _TYPESTR[dtype]}


def tensor(buf: DeviceBuffer, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor on `buf`'s memory (no copy), read as `dtype` of the same size if given (u32
    token ids as torch.int32, say: ids are < 2**31). The tensor keeps `buf` alive; freeing
    `buf` explicitly while the tensor is in use is the caller's mistake to avoid."""
    source = buf if dtype is None else _Alias(buf, dtype)
    return torch.as_tensor(source, device=torch.device("cuda", buf.device))


def capture(engine: Engine, issue: Callable[[], None]) -> tuple[Any, Any]:
    """A `Capture` (see memra_cuda.driver.graph) through `torch.cuda.graph` on the engine's
    stream, with a private memory pool. The torch graph owns the executable graph; the
    memra Graph keeps it, and with it the pool, alive."""
    if engine.stream_handle in (0, 1, 2):
        raise CaptureError("the default stream cannot be captured: create the engine inside "
                           "`with torch.cuda.stream(torch.cuda.Stream()):`")
    graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    stream = torch.cuda.ExternalStream(engine.stream_handle, device=torch.device("cuda", engine.device))
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        issue()
    return driver().CUgraphExec(int(graph.raw_cuda_graph_exec())), (graph, pool)

"""memra_cuda: driver-level CUDA for inference engines, built around round-stream speculative
decoding (M rounds of draft + verify on one stream, one host readback per burst)."""
from .buffer import DeviceBuffer, PinnedBuffer
from .cache import Cache, KVLayer
from .engine import Engine
from .errors import CapacityError, CudaError, CudaUnavailable
from .event import Event
from .graph import Graph
from .module import Kernel, KernelArgs, Launch, Module
from .round_stream import StreamBufs, drain_ring, kv_len_ptr_table, kv_len_ptr_table_range
from .spec import RoundStream, SpecKernels

__all__ = [
    "CapacityError", "CudaError", "CudaUnavailable", "Engine", "DeviceBuffer", "PinnedBuffer", "Event", "Graph",
    "Module", "Kernel", "KernelArgs", "Launch", "Cache", "KVLayer", "StreamBufs", "drain_ring",
    "kv_len_ptr_table", "kv_len_ptr_table_range", "SpecKernels", "RoundStream",
]

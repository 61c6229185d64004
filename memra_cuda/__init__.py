"""memra_cuda: driver-level CUDA for inference engines, built around round-stream speculative
decoding (M rounds of draft + verify on one stream, one host readback per burst).

`memra_cuda.driver` is the general driver layer; round-stream (tables, bufs, kernels, stream)
is built on it; models (`memra_cuda.models.toy`) and the PyTorch adapter (`memra_cuda.torch`,
optional) sit at the edge.
"""
from .bufs import Readback, StreamBufs, drain_ring
from .driver import (CaptureError, CudaError, CudaFault, CudaUnavailable, DeviceBuffer, Engine, Event, Graph,
                     Kernel, KernelArgs, Launch, Module, PinnedBuffer)
from .kernels import SpecKernels
from .sampling import Sampling
from .stream import MODES, CapacityError, RoundStream, chain, kv_capacity
from .tables import Cache, KVLayer, PointerTable, kv_len_ptr_table, kv_len_ptr_table_range

__all__ = [
    "CapacityError", "CaptureError", "CudaError", "CudaFault", "CudaUnavailable", "Engine", "DeviceBuffer",
    "PinnedBuffer", "Event", "Graph", "Module", "Kernel", "KernelArgs", "Launch", "Cache", "KVLayer",
    "PointerTable", "StreamBufs", "Readback", "drain_ring", "kv_len_ptr_table", "kv_len_ptr_table_range",
    "SpecKernels", "Sampling", "RoundStream", "MODES", "chain", "kv_capacity",
]

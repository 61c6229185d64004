"""memra_cuda: driver-level CUDA for inference engines, built around round-stream speculative
decoding (M rounds of draft + verify on one stream, one host readback per burst).

`memra_cuda.driver` is the general driver layer; round-stream (tables, bufs, kernels, capacity,
pace, round, stream; for trees, tree and tree_kernels) is built on it; models
(`memra_cuda.models.toy`) and the PyTorch adapter (`memra_cuda.torch`, optional) sit at the edge.
"""
from .acceptance import Greedy, Sampling
from .bufs import BuffersHeld, Readback, StreamBufs, drain_ring
from .capacity import UNCHECKED, CapacityError, kv_capacity
from .compiler import CompileError, NvrtcUnavailable, compile
from .device_loop import Landed, RoundCapError
from .driver import (CaptureError, CudaError, CudaFault, CudaUnavailable, DeviceBuffer, Engine, Event, Graph,
                     Kernel, KernelArgs, Launch, LoopUnsupported, MappedBuffer, Module, PinnedBuffer, Prepared, Stream)
from .kernels import SpecKernels
from .round import ChainRound, Round, Stages, TreeRound, chain
from .stream import MODES, Mode, RoundStream
from .tables import (Cache, KVData, KVDataTable, KVLayer, PointerTable, StateIndexTable, StateLayer, StateTable,
                     kv_data_table, kv_len_ptr_table, kv_len_ptr_table_range, state_copy_table,
                     state_copy_table_range, state_flip_table)
from .tree import Candidates, DynamicTree, TreeBufs, TreeShape
from .tree_kernels import TreeKernels

__version__ = "0.2.0"  # the one place the version lives: pyproject.toml reads it (tool.hatch.version)

__all__ = [
    "CapacityError", "CaptureError", "CudaError", "CudaFault", "CudaUnavailable", "Stream", "Engine", "DeviceBuffer",
    "PinnedBuffer", "Event", "Graph", "Module", "Kernel", "KernelArgs", "Launch", "Prepared", "Cache", "KVLayer",
    "PointerTable", "UNCHECKED", "StreamBufs", "Readback", "drain_ring", "kv_len_ptr_table", "kv_len_ptr_table_range",
    "SpecKernels", "Greedy", "Sampling", "RoundStream", "Mode", "MODES", "Stages", "chain", "kv_capacity",
    "MappedBuffer", "LoopUnsupported", "Landed", "RoundCapError", "StateLayer", "StateTable", "StateIndexTable",
    "state_copy_table", "state_copy_table_range", "state_flip_table",
    "compile", "CompileError", "NvrtcUnavailable", "BuffersHeld", "Round", "ChainRound",
    "TreeRound", "TreeShape", "DynamicTree", "TreeBufs", "Candidates", "TreeKernels", "KVData", "KVDataTable",
    "kv_data_table",
]

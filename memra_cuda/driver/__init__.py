"""The general driver layer: contexts, engines, owned buffers, modules, launches, graphs and
events over `cuda.bindings.driver`. It knows nothing of round-stream, which is built on it."""
from .buffer import DeviceBuffer, MappedBuffer, PinnedBuffer
from .call import Prepared
from .engine import Engine
from .compiler import CompileError, NvrtcUnavailable, compile_ptx
from .errors import CaptureError, CudaError, CudaFault, CudaUnavailable, MemraError
from .event import Event
from .graph import Capture, Graph, LoopBuilder, LoopUnsupported, SwitchUnsupported, loops, stream_capture
from .handle import Handle
from .module import Kernel, Launch, Module
from .signature import Param, Signature
from .stream import Stream

__all__ = [
    "Capture", "CaptureError", "CompileError", "CudaError", "CudaFault", "CudaUnavailable", "DeviceBuffer", "Engine",
    "Event", "Graph", "Handle", "Kernel", "Launch", "LoopBuilder", "LoopUnsupported", "MappedBuffer", "MemraError",
    "Module", "NvrtcUnavailable", "Param", "PinnedBuffer", "Prepared", "Signature", "Stream", "SwitchUnsupported",
    "compile_ptx", "loops", "stream_capture",
]

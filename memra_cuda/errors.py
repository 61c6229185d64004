"""Every error of memra_cuda's own, in one place (docs/errors.md). They share one base,
MemraError; each is also the builtin that says what kind of failure it is."""
from .buffers.capacity import CapacityError
from .buffers.stream_bufs import BuffersHeld
from .comm.communicator import RankFailure, RanksDiverged
from .comm.library import NcclError, NcclUnavailable
from .comm.rendezvous import RankRefused
from .driver.compiler import CompileError, NvrtcUnavailable
from .driver.errors import CaptureError, CudaError, CudaFault, CudaUnavailable, MemraError, NotFused
from .driver.graph import LoopUnsupported, SwitchUnsupported
from .rounds.device_loop import RoundCapError
from .rounds.serving import RequestRefused

__all__ = ["BuffersHeld", "CapacityError", "CaptureError", "CompileError", "CudaError", "CudaFault", "CudaUnavailable",
           "LoopUnsupported", "MemraError", "NcclError", "NcclUnavailable", "NotFused", "NvrtcUnavailable",
           "RankFailure", "RankRefused", "RanksDiverged", "RequestRefused", "RoundCapError", "SwitchUnsupported"]

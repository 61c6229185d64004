"""Errors, and the one place where a driver result becomes a value or an exception.

The driver module is loaded lazily, on the first call that needs it, so that importing
memra_cuda (and running everything that needs no GPU) works on a machine without a driver.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any


class MemraError(Exception):
    """The base of every error of memra_cuda's own (memra_cuda.errors lists them): `except
    MemraError` catches what the library raises and nothing else. Each is also the builtin that
    says what kind of failure it is (RuntimeError, ValueError; NotFused a TypeError, RankRefused a
    PermissionError), so `except RuntimeError` works too. Bad arguments raise the builtins
    themselves (ValueError, TypeError)."""


class CudaError(MemraError, RuntimeError):
    """A driver call returned something other than CUDA_SUCCESS."""

    def __init__(self, code: int, name: str, message: str, call: str):
        self.code = code
        self.name = name
        self.message = message
        self.call = call
        super().__init__(f"{call} failed: {name}: {message}")


class CudaUnavailable(CudaError):
    """No NVIDIA driver (or no usable GPU) on this machine."""

    def __init__(self, reason: str, call: str = "cuInit"):
        self.code, self.name, self.message, self.call = -1, "CUDA_UNAVAILABLE", reason, call
        RuntimeError.__init__(self, reason)


class CudaFault(CudaError):
    """A kernel faulted, and the fault is sticky: the device's context is unusable until the
    process restarts (as in PyTorch). `name` is the fault's code, whichever call reported it;
    every later call on that device raises this again without reaching the driver."""

    def __init__(self, first: CudaError, device: int, call: str | None = None):
        self.first = first
        self.device = device
        self.code, self.name, self.message = first.code, first.name, first.message
        self.call = call or first.call
        if call is None:
            text = (f"{first}\nA kernel fault is sticky: the CUDA context of device {device} is unusable "
                    f"until the process restarts")
        else:
            text = (f"{call} refused: device {device} faulted earlier ({first.name}: {first.message}, reported "
                    f"by {first.call}); its CUDA context is unusable until the process restarts")
        RuntimeError.__init__(self, text)

    def again(self, call: str) -> CudaFault:
        """The error for a later call on the faulted device."""
        return CudaFault(self.first, self.device, call)


class NotFused(MemraError, TypeError):
    """memra_cuda.torch cannot run a model through its compiled step (memra_cuda.torch.fused): the
    message names the layer and the part. Here, at the ground, so that memra_cuda.errors has it
    without importing torch."""


class CaptureError(MemraError, RuntimeError):
    """Work that a CUDA graph cannot hold was asked for during a stream capture, or a capture of a
    stream sealed for serving (RoundStream.capture_graphs(seal=True))."""


# Errors after which the context cannot be used again (the CUDA programming guide's sticky
# errors): every later call would fail with them, named after whatever call came next.
STICKY = frozenset({
    "CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_HARDWARE_STACK_ERROR",
    "CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA_ERROR_MISALIGNED_ADDRESS", "CUDA_ERROR_INVALID_ADDRESS_SPACE",
    "CUDA_ERROR_INVALID_PC", "CUDA_ERROR_ASSERT", "CUDA_ERROR_LAUNCH_TIMEOUT", "CUDA_ERROR_ECC_UNCORRECTABLE",
})

_driver: ModuleType | None = None


def driver() -> ModuleType:
    """`cuda.bindings.driver`, initialised; CudaUnavailable in one sentence when it cannot be."""
    global _driver
    if _driver is None:
        _driver = _load_driver()
    return _driver


# The CUDA 12 driver's cuda-python (pyproject's floor, below CUDA 13's): named once for each refusal that says it.
CUDA12_BINDINGS = "cuda-python>=12.6.2.post1,<13"


def _load_driver() -> ModuleType:
    try:
        from cuda.bindings import driver as drv
    except ImportError:
        raise CudaUnavailable(
            f"cuda-python is not installed, so memra_cuda cannot reach the GPU: pip install '{CUDA12_BINDINGS}' for a "
            "CUDA 12 driver, 'cuda-python>=13,<14' for a CUDA 13 one (nvidia-smi names the driver's CUDA)"
        ) from None
    try:
        (err,) = drv.cuInit(0)
    except Exception:  # the binding's loader raises its own types when libcuda is missing
        raise CudaUnavailable(
            "no NVIDIA driver found (libcuda could not be loaded): memra_cuda needs an NVIDIA GPU and its driver"
        ) from None
    if err:
        raise CudaUnavailable(f"the NVIDIA driver found no usable GPU ({_name(err)})")
    err, version = drv.cuDriverGetVersion()
    refusal = None if err else bindings_refusal(_bindings_version(), _release(version))
    if refusal:
        raise CudaUnavailable(refusal, call="cuDriverGetVersion")
    return drv


def _bindings_version() -> str:
    from cuda import bindings
    return str(getattr(bindings, "__version__", ""))


def bindings_refusal(bindings: str, driver: tuple[int, int]) -> str | None:
    """Why cuda-python's bindings of release `bindings` ("13.3.0") cannot serve a driver of CUDA
    release `driver` ((12, 9)), or None where they can: bindings of a newer major release than the
    driver's call functions it lacks, each failing later with a code that names no version (CUDA
    13's bindings want a driver of 580 or later; a CUDA 12 driver is served by the 12.x bindings)."""
    major = bindings.split(".", 1)[0]
    if not major.isdigit() or int(major) <= driver[0]:
        return None
    fix = (f"pip install '{CUDA12_BINDINGS}', the CUDA 12 bindings, or a newer driver" if driver[0] == 12
           else "a driver of CUDA 12 or later")
    return (f"cuda-python's bindings {bindings} are for a CUDA {major} driver, and this machine's driver is CUDA "
            f"{driver[0]}.{driver[1]}: {fix}")


def _name(err: Any) -> str:
    return getattr(err, "name", None) or f"CUresult {int(err)}"


def error(err: Any, call: str) -> CudaError:
    """The CudaError for a failed call: the code's name and the driver's own words."""
    message = "no description from the driver"
    if _driver is not None:
        res, text = _driver.cuGetErrorString(err)
        if not res and text:
            message = text.decode() if isinstance(text, bytes) else str(text)
    return CudaError(int(err), _name(err), message, call)


def values(result: tuple) -> Any:
    """A successful binding result's values: None, the one value, or the tuple of values."""
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


def check(result: tuple, call: str) -> Any:
    """Unwrap a binding's `(CUresult, *values)`, raising CudaError on failure."""
    if result[0]:
        raise error(result[0], call)
    return values(result)


def call(name: str, *args: Any) -> Any:
    """Call the driver function `name` and check it, so failures name the call. For calls that
    belong to no context yet; everything else goes through PrimaryContext.call."""
    return check(getattr(driver(), name)(*args), name)


def driver_version() -> tuple[int, int]:
    """The CUDA release of this machine's driver, (major, minor) (cuDriverGetVersion, which needs
    no context); CudaUnavailable where there is no driver."""
    return _release(call("cuDriverGetVersion"))


def _release(version: Any) -> tuple[int, int]:
    """cuDriverGetVersion's int (12090) as its CUDA release, (major, minor) ((12, 9))."""
    return int(version) // 1000, int(version) % 1000 // 10

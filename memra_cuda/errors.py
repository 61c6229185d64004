"""Errors, and the one place where every driver call is checked.

The driver module is loaded lazily, on the first call that needs it, so that importing
memra_cuda (and running everything that needs no GPU) works on a machine without a driver.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any


class CudaError(RuntimeError):
    """A driver call returned something other than CUDA_SUCCESS."""

    def __init__(self, code: int, name: str, message: str, call: str):
        self.code = code
        self.name = name
        self.message = message
        self.call = call
        super().__init__(f"{call} failed: {name}: {message}")


class CudaUnavailable(CudaError):
    """No NVIDIA driver (or no usable GPU) on this machine."""

    def __init__(self, reason: str):
        self.code, self.name, self.message, self.call = -1, "CUDA_UNAVAILABLE", reason, "cuInit"
        RuntimeError.__init__(self, reason)


class CapacityError(ValueError):
    """A KV cache cannot hold the entries the next burst may append."""


_driver: ModuleType | None = None


def driver() -> ModuleType:
    """`cuda.bindings.driver`, initialised; CudaUnavailable in one sentence when it cannot be."""
    global _driver
    if _driver is None:
        _driver = _load_driver()
    return _driver


def _load_driver() -> ModuleType:
    try:
        from cuda.bindings import driver as drv
    except ImportError:
        raise CudaUnavailable(
            "cuda-python is not installed (pip install cuda-python), so memra_cuda cannot reach the GPU"
        ) from None
    try:
        (err,) = drv.cuInit(0)
    except Exception:  # the binding's loader raises its own types when libcuda is missing
        raise CudaUnavailable(
            "no NVIDIA driver found (libcuda could not be loaded): memra_cuda needs an NVIDIA GPU and its driver"
        ) from None
    if err:
        raise CudaUnavailable(f"the NVIDIA driver found no usable GPU ({_name(err)})")
    return drv


def _name(err: Any) -> str:
    return getattr(err, "name", None) or f"CUresult {int(err)}"


def error(err: Any, call: str, detail: str = "") -> CudaError:
    """The CudaError for a failed call: the code's name, the driver's own words, any detail."""
    message = "no description from the driver"
    if _driver is not None:
        res, text = _driver.cuGetErrorString(err)
        if not res and text:
            message = text.decode() if isinstance(text, bytes) else str(text)
    if detail:
        message += "\n" + detail
    return CudaError(int(err), _name(err), message, call)


def check(result: tuple, call: str) -> Any:
    """Unwrap a binding's `(CUresult, *values)`: None, the one value, or the tuple of values."""
    if result[0]:
        raise error(result[0], call)
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


def call(name: str, *args: Any) -> Any:
    """Call the driver function `name` and check it, so failures name the call."""
    return check(getattr(driver(), name)(*args), name)

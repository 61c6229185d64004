"""PTX modules, kernels, and prepared launches (PyCUDA's prepared calls, cudarc's LaunchArgs).

A prepared launch declares its argument types once and keeps their storage and the `void**`
table the driver reads in one place; launching it again is a single cuLaunchKernel call on a
prebuilt argument tuple, so per-launch Python work stays near the bare binding's cost.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from .buffer import DeviceBuffer, exact_int
from .errors import CudaError, call, driver, error

if TYPE_CHECKING:
    from .engine import Engine

_PTX_DIRS = (Path(__file__).parent / "ptx", Path(__file__).parent.parent / "ptx")

# "ptr" is a device pointer: a DeviceBuffer or an int.
ARG_TYPES = {"ptr": np.dtype(np.uint64), "u32": np.dtype(np.uint32), "i32": np.dtype(np.int32),
             "u64": np.dtype(np.uint64), "i64": np.dtype(np.int64), "f32": np.dtype(np.float32),
             "f64": np.dtype(np.float64)}


def packaged_ptx(name: str) -> str:
    """The committed ptx/<name>.ptx, from an installed package or a source checkout."""
    for folder in _PTX_DIRS:
        path = folder / f"{name}.ptx"
        if path.is_file():
            return path.read_text()
    raise FileNotFoundError(f"no {name}.ptx in {' or '.join(str(d) for d in _PTX_DIRS)}")


class KernelArgs:
    """Storage for one launch's arguments: an 8-byte slot each, and the pointer table to them.

    Only the values change between launches; the table (`pointer`, what cuLaunchKernel's
    kernelParams receives) is built once. Buffers passed as arguments are kept alive with the
    launch, so a prepared launch (or a graph captured from it) never outlives its memory by
    garbage collection; an explicit free() before the next launch remains the caller's call.
    """

    def __init__(self, types: Sequence[str]):
        unknown = [t for t in types if t not in ARG_TYPES]
        if unknown:
            raise ValueError(f"unknown argument type(s) {unknown}; use one of {sorted(ARG_TYPES)}")
        self.types = tuple(types)
        self.storage = np.zeros(max(1, len(types)), np.uint64)
        raw = self.storage.view(np.uint8)
        self._slots = [raw[8 * i: 8 * i + ARG_TYPES[t].itemsize].view(ARG_TYPES[t])
                       for i, t in enumerate(self.types)]
        base = self.storage.ctypes.data
        self.table = np.array([base + 8 * i for i in range(len(types))] or [0], np.uint64)
        self.pointer = int(self.table.ctypes.data)
        self.buffers: list[DeviceBuffer | None] = [None] * len(self.types)

    def set(self, *values: Any) -> None:
        """Store new values; all are checked before any is written, so a refused call leaves
        the previous arguments whole."""
        if len(values) != len(self.types):
            raise TypeError(f"kernel takes {len(self.types)} arguments {self.types}, got {len(values)}")
        checked = [self._convert(i, kind, value) for i, (kind, value) in enumerate(zip(self.types, values))]
        for i, (slot, value) in enumerate(zip(self._slots, checked)):
            slot[0] = value
            self.buffers[i] = values[i] if isinstance(values[i], DeviceBuffer) else None

    @staticmethod
    def _convert(i: int, kind: str, value: Any) -> int | float:
        if isinstance(value, DeviceBuffer):
            if kind not in ("ptr", "u64"):
                raise TypeError(f"argument {i} is {kind}, not a device pointer")
            return value.ptr
        if kind == "ptr" and not isinstance(value, (int, np.integer)):
            raise TypeError(f"argument {i} is a device pointer: pass a DeviceBuffer or an int, not {value!r}")
        dtype = ARG_TYPES[kind]
        try:
            return float(value) if dtype.kind == "f" else exact_int(value, dtype)
        except TypeError as exc:
            raise TypeError(f"argument {i} ({kind}) cannot take {value!r}") from exc
        except ValueError as exc:
            raise ValueError(f"argument {i} ({kind}): {exc}") from exc


class Launch:
    """A kernel bound to a grid, a block, a stream and reusable argument storage."""

    def __init__(self, kernel: Kernel, types: Sequence[str], grid: int | Sequence[int],
                 block: int | Sequence[int], shared: int = 0):
        engine = kernel.module.engine
        self.kernel = kernel
        self.args = KernelArgs(types)
        self._activate = engine.activate
        self._launch = driver().cuLaunchKernel
        self._argv = (kernel.handle, *_dim3(grid, "grid"), *_dim3(block, "block"), int(shared),
                      engine.stream, self.args.pointer, 0)

    def set(self, *values: Any) -> Launch:
        self.args.set(*values)
        return self

    def __call__(self, *values: Any) -> None:
        """Launch on the engine's stream, first storing `values` if any are given."""
        if values:
            self.args.set(*values)
        self._activate()
        (err,) = self._launch(*self._argv)
        if err:
            raise error(err, f"cuLaunchKernel({self.kernel.name})")


class Kernel:
    """One function of a loaded module."""

    def __init__(self, module: Module, name: str):
        self.module = module
        self.name = name
        try:
            self.handle = call("cuModuleGetFunction", module.handle, name.encode())
        except CudaError as exc:
            raise ValueError(f"the module has no kernel named {name!r}") from exc

    def prepare(self, types: Sequence[str], grid: int | Sequence[int] = 1,
                block: int | Sequence[int] = 1, shared: int = 0) -> Launch:
        return Launch(self, types, grid, block, shared)

    def __repr__(self) -> str:
        return f"Kernel({self.name})"


class Module:
    """A PTX image JIT-compiled into the engine's context.

    Modules are never unloaded explicitly: they live as long as the context, which frees them
    when its last owner lets go, so no unload can run against a dead context at exit.
    """

    def __init__(self, engine: Engine, ptx: str | bytes):
        image = ptx.encode() if isinstance(ptx, str) else bytes(ptx)
        image = image[:-1] if image.endswith(b"\0") else image
        if b"\0" in image:
            raise ValueError("the PTX image contains a NUL byte before its end")
        self.engine = engine
        self._kernels: dict[str, Kernel] = {}
        engine.activate()
        self.handle = _load(image + b"\0")

    def kernel(self, name: str) -> Kernel:
        if name not in self._kernels:
            self._kernels[name] = Kernel(self, name)
        return self._kernels[name]


def _load(image: bytes) -> Any:
    drv = driver()
    log = bytearray(16384)
    opts = [drv.CUjit_option.CU_JIT_ERROR_LOG_BUFFER, drv.CUjit_option.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES]
    err, handle = drv.cuModuleLoadDataEx(image, len(opts), opts, [log, len(log)])
    if err:
        jit_log = bytes(log).split(b"\0", 1)[0].decode(errors="replace").strip()
        raise error(err, "cuModuleLoadDataEx", detail=f"JIT log:\n{jit_log}" if jit_log else "")
    return handle


def _dim3(dims: int | Sequence[int], what: str) -> tuple[int, int, int]:
    d = (int(dims),) if isinstance(dims, (int, np.integer)) else tuple(int(x) for x in dims)
    if not 1 <= len(d) <= 3 or min(d) < 1:
        raise ValueError(f"{what} must be 1 to 3 positive sizes, not {dims!r}")
    return d + (1,) * (3 - len(d))

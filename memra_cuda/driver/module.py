"""PTX modules, kernels, and prepared launches (PyCUDA's prepared calls, cudarc's LaunchArgs).

A prepared launch declares its argument types once and keeps their storage and the `void**`
table the driver reads in one place; launching it again is a single cuLaunchKernel call on a
prebuilt argument tuple, so per-launch Python work stays near the bare binding's cost. A module
loaded with a signature table (signature.py) checks the declared types against the kernel's at
prepare, and gives them where a launcher leaves them out; its launches take their arguments by
the table's names.

Thread safety: modules and kernels may be shared between threads. A Launch may not: its
argument store is written by set() and read by the driver at the next launch, so two threads
setting and launching the same Launch would launch each other's arguments. Give each thread
its own Launch (kernel.prepare() is cheap).
"""
from __future__ import annotations

import functools
import math
import reprlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .buffer import DeviceBuffer, as_buffer
from .call import Prepared
from .errors import CudaError, CudaFault, driver
from .handle import Handle
from .signature import ARG_TYPES, Signature, arguments, is_arg_type
from .stream import Stream, as_engine_stream
from .values import as_index, as_size, c_string, exact_int

if TYPE_CHECKING:
    from .context import PrimaryContext

_PTX_DIRS = (Path(__file__).parent.parent / "ptx", Path(__file__).parent.parent.parent / "ptx")


def packaged_ptx(name: str) -> str:
    """The committed ptx/<name>.ptx, from an installed package or a source checkout; `name` is
    checked by ptx_name (a path reached outside ptx/)."""
    name = ptx_name(name)
    for folder in _PTX_DIRS:
        path = folder / f"{name}.ptx"
        if path.is_file():
            return path.read_text()
    raise FileNotFoundError(f"no {name}.ptx in {' or '.join(str(d) for d in _PTX_DIRS)}")


class KernelArgs:
    """Storage for one launch's arguments: an 8-byte slot each, and the pointer table to them.

    Only the values change between launches; the table (`pointer`, what cuLaunchKernel's
    kernelParams receives) is built once. `buffers` holds the buffer passed in each slot, so
    the memory stays alive as long as the arguments name it. With `engine`, a buffer that
    belongs to another engine is refused: its work is ordered by another stream.

    A refused value's error names its slot: `kernel` and the parameters' `names` (a Launch of a
    kernel with a signature gives both: "spec_ring_commit: ring_cap (u32): ..."), else its
    position ("argument 6 (u32): ..."). The labels are made here, once, and read only by an error.
    """

    def __init__(self, types: Sequence[str], engine: Stream | None = None, *, kernel: str | None = None,
                 names: Sequence[str] | None = None):
        self.types = tuple(types)
        unknown = [t for t in self.types if not is_arg_type(t)]  # a list among them met "unhashable type"
        if unknown:
            where = "" if kernel is None else f"{kernel}: "
            raise ValueError(f"{where}unknown argument type(s) {unknown}; use one of {sorted(ARG_TYPES)}")
        if names is not None and len(names) != len(self.types):
            raise ValueError(f"{len(names)} parameter names given for {len(self.types)} arguments {self.types}")
        self._labels = tuple(_label(i, kind, kernel, None if names is None else names[i])
                             for i, kind in enumerate(self.types))
        self.engine = engine
        self.storage = np.zeros(max(1, len(self.types)), np.uint64)
        raw = self.storage.view(np.uint8)
        self._slots = [raw[8 * i: 8 * i + ARG_TYPES[t].itemsize].view(ARG_TYPES[t])
                       for i, t in enumerate(self.types)]
        base = self.storage.ctypes.data
        self.table = np.array([base + 8 * i for i in range(len(self.types))] or [0], np.uint64)
        self.pointer = int(self.table.ctypes.data)
        self.buffers: list[DeviceBuffer | None] = [None] * len(self.types)

    @classmethod
    def of_kernel(cls, kernel: str, signature: Signature | None, types: Sequence[str],
                  engine: Stream | None = None) -> KernelArgs:
        """The storage of a launch of `kernel` with `types` (Kernel.declared's): its errors name
        the kernel, and each parameter by its name where the kernel has a `signature`."""
        return cls(types, engine, kernel=kernel,
                   names=None if signature is None else [param.name for param in signature.params])

    def set(self, *values: Any) -> None:
        """Store new values; all are checked before any is written, so a refused call leaves
        the previous arguments whole."""
        if len(values) != len(self.types):
            raise TypeError(f"kernel takes {len(self.types)} arguments {self.types}, got {len(values)}")
        buffers = [self._buffer(what, kind, value) for what, kind, value in zip(self._labels, self.types, values)]
        checked = [self._convert(what, kind, value if buf is None else buf)
                   for what, kind, value, buf in zip(self._labels, self.types, values, buffers)]
        for slot, value in zip(self._slots, checked):
            slot[0] = value
        self.buffers = buffers

    def _buffer(self, what: str, kind: str, value: Any) -> DeviceBuffer | None:
        if not (isinstance(value, DeviceBuffer) or hasattr(value, "__cuda_array_interface__")):
            return None
        if kind not in ("ptr", "u64"):
            raise TypeError(f"{what} cannot take a device pointer ({type(value).__name__})")
        buf = as_buffer(value, what, self.engine)
        if self.engine is not None:
            self.engine.check_owns(buf, what)
        return buf

    @staticmethod
    def _convert(what: str, kind: str, value: Any) -> int | float:
        """`value` as the number slot `what` (of type `kind`) stores: a bool is no integer,
        pointer or float here (True would be stored as 1, an address of 1), and a number the
        type cannot hold is refused, never wrapped or stored as an infinity."""
        if isinstance(value, DeviceBuffer):
            return value.ptr
        dtype = ARG_TYPES[kind]
        if kind == "ptr" and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
            raise TypeError(f"{what} is a device pointer: pass a DeviceBuffer, an array with "
                            f"__cuda_array_interface__ or an int, not {value!r}")
        if dtype.kind == "f":
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise TypeError(f"{what} must be a number, not {value!r}")
            return _exact_float(what, value, dtype)
        try:
            return exact_int(value, dtype)
        except TypeError as exc:
            raise TypeError(f"{what} must be an integer, not {value!r}") from exc
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from exc


def _label(i: int, kind: str, kernel: str | None, name: str | None) -> str:
    """How an error names argument `i`: by its kernel and parameter where they are known."""
    where = f"argument {i}" if name is None else name
    return f"{where} ({kind})" if kernel is None else f"{kernel}: {where} ({kind})"


def _exact_float(what: str, value: int | float | np.integer | np.floating, dtype: np.dtype) -> float:
    """`value` as a float that `dtype` holds, rounded to its nearest: a finite value past its
    range (an int past every float, a longdouble past float64's) is refused, ValueError naming
    `what`, not stored as an infinity; an infinity or a NaN given as one is taken."""
    try:
        number = float(value)
    except OverflowError:  # an int past every float
        number = math.inf
    if math.isfinite(number):
        if abs(number) <= _FLOAT_MAX[dtype.itemsize]:
            return number
    elif isinstance(value, (float, np.floating)) and not np.isfinite(value):  # an inf or a NaN, as given
        return number
    raise ValueError(f"{what}: {value!r} is outside the range of {dtype.name}")


_FLOAT_MAX = {4: float(np.finfo(np.float32).max), 8: float(np.finfo(np.float64).max)}  # f32's, f64's


class Launch(Prepared):
    """A kernel bound to a grid, a block, the engine's stream and reusable argument storage.

    It holds the buffers its arguments name; if one of them is freed explicitly, the launch
    refuses to run (ValueError naming what was freed) until set() gives it live arguments
    again; if the module is unloaded or the engine closed (its stream destroyed), for good.
    Until the first set() it refuses too: a kernel with zeroed pointer arguments would fault.
    A Graph that captures the launch holds the buffers of that moment, so re-binding the
    launch later cannot strand the graph.

    A kernel with a signature takes its arguments by name (`set(k=4, B=8, ...)`), one without
    in order (signature.arguments); `signature` is the kernel's at prepare, the one its types
    were checked against.
    """

    def __init__(self, kernel: Kernel, types: Sequence[str] | None, grid: int | Sequence[int],
                 block: int | Sequence[int], shared: int = 0):
        declared = kernel.declared(types)  # a type swap is refused before anything else is asked
        module = kernel.module
        module._usable()
        engine = module.engine
        self.kernel, self.signature = kernel, kernel.signature
        self.args = KernelArgs.of_kernel(kernel.name, self.signature, declared, engine)
        kernel.check_sizes(self.args.types)
        argv = (kernel.handle, *_dim3(grid, f"{kernel.name}'s grid", GRID_LIMITS),
                *_block(block, f"{kernel.name}'s block"),
                as_size(shared, f"{kernel.name}'s dynamic shared memory (bytes)", 0, SHARED_MOST), engine.stream,
                self.args.pointer, 0)
        super().__init__(engine, driver().cuLaunchKernel, f"cuLaunchKernel({kernel.name})", argv, (module,))
        if self.args.types:
            self._refusal = f"{kernel.name} has no arguments yet: call set(...) before launching it"

    def set(self, *values: Any, **named: Any) -> Launch:
        """Store new arguments: by their parameters' names where the kernel has a signature, in
        order where it has none; all are checked before any is written."""
        self.args.set(*arguments(self.kernel.name, self.signature, values, named))
        self._bind((self.kernel.module, *self.args.buffers))
        if not (self.kernel.module.freed or self.engine.closed):
            self._refusal = None
        return self

    def add_node(self, graph: Any, after: Sequence[Any]) -> Any:
        """Add this launch, with its arguments now, to `graph` as a kernel node after the nodes
        `after` (graph.branch: work beside a capture); a Graph being captured holds what it names."""
        if self._refusal is not None:
            raise ValueError(self._refusal)
        func, gx, gy, gz, bx, by, bz, shared, _stream, params, _extra = self._argv
        node = driver().CUDA_KERNEL_NODE_PARAMS()
        node.func, node.sharedMemBytes, node.kernelParams = func, shared, params
        node.gridDimX, node.gridDimY, node.gridDimZ = gx, gy, gz
        node.blockDimX, node.blockDimY, node.blockDimZ = bx, by, bz
        added = self._ctx.call("cuGraphAddKernelNode", graph, list(after), len(after), node)
        self.engine._uses(*self._holds)
        return added

    def _poison(self, source: Handle, reason: str) -> None:
        if source in (self.kernel.module, self.engine) or any(b is not None and b.names(source)
                                                              for b in self.args.buffers):
            super()._poison(source, reason)

    def __repr__(self) -> str:
        return f"Launch({self.kernel.name})"


class Kernel:
    """One function of a loaded module."""

    def __init__(self, module: Module, name: str):
        self.module = module
        self.name = name = kernel_name(name)
        try:
            self.handle = module.engine.ctx.call("cuModuleGetFunction", module.handle, name.encode())
        except CudaError as exc:
            raise ValueError(f"the module has no kernel named {name!r}") from exc

    def prepare(self, types: Sequence[str] | None = None, grid: int | Sequence[int] = 1,
                block: int | Sequence[int] = 1, shared: int = 0) -> Launch:
        """A launch of `grid` blocks of `block` threads with `shared` bytes of dynamic shared
        memory, its arguments of `types` (ARG_TYPES' names, one a parameter). Where the module's
        signature table declares this kernel, `types` may be left out (the table's are taken),
        and given, must be the table's: TypeError naming the parameter otherwise."""
        return Launch(self, types, grid, block, shared)

    @property
    def signature(self) -> Signature | None:
        """The kernel's parameters as its module's signature table declares them; None where the
        table does not name it."""
        return self.module.signatures.get(self.name)

    def declared(self, types: Sequence[str] | None) -> tuple[str, ...]:
        """The argument types a launch packs: `types`, checked against the kernel's signature
        where it has one, or the signature's where `types` is None. Needs no driver."""
        signature = self.signature
        if signature is None:
            if types is None:
                raise TypeError(f"{self.name} has no signature in its module's table: give its argument types")
            return tuple(types)
        if types is None:
            return signature.types
        signature.check(self.name, types)
        return tuple(types)

    @functools.cached_property
    def param_sizes(self) -> tuple[int, ...] | None:
        """The kernel's parameter sizes in bytes, from cuFuncGetParamInfo (CUDA 12.4+), or None
        where the driver or the binding cannot tell."""
        drv = driver()
        try:
            count = self._param_count(drv)
            sizes: list[int] = []
            while count is None or len(sizes) < count:
                err, _offset, size = drv.cuFuncGetParamInfo(self.handle, len(sizes))
                if err:  # past the last parameter, when the count is unknown
                    return tuple(sizes) if count is None and err == drv.CUresult.CUDA_ERROR_INVALID_VALUE else None
                sizes.append(int(size))
            return tuple(sizes)
        except Exception:  # noqa: BLE001 - a binding or driver without cuFuncGetParamInfo
            return None

    def _param_count(self, drv: Any) -> int | None:
        """cuFuncGetParamCount (CUDA 12.8+ bindings and drivers), or None where it is missing."""
        try:
            err, count = drv.cuFuncGetParamCount(self.handle)
        except Exception:  # noqa: BLE001 - an older binding or driver
            return None
        return None if err else int(count)

    def check_sizes(self, types: Sequence[str]) -> None:
        """ValueError unless `types` match the kernel's parameter sizes, where the driver can say:
        run at every prepare, and all that is checked of a kernel its module has no signature for."""
        sizes = self.param_sizes
        declared = tuple(ARG_TYPES[t].itemsize for t in types)
        if sizes is not None and sizes != declared:
            raise ValueError(f"{self.name} takes {len(sizes)} parameter(s) of {list(sizes)} bytes, but "
                             f"{list(types)} declares {list(declared)}")

    def __repr__(self) -> str:
        return f"Kernel({self.name})"


class Module(Handle):
    """A PTX image JIT-compiled into the engine's context.

    `signatures` maps kernel names to their Signature (memra_cuda.driver.Signature): every
    prepare of a kernel it names checks the declared argument types against it, naming the
    parameter a u32 was given for an f32, say, and may leave the types out. A kernel the table
    does not name is checked by its parameter sizes alone, where the driver can tell them, and
    takes its arguments in order. For your own kernels: `Module(engine, compile_ptx(source),
    signatures={"scale": Signature.of(x="ptr", y="ptr", n="u32")})`, whose launches are then set
    by name: `set(x=src, y=dst, n=1000)`.

    `ptx` is the PTX text itself, a str or bytes (a bytearray, a memoryview): a file's is
    `Path(...).read_text()`, its Path being no PTX (a TypeError, as is anything else).

    Freed (unloaded) once, by free() or when the last kernel, launch or graph using it is
    gone; at interpreter exit the context takes its modules with it. Launches of an unloaded
    module refuse to run.
    """

    def __init__(self, engine: Stream, ptx: str | bytes, signatures: Mapping[str, Signature] | None = None):
        if not isinstance(ptx, (str, bytes, bytearray, memoryview)):
            # bytes() made a Path its name's bytes (loaded as PTX: the JIT's log, not the file's name),
            # an int that many NULs ("a NUL byte before its end") and a list of ints its bytes
            raise TypeError(f"ptx must be the PTX text (a str or bytes: a file's Path(...).read_text()), not "
                            f"{reprlib.repr(ptx)}")
        image = ptx.encode() if isinstance(ptx, str) else bytes(ptx)
        image = image[:-1] if image.endswith(b"\0") else image
        if b"\0" in image:
            raise ValueError("the PTX image contains a NUL byte before its end")
        self.engine = engine
        self.signatures: Mapping[str, Signature] = _table(signatures)
        self._kernels: dict[str, Kernel] = {}
        ctx = as_engine_stream(engine).activate()  # None failed on an attribute it lacks
        self.handle = _load(ctx, image + b"\0")
        self._own(ctx, "cuModuleUnload", self.handle, at_exit=False)

    def kernel(self, name: str) -> Kernel:
        """The module's kernel `name`, fetched from the driver once and the same Kernel after
        (ValueError where the module has no such kernel, or has been unloaded)."""
        self._usable()
        name = kernel_name(name)  # before the lookup: a list met its bare "unhashable type"
        if name not in self._kernels:
            self._kernels[name] = Kernel(self, name)
        return self._kernels[name]

    def declare(self, signatures: Mapping[str, Signature]) -> None:
        """Take `signatures` as this module's table, where it has none yet (a module loaded
        before its table was at hand: Engine.load_ptx's); ValueError where it has another."""
        if signatures is self.signatures:
            return
        table = _table(signatures)  # before it is compared: a list was "another signature table"
        if self.signatures and self.signatures != table:
            raise ValueError(f"{self!r} has another signature table already")
        self.signatures = table

    def __repr__(self) -> str:
        return f"Module({', '.join(self._kernels) or 'no kernels fetched'}{', unloaded' if self.freed else ''})"


def kernel_name(name: Any) -> str:
    """`name`, a kernel's, as a C string whole (values.c_string): a list met the kernel cache's
    "unhashable type", and a NUL ended the name cuModuleGetFunction looked up early."""
    return c_string(name, "a kernel's name")


def ptx_name(name: Any) -> str:
    """`name`, a packaged module's (ptx/<name>.ptx: "spec_stream", "probe"), if it is a str and an
    identifier, as every stem of ptx/ is: TypeError for anything else (a list met the module
    cache's bare "unhashable type"), ValueError for a str that is no plain stem ("../x" or "a/b"
    reached outside ptx/, to any file ending .ptx)."""
    if not isinstance(name, str):
        raise TypeError(f"a packaged module's name must be a str (ptx/<name>.ptx), not {reprlib.repr(name)}")
    if not name.isidentifier():
        raise ValueError(f"a packaged module's name is the stem of a file in ptx/, an identifier ('spec_stream'), "
                         f"not {name!r}")
    return name


def _table(signatures: Mapping[str, Signature] | None) -> Mapping[str, Signature]:
    """`signatures`, checked to map kernel names to Signatures (an empty table for None): a
    TypeError naming what is given otherwise, a list of Signatures or of pairs too (it met
    "'list' object has no attribute 'items'")."""
    if signatures is None:
        return {}
    if not isinstance(signatures, Mapping):
        raise TypeError("signatures must be a mapping of kernel names to Signatures ({'scale': "
                        f"Signature.of(x=\"ptr\", n=\"u32\")}}), not {reprlib.repr(signatures)}")
    wrong = [f"{name!r}: {sig!r}" for name, sig in signatures.items()
             if not isinstance(name, str) or not isinstance(sig, Signature)]
    if wrong:
        raise TypeError(f"signatures map kernel names to Signatures, not {', '.join(wrong)}")
    return signatures


def _load(ctx: PrimaryContext, image: bytes) -> Any:
    """cuModuleLoadDataEx in the context; a failure carries the JIT's own log."""
    drv = driver()
    log = bytearray(16384)
    opts = [drv.CUjit_option.CU_JIT_ERROR_LOG_BUFFER, drv.CUjit_option.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES]
    try:
        return ctx.run(drv.cuModuleLoadDataEx, "cuModuleLoadDataEx", (image, len(opts), opts, [log, len(log)]))[1]
    except CudaFault:
        raise
    except CudaError as exc:
        jit_log = bytes(log).split(b"\0", 1)[0].decode(errors="replace").strip()
        if not jit_log:
            raise
        raise CudaError(exc.code, exc.name, f"{exc.message}\nJIT log:\n{jit_log}", exc.call) from None


GRID_LIMITS = (2**31 - 1, 65535, 65535)  # CUDA's gridDim.x, .y, .z: a kernel giving rows a grid row has 65535
BLOCK_LIMITS = (1024, 1024, 64)  # CUDA's blockDim.x, .y, .z, on every GPU memra serves (sm_80 and up)
BLOCK_THREADS = 1024  # and a block's threads, x * y * z
SHARED_MOST = 2**32 - 1  # cuLaunchKernel's sharedMemBytes is an unsigned int


def _dim3(dims: int | Sequence[int], what: str, limits: tuple[int, int, int] | None = None) -> tuple[int, int, int]:
    """`dims` as (x, y, z): one int, or a list, tuple or 1-D array of one to three; TypeError
    naming `what` for a size that is no int (int() read a string's characters as sizes, "128" as
    a grid of (1, 2, 8), truncated 2.5 to 2 and took True as 1), and ValueError, before anything
    is queued, for what CUDA's launch would refuse: sizes past 3, below 1, or past `limits`."""
    sizes: Sequence[Any] = dims if isinstance(dims, (list, tuple)) or isinstance(dims, np.ndarray) and \
        dims.ndim == 1 else (dims,)
    try:
        given = tuple(as_index(x, what) for x in sizes)
    except TypeError:
        raise TypeError(f"{what} must be an int or 1 to 3 ints, not {dims!r}") from None
    if not 1 <= len(given) <= 3 or min(given) < 1:
        raise ValueError(f"{what} must be 1 to 3 positive sizes, not {dims!r}")
    x, y, z = given + (1,) * (3 - len(given))
    for axis, size, most in zip("xyz", (x, y, z), limits or (x, y, z)):
        if size > most:
            raise ValueError(f"{what} {(x, y, z)} is past CUDA's limit of {most} in {axis}")
    return x, y, z


def _block(dims: int | Sequence[int], what: str) -> tuple[int, int, int]:
    """`dims` as a block's (x, y, z), checked as _dim3 checks a grid, against BLOCK_LIMITS, and
    its threads against BLOCK_THREADS: ValueError naming `what` at prepare. A block was checked
    for its type and sign alone, and one past an unsigned int (2**32) reached cuLaunchKernel's
    binding at the first launch, an OverflowError naming nothing; one the driver refuses, its
    CUDA_ERROR_INVALID_VALUE at every launch."""
    x, y, z = _dim3(dims, what, BLOCK_LIMITS)
    if x * y * z > BLOCK_THREADS:
        raise ValueError(f"{what} {(x, y, z)} holds {x * y * z} threads, past CUDA's limit of {BLOCK_THREADS} a block")
    return x, y, z

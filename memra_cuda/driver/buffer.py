"""Device memory that frees itself exactly once, and pinned host memory for readbacks.

Thread safety: a buffer may be shared between threads (its memory is freed once, whichever
thread lets go last); what the threads queue into it is ordered by the stream, not by Python.
"""
from __future__ import annotations

import ctypes
import math
import reprlib
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import numpy as np
from numpy.typing import DTypeLike

from .errors import CaptureError, call, driver
from .values import U64_MOST, as_index, as_listed, as_size, device_dtype, short_name
from .handle import Handle
from .release import AtCollection, release_after
from .stream import Stream, as_engine_stream

if TYPE_CHECKING:
    from .context import PrimaryContext


class DeviceBuffer(Handle):
    """A typed 1-D array in device memory, like cudarc's CudaSlice.

    An owning buffer (`allocate`, `Engine.alloc`) frees its allocation once: by free(), by
    leaving a `with` block, or by its finaliser when it is collected. Views and adopted
    foreign memory own nothing: a view keeps its parent alive and dies with it; a foreign
    buffer keeps `keepalive` (the other framework's tensor, say) alive until it is freed, or,
    collected, until the streams that queued work on the memory have run it (queued_on).
    Any use after free raises ValueError without touching the driver, and so does every
    launch, graph or pointer table that holds this buffer's address (see Handle).

    `engine` is the engine whose stream orders the work on this memory (None for foreign
    memory, which any engine on `device` may use); `label` names the buffer in messages.
    """

    def __init__(self, ptr: int, dtype: DTypeLike, length: int, *, engine: Stream | None = None,
                 base: DeviceBuffer | None = None, keepalive: Any = None, device: int | None = None,
                 label: str | None = None):
        ptr, length = as_index(ptr, "ptr"), as_size(length, "length")
        self.dtype = device_dtype(dtype)
        if ptr <= 0:
            raise ValueError(f"a device buffer needs a device address, not {ptr:#x}")
        if ptr + length * self.dtype.itemsize > 2**64:
            raise ValueError(f"{length} elements at {ptr:#x} run past the end of the address space")
        self._ptr = ptr
        self.len = length
        self.engine = engine
        self.device = engine.device if engine is not None else device
        self.label = label
        self._base = base
        self._keepalive = keepalive
        # an adopted tensor's storage (from_cuda_array), whose memory a set_() leaves alive: where
        # held, the tensor (keepalive) is asked for its address at every use of ptr
        self._storage: Any = None
        # The streams that queued work on borrowed memory, held (the buffer keeps the stream that orders
        # its work, as an owning buffer keeps its engine), and from the first such work the release of what
        # the buffer keeps of the memory's owner at its collection, after that work (queued_on)
        self._streams: set[Stream] | None = None
        self._let_go: AtCollection | None = None
        self._holders: weakref.WeakSet | None = None  # what another framework keeps with this memory (hold)
        # whether __cuda_array_interface__ handed this memory's address out: its consumer keeps the buffer
        # object (the protocol's rule), not a holder, so free() leaves the release to the buffer's collection
        self._exported = False

    @classmethod
    def allocate(cls, engine: Stream, dtype: DTypeLike, length: int, *, label: str | None = None) -> DeviceBuffer:
        """A new buffer of `length` elements of `dtype` in the engine's device memory (cuMemAlloc),
        owned: released by free(), a `with` block or its collection. Refused inside a capture.
        engine.alloc (and zeros) is the usual way to it."""
        dtype = device_dtype(dtype)
        length = alloc_length(length, dtype)
        ctx, ptr = device_allocation(engine, length * dtype.itemsize)
        buf = cls(ptr, dtype, length, engine=engine, label=label)
        buf._own(ctx, "cuMemFree", ptr)
        return buf

    @classmethod
    def wrap(cls, ptr: int, dtype: DTypeLike, length: int, *, engine: Stream | None = None,
             keepalive: Any = None) -> DeviceBuffer:
        """Borrow memory allocated elsewhere: never freed here. Prefer from_cuda_array, which
        reads the type and size from the owner and keeps it alive. `engine`, where given, is the
        Engine whose stream orders work on the memory (TypeError naming it otherwise)."""
        engine = None if engine is None else as_engine_stream(engine)  # a wrong one failed at a later use
        return cls(ptr, dtype, length, engine=engine, keepalive=keepalive)

    @classmethod
    def from_cuda_array(cls, obj: CudaArray, engine: Stream | None = None) -> DeviceBuffer:
        """Adopt a contiguous `__cuda_array_interface__` object (v2/v3: a PyTorch tensor, a
        CuPy array) without owning it, keeping `obj` alive.

        With `engine`, work the engine queues on this memory is ordered after the stream the
        producer names (v3's `stream`: a handle, 1 the legacy default stream, 2 the per-thread
        one; None or none, nothing to wait for; 0, which the interface disallows, a ValueError),
        so nothing reads the tensor before it is written. A wait no capture can take is a
        CaptureError before anything is queued (Stream.check_wait): the engine's stream being
        captured and the producer's not of its capture, or the producer's being captured and the
        engine's not. Adopt such an array before capturing.
        Empty, masked, non-contiguous or host memory is a ValueError (a CPU tensor raises
        AttributeError when asked for the interface: that is host memory too), and so is a
        bfloat16 array, numpy having no bfloat16: adopt its memory as tensor.view(torch.int16).
        An interface's `data` that is no (pointer, read-only) pair, or `strides` that are neither
        None nor an int a dimension of its shape, is refused naming the object and the field.

        The buffer keeps `obj` as long as work memra queued on its memory may run: free() waits
        for the streams that queued it, and a buffer collected unfreed (an API's temporary
        adoption of a tensor passed in, say) lets go of `obj` only once those streams have run it
        (release.release_after), so a tensor dropped right after it was passed in does not hand
        its memory to the next tensor while memra's kernels still write it.

        A tensor (an object with `data_ptr()`, as torch's) can be moved under its owner's feet:
        `resize_`, `set_` or its storage resized to 0 (as FSDP does) leave this buffer's address
        naming memory torch may give to another tensor. Its storage is kept too (`set_` then
        leaves the old memory alive), and every use of `ptr` (a launch's arguments, a table, a
        copy) asks the tensor for its address: where it moved, ValueError, not a write into
        another tensor's memory. A graph or a table made before the move holds the old address:
        do not resize an adopted tensor, or adopt it again and rebuild them.
        """
        try:
            iface = obj.__cuda_array_interface__
        except AttributeError as exc:
            raise ValueError(f"{type(obj).__name__} is not device memory (no __cuda_array_interface__: a CUDA tensor "
                             f"or a CuPy array is): {exc}") from None
        if not isinstance(iface, Mapping) or not {"shape", "typestr"} <= iface.keys():  # a bare KeyError or TypeError
            raise TypeError(f"the __cuda_array_interface__ of {type(obj).__name__} must be a dict holding shape, "
                            f"typestr and data, not {reprlib.repr(iface)}")
        shape = _shape(iface["shape"])
        if isinstance(iface["typestr"], str) and iface["typestr"][1:] == "V2":  # torch's and ml_dtypes' bfloat16
            raise ValueError(f"a bfloat16 array (typestr {iface['typestr']!r}) cannot be a device buffer: numpy has no "
                             "bfloat16; adopt its memory as 2-byte ints, tensor.view(torch.int16) (an NCCL operation "
                             "reduces them with dtype='bfloat16'), or as 4-byte words where a kernel takes words")
        dtype = device_dtype(iface["typestr"])
        ptr = _data_pointer(iface.get("data"), obj)
        count = math.prod(shape)
        if iface.get("mask") is not None:
            raise ValueError("a masked array cannot be a device buffer")
        if count == 0:
            raise ValueError(f"an empty array (shape {shape}) cannot be a device buffer")
        strides = _strides(iface.get("strides"), shape, obj)
        if strides is not None and not _c_contiguous(shape, strides, dtype.itemsize):
            raise ValueError(f"array of shape {shape} with strides {strides} is not contiguous: "
                             "pass a contiguous copy")
        producer = None if engine is None or iface.get("stream") is None else _producer(iface["stream"])
        if engine is not None:
            engine.activate()
            if producer is not None:
                engine.check_wait(producer, f"{type(obj).__name__}'s __cuda_array_interface__")
        device = _device_of(ptr)
        buf = cls(ptr, dtype, count, keepalive=obj, device=device)
        storage = getattr(obj, "untyped_storage", None)
        if callable(getattr(obj, "data_ptr", None)) and callable(storage):
            buf._storage = storage()  # a tensor's: it can move (above)
        if engine is not None and producer is not None:
            engine.wait_stream(producer)
        return buf

    @property
    def freed(self) -> bool:
        """Whether this buffer, or the buffer it is a view of, was freed."""
        return self._freed or (self._base is not None and self._base._freed)

    @property
    def ptr(self) -> int:
        """The device address: ValueError once freed, or where an adopted tensor no longer holds
        this memory (from_cuda_array)."""
        if self._refusal is not None:
            raise ValueError(self._refusal)
        owner = self._base or self
        if owner._refusal is not None:
            raise ValueError(owner._refusal)
        if owner._storage is not None and owner._keepalive.data_ptr() != owner._ptr:
            raise ValueError(f"{owner!r} names memory its tensor no longer holds (the tensor was resized, or given "
                             f"another storage, and is at {owner._keepalive.data_ptr():#x} now): adopt it again")
        return self._ptr

    @property
    def nbytes(self) -> int:
        """The size in bytes: `len` elements of `dtype`."""
        return self.len * self.dtype.itemsize

    @property
    def owns_memory(self) -> bool:
        """Whether this buffer releases its memory (allocate's, engine.alloc's): a view, and
        memory wrapped or adopted (wrap, from_cuda_array), own none."""
        return self._finalizer is not None

    @property
    def foreign(self) -> Any:
        """The object whose memory this is and which it keeps alive (a tensor, say), or None."""
        return (self._base or self)._keepalive

    def __len__(self) -> int:
        return self.len

    def view(self, start: int, count: int, dtype: DTypeLike | None = None, *,
             label: str | None = None) -> DeviceBuffer:
        """A non-owning window [start, start+count) that keeps this buffer alive, read as
        `dtype` of the same size if given (i32 fields inside a u32 arena, say)."""
        start, count = as_index(start, "start"), as_size(count, "count")
        if not (0 <= start and start + count <= self.len):
            raise ValueError(f"view [{start}, {start + count}) is outside a buffer of {self.len}")
        dtype = self.dtype if dtype is None else device_dtype(dtype)
        if dtype.itemsize != self.dtype.itemsize:
            raise ValueError(f"a view of {self!r} cannot read {dtype.name}: elements of another size")
        return DeviceBuffer(self.ptr + start * self.dtype.itemsize, dtype, count, engine=self.engine,
                            base=self._base or self, device=self.device, label=label or self.label)

    def depend(self, dependent: Handle) -> None:
        """A dependent of a view also depends on the memory's owner; one that queues work on an
        engine (a launch, a graph, a table) tells borrowed memory that stream (queued_on), so its
        free() waits for it even once the dependent is gone (a launch made, run and dropped in
        one line, a graph dropped with its replay queued)."""
        super().depend(dependent)
        if self._base is not None:
            self._base.depend(dependent)
        elif self._keepalive is not None and (engine := getattr(dependent, "engine", None)) is not None:
            self.queued_on(engine)

    def queued_on(self, stream: Stream) -> None:
        """Work on this memory was queued on `stream` (a copy, a memset): if the memory is
        borrowed, free() waits for that stream before giving it back, and so does the buffer's
        collection, without waiting on the host: from the first such work, the buffer's finaliser
        hands what it keeps of the memory's owner to release_after, which drops it once the
        streams have run what they queued (release.py)."""
        owner = self._base or self
        if owner._keepalive is not None:
            if owner._streams is None:
                owner._streams = set()
                # a __del__ of its own (AtCollection), not a finalize on the owner, which held the owner's
                # keepalive from its registry: a tensor keeping its buffer was never collected
                owner._let_go = AtCollection(owner._streams, (owner._keepalive, owner._storage))
            owner._streams.add(stream)

    def hold(self, holder: Any) -> None:
        """`holder` (weakly referenced; what another framework keeps with a view of this memory: a
        torch tensor's source object, memra_cuda.torch.tensor) keeps the memory: free() then
        refuses memra's every use at once, as always, but the memory goes back only once every
        holder is collected, so no tensor reads memory the allocator has handed out again."""
        owner = self._base or self
        if owner._holders is None:
            owner._holders = weakref.WeakSet()
        owner._holders.add(holder)

    def names(self, handle: Handle) -> bool:
        """Whether freeing `handle` frees this buffer's memory."""
        return handle is self or handle is self._base

    def free(self) -> None:
        """Free the memory (owning buffers) or drop the borrow (views, foreign); idempotent.

        Borrowed memory goes back to its owner (a framework's allocator may hand it out again
        at once), so work already queued on it must finish first: the streams of everything
        that holds its address (launches, graphs, tables) are waited for before the borrow is
        dropped; a stream being captured, which no host may wait for, keeps the borrow until it
        has run that work (release_after). Memory a holder keeps (hold) goes back when the last
        holder is collected: its release (or its owner, borrowed) stays with this buffer, which
        every holder keeps. So does memory whose address __cuda_array_interface__ handed out: it
        goes back when this buffer is collected, which the consumer's array (keeping the buffer,
        as the protocol asks) prevents."""
        if self._freed:
            return
        captured: list[Stream] = []
        if self._keepalive is not None:
            for stream in list(self._streams or ()):  # every dependent's engine among them (depend)
                if stream.closed or stream.ctx.fault is not None:  # its work done, or lost with the context
                    continue
                if stream.capture_hold is not None or stream.capturing:
                    captured.append(stream)
                else:
                    stream.synchronize()
        if self._holders or self._exported:
            self._retire()  # refused from now on, dependents poisoned; the memory not yet released
            return
        if self._let_go is not None:
            self._let_go.keep = None  # released here, not at collection
        if captured:
            release_after(captured, (self._keepalive, self._storage))
        self._keepalive = self._storage = None
        super().free()

    @property
    def __cuda_array_interface__(self) -> dict:
        """Zero-copy access for CuPy, Numba, PyTorch (version 3 of the protocol).

        The array a consumer makes of it (torch.as_tensor(buf), cupy.asarray(buf)) holds the
        address and cannot refuse to run, so reading it exports the memory: the consumer keeps
        this buffer (the protocol's rule), and free() then refuses memra's use at once but gives
        the memory back only when the buffer is collected, once the arrays on it are gone (else
        free() pulled the memory from under them, their reads and writes landing in whatever the
        allocator handed it to next). memra_cuda.torch.tensor holds it more closely (hold)."""
        iface = self._interface()
        (self._base or self)._exported = True
        return iface

    def _interface(self) -> dict:
        """The protocol's dictionary, exporting nothing: for a reader that holds the memory its
        own way (memra_cuda.torch.tensor's hold)."""
        iface = {"shape": (self.len,), "typestr": self.dtype.str, "data": (self.ptr, False),
                 "strides": None, "version": 3}
        if self.engine is not None and not self.engine.closed:  # a closed engine finished its work, and
            iface["stream"] = self.engine.stream_handle or 1   # its stream is gone; 0 is not allowed: legacy is 1
        return iface

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"0x{self._ptr:x}"
        label = f"{self.label} " if self.label else ""
        return f"{type(self).__name__}({label}{short_name(self.dtype)}[{self.len}] at {state})"


class PinnedBuffer(Handle):
    """Page-locked host memory: the target of asynchronous (and graph-captured) readbacks.

    Reads hand out copies, so no numpy array can outlive the memory it would point into.
    """

    _flags = 0  # cuMemHostAlloc's

    def __init__(self, engine: Stream, dtype: DTypeLike, length: int, *, label: str | None = None):
        self.dtype = device_dtype(dtype)
        self.len = alloc_length(length, self.dtype)
        self.engine = engine
        self.label = label
        _no_alloc_in_capture(engine, "pinned memory")
        ctx = engine.activate()
        self._ptr = int(ctx.call("cuMemHostAlloc", self.nbytes, self._flags))
        self._own(ctx, "cuMemFreeHost", self._ptr)
        self._array = np.frombuffer(memoryview((ctypes.c_char * self.nbytes).from_address(self._ptr)), self.dtype)

    @property
    def ptr(self) -> int:
        """The host address of the pinned memory: ValueError once freed."""
        self._usable()
        return self._ptr

    @property
    def nbytes(self) -> int:
        """The size in bytes: `len` elements of `dtype`."""
        return self.len * self.dtype.itemsize

    def names(self, handle: Handle) -> bool:
        return handle is self

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """A copy of elements `start` to `stop` (the end where None; wait for the copies into it
        first): a copy, so no array outlives the memory. Bounds outside the buffer, or a stop
        before the start, are a ValueError naming them (a slice would have shortened quietly)."""
        self._usable()
        first = as_size(start, "read's start", 0, self.len)
        last = self.len if stop is None else as_size(stop, "read's stop", first, self.len, also="None")
        return self._array[first:last].copy()

    def __repr__(self) -> str:
        label = f"{self.label} " if self.label else ""
        return f"{type(self).__name__}({label}{short_name(self.dtype)}[{self.len}]{' freed' if self.freed else ''})"


class MappedBuffer(PinnedBuffer):
    """Pinned host memory that kernels write directly (mapped into the device's address space):
    how the device hands the host tokens while a graph is still running, with no copy and no
    stream synchronise.

    `device` gives the memory as a DeviceBuffer for kernel arguments, which keeps this buffer
    alive and is poisoned with everything that holds it when this buffer is freed. `live` is
    the host's view of the memory itself, not a copy (a flag the host writes and spins on,
    the token feed's words): what a kernel wrote is there as soon as it is visible, so read a
    count before the words it publishes. A numpy view cannot refuse to run, so the view holds
    the memory instead: it keeps this buffer alive (the collector never frees the memory
    under it), and free() refuses while any view of it, or a slice of one, is still held; and
    so while a tensor made from `device` (memra_cuda.torch.tensor) is, or while that `device` buffer
    lives once its array interface was read (an array made so keeps the buffer, not a count).
    `read(start, stop)` takes a copy.
    """

    _flags = 2  # CU_MEMHOSTALLOC_DEVICEMAP

    def __init__(self, engine: Stream, dtype: DTypeLike, length: int, *, label: str | None = None):
        super().__init__(engine, dtype, length, label=label)
        self._address = int(engine.activate().call("cuMemHostGetDevicePointer", self._ptr, 0))
        self._viewed: list[weakref.ref] = []  # the memory under each view live() handed out

    @property
    def device(self) -> DeviceBuffer:
        """A new DeviceBuffer on the memory; it keeps this buffer alive (this one does not keep
        it: no cycle for the collector to break at some random moment)."""
        self._usable()
        view = DeviceBuffer(self._address, self.dtype, self.len, engine=self.engine, keepalive=self,
                            label=self.label and f"{self.label} (mapped)")
        self.depend(view)
        return view

    @property
    def live(self) -> np.ndarray:
        """A view of the memory itself, which holds this buffer (see the class): take it once,
        not in a loop (a new view each time, ~2 us), and drop it, with its slices, before free()."""
        self._usable()
        words = (ctypes.c_char * self.nbytes).from_address(self._ptr)
        words.owner = self  # type: ignore[attr-defined]  # every view and slice of it holds `words`
        self._viewed = [ref for ref in self._viewed if ref() is not None] + [weakref.ref(words)]
        return np.frombuffer(memoryview(words), self.dtype)

    def free(self) -> None:
        """PinnedBuffer's free, refused while a view of the memory (live, or a slice of it) is
        held: it would read and write freed memory, and no numpy array can refuse to."""
        if any(ref() is not None for ref in self._viewed):
            raise ValueError(f"{self!r} is still viewed (its live, or a slice of it, is held): drop every view "
                             "before free(), which would leave them on freed memory")
        # A tensor on `device` (memra_cuda.torch.tensor's hold, or an array made from its
        # __cuda_array_interface__) cannot refuse to run either: its memory is this buffer's.
        tensors = [buf for buf in list(self._dependents or ()) if isinstance(buf, DeviceBuffer)
                   and buf._keepalive is self and (buf._holders or buf._exported)]
        if tensors:
            raise ValueError(f"{self!r} is still read by a tensor or an array made from {tensors[0]!r} (its device, "
                             "handed to another framework): drop them, and that buffer, before free(), which would "
                             "leave them on freed memory")
        super().free()


class CudaArray(Protocol):
    """Device memory of another framework's (a PyTorch tensor, a CuPy array, ...): anything that
    speaks the CUDA array interface (v2/v3), which every API taking a buffer adopts."""

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...


# What an API that takes device memory accepts: a DeviceBuffer, or memory it adopts (as_buffer).
BufferLike: TypeAlias = "DeviceBuffer | CudaArray"


def as_buffer(obj: BufferLike, what: str = "buffer", engine: Stream | None = None) -> DeviceBuffer:
    """`obj` as a DeviceBuffer: itself, or adopted through `__cuda_array_interface__`."""
    if isinstance(obj, DeviceBuffer):
        return obj
    if hasattr(obj, "__cuda_array_interface__"):
        return DeviceBuffer.from_cuda_array(obj, engine)
    raise TypeError(f"{what} must be a DeviceBuffer or an object with __cuda_array_interface__, "
                    f"not {type(obj).__name__}")


def alloc_length(length: Any, dtype: np.dtype) -> int:
    """`length` elements of `dtype` to allocate: as_size's, of at least 1 and at most what a size_t
    of bytes holds (cuMemAlloc's and cuMemHostAlloc's), so a length past it is a ValueError naming
    it, where the binding raised OverflowError ("int too big to convert"), naming nothing."""
    return as_size(length, "length", 1, U64_MOST // dtype.itemsize)


def device_allocation(engine: Stream, nbytes: int) -> tuple[PrimaryContext, int]:
    """A fresh cuMemAlloc of `nbytes` on the engine's device, and the context that must free it
    (the caller takes ownership with Handle._own). Refused inside a capture."""
    _no_alloc_in_capture(engine, "device memory")
    ctx = engine.activate()
    return ctx, int(ctx.call("cuMemAlloc", nbytes))


def _no_alloc_in_capture(engine: Stream, what: str) -> None:
    """Refused while the stream is captured, by memra's Graph or anyone else's (torch.cuda.graph):
    the driver forbids it in most capture modes, and where it allows it, the graph would address
    memory it does not own. Allocation is never on the per-round path, so the check is free."""
    if engine.capture_hold is not None or engine.capturing:
        raise CaptureError(f"{what} cannot be allocated inside a graph capture (the driver forbids it while "
                           "the stream is captured): allocate before capturing")


def _shape(given: Any) -> tuple[int, ...]:
    """An array interface's `shape`: a tuple (or a list: as_listed) of ints of at least 0, else a
    TypeError or a ValueError naming it. Its dimensions were read as ints alone, so (-1, -2) was 2
    elements, adopted, and a bare int met "'int' object is not iterable", naming nothing."""
    what = f"each dimension of an array interface's shape {reprlib.repr(given)}"
    return tuple(as_size(d, what, 0) for d in as_listed(given, "an array interface's shape", "ints"))


def _data_pointer(given: Any, obj: Any) -> int:
    """The pointer of an array interface's `data`, a (pointer, read-only) pair, of `obj`'s: TypeError
    naming `obj` and the field for anything else (None, or none given, met "'NoneType' object is
    not subscriptable", naming nothing), as_index's for a pointer that is no int."""
    what = f"the data of {type(obj).__name__}'s __cuda_array_interface__"
    if not (isinstance(given, (tuple, list)) and len(given) == 2):
        raise TypeError(f"{what} must be a (pointer, read-only) pair, not {reprlib.repr(given)}")
    return as_index(given[0], f"the pointer of {what}")


def _strides(given: Any, shape: tuple[int, ...], obj: Any) -> tuple[int, ...] | None:
    """An array interface's `strides` of `obj`'s: None (C-contiguous), or a tuple (a list:
    as_listed) of bytes, an int a dimension of `shape`; else a TypeError or a ValueError naming
    `obj` and the field. Anything was taken that tuple() took: a bare int met "'int' object is
    not iterable", naming nothing, and strides fewer than the dimensions were paired with the last
    ones alone (zip), so a gapped array whose first strides were left out was adopted as contiguous."""
    if given is None:
        return None
    what = f"the strides of {type(obj).__name__}'s __cuda_array_interface__"
    strides = tuple(as_index(stride, f"each of {what}")
                    for stride in as_listed(given, f"{what} (None where it is contiguous)", "ints"))
    if len(strides) != len(shape):
        raise ValueError(f"{what} must be one a dimension of its shape {shape}, not {strides}")
    return strides


def _c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


def _producer(stream: Any) -> int:
    """The producer's stream an array interface names (v3's `stream`, given): its handle, 1 the
    legacy default stream, 2 the per-thread one. 0 is disallowed by the interface (it would read
    as None, no wait, to one consumer, and as the legacy stream to another): a ValueError, as a
    negative one is; an int it must be (TypeError)."""
    handle = as_index(stream, "an array interface's stream")
    if handle <= 0:
        raise ValueError(f"an array interface's stream is a stream handle, 1 (the legacy default stream) or 2 (the "
                         f"per-thread one), or None where no wait is needed; not {handle} (the interface disallows 0)")
    return handle


def _device_of(ptr: int) -> int:
    """The ordinal of the device `ptr` lives on; ValueError for host memory."""
    attr = driver().CUpointer_attribute
    try:
        kind = call("cuPointerGetAttribute", attr.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr)
    except Exception:
        raise ValueError(f"{ptr:#x} is not device memory the driver knows") from None
    if int(kind) != int(driver().CUmemorytype.CU_MEMORYTYPE_DEVICE):
        raise ValueError(f"{ptr:#x} is host memory, not device memory")
    # The device of the context that owns the memory: DEVICE_ORDINAL answers 0 for device 1's
    # memory (seen with cuda-bindings 13.3 on two H200s); memory no context owns (virtual memory
    # management) has only the ordinal to go by.
    ctx = call("cuPointerGetAttribute", attr.CU_POINTER_ATTRIBUTE_CONTEXT, ptr)
    if not int(ctx):
        return int(call("cuPointerGetAttribute", attr.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr))
    drv = driver()
    call("cuCtxPushCurrent", ctx)
    try:
        return int(call("cuCtxGetDevice"))
    finally:
        drv.cuCtxPopCurrent()

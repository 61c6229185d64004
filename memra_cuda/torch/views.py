"""Tensors and buffers on the same memory, no copy either way.

A model's callables must read every position and token on the device (nothing a burst depends
on may come back to the host), so they read round-stream's own buffers as tensors: `tensor(buf)`
for one buffer, `RoundViews(bufs)` and `TreeViews(tree_bufs)` for the words a chain's or a
tree's callables read. The other direction, `buffer(tensor)`, is rarely needed: every API that
takes a buffer takes a tensor too.
"""
from __future__ import annotations

import reprlib
from collections.abc import Callable

import torch

from ..buffers.layout import ACC_ROUND, ACC_WORDS, CTL_DONE, CTL_WORDS
from ..buffers.stream_bufs import StreamBufs
from ..buffers.tree import TreeBufs
from ..driver.buffer import DeviceBuffer

_TYPESTR = {torch.bool: "|b1", torch.uint8: "|u1", torch.int8: "|i1", torch.int16: "<i2", torch.int32: "<i4",
            torch.int64: "<i8", torch.float16: "<f2", torch.float32: "<f4", torch.float64: "<f8"}
# The unsigned types torch has had since 2.3 (tensor() without a dtype returns them).
_TYPESTR.update({getattr(torch, name): code for name, code in (("uint16", "<u2"), ("uint32", "<u4"),
                                                                 ("uint64", "<u8")) if hasattr(torch, name)})


def buffer(tensor: torch.Tensor) -> DeviceBuffer:
    """The tensor's memory as a DeviceBuffer that keeps the tensor alive and owns nothing."""
    return DeviceBuffer.from_cuda_array(tensor)


class _Held:
    """The `__cuda_array_interface__` a tensor is made from: the buffer's, read as another element
    type where asked. Torch keeps this object with the tensor (and every view of it), and the
    buffer holds it weakly (DeviceBuffer.hold): a buffer freed while a tensor on it lives is
    refused to memra at once, and its memory goes back once the tensors are gone."""

    def __init__(self, buf: DeviceBuffer, dtype: torch.dtype | None):
        if dtype is not None and dtype.itemsize != buf.dtype.itemsize:
            raise ValueError(f"{buf!r} cannot be read as {dtype}: elements of {buf.dtype.itemsize} bytes")
        if dtype is not None and dtype not in _TYPESTR:  # bfloat16, say: torch reads it from no interface
            same = next((t for t, code in _TYPESTR.items() if code[1] == "i" and t.itemsize == dtype.itemsize), None)
            how = f"read it as {same} and .view({dtype})" if same is not None else "read it as a type torch adopts"
            raise ValueError(f"{buf!r} cannot be read as {dtype}: torch makes no tensor of it from a "
                             f"__cuda_array_interface__; {how}")
        self.buf = buf  # torch keeps this object, and so the buffer, alive with the tensor
        iface = buf._interface()  # held above, not exported: the memory goes back once these tensors are gone
        self.__cuda_array_interface__ = iface if dtype is None else {**iface, "typestr": _TYPESTR[dtype]}
        buf.hold(self)


def tensor(buf: DeviceBuffer, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor on `buf`'s memory (no copy), read as `dtype` of the same size if given (u32
    token ids as torch.int32, say: ids are < 2**31; bf16 as torch.int16, then
    .view(torch.bfloat16), since torch adopts no bf16 memory). The tensor keeps `buf`'s memory:
    freeing `buf` while the tensor (or a view of it) lives refuses memra's use of it at once, but the
    memory goes back only once the tensors are gone.

    What `buf`'s engine has queued so far comes before what torch's current stream queues next
    (Stream.precede): torch.as_tensor does not wait on the stream a buffer names (2.11), so a
    buffer just uploaded on an engine's own stream read back as garbage under load. Later work on
    the two streams is the caller's to order. Inside a capture that wait is refused
    (CaptureError): make the tensor before capturing. A `buf` that is no DeviceBuffer and a `dtype`
    that is no torch.dtype are refused first (TypeError: "int32" met a bare AttributeError,
    np.int32 a ValueError of its size, a numpy array torch's device())."""
    if not isinstance(buf, DeviceBuffer):
        raise TypeError(f"tensor's buf is a memra_cuda DeviceBuffer, not {reprlib.repr(buf)}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"tensor's dtype is a torch.dtype (torch.int32, say) or None, not {dtype!r}")
    device, source = torch.device("cuda", buf.device), _Held(buf, dtype)
    if buf.engine is not None and not buf.engine.closed:  # a closed engine finished its work
        buf.engine.precede(torch.cuda.current_stream(device), f"tensor({buf!r})")
    return torch.as_tensor(source, device=device)


def windows(arena: DeviceBuffer) -> Callable[[DeviceBuffer], torch.Tensor]:
    """Each window of `arena` (carve's: 32-bit fields side by side) as an int32 slice of one
    tensor over the whole allocation, at its storage offset. torch.compile reads a tensor's
    alignment from its storage offset: a field's own tensor, at offset 0, was taken as 16-byte
    aligned, and where its address was not inductor cloned it before every call, a kernel each
    (four of a chain round's views at B = 1)."""
    words = tensor(arena, torch.int32)

    def window(buf: DeviceBuffer) -> torch.Tensor:
        start = (buf.ptr - arena.ptr) // arena.dtype.itemsize
        return words[start:start + buf.len]
    return window


class RoundViews:
    """The words of StreamBufs a chain's callables read, as tensors of one column a row where
    the buffer has one word a row, so that they broadcast against [B][T] positions (int32
    slices of one tensor over the fields' allocation: windows):

    - `pend` [B][1] int32: the pending token, committed, its KV not yet computed;
    - `pos_ctr` [B][1] int32: its position (the draft chain's first);
    - `pos_start` [B][1] int32: the position of the round's first verify token;
    - `vtok` [B][k+1] int32: what the verify reads, the pending token then the k drafts (after a
      round, the last round's, whose entry `accepted` is the token it accepted deepest);
    - `accepted` [B][1] int32: the drafts the last round accepted;
    - `done` [B][1] int32: nonzero where the row has stopped (its EOS or budget).
    """

    def __init__(self, bufs: StreamBufs):
        if not isinstance(bufs, StreamBufs):  # None met an AttributeError of NoneType, naming no argument
            raise TypeError(f"RoundViews' bufs must be a StreamBufs, not {reprlib.repr(bufs)}")
        rows, k, window = bufs.batch, bufs.k, windows(bufs.arena)
        self.pend = window(bufs.pend_d)[:, None]
        self.pos_ctr = window(bufs.pos_ctr_d)[:, None]
        self.pos_start = window(bufs.pos_start_d)[:, None]
        self.vtok = window(bufs.vtok_d).view(rows, k + 1)
        self.accepted = window(bufs.acc_d).view(rows, ACC_WORDS)[:, ACC_ROUND:ACC_ROUND + 1]
        self.done = window(bufs.ctl_d).view(rows, CTL_WORDS)[:, CTL_DONE:CTL_DONE + 1]


class TreeViews:
    """The words of TreeBufs a tree's callables read, as tensors (T + 1 nodes, W mask words,
    depth D; int32 slices of one tensor over the fields' allocation: windows):

    - `tok` [B][T+1] int32: node i's token (node 0 the pending one);
    - `pos` [B][T+1] int32: node i's position, the root's plus its depth (for RoPE);
    - `parents` [B][T+1] int32: node i's parent (node 0's a sentinel);
    - `words` [B][T+1][W] int32: the ancestor mask, node j at bit j % 32 of word j // 32;
    - `path` [B][D+1] int32: the accepted path, entry d the node at depth d (after the accept).
    """

    def __init__(self, tree_bufs: TreeBufs):
        if not isinstance(tree_bufs, TreeBufs):
            raise TypeError(f"TreeViews' tree_bufs must be a TreeBufs, not {reprlib.repr(tree_bufs)}")
        rows, nodes, window = tree_bufs.bufs.batch, tree_bufs.nodes, windows(tree_bufs.arena)
        self.tok = window(tree_bufs.tok_d).view(rows, nodes)
        self.pos = window(tree_bufs.pos_d).view(rows, nodes)
        self.parents = window(tree_bufs.parent_d).view(rows, nodes)
        self.words = window(tree_bufs.mask_d).view(rows, nodes, tree_bufs.words)
        self.path = window(tree_bufs.path_d).view(rows, tree_bufs.depth + 1)

"""SpecKernels: typed launchers of the spec_* kernels of ptx/spec_stream.cu (the round's
bookkeeping and the rollback of recurrent state), and of stochastic acceptance
(ptx/spec_sample.cu, launched from sampling.py).

The kernels clamp every count they read from device memory; the launchers check everything
the host knows (buffer types and sizes for the batch, the engine they belong to, that a
rollback table holds what it names and has one length or state per row) before anything is queued.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from ..buffers.acceptance import Acceptance, Greedy, Sampling
from ..buffers.layout import HEAD_WORDS
from ..buffers.lengths import DraftLengths
from ..buffers.stream_bufs import StreamBufs
from ..buffers.tables import PointerTable, StateIndexTable, StateTable
from ..driver.buffer import BufferLike, DeviceBuffer
from ..driver.module import Launch, Module
from ..driver.values import as_size
from .sampling import _exact, prepare_accept_sample, prepare_draft_sample
from .signatures import load

if TYPE_CHECKING:
    from ..driver.engine import Engine

# The widest row seed_gather copies: its u32 word index, stepping by the grid (at most 2**18 threads),
# never wraps below 2**32 (a hidden state of 2**31 words is 8 GiB)
MAX_ROW_WORDS = 2**31
CHOOSE_THREADS = 512  # spec_stream.cu's: the length chooser's one block


class SpecKernels:
    """The nine round-stream kernels: seven of ptx/spec_stream.ptx (loaded once per engine),
    stochastic acceptance and the draft's draw (ptx/spec_sample.ptx, through sampling.py); device
    mode's publish (4', spec_stream.ptx too); the length chooser (spec_stream.ptx); and the
    greedy round tail, kernels 3, 4 and 5 in one launch (spec_stream.ptx).

    `prepare_*` validates the buffers and returns a prepared launch to keep and call every
    round; the plain methods make that launch and queue it once, checked at each call (a one-off:
    a round keeps the prepared launch instead). Buffers may be DeviceBuffers or
    __cuda_array_interface__ objects of this engine's device. Every launch serves all
    `bufs.batch` rows, so a buffer the model writes holds B rows (see `batch_rows`).
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.module = load(engine, "spec_stream")

    def _launch(self, name: str, args: Mapping[str, object], threads: int = 1, rows: int = 1) -> Launch:
        return spread(self.module, name, args, threads, rows)

    def prepare_seed_gather(self, bufs: StreamBufs, rows_d: BufferLike, row_words: int, out_d: BufferLike) -> Launch:
        """rows_d holds [B][n_rows][row_words] words (n_rows = rows_d.len // (B·row_words)),
        out_d [B][row_words]; row_words at most MAX_ROW_WORDS (the kernel's u32 word index steps
        by its grid: past 2**32 - the grid it would wrap, and the copy never end)."""
        rows_d, out_d = self._words("rows_d", rows_d), self._words("out_d", out_d)
        row_words, batch = as_size(row_words, "row_words", 1, MAX_ROW_WORDS), bufs.batch
        if rows_d.len % (batch * row_words):
            raise ValueError(f"rows_d ({rows_d.len} words) must hold {batch} sequences of whole rows of "
                             f"{row_words} words")
        out_d = batch_rows("out_d", out_d, batch, row_words)
        return self._launch("spec_seed_gather", dict(rows=rows_d, n_rows=rows_d.len // (batch * row_words),
                                                     row_words=row_words, B=batch, acc_d=bufs.acc_d, out=out_d),
                            threads=row_words, rows=batch)

    def prepare_assemble_verify(self, bufs: StreamBufs, draft_d: BufferLike) -> Launch:
        """Kernel 2: the verify's input, the pending token then the k drafts of `draft_d` (B rows of
        max(k, 1) tokens, 32- or 64-bit), into vtok_d; the round's start position into pos_start_d."""
        draft_d = token_buffer(self.engine, "draft_d", draft_d)
        draft_d = batch_rows("draft_d", draft_d, bufs.batch, max(bufs.k, 1), bufs.k)
        return self._launch(width_kernel("spec_assemble_verify", draft_d),
                            dict(pend_d=bufs.pend_d, draft_d=draft_d, k=bufs.k, B=bufs.batch, vtok_d=bufs.vtok_d,
                                 pos_ctr=bufs.pos_ctr_d, pos_start_d=bufs.pos_start_d),
                            threads=bufs.batch * (bufs.k + 1))

    def prepare_accept_greedy(self, bufs: StreamBufs, pred_d: BufferLike) -> Launch:
        """Kernel 3 (contract 3): each row keeps the drafts that match `pred_d`, the target's
        token at each of the k + 1 verified positions (B rows, 32- or 64-bit), and the bonus after them."""
        pred_d = batch_rows("pred_d", token_buffer(self.engine, "pred_d", pred_d), bufs.batch, bufs.k + 1)
        return self._launch(width_kernel("spec_accept_greedy_dc", pred_d),
                            dict(vtok_d=bufs.vtok_d, pred_d=pred_d, k=bufs.k, B=bufs.batch, brk_d=bufs.brk_d,
                                 acc_d=bufs.acc_d, last_pred_d=bufs.last_pred_d, ctl_d=bufs.ctl_d),
                            threads=32 * bufs.batch)

    def prepare_ring_commit(self, bufs: StreamBufs) -> Launch:
        """Kernel 4: each row's accepted tokens and bonus appended to its ring, under its EOS and
        budget; the last one becomes the pending token. Reads only these buffers, so nothing to check."""
        return self._launch("spec_ring_commit", dict(vtok_d=bufs.vtok_d, acc_d=bufs.acc_d, last_pred_d=bufs.last_pred_d,
                                                     ctl_d=bufs.ctl_d, pend_d=bufs.pend_d, ring_d=bufs.ring_d,
                                                     ring_cap=bufs.ring_cap, k=bufs.k, B=bufs.batch),
                            threads=32 * bufs.batch)

    def prepare_ring_publish(self, bufs: StreamBufs, published_d: DeviceBuffer, seq_d: DeviceBuffer,
                             head_d: DeviceBuffer, count_d: DeviceBuffer, tokens_d: DeviceBuffer,
                             stamps_d: DeviceBuffer, cap: int) -> Launch:
        """Kernel 4': the rings published to a mapped token stream (device mode): `published_d`
        u32[B] counts what each row published, `seq_d` u32[1] the publishes; head_d
        u32[HEAD_WORDS], count_d u32[B], tokens_d and stamps_d u32[B][cap] are the stream's
        mapped words (device_loop.TokenFeed). One block, so the head is written once every
        row is out: of 1024 threads, the rows striding over them (a block of one warp, inside a
        loop, crashed compute-sanitizer's racecheck)."""
        cap, batch = as_size(cap, "cap"), bufs.batch
        for name, buf, shape in (("published_d", published_d, (batch,)), ("seq_d", seq_d, (1,)),
                                 ("head_d", head_d, (HEAD_WORDS,)), ("count_d", count_d, (batch,)),
                                 ("tokens_d", tokens_d, (batch, cap)), ("stamps_d", stamps_d, (batch, cap))):
            _exact(self.engine.buffer(buf, name), name, ("u32",), shape)
        return self.module.kernel("spec_ring_publish").prepare(grid=1, block=1024).set(
            ring_d=bufs.ring_d, ring_cap=bufs.ring_cap, B=batch, pub_d=published_d, seq_d=seq_d, out_head=head_d,
            out_count=count_d, out_tokens=tokens_d, out_stamps=stamps_d, out_cap=cap)

    def prepare_accept(self, bufs: StreamBufs, rule: Acceptance) -> Launch:
        """The kernel that judges `rule` (Greedy: contract 3; Sampling: contract 6)."""
        if isinstance(rule, Greedy):
            return self.prepare_accept_greedy(bufs, rule.pred_d)
        if isinstance(rule, Sampling):
            return self.prepare_accept_sample(bufs, rule.p_d, rule.q_d, rule.seed_d, rule.vocab)
        raise TypeError(f"acceptance must be Greedy(pred_d) or Sampling(p_d, q_d, seed_d, vocab), not {rule!r}")

    def prepare_rollback(self, bufs: StreamBufs, table_d: PointerTable) -> Launch:
        """Kernel 5: every i32[B] length `table_d` names set to the round's start plus what each row
        kept (kv_len_ptr_table builds it; with pos_ctr_d in it, the position moves on too)."""
        table_d = rollback_table(bufs, table_d)
        return self._launch("spec_rollback_stream", dict(len_ptrs=table_d, n_ptrs=table_d.len, B=bufs.batch,
                                                         pos_start_d=bufs.pos_start_d, ctl_d=bufs.ctl_d),
                            threads=table_d.len * bufs.batch)

    def prepare_round_tail_greedy(self, bufs: StreamBufs, pred_d: BufferLike, table_d: PointerTable) -> Launch:
        """Kernels 3, 4 and 5 in one launch, a greedy chain round's tail: each row's acceptance of
        `pred_d` (as prepare_accept_greedy's), its commit (prepare_ring_commit's), then the
        rollback of the lengths `table_d` names (prepare_rollback's), one warp a row. The same
        buffers after it as after the three launches in that order, checked as each of them checks."""
        pred_d = batch_rows("pred_d", token_buffer(self.engine, "pred_d", pred_d), bufs.batch, bufs.k + 1)
        table_d = rollback_table(bufs, table_d, tail_reads(bufs, pred_d), TAIL_READS)
        return self._launch(width_kernel("spec_round_tail_greedy", pred_d),
                            dict(vtok_d=bufs.vtok_d, pred_d=pred_d, k=bufs.k, B=bufs.batch, brk_d=bufs.brk_d,
                                 acc_d=bufs.acc_d, last_pred_d=bufs.last_pred_d, ctl_d=bufs.ctl_d, pend_d=bufs.pend_d,
                                 ring_d=bufs.ring_d, ring_cap=bufs.ring_cap, len_ptrs=table_d, n_ptrs=table_d.len,
                                 pos_start_d=bufs.pos_start_d),
                            threads=32 * bufs.batch)

    def prepare_state_copy(self, bufs: StreamBufs, table: StateTable) -> Launch:
        """Kernel 8: each row's live recurrent state becomes its kept slot (keep - 1), by copy.
        `table` comes from state_copy_table; its layers must be of this batch and k."""
        if not isinstance(table, StateTable):
            raise TypeError(f"a state copy table must be a StateTable (state_copy_table builds one), not {table!r}")
        if table.k is not None and (table.batch, table.k) != (bufs.batch, bufs.k):  # None: every layer is None
            raise ValueError(f"{table.label}: its layers hold B={table.batch} rows of k+1={table.k + 1} slots, but "
                             f"the round has B={bufs.batch} and k={bufs.k}")
        grid, block = state_copy_grid(table, bufs.batch)
        return self.module.kernel("spec_state_copy").prepare(grid=grid, block=block).set(
            table=table, n_entries=len(table.layers), B=bufs.batch, k=bufs.k, ctl_d=bufs.ctl_d)

    def prepare_state_flip(self, bufs: StreamBufs, table: StateIndexTable) -> Launch:
        """Kernel 9: each row's state index moves to the kept slot of the bank the verify wrote.
        `table` comes from state_flip_table: u32[B] indices of this batch."""
        check_flip_table(table, bufs.batch)
        return self._launch("spec_state_flip", dict(idx_ptrs=table, n_ptrs=table.len, B=bufs.batch, k=bufs.k,
                                                    ctl_d=bufs.ctl_d), threads=table.len * bufs.batch)

    def prepare_choose_lengths(self, bufs: StreamBufs, lengths: DraftLengths) -> Launch:
        """The length chooser (docs/lengths.md): each live row's statistics moved on by the last
        round, the batch's width chosen from them and the costs, each row's acceptance capped at
        its length. Once a round, before its draft chain; `lengths` must be these buffers'."""
        if not isinstance(lengths, DraftLengths):
            raise TypeError(f"the length chooser's buffers are a DraftLengths, not {lengths!r}")
        if lengths.bufs is not bufs:
            raise ValueError(f"{lengths!r} were made for other round-stream buffers than these (k={bufs.k}, "
                             f"batch={bufs.batch}): make them with DraftLengths(bufs, ...)")
        return self.module.kernel("spec_choose_lengths").prepare(grid=1, block=CHOOSE_THREADS).set(
            ctl_d=bufs.ctl_d, acc_d=bufs.acc_d, brk_d=bufs.brk_d, rate_d=lengths.rate_d, cap_d=lengths.cap_d,
            cost_d=lengths.cost_d, width_d=lengths.width_d, k=bufs.k, B=bufs.batch, decay=lengths.decay,
            prior=lengths.prior)

    def prepare_accept_sample(self, bufs: StreamBufs, p_d: BufferLike, q_d: BufferLike, seed_d: BufferLike,
                              vocab: int | None = None) -> Launch:
        """Stochastic acceptance (contract 6, ptx/spec_sample.ptx): see sampling.py."""
        return prepare_accept_sample(self.engine, bufs, p_d, q_d, seed_d, vocab)

    def prepare_draft_sample(self, bufs: StreamBufs, q_d: BufferLike, seed_d: BufferLike, draft_d: BufferLike,
                             step: int, vocab: int) -> Launch:
        """The draft's position-keyed draw of token `step` (contract 7, ptx/spec_sample.ptx): see
        sampling.py."""
        return prepare_draft_sample(self.engine, bufs, q_d, seed_d, draft_d, step, vocab)

    def seed_gather(self, bufs: StreamBufs, rows_d: BufferLike, row_words: int, out_d: BufferLike) -> None:
        """prepare_seed_gather's launch, made and queued once (see the class)."""
        self.prepare_seed_gather(bufs, rows_d, row_words, out_d)()

    def assemble_verify(self, bufs: StreamBufs, draft_d: BufferLike) -> None:
        """prepare_assemble_verify's launch, made and queued once (see the class)."""
        self.prepare_assemble_verify(bufs, draft_d)()

    def accept_greedy(self, bufs: StreamBufs, pred_d: BufferLike) -> None:
        """prepare_accept_greedy's launch, made and queued once (see the class)."""
        self.prepare_accept_greedy(bufs, pred_d)()

    def ring_commit(self, bufs: StreamBufs) -> None:
        """prepare_ring_commit's launch, made and queued once (see the class)."""
        self.prepare_ring_commit(bufs)()

    def rollback(self, bufs: StreamBufs, table_d: PointerTable) -> None:
        """prepare_rollback's launch, made and queued once (see the class)."""
        self.prepare_rollback(bufs, table_d)()

    def round_tail_greedy(self, bufs: StreamBufs, pred_d: BufferLike, table_d: PointerTable) -> None:
        """prepare_round_tail_greedy's launch, made and queued once (see the class)."""
        self.prepare_round_tail_greedy(bufs, pred_d, table_d)()

    def state_copy(self, bufs: StreamBufs, table: StateTable) -> None:
        """prepare_state_copy's launch, made and queued once (see the class)."""
        self.prepare_state_copy(bufs, table)()

    def state_flip(self, bufs: StreamBufs, table: StateIndexTable) -> None:
        """prepare_state_flip's launch, made and queued once (see the class)."""
        self.prepare_state_flip(bufs, table)()

    def choose_lengths(self, bufs: StreamBufs, lengths: DraftLengths) -> None:
        """prepare_choose_lengths's launch, made and queued once (see the class)."""
        self.prepare_choose_lengths(bufs, lengths)()

    def accept_sample(self, bufs: StreamBufs, p_d: BufferLike, q_d: BufferLike, seed_d: BufferLike,
                      vocab: int | None = None) -> None:
        """prepare_accept_sample's launch, made and queued once (see the class)."""
        self.prepare_accept_sample(bufs, p_d, q_d, seed_d, vocab)()

    def draft_sample(self, bufs: StreamBufs, q_d: BufferLike, seed_d: BufferLike, draft_d: BufferLike, step: int,
                     vocab: int) -> None:
        """prepare_draft_sample's launch, made and queued once (see the class)."""
        self.prepare_draft_sample(bufs, q_d, seed_d, draft_d, step, vocab)()

    def _words(self, name: str, obj: BufferLike) -> DeviceBuffer:
        """A buffer of 32-bit words of any kind (rows of hidden states, say)."""
        buf = self.engine.buffer(obj, name)
        if buf.dtype.itemsize != 4:
            raise ValueError(f"{name} must be a buffer of 32-bit words, not {buf!r}")
        return buf


def spread(module: Module, name: str, args: Mapping[str, object], threads: int = 1, rows: int = 1) -> Launch:
    """A prepared launch of `threads` spread over a 1-D grid of at most 1024 blocks (the kernels
    stride over what is left); `rows` > 1 gives each row its own grid row (y). `args` are the
    kernel's by its parameters' names (a dict, since a kernel may have a parameter `rows`)."""
    block = min(max(32, threads), 256)
    grid = min((threads + block - 1) // block, 1024)
    return module.kernel(name).prepare(grid=(grid, rows) if rows > 1 else grid, block=block).set(**args)


def rollback_table(bufs: StreamBufs, table_d: PointerTable, read: Mapping[str, DeviceBuffer] | None = None,
                   why: str = "the rollback reads the round's start and keep there as it writes each length"
                   ) -> PointerTable:
    """`table_d`, checked to be a rollback table of kernel 5 for these buffers: a PointerTable
    (which holds what it names) of i32[B] lengths, one per sequence, none of them memory the
    rollback reads (pos_start_d, ctl_d) or `read` names (what runs after it reads, `why`): by
    bytes, so a view of it is refused too. Each (length, row) is a thread of its own, so a
    length over pos_start moved the anchor of the others as they read it."""
    if not isinstance(table_d, PointerTable):
        raise TypeError(f"a rollback table must be a PointerTable (kv_len_ptr_table builds one), which holds "
                        f"the lengths it names; not {table_d!r}")
    table_d._usable()  # a freed length: the table's own refusal names it (its address, read below, would not)
    wrong = [t for t in table_d.targets if t is not None and (t.dtype != np.int32 or t.len != bufs.batch)]
    if wrong:
        raise ValueError(f"a rollback table for a batch of {bufs.batch} must name i32[{bufs.batch}] lengths "
                         f"(one per sequence), not {wrong[0]!r}")
    reads = {"bufs.pos_start_d": bufs.pos_start_d, "bufs.ctl_d": bufs.ctl_d, **(read or {})}
    for target in (t for t in table_d.targets if t is not None):
        for name, buf in reads.items():
            if target.ptr < buf.ptr + buf.nbytes and buf.ptr < target.ptr + target.nbytes:
                raise ValueError(f"a rollback table may not name memory of {name} ({target!r}): {why}")
    return table_d


TAIL_READS = "the tail's other rows accept and commit from it while this row's rollback writes"


def tail_reads(bufs: StreamBufs, pred_d: DeviceBuffer) -> dict[str, DeviceBuffer]:
    """What a greedy round's tail reads and writes besides the rollback's own (rollback_table):
    a warp a row, so one row's rollback runs beside the other rows' acceptance and commit, and a
    length over their words (an i32[B] view passes the table's shape check) would race them."""
    return {"bufs.vtok_d": bufs.vtok_d, "bufs.brk_d": bufs.brk_d, "bufs.acc_d": bufs.acc_d,
            "bufs.last_pred_d": bufs.last_pred_d, "bufs.pend_d": bufs.pend_d, "bufs.ring_d": bufs.ring_d,
            "pred_d": pred_d}


def check_flip_table(table: StateIndexTable, batch: int) -> None:
    """A FLIP rollback table (kernels 9, 17) names u32[B] indices, one per sequence."""
    if not isinstance(table, StateIndexTable):
        raise TypeError(f"a state flip table must be a StateIndexTable (state_flip_table builds one), not {table!r}")
    wrong = [t for t in table.targets if t is not None and t.len != batch]
    if wrong:
        raise ValueError(f"a state flip table for a batch of {batch} must name u32[{batch}] indices (one per "
                         f"sequence), not {wrong[0]!r}")


def state_copy_grid(table: StateTable, batch: int) -> tuple[tuple[int, int], int]:
    """The grid of a state copy (kernels 8, 16): x the (layer, row) pairs, y blocks over one
    row's words, so a single wide state still spreads over the GPU; 1024 blocks at most."""
    words = max((layer.row_words for layer in table.layers if layer is not None), default=1)
    block = min(-(-words // 32) * 32, 256)
    pairs = min(len(table.layers) * batch, 1024)
    return (pairs, min(-(-words // block), max(1, 1024 // pairs))), block


def batch_rows(name: str, buf: DeviceBuffer, batch: int, row: int, single: int | None = None) -> DeviceBuffer:
    """`buf`, checked to hold `batch` rows of `row` elements, row b at b·row (docs/buffers.md,
    "Batched layout"). One sequence needs only its `single` (default `row`) elements, and may have more;
    a batch's buffer must be exactly B rows long, since any other length means another layout."""
    need = row if single is None else single
    if batch == 1 and buf.len >= need or batch > 1 and buf.len == batch * row:
        return buf
    want = f"at least {need}" if batch == 1 else f"exactly {batch} x {row} = {batch * row}"
    raise ValueError(f"{name} must hold {want} elements for a batch of {batch}, not {buf!r}")


def token_buffer(engine: Engine, name: str, obj: BufferLike) -> DeviceBuffer:
    """`obj` as a buffer of token ids, 32- or 64-bit integers (ids < 2**31): what every kernel
    that reads a model's tokens takes, at either width (width_kernel)."""
    buf = engine.buffer(obj, name)
    if buf.dtype.kind not in "iu" or buf.dtype.itemsize not in (4, 8):
        raise ValueError(f"{name} must be a buffer of 32- or 64-bit integer tokens, not {buf!r}")
    return buf


def width_kernel(kernel: str, tokens: DeviceBuffer) -> str:
    """The kernel that reads `tokens` at their width (<name>, <name>_t64)."""
    return kernel if tokens.dtype.itemsize == 4 else f"{kernel}_t64"


"""The executable specification of ptx/spec_stream.cu and ptx/spec_sample.cu, in numpy: what a
test of one's own kernels, or of the committed ones on a new GPU, compares the buffers with.

One function per kernel, named after it, taking the same buffers as numpy arrays (u32 buffers
as uint32, i32 buffers as int32) and updating them in place exactly as the kernel does,
clamps included. It is the oracle of the GPU tests and the plainest statement of the contracts.
Each takes `batch` (B, default 1) as its kernel does: every buffer then holds B rows, row-major
(docs/buffers.md, "Batched layout"), and the single-sequence contract applies to each row alone;
a buffer that is not flat or holds fewer than the B rows its sizes (k, V) make is refused, naming
it, before the kernel's function writes any (rows_of), as a k or a V that is no size is (sizes),
and so is one no view of it reaches (a list): its rows are read and written through a view.
Token buffers the model writes (draft, pred) may be 32- or 64-bit: ids are < 2**31, and the
kernels read the low 32 bits of a 64-bit word (`ids`). Rows are laid out as
memra_cuda.buffers.layout says.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import numpy.typing as npt

from ..buffers.layout import (ACC_ROUND, ACC_TOTAL, ACC_WORDS, BRK_COUNT, BRK_MARK, BRK_WORDS, COST_DRAFT, COST_VERIFY,
                              CTL_BUDGET, CTL_DONE, CTL_EOS, CTL_KEEP, CTL_WORDS, RATE_ACCEPTED, RATE_REJECTED,
                              RATE_WORDS, RING_COUNT, RING_TOKENS)
from ..driver.values import as_size
from .philox import uniform, words

# ctl_d's words by the short names the tests and the toy (testing.toy) index it with
EOS, BUDGET, DONE, KEEP = CTL_EOS, CTL_BUDGET, CTL_DONE, CTL_KEEP


def ids(tokens: np.ndarray) -> np.ndarray:
    """Token ids as the kernels read them: the low 32 bits of each word."""
    return tokens.astype(np.uint32)


def rows_of(buf: np.ndarray, batch: int, row: int, name: str, *, flat: bool = True) -> np.ndarray:
    """The first `batch` rows of `row` values of `buf`, as a [batch][row] view of it: what is
    written there lands in `buf`, as a kernel's writes land in its buffer. A ValueError naming
    `name` unless `buf` is a numpy array, flat (1-D; where not `flat`, of any shape, its words
    read in order: a state layer's [slots][row_words]) and of at least `batch` rows of `row`
    values, all a kernel reads of it (a buffer the sizes given (k, V, B) do not fit met numpy's
    broadcast or index error, or a row read the next one's words as its own, silently), whose
    words one view reaches: a list, or an array whose words are not evenly strided (a [B][W]
    column slice of a wider array), would be copied, and what was written into the copy lost,
    silently. Words past the rows are never read, as a kernel's are not (a test's guard words),
    so a buffer laid out for a smaller k or V than the one given is not told from one with words
    to spare."""
    count = batch * row
    if not isinstance(buf, np.ndarray):
        raise ValueError(f"{name} must be a numpy array, which the reference writes in place, not a "
                         f"{type(buf).__name__}")
    if (flat and buf.ndim != 1) or buf.size < count:
        raise ValueError(f"{name} must be {'a flat array' if flat else 'an array'} of at least {count} values "
                         f"({batch} row{'s' if batch != 1 else ''} of {row}), not one of shape {buf.shape}")
    words = buf.reshape(-1)  # a view where one reaches its words; else a copy, which holds none of buf's memory
    if buf.size and not np.may_share_memory(words, buf):
        raise ValueError(f"{name} must be an array whose words one view reaches, which the reference writes in "
                         f"place, not one of shape {buf.shape} and strides {buf.strides} (a copy would take the "
                         f"writes)")
    return words[:count].reshape(batch, row)


def sizes(k: int | None = None, V: int | None = None) -> None:
    """The sizes a kernel's function is given, where given (None: not one of its), checked as the
    launchers check them (as_size, naming each): `k`, the drafts a row, an int of at least 0, and
    `V`, the vocabulary, of at least 1. A negative k or V made rows of negative length, which
    rows_of cannot refuse (no buffer is too short for them), so a row's views were empty or
    reached into the next row, silently, or met numpy's index or reshape error. The sizes of one
    function alone (spec_ring_commit's ring_cap, spec_seed_gather's n_rows and row_words, the
    state rollbacks' slots and a layer's row_words) are checked beside these, by as_size where the
    function takes them, and the int it checked is the one counted in."""
    if k is not None:
        as_size(k, "k", 0)
    if V is not None:
        as_size(V, "V", 1)


def row_views(batch: int, *, k: int | None = None, V: int | None = None,
              **buffers: tuple[np.ndarray, int]) -> Iterator[tuple[np.ndarray, ...]]:
    """For each row b < batch, views of every buffer (name=(buffer, row length)) at offset
    b * row length: the single-sequence code then updates the batched buffers in place. Checked
    before any row is read: the sizes the row lengths are made of (`k`, `V`: sizes), `batch`
    (as_size), then rows_of each buffer, naming it (whose views these rows are)."""
    sizes(k, V)
    batch = as_size(batch, "batch")
    views = [rows_of(buf, batch, row, name) for name, (buf, row) in buffers.items()]
    return (tuple(view[b] for view in views) for b in range(batch))


def spec_seed_gather(rows: np.ndarray, n_rows: int, row_words: int, acc: np.ndarray,
                     out: np.ndarray, batch: int = 1) -> None:
    """out = the verify row of the bonus token (row acc[ACC_ROUND], clamped to the last row).
    Batched: rows is [B][n_rows][row_words], out [B][row_words]."""
    n_rows, row_words = as_size(n_rows, "n_rows", 0), as_size(row_words, "row_words", 0)  # beside row_views' sizes
    views = row_views(batch, rows=(rows, n_rows * row_words), acc=(acc, ACC_WORDS), out=(out, row_words))
    if n_rows == 0:
        return
    for rows_b, acc_b, out_b in views:
        r = min(int(acc_b[ACC_ROUND]), n_rows - 1)
        out_b[:row_words] = rows_b[r * row_words:(r + 1) * row_words]


def spec_assemble_verify(pend: np.ndarray, draft: np.ndarray, k: int, vtok: np.ndarray,
                         pos_ctr: np.ndarray, pos_start: np.ndarray, batch: int = 1) -> None:
    """vtok = [pending token, draft_0 .. draft_{k-1}]; the round starts at pos_ctr.
    Batched: draft rows are max(k, 1) tokens apart."""
    for pend, draft, vtok, pos_ctr, pos_start in row_views(
            batch, k=k, pend=(pend, 1), draft=(draft, max(k, 1)), vtok=(vtok, k + 1), pos_ctr=(pos_ctr, 1),
            pos_start=(pos_start, 1)):
        vtok[0] = pend[0]
        vtok[1:k + 1] = ids(draft[:k])
        pos_start[0] = pos_ctr[0]


def spec_accept_greedy_dc(vtok: np.ndarray, pred: np.ndarray, k: int, brk: np.ndarray,
                          acc: np.ndarray, last_pred: np.ndarray, ctl: np.ndarray, batch: int = 1) -> None:
    """Accept the longest prefix of drafts equal to the target's predictions.

    A p-min break at draft i (brk[BRK_MARK] = i + 1) caps acceptance at i drafts. The target's
    prediction after the last accepted token becomes the bonus (last_pred); keep = n + 1 KV
    entries (the pending token and n drafts) survive the round. Once done, nothing is kept.
    """
    for vtok, pred, brk, acc, last_pred, ctl in _greedy_rows(vtok, pred, k, brk, acc, last_pred, ctl, batch):
        _accept_greedy_row(vtok, pred, k, brk, acc, last_pred, ctl)


def _greedy_rows(vtok: np.ndarray, pred: np.ndarray, k: int, brk: np.ndarray, acc: np.ndarray,
                 last_pred: np.ndarray, ctl: np.ndarray, batch: int) -> Iterator[tuple[np.ndarray, ...]]:
    """spec_accept_greedy_dc's rows, its buffers checked (row_views) when this is called."""
    return row_views(batch, k=k, vtok=(vtok, k + 1), pred=(pred, k + 1), brk=(brk, BRK_WORDS), acc=(acc, ACC_WORDS),
                     last_pred=(last_pred, 1), ctl=(ctl, CTL_WORDS))


def marked_limit(mark: int, most: int) -> int:
    """The most drafts a row's acceptance keeps under its mark word (ptx/layout.cuh's
    marked_limit): `most` (k, or a tree's depth) where the mark is 0, else the smaller of mark - 1
    and `most`."""
    return min(most, mark - 1) if mark else most


def _accept_greedy_row(vtok: np.ndarray, pred: np.ndarray, k: int, brk: np.ndarray, acc: np.ndarray,
                       last_pred: np.ndarray, ctl: np.ndarray) -> None:
    b = int(brk[BRK_MARK])
    pred = ids(pred)
    if ctl[CTL_DONE] != 0:
        acc[ACC_ROUND] = 0
        ctl[CTL_KEEP] = 0
    else:
        limit = marked_limit(b, k)
        n = 0
        while n < limit and vtok[1 + n] == pred[n]:
            n += 1
        acc[ACC_ROUND] = n
        acc[ACC_TOTAL] = (int(acc[ACC_TOTAL]) + n) & 0xFFFFFFFF
        last_pred[0] = pred[n]
        ctl[CTL_KEEP] = n + 1
        if b:
            brk[BRK_COUNT] = (int(brk[BRK_COUNT]) + 1) & 0xFFFFFFFF
    brk[BRK_MARK] = 0


def spec_ring_commit(vtok: np.ndarray, acc: np.ndarray, last_pred: np.ndarray, ctl: np.ndarray,
                     pend: np.ndarray, ring: np.ndarray, ring_cap: int, k: int, batch: int = 1) -> None:
    """Append the accepted drafts, then the bonus, one at a time until done.

    Budget 0 means done before the token; otherwise the token goes in (if the ring has room),
    a positive budget counts down, and EOS or a spent budget means done after it. The bonus
    becomes the pending token whatever happened. A stop inside the drafts (t <= n tokens
    committed) takes n + 1 - max(t, 1) off the accepted total, so that it counts only the
    drafts committed before the round's last token, and committed - accepted counts rounds.
    """
    ring_cap, rows = commit_rows(vtok, acc, last_pred, ctl, pend, ring, ring_cap, k, batch)
    for vtok, acc, last_pred, ctl, pend, ring in rows:
        _ring_commit_row(vtok, acc, last_pred, ctl, pend, ring, ring_cap, k)


def commit_rows(vtok: np.ndarray, acc: np.ndarray, last_pred: np.ndarray, ctl: np.ndarray, pend: np.ndarray,
                 ring: np.ndarray, ring_cap: int, k: int, batch: int) -> tuple[int, Iterator[tuple[np.ndarray, ...]]]:
    """spec_ring_commit's ring_cap (an int of at least 0, as_size, beside row_views' sizes) and
    rows, its buffers checked (row_views) when this is called: a round's tail checks them before
    its acceptance writes any."""
    ring_cap = as_size(ring_cap, "ring_cap", 0)
    return ring_cap, row_views(batch, k=k, vtok=(vtok, k + 1), acc=(acc, ACC_WORDS), last_pred=(last_pred, 1),
                               ctl=(ctl, CTL_WORDS), pend=(pend, 1), ring=(ring, RING_TOKENS + ring_cap))


def _ring_commit_row(vtok: np.ndarray, acc: np.ndarray, last_pred: np.ndarray, ctl: np.ndarray,
                     pend: np.ndarray, ring: np.ndarray, ring_cap: int, k: int) -> None:
    if ctl[CTL_DONE] != 0:
        return
    eos, budget = int(ctl[CTL_EOS]), int(ctl[CTL_BUDGET])
    n = min(int(acc[ACC_ROUND]), k)
    bonus = int(last_pred[0])
    count = min(int(ring[RING_COUNT]), ring_cap)
    done, walked = False, 0
    for tok in [int(t) for t in vtok[1:1 + n]] + [bonus]:
        if budget == 0:
            done = True
            break
        if count < ring_cap:
            ring[RING_TOKENS + count] = tok
            count += 1
        walked += 1
        if budget > 0:
            budget -= 1
        done = (eos >= 0 and tok == eos) or budget == 0
        if done:
            break
    if walked <= n:
        acc[ACC_TOTAL] = (int(acc[ACC_TOTAL]) - (n + 1 - max(walked, 1))) % 2**32
    ring[RING_COUNT] = count
    ctl[CTL_BUDGET] = budget
    ctl[CTL_DONE] = int(done)
    pend[0] = bonus


def spec_rollback_stream(len_ptrs: list, pos_start: np.ndarray, ctl: np.ndarray, batch: int = 1) -> None:
    """Every length in the table (None for a layer without KV) becomes pos_start + keep.

    The table holds the length arrays themselves (i32[B]), standing for device pointers;
    batched, entry b of each becomes row b's pos_start + keep.
    """
    rows, lengths = rollback_rows(len_ptrs, pos_start, ctl, batch)
    for b, (pos_start_b, ctl_b) in enumerate(rows):
        value = (int(pos_start_b[0]) + int(ctl_b[CTL_KEEP]) + 2**31) % 2**32 - 2**31  # i32 wrap-around
        for length in lengths:
            length[b] = value


def rollback_rows(len_ptrs: list, pos_start: np.ndarray, ctl: np.ndarray,
                   batch: int) -> tuple[Iterator[tuple[np.ndarray, ...]], list[np.ndarray]]:
    """spec_rollback_stream's buffers, checked when this is called (row_views; rows_of each length
    array, naming it by its entry): each row's (pos_start, ctl) views, and a [B][1] view of each
    length array (the entries that are not None). A round's tail checks them before its
    acceptance writes any."""
    rows = row_views(batch, pos_start=(pos_start, 1), ctl=(ctl, CTL_WORDS))
    lengths = [rows_of(length, batch, 1, f"len_ptrs[{i}]") for i, length in enumerate(len_ptrs) if length is not None]
    return rows, lengths


def spec_round_tail_greedy(vtok: np.ndarray, pred: np.ndarray, k: int, brk: np.ndarray, acc: np.ndarray,
                           last_pred: np.ndarray, ctl: np.ndarray, pend: np.ndarray, ring: np.ndarray, ring_cap: int,
                           len_ptrs: list, pos_start: np.ndarray, batch: int = 1) -> None:
    """Kernels 3, 4 and 5 in one launch (a greedy chain round's tail): exactly
    spec_accept_greedy_dc, then spec_ring_commit, then spec_rollback_stream over `len_ptrs`. The
    buffers of all three are checked before the first writes any (a ring or a length array the
    sizes do not fit was refused by the second or the third, after the acceptance had written
    acc, ctl and vtok)."""
    _greedy_rows(vtok, pred, k, brk, acc, last_pred, ctl, batch)
    commit_rows(vtok, acc, last_pred, ctl, pend, ring, ring_cap, k, batch)
    rollback_rows(len_ptrs, pos_start, ctl, batch)
    spec_accept_greedy_dc(vtok, pred, k, brk, acc, last_pred, ctl, batch)
    spec_ring_commit(vtok, acc, last_pred, ctl, pend, ring, ring_cap, k, batch)
    spec_rollback_stream(len_ptrs, pos_start, ctl, batch)


# -- 6. spec_accept_sample (ptx/spec_sample.cu): stochastic acceptance ------------------------

PURPOSE_ACCEPT, PURPOSE_SAMPLE, PURPOSE_DRAFT = range(3)  # U's purpose word: the draws never coincide
NO_MASS_TOKEN = 0  # the bonus of a row whose p[n] has no positive weight: a caller's bug, never a fault
_STAND_IN = 0xFFFFFFFF  # a vtok word that no token id (< 2**31) equals


def probabilities(x: np.ndarray) -> np.ndarray:
    """x as float32 with NaN and negative entries 0: how every kernel reads a probability."""
    x = np.asarray(x, np.float32)
    return np.where(x > 0, x, np.float32(0))


def race_scores(w: np.ndarray, seed: npt.ArrayLike, position: npt.ArrayLike, purpose: int,
                node: npt.ArrayLike = 0) -> np.ndarray:
    """The exponential race's float64 scores w[v] / E_v, E_v = -ln U(seed, position, v, purpose, node), over
    the last axis of w (leading axes are rows; seed and position broadcast against them); -inf where
    w[v] is not positive (zero, negative, NaN), so such an entry never wins."""
    w = np.asarray(w, np.float64)
    # words(), not np.asarray: a list of seeds past int64 is float64 to numpy, its low bits lost
    e = -np.log(uniform(words(seed)[..., None], words(position)[..., None], np.arange(w.shape[-1]),
                        purpose, words(node)[..., None]))
    return np.where(w > 0, w / e, -np.inf)


def sample_race(w: np.ndarray, seed: npt.ArrayLike, position: npt.ArrayLike, purpose: int, node: int = 0) -> int:
    """The token drawn from unnormalised weights w at an absolute position: argmax over w[v] > 0 of
    w[v] / E_v, ties to the smallest v. With E_v independent Exp(1), v wins with probability
    w[v] / sum(w), so no normalisation, prefix sum or second pass over V is needed, and a kernel
    can race a vocabulary across many blocks with one max-reduction.

    -1 when no weight is positive. spec_accept_sample then races p[n] instead of an empty residual,
    and commits NO_MASS_TOKEN when p[n] is empty too; a draft must give its own rows weight.

    An empty w has no positive weight either, so -1 too (as the kernels' race over V = 0 entries
    keeps no key, ptx/philox.cuh's race_draw): np.argmax met "attempt to get argmax of an empty
    sequence". w is one row (ValueError naming it otherwise): race_scores races rows, but one
    token is drawn here, and a 2-D w met "truth value ... is ambiguous"."""
    w = np.asarray(w)
    if w.ndim != 1:
        raise ValueError(f"w must be one row of weights (1-D), not an array of shape {w.shape}")
    if not w.size:
        return -1
    scores = race_scores(w, seed, position, purpose, node)
    best = int(np.argmax(scores))
    return best if scores[best] > -np.inf else -1


def bonus_weights(p_n: np.ndarray, q_n: np.ndarray | None) -> np.ndarray | None:
    """The weights the bonus token is raced over, in float32 as the kernel computes them: after a
    rejected draft (q_n, the draft's probabilities there, given) the residual max(0, p - q), unless
    it has no positive weight (p <= q everywhere: p then is the right law); p_n itself when no draft
    was rejected (q_n None); None when p_n has no positive weight either."""
    p_n = probabilities(p_n)
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, which counts as 0
        candidates = [p_n] if q_n is None else [probabilities(p_n - probabilities(q_n)), p_n]
    return next((w for w in candidates if (w > 0).any()), None)


def spec_accept_sample(vtok: np.ndarray, p: np.ndarray, q: np.ndarray, V: int, k: int, brk: np.ndarray,
                       acc: np.ndarray, last_pred: np.ndarray, ctl: np.ndarray, pos_start: np.ndarray,
                       seed: np.ndarray, batch: int = 1) -> None:
    """Accept drafts with probability min(1, p/q), then sample the bonus (contract 6).

    p is float32 [B][k+1][V], q float32 [B][max(k,1)][V], seed uint64 [B]. Draft x = vtok[1+i] at
    absolute position a = pos_start + 1 + i survives iff U(seed, a, 0, 0) * q[i][x] < p[i][x] in
    float32 (an id >= V, NaN and negative probabilities count as 0, so reject); n = the drafts that
    survive before the first that does not, capped by the p-min break as in greedy. The bonus at
    pos_start + 1 + n is raced (purpose 1) over bonus_weights: the residual after a rejection, p[n]
    otherwise. Committed tokens are then distributed as sampling from p, whatever q is. acc,
    last_pred, keep and brk follow greedy's contract; a done row changes only acc[0], keep and brk[0].
    """
    for vtok, p, q, brk, acc, last_pred, ctl, pos_start, seed in row_views(
            batch, k=k, V=V, vtok=(vtok, k + 1), p=(p, (k + 1) * V), q=(q, max(k, 1) * V), brk=(brk, BRK_WORDS),
            acc=(acc, ACC_WORDS), last_pred=(last_pred, 1), ctl=(ctl, CTL_WORDS), pos_start=(pos_start, 1),
            seed=(seed, 1)):
        n, token = (0, NO_MASS_TOKEN) if ctl[CTL_DONE] != 0 else _sample_verdict(vtok, p, q, V, k, brk, pos_start, seed)
        _settle_row(n, token, k, brk, acc, last_pred, ctl)


def _sample_verdict(vtok: np.ndarray, p: np.ndarray, q: np.ndarray, V: int, k: int, brk: np.ndarray,
                    pos_start: np.ndarray, seed: np.ndarray) -> tuple[int, int]:
    """(n drafts accepted, the bonus token) of one live row."""
    limit = marked_limit(int(brk[BRK_MARK]), k)
    p, q = p.reshape(k + 1, V), q.reshape(max(k, 1), V)
    first = int(pos_start[0]) + 1  # draft 0's absolute position; U wraps it to 32 bits, as the kernel
    i = np.arange(limit)
    x = vtok[1:1 + limit].astype(np.int64)
    known = x < V
    at = np.where(known, x, 0)
    p_x = np.where(known, probabilities(p[i, at]), np.float32(0))
    u = uniform(seed[0], first + i, 0, PURPOSE_ACCEPT).astype(np.float32)
    rejected = np.flatnonzero(~(u * probabilities(q[i, at]) < p_x))
    n = int(rejected[0]) if rejected.size else limit
    weights = bonus_weights(p[n], q[n] if n < limit else None)
    return n, NO_MASS_TOKEN if weights is None else sample_race(weights, seed[0], first + n, PURPOSE_SAMPLE)


def _settle_row(n: int, token: int, k: int, brk: np.ndarray, acc: np.ndarray, last_pred: np.ndarray,
                ctl: np.ndarray) -> None:
    """acc, last_pred, keep and brk after n accepted drafts and the bonus `token`, by greedy's own
    row (contract 3): its predictions match n stand-in drafts, then say `token` (an id, which no
    stand-in equals), so it finds this n, caps and counts as greedy, and leaves a done row inert."""
    stand_in = np.full(k + 1, _STAND_IN, np.uint32)
    pred = np.zeros(k + 1, np.uint32)
    pred[:n], pred[n] = _STAND_IN, token
    _accept_greedy_row(stand_in, pred, k, brk, acc, last_pred, ctl)


# -- 7. spec_draft_sample (ptx/spec_sample.cu): the draft's position-keyed draw ---------------

def spec_draft_sample(step: int, k: int, V: int, q: np.ndarray, pos_ctr: np.ndarray, seed: np.ndarray,
                      draft: np.ndarray, batch: int = 1) -> None:
    """Draft token `step` of each row raced over q[b][step] (float32 [B][max(k,1)][V]) with
    purpose 2 at the absolute position it will sit at, pos_ctr + step + 1, into draft[b][step]
    ([B][max(k,1)]); 0 where q's row has no positive weight (contract 7)."""
    rows = max(k, 1)
    # as the kernel clamps it: a step past the chain redraws the last row (a negative one indexed q's rows
    # and draft from the end, numpy's way, where the kernel's u32 step is past the chain)
    step = min(as_size(step, "step", 0), rows - 1)
    for q, pos_ctr, seed, draft in row_views(batch, k=k, V=V, q=(q, rows * V), pos_ctr=(pos_ctr, 1),
                                             seed=(seed, 1), draft=(draft, rows)):
        token = sample_race(probabilities(q.reshape(rows, V)[step]), seed[0], int(pos_ctr[0]) + step + 1,
                            PURPOSE_DRAFT)
        draft[step] = max(token, 0)


# -- 8, 9. spec_state_copy, spec_state_flip: recurrent state ---------------------------------

def kept_states(ctl: np.ndarray, k: int, batch: int) -> Iterator[tuple[int, int]]:
    """(b, keep) for every row with a state to roll back, keep read as the state kernels read
    it: as u32, clamped to the k + 1 verify states (a done row's 0 rolls nothing back). ctl is
    checked (row_views) before a row is read."""
    for b, (ctl_b,) in enumerate(row_views(batch, k=k, ctl=(ctl, CTL_WORDS))):
        keep = min(int(ctl_b[CTL_KEEP]) % 2**32, k + 1)
        if keep:
            yield b, keep


def _after_last_kept(b: int, keep: int) -> int:
    """A chain's kept slot: the state after its last kept token, keep - 1."""
    return keep - 1


def spec_state_copy(table: list, k: int, ctl: np.ndarray, batch: int = 1, *, slots: int | None = None,
                    slot_of: Callable[[int, int], int] = _after_last_kept) -> None:
    """Each layer's live state becomes the state after the last kept token: row b of live
    ([B][row_words]) becomes slot slot_of(b, keep) (keep - 1) of row b of slots
    ([B][slots][row_words], slots k + 1 by default); keep 0 copies nothing. (A tree's kernel 16
    keeps its path's last node: reference_tree.spec_tree_state_copy; as ptx/state.cuh's slot_of.)

    The table holds per layer (live, slots, row_words), the arrays standing for the device
    pointers, or None for a layer without state (each checked, rows_of, before a row is read:
    read by their words in order, whatever their shapes, and the live state written through a
    view of it, so an array no view reaches is refused).
    """
    batch = as_size(batch, "batch")  # as row_views checks it: the layers' rows are counted in it
    kept = list(kept_states(ctl, k, batch))
    slots = k + 1 if slots is None else as_size(slots, "slots")  # a kept row reads one
    layers = []
    for i, layer in enumerate(table):
        if layer is not None:  # its arrays' words in order, whatever their shapes ([slots][row_words], say)
            row_words = as_size(layer[2], f"table[{i}]'s row_words", 0)
            layers.append((rows_of(layer[0], batch, row_words, f"table[{i}]'s live", flat=False),
                           rows_of(layer[1], batch, slots * row_words, f"table[{i}]'s slots",
                                   flat=False).reshape(batch, slots, row_words)))
    for b, keep in kept:
        slot = slot_of(b, keep)
        for live, held in layers:
            live[b] = held[b, slot]


def spec_state_flip(idx_ptrs: list, k: int, ctl: np.ndarray, batch: int = 1, *, slots: int | None = None,
                    slot_of: Callable[[int, int], int] = _after_last_kept) -> None:
    """Each model's slot index (u32[B], standing for its device pointer; None: skip) moves to
    slot slot_of(b, keep) (keep - 1) of the bank of `slots` (k + 1) the verify wrote, the one idx
    is not in: idx = (1 - bank) * slots + slot with bank = min(idx // slots, 1), so a garbage idx
    counts as bank 1 and the new one is in range. keep 0 leaves idx as it is."""
    kept = list(kept_states(ctl, k, batch))
    slots = k + 1 if slots is None else as_size(slots, "slots")  # a bank of none has no slot to flip to
    indices = [rows_of(idx, batch, 1, f"idx_ptrs[{i}]") for i, idx in enumerate(idx_ptrs) if idx is not None]
    for b, keep in kept:
        slot = slot_of(b, keep)
        for idx in indices:
            bank = min(int(idx[b, 0]) // slots, 1)
            idx[b] = (1 - bank) * slots + slot


# -- spec_choose_lengths (ptx/spec_stream.cu): each row's draft length, chosen on the device --

def spec_choose_lengths(ctl: np.ndarray, acc: np.ndarray, brk: np.ndarray, rate: np.ndarray, cap: np.ndarray,
                        cost: np.ndarray, width: np.ndarray, k: int, decay: float, prior: float,
                        batch: int = 1) -> None:
    """Each row's draft length for the next round, from the rows' running acceptance and the
    measured costs of the widths (docs/lengths.md); launched once a round, before the draft chain.

    rate is float32 [B][RATE_WORDS], cap uint32 [B] (each request's most draft length; 0:
    speculation off), cost float32 [COST_VERIFY + k + 1] (a draft step, then the verify of w + 1
    tokens for w = 0..k, in plain steps), width uint32 [1]. Done rows are left as they are and
    count for nothing. For each live row:

    - Its statistics. A keep of 0 means the row was admitted since the last round (a reset
      clears keep, every judged round sets it to at least 1): they restart at the prior,
      accepted = prior, rejected = 1 - prior. Otherwise the last round judged the row at length
      L = min(width, cap, k) (width as the last launch left it) and it accepted
      n = min(acc[ACC_ROUND], L); if L >= 1, accepted = decay * accepted + n and rejected =
      decay * rejected + (n < L); if L = 0 nothing was judged and they decay toward the prior,
      accepted = decay * accepted + (1 - decay) * prior and rejected = decay * rejected +
      (1 - decay) * (1 - prior), so a batch whose width fell to 0 can open it again (else no row
      would ever be judged again). In float32, each product, difference and sum rounded on its
      own (no fused multiply-add). These are a geometric acceptance's sufficient statistics, so
      accepted / (accepted + rejected) is the per-draft acceptance's maximum-likelihood estimate
      (length_estimates), and the decay lets it follow the request's text. A round that the
      draft's p-min break cut short counts as a rejection: the break falls where the draft
      doubts its token, so the estimate errs low.
    - Then the batch's width: W = 0..k maximising width_values over the live rows, ties to the
      smaller W, 0 where no width has a positive cost; width[0] = W, the selector a SWITCH of
      bodies by width reads.
    - Then its length, min(W, cap), as its acceptance cap (mark_lengths).

    Why one width for the batch and a cap per row: in a body of width W every row drafts W
    tokens and the verify reads W + 1 of each, so a row judged at fewer saves nothing; the
    width is what costs, and what there is to choose. A row's own cap is its request's limit,
    which no cost overrides. Exact whatever the lengths: a row capped at L is judged as a chain
    of L drafts (kernels 3 and 6), at L = 0 as plain decoding, and L depends only on rounds
    already judged.
    """
    batch = as_size(batch, "batch")  # as row_views checks it: the rates' rows are counted in it
    views = row_views(batch, k=k, ctl=(ctl, CTL_WORDS), acc=(acc, ACC_WORDS), brk=(brk, BRK_WORDS),
                      rate=(rate, RATE_WORDS), cap=(cap, 1))
    rows_of(cost, 1, COST_VERIFY + k + 1, "cost")
    rows_of(width, 1, 1, "width")
    decay32, prior32 = np.float32(decay), np.float32(prior)
    rest32 = np.float32(1) - decay32  # the weight a round without evidence gives the prior
    last = min(int(width[0]), k)
    live = []
    with np.errstate(all="ignore"):  # garbage words may overflow or be NaN: the kernel's f32 does the same
        for b, (ctl_b, acc_b, _, rate_b, cap_b) in enumerate(views):
            if ctl_b[CTL_DONE] != 0:
                continue
            live.append(b)
            if ctl_b[CTL_KEEP] == 0:
                rate_b[RATE_ACCEPTED], rate_b[RATE_REJECTED] = prior32, np.float32(1) - prior32
                continue
            length = min(last, int(cap_b[0]))
            if length:
                n = min(int(acc_b[ACC_ROUND]), length)
                rate_b[RATE_ACCEPTED] = decay32 * rate_b[RATE_ACCEPTED] + np.float32(n)
                rate_b[RATE_REJECTED] = decay32 * rate_b[RATE_REJECTED] + np.float32(n < length)
            else:  # nothing judged: the belief decays toward the prior
                rate_b[RATE_ACCEPTED] = decay32 * rate_b[RATE_ACCEPTED] + rest32 * prior32
                rate_b[RATE_REJECTED] = decay32 * rate_b[RATE_REJECTED] + rest32 * (np.float32(1) - prior32)
    rows = np.array(live, np.int64)
    values = width_values(length_estimates(rate[:batch * RATE_WORDS].reshape(batch, RATE_WORDS)[rows]), cap[rows],
                          cost, k)
    width[0] = int(np.argmax(values))  # the first of equal values: ties to the smaller width
    mark_lengths(ctl, brk, cap, int(width[0]), k, batch)


def length_estimates(rate: np.ndarray) -> np.ndarray:
    """Each row's per-draft acceptance a, float64 [rows] from its float32 words: accepted /
    (accepted + rejected), computed in float64; clamped to [0, 1], and 0 where the sum is not
    positive or the quotient is no number (garbage words)."""
    words = np.asarray(rate, np.float32).reshape(-1, RATE_WORDS).astype(np.float64)
    accepted, total = words[:, RATE_ACCEPTED], words[:, RATE_ACCEPTED] + words[:, RATE_REJECTED]
    with np.errstate(all="ignore"):
        a = np.where(total > 0, accepted / np.where(total > 0, total, 1), 0.0)
    return np.fmin(np.fmax(a, 0.0), 1.0)  # fmax and fmin drop a NaN, as the kernel's do


def width_values(a: np.ndarray, cap: np.ndarray, cost: np.ndarray, k: int) -> np.ndarray:
    """The batch's expected tokens per unit of cost at each width W = 0..k, float64 [k + 1]: the
    sum over the rows (estimates a, caps cap) of E(min(W, cap)) over the round's cost
    cost[COST_VERIFY + W] + W * cost[COST_DRAFT]; -inf where that cost is not positive.

    E(L) = 1 + a + ... + a^L = (1 - a^(L+1)) / (1 - a) is what a row of acceptance a commits
    from a round of L drafts (L + 1 at a = 1), so the sum is G(0) + ... + G(W) with G(i) the
    rows' a^i over the rows whose cap is at least i; each a^i is a product of i factors a from
    1, and each sum is accumulated in increasing i, as the kernel does. The kernel adds the
    rows of one G(i) in another order, so its values may differ from these in the last bits.
    `a` and `cap` are one value a row each (1-D, of the same length), refused otherwise (a cap
    short of the rows met numpy's boolean index error, and a single cap was taken for every row)."""
    sizes(k)
    rows_of(cost, 1, COST_VERIFY + k + 1, "cost")
    a, cap = np.asarray(a, np.float64), np.asarray(cap, np.int64)
    if a.ndim != 1 or cap.shape != a.shape:
        raise ValueError(f"a and cap must hold one value a row each (1-D, of the same length), not arrays of "
                         f"shapes {a.shape} and {cap.shape}")
    cap = np.minimum(cap, k)
    power, total, totals = np.ones_like(a), 0.0, np.empty(k + 1)
    for i in range(k + 1):
        total += float(power[cap >= i].sum())
        totals[i] = total
        power = power * a
    widths = np.arange(k + 1, dtype=np.float64)
    with np.errstate(all="ignore"):  # garbage costs: 0 * inf is NaN, no positive cost, as in the kernel
        costs = cost[COST_VERIFY:COST_VERIFY + k + 1].astype(np.float64) + widths * np.float64(cost[COST_DRAFT])
        return np.where(costs > 0, totals / np.where(costs > 0, costs, 1), -np.inf)


def mark_lengths(ctl: np.ndarray, brk: np.ndarray, cap: np.ndarray, width: int, k: int, batch: int = 1) -> None:
    """Each live row's length L = min(width, cap, k) as its acceptance cap: BRK_MARK lowered to
    L + 1 where L < k (tighter_mark); a length of k caps nothing, so BRK_COUNT does not count it."""
    for ctl_b, brk_b, cap_b in row_views(batch, k=k, ctl=(ctl, CTL_WORDS), brk=(brk, BRK_WORDS), cap=(cap, 1)):
        if ctl_b[CTL_DONE] == 0:
            length = min(width, int(cap_b[0]), k)
            brk_b[BRK_MARK] = tighter_mark(int(brk_b[BRK_MARK]), length + 1 if length < k else 0)


def tighter_mark(mark: int, new: int) -> int:
    """Two caps on a row's acceptance as BRK_MARK words (i + 1: at most i drafts; 0: no cap) as
    one, the smaller cap. Whoever writes the mark (the draft's p-min break, the length chooser)
    only lowers it, so the order they run in does not matter."""
    return new if mark == 0 else mark if new == 0 else min(mark, new)

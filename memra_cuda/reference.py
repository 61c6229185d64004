"""The executable specification of ptx/spec_stream.cu, in numpy.

One function per kernel, named after it, taking the same buffers as numpy arrays (u32 buffers
as uint32, i32 buffers as int32) and updating them in place exactly as the kernel does,
clamps included. It is the oracle of the GPU tests and the plainest statement of the contracts.
Token buffers the model writes (draft, pred) may be 32- or 64-bit: ids are < 2**31, and the
kernels read the low 32 bits of a 64-bit word (`ids`).
"""
from __future__ import annotations

import numpy as np

# ctl_d slots
EOS, BUDGET, DONE, KEEP = range(4)


def ids(tokens: np.ndarray) -> np.ndarray:
    """Token ids as the kernels read them: the low 32 bits of each word."""
    return tokens.astype(np.uint32)


def spec_seed_gather(rows: np.ndarray, n_rows: int, row_words: int, acc: np.ndarray,
                     out: np.ndarray) -> None:
    """out = the verify row of the bonus token (row acc[0], clamped to the last row)."""
    if n_rows == 0:
        return
    r = min(int(acc[0]), n_rows - 1)
    out[:row_words] = rows[r * row_words:(r + 1) * row_words]


def spec_assemble_verify(pend: np.ndarray, draft: np.ndarray, k: int, vtok: np.ndarray,
                         pos_ctr: np.ndarray, pos_start: np.ndarray) -> None:
    """vtok = [pending token, draft_0 .. draft_{k-1}]; the round starts at pos_ctr."""
    vtok[0] = pend[0]
    vtok[1:k + 1] = ids(draft[:k])
    pos_start[0] = pos_ctr[0]


def spec_accept_greedy_dc(vtok: np.ndarray, pred: np.ndarray, k: int, brk: np.ndarray,
                          acc: np.ndarray, last_pred: np.ndarray, ctl: np.ndarray) -> None:
    """Accept the longest prefix of drafts equal to the target's predictions.

    A p-min break at draft i (brk[0] = i + 1) caps acceptance at i drafts. The target's
    prediction after the last accepted token becomes the bonus (last_pred); keep = n + 1 KV
    entries (the pending token and n drafts) survive the round. Once done, nothing is kept.
    """
    b = int(brk[0])
    pred = ids(pred)
    if ctl[DONE] != 0:
        acc[0] = 0
        ctl[KEEP] = 0
    else:
        limit = min(k, b - 1) if b else k
        n = 0
        while n < limit and vtok[1 + n] == pred[n]:
            n += 1
        acc[0] = n
        acc[1] = (int(acc[1]) + n) & 0xFFFFFFFF
        last_pred[0] = pred[n]
        ctl[KEEP] = n + 1
        if b:
            brk[1] = (int(brk[1]) + 1) & 0xFFFFFFFF
    brk[0] = 0


def spec_ring_commit(vtok: np.ndarray, acc: np.ndarray, last_pred: np.ndarray, ctl: np.ndarray,
                     pend: np.ndarray, ring: np.ndarray, ring_cap: int, k: int) -> None:
    """Append the accepted drafts, then the bonus, one at a time until done.

    Budget 0 means done before the token; otherwise the token goes in (if the ring has room),
    a positive budget counts down, and EOS or a spent budget means done after it. The bonus
    becomes the pending token whatever happened.
    """
    if ctl[DONE] != 0:
        return
    eos, budget = int(ctl[EOS]), int(ctl[BUDGET])
    n = min(int(acc[0]), k)
    bonus = int(last_pred[0])
    count = min(int(ring[0]), ring_cap)
    done = False
    for tok in [int(t) for t in vtok[1:1 + n]] + [bonus]:
        if budget == 0:
            done = True
            break
        if count < ring_cap:
            ring[1 + count] = tok
            count += 1
        if budget > 0:
            budget -= 1
        done = (eos >= 0 and tok == eos) or budget == 0
        if done:
            break
    ring[0] = count
    ctl[BUDGET] = budget
    ctl[DONE] = int(done)
    pend[0] = bonus


def spec_rollback_stream(len_ptrs: list, pos_start: np.ndarray, ctl: np.ndarray) -> None:
    """Every length in the table (None for a layer without KV) becomes pos_start + keep.

    The table holds the one-element length arrays themselves, standing for device pointers.
    """
    value = (int(pos_start[0]) + int(ctl[KEEP]) + 2**31) % 2**32 - 2**31  # i32 wrap-around
    for length in len_ptrs:
        if length is not None:
            length[0] = value

// A round's tail after its acceptance, one row at a time: the commit (kernel 4) and the rollback
// of the KV lengths (kernel 5). Shared by those kernels (spec_stream.cu) and by the greedy round
// tails, which run a row's acceptance, commit and rollback in one launch (spec_stream.cu's for a
// chain, spec_tree.cu's for a tree), so each step has one body whichever kernel runs it.
#pragma once

#include "layout.cuh"

typedef unsigned int u32;
typedef unsigned long long u64;

// 4. Commit the accepted drafts and the bonus token to the ring, applying EOS and the budget.
//    k bounds the accept count read from acc_d (the contract's arguments, plus this bound).
//    One warp a row: lanes load 32 tokens at once; every lane then walks them in the same order
//    (the state is uniform across the warp) and lane 0 stores. Ring rows are RING_TOKENS + ring_cap long.
__device__ void ring_commit_row(u32 b, const u32* vtok_d, u32* acc_d, const u32* last_pred_d, int* ctl_d,
                                u32* pend_d, u32* ring_d, u32 ring_cap, u32 k) {
    const u32 lane = threadIdx.x & 31;
    const u32* vtok = vtok_d + (u64)b * (k + 1);
    int* ctl = ctl_d + CTL_WORDS * b;
    u32* ring = ring_d + (u64)b * (RING_TOKENS + ring_cap);
    const int done_at_entry = ctl[CTL_DONE], eos = ctl[CTL_EOS];
    int budget = ctl[CTL_BUDGET];
    const u32 n = min(acc_d[ACC_WORDS * b + ACC_ROUND], k);
    const u32 bonus = last_pred_d[b];
    u32 count = min(ring[RING_COUNT], ring_cap);
    if (done_at_entry != 0) return;  // the whole warp: every lane read the same flag
    int done = 0;
    u32 walked = 0;  // tokens committed this round (the ring may have had room for fewer)
    for (u32 base = 0; base <= n && !done; base += 32) {
        const u32 i = base + lane;
        const u32 mine = i < n ? vtok[1 + i] : bonus;
        for (u32 j = 0; j < 32 && base + j <= n; ++j) {
            const u32 tok = __shfl_sync(0xffffffffu, mine, j);
            if (budget == 0) {
                done = 1;
                break;
            }
            if (count < ring_cap) {
                if (lane == 0) ring[RING_TOKENS + count] = tok;
                ++count;
            }
            ++walked;
            if (budget > 0) --budget;
            done = (eos >= 0 && tok == (u32)eos) || budget == 0;
            if (done) break;
        }
    }
    if (lane == 0) {
        // A stop inside the drafts commits fewer than n + 1 tokens: the total counts only the
        // drafts it committed before the last, so committed - accepted still counts the rounds.
        if (walked <= n) acc_d[ACC_WORDS * b + ACC_TOTAL] -= n + 1 - max(walked, 1u);
        ring[RING_COUNT] = count;
        ctl[CTL_BUDGET] = budget;
        ctl[CTL_DONE] = done;
        pend_d[b] = bonus;
    }
}

// 5. One entry of the rollback table for row b: a non-zero entry points at an i32[B], whose
//    element b becomes the row's pos_start + keep (wrapping, as the reference).
__device__ __forceinline__ void rollback_entry(const u64* len_ptrs, u32 entry, u32 b, const int* pos_start_d,
                                               const int* ctl_d) {
    int* p = (int*)len_ptrs[entry];
    if (p) p[b] = (int)((u32)pos_start_d[b] + (u32)ctl_d[CTL_WORDS * b + CTL_KEEP]);
}

// A greedy round's tail once row b's acceptance has settled it (acc, last_pred, keep, and a
// tree's vtok and path), the whole warp calling: the warp syncs (what lane 0 of the acceptance
// wrote is then seen by every lane), commits the row, syncs again, and rolls back the row's
// entries of the table, the lanes striding over it. Every step reads only row b's words, so a
// warp a row composes the three kernels exactly.
__device__ void commit_and_roll_back_row(u32 b, const u32* vtok_d, u32* acc_d, const u32* last_pred_d, int* ctl_d,
                                         u32* pend_d, u32* ring_d, u32 ring_cap, u32 k, const u64* len_ptrs,
                                         u32 n_ptrs, const int* pos_start_d) {
    __syncwarp();
    ring_commit_row(b, vtok_d, acc_d, last_pred_d, ctl_d, pend_d, ring_d, ring_cap, k);
    __syncwarp();
    for (u32 entry = threadIdx.x & 31; entry < n_ptrs; entry += 32) rollback_entry(len_ptrs, entry, b, pos_start_d,
                                                                                    ctl_d);
    __syncwarp();  // the next row's steps (a warp strides over rows) start together
}

// Round-stream speculative decoding: the five per-round kernels (DESIGN.md, "Kernel contracts").
//
// Every kernel serves one sequence and takes only device pointers and launch-time constants, so
// a captured graph replays unchanged while the values it reads move on the device. Whatever the
// device memory holds (a garbage accept count, ring count or break marker), no kernel reads or
// writes outside its buffers: counts are clamped to the sizes the launcher passes.

typedef unsigned int u32;
typedef unsigned long long u64;

#define GRID_STRIDE(i, n) \
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += gridDim.x * blockDim.x)

// 1. The verify hidden row that produced the bonus token, for EAGLE/MTP-style drafts.
extern "C" __global__ void spec_seed_gather(const u32* rows, u32 n_rows, u32 row_words,
                                            const u32* acc_d, u32* out) {
    if (n_rows == 0) return;
    const u32 r = min(acc_d[0], n_rows - 1);
    const u32* row = rows + (u64)r * row_words;
    GRID_STRIDE(i, row_words) out[i] = row[i];
}

// Token buffers the model writes (draft_d, pred_d) hold 32- or 64-bit ids (PyTorch's argmax
// gives int64); ids are < 2**31, so either reads as the same u32. Each kernel that reads one
// comes in both widths: <name> for 32 bits, <name>_t64 for 64.

// 2. Verify input = pending token then the k drafts; remember where the round started.
template <typename Tok>
__device__ void assemble_verify(const u32* pend_d, const Tok* draft_d, u32 k, u32* vtok_d, const int* pos_ctr,
                                int* pos_start_d) {
    GRID_STRIDE(i, k + 1) vtok_d[i] = i == 0 ? pend_d[0] : (u32)draft_d[i - 1];
    if (blockIdx.x == 0 && threadIdx.x == 0) pos_start_d[0] = pos_ctr[0];
}

extern "C" __global__ void spec_assemble_verify(const u32* pend_d, const u32* draft_d, u32 k,
                                                u32* vtok_d, const int* pos_ctr, int* pos_start_d) {
    assemble_verify(pend_d, draft_d, k, vtok_d, pos_ctr, pos_start_d);
}

extern "C" __global__ void spec_assemble_verify_t64(const u32* pend_d, const u64* draft_d, u32 k,
                                                    u32* vtok_d, const int* pos_ctr, int* pos_start_d) {
    assemble_verify(pend_d, draft_d, k, vtok_d, pos_ctr, pos_start_d);
}

// 3. Greedy acceptance: the longest prefix of drafts the target agrees with, cut at a p-min break.
//    One warp: lanes compare 32 positions at once, so the round pays one load latency, not k.
template <typename Tok>
__device__ void accept_greedy(const u32* vtok_d, const Tok* pred_d, u32 k, u32* brk_d, u32* acc_d,
                              u32* last_pred_d, int* ctl_d) {
    if (blockIdx.x != 0 || threadIdx.x >= 32) return;
    const u32 lane = threadIdx.x;
    const u32 brk = brk_d[0];
    const int done = ctl_d[2];
    const u32 limit = brk ? min(k, brk - 1) : k;
    u32 n = limit;
    for (u32 base = 0; base < limit; base += 32) {
        const u32 i = base + lane;
        const u32 misses = __ballot_sync(0xffffffffu, i < limit && vtok_d[1 + i] != (u32)pred_d[i]);
        if (misses) {
            n = base + __ffs(misses) - 1;
            break;
        }
    }
    if (lane != 0) return;
    if (done != 0) {
        acc_d[0] = 0;
        ctl_d[3] = 0;
    } else {
        acc_d[0] = n;
        acc_d[1] += n;
        last_pred_d[0] = (u32)pred_d[n];
        ctl_d[3] = (int)(n + 1);
        if (brk) brk_d[1] += 1;
    }
    brk_d[0] = 0;
}

extern "C" __global__ void spec_accept_greedy_dc(const u32* vtok_d, const u32* pred_d, u32 k, u32* brk_d,
                                                 u32* acc_d, u32* last_pred_d, int* ctl_d) {
    accept_greedy(vtok_d, pred_d, k, brk_d, acc_d, last_pred_d, ctl_d);
}

extern "C" __global__ void spec_accept_greedy_dc_t64(const u32* vtok_d, const u64* pred_d, u32 k, u32* brk_d,
                                                     u32* acc_d, u32* last_pred_d, int* ctl_d) {
    accept_greedy(vtok_d, pred_d, k, brk_d, acc_d, last_pred_d, ctl_d);
}

// 4. Commit the accepted drafts and the bonus token to the ring, applying EOS and the budget.
//    k bounds the accept count read from acc_d (the contract's arguments, plus this bound).
//    One warp: lanes load 32 tokens at once; every lane then walks them in the same order
//    (the state is uniform across the warp) and lane 0 stores.
extern "C" __global__ void spec_ring_commit(const u32* vtok_d, const u32* acc_d, const u32* last_pred_d,
                                            int* ctl_d, u32* pend_d, u32* ring_d, u32 ring_cap, u32 k) {
    if (blockIdx.x != 0 || threadIdx.x >= 32) return;
    const u32 lane = threadIdx.x;
    const int done_at_entry = ctl_d[2], eos = ctl_d[0];
    int budget = ctl_d[1];
    const u32 n = min(acc_d[0], k);
    const u32 bonus = last_pred_d[0];
    u32 count = min(ring_d[0], ring_cap);
    if (done_at_entry != 0) return;
    int done = 0;
    for (u32 base = 0; base <= n && !done; base += 32) {
        const u32 i = base + lane;
        const u32 mine = i < n ? vtok_d[1 + i] : bonus;
        for (u32 j = 0; j < 32 && base + j <= n; ++j) {
            const u32 tok = __shfl_sync(0xffffffffu, mine, j);
            if (budget == 0) {
                done = 1;
                break;
            }
            if (count < ring_cap) {
                if (lane == 0) ring_d[1 + count] = tok;
                ++count;
            }
            if (budget > 0) --budget;
            done = (eos >= 0 && tok == (u32)eos) || budget == 0;
            if (done) break;
        }
    }
    if (lane == 0) {
        ring_d[0] = count;
        ctl_d[1] = budget;
        ctl_d[2] = done;
        pend_d[0] = bonus;
    }
}

// 5. Roll every KV length in the table (and pos_ctr, when it is last) back to what was kept.
extern "C" __global__ void spec_rollback_stream(const u64* len_ptrs, u32 n_ptrs,
                                                const int* pos_start_d, const int* ctl_d) {
    const int len = (int)((u32)pos_start_d[0] + (u32)ctl_d[3]);  // wraps, as in the reference
    GRID_STRIDE(i, n_ptrs) {
        int* p = (int*)len_ptrs[i];
        if (p) *p = len;
    }
}

// Round-stream speculative decoding: the per-round kernels (docs/kernels.md, "Kernel contracts").
//
// Every kernel takes B, the sequences of the batch, and applies its single-sequence contract to
// each row of its row-major buffers (row b of a buffer of row length n starts at b * n). It takes
// only device pointers and launch-time constants, so a captured graph replays unchanged while the
// values it reads move on the device. Whatever the device memory holds (a garbage accept count,
// ring count or break marker), no kernel reads or writes outside its buffers: counts are clamped
// to the sizes the launcher passes. Rows are laid out as ptx/layout.cuh says.

#include "layout.cuh"
#include "round_tail.cuh"
#include "state.cuh"

#define GRID_STRIDE(i, n) \
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

// The warp kernels (accept, commit, the greedy round tail) serve a row with a whole warp: warp w of the grid takes rows
// w, w + (the grid's warps), ..., so any grid covers any B (the launcher caps the grid at 1024
// blocks). blockDim.x is a multiple of 32, so a warp's lanes walk the same rows together and every
// ballot and shuffle of a row's body has all 32 of them.
#define WARP_STRIDE(b, B) \
    for (u64 b = (blockIdx.x * (u64)blockDim.x + threadIdx.x) / 32; b < (B); b += (u64)gridDim.x * blockDim.x / 32)

// 1. The verify hidden row that produced the bonus token, for EAGLE/MTP-style drafts.
//    rows is [B][n_rows][row_words], out [B][row_words]; blockIdx.y is the row.
extern "C" __global__ void spec_seed_gather(const u32* rows, u32 n_rows, u32 row_words, u32 B,
                                            const u32* acc_d, u32* out) {
    const u32 b = blockIdx.y;
    if (n_rows == 0 || b >= B) return;
    const u32 r = min(acc_d[ACC_WORDS * b + ACC_ROUND], n_rows - 1);
    const u32* row = rows + ((u64)b * n_rows + r) * row_words;
    u32* dst = out + (u64)b * row_words;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < row_words; i += gridDim.x * blockDim.x) dst[i] = row[i];
}

// Token buffers the model writes (draft_d, pred_d) hold 32- or 64-bit ids (PyTorch's argmax
// gives int64); ids are < 2**31, so either reads as the same u32. Each kernel that reads one
// comes in both widths: <name> for 32 bits, <name>_t64 for 64. Rows of draft_d are max(k, 1)
// tokens apart, rows of pred_d k + 1.

// 2. Verify input = pending token then the k drafts; remember where the round started.
template <typename Tok>
__device__ void assemble_verify(const u32* pend_d, const Tok* draft_d, u32 k, u32 B, u32* vtok_d,
                                const int* pos_ctr, int* pos_start_d) {
    const u32 k1 = k + 1, stride = max(k, 1u);
    GRID_STRIDE(i, (u64)B * k1) {
        const u32 b = (u32)(i / k1), j = (u32)(i % k1);
        vtok_d[i] = j == 0 ? pend_d[b] : (u32)draft_d[(u64)b * stride + j - 1];
        if (j == 0) pos_start_d[b] = pos_ctr[b];
    }
}

extern "C" __global__ void spec_assemble_verify(const u32* pend_d, const u32* draft_d, u32 k, u32 B,
                                                u32* vtok_d, const int* pos_ctr, int* pos_start_d) {
    assemble_verify(pend_d, draft_d, k, B, vtok_d, pos_ctr, pos_start_d);
}

extern "C" __global__ void spec_assemble_verify_t64(const u32* pend_d, const u64* draft_d, u32 k, u32 B,
                                                    u32* vtok_d, const int* pos_ctr, int* pos_start_d) {
    assemble_verify(pend_d, draft_d, k, B, vtok_d, pos_ctr, pos_start_d);
}

// 3. Greedy acceptance: the longest prefix of drafts the target agrees with, cut at a p-min break.
//    One warp a row: lanes compare 32 positions at once, so the round pays one load latency, not k.
template <typename Tok>
__device__ void accept_greedy_row(u32 b, const u32* vtok_d, const Tok* pred_d, u32 k, u32* brk_d, u32* acc_d,
                                  u32* last_pred_d, int* ctl_d) {
    const u32 lane = threadIdx.x & 31;
    const u32* vtok = vtok_d + (u64)b * (k + 1);
    const Tok* pred = pred_d + (u64)b * (k + 1);
    u32* brk_row = brk_d + BRK_WORDS * b;
    u32* acc = acc_d + ACC_WORDS * b;
    int* ctl = ctl_d + CTL_WORDS * b;
    const u32 brk = brk_row[BRK_MARK];
    const int done = ctl[CTL_DONE];
    const u32 limit = marked_limit(brk, k);
    u32 n = limit;
    for (u32 base = 0; base < limit; base += 32) {
        const u32 i = base + lane;
        const u32 misses = __ballot_sync(0xffffffffu, i < limit && vtok[1 + i] != (u32)pred[i]);
        if (misses) {
            n = base + __ffs(misses) - 1;
            break;
        }
    }
    if (lane != 0) return;
    if (done != 0) {
        acc[ACC_ROUND] = 0;
        ctl[CTL_KEEP] = 0;
    } else {
        acc[ACC_ROUND] = n;
        acc[ACC_TOTAL] += n;
        last_pred_d[b] = (u32)pred[n];
        ctl[CTL_KEEP] = (int)(n + 1);
        if (brk) brk_row[BRK_COUNT] += 1;
    }
    brk_row[BRK_MARK] = 0;
}

template <typename Tok>
__device__ void accept_greedy(const u32* vtok_d, const Tok* pred_d, u32 k, u32 B, u32* brk_d, u32* acc_d,
                              u32* last_pred_d, int* ctl_d) {
    WARP_STRIDE(b, B) accept_greedy_row((u32)b, vtok_d, pred_d, k, brk_d, acc_d, last_pred_d, ctl_d);
}

extern "C" __global__ void spec_accept_greedy_dc(const u32* vtok_d, const u32* pred_d, u32 k, u32 B, u32* brk_d,
                                                 u32* acc_d, u32* last_pred_d, int* ctl_d) {
    accept_greedy(vtok_d, pred_d, k, B, brk_d, acc_d, last_pred_d, ctl_d);
}

extern "C" __global__ void spec_accept_greedy_dc_t64(const u32* vtok_d, const u64* pred_d, u32 k, u32 B,
                                                     u32* brk_d, u32* acc_d, u32* last_pred_d, int* ctl_d) {
    accept_greedy(vtok_d, pred_d, k, B, brk_d, acc_d, last_pred_d, ctl_d);
}

// 4. Commit the accepted drafts and the bonus token to the ring, applying EOS and the budget
//    (ring_commit_row, round_tail.cuh). One warp a row.
extern "C" __global__ void spec_ring_commit(const u32* vtok_d, u32* acc_d, const u32* last_pred_d,
                                            int* ctl_d, u32* pend_d, u32* ring_d, u32 ring_cap, u32 k, u32 B) {
    WARP_STRIDE(b, B) ring_commit_row((u32)b, vtok_d, acc_d, last_pred_d, ctl_d, pend_d, ring_d, ring_cap, k);
}

// 4'. Publish the round's committed tokens to the host while the loop runs (device-resident
//     generation, docs/device-mode.md, "Its kernels"). A branch of the loop graph beside the
//     next round's draft and verify, joined before its commit, so the round never waits for
//     host memory: each row's ring is appended to the row's stream in mapped pinned memory,
//     each token with a %globaltimer stamp (low 32 bits), then __threadfence_system(), then
//     the row's published count, so a host that reads a count sees every token below it. The
//     ring is emptied for the next commit; pub_d[b] counts what row b published, and writes past
//     out_cap are dropped (the host sizes the stream for the budget). Then, once every row is
//     out, the stream's head: the publish's stamp, a fence, and the number of publishes so far
//     (seq_d), what the host watches between looks. One block.
__device__ __forceinline__ u32 global_time_lo() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return (u32)t;
}

extern "C" __global__ void spec_ring_publish(u32* ring_d, u32 ring_cap, u32 B, u32* pub_d, u32* seq_d,
                                             volatile u32* out_head, volatile u32* out_count, u32* out_tokens,
                                             u32* out_stamps, u32 out_cap) {
    const u32 stamp = global_time_lo();
    for (u32 b = threadIdx.x; b < B; b += blockDim.x) {
        const u32* ring = ring_d + (u64)b * (RING_TOKENS + ring_cap);
        const u32 base = min(pub_d[b], out_cap), end = min(base + min(ring[RING_COUNT], ring_cap), out_cap);
        for (u32 i = base; i < end; ++i) {
            out_tokens[(u64)b * out_cap + i] = ring[RING_TOKENS + i - base];
            out_stamps[(u64)b * out_cap + i] = stamp;
        }
    }
    __threadfence_system();  // this thread's tokens, before any of its counts
    for (u32 b = threadIdx.x; b < B; b += blockDim.x) {
        u32* ring = ring_d + (u64)b * (RING_TOKENS + ring_cap);
        const u32 n = min(ring[RING_COUNT], ring_cap);
        if (n == 0) continue;
        const u32 end = min(min(pub_d[b], out_cap) + n, out_cap);
        out_count[b] = end;
        pub_d[b] = end;
        ring[RING_COUNT] = 0;
    }
    __threadfence_system();  // every count before the head says the publish is out
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 seq = *seq_d + 1;
        *seq_d = seq;
        out_head[HEAD_STAMP] = stamp;
        __threadfence_system();
        out_head[HEAD_SEQ] = seq;
    }
}

// 5. Roll every KV length in the table (and pos_ctr, when it is last) back to what was kept:
//    each non-zero entry points at an i32[B], whose element b becomes row b's pos_start + keep.
extern "C" __global__ void spec_rollback_stream(const u64* len_ptrs, u32 n_ptrs, u32 B,
                                                const int* pos_start_d, const int* ctl_d) {
    GRID_STRIDE(i, (u64)n_ptrs * B) rollback_entry(len_ptrs, (u32)(i / B), (u32)(i % B), pos_start_d, ctl_d);
}

// 3 + 4 + 5. A greedy chain round's tail in one launch: for each row, what kernel 3, then kernel
//    4, then kernel 5 over `len_ptrs` do to it, one warp a row (round_tail.cuh). Each of the three
//    reads and writes only its row's words, so running them a row at a time is running them one
//    after another; one launch instead of three on the round's critical path.
template <typename Tok>
__device__ void round_tail_greedy(const u32* vtok_d, const Tok* pred_d, u32 k, u32 B, u32* brk_d, u32* acc_d,
                                  u32* last_pred_d, int* ctl_d, u32* pend_d, u32* ring_d, u32 ring_cap,
                                  const u64* len_ptrs, u32 n_ptrs, const int* pos_start_d) {
    WARP_STRIDE(b, B) {
        accept_greedy_row((u32)b, vtok_d, pred_d, k, brk_d, acc_d, last_pred_d, ctl_d);
        commit_and_roll_back_row((u32)b, vtok_d, acc_d, last_pred_d, ctl_d, pend_d, ring_d, ring_cap, k, len_ptrs,
                                 n_ptrs, pos_start_d);
    }
}

extern "C" __global__ void spec_round_tail_greedy(const u32* vtok_d, const u32* pred_d, u32 k, u32 B, u32* brk_d,
                                                  u32* acc_d, u32* last_pred_d, int* ctl_d, u32* pend_d, u32* ring_d,
                                                  u32 ring_cap, const u64* len_ptrs, u32 n_ptrs,
                                                  const int* pos_start_d) {
    round_tail_greedy(vtok_d, pred_d, k, B, brk_d, acc_d, last_pred_d, ctl_d, pend_d, ring_d, ring_cap, len_ptrs,
                      n_ptrs, pos_start_d);
}

extern "C" __global__ void spec_round_tail_greedy_t64(const u32* vtok_d, const u64* pred_d, u32 k, u32 B,
                                                      u32* brk_d, u32* acc_d, u32* last_pred_d, int* ctl_d,
                                                      u32* pend_d, u32* ring_d, u32 ring_cap, const u64* len_ptrs,
                                                      u32 n_ptrs, const int* pos_start_d) {
    round_tail_greedy(vtok_d, pred_d, k, B, brk_d, acc_d, last_pred_d, ctl_d, pend_d, ring_d, ring_cap, len_ptrs,
                      n_ptrs, pos_start_d);
}

// Recurrent state (hybrid models, ptx/state.cuh): the verify keeps the state after each of the
// round's k + 1 tokens in a slot; rollback makes the state after the last kept token, slot
// keep - 1, the live one. keep is read as u32 and clamped to k + 1; keep 0 (a done row) changes
// nothing (its slot is k + 1, past the bank).
struct KeptSlot {
    const int* ctl_d;
    u32 k;
    __device__ u32 operator()(u32 b) const { return min((u32)ctl_d[CTL_WORDS * b + CTL_KEEP], k + 1) - 1u; }
};

// 8. Roll back by copy: table holds n_entries records (live, slots, row_words), slots [B][k+1][row_words].
extern "C" __global__ void spec_state_copy(const u64* table, u32 n_entries, u32 B, u32 k, const int* ctl_d) {
    state_copy_rows(table, n_entries, B, k + 1, KeptSlot{ctl_d, k});
}

// 9. Roll back by flipping a slot index (no copy): each non-zero entry of idx_ptrs points at a
//    u32[B] index into 2(k+1) slots, two banks of k+1.
extern "C" __global__ void spec_state_flip(const u64* idx_ptrs, u32 n_ptrs, u32 B, u32 k, const int* ctl_d) {
    state_flip_rows(idx_ptrs, n_ptrs, B, k + 1, KeptSlot{ctl_d, k});
}

// The length chooser (docs/lengths.md; reference.spec_choose_lengths): each row's draft length for
// the next round, chosen on the device from the rows' running acceptance and the measured costs
// of the widths, once a round before the draft chain. One block: it updates each live row's
// statistics (rate_d), chooses the batch's width W (width_d, the selector a SWITCH of bodies by
// width reads) and caps each live row's acceptance at its length min(W, cap) (brk_d's mark).
// Statistics are f32, each product and sum rounded on its own (no fused multiply-add), so they
// are the reference's bit for bit; the width's values are doubles, a row's a^i a product of i
// factors from 1 as the reference has them, so only the order in which a width's rows are
// summed differs from the reference's.
#define CHOOSE_THREADS 512  // block size the launcher uses (memra_cuda/kernels/spec.py)
#define CHOOSE_WIDTHS 16    // widths one pass over the rows sums, in registers

// A row's per-draft acceptance from its statistics, accepted / (accepted + rejected) in double,
// clamped to [0, 1]; 0 where the sum is not positive or the quotient is no number (fmax and fmin
// drop a NaN).
__device__ __forceinline__ double acceptance(const float* rate) {
    const double accepted = rate[RATE_ACCEPTED], total = __dadd_rn(accepted, (double)rate[RATE_REJECTED]);
    return fmin(fmax(total > 0.0 ? __ddiv_rn(accepted, total) : 0.0, 0.0), 1.0);
}

extern "C" __global__ void __launch_bounds__(CHOOSE_THREADS)
spec_choose_lengths(const int* ctl_d, const u32* acc_d, u32* brk_d, float* rate_d, const u32* cap_d,
                    const float* cost_d, u32* width_d, u32 k, u32 B, float decay, float prior) {
    __shared__ double sums[CHOOSE_THREADS / 32][CHOOSE_WIDTHS];
    __shared__ u32 chosen;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    const u32 last = min(width_d[0], k);  // the last round's width: thread 0 writes the new one after barriers

    // A live row's statistics: restarted at the prior when the row was admitted since the last
    // round (keep 0: a reset clears it, a judged round sets it to at least 1); else the last round
    // judged it at length min(last, cap) and it accepted n of those; at length 0 nothing was judged
    // and they decay toward the prior, so a batch at width 0 can open it again.
    for (u32 b = threadIdx.x; b < B; b += blockDim.x) {
        const int* ctl = ctl_d + CTL_WORDS * b;
        if (ctl[CTL_DONE] != 0) continue;
        float* rate = rate_d + RATE_WORDS * b;
        if (ctl[CTL_KEEP] == 0) {
            rate[RATE_ACCEPTED] = prior;
            rate[RATE_REJECTED] = __fsub_rn(1.f, prior);
            continue;
        }
        const u32 length = min(last, cap_d[b]);
        if (length == 0) {  // a plain round, nothing judged: the belief decays toward the prior
            const float rest = __fsub_rn(1.f, decay);
            rate[RATE_ACCEPTED] = __fadd_rn(__fmul_rn(decay, rate[RATE_ACCEPTED]), __fmul_rn(rest, prior));
            rate[RATE_REJECTED] =
                __fadd_rn(__fmul_rn(decay, rate[RATE_REJECTED]), __fmul_rn(rest, __fsub_rn(1.f, prior)));
            continue;
        }
        const u32 n = min(acc_d[ACC_WORDS * b + ACC_ROUND], length);
        rate[RATE_ACCEPTED] = __fadd_rn(__fmul_rn(decay, rate[RATE_ACCEPTED]), __uint2float_rn(n));
        rate[RATE_REJECTED] = __fadd_rn(__fmul_rn(decay, rate[RATE_REJECTED]), n < length ? 1.f : 0.f);
    }

    // The width: the sum of the live rows' E(min(W, cap)) is G(0) + ... + G(W), G(i) the rows'
    // a^i over the rows whose cap is at least i. A pass sums CHOOSE_WIDTHS of the G(i) (each thread
    // its rows, then each warp by shuffles, then thread 0 over the warps) and thread 0 weighs each
    // width by its cost, keeping the first best (ties to the smaller width). Each thread sees only
    // its own rows' statistics, which it wrote above.
    double total = 0.0, best = -1.0;  // thread 0's: G(0) + ... up to the width, the best value yet
    u32 width = 0;
    for (u64 first = 0; first <= k; first += CHOOSE_WIDTHS) {
        double sum[CHOOSE_WIDTHS];
#pragma unroll
        for (u32 j = 0; j < CHOOSE_WIDTHS; ++j) sum[j] = 0.0;
        for (u32 b = threadIdx.x; b < B; b += blockDim.x) {
            const u64 cap = min(cap_d[b], k);
            if (ctl_d[CTL_WORDS * b + CTL_DONE] != 0 || cap < first) continue;
            const double a = acceptance(rate_d + RATE_WORDS * b);
            double power = 1.0;
            for (u64 i = 0; i < first; ++i) power = __dmul_rn(power, a);
#pragma unroll
            for (u32 j = 0; j < CHOOSE_WIDTHS; ++j) {
                if (first + j <= cap) sum[j] = __dadd_rn(sum[j], power);
                power = __dmul_rn(power, a);
            }
        }
#pragma unroll
        for (u32 j = 0; j < CHOOSE_WIDTHS; ++j) {
            for (u32 offset = 16; offset; offset >>= 1)
                sum[j] = __dadd_rn(sum[j], __shfl_down_sync(0xffffffffu, sum[j], offset));
            if (lane == 0) sums[warp][j] = sum[j];
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (u32 j = 0; j < CHOOSE_WIDTHS && first + j <= k; ++j) {
                double g = 0.0;
                for (u32 w = 0; w < blockDim.x / 32; ++w) g = __dadd_rn(g, sums[w][j]);
                total = __dadd_rn(total, g);
                const u32 W = (u32)(first + j);
                const double cost = __dadd_rn((double)cost_d[COST_VERIFY + (u64)W],
                                              __dmul_rn((double)W, (double)cost_d[COST_DRAFT]));
                const double value = cost > 0.0 ? __ddiv_rn(total, cost) : -1.0;  // NaN: a width left out
                if (value > best) {
                    best = value;
                    width = W;
                }
            }
        }
        __syncthreads();  // the next pass writes sums again
    }
    if (threadIdx.x == 0) {
        chosen = width;
        width_d[0] = width;
    }
    __syncthreads();

    // Each live row's length, min(W, cap) <= k, caps its acceptance; a length of k caps nothing.
    for (u32 b = threadIdx.x; b < B; b += blockDim.x) {
        if (ctl_d[CTL_WORDS * b + CTL_DONE] != 0) continue;
        const u32 length = min(chosen, cap_d[b]);
        u32* mark = brk_d + BRK_WORDS * b + BRK_MARK;
        *mark = tighter_mark(*mark, length < k ? length + 1 : 0);
    }
}

// 6. Stochastic acceptance (docs/kernels.md, "6. spec_accept_sample"), for B rows; mirrored by
//    memra_cuda/testing/reference.py's spec_accept_sample.
//
// Row b (blockIdx.y): draft x = vtok[1+i] at absolute position a = pos_start + 1 + i is accepted
// iff U(seed, a, 0, 0) * q[i][x] < p[i][x] (f32), up to the p-min limit; n = drafts accepted before
// the first rejection. The bonus at pos_start + 1 + n is raced (purpose 1) over the residual
// max(0, p[n] - q[n]) after a rejection, over p[n] when n = limit or the residual is empty, and is
// NO_MASS_TOKEN when p[n] is empty too. acc, last_pred, keep and brk then follow the greedy contract.
//
// The race over V is spread over gridDim.x blocks per row: each block recomputes n (k loads), races
// its slice for both the residual and p[n] (they share the draws E_v), and folds its best race key
// into the row's scratch with atomicMax. One key serves both races: a residual key carries the top
// bit (a score's f32 bits never do), so the row's largest key is the residual's winner whenever
// the residual has weight, and p[n]'s otherwise. The last block of the row to finish (a releasing
// and acquiring atomicInc of the row's counter, which wraps back to 0) settles the row and zeroes
// its scratch, so the next launch, or the next replay of a captured graph, starts clean.
//
// Whatever the device values (garbage brk, acc or ctl, draft ids >= V, NaN, negative or infinite
// probabilities), nothing is read or written outside the buffers: a draft id >= V has probability 0
// and is never used as an index, and row n of q is read only when n < limit <= k.
//
// Layout: vtok u32[B][k+1], p f32[B][k+1][V], q f32[B][max(k,1)][V], brk, acc and ctl rows as
// ptx/layout.cuh says, last_pred u32[B], pos_start i32[B], seed u64[B]; scratch u64[B][2], zero at the
// first launch: [0] the row's best race key (over the residual, or p[n] itself when no draft was
// rejected: q counts as 0 there), [1] (low word) the blocks of the row that finished.

#include "layout.cuh"
#include "philox.cuh"

#define THREADS 256    // block size the launcher uses (memra_cuda/kernels/sampling.py)
#define PER_THREAD 2   // vocabulary entries per thread per pass; the launcher sizes gridDim.x with it
#define NO_MASS_TOKEN 0u
#define RESIDUAL_KEY (1ull << 63)  // marks a key of the residual race, which outranks p[n]'s

// A probability as the contract reads it: NaN and negative values are 0.
__device__ __forceinline__ float prob(float x) { return x > 0.f ? x : 0.f; }

// Whether draft x = vtok[1+i] survives its acceptance test. An id >= V has probability 0: it reads
// entry 0 of the row (in bounds) and discards it. Both loads go out before the Philox rounds.
__device__ __forceinline__ bool accepts(u32 x, const float* p, const float* q, u32 V, u32 i, u64 seed, u32 first) {
    const u64 at = (u64)i * V + (x < V ? x : 0u);
    const float p_at = p[at], q_at = q[at];
    const float u = philox_uniform(seed, first + i, 0u, PURPOSE_ACCEPT);
    return __fmul_rn(u, prob(q_at)) < (x < V ? prob(p_at) : 0.f);
}

extern "C" __global__ void __launch_bounds__(THREADS)
spec_accept_sample(const u32* vtok_d, const float* p_d, const float* q_d, u32 V, u32 k, u32 B, u32* brk_d,
                   u32* acc_d, u32* last_pred_d, int* ctl_d, const int* pos_start_d, const u64* seed_d,
                   u64* scratch) {
    const u32 b = blockIdx.y;
    if (b >= B) return;
    const u32* vtok = vtok_d + (u64)b * (k + 1);
    const float* p = p_d + (u64)b * (k + 1) * V;
    const float* q = q_d + (u64)b * max(k, 1u) * V;
    const u64 seed = seed_d[b];
    const u32 first = (u32)pos_start_d[b] + 1u;  // draft 0's absolute position (u32 wraps, as U takes it)

    // Warp 0 judges the drafts, 32 at a time: one load latency and one Philox per lane, not k. The
    // first 32 drafts load alongside brk and ctl, and thread 0 reads the counters it will advance.
    __shared__ u32 s_n, s_limit;
    __shared__ int s_live;
    u32 brk = 0, n = 0, limit = 0, acc_total = 0, brk_total = 0;  // thread 0 keeps them to settle the row
    int live = 0;
    if (threadIdx.x < 32) {
        u32 x = threadIdx.x < k ? vtok[1 + threadIdx.x] : 0u;
        brk = brk_d[BRK_WORDS * b + BRK_MARK];
        live = ctl_d[CTL_WORDS * b + CTL_DONE] == 0;
        if (threadIdx.x == 0) {
            acc_total = acc_d[ACC_WORDS * b + ACC_TOTAL];
            brk_total = brk_d[BRK_WORDS * b + BRK_COUNT];
        }
        limit = marked_limit(brk, k);
        n = limit;
        for (u32 base = 0; live && base < limit; base += 32) {
            const u32 i = base + threadIdx.x;
            if (base) x = i < k ? vtok[1 + i] : 0u;
            const u32 rejects = __ballot_sync(0xffffffffu, i < limit && !accepts(x, p, q, V, i, seed, first));
            if (rejects) {
                n = base + __ffs(rejects) - 1;
                break;
            }
        }
        if (threadIdx.x == 0) {
            s_n = n;
            s_limit = limit;
            s_live = live;
        }
    }
    __syncthreads();

    // The race over this block's slices of V: one draw E_v per entry serves both weight rows. The
    // slice's loads go out first, so their latency hides behind the Philox rounds.
    u64 best = 0;
    if (s_live) {
        const u32 row = s_n;
        const bool residual = row < s_limit;
        const u32 a = first + row;
        const float* pn = p + (u64)row * V;
        const float* qn = q + (u64)row * V;  // read only after a rejection (row < limit <= k); else q = 0
        const u64 stride = (u64)gridDim.x * THREADS * PER_THREAD;
        for (u64 base = (u64)blockIdx.x * THREADS * PER_THREAD + threadIdx.x; base < V; base += stride) {
            float pv[PER_THREAD], qv[PER_THREAD];
#pragma unroll
            for (u32 j = 0; j < PER_THREAD; ++j) {
                const u64 v = base + j * THREADS;
                pv[j] = v < V ? prob(pn[v]) : 0.f;
                qv[j] = residual && v < V ? prob(qn[v]) : 0.f;
            }
#pragma unroll
            for (u32 j = 0; j < PER_THREAD; ++j) {
                const u32 v = (u32)(base + j * THREADS);
                if (pv[j] > 0.f) {  // else neither row has weight here: no draw needed
                    const float inv_e = __fdividef(1.f, philox_exponential(seed, a, v, PURPOSE_SAMPLE));
                    const u64 residual_key = race_key(prob(pv[j] - qv[j]), inv_e, v);
                    best = race_max(best, residual_key ? residual_key | RESIDUAL_KEY : race_key(pv[j], inv_e, v));
                }
            }
        }
    }
    best = block_race_max<THREADS>(best);
    if (threadIdx.x != 0) return;

    if (!race_settle(best, scratch + 2 * (u64)b, &best)) return;

    // The row's last block: every other block's key is in, and every block has read brk and ctl.
    u32* acc = acc_d + ACC_WORDS * b;
    u32* brk_row = brk_d + BRK_WORDS * b;
    int* ctl = ctl_d + CTL_WORDS * b;
    if (live) {
        const u32 token = best ? race_token(best) : NO_MASS_TOKEN;
        acc[ACC_ROUND] = n;
        acc[ACC_TOTAL] = acc_total + n;
        last_pred_d[b] = token;
        ctl[CTL_KEEP] = (int)(n + 1);
        if (brk) brk_row[BRK_COUNT] = brk_total + 1;
    } else {
        acc[ACC_ROUND] = 0;
        ctl[CTL_KEEP] = 0;
    }
    brk_row[BRK_MARK] = 0;
}

// 7. The draft's draw (docs/kernels.md, "7. spec_draft_sample"), for B rows; mirrored by
//    memra_cuda/testing/reference.py's spec_draft_sample.
//
// Row b (blockIdx.y): draft token `step` (< max(k, 1)) is raced over the draft's probabilities
// q[b][step][0..V) with purpose 2 at the absolute position it will sit at, a = pos_ctr[b] + step + 1,
// and written to draft[b][step] (0 when q's row has no positive weight). Keyed by position and seed
// alone, a request's drafts (and so its tokens) do not depend on its slot, the batch, M or the mode.
// The race is spread over gridDim.x blocks per row, settled as spec_accept_sample settles its own:
// scratch u64[B][2], zero at the first launch and left zero by every launch.
template <typename Tok>
__device__ __forceinline__ void draft_sample(u32 step, u32 k, u32 V, u32 B, const float* q_d, const int* pos_ctr_d,
                                             const u64* seed_d, Tok* draft_d, u64* scratch) {
    const u32 b = blockIdx.y;
    if (b >= B) return;
    const u32 rows = max(k, 1u);
    const u32 row = min(step, rows - 1);  // clamped: a step past the chain redraws the last row, in bounds
    const float* q = q_d + ((u64)b * rows + row) * V;
    u32 token;
    if (race_draw<THREADS>([q](u32 v) { return prob(q[v]); }, V, seed_d[b], (u32)pos_ctr_d[b] + row + 1u,
                           PURPOSE_DRAFT, scratch + 2 * (u64)b, &token))
        draft_d[(u64)b * rows + row] = (Tok)token;
}

extern "C" __global__ void __launch_bounds__(THREADS)
spec_draft_sample(u32 step, u32 k, u32 V, u32 B, const float* q_d, const int* pos_ctr_d, const u64* seed_d,
                  u32* draft_d, u64* scratch) {
    draft_sample(step, k, V, B, q_d, pos_ctr_d, seed_d, draft_d, scratch);
}

extern "C" __global__ void __launch_bounds__(THREADS)
spec_draft_sample_t64(u32 step, u32 k, u32 V, u32 B, const float* q_d, const int* pos_ctr_d, const u64* seed_d,
                      u64* draft_d, u64* scratch) {
    draft_sample(step, k, V, B, q_d, pos_ctr_d, seed_d, draft_d, scratch);
}

// Philox4x32-10 and the draws of stochastic acceptance (docs/sampling.md, "Random numbers"),
// mirrored by memra_cuda/testing/philox.py and memra_cuda/testing/reference.py.
//
// Philox is counter-based: a draw is a pure function of (counter, key), so every draw is addressed
// by what it is for (seed, absolute position, vocabulary index, purpose) and no generator state
// lives anywhere: a captured graph replays, and a request's tokens depend on its seed alone.
// Shared by every kernel that samples (acceptance, the toy model's draft), so they cannot drift.
#pragma once

typedef unsigned int u32;
typedef unsigned long long u64;

// The third counter word: the draws of one position for different ends never coincide.
enum : u32 { PURPOSE_ACCEPT = 0, PURPOSE_SAMPLE = 1, PURPOSE_DRAFT = 2 };

// Philox4x32-10 as Random123 and cuRAND define it: ten rounds, the key bumped before each but the first.
__device__ __forceinline__ uint4 philox4x32_10(uint4 ctr, uint2 key) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round) {
            key.x += 0x9E3779B9u;
            key.y += 0xBB67AE85u;
        }
        const u32 hi0 = __umulhi(0xD2511F53u, ctr.x), lo0 = 0xD2511F53u * ctr.x;
        const u32 hi1 = __umulhi(0xCD9E8D57u, ctr.z), lo1 = 0xCD9E8D57u * ctr.z;
        ctr = make_uint4(hi1 ^ ctr.y ^ key.x, lo1, hi0 ^ ctr.w ^ key.y, lo0);
    }
    return ctr;
}

// The top 23 bits of the first word of counter (j, a, purpose, node) under key (seed lo, seed hi):
// U(seed, a, j, purpose, node) = (m + 0.5) * 2^-23. `node` tells apart the draws of one position
// for different nodes of a tree (docs/sampling.md, "Trees"); a chain's draws have node 0.
__device__ __forceinline__ u32 philox_mantissa(u64 seed, u32 a, u32 j, u32 purpose, u32 node = 0u) {
    return philox4x32_10(make_uint4(j, a, purpose, node), make_uint2((u32)seed, (u32)(seed >> 32))).x >> 9;
}

// U in f32, exact: m + 0.5 needs 24 significant bits, which f32 has, and the scaling by 2^-23 is
// exact. So U < 1 in f32 as in the contract (with 24 bits the top m rounded to 1.0f, and a draft
// with p = q, accepted iff U * q < p, was rejected).
__device__ __forceinline__ float philox_uniform(u64 seed, u32 a, u32 j, u32 purpose, u32 node = 0u) {
    return ((float)philox_mantissa(seed, a, j, purpose, node) + 0.5f) * 0x1p-23f;
}

// E = -ln U of the same draw, for the exponential race, to a few ulp over the whole range. The
// smallest E win races, and they come from U near 1, where __logf's error (small in absolute terms,
// not relative ones) would swamp them: there E = -log1p(-(1 - U)), and 1 - U = (2^23 - 1 - m + 0.5)
// * 2^-23 is exact.
__device__ __forceinline__ float philox_exponential(u64 seed, u32 a, u32 j, u32 purpose, u32 node = 0u) {
    const u32 m = philox_mantissa(seed, a, j, purpose, node);
    const bool low = m < (1u << 22);
    const float s = ((float)(low ? m : 0x7FFFFFu - m) + 0.5f) * 0x1p-23f;  // U below 1/2, else 1 - U
    return low ? -__logf(s) : -log1pf(-s);
}

// The exponential race (sampling v with probability w[v] / sum(w)): the token is the argmax over
// w[v] > 0 of w[v] / E_v, ties to the smallest v. A race key packs the score's f32 bits (ordered
// like the scores, all being positive) above ~v, so the largest key is the best score and, among
// equal scores, the smallest v; 0 stands for "no positive weight" (NaN, negative and zero weights
// never enter). Scores are exact to a few ulp for weights in (2^-100, 2^100).
__device__ __forceinline__ u64 race_key(float w, float inv_e, u32 v) {
    return w > 0.f ? (u64)__float_as_uint(w * inv_e) << 32 | (u64)(~v) : 0ull;
}

__device__ __forceinline__ u32 race_token(u64 key) { return ~(u32)key; }

__device__ __forceinline__ u64 race_max(u64 a, u64 b) { return a > b ? a : b; }

__device__ __forceinline__ u64 warp_race_max(u64 key) {
    for (int o = 16; o > 0; o >>= 1) key = race_max(key, __shfl_xor_sync(0xffffffffu, key, o));
    return key;
}

// The largest key of the block, in thread 0. Every thread of the block must call it; BLOCK is
// blockDim.x, a multiple of 32. The last barrier lets a second call reuse the slots.
template <u32 BLOCK>
__device__ __forceinline__ u64 block_race_max(u64 key) {
    __shared__ u64 warp_best[BLOCK / 32];
    key = warp_race_max(key);
    if (threadIdx.x % 32 == 0) warp_best[threadIdx.x / 32] = key;
    __syncthreads();
    if (threadIdx.x < 32) key = warp_race_max(threadIdx.x < BLOCK / 32 ? warp_best[threadIdx.x] : 0ull);
    __syncthreads();
    return key;
}

// atomicInc with release and acquire semantics at GPU scope: the keys a block folded in are
// visible before its count, and the block that counts last sees every block's keys.
__device__ __forceinline__ u32 atomic_inc_acq_rel(u32* address, u32 limit) {
    u32 old;
    asm volatile("atom.acq_rel.gpu.global.inc.u32 %0, [%1], %2;" : "=r"(old) : "l"(address), "r"(limit) : "memory");
    return old;
}

// A race spread over gridDim.x blocks per row: thread 0 of each block folds the block's best key
// into the row's slot (u64[2]: the best key, then the count of blocks done). True in the row's last
// block, which gets the row's best key in *winner; the slot is left zeroed (the count wraps), so
// the next launch, or the next replay of a captured graph, starts clean.
__device__ __forceinline__ bool race_settle(u64 best, u64* slot, u64* winner) {
    if (best) atomicMax(&slot[0], best);
    if (atomic_inc_acq_rel((u32*)&slot[1], gridDim.x - 1) != gridDim.x - 1) return false;
    *winner = atomicExch(&slot[0], 0ull);
    return true;
}

// A draw from the weights weight(v), v < V, by the race at position `a` for `purpose`, spread over
// gridDim.x blocks of BLOCK threads per row (every thread of the block calls it; `slot` is the
// row's race slot, as race_settle takes it). True in the row's last block only, with the winner in
// *token (0 when no weight is positive). Draws that sample a whole vocabulary (the draft's own,
// kernel 7 and the toy's) share it, so they cannot drift.
template <u32 BLOCK, typename Weight>
__device__ __forceinline__ bool race_draw(Weight weight, u32 V, u64 seed, u32 a, u32 purpose, u64* slot,
                                          u32* token) {
    u64 best = 0;
    for (u64 v = (u64)blockIdx.x * BLOCK + threadIdx.x; v < V; v += (u64)gridDim.x * BLOCK) {
        const float w = weight((u32)v);
        if (w > 0.f)
            best = race_max(best, race_key(w, __fdividef(1.f, philox_exponential(seed, a, (u32)v, purpose)), (u32)v));
    }
    best = block_race_max<BLOCK>(best);
    if (threadIdx.x != 0 || !race_settle(best, slot, &best)) return false;
    *token = best ? race_token(best) : 0u;
    return true;
}
